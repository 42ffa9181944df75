"""``python -m loraserve.runtime.executor.worker``: one follower rank of a pod's group.

Started by :func:`loraserve.runtime.executor.launch.start_tensor_parallel`, never by
hand. Reads ``(RuntimeConfig, TPOptions, random_weights)`` (pickled by its parent, rank
0, through a pipe only it holds) from stdin,
joins the group, builds its shard of the target model and follows rank 0 until told to
stop (exit 0). Any failure, or rank 0 disappearing, ends it with ``EXIT_TP_FAILURE``.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import threading
import time
import traceback

log = logging.getLogger("loraserve.executor")


def _watch_parent(parent: int, rank: int) -> None:
    """Exit as soon as rank 0 is gone, even while blocked inside a collective."""
    from ..distributed.health import EXIT_TP_FAILURE

    while True:
        if os.getppid() != parent:
            print(
                f"loraserve tensor-parallel rank {rank}: rank 0 (pid {parent}) is gone; stopping",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_TP_FAILURE)
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loraserve-tp-worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format=f"%(asctime)s %(levelname)s tp-rank-{args.rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    threading.Thread(target=_watch_parent, args=(args.parent, args.rank), daemon=True).start()

    import torch
    import torch.distributed as dist

    from ..distributed import context
    from ..distributed.group import init_group
    from ..distributed.health import EXIT_TP_FAILURE, reset_health
    from ..runner.model_runner import ModelRunner
    from .follower import Follower

    config, options, random_weights = pickle.load(sys.stdin.buffer)
    health = reset_health(exit_on_failure=False)
    name = str(config.device)
    use_cuda = name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", args.rank) if use_cuda else torch.device("cpu")
    try:
        group = init_group(
            rank=args.rank,
            size=args.size,
            store=dist.FileStore(args.store, args.size),
            device=device,
            collective_timeout_s=options.collective_timeout_s,
            control_timeout_s=options.control_timeout_s,
            startup_timeout_s=options.startup_timeout_s,
        )
        context.set_current(context.TPContext(group=group, health=health))
        runner = ModelRunner(config, random_weights=random_weights)
        Follower(runner, group).run()
    except BaseException as exc:
        from ..distributed.errors import TensorParallelError

        if not isinstance(exc, TensorParallelError):
            traceback.print_exc()
        print(f"loraserve tensor-parallel rank {args.rank} failed: {exc}", file=sys.stderr, flush=True)
        # No clean-up: collectives other ranks abandoned may never complete.
        os._exit(EXIT_TP_FAILURE)
    # Told to stop by rank 0: nothing is left to tear down. Destroying a gloo group (or
    # letting interpreter exit destroy it) can abort in C++ ("terminate called without an
    # active exception") when rank 0 leaves the group at the same moment, turning a clean
    # stop into SIGABRT; exit directly once output is flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
