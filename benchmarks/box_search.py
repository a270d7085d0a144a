"""Time of finding the last box in adversarial responses: the former quadratic search against the current one.

    python benchmarks/box_search.py [--size 800000] [--repeats 3]

Each input is ``--size`` characters built to make a box search work hard: thousands of commands
that only look like boxes (``\\boxedfoo``, ``\\fboxsep``), of both kinds interleaved, unmatched
braces after a box, nested boxes. The baseline is the search this project used before, kept here
(and only here) as a reference: it rescanned the text for every command that turned out not to
be a box, so a response made of them took time quadratic in its length, in the trainer's process.
Both run in this process on the same inputs; the answers must agree, and the report gives each
time and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stapo_megatron.rewards import extract  # noqa: E402


def quadratic_last_command(text: str, end: int) -> tuple[int, int]:
    """The former search: after each rejected command, both commands are searched again from ``end``."""
    while end > 0:
        best, length = -1, 0
        for command in extract._COMMANDS:
            at = text.rfind(command, 0, end)
            if at > best:
                best, length = at, len(command)
        if best < 0:
            return -1, 0
        after = best + length
        if after < len(text) and text[after].isalpha():
            end = best
            continue
        return best, length
    return -1, 0


def adversarial_inputs(size: int) -> dict[str, str]:
    def fill(unit: str, tail: str = "") -> str:
        return unit * ((size - len(tail)) // len(unit)) + tail

    return {
        "\\boxedfoo x N": fill("\\boxeda"),
        "\\fboxsep x N": fill("\\fboxa"),
        "\\boxedfoo and \\fboxsep interleaved": fill("\\boxedq \\fboxq "),
        "a box, then N \\boxedfoo": "\\boxed{42} " + fill("\\boxedz"),
        "\\boxed{ then N unmatched {": "\\boxed{" + "{" * (size - 7),
        "N nested boxes": "\\boxed{" * (size // 8) + "1" + "}" * (size // 8),
        "N \\boxed without braces": fill("\\boxed 5 "),
    }


def best_time(function, *args, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function(*args)
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=800_000, help="characters of each adversarial response")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the current search (best time kept)")
    args = parser.parse_args()

    print(f"{'input':40s} {'former s':>10s} {'current s':>10s} {'ratio':>9s}  result")
    for name, text in adversarial_inputs(args.size).items():
        # The former search once (it is the slow one), the current one best of --repeats.
        former, former_span = best_time(quadratic_last_command, text, len(text), repeats=1)
        current, current_span = best_time(extract._last_command, text, len(text), repeats=args.repeats)
        if former_span != current_span:
            raise SystemExit(f"{name}: the searches disagree: former {former_span}, current {current_span}")
        whole, span = best_time(extract.find_last_box, text, repeats=args.repeats)
        ratio = former / max(current, 1e-9)
        print(
            f"{name:40s} {former:10.4f} {current:10.4f} {ratio:8.0f}x  {span.reason or 'answer'} "
            f"(whole find_last_box: {whole:.4f} s)"
        )


if __name__ == "__main__":
    main()
