"""Spreading ``/generate`` requests over the rollout servers by outstanding tokens.

Why not ``sglang-router`` (PyPI): it is a Rust binary wheel run as a process of its own
(``python -m sglang_router.launch_router --worker-urls ...``), which would be one more process per
run to launch, supervise and secure, and one more network hop per request. It routes only
``/generate``-style traffic (weight updates, memory and pause routes must go to each server
anyway), and it knows nothing about weight versions: a server restarted with its launch weights
would keep receiving requests unless we removed it from the router by hand, which breaks "no
``/generate`` is served on a mix of versions". The engine already talks to every server directly,
so the routing decision is the few lines below.

Cost of a request = its prompt tokens + n x ``max_new_tokens`` (what the server may have to hold
in its KV cache). A request goes to the usable server with the least outstanding cost; ties go to the
server that was given the fewest tokens so far, so that even requests that finish at once (short
completions) spread evenly.
"""

from __future__ import annotations

import threading
from collections.abc import Collection


class TokenBalancer:
    """Outstanding-token bookkeeping for ``num_servers`` servers; thread-safe."""

    def __init__(self, num_servers: int):
        self._lock = threading.Lock()
        self.outstanding = [0] * num_servers  # cost of the requests in flight per server
        self.routed = [0] * num_servers  # cost of every request ever sent per server

    def acquire(self, usable: Collection[int], cost: int) -> int:
        """The least-loaded server of ``usable`` (indices), charged ``cost`` until :meth:`release`."""
        if not usable:
            raise ValueError("no usable server to route to")
        with self._lock:
            index = min(usable, key=lambda i: (self.outstanding[i], self.routed[i], i))
            self.outstanding[index] += cost
            self.routed[index] += cost
            return index

    def release(self, index: int, cost: int) -> None:
        """The request charged to ``index`` finished (answered or failed)."""
        with self._lock:
            self.outstanding[index] -= cost
