# Shared by run_qwen3_*.sh: submit the paper's config, starting from the Hugging Face base model
# (checkpoint.load_hf: every rank reads its own rows of the safetensors). CONVERT=1 converts it to a
# Megatron checkpoint first and starts from that: it pays when many runs start from the same base (one
# conversion, checked once, instead of every start resharding the safetensors) or when the shared file
# system serves each data-parallel replica's reads of the safetensors slowly. Either way one format:
# a checkpoint converted on a CPU node loads on the GPU nodes (with or without Transformer Engine).
# The caller sets SIZE, KEY, NODES, TP and PP (and VARIANT=_async for configs/qwen3_<KEY>_stapo_async.yaml);
# everything else comes from the environment:
#
#   HF_MODEL     Hugging Face directory of Qwen3-$SIZE-Base        (default models/Qwen3-$SIZE-Base)
#   DATA         DAPO-Math-17k parquet                              (default data/dapo_math_17k.parquet)
#   EVAL_DIR     benchmark files (aime24.jsonl, ...)                (default data/eval)
#   CONVERT=1    convert first (stapo convert hf-to-megatron) and start from CKPT
#   CKPT         with CONVERT=1: the Megatron checkpoint to write and start from
#                                                                   (default checkpoints/qwen3_${KEY}_base_tp${TP}pp${PP})
#   WORKDIR      directory the job runs in, on the shared file system (default: this directory)
#   ACCOUNT      SLURM account (required), PARTITION, TIME (default 48:00:00), CONTAINER (optional image)
#   GPUS_PER_NODE  (default 8)
#   STAPO_DRYRUN=1   print the sbatch script only (no conversion, no file checks, nothing submitted)
#
# Extra arguments go to `stapo submit` (e.g. run.steps=200, --mounts /lustre:/lustre, --tunnel ssh ...).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORKDIR="${WORKDIR:-$PWD}"
cd "$WORKDIR"
HF_MODEL="${HF_MODEL:-models/Qwen3-$SIZE-Base}"
DATA="${DATA:-data/dapo_math_17k.parquet}"
EVAL_DIR="${EVAL_DIR:-data/eval}"
CKPT="${CKPT:-checkpoints/qwen3_${KEY}_base_tp${TP}pp${PP}}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
: "${ACCOUNT:?set ACCOUNT to your SLURM account}"

submit_flags=(--nodes "$NODES" --gpus-per-node "$GPUS_PER_NODE" --account "$ACCOUNT" --time "${TIME:-48:00:00}"
              --workdir "$WORKDIR")
[[ -n "${PARTITION:-}" ]] && submit_flags+=(--partition "$PARTITION")
[[ -n "${CONTAINER:-}" ]] && submit_flags+=(--container-image "$CONTAINER" --mounts "$WORKDIR:$WORKDIR")

[[ -n "${STAPO_DRYRUN:-}" ]] && submit_flags+=(--dryrun --no-check-files)
start=(checkpoint.load_megatron= checkpoint.load_hf="$HF_MODEL")
if [[ -n "${CONVERT:-}" ]]; then
    start=(checkpoint.load_megatron="$CKPT")
    if [[ -z "${STAPO_DRYRUN:-}" && ! -e "$CKPT" ]]; then
        # one process per TP x PP rank (on the CPU where the host has fewer GPUs), each reading its own rows
        stapo convert hf-to-megatron --hf "$HF_MODEL" --out "$CKPT" --tp "$TP" --pp "$PP" --dtype bfloat16
    fi
fi

exec stapo submit --config "$REPO/configs/qwen3_${KEY}_stapo${VARIANT:-}.yaml" --executor slurm "${submit_flags[@]}" \
    "${start[@]}" tokenizer="$HF_MODEL" rollout.sglang.model_path="$HF_MODEL" \
    data.source="$DATA" eval.data_dir="$EVAL_DIR" "$@"
