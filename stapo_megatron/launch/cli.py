"""The launch commands: ``stapo submit``, ``stapo status``, ``stapo logs`` and ``stapo plan``."""

from __future__ import annotations

from stapo_megatron.launch import experiments, plan_command, submit


def register(subparsers) -> None:
    for module in (submit, experiments, plan_command):
        module.register(subparsers)
