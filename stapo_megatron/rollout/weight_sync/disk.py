"""Disk sync: each source rank writes its buckets as safetensors files into one shared directory; the
controller writes the index, renames the directory into place and calls ``/update_weights_from_disk``
on every server (which loads the whole checkpoint and rolls back on failure)."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import Any

from stapo_megatron.checkpoint.export import FlatBucket
from stapo_megatron.rollout.sglang_weights import publish_checkpoint, write_bucket_file
from stapo_megatron.rollout.weight_sync.transport import (
    RankLayouts,
    Transport,
    UpdateSession,
    check_tallies,
    wait_on_host,
)


class DiskTransport(Transport):
    def __init__(self, link):
        super().__init__(link)
        self.directory: Path | None = None
        self.files: list[tuple[str, list[str], int]] = []  # (file name, tensor names, tensor bytes)
        self.previous: Path | None = None  # controller: the last published checkpoint, removed after the next
        self.writes = bool(link.targets())  # a source of its share (a TP peer of one exports, writes nothing)

    def begin(self, version: int) -> Any:
        staging = Path(self.link.plan.disk_dir) / f".weights-{version}-{secrets.token_hex(4)}.partial"
        staging.mkdir(parents=True)
        return str(staging)

    def prepare(self, update: UpdateSession, opened: Any, layouts: RankLayouts | None) -> None:
        super().prepare(update, opened, layouts)
        self.directory, self.files = Path(opened), []

    def send(self, bucket: FlatBucket) -> None:
        if not self.writes:
            return
        assert self.directory is not None, "prepare() names the update's directory"
        name = f"rank{self.link.rank:05d}-{bucket.layout.index:05d}.safetensors"
        # this worker thread's copies to the host follow its own stream, not the export's
        wait_on_host(self.ready.get(bucket.layout.index))
        write_bucket_file(self.directory / name, bucket.named_tensors())
        self.files.append((name, bucket.layout.names, bucket.nbytes))

    def finish(self) -> None:
        """The files are complete once written; the controller publishes them."""

    def report(self) -> Any:
        return self.files

    def close(self) -> None:
        """No update leaves anything behind on this rank (the controller removes old checkpoints)."""

    def commit(self, reports: list[tuple[dict[int, list[str]], Any]], version: int, opened: Any) -> None:
        pool, plan = self.link.pool, self.link.plan
        files = [entry for _, rank_files in reports for entry in rank_files or ()]
        written = [name for _, names, _ in files for name in names]
        # Every server reads the one checkpoint: it must hold every expected name once.
        check_tallies(plan.expected_names, [{s.index: written for s in pool.servers}], pool.servers)
        weight_map = {name: fname for fname, names, _ in files for name in names}
        total = sum(nbytes for _, _, nbytes in files)
        final = publish_checkpoint(Path(opened), weight_map, total, config_from=plan.config.model_path or None)
        body = {"model_path": str(final), "flush_cache": False, "weight_version": str(version)}
        pool.run_all(pool.servers, pool.control, "/update_weights_from_disk", body, plan.transfer_timeout_s)
        if self.previous is not None and self.previous != final:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = final

    def abort(self, opened: Any) -> None:
        shutil.rmtree(opened, ignore_errors=True)
