"""Contract tests of SGLangEngine against SGLang's documented API.

The server side is ``fake_sglang``: a small HTTP server that follows SGLang's request and response
shapes (from SGLang's source; see shared/notes/sglang-api.md) and rejects anything else. Servers run
either in a thread or as separate processes the engine launches through ``server_command``, so
crashes and restarts are real. All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from stapo_megatron.config.core import ConfigError, build, describe
from stapo_megatron.rollout.config import RolloutConfig, SGLangConfig
from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.rollout.sglang_client import request
from stapo_megatron.rollout.sglang_engine import (
    SGLangEngine,
    SGLangServerError,
    SGLangWeightSyncError,
    expected_names_from_hf_checkpoint,
)
from stapo_megatron.rollout.sglang_generate import parse_generate
from stapo_megatron.rollout.sglang_launch import KEY_ENV
from stapo_megatron.rollout.sglang_server import build_launch_command
from stapo_megatron.runtime.launch import reserve_port

try:
    from . import fake_sglang
except ImportError:  # tests/rollout is not a package
    import fake_sglang

FakeSGLangServer = fake_sglang.FakeSGLangServer
fake_sample = fake_sglang.fake_sample
serialize_tensors = fake_sglang.serialize_tensors

KEY = "contract-test-key"
# Started as production starts sglang.launch_server: through the wrapper that hands it the key.
FAKE_COMMAND = [sys.executable, "-m", "stapo_megatron.rollout.sglang_launch", str(Path(fake_sglang.__file__).resolve())]
SETUP_PATHS = {"/health", "/health_generate", "/server_info", "/get_server_info"}

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------- helpers


def attach_config(*urls: str, **overrides) -> SGLangConfig:
    fields = dict(
        urls=list(urls),
        api_key=KEY,
        retry_backoff_s=0.01,
        startup_timeout_s=10,
        control_timeout_s=20,
        flush_timeout_s=5,
        shutdown_grace_s=2,
    )
    fields.update(overrides)
    return SGLangConfig(**fields)


def launch_config(tmp_path: Path, env: dict | None = None, **overrides) -> SGLangConfig:
    fields = dict(
        model_path="fake/qwen3-0.6b",
        server_command=FAKE_COMMAND,
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=30,
        retry_backoff_s=0.05,
        control_timeout_s=30,
        shutdown_grace_s=3,
        env={"FAKE_SGLANG_RECORD_DIR": str(tmp_path), **(env or {})},
    )
    fields.update(overrides)
    return SGLangConfig(**fields)


@pytest.fixture
def fake():
    server = FakeSGLangServer(api_key=KEY, admin_api_key=KEY).start()
    yield server
    server.stop()


def requests_after_setup(server) -> list[dict]:
    return [r for r in server.state.requests if r["path"] not in SETUP_PATHS]


def control_paths(server) -> list[str]:
    return [r["path"] for r in requests_after_setup(server) if r["path"] != "/generate"]


def expected(prompt, n, max_new_tokens, stops, seed=None):
    return [fake_sample(prompt, s, max_new_tokens, set(stops), seed) for s in range(n)]


def weights_stream(seed: int):
    """(name, tensor) pairs of assorted dtypes and sizes; 'big' exceeds a 4 KiB bucket on its own."""
    gen = torch.Generator().manual_seed(seed)
    specs = [
        ("model.embed_tokens.weight", (50, 8), torch.bfloat16),
        ("model.layers.0.self_attn.q_proj.weight", (16, 8), torch.float32),
        ("model.layers.0.self_attn.k_proj.weight", (8, 8), torch.float32),
        ("model.layers.0.self_attn.v_proj.weight", (8, 8), torch.float16),
        ("model.layers.0.mlp.big.weight", (40, 40), torch.float32),  # 6400 bytes > bucket
        ("model.layers.0.input_layernorm.weight", (8,), torch.bfloat16),
        ("model.layers.0.post_attention_layernorm.weight", (8,), torch.float32),
        ("model.layers.0.mlp.gate_proj.weight", (24, 8), torch.float32),
        ("model.layers.0.mlp.up_proj.weight", (24, 8), torch.float32),
        ("model.layers.0.mlp.down_proj.weight", (8, 24), torch.float32),
        ("model.norm.weight", (8,), torch.float32),
        ("lm_head.weight", (50, 8), torch.bfloat16),
    ]
    return [(name, torch.randn(shape, generator=gen).to(dtype)) for name, shape, dtype in specs]


NAMES = [name for name, _ in weights_stream(0)]
BUCKET = 4096


def check_buckets(updates: list[dict], sent: list[tuple[str, torch.Tensor]], bound: int) -> None:
    """Every tensor exactly once, in order; each call within the bound unless it carries one tensor;
    buckets are filled greedily (the next tensor would not have fit)."""
    assert [n for u in updates for n in u["names"]] == [n for n, _ in sent]
    sizes = {n: t.numel() * t.element_size() for n, t in sent}
    for i, update in enumerate(updates):
        assert update["nbytes"] == sum(sizes[n] for n in update["names"])
        assert update["nbytes"] <= bound or len(update["names"]) == 1
        if i + 1 < len(updates):
            assert update["nbytes"] + sizes[updates[i + 1]["names"][0]] > bound


def assert_bit_equal(received: dict, sent: list[tuple[str, torch.Tensor]]) -> None:
    assert set(received) == {n for n, _ in sent}
    for name, tensor in sent:
        got = received[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def fake_state(url: str) -> dict:
    resp = request(url, "GET", "/fake/state", api_key=None, timeout=10)
    state = resp.json()
    state["weights"] = torch.load(io.BytesIO(base64.b64decode(state["weights"])), weights_only=True)
    return state


def recorded(tmp_path: Path, url: str) -> list[dict]:
    port = url.rsplit(":", 1)[1]
    path = tmp_path / f"{port}.jsonl"
    calls = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [c for c in calls if not c["path"].startswith("/fake/")]  # the test's own state reads


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------- launch command


def test_launch_command_for_given_settings():
    cfg = SGLangConfig(
        model_path="/models/Qwen3-8B",
        tp_size=2,
        num_servers=2,
        base_gpu_id=4,
        host="0.0.0.0",
        mem_fraction_static=0.55,
        dtype="bfloat16",
        context_length=8192,
        random_seed=7,
        deterministic_inference=True,
        load_format="dummy",
        extra_args=["--skip-server-warmup"],
        env={"NCCL_DEBUG": "WARN"},
    )
    argv, env = build_launch_command(cfg, local_index=1, global_index=5, port=31001, nccl_port=32001, api_key="s3cret")
    assert argv[:4] == [sys.executable, "-m", "stapo_megatron.rollout.sglang_launch", "sglang.launch_server"]
    assert argv[-1] == "--skip-server-warmup"
    flags = argv[4:]
    values = {
        flags[i]: flags[i + 1]
        for i in range(len(flags) - 1)
        if flags[i].startswith("--") and "=" not in flags[i] and not flags[i + 1].startswith("--")
    }
    values.update(f.split("=", 1) for f in flags if f.startswith("--") and "=" in f)
    assert values == {
        "--model-path": "/models/Qwen3-8B",
        "--host": "0.0.0.0",
        "--port": "31001",
        "--tp-size": "2",
        "--base-gpu-id": "6",
        "--mem-fraction-static": "0.55",
        "--random-seed": "12",
        "--dtype": "bfloat16",
        "--nccl-port": "32001",
        "--context-length": "8192",
        "--load-format": "dummy",
    }
    for switch in ("--skip-tokenizer-init", "--enable-deterministic-inference"):
        assert switch in flags
    # Colocated servers (one per tp_size GPUs of each node, from GPU 0) can give their memory back.
    colocated = SGLangConfig(model_path="m", tp_size=2, placement="colocated")
    argv, _ = build_launch_command(colocated, local_index=3, global_index=7, port=1, nccl_port=2, api_key="k")
    assert "--enable-memory-saver" in argv and argv[argv.index("--base-gpu-id") + 1] == "6"
    assert env["NCCL_DEBUG"] == "WARN" and env["PATH"] == os.environ["PATH"]
    # The key travels in the environment only (see test_sglang_secrets for the launched processes).
    assert env[KEY_ENV] == "s3cret" and not any("s3cret" in arg for arg in argv)
    # Every flag is one SGLang's launcher documents, with the right arity (the fake parses them the same way).
    fake_sglang.build_parser().parse_args(flags)

    plain = SGLangConfig(model_path="m", server_command=["/opt/wrap.sh", "serve"])
    argv, _ = build_launch_command(plain, local_index=0, global_index=0, port=1, nccl_port=2, api_key="k")
    assert argv[:2] == ["/opt/wrap.sh", "serve"] and argv[2] == "--model-path" and "k" not in argv
    assert "--enable-memory-saver" not in argv and "--context-length" not in argv


def test_config_validation():
    with pytest.raises(ConfigError, match=r"^model_path: "):
        SGLangEngine(SGLangConfig())
    with pytest.raises(ConfigError, match=r"^sglang.urls\[0\]: "):
        build(RolloutConfig, {"engine": "sglang", "sglang": {"urls": ["localhost:30000"]}})
    with pytest.raises(ConfigError, match=r"^rollout.sglang.model_path: required"):
        build(RolloutConfig, {"engine": "sglang"}, "rollout")
    assert any(row[0] == "sglang.weight_bucket_bytes" for row in describe(RolloutConfig))
    with pytest.raises(ConfigError, match=r"^weight_sync: "):
        SGLangConfig(urls=["http://h:1"], weight_sync="tensor")
    with pytest.raises(ConfigError, match=r"^sglang.weight_bucket_bytes: "):
        build(RolloutConfig, {"engine": "sglang", "sglang": {"model_path": "m", "weight_bucket_bytes": 0}})
    cfg = build(RolloutConfig, {"engine": "sglang", "sglang": {"model_path": "m", "placement": "colocated"}})
    assert cfg.sglang.resolved_weight_sync == "tensor" and cfg.sglang.launches and cfg.sglang.colocated
    with pytest.raises(ConfigError, match=r"^sglang.placement: "):
        build(RolloutConfig, {"engine": "sglang", "sglang": {"model_path": "m", "placement": "everywhere"}})
    with pytest.raises(ConfigError, match=r"^num_servers: colocated placement launches one server per tp_size GPUs"):
        SGLangConfig(model_path="m", placement="colocated", num_servers=4)
    with pytest.raises(ConfigError, match=r"^base_gpu_id: colocated placement"):
        SGLangConfig(model_path="m", placement="colocated", base_gpu_id=4)
    assert SGLangConfig(urls=["http://h:1"]).resolved_weight_sync == "distributed"
    assert RolloutConfig().engine == "local"


def test_startup_failure_names_the_log(tmp_path):
    cfg = launch_config(
        tmp_path, server_command=[sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(7)"]
    )
    with pytest.raises(SGLangServerError, match=r"exited with status 7") as info:
        SGLangEngine(cfg)
    assert str(tmp_path / "logs" / "server-0.log") in str(info.value)
    assert "no GPU here" in str(info.value)


# ---------------------------------------------------------------------------- the fake itself


def test_fake_enforces_documented_validation():
    new = FakeSGLangServer(version="0.5.22", api_key=KEY).start()
    old = FakeSGLangServer(version="0.5.20", api_key=KEY).start()
    try:
        body = {
            "input_ids": [[1, 2]],
            "sampling_params": {"max_new_tokens": 2, "seed": 1},
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        assert request(new.url, "POST", "/generate", body, api_key=KEY, timeout=5).status == 400
        assert request(old.url, "POST", "/generate", body, api_key=KEY, timeout=5).status == 200
        assert request(new.url, "POST", "/generate", body, api_key=None, timeout=5).status == 401
        assert request(new.url, "GET", "/health", api_key=None, timeout=5).status == 200
        assert request(old.url, "POST", "/begin_weight_update", {}, api_key=KEY, timeout=5).status == 404
        assert (
            request(
                new.url,
                "POST",
                "/update_weights_from_tensor",
                {"serialized_named_tensors": [serialize_tensors([])]},
                api_key=KEY,
                timeout=5,
            ).status
            == 400
        )
        assert request(new.url, "POST", "/pause_generation", {"mode": "later"}, api_key=KEY, timeout=5).status == 400
    finally:
        new.stop()
        old.stop()


# ---------------------------------------------------------------------------- generation


def test_generate_request_shape_and_response_parsing(fake):
    prompts = [[5, 6, 7], [11, 12], [3, 1, 4, 1, 5]]
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=6, stop_token_ids=(3, 17, 29))
    with SGLangEngine(attach_config(fake.url, max_prompts_per_request=2)) as engine:
        out = engine.generate(prompts, params)
    assert len(out) == 3 and all(len(group) == 3 for group in out)
    reasons = set()
    for prompt, group in zip(prompts, out):
        for completion, (tokens, logprobs, finish) in zip(group, expected(prompt, 3, 6, params.stop_token_ids)):
            assert completion.token_ids == tokens and completion.logprobs == logprobs
            assert completion.finish_reason == finish["type"]
            reasons.add(completion.finish_reason)
    assert reasons == {"stop", "length"}

    calls = [r for r in fake.state.requests if r["path"] == "/generate"]
    assert sorted(len(c["body"]["input_ids"]) for c in calls) == [1, 2]
    assert sorted(map(str, (c["body"]["input_ids"] for c in calls))) == sorted(map(str, ([prompts[2]], prompts[:2])))
    for call in calls:
        assert call["body"]["return_logprob"] is True and call["body"]["logprob_start_len"] == -1
        assert call["body"]["sampling_params"] == {
            "n": 3,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "max_new_tokens": 6,
            "stop_token_ids": [3, 17, 29],
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "min_new_tokens": 0,
            "ignore_eos": False,
        }
    assert fake.state.requests and all(r["auth"] == f"Bearer {KEY}" for r in fake.state.requests)


def test_server_preferred_sampling_cannot_bend_the_sampler(fake):
    # A server launched with --preferred-sampling-params, as a model's generation_config.json might
    # suggest (min_p, repetition penalty): SGLang merges them under each request's own keys.
    fake.state.preferred_sampling_params = {
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "min_new_tokens": 4,
        "ignore_eos": True,
        "stop_token_ids": [9],
        "top_k": 20,
        "skip_special_tokens": False,
    }
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, top_k=0, max_new_tokens=4)
    with SGLangEngine(attach_config(fake.url)) as engine:
        [group] = engine.generate([[1, 2, 3]], params)
        seeded = engine.generate([[4, 5]], SamplingParams(n=2, max_new_tokens=3, seed=7))
    assert len(group) == 2 and len(seeded[0]) == 2
    assert len(fake.state.sampled_with) == 4  # every sample, unseeded and seeded
    for effective in fake.state.sampled_with:
        assert {
            k: v
            for k, v in effective.items()
            if k not in ("n", "temperature", "top_p", "max_new_tokens", "sampling_seed")
        } == {
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "min_new_tokens": 0,
            "ignore_eos": False,
            "stop_token_ids": [],
            "top_k": -1,
            "skip_special_tokens": False,
        }
    assert [(e["temperature"], e["top_p"]) for e in fake.state.sampled_with[:2]] == [(0.9, 0.95)] * 2


@pytest.mark.parametrize("preferred", [{"logit_bias": {"7": 5.0}}, {"min_p": 0.0, "regex": "[0-9]+"}])
def test_a_server_preferring_an_unpinned_sampling_parameter_is_refused(fake, preferred):
    fake.state.preferred_sampling_params = preferred
    unpinned = sorted(set(preferred) - {"min_p"})
    with pytest.raises(
        SGLangServerError,
        match=rf"{fake.url} \(attached\) sets preferred_sampling_params {unpinned!r}".replace("[", r"\["),
    ):
        SGLangEngine(attach_config(fake.url))


def test_single_prompt_dict_response_is_parsed():
    tokens, logprobs, finish = fake_sample([1, 2], 0, 4, set(), None)
    item = {
        "output_ids": tokens,
        "meta_info": {
            "finish_reason": finish,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
        },
    }
    [[completion]] = parse_generate(item, 1, 1, "http://x")
    assert completion.token_ids == tokens and completion.finish_reason == "length"


def test_a_weight_sync_runs_while_a_generate_is_in_flight(fake):
    """generate() does not hold the engine while its requests run: load_weights (version 2) completes
    while a request answered under version 1 is still in flight, and that answer is accepted, each
    token with version 1, because the engine synced while it ran. Without a sync the same answer
    would be stale (the unit tests of the parser)."""
    cfg = attach_config(fake.url, placement="colocated", weight_sync="tensor", weight_bucket_bytes=BUCKET)
    with SGLangEngine(cfg, expected_weight_names=NAMES, tensor_serializer=serialize_tensors) as engine:
        engine.load_weights(weights_stream(1), version=1)
        fake.state.answer_gate.clear()  # the next answer is made (version 1) and then held
        calls = fake.state.generate_calls
        result: dict = {}
        generating = threading.Thread(
            target=lambda: result.setdefault("groups", engine.generate([[1, 2], [3]], SamplingParams(max_new_tokens=4)))
        )
        generating.start()
        while fake.state.generate_calls == calls:  # the request reached the server
            time.sleep(0.01)
        engine.load_weights(weights_stream(2), version=2)
        assert fake.state.weight_version == "2" and generating.is_alive()
        fake.state.answer_gate.set()
        generating.join(30)
        assert [[c.versions for c in group] for group in result["groups"]] == [[[1] * 4], [[1] * 4]]
        [[after]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))
        assert after.versions == [2, 2, 2]


def test_answers_during_a_sync_carry_its_version_before_the_engine_confirms_it(fake):
    """Between the servers taking a new version and the engine hearing of it (weights_synced), answers
    already carry it: accepted while a sync the engine planned is under way; a version nobody synced
    is stale, and the server is kept out."""
    cfg = attach_config(fake.url, placement="colocated", weight_sync="tensor", weight_bucket_bytes=BUCKET)
    with SGLangEngine(cfg, expected_weight_names=NAMES, tensor_serializer=serialize_tensors) as engine:
        engine.load_weights(weights_stream(1), version=1)
        engine.weight_sync_plan()  # a sync begins; its version is known to the engine when it completes
        fake.state.weight_version = "2"  # the server has it already
        [[during]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert during.versions == [2, 2]
        engine.weights_synced(2)
        [[after]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert after.versions == [2, 2]
        fake.state.weight_version = "5"  # no sync under way
        with pytest.raises(SGLangWeightSyncError):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert engine.server_status()[0]["stale"]


def test_seeded_sampling_sends_one_sampling_seed_per_sample(fake):
    fake.state.deterministic = True  # as launched with --enable-deterministic-inference: only then do seeds act
    prompts = [[1, 2, 3], [4, 5], [6]]
    params = SamplingParams(n=2, max_new_tokens=5, seed=42)
    with SGLangEngine(attach_config(fake.url, max_prompts_per_request=3)) as engine:
        whole = engine.generate(prompts, params)
    with SGLangEngine(attach_config(fake.url, max_prompts_per_request=1)) as engine:
        split = engine.generate(prompts, params)
    assert whole == split  # seeds depend on the prompt and sample, not on chunking
    call = next(r for r in fake.state.requests if r["path"] == "/generate")
    sps = call["body"]["sampling_params"]
    assert len(sps) == 6 and all(sp["n"] == 1 and "seed" not in sp for sp in sps)
    assert len({sp["sampling_seed"] for sp in sps}) == 6
    assert call["body"]["input_ids"] == [p for p in prompts for _ in range(2)]
    for (prompt, group), k in zip(zip(prompts, whole), range(3)):
        for s, completion in enumerate(group):
            tokens, _, _ = fake_sample(prompt, 0, 5, set(), sps[2 * k + s]["sampling_seed"])
            assert completion.token_ids == tokens
    assert whole[0][0].token_ids != whole[0][1].token_ids


def test_aborted_samples_are_retried(fake):
    fake.state.abort_next = 1
    with SGLangEngine(attach_config(fake.url)) as engine:
        out = engine.generate([[9, 9]], SamplingParams(n=2, max_new_tokens=4))
    assert [c.token_ids for c in out[0]] == [t for t, _, _ in expected([9, 9], 2, 4, ())]
    assert fake.state.generate_calls == 2


# ---------------------------------------------------------------------------- weight sync


def test_tensor_update_buckets_every_tensor_once_in_order(fake):
    other = FakeSGLangServer(api_key=KEY, admin_api_key=KEY, tp_size=2).start()
    sent = weights_stream(1)
    fake.state.flush_busy = 2  # the first flushes see requests still running
    try:
        cfg = attach_config(
            fake.url, other.url, placement="colocated", weight_sync="tensor", weight_bucket_bytes=BUCKET
        )
        with SGLangEngine(cfg, expected_weight_names=NAMES, tensor_serializer=serialize_tensors) as engine:
            engine.load_weights((pair for pair in sent), version=3)  # a one-pass generator
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        for server in (fake, other):
            updates = [u for u in server.state.updates if u["path"] == "/update_weights_from_tensor"]
            assert len(updates) == 3  # [embed..v_proj], [big alone], [the rest]
            check_buckets(updates, sent, BUCKET)
            assert all(u["session"] for u in updates)
            # The version is stamped once, after every server was checked complete, outside the session.
            assert server.state.updates[-1]["path"] == "/update_weight_version"
            assert server.state.weight_version == "3" and not server.state.updates[-1]["session"]
            assert_bit_equal(server.state.weights, sent)
            paths = control_paths(server)
            flushes = 4 if server is fake else 2
            assert paths == (
                ["/pause_generation"]
                + ["/flush_cache"] * (flushes - 1)
                + ["/begin_weight_update"]
                + ["/update_weights_from_tensor"] * len(updates)
                + ["/end_weight_update", "/update_weight_version", "/flush_cache", "/continue_generation"]
            )
            pause = next(r for r in server.state.requests if r["path"] == "/pause_generation")
            assert pause["body"] == {"mode": "abort"}
            assert not server.state.session_open and not server.state.paused
            assert all(r["auth"] == f"Bearer {KEY}" for r in server.state.requests)
    finally:
        other.stop()


@pytest.mark.parametrize("version,session", [("0.5.20", False), ("0.5.21", True), ("0.5.21.post1", True)])
def test_weight_update_session_only_from_0_5_21(version, session):
    server = FakeSGLangServer(version=version, api_key=KEY).start()
    try:
        cfg = attach_config(server.url, placement="colocated", weight_sync="tensor", weight_bucket_bytes=BUCKET)
        with SGLangEngine(cfg, expected_weight_names=NAMES, tensor_serializer=serialize_tensors) as engine:
            engine.load_weights(weights_stream(2))
        paths = control_paths(server)
        assert ("/begin_weight_update" in paths) is session and ("/end_weight_update" in paths) is session
        assert_bit_equal(server.state.weights, weights_stream(2))
    finally:
        server.stop()


def test_weight_names_are_checked_before_any_request(fake):
    cfg = attach_config(fake.url, placement="colocated", weight_sync="tensor", weight_bucket_bytes=BUCKET)
    good = weights_stream(3)
    with SGLangEngine(cfg, expected_weight_names=NAMES, tensor_serializer=serialize_tensors) as engine:
        before = len(fake.state.requests)
        typo = [("model.layers.0.self_attn.q_projj.weight" if n.endswith("q_proj.weight") else n, t) for n, t in good]
        with pytest.raises(
            SGLangWeightSyncError,
            match=r"^load_weights: the stream lacks 1 of 12 tensors: "
            r"model.layers.0.self_attn.q_proj.weight; got 1 unexpected tensors .*: .*q_projj.weight$",
        ):
            engine.load_weights(typo)
        with pytest.raises(SGLangWeightSyncError, match=r"lacks 1 of 12 tensors: lm_head.weight$"):
            engine.load_weights(good[:-1])
        with pytest.raises(SGLangWeightSyncError, match=r"got 1 tensors more than once: model.embed_tokens.weight$"):
            engine.load_weights(good + good[:1])
        assert len(fake.state.requests) == before  # nothing reached the server
        engine.generate([[1]], SamplingParams(max_new_tokens=1))  # still usable: weights untouched

        # A one-pass stream can only be found short at its end, after buckets went out: the version is
        # not stamped, generation stays paused on the server and is refused here until a complete update lands.
        with pytest.raises(
            SGLangWeightSyncError,
            match=rf"^weight sync to {fake.url} lacks 1 of 12 tensors: "
            r"lm_head.weight \(generation stays paused until a weight sync succeeds\)$",
        ):
            engine.load_weights(iter(good[:-1]))
        assert fake.state.updates and not fake.state.session_open and fake.state.paused
        assert fake.state.weight_version == "default"
        with pytest.raises(SGLangWeightSyncError, match=r"mix of old and new weights"):
            engine.generate([[1]], SamplingParams(max_new_tokens=1))
        engine.load_weights(iter(good))
        engine.generate([[1]], SamplingParams(max_new_tokens=1))

    with SGLangEngine(attach_config(fake.url)) as engine:
        with pytest.raises(SGLangWeightSyncError, match=r"expected_weight_names"):
            engine.load_weights(good)


def test_attached_servers_without_api_key_refuse_weight_updates(monkeypatch):
    monkeypatch.delenv("STAPO_SGLANG_API_KEY", raising=False)
    open_server = FakeSGLangServer().start()
    try:
        with SGLangEngine(attach_config(open_server.url, api_key=None), expected_weight_names=NAMES) as engine:
            engine.generate([[1]], SamplingParams(max_new_tokens=1))
            before = len(open_server.state.requests)
            with pytest.raises(SGLangWeightSyncError, match=r"no API key is configured"):
                engine.load_weights(weights_stream(0))
            assert len(open_server.state.requests) == before
    finally:
        open_server.stop()


def test_distributed_update_broadcasts_over_a_real_gloo_group(tmp_path):
    cfg = launch_config(
        tmp_path,
        num_servers=2,
        weight_sync="distributed",
        weight_sync_backend="gloo",
        weight_sync_master_address="127.0.0.1",
        weight_bucket_bytes=BUCKET,
        weight_sync_timeout_s=30,
    )
    with SGLangEngine(cfg, expected_weight_names=NAMES) as engine:
        first, second = weights_stream(4), weights_stream(5)
        engine.load_weights(first, version=1)
        engine.load_weights(iter(second), version=2)
        out = engine.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_new_tokens=3))
        assert [c.token_ids for g in out for c in g] == [
            fake_sample(p, 0, 3, set(), None)[0] for p in ([1, 2, 3], [4, 5, 6])
        ]
        for url in engine.urls:
            state = fake_state(url)
            assert_bit_equal(state["weights"], second)
            updates = [u for u in state["updates"] if u["path"] == "/update_weights_from_distributed"]
            n_first = len(updates) // 2
            check_buckets(updates[:n_first], first, BUCKET)
            check_buckets(updates[n_first:], second, BUCKET)
            assert state["weight_version"] == "2"
            calls = recorded(tmp_path, url)
            inits = [c["body"] for c in calls if c["path"] == "/init_weights_update_group"]
            assert len(inits) == 1  # the group is reused by the second update
            # One group per server (this process is rank 0 of each), so no sender waits on another.
            assert inits[0]["rank_offset"] == 1 and inits[0]["world_size"] == 2
            assert inits[0]["backend"] == "gloo" and inits[0]["master_address"] == "127.0.0.1"
            bucket_calls = [c["body"] for c in calls if c["path"] == "/update_weights_from_distributed"]
            assert bucket_calls[0]["dtypes"][0] == "bfloat16" and bucket_calls[0]["shapes"][0] == [50, 8]
            assert all(c["auth"] == f"Bearer {engine._api_key}" for c in calls)
            assert [c["path"] for c in calls].count("/begin_weight_update") == 2


def test_disk_update_writes_a_checkpoint_the_server_loads(fake, tmp_path):
    cfg = attach_config(fake.url, weight_sync="disk", disk_sync_dir=str(tmp_path / "sync"), weight_bucket_bytes=BUCKET)
    with SGLangEngine(cfg, expected_weight_names=NAMES) as engine:
        engine.load_weights(weights_stream(6), version=1)
        first_dir = fake.state.requests[-3]["body"]["model_path"]
        engine.load_weights(iter(weights_stream(7)), version=2)
    assert_bit_equal(fake.state.weights, weights_stream(7))
    disk_calls = [r["body"] for r in fake.state.requests if r["path"] == "/update_weights_from_disk"]
    assert [c["weight_version"] for c in disk_calls] == ["1", "2"] and disk_calls[0]["model_path"] == first_dir
    assert not Path(first_dir).exists()  # superseded checkpoints are removed
    assert [p.name for p in (tmp_path / "sync").iterdir()] == [Path(disk_calls[1]["model_path"]).name]
    assert "/begin_weight_update" not in control_paths(fake)
    assert expected_names_from_hf_checkpoint(disk_calls[1]["model_path"]) == set(NAMES)


# ---------------------------------------------------------------------------- failures


def test_server_death_restart_and_retry(tmp_path):
    die = tmp_path / "die"
    die.write_text("1")
    cfg = launch_config(
        tmp_path, env={"FAKE_SGLANG_DIE_FILE": str(die), "FAKE_SGLANG_SPAWN_CHILD": "1"}, max_prompts_per_request=1
    )
    engine = SGLangEngine(cfg)
    try:
        url = engine.urls[0]
        child_file = tmp_path / f"{url.rsplit(':', 1)[1]}.child"
        prompts = [[i, i + 1] for i in range(1, 7)]
        out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4))
        assert [[c.token_ids for c in g] for g in out] == [[t for t, _, _ in expected(p, 2, 4, ())] for p in prompts]
        [status] = engine.server_status()
        assert status["recoveries"] == 1 and status["restarts"] == 1 and not status["dead"] and die.read_text() == "0"
        log = Path(status["log_file"]).read_text()
        assert log.count("=== start") == 2 and "dying mid-request" in log
        assert engine._api_key not in log and "<redacted>" in log  # a per-run key, never written to the log
        first_child, second_child = map(int, child_file.read_text().split())
        assert not pid_alive(first_child)  # the restart reaped the dead server's process group
        assert all(r["auth"] == f"Bearer {engine._api_key}" for r in recorded(tmp_path, url))
    finally:
        engine.shutdown()
    assert not pid_alive(second_child) and not pid_alive(status["pid"])


def test_second_death_is_a_clear_error(tmp_path):
    die = tmp_path / "die"
    die.write_text("2")
    cfg = launch_config(tmp_path, env={"FAKE_SGLANG_DIE_FILE": str(die)})
    with SGLangEngine(cfg) as engine:
        log_file = str(engine.log_files[0])
        with pytest.raises(SGLangServerError) as info:
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        message = str(info.value)
        assert engine.urls[0] in message and log_file in message and "is dead: it failed again after" in message
        [status] = engine.server_status()
        assert status["dead"] and status["recoveries"] == 1 and status["restarts"] == 1
        with pytest.raises(SGLangServerError, match="is dead: it failed again after its restarts"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_restarted_server_is_kept_out_until_weights_are_resent(tmp_path):
    die = tmp_path / "die"
    die.write_text("0")
    cfg = launch_config(
        tmp_path,
        env={"FAKE_SGLANG_DIE_FILE": str(die)},
        placement="colocated",
        weight_sync="tensor",
        weight_bucket_bytes=BUCKET,
    )
    with SGLangEngine(cfg, expected_weight_names=NAMES, tensor_serializer=serialize_tensors) as engine:
        engine.load_weights(weights_stream(8), version=1)
        die.write_text("1")
        with pytest.raises(SGLangWeightSyncError, match=r"launch weights"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert engine.server_status()[0]["stale"]
        engine.load_weights(weights_stream(8), version=1)
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert_bit_equal(fake_state(engine.urls[0])["weights"], weights_stream(8))


def test_restarted_server_gets_a_new_weight_update_group(tmp_path):
    """A restarted server left its group: the next update (load_weights, and the trainer ranks' plan) builds new
    ones."""
    die = tmp_path / "die"
    die.write_text("0")
    cfg = launch_config(
        tmp_path,
        env={"FAKE_SGLANG_DIE_FILE": str(die)},
        weight_sync="distributed",
        weight_sync_backend="gloo",
        weight_sync_master_address="127.0.0.1",
        weight_bucket_bytes=BUCKET,
        weight_sync_timeout_s=30,
    )
    with SGLangEngine(cfg, expected_weight_names=NAMES) as engine:
        engine.load_weights(weights_stream(1), version=1)
        before = engine.weight_sync_plan()
        die.write_text("1")
        with pytest.raises(SGLangWeightSyncError, match=r"launch weights"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        after = engine.weight_sync_plan()
        assert (before.server_restarts, after.server_restarts) == (0, 1) and before != after
        engine.load_weights(iter(weights_stream(2)))  # no version: one more than the last
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        url = engine.urls[0]
        state = fake_state(url)
        assert_bit_equal(state["weights"], weights_stream(2))
        assert state["weight_version"] == "2"
        inits = [c["body"] for c in recorded(tmp_path, url) if c["path"] == "/init_weights_update_group"]
        assert len(inits) == 2 and inits[0]["group_name"] != inits[1]["group_name"]


def test_attached_server_is_awaited_after_it_goes_away():
    # The server comes and goes on one port: reserved (outside the ephemeral range, locked), so no
    # connection or bind(0) on the machine can take it while no server listens there.
    reservation = reserve_port()
    port = reservation.port
    replacement = []

    def bring_back():
        time.sleep(0.3)
        replacement.append(FakeSGLangServer(port=port, api_key=KEY).start())

    cfg = attach_config(f"http://127.0.0.1:{port}", failure_threshold=2, startup_timeout_s=10)
    second = FakeSGLangServer(port=port, api_key=KEY).start()  # up for the engine's startup check
    engine = SGLangEngine(cfg)
    second.stop()
    thread = threading.Thread(target=bring_back)
    thread.start()
    try:
        out = engine.generate([[7, 7]], SamplingParams(max_new_tokens=3))
        assert out[0][0].token_ids == fake_sample([7, 7], 0, 3, set(), None)[0]
        assert engine.server_status()[0]["recoveries"] == 1
    finally:
        thread.join()
        engine.shutdown()
        for server in replacement:
            server.stop()
        reservation.release()


# ---------------------------------------------------------------------------- memory


def test_release_and_resume_memory(fake):
    cfg = attach_config(fake.url, placement="colocated", weight_sync="tensor", weight_bucket_bytes=BUCKET)
    with SGLangEngine(cfg, expected_weight_names=NAMES, tensor_serializer=serialize_tensors) as engine:
        engine.release_memory()
        with pytest.raises(Exception, match=r"memory is released \(cuda_graph, kv_cache, weights\)"):
            engine.generate([[1]], SamplingParams(max_new_tokens=1))
        with pytest.raises(SGLangWeightSyncError, match=r"resume_memory\(\['weights'\]\)"):
            engine.load_weights(weights_stream(0))
        engine.resume_memory(["weights"])
        engine.load_weights(weights_stream(0))
        engine.resume_memory(["kv_cache", "cuda_graph"])
        engine.generate([[1]], SamplingParams(max_new_tokens=1))
        with pytest.raises(ValueError, match=r"memory tags"):
            engine.release_memory(["activations"])
        engine.release_memory(["kv_cache"])
        engine.resume_memory()
        engine.generate([[1]], SamplingParams(max_new_tokens=1))  # weights were kept
        engine.release_memory()
        engine.resume_memory()
        with pytest.raises(SGLangWeightSyncError, match=r"garbage after resume; call load_weights"):
            engine.generate([[1]], SamplingParams(max_new_tokens=1))
    memory = [(r["path"], r["body"]) for r in fake.state.requests if "memory" in r["path"]]
    assert memory[:3] == [
        ("/release_memory_occupation", {"tags": None}),
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
    ]
    paths = [r["path"] for r in fake.state.requests]
    assert paths[paths.index("/release_memory_occupation") - 1] == "/flush_cache"
