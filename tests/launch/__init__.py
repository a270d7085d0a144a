"""Tests of stapo submit, status, logs and plan."""
