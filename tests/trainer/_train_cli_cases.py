"""``stapo train`` (the ``stapo`` command's own ``main``) once per case, all in this one process, so
that a test checks many refusals with one start-up.

Run as ``python -m tests.trainer._train_cli_cases CASES.json RESULTS.json``: each case is
``{"argv": [...], "env": {...}}`` (variables set for that case only); each result is
``{"code": exit status, "stderr": ...}``, ``"code": "raised"`` when ``main`` raised (a traceback,
which is in ``stderr``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def run_case(argv: list[str], env: dict[str, str]) -> dict:
    from stapo_megatron.cli import main

    saved = dict(os.environ)
    os.environ.update(env)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code: int | str = main(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = "raised"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"code": code, "stderr": err.getvalue()}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    results = [run_case(case["argv"], case["env"]) for case in cases]
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(results, f)
