"""Tests of config loading, checks and redaction."""
