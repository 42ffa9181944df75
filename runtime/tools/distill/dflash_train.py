"""Training of a DFLASH draft over the frozen target: masked block prediction.

Each training window (the target's own greedy continuations and corpus windows, as the
other drafts train on) gets ``blocks`` distinct random anchors (the reference trains
hundreds of blocks per sequence in one forward: the target's outputs are computed once per
window, and every block costs the draft only its own rows); the draft predicts every
masked position of each anchor's block from the target's layer outputs before the anchor,
and learns the target's greedy token there (cross-entropy, as the reference: greedy
verification accepts the argmax and nothing else), earlier block positions weighted more
(a block is accepted from its start: the DFlash paper's position decay).

Only labels a served draft can be judged by count. Block position ``j`` of anchor ``a``
is verified only when the drafts before it were accepted, i.e. when tokens ``a + 1 ..
a + j - 1`` are the target's own greedy choices; the label there is the target's
choice after exactly those tokens. Where a window's tokens are not the target's
choices (corpus text, a teacher prompt), the target's distribution at ``a + j - 1`` is
conditioned on tokens the draft never sees and serving never verifies after: such labels
are noise, and are masked (the reference trains on responses the target generated, for
the same reason). Position 1 always counts.

The target is frozen, so its outputs of a training window are computed once
(:func:`output_caches`, on a GPU by default): each step is then the draft's own work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...speculative.dflash.format import check_target_layer_ids
from ...speculative.metrics import context_bucket
from .corpus import sample_windows, teacher_sequences
from .dflash_draft import DFlashDraft
from .eagle_head import LayerDims, RopeFrequencies
from .eagle_train import FeatureCache, cache_windows, sample_cached
from .train import apply_update, log, lr_scale, progress, set_lr


@dataclass
class DFlashTraining:
    """How the DFLASH draft trains."""

    seconds: float
    seq: int
    batch: int
    lr: float
    block: int
    layer_ids: list[int]
    num_layers: int = 1
    mask_id: int = 0  # the local tokenizer's <pad>: a token no text contains
    blocks: int = 24  # distinct anchors per window
    teacher_fraction: float = 0.5
    decay: float = 4.0  # weight of block position j: exp(-(j - 1) / decay)
    # "greedy": cross-entropy to the target's greedy token, which is all greedy verification
    # accepts (the reference's labels: the target's own generated tokens); "distribution":
    # KL from its whole next-token distribution, which spends the draft's capacity on the
    # tail. CPU toy target, 400 steps: 4.35 against 3.63 accepted drafts a block in the walk.
    labels: str = "greedy"
    seed: int = 5
    weight_decay: float = 0.0  # AdamW's, on the matrices (norm weights are not decayed)
    # "random": as a Llama initialises; "target": each draft layer starts as one of the target's
    # top layers and the final norm as the target's (the LM head reads what that norm makes)
    init: str = "random"
    max_steps: int | None = None
    # > 0: the target's outputs of every training window computed once, up to this many GiB;
    # None: CACHE_GIB on a GPU (within its free memory less STEP_RESERVE_GIB), off on the CPU
    cache_gib: float | None = None
    # > 0: every this many steps, the probe given to train_dflash judges the draft so far (its
    # time not counted): the learning curve of one run, over one target. Steps, not seconds:
    # the same probes on any machine, however loaded
    probe_every: int = 0
    # tokens of each teacher window before the target's own continuation (its prompt)
    teacher_prompt: int = 0
    # where a teacher window's blocks go: "window", anywhere; "continuation", only where the
    # block's first draft follows the prompt. Block positions 2.. are labelled only after the
    # target's own tokens, so a block in the prompt trains position 1 and little else, which
    # the corpus windows already teach
    anchor_from: str = "window"
    # "cache": teacher windows share the output cache with the corpus (the corpus keeps up to
    # half of it); "stream": only corpus windows are cached, and the target runs over each step's
    # teacher windows, so every teacher window generated is trained on, however many the
    # device's memory would hold (a draft trained over and over on the windows a cache holds
    # memorises them; docs/dflash.md)
    teacher_outputs: str = "cache"
    # torch.compile the draft's training forward (its shapes are fixed: one graph), compiled by a
    # step outside the training clock whose gradients are dropped. Eager, a step is a few hundred
    # small kernels (norms, RoPE, masks) around its matmuls; the served draft is the same either way
    compile: bool = False


def dflash_layer_ids(num_target_layers: int, num_draft_layers: int, spread: str = "reference") -> list[int]:
    """The target layers a DFLASH draft reads: as many as it has layers, distinct, so fewer
    where the span holds fewer (layer ``0`` alone for a target of under 4 layers).
    ``spread``: ``reference``, over ``1 .. L-3`` as the reference spreads them over its
    36-layer targets (3 of 36 unread); ``top``, over ``1 .. L-2``, the deepest output a
    target's forward captures (``dflash.format.check_target_layer_ids``: layer ``L-1``'s
    output is the final norm's input, served un-normed where training would see it normed).
    Of an 8-layer target, ``L-3`` leaves 2 unread, a quarter of its depth."""
    from ...speculative.dflash.format import default_target_layer_ids

    if num_target_layers < 4:
        return [0]
    if spread == "reference":
        return sorted(set(default_target_layer_ids(num_target_layers, num_draft_layers)))
    if spread != "top":
        raise ValueError(f"DFLASH target layer spread must be reference or top, got {spread!r}")
    deepest = num_target_layers - 2
    if num_draft_layers == 1:
        return [deepest]
    span = deepest - 1
    return sorted({round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)})


# The output cache keeps the target's layer outputs of each window, so a training step is the
# draft's own work rather than the target's forward; the teacher windows it holds bound what
# the draft learns. A 193-token window with three layer outputs of the 1024-wide small target
# and greedy labels is ~1.2 MB, so this holds ~50k teacher and as many corpus windows; a
# device with less free memory bounds it first (docs/dflash.md).
CACHE_GIB = 120.0
# what a training step itself allocates, beside the cache (batch 48, 24 blocks of 8: ~3 GiB)
STEP_RESERVE_GIB = 10.0


def cache_budget(opts: DFlashTraining, device: torch.device) -> float:
    """The GiB :func:`output_caches` may fill: ``opts.cache_gib``, or its default on ``device``."""
    if opts.cache_gib is not None:
        return opts.cache_gib
    if device.type != "cuda":
        return 0.0
    free, _ = torch.cuda.mem_get_info(device)
    # what the allocator holds unused (the EAGLE head's freed cache) is free to this cache too
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(0.0, min(CACHE_GIB, free / 2**30 - STEP_RESERVE_GIB))


def target_outputs(target, window: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's outputs of ``layer_ids`` concatenated ``[B, L, K * H]`` (Hugging Face's
    ``hidden_states[i + 1]``: what the runtime captures, for the layers it captures) and its
    logits ``[B, L, V]``."""
    parts, _, logits = _target_forward(target, window, layer_ids)
    return torch.cat(parts, -1).float(), logits.float()


def _target_forward(
    target, window: torch.Tensor, layer_ids: list[int]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The frozen target over ``window`` (bf16 autocast on a GPU): the outputs of
    ``layer_ids`` (only layers whose outputs serving captures), the final normed hidden state
    and the logits."""
    check_target_layer_ids(layer_ids, target.config.num_hidden_layers)
    autocast = window.device.type == "cuda"
    with (
        torch.no_grad(),
        torch.autocast(device_type=window.device.type, dtype=torch.bfloat16, enabled=autocast),
    ):
        out = target.model(input_ids=window, output_hidden_states=True)
        parts = [out.hidden_states[i + 1] for i in layer_ids]
        return parts, out.last_hidden_state, target.lm_head(out.last_hidden_state)


def sample_anchors(
    b: int, length: int, block: int, n: int, gen: torch.Generator, *, first: int | torch.Tensor = 1
) -> torch.Tensor:
    """``n`` distinct anchors ``[b, n]`` per window of ``length`` tokens, each in ``first ..
    length - block + 1``: the block ``a .. a + block - 1`` takes its labels from the target's
    rows ``a .. a + block - 2``, the last of which is the window's last token. ``first``: one
    for every window, or each window's ``[b]``."""
    if isinstance(first, int):
        span = length - block + 2 - first
        if span < n:
            raise ValueError(f"windows of {length} tokens hold fewer than {n} blocks of {block} from {first}")
        return torch.rand(b, span, generator=gen).argsort(-1)[:, :n] + first
    spans = length - block + 2 - first
    if int(spans.min()) < n:
        raise ValueError(
            f"windows of {length} tokens hold fewer than {n} blocks of {block} from {int(first.max())}"
        )
    scores = torch.rand(b, int(spans.max()), generator=gen)
    scores[torch.arange(scores.shape[1]) >= spans[:, None]] = 2.0  # past a window's span: sorted last
    return scores.argsort(-1)[:, :n] + first[:, None]


def first_anchors(b: int, teacher_rows: int, opts: DFlashTraining) -> int | torch.Tensor:
    """Each window's first anchor (:func:`sample_anchors`' ``first``) when a batch's last
    ``teacher_rows`` of ``b`` windows are teacher windows (``opts.anchor_from``)."""
    if opts.anchor_from == "window" or teacher_rows == 0:
        return 1
    if opts.anchor_from != "continuation":
        raise ValueError(f"DFLASH anchor_from must be window or continuation, got {opts.anchor_from!r}")
    first = torch.ones(b, dtype=torch.long)
    first[b - teacher_rows :] = max(1, opts.teacher_prompt - 1)  # the block starts at the prompt's last token
    return first


def block_targets(
    window: torch.Tensor, greedy: torch.Tensor, logits: torch.Tensor | None, anchors: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """At every masked block position: the target's greedy token ``[B, n, block - 1]``, its
    log-distribution ``[B, n, block - 1, V]`` (None without ``logits``) and whether the
    position counts ``[B, n, block - 1]`` (bool): position ``j`` counts when tokens ``a + 1
    .. a + j - 1`` of the window are the target's greedy choices (see the module).
    ``greedy`` ``[B, L]``: the target's choice after each of the window's prefixes."""
    b, n = anchors.shape
    rows = (anchors[:, :, None] + torch.arange(block - 1, device=window.device)).view(b, -1)
    labels = greedy.gather(1, rows).view(b, n, block - 1)
    teacher = None
    if logits is not None:
        vocab = logits.shape[-1]
        gathered = logits.gather(1, rows[..., None].expand(-1, -1, vocab))
        teacher = torch.log_softmax(gathered, -1).view(b, n, block - 1, vocab)
    # follows[i]: token i + 1 is the target's greedy choice after the window's tokens 0..i
    follows = window[:, 1:] == greedy[:, :-1]
    before = rows.view(b, n, block - 1)[:, :, :-1].reshape(b, -1)  # rows a .. a + block - 3
    chosen = follows.gather(1, before).view(b, n, block - 2)  # tokens a + 1 .. a + block - 2
    ones = torch.ones(b, n, 1, dtype=torch.bool, device=window.device)
    counts = torch.cat([ones, chosen.cumprod(-1).bool()], -1)
    return labels, teacher, counts


def dflash_loss(
    draft: DFlashDraft, target, window: torch.Tensor, opts: DFlashTraining, gen: torch.Generator,
    cached: tuple[torch.Tensor, torch.Tensor] | None = None, teacher_rows: int = 0,
    forward: Callable[..., torch.Tensor] | None = None,
):  # fmt: skip
    """Position-weighted loss at every masked block position that counts: cross-entropy to
    the target's greedy token (``opts.labels == "greedy"``) or KL from its next-token
    distribution (``"distribution"``); returns (loss, per-position top-1 agreement with the
    target's greedy token there). ``cached``: the window's :func:`cached_outputs` and greedy
    tokens (else the target runs); ``teacher_rows``: the batch's last windows that are teacher
    windows (where ``opts.anchor_from`` places their blocks); ``forward``: the draft's
    ``block_logits`` as the step runs it (compiled), by default the draft's own."""
    b, length = window.shape
    blk = opts.block
    if cached is None:
        feats, logits = target_outputs(target, window, opts.layer_ids)
        greedy = logits.argmax(-1)
    else:
        rows, greedy = cached
        feats, logits = split_cached(target, rows, with_logits=opts.labels != "greedy")
    # anchor a: context 0..a-1, block a..a+blk-1, labels from the target's logits at a..a+blk-2
    first = first_anchors(b, teacher_rows, opts)
    anchors = sample_anchors(b, length, blk, opts.blocks, gen, first=first).to(window.device)
    autocast = window.device.type == "cuda"
    with torch.autocast(device_type=window.device.type, dtype=torch.bfloat16, enabled=autocast):
        draft_logits = (forward or draft.block_logits)(window, feats, anchors)
    labels, teacher, counts = block_targets(
        window, greedy, logits if opts.labels != "greedy" else None, anchors, blk
    )
    logp = torch.log_softmax(draft_logits, -1)
    if teacher is None:
        per_position = -logp.gather(-1, labels[..., None]).squeeze(-1)  # [B, n, blk - 1]
    else:
        per_position = (teacher.exp() * (teacher - logp)).sum(-1)
    weight = torch.exp(-torch.arange(blk - 1, device=window.device) / opts.decay) * counts
    loss = (per_position * weight).sum() / weight.sum()
    hits = (logp.argmax(-1) == labels) & counts
    top1 = hits.sum((0, 1)).float() / counts.sum((0, 1)).clamp_min(1)
    return loss, [round(float(a), 3) for a in top1]


def cached_outputs(
    target, window: torch.Tensor, layer_ids: list[int], *, with_final: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache keeps of the target's forward over ``window``: bfloat16 rows ``[B, L,
    K * H]``, the outputs of ``layer_ids`` (the draft's context), followed by the final normed
    hidden state when ``with_final`` (KL labels: :func:`split_cached` recomputes the logits
    from it; the LM head is ~8% of the target's work, and logits over the vocabulary would be
    2-8x the size of the rest); and the target's greedy token after each prefix ``[B, L]``
    (all that greedy labels need: a three-layer draft's row is then a quarter smaller)."""
    parts, final, logits = _target_forward(target, window, layer_ids)
    return torch.cat([*parts, final] if with_final else parts, -1).to(torch.bfloat16), logits.argmax(-1)


def split_cached(
    target, rows: torch.Tensor, *, with_logits: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer outputs (float32) of :func:`cached_outputs`' rows, and the logits when
    ``with_logits`` (the rows then end with the final normed hidden state)."""
    if not with_logits:
        return rows.float(), None
    hidden = target.config.hidden_size
    autocast = rows.device.type == "cuda"
    with (
        torch.no_grad(),
        torch.autocast(device_type=rows.device.type, dtype=torch.bfloat16, enabled=autocast),
    ):
        logits = target.lm_head(rows[..., -hidden:].float()).float()
    return rows[..., :-hidden].float(), logits


def output_caches(
    target, data: torch.Tensor, teacher_data: torch.Tensor | None, device: torch.device, opts: DFlashTraining
) -> tuple[FeatureCache, FeatureCache | None, dict] | None:
    """The corpus and teacher windows with :func:`cached_outputs` within :func:`cache_budget`
    (:func:`cache_windows`' split; corpus windows fixed non-overlapping slices), or None.

    The target is frozen, so its outputs of a window never change: computing them once
    leaves each training step the draft's own work (as the EAGLE head's feature cache)."""
    gib = cache_budget(opts, device)
    if gib <= 0:
        return None
    width = opts.seq + 1
    with_final = opts.labels != "greedy"
    dims = (len(opts.layer_ids) + with_final) * target.config.hidden_size
    row_bytes = width * (dims * 2 + 8)  # bfloat16 rows, an int64 greedy token

    def build(windows: torch.Tensor) -> FeatureCache:
        # filled in place: concatenating the chunks would hold the cache twice for a moment;
        # each window's greedy tokens ride with its tokens ([n, 2, L]: sample_cached keeps them paired)
        windows = windows.to(device)
        out = torch.empty(*windows.shape, dims, dtype=torch.bfloat16, device=device)
        paired = torch.empty(windows.shape[0], 2, width, dtype=windows.dtype, device=device)
        paired[:, 0] = windows
        for start in range(0, windows.shape[0], 256):
            part = windows[start : start + 256]
            out[start : start + 256], paired[start : start + 256, 1] = cached_outputs(
                target, part, opts.layer_ids, with_final=with_final
            )
        return FeatureCache(paired, out)

    return cache_windows(data, teacher_data, width, row_bytes, gib, build, "DFLASH output cache")


def _batch(data, teacher_data, gen: torch.Generator, opts: DFlashTraining) -> torch.Tensor:
    """``opts.batch`` windows of ``opts.seq + 1`` tokens, ``teacher_fraction`` of them the
    target's own continuations."""
    n_teacher = 0 if teacher_data is None else max(1, round(opts.batch * opts.teacher_fraction))
    return sample_windows(data, teacher_data, gen, count=opts.batch, n_teacher=n_teacher, seq=opts.seq)


def _with_streamed(
    target, paired: torch.Tensor, rows: torch.Tensor, teacher_data: torch.Tensor, n: int, gen: torch.Generator,
    opts: DFlashTraining,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The cached corpus windows ``paired`` / ``rows`` of a batch followed by ``n`` random
    teacher windows whose :func:`cached_outputs` the target computes now (``teacher_outputs
    == "stream"``)."""
    pick = torch.randint(0, teacher_data.shape[0], (n,), generator=gen).to(teacher_data.device)
    windows = teacher_data[pick]
    t_rows, greedy = cached_outputs(target, windows, opts.layer_ids, with_final=opts.labels != "greedy")
    return torch.cat([paired, torch.stack([windows, greedy], 1)]), torch.cat([rows, t_rows])


@torch.no_grad()
def init_from_target(draft: DFlashDraft, target) -> None:
    """Draft layer ``j`` of ``n`` takes target layer ``L - n + j``'s weights (the layers that
    turn its hidden states into next-token predictions; the q/k norms, which the target lacks,
    stay 1), and the draft's final norm the target's."""
    layers = target.model.layers
    if len(draft.layers) > len(layers):
        raise ValueError(f"a {len(draft.layers)}-layer draft cannot start from a {len(layers)}-layer target")
    for mine, theirs in zip(draft.layers, layers[len(layers) - len(draft.layers) :], strict=True):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(mine, name).weight.copy_(getattr(theirs.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mine, name).weight.copy_(getattr(theirs.mlp, name).weight)
        mine.input_layernorm.copy_(theirs.input_layernorm.weight)
        mine.post_attention_layernorm.copy_(theirs.post_attention_layernorm.weight)
    draft.norm.copy_(target.model.norm.weight)


def train_dflash(
    target, data: torch.Tensor, teacher_data: torch.Tensor | None, device: torch.device,
    opts: DFlashTraining, probe: Callable[[DFlashDraft], dict] | None = None,
) -> tuple[DFlashDraft, dict]:  # fmt: skip
    """Train a DFLASH draft over the frozen ``target`` for ``opts.seconds``; ``probe`` (with
    ``opts.probe_every``) judges it every ``probe_every`` steps, listed under ``probes``."""
    cfg = target.config
    draft = DFlashDraft(
        LayerDims.of(cfg), target.model.embed_tokens.weight, target.lm_head.weight, layer_ids=opts.layer_ids,
        num_layers=opts.num_layers, block=opts.block, mask_id=opts.mask_id, eps=cfg.rms_norm_eps,
        rope=RopeFrequencies.of(cfg),
    ).to(device)  # fmt: skip
    torch.manual_seed(opts.seed)
    for p in draft.parameters():  # norms start at 1; the rest as a Llama initialises
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    if opts.init == "target":
        init_from_target(draft, target)
    elif opts.init != "random":
        raise ValueError(f"DFLASH init must be random or target, got {opts.init!r}")
    params = list(draft.parameters())
    groups = [
        {"params": [p for p in params if p.dim() == 2], "weight_decay": opts.weight_decay},
        {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(opts.seed)
    data = data.to(device)
    if opts.teacher_outputs not in ("cache", "stream"):
        raise ValueError(f"DFLASH teacher_outputs must be cache or stream, got {opts.teacher_outputs!r}")
    stream = opts.teacher_outputs == "stream" and teacher_data is not None
    caches = output_caches(target, data, None if stream else teacher_data, device, opts)
    if stream and caches is not None:
        teacher_data = teacher_data[:, : opts.seq + 1].to(device)
    n_teacher = 0 if teacher_data is None else max(1, round(opts.batch * opts.teacher_fraction))

    def step_loss(gen: torch.Generator, forward) -> tuple[torch.Tensor, list[float]]:
        if caches is None:
            batch = _batch(data, teacher_data, gen, opts)
            return dflash_loss(draft, target, batch, opts, gen, teacher_rows=n_teacher, forward=forward)
        paired, rows = sample_cached(caches, opts.batch, n_teacher, gen)
        if stream:
            paired, rows = _with_streamed(target, paired, rows, teacher_data, n_teacher, gen, opts)
        return dflash_loss(draft, target, paired[:, 0], opts, gen, (rows, paired[:, 1]), n_teacher, forward)

    forward, compiled = _compiled(draft, step_loss, opts.seed) if opts.compile else (draft.block_logits, {})
    start, step, loss, top1 = time.monotonic(), 0, torch.zeros(()), [0.0]
    probes: list[dict] = []
    while (frac := progress(time.monotonic() - start, opts.seconds, step, opts.max_steps)) < 1.0:
        if probe is not None and opts.probe_every > 0 and step > 0 and step % opts.probe_every == 0:
            start += _probe(draft, probe, probes, time.monotonic() - start, step)
        set_lr(optim, opts.lr * lr_scale(step, frac))
        loss, top1 = step_loss(gen, forward)
        apply_update(optim, loss, params)
        step += 1
    draft.eval()
    return draft, {
        "seconds": opts.seconds,
        "steps": step,
        "windows": step * opts.batch,
        "final_loss": round(loss.item(), 3),
        "train_top1": top1,
        "params": sum(p.numel() for p in params),
        "block": opts.block,
        "layers": opts.num_layers,
        "target_layer_ids": opts.layer_ids,
        "blocks_per_window": opts.blocks,
        "decay": opts.decay,
        "labels": opts.labels,
        "lr": opts.lr,
        "weight_decay": opts.weight_decay,
        "init": opts.init,
        "teacher_fraction": opts.teacher_fraction if teacher_data is not None else 0.0,
        "anchor_from": opts.anchor_from,
        "teacher_outputs": "stream" if stream else "cache",
        **compiled,
        "seq": opts.seq,
        **(caches[2] if caches is not None else {"output_cache": "off"}),
        **({"probes": probes} if probes else {}),
    }


def _compiled(draft: DFlashDraft, step_loss: Callable, seed: int) -> tuple[Callable[..., torch.Tensor], dict]:
    """``draft.block_logits`` compiled (fixed shapes), and what compiling took: one forward and
    backward of a step on its own generator (the training's batches stay as they would be),
    gradients dropped, so no clock counts the compilation. Where the compiler fails, the
    eager forward and the error: a compiler's bug costs a run its speed-up, not the run."""
    t0 = time.monotonic()
    forward = torch.compile(draft.block_logits, dynamic=False)
    try:
        loss, _ = step_loss(torch.Generator().manual_seed(seed + 1), forward)
        loss.backward()
    except Exception as err:  # any compiler failure: train eagerly, say why
        log(f"DFLASH training forward did not compile, training eagerly: {err!r}")
        return draft.block_logits, {"compile_error": repr(err)[:500]}
    finally:
        draft.zero_grad(set_to_none=True)
    seconds = round(time.monotonic() - t0, 1)
    log(f"DFLASH training forward compiled in {seconds} s")
    return forward, {"compile_seconds": seconds}


def _probe(
    draft: DFlashDraft, probe: Callable[[DFlashDraft], dict], probes: list[dict], elapsed: float, step: int
) -> float:
    """Append ``probe``'s judgement of ``draft`` after ``elapsed`` training seconds (``step``
    steps) to ``probes``; returns the seconds it took, which the training budget does not count."""
    t0 = time.monotonic()
    draft.eval()
    probes.append({"seconds": round(elapsed, 1), "steps": step, **probe(draft)})
    draft.train()
    log(f"DFLASH probe: {probes[-1]}")
    return time.monotonic() - t0


@dataclass(frozen=True)
class HeldOut:
    """The target's greedy continuations of held-out prompts and what a draft is judged
    against on them: built once (:func:`heldout_data`) and shared by every judgement of
    drafts reading ``layer_ids`` (the training probes and the final walk)."""

    window: torch.Tensor  # [count, seq + 1] prompt then the target's greedy continuation
    feats: torch.Tensor  # the target's outputs at ``layer_ids``, per window token
    greedy: torch.Tensor  # [count, seq + 1] the target's greedy next token per position
    anchors: torch.Tensor  # [count, blocks] random block anchors in the continued part
    prompt: int
    layer_ids: tuple[int, ...]
    block: int


@torch.no_grad()
def heldout_windows(
    target, held_ids: torch.Tensor, device: torch.device, *, seq: int, count: int
) -> torch.Tensor:
    """The target's greedy continuations of ``count`` held-out prompts (``seq // 3`` tokens
    each), ``[count, seq + 1]``; deterministic (seed 11). They depend on the target alone, so
    drafts of other layers or blocks over one target can share them (the recipe study)."""
    prompt = seq // 3
    return teacher_sequences(
        target, held_ids, device, count=count, prompt_len=prompt, new_tokens=seq + 1 - prompt, seed=11
    )


@torch.no_grad()
def heldout_data(
    target, held_ids: torch.Tensor, device: torch.device, *, seq: int, count: int, block: int,
    layer_ids: list[int], windows: torch.Tensor | None = None,
) -> HeldOut:  # fmt: skip
    """:func:`heldout_windows` (or the given ``windows`` of them), the target's outputs at
    ``layer_ids`` over them and 8 random anchors a window for blocks of ``block`` tokens;
    deterministic (seed 11)."""
    prompt = seq // 3
    if windows is None:
        windows = heldout_windows(target, held_ids, device, seq=seq, count=count)
    elif tuple(windows.shape) != (count, seq + 1):
        raise ValueError(
            f"held-out windows must be [{count}, {seq + 1}] (heldout_windows' shape), got {list(windows.shape)}"
        )
    feats, logits = target_outputs(target, windows, layer_ids)
    # the block's drafts follow the prompt: its first token is the prompt's last or later
    gen = torch.Generator().manual_seed(11)
    anchors = sample_anchors(count, seq + 1, block, 8, gen, first=prompt - 1).to(device)
    return HeldOut(windows, feats, logits.argmax(-1), anchors, prompt, tuple(layer_ids), block)


@torch.no_grad()
def dflash_heldout(draft: DFlashDraft, held: HeldOut) -> dict:
    """What serving would accept, offline, on ``held``'s greedy continuations.

    Blocks at ``held``'s random anchors: per block position, top-1 agreement with the
    target's greedy token and the share of blocks whose drafts agree up to there; the mean
    number of leading agreeing positions. Random anchors flatter a draft: serving anchors
    each block right after the last one's first miss, a token the draft failed to predict.
    So the continuations are also walked as greedy serving walks them (each block anchored
    at the target's token after the previous block's accepted drafts): accepted drafts per
    step and the share of steps that accept position ``j``, which is what the served run's
    per-position acceptance measures on the base model."""
    if (tuple(draft.layer_ids), draft.block) != (held.layer_ids, held.block):
        raise ValueError(
            f"the draft reads target layers {list(draft.layer_ids)} in blocks of {draft.block}; the held-out"
            f" data is for layers {list(held.layer_ids)} in blocks of {held.block}: build it with"
            " heldout_data(..., block=draft.block, layer_ids=draft.layer_ids)"
        )
    count, blocks = held.anchors.shape
    blk = draft.block
    offsets = torch.arange(blk - 1, device=held.window.device)
    got = draft.block_logits(held.window, held.feats, held.anchors).argmax(-1)
    idx = (held.anchors[:, :, None] + offsets).view(count, -1)
    want = held.greedy.gather(1, idx).view(count, blocks, blk - 1)
    match = (got == want).float()
    leading = match.cumprod(-1)
    walk, contexts = _walk(draft, held.window, held.feats, held.greedy, held.prompt - 1)
    return {
        "heldout_top1": [round(float(a), 3) for a in match.mean((0, 1))],
        "heldout_accept": [round(float(a), 3) for a in leading.mean((0, 1))],
        "heldout_leading": round(float(leading.sum(-1).mean()), 3),
        "max_leading": blk - 1,
        "heldout_walk_accept": [round(float(a), 3) for a in walk.mean(0)],
        "heldout_walk_mean": round(float(walk.sum(-1).mean()), 3),
        "heldout_walk_by_context": walk_by_context(walk, contexts),
    }


def walk_by_context(walk: torch.Tensor, contexts: torch.Tensor) -> dict[str, list]:
    """The walk's accepted drafts a step by the tokens before the block, in the runtime's
    context buckets (what ``/metrics`` and the served run count them in): ``{bucket: [mean,
    steps]}``, shortest first. A draft trained on shorter windows than it serves falls off
    in the longer buckets."""
    accepted = walk.sum(-1)
    buckets: dict[str, list[float]] = {}
    for n, ctx in zip(accepted.tolist(), contexts.tolist(), strict=True):
        buckets.setdefault(context_bucket(int(ctx)), []).append(n)
    return {b: [round(sum(v) / len(v), 3), len(v)] for b, v in buckets.items()}


def format_walk_by_context(buckets: dict[str, list] | None) -> str:
    """``128-255 2.31 (540), 256-511 3.68 (300)``: :func:`walk_by_context`'s dict as the reports
    write it (mean accepted, steps); "" for records made before the walk was split by context."""
    return ", ".join(f"{b} {mean} ({n})" for b, (mean, n) in (buckets or {}).items())


def _walk(
    draft: DFlashDraft, window: torch.Tensor, feats: torch.Tensor, greedy: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy speculation over windows that are the target's greedy continuations: each
    block at the window's token after the previous block's accepted drafts, from ``start``
    while a whole block fits. Returns every step's accepted positions ``[steps, block - 1]``
    (0/1, leading ones) and the tokens before its block ``[steps]`` (its anchor + 1)."""
    count, length = window.shape
    blk = draft.block
    last = length - blk + 1  # the last anchor whose labels are all in the window
    offsets = torch.arange(blk - 1, device=window.device)
    pos = torch.full((count,), start, dtype=torch.long, device=window.device)
    steps, contexts = [], []
    while bool((pos <= last).any()):
        live = pos <= last
        anchor = pos.clamp(max=last)
        got = draft.block_logits(window, feats, anchor[:, None])[:, 0].argmax(-1)
        lead = (got == greedy.gather(1, anchor[:, None] + offsets)).long().cumprod(-1)
        steps.append(lead[live])
        contexts.append(anchor[live] + 1)
        pos = torch.where(live, pos + lead.sum(-1) + 1, pos)
    return torch.cat(steps).float(), torch.cat(contexts)
