"""Shipped YAML presets: model shapes, algorithms, and complete run configs."""
