"""Speculative decoding throughput: tokens/s with and without a draft, 4 adapters in the mix.

Method (everything is built inside the run; nothing is downloaded):

1. Corpus: the Python standard library's own sources, tokenized with the project's local
   byte-level BPE (``devmodels.write_tokenizer``). A few modules are held out for prompts.
2. Train a small Llama target on that corpus for a fixed number of seconds (AdamW, bf16
   autocast), then distill a much smaller Llama draft from it: KL to the target's
   next-token distribution, half of every batch being the target's own greedy
   continuations of training-corpus prompts, half corpus windows.
   ``--distill-prompts unseen`` takes the teacher prompts from code neither model trains
   on (the installed torch package's modules) at the benchmark's prompt length instead;
   on the CPU it did not beat the default, while more distillation time did.
3. Serve a Llama-3-8B-shaped target (32 layers, hidden 4096, GQA 32/8, MLP 14336; the
   vocabulary is the local tokenizer's) that computes exactly what the small trained
   target computes: its weights are a function-preserving expansion of the small model
   (extra hidden dimensions, heads, MLP units and layers contribute nothing; RMSNorm
   weights and eps rescaled so the statistics over the padded width match). The serving
   cost is that of the full 8B shape (every GEMM runs at full size); the predictions are
   those of the trained model. ``--target-shape trained`` serves the small model as is.
4. Four random PEFT adapters (all linear modules, rank 16, small B) are loaded; request
   ``i`` of a workload uses base, or adapter ``i % 5``.
5. For concurrency 1, 8 and 32, the same greedy workload runs through the real engine
   without speculation and with STANDALONE speculation (the trained draft). Tokens/s is
   generated tokens over wall time (prefill included); accept lengths come from the
   decoder's metrics, overall and per adapter. Outputs of the two runs are compared.
   The engine's step counters say where each run's time went (extend and decode steps,
   batch occupancy, host work, CUDA graphs captured during the timed run).

    python bench/spec.py --smoke                # CPU, tiny models, a minute
    python bench/spec.py --out results.md       # GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraserve.runtime.config import DEFAULT_LORA_MODULES, RuntimeConfig, SpecAlgorithm
from loraserve.runtime.devmodels import write_tokenizer
from loraserve.runtime.engine.decoder import StandardDecoder
from loraserve.runtime.engine.engine import Engine
from loraserve.runtime.engine.request import Request
from loraserve.runtime.model_runner import ModelRunner
from loraserve.runtime.sampling import Sampler, SamplingParams
from loraserve.runtime.spec import build_decoder

SHAPES = {
    # name: (hidden, layers, heads, kv_heads, head_dim, intermediate)
    "smoke-small": (64, 2, 4, 2, 16, 128),
    "smoke-draft": (32, 1, 2, 1, 16, 64),
    "smoke-big": (128, 4, 8, 4, 16, 256),
    "small": (1024, 8, 8, 2, 128, 2816),
    "draft": (384, 2, 6, 3, 64, 1024),
    "8b": (4096, 32, 32, 8, 128, 14336),
}
HELD_OUT = ("difflib.py", "heapq.py", "textwrap.py", "shlex.py", "fractions.py", "bisect.py", "sched.py")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- corpus


def corpus_files(limit_bytes: int) -> tuple[list[Path], list[Path]]:
    """Standard-library sources: (training files, held-out prompt files)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    held = [p for p in files if p.name in HELD_OUT and p.parent == root]
    train, total = [], 0
    for p in files:
        if p in held:
            continue
        size = p.stat().st_size
        if total + size > limit_bytes:
            break
        train.append(p)
        total += size
    return train, held


def unseen_code_files(limit_bytes: int) -> list[Path]:
    """Python sources no model here trains on: the installed torch package's own modules.

    Prompts for the draft's distillation: the target continues code it has never seen,
    as it does on the benchmark's held-out prompts (which stay out of every training set).
    """
    root = Path(torch.__file__).parent
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "test" not in p.parts and "testing" not in p.parts and p.name not in HELD_OUT
    )
    chosen, total = [], 0
    for p in files[::3]:  # spread over the package rather than its first folders
        size = p.stat().st_size
        if size < 2000:
            continue
        if total + size > limit_bytes:
            break
        chosen.append(p)
        total += size
    return chosen


def tokenize(tokenizer_dir: Path, files: list[Path]) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    ids: list[int] = []
    eos = tok.token_to_id("</s>")
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


# --------------------------------------------------------------------------- training


def llama_config(shape: str, vocab: int, *, eps: float = 1e-5, max_pos: int = 4096) -> dict:
    hidden, layers, heads, kv, head_dim, inter = SHAPES[shape]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "rms_norm_eps": eps,
        "max_position_embeddings": max_pos,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def train_lm(
    shape: str,
    vocab: int,
    data: torch.Tensor,
    seconds: float,
    device: torch.device,
    *,
    seq: int,
    batch: int,
    lr: float,
    seed: int,
    teacher=None,
    teacher_data: torch.Tensor | None = None,
    teacher_fraction: float = 0.5,
):
    """Train a Llama of ``shape`` for ``seconds`` on random windows of ``data``.

    With a ``teacher``, the loss is the KL divergence from the teacher's next-token
    distribution (distillation), and ``teacher_fraction`` of every batch comes from
    ``teacher_data`` (sequences the teacher generated itself, ``[n, seq + 1]``): the draft
    learns to predict what the target says, which is what speculation accepts.
    """
    import transformers

    raw = llama_config(shape, vocab)
    cfg = transformers.LlamaConfig(
        **{k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")}
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    gen = torch.Generator().manual_seed(seed)
    data = data.to(device)
    autocast = {"device_type": device.type, "dtype": torch.bfloat16, "enabled": device.type == "cuda"}
    start, step, losses = time.monotonic(), 0, []
    loss = torch.zeros(())
    warmup = 50
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= seconds:
            break
        frac = elapsed / seconds
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        n_corpus = batch if teacher_data is None else batch - max(1, round(batch * teacher_fraction))
        starts = torch.randint(0, data.numel() - seq - 1, (n_corpus,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        window = data[idx.to(device)]
        if teacher_data is not None:
            rows = torch.randint(0, teacher_data.shape[0], (batch - n_corpus,), generator=gen)
            window = torch.cat([window, teacher_data[rows.to(teacher_data.device)].to(device)])
        with torch.autocast(**autocast):
            logits = model(input_ids=window[:, :-1]).logits
        if teacher is None:
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, vocab), window[:, 1:].reshape(-1)
            )
        else:
            with torch.no_grad(), torch.autocast(**autocast):
                target_logp = torch.log_softmax(teacher(input_ids=window[:, :-1]).logits.float(), dim=-1)
            logp = torch.log_softmax(logits.float(), dim=-1)
            loss = torch.nn.functional.kl_div(
                logp.reshape(-1, vocab),
                target_logp.reshape(-1, vocab),
                log_target=True,
                reduction="batchmean",
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            losses.append(loss.item())
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    final = losses[-1] if losses else loss.item()
    return model, {
        "steps": step,
        "tokens": step * batch * seq,
        "final_loss": round(final, 3),
        "params": n_params,
    }


@torch.no_grad()
def teacher_sequences(
    model,
    data: torch.Tensor,
    device: torch.device,
    *,
    count: int,
    prompt_len: int,
    new_tokens: int,
    seed: int,
) -> torch.Tensor:
    """Greedy continuations by ``model`` of random windows of ``data``, ``[count, prompt+new]``.

    ``data`` is never the held-out files the benchmark prompts are cut from.
    """
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - prompt_len - 1, (count,), generator=gen)
    prompts = data[starts[:, None] + torch.arange(prompt_len)[None, :]].to(device)
    chunks = []
    for part in prompts.split(512):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model.generate(
                input_ids=part,
                attention_mask=torch.ones_like(part),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        chunks.append(out[:, : prompt_len + new_tokens])
    return torch.cat(chunks)


def save_hf(model, dest: Path, tokenizer_dir: Path) -> Path:
    from loraserve.runtime.devmodels import copy_tokenizer

    model.to(torch.bfloat16).save_pretrained(str(dest), safe_serialization=True)
    copy_tokenizer(tokenizer_dir, dest)
    return dest


# --------------------------------------------------------------------------- expansion


@torch.no_grad()
def expand_into(runner: ModelRunner, small: dict[str, torch.Tensor], small_shape: str) -> None:
    """Make ``runner``'s (bigger, randomly initialised) model compute the small model's function.

    Padded hidden dimensions stay exactly zero in the residual stream: the embedding,
    every o_proj / down_proj outside the small block, and whole extra layers write zeros
    there. RMSNorm over the padded width sees ``Hs/Hb`` of the mean square, so norm
    weights scale by ``sqrt(Hs/Hb)`` (and eps by ``Hs/Hb`` in config.json).
    """
    hs, ls, ns, kvs, d, is_ = SHAPES[small_shape]
    m = runner.model
    arch = runner.arch
    hb, ib = arch.hidden_size, arch.intermediate_size
    assert arch.head_dim == d and arch.num_heads // arch.num_kv_heads == ns // kvs, "GQA groups must match"
    scale = math.sqrt(hs / hb)

    def w(name: str) -> torch.Tensor:
        return small[name].to(device=runner.device, dtype=runner.dtype)

    emb = m.model.embed_tokens.weight
    emb.zero_()
    emb[:, :hs] = w("model.embed_tokens.weight")
    q_b, kv_b = arch.q_size, arch.kv_size
    for i, layer in enumerate(m.model.layers):
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        if i >= ls:
            continue  # an identity layer: attention and MLP add zero to the stream
        p = f"model.layers.{i}."
        qkv = layer.self_attn.qkv_proj.weight
        qkv[: ns * d, :hs] = w(p + "self_attn.q_proj.weight")
        qkv[q_b : q_b + kvs * d, :hs] = w(p + "self_attn.k_proj.weight")
        qkv[q_b + kv_b : q_b + kv_b + kvs * d, :hs] = w(p + "self_attn.v_proj.weight")
        layer.self_attn.o_proj.weight[:hs, : ns * d] = w(p + "self_attn.o_proj.weight")
        gate_up = layer.mlp.gate_up_proj.weight
        gate_up[:is_, :hs] = w(p + "mlp.gate_proj.weight")
        gate_up[ib : ib + is_, :hs] = w(p + "mlp.up_proj.weight")
        layer.mlp.down_proj.weight[:hs, :is_] = w(p + "mlp.down_proj.weight")
        layer.input_layernorm.weight[:hs] = w(p + "input_layernorm.weight") * scale
        layer.post_attention_layernorm.weight[:hs] = w(p + "post_attention_layernorm.weight") * scale
    m.model.norm.weight[:hs] = w("model.norm.weight") * scale
    m.lm_head.weight[:, :hs] = w("lm_head.weight")


def write_adapter(dest: Path, raw_cfg: dict, *, rank: int, seed: int, b_std: float) -> Path:
    """A PEFT LoRA adapter (all linear modules) with random A and small random B."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    h, inter = raw_cfg["hidden_size"], raw_cfg["intermediate_size"]
    q = raw_cfg["num_attention_heads"] * raw_cfg["head_dim"]
    kv = raw_cfg["num_key_value_heads"] * raw_cfg["head_dim"]
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(raw_cfg["num_hidden_layers"]):
        for module in DEFAULT_LORA_MODULES:
            fan_in, fan_out = dims[module]
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in**0.5).to(
                torch.bfloat16
            )
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * b_std).to(
                torch.bfloat16
            )
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(DEFAULT_LORA_MODULES),
           "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest


# --------------------------------------------------------------------------- serving


@dataclass
class Workload:
    prompts: list[list[int]]
    adapters: list[str | None]
    gen_tokens: int


@dataclass
class RunResult:
    tokens_per_s: float
    seconds: float
    generated: int
    outputs: dict[str, list[int]] = field(default_factory=dict)
    spec: dict | None = None
    steps: dict = field(default_factory=dict)


def graph_count(runner) -> int:
    graphs = getattr(runner, "graphs", None)
    return graphs.num_graphs if graphs is not None else 0


def step_breakdown(engine: Engine, seconds: float, graphs_captured: int) -> dict:
    """Where a run's wall time went, from the engine's counters."""
    snap = engine.snapshot
    ext, dec = snap.extend, snap.decode
    return {
        "extend_steps": ext.steps,
        "extend_requests": ext.requests,
        "extend_s": round(ext.seconds, 3),
        "extend_ms_per_step": round(1e3 * ext.seconds / max(ext.steps, 1), 2),
        "extends_during_decode": snap.extends_during_decode,
        "decode_steps": dec.steps,
        "decode_s": round(dec.seconds, 3),
        "decode_ms_per_step": round(1e3 * dec.seconds / max(dec.steps, 1), 2),
        "mean_decode_batch": round(dec.mean_batch, 2),
        "decode_occupancy": round(snap.decode_occupancy, 3),
        "tokens_per_decode_step": round(dec.tokens / max(dec.steps, 1), 2),
        "engine_s": round(snap.engine_seconds, 3),
        "other_s": round(seconds - ext.seconds - dec.seconds - snap.engine_seconds, 3),
        "deferred_admission_steps": snap.deferred_admission_steps,
        "graphs_captured": graphs_captured,
    }


def run_workload(
    config: RuntimeConfig,
    runner: ModelRunner,
    decoder,
    work: Workload,
    concurrency: int,
    tag: str,
    *,
    defer_steps: int | None = None,
) -> RunResult:
    """All requests submitted at once; the engine runs ``concurrency`` at a time."""
    config = config.copy()
    config.scheduler.max_running_requests = concurrency
    engine = Engine(config, runner, decoder=decoder, max_admission_defer_steps=defer_steps)
    drafter_runner = getattr(getattr(decoder, "drafter", None), "runner", None)
    graphs_before = graph_count(runner) + graph_count(drafter_runner)
    engine.refresh_adapters()
    done = threading.Event()
    outputs: dict[str, list[int]] = {}
    errors: list[str] = []
    pending = set()
    lock = threading.Lock()

    def sink_for(rid: str):
        def sink(out):
            with lock:
                outputs.setdefault(rid, []).extend(out.token_ids)
                if out.error is not None:
                    errors.append(f"{rid}: {out.error.message}")
                if out.finished:
                    pending.discard(rid)
                    if not pending:
                        done.set()

        return sink

    reqs = []
    for i, (prompt, adapter) in enumerate(zip(work.prompts, work.adapters, strict=True)):
        rid = f"{tag}-{i}"
        pending.add(rid)
        reqs.append(Request(rid=rid, prompt_ids=prompt, adapter=adapter, sink=sink_for(rid),
                            params=SamplingParams(max_tokens=work.gen_tokens, temperature=0.0, ignore_eos=True)))  # fmt: skip
    engine.start()
    start = time.perf_counter()
    for req in reqs:
        engine.submit(req)
    if not done.wait(600):
        raise RuntimeError(f"{tag}: timed out")
    seconds = time.perf_counter() - start
    engine.shutdown(drain_timeout_s=1.0)
    if errors:
        raise RuntimeError(f"{tag}: {errors[:3]}")
    generated = sum(len(v) for v in outputs.values())
    captured = graph_count(runner) + graph_count(drafter_runner) - graphs_before
    return RunResult(
        generated / seconds, seconds, generated, outputs, steps=step_breakdown(engine, seconds, captured)
    )


def spec_summary(decoder) -> dict:
    snap = decoder.metrics.snapshot()
    per = {name or "base": round(s.mean_accept_len, 2) for name, s in sorted(snap.per_adapter.items())}
    return {
        "mean_accept": round(snap.overall.mean_accept_len, 2),
        "accept_rate": round(snap.overall.accept_rate, 3),
        "per_adapter_mean_accept": per,
        "histogram": snap.overall.histogram,
        "verify_ms": round(1e3 * snap.verify_seconds.total / max(snap.verify_seconds.count, 1), 2),
        "step_ms": round(1e3 * snap.step_seconds.total / max(snap.step_seconds.count, 1), 2),
    }


def make_workload(prompt_pool: list[list[int]], count: int, gen_tokens: int, offset: int) -> Workload:
    names: list[str | None] = [None, "ad0", "ad1", "ad2", "ad3"]
    prompts = [prompt_pool[(offset + i) % len(prompt_pool)] for i in range(count)]
    return Workload(prompts, [names[(offset + i) % len(names)] for i in range(count)], gen_tokens)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, short training")
    ap.add_argument("--out", default=None, help="markdown results file")
    ap.add_argument("--target-shape", default=None, help="8b (default on GPU) or trained")
    ap.add_argument("--k", type=int, default=None, help="num_draft_tokens (default 6; smoke 4)")
    ap.add_argument("--train-target-s", type=float, default=None)
    ap.add_argument("--train-draft-s", type=float, default=None)
    ap.add_argument("--gen-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--concurrency", default=None, help="comma list, default 1,8,32 (smoke 1,2,4)")
    ap.add_argument("--adapter-b-std", type=float, default=0.004)
    ap.add_argument(
        "--draft-training",
        choices=("distill", "corpus"),
        default="distill",
        help="distill: KL to the target on its own continuations + corpus; corpus: plain LM training",
    )
    ap.add_argument(
        "--distill-prompts",
        choices=("unseen", "corpus"),
        default="corpus",
        help="teacher prompts: corpus: training-corpus windows, 192-token sequences; unseen: code no model"
        " trains on (torch's modules) at the benchmark's prompt length, continued past the longest request",
    )
    ap.add_argument("--distill-seq", type=int, default=None, help="draft distillation sequence length")
    ap.add_argument("--distill-count", type=int, default=None, help="teacher continuations (default 1024)")
    ap.add_argument(
        "--teacher-fraction",
        type=float,
        default=None,
        help="share of each draft batch from teacher continuations (default 0.75 unseen, 0.5 corpus)",
    )
    ap.add_argument(
        "--waves",
        type=int,
        default=None,
        help="requests per concurrency level = waves x concurrency (keeps the batch full; default 3, smoke 1)",
    )
    ap.add_argument(
        "--defer-steps",
        type=int,
        default=None,
        help="decode steps admission may wait to batch prefills (default: the engine's; 0: admit at once)",
    )
    ap.add_argument(
        "--ab-defer",
        default="",
        help="comma list of concurrencies at which speculation is also timed with admission batching off",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="seconds from the start after which optional runs (--ab-defer) are skipped",
    )
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    k = args.k or (4 if smoke else 6)
    gen_tokens = args.gen_tokens or (24 if smoke else 192)
    prompt_len = args.prompt_len or (32 if smoke else 128)
    conc = [int(c) for c in (args.concurrency or ("1,2,4" if smoke else "1,8,32")).split(",")]
    small_shape, draft_shape = ("smoke-small", "smoke-draft") if smoke else ("small", "draft")
    target_shape = args.target_shape or ("smoke-big" if smoke else "8b")
    t_target = args.train_target_s if args.train_target_s is not None else (8 if smoke else 60)
    t_draft = args.train_draft_s if args.train_draft_s is not None else (4 if smoke else 45)
    vocab = 512 if smoke else 8192
    waves = args.waves or (1 if smoke else 3)
    started = time.monotonic()
    notes: list[str] = []

    work = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    tok_dir = write_tokenizer(work / "tokenizer", vocab)
    train_files, held = corpus_files(2_000_000 if smoke else 40_000_000)
    data = tokenize(tok_dir, train_files)
    log(
        f"corpus: {len(train_files)} files, {data.numel():,} tokens; held-out prompt files: {[p.name for p in held]}"
    )

    seq, batch = (64, 16) if smoke else (512, 48)
    target_small, t_info = train_lm(
        small_shape, vocab, data, t_target, device, seq=seq, batch=batch, lr=1.5e-3 if smoke else 6e-4, seed=1
    )
    log(f"target-small trained: {t_info}")
    if args.draft_training == "distill":
        t0 = time.monotonic()
        if args.distill_prompts == "unseen":
            # The serving regime: prompts of the benchmark's length from code the target never
            # saw, continued past the longest sequence a request reaches.
            unseen_files = unseen_code_files(1_000_000 if smoke else 8_000_000)
            prompt_data = tokenize(tok_dir, unseen_files)
            gen_len = args.distill_seq or 64 * math.ceil((prompt_len + gen_tokens + k) / 64)
            teacher_prompt = prompt_len
            source = f"{len(unseen_files)} unseen torch modules ({prompt_data.numel():,} tokens)"
        else:  # run 2's recipe
            prompt_data = data
            gen_len = args.distill_seq or (64 if smoke else 192)
            teacher_prompt = gen_len // 3
            source = "the training corpus"
        distill_data = teacher_sequences(
            target_small, prompt_data, device, count=args.distill_count or (32 if smoke else 1024),
            prompt_len=teacher_prompt, new_tokens=gen_len - teacher_prompt + 1, seed=3,
        )  # fmt: skip
        teacher_s = time.monotonic() - t0
        log(f"teacher continuations: {tuple(distill_data.shape)} of {source} in {teacher_s:.1f} s")
        fraction = args.teacher_fraction if args.teacher_fraction is not None else (
            0.75 if args.distill_prompts == "unseen" else 0.5
        )  # fmt: skip
        draft, d_info = train_lm(
            draft_shape, vocab, data, t_draft, device, seq=gen_len, batch=batch, lr=2e-3 if smoke else 1e-3,
            seed=2, teacher=target_small, teacher_data=distill_data, teacher_fraction=fraction,
        )  # fmt: skip
        d_info.update(
            teacher_prompts=source,
            teacher_sequences=list(distill_data.shape),
            teacher_seconds=round(teacher_s, 1),
            teacher_fraction=fraction,
            seq=gen_len,
        )
    else:
        draft, d_info = train_lm(
            draft_shape,
            vocab,
            data,
            t_draft,
            device,
            seq=seq,
            batch=batch,
            lr=2e-3 if smoke else 1e-3,
            seed=2,
        )
    d_info["training"] = args.draft_training
    log(f"draft trained: {d_info}")
    small_dir = save_hf(target_small, work / "target-small", tok_dir)
    draft_dir = save_hf(draft, work / "draft", tok_dir)
    small_state = {n: t.detach() for n, t in target_small.state_dict().items()}
    del target_small, draft
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # The serving target.
    hs = SHAPES[small_shape][0]
    if target_shape == "trained":
        target_dir, random_weights = small_dir, False
        raw = json.loads((small_dir / "config.json").read_text())
    else:
        hb = SHAPES[target_shape][0]
        small_eps = json.loads((small_dir / "config.json").read_text()).get("rms_norm_eps", 1e-5)
        raw = llama_config(target_shape, vocab, eps=small_eps * hs / hb)
        target_dir = work / f"target-{target_shape}"
        target_dir.mkdir()
        (target_dir / "config.json").write_text(json.dumps(raw, indent=1))
        from loraserve.runtime.devmodels import copy_tokenizer

        copy_tokenizer(tok_dir, target_dir)
        random_weights = True
    adapters = {
        f"ad{i}": write_adapter(work / f"ad{i}", raw, rank=16, seed=10 + i, b_std=args.adapter_b_std)
        for i in range(4)
    }

    max_c = max(conc)
    config = RuntimeConfig()
    config.model.path = str(target_dir)
    config.model.dtype = "float32" if device.type == "cpu" else "bfloat16"
    config.device = str(device)
    config.seed = 0
    config.lora.max_rank = 16
    config.lora.max_loras_per_batch = 4
    config.lora.max_loaded_loras = 4
    config.lora.target_modules = DEFAULT_LORA_MODULES
    config.lora.adapters = {n: str(p) for n, p in adapters.items()}
    config.scheduler.max_running_requests = max_c
    config.scheduler.max_total_tokens = max_c * (prompt_len + gen_tokens + 2 * k + 16) + 4096
    config.cuda_graph.enabled = device.type == "cuda"
    config.cuda_graph.max_bs = max_c
    t0 = time.monotonic()
    runner = ModelRunner(config, random_weights=random_weights)
    if random_weights:
        expand_into(runner, small_state, small_shape)
    target_params = sum(p.numel() for p in runner.model.parameters())
    log(
        f"target runner ({target_shape}, {target_params / 1e9:.2f} B params) built in {time.monotonic() - t0:.1f} s"
    )

    # Check: the serving target computes the trained model's function.
    held_ids = tokenize(tok_dir, held)
    pool = [held_ids[i : i + prompt_len].tolist() for i in range(0, held_ids.numel() - prompt_len, 499)]
    check = _expansion_check(runner, small_dir, pool[0], device)
    log(f"serving target vs trained model on a held-out prompt: {check}")

    spec_config = config.copy()
    spec_config.speculative.algorithm = SpecAlgorithm.STANDALONE
    spec_config.speculative.draft_model_path = str(draft_dir)
    spec_config.speculative.num_steps = k - 1
    spec_config.speculative.num_draft_tokens = k
    sampler = Sampler(0)
    decoder = build_decoder(config=spec_config, runner=runner, sampler=sampler)
    plain = StandardDecoder(runner, sampler)

    opts = MeasureOptions(
        k=k,
        gen_tokens=gen_tokens,
        waves=waves,
        defer_steps=args.defer_steps,
        ab_defer=frozenset(int(c) for c in args.ab_defer.split(",") if c.strip()),
        deadline=started + args.deadline_s if args.deadline_s else float("inf"),
    )
    rows, details = [], {}

    def report() -> str:
        lines = _report(
            args, argv, device, target_shape, target_params, t_info, d_info, k, gen_tokens, prompt_len,
            check, rows, notes, details,
        )  # fmt: skip
        text = "\n".join(lines) + "\n"
        if args.out:  # after every phase: a run cut short keeps what it measured
            meta = {"target": t_info, "draft": d_info, "k": k, "check": check, "argv": argv or sys.argv[1:]}
            Path(args.out).with_suffix(".json").write_text(json.dumps({**details, "setup": meta}, indent=1))
            Path(args.out).write_text(text)
        return text

    for c in conc:
        try:
            rows.append(_measure(config, spec_config, runner, plain, decoder, pool, c, opts, details))
        except Exception as exc:  # keep what was measured; say what failed
            notes.append(f"concurrency {c} failed: {type(exc).__name__}: {exc}")
            log(notes[-1])
        report()
    print(report())
    log(f"total {time.monotonic() - started:.0f} s")
    if smoke:
        bad = [r for r in rows if r[5] != r[6]]
        if bad or notes:
            print(f"smoke: outputs differ or runs failed: {[r[0] for r in bad]} {notes}")
            return 1
    return 0


@dataclass
class MeasureOptions:
    k: int
    gen_tokens: int
    waves: int
    defer_steps: int | None = None  # admission batching limit (None: the engine's default)
    ab_defer: frozenset[int] = frozenset()  # concurrencies also timed with admission batching off (0)
    deadline: float = float("inf")  # time.monotonic() after which optional runs are skipped


def _measure(config, spec_config, runner, plain, decoder, pool, c, opts: MeasureOptions, details):
    """One concurrency level: a warm-up of each path (captures its CUDA graphs for the batch
    and context buckets the timed run meets), then the timed runs.

    ``waves * c`` requests keep ``c`` running as earlier ones finish, so speculative
    requests finishing at different steps do not leave the batch draining (concurrency 1
    runs at least 5 requests, one after another: base and each adapter). Speculative
    requests finish at different steps, so their batch sizes and context lengths mix in
    ways the plain run never meets: its warm-up is the timed workload's shape (other
    prompts), and the graphs any timed run still had to capture are reported.
    """
    k, gen_tokens, waves = opts.k, opts.gen_tokens, opts.waves
    count = max(5, waves) if c == 1 else waves * c
    warm = make_workload(pool, max(c, 2), gen_tokens, offset=100)
    warm_spec = make_workload(pool, count if c > 1 else 2, gen_tokens, offset=100)
    bench = make_workload(pool, count, gen_tokens, offset=0)
    run_workload(config, runner, plain, warm, c, f"warm-off-{c}")
    off = run_workload(config, runner, plain, bench, c, f"off-{c}")
    run_workload(spec_config, runner, decoder, warm_spec, c, f"warm-on-{c}", defer_steps=opts.defer_steps)
    decoder.metrics = type(decoder.metrics)(decoder.metrics.algorithm, k)
    on = run_workload(spec_config, runner, decoder, bench, c, f"on-{c}", defer_steps=opts.defer_steps)
    summary = spec_summary(decoder)
    same = sum(off.outputs[f"off-{c}-{i}"] == on.outputs[f"on-{c}-{i}"] for i in range(count))
    speedup = on.tokens_per_s / off.tokens_per_s
    details[c] = {
        "off_s": off.seconds,
        "on_s": on.seconds,
        "generated": on.generated,
        **summary,
        "off_steps": off.steps,
        "on_steps": on.steps,
    }
    log(
        f"concurrency {c}: off {off.tokens_per_s:,.1f} tok/s, spec {on.tokens_per_s:,.1f} tok/s, x{speedup:.2f}; "
        f"{summary}; identical outputs {same}/{count}"
    )
    log(f"concurrency {c} steps: off {off.steps}; spec {on.steps}")
    if c in opts.ab_defer:
        if time.monotonic() + 1.5 * on.seconds > opts.deadline:
            log(f"concurrency {c}: no time left for the run without admission batching")
        else:
            plain_sched = run_workload(spec_config, runner, decoder, bench, c, f"nodefer-{c}", defer_steps=0)
            details[c]["on_nodefer_s"] = plain_sched.seconds
            details[c]["on_nodefer_steps"] = plain_sched.steps
            log(
                f"concurrency {c}: spec without admission batching {plain_sched.tokens_per_s:,.1f} tok/s"
                f" (x{plain_sched.tokens_per_s / off.tokens_per_s:.2f}); steps {plain_sched.steps}"
            )
    return (c, off.tokens_per_s, on.tokens_per_s, speedup, summary, same, count)


@torch.no_grad()
def _expansion_check(runner: ModelRunner, small_dir: Path, prompt: list[int], device: torch.device) -> dict:
    """Relative difference of last-position logits and greedy agreement: serving target vs trained model."""
    from transformers import AutoModelForCausalLM

    from loraserve.kernels import ForwardMode
    from loraserve.runtime.model import ForwardBatch

    ref = AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=runner.dtype).to(device).eval()
    ids = torch.tensor(prompt, device=device)
    ref_logits = ref(input_ids=ids[None]).logits[0].float()
    out = runner.forward(
        ForwardBatch(ForwardMode.EXTEND, ["check"], ids, extend_lens=[len(prompt)], return_all_logits=True)
    )
    runner.kv.free("check")
    ours = out.logits.float()
    rel = float((ours - ref_logits).norm() / ref_logits.norm())
    agree = float((ours.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    del ref
    return {"rel_logit_diff": round(rel, 4), "argmax_agreement": round(agree, 3)}


def _report(
    args,
    argv,
    device,
    target_shape,
    target_params,
    t_info,
    d_info,
    k,
    gen_tokens,
    prompt_len,
    check,
    rows,
    notes,
    details,
) -> list[str]:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "absent"
    lines = [
        f"# Speculative decoding with co-batched LoRA adapters ({datetime.date.today().isoformat()})",
        "",
        f"- device: {gpu}; torch {torch.__version__}; triton {triton_v}; python {platform.python_version()}",
        f"- command: `python bench/spec.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- serving target: {target_shape} shape, {target_params / 1e9:.2f} B parameters,"
        f" {'bf16, CUDA graphs on' if device.type == 'cuda' else 'float32, no CUDA graphs'};"
        " computes the trained small target's function"
        f" (check on a held-out prompt: {check})",
        f"- trained small target: {SHAPES['smoke-small' if args.smoke else 'small']} (hidden, layers, heads, kv, head_dim, mlp);"
        f" {t_info['params'] / 1e6:.0f} M params, {t_info['steps']} steps, {t_info['tokens'] / 1e6:.1f} M tokens, final loss {t_info['final_loss']:.2f}",
        f"- draft (STANDALONE, {d_info['training']} training): {SHAPES['smoke-draft' if args.smoke else 'draft']};"
        f" {d_info['params'] / 1e6:.0f} M params,"
        f" {d_info['steps']} steps, {d_info['tokens'] / 1e6:.1f} M tokens, final loss {d_info['final_loss']:.2f}"
        + (
            f"; teacher continuations {d_info['teacher_sequences']} of {d_info['teacher_prompts']}"
            f" ({d_info['teacher_seconds']} s), {d_info['teacher_fraction']:.0%} of each batch, sequences of {d_info['seq']}"
            if "teacher_prompts" in d_info
            else ""
        ),
        f"- verify width k = {k} (num_steps {k - 1}); greedy; prompts {prompt_len} held-out stdlib tokens; {gen_tokens} new tokens per request;"
        f" 4 adapters (rank 16, all linear modules, B ~ N(0, {args.adapter_b_std}^2)) + base, request i uses base or adapter i % 5;"
        f" concurrency 1 runs {max(5, args.waves or 1)} requests one after another, concurrency c runs"
        f" {args.waves or (1 if args.smoke else 3)} x c requests, c at a time",
        "",
        "| concurrency | no spec tok/s | spec tok/s | speedup | mean accepted drafts / step | accept rate | per-adapter mean accepted | verify ms | step ms | identical outputs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, off, on, speedup, s, same, count in rows:
        per = ", ".join(f"{n} {v}" for n, v in s["per_adapter_mean_accept"].items())
        lines.append(
            f"| {c} | {off:,.1f} | {on:,.1f} | {speedup:.2f}x | {s['mean_accept']} of {k - 1} | {s['accept_rate']} | {per} |"
            f" {s['verify_ms']} | {s['step_ms']} | {same}/{count} |"
        )
    lines += _time_table(details)
    lines += [""] + [f"- {n}" for n in notes]
    return lines


def _time_table(details: dict) -> list[str]:
    """Where each timed run's wall time went, from the engine's step counters."""
    lines = [
        "",
        "Where the time went (engine counters; decoder seconds by step kind, engine = host work outside"
        " the decoder; graphs = CUDA graphs the timed run itself had to capture):",
        "",
        "| concurrency | run | wall s | extend steps (during decode) | ms / extend | decode steps | mean batch |"
        " ms / decode step | tokens / decode step | engine s | deferred steps | graphs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, d in details.items():
        runs = [("no spec", d.get("off_s"), d.get("off_steps")), ("spec", d.get("on_s"), d.get("on_steps"))]
        if "on_nodefer_steps" in d:
            runs.append(("spec, admission at once", d["on_nodefer_s"], d["on_nodefer_steps"]))
        for name, wall, st in runs:
            if not st:
                continue
            lines.append(
                f"| {c} | {name} | {wall:.2f} | {st['extend_steps']} ({st['extends_during_decode']}) |"
                f" {st['extend_ms_per_step']} | {st['decode_steps']} | {st['mean_decode_batch']} |"
                f" {st['decode_ms_per_step']} | {st['tokens_per_decode_step']} | {st['engine_s']} |"
                f" {st['deferred_admission_steps']} | {st['graphs_captured']} |"
            )
    return lines


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
