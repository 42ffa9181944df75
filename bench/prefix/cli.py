"""Build the model and adapters, run every workload cache off then on, report."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import tempfile
from pathlib import Path

import torch

from bench.runtime import PRESETS, write_model_config, write_random_adapter
from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES, RuntimeConfig
from loraserve.runtime.engine import Engine
from loraserve.runtime.runner.model_runner import ModelRunner

from ..harness import add_output_args, environment, write_report
from .driver import HitCounter, RunResult, run_sessions
from .report import HEADER, row, summary, workload_label
from .workloads import WORKLOADS, Shape, adapter_names, with_think_time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/prefix", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model and workload (seconds)")
    p.add_argument("--size", default="8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument(
        "--think-s",
        default=None,
        help="comma list of users' mean think times in seconds, each a run of every workload"
        " (0: the next request the instant an answer ends); default 2,0 (smoke 0)",
    )
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool (default: from free memory)")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--chunked-prefill", type=int, default=8192)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument(
        "--max-admission-defer-steps",
        type=int,
        default=None,
        help="the scheduler's admission deferral (default: the runtime's); 0 admits at once",
    )
    add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.device, args.dtype = "smoke", "cpu", "float32"
        args.max_total_tokens = args.max_total_tokens or 16384
        args.chunked_prefill = 256
    default_think = "0" if args.smoke else "2,0"
    args.think_s = [float(x) for x in (args.think_s or default_think).split(",")]
    return args


def build_engine(model_dir: Path, adapters: dict[str, str], args, prefix_cache: bool) -> tuple[Engine, HitCounter]:
    cfg = RuntimeConfig()
    cfg.model.path = str(model_dir)
    cfg.model.dtype = args.dtype
    cfg.device = args.device
    cfg.lora.max_rank = 16
    cfg.lora.max_loras_per_batch = len(adapters)
    cfg.lora.max_loaded_loras = len(adapters)
    cfg.lora.target_modules = DEFAULT_LORA_MODULES
    cfg.lora.adapters = adapters
    cfg.scheduler.max_running_requests = args.max_running
    cfg.scheduler.max_total_tokens = args.max_total_tokens
    cfg.scheduler.chunked_prefill_size = args.chunked_prefill
    cfg.scheduler.max_prefill_tokens = max(args.chunked_prefill, 8192)
    cfg.scheduler.prefix_cache = prefix_cache
    if args.max_admission_defer_steps is not None:
        cfg.scheduler.max_admission_defer_steps = args.max_admission_defer_steps
    cfg.cuda_graph.enabled = args.cuda_graphs
    runner = ModelRunner(cfg, random_weights=True)
    hits = HitCounter()
    engine = Engine(cfg, runner, observer=hits)
    engine.start()
    return engine, hits


def run_one(
    name: str, think_s: float, shape: Shape, model_dir: Path, adapters: dict[str, str], args, cache: bool
) -> RunResult:
    engine, hits = build_engine(model_dir, adapters, args, cache)
    try:
        vocab = engine.runner.vocab_size
        # Warm-up (kernels, graphs) on prompts the measured run never repeats.
        warm = WORKLOADS["no-shared-prefix"](Shape(adapters=shape.adapters, system_tokens=8, users=shape.adapters,
                                                   question_tokens=8, rounds=1), vocab, seed=99)  # fmt: skip
        run_sessions(engine, warm, 2, f"warm-{name}")
        hits.hit = hits.query = 0
        evicted_before = engine.kv.prefix_evicted_tokens
        sessions = with_think_time(WORKLOADS[name](shape, vocab), think_s)
        result = run_sessions(engine, sessions, shape.output_tokens, name)
        result.hit_tokens, result.query_tokens = hits.hit, hits.query
        result.evicted_tokens = engine.kv.prefix_evicted_tokens - evicted_before
        return result
    finally:
        engine.shutdown(drain_timeout_s=1.0)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = Shape.smoke() if args.smoke else Shape()
    lines = [
        f"# Prefix cache per adapter ({args.size}, {args.device}, {platform.node()})",
        "",
        f"shape: {shape}",
        "",
        *HEADER,
    ]
    summaries = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_config(Path(tmp) / "model", args.size)
        from loraserve.runtime.model import load_arch_config

        arch = load_arch_config(model_dir)
        adapters = {
            name: str(write_random_adapter(Path(tmp) / name, arch, rank=8, seed=i))
            for i, name in enumerate(adapter_names(shape))
        }
        for think_s in args.think_s:
            for name in args.workloads.split(","):
                off = run_one(name, think_s, shape, model_dir, adapters, args, cache=False)
                on = run_one(name, think_s, shape, model_dir, adapters, args, cache=True)
                label = workload_label(name, think_s)
                lines += [row(label, False, off, None), row(label, True, on, off)]
                summaries.append(summary(label, off, on))
                print(lines[-2], lines[-1], sep="\n", flush=True)
    text = "\n".join(lines) + "\n"
    write_report(text, {"env": environment(args.device), "workloads": summaries}, out=args.out, json_to=args.json,
                 name="prefix")  # fmt: skip
    print(json.dumps(summaries))
    return 0
