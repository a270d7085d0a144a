"""``stapo experiment``: experiments made of several training runs."""

from __future__ import annotations

from stapo_megatron.config.command import positive_int


def run_study(args) -> None:
    from stapo_megatron.experiment.study import run_study_command

    run_study_command(args)


def register(subparsers) -> None:
    from stapo_megatron.experiment.study import (
        DEFAULT_METHODS,
        DEFAULT_MINIBATCHES,
        DEFAULT_SEEDS,
        DEFAULT_STEPS,
        seeds_text,
    )

    experiment = subparsers.add_parser("experiment", help="experiments made of several training runs")
    kinds = experiment.add_subparsers(dest="experiment", required=True)
    study = kinds.add_parser(
        "study",
        help="methods x seeds on one task: bootstrap intervals over the seeds, figures with bands",
        description="Train each (method, seed) with `stapo train` (same config and steps; "
        "<out>/<method>/seed_<seed>), then write <out>/comparison.md (per method: mean and 95% bootstrap "
        "interval over the seeds of final accuracy, end entropy and masked fraction) and PNG figures of "
        "accuracy, entropy and masked fraction with bands. Finished runs are not run again; unfinished ones "
        "continue from their latest checkpoint.",
    )
    study.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated methods: an algo preset (configs/algo), or a preset with algo fields on top, "
        "preset:field=value[:field=value] (stapo:q=0.5). Default: the STAPO paper's comparison set, its "
        "masking ablations and a q / tau_p sweep",
    )
    study.add_argument(
        "--seeds", default=seeds_text(DEFAULT_SEEDS), help="run.seed of each method's runs: 0-4, 0,3,7 or 0-2,9"
    )
    study.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, help="training steps of every run")
    study.add_argument(
        "--minibatches",
        type=positive_int,
        default=DEFAULT_MINIBATCHES,
        help="optimizer mini-batches per rollout step (the paper: 4); must divide batch.prompts_per_step",
    )
    study.add_argument(
        "--out",
        default="runs/experiment_study",
        help="experiment directory: new, or one this command made (it holds experiment.json); a directory "
        "holding other files of the experiment's names (comparison.md, the figures, ...) is refused",
    )
    study.add_argument("--config", default=None, help="YAML config of every run (default: the packaged tiny CPU one)")
    study.add_argument("--parallel", type=positive_int, default=2, help="runs at the same time")
    study.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        help="parallel.tensor_parallel of every run (processes per run: keep parallel x this <= cores)",
    )
    study.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. batch.group_size=8")
    study.set_defaults(func=run_study)
