"""Build the model and adapters, cache the system prompts, time every batch size, report."""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.runtime import PRESETS, write_model_config, write_random_adapter
from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES, RuntimeConfig
from loraserve.runtime.model import load_arch_config
from loraserve.runtime.runner.cuda_graph import CudaGraphRunner
from loraserve.runtime.runner.model_runner import ModelRunner, resolve_device

from ..harness import add_output_args, environment, write_report
from .measure import ExtendBench, Row, cache_system_prompts

HEADER = [
    "| requests | real tokens | graph shape (width x requests) | eager ms | graph ms | speed-up | logits rel. err |",
    "|---:|---:|---|---:|---:|---:|---:|",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/extend_graphs", description=__doc__)
    p.add_argument(
        "--smoke", action="store_true", help="CPU, tiny model, the graph runner's static path (seconds)"
    )
    p.add_argument("--size", default="8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--prefix-len", type=int, default=1500, help="each adapter's cached system prompt")
    p.add_argument("--new-tokens", type=int, default=100, help="each request's question (its extend)")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=2048,
        help="cuda_graph.max_prefill_tokens (the runtime's default, 512, replays up to 4 x 128 tokens)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.device, args.dtype = "smoke", "cpu", "float32"
        args.batch_sizes, args.prefix_len, args.new_tokens = "1,2,4", 64, 16
        args.adapters, args.rank, args.max_prefill_tokens, args.warmup, args.repeats = 4, 8, 256, 1, 2
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


def build_runner(model_dir: Path, adapters: dict[str, str], args) -> tuple[ModelRunner, CudaGraphRunner]:
    """The target runner with ``adapters`` loaded and a prefix cache; its graph runner
    (on the CPU: the static path, the same padding run eagerly)."""
    cfg = RuntimeConfig()
    cfg.model.path = str(model_dir)
    cfg.model.dtype = args.dtype
    cfg.device = args.device
    cfg.lora.max_rank = args.rank
    cfg.lora.max_loras_per_batch = len(adapters)
    cfg.lora.max_loaded_loras = len(adapters)
    cfg.lora.target_modules = DEFAULT_LORA_MODULES
    cfg.lora.adapters = adapters
    most = max(args.batch_sizes)
    cfg.scheduler.max_running_requests = most + len(adapters)
    # The system prompts stay cached; each step's requests are freed after it.
    cfg.scheduler.max_total_tokens = len(adapters) * args.prefix_len + 2 * most * args.new_tokens + 1024
    cfg.scheduler.prefix_cache = True
    cfg.cuda_graph.enabled = True
    cfg.cuda_graph.max_bs = most
    cfg.cuda_graph.max_prefill_tokens = args.max_prefill_tokens
    runner = ModelRunner(cfg, random_weights=True)
    graphs = runner.graphs or CudaGraphRunner(
        runner, max_bs=most, max_prefill_tokens=args.max_prefill_tokens, use_graphs=False
    )
    return runner, graphs


def row(r: Row) -> str:
    shape = "eager (not replayed)" if r.shape is None else f"{r.shape.width} x {r.shape.batch_size}"
    return (
        f"| {r.requests} | {r.real_tokens} | {shape} | {r.eager_ms:.1f} | {r.graph_ms:.1f} | "
        f"{r.eager_ms / r.graph_ms:.2f}x | {r.rel_err:.1e} |"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = resolve_device(args.device)
    name = environment(device)["gpu"]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_config(Path(tmp) / "model", args.size)
        arch = load_arch_config(model_dir)
        adapters = {
            f"a{i}": str(write_random_adapter(Path(tmp) / f"a{i}", arch, rank=args.rank, seed=i))
            for i in range(args.adapters)
        }
        runner, graphs = build_runner(model_dir, adapters, args)
        systems = cache_system_prompts(runner, list(adapters), args.prefix_len, seed=7)
        bench = ExtendBench(runner, graphs, systems, args.new_tokens)
        lines = [
            f"# Extend steps after a cached prefix: eager vs CUDA graph ({args.size}, {name})",
            "",
            f"{args.new_tokens} new tokens per request after a cached {args.prefix_len}-token system prompt, "
            f"request i under adapter i % {args.adapters} (rank {args.rank}), {args.dtype}; "
            f"cuda_graph.max_prefill_tokens {args.max_prefill_tokens}; LoRA in graphs: {graphs.lora_in_graphs}; "
            f"captured graphs: {graphs.use_graphs}. Medians of {args.repeats} steps of ModelRunner.forward.",
            "",
            *HEADER,
        ]
        print("\n".join(lines), flush=True)
        for requests in args.batch_sizes:
            rows.append(bench.measure(requests, warmup=args.warmup, repeats=args.repeats))
            lines.append(row(rows[-1]))
            print(lines[-1], flush=True)
    lines += [
        "",
        f"Wall time {time.perf_counter() - started:.0f} s; {graphs.capture_failures} failed captures.",
    ]
    text = "\n".join(lines) + "\n"
    print(lines[-1])
    record = {"env": environment(device), "rows": [asdict(r) for r in rows]}
    write_report(text, record, out=args.out, json_to=args.json, name="extend_graphs")
    return 0
