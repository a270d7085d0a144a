"""Throughput of the math reward, and of the dapo reward beside it, on a realistic mix of responses.

    python benchmarks/rewards.py [--responses 10000] [--baseline-samples 1000] [--data-dir ../shared/data]
        [--dapo-answer strict_box]

Responses are chains of reasoning text ending in a box, built from the real ground truths of the
data files: correct (the ground truth, sometimes in another equivalent form), wrong, unparsable
or without a box, and hostile (code in the box, 1 MB outputs, 10,000 nested braces, unterminated
boxes, a power tower that only a time limit stops). It reports verified responses per second
and per-sample times for the reward pool with one and two workers, against a baseline measured
in the same process: math_verify's own parse + verify, sequential, on an evenly spaced subset.
The dapo reward (DAPO's string match, reward.dapo_answer as given) runs on the same mix with two
workers; its throughput over the math reward's and how often the two agree are printed last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stapo_megatron.data import load_benchmark, load_records  # noqa: E402
from stapo_megatron.rewards import RewardPool, summarize_reasons  # noqa: E402
from stapo_megatron.rewards.dapo_math import DAPO_ANSWERS  # noqa: E402

FILLER = [
    "First, we rewrite the condition as $x^2 - 5x + 6 = 0$, which factors as $(x-2)(x-3) = 0$.",
    "Let $S$ be the sum we want; pairing the first and last terms gives $S = \\frac{n(n+1)}{2}$.",
    "By the AM-GM inequality, $a + b \\geq 2\\sqrt{ab}$, with equality when $a = b$.",
    "Substituting back, the expression simplifies to $\\frac{3}{4} \\cdot 8 = 6$.",
    "We check the boundary case separately: when $k = 0$ nothing changes.",
    "Wait, that is not right. Let me recompute the second term more carefully.",
    "So the number of valid arrangements is $\\binom{6}{2} = 15$ in this case.",
    "Taking everything modulo $7$, we get $3^{k} \\equiv 5 \\pmod{7}$.",
    "The area of the triangle is $\\frac{1}{2} \\cdot 6 \\cdot 4 = 12$.",
    "Hence the remaining case contributes nothing new.",
]


def reasoning(rng: random.Random) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(rng.randint(4, 25)))


def equivalent_form(answer: str, rng: random.Random) -> str:
    """Another way to write the same answer (for integers and simple decimals), else the answer."""
    text = answer.strip().strip("$")
    if text.lstrip("-").isdigit():
        n = int(text)
        return rng.choice([f"\\frac{{{2 * n}}}{{2}}", f"{n}.0", f"{n}", f"x = {n}"])
    return answer


def perturbed(answer: str, rng: random.Random, other: str) -> str:
    digits = [i for i, c in enumerate(answer) if c.isdigit()]
    if digits and rng.random() < 0.7:
        i = rng.choice(digits)
        return answer[:i] + str((int(answer[i]) + rng.randint(1, 9)) % 10) + answer[i + 1 :]
    return other


def build_mix(golds: list[str], n: int, rng: random.Random, scratch: Path) -> tuple[list[str], list[str], list[str]]:
    """(responses, ground truths, kind of each response)."""
    hostile_makers = [
        lambda g: f"{reasoning(rng)} \\boxed{{__import__('os').system('touch {scratch}/pwned')}}",
        lambda g: f"{reasoning(rng)} \\boxed{{eval(\"open('{scratch}/pwned', 'w')\")}}",
        lambda g: "\\boxed{" + "{" * 10_000 + g + "}" * 10_000 + "}",
        lambda g: f"{reasoning(rng)} so the answer is \\boxed{{",
        lambda g: f"{reasoning(rng)} \\boxed{{{g}",
        lambda g: f"{reasoning(rng)} \\boxed{{import os; os.remove('/')}}",
    ]
    responses, answers, kinds = [], [], []
    big_left, tower_left = 5, 3  # each 1 MB output is 1 MB; each tower costs a full time limit
    for i in range(n):
        gold = golds[i % len(golds)]
        roll = rng.random()
        if roll < 0.40:
            kind, response = "correct", f"{reasoning(rng)}\nThe final answer is $\\boxed{{{gold}}}$."
        elif roll < 0.50:
            kind = "correct-other-form"
            response = f"{reasoning(rng)}\nTherefore $\\boxed{{{equivalent_form(gold, rng)}}}$."
        elif roll < 0.80:
            other = golds[rng.randrange(len(golds))]
            kind, response = "wrong", f"{reasoning(rng)}\nSo the answer is \\boxed{{{perturbed(gold, rng, other)}}}."
        elif roll < 0.90:
            kind = "unparsable"
            response = rng.choice(
                [
                    reasoning(rng),  # ran out of tokens before answering
                    f"{reasoning(rng)} \\boxed{{the answer is probably large}}",
                    f"{reasoning(rng)} \\boxed{{)(}}",
                    f"{reasoning(rng)} \\boxed{{}}",
                ]
            )
        else:
            kind = "hostile"
            if big_left and rng.random() < 0.01:
                big_left -= 1
                response = ("x" * 1_000_000) + (f" \\boxed{{{gold}}}" if big_left % 2 else "")
            elif tower_left and rng.random() < 0.01:
                tower_left -= 1
                response = f"{reasoning(rng)} \\boxed{{10^{{10^{{{8 + tower_left}}}}}}}"
            else:
                response = rng.choice(hostile_makers)(gold)
        responses.append(response)
        answers.append(gold)
        kinds.append(kind)
    return responses, answers, kinds


def ground_truths(data_dir: Path) -> list[str]:
    golds: list[str] = []
    for name in ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench", "gsm8k"):
        records, _ = load_benchmark(name, data_dir / "eval")
        golds += [r.answer for r in records]
    dapo = data_dir / "train" / "dapo_math_17k.parquet"
    if dapo.exists():
        records, _ = load_records(str(dapo))
        golds += [r.answer for r in records[:3000]]
    random.Random(0).shuffle(golds)
    return golds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_pool(workers: int, responses, answers, timeout_s: float, kind: str = "math", dapo_answer: str = "strict_box"):
    with RewardPool(num_workers=workers, timeout_s=timeout_s, kind=kind, dapo_answer=dapo_answer) as pool:
        pool.score(["\\boxed{1}"] * workers, ["1"] * workers)  # start-up is not part of the measurement
        started = time.perf_counter()
        results = pool.score(responses, answers)
        wall = time.perf_counter() - started
        replaced = pool.workers_replaced
    return results, wall, replaced


def run_baseline(responses, answers):
    from math_verify import parse, verify

    rewards, seconds = [], []
    for response, answer in zip(responses, answers):
        started = time.perf_counter()
        gold = parse(f"\\boxed{{{answer}}}")
        rewards.append(1.0 if verify(gold, parse(response)) else 0.0)
        seconds.append(time.perf_counter() - started)
    return rewards, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=10_000)
    parser.add_argument("--baseline-samples", type=int, default=1_000)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dapo-answer", default="strict_box", choices=DAPO_ANSWERS)
    args = parser.parse_args()
    if not (args.data_dir / "eval").is_dir():
        sys.exit(f"no evaluation files under {args.data_dir / 'eval'}: pass --data-dir")

    scratch = Path(tempfile.mkdtemp(prefix="reward-bench-"))
    rng = random.Random(args.seed)
    responses, answers, kinds = build_mix(ground_truths(args.data_dir), args.responses, rng, scratch)
    mix = {k: kinds.count(k) for k in sorted(set(kinds))}
    megabytes = sum(len(r) for r in responses) / 1e6
    print(f"{len(responses)} responses ({megabytes:.1f} MB of text) on {os.cpu_count()} CPUs: {json.dumps(mix)}")
    # Other work on the machine shows in every figure below.
    print("load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))

    benign = [i for i, kind in enumerate(kinds) if kind != "hostile"]
    step = max(1, len(responses) // args.baseline_samples)
    subset = list(range(0, len(responses), step))[: args.baseline_samples]

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # one warning per timeout otherwise
    started = time.perf_counter()
    base_rewards, base_seconds = run_baseline([responses[i] for i in subset], [answers[i] for i in subset])
    base_wall = time.perf_counter() - started
    base_benign = [sec for i, sec in zip(subset, base_seconds) if kinds[i] != "hostile"]
    # Sequential: the benign part's wall time is the sum of its samples' times.
    rows = [
        ("math_verify parse+verify, sequential", "all", len(subset), base_wall, base_seconds, 0),
        ("math_verify parse+verify, sequential", "benign", len(base_benign), sum(base_benign), base_benign, 0),
    ]
    pool_results = {}
    for workers in (1, 2):
        results, wall, replaced = run_pool(workers, responses, answers, args.timeout_s)
        pool_results[workers] = results
        name = f"RewardPool, {workers} worker{'s' if workers > 1 else ''}"
        rows.append((name, "all", len(results), wall, [r.seconds for r in results], replaced))
        results, wall, replaced = run_pool(
            workers, [responses[i] for i in benign], [answers[i] for i in benign], args.timeout_s
        )
        rows.append((name, "benign", len(results), wall, [r.seconds for r in results], replaced))

    dapo_name = f"RewardPool dapo ({args.dapo_answer}), 2 workers"
    dapo_results, wall, replaced = run_pool(2, responses, answers, args.timeout_s, "dapo", args.dapo_answer)
    rows.append((dapo_name, "all", len(dapo_results), wall, [r.seconds for r in dapo_results], replaced))
    results, wall, replaced = run_pool(
        2, [responses[i] for i in benign], [answers[i] for i in benign], args.timeout_s, "dapo", args.dapo_answer
    )
    rows.append((dapo_name, "benign", len(results), wall, [r.seconds for r in results], replaced))

    base_rate = {kind: count / wall for _, kind, count, wall, _, _ in rows[:2]}
    print()
    print(
        f"{'method':38} {'mix':>6} {'responses':>9} {'wall s':>8} {'resp/s':>8} {'x base':>7} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'killed':>6}"
    )
    for name, kind, count, wall, seconds, replaced in rows:
        rate = count / wall
        print(
            f"{name:38} {kind:>6} {count:9d} {wall:8.2f} {rate:8.1f} {rate / base_rate[kind]:7.2f} "
            f"{statistics.median(seconds) * 1e3:8.2f} {percentile(seconds, 0.99) * 1e3:8.1f} {replaced:6d}"
        )

    results = pool_results[2]
    agree = sum(1 for i, r in zip(subset, base_rewards) if results[i].reward == r) / len(subset)
    print(f"\nreasons (2 workers, all): {json.dumps({k: v for k, v in summarize_reasons(results).items() if v})}")
    by_kind: dict[str, list[float]] = {}
    for kind, result in zip(kinds, results):
        by_kind.setdefault(kind, []).append(result.reward)
    print("mean reward by kind:", json.dumps({k: round(sum(v) / len(v), 3) for k, v in sorted(by_kind.items())}))
    print(f"same reward as the baseline on its {len(subset)} responses: {agree:.1%}")
    rate = {(name, kind): count / wall for name, kind, count, wall, _, _ in rows}
    math_name = "RewardPool, 2 workers"
    print(
        f"dapo ({args.dapo_answer}) / math verdicts per second, 2 workers: "
        + ", ".join(f"{kind} {rate[(dapo_name, kind)] / rate[(math_name, kind)]:.2f}x" for kind in ("all", "benign"))
    )
    same = sum(d.reward == m.reward for d, m in zip(dapo_results, results)) / len(results)
    dapo_by_kind: dict[str, list[float]] = {}
    for kind, result in zip(kinds, dapo_results):
        dapo_by_kind.setdefault(kind, []).append(result.reward)
    print(f"dapo ({args.dapo_answer}) gives the math reward's verdict on {same:.1%} of the mix; mean reward by kind:")
    print("  " + json.dumps({k: round(sum(v) / len(v), 3) for k, v in sorted(dapo_by_kind.items())}))
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"hostile side effects: {'NONE' if not (scratch / 'pwned').exists() else 'FILE CREATED'}")
    print(
        "mix: all = the whole mix, benign = without the hostile responses (a separate run); x base: "
        "throughput over the baseline's on the same mix; p50/p99: per-sample time (pool: verification inside "
        "the worker, or extraction for samples rejected before it); killed: workers killed at the time limit"
    )


if __name__ == "__main__":
    main()
