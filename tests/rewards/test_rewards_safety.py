"""Untrusted responses: no code evaluation on the way to a reward, hostile outputs, the guard."""

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from answer_pairs import ANSWER_PAIRS, boxed_response
from code_eval_trap import read_log

from stapo_megatron.rewards import RewardPool

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def hostile_cases(tmp_path: Path) -> list[tuple[str, str, set[str]]]:
    """(response, ground truth, acceptable reasons): every one must get reward 0."""
    touched = tmp_path / "pwned"
    return [
        (f"\\boxed{{__import__('os').system('touch {touched}')}}", "0", {"parse_error", "wrong"}),
        (f"\\boxed{{eval(\"open('{touched}', 'w')\")}}", "0", {"parse_error", "wrong"}),
        ("\\boxed{exec(compile('import os', 'x', 'exec'))}", "0", {"parse_error", "wrong"}),
        (
            f"\\boxed{{Symbol('x').__class__.__init__.__globals__['os'].system('touch {touched}')}}",
            "0",
            {"parse_error", "wrong"},
        ),
        ("\\boxed{lambda: 1}", "1", {"parse_error", "wrong"}),
        ("\\boxed{\\input{/etc/passwd}}", "1", {"parse_error", "wrong"}),
        ("\\boxed{\x00\x01\u202e💥}", "1", {"parse_error", "wrong"}),
        ("x" * 1_000_000, "1", {"no_box"}),
        ("\\boxed{" + "1" * 1_000_000 + "}", "1", {"too_long"}),
        ("y" * 1_000_000 + "\\boxed{2}", "1", {"wrong"}),
        ("\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}", "1", {"too_long"}),
        ("\\boxed{" + "{" * 450 + "2" + "}" * 450 + "}", "1", {"parse_error", "wrong", "error", "timeout"}),
        ("\\boxed{" + "(" * 900 + "2" + ")" * 90 + "}", "1", {"parse_error", "wrong", "error", "timeout"}),
        ("\\boxed{" * 5000, "1", {"unterminated_box"}),
        ("the answer is \\boxed{", "1", {"unterminated_box"}),
        ("the answer is \\boxed{1", "1", {"unterminated_box"}),
        ("\\boxed{" + "9" * 999 + "}", "1", {"wrong"}),
        ("\\boxed{1e99999999}", "1", {"timeout", "wrong"}),
        ("\\boxed{10^{10^{8}}}", "1", {"timeout", "wrong"}),
        ("\\boxed{(10^{6})!}", "1", {"timeout", "wrong"}),
    ]


def test_hostile_outputs_get_zero_within_the_time_limit(tmp_path):
    cases = hostile_cases(tmp_path)
    with RewardPool(num_workers=2, timeout_s=1.0, kill_grace_s=1.0) as pool:
        started = time.perf_counter()
        results = pool.score([c[0] for c in cases], [c[1] for c in cases])
        elapsed = time.perf_counter() - started
        for (response, _, reasons), result in zip(cases, results):
            assert result.reward == 0.0 and result.reason in reasons, (response[:60], result.reason)
            # Each sample ends by the per-sample limit plus the kill grace.
            assert result.seconds < 2.5, (response[:60], result.seconds)
        assert not (tmp_path / "pwned").exists()
        # Two workers; the five slow cases cost a time limit each (generous for a loaded machine).
        assert elapsed < 20
        # The pool is still healthy afterwards.
        assert [r.reward for r in pool.score(["\\boxed{3}"], ["3"])] == [1.0]


def test_no_eval_exec_sympify_or_parse_expr_while_verifying(tmp_path):
    """Workers with eval/exec/parse_expr/sympify(str) trapped (the production guard off) still score right."""
    from code_eval_trap import install_trap

    log = str(tmp_path / "trap.log")
    golds = []
    for name in ("math500", "olympiadbench", "minerva"):
        path = DATA / "eval" / f"{name}.jsonl"
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines()[:60]]
            if name == "olympiadbench":
                golds += [", ".join(r["final_answer"]) for r in rows]
            elif name == "minerva":
                from stapo_megatron.rewards import extract_boxed

                golds += [extract_boxed(r["solution"]) for r in rows]
            else:
                golds += [r["answer"] for r in rows]
    # Without the cases that only end by the time limit: they never finish a path.
    hostile = [case for case in hostile_cases(tmp_path) if "timeout" not in case[2]]
    # Every ground truth parsed on both sides, against an answer that compares cheaply.
    responses = (
        [boxed_response(a) for a, _, _ in ANSWER_PAIRS]
        + [boxed_response("\\text{none}")] * len(golds)
        + [boxed_response(g) for g in golds]
        + [h[0] for h in hostile]
    )
    answers = [g for _, g, _ in ANSWER_PAIRS] + golds + ["\\text{none}"] * len(golds) + [h[1] for h in hostile]
    with RewardPool(
        num_workers=2, timeout_s=5.0, forbid_code_eval=False, worker_init=functools.partial(install_trap, log)
    ) as pool:
        results = pool.score(responses, answers)
    assert len(Path(log + ".installed").read_text().split()) == 2  # the trap is in both workers
    entries = read_log(log)
    refused = [e for e in entries if e.startswith("refused")]
    assert refused == []
    # What exec did run: module code (imports) and sympy's monomial helpers, never answer text.
    allowed_sources = [e.split(" ", 3)[3] for e in entries if e.startswith("allowed exec")]
    for source in allowed_sources:
        assert source == "<code object>" or source.lstrip().startswith("def monomial_"), source[:200]
    n = len(ANSWER_PAIRS)
    assert [r.reward for r in results[:n]] == [expected for *_, expected in ANSWER_PAIRS]
    assert all(r.reward == 0.0 for r in results[n:])
    parsed = [r.reason for r in results[n : n + 2 * len(golds)]]
    assert parsed.count("wrong") >= 0.95 * len(parsed)  # (not "error": nothing was refused)
    assert not (tmp_path / "pwned").exists()


def test_the_trap_does_catch_math_verifys_default_parser(tmp_path):
    """Control: the plain-expression path of math_verify.parse goes through parse_expr, and the trap sees it."""
    log = str(tmp_path / "trap.log")
    script = (
        f"import sys; sys.path.insert(0, {HERE!r})\n"
        "from math_verify import parse\n"
        "from code_eval_trap import install_trap\n"
        "from stapo_megatron.rewards.math_equiv import MathVerifier\n"
        "verifier = MathVerifier()\n"
        "assert verifier.check('5', '5') == 'correct'\n"
        f"install_trap({log!r})\n"
        "print(verifier.check('\\\\frac{1}{2}', '0.5'), flush=True)\n"
        "parse('The answer is 3/4 + 1', parsing_timeout=None)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["correct"]
    refused = [e for e in read_log(log) if e.startswith("refused")]
    assert refused and any(e.startswith("refused parse_expr") for e in refused)


def test_the_guard_blocks_code_evaluation_in_a_worker_process():
    # No warm-up here: simplify's lazy import of sympy.physics.units (whose module body sympifies
    # constant strings) happens under the guard and must go through.
    script = (
        "from stapo_megatron.rewards.guard import CodeEvaluationBlocked, install_code_eval_guard\n"
        "from stapo_megatron.rewards.math_equiv import MathVerifier\n"
        "import sympy, collections\n"
        "install_code_eval_guard()\n"
        "blocked = []\n"
        "for attempt in (lambda: eval('1+1'), lambda: exec('x = 1'), lambda: sympy.sympify('1+1'),\n"
        "                lambda: sympy.parsing.sympy_parser.parse_expr('1'), lambda: sympy.Number('3')):\n"
        "    try:\n"
        "        attempt()\n"
        "    except CodeEvaluationBlocked:\n"
        "        blocked.append(True)\n"
        "print(len(blocked), sympy.sympify(sympy.Integer(2)) + 1)\n"
        "print(MathVerifier().check('x^2+2x+1', '(x+1)^2'), MathVerifier().check('\\\\frac{3}{6}', '0.5'))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5", "3", "correct", "correct"]


@pytest.mark.parametrize(
    "text",
    [
        "42",
        "-7",
        "007",
        "3.5",
        ".5",
        "3.",
        "1.5E3",
        "0.333333333333333333333",
        "1,234",
        "-1,234",
        "0,111",
        "1,234.56",
        "12,345,678",
        "5\\%",
        "12.5\\%",
        "2.5 + 1,5",
        "\\frac{3}{4}",
        "x^{2.5}",
        "\\sqrt{2.25}",
        "(1.5, 2]",
        "\\{0.5, 1\\}",
        "\\begin{pmatrix} 1.5 \\\\ 2 \\end{pmatrix}",
        "3\\times10^{5}",
        "x = 0.25",
    ],
)
def test_the_safe_converter_agrees_with_the_upstream_one(text):
    """Same sympy objects as latex2sympy2_extended's own converter (whose numbers go through eval)."""
    from latex2sympy2_extended.latex2sympy2 import latex2sympy
    from math_verify.grader import should_treat_as_complex

    from stapo_megatron.rewards.math_equiv import _SafeConverter

    def outcome(parse):
        try:
            value = parse(text)
        except Exception as err:  # the grammar rejects some of these: then both must
            return "rejected", type(err).__name__
        return type(value), str(value), value

    is_real = not should_treat_as_complex(text)
    ours = outcome(_SafeConverter(is_real=is_real, convert_degrees=False).parse)
    upstream = outcome(lambda t: latex2sympy(t, is_real=is_real, convert_degrees=False, normalization_config=None))
    assert ours == upstream
    if text in ("3.5", "1,234", "0,111", "5\\%"):
        assert ours[0] != "rejected"
