"""Test-only: a slow model load for the end-to-end stand-in cluster (a "slow node").

The kubelet stand-in (``kubelet.py``, ``Kubelet.model_load_delay_s``) puts this directory
on ``PYTHONPATH`` with ``LORASERVE_E2E_MODEL_LOAD_DELAY_S`` set; Python imports it at
start-up. When the process imports ``loraserve.runtime.builder``, its
``build_engine`` is wrapped to sleep that long first, so the server listens, reads its
catalog file and takes catalog pushes while "the model loads", as a runtime reading a large
model from a slow volume does. Nothing in the product reads the variable; without it this
module does nothing, and other processes (hooks) never import the runtime because of it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time

TARGET = "loraserve.runtime.builder"
DELAY_S = float(os.environ.get("LORASERVE_E2E_MODEL_LOAD_DELAY_S") or 0)


def _slowed(module) -> None:  # type: ignore[no-untyped-def]
    build = module.build_engine

    @functools.wraps(build)
    def build_engine(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(DELAY_S)  # build_engine runs off the event loop (a worker thread)
        return build(*args, **kwargs)

    module.build_engine = build_engine


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of :data:`TARGET` to patch it once run."""

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            run(module)
            _slowed(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if DELAY_S > 0:
    sys.meta_path.insert(0, _Finder())
