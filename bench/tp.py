"""Tensor parallelism: TP=N against one device (equality and decode throughput), and
what it costs to keep the draft on rank 0.

1. Equality: the same random model (drawn whole, then cut, so every size builds the
   same weights) runs the same batches on N ranks and on one device, teacher-forced so
   both see identical inputs. Reported: max / mean |Δlogit| between TP=N and TP=1 in
   the serving dtype, next to the dtype's own floor (TP=1 in that dtype vs TP=1 in
   float32), and how often the greedy token agrees.
2. Throughput: decode tokens/s through ``ModelRunner.forward`` on rank 0 (the step is
   described to the other ranks, every rank runs it), base model and with adapters.
3. Draft placement: the draft runs on rank 0 only and its proposals reach the other
   ranks inside the target-verify description they receive anyway. Measured: the
   draft's own cost per step (k-1 proposals + caching the last) against the cost of
   the control message with and without the proposals in it.

    python bench/tp.py --smoke                                   # CPU, gloo, tiny model
    python bench/tp.py --device cuda --preset 8b --out bench/results/DATE-tp-h200x2.md
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile
import time
import types
from pathlib import Path

# NVLink multicast stays off: on shared hosts it can take the GPUs out of service.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES, RuntimeConfig
from loraserve.runtime.distributed.protocol import ForwardStep, Kind, Message
from loraserve.runtime.executor.launch import TPOptions, start_tensor_parallel
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner

# Beside bench/runtime.py's presets (1b, 8b): the CPU smoke target and its draft.
SMOKE_PRESETS = {
    "smoke": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=509, max_position_embeddings=2048,
    ),
    "draft-smoke": dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=509, max_position_embeddings=2048,
    ),
}  # fmt: skip


def _bench_module(name: str) -> types.ModuleType:
    """``bench/<name>`` as ``bench.<name>``: bench/runtime.py's model-config and adapter writers
    and the harness serve here too (``bench/`` is no package and stays off ``sys.path``:
    ``bench/bootstrap.py``)."""
    bootstrap = runpy.run_path(str(Path(__file__).resolve().with_name("bootstrap.py")))
    return bootstrap["import_module"](name)


harness = _bench_module("harness")


def make_config(model_dir: Path, args, tp: int, dtype: str, adapters: dict[str, Path]) -> RuntimeConfig:
    config = RuntimeConfig()
    config.model.path = str(model_dir)
    config.model.dtype = dtype
    config.device = args.device
    config.parallel.tensor_parallel_size = tp
    config.lora.max_rank = args.rank
    config.lora.max_loras_per_batch = max(1, len(adapters))
    config.lora.max_loaded_loras = max(1, len(adapters))
    config.lora.target_modules = DEFAULT_LORA_MODULES
    config.lora.backend = "auto"
    config.lora.adapters = {k: str(v) for k, v in adapters.items()}
    max_bs = max(args.batch_sizes)
    context = args.prompt_len + args.warmup + args.steps + 8
    config.scheduler.max_running_requests = max_bs
    config.scheduler.max_total_tokens = max_bs * context + 4 * 256
    config.cuda_graph.enabled = args.graphs and args.device == "cuda"
    config.cuda_graph.max_bs = max_bs
    return config


# --------------------------------------------------------------------------- 1. equality
def equality(tp: ModelRunner, ref: ModelRunner, ref32: ModelRunner, args) -> dict:
    """Teacher-forced greedy decoding on every runner; the logits compared row by row."""
    gen = torch.Generator().manual_seed(1)
    lens = [17, 5, 33, 9]
    rids = [f"eq{i}" for i in range(len(lens))]
    prompts = [torch.randint(3, ref.vocab_size, (n,), generator=gen) for n in lens]
    runners = {"tp": tp, "ref": ref, "ref32": ref32}
    logits = {k: [] for k in runners}
    for key, runner in runners.items():
        batch = ForwardBatch(ForwardMode.EXTEND, rids, torch.cat(prompts), extend_lens=lens, return_all_logits=True)
        logits[key].append(runner.forward(batch).logits.float().cpu())
    ends = torch.tensor(lens).cumsum(0) - 1
    nxt = logits["ref32"][0][ends].argmax(-1)  # every runner is fed float32's greedy choice
    for _ in range(args.equality_steps):
        for key, runner in runners.items():
            batch = ForwardBatch(ForwardMode.DECODE, rids, nxt.to(runner.device))
            logits[key].append(runner.forward(batch).logits.float().cpu())
        nxt = logits["ref32"][-1].argmax(-1)
    for runner in runners.values():
        for rid in rids:
            runner.kv.free(rid)
    tp_all, ref_all, ref32_all = (torch.cat(logits[k]) for k in ("tp", "ref", "ref32"))
    d_tp = (tp_all - ref_all).abs()
    d_floor = (ref_all - ref32_all).abs()
    return {
        "rows": int(tp_all.shape[0]),
        "max_abs_tp_vs_tp1": float(d_tp.max()),
        "mean_abs_tp_vs_tp1": float(d_tp.mean()),
        "max_abs_dtype_floor": float(d_floor.max()),
        "mean_abs_dtype_floor": float(d_floor.mean()),
        "greedy_agree_tp_vs_tp1": float((tp_all.argmax(-1) == ref_all.argmax(-1)).float().mean()),
        "greedy_agree_tp1_vs_fp32": float((ref_all.argmax(-1) == ref32_all.argmax(-1)).float().mean()),
    }


# --------------------------------------------------------------------------- 2. throughput
def decode_rate(runner: ModelRunner, bs: int, names: list[str | None], args, tag: str) -> float:
    """Decode tokens/s: ``bs`` requests prefilled, ``args.steps`` greedy steps timed."""
    gen = torch.Generator().manual_seed(bs)
    rids = [f"{tag}-{i}" for i in range(bs)]
    prompts = [torch.randint(3, runner.vocab_size, (args.prompt_len,), generator=gen) for _ in rids]
    chunk = max(1, 4096 // args.prompt_len)
    last = []
    for i in range(0, bs, chunk):
        part = slice(i, i + chunk)
        batch = ForwardBatch(
            ForwardMode.EXTEND,
            rids[part],
            torch.cat(prompts[part]).to(runner.device),
            extend_lens=[args.prompt_len] * len(rids[part]),
            lora_names=names[part],
        )
        last.append(runner.forward(batch).logits.argmax(-1))
    tokens = torch.cat(last)
    for _ in range(args.warmup):
        tokens = runner.forward(ForwardBatch(ForwardMode.DECODE, rids, tokens, lora_names=names)).logits.argmax(-1)

    def steps() -> None:
        nonlocal tokens
        for _ in range(args.steps):
            tokens = runner.forward(ForwardBatch(ForwardMode.DECODE, rids, tokens, lora_names=names)).logits.argmax(-1)
        tokens.tolist()  # the host needs the tokens each step in serving; wait for the last

    (elapsed,) = harness.wall_times(steps, runner.device, repeats=1)
    for rid in rids:
        runner.kv.free(rid)
    return bs * args.steps / elapsed


# --------------------------------------------------------------------------- 3. draft placement
def draft_placement(handle, args, draft_dir: Path) -> dict:
    """Per verify step: the draft's forwards on rank 0 vs the control message's cost."""
    driver = handle.driver
    bs, k = args.draft_bs, args.num_draft_tokens
    config = RuntimeConfig()
    config.model.path = str(draft_dir)
    config.model.dtype = args.dtype
    config.device = args.device
    config.lora.enabled = False
    config.scheduler.max_total_tokens = bs * (args.prompt_len + 64 * k) + 64
    config.scheduler.max_running_requests = bs
    draft = ModelRunner(config, is_draft=True, model_path=draft_dir, random_weights=True)
    gen = torch.Generator().manual_seed(7)
    rids = [f"d{i}" for i in range(bs)]
    prompt = torch.randint(3, draft.vocab_size, (bs * args.prompt_len,), generator=gen).to(draft.device)
    draft.forward(ForwardBatch(ForwardMode.EXTEND, rids, prompt, extend_lens=[args.prompt_len] * bs))
    tokens = torch.randint(3, draft.vocab_size, (bs,), generator=gen).to(draft.device)

    def one_draft_step():
        nonlocal tokens
        # As StandaloneDrafter.propose: decode the last token, k-1 proposals, cache the last.
        for _ in range(k):
            tokens = draft.forward(ForwardBatch(ForwardMode.DECODE, rids, tokens)).logits.argmax(-1)
        tokens.tolist()
        for rid in rids:
            draft.kv.truncate(rid, k)

    def message(width: int) -> Message:
        ids = torch.randint(3, draft.vocab_size, (bs * width,), generator=gen)
        step = ForwardStep(
            mode="target_verify" if width > 1 else "decode",
            request_ids=list(range(bs)),
            num_tokens=bs * width,
            slots=[-1] * bs,
            num_draft_tokens=width if width > 1 else None,
            input_ids=ForwardStep.encode_ids(ids),
        )
        return Message(Kind.NOOP, step=step)  # followers receive it whole and run nothing

    def timed(fn, reps: int) -> float:
        for _ in range(3):
            fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6

    plain_msg, verify_msg = message(1), message(k)
    with driver.forward_scope():  # no heartbeat interleaves with the timed sends
        send_plain = timed(lambda: driver._send(plain_msg), args.reps)
        send_verify = timed(lambda: driver._send(verify_msg), args.reps)
    draft_us = timed(one_draft_step, max(3, args.reps // 10))
    return {
        "batch_size": bs,
        "num_draft_tokens": k,
        "draft_step_us": draft_us,
        "control_message_us_without_drafts": send_plain,
        "control_message_us_with_drafts": send_verify,
        "drafts_extra_bytes": len(verify_msg.encode()) - len(plain_msg.encode()),
    }


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    files = _bench_module("runtime")
    presets = {**files.PRESETS, **SMOKE_PRESETS}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model, seconds")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--preset", default="8b", choices=sorted(presets))
    p.add_argument("--draft-preset", default="1b", choices=sorted(presets))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--adapters", type=int, default=8, help="distinct adapters in the LoRA rows (0: base only)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--equality-steps", type=int, default=16)
    p.add_argument("--draft-bs", type=int, default=8)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True)
    harness.add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.preset, args.draft_preset, args.dtype = "cpu", "smoke", "draft-smoke", "float32"
        args.batch_sizes, args.adapters, args.steps, args.warmup = [1, 4], 2, 8, 2
        args.prompt_len, args.equality_steps, args.reps, args.graphs = 16, 4, 50, False

    root = Path(tempfile.mkdtemp(prefix="loraserve-bench-tp-"))
    model_dir = files.write_model_config(root / "model", args.preset, presets)
    draft_dir = files.write_model_config(root / "draft", args.draft_preset, presets)
    from loraserve.runtime.model.arch import load_arch_config

    arch = load_arch_config(model_dir)
    adapters = {
        f"a{i}": files.write_random_adapter(root / f"a{i}", arch, rank=args.rank, seed=i)
        for i in range(args.adapters)
    }
    names_cycle = [*adapters] or [None]

    options = TPOptions(collective_timeout_s=120, control_timeout_s=60, heartbeat_s=5, startup_timeout_s=600)
    tp_config = make_config(model_dir, args, args.tp, args.dtype, adapters)
    t0 = time.perf_counter()
    handle = start_tensor_parallel(tp_config, options=options, exit_on_failure=False, random_weights=True)
    results: dict = {"preset": args.preset, "tp": args.tp, "dtype": args.dtype, "device": args.device}
    try:
        tp = ModelRunner(tp_config, random_weights=True)
        results["tp_load_s"] = time.perf_counter() - t0
        ref = ModelRunner(make_config(model_dir, args, 1, args.dtype, adapters), random_weights=True)
        ref32 = ModelRunner(make_config(model_dir, args, 1, "float32", {}), random_weights=True)
        results["equality"] = equality(tp, ref, ref32, args)
        del ref32
        rates = []
        for bs in args.batch_sizes:
            for label, names in (("base", [None] * bs), ("lora", [names_cycle[i % len(names_cycle)] for i in range(bs)])):
                if label == "lora" and not adapters:
                    continue
                one = decode_rate(ref, bs, names, args, f"ref-{label}-{bs}")
                many = decode_rate(tp, bs, names, args, f"tp-{label}-{bs}")
                rates.append({"bs": bs, "rows": label, "tp1_tok_s": one, "tp_tok_s": many, "speedup": many / one})
                print(json.dumps(rates[-1]), flush=True)
        results["throughput"] = rates
        del ref
        results["draft_placement"] = draft_placement(handle, args, draft_dir)
    finally:
        handle.shutdown()
    results["host"] = harness.environment(args.device)
    print(json.dumps(results, indent=1))
    harness.write_report(render(results, args), results, out=args.out, json_to=args.json, name="tp")
    eq = results["equality"]
    # A TP error beyond a few times the dtype's own floor means the sharding is wrong.
    ok = eq["max_abs_tp_vs_tp1"] <= max(4 * eq["max_abs_dtype_floor"], 1e-3)
    return 0 if ok else 1


def render(r: dict, args) -> str:
    eq, dp = r["equality"], r["draft_placement"]
    lines = [
        f"# Tensor parallelism, TP={r['tp']} vs TP=1 ({r['host']['gpu']}, {r['host']['date']})",
        "",
        f"`python bench/tp.py {' '.join(sys.argv[1:])}`; torch {r['host']['torch']}; model {r['preset']} "
        f"(random weights, drawn whole and cut), {r['dtype']}; CUDA graphs {'on' if args.graphs else 'off'}.",
        "",
        "## Equality (teacher-forced greedy, every logit row)",
        "",
        "| | max abs Δlogit | mean abs Δlogit | greedy agreement |",
        "|---|---|---|---|",
        f"| TP={r['tp']} vs TP=1, {r['dtype']} | {eq['max_abs_tp_vs_tp1']:.4g} | {eq['mean_abs_tp_vs_tp1']:.3g} | "
        f"{eq['greedy_agree_tp_vs_tp1']:.4f} |",
        f"| floor: TP=1 {r['dtype']} vs TP=1 float32 | {eq['max_abs_dtype_floor']:.4g} | "
        f"{eq['mean_abs_dtype_floor']:.3g} | {eq['greedy_agree_tp1_vs_fp32']:.4f} |",
        "",
        f"## Decode throughput (prompt {args.prompt_len}, {args.steps} steps, adapters: {args.adapters} distinct)",
        "",
        f"| batch | rows | TP=1 tok/s | TP={r['tp']} tok/s | speed-up |",
        "|---|---|---|---|---|",
    ]
    for row in r["throughput"]:
        lines.append(
            f"| {row['bs']} | {row['rows']} | {row['tp1_tok_s']:.0f} | {row['tp_tok_s']:.0f} | "
            f"{row['speedup']:.2f} |"
        )
    lines += [
        "",
        f"## Draft on rank 0: its cost vs carrying its proposals (batch {dp['batch_size']}, k={dp['num_draft_tokens']})",
        "",
        "| per verify step | µs |",
        "|---|---|",
        f"| draft forwards on rank 0 ({args.draft_preset}) | {dp['draft_step_us']:.0f} |",
        f"| control message, decode-sized (no drafts) | {dp['control_message_us_without_drafts']:.0f} |",
        f"| control message, verify-sized (drafts inside, +{dp['drafts_extra_bytes']} bytes) | "
        f"{dp['control_message_us_with_drafts']:.0f} |",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
