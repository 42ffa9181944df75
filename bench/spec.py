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
   ``--draft eagle`` trains an EAGLE head instead (``--draft standalone,eagle``: both): one
   Llama decoder layer of the small target's shape over the target's own final normed
   hidden state, sharing its embeddings and LM head (the runtime's EAGLE format and
   equations, ``loraserve.runtime.speculative.eagle_format``). The input at position ``i`` is
   ``fc([embed(x[i+1]), feature[i]])``; the loss is KL to the target's distribution of
   ``x[i+2]`` plus a smooth-L1 pull towards ``feature[i+1]``, on the same batches as the
   STANDALONE distillation, for ``--train-draft-s``. Training unrolls a second draft step
   on the head's own predicted feature (as serving's steps 2..k run; ``--eagle-unroll S``
   trains steps 2..S that way, EAGLE-3's training-time test); ``--eagle-unroll 1``
   trains teacher-forced only. The target's features of the training windows are computed
   once before training (``--eagle-cache-gib``; 0: every step, as up to run 12), so the
   training budget goes to the head. For the 8B-shaped target the head is expanded the same
   function-preserving way, and a check compares the served head's proposals and output
   features with the trained head's on held-out prompts.
5. For concurrency 1, 8 and 32, the same greedy workload runs through the real engine
   without speculation and with each draft's speculation (EAGLE first, so that under
   ``--deadline-s`` a second draft's run is the one skipped). Tokens/s is
   generated tokens over wall time (prefill included); accept lengths come from the
   decoder's metrics, overall and per adapter. Outputs of the two runs are compared.
   The engine's step counters say where each run's time went (extend and decode steps,
   batch occupancy, host work, CUDA graphs captured during the timed run). Concurrency 1
   runs ``--c1-requests`` requests (default 10) one after another. ``--phases DIR`` then
   times one more request per draft, and the same request without speculation, call by
   call inside each decode step (host time and CUDA-event spans; ``PhaseRecorder``).

    python bench/spec.py --smoke                # CPU, tiny models, a minute
    python bench/spec.py --out results.md       # GPU
    python bench/spec.py --out results.md --draft standalone,eagle --deadline-s 480
    python bench/spec.py --out results.md --draft eagle --concurrency 1 --phases phases/
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
import platform
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES, RuntimeConfig, SpecAlgorithm
from loraserve.runtime.dev.devmodels import write_tokenizer
from loraserve.runtime.engine.decoder import StandardDecoder
from loraserve.runtime.engine.engine import Engine
from loraserve.runtime.engine.request import Request
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import Sampler, SamplingParams
from loraserve.runtime.speculative import build_decoder

SHAPES = {
    # name: (hidden, layers, heads, kv_heads, head_dim, intermediate)
    "smoke-small": (64, 2, 4, 2, 16, 128),
    "smoke-draft": (32, 1, 2, 1, 16, 64),
    "smoke-big": (128, 4, 8, 4, 16, 256),
    "small": (1024, 8, 8, 2, 128, 2816),
    "draft": (384, 2, 6, 3, 64, 1024),
    "8b": (4096, 32, 32, 8, 128, 14336),
}
DRAFTS = ("standalone", "eagle")
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
    max_steps: int | None = None,
):
    """Train a Llama of ``shape`` for ``seconds`` on random windows of ``data``.

    With a ``teacher``, the loss is the KL divergence from the teacher's next-token
    distribution (distillation), and ``teacher_fraction`` of every batch comes from
    ``teacher_data`` (sequences the teacher generated itself, ``[n, seq + 1]``): the draft
    learns to predict what the target says, which is what speculation accepts.
    ``max_steps`` also ends training (whichever comes first; the schedule follows the
    larger of the time and step fractions).
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
    while (frac := _progress(time.monotonic() - start, seconds, step, max_steps)) < 1.0:
        for group in opt.param_groups:
            group["lr"] = lr * _lr_scale(step, frac)
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
    # large batches on a GPU: generation of a small model is bound by per-step latency
    for part in prompts.split(2048 if device.type == "cuda" else 512):
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
    from loraserve.runtime.dev.devmodels import copy_tokenizer

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


# --------------------------------------------------------------------------- EAGLE head

# Checkpoint names (``loraserve.runtime.speculative.eagle_format``) of the head's parameters.
EAGLE_NAMES = {
    "fc": "fc.weight",
    "q_proj": "layers.0.self_attn.q_proj.weight",
    "k_proj": "layers.0.self_attn.k_proj.weight",
    "v_proj": "layers.0.self_attn.v_proj.weight",
    "o_proj": "layers.0.self_attn.o_proj.weight",
    "gate_proj": "layers.0.mlp.gate_proj.weight",
    "up_proj": "layers.0.mlp.up_proj.weight",
    "down_proj": "layers.0.mlp.down_proj.weight",
    "input_norm": "layers.0.input_layernorm.weight",
    "post_norm": "layers.0.post_attention_layernorm.weight",
}
# Keys an EAGLE config.json takes over from its target's (eagle_builder does the same).
EAGLE_COPIED_KEYS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling", "hidden_act", "bos_token_id",
    "eos_token_id", "pad_token_id",
)  # fmt: skip


class EagleHead(torch.nn.Module):
    """The runtime's EAGLE draft layer (version 1, with input norm) as a trainable module.

    The equations of ``eagle_format`` / ``EagleDraftModel``: the input at position ``i`` is
    ``fc([embed(x[i+1]), feature[i]])`` (feature = the target's final normed hidden state),
    then one Llama decoder layer with causal attention at positions ``0..T-1``; the output
    is the predicted ``feature[i+1]`` and ``lm_head(output)`` (no norm) the distribution of
    ``x[i+2]``. The target's embeddings and LM head are frozen buffers, never trained.
    """

    def __init__(self, shape: str, embed: torch.Tensor, lm_head: torch.Tensor, *, eps: float, theta: float):
        super().__init__()
        hidden, _, heads, kv, head_dim, inter = SHAPES[shape]
        self.shape, self.eps = shape, eps
        self.heads, self.kv_heads, self.head_dim = heads, kv, head_dim

        def lin(fan_in: int, fan_out: int) -> torch.nn.Linear:
            return torch.nn.Linear(fan_in, fan_out, bias=False)

        self.fc = lin(2 * hidden, hidden)
        self.q_proj, self.k_proj = lin(hidden, heads * head_dim), lin(hidden, kv * head_dim)
        self.v_proj, self.o_proj = lin(hidden, kv * head_dim), lin(heads * head_dim, hidden)
        self.gate_proj, self.up_proj, self.down_proj = (
            lin(hidden, inter),
            lin(hidden, inter),
            lin(inter, hidden),
        )
        self.input_norm = torch.nn.Parameter(torch.ones(hidden))
        self.post_norm = torch.nn.Parameter(torch.ones(hidden))
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        self.register_buffer(
            "inv_freq",
            1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim),
            persistent=False,
        )

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The head's weights under their ``eagle_format`` names (float32, CPU)."""
        out = {}
        for attr, name in EAGLE_NAMES.items():
            p = getattr(self, attr)
            weight = p if isinstance(p, torch.nn.Parameter) else p.weight
            out[name] = weight.detach().float().cpu().contiguous()
        return out

    @torch.no_grad()
    def round_to_bf16(self) -> None:
        """Round the weights and the shared embeddings / LM head to bfloat16 values: what is
        saved and served (``save_hf`` stores the target in bfloat16 too)."""
        for t in [*self.parameters(), self.embed, self.lm_head]:
            t.copy_(t.to(torch.bfloat16).float())

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return out.float() @ self.lm_head.T

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32 (as Llama and the runtime do), back in ``x``'s dtype under autocast."""
        xf = x.float()
        return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _qkv(self, ids: torch.Tensor, feats: torch.Tensor):
        """Residual, rotated q / k and v of input pairs ``(ids, feats)`` ``[B, T]`` at positions 0..T-1."""
        b, t = ids.shape
        residual = self.fc(torch.cat([torch.nn.functional.embedding(ids, self.embed), feats.float()], -1))
        x = self._norm(residual, self.input_norm)
        pos = torch.arange(t, device=ids.device)

        def split(y: torch.Tensor, n: int) -> torch.Tensor:
            return y.view(b, t, n, self.head_dim).transpose(1, 2)

        q = self._rope(split(self.q_proj(x), self.heads), pos)
        k = self._rope(split(self.k_proj(x), self.kv_heads), pos)
        groups = self.heads // self.kv_heads
        v = split(self.v_proj(x), self.kv_heads).repeat_interleave(groups, 1)
        return residual, q, k.repeat_interleave(groups, 1), v

    def _finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        h = residual + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        m = self._norm(h, self.post_norm)
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(m)) * self.up_proj(m))

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Output features ``[B, T, H]`` of the input pairs ``(ids[:, i], feats[:, i])``."""
        residual, q, k, v = self._qkv(ids, feats)
        return self._finish(
            residual, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        )

    def unrolled(self, ids: torch.Tensor, feats: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
        """``steps`` draft steps at once (EAGLE-3's training-time test), one output per step.

        Step 1 is :meth:`forward`. Step ``s`` at position ``j`` takes the head's own step
        ``s - 1`` output of ``j - 1`` as its feature and attends as serving's ``s``-th chain
        step does: to the step-1 (target-feature) entries up to ``j - s + 1``, to the step
        ``r`` entry at ``j - s + r`` for ``1 < r < s``, and to itself. Rows ``j < s - 1`` have
        too few predecessors; their values are computed but mean nothing (the loss skips them).
        """
        residual, q, k, v = self._qkv(ids, feats)
        outs = [
            self._finish(residual, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        ]
        t = ids.shape[1]
        scale = self.head_dim**-0.5
        keys, values = [k], [v]  # per step: K / V of its entry at every position
        for step in range(2, steps + 1):
            prev = outs[-1]
            own = torch.cat([feats[:, :1].to(prev.dtype), prev[:, :-1]], 1)
            residual_s, q_s, k_s, v_s = self._qkv(ids, own)
            # target-feature entries i <= j - step + 1
            past = (q_s @ k.transpose(-1, -2)) * scale
            allowed = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril(-(step - 1))
            scores = [past.masked_fill(~allowed, float("-inf"))]
            shifted_v = []
            for r in range(2, step):  # the step-r chain entry at j - step + r
                shift = step - r
                k_r = torch.cat([keys[r - 1][:, :, :1].expand(-1, -1, shift, -1), keys[r - 1][:, :, :-shift]], 2)
                v_r = torch.cat([values[r - 1][:, :, :1].expand(-1, -1, shift, -1), values[r - 1][:, :, :-shift]], 2)
                scores.append((q_s * k_r).sum(-1, keepdim=True) * scale)
                shifted_v.append(v_r)
            scores.append((q_s * k_s).sum(-1, keepdim=True) * scale)
            p = torch.cat(scores, -1).float().softmax(-1).to(v.dtype)
            attn = p[..., :t] @ v
            for i, v_r in enumerate([*shifted_v, v_s]):
                attn = attn + p[..., t + i : t + i + 1] * v_r
            outs.append(self._finish(residual_s, attn))
            keys.append(k_s)
            values.append(v_s)
        return outs

    @torch.no_grad()
    def propose(
        self, ids: list[int], feats: torch.Tensor, first: int, steps: int
    ) -> tuple[list[int], torch.Tensor]:
        """Greedy proposals after a prompt ``ids`` with target features ``feats`` ``[P, H]``
        and the target's next token ``first``, recomputing the whole sequence each step;
        returns the tokens and the head's output feature of each step ``[steps, H]``.

        One layer: an entry's K/V depend only on its own input pair, so recomputing the
        pairs (target features, then the head's own outputs) equals serving's cached run.
        """
        pair_ids = [*ids[1:], first]
        pair_feats = feats.float()
        tokens: list[int] = []
        outs = []
        for _ in range(steps):
            o = self(torch.tensor([pair_ids], device=feats.device), pair_feats[None])[0, -1]
            tokens.append(int(self.logits(o).argmax()))
            outs.append(o)
            pair_ids.append(tokens[-1])
            pair_feats = torch.cat([pair_feats, o[None]])
        return tokens, torch.stack(outs)


def _progress(elapsed: float, seconds: float, step: int, max_steps: int | None) -> float:
    """Share of the training budget spent: time, or steps when ``max_steps`` caps them."""
    frac = elapsed / seconds if seconds > 0 else 1.0
    return max(frac, step / max_steps) if max_steps else frac


def _lr_scale(step: int, frac: float, warmup: int = 50) -> float:
    """Linear warm-up, then cosine decay to 10% over the time budget (as ``train_lm``)."""
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class EagleTraining:
    """How the EAGLE head trains (``--eagle-*`` options)."""

    seconds: float
    seq: int
    batch: int
    lr: float
    teacher_fraction: float = 0.5
    noise: float = 0.0  # EAGLE's uniform feature noise U(-noise, noise) on the step-1 input
    unroll: int = 2  # draft steps trained per position: 1 teacher forcing only; s > 1 also steps 2..s on own features
    feature_weight: float = 0.1  # smooth-L1 on the feature, next to KL to the target on the token
    seed: int = 4
    max_steps: int | None = None  # also ends training (a shared CPU trains as far as an idle one)
    cache_gib: float = 0.0  # > 0: the target's features of every training window computed once, up to this size


def target_features(target, window: torch.Tensor) -> torch.Tensor:
    """The target's final normed hidden states ``[B, L, H]``: the feature the runtime feeds."""
    autocast = window.device.type == "cuda"
    with (
        torch.no_grad(),
        torch.autocast(device_type=window.device.type, dtype=torch.bfloat16, enabled=autocast),
    ):
        return target.model(input_ids=window).last_hidden_state.float()


def eagle_loss(
    head: EagleHead, target, window: torch.Tensor, opts: EagleTraining, feats: torch.Tensor | None = None
):
    """EAGLE's loss on token windows ``[B, L]``: per draft step, KL from the target's
    next-token distribution plus ``feature_weight`` x smooth-L1 to the target's feature.
    ``feats``: the target's features of ``window`` when already computed (:class:`FeatureCache`).

    Returns (loss, per-step top-1 agreement with the target's greedy token).
    """
    feats = target_features(target, window) if feats is None else feats.float()
    ids, inputs, want = window[:, 1:], feats[:, :-1], feats[:, 1:]
    if opts.noise:
        inputs = inputs + (2 * torch.rand_like(inputs) - 1) * opts.noise
    with torch.no_grad():
        teacher = torch.log_softmax(head.logits(want), -1)
    autocast = window.device.type == "cuda"
    with torch.autocast(device_type=window.device.type, dtype=torch.bfloat16, enabled=autocast):
        outs = head.unrolled(ids, inputs, opts.unroll) if opts.unroll > 1 else [head(ids, inputs)]
    loss, top1 = torch.zeros((), device=window.device), []
    for step, out in enumerate(outs):
        out, t_logp, w = out[:, step:], teacher[:, step:], want[:, step:]  # step s skips rows < s - 1
        logp = torch.log_softmax(head.logits(out), -1)
        vocab = logp.shape[-1]
        kl = torch.nn.functional.kl_div(
            logp.reshape(-1, vocab), t_logp.reshape(-1, vocab), log_target=True, reduction="batchmean"
        )
        loss = loss + kl + opts.feature_weight * torch.nn.functional.smooth_l1_loss(out.float(), w)
        top1.append(float((logp.argmax(-1) == t_logp.argmax(-1)).float().mean()))
    return loss, top1


@dataclass
class FeatureCache:
    """Training windows with the target's features, computed once (``--eagle-cache-gib``).

    The target is frozen, so its features of a window never change: computing them once
    leaves every training step the head's own work (the target's forward was about 40% of
    a step). Corpus windows are then fixed, non-overlapping slices of the corpus instead of
    windows at random offsets."""

    windows: torch.Tensor  # int64 [n, seq + 1], on the device
    features: torch.Tensor  # bfloat16 [n, seq + 1, H], on the device

    @classmethod
    def build(cls, target, windows: torch.Tensor, device: torch.device, chunk: int = 256) -> FeatureCache:
        windows = windows.to(device)
        parts = [target_features(target, part).to(torch.bfloat16) for part in windows.split(chunk)]
        return cls(windows, torch.cat(parts))

    def sample(self, count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(0, self.windows.shape[0], (count,), generator=gen).to(self.windows.device)
        return self.windows[rows], self.features[rows]


def _feature_caches(
    target, data: torch.Tensor, teacher_data: torch.Tensor | None, device: torch.device, opts: EagleTraining
) -> tuple[FeatureCache, FeatureCache | None, dict] | None:
    """The corpus and teacher caches within ``opts.cache_gib`` (teacher rows first), or None."""
    if opts.cache_gib <= 0:
        return None
    t0 = time.monotonic()
    width = opts.seq + 1
    per_row = width * target.config.hidden_size * 2  # bfloat16
    budget = int(opts.cache_gib * 2**30) // per_row
    n_teacher = 0 if teacher_data is None else min(teacher_data.shape[0], budget // 2)
    n_corpus = min(data.numel() // width, budget - n_teacher)
    if n_corpus < 1 or (teacher_data is not None and n_teacher < 1):
        return None
    corpus = FeatureCache.build(target, data[: n_corpus * width].view(n_corpus, width), device)
    teacher = None
    if n_teacher:
        assert teacher_data is not None
        teacher = FeatureCache.build(target, teacher_data[:n_teacher, :width], device)
    info = {
        "cached_corpus_windows": n_corpus,
        "cached_teacher_windows": n_teacher,
        "cache_gib": round((n_corpus + n_teacher) * per_row / 2**30, 2),
        "cache_seconds": round(time.monotonic() - t0, 1),
    }
    log(f"EAGLE feature cache: {info}")
    return corpus, teacher, info


def train_eagle_head(
    target, shape: str, data: torch.Tensor, teacher_data: torch.Tensor | None, device: torch.device,
    opts: EagleTraining,
) -> tuple[EagleHead, dict]:  # fmt: skip
    """Train an EAGLE head over the frozen ``target`` for ``opts.seconds``.

    Batches mix corpus windows and the target's own greedy continuations (``teacher_data``,
    ``[n, seq + 1]``; the STANDALONE draft's distillation data) in ``teacher_fraction``.
    With ``opts.cache_gib`` the target's features of the windows are computed once, before
    the clock starts (:class:`FeatureCache`); the time it takes is reported.
    """
    cfg = target.config
    head = EagleHead(
        shape, target.model.embed_tokens.weight, target.lm_head.weight, eps=cfg.rms_norm_eps,
        theta=float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]),
    ).to(device)  # fmt: skip
    torch.manual_seed(opts.seed)
    for p in head.parameters():  # norms start at 1; the rest as a Llama initialises
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    params = list(head.parameters())
    optim = torch.optim.AdamW(
        params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda"
    )
    gen = torch.Generator().manual_seed(opts.seed)
    data = data.to(device)
    caches = _feature_caches(target, data, teacher_data, device, opts)
    start, step, loss, top1 = time.monotonic(), 0, torch.zeros(()), [0.0]
    while (frac := _progress(time.monotonic() - start, opts.seconds, step, opts.max_steps)) < 1.0:
        for group in optim.param_groups:
            group["lr"] = opts.lr * _lr_scale(step, frac)
        n_teacher = 0 if teacher_data is None else max(1, round(opts.batch * opts.teacher_fraction))
        if caches is not None:
            corpus, teacher, _ = caches
            window, feats = corpus.sample(opts.batch - n_teacher, gen)
            if teacher is not None and n_teacher:
                t_window, t_feats = teacher.sample(n_teacher, gen)
                window, feats = torch.cat([window, t_window]), torch.cat([feats, t_feats])
            loss, top1 = eagle_loss(head, target, window, opts, feats)
        else:
            starts = torch.randint(0, data.numel() - opts.seq - 1, (opts.batch - n_teacher,), generator=gen)
            window = data[(starts[:, None] + torch.arange(opts.seq + 1)[None, :]).to(device)]
            if n_teacher:
                rows = torch.randint(0, teacher_data.shape[0], (n_teacher,), generator=gen)
                window = torch.cat(
                    [window, teacher_data[rows.to(teacher_data.device)][:, : opts.seq + 1].to(device)]
                )
            loss, top1 = eagle_loss(head, target, window, opts)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        step += 1
    head.eval()
    return head, {
        "steps": step,
        "tokens": step * opts.batch * opts.seq,
        "final_loss": round(loss.item(), 3),
        "train_top1": [round(a, 3) for a in top1],
        "params": sum(p.numel() for p in params),
        "noise": opts.noise,
        "unroll": opts.unroll,
        "feature_weight": opts.feature_weight,
        "teacher_fraction": opts.teacher_fraction if teacher_data is not None else 0.0,
        "seq": opts.seq,
        **(caches[2] if caches is not None else {"feature_cache": "off"}),
    }


@torch.no_grad()
def eagle_heldout_top1(
    head: EagleHead, target, held_ids: torch.Tensor, device: torch.device, *, seq: int, steps: int = 2
) -> list[float]:
    """Per-step top-1 agreement with the target's greedy token on held-out windows
    (steps 2.. on the head's own previous feature): an offline proxy of multi-step acceptance."""
    n = min(16, (held_ids.numel() - 1) // (seq + 1))
    window = held_ids[: n * (seq + 1)].view(n, seq + 1).to(device)
    opts = EagleTraining(seconds=0, seq=seq, batch=n, lr=0, unroll=steps)
    _, top1 = eagle_loss(head, target, window, opts)
    return [round(a, 3) for a in top1]


def eagle_config(target_raw: dict, intermediate: int) -> dict:
    """config.json of an EAGLE head for the target whose config.json is ``target_raw``."""
    raw = {key: target_raw[key] for key in EAGLE_COPIED_KEYS if key in target_raw}
    raw.update(
        architectures=["LlamaForCausalLMEagle"],
        model_type="llama",
        num_hidden_layers=1,
        intermediate_size=intermediate,
        target_hidden_size=target_raw["hidden_size"],
        bias=False,
        tie_word_embeddings=False,
        # float32 on disk: the expansion's rescaled norm weights are not bfloat16 values;
        # the runtime casts to the serving dtype, as it does for the expanded target
        torch_dtype="float32",
    )
    return raw


def save_eagle_head(tensors: dict[str, torch.Tensor], raw: dict, dest: Path) -> Path:
    """Write an EAGLE draft directory (``eagle_format``): config.json + model.safetensors (float32)."""
    from safetensors.torch import save_file

    from loraserve.runtime.speculative.eagle_format import eagle_config_from_dict

    config = eagle_config_from_dict(raw)
    shapes = config.tensor_shapes()
    wrong = {n: tuple(t.shape) for n, t in tensors.items() if shapes.get(n) != tuple(t.shape)}
    if wrong or set(shapes) != set(tensors):
        raise ValueError(
            f"EAGLE head tensors do not fit their config: {wrong or sorted(set(shapes) ^ set(tensors))}"
        )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(raw, indent=1))
    save_file({n: t.float().contiguous() for n, t in tensors.items()}, str(dest / "model.safetensors"))
    return dest


@torch.no_grad()
def expand_eagle_head(
    small: dict[str, torch.Tensor], small_shape: str, big_shape: str
) -> dict[str, torch.Tensor]:
    """The small head's weights placed in a head of ``big_shape`` that computes the same function
    on the expanded target's features (``expand_into``): the embedding and feature inputs are
    zero-padded, so fc reads only their first ``Hs`` dimensions and writes only its first
    ``Hs`` outputs; extra heads and MLP units have zero weights and add nothing; RMSNorm
    weights scale by ``sqrt(Hs/Hb)`` (the config's eps is the big target's, ``eps * Hs/Hb``).
    """
    hs, _, ns, kvs, d, _ = SHAPES[small_shape]
    hb, _, nb, kvb, db, ib = SHAPES[big_shape]
    if db != d or nb // kvb != ns // kvs:
        raise ValueError(f"{big_shape} must keep {small_shape}'s head_dim {d} and GQA group size {ns // kvs}")
    scale = math.sqrt(hs / hb)
    big = {
        "fc.weight": torch.zeros(hb, 2 * hb),
        EAGLE_NAMES["q_proj"]: torch.zeros(nb * d, hb),
        EAGLE_NAMES["k_proj"]: torch.zeros(kvb * d, hb),
        EAGLE_NAMES["v_proj"]: torch.zeros(kvb * d, hb),
        EAGLE_NAMES["o_proj"]: torch.zeros(hb, nb * d),
        EAGLE_NAMES["gate_proj"]: torch.zeros(ib, hb),
        EAGLE_NAMES["up_proj"]: torch.zeros(ib, hb),
        EAGLE_NAMES["down_proj"]: torch.zeros(hb, ib),
        EAGLE_NAMES["input_norm"]: torch.zeros(hb),
        EAGLE_NAMES["post_norm"]: torch.zeros(hb),
    }
    fc = small["fc.weight"]
    big["fc.weight"][:hs, :hs] = fc[:, :hs]  # the embedding half
    big["fc.weight"][:hs, hb : hb + hs] = fc[:, hs:]  # the feature half
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        w = small[EAGLE_NAMES[name]]
        big[EAGLE_NAMES[name]][: w.shape[0], :hs] = w
    for name in ("o_proj", "down_proj"):
        w = small[EAGLE_NAMES[name]]
        big[EAGLE_NAMES[name]][:hs, : w.shape[1]] = w
    for name in ("input_norm", "post_norm"):
        big[EAGLE_NAMES[name]][:hs] = small[EAGLE_NAMES[name]] * scale
    return big


@torch.no_grad()
def _eagle_check(
    runner: ModelRunner,
    head_dir: Path,
    head: EagleHead,
    small_dir: Path,
    prompts: list[list[int]],
    steps: int,
) -> dict:
    """The served head (``head_dir``, loaded by the runtime, on the serving target's features)
    against the trained head on the trained target's features, after each held-out prompt.
    The served head steps on the trained head's own proposals (teacher forcing), so one
    near-tied argmax that bf16 flips costs one proposal instead of derailing the rest: the
    share of proposals that agree, the smallest top-2 logit margin among those that do not
    (a flip of a near-tie has a margin near bf16's rounding of the logits), the relative
    difference of the output features (the served head's first ``Hs`` dimensions) and the
    largest relative norm of its padded dimensions, which must stay zero."""
    from transformers import AutoModelForCausalLM

    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch
    from loraserve.runtime.speculative.eagle_model import base_weight
    from loraserve.runtime.speculative.eagle_runner import EagleDraftRunner

    device = runner.device
    ref = AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=runner.dtype).to(device).eval()
    longest = max(len(p) for p in prompts) + steps + 1
    served = EagleDraftRunner(
        str(head_dir), target_arch=runner.arch, embed_weight=base_weight(runner.embed_tokens),
        lm_head_weight=base_weight(runner.lm_head), dtype=runner.dtype, device=device,
        max_total_tokens=2 * longest, max_requests=2, max_context_len=longest,
    )  # fmt: skip
    ref_head = head.to(device=device, dtype=torch.float32)
    hs = head.fc.weight.shape[0]
    same = total = 0
    rel = padded = 0.0
    margins: list[float] = []
    pairs = []
    for prompt in prompts:
        ids = torch.tensor(prompt, device=device)
        batch = ForwardBatch(
            ForwardMode.EXTEND, ["eagle-check"], ids, extend_lens=[len(prompt)], return_hidden=True
        )
        out = runner.forward(batch)
        runner.kv.free("eagle-check")
        first = int(out.logits[-1].argmax())
        want, want_out = ref_head.propose(prompt, target_features(ref, ids[None])[0], first, steps)
        pair_ids = torch.tensor([*prompt[1:], first])
        tail = served.forward(["c"], pair_ids, out.hidden_states, [len(prompt)])[-1:]
        got, tails = [], []
        for j in range(steps):
            if j:  # the trained head's token, whatever the served head proposed
                tail = served.forward(["c"], torch.tensor([want[j - 1]]), tail, [1], from_target=False)
            logits = served.compute_logits(tail)[0]
            got.append(int(logits.argmax()))
            if got[-1] != want[j]:
                top2 = logits.topk(2).values
                margins.append(float(top2[0] - top2[1]))
            tails.append(tail[0].float())
        served.kv.free("c")
        got_out = torch.stack(tails)
        rel = max(rel, float((got_out[:, :hs] - want_out).norm() / want_out.norm()))
        padded = max(padded, float(got_out[:, hs:].norm() / got_out.norm()))
        same += sum(a == b for a, b in zip(got, want, strict=True))
        total += steps
        pairs.append((want, got))
    del ref, served
    return {
        "proposal_agreement": round(same / total, 3),
        "disagreeing_margin": round(min(margins), 4) if margins else None,
        "rel_feature_diff": round(rel, 5),
        "padded_norm": round(padded, 6),
        "first_prompt": {"trained": pairs[0][0], "served": pairs[0][1]},
    }


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
    profiler=None,
) -> RunResult:
    """All requests submitted at once; the engine runs ``concurrency`` at a time.

    ``profiler``: a ``torch.profiler.profile`` started and stopped on the engine's own
    thread (the profiler records the thread that starts it)."""
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
    if profiler is not None:
        engine.call(profiler.start).result()
    start = time.perf_counter()
    for req in reqs:
        engine.submit(req)
    if not done.wait(600):
        raise RuntimeError(f"{tag}: timed out")
    seconds = time.perf_counter() - start
    if profiler is not None:
        engine.call(profiler.stop).result()
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
    hist = snap.overall.histogram
    steps = max(sum(hist), 1)
    return {
        "mean_accept": round(snap.overall.mean_accept_len, 2),
        # P(draft j of a step is accepted) = share of steps accepting at least j drafts
        "per_position": [round(sum(hist[j:]) / steps, 3) for j in range(1, len(hist))],
        "accept_rate": round(snap.overall.accept_rate, 3),
        "per_adapter_mean_accept": per,
        "histogram": snap.overall.histogram,
        "verify_ms": round(1e3 * snap.verify_seconds.total / max(snap.verify_seconds.count, 1), 2),
        "step_ms": round(1e3 * snap.step_seconds.total / max(snap.step_seconds.count, 1), 2),
        "undrafted_steps": snap.undrafted_steps,
    }


def make_workload(prompt_pool: list[list[int]], count: int, gen_tokens: int, offset: int) -> Workload:
    names: list[str | None] = [None, "ad0", "ad1", "ad2", "ad3"]
    prompts = [prompt_pool[(offset + i) % len(prompt_pool)] for i in range(count)]
    return Workload(prompts, [names[(offset + i) % len(names)] for i in range(count)], gen_tokens)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), or
    None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identity_by_kind(
    adapters: list[str | None],
    outs_a: list[list[int]],
    outs_b: list[list[int]],
    gap: Callable[[int, int], float | None] | None = None,
) -> dict:
    """Token-for-token agreement of two runs of the same requests, split into base-model and
    adapter requests: ``{kind: {"identical", "count", "mean_first_divergence", "max_gap"}}``.
    ``gap(i, at)``: how far apart the target's logits put the two runs' tokens where request
    ``i`` first differs (see :func:`first_difference_gap`); ``max_gap`` is the largest.

    On a GPU in bf16 two batch shapes can round near-tied argmaxes differently (a verify of
    k rows against a decode of one), so speculation's agreement is read against the same
    split for two plain runs that differ only in batch shape: a LoRA bug shows as adapter
    requests diverging more, or earlier, than base requests and than that floor.
    """
    kinds: dict[str, dict] = {}
    for i, (adapter, a, b) in enumerate(zip(adapters, outs_a, outs_b, strict=True)):
        kind = "base" if adapter is None else "adapter"
        k = kinds.setdefault(kind, {"identical": 0, "count": 0, "first": [], "gaps": []})
        k["count"] += 1
        at = first_divergence(a, b)
        if at is None:
            k["identical"] += 1
            continue
        k["first"].append(at)
        if gap is not None and (g := gap(i, at)) is not None:
            k["gaps"].append(g)
    return {
        kind: {
            "identical": k["identical"],
            "count": k["count"],
            "mean_first_divergence": round(sum(k["first"]) / len(k["first"]), 1) if k["first"] else None,
            "max_gap": round(max(k["gaps"]), 3) if k["gaps"] else None,
        }
        for kind, k in sorted(kinds.items())
    }


def first_difference_gap(
    runner: ModelRunner, prompt: list[int], adapter: str | None, a: list[int], b: list[int], at: int
) -> float | None:
    """|logit(a[at]) - logit(b[at])| of the target (with ``adapter``) after ``prompt`` and the
    tokens both outputs share: near zero where the two runs differ by rounding a near-tie
    (batch shape, verify width), large where one of them chose a token the target does not
    prefer. None where one output ended first."""
    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch

    if at >= min(len(a), len(b)):
        return None
    ids = torch.tensor([*prompt, *a[:at]])
    out = runner.forward(
        ForwardBatch(ForwardMode.EXTEND, ["gap-check"], ids, extend_lens=[len(ids)], lora_names=[adapter])
    )
    runner.kv.free("gap-check")
    logits = out.logits[-1].float()
    return abs(float(logits[a[at]] - logits[b[at]]))


def gap_of(runner: ModelRunner, work: Workload, outs_a: list[list[int]], outs_b: list[list[int]]):
    """The ``gap`` argument of :func:`identity_by_kind` for two runs of ``work``."""
    return lambda i, at: first_difference_gap(runner, work.prompts[i], work.adapters[i], outs_a[i], outs_b[i], at)


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
    ap.add_argument(
        "--distill-count", type=int, default=None, help="teacher continuations (default 24576; smoke 32)"
    )
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
        "--disable-batch-size",
        type=int,
        default=0,
        help="speculative.disable_batch_size for every draft: steps of at least this many requests skip"
        " drafting (0: always draft)",
    )
    ap.add_argument(
        "--auto-disable",
        action="store_true",
        help="speculative.auto_disable for every draft: draft per batch-size bucket only while it measures faster",
    )
    ap.add_argument(
        "--auto-disable-ab",
        action="store_true",
        help="also time each draft with speculative.auto_disable on, as its own run (DRAFT+auto) against the"
        " same baseline, so one call measures the switch beside plain speculation",
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="directory: after each draft's timed run at concurrency 1, profile one more request with"
        " torch.profiler and write the operator table there (where a step's time goes)",
    )
    ap.add_argument(
        "--phases",
        default=None,
        help="directory: after each draft's timed run at concurrency 1, run one more request through the"
        " speculative and the plain decoder with their methods timed on the host and (CUDA events) on the"
        " GPU, and write phases-DRAFT.md there (where a step's time goes, without a profiler's distortion)",
    )
    ap.add_argument(
        "--k-sweep",
        default="",
        help="comma list of other num_draft_tokens values to time at concurrency 1 with the first draft"
        " (the same trained draft and workload; rows DRAFT-kN), e.g. 4,8,10",
    )
    ap.add_argument(
        "--c1-requests",
        type=int,
        default=10,
        help="requests concurrency 1 runs, one after another (base and each adapter in turn; default 10)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="seconds from the start after which optional runs (--ab-defer, a second draft) are skipped",
    )
    ap.add_argument(
        "--draft",
        default="standalone",
        help="comma list of drafts, each its own speculative run against the same no-spec baseline:"
        " standalone (a small distilled Llama) and/or eagle (an EAGLE head over the target's features)",
    )
    ap.add_argument(
        "--eagle-noise", type=float, default=0.0, help="EAGLE training: U(-a, a) noise on features"
    )
    ap.add_argument(
        "--eagle-unroll",
        type=int,
        default=2,
        help="EAGLE training: draft steps trained per position (training-time test); 1 teacher forcing"
        " only, s > 1 also steps 2..s, each on the head's own previous feature (default 2)",
    )
    ap.add_argument(
        "--eagle-feature-weight", type=float, default=0.1, help="EAGLE training: weight of the feature loss"
    )
    ap.add_argument("--eagle-lr", type=float, default=None, help="EAGLE training: peak learning rate")
    ap.add_argument(
        "--eagle-cache-gib",
        type=float,
        default=None,
        help="EAGLE training: compute the target's features of the training windows once, up to this many"
        " GiB (teacher windows first, then fixed corpus slices), so each step is the head's work alone;"
        " 0 computes them every step at random corpus offsets (runs up to 12). Default 32 (smoke 0.02)",
    )
    ap.add_argument(
        "--max-steps",
        default=None,
        help="TARGET,STANDALONE,EAGLE: optimizer-step caps next to the time budgets (0: no cap), so a"
        " comparison on a shared CPU trains each model as far as an idle machine would",
    )
    ap.add_argument(
        "--attention-backend",
        default="auto",
        choices=("auto", "sdpa", "triton"),
        help="the served target's (and EAGLE head's) decode/verify attention: sdpa, triton's paged kernel, or auto"
        " (the runtime's default: triton on CUDA)",
    )
    ap.add_argument(
        "--tree",
        default="",
        help="comma list of TOPK:TOKENS tree shapes, each also timed as its own EAGLE run (rows eagle-tTOPK-nTOKENS):"
        " the same head grows trees of top-k TOPK over num_steps k - 1 and the target verifies TOKENS nodes, e.g. 2:10",
    )
    ap.add_argument(
        "--tree-max-batch-size",
        type=int,
        default=0,
        help="speculative.tree_max_batch_size of the --tree runs: steps of more requests verify chains (0: trees always)",
    )
    args = ap.parse_args(argv)
    if args.eagle_unroll < 1:
        ap.error(f"--eagle-unroll must be at least 1 (draft steps trained per position), got {args.eagle_unroll}")
    if args.c1_requests < 1:
        raise SystemExit(f"--c1-requests {args.c1_requests}: give at least 1")
    drafts = parse_drafts(args.draft)
    sweep = parse_k_sweep(args.k_sweep)
    trees = parse_trees(args.tree)
    if trees and "eagle" not in drafts:
        raise SystemExit("--tree needs --draft eagle: trees are grown by the EAGLE head")
    cap_target, cap_standalone, cap_eagle = parse_max_steps(args.max_steps)
    smoke = args.smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    k = args.k or (4 if smoke else 6)
    gen_tokens = args.gen_tokens or (24 if smoke else 192)
    prompt_len = args.prompt_len or (32 if smoke else 128)
    conc = [int(c) for c in (args.concurrency or ("1,2,4" if smoke else "1,8,32")).split(",")]
    small_shape, draft_shape = ("smoke-small", "smoke-draft") if smoke else ("small", "draft")
    target_shape = args.target_shape or ("smoke-big" if smoke else "8b")
    t_target = args.train_target_s if args.train_target_s is not None else (8 if smoke else 60)
    t_draft = args.train_draft_s if args.train_draft_s is not None else (4 if smoke else 240)
    vocab = 512 if smoke else 8192
    waves = args.waves or (1 if smoke else 3)
    started = time.monotonic()
    notes: list[str] = []

    work = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    tok_dir = write_tokenizer(work / "tokenizer", vocab)
    train_files, held = corpus_files(2_000_000 if smoke else 40_000_000)
    data = tokenize(tok_dir, train_files)
    held_ids = tokenize(tok_dir, held)
    log(
        f"corpus: {len(train_files)} files, {data.numel():,} tokens; held-out prompt files: {[p.name for p in held]}"
    )

    seq, batch = (64, 16) if smoke else (512, 48)
    target_small, t_info = train_lm(
        small_shape,
        vocab,
        data,
        t_target,
        device,
        seq=seq,
        batch=batch,
        lr=1.5e-3 if smoke else 6e-4,
        seed=1,
        max_steps=cap_target,
    )
    log(f"target-small trained: {t_info}")
    teacher = None
    if args.draft_training == "distill" or "eagle" in drafts:
        teacher = _teacher_data(args, target_small, data, tok_dir, device, smoke=smoke, k=k,
                                prompt_len=prompt_len, gen_tokens=gen_tokens)  # fmt: skip
    infos: dict[str, dict] = {}
    draft_dir = head = None
    if "standalone" in drafts:
        draft, infos["standalone"] = _train_standalone(
            args,
            target_small,
            draft_shape,
            vocab,
            data,
            teacher,
            t_draft,
            device,
            seq=seq,
            batch=batch,
            smoke=smoke,
            max_steps=cap_standalone,
        )
        draft_dir = save_hf(draft, work / "draft", tok_dir)
        del draft
    if "eagle" in drafts:
        assert teacher is not None
        opts = EagleTraining(
            seconds=t_draft, seq=teacher.seq, batch=batch, lr=args.eagle_lr or (2e-3 if smoke else 1e-3),
            teacher_fraction=teacher.fraction, noise=args.eagle_noise, unroll=args.eagle_unroll,
            feature_weight=args.eagle_feature_weight, max_steps=cap_eagle,
            cache_gib=args.eagle_cache_gib if args.eagle_cache_gib is not None else (0.02 if smoke else 32.0),
        )  # fmt: skip
        head, infos["eagle"] = train_eagle_head(target_small, small_shape, data, teacher.data, device, opts)
        head.round_to_bf16()  # what is served
        infos["eagle"]["heldout_top1"] = eagle_heldout_top1(
            head, target_small, held_ids, device, seq=teacher.seq, steps=max(2, opts.unroll)
        )
        log(f"EAGLE head trained: {infos['eagle']}")
    small_dir = save_hf(target_small, work / "target-small", tok_dir)
    small_state = {n: t.detach() for n, t in target_small.state_dict().items()}
    del target_small
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
        from loraserve.runtime.dev.devmodels import copy_tokenizer

        copy_tokenizer(tok_dir, target_dir)
        random_weights = True
    head_dir = None
    if head is not None:
        tensors = head.checkpoint()
        if target_shape != "trained":
            tensors = expand_eagle_head(tensors, small_shape, target_shape)
        head_dir = save_eagle_head(tensors, eagle_config(raw, raw["intermediate_size"]), work / "eagle")
        del tensors
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
    widest = max([k] + [tokens for _, tokens in trees])
    config.scheduler.max_total_tokens = max_c * (prompt_len + gen_tokens + 2 * widest + 16) + 4096
    config.cuda_graph.enabled = device.type == "cuda"
    config.cuda_graph.max_bs = max_c
    config.attention_backend = args.attention_backend
    t0 = time.monotonic()
    runner = ModelRunner(config, random_weights=random_weights)
    if random_weights:
        expand_into(runner, small_state, small_shape)
    target_params = sum(p.numel() for p in runner.model.parameters())
    log(
        f"target runner ({target_shape}, {target_params / 1e9:.2f} B params, attention {runner.attention_backend}) "
        f"built in {time.monotonic() - t0:.1f} s"
    )

    # Checks: the serving target computes the trained model's function; the served EAGLE
    # head proposes what the trained head proposes.
    pool = [held_ids[i : i + prompt_len].tolist() for i in range(0, held_ids.numel() - prompt_len, 499)]
    check = _expansion_check(runner, small_dir, pool[0], device)
    log(f"serving target vs trained model on a held-out prompt: {check}")
    if head is not None and head_dir is not None:
        infos["eagle"]["check"] = _eagle_check(runner, head_dir, head, small_dir, pool[:4], k - 1)
        log(f"served EAGLE head vs trained head on held-out prompts: {infos['eagle']['check']}")

    sampler = Sampler(0)
    spec_configs, decoders = {}, {}
    runs = [(name, name, args.auto_disable, None) for name in drafts]
    if args.auto_disable_ab:
        runs += [(f"{name}+auto", name, True, None) for name in drafts if not args.auto_disable]
    runs += [(f"eagle-t{top}-n{tokens}", "eagle", args.auto_disable, (top, tokens)) for top, tokens in trees]
    for name, draft, auto, tree in runs:
        spec_config = config.copy()
        spec_config.speculative.algorithm = (
            SpecAlgorithm.EAGLE if draft == "eagle" else SpecAlgorithm.STANDALONE
        )
        spec_config.speculative.draft_model_path = str(head_dir if draft == "eagle" else draft_dir)
        spec_config.speculative.num_steps = k - 1
        spec_config.speculative.num_draft_tokens = k
        if tree is not None:
            spec_config.speculative.top_k, spec_config.speculative.num_draft_tokens = tree
            spec_config.speculative.tree_max_batch_size = args.tree_max_batch_size
        spec_config.speculative.disable_batch_size = args.disable_batch_size
        spec_config.speculative.auto_disable = auto
        spec_configs[name] = spec_config
        decoders[name] = build_decoder(config=spec_config, runner=runner, sampler=sampler)
    plain = StandardDecoder(runner, sampler)

    opts = MeasureOptions(
        k=k,
        gen_tokens=gen_tokens,
        waves=waves,
        defer_steps=args.defer_steps,
        ab_defer=frozenset(int(c) for c in args.ab_defer.split(",") if c.strip()),
        deadline=started + args.deadline_s if args.deadline_s else float("inf"),
        profile=Path(args.profile) if args.profile else None,
        phases=Path(args.phases) if args.phases else None,
        c1_requests=args.c1_requests,
    )
    rows: list[Row] = []
    details: dict = {}
    plain_runs: dict[int, tuple[Workload, RunResult]] = {}

    def report() -> str:
        lines = _report(
            args, argv, device, target_shape, target_params, t_info, infos, k, gen_tokens, prompt_len,
            check, rows, notes, details,
        )  # fmt: skip
        text = "\n".join(lines) + "\n"
        if args.out:  # after every phase: a run cut short keeps what it measured
            meta = {"target": t_info, "drafts": infos, "k": k, "check": check, "argv": argv or sys.argv[1:]}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).with_suffix(".json").write_text(json.dumps({**details, "setup": meta}, indent=1))
            Path(args.out).write_text(text)
        return text

    # EAGLE first at every level: under --deadline-s a later draft's run is the one skipped.
    order = sorted(decoders, key=lambda name: (not name.startswith("eagle"), name))
    for c in conc:
        try:
            bench_work, off = _measure_off(config, runner, plain, pool, c, opts)
        except Exception as exc:  # keep what was measured; say what failed
            notes.append(f"concurrency {c} failed without speculation: {type(exc).__name__}: {exc}")
            log(notes[-1])
            continue
        details[c] = {"off_s": off.seconds, "off_steps": off.steps, "spec": {}}
        plain_runs[c] = (bench_work, off)
        if c != min(plain_runs):  # the batch-shape floor: the same prompts, plain, at the lowest concurrency
            details[c]["floor"] = _plain_floor(runner, plain_runs, min(plain_runs), c)
        for i, name in enumerate(order):
            last = details[c]["spec"].get(order[0], {}).get("on_s", 0.0)
            if i > 0 and time.monotonic() + 2.5 * last > opts.deadline:
                notes.append(f"concurrency {c}: {name} skipped, the --deadline-s budget is spent")
                log(notes[-1])
                continue
            try:
                rows.append(
                    _measure_spec(
                        spec_configs[name],
                        runner,
                        decoders[name],
                        name,
                        pool,
                        c,
                        opts,
                        off,
                        bench_work,
                        details[c]["spec"],
                        plain=(config, plain),
                    )
                )
            except Exception as exc:
                notes.append(f"concurrency {c} {name} failed: {type(exc).__name__}: {exc}")
                log(notes[-1])
        if c == 1 and sweep:
            _k_sweep(sweep, order[0], spec_configs[order[0]], runner, sampler, pool, opts, off, bench_work,
                     details[c]["spec"], rows, notes)  # fmt: skip
        report()
    print(report())
    log(f"total {time.monotonic() - started:.0f} s")
    if smoke:
        bad = [(r.concurrency, r.draft) for r in rows if r.same != r.count]
        eagle_check = infos.get("eagle", {}).get("check")
        if eagle_check and (
            eagle_check["proposal_agreement"] != 1.0 or eagle_check["rel_feature_diff"] > 1e-4
        ):
            notes.append(
                f"the served EAGLE head proposes other tokens than the trained head: {infos['eagle']['check']}"
            )
        if bad or notes:
            print(f"smoke: outputs differ or runs failed: {bad} {notes}")
            return 1
    return 0


def parse_k_sweep(value: str) -> list[int]:
    """``--k-sweep 4,8``: the other verify widths to time at concurrency 1 (each >= 2)."""
    try:
        ks = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--k-sweep {value!r}: give a comma list of integers, e.g. 4,8,10") from None
    if any(k < 2 for k in ks):
        raise SystemExit(f"--k-sweep {value!r}: every width must be >= 2 (one draft token at least)")
    return ks


def _k_sweep(ks, name, base_config, runner, sampler, pool, opts: MeasureOptions, off, bench, details, rows, notes):
    """``name``'s draft at concurrency 1 with each other verify width in ``ks``: a decoder of
    its own per width (its draft runner and graphs), the same workload and baseline."""
    for width in ks:
        if width == opts.k:
            continue
        last = details.get(name, {}).get("on_s", 0.0)
        if time.monotonic() + 2.5 * last > opts.deadline:
            notes.append(f"--k-sweep: k = {width} and later skipped, the --deadline-s budget is spent")
            log(notes[-1])
            return
        config = base_config.copy()
        config.speculative.num_steps = width - 1
        config.speculative.num_draft_tokens = width
        decoder = build_decoder(config=config, runner=runner, sampler=sampler)
        try:
            sweep_opts = replace(opts, k=width, profile=None, phases=None)
            rows.append(_measure_spec(config, runner, decoder, f"{name}-k{width}", pool, 1, sweep_opts, off, bench, details))
        except Exception as exc:
            notes.append(f"--k-sweep k = {width} failed: {type(exc).__name__}: {exc}")
            log(notes[-1])
        finally:
            del decoder
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def parse_max_steps(value: str | None) -> tuple[int | None, int | None, int | None]:
    """``--max-steps TARGET,STANDALONE,EAGLE``: step caps (0 or empty: none)."""
    if not value:
        return None, None, None
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts if p):
        raise SystemExit(
            f"--max-steps {value!r}: give three step counts TARGET,STANDALONE,EAGLE, e.g. 2000,1500,800"
        )
    caps = [int(p) if p else 0 for p in parts]
    return caps[0] or None, caps[1] or None, caps[2] or None


def parse_trees(value: str) -> list[tuple[int, int]]:
    """``--tree 2:10,4:16``: (top_k, num_draft_tokens) tree shapes, top_k >= 2."""
    shapes = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            top, tokens = (int(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(f"--tree {value!r}: give TOPK:TOKENS pairs, e.g. --tree 2:10") from None
        if top < 2 or tokens < 2:
            raise SystemExit(f"--tree {part!r}: TOPK must be >= 2 (1 is a chain) and TOKENS >= 2")
        shapes.append((top, tokens))
    return shapes


def parse_drafts(value: str) -> list[str]:
    """``--draft``: a comma list of ``standalone`` and ``eagle``, each at most once."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in DRAFTS]
    if not names or bad or len(set(names)) != len(names):
        raise SystemExit(
            f"--draft {value!r}: give a comma list of distinct drafts from {list(DRAFTS)}, e.g. --draft standalone,eagle"
        )
    return names


@dataclass
class TeacherData:
    """The target's own greedy continuations (plus how they were made) for draft training."""

    data: torch.Tensor  # [n, seq + 1]
    seq: int
    fraction: float  # share of each draft batch taken from ``data``
    info: dict


def _teacher_data(args, target, data, tok_dir, device, *, smoke, k, prompt_len, gen_tokens) -> TeacherData:
    """Greedy continuations of the target for the drafts' distillation (``--distill-prompts``)."""
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
    out = teacher_sequences(
        # 24576 on a GPU: with 1024 the EAGLE head memorised them (training top-1 0.78, held
        # out 0.44), 8192 and 70 s of training held out 0.47-0.49, 16384 and 170 s 0.52-0.53,
        # 24576 and 240 s 0.52-0.53 with 2.22 of 5 drafts accepted against 2.03-2.12
        # (bench/results/2026-12-03-spec-h200.md, runs 5, 7, 10-12)
        target, prompt_data, device, count=args.distill_count or (32 if smoke else 24576),
        prompt_len=teacher_prompt, new_tokens=gen_len - teacher_prompt + 1, seed=3,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    log(f"teacher continuations: {tuple(out.shape)} of {source} in {seconds:.1f} s")
    fraction = args.teacher_fraction if args.teacher_fraction is not None else (
        0.75 if args.distill_prompts == "unseen" else 0.5
    )  # fmt: skip
    info = {"teacher_prompts": source, "teacher_sequences": list(out.shape), "teacher_seconds": round(seconds, 1),
            "teacher_fraction": fraction, "seq": gen_len}  # fmt: skip
    return TeacherData(out, gen_len, fraction, info)


def _train_standalone(
    args, target, draft_shape, vocab, data, teacher, seconds, device, *, seq, batch, smoke, max_steps
):
    """The STANDALONE draft: distilled from ``target`` on ``teacher`` data, or trained on the corpus."""
    lr = 2e-3 if smoke else 1e-3
    if args.draft_training == "distill":
        draft, info = train_lm(
            draft_shape, vocab, data, seconds, device, seq=teacher.seq, batch=batch, lr=lr, seed=2,
            teacher=target, teacher_data=teacher.data, teacher_fraction=teacher.fraction, max_steps=max_steps,
        )  # fmt: skip
        info.update(teacher.info)
    else:
        draft, info = train_lm(
            draft_shape,
            vocab,
            data,
            seconds,
            device,
            seq=seq,
            batch=batch,
            lr=lr,
            seed=2,
            max_steps=max_steps,
        )
    info["training"] = args.draft_training
    log(f"STANDALONE draft trained: {info}")
    return draft, info


@dataclass
class MeasureOptions:
    k: int
    gen_tokens: int
    waves: int
    defer_steps: int | None = None  # admission batching limit (None: the engine's default)
    ab_defer: frozenset[int] = frozenset()  # concurrencies also timed with admission batching off (0)
    deadline: float = float("inf")  # time.monotonic() after which optional runs are skipped
    profile: Path | None = None  # where to write operator profiles of one request per draft at c=1
    phases: Path | None = None  # where to write per-phase timings of one request per draft at c=1
    c1_requests: int = 10  # requests concurrency 1 runs, one after another


@dataclass
class Row:
    """One (concurrency, draft) result against the no-spec run at that concurrency."""

    concurrency: int
    draft: str
    off_tps: float
    on_tps: float
    speedup: float
    summary: dict
    same: int
    count: int
    identity: dict = field(default_factory=dict)  # identity_by_kind: spec vs plain at this concurrency


def _request_count(c: int, waves: int, c1_requests: int) -> int:
    """Requests of a workload: ``c1_requests`` at concurrency 1 (one after another, so the
    sample of accept lengths comes from that many prompts), else ``waves * c``."""
    return c1_requests if c == 1 else waves * c


def _measure_off(config, runner, plain, pool, c, opts: MeasureOptions) -> tuple[Workload, RunResult]:
    """The no-spec baseline at concurrency ``c``: a warm-up, then the timed workload.

    ``waves * c`` requests keep ``c`` running as earlier ones finish, so speculative
    requests finishing at different steps do not leave the batch draining (concurrency 1
    runs ``--c1-requests`` requests, one after another, cycling through base and each adapter).
    """
    count = _request_count(c, opts.waves, opts.c1_requests)
    warm = make_workload(pool, max(c, 2), opts.gen_tokens, offset=100)
    bench = make_workload(pool, count, opts.gen_tokens, offset=0)
    run_workload(config, runner, plain, warm, c, f"warm-off-{c}")
    return bench, run_workload(config, runner, plain, bench, c, f"off-{c}")


def _plain_floor(runner: ModelRunner, plain_runs: dict[int, tuple[Workload, RunResult]], lo: int, c: int) -> dict:
    """Plain decoding at concurrency ``lo`` against concurrency ``c`` on the prompts both ran
    (the workloads share their first prompts): divergence from batch shape alone."""
    (work_lo, run_lo), (work_c, run_c) = plain_runs[lo], plain_runs[c]
    n = min(len(work_lo.prompts), len(work_c.prompts))
    outs_lo = [run_lo.outputs[f"off-{lo}-{i}"] for i in range(n)]
    outs_c = [run_c.outputs[f"off-{c}-{i}"] for i in range(n)]
    return identity_by_kind(work_lo.adapters[:n], outs_lo, outs_c, gap_of(runner, work_lo, outs_lo, outs_c)) | {
        "against": lo
    }


def _measure_spec(spec_config, runner, decoder, name, pool, c, opts: MeasureOptions, off: RunResult, bench,
                  details: dict, *, plain: tuple | None = None) -> Row:  # fmt: skip
    """One draft at concurrency ``c``: a warm-up (captures the CUDA graphs for the batch and
    context buckets the timed run meets), then the same workload as the baseline.

    Speculative requests finish at different steps, so their batch sizes and context
    lengths mix in ways the plain run never meets: the warm-up is the timed workload's
    shape (other prompts), and the graphs the timed run still had to capture are reported.
    ``plain``: ``(config, decoder)`` of the no-spec baseline, timed beside the draft by
    ``--phases``.
    """
    k, count = opts.k, len(bench.prompts)
    warm_spec = make_workload(pool, count if c > 1 else 2, opts.gen_tokens, offset=100)
    run_workload(spec_config, runner, decoder, warm_spec, c, f"warm-{name}-{c}", defer_steps=opts.defer_steps)
    decoder.metrics = type(decoder.metrics)(decoder.metrics.algorithm, k)
    on = run_workload(spec_config, runner, decoder, bench, c, f"{name}-{c}", defer_steps=opts.defer_steps)
    summary = spec_summary(decoder)
    outs_off = [off.outputs[f"off-{c}-{i}"] for i in range(count)]
    outs_on = [on.outputs[f"{name}-{c}-{i}"] for i in range(count)]
    identity = identity_by_kind(bench.adapters, outs_off, outs_on, gap_of(runner, bench, outs_off, outs_on))
    same = sum(kind["identical"] for kind in identity.values())
    speedup = on.tokens_per_s / off.tokens_per_s
    details[name] = {
        "on_s": on.seconds, "generated": on.generated, **summary, "on_steps": on.steps, "identity": identity,
    }  # fmt: skip
    log(
        f"concurrency {c} {name}: off {off.tokens_per_s:,.1f} tok/s, spec {on.tokens_per_s:,.1f} tok/s,"
        f" x{speedup:.2f}; {summary}; identical outputs {same}/{count}"
    )
    log(f"concurrency {c} {name} steps: off {off.steps}; spec {on.steps}")
    if opts.profile is not None and c == 1:
        _profile_run(spec_config, runner, decoder, name, pool, opts)
    if opts.phases is not None and c == 1:
        details[name]["phases"] = _phases_run(spec_config, runner, decoder, name, pool, opts, plain)
    if c in opts.ab_defer:
        if time.monotonic() + 1.5 * on.seconds > opts.deadline:
            log(f"concurrency {c} {name}: no time left for the run without admission batching")
        else:
            plain_sched = run_workload(
                spec_config, runner, decoder, bench, c, f"nodefer-{name}-{c}", defer_steps=0
            )
            details[name]["on_nodefer_s"] = plain_sched.seconds
            details[name]["on_nodefer_steps"] = plain_sched.steps
            log(
                f"concurrency {c} {name}: spec without admission batching {plain_sched.tokens_per_s:,.1f} tok/s"
                f" (x{plain_sched.tokens_per_s / off.tokens_per_s:.2f}); steps {plain_sched.steps}"
            )
    return Row(c, name, off.tokens_per_s, on.tokens_per_s, speedup, summary, same, count, identity)


def _profile_run(spec_config, runner, decoder, name: str, pool, opts: MeasureOptions) -> None:
    """One request under torch.profiler, on the engine's thread; writes the operator table
    sorted by host time and by device time to ``opts.profile``."""
    from torch.profiler import ProfilerActivity, profile

    assert opts.profile is not None
    opts.profile.mkdir(parents=True, exist_ok=True)
    work = make_workload(pool, 1, min(opts.gen_tokens, 64), offset=200)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    result = run_workload(spec_config, runner, decoder, work, 1, f"profile-{name}", profiler=prof)
    table = prof.key_averages()
    text = [
        f"# {name}: one request, {result.generated} tokens in {result.seconds:.3f} s; steps {result.steps}"
    ]
    for key in ("cpu_time_total", "self_cpu_time_total", "cuda_time_total"):
        if key == "cuda_time_total" and not torch.cuda.is_available():
            continue
        text += [f"\n## sorted by {key}", table.table(sort_by=key, row_limit=30)]
    (opts.profile / f"profile-{name}.txt").write_text("\n".join(text))
    log(f"profile of {name} written to {opts.profile}")


# --------------------------------------------------------------------------- phases (--phases)

PHASE_TOKENS = 96  # new tokens of the one request each decoder runs under --phases
PHASE_WARMUP_STEPS = 3  # leading decode steps left out of the summary


@dataclass
class Span:
    """One timed call: host ``perf_counter`` at its start and end, CUDA events recorded on
    the current stream just before and just after it (None off CUDA), and the timed calls
    made inside it."""

    name: str
    start: object = None  # torch.cuda.Event (or anything with elapsed_time) | None
    end: object = None
    t0: float = 0.0
    t1: float = 0.0
    children: list[Span] = field(default_factory=list)
    tokens: int = 0  # a decoder step's generated tokens


def _elapsed_ms(a, b) -> float | None:
    """Milliseconds on the GPU from event ``a`` to event ``b`` (None without events)."""
    return None if a is None or b is None else float(a.elapsed_time(b))


class PhaseRecorder:
    """Times a decoder's steps and the calls inside them by wrapping bound methods on the
    instances (``obj.method = timed(obj.method)``); :meth:`restore` puts them back.

    Per call: host seconds around it (no synchronize: what the host spends issuing it, or
    waiting where the call itself waits) and a pair of CUDA events before and after it
    (the GPU span from the first to the last work the call queued, idle time inside
    included). Events are read after the run (:meth:`close`, one synchronize). Calls made
    outside ``decoder.step`` (prefill) are not recorded; extends are only noted, so a gap
    between two steps that holds one is left out of the between-steps time.
    """

    def __init__(self, cuda: bool, *, annotate: bool = False):
        self.cuda = cuda
        self.annotate = annotate  # also open a torch.profiler range named for each call
        self.steps: list[Span] = []
        self.extends: list[tuple[float, float]] = []
        self._stack: list[Span] = []
        self._saved: list[tuple[object, str, bool, object]] = []

    def current(self) -> str | None:
        """The innermost call being timed now (None outside a step)."""
        return self._stack[-1].name if self._stack else None

    def _range(self, name: str):
        return torch.profiler.record_function(name) if self.annotate else contextlib.nullcontext()

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap(self, obj, attr: str, name, *, after=None, restore: bool = True) -> bool:
        """Time ``obj.attr`` as phase ``name`` (a string, or a function of the call's
        arguments returning one); ``after(result)`` runs outside the timing. False when
        ``obj`` has no such method."""
        fn = getattr(obj, attr, None) if obj is not None else None
        own = getattr(obj, "__dict__", None)
        if fn is None or not callable(fn) or own is None:
            return False
        if restore:
            self._saved.append((obj, attr, attr in own, own.get(attr)))
        recorder = self

        def timed(*args, **kwargs):
            if not recorder._stack:
                return fn(*args, **kwargs)
            span = Span(name(*args, **kwargs) if callable(name) else name, start=recorder._event())
            recorder._stack[-1].children.append(span)
            recorder._stack.append(span)
            span.t0 = time.perf_counter()
            try:
                with recorder._range(span.name):
                    out = fn(*args, **kwargs)
            finally:
                span.t1 = time.perf_counter()
                recorder._stack.pop()
                span.end = recorder._event()
            if after is not None:
                after(out)
            return out

        setattr(obj, attr, timed)
        return True

    def wrap_decoder(self, decoder) -> None:
        """``decoder.step`` (each call one recorded step) and ``decoder.extend`` (noted)."""
        step_fn, extend_fn = decoder.step, decoder.extend
        recorder = self

        def step(requests):
            span = Span("decoder.step", start=recorder._event())
            recorder._stack = [span]
            span.t0 = time.perf_counter()
            try:
                with recorder._range("decoder.step (own work)"):
                    outs = step_fn(requests)
            finally:
                span.t1 = time.perf_counter()
                recorder._stack = []
                span.end = recorder._event()
                recorder.steps.append(span)
            span.tokens = sum(len(out.token_ids) for out in outs if out is not None)
            return outs

        def extend(chunks):
            t0 = time.perf_counter()
            try:
                return extend_fn(chunks)
            finally:
                recorder.extends.append((t0, time.perf_counter()))

        for attr, fn in (("step", step), ("extend", extend)):
            self._saved.append((decoder, attr, attr in vars(decoder), vars(decoder).get(attr)))
            setattr(decoder, attr, fn)

    def instrument(self, decoder) -> None:
        """The phases of a step: the target's forwards (by mode), and for a speculative
        decoder the drafter's calls, the draft runner's (those it has) and acceptance
        (``decoder._accept``; the wait for the device is its result's ``host()``)."""
        self.wrap_decoder(decoder)
        runner = getattr(decoder, "runner", None)
        self.wrap(runner, "forward", _mode_label("target.forward"))
        drafter = getattr(decoder, "drafter", None)
        if drafter is None:
            return
        for method in ("propose", "propose_tree", "on_verify", "on_decode"):
            self.wrap(drafter, method, f"drafter.{method}")
        kv = getattr(runner, "kv", None)
        self.wrap(kv, "keep", "target.kv.keep")  # a tree step keeps its accepted path's entries
        self.wrap(
            decoder, "_accept", "decoder._accept",
            after=lambda acceptance: self.wrap(acceptance, "host", "acceptance.host", restore=False),
        )  # fmt: skip
        draft_runner = getattr(drafter, "runner", None)
        if draft_runner is not None and draft_runner is not runner:
            methods = ("forward", "forward_uniform", "draft_chain", "feed_chain", "draft_tree", "feed_tree",
                       "compute_logits", "step")  # fmt: skip
            for method in methods:
                label = _mode_label("draft.forward") if method == "forward" else f"draft.{method}"
                self.wrap(draft_runner, method, label)

    def restore(self) -> None:
        """Put every wrapped method back (instance attributes that were not there are removed)."""
        while self._saved:
            obj, attr, had, old = self._saved.pop()
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)

    def close(self) -> None:
        """Wait once for the device, so every recorded event can be read."""
        if self.cuda:
            torch.cuda.synchronize()

    def overhead_us(self, calls: int = 200) -> float:
        """Host microseconds one wrapped call adds (a no-op timed ``calls`` times, events
        included on CUDA) over calling it bare."""
        import types

        probe = types.SimpleNamespace(noop=lambda: None)
        bare = probe.noop
        t0 = time.perf_counter()
        for _ in range(calls):
            bare()
        bare_s = time.perf_counter() - t0
        saved, self._saved = self._saved, []
        self.wrap(probe, "noop", "noop")
        self._stack = [Span("probe")]
        t0 = time.perf_counter()
        for _ in range(calls):
            probe.noop()
        timed_s = time.perf_counter() - t0
        self._stack = []
        self.restore()
        self._saved = saved
        return max(timed_s - bare_s, 0.0) / calls * 1e6


def _mode_label(prefix: str):
    """A phase name for a forward: ``prefix[MODE]`` from its batch's ``mode`` when it has one."""

    def label(*args, **kwargs) -> str:
        batch = args[0] if args else kwargs.get("batch")
        mode = getattr(batch, "mode", None)
        return f"{prefix}[{mode.name}]" if mode is not None else prefix

    return label


@dataclass
class PhaseRow:
    """One call (or gap) of one step's timeline (:func:`phase_rows`)."""

    key: str  # the path of names from the step down, " / "-separated
    parent: str  # the parent's key ("" for the step itself)
    label: str
    depth: int  # 1: called by the step itself
    index: int  # position among the parent's rows
    host_ms: float
    gpu_ms: float | None


def phase_rows(span: Span, elapsed=_elapsed_ms, depth: int = 1, parent: str = "") -> list[PhaseRow]:
    """The timeline of one step: a row per timed call inside ``span`` (pre-order), with a
    ``(gap) A → B`` row before, between and after the calls of every parent: host time not
    inside a timed call, and GPU time between one call's end event and the next one's
    start event (work queued outside the timed calls, or the GPU idle while the host
    works). A parent's children and gaps add up to the parent."""
    rows: list[PhaseRow] = []
    prefix = f"{parent} / " if parent else ""
    index = 0

    def add(label: str, host_s: float, start, end) -> str:
        nonlocal index
        key = f"{prefix}{label}"
        rows.append(PhaseRow(key, parent, label, depth, index, 1e3 * host_s, elapsed(start, end)))
        index += 1
        return key

    prev_name, prev_t, prev_event = "start", span.t0, span.start
    for child in span.children:
        add(f"(gap) {prev_name} → {child.name}", child.t0 - prev_t, prev_event, child.start)
        key = add(child.name, child.t1 - child.t0, child.start, child.end)
        rows += phase_rows(child, elapsed, depth + 1, key)
        prev_name, prev_t, prev_event = child.name, child.t1, child.end
    if span.children:
        add(f"(gap) {prev_name} → end", span.t1 - prev_t, prev_event, span.end)
    return rows


def _mean_median(values: list[float | None]) -> list[float] | None:
    got = [v for v in values if v is not None]
    if not got:
        return None
    ordered = sorted(got)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return [round(sum(got) / len(got), 4), round(median, 4)]


def summarize_phases(
    steps: list[Span],
    extends: list[tuple[float, float]],
    *,
    skip: int = PHASE_WARMUP_STEPS,
    elapsed=_elapsed_ms,
) -> dict:
    """Per-step means and medians of every phase (``phase_rows``) over ``steps[skip:]``
    (all of them when there are no more), plus per-step totals: the step's host time and
    GPU span, and the engine's time between one step's end and the next one's start (host;
    on the GPU, end event to start event), gaps that hold an extend left out."""
    skip = skip if len(steps) > skip else 0
    used = steps[skip:]
    first: dict[str, PhaseRow] = {}  # each key's row at its earliest place among its parent's rows
    per_step: list[dict[str, list]] = []
    for span in used:
        sums: dict[str, list] = {}
        for row in phase_rows(span, elapsed):
            if row.key not in first or row.index < first[row.key].index:
                first[row.key] = row
            cell = sums.setdefault(row.key, [0, 0.0, None])
            cell[0] += 1
            cell[1] += row.host_ms
            if row.gpu_ms is not None:
                cell[2] = (cell[2] or 0.0) + row.gpu_ms
        per_step.append(sums)
    children: dict[str, list[PhaseRow]] = {}
    for row in first.values():  # dicts keep first-seen order: the tie-break
        children.setdefault(row.parent, []).append(row)
    order: list[str] = []

    def visit(parent: str) -> None:
        for row in sorted(children.get(parent, []), key=lambda r: r.index):
            order.append(row.key)
            visit(row.key)

    visit("")
    timed = any(s.start is not None for s in used)  # CUDA events: a step without a phase spent 0 ms in it
    rows = []
    for key in order:
        label, depth = first[key].label, first[key].depth
        cells = [s.get(key, (0, 0.0, 0.0 if timed else None)) for s in per_step]
        rows.append({
            "phase": key, "label": label, "depth": depth, "gap": label.startswith("(gap)"),
            "calls": round(sum(c[0] for c in cells) / max(len(cells), 1), 2),
            "host_ms": _mean_median([c[1] for c in cells]),
            "gpu_ms": _mean_median([c[2] for c in cells]),
        })  # fmt: skip
    between_host, between_gpu = [], []
    for a, b in itertools.pairwise(used):
        if any(a.t1 <= t0 < b.t0 for t0, _ in extends):
            continue
        between_host.append(1e3 * (b.t0 - a.t1))
        between_gpu.append(elapsed(a.end, b.start))
    tokens = sum(s.tokens for s in used)
    return {
        "steps": len(used),
        "skipped": skip,
        "tokens_per_step": round(tokens / max(len(used), 1), 3),
        "rows": rows,
        "step_host_ms": _mean_median([1e3 * (s.t1 - s.t0) for s in used]),
        "step_gpu_ms": _mean_median([elapsed(s.start, s.end) for s in used]),
        "between_host_ms": _mean_median(between_host),
        "between_gpu_ms": _mean_median(between_gpu),
        "timed_calls_per_step": round(sum(_count_spans(s) for s in used) / max(len(used), 1), 2),
    }


def _count_spans(span: Span) -> int:
    return sum(1 + _count_spans(child) for child in span.children)


def _ms(cell: list[float] | None, i: int) -> str:
    return "–" if cell is None else f"{cell[i]:.3f}"


def phases_markdown(name: str, runs: dict[str, dict], meta: dict) -> str:
    """``phases-<draft>.md``: a table per decoder from :func:`summarize_phases`."""
    lines = [
        f"# Phases of one request at concurrency 1: {name} ({meta['device']})",
        "",
        f"One request ({meta['prompt_tokens']}-token held-out prompt, adapter {meta['adapter'] or 'base'},"
        f" {meta['new_tokens']} new tokens, greedy) through each decoder; the first {PHASE_WARMUP_STEPS}"
        " decode steps are left out. Host ms: `perf_counter` around the call, no synchronize (issuing it, or"
        " waiting where the call itself waits). GPU span ms: CUDA events recorded before and after the call"
        " on the current stream, read after the run (from the first to the last work it queued, idle time"
        " inside included). Indented rows are calls made inside the row above them; `(gap) A → B` rows are"
        " what lies between two timed calls of the same parent: host work that is not timed (tensor"
        " building, cache truncation, a sampler's wait for the device) and on the GPU either work queued"
        " there or idle time while the host works. Within a parent, children and gaps add up to it.",
        f"Instrumentation: about {meta['overhead_us']:.1f} µs of host time per timed call (measured on a"
        " no-op), included in the gaps.",
    ]
    for kind, s in runs.items():
        lines += [
            "",
            f"## {kind}: {s['steps']} steps timed ({s['skipped']} skipped), {s['tokens_per_step']} tokens / step,"
            f" {s['timed_calls_per_step']} timed calls / step; run {s['generated']} tokens in {s['seconds']:.3f} s,"
            f" graphs captured during it {s['graphs_captured']}",
            "",
            "| phase | calls / step | host ms / step (mean) | host ms (median) | GPU span ms / step (mean)"
            " | GPU span ms (median) |",
            "|---|---|---|---|---|---|",
        ]
        for row in s["rows"]:
            indent = "· " * (row["depth"] - 1)
            label = row["label"] if row["gap"] else f"`{row['label']}`"
            lines.append(
                f"| {indent}{label} | {row['calls']:g} | {_ms(row['host_ms'], 0)} | {_ms(row['host_ms'], 1)} |"
                f" {_ms(row['gpu_ms'], 0)} | {_ms(row['gpu_ms'], 1)} |"
            )
        lines += [
            f"| **step** (`decoder.step`, start to end) | 1 | {_ms(s['step_host_ms'], 0)} |"
            f" {_ms(s['step_host_ms'], 1)} | {_ms(s['step_gpu_ms'], 0)} | {_ms(s['step_gpu_ms'], 1)} |",
            f"| **between steps** (engine: one step's end to the next one's start) | 1 |"
            f" {_ms(s['between_host_ms'], 0)} | {_ms(s['between_host_ms'], 1)} | {_ms(s['between_gpu_ms'], 0)} |"
            f" {_ms(s['between_gpu_ms'], 1)} |",
        ]
    return "\n".join(lines) + "\n"


def _phases_one_line(runs: dict[str, dict]) -> str:
    parts = []
    for kind, s in runs.items():
        top = ", ".join(
            f"{r['label']} {_ms(r['host_ms'], 0)}/{_ms(r['gpu_ms'], 0)}"
            for r in s["rows"]
            if r["depth"] == 1 and not r["gap"]
        )
        parts.append(
            f"{kind}: step host {_ms(s['step_host_ms'], 0)} ms, GPU span {_ms(s['step_gpu_ms'], 0)} ms,"
            f" between steps {_ms(s['between_host_ms'], 0)} ms, {s['tokens_per_step']} tokens/step"
            f" (host/GPU ms: {top})"
        )
    return "; ".join(parts)


def _phases_run(spec_config, runner, decoder, name: str, pool, opts: MeasureOptions, plain) -> dict:
    """One request through the speculative decoder, then (``plain``: ``(config, decoder)``)
    the same request through the plain one, each with its phases timed
    (:class:`PhaseRecorder`); writes ``phases-<name>.md`` to ``opts.phases`` and returns the
    summaries for the details JSON."""
    assert opts.phases is not None
    opts.phases.mkdir(parents=True, exist_ok=True)
    work = make_workload(pool, 1, min(opts.gen_tokens, PHASE_TOKENS), offset=300)
    cuda = torch.device(runner.device).type == "cuda"
    runs = [("spec", spec_config, decoder)] + ([("plain", *plain)] if plain is not None else [])
    results: dict[str, dict] = {}
    outputs = {}
    overhead = PhaseRecorder(cuda).overhead_us()
    for kind, config, dec in runs:
        recorder = PhaseRecorder(cuda)
        recorder.instrument(dec)
        try:
            result = run_workload(config, runner, dec, work, 1, f"phases-{name}-{kind}")
        finally:
            recorder.restore()
        recorder.close()
        summary = summarize_phases(recorder.steps, recorder.extends)
        summary.update(
            generated=result.generated, seconds=round(result.seconds, 4),
            graphs_captured=result.steps.get("graphs_captured", 0),
        )  # fmt: skip
        results[kind] = summary
        outputs[kind] = next(iter(result.outputs.values()), [])
    meta = {
        "device": torch.cuda.get_device_name(runner.device) if cuda else "cpu",
        "prompt_tokens": len(work.prompts[0]), "adapter": work.adapters[0], "new_tokens": work.gen_tokens,
        "overhead_us": overhead,
    }  # fmt: skip
    text = phases_markdown(name, results, meta)
    if "plain" in outputs:
        same = outputs["spec"] == outputs["plain"]
        text += f"\nOutputs of the two runs identical: {'yes' if same else 'NO'}.\n"
        results["identical_outputs"] = same
    results["overhead_us_per_call"] = round(overhead, 2)
    text += (
        "\n## Kernels and synchronizations\n\nOne more run of the same request per decoder, "
        "untimed, under torch.profiler and torch's CUDA sync debug mode.\n\n"
    )
    (opts.phases / f"phases-{name}.md").write_text(text)  # kept if a traced run fails
    for kind, config, dec in runs:
        try:
            text += _traced_phases(config, runner, dec, work, name, kind, cuda) + "\n"
        except Exception as exc:  # the timed tables above stand without it
            log(f"trace {name} {kind} failed: {exc!r}")
            text += f"### {kind}: the traced run failed: `{exc!r}`\n\n"
    (opts.phases / f"phases-{name}.md").write_text(text)
    log(f"phases {name}: {_phases_one_line({k: v for k, v in results.items() if isinstance(v, dict)})}")
    return results


def _load_phase_trace():
    """``bench/phase_trace.py``, loaded by path: putting ``bench/`` on ``sys.path`` would let
    ``bench/operator.py`` shadow the standard library's ``operator``."""
    import importlib.util

    name = "loraserve_bench_phase_trace"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("phase_trace.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _traced_phases(config, runner, decoder, work, name: str, kind: str, cuda: bool) -> str:
    """One request through ``decoder`` under torch.profiler and the sync debug mode: GPU
    kernel time and synchronizing calls charged to the phase that caused them (markdown)."""
    from torch.profiler import ProfilerActivity, profile

    trace = _load_phase_trace()
    recorder = PhaseRecorder(cuda, annotate=True)
    recorder.instrument(decoder)
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    syncs = trace.SyncTrace(recorder.current)
    try:
        with syncs:
            run_workload(config, runner, decoder, work, 1, f"trace-{name}-{kind}", profiler=prof)
    finally:
        recorder.restore()
    recorder.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        table = trace.kernels_by_phase(path)
    log(f"trace {name} {kind}: {sum(syncs.sites.values())} synchronizing calls, {len(recorder.steps)} steps")
    return trace.trace_markdown(kind, table, syncs.sites, len(recorder.steps))


@torch.no_grad()
def _expansion_check(runner: ModelRunner, small_dir: Path, prompt: list[int], device: torch.device) -> dict:
    """Relative difference of last-position logits and greedy agreement: serving target vs trained model."""
    from transformers import AutoModelForCausalLM

    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch

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
    infos,
    k,
    gen_tokens,
    prompt_len,
    check,
    rows: list[Row],
    notes,
    details,
) -> list[str]:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "absent"
    import transformers

    small = "smoke-small" if args.smoke else "small"
    lines = [
        f"# Speculative decoding with co-batched LoRA adapters ({datetime.date.today().isoformat()})",
        "",
        f"- device: {gpu}; torch {torch.__version__}; triton {triton_v}; transformers {transformers.__version__};"
        f" python {platform.python_version()}",
        f"- command: `python bench/spec.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- serving target: {target_shape} shape, {target_params / 1e9:.2f} B parameters,"
        f" {'bf16, CUDA graphs on' if device.type == 'cuda' else 'float32, no CUDA graphs'};"
        " computes the trained small target's function"
        f" (check on a held-out prompt: {check})",
        f"- trained small target: {SHAPES[small]} (hidden, layers, heads, kv, head_dim, mlp);"
        f" {_count(t_info['params'])} params, {t_info['steps']} steps, {t_info['tokens'] / 1e6:.1f} M tokens, final loss {t_info['final_loss']:.2f}",
    ]
    d_info = infos.get("standalone")
    if d_info:
        lines.append(
            f"- draft STANDALONE ({d_info['training']} training): {SHAPES['smoke-draft' if args.smoke else 'draft']};"
            f" {_count(d_info['params'])} params,"
            f" {d_info['steps']} steps, {d_info['tokens'] / 1e6:.1f} M tokens, final loss {d_info['final_loss']:.2f}"
            + (
                f"; teacher continuations {d_info['teacher_sequences']} of {d_info['teacher_prompts']}"
                f" ({d_info['teacher_seconds']} s), {d_info['teacher_fraction']:.0%} of each batch, sequences of {d_info['seq']}"
                if "teacher_prompts" in d_info
                else ""
            )
        )
    e_info = infos.get("eagle")
    if e_info:
        served = (
            "expanded function-preservingly to the serving shape"
            if target_shape != "trained"
            else "as trained"
        )
        lines.append(
            f"- draft EAGLE: one Llama layer of the small target's shape over its final normed hidden state"
            f" (shares its embeddings and lm_head), {served}; {_count(e_info['params'])} trained params,"
            f" {e_info['steps']} steps, {e_info['tokens'] / 1e6:.1f} M tokens, final loss {e_info['final_loss']:.2f};"
            f" KL to the target + {e_info['feature_weight']} x smooth-L1 on the feature, unrolled steps"
            f" {e_info['unroll']}, feature noise {e_info['noise']}, teacher continuations"
            f" {e_info['teacher_fraction']:.0%} of each batch, sequences of {e_info['seq']};"
            f" held-out top-1 agreement with the target per draft step {e_info['heldout_top1']};"
            f" served head vs trained head: {e_info.get('check')}"
        )
    lines += [
        f"- verify width k = {k} (num_steps {k - 1}); greedy; prompts {prompt_len} held-out stdlib tokens; {gen_tokens} new tokens per request;"
        f" 4 adapters (rank 16, all linear modules, B ~ N(0, {args.adapter_b_std}^2)) + base, request i uses base or adapter i % 5;"
        f" concurrency 1 runs {args.c1_requests} requests one after another, concurrency c runs"
        f" {args.waves or (1 if args.smoke else 3)} x c requests, c at a time",
        "",
        "| concurrency | draft | no spec tok/s | spec tok/s | speedup | mean accepted drafts / step"
        " | accepted at draft position 1.. | accept rate | per-adapter mean accepted | verify ms | step ms"
        " | undrafted steps | identical outputs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r.summary
        per = ", ".join(f"{n} {v}" for n, v in s["per_adapter_mean_accept"].items())
        pos = " / ".join(str(p) for p in s["per_position"])
        lines.append(
            f"| {r.concurrency} | {r.draft} | {r.off_tps:,.1f} | {r.on_tps:,.1f} | {r.speedup:.2f}x |"
            f" {s['mean_accept']} of {len(s['per_position'])} | {pos} | {s['accept_rate']} | {per} |"
            f" {s['verify_ms']} | {s['step_ms']} | {s.get('undrafted_steps', 0)} | {r.same}/{r.count} |"
        )
    lines += _identity_table(rows, details)
    lines += _time_table(details)
    lines += [""] + [f"- {n}" for n in notes]
    return lines


def _identity_table(rows: list[Row], details: dict) -> list[str]:
    """Identical outputs split into base-model and adapter requests, beside the floor that
    batch shape alone gives plain decoding."""

    def cell(d: dict | None) -> str:
        if not d:
            return "–"
        first, gap = d["mean_first_divergence"], d.get("max_gap")
        if first is None:
            return f"{d['identical']}/{d['count']}"
        return f"{d['identical']}/{d['count']} (first diff at {first}" + ("" if gap is None else f"; gap ≤ {gap}") + ")"

    lines = [
        "",
        "Identical outputs by request kind (identical / requests, mean token index of the first difference"
        " among those that differ; gap: the largest |logit difference| the target, with the request's adapter,"
        " puts between the two runs' tokens at a first difference: rounding flips near-ties, a bug picks"
        " tokens far apart); the floor compares plain decoding at the lowest concurrency with plain"
        " decoding at this one, on the prompts both ran:",
        "",
        "| concurrency | comparison | base-model requests | adapter requests |",
        "|---|---|---|---|",
    ]
    for c, d in details.items():
        floor = d.get("floor")
        if floor:
            lines.append(f"| {c} | plain c={floor['against']} vs plain c={c} (floor) | {cell(floor.get('base'))} |"
                         f" {cell(floor.get('adapter'))} |")  # fmt: skip
        for r in rows:
            if r.concurrency == c and r.identity:
                lines.append(
                    f"| {c} | {r.draft} vs plain | {cell(r.identity.get('base'))} | {cell(r.identity.get('adapter'))} |"
                )
    return lines


def _count(n: int) -> str:
    """A parameter count for the report: 139.6 k, 9.5 M."""
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


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
        runs = [("no spec", d.get("off_s"), d.get("off_steps"))]
        for name, spec in d.get("spec", {}).items():
            runs.append((f"spec {name}", spec.get("on_s"), spec.get("on_steps")))
            if "on_nodefer_steps" in spec:
                runs.append(
                    (f"spec {name}, admission at once", spec["on_nodefer_s"], spec["on_nodefer_steps"])
                )
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
