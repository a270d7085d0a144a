"""The GPU path end to end on one GPU, in a few minutes (issue 10, item 4).

    python benchmarks/gpu_smoke.py [--workdir DIR] [--train-steps 20] [--cpu]

Needs torch with CUDA, transformers and megatron-core; no Transformer Engine, SGLang or network.
Four checks, each printed with its numbers and PASS or FAIL:

1. logits: the Megatron Qwen3 stage (Transformer Engine's layer spec when it imports, else the local
   one) on the GPU against transformers' Qwen3ForCausalLM with the same random weights, in fp32 and bf16;
2. token statistics at V = 151,936 on the GPU: ``vocab_parallel_logprob_entropy`` against the
   naive fp32 log-softmax, forward + backward: time, peak memory, agreement;
3. ``stapo train`` on the tiny configuration with one rank (NCCL): a run of N steps, and a run
   killed (SIGKILL) once the checkpoint of step N/2 is complete and then resumed: the step-N
   parameters bit-identical, the metrics of every resumed step equal. This is the run in which
   every collective of the trainer meets NCCL's default group;
4. HF -> Megatron -> HF conversion on the GPU: bit-exact.

Without CUDA it says so and exits 0; ``--cpu`` runs the same checks on the CPU (gloo) to check
the script itself. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from stapo_megatron.runtime.launch import spawn_ranks  # noqa: E402

QWEN3_VOCAB = 151_936
SMALL_QWEN3 = dict(
    vocab_size=QWEN3_VOCAB,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
)
# max |logits difference| / max |logits| allowed against transformers (different kernels and op order)
LOGITS_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # bf16 on CPU: 1.5e-2


def _report(name: str, ok: bool, details: str, outcomes: dict[str, bool]) -> None:
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {details}", flush=True)
    outcomes[name] = ok


def _device(cpu: bool) -> torch.device:
    return torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- 1. logits against transformers ------------------------------------------------------------


def save_small_qwen3(directory: Path) -> Path:
    """A random-weight transformers Qwen3 with the real vocabulary, saved as fp32 safetensors."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL_QWEN3, tie_word_embeddings=True)).float()
    with torch.no_grad():  # random norms, so that a mis-mapped norm weight shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _megatron_logits_rank(hf_dir: str, dtype_name: str, ids_file: str, out_file: str) -> None:
    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed, shutdown_distributed
    from stapo_megatron.trainer.schedule import forward_only

    ctx = init_distributed(ParallelConfig())
    arch = Qwen3Config.from_hf(hf_dir)
    model = build_stage(
        arch, ctx, params_dtype=getattr(torch, dtype_name), perform_initialization=False, device=ctx.device
    )
    fill_from_hf(model, arch, HFCheckpoint(hf_dir), ctx)
    ids = torch.load(ids_file, weights_only=True).to(ctx.device)
    positions = torch.arange(ids.shape[1], device=ctx.device).unsqueeze(0)
    batches = [{"input_ids": ids[i : i + 1], "position_ids": positions} for i in range(ids.shape[0])]
    outputs = forward_only(model, batches, lambda logits, batch: logits[..., : arch.vocab_size].float().cpu())
    torch.save(torch.cat(outputs), out_file)
    shutdown_distributed()


def check_logits(hf_dir: Path, device: torch.device, workdir: Path, outcomes: dict[str, bool]) -> None:
    from transformers import Qwen3ForCausalLM

    ids = torch.randint(0, QWEN3_VOCAB, (3, 96), generator=torch.Generator().manual_seed(1))
    ids_file = workdir / "ids.pt"
    torch.save(ids, ids_file)
    for dtype_name, tolerance in LOGITS_TOLERANCE.items():
        dtype = getattr(torch, dtype_name)
        reference_model = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
        with torch.no_grad():
            reference = reference_model(ids.to(device)).logits.float().cpu()
        del reference_model
        out_file = workdir / f"logits_{dtype_name}.pt"
        spawn_ranks(_megatron_logits_rank, 1, str(hf_dir), dtype_name, str(ids_file), str(out_file))
        got = torch.load(out_file, weights_only=True)
        relative = float((got - reference).abs().max() / reference.abs().max())
        same_argmax = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
        _report(
            f"logits {dtype_name} vs transformers",
            got.shape == reference.shape and relative <= tolerance,
            f"max|diff|/max|logit| = {relative:.2e} (<= {tolerance:.0e}), same argmax {same_argmax:.1%}",
            outcomes,
        )


# ---- 2. token statistics at the real vocabulary -------------------------------------------------


def _naive_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor):
    logp = torch.log_softmax(logits.float(), dim=-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def check_token_statistics(device: torch.device, tokens: int, outcomes: dict[str, bool]) -> None:
    from stapo_megatron.loss import vocab_parallel_logprob_entropy

    generator = torch.Generator().manual_seed(2)
    logits = (torch.randn(tokens, QWEN3_VOCAB, generator=generator) * 2).to(device=device, dtype=torch.bfloat16)
    logits.requires_grad_(True)
    targets = torch.randint(0, QWEN3_VOCAB, (tokens,), generator=generator).to(device)
    weights = torch.randn(tokens, generator=generator).to(device)
    methods = {
        "ours": lambda: vocab_parallel_logprob_entropy(logits, targets, None, vocab_size=QWEN3_VOCAB),
        "naive": lambda: _naive_logprob_entropy(logits, targets),
    }
    results = {}
    for name, method in methods.items():
        best, peak = float("inf"), None
        for repeat in range(3):
            logits.grad = None
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            start = time.perf_counter()
            logprob, entropy = method()
            (logprob * weights).sum().backward()
            _sync(device)
            best = min(best, time.perf_counter() - start)
            if device.type == "cuda" and repeat == 0:
                peak = torch.cuda.max_memory_allocated(device) - base
        results[name] = (best, peak, logprob.detach(), entropy.detach(), logits.grad.clone())
    (t_ours, m_ours, lp_ours, h_ours, g_ours), (t_naive, m_naive, lp_naive, h_naive, g_naive) = (
        results["ours"],
        results["naive"],
    )
    logprob_diff = float((lp_ours - lp_naive).abs().max())
    entropy_diff = float((h_ours - h_naive).abs().max())
    grad_diff = float((g_ours.float() - g_naive.float()).abs().max())
    memory = (
        f"peak {m_ours / 2**30:.2f} GiB vs naive {m_naive / 2**30:.2f} GiB ({m_ours / m_naive:.2f}x)"
        if m_ours is not None
        else "peak memory: CUDA only"
    )
    _report(
        f"token statistics, {tokens} tokens x V={QWEN3_VOCAB} bf16",
        max(logprob_diff, entropy_diff) <= 1e-3 and grad_diff <= 1e-2,
        f"time {t_ours * 1e3:.1f} ms vs naive {t_naive * 1e3:.1f} ms ({t_ours / t_naive:.2f}x); {memory}; "
        f"max|diff| log-prob {logprob_diff:.1e}, entropy {entropy_diff:.1e}, grad {grad_diff:.1e}",
        outcomes,
    )


# ---- 3. stapo train with a kill and an exact resume -------------------------------------------


def check_train_resume(workdir: Path, steps: int, outcomes: dict[str, bool]) -> None:
    from stapo_megatron.checkpoint.dist import COMPLETE_MARKER
    from tests.trainer.runs import checkpoint_tensors, kill_when, metrics, run, start_session, train_command

    half = steps // 2
    overrides = [
        "parallel.tensor_parallel=1",
        f"run.steps={steps}",
        f"checkpoint.save_every={half}",
        "checkpoint.keep_last=10",
        "logging.inspect_every=5",
    ]
    reference_dir, resumed_dir = workdir / "reference", workdir / "resumed"
    start = time.perf_counter()
    run(train_command(reference_dir, *overrides), timeout=900)
    reference_seconds = time.perf_counter() - start
    process = start_session(train_command(resumed_dir, *overrides))
    kill_when(
        process, lambda: (resumed_dir / "checkpoints" / f"iter_{half:07d}" / COMPLETE_MARKER).is_file(), timeout=900
    )
    resumed = run(train_command(resumed_dir, *overrides), timeout=900)
    final = f"iter_{steps:07d}"
    reference, got = checkpoint_tensors(reference_dir / "checkpoints" / final, resumed_dir / "checkpoints" / final)
    parameters = [k for k in reference if not k.startswith("optimizer.")]
    differing = [k for k in parameters if k not in got or not torch.equal(reference[k], got[k])]

    def comparable(row):
        return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}

    reference_rows, resumed_rows = metrics(reference_dir), metrics(resumed_dir)
    same_metrics = [comparable(r) for r in reference_rows[half:]] == [comparable(r) for r in resumed_rows[half:]]
    _report(
        f"stapo train {steps} steps, killed after step {half}, resumed",
        "resumed from" in resumed.stderr and not differing and same_metrics and len(resumed_rows) == steps,
        f"{len(parameters) - len(differing)}/{len(parameters)} parameters bit-identical"
        f"{' (differ: ' + ', '.join(differing[:3]) + ')' if differing else ''}; metrics of steps {half + 1}-{steps} "
        f"{'equal' if same_metrics else 'differ'}; uninterrupted run {reference_seconds:.0f} s",
        outcomes,
    )


# ---- 4. conversion round trip ------------------------------------------------------------------


def check_conversion(hf_dir: Path, workdir: Path, outcomes: dict[str, bool]) -> None:
    from safetensors.torch import load_file

    from stapo_megatron.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf

    start = time.perf_counter()
    convert_hf_to_megatron(hf_dir, workdir / "megatron", tp=1, pp=1)
    back = convert_megatron_to_hf(workdir / "megatron", workdir / "hf_back", tp=1, pp=1)
    seconds = time.perf_counter() - start

    def tensors(directory: Path) -> dict:
        out = {}
        for file in sorted(directory.glob("*.safetensors")):
            out.update(load_file(file))
        return out

    source, exported = tensors(hf_dir), tensors(back)
    exact = sorted(source) == sorted(exported) and all(torch.equal(source[k], exported[k]) for k in source)
    _report(
        "conversion HF -> Megatron -> HF",
        exact,
        f"{len(exported)} tensors {'bit-exact' if exact else 'DIFFER'}; {seconds:.0f} s",
        outcomes,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=None, help="kept when given (default: a temporary directory)")
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the token-statistics check")
    parser.add_argument("--cpu", action="store_true", help="run the checks on the CPU (to check this script)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(
            f"gpu_smoke: skipped: no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
            "--cpu runs the checks on the CPU",
            flush=True,
        )
        return 0
    if args.train_steps < 2 or args.train_steps % 2:
        parser.error("--train-steps: an even number >= 2")
    # Deterministic cuBLAS and (when installed) Transformer Engine attention, for the exact resume.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    device = _device(args.cpu)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"gpu_smoke on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
        f"{torch.__version__}, "
        f"workdir {workdir}",
        flush=True,
    )
    outcomes: dict[str, bool] = {}
    start = time.perf_counter()
    try:
        hf_dir = save_small_qwen3(workdir / "hf")
        check_logits(hf_dir, device, workdir, outcomes)
        check_token_statistics(device, args.tokens, outcomes)
        check_train_resume(workdir, args.train_steps, outcomes)
        check_conversion(hf_dir, workdir, outcomes)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = [name for name, ok in outcomes.items() if not ok]
    print(
        f"gpu_smoke: {len(outcomes) - len(failed)}/{len(outcomes)} checks passed in {time.perf_counter() - start:.0f} s"
        f"{'; failed: ' + ', '.join(failed) if failed else ''}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
