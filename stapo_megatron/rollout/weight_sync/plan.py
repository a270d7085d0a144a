"""What every trainer rank needs to push its shares: the engine makes it, the controller broadcasts it."""

from __future__ import annotations

import dataclasses

from stapo_megatron.config import ConfigError
from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.endpoints import ServerEndpoint
from stapo_megatron.rollout.weight_sync.routes import SYNC_MODES

CONTROLLER = 0  # global rank that pauses, checks and resumes the servers


@dataclasses.dataclass(frozen=True)
class WeightSyncPlan:
    """One weight update's servers and settings (equal plans reuse one :class:`WeightSync`)."""

    mode: str  # "tensor" | "distributed" | "disk"
    endpoints: tuple[ServerEndpoint, ...]
    expected_names: frozenset[str]
    api_key: str | None
    config: SGLangConfig  # bucket size, timeouts, weight-update group backend and address, model path
    session_servers: frozenset[int] = frozenset()  # indices of servers with /begin_weight_update (0.5.21+)
    disk_dir: str = ""  # disk: a directory every node and server can read
    server_restarts: int = 0  # a restarted server left its weight-update groups: a new count means new groups

    def __post_init__(self):
        if self.mode not in SYNC_MODES:
            raise ConfigError(f"weight_sync: must be one of {', '.join(SYNC_MODES)}, got {self.mode!r}")
        if not self.endpoints:
            raise ConfigError("weight_sync: no rollout servers to send weights to")
        if self.mode == "disk" and not self.disk_dir:
            raise ConfigError("disk_sync_dir: required for weight_sync disk across ranks (a directory all nodes share)")

    @property
    def bucket_bytes(self) -> int:
        return self.config.weight_bucket_bytes

    @property
    def transfer_timeout_s(self) -> float:
        return self.config.weight_sync_timeout_s
