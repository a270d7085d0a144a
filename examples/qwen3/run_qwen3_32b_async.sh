#!/usr/bin/env bash
# STAPO on Qwen3-32B-Base, asynchronous: 8 node(s) x 8 GPUs, on every node 4 trainer GPUs (TP=4 PP=1 DP=8 in
# all) and one TP4 SGLang server on the other 4 (configs/qwen3_32b_stapo_async.yaml).
#   ACCOUNT=my_account PARTITION=batch bash examples/qwen3/run_qwen3_32b_async.sh [stapo submit arguments...]
# Environment: see examples/qwen3/common.sh; STAPO_DRYRUN=1 prints the sbatch script only.
SIZE=32B KEY=32b NODES=8 TP=4 PP=1 VARIANT=_async
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
