#!/usr/bin/env python
"""Hugging Face Qwen3 safetensors -> Megatron distributed checkpoint (same as `stapo convert hf-to-megatron`)."""

import argparse
import sys

from stapo_megatron.checkpoint.cli import add_hf_to_megatron_args, run_hf_to_megatron
from stapo_megatron.cli import run

if __name__ == "__main__":  # the conversion spawns ranks, which re-import this file
    parser = argparse.ArgumentParser(description=__doc__)
    add_hf_to_megatron_args(parser)
    sys.exit(run(run_hf_to_megatron, parser.parse_args()))
