"""Where the suite's time goes: ``python -m tests.durations JUNIT.xml`` reads the JUnit report of a run
(``python -m pytest --junitxml=JUNIT.xml``; each test's time is its setup, call and teardown) and
prints a Markdown table of the README's test groups: tests, seconds, share, slowest test. A group is
the first of :data:`GROUPS` whose prefix names the test's file.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

# (group, prefixes of the test's path): the first match wins, so the narrow ones come first.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("real SGLang servers (venv build included)", ("tests/sglang_real/",)),
    ("real Slurm cluster (its start included)", ("tests/launch/test_slurm_",)),
    (
        "trainer end-to-end runs (stapo train)",
        (
            "tests/trainer/test_train_runs",
            "tests/trainer/test_resume",
            "tests/trainer/test_faults",
            "tests/trainer/test_async_runs",
            "tests/trainer/test_offload",
            "tests/trainer/test_objectives_e2e",
            "tests/trainer/test_related_rules_e2e",
            "tests/trainer/test_reference_kl",
            "tests/trainer/test_heartbeat",
            "tests/trainer/test_run_directory",
            "tests/trainer/test_minibatch_scope",
            "tests/trainer/test_rewards_and_schedule",
            "tests/trainer/test_packing",
            "tests/trainer/test_metrics_readers",
            "tests/trainer/test_rank0_alone",
            "tests/trainer/test_zero_advantage_skip",
            "tests/trainer/test_step_timing",
            "tests/trainer/test_diagnostics_report",
            "tests/trainer/test_inspect",
            "tests/trainer/test_run_summary",
        ),
    ),
    ("trainer units (batches, pools, controller)", ("tests/trainer/",)),
    ("checkpoint and conversion", ("tests/checkpoint/", "tests/models/test_convert", "tests/models/test_per_rank")),
    ("model (Qwen3 on Megatron, TP/PP/SP)", ("tests/models/",)),
    ("loss", ("tests/loss/",)),
    ("rollout engines and weight sync", ("tests/rollout/",)),
    ("rewards", ("tests/rewards/",)),
    ("eval", ("tests/eval/",)),
    ("launch, plan, layout, submit", ("tests/launch/",)),
    ("runtime (CPU layer, ranks, ports, console)", ("tests/runtime/",)),
    ("config", ("tests/config/",)),
    ("data", ("tests/data/",)),
    ("experiment (study, report)", ("tests/experiment/",)),
    ("command line, README, imports", ("tests/test_",)),
)


def group_of(path: str) -> str:
    for name, prefixes in GROUPS:
        if path.startswith(prefixes):
            return name
    return "other"


def read_junit(report: str) -> list[tuple[str, str, float]]:
    """(file, test id, seconds) of every test case in the report."""
    cases = []
    for case in ET.parse(report).iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.trainer.test_x, or .TestClass after it
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        path = "/".join(parts[: module + 1]) + ".py"
        cases.append((path, f"{path}::{case.get('name')}", float(case.get("time", 0.0))))
    return cases


def table(cases: list[tuple[str, str, float]]) -> str:
    groups: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for path, test, seconds in cases:
        groups[group_of(path)].append((test, seconds))
    total = sum(seconds for _, _, seconds in cases) or 1.0
    lines = ["| group | tests | seconds | share | slowest test (s) |", "|---|---:|---:|---:|---|"]
    for name, tests in sorted(groups.items(), key=lambda item: -sum(s for _, s in item[1])):
        seconds = sum(s for _, s in tests)
        slowest, slowest_s = max(tests, key=lambda t: t[1])
        lines.append(
            f"| {name} | {len(tests)} | {seconds:.0f} | {100 * seconds / total:.1f}% | "
            f"`{slowest.split('/')[-1]}` ({slowest_s:.0f}) |"
        )
    lines.append(f"| all | {len(cases)} | {total:.0f} | 100% | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a pytest --junitxml report")
    parser.add_argument("--slowest", type=int, default=0, help="also list the N slowest tests")
    args = parser.parse_args(argv)
    cases = read_junit(args.report)
    print(table(cases))
    if args.slowest:
        print()
        for _, test, seconds in sorted(cases, key=lambda c: -c[2])[: args.slowest]:
            print(f"{seconds:7.1f}  {test}")


if __name__ == "__main__":
    sys.exit(main())
