"""Start a pod's tensor-parallel group: this process is rank 0, one worker process per other GPU.

The runtime's entry point calls :func:`start_tensor_parallel` before it builds the
target runner. Rank 0 (this process) keeps serving HTTP and scheduling; ranks 1..N-1
are ``python -m loraserve.runtime.executor.worker`` processes that build their shard of
the model and follow rank 0's steps. Every rank meets through a file store in a private
temporary directory (no listening socket for the rendezvous) and talks over loopback.

Failure handling: a monitor thread waits on every worker; if one exits while the group
is serving, rank 0 reports the failure (``distributed.health``: ``/ready`` turns 503) and
exits with ``EXIT_TP_FAILURE`` after a short grace period. Workers exit the same way
when rank 0 disappears (their parent changes) or stops answering (control timeout).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ..contract.config import RuntimeConfig
from ..distributed import context
from ..distributed.errors import TensorParallelConfigError
from ..distributed.group import TPGroup, destroy_group, init_group
from ..distributed.health import TPHealth, reset_health
from ..distributed.sharding import check_tensor_parallel
from ..model.arch import load_arch_config
from .driver import Driver

log = logging.getLogger("loraserve.executor")

WORKER_MODULE = "loraserve.runtime.executor.worker"


@dataclass
class TPOptions:
    """Timeouts of a tensor-parallel group (seconds). ``from_env`` reads ``LORASERVE_TP_*``."""

    collective_timeout_s: float = 300.0
    """A model collective (all-reduce / all-gather) waiting longer fails the group."""
    control_timeout_s: float = 60.0
    """A follower hearing nothing from rank 0 for this long (no step, no heartbeat) fails."""
    heartbeat_s: float = 5.0
    """Rank 0 sends an empty message after this long without a step."""
    startup_timeout_s: float = 1800.0
    """Joining the group and loading every rank's shard of the weights."""
    failure_grace_s: float = 2.0
    """After a failure, how long rank 0 keeps answering (``/ready`` 503) before it exits."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> TPOptions:
        env = os.environ if env is None else env
        out = cls()
        for f in fields(cls):
            key = "LORASERVE_TP_" + f.name.removesuffix("_s").upper() + "_S"
            if key in env:
                try:
                    value = float(env[key])
                except ValueError as exc:
                    raise TensorParallelConfigError(f"{key}={env[key]!r} is not a number of seconds") from exc
                if value <= 0:
                    raise TensorParallelConfigError(f"{key} must be > 0, got {value}")
                setattr(out, f.name, value)
        out.validate()
        return out

    def validate(self) -> None:
        """Raise :class:`TensorParallelConfigError` for timeouts that cannot work together."""
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise TensorParallelConfigError(f"{f.name} must be > 0, got {getattr(self, f.name)}")
        if self.heartbeat_s * 2 > self.control_timeout_s:
            raise TensorParallelConfigError(
                f"LORASERVE_TP_HEARTBEAT_S ({self.heartbeat_s}) must be well under "
                f"LORASERVE_TP_CONTROL_TIMEOUT_S ({self.control_timeout_s}): at most half of it"
            )


class TPHandle:
    """Rank 0's handle on its group: the worker processes, the driver, the shutdown."""

    def __init__(
        self, group: TPGroup, driver: Driver, health: TPHealth, workers: list[subprocess.Popen], store_dir: str
    ):
        self.group = group
        self.driver = driver
        self.health = health
        self.workers = workers
        self._store_dir = store_dir
        self._stopping = threading.Event()
        for rank, proc in enumerate(workers, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"loraserve-tp-watch-{rank}", daemon=True
            ).start()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._stopping.is_set():
            self.health.report_failure(
                f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {code}: "
                "the pod cannot serve without it"
            )

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (cleanly when possible), leave the group. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.driver.stop()
        for proc in self.workers:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        context.set_current(None)
        destroy_group()
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def __enter__(self) -> TPHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _device_for(config: RuntimeConfig, size: int) -> torch.device:
    name = str(config.device)
    use_cuda = name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TensorParallelConfigError(f"device {name!r} was asked for but CUDA is not available: use device=cpu")
    visible = torch.cuda.device_count()
    if visible < size:
        raise TensorParallelConfigError(
            f"parallel.tensor_parallel_size={size} needs {size} GPUs but {visible} are visible: "
            f"request {size} GPUs per replica (spec.gpus) or lower the size"
        )
    return torch.device("cuda", 0)


def _loopback_defaults() -> None:
    # Every rank of a pod is on one host: keep rendezvous and bootstrap traffic off the network.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def start_tensor_parallel(
    config: RuntimeConfig,
    *,
    options: TPOptions | None = None,
    exit_on_failure: bool = True,
    random_weights: bool = False,
) -> TPHandle | None:
    """Start ranks 1..N-1 and join the group as rank 0; None when the size is 1.

    Blocks until every rank has joined (``startup_timeout_s``). Validates first, so a
    size the model cannot be split into fails before any process starts. With
    ``exit_on_failure=False`` (tests) a failure is recorded and raised, not fatal.
    ``random_weights`` (benchmarks) is passed to every worker's runner; rank 0 must
    build its own runner with the same configuration and flag (the ranks check).
    """
    size = int(config.parallel.tensor_parallel_size)
    if size <= 1:
        return None
    if context.current() is not None:
        raise RuntimeError("a tensor-parallel group is already running in this process")
    options = options or TPOptions.from_env()
    options.validate()
    arch = load_arch_config(config.model.path, architecture_override=config.model.architecture)
    check_tensor_parallel(arch, size)
    device = _device_for(config, size)
    _loopback_defaults()
    health = reset_health(exit_on_failure=exit_on_failure, grace_s=options.failure_grace_s)
    store_dir = tempfile.mkdtemp(prefix="loraserve-tp-")  # mode 0700: only this user's ranks
    store_path = os.path.join(store_dir, "store")
    payload = pickle.dumps((config, options, random_weights))
    workers: list[subprocess.Popen] = []
    try:
        for rank in range(1, size):
            cmd = [
                sys.executable,
                "-P",  # never the working directory on sys.path (a checkout's operator/ shadows the stdlib)
                "-m",
                WORKER_MODULE,
                "--rank", str(rank),
                "--size", str(size),
                "--store", store_path,
                "--parent", str(os.getpid()),
                "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            ]  # fmt: skip
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(payload)
            proc.stdin.close()
            workers.append(proc)
        store = dist.FileStore(store_path, size)
        group = init_group(
            rank=0,
            size=size,
            store=store,
            device=device,
            collective_timeout_s=options.collective_timeout_s,
            control_timeout_s=options.control_timeout_s,
            startup_timeout_s=options.startup_timeout_s,
        )
    except BaseException:
        for proc in workers:
            proc.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
        raise
    driver = Driver(group, health, heartbeat_s=options.heartbeat_s)
    context.set_current(context.TPContext(group=group, health=health, driver=driver))
    handle = TPHandle(group, driver, health, workers, store_dir)
    atexit.register(handle.shutdown)
    global _HANDLE
    _HANDLE = handle
    log.info("tensor parallelism: rank 0 of %d on %s; worker pids %s", size, device, handle.worker_pids)
    return handle


_HANDLE: TPHandle | None = None


def build_target_runner(config: RuntimeConfig, **launch):
    """The serving process's target ``ModelRunner``: with ``tensor_parallel_size > 1``
    the pod's group is started first (this process becomes rank 0).

    The one call the runtime's entry point needs; with one GPU it is ``ModelRunner(config)``.
    ``launch``: keyword arguments of :func:`start_tensor_parallel` (tests: timeouts).
    """
    from ..runner.model_runner import ModelRunner

    if int(config.parallel.tensor_parallel_size) > 1 and context.current() is None:
        start_tensor_parallel(config, **launch)
    return ModelRunner(config)


def shutdown_tensor_parallel(timeout_s: float = 10.0) -> None:
    """Stop this process's group, if it started one (also runs at exit)."""
    global _HANDLE
    handle, _HANDLE = _HANDLE, None
    if handle is not None:
        handle.shutdown(timeout_s)
