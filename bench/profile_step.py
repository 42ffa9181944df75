"""Where a decoder step's kernel time goes, by op family, with the fused ops off and on.

torch.profiler over three kinds of step at the target's dimensions (8B by default), each
after warm-up steps: a plain decode step of ``--batch-size`` requests (request ``i`` with
adapter ``i % --adapters``), a target verify of ``--verify-width`` rows per request, and a
draft step (one decoder layer of the same dimensions plus the LM head, as an EAGLE head's or
a one-layer draft's decode). Every kernel is put in one family (GEMM, attention, LoRA, norm,
rotary, KV write, elementwise, other) by its name, else by the op and the Python frames that
launched it; the markdown table gives microseconds of kernel time per step and the share.
Steps run eagerly (kernel times are those of a CUDA-graph replay; the launch gaps are not
counted). On the CPU (``--smoke``: tiny dimensions) the leaf ops' CPU time stands in.

    python3 -P bench/profile_step.py --fused-ops off,on --out profile.md   # GPU
    python3 -P bench/profile_step.py --smoke                               # CPU, seconds
"""

from __future__ import annotations

import argparse
import runpy
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from loraserve.kernels import ForwardMode, model_ops
from loraserve.runtime.runner.forward_batch import ForwardBatch

HERE = Path(__file__).resolve().parent
FAMILIES = ["GEMM", "attention", "LoRA", "norm", "rotary", "rotary + KV write", "KV write", "elementwise", "other"]
# (family, substrings of a kernel's name), first match wins: the Triton kernels by their
# function names, then cuBLAS / CUTLASS GEMMs and attention libraries.
BY_NAME = [
    ("rotary + KV write", ("rotary_kv_write",)),
    ("LoRA", ("lora_", "gemm_expand", "sgmv", "bgmv")),
    ("norm", ("rms_norm",)),
    ("rotary", ("rotary",)),
    ("elementwise", ("silu_mul",)),
    ("attention", ("_split_kernel", "_combine_kernel", "flash", "fmha", "attention", "sdpa")),
    ("GEMM", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "sm80_", "ampere_", "cublas", "gemv", "splitk")),
]
# (family, substrings of a Python frame): the innermost frame that matches names the family
# of a kernel whose own name says nothing (torch's generic kernels, the CPU's ops).
BY_FRAME = [
    ("LoRA", ("kernels/backend.py", "kernels/reference.py", "triton_backend", "triton_ops/", "overlap.py",
              "runtime/lora/")),
    ("GEMM", ("layers/linear.py", "layers/parallel.py")),
    ("norm", ("rms_norm", "layers/norm.py")),
    ("rotary", ("rotary",)),
    ("attention", ("attention.py",)),
]  # fmt: skip
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def family(kernel: str, op: str = "", frames: Iterable[str] = ()) -> str:
    """The op family of a kernel (or, on the CPU, of a leaf op) named ``kernel``, launched by
    ``op`` under the Python ``frames`` (innermost first)."""
    low = kernel.lower()
    for fam, keys in BY_NAME:
        if any(k in low for k in keys):
            return fam
    if op.startswith("aten::index_copy") or "index_copy" in low:
        return "KV write"
    for frame in frames:
        for fam, keys in BY_FRAME:
            if any(k in frame for k in keys):
                return fam
    if op.startswith(GEMM_OPS):
        return "GEMM"
    return "elementwise" if op.startswith("aten::") or "elementwise" in low or "reduce" in low else "other"


def _frames(evt) -> list[str]:
    """The Python frames (and ops) above a profiled op: the profiler's Python tracer puts
    them in the event tree as its ancestors."""
    frames = []
    parent = evt.cpu_parent
    while parent is not None:
        frames.append(parent.name)
        parent = parent.cpu_parent
    return frames


def kernel_times(prof, device: torch.device) -> tuple[Counter, int]:
    """Microseconds by family and the kernel count of a profile."""
    times: Counter = Counter()
    launches = 0
    events = prof.events()
    if device.type != "cuda":  # the ops' own CPU time
        for evt in events:
            if evt.name.startswith("aten::") and evt.self_cpu_time_total > 0:
                times[family(evt.name, evt.name, _frames(evt))] += evt.self_cpu_time_total
                launches += 1
        return times, launches
    attributed: Counter = Counter()
    for evt in events:
        for k in getattr(evt, "kernels", ()):
            times[family(k.name, evt.name, _frames(evt))] += k.duration
            attributed[k.name] += k.duration
            launches += 1
    # Kernels no op launched (Triton's): by name, what the ops did not account for.
    device_total: Counter = Counter()
    for evt in events:
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            device_total[evt.name] += evt.time_range.elapsed_us()
            launches += evt.name not in attributed
    for name, total in device_total.items():
        if total - attributed[name] > 0.5:
            times[family(name)] += total - attributed[name]
    return times, launches


def profiled(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> tuple[Counter, int]:
    """Run ``warmup`` steps, then profile ``steps``; per-step times and launches."""
    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    times, launches = kernel_times(prof, device)
    return Counter({k: v / steps for k, v in times.items()}), launches // steps


def phases(target, draft, args, rt) -> dict[str, tuple[Counter, int]]:
    """Profile the decode, verify and draft steps."""
    bs, dev = args.batch_size, target.device
    names = [f"a{i % args.adapters}" if args.adapters else None for i in range(bs)]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, target.vocab_size, (bs,), generator=gen).to(dev)
    out = {}
    rids = [f"d{i}" for i in range(bs)]
    rt["prefill"](target, rids, names, args.prompt_len, seed=1)
    out["decode"] = profiled(
        lambda: target.forward(ForwardBatch(ForwardMode.DECODE, rids, tokens, lora_names=names)),
        dev, args.warmup, args.steps,
    )  # fmt: skip
    block = torch.randint(3, target.vocab_size, (bs * args.verify_width,), generator=gen).to(dev)
    verify = ForwardBatch  # one verify per step: every request's last token and its drafts
    out["verify"] = profiled(
        lambda: target.forward(
            verify(ForwardMode.TARGET_VERIFY, rids, block, num_draft_tokens=args.verify_width, lora_names=names)
        ),
        dev, args.warmup, args.steps,
    )  # fmt: skip
    for rid in rids:
        target.kv.free(rid)
    rt["prefill"](draft, rids, [None] * bs, args.prompt_len, seed=2)
    out["draft"] = profiled(
        lambda: draft.forward(ForwardBatch(ForwardMode.DECODE, rids, tokens)), dev, args.warmup, args.steps
    )
    for rid in rids:
        draft.kv.free(rid)
    return out


def table(results: dict[str, tuple[Counter, int]], title: str) -> str:
    """A markdown table: µs per step and share, by family, for each phase."""
    kinds = list(results)
    lines = [f"### {title}", "", "| family | " + " | ".join(f"{k} µs (share)" for k in kinds) + " |"]
    lines.append("|---|" + "---|" * len(kinds))
    totals = {k: sum(results[k][0].values()) or 1.0 for k in kinds}
    for fam in FAMILIES:
        if any(results[k][0].get(fam) for k in kinds):
            cells = [f"{results[k][0].get(fam, 0.0):,.0f} ({100 * results[k][0].get(fam, 0.0) / totals[k]:.1f}%)" for k in kinds]
            lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    lines.append("| **all** | " + " | ".join(f"**{totals[k]:,.0f}** ({results[k][1]} launches)" for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="8b", help="a bench/runtime.py preset")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--verify-width", type=int, default=4, help="rows per request of a verify")
    parser.add_argument("--adapters", type=int, default=8, help="rank-16 adapters on the target (0: base)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps of each kind")
    parser.add_argument("--fused-ops", default="off,on", help="comma list of off / on (kernels.model_ops)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny dimensions, 2 steps")
    parser.add_argument("--out", type=Path, help="also write the tables here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.size, args.device, args.dtype, args.batch_size = "smoke", "cpu", "float32", 2
        args.prompt_len, args.warmup, args.steps = 8, 1, 2
    rt = runpy.run_path(str(HERE / "runtime.py"))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))  # fmt: skip
    backend = "triton" if rt["triton_usable"](device)[0] else "torch"
    context = args.prompt_len + (args.warmup + args.steps) * (args.verify_width + 1) + 8
    sized = argparse.Namespace(
        dtype=args.dtype, device=str(device), max_lora_rank=16, adapters=max(1, args.adapters),
        attention_backend="auto", batch_sizes=[args.batch_size], prompt_len=context, warmup=0, repeats=0,
        steps=0, graphs=False,
    )  # fmt: skip
    report = [f"## Step profile: {args.size}, batch {args.batch_size}, verify width {args.verify_width}, "
              f"{args.adapters} adapters, {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
              f"LoRA backend {backend}\n"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = rt["write_model_config"](Path(tmp) / "target", args.size)
        draft_presets = {args.size: {**rt["PRESETS"][args.size], "num_hidden_layers": 1}}
        draft_dir = rt["write_model_config"](Path(tmp) / "draft", args.size, draft_presets)
        # Eager steps read the fused-ops switch at every call: one pair of runners serves both settings.
        target = rt["make_runner"](target_dir, sized, backend)
        for i in range(args.adapters):
            target.lora.load(f"a{i}", rt["write_random_adapter"](Path(tmp) / f"a{i}", target.arch, rank=16, seed=i))
        draft = rt["make_runner"](draft_dir, argparse.Namespace(**{**vars(sized), "adapters": 1}), backend)
        for setting in [s.strip() for s in args.fused_ops.split(",") if s.strip()]:
            model_ops.set_fused(setting == "on")
            report.append(table(phases(target, draft, args, rt), f"fused ops {setting}"))
            print(report[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
