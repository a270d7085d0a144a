"""The per-rank export: every rank produces its own share of the HF tensors, no gather to one rank.

At TP2, PP2 and TP2xPP2, tied and untied: the union of all ranks' buckets is the HF checkpoint the
model was loaded from, bit for bit, each name exactly once; and the bucket and gather buffers alive
on a rank (measured by their real lifetimes) never exceed two buckets, with the next bucket being
filled while the previous one is in flight.
"""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch
from safetensors.torch import load_file

from stapo_megatron.runtime.launch import spawn_ranks
from tests.helpers import save_tiny_qwen3


class LiveBytes:
    """Bytes (and bucket buffers) alive right now and at the peak, from the buffers' own lifetimes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live = self.peak = 0
        self.live_buckets = self.peak_buckets = 0

    def probe(self, kind: str):
        def register(tensor: torch.Tensor) -> None:
            nbytes = tensor.numel() * tensor.element_size()
            with self.lock:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                if kind == "bucket":
                    self.live_buckets += 1
                    self.peak_buckets = max(self.peak_buckets, self.live_buckets)
            weakref.finalize(tensor.untyped_storage(), self._free, nbytes, kind)

        return register

    def _free(self, nbytes: int, kind: str) -> None:
        with self.lock:
            self.live -= nbytes
            if kind == "bucket":
                self.live_buckets -= 1


def export_every_rank(tp: int, pp: int, cases: list[tuple[str, str]]) -> None:
    """Each rank: load each HF checkpoint, export its share through the one-deep pipeline, save it."""
    import torch.distributed as dist

    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.export import iter_rank_buckets, pipelined, stage_export_plan
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    ctx = init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp))
    for hf_dir, out_prefix in cases:
        arch = Qwen3Config.from_hf(hf_dir)
        model = build_stage(arch, ctx, perform_initialization=False)
        fill_from_hf(model, arch, HFCheckpoint(hf_dir), ctx)
        plan = stage_export_plan(model, arch, ctx.tp_size)
        # Just room for the largest parameter with its staging: several buckets per rank.
        bucket_bytes = max(e.nbytes + e.staging_bytes for e in plan)
        own_shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        meter = LiveBytes()
        probes = {"bucket": meter.probe("bucket"), "gather": meter.probe("gather")}

        def probe(tensor: torch.Tensor, probes=probes) -> None:
            # A bucket buffer is 1-D; gather buffers and conversion copies are not.
            probes["bucket" if tensor.dim() == 1 else "gather"](tensor)

        received: list[tuple[str, torch.Tensor]] = []

        def send(bucket, received=received) -> None:
            time.sleep(0.01)  # a slow link: the next bucket is filled meanwhile
            received.extend((name, t.clone()) for name, t in bucket.named_tensors())

        sent = pipelined(iter_rank_buckets(model, arch, ctx, bucket_bytes=bucket_bytes, probe=probe), send)
        assert meter.live == 0, f"rank {ctx.rank}: {meter.live} bytes of buffers outlived the export"
        assert meter.peak <= 2 * bucket_bytes, (
            f"rank {ctx.rank}: {meter.peak} bytes of buckets and gather buffers alive at once > 2 buckets of "
            f"{bucket_bytes}"
        )
        assert meter.peak_buckets <= 2, f"rank {ctx.rank}: {meter.peak_buckets} buckets alive at once"
        torch.save(
            {
                "received": received,
                "buckets": sent,
                "peak": meter.peak,
                "peak_buckets": meter.peak_buckets,
                "bucket_bytes": bucket_bytes,
                "own_shard_bytes": own_shard_bytes,
            },
            f"{out_prefix}.rank{ctx.rank}.pt",
        )
        dist.barrier(group=ctx.cpu_group)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("per_rank_export")
    # Small vocabularies: the embedding is not much bigger than a layer's weights, so buckets sized for the
    # largest parameter hold a few parameters each and every rank sends several. 300 is padded to 512 at
    # TP2: the last TP rank's shard is part vocabulary, part padding rows that must not be exported.
    vocab = {True: 256, False: 300}
    return {
        tie: save_tiny_qwen3(root / f"hf_tie{int(tie)}", tie=tie, seed=3 + tie, vocab_size=vocab[tie])
        for tie in (True, False)
    }


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["TP2", "PP2", "TP2xPP2"])
def test_union_of_rank_buckets_is_the_hf_checkpoint_bit_exact(checkpoints, tmp_path, tp, pp):
    cases = [(str(checkpoints[tie]), str(tmp_path / f"tie{int(tie)}")) for tie in (True, False)]
    spawn_ranks(export_every_rank, tp * pp, tp, pp, cases)
    for tie in (True, False):
        reference = load_file(str(checkpoints[tie] / "model.safetensors"))
        if tie:
            reference.pop("lm_head.weight", None)  # tied: transformers may store it; SGLang loads embed_tokens
        counts: dict[str, int] = {}
        overlapped = False
        for rank in range(tp * pp):
            out = torch.load(tmp_path / f"tie{int(tie)}.rank{rank}.pt", weights_only=False)
            shares = len(out["received"])
            assert shares > 0, f"rank {rank} exported nothing: the work is not split over the TP ranks"
            assert out["buckets"] >= 2, f"rank {rank} sent {out['buckets']} bucket(s)"
            overlapped |= out["peak_buckets"] == 2
            for name, tensor in out["received"]:
                counts[name] = counts.get(name, 0) + 1
                assert name in reference, f"rank {rank} exported {name}, which the checkpoint does not hold"
                assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), name
        assert sorted(n for n, c in counts.items() if c > 1) == []
        assert set(counts) == set(reference), sorted(set(reference) ^ set(counts))
        assert ("lm_head.weight" in counts) == (not tie)
        assert overlapped, "no rank ever had a bucket in flight while filling the next one"
