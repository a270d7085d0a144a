"""stapo_megatron: STAPO reinforcement learning for Qwen3 on Megatron-Core."""

from setuptools import setup

PACKAGES = [
    "stapo_megatron",
    "stapo_megatron.checkpoint",
    "stapo_megatron.config",
    "stapo_megatron.data",
    "stapo_megatron.eval",
    "stapo_megatron.experiment",
    "stapo_megatron.launch",
    "stapo_megatron.loss",
    "stapo_megatron.models",
    "stapo_megatron.models.qwen3",
    "stapo_megatron.rewards",
    "stapo_megatron.rollout",
    "stapo_megatron.rollout.weight_sync",
    "stapo_megatron.runtime",
    "stapo_megatron.trainer",
    # The YAML presets live at the repository root (configs/) and ship inside the package.
    "stapo_megatron.configs",
]

setup(
    name="stapo_megatron",
    version="0.1.0",
    description="Megatron-Core trainer for STAPO reinforcement learning of Qwen3 models on math reasoning",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir={"stapo_megatron.configs": "configs"},
    package_data={"stapo_megatron.configs": ["*.yaml", "*/*.yaml"]},
    install_requires=[
        # Install the build you want first (CPU: `pip install torch==2.13.0`); any torch >= 2.5 works.
        "torch>=2.5",
        # The tested releases: 0.16.1 (Python 3.11, the whole suite) through 0.19.x (Python 3.12, whose
        # 0.17+ require it: tests/py312_env.py). pip picks 0.16.1 on 3.11 and the newest 0.19 on 3.12.
        # Widen only to releases that pass the fast tests and tests/trainer/test_resume.py there.
        "megatron-core>=0.16.1,<0.20",
        "transformers>=4.51,<6",
        "safetensors>=0.4",
        "numpy>=1.24",
        "pyyaml>=6.0",
        # dist_checkpointing's writer processes import psutil, which megatron-core does not declare.
        "psutil>=5.9",
        "math-verify>=0.8,<0.10",
        # The reward parser subclasses a private converter of this release line (see rewards/math_equiv.py).
        "latex2sympy2_extended>=1.11,<1.12",
        "datasets>=2.19",
        "pyarrow>=14",
        "tqdm>=4.66",
        "tensorboard>=2.14",
        "matplotlib>=3.7",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]>=2.0", "sglang>=0.5.15"],
        "launch": ["nemo-run>=0.11", "leptonai==0.27.3"],
        "wandb": ["wandb>=0.17"],
        # ruff, mypy and pre-commit pinned: .ci/run and the pre-commit hooks must give the same verdict everywhere.
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "coverage==7.18.0",
            "ruff==0.17.6",
            "mypy==2.4.1",
            "pre-commit==4.6.2",
        ],
    },
    entry_points={"console_scripts": ["stapo = stapo_megatron.cli:main"]},
)
