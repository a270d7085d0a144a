"""What every rank knows about the rollout servers of a run: where they are and who owns them.

The node leaders (local rank 0) launch and own their node's servers; the controller (global rank 0)
routes ``/generate`` over all of them; every rank pushes its weight shards to the servers of its
own node. A :class:`ServerEndpoint` is the small, picklable record that crosses ranks (over the
gloo ``cpu_group``) so that all three agree on the same list.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerEndpoint:
    """One SGLang server (one ``/generate`` URL, ``tp_size`` GPUs of one node)."""

    index: int  # position in the run's server list, the same on every rank
    url: str  # http://host:port
    node: int  # node index of the job (global rank // ranks per node); -1: outside the job (given URL)
    tp_size: int  # the server's tensor-parallel size (GPUs it spans)
    gpu_ids: tuple[int, ...] = ()  # the node-local trainer GPUs it runs on (colocated placement); () otherwise
    log_path: str = ""  # its log file on its node (named in errors); "" when not launched by the run

    @property
    def colocated(self) -> bool:
        """Runs on GPUs that trainer ranks of the job also use."""
        return self.node >= 0 and bool(self.gpu_ids)
