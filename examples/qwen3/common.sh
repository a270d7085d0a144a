# Shared by run_qwen3_*.sh: convert the Hugging Face checkpoint at the training layout, then submit.
# The caller sets SIZE, KEY, NODES, TP and PP (and VARIANT=_async for configs/qwen3_<KEY>_stapo_async.yaml);
# everything else comes from the environment:
#
#   HF_MODEL     Hugging Face directory of Qwen3-$SIZE-Base        (default models/Qwen3-$SIZE-Base)
#   DATA         DAPO-Math-17k parquet                              (default data/dapo_math_17k.parquet)
#   EVAL_DIR     benchmark files (aime24.jsonl, ...)                (default data/eval)
#   CKPT         Megatron checkpoint to write and start from       (default checkpoints/qwen3_${KEY}_base_tp${TP}pp${PP})
#   WORKDIR      directory the job runs in, on the shared file system (default: this directory)
#   ACCOUNT      SLURM account (required), PARTITION, TIME (default 48:00:00), CONTAINER (optional image)
#   GPUS_PER_NODE  (default 8)
#   SKIP_CONVERT=1   the checkpoint exists already
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

if [[ -n "${STAPO_DRYRUN:-}" ]]; then
    submit_flags+=(--dryrun --no-check-files)
elif [[ -z "${SKIP_CONVERT:-}" && ! -e "$CKPT" ]]; then
    # one CPU process per TP x PP rank, each reading only its own shards (about 2 bytes per parameter in all)
    stapo convert hf-to-megatron --hf "$HF_MODEL" --out "$CKPT" --tp "$TP" --pp "$PP" --dtype bfloat16
fi

exec stapo submit --config "$REPO/configs/qwen3_${KEY}_stapo${VARIANT:-}.yaml" --executor slurm "${submit_flags[@]}" \
    checkpoint.load_megatron="$CKPT" tokenizer="$HF_MODEL" rollout.sglang.model_path="$HF_MODEL" \
    data.source="$DATA" eval.data_dir="$EVAL_DIR" "$@"
