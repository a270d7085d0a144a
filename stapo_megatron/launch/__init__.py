"""Launching runs: ``stapo submit`` (NeMo-Run: SLURM or local), ``stapo status``/``stapo logs``,
and ``stapo plan`` (per-GPU memory of a layout). NeMo-Run is imported only when a command needs it."""
