"""Generation beside training, rank 0's side: the sample pool (segments, quorum, partial samples that
continue as the same samples, staleness drops, its checkpoint state) and the pipeline's schedule of
weight versions (which step is generated with which weights, the boundary a sync waits for, errors,
resume).

The pool's equivalence with the synchronous collector runs the real local engine; the partial and
staleness cases use :class:`ScriptedEngine`, a contract engine whose responses have lengths fixed by
the prompt, so every quorum and carry-over below is computed by hand."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from stapo_megatron.data.prompts import build_prompt_dataset
from stapo_megatron.data.sampler import PromptSampler
from stapo_megatron.data.synthetic import synthetic_tokenizer
from stapo_megatron.rewards import RewardPool
from stapo_megatron.rollout.engine import Completion
from stapo_megatron.trainer.controller import stop_token_ids
from stapo_megatron.trainer.launcher import load_train_config
from stapo_megatron.trainer.metrics import PhaseTimer
from stapo_megatron.trainer.rollout_collector import RolloutCollector
from stapo_megatron.trainer.rollout_pipeline import RolloutGenerationError, RolloutPipeline
from stapo_megatron.trainer.sample_pool import SamplePool
from tests.eval.scripted import WeightlessEngine


def _config(tmp_path, *overrides):
    return load_train_config(None, [f"run.output_dir={tmp_path}", "rollout.engine=local", *overrides])


class ScriptedEngine(WeightlessEngine):
    """A contract engine: a response to prompt p is ``length(p)`` tokens long in all (the prompt's
    own tokens decide it, so a continuation, whose prompt carries the tokens so far, goes on with
    the same total); token k of a response is ``3 + k`` with log-prob ``-0.1 * (k + 1)``; every token
    carries the engine's current ``version``. It records every call."""

    def __init__(self, lengths: dict[tuple[int, ...], int]):
        self.lengths = lengths  # prompt ids (without any generated tokens) -> response length
        self.version = 0
        self.calls: list[tuple[int, int]] = []  # (requests, max_new_tokens)

    def _split(self, ids):
        for prompt, length in self.lengths.items():
            if tuple(ids[: len(prompt)]) == prompt:
                return prompt, length, len(ids) - len(prompt)
        raise AssertionError(f"unscripted prompt {ids}")

    def generate(self, prompts, params):
        assert params.n == 1
        self.calls.append((len(prompts), params.max_new_tokens))
        out = []
        for ids in prompts:
            _, length, done = self._split(list(ids))
            count = min(params.max_new_tokens, length - done)
            tokens = [3 + k for k in range(done, done + count)]
            out.append(
                [
                    Completion(
                        token_ids=tokens,
                        logprobs=[-0.1 * (k + 1) for k in range(done, done + count)],
                        finish_reason="stop" if done + count == length else "length",
                        versions=[self.version] * count,
                    )
                ]
            )
        return out


@pytest.fixture
def reward_pool():
    pool = RewardPool.from_config(_config("/tmp/unused").reward)
    yield pool
    pool.close()


def _collector(cfg, engine, reward_pool, sampler_state=None):
    tokenizer = synthetic_tokenizer(cfg.data.synthetic_distractors)
    dataset = build_prompt_dataset(cfg.data, tokenizer)
    sampler = PromptSampler(len(dataset), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    if sampler_state is not None:
        sampler.load_state_dict(sampler_state)
    return RolloutCollector(engine, reward_pool, tokenizer, dataset, sampler, cfg, stop_token_ids(cfg, tokenizer))


def _scripted(cfg, reward_pool):
    """A collector on a ScriptedEngine, the sampler's first prompts (in order), and a function that
    scripts the response length of every prompt of the dataset by its index."""
    collector = _collector(cfg, ScriptedEngine({}), reward_pool)
    engine, dataset = collector.engine, collector.dataset
    order = PromptSampler(len(dataset), seed=cfg.data.seed, shuffle=cfg.data.shuffle).next_indices(len(dataset))
    prompts = dataset.batch(range(len(dataset)))

    def script(length_of):
        engine.lengths = {tuple(p.prompt_ids): length_of(i) for i, p in enumerate(prompts)}

    return collector, engine, order, script


def _same_batch(a, b):
    assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
    assert a.rollout_logprobs == b.rollout_logprobs
    for name in ("truncated", "rewards", "correct", "advantages", "group_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# ---- the pool ---------------------------------------------------------------------------------


def test_without_partial_rollouts_the_pool_generates_the_synchronous_collectors_batch(tmp_path, reward_pool):
    """The same step, seeds and weights: the pool (one segment of max_new_tokens, one request per
    sample) gives the synchronous loop's batch token for token, its rewards and advantages."""
    from stapo_megatron.rollout.local_engine import LocalEngine

    sync_cfg = _config(tmp_path, "batch.prompts_per_step=8", "batch.prompts_per_minibatch=8")
    async_cfg = _config(
        tmp_path, "batch.prompts_per_step=8", "batch.prompts_per_minibatch=8", "rollout.async.max_staleness=1"
    )
    torch.manual_seed(0)
    engine = LocalEngine(sync_cfg.model)
    engine.load_weights([(n, p.detach().clone()) for n, p in engine.model.named_parameters()], version=0)
    expected, expected_metrics = _collector(sync_cfg, engine, reward_pool).collect(1, PhaseTimer())
    batch, metrics = SamplePool(_collector(async_cfg, engine, reward_pool)).take(1)
    _same_batch(batch, expected)
    for key, value in expected_metrics.items():
        assert metrics[key] == value, key
    assert metrics["async/staleness_0"] == 1.0 and metrics["async/segment_rounds"] == 1
    assert metrics["async/response_tokens"] == sum(len(r) for r in batch.response_ids) > 0


def _partial_cfg(tmp_path, *overrides):
    return _config(
        tmp_path,
        "batch.prompts_per_step=4",
        "batch.prompts_per_minibatch=4",
        "batch.group_size=2",
        "batch.max_new_tokens=6",
        "rollout.async.max_staleness=2",
        "rollout.partial.enabled=true",
        "rollout.partial.segment_tokens=2",
        "rollout.partial.over_sampling=0.5",
        *overrides,
    )


def test_a_step_takes_the_first_groups_to_finish_and_the_rest_continue_as_the_same_samples(tmp_path, reward_pool):
    cfg = _partial_cfg(tmp_path)  # 4 groups a step, 2 more in the pool, segments of 2 tokens
    collector, engine, order, script = _scripted(cfg, reward_pool)
    slow = {order[0], order[3]}  # 3 tokens: two segments; every other prompt answers in one
    script(lambda i: 3 if i in slow else 2)
    prompts = collector.dataset.batch(range(len(collector.dataset)))
    pool = SamplePool(collector)

    batch, metrics = pool.take(1)
    # One round: the four one-segment groups reach the quorum, in pool order.
    assert metrics["async/segment_rounds"] == 1
    assert batch.prompt_ids == [
        list(prompts[i].prompt_ids) for i in (order[1], order[2], order[4], order[5]) for _ in "ab"
    ]
    assert batch.response_ids == [[3, 4]] * 8
    # The two slow groups stay, each sample holding its first segment, of version 0.
    assert [g.prompt_index for g in pool.groups] == [order[0], order[3]]
    assert all(
        s.token_ids == [3, 4] and s.versions == [0, 0] and s.finish_reason is None
        for g in pool.groups
        for s in g.samples
    )
    assert metrics["async/partial_aborted"] == 4 and metrics["async/partial_carried_over"] == 0

    # Step 2, under version 1: the carried samples continue from their third token (their prompt is
    # the prompt and their two tokens), finish first in pool order, and are trained as they are.
    engine.version = 1
    batch, metrics = pool.take(2)
    assert batch.prompt_ids[:4] == [list(prompts[i].prompt_ids) for i in (order[0], order[3]) for _ in "ab"]
    assert batch.response_ids[:4] == [[3, 4, 5]] * 4
    assert batch.rollout_logprobs[:4] == [pytest.approx([-0.1, -0.2, -0.3])] * 4
    assert batch.prompt_ids[4:] == [list(prompts[i].prompt_ids) for i in (order[6], order[7]) for _ in "ab"]
    assert metrics["async/partial_carried_over"] == 4
    # Trained from version 1: the carried samples' first two tokens are one version behind.
    assert metrics["async/response_tokens"] == 4 * 3 + 4 * 2
    assert metrics["async/staleness_1"] == pytest.approx(8 / 20) and metrics["async/staleness_0"] == pytest.approx(
        12 / 20
    )
    assert metrics["async/version_oldest"] == 0 and metrics["async/version_newest"] == 1
    assert metrics["async/staleness_max"] == 1


def test_a_group_older_than_max_staleness_is_dropped_and_its_prompt_starts_again(tmp_path, reward_pool):
    # max_staleness 1: a sample may continue once; the slow prompt needs three segments, so it would
    # carry tokens of version 0 into a step trained from version 2.
    cfg = _partial_cfg(tmp_path, "rollout.async.max_staleness=1", "rollout.partial.over_sampling=0.25")
    collector, engine, order, script = _scripted(cfg, reward_pool)
    slow = order[0]
    script(lambda i: 6 if i == slow else 2)
    pool = SamplePool(collector)
    _, metrics = pool.take(1)  # 5 groups: 4 finish in one segment, the slow one has 2 of its 6 tokens
    assert metrics["async/partial_aborted"] == 2 and metrics["async/groups_dropped"] == 0
    engine.version = 1
    _, metrics = pool.take(2)  # trained from 1: its version-0 tokens are 1 behind, so it continues
    assert metrics["async/groups_dropped"] == 0
    slow_group = next(g for g in pool.groups if g.prompt_index == slow)
    assert [s.token_ids for s in slow_group.samples] == [[3, 4, 5, 6]] * 2
    assert [s.versions for s in slow_group.samples] == [[0, 0, 1, 1]] * 2
    engine.version = 2
    _, metrics = pool.take(3)  # trained from 2: version 0 is 2 behind, so the group starts again
    assert metrics["async/groups_dropped"] == 1
    restarted = [g for g in pool.groups if g.prompt_index == slow]
    assert len(restarted) == 1 and restarted[0].uid > slow_group.uid
    assert [s.versions for s in restarted[0].samples] == [[2, 2]] * 2  # its new first segment


def test_the_pool_state_is_plain_data_and_a_restored_pool_goes_on_identically(tmp_path, reward_pool):
    cfg = _partial_cfg(tmp_path)
    collector, engine, order, script = _scripted(cfg, reward_pool)

    def length_of(i):  # two segments for two of the first step's groups, one or two tokens otherwise
        return 3 if i in (order[0], order[3]) else 1 + i % 2

    script(length_of)
    pool = SamplePool(collector)
    pool.take(1)
    engine.version = 1
    state = json.loads(json.dumps(pool.state_dict()))  # nothing but JSON types
    assert any(s["token_ids"] and s["finish_reason"] is None for g in state["groups"] for s in g["samples"])
    restored_collector, restored_engine, _, restored_script = _scripted(cfg, reward_pool)
    restored_script(length_of)
    restored_collector.sampler.load_state_dict(collector.sampler.state_dict())
    restored = SamplePool(restored_collector)
    restored.load_state_dict(state)
    restored_engine.version = 1
    for step in (2, 3):
        (a, ma), (b, mb) = pool.take(step), restored.take(step)
        _same_batch(a, b)
        assert ma == mb
        engine.version = restored_engine.version = step


def test_a_pool_state_that_does_not_fit_the_run_is_refused_in_one_line(tmp_path, reward_pool):
    cfg = _partial_cfg(tmp_path)
    collector, _, _, script = _scripted(cfg, reward_pool)
    script(lambda i: 3)
    pool = SamplePool(collector)
    pool.take(1)
    state = pool.state_dict()
    state["groups"][0]["samples"] = state["groups"][0]["samples"][:1]
    with pytest.raises(ValueError, match=r"^rollout pool state: a group of 1 samples, but batch.group_size is 2$"):
        SamplePool(collector).load_state_dict(state)


# ---- the pipeline's schedule -------------------------------------------------------------------


class GatedPool:
    """A contract pool: take(step) records the engine version the pipeline allowed, then waits until
    the test opens the step's gate."""

    def __init__(self, fail_at: int | None = None):
        self.started: dict[int, threading.Event] = {}
        self.gates: dict[int, threading.Event] = {}
        self.fail_at = fail_at
        self.taken: list[int] = []
        self.state = {"taken": self.taken}

    def gate(self, step):
        return self.gates.setdefault(step, threading.Event())

    def entered(self, step):
        return self.started.setdefault(step, threading.Event())

    def take(self, step):
        self.entered(step).set()
        assert self.gate(step).wait(60), f"step {step}'s gate was never opened"
        if step == self.fail_at:
            raise RuntimeError("the servers went away")
        self.taken.append(step)
        batch = _tiny_batch(step)
        return batch, {"reward/mean": float(step)}

    def state_dict(self):
        return {"taken": list(self.taken)}

    def load_state_dict(self, state):
        self.taken[:] = state["taken"]


def _tiny_batch(step):
    from stapo_megatron.trainer.batch import RolloutBatch

    return RolloutBatch(
        prompt_ids=[[1, step]],
        response_ids=[[step, 2]],
        rollout_logprobs=[[-0.5, -0.25]],
        truncated=torch.tensor([False]),
        rewards=torch.tensor([float(step)]),
        correct=torch.tensor([1.0]),
        advantages=torch.tensor([0.5]),
        group_ids=torch.tensor([0]),
    )


def _open(pool, *steps):
    for step in steps:
        pool.gate(step).set()


def test_the_thread_generates_each_step_with_the_scheduled_version_and_the_sync_waits_for_the_boundary():
    pool = GatedPool()
    pipeline = RolloutPipeline(pool, lag=1, last_step=4, next_step=1)  # type: ignore[arg-type]
    try:
        assert [pipeline.version_for(s) for s in (1, 2, 3, 4)] == [0, 0, 1, 2]
        assert not pool.entered(1).is_set()  # nothing before the trainer asks for step 1
        _open(pool, 1, 2)
        batch, metrics = pipeline.take(1)  # version 0 is on the engine: steps 1 and 2 may run
        assert batch.prompt_ids == [[1, 1]] and metrics["reward/mean"] == 1.0
        assert metrics["async/trainer_wait_s"] >= 0 and metrics["async/generator_wait_s"] >= 0
        pipeline.wait_for_boundary(1)  # every batch of version 0 (steps 1, 2) is generated
        assert pool.taken == [1, 2] and not pool.entered(3).is_set()  # step 3 needs version 1
        pipeline.take(2)  # the trainer synced version 1
        assert pool.entered(3).wait(60)
        boundary = threading.Thread(target=pipeline.wait_for_boundary, args=(2,))
        boundary.start()
        boundary.join(0.2)
        assert boundary.is_alive()  # step 3 (version 1) is still generating
        _open(pool, 3)
        boundary.join(60)
        assert not boundary.is_alive() and pool.taken == [1, 2, 3]
        state = pipeline.state_dict(2)  # at the boundary of version 2: step 3 generated ahead
        assert state["next_step"] == 4 and list(state["ready"]) == ["3"] and state["pool"] == {"taken": [1, 2, 3]}
    finally:
        pipeline.close()

    # A resume at step 2 from that state hands step 3 over as generated, and goes on with step 4.
    resumed_pool = GatedPool()
    resumed = RolloutPipeline.resumed(resumed_pool, 1, 4, 2, json.loads(json.dumps(state)))  # type: ignore[arg-type]
    try:
        assert resumed_pool.taken == [1, 2, 3]
        _open(resumed_pool, 4)
        batch, metrics = resumed.take(3)
        assert batch.prompt_ids == [[1, 3]] and batch.rollout_logprobs == [[-0.5, -0.25]]
        assert metrics["reward/mean"] == 3.0
        assert resumed.take(4)[0].prompt_ids == [[1, 4]]
    finally:
        resumed.close()


def test_a_checkpoint_of_another_lag_discards_what_it_generated_ahead(caplog):
    """...and keeps its pool: the samples in flight continue."""
    pool = GatedPool()
    state = {"version": 1, "lag": 2, "next_step": 5, "ready": {"3": {}, "4": {}}, "pool": {"taken": [1, 2, 3]}}
    pipeline = RolloutPipeline.resumed(pool, 1, 6, 2, state)  # type: ignore[arg-type]
    try:
        assert "the 2 batches it generated ahead are discarded" in caplog.text
        assert pool.taken == [1, 2, 3]  # the checkpoint's pool
        _open(pool, 3)
        assert pipeline.take(3)[0].prompt_ids == [[1, 3]]  # generated afresh
    finally:
        pipeline.close()


def test_a_failure_of_the_generation_thread_reaches_the_trainer_where_it_waits():
    pool = GatedPool(fail_at=2)
    pipeline = RolloutPipeline(pool, lag=1, last_step=4, next_step=1)  # type: ignore[arg-type]
    try:
        _open(pool, 1, 2)
        pipeline.take(1)
        with pytest.raises(RolloutGenerationError, match="rollout generation failed: the servers went away"):
            pipeline.wait_for_boundary(1)
        with pytest.raises(RolloutGenerationError):
            pipeline.take(2)
    finally:
        pipeline.close()


def test_async_settings_that_cannot_work_are_refused_in_one_line(tmp_path):
    from stapo_megatron.config import ConfigError

    cases = {
        ("rollout.partial.enabled=true",): "rollout.partial.enabled: needs async.max_staleness >= 1",
        ("rollout.partial.segment_tokens=8",): "rollout.partial.segment_tokens: acts only with partial.enabled: true",
        ("rollout.async.max_staleness=1", "compute.offload_while_generating=true"): (
            "compute.offload_while_generating: the servers generate while the trainer trains"
        ),
        (
            "rollout.async.max_staleness=1",
            "algo.dynamic_sampling=true",
        ): "algo.dynamic_sampling: not with rollout.async",
        (
            "rollout.async.max_staleness=1",
            "rollout.engine=sglang",
            "rollout.sglang.placement=colocated",
            "rollout.sglang.model_path=m",
        ): "rollout.async: generation overlapped with training needs servers on GPUs of their own",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as error:
            load_train_config(None, [f"run.output_dir={tmp_path}", *overrides])
        assert message in str(error.value) and "\n" not in str(error.value), overrides


def test_the_off_policy_correction_is_on_by_default_only_when_generation_runs_ahead(tmp_path):
    assert _config(tmp_path).algo.rollout_correction == "none"
    assert _config(tmp_path, "rollout.async.max_staleness=2").algo.rollout_correction == "tis_token"
    explicit = _config(tmp_path, "rollout.async.max_staleness=2", "algo.rollout_correction=mis_token")
    assert explicit.algo.rollout_correction == "mis_token"
    assert dataclasses.asdict(_config(tmp_path).rollout)["async_"] == {"max_staleness": 0}
