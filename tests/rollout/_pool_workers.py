"""Rank function of the two-node rollout-server contract test (tests/rollout/test_server_pool.py).

Four gloo ranks with LOCAL_WORLD_SIZE=2 are two "nodes"; each node leader launches two contract-test
SGLang servers (tests/rollout/fake_sglang.py) through the real launch path.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import torch
import torch.distributed as dist

FAKE_SCRIPT = str(Path(__file__).with_name("fake_sglang.py").resolve())
FAKE_COMMAND = [sys.executable, "-m", "stapo_megatron.rollout.sglang_launch", FAKE_SCRIPT]
BUCKET = 4096


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    specs = [
        ("model.embed_tokens.weight", (50, 8)),
        ("model.layers.0.mlp.up_proj.weight", (24, 8)),
        ("model.norm.weight", (8,)),
        ("lm_head.weight", (50, 8)),
    ]
    return [(name, torch.randn(shape, generator=gen)) for name, shape in specs]


def records(tmp: Path, url: str) -> list[dict]:
    path = tmp / f"{url.rsplit(':', 1)[1]}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def generate_bodies(tmp: Path, url: str) -> list[dict]:
    return [r["body"] for r in records(tmp, url) if r["path"] == "/generate"]


def completed_prompts(tmp: Path, urls: list[str]) -> list[tuple[int, ...]]:
    """Every prompt a fake answered (once per answer), over all servers."""
    return [
        tuple(p) for url in urls for r in records(tmp, url) if r["path"] == "/fake/completed" for p in r["input_ids"]
    ]


def tokens_sent(bodies: list[dict]) -> int:
    """prompt + n x max_new_tokens of the requests, as the balancer counts them."""
    total = 0
    for body in bodies:
        sampling = body["sampling_params"]
        sampling = sampling[0] if isinstance(sampling, list) else sampling
        total += sum(len(p) + sampling["n"] * sampling["max_new_tokens"] for p in body["input_ids"])
    return total


def check_servers_on_every_node(tmp_dir: str) -> None:
    from stapo_megatron.rollout.config import SGLangConfig
    from stapo_megatron.rollout.engine import SamplingParams
    from stapo_megatron.rollout.node_servers import start_job_servers
    from stapo_megatron.rollout.sglang_client import request
    from stapo_megatron.rollout.sglang_engine import SGLangEngine
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    sys.path.insert(0, str(Path(__file__).parent))
    import fake_sglang

    tmp = Path(tmp_dir)
    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))  # two nodes of two ranks
    ctx = init_distributed(ParallelConfig(data_parallel=4))
    die_file = tmp / "die"
    cfg = SGLangConfig(
        model_path="fake/qwen3-0.6b",
        placement="colocated",
        host="0.0.0.0",
        server_command=FAKE_COMMAND,
        startup_timeout_s=60,
        retry_backoff_s=0.01,
        control_timeout_s=30,
        shutdown_grace_s=3,
        supervise_interval_s=0.2,
        max_prompts_per_request=1,
        weight_bucket_bytes=BUCKET,
        env={
            "FAKE_SGLANG_RECORD_DIR": str(tmp),
            "FAKE_SGLANG_DIE_FILE": str(die_file),
            "FAKE_SGLANG_TOKEN_S": "0.1",
        },  # 1.2 s per request: all of a step in flight at once, as on GPUs
    )
    job = start_job_servers(ctx, cfg, tmp / "run")

    # ---- discovery: every rank holds the same list; each leader owns its node's two servers
    seen: list = [None] * 4
    dist.all_gather_object(seen, (job.endpoints, job.api_key), group=ctx.cpu_group)
    assert all(entry == seen[0] for entry in seen), seen
    endpoints = job.endpoints
    assert [e.index for e in endpoints] == [0, 1, 2, 3]
    assert [e.node for e in endpoints] == [0, 0, 1, 1] and [e.gpu_ids for e in endpoints] == [(0,), (1,), (0,), (1,)]
    assert len({e.url for e in endpoints}) == 4 and all(e.colocated for e in endpoints)
    node = rank // 2
    on_node = [e for e in endpoints if e.node == node]
    assert [e.index for e in on_node] == [2 * node, 2 * node + 1]
    assert (job.owned is not None) == (rank % 2 == 0)
    if job.owned is not None:
        for i, (endpoint, row) in enumerate(zip(on_node, job.owned.status())):
            log = Path(endpoint.log_path)
            assert log == tmp / "run" / "sglang" / f"node{node}" / f"server-{i}.log" and row["url"] == endpoint.url
            assert stat.S_IMODE(log.stat().st_mode) == 0o600
            assert job.api_key.encode() not in Path(f"/proc/{row['pid']}/cmdline").read_bytes()
            # --random-seed differs across the run: node 1's servers continue node 0's numbering
            assert f"--random-seed {cfg.random_seed + endpoint.index}" in log.read_text()
    for endpoint in endpoints:  # the per-run key guards every server
        assert request(endpoint.url, "POST", "/flush_cache", {}, api_key=None, timeout=10).status == 401
    dist.barrier(group=ctx.cpu_group)

    report = None
    if rank == 0:
        urls = [e.url for e in endpoints]
        engine = SGLangEngine(
            cfg,
            expected_weight_names=[n for n, _ in weights(0)],
            tensor_serializer=fake_sglang.serialize_tensors,
            endpoints=endpoints,
            api_key=job.api_key,
        )
        engine.load_weights(weights(1), version=1)

        # ---- step 1: requests spread over all four servers within 10% of even by tokens. Every fourth
        # prompt is long, so sending request i to server i % 4 would give server 0 three times the others.
        lengths = [40 if i % 4 == 0 else 4 + i % 3 for i in range(96)]  # 96 requests: all in flight at once
        prompts = [[1 + i] + [(i * 31 + j) % 97 + 2 for j in range(n - 1)] for i, n in enumerate(lengths)]
        params = SamplingParams(n=2, max_new_tokens=6)
        out = engine.generate(prompts, params)
        for prompt, group in zip(prompts, out):
            assert [c.token_ids for c in group] == [
                fake_sglang.fake_sample(prompt, s, 6, set(), None)[0] for s in range(2)
            ]
        sent = [tokens_sent(generate_bodies(tmp, url)) for url in urls]  # what each fake received
        assert sent == engine.routed_tokens
        mean = sum(sent) / 4
        print(
            f"[pool test] tokens per server {sent}, max deviation from even "
            f"{max(abs(t - mean) for t in sent) / mean:.1%}"
        )
        assert all(abs(t - mean) <= 0.1 * mean for t in sent), sent

        # ---- step 2: one server dies mid-step; the step completes on the others, nothing lost or doubled
        before = {url: len(records(tmp, url)) for url in urls}
        die_file.write_text("1")
        prompts2 = [[1000 + i, 5, 6] for i in range(40)]
        out2 = engine.generate(prompts2, params)
        for prompt, group in zip(prompts2, out2):
            assert [c.token_ids for c in group] == [
                fake_sglang.fake_sample(prompt, s, 6, set(), None)[0] for s in range(2)
            ]
        assert die_file.read_text() == "0"
        answered = [p for p in completed_prompts(tmp, urls) if p[0] >= 1000]
        assert sorted(answered) == sorted(tuple(p) for p in prompts2)  # each prompt answered exactly once
        arrived = {url: [r for r in records(tmp, url)[before[url] :] if r["path"] == "/generate"] for url in urls}
        killed = [
            url
            for url in urls
            if any(
                "dying mid-request" in line
                for line in Path(endpoints[urls.index(url)].log_path).read_text().splitlines()
            )
        ]
        assert len(killed) == 1, killed
        assert all(len(arrived[url]) > 0 for url in urls)

        # ---- the restarted server comes back with launch weights: the next sync reaches it, then it serves
        engine.load_weights(weights(2), version=2)
        assert not any(row["down"] or row["stale"] or row["dead"] for row in engine.server_status())
        for url in urls:
            state = request(url, "GET", "/fake/state", api_key=None, timeout=10).json()
            assert state["weight_version"] == "2"
        engine.generate([[2000 + i, 1] for i in range(8)], params)
        late = [r for r in records(tmp, killed[0]) if r["path"] == "/fake/completed"]
        assert late and late[-1]["weight_version"] == "2"
        engine.shutdown()
        report = killed[0]
    killed_url = ctx.broadcast_object(report, src=0)

    # ---- the owner of the killed server restarted it; nobody else restarted anything
    restarts = {row["url"]: row["restarts"] for row in job.owned.status()} if job.owned else {}
    everyone: list = [None] * 4
    dist.all_gather_object(everyone, restarts, group=ctx.cpu_group)
    merged = {url: count for entry in everyone for url, count in entry.items()}
    assert merged == {e.url: int(e.url == killed_url) for e in endpoints}, merged
    if job.owned is not None and killed_url in restarts:
        log = Path(next(e.log_path for e in endpoints if e.url == killed_url))
        assert log.read_text().count("=== start") == 2
    pids = [row["pid"] for row in job.owned.status()] if job.owned else []
    job.shutdown()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    dist.barrier(group=ctx.cpu_group)
