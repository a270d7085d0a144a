"""The step-time model (stapo_megatron/launch/step_time.py) on numbers worked out by hand."""

from __future__ import annotations

import pytest

from stapo_megatron.launch import step_time as st


def test_reference_rates_are_the_published_runs_divided_out():
    # NeMo-RL v0.5 Qwen3-32B: 2,048 samples x 3,251 tokens = 6,658,048 tokens per step;
    # one-step-off 200 s bound by generation on 32 GPUs; on-policy 376 s = 200 + 16 (transition) + 160 training
    assert st.DECODE_TOKENS_PER_GPU_S == pytest.approx(6_658_048 / 6_400)  # 1,040.32
    assert st.TRAIN_TOKENS_PER_GPU_S == pytest.approx(6_658_048 / 5_120)  # 1,300.40
    at_32b = st.Throughput.scaled(st.REFERENCE_PARAMETERS)
    assert (at_32b.decode_tokens_per_gpu_s, at_32b.train_tokens_per_gpu_s, at_32b.pause_s) == pytest.approx(
        (1040.32, 1300.4, 16.0)
    )
    # the reference's own step, recomputed from its rates: 32 GPUs in turns, and 32 + 32 overlapped
    tokens = st.StepTokens(2048, 0, 3251)
    assert st.synchronous_step(tokens, 32, at_32b, st.REFERENCE_EFFICIENCY).total_s == pytest.approx(376.0)
    overlapped = st.asynchronous_step(tokens, 32, 32, at_32b, st.REFERENCE_EFFICIENCY, steps=10**9)
    assert overlapped.generation_s == pytest.approx(200.0) and overlapped.training_s == pytest.approx(160.0)


def test_rates_scale_with_the_parameters():
    half = st.Throughput.scaled(st.REFERENCE_PARAMETERS // 2)
    assert half.decode_tokens_per_gpu_s == pytest.approx(2 * 1040.32)
    assert half.train_tokens_per_gpu_s == pytest.approx(2 * 1300.4)
    assert half.pause_s == pytest.approx(8.0)


def test_pipeline_efficiency_is_1f1b_busy_fraction():
    assert st.pipeline_efficiency(1, 7) == 1.0
    assert st.pipeline_efficiency(4, 256) == pytest.approx(256 / 259)
    assert st.pipeline_efficiency(2, 3) == pytest.approx(0.75)


def test_synchronous_and_asynchronous_steps_on_hand_computed_cases():
    rate = st.Throughput(decode_tokens_per_gpu_s=10.0, train_tokens_per_gpu_s=20.0, pause_s=5.0)
    tokens = st.StepTokens(samples=100, prompt_tokens=10, response_tokens=90)
    assert (tokens.generated, tokens.trained) == (9000, 10000)
    ref = st.REFERENCE_EFFICIENCY
    # 10 GPUs in turns: 9000 / 100 = 90 s generating, 10000 / 200 = 50 s training, 5 s pause
    sync = st.synchronous_step(tokens, 10, rate, ref)
    assert (sync.generation_s, sync.training_s, sync.total_s) == pytest.approx((90.0, 50.0, 145.0))
    # 6 server GPUs: 150 s; 4 trainer GPUs: 125 s; overlapped 150 + 5 + the first generation over 10 steps 15
    overlapped = st.asynchronous_step(tokens, 6, 4, rate, ref, steps=10)
    assert (overlapped.generation_s, overlapped.training_s, overlapped.startup_s) == pytest.approx((150, 125, 15))
    assert overlapped.total_s == pytest.approx(170.0)
    # a pipeline half as busy as the reference's trains for twice as long, and now training bounds the step
    slow = st.asynchronous_step(tokens, 6, 4, rate, ref / 2, steps=10)
    assert slow.training_s == pytest.approx(250.0) and slow.total_s == pytest.approx(270.0)
