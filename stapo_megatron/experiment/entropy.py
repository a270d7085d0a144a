"""``stapo experiment entropy``: GRPO, DAPO, 20-Entropy, JustRL and STAPO on the same task.

Each algorithm is a normal ``stapo train`` run (its own process, lock and run directory
``<out>/<algo>``) from the same config, seed and number of steps; only the ``algo`` preset
differs, and the config is the copy ``<out>/base_config.yaml`` taken at the start. A config whose
``algo`` section is a preset with fields set on top (the tiny task's ``{preset: stapo, tau_p:
0.006}``) keeps that section for the run of that preset: those fields are the task's settings of
that algorithm, and that run is the one ``stapo train`` would make. The other algorithms run their
presets as published.
``--parallel N`` runs N of them at once. A run whose metrics already reach the last step is not
run again, and an unfinished one continues from its latest checkpoint, so the command can be
repeated after an interruption. At the end the comparison (table and figures,
:mod:`stapo_megatron.experiment.report`) is written to ``<out>``. The experiment replaces only
what it wrote: ``<out>`` is new, or holds none of its file names (:func:`own_files`), or holds its
``experiment.json``; anything else is refused before any run starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stapo_megatron.config import ConfigError, load_config
from stapo_megatron.config.core import PRESET_KEY, read_yaml
from stapo_megatron.experiment.report import FIGURES, TABLE_FILE, write_comparison
from stapo_megatron.runtime.jsonl import is_finite_number, read_json
from stapo_megatron.runtime.launch import kill_tree
from stapo_megatron.runtime.run_files import atomic_open
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.inspector import read_dumps, summarize
from stapo_megatron.trainer.launcher import default_config_path, load_train_config
from stapo_megatron.trainer.metrics import read_metrics

logger = logging.getLogger(__name__)

ALGOS = ("grpo", "dapo", "entropy20", "justrl", "stapo")
SETTINGS_FILE = "experiment.json"
# The runs' config: a copy of --config (or of the packaged default) taken when the experiment
# starts, so that every run, resumed ones too, trains on the same task even if the source changes.
BASE_CONFIG = "base_config.yaml"
LOG_DIR = "logs"
# DAPO's overlong buffer is L_cache = 4096 of its L_max = 20480 response tokens (arXiv 2503.14476,
# section 3.4): the presets' 4096 is longer than a tiny task's responses, so presets with overlong
# shaping (dapo, entropy20) get the same fifth of batch.max_new_tokens.
OVERLONG_BUFFER_FRACTION = 4096 / 20480
# Overrides the experiment sets itself for every run; the options that set them instead.
_OWN_FIELDS = {
    "algo": "--algos",
    "run.steps": "--steps",
    "run.seed": "--seed",
    "run.output_dir": "--out",
    "run.name": "(the algorithm's name)",
    "parallel.tensor_parallel": "--tensor-parallel",
}


@dataclasses.dataclass
class EntropyExperiment:
    out: Path
    algos: tuple[str, ...] = ALGOS
    steps: int = 300
    seed: int = 0
    config: str | None = None
    tensor_parallel: int = 1
    parallel: int = 2
    overrides: tuple[str, ...] = ()

    def __post_init__(self):
        self.out = Path(self.out)
        if not self.algos:
            raise ConfigError("--algos: give at least one algorithm")
        repeated = sorted({a for a in self.algos if self.algos.count(a) > 1})
        if repeated:
            raise ConfigError(f"--algos: {', '.join(repeated)} given more than once")
        for item in self.overrides:
            key = item.split("=", 1)[0]
            if key in _OWN_FIELDS or key.startswith("algo."):
                raise ConfigError(
                    f"{item}: the experiment sets {key} for every run; use {_OWN_FIELDS.get(key, '--algos')}"
                )

    def settings(self) -> dict:
        """What makes the runs comparable; an experiment directory holds runs of one setting."""
        return {
            "steps": self.steps,
            "seed": self.seed,
            "config": self.config,
            "tensor_parallel": self.tensor_parallel,
            "overrides": list(self.overrides),
        }

    @property
    def base_config(self) -> Path:
        return self.out / BASE_CONFIG

    def source_config(self) -> Path:
        """The config the runs train with: the copy once taken, else --config or the packaged default."""
        if self.base_config.is_file():
            return self.base_config
        return Path(self.config) if self.config else default_config_path()

    def run_directory(self, algo: str) -> Path:
        return self.out / algo

    def configured_algo(self) -> str | None:
        """The preset whose run keeps the config's own ``algo`` section: the one that section names
        when it sets fields on top of a preset (None when it is a bare preset name or spells out
        every field)."""
        section = read_yaml(self.source_config()).get("algo")
        if isinstance(section, dict) and isinstance(section.get(PRESET_KEY), str) and len(section) > 1:
            return section[PRESET_KEY]
        return None

    def run_overrides(self) -> dict[str, list[str]]:
        """Every run's ``stapo train`` overrides, each checked as ``stapo train`` checks them
        (a bad preset name or override fails here, before any run starts)."""
        plans = {}
        configured = self.configured_algo()
        for algo in self.algos:
            overrides = [
                *self.overrides,
                *([] if algo == configured else [f"algo={algo}"]),
                f"run.steps={self.steps}",
                f"run.seed={self.seed}",
                f"run.name={algo}",
                f"run.output_dir={self.run_directory(algo)}",
                f"parallel.tensor_parallel={self.tensor_parallel}",
                "logging.progress_bar=false",
            ]
            unchecked = load_config(TrainConfig, self.source_config(), overrides)
            if unchecked.algo.overlong_shaping:
                buffer = max(1, round(OVERLONG_BUFFER_FRACTION * unchecked.batch.max_new_tokens))
                overrides.append(f"algo.overlong_buffer={buffer}")
            load_train_config(self.source_config(), overrides)
            plans[algo] = overrides
        return plans

    def finished(self, algo: str) -> bool:
        rows = read_metrics(self.run_directory(algo))
        return bool(rows) and rows[-1].get("step") == self.steps

    def command(self) -> str:
        """The command line that reproduces this experiment."""
        words = [
            "stapo",
            "experiment",
            "entropy",
            "--steps",
            str(self.steps),
            "--seed",
            str(self.seed),
            "--algos",
            ",".join(self.algos),
            "--parallel",
            str(self.parallel),
            "--tensor-parallel",
            str(self.tensor_parallel),
            "--out",
            str(self.out),
        ]
        if self.config:
            words += ["--config", self.config]
        return shlex.join([*words, *self.overrides])


def own_files(experiment: EntropyExperiment) -> list[str]:
    """The names in ``--out`` that the experiment writes or replaces, besides the runs' directories."""
    inspections = [f"inspect_{algo}.txt" for algo in experiment.algos]
    return [SETTINGS_FILE, BASE_CONFIG, LOG_DIR, TABLE_FILE, *(name for _, name, _ in FIGURES), *inspections]


def _settings_problem(recorded: Any, wanted: dict) -> str | None:
    """Why ``recorded`` is not the content of an experiment's settings file, or None."""
    if not isinstance(recorded, dict):
        return "not a JSON object"
    missing = [key for key in (*wanted, "wall_seconds") if key not in recorded]
    if missing:
        return f"no {missing[0]}"
    walls = recorded["wall_seconds"]
    if not isinstance(walls, dict) or not all(is_finite_number(v) and v >= 0 for v in walls.values()):
        return "wall_seconds is not a mapping of algorithms to seconds"
    return None


def _check_settings(experiment: EntropyExperiment) -> dict:
    """The settings file's content (with its recorded wall times), or new settings for a directory
    that is new or holds none of the experiment's files. Refuses, before any run starts, a
    directory whose runs were made with other settings, and one that holds files of the
    experiment's names but no settings file of it (they are someone else's: never replaced)."""
    out, wanted = experiment.out, experiment.settings()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    path = out / SETTINGS_FILE
    if not path.is_file():
        taken = [name for name in own_files(experiment) if os.path.lexists(out / name)]
        if taken:
            raise ConfigError(
                f"--out {out}: holds {taken[0]} but no {SETTINGS_FILE} of an experiment; "
                "its files are not the experiment's to replace: choose another --out"
            )
        return {**wanted, "wall_seconds": {}}
    recorded = read_json(path, "--out")
    problem = _settings_problem(recorded, wanted)
    if problem is not None:
        raise ConfigError(f"--out {out}: {path} is not an experiment's settings file ({problem}); choose another --out")
    differing = [key for key in wanted if recorded.get(key) != wanted[key]]
    if differing:
        key = differing[0]
        raise ConfigError(
            f"--out {out}: holds runs made with {key}={recorded.get(key)!r}, not {wanted[key]!r}; "
            "use the same settings to continue them, or another --out"
        )
    return recorded


def _write_settings(experiment: EntropyExperiment, state: dict) -> None:
    with atomic_open(experiment.out / SETTINGS_FILE) as f:
        json.dump(state, f, indent=2)


def _start(experiment: EntropyExperiment, algo: str, overrides: list[str]) -> tuple[subprocess.Popen, float]:
    command = [sys.executable, "-m", "stapo_megatron.cli", "train", "--config", str(experiment.base_config)]
    # One thread per rank: the runs share the cores; more threads per process only contend.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(experiment.out / LOG_DIR / f"{algo}.log", "a", encoding="utf-8")
    with log:
        process = subprocess.Popen(
            [*command, *overrides], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    logger.info("experiment %s: started (log: %s)", algo, log.name)
    return process, time.monotonic()


def _stop(processes: list[subprocess.Popen]) -> None:
    """Ask each run still going to stop after its current step and checkpoint (SIGTERM: ``stapo
    train``'s first stop request, which a shell's background job does not ignore as it does
    SIGINT) and wait for them; a Ctrl-C during the wait kills them and what they started. The
    runs are in sessions of their own, so a Ctrl-C at the terminal reaches only this process."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    try:
        for process in processes:
            process.wait()
    except KeyboardInterrupt:
        for process in processes:
            kill_tree(process.pid)
            process.wait()
        raise


def run_experiment(experiment: EntropyExperiment) -> list[Path]:
    """Run the algorithms that have not finished, N at a time, then write the comparison.
    Returns the files of the comparison."""
    state = _check_settings(experiment)
    plans = experiment.run_overrides()
    experiment.out.mkdir(parents=True, exist_ok=True)
    _write_settings(experiment, state)
    if not experiment.base_config.is_file():
        text = experiment.source_config().read_text(encoding="utf-8")
        with atomic_open(experiment.base_config) as f:
            f.write(text)
    (experiment.out / LOG_DIR).mkdir(exist_ok=True)
    pending = [algo for algo in experiment.algos if not experiment.finished(algo)]
    for algo in experiment.algos:
        if algo not in pending:
            logger.info("experiment %s: finished earlier (%s), not run again", algo, experiment.run_directory(algo))
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    failed = []

    def on_terminate(signum, frame):
        raise SystemExit(128 + signum)  # through the ``finally`` below, which stops the runs

    previous = signal.signal(signal.SIGTERM, on_terminate)
    try:
        while pending or running:
            while pending and len(running) < experiment.parallel:
                algo = pending.pop(0)
                running[algo] = _start(experiment, algo, plans[algo])
            time.sleep(0.5)
            for algo, (process, started) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[algo]
                seconds = time.monotonic() - started
                # A resumed run's seconds add to those of its earlier part.
                state["wall_seconds"][algo] = state["wall_seconds"].get(algo, 0.0) + seconds
                _write_settings(experiment, state)
                if process.returncode != 0 or not experiment.finished(algo):
                    failed.append(
                        f"{algo} (exit {process.returncode}, see {experiment.out / LOG_DIR / (algo + '.log')})"
                    )
                logger.info("experiment %s: exit %d after %.0f s", algo, process.returncode, seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop([process for process, _ in running.values()])
    if failed:
        raise SystemExit(
            f"stapo: experiment: runs did not finish: {'; '.join(failed)}; run the same command again to continue them"
        )
    runs = [(algo, read_metrics(experiment.run_directory(algo))) for algo in experiment.algos]
    heading = [
        "# Entropy experiment: the algorithm presets on one task",
        "",
        f"Command: `{experiment.command()}`",
        "",
        f"Each algorithm is a `stapo train` run of {experiment.steps} steps from seed {experiment.seed}, "
        f"tensor parallel {experiment.tensor_parallel}, {experiment.parallel} runs at a time, on `{BASE_CONFIG}` "
        "(the free-words task unless --config chose another); presets with DAPO's "
        f"overlong shaping use a buffer of {OVERLONG_BUFFER_FRACTION:.0%} of batch.max_new_tokens (DAPO: 4096 of "
        "20480).",
    ]
    configured = experiment.configured_algo()
    if configured in experiment.algos:
        section = read_yaml(experiment.source_config())["algo"]
        fields = ", ".join(f"`{k}: {v}`" for k, v in section.items() if k != PRESET_KEY)
        heading[-1] += (
            f" The {configured} run keeps the config's algo section, the preset with {fields} (the task's "
            "settings, as `stapo train` runs it); the others run their presets as published."
        )
    inspected = write_inspections(experiment)
    notes = (
        [
            "",
            "Silenced tokens (`stapo inspect`, next to the STAPO paper's token classes): "
            + ", ".join(f"[{path.name}]({path.name})" for path in inspected),
        ]
        if inspected
        else []
    )
    return [*write_comparison(experiment.out, runs, state["wall_seconds"], heading, notes), *inspected]


def write_inspections(experiment: EntropyExperiment) -> list[Path]:
    """``stapo inspect``'s report of each run that silenced tokens, as ``inspect_<algo>.txt``."""
    written = []
    for algo in experiment.algos:
        run_dir = experiment.run_directory(algo)
        if read_dumps(run_dir):
            path = experiment.out / f"inspect_{algo}.txt"
            with atomic_open(path) as f:
                f.write(summarize(run_dir) + "\n")
            written.append(path)
    return written


def run_entropy(args) -> None:
    # The runs' directories, configs and logs: this user's only, as `stapo train` makes its own.
    os.umask(0o077)
    algos = tuple(a.strip() for a in args.algos.split(",") if a.strip())
    experiment = EntropyExperiment(
        out=Path(args.out),
        algos=algos,
        steps=args.steps,
        seed=args.seed,
        config=args.config,
        tensor_parallel=args.tensor_parallel,
        parallel=args.parallel,
        overrides=tuple(args.overrides),
    )
    files = run_experiment(experiment)
    print(f"wrote {files[0]} and {', '.join(p.name for p in files[1:])}", flush=True)
