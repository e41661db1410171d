"""Defaults shared by the commands."""

DEFAULT_MODEL = "demo-fine"  # shipped in models/
