"""``stapo experiment study``: methods x seeds on one task, with intervals over the seeds.

Each (method, seed) is a normal ``stapo train`` run (its own process, lock and run directory
``<out>/<method name>/seed_<seed>``) from the same config and number of steps; only the ``algo``
section, the method's settings outside it (:data:`~stapo_megatron.experiment.paper.OUTSIDE_ALGO_SETTINGS`)
and ``run.seed`` differ, and the config is the copy ``<out>/base_config.yaml`` taken at the
start. A method is a preset or a preset with algo fields on top (:mod:`.methods`). A config whose
``algo`` section is a preset with fields set on top (the tiny task's ``{preset: stapo, tau_p:
0.006}``) keeps that section for the methods of that preset, their own fields on top: those fields
are the task's settings of that algorithm. The other presets run as published.

Updates are off-policy as in the STAPO paper: ``--minibatches`` optimizer steps per rollout step
(``batch.prompts_per_minibatch = prompts_per_step / minibatches``; the paper: 256 prompts in
mini-batches of 64, four), so the ratios move away from 1 and clipping, clip-higher and dual-clip
act. Every method and override is validated as ``stapo train`` validates it before any run starts.

``--parallel N`` runs N at once. A run whose metrics already reach the last step is not run
again, and an unfinished one continues from its latest checkpoint, so the command can be repeated
after an interruption. At the end the report (table with bootstrap intervals and figures with
bands, :mod:`stapo_megatron.experiment.report`) is written to ``<out>``. The study replaces only
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

from stapo_megatron.config import MAX_SEED, ConfigError
from stapo_megatron.config.command import load_training_config
from stapo_megatron.config.core import PRESET_KEY, read_yaml
from stapo_megatron.experiment.methods import Method, parse_methods
from stapo_megatron.experiment.paper import OUTSIDE_ALGO_SETTINGS, PAPER_COMPARISON
from stapo_megatron.experiment.report import FIGURES, TABLE_FILE, MethodRuns, run_key, write_report
from stapo_megatron.runtime.jsonl import is_finite_number, read_json
from stapo_megatron.runtime.launch import kill_tree
from stapo_megatron.runtime.run_files import atomic_open
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.inspector import read_dumps, summarize
from stapo_megatron.trainer.launcher import default_config_path, load_train_config
from stapo_megatron.trainer.metrics import read_metrics

logger = logging.getLogger(__name__)

# The paper's ablations (Masking Strategy Ablation): among S2T's candidates mask the high-entropy
# ones instead, or random ones at the same budget, or all of them (JustRL-FullMask).
ABLATIONS = ("stapo:token_rule=s2t_high_entropy", "stapo:token_rule=s2t_random", "stapo:token_rule=lowprob_all")
# Around the tiny task's settings (configs/tiny_cpu.yaml: tau_p 0.006 on its 24-token vocabulary,
# q the paper's 0.75): half the quantile, and twice the threshold (its comments: 0.0075 masks up
# to 1%; the paper's 0.002 fires on 2 of 130 steps, too rarely to tell anything from).
SWEEP = ("stapo:q=0.5", "stapo:tau_p=0.012")
DEFAULT_METHODS = (*PAPER_COMPARISON, *ABLATIONS, *SWEEP)
DEFAULT_SEEDS = (0, 1, 2, 3, 4)
# With four mini-batches the tiny task learns faster per rollout step (accuracy 0.9 over steps 46-50,
# against 0.7 with one; seed 0), so 100 steps reach the sharp, S2T-firing regime and leave it steps
# to show. Estimated time on 2 quiet cores, two runs at a time: 9 methods x 5 seeds x 100 steps at
# 0.7-1.2 s per step and run (the one-update entropy experiment's 0.72 s at TP=1; four mini-batches
# cost the same per step, GRPO's reference pass 1.5 times), 30 to 53 minutes, about 40.
DEFAULT_STEPS = 100
# The paper: 256 prompts per rollout step in mini-batches of 64 (arXiv 2602.15620, Settings).
DEFAULT_MINIBATCHES = 4
SETTINGS_FILE = "experiment.json"
# The runs' config: a copy of --config (or of the packaged default) taken when the study starts,
# so that every run, resumed ones too, trains on the same task even if the source changes.
BASE_CONFIG = "base_config.yaml"
LOG_DIR = "logs"
# DAPO's overlong buffer is L_cache = 4096 of its L_max = 20480 response tokens (arXiv 2503.14476,
# section 3.4): the presets' 4096 is longer than a tiny task's responses, so presets with overlong
# shaping get the same fifth of batch.max_new_tokens (unless the method sets its own).
OVERLONG_BUFFER_FRACTION = 4096 / 20480
# Fields the study sets itself for every run; the options that set them instead.
_OWN_FIELDS = {
    "algo": "--methods",
    "run.steps": "--steps",
    "run.seed": "--seeds",
    "run.output_dir": "--out",
    "run.name": "(the method and seed)",
    "parallel.tensor_parallel": "--tensor-parallel",
    "batch.prompts_per_minibatch": "--minibatches",
}


def parse_seeds(text: str) -> tuple[int, ...]:
    """``0-4``, ``0,2,7`` or both (``0-2,7``): the seeds, each once, in the order given."""
    seeds: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        first, dash, last = item.partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ConfigError(f"--seeds {text}: '{item}' is not a seed or a range low-high") from None
        if not 0 <= low <= high <= MAX_SEED:
            raise ConfigError(f"--seeds {text}: '{item}': seeds are from 0 to {MAX_SEED}, a range low to high")
        seeds.extend(range(low, high + 1))
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        raise ConfigError(f"--seeds {text}: {repeated[0]} given more than once")
    return tuple(seeds)


def seeds_text(seeds: tuple[int, ...]) -> str:
    """The shortest ``--seeds`` text of ``seeds`` (runs of consecutive seeds as ranges)."""
    parts: list[str] = []
    start = previous = seeds[0]
    for seed in (*seeds[1:], None):
        if seed is not None and seed == previous + 1:
            previous = seed
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if seed is not None:
            start = previous = seed
    return ",".join(parts)


def override_text(key: str, value: object) -> str:
    """``key=value`` for a setting given as data (JSON is YAML: what ``stapo train`` reads back)."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


@dataclasses.dataclass
class Study:
    out: Path
    methods: tuple[Method, ...] = dataclasses.field(default_factory=lambda: parse_methods(",".join(DEFAULT_METHODS)))
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    steps: int = DEFAULT_STEPS
    minibatches: int = DEFAULT_MINIBATCHES
    config: str | None = None
    tensor_parallel: int = 1
    parallel: int = 2
    overrides: tuple[str, ...] = ()

    def __post_init__(self):
        self.out = Path(self.out)
        if not self.methods:
            raise ConfigError("--methods: give at least one method")
        names = [method.name for method in self.methods]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ConfigError(f"--methods: {', '.join(repeated)} given more than once")
        if not self.seeds:
            raise ConfigError("--seeds: give at least one seed")
        outside = {key for method in self.methods for key in OUTSIDE_ALGO_SETTINGS.get(method.preset, {})}
        for item in self.overrides:
            key = item.split("=", 1)[0]
            if key in _OWN_FIELDS or key.startswith("algo."):
                raise ConfigError(
                    f"{item}: the study sets {key} for every run; use "
                    f"{_OWN_FIELDS.get(key, '--methods (a method such as stapo:q=0.5)')}"
                )
            if key in outside:
                presets = sorted({m.preset for m in self.methods if key in OUTSIDE_ALGO_SETTINGS.get(m.preset, {})})
                raise ConfigError(
                    f"{item}: the {', '.join(presets)} runs set {key} themselves (their papers' setting, "
                    "experiment/paper.py); leave it to them or study other methods"
                )

    def settings(self) -> dict:
        """What makes the runs comparable; an experiment directory holds runs of one setting."""
        return {
            "steps": self.steps,
            "minibatches": self.minibatches,
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

    def run_directory(self, method: Method, seed: int) -> Path:
        return self.out / run_key(method, seed)

    def runs(self) -> list[tuple[Method, int]]:
        """Every (method, seed), seed by seed: an interrupted study has whole seeds of every method."""
        return [(method, seed) for seed in self.seeds for method in self.methods]

    def configured_preset(self) -> str | None:
        """The preset whose methods keep the config's own ``algo`` section: the one that section
        names when it sets fields on top of a preset (None when it is a bare preset name or spells
        out every field)."""
        section = read_yaml(self.source_config()).get("algo")
        if isinstance(section, dict) and isinstance(section.get(PRESET_KEY), str) and len(section) > 1:
            return section[PRESET_KEY]
        return None

    def method_overrides(self) -> dict[str, list[str]]:
        """Each method's ``stapo train`` overrides but those of the run (steps, seed, directory),
        each method checked as ``stapo train`` checks it: a bad method or override fails here, in
        one line naming it, before any run starts. Two methods that resolve to the same runs are refused."""
        configured = self.configured_preset()
        prompts_per_step = load_train_config(self.source_config(), list(self.overrides)).batch.prompts_per_step
        if prompts_per_step % self.minibatches:
            raise ConfigError(
                f"--minibatches {self.minibatches}: does not divide batch.prompts_per_step {prompts_per_step}"
            )
        plans: dict[str, list[str]] = {}
        resolved: dict[str, tuple[Any, dict[str, object]]] = {}
        for method in self.methods:
            outside = OUTSIDE_ALGO_SETTINGS.get(method.preset, {})
            own = sorted(key for key in outside if key in _OWN_FIELDS or key.startswith("algo"))
            if own:
                raise ConfigError(f"experiment/paper.py: {method.preset} sets {own[0]}, which the study sets itself")
            overrides = [
                *self.overrides,
                *(override_text(key, value) for key, value in outside.items()),
                *([] if method.preset == configured else [f"algo={method.preset}"]),
                *method.algo_overrides(),
                f"batch.prompts_per_minibatch={prompts_per_step // self.minibatches}",
                f"parallel.tensor_parallel={self.tensor_parallel}",
                f"run.steps={self.steps}",
                "logging.progress_bar=false",
            ]
            try:
                unchecked = load_training_config(TrainConfig, self.source_config(), overrides)
                if unchecked.algo.overlong_shaping and all(key != "overlong_buffer" for key, _ in method.fields):
                    buffer = max(1, round(OVERLONG_BUFFER_FRACTION * unchecked.batch.max_new_tokens))
                    overrides.append(f"algo.overlong_buffer={buffer}")
                cfg = load_train_config(self.source_config(), overrides)
            except ConfigError as err:
                raise ConfigError(f"--methods {method.spec}: {err}") from None
            twin = next((name for name, (algo, rest) in resolved.items() if algo == cfg.algo and rest == outside), None)
            if twin is not None:
                raise ConfigError(f"--methods {method.spec}: the same runs as {twin} (the same algo settings)")
            resolved[method.spec] = (cfg.algo, outside)
            plans[method.name] = overrides
        return plans

    def run_overrides(self, plans: dict[str, list[str]], method: Method, seed: int) -> list[str]:
        return [
            *plans[method.name],
            f"run.seed={seed}",
            f"run.name={method.name}-seed{seed}",
            f"run.output_dir={self.run_directory(method, seed)}",
        ]

    def finished(self, method: Method, seed: int) -> bool:
        rows = read_metrics(self.run_directory(method, seed))
        return bool(rows) and rows[-1].get("step") == self.steps

    def command(self) -> str:
        """The command line that reproduces this study."""
        words = [
            "stapo",
            "experiment",
            "study",
            "--methods",
            ",".join(method.spec for method in self.methods),
            "--seeds",
            seeds_text(self.seeds),
            "--steps",
            str(self.steps),
            "--minibatches",
            str(self.minibatches),
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


def own_files(study: Study) -> list[str]:
    """The names in ``--out`` that the study writes or replaces, besides the runs' directories."""
    inspections = [inspection_name(method) for method in study.methods]
    return [SETTINGS_FILE, BASE_CONFIG, LOG_DIR, TABLE_FILE, *(name for _, name, _ in FIGURES), *inspections]


def inspection_name(method: Method) -> str:
    return f"inspect_{method.name}.txt"


def _settings_problem(recorded: Any, wanted: dict) -> str | None:
    """Why ``recorded`` is not the content of a study's settings file, or None."""
    if not isinstance(recorded, dict):
        return "not a JSON object"
    missing = [key for key in (*wanted, "wall_seconds") if key not in recorded]
    if missing:
        return f"no {missing[0]}"
    walls = recorded["wall_seconds"]
    if not isinstance(walls, dict) or not all(is_finite_number(v) and v >= 0 for v in walls.values()):
        return "wall_seconds is not a mapping of runs to seconds"
    return None


def _check_settings(study: Study) -> dict:
    """The settings file's content (with its recorded wall times), or new settings for a directory
    that is new or holds none of the study's files. Refuses, before any run starts, a directory
    whose runs were made with other settings, and one that holds files of the study's names but
    no settings file of it (they are someone else's: never replaced)."""
    out, wanted = study.out, study.settings()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    path = out / SETTINGS_FILE
    if not path.is_file():
        taken = [name for name in own_files(study) if os.path.lexists(out / name)]
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


def _write_settings(study: Study, state: dict) -> None:
    with atomic_open(study.out / SETTINGS_FILE) as f:
        json.dump(state, f, indent=2)


def _log_path(study: Study, method: Method, seed: int) -> Path:
    return study.out / LOG_DIR / f"{method.name}-seed{seed}.log"


def _start(study: Study, key: str, log_path: Path, overrides: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "stapo_megatron.cli", "train", "--config", str(study.base_config)]
    # One thread per rank: the runs share the cores; more threads per process only contend.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log_path, "a", encoding="utf-8") as log:
        process = subprocess.Popen(
            [*command, *overrides], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    logger.info("experiment %s: started (log: %s)", key, log_path)
    return process


@dataclasses.dataclass
class _Running:
    process: subprocess.Popen
    started: float  # time.monotonic()
    log_path: Path
    method: Method
    seed: int


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


def run_study(study: Study) -> list[Path]:
    """Run the (method, seed) runs that have not finished, N at a time, then write the report.
    Returns the files of the report."""
    state = _check_settings(study)
    plans = study.method_overrides()
    study.out.mkdir(parents=True, exist_ok=True)
    _write_settings(study, state)
    if not study.base_config.is_file():
        text = study.source_config().read_text(encoding="utf-8")
        with atomic_open(study.base_config) as f:
            f.write(text)
    (study.out / LOG_DIR).mkdir(exist_ok=True)
    pending = []
    for method, seed in study.runs():
        if study.finished(method, seed):
            logger.info("experiment %s: finished earlier, not run again", run_key(method, seed))
        else:
            pending.append((method, seed))
    running: dict[str, _Running] = {}
    failed = []

    def on_terminate(signum, frame):
        raise SystemExit(128 + signum)  # through the ``finally`` below, which stops the runs

    previous = signal.signal(signal.SIGTERM, on_terminate)
    try:
        while pending or running:
            while pending and len(running) < study.parallel:
                method, seed = pending.pop(0)
                key, log_path = run_key(method, seed), _log_path(study, method, seed)
                study.run_directory(method, seed).parent.mkdir(exist_ok=True)
                process = _start(study, key, log_path, study.run_overrides(plans, method, seed))
                running[key] = _Running(process, time.monotonic(), log_path, method, seed)
            time.sleep(0.5)
            for key, run in list(running.items()):
                if run.process.poll() is None:
                    continue
                del running[key]
                seconds = time.monotonic() - run.started
                # A resumed run's seconds add to those of its earlier part.
                state["wall_seconds"][key] = state["wall_seconds"].get(key, 0.0) + seconds
                _write_settings(study, state)
                if run.process.returncode != 0 or not study.finished(run.method, run.seed):
                    failed.append(f"{key} (exit {run.process.returncode}, see {run.log_path})")
                logger.info("experiment %s: exit %d after %.0f s", key, run.process.returncode, seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop([run.process for run in running.values()])
        if running:  # stopped early: their seconds so far count, as a resumed run's add to them
            for key, run in running.items():
                state["wall_seconds"][key] = state["wall_seconds"].get(key, 0.0) + time.monotonic() - run.started
            _write_settings(study, state)
            logger.info("experiment: stopped %s; run the same command again to continue", ", ".join(running))
    if failed:
        raise SystemExit(
            f"stapo: experiment: runs did not finish: {'; '.join(failed)}; run the same command again to continue them"
        )
    return write_study_report(study, state["wall_seconds"])


def write_study_report(study: Study, wall_seconds: dict[str, float]) -> list[Path]:
    methods = [
        MethodRuns(method, [(seed, read_metrics(study.run_directory(method, seed))) for seed in study.seeds])
        for method in study.methods
    ]
    heading = [
        "# Study: methods x seeds on one task",
        "",
        f"Command: `{study.command()}`",
        "",
        f"Each (method, seed) is a `stapo train` run of {study.steps} steps, {study.minibatches} optimizer "
        f"mini-batches per rollout step (batch.prompts_per_minibatch = prompts_per_step / {study.minibatches}), "
        f"tensor parallel {study.tensor_parallel}, {study.parallel} runs at a time, on `{BASE_CONFIG}` (the "
        f"free-words task unless --config chose another); seeds {seeds_text(study.seeds)}. Presets with DAPO's "
        f"overlong shaping use a buffer of {OVERLONG_BUFFER_FRACTION:.0%} of batch.max_new_tokens (DAPO: 4096 of "
        "20480).",
    ]
    outside = {m.preset: OUTSIDE_ALGO_SETTINGS[m.preset] for m in study.methods if OUTSIDE_ALGO_SETTINGS.get(m.preset)}
    if outside:
        heading[-1] += " Settings outside the algo section from the methods' papers (experiment/paper.py): " + (
            "; ".join(
                f"{preset}: {', '.join(f'`{override_text(k, v)}`' for k, v in settings.items())}"
                for preset, settings in outside.items()
            )
            + "."
        )
    configured = study.configured_preset()
    if any(method.preset == configured for method in study.methods):
        section = read_yaml(study.source_config())["algo"]
        fields = ", ".join(f"`{k}: {v}`" for k, v in section.items() if k != PRESET_KEY)
        heading[-1] += (
            f" The {configured} methods keep the config's algo section, the preset with {fields} (the task's "
            "settings, as `stapo train` runs it), their own fields on top; the other presets run as published."
        )
    inspected = write_inspections(study)
    notes = (
        [
            "",
            "Silenced tokens of each method's first seed (`stapo inspect`): "
            + ", ".join(f"[{path.name}]({path.name})" for path in inspected),
        ]
        if inspected
        else []
    )
    return [*write_report(study.out, methods, wall_seconds, heading, notes), *inspected]


def write_inspections(study: Study) -> list[Path]:
    """``stapo inspect``'s report of each method's first-seed run that silenced tokens."""
    written = []
    for method in study.methods:
        run_dir = study.run_directory(method, study.seeds[0])
        if read_dumps(run_dir):
            path = study.out / inspection_name(method)
            with atomic_open(path) as f:
                f.write(summarize(run_dir) + "\n")
            written.append(path)
    return written


def run_study_command(args) -> None:
    # The runs' directories, configs and logs: this user's only, as `stapo train` makes its own.
    os.umask(0o077)
    study = Study(
        out=Path(args.out),
        methods=parse_methods(args.methods),
        seeds=parse_seeds(args.seeds),
        steps=args.steps,
        minibatches=args.minibatches,
        config=args.config,
        tensor_parallel=args.tensor_parallel,
        parallel=args.parallel,
        overrides=tuple(args.overrides),
    )
    files = run_study(study)
    print(f"wrote {files[0]} and {', '.join(p.name for p in files[1:])}", flush=True)
