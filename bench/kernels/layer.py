"""One whole layer: the LoRA of seven modules against the layer's base GEMMs."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from loraserve.kernels.overlap import OverlapMode, OverlapPolicy, linear_with_lora
from loraserve.kernels.triton_backend import TritonLoRABackend
from loraserve.kernels.triton_ops.configs import GemmConfig, gemm_config
from loraserve.kernels.triton_ops.gemm_expand import gemm_linear, launch_gemm_expand

from .report import fmt
from .shapes import Module, Workload, batch_info, make_b, request_slots
from .timing import num_sms, sm_carveout, time_replays, trace_replay
from .variants import BACKENDS, CARVEOUTS, MIXED_DELTA, OVERLAPS, TRITON_GEMM, TUNED, describe, path_of


def bench_layer(
    device, modules, scenarios, reps, layers: int, deadline, tuned=None, trace_dir=None
) -> list[dict]:
    """LoRA of all seven modules (4 apply calls) vs the base GEMMs, over ``layers`` layers' weights."""
    gen = torch.Generator().manual_seed(3)
    dt = torch.bfloat16
    base = [
        {
            name: torch.randn(m.out_dim, m.in_dim, device=device, dtype=dt) * 0.02
            for name, m in modules.items()
        }
        for _ in range(layers)
    ]
    results = []
    for w, variants in scenarios:
        for variant in variants:
            if time.time() > deadline:
                print(f"[deadline] skipping layer {w.label()} {variant}", flush=True)
                continue
            try:
                label = w.label().replace(" [graph]", "")
                res = layer_case(
                    device, modules, base, w, gen, reps, variant, (tuned or {}).get(label), trace_dir
                )
                results.append(res)
                print(
                    f"layer {w.label():28s} {variant:17s} lora {fmt(res['lora_us'], '7.2f')} us  base {res['base_us']:7.2f} us"
                    f"  lora/base {fmt(res['lora_pct_of_base'], '5.1f')}%  in-situ +{res['increment_pct']:5.1f}%"
                    f"  paths {res['paths']}",
                    flush=True,
                )
            except Exception:
                traceback.print_exc()
    return results


class LayerCase:
    """One workload and backend ``variant`` over the layers of ``base``: the weights and
    activations of every layer's seven modules, and a layer's LoRA alone, base GEMMs alone
    and both as the variant runs them.

    ``tuned`` ({module: best of ``tune_module``}) gives each module its own two-launch
    configuration (the ``tuned*`` variants)."""

    def __init__(
        self, device, modules: dict[str, Module], base: list[dict], w: Workload, gen, variant: str, tuned
    ):
        dt = torch.bfloat16
        self.device, self.modules, self.base, self.variant = device, modules, base, variant
        self.overlapped = variant in OVERLAPS or variant in TRITON_GEMM
        self.backend = BACKENDS[variant]() if variant in BACKENDS else TritonLoRABackend(pdl=variant == "pdl")
        self.backends = self._backends(w, tuned)
        R = w.pool_rank
        slots = request_slots(w, gen)
        self.info = info = batch_info(w, slots, [w.rank] * w.adapters, [1.0 / w.rank] * w.adapters, device)
        T = self.tokens = info.total_tokens
        h = torch.randn(T, modules["qkv"].in_dim, device=device, dtype=dt)
        self.inputs = {
            "qkv": h,
            "o": torch.randn(T, modules["o"].in_dim, device=device, dtype=dt),
            "gate_up": h,
            "down": torch.randn(T, modules["down"].in_dim, device=device, dtype=dt),
        }
        self.outs = {name: torch.randn(T, m.out_dim, device=device, dtype=dt) for name, m in modules.items()}
        self.lora = [
            {
                name: (
                    torch.randn(w.adapters, len(m.widths) * R, m.in_dim, device=device, dtype=dt) * 0.02,
                    make_b(w.adapters, m.out_dim, R, w.rank_major_b, device=device, dtype=dt).mul_(0.02),
                )
                for name, m in modules.items()
            }
            for _ in range(len(base))
        ]
        self.side = torch.cuda.Stream(device) if self.overlapped and device.type == "cuda" else None
        overlap = OVERLAPS.get(variant) or OverlapPolicy().mode_for(T, info.num_tiles, torch.device("cuda"))
        self.modes = {
            name: (OverlapMode.DELTA if name in MIXED_DELTA else OverlapMode.SHRINK)
            if overlap == "mixed"
            else overlap
            for name in modules
        }
        self.gemm_cfgs: dict[str, GemmConfig] = {
            name: gemm_config(T, m.out_dim, m.in_dim, dt, num_sms(device)) for name, m in modules.items()
        }
        self.delta_join = variant == "epilogue-auto" and info.num_tiles <= OverlapPolicy().delta_max_tiles
        self.paths = self._paths()

    def _backends(self, w: Workload, tuned) -> dict[str, TritonLoRABackend]:
        """The backend of each module: the variant's, or for ``tuned*`` each module's own."""
        if self.variant not in TUNED:
            return {name: self.backend for name in self.modules}
        if not tuned or set(tuned) != set(self.modules):
            raise RuntimeError(f"{self.variant}: no tuned configuration for every module of {w.label()}")
        return {
            name: TritonLoRABackend(fused=False, shrink_config=t["shrink"], expand_config=t["expand"])
            for name, t in tuned.items()
        }

    def _paths(self) -> dict[str, str]:
        """What each module runs, for the report: the backend's path, and the join or GEMM."""
        if self.variant in TRITON_GEMM:
            return {
                name: "delta" if self.delta_join else f"{self.variant}[{describe(self.gemm_cfgs[name])}]"
                for name in self.modules
            }
        paths = {}
        for name, m in self.modules.items():
            path = path_of(
                self.backends[name], self.info, self.inputs[name], self.lora[0][name][1], m.offsets
            )
            paths[name] = path.split(" ")[0]  # fused or two-launch
        if self.overlapped:
            paths = {name: f"{p}+{self.modes[name].value}" for name, p in paths.items()}
        return paths

    def lora_layer(self, li: int) -> None:
        """Layer ``li``'s LoRA alone: every module's apply into its output."""
        for name, m in self.modules.items():
            A, B = self.lora[li][name]
            self.backends[name].apply(self.inputs[name], A, B, self.info, self.outs[name], m.offsets)

    def base_layer(self, li: int) -> None:
        """Layer ``li``'s base GEMMs alone."""
        for name in self.modules:
            self.outs[name] = F.linear(self.inputs[name], self.base[li][name])

    def both_layer(self, li: int) -> None:
        """Layer ``li`` with LoRA: serial, beside the GEMM on a side stream, or in a Triton GEMM."""
        for name, m in self.modules.items():
            A, B = self.lora[li][name]
            x, W = self.inputs[name], self.base[li][name]
            if self.variant in TRITON_GEMM:
                self.outs[name] = self._triton_gemm(name, m, li)
                continue
            if not self.overlapped:
                y = F.linear(x, W)
                self.backends[name].apply(x, A, B, self.info, y, m.offsets)
            else:
                y = linear_with_lora(
                    self.backends[name], x, A, B, self.info, m.offsets, lambda x=x, W=W: F.linear(x, W),
                    mode=self.modes[name], side=self.side,
                )  # fmt: skip
            self.outs[name] = y

    def _triton_gemm(self, name: str, m: Module, li: int) -> torch.Tensor:
        """The Triton base GEMM: alone (``gemm-only``), the delta join at few tiles
        (``epilogue-auto``), else the shrink and then the GEMM with the expand in its epilogue."""
        A, B = self.lora[li][name]
        x, W = self.inputs[name], self.base[li][name]
        if self.variant == "gemm-only":
            return gemm_linear(x, W, None, self.gemm_cfgs[name])
        if self.delta_join:
            return linear_with_lora(
                self.backend, x, A, B, self.info, m.offsets, lambda: F.linear(x, W), mode=OverlapMode.DELTA,
                side=self.side,
            )  # fmt: skip
        stage = self.backend.shrink_stage(x, A, self.info, len(m.widths))
        return launch_gemm_expand(x, W, None, stage, B, self.info, m.offsets, self.gemm_cfgs[name])


def layer_case(
    device,
    modules,
    base,
    w: Workload,
    gen,
    reps,
    variant: str = "default",
    tuned=None,
    trace_dir: Path | None = None,
) -> dict:
    """Three graphs over the same layers (:class:`LayerCase`): LoRA only, base GEMMs only,
    both interleaved; with ``trace_dir``, one replay of one layer's kernel timeline too."""
    case = LayerCase(device, modules, base, w, gen, variant, tuned)
    layers = range(len(base))
    # The overlapped variants have no "LoRA alone": their cost is what they add to the layer.
    t_lora = (
        None
        if case.overlapped
        else time_replays([lambda i=i: case.lora_layer(i) for i in layers], device, reps)
    )
    t_base = time_replays([lambda i=i: case.base_layer(i) for i in layers], device, reps)
    with sm_carveout(CARVEOUTS.get(variant, 0)):
        t_both = time_replays([lambda i=i: case.both_layer(i) for i in layers], device, reps)
    trace = None
    if trace_dir is not None and device.type == "cuda":
        name = (
            f"trace-{w.label()}-{variant}".replace(" ", "_")
            .replace("[", "")
            .replace("]", "")
            .replace("ᵀ", "T")
        )
        trace = trace_replay([lambda: case.both_layer(0)], device, trace_dir / f"{name}.csv")
        print(f"trace {w.label()} {variant}: {trace}", flush=True)
    return {
        "trace": trace,
        "workload": w.label(),
        "variant": variant,
        "tokens": case.tokens,
        "lora_us": None if t_lora is None else t_lora * 1e3,
        "base_us": t_base * 1e3,
        "base_plus_lora_us": t_both * 1e3,
        "lora_pct_of_base": None if t_lora is None else 100 * t_lora / t_base,
        "increment_pct": 100 * (t_both - t_base) / t_base,
        "paths": ",".join(f"{k}:{v}" for k, v in case.paths.items()),
    }
