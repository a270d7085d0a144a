#!/usr/bin/env bash
# STAPO on Qwen3-32B-Base: 8 node(s) x 8 GPUs, trainer TP=8 PP=2 (configs/qwen3_32b_stapo.yaml).
#   ACCOUNT=my_account PARTITION=batch bash examples/qwen3/run_qwen3_32b.sh [stapo submit arguments...]
# Environment: see examples/qwen3/common.sh; STAPO_DRYRUN=1 prints the sbatch script only.
SIZE=32B KEY=32b NODES=8 TP=8 PP=2
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
