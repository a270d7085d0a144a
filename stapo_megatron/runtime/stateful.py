"""What a checkpoint saves besides the sharded model and optimizer: objects that hand over their
state as a plain dict and take it back.

The same two methods as ``torch.distributed.checkpoint.stateful.Stateful`` (and Megatron's
scheduler, which already has them), declared here so that reading a type does not load torch's
checkpointing.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]:
        """The state to save: plain Python values (a checkpoint's common state is read back with
        ``weights_only=True``), the same on every rank."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back a state :meth:`state_dict` returned (possibly written by an earlier version)."""
        ...
