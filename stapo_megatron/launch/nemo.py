"""The NeMo-Run side of ``stapo submit``: imported only once nemo-run is known to be importable.

NeMo-Run stores the executor (packager included) with each experiment and rebuilds it when an
experiment is reopened (``stapo status``), so the packager class lives in an importable module.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import nemo_run as run
from nemo_run.config import RUNDIR_NAME

# Where the job finds its config: NeMo-Run mounts the job directory at /nemo_run in a container
# and, without one, rewrites /nemo_run in the sbatch script to the job directory on the cluster.
CONFIG_NAME = "stapo_config.yaml"
JOB_DIR_IN_SCRIPT = f"/{RUNDIR_NAME}"


@dataclasses.dataclass(kw_only=True)
class ResolvedConfigPackager(run.Packager):
    """Puts the resolved training config into the job directory; ships no code.

    The job runs the stapo installed on the cluster (or in the container), so there is nothing to
    archive; what must travel is the config, exactly as it was checked here. NeMo-Run calls
    ``package`` after it has created the job directory and before it copies that directory to the
    cluster (SSH tunnel) and runs sbatch.
    """

    config_yaml: str = ""

    def package(self, path: Path, job_dir: str, name: str) -> str:
        os.makedirs(job_dir, exist_ok=True)
        target = os.path.join(job_dir, CONFIG_NAME)
        # 0600: the job's ranks read secrets (API key, tokens) from it; other users must not
        fd = os.open(target + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)  # also a temporary left with wider permissions by an earlier try
            f.write(self.config_yaml)
        os.replace(target + ".tmp", target)
        return ""  # nothing to extract into the job's code directory
