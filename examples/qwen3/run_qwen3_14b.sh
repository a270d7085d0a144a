#!/usr/bin/env bash
# STAPO on Qwen3-14B-Base: 4 node(s) x 8 GPUs, trainer TP=4 PP=2 (configs/qwen3_14b_stapo.yaml).
#   ACCOUNT=my_account PARTITION=batch bash examples/qwen3/run_qwen3_14b.sh [stapo submit arguments...]
# Environment: see examples/qwen3/common.sh; STAPO_DRYRUN=1 prints the sbatch script only.
SIZE=14B KEY=14b NODES=4 TP=4 PP=2
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
