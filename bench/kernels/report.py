"""``kernels.json`` and ``kernels.md``: everything measured so far."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..harness import table
from .module_bench import Row
from .variants import describe


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or a dash where a variant has no such number."""
    return "-" if value is None else format(value, spec)


def markdown(env, rows, sweeps, layer, tuned=None) -> str:
    """``kernels.md``: the environment, then a section per phase that has results."""
    lines = ["# LoRA kernels", ""]
    lines += [f"- {k}: {v}" for k, v in env.items() if k != "gemm"]
    if env.get("gemm"):
        lines += _gemm_lines(env["gemm"])
    lines += _module_lines(rows) + _sweep_lines(sweeps) + _layer_lines(layer)
    if tuned:
        lines += _tune_lines(tuned)
    return "\n".join(lines) + "\n"


def _section(title: str, header: str, rows) -> list[str]:
    """A titled table; ``header``'s cells are ``|``-separated."""
    return ["", f"## {title}", "", *table([h.strip() for h in header.split("|")], rows)]


def _gemm_lines(gemm: list[dict]) -> list[str]:
    """The Triton base GEMM against cuBLAS (``--layer epilogue``)."""
    return _section(
        "Triton base GEMM (no LoRA) vs cuBLAS (graph replay, 8 weight copies rotating; * = heuristic)",
        "module | tokens | cuBLAS µs | TB/s | Triton µs | TB/s | Triton / cuBLAS | configuration",
        ([g["module"], g["tokens"], f"{g['cublas_us']:.2f}", f"{g['cublas_tb_s']:.2f}", f"{g['triton_us']:.2f}",
          f"{g['triton_tb_s']:.2f}", f"{g['ratio']:.3f}", f"{'*' if g['heuristic'] else ''}{g['config']}"]
         for g in gemm),
    )  # fmt: skip


def _module_lines(rows: list[Row]) -> list[str]:
    """Per-module timings, Triton against torch."""
    return _section(
        "Per module (median per call, graph replay, rotating inputs)",
        "module | workload | variant | tokens | MB moved | Triton µs | torch µs | speed-up | % copy BW | weights % | path",
        ([r.module, r.workload, r.variant, r.tokens, f"{r.bytes / 1e6:.2f}", f"{r.triton_us:.2f}",
          f"{r.torch_us:.2f}", f"{r.speedup:.2f}", f"{100 * r.bw_frac:.1f}", f"{100 * r.weight_frac:.0f}",
          r.extra.get("path", "")] for r in rows),
    )  # fmt: skip


def _sweep_lines(sweeps: list[dict]) -> list[str]:
    """The launch-configuration sweep."""
    return _section(
        "Launch-configuration sweep", "module | workload | variant | µs | % copy BW | configuration",
        ([s["module"], s["workload"], s["variant"], f"{s['us']:.2f}", f"{100 * s['bw_frac']:.1f}", s["config"]]
         for s in sweeps),
    )  # fmt: skip


def _layer_lines(layer: list[dict]) -> list[str]:
    """One whole layer, LoRA against the base GEMMs, per workload and variant."""
    return _section(
        "One Llama-3-8B layer (7 modules; base = 4 bf16 F.linear: fused qkv, o, fused gate/up, down)",
        "workload | variant | tokens | LoRA µs | base µs | LoRA % of base | base+LoRA µs | in-situ increment % | paths",
        ([x["workload"], x["variant"], x["tokens"], fmt(x["lora_us"], ".2f"), f"{x['base_us']:.2f}",
          fmt(x["lora_pct_of_base"], ".1f"), f"{x['base_plus_lora_us']:.2f}", f"{x['increment_pct']:.1f}", x["paths"]]
         for x in layer),
    )  # fmt: skip


def _tune_lines(tuned: dict[str, dict]) -> list[str]:
    """The tune phase's best configuration per workload and module."""
    return _section(
        "Tune phase (two launches; best per module and workload)",
        "workload | module | default µs | best µs | shrink | expand",
        ([label, name, f"{b['default_us']:.2f}", f"{b['us']:.2f}", describe(b["shrink"]), describe(b["expand"])]
         for label, per in tuned.items() for name, b in per.items()),
    )  # fmt: skip


def save(out_dir: Path, env, rows, sweeps, layer, tuned=None, tune_record=()) -> None:
    """Write ``kernels.json`` and ``kernels.md`` with what has been measured so far."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "env": env,
        "modules": [asdict(r) for r in rows],
        "sweep": sweeps,
        "layer": layer,
        "tuned": {
            label: {
                name: {**b, "shrink": asdict(b["shrink"]), "expand": asdict(b["expand"])}
                for name, b in per.items()
            }
            for label, per in (tuned or {}).items()
        },
        "tune_record": list(tune_record),
    }
    (out_dir / "kernels.json").write_text(json.dumps(payload, indent=1, default=str))
    (out_dir / "kernels.md").write_text(markdown(env, rows, sweeps, layer, tuned))


def print_summary(layer: list[dict], rows: list[Row]) -> None:
    """The short table printed last: what a reply shows of the run."""
    print("\n== layer: LoRA vs base GEMMs ==")
    for x in layer:
        print(
            f"{x['workload']:28s} {x['variant']:17s} lora {fmt(x['lora_us'], '7.2f')}us base {x['base_us']:7.2f}us "
            f"{fmt(x['lora_pct_of_base'], '5.1f')}%  in-situ +{x['increment_pct']:4.1f}%"
        )
    print("== modules: triton us / torch us / %copyBW ==")
    for r in rows:
        print(
            f"{r.module:7s} {r.workload:26s} {r.variant:10s} {r.triton_us:7.2f} {r.torch_us:8.2f} {100 * r.bw_frac:5.1f}%"
        )
