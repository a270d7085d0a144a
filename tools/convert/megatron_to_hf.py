#!/usr/bin/env python
"""Megatron distributed checkpoint (any TP/PP) -> Hugging Face safetensors (same as `stapo convert megatron-to-hf`)."""

import argparse
import sys

from stapo_megatron.checkpoint.cli import add_megatron_to_hf_args, run_megatron_to_hf
from stapo_megatron.cli import run

if __name__ == "__main__":  # the conversion spawns ranks, which re-import this file
    parser = argparse.ArgumentParser(description=__doc__)
    add_megatron_to_hf_args(parser)
    sys.exit(run(run_megatron_to_hf, parser.parse_args()))
