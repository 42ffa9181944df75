"""Errors of a model the runtime is asked to serve, shared by every layer that reads one."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """A model directory or config.json the runtime cannot serve; the message names the fix."""
