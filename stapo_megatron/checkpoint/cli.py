"""``stapo convert``: Hugging Face <-> Megatron checkpoints."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from stapo_megatron.config import ConfigError

# A training checkpoint: <run>/checkpoints/iter_ + the zero-padded step (checkpoint_name in
# trainer/checkpoint_directory.py). Any other entry there (a copy iter_0000004.bak, a staging
# .iter_0000005.partial) is not one.
CHECKPOINT_NAME = re.compile(r"iter_(\d{7})")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '512MiB', '1000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ConfigError(f"--max-shard-size: cannot read {text!r} as a size (e.g. 5GB, 512MiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()])


def run_checkpoints(run_dir: str | Path) -> list[Path]:
    """The training checkpoints of a run directory, newest first: the directories of
    ``<run>/checkpoints/`` named exactly as the trainer names them."""
    root = Path(run_dir, "checkpoints")
    if not root.is_dir():
        return []
    found = [entry for entry in root.iterdir() if CHECKPOINT_NAME.fullmatch(entry.name) and entry.is_dir()]
    return sorted(found, reverse=True)  # zero-padded: the names sort as the steps do


def newest_intact_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of a run directory (``<run>/checkpoints/iter_*``) that passes the
    cheap integrity check (every recorded file present at its size, the small files' checksums;
    what ``stapo convert`` checks before it starts), by this process alone; and why each newer
    one was passed over. Resume and conversion still verify it in full."""
    from stapo_megatron.checkpoint.integrity import verify_checkpoint

    skipped = []
    for candidate in run_checkpoints(run_dir):
        try:
            verify_checkpoint(candidate, full=False)
        except ConfigError as err:
            skipped.append(str(err))
            continue
        return candidate, skipped
    return None, skipped


def _refuse_run_directory(ckpt: Path) -> None:
    """``--ckpt`` given a run directory (or its ``checkpoints/``) rather than one checkpoint:
    name the checkpoint to pass instead of calling the directory an incomplete checkpoint."""
    from stapo_megatron.checkpoint.marker import COMPLETE_MARKER

    run_dir = ckpt.parent if ckpt.name == "checkpoints" else ckpt
    if (ckpt / COMPLETE_MARKER).exists() or not run_checkpoints(run_dir):
        return
    newest, skipped = newest_intact_checkpoint(run_dir)
    where = f"--ckpt: {ckpt} is a run directory, not a checkpoint; its checkpoints are {run_dir / 'checkpoints'}/iter_*"
    if newest is None:
        raise ConfigError(f"{where}, and none is intact (newest: {skipped[0]})")
    raise ConfigError(f"{where}: the newest intact one is {newest} (pass --ckpt {newest})")


OVERWRITE_HELP = (
    "replace a non-empty --out that stapo convert wrote (an export holding stapo_export.json, or a converted "
    "checkpoint), once the new output is whole; anything else there is refused and left as it is"
)


def add_hf_to_megatron_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", required=True, help="Hugging Face Qwen3 checkpoint directory (safetensors)")
    parser.add_argument("--out", required=True, help="Megatron distributed checkpoint directory to write")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to write at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to write at")
    parser.add_argument("--dtype", default=None, help="parameter dtype (default: the checkpoint's)")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def add_megatron_to_hf_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="Megatron checkpoint directory (written at any TP/PP)")
    parser.add_argument("--out", required=True, help="Hugging Face directory to write")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load at (ranks launched: tp x pp)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load at")
    parser.add_argument("--dtype", default=None, help="dtype of the written tensors (default: the checkpoint's)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 512MiB")
    parser.add_argument(
        "--tokenizer", default=None, help="copy tokenizer files from here (default: the ones the checkpoint carries)"
    )
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def run_hf_to_megatron(args: argparse.Namespace) -> None:
    from stapo_megatron.checkpoint.convert import convert_hf_to_megatron

    out = convert_hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote Megatron checkpoint {out} (TP={args.tp}, PP={args.pp})")


def run_megatron_to_hf(args: argparse.Namespace) -> None:
    from stapo_megatron.checkpoint.convert import convert_megatron_to_hf

    _refuse_run_directory(Path(args.ckpt))
    out = convert_megatron_to_hf(
        args.ckpt,
        args.out,
        tp=args.tp,
        pp=args.pp,
        dtype=args.dtype,
        max_shard_bytes=parse_size(args.max_shard_size),
        tokenizer_dir=args.tokenizer,
        overwrite=args.overwrite,
    )
    print(f"wrote Hugging Face checkpoint {out}")


def register(subparsers) -> None:
    convert = subparsers.add_parser("convert", help="convert checkpoints between Hugging Face and Megatron")
    kinds = convert.add_subparsers(dest="direction", required=True)
    to_megatron = kinds.add_parser("hf-to-megatron", help="Hugging Face safetensors -> Megatron distributed checkpoint")
    add_hf_to_megatron_args(to_megatron)
    to_megatron.set_defaults(func=run_hf_to_megatron)
    to_hf = kinds.add_parser("megatron-to-hf", help="Megatron distributed checkpoint -> Hugging Face safetensors")
    add_megatron_to_hf_args(to_hf)
    to_hf.set_defaults(func=run_megatron_to_hf)
