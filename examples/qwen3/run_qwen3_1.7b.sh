#!/usr/bin/env bash
# STAPO on Qwen3-1.7B-Base: 1 node(s) x 8 GPUs, trainer TP=1 PP=1 (configs/qwen3_1.7b_stapo.yaml).
#   ACCOUNT=my_account PARTITION=batch bash examples/qwen3/run_qwen3_1.7b.sh [stapo submit arguments...]
# Environment: see examples/qwen3/common.sh; STAPO_DRYRUN=1 prints the sbatch script only.
SIZE=1.7B KEY=1.7b NODES=1 TP=1 PP=1
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
