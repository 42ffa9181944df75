"""One mixture-of-experts layer on the fused Triton path: the base model vs 8 LoRA adapters
on the experts.

The layer is Qwen3-30B-A3B's (hidden 2048, 128 experts, top-8 renormalised, expert width
768, bf16): router GEMM, top-k routing and the fused experts (``loraserve.kernels.moe``).
The LoRA rows give token ``i`` adapter ``i % adapters`` (rank 16 on every expert's
gate_up and down, in the adapter pool's layout), so a batch of ``bs`` decode tokens
carries ``min(bs, adapters)`` distinct adapters. Timed with CUDA events, eagerly and as a
replayed CUDA graph (routing buffers sized for the batch's token rows). Before timing,
each batch is checked: the kernels against the float64 reference on a few rows, the
graph replay against the eager run, and the adapters' output against the base's.

    python bench/moe.py --out moe.json                   # GPU: markdown on stdout, JSON to --out
    TRITON_INTERPRET=1 python bench/moe.py --smoke --out /tmp/moe.json   # CPU, tiny, seconds
"""

from __future__ import annotations

import argparse
import json
import runpy
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loraserve.kernels import moe
from loraserve.kernels.moe import reference
from loraserve.runtime.model.moe import route

harness = runpy.run_path(str(Path(__file__).resolve().parent / "bootstrap.py"))["import_module"]("harness")


@dataclass(frozen=True)
class Shape:
    hidden: int
    experts: int
    top_k: int
    inter: int
    rank: int
    dtype: torch.dtype


SHAPES = {
    "qwen3-30b-a3b": Shape(hidden=2048, experts=128, top_k=8, inter=768, rank=16, dtype=torch.bfloat16),
    "smoke": Shape(hidden=64, experts=8, top_k=2, inter=32, rank=4, dtype=torch.float32),
}
CHECK_ROWS = 2  # rows checked against the float64 reference (its gathered weights are large)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative error against float64


@dataclass
class Layer:
    """The router and experts, plus the adapters' expert LoRA in the pool's layout."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    parts: dict[str, moe.ExpertLoRA]
    scalings: torch.Tensor


def build_layer(shape: Shape, adapters: int, device: torch.device, seed: int = 0) -> Layer:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size: int, scale: float) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(shape.dtype)

    h, e, i, r = shape.hidden, shape.experts, shape.inter, shape.rank
    ranks = torch.full((adapters,), r, dtype=torch.int32, device=device)
    parts = {
        # B rank-major ([.., r, out] storage, transposed view), as the adapter pool holds it
        "gate_up": moe.ExpertLoRA(
            rand(adapters, e, 2 * r, h, scale=h**-0.5), rand(adapters, e, r, 2 * i, scale=r**-0.5).transpose(2, 3),
            (0, i, 2 * i), ranks,
        ),
        "down": moe.ExpertLoRA(
            rand(adapters, e, r, i, scale=i**-0.5), rand(adapters, e, r, h, scale=r**-0.5).transpose(2, 3), (0, h), ranks
        ),
    }  # fmt: skip
    return Layer(
        router=rand(e, h, scale=h**-0.5),
        gate_up=rand(e, 2 * i, h, scale=h**-0.5),
        down=rand(e, h, i, scale=i**-0.5),
        parts=parts,
        scalings=torch.full((adapters,), 2.0, device=device),
    )


def forward_fn(layer: Layer, shape: Shape, x: torch.Tensor, slots: torch.Tensor | None, buffers) -> Callable[[], torch.Tensor]:
    """The layer's forward on ``x`` (router, routing, experts); ``slots`` None: base model."""
    lora = None if slots is None else moe.MoELoRA(slots, layer.scalings, **layer.parts)

    def run() -> torch.Tensor:
        weights, ids = route(x @ layer.router.T, shape.top_k, True)
        return moe.fused_moe(x, layer.gate_up, layer.down, weights, ids, lora, buffers)

    return run


def check(layer: Layer, shape: Shape, x: torch.Tensor, slots: torch.Tensor) -> dict[str, float]:
    """Kernels vs float64 on the first rows, with and without the adapters; adapters vs base."""
    rows = slice(0, CHECK_ROWS)
    weights, ids = route(x[rows] @ layer.router.T, shape.top_k, True)
    out = {}
    for name, lora in (("base", None), ("lora", moe.MoELoRA(slots[rows], layer.scalings, **layer.parts))):
        got = moe.fused_moe(x[rows], layer.gate_up, layer.down, weights, ids, lora)
        want = reference.fused_moe(x[rows], layer.gate_up, layer.down, weights, ids, lora)
        out[f"{name}_vs_float64"] = ((got.double() - want).norm() / want.norm()).item()
        out[f"_{name}"] = got
    out["lora_vs_base"] = ((out.pop("_lora") - out.pop("_base")).double().norm() / x[rows].double().norm()).item()
    return out


def graph_fn(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """``fn`` captured into a CUDA graph: (replay, the graph's output tensor)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls."""

    def many() -> None:
        for _ in range(iters):
            fn()

    return harness.median_ms(many, device, warmup=1, repeats=repeats) / iters


def bench_batch(layer: Layer, shape: Shape, bs: int, adapters: int, device: torch.device, args) -> dict:
    gen = torch.Generator(device=device).manual_seed(bs)
    x = torch.randn(bs, shape.hidden, generator=gen, device=device).to(shape.dtype)
    slots = (torch.arange(bs, device=device) % adapters).to(torch.int32)
    row: dict = {"bs": bs, "tokens": bs, "pairs": bs * shape.top_k, "adapters": min(bs, adapters)}
    row.update(check(layer, shape, x, slots))
    buffers = moe.MoEBuffers(bs, shape.top_k, shape.experts, adapters, device)
    for name, s in (("base", None), ("lora", slots)):
        fn = forward_fn(layer, shape, x, s, buffers)
        row[f"{name}_eager_ms"] = time_ms(fn, device, args.iters, args.repeats)
        if device.type == "cuda":
            replay, graph_out = graph_fn(fn)
            row[f"{name}_graph_ms"] = time_ms(replay, device, args.iters, args.repeats)
            replay()
            row[f"{name}_graph_vs_eager"] = (graph_out.float() - fn().float()).abs().max().item()
    for mode in ("eager", "graph"):
        if f"base_{mode}_ms" in row:
            row[f"lora_overhead_{mode}"] = row[f"lora_{mode}_ms"] / row[f"base_{mode}_ms"] - 1
    tol = TOLERANCE[shape.dtype]
    row["checks_ok"] = (
        row["base_vs_float64"] < tol and row["lora_vs_float64"] < tol and row["lora_vs_base"] > 1e-3
        and all(row.get(f"{n}_graph_vs_eager", 0.0) == 0.0 for n in ("base", "lora"))
    )  # fmt: skip
    return row


def table(rows: list[dict], shape_name: str) -> str:
    cols = ["bs", "adapters", "base_eager_ms", "lora_eager_ms", "lora_overhead_eager",
            "base_graph_ms", "lora_graph_ms", "lora_overhead_graph", "lora_vs_float64", "checks_ok"]  # fmt: skip
    cols = [c for c in cols if any(c in r for r in rows)]
    lines = [f"MoE layer `{shape_name}`, fused Triton path", "", "| " + " | ".join(cols) + " |"]
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if isinstance(v, float):
                v = f"{v:+.1%}" if c.startswith("lora_overhead") else (f"{v:.4f}" if c.endswith("_ms") else f"{v:.2e}")
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated decode batch sizes (default 1,32,64)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", required=True, help="write the JSON record here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape_name = "smoke" if args.smoke else "qwen3-30b-a3b"
    if args.smoke:
        args.iters, args.repeats = 1, 1
    if device.type != "cuda" and not args.smoke:
        parser.error("the full-size layer needs a GPU: pass --smoke on the CPU")
    sizes = [int(b) for b in (args.batch_sizes or ("1,4" if args.smoke else "1,32,64")).split(",")]
    shape = SHAPES[shape_name]
    env = harness.environment(device)
    harness.log(harness.environment_line(env))
    layer = build_layer(shape, args.adapters, device)
    rows = []
    for bs in sizes:
        with torch.no_grad():
            rows.append(bench_batch(layer, shape, bs, args.adapters, device, args))
        harness.log(f"bs {bs}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'bs'}, default=str)}")
    print(table(rows, shape_name), flush=True)
    shape_record = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in asdict(shape).items()}
    record = {"shape": shape_name, "dims": shape_record, "adapters": args.adapters, "env": env, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0 if all(r["checks_ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
