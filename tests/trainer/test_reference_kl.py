"""GRPO with a KL penalty to a frozen reference model: the k1/k2/k3 estimators, the loss's
gradient against an independent fp64 autograd, the reference model on the real update path
(equal to the policy at step 0, fixed while the policy moves, offloaded with the optimizer, the
same log-probs at TP=2 as at TP=1 and as Hugging Face's model), and a tiny end-to-end run with
``algo=grpo`` (DeepSeekMath's GRPO, KL 0.04) that resumes with the reference back at the initial weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

from stapo_megatron.config import ConfigError, build, load_config
from stapo_megatron.loss import AlgoConfig
from stapo_megatron.loss.policy import kl_estimate
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.validation import check_train_config
from tests.loss._loss_call import loss_of

ESTIMATORS = ("k1", "k2", "k3")


def test_estimators_have_schulmans_values_and_estimate_kl_of_the_policy_to_the_reference():
    x = torch.tensor([0.5, -1.0], dtype=torch.float64)  # log(pi_ref / pi)
    assert torch.allclose(kl_estimate(x, "k1"), torch.tensor([-0.5, 1.0], dtype=torch.float64))
    assert torch.allclose(kl_estimate(x, "k2"), torch.tensor([0.125, 0.5], dtype=torch.float64))
    assert torch.allclose(kl_estimate(x, "k3"), torch.exp(x) - 1 - x)
    # Direction: at tokens sampled from pi, k1 and k3 average to KL(pi || pi_ref), not KL(pi_ref || pi).
    pi = torch.tensor([0.8, 0.1, 0.05, 0.04, 0.01], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    forward, reverse = float((pi * (pi / ref).log()).sum()), float((ref * (ref / pi).log()).sum())
    assert abs(forward - reverse) > 0.1
    samples = torch.multinomial(pi, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    log_r = (ref.log() - pi.log())[samples]
    for name in ("k1", "k3"):
        assert math.isclose(float(kl_estimate(log_r, name).mean()), forward, abs_tol=0.012), name
    assert float(kl_estimate(log_r, "k3").min()) >= 0 and float(kl_estimate(log_r, "k2").min()) >= 0
    assert float(kl_estimate(log_r, "k1").min()) < 0  # k1 is negative where pi_ref > pi
    # k2 is biased: second order in log r, it is off by more than the sampling error here
    assert abs(float(kl_estimate(log_r, "k2").mean()) - forward) > 0.04
    with pytest.raises(ValueError, match="^kl_estimator: 'k4' is not one of k1, k2, k3$"):
        kl_estimate(x, "k4")


def _independent_loss(lp, old, ref, adv, keep, coef, estimator, eps_low=0.2, eps_high=0.28, c=3.0):
    """The token-mean loss with the KL term, written out in fp64 from the formulas."""
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * c), pg)
    log_r = ref - lp  # log(pi_ref / pi)
    kl = {"k1": -log_r, "k2": log_r**2 / 2, "k3": torch.exp(log_r) - 1 - log_r}[estimator]
    kept = keep > 0
    return ((pg + coef * kl) * keep)[kept].sum() / kept.sum()


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_loss_gradient_with_the_kl_term_matches_fp64_autograd(estimator):
    g = torch.Generator().manual_seed(1)
    shape = (3, 9)
    old = -3 * torch.rand(shape, generator=g, dtype=torch.float64)
    lp64 = old + 0.6 * torch.randn(shape, generator=g, dtype=torch.float64)  # ratios inside and beyond the clip
    ref = old + 0.8 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, -2.0], dtype=torch.float64)[:, None].expand(shape)
    keep = (torch.rand(shape, generator=g) > 0.25).double()
    keep[0, 0] = 0.5  # a fractional weight
    coef = 0.3
    lp = lp64.float().requires_grad_()
    loss_sum, count, metrics = loss_of(
        lp,
        old.float(),
        adv[:, 0].float(),
        keep.float(),
        ref_logprob=ref.float(),
        kl_coef=coef,
        kl_estimator=estimator,
        clip_ratio_c=3.0,  # veRL's dual-clip, which these ratios reach (the reference's c)
    )
    (loss_sum / count).backward()
    x = lp.detach().double().requires_grad_()
    expected = _independent_loss(x, old, ref, adv, keep, coef, estimator)
    expected.backward()
    assert math.isclose(float(loss_sum.detach() / count), float(expected.detach()), rel_tol=1e-5)
    assert torch.allclose(lp.grad.double(), x.grad, atol=1e-6, rtol=1e-5), (lp.grad, x.grad)
    # the KL term carries gradient: without it the gradient differs
    y = lp.detach().double().requires_grad_()
    _independent_loss(y, old, ref, adv, keep, 0.0, estimator).backward()
    assert (y.grad - x.grad).abs().max() > 1e-3
    kept = keep > 0
    log_r = (ref - lp64.float().double())[kept]
    estimate = {"k1": -log_r, "k2": log_r**2 / 2, "k3": torch.exp(log_r) - 1 - log_r}[estimator]
    assert math.isclose(float(metrics["ref_kl_sum"]), float(estimate.sum()), rel_tol=1e-5)


def test_kl_estimator_is_checked_and_kl_coef_is_accepted_by_the_trainer():
    with pytest.raises(ValueError, match="^kl_estimator: 'mse' is not one of k1, k2, k3$"):
        loss_of(
            torch.zeros(2),
            torch.zeros(2),
            torch.ones(2),
            torch.ones(2),
            ref_logprob=torch.zeros(2),
            kl_coef=0.1,
            kl_estimator="mse",
        )
    with pytest.raises(ConfigError, match="^algo.kl_estimator:"):
        build(AlgoConfig, {"preset": "grpo", "kl_estimator": "low_var_kl"}, "algo")
    from stapo_megatron.trainer.launcher import default_config_path

    cfg = load_config(TrainConfig, str(default_config_path()), ["algo=grpo"])
    assert (cfg.algo.name, cfg.algo.kl_coef, cfg.algo.kl_estimator) == ("grpo", 0.04, "k3")
    check_train_config(cfg, files=False)  # refused before the trainer kept a reference model


def _hf_logprobs(hf_dir, batch, temperature) -> dict[int, torch.Tensor]:
    """Each sequence's label log-probs from Hugging Face's model in fp64 (one row per sequence)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float64).eval()
    out = {}
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
            tokens = torch.tensor(prompt + response)
            logits = model(tokens[None]).logits[0, :-1] / temperature
            out[i] = torch.log_softmax(logits, -1).gather(-1, tokens[1:, None])[:, 0]
    return out


def test_reference_model_on_the_update_path_at_tp1_and_tp2(tmp_path):
    from stapo_megatron.runtime.launch import spawn_ranks
    from tests.helpers import TINY_QWEN3, save_tiny_qwen3
    from tests.trainer import _reference_workers as workers

    hf_dir = save_tiny_qwen3(tmp_path / "hf", tie=False)
    arch = {**TINY_QWEN3, "tie_word_embeddings": False}
    for tp in (1, 2):
        spawn_ranks(workers.reference_checks, tp, str(tmp_path), str(hf_dir), arch, tp)
    records = {tp: json.loads((tmp_path / f"tp{tp}.json").read_text()) for tp in (1, 2)}
    for record in records.values():
        assert not record["failures"], "\n".join(record["failures"])
        # one reference pass per step, timed on its own, before the updates
        assert record["phases"].count("reference") == 1
        assert record["phases"].index("reference") < record["phases"].index("update")
        first, second = record["minibatch_metrics"]
        assert record["skipped"] == [False, False]
        # the first mini-batch updates a policy equal to the reference: the estimate is 0 up to
        # the rounding of two micro-batch layouts; after one optimizer step it is not
        assert 0 <= first["policy/ref_kl"] < 1e-9, first["policy/ref_kl"]
        assert second["policy/ref_kl"] > 1e-5, second["policy/ref_kl"]

    ref1, ref2 = (torch.tensor(records[tp]["ref_logprob"], dtype=torch.float64) for tp in (1, 2))
    response = torch.tensor(records[1]["response"])
    assert records[1]["offsets"] == records[2]["offsets"] and response.sum() > 300
    assert (ref1[response] - ref2[response]).abs().max() < 1e-5
    # against an independent model: Hugging Face's Qwen3 in fp64 at the rollout temperature
    batch = workers.rollout(arch["vocab_size"])
    expected = torch.zeros_like(ref1)
    for i, logprob in _hf_logprobs(hf_dir, batch, workers.TEMPERATURE).items():
        offset = records[1]["offsets"][str(i)]
        expected[offset : offset + logprob.numel()] = logprob
    assert (ref1[response] - expected[response]).abs().max() < 1e-4
    assert ref1[response].std() > 0.1  # varied log-probs: the comparison means something


@pytest.mark.slow
def test_tiny_run_with_grpo_logs_ref_kl_and_resumes_with_the_initial_reference(tmp_path):
    from tests.trainer.runs import metrics, run, train_command

    # 16 prompts a step (a quarter of the default): GRPO trains every sequence, the reference scores them all
    common = ["algo=grpo", "algo.kl_coef=0.5", "batch.prompts_per_step=16", "batch.prompts_per_minibatch=16"]
    straight = tmp_path / "straight"
    run(train_command(straight, *common, "run.steps=3"))
    rows = metrics(straight)
    # step 1 updates a policy that still equals the reference; from step 2 on they differ
    assert 0 <= rows[0]["policy/ref_kl"] < 1e-6
    assert rows[1]["policy/ref_kl"] > 1e-6 and rows[2]["policy/ref_kl"] > 1e-6
    assert rows[0]["time/reference"] > 0

    resumed = tmp_path / "resumed"
    run(train_command(resumed, *common, "run.steps=2"))
    run(train_command(resumed, *common, "run.steps=3"))  # resumes from step 2's checkpoint
    again = metrics(resumed)
    assert [r["step"] for r in again] == [1, 2, 3]
    # a reference rebuilt from the trained weights would give ~0 at step 3
    assert math.isclose(again[2]["policy/ref_kl"], rows[2]["policy/ref_kl"], rel_tol=1e-5)
    assert math.isclose(again[2]["policy/pg_loss"], rows[2]["policy/pg_loss"], rel_tol=1e-5, abs_tol=1e-7)


def test_plan_counts_the_reference_weights_when_kl_coef_is_positive():
    from stapo_megatron.launch.plan import Layout, Workload, estimate, stage_parameters
    from stapo_megatron.launch.plan_config import training_config_defaults
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.trainer.launcher import default_config_path

    arch = build(Qwen3Config, "qwen3_8b")
    layout = Layout(tp=2, pp=2, dp=2)
    for dtype in ("bfloat16", "float32"):
        plain = estimate(arch, layout, Workload(seq_len=4096, kernels="local", params_dtype=dtype))
        with_ref = estimate(
            arch, layout, Workload(seq_len=4096, kernels="local", params_dtype=dtype, reference_model=True)
        )
        for stage, (a, b) in enumerate(zip(plain.stages, with_ref.stages)):
            params = stage_parameters(arch, layout.tp, layout.pp, stage)
            # the local spec keeps the RMSNorm weights in fp32 whatever the dtype
            expected = sum(
                p.numel * (4 if dtype == "float32" or p.name.endswith("layernorm.weight") else 2) for p in params
            )
            assert a.reference == 0 and b.reference == expected > 0
            assert b.trainer - a.trainer == expected
        # without offload the reference stays resident while the servers generate
        kept = max(st.weights + st.grads + st.optimizer + st.reference for st in with_ref.stages)
        assert with_ref.rollout_phase == kept + with_ref.sglang + with_ref.reserve > plain.rollout_phase
        offloaded = [
            estimate(arch, layout, Workload(seq_len=4096, reference_model=r), offload=True) for r in (False, True)
        ]
        assert offloaded[0].rollout_phase == offloaded[1].rollout_phase  # it leaves with the optimizer state
    path = str(default_config_path())
    assert training_config_defaults(load_config(TrainConfig, path, ["algo=grpo"]))["reference_model"] is True
    assert training_config_defaults(load_config(TrainConfig, path, []))["reference_model"] is False
