"""Tensor-parallel errors: a configuration that cannot be split, and a group that broke."""

from __future__ import annotations

from ..contract.errors import ModelConfigError


class TensorParallelConfigError(ModelConfigError):
    """A model / size / device combination tensor parallelism cannot run; names the field and the fix."""


class TensorParallelError(RuntimeError):
    """A rank failed, diverged or stopped answering: the pod's group cannot serve any more."""
