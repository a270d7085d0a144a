#!/usr/bin/env bash
# STAPO on Qwen3-8B-Base: 2 node(s) x 8 GPUs, trainer TP=4 PP=1 (configs/qwen3_8b_stapo.yaml).
#   ACCOUNT=my_account PARTITION=batch bash examples/qwen3/run_qwen3_8b.sh [stapo submit arguments...]
# Environment: see examples/qwen3/common.sh; STAPO_DRYRUN=1 prints the sbatch script only.
SIZE=8B KEY=8b NODES=2 TP=4 PP=1
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
