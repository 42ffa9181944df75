"""Decode throughput of the model runner: the base model vs many distinct LoRA adapters.

For each model size and batch size, ``bs`` requests are prefilled, then decode steps
are timed through ``ModelRunner.forward`` (host bookkeeping, KV allocation, LoRA slot
placement and, when enabled, CUDA-graph replay included). The LoRA rows give request
``i`` adapter ``i % num_adapters``: every step carries that many distinct adapters.

Weights are random (Llama-shaped, built on the device); adapters are written in PEFT's
file format with random weights and loaded through the runner's real loading path.
Before timing, the LoRA path is checked three ways on the real model: graph replay vs
eager, the chosen backend vs the torch reference, and adapter vs base (it must differ).

    python bench/runtime.py --smoke                      # CPU, tiny model, seconds
    python bench/runtime.py --sizes 1b,8b --out r.md     # GPU
    python bench/runtime.py --sizes 8b --attention sdpa,triton --prompt-len 4096 --out r.md
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import runpy
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from loraserve.kernels import ForwardMode, TorchLoRABackend, model_ops
from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES, RuntimeConfig
from loraserve.runtime.model import ModelArchConfig
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner

# bench/harness.py, imported as bootstrap.py imports a benchmark (this file runs by its path)
harness = runpy.run_path(str(Path(__file__).resolve().parent / "bootstrap.py"))["import_module"]("harness")

PRESETS = {
    "smoke": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, max_position_embeddings=2048,
    ),
    # Llama 3.2 1B dimensions
    "1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    # Llama 3.1 8B dimensions
    "8b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
    ),
}  # fmt: skip


def write_model_config(dest: Path, preset: str, presets: Mapping[str, dict] = PRESETS) -> Path:
    """A Llama config.json only, of ``presets[preset]``'s dimensions: the runner fills random
    weights on the device."""
    dest.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **presets[preset],
    }
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    return dest


def write_random_adapter(
    dest: Path, arch: ModelArchConfig, *, rank: int, seed: int, modules=DEFAULT_LORA_MODULES, b_std: float = 0.02
) -> Path:
    """A PEFT-format adapter (config + safetensors) with random A (scaled by its fan-in) and
    random B of standard deviation ``b_std`` for ``modules``: every benchmark's adapters."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module in modules:
            in_dim, out_dim = arch.module_dims(module)
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_dim, generator=gen) / in_dim**0.5).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_dim, rank, generator=gen) * b_std).to(torch.bfloat16)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules), "bias": "none",
              "task_type": "CAUSAL_LM"}  # fmt: skip
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


def make_runner(model_dir: Path, args, backend: str) -> ModelRunner:
    config = RuntimeConfig()
    config.model.path = str(model_dir)
    config.model.dtype = args.dtype
    config.device = args.device
    config.lora.max_rank = args.max_lora_rank
    config.lora.max_loras_per_batch = args.adapters
    config.lora.max_loaded_loras = args.adapters
    config.lora.target_modules = DEFAULT_LORA_MODULES
    config.lora.backend = backend
    config.attention_backend = args.attention_backend
    max_bs = max(args.batch_sizes)
    context = args.prompt_len + args.warmup + (args.repeats + 1) * args.steps + 8
    checks = 4 * min(8, max_bs)  # requests of check_lora_path, 32-token prompts + 1 step
    config.scheduler.max_running_requests = max(max_bs, checks)
    config.scheduler.max_total_tokens = max_bs * context + checks * 40
    config.cuda_graph.enabled = args.graphs
    config.cuda_graph.max_bs = max_bs
    return ModelRunner(config, random_weights=True)


def prefill(runner: ModelRunner, rids: list[str], names: list[str | None], prompt_len: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, runner.vocab_size, (prompt_len,), generator=gen) for _ in rids]
    chunk = max(1, 8192 // prompt_len)  # prefill in batches that keep activations modest
    for start in range(0, len(rids), chunk):
        part = slice(start, start + chunk)
        runner.forward(
            ForwardBatch(
                ForwardMode.EXTEND,
                rids[part],
                torch.cat(prompts[part]),
                extend_lens=[prompt_len] * len(rids[part]),
                lora_names=names[part],
            )
        )


def decode_step(runner: ModelRunner, rids, names, tokens: torch.Tensor):
    return runner.forward(ForwardBatch(ForwardMode.DECODE, rids, tokens, lora_names=names))


def measure(runner: ModelRunner, bs: int, names: list[str | None], args, tag: str) -> float:
    """Median decode tokens/s over ``repeats`` timed runs of ``steps`` steps."""
    rids = [f"{tag}-{i}" for i in range(bs)]
    prefill(runner, rids, names, args.prompt_len, seed=bs)
    tokens = torch.randint(3, runner.vocab_size, (bs,))
    for _ in range(args.warmup):
        decode_step(runner, rids, names, tokens)

    def steps() -> None:
        for _ in range(args.steps):
            decode_step(runner, rids, names, tokens)

    rates = [bs * args.steps / s for s in harness.wall_times(steps, runner.device, repeats=args.repeats)]
    for rid in rids:
        runner.kv.free(rid)
    return statistics.median(rates)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_lora_path(runner: ModelRunner, args) -> dict[str, float]:
    """Same prompts down three paths; returns relative logit differences."""
    bs = min(8, max(args.batch_sizes))
    names = [f"a{i % args.adapters}" for i in range(bs)]
    results = {}
    groups = {}
    for tag in ("graph", "eager", "ref", "base"):
        rids = [f"check-{tag}-{i}" for i in range(bs)]
        prefill(runner, rids, names if tag != "base" else [None] * bs, 32, seed=99)
        groups[tag] = rids
    tokens = torch.randint(3, runner.vocab_size, (bs,), generator=torch.Generator().manual_seed(5))
    graph_logits = decode_step(runner, groups["graph"], names, tokens).logits
    graphs, runner.graphs = runner.graphs, None
    try:
        eager_logits = decode_step(runner, groups["eager"], names, tokens).logits
        base_logits = decode_step(runner, groups["base"], [None] * bs, tokens).logits
        backend = runner.lora.backend
        reference = TorchLoRABackend()
        runner.lora.backend = runner.lora.ctx.backend = reference
        try:
            ref_logits = decode_step(runner, groups["ref"], names, tokens).logits
        finally:
            runner.lora.backend = runner.lora.ctx.backend = backend
    finally:
        runner.graphs = graphs
    results["graph_vs_eager"] = rel_err(graph_logits, eager_logits)
    results["backend_vs_torch_reference"] = rel_err(eager_logits, ref_logits)
    results["adapter_vs_base"] = rel_err(eager_logits, base_logits)
    for rids in groups.values():
        for rid in rids:
            runner.kv.free(rid)
    return results


def triton_usable(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "no CUDA device"
    try:
        from loraserve.kernels import get_backend

        get_backend("triton", str(device))
        return True, "imported"
    except Exception as exc:  # any import/compile failure means: use the reference
        return False, f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1b", help="comma list of presets: " + ", ".join(PRESETS))
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--check-tol",
        type=float,
        default=2e-2,
        help="largest relative L2 of the decode logits, Triton LoRA vs the torch reference, before the size is"
        " rerun on the torch backend (bf16 over 32 layers: 0.7-1.4e-2 in rank-16 pools, 2.3e-2 in rank-64 ones)",
    )
    parser.add_argument(
        "--max-lora-rank", type=int, default=0, help="the pool's rank (0: --rank; the runtime's own default is 64)"
    )
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--backend", default="auto", help="auto: triton when usable on CUDA, else torch")
    parser.add_argument("--no-graphs", dest="graphs", action="store_false")
    parser.add_argument(
        "--attention",
        default="auto",
        help="comma list of decode attention backends, each timed in turn: sdpa, triton (paged kernel), auto"
        " (the runtime's default: triton on CUDA); rows name the backend that ran",
    )
    parser.add_argument(
        "--fused-ops",
        default="on",
        help="comma list of on / off: the decoder's fused norm and SiLU kernels (kernels.model_ops), each"
        " setting timed in turn on a model built (and graphs captured) under it",
    )
    parser.add_argument("--deadline", type=float, default=0, help="seconds; skip sizes that start after it")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, few steps")
    parser.add_argument(
        "--stall-dump-s",
        type=float,
        default=0,
        help="every N seconds, print every thread's Python stack to stderr (0: off): where a run that stops"
        " printing is waiting",
    )
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    args = parser.parse_args(argv)
    if args.stall_dump_s > 0:
        faulthandler.dump_traceback_later(args.stall_dump_s, repeat=True, file=sys.stderr)
    if args.smoke:
        args.sizes, args.device, args.dtype = "smoke", "cpu", "float32"
        args.batch_sizes, args.steps, args.repeats, args.warmup, args.prompt_len = "1,4", 4, 1, 1, 16
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.max_lora_rank = args.max_lora_rank or args.rank
    attentions = [a.strip() for a in args.attention.split(",") if a.strip()]
    fused_settings = [f.strip() == "on" for f in args.fused_ops.split(",") if f.strip()]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))  # fmt: skip
    args.device = str(device)
    if device.type != "cuda":
        args.graphs = False
    backend = args.backend
    triton_ok, triton_note = triton_usable(device)
    if backend == "auto":
        backend = "triton" if triton_ok else "torch"

    began = time.perf_counter()
    rows: list[str] = []
    notes: list[str] = []
    header = _header(args, device, backend, triton_note, argv)
    for size in args.sizes.split(","):
        if args.deadline and time.perf_counter() - began > args.deadline:
            notes.append(f"{size}: skipped (past the --deadline of {args.deadline:.0f} s)")
            continue
        # Fall back step by step if a path fails on this machine; each failure is reported.
        for attention, fused in [(a, f) for f in fused_settings for a in attentions]:
            model_ops.set_fused(fused)
            attempts = [(backend, args.graphs)]
            if args.graphs:
                attempts.append((backend, False))
            if backend != "torch":
                attempts.append(("torch", args.graphs))
            sized = argparse.Namespace(**{**vars(args), "attention_backend": attention, "fused": fused})
            for attempt_backend, graphs in attempts:
                try:
                    rows += run_size(size, sized, attempt_backend, graphs, notes)
                    break
                except Exception as exc:
                    notes.append(
                        f"{size}: attention={attention} backend={attempt_backend} graphs={graphs} failed: "
                        f"{type(exc).__name__}: {exc}"
                    )
                    print(notes[-1], flush=True)
                finally:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            _write_report(args, header, rows, notes)
    _write_report(args, header, rows, notes, final=True)
    return 0


def run_size(size: str, args, backend: str, graphs: bool, notes: list[str]) -> list[str]:
    """Build one model size, check the LoRA path, and time every batch size."""
    rows = []
    args = argparse.Namespace(**{**vars(args), "graphs": graphs})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_config(Path(tmp) / "model", size)
        t0 = time.perf_counter()
        runner = make_runner(model_dir, args, backend)
        args = argparse.Namespace(**{**vars(args), "attention_backend": runner.attention_backend})  # auto resolved
        for i in range(args.adapters):
            path = write_random_adapter(Path(tmp) / f"a{i}", runner.arch, rank=args.rank, seed=i)
            runner.lora.load(f"a{i}", path)
        build_s = time.perf_counter() - t0
        checks = check_lora_path(runner, args)
        notes.append(
            f"{size} ({backend}, attention {args.attention_backend}, graphs {'on' if graphs else 'off'}): built in {build_s:.1f} s; "
            "checks, relative L2 of decode logits: " + ", ".join(f"{k} {v:.2e}" for k, v in checks.items())
        )
        print(notes[-1], flush=True)
        if checks["adapter_vs_base"] < 1e-3:
            raise RuntimeError(f"adapters barely change logits ({checks['adapter_vs_base']:.2e})")
        if checks["backend_vs_torch_reference"] > args.check_tol or checks["graph_vs_eager"] > args.check_tol:
            raise RuntimeError(f"LoRA path disagrees with its references: {checks}")
        for bs in args.batch_sizes:
            print(f"{size} attention {args.attention_backend}: batch {bs} at {time.perf_counter() - t0:.1f} s", flush=True)
            base = measure(runner, bs, [None] * bs, args, f"base{bs}")
            names = [f"a{i % args.adapters}" for i in range(bs)]
            lora = measure(runner, bs, names, args, f"lora{bs}")
            rows.append(
                f"| {size} | {args.attention_backend} | {'on' if args.fused else 'off'} | {backend} | "
                f"{'on' if graphs else 'off'} | {bs} | {base:,.0f} | "
                f"{lora:,.0f} ({len(set(names))} adapters) | {100 * lora / base:.1f}% |"
            )
            print(rows[-1], flush=True)
        captured = runner.graphs.num_graphs if runner.graphs is not None else 0
        notes.append(f"{size}: {captured} CUDA graphs captured; KV cache {runner.kv.capacity} tokens; "
                     f"total {time.perf_counter() - t0:.1f} s")  # fmt: skip
        del runner
    return rows


def _header(args, device: torch.device, backend: str, triton_note: str, argv) -> list[str]:
    command = " ".join(["python", "bench/runtime.py", *(argv if argv is not None else sys.argv[1:])])
    return [
        f"# Runtime decode throughput: base vs {args.adapters} LoRA adapters\n",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"{harness.environment_line(harness.environment(device))}  ",
        f"Setup: {args.dtype}, random Llama-shaped weights, prompt {args.prompt_len} tokens, "
        f"{args.steps} timed decode steps x {args.repeats} (median) through ModelRunner.forward, "
        f"rank-{args.rank} adapters (pool rank {args.max_lora_rank}) on {', '.join(DEFAULT_LORA_MODULES)}, "
        "request i uses adapter i % "
        f"{args.adapters}; requested LoRA backend: {backend} (triton: {triton_note})  ",
        f"Command: `{command}`\n",
        "| model | attention | fused ops | LoRA backend | CUDA graphs | batch | base tok/s | multi-LoRA tok/s "
        "| LoRA / base |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]


def _write_report(args, header: list[str], rows: list[str], notes: list[str], final: bool = False) -> None:
    report = "\n".join([*header, *rows, "", *(f"- {n}" for n in notes)]) + "\n"
    if final:
        print(report, flush=True)
    record = {"env": harness.environment(), "argv": sys.argv[1:], "rows": rows, "notes": notes}
    harness.write_report(report, record, out=args.out, json_to=None, name="runtime")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
