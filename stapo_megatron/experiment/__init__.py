"""Experiments that compare the algorithm presets with whole training runs (``stapo experiment``)."""
