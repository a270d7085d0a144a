"""Tests of the trainer: end-to-end runs, exact resume, faults."""
