"""``stapo experiment``: experiments made of several training runs."""

from __future__ import annotations

from stapo_megatron.config import MAX_SEED
from stapo_megatron.config.command import int_in, positive_int


def run_entropy(args) -> None:
    from stapo_megatron.experiment.entropy import run_entropy as run

    run(args)


def register(subparsers) -> None:
    from stapo_megatron.experiment.entropy import ALGOS

    experiment = subparsers.add_parser("experiment", help="experiments made of several training runs")
    kinds = experiment.add_subparsers(dest="experiment", required=True)
    entropy = kinds.add_parser(
        "entropy",
        help="GRPO, DAPO, 20-Entropy, JustRL and STAPO on one task from one seed; table and figures",
        description="Train each algorithm preset with `stapo train` (same config, seed and steps; <out>/<algo>), "
        "then write <out>/comparison.md and PNG figures of entropy, accuracy, masked fraction and response length. "
        "Finished runs are not run again; unfinished ones continue from their latest checkpoint.",
    )
    entropy.add_argument("--steps", type=positive_int, default=300, help="training steps of every run")
    entropy.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="run.seed of every run")
    entropy.add_argument("--algos", default=",".join(ALGOS), help="comma-separated algorithm presets (configs/algo)")
    entropy.add_argument(
        "--out",
        default="runs/experiment_entropy",
        help="experiment directory: new, or one this command made (it holds experiment.json); a directory "
        "holding other files of the experiment's names (comparison.md, the figures, ...) is refused",
    )
    entropy.add_argument("--config", default=None, help="YAML config of every run (default: the packaged tiny CPU one)")
    entropy.add_argument("--parallel", type=positive_int, default=2, help="runs at the same time")
    entropy.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        help="parallel.tensor_parallel of every run (processes per run: keep parallel x this <= cores)",
    )
    entropy.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. batch.group_size=8")
    entropy.set_defaults(func=run_entropy)
