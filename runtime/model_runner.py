"""The model runner: one model, its KV cache and (for the target) its adapter pool.

``forward`` runs one batch in any mode (extend, decode, target-verify), appending the
batch's tokens to the KV cache; callers drop rejected tokens through ``runner.kv``. A
draft runner (``is_draft=True``) is built from the same class but has no adapter pool
at all: ``runner.lora is None`` and it always runs the base weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from loraserve.kernels import ForwardMode, get_backend

from .config import RuntimeConfig
from .kv import Allocation, KVCache, derive_max_total_tokens, kv_bytes_per_token
from .lora import LoRAManager
from .model import (
    ForwardBatch,
    ForwardBatchError,
    ForwardOutput,
    ModelArchConfig,
    build_model,
    load_arch_config,
)
from .model.arch import ModelConfigError, parse_dtype
from .model.layers import LMHead, VocabEmbedding, build_attention_metadata

log = logging.getLogger(__name__)


def resolve_device(name: str | torch.device | None) -> torch.device:
    """``auto``/None: CUDA when available, else CPU."""
    if name is None or str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelConfigError(f"device {str(name)!r} was asked for but CUDA is not available: use device=cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class ModelRunner:
    """Owns the model, the KV cache and (target only) the LoRA manager of one process.

    ``model_path`` overrides the configured path (``model.path`` for the target,
    ``speculative.draft_model_path`` for a draft). ``random_weights`` (benchmarks only)
    skips the checkpoint and fills the weights with N(0, 0.02) on the device; the
    directory then needs only config.json.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        is_draft: bool = False,
        model_path: str | Path | None = None,
        device: str | torch.device | None = None,
        random_weights: bool = False,
    ):
        self.config = config
        self.is_draft = is_draft
        self.device = resolve_device(device if device is not None else config.device)
        if model_path is None:
            model_path = config.speculative.draft_model_path if is_draft else config.model.path
            if not model_path:
                field = "speculative.draft_model_path" if is_draft else "model.path"
                raise ModelConfigError(f"{field} is not set: point it at a local model directory")
        self.model_path = Path(model_path)
        override = config.speculative.draft_model_architecture if is_draft else config.model.architecture
        self.arch: ModelArchConfig = load_arch_config(self.model_path, architecture_override=override)
        default_dtype = self.arch.torch_dtype if self.device.type == "cuda" else torch.float32
        self.dtype = parse_dtype(config.model.dtype, default_dtype)
        self.context_len = int(config.model.context_length or self.arch.max_position_embeddings)
        if self.context_len < 1:
            raise ModelConfigError(f"model.context_length must be >= 1, got {self.context_len}")

        self.model = build_model(
            self.arch,
            dtype=self.dtype,
            device=self.device,
            max_positions=self.context_len,
            model_dir=None if random_weights else self.model_path,
            random_init_std=0.02 if random_weights else None,
            seed=config.seed,
        )

        self.lora: LoRAManager | None = None
        if not is_draft and config.lora.enabled:
            self.lora = LoRAManager(
                config.lora,
                self.model,
                backend=get_backend(config.lora.backend, str(self.device)),
                device=self.device,
                dtype=self.dtype,
            )

        max_requests = 2 * max(1, config.scheduler.max_running_requests)
        bytes_per_token = kv_bytes_per_token(self.arch.num_layers, self.arch.num_kv_heads, self.arch.head_dim, self.dtype)
        max_total_tokens = derive_max_total_tokens(
            requested=config.scheduler.max_total_tokens,
            bytes_per_token=bytes_per_token,
            device=self.device,
            memory_fraction=config.scheduler.kv_memory_fraction,
            max_requests=max_requests,
            max_context_len=self.context_len,
        )
        self.kv = KVCache(
            num_layers=self.arch.num_layers,
            num_kv_heads=self.arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            dtype=self.dtype,
            device=self.device,
            max_total_tokens=max_total_tokens,
            max_requests=max_requests,
            max_context_len=self.context_len,
        )
        log.info(
            "%s runner: %s (%s, %s layers) on %s in %s; KV cache %d tokens (%.2f GiB)",
            "draft" if is_draft else "target",
            self.model_path,
            self.arch.architecture,
            self.arch.num_layers,
            self.device,
            self.dtype,
            max_total_tokens,
            max_total_tokens * bytes_per_token / 2**30,
        )

        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graph.enabled:
            from .cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self, max_bs=config.cuda_graph.max_bs)

        if self.lora is not None:
            for name, path in config.lora.adapters.items():
                self.lora.load(name, path, pinned=name in config.lora.pinned)

    # ------------------------------------------------------------------ accessors
    @property
    def model_config(self) -> ModelArchConfig:
        """vocab_size, hidden_size, num_layers, max_position_embeddings, ... (no tokenizer)."""
        return self.arch

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @property
    def embed_tokens(self) -> VocabEmbedding:
        """The BASE token embedding (no adapter delta), for drafts that share it."""
        return self.model.embed_tokens

    @property
    def lm_head(self) -> LMHead:
        """The BASE output projection (no adapter delta), for drafts that share it."""
        return self.model.lm_head

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one batch; appends its tokens to the KV cache (rolled back on failure)."""
        batch.validate()
        aux_layers = tuple(int(i) for i in batch.hidden_layers or ())
        bad = [i for i in aux_layers if not 0 <= i <= self.arch.num_layers]
        if bad:
            raise ForwardBatchError(f"hidden_layers {bad} are outside 0..{self.arch.num_layers}")
        names = list(batch.lora_names) if batch.lora_names is not None else [None] * batch.batch_size
        if self.lora is None and any(n is not None for n in names):
            raise ForwardBatchError(
                "lora_names names adapters but this runner has no adapter pool "
                f"({'a draft runs base weights only' if self.is_draft else 'lora.enabled is false'})"
            )
        input_ids = batch.input_ids
        if input_ids.device.type == "cpu" and input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.arch.vocab_size:
                raise ForwardBatchError(f"input_ids must be in [0, {self.arch.vocab_size}), got values in [{lo}, {hi}]")
        slots = self.lora.prepare_batch(names) if self.lora is not None else [-1] * batch.batch_size
        alloc = self.kv.allocate(list(batch.request_ids), batch.per_request_tokens())
        try:
            if self.graphs is not None and self.graphs.can_run(batch, slots, alloc):
                return self.graphs.run(batch, slots, alloc)
            return self._forward_eager(batch, slots, alloc, aux_layers)
        except BaseException:
            self.kv.rollback(alloc)
            raise

    def _forward_eager(
        self, batch: ForwardBatch, slots: list[int], alloc: Allocation, aux_layers: tuple[int, ...]
    ) -> ForwardOutput:
        mode = batch.mode
        counts = alloc.new_lens
        _, max_q = batch.token_counts()
        device = self.device
        meta = build_attention_metadata(
            req_to_token=self.kv.req_to_token,
            rows=alloc.rows,
            prefix_lens=torch.tensor(alloc.prefix_lens, dtype=torch.int64).to(device, non_blocking=True),
            out_cache_loc=alloc.out_cache_loc,
            max_q=max_q,
            max_ctx=max(alloc.seq_lens),
            groups=self.arch.num_heads // self.arch.num_kv_heads,
            q_lens=(torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True) if mode is ForwardMode.EXTEND else None),
            sliding_window=self.arch.sliding_window,
        )
        last_only = mode is ForwardMode.EXTEND and not batch.return_all_logits
        if self.lora is not None:
            info = self.lora.batch_info(
                mode,
                slots,
                extend_lens=counts if mode is ForwardMode.EXTEND else None,
                num_draft_tokens=batch.num_draft_tokens,
            )
            # The lm_head sees one row per request when only last positions are wanted.
            logits_info = self.lora.batch_info(ForwardMode.DECODE, slots) if last_only and info is not None else info
            self.lora.ctx.set(info, logits_info)
        try:
            input_ids = batch.input_ids.to(device=device, dtype=torch.int64, non_blocking=True)
            hidden, aux = self.model(input_ids, meta, self.kv.k_buffers, self.kv.v_buffers, aux_layers)
            if last_only:
                last = torch.tensor(counts, dtype=torch.int64).cumsum(0) - 1
                logits = self.model.compute_logits(hidden.index_select(0, last.to(device)))
            else:
                logits = self.model.compute_logits(hidden)
        finally:
            if self.lora is not None:
                self.lora.ctx.clear()
        return ForwardOutput(
            logits=logits,
            hidden_states=hidden if batch.return_hidden else None,
            aux_hidden_states=torch.cat(aux, dim=-1) if aux_layers else None,
        )
