"""Start an SGLang server whose API key comes from the environment, never from a command line.

``sglang.launch_server`` takes its key only from ``--api-key`` / ``--admin-api-key`` (``ServerArgs``
has no environment fallback), and a command line is readable by every local user (``ps``,
``/proc/<pid>/cmdline``). The engine therefore starts::

    python -m stapo_megatron.rollout.sglang_launch sglang.launch_server --model-path ... (no key)

with the key in ``STAPO_SGLANG_SERVER_API_KEY``. This module removes it from the environment (the
server's own child processes do not need it), appends the key flags to the in-process ``sys.argv``
only (the kernel's copy, which ``ps`` shows, is the one above) and runs the target as ``python -m``
(or ``python script.py``) would. SGLang logs its ``ServerArgs``, key included, when it starts: log
records of this process have the key replaced by ``<redacted>``.

Only the standard library is imported, so the file can also be run by path where stapo_megatron
is not installed (e.g. inside a server container).
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

KEY_ENV = "STAPO_SGLANG_SERVER_API_KEY"
# SGLang's flags that carry a secret; one key serves both, so every route sits behind the same secret.
KEY_FLAGS = ("--api-key", "--admin-api-key")
REDACTED = "<redacted>"
PROG = "stapo_megatron.rollout.sglang_launch"


def key_flag_in(args) -> str | None:
    """The first of ``args`` that passes a key on the command line: ``--api-key KEY``, ``--api-key=KEY``
    or an abbreviation argparse would expand to a key flag (``--api-k``)."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and any(flag.startswith(name) for flag in KEY_FLAGS):
            return name
    return None


def redact_key_in_log_records(key: str) -> None:
    """Every log record made in this process afterwards shows ``<redacted>`` in place of ``key``."""
    make_record = logging.getLogRecordFactory()

    def make_redacted_record(*args, **kwargs):
        record = make_record(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: logging reports it when the record is emitted
            return record
        if key in message:
            record.msg, record.args = message.replace(key, REDACTED), None
        return record

    logging.setLogRecordFactory(make_redacted_record)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0].startswith("-"):
        sys.exit(f"usage: python -m {PROG} <server module | script.py> [server flags], with the key in ${KEY_ENV}")
    target, flags = args[0], args[1:]
    key_flag = key_flag_in(flags)
    if key_flag:
        sys.exit(f"{PROG}: {key_flag} on the command line is readable by every local user; pass the key in ${KEY_ENV}")
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        sys.exit(f"{PROG}: ${KEY_ENV} is empty or not set; refusing to start a server that anyone can control")
    redact_key_in_log_records(key)
    sys.argv = [target, *flags, *(f"{flag}={key}" for flag in KEY_FLAGS)]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
