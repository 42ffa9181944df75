"""The model runner: one model, its KV cache and (for the target) its adapter pool.

``forward`` runs one batch in any mode (extend, decode, target-verify), appending the
batch's tokens to the KV cache; callers drop rejected tokens through ``runner.kv``. With
``cuda_graph.enabled`` on a GPU, decode and target-verify batches and extends of one or
several requests of up to ``cuda_graph.max_prefill_tokens`` padded tokens replay CUDA
graphs (``loraserve.runtime.runner.cuda_graph``; its ``can_run`` decides); every other
batch runs eagerly, with the same results. A draft runner (``is_draft=True``) is built from the same class but has no adapter pool
at all: ``runner.lora is None`` and it always runs the base weights.

Tensor parallelism (``parallel.tensor_parallel_size > 1``, target only): the process
belongs to a group the launcher (``loraserve.runtime.executor.launch``) started, and
the runner holds this rank's shard of the model, its KV heads and adapter slices. On
rank 0 the runner is used exactly like a single-device one; each ``forward`` is first
described to the other ranks (``executor.driver``), whose runners replay it with
:meth:`ModelRunner.follow`. A draft runner is never sharded: it runs whole, on rank 0.
With one device none of this exists: same layers, same calls, no collective.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import torch

from loraserve.kernels import ForwardMode, get_backend

from ..contract.config import RuntimeConfig
from ..distributed import context as tp_context
from ..distributed.errors import TensorParallelConfigError, TensorParallelError
from ..distributed.protocol import Kind
from ..distributed.sharding import ShardPlan
from ..kv import Allocation, KVCache, derive_max_total_tokens, kv_bytes_per_token
from ..lora import LoRAManager
from ..model import (
    ModelArchConfig,
    build_model,
    load_arch_config,
    read_checkpoint_tensor,
)
from ..model.arch import ModelConfigError, parse_dtype
from ..model.layers import LMHead, VocabEmbedding, build_attention_metadata
from ..model.layers.attention import check_attention_backend, resolve_attention_backend
from .cuda_graph import context_bucket
from .forward_batch import ForwardBatch, ForwardBatchError, ForwardOutput

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

    A tensor-parallel target takes its group and device from the process's
    :func:`loraserve.runtime.distributed.context.current` context; ``tp`` is that context
    (None for one device and for every draft).
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
        self.tp = _tensor_parallel_context(config, is_draft)
        if self.tp is not None:
            device = self.tp.group.device  # one GPU per rank, chosen by the launcher
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
        try:
            check_attention_backend(config.attention_backend, self.device)
        except ValueError as exc:
            raise ModelConfigError(str(exc)) from None
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)

        group = self.tp.group if self.tp is not None else None
        driver = self.tp.driver if self.tp is not None else None
        self.shard: ShardPlan | None = None
        if group is not None:
            # Every rank must build the same model from the same settings, or their steps differ.
            group.check_same("the runtime configuration", _fingerprint(config, random_weights))
            self.shard = ShardPlan.for_arch(self.arch, group.rank, group.size)
        self.model = build_model(
            self.arch,
            dtype=self.dtype,
            device=self.device,
            max_positions=self.context_len,
            model_dir=None if random_weights else self.model_path,
            random_init_std=0.02 if random_weights else None,
            seed=config.seed,
            shard=self.shard,
            group=group,
        )
        # Attention runs on this rank's heads: the query heads per KV head it holds.
        num_kv_heads = self.shard.local_kv_heads if self.shard else self.arch.num_kv_heads
        num_heads = self.shard.local_heads if self.shard else self.arch.num_heads
        self.attn_groups = num_heads // num_kv_heads
        self._full_vocab: tuple[VocabEmbedding, LMHead] | None = None

        self.lora: LoRAManager | None = None
        # A draft's pool holds draft adapters only: its lora section is the draft pool that
        # build_draft_config made from speculative.draft_max_loras, and nothing is loaded into
        # it at start-up (draft adapters come with their Adapters, by name).
        pool = config.lora if config.lora.enabled else None
        if is_draft and config.speculative.draft_max_loras <= 0:
            pool = None
        if pool is not None:
            self.lora = LoRAManager(
                pool,
                self.model,
                backend=get_backend(pool.backend, str(self.device)),
                device=self.device,
                dtype=self.dtype,
                shard=self.shard,
                base_tensor=None if self.shard is None or random_weights else self._checkpoint_vocab_tensor,
            )
            if driver is not None:
                driver.attach_lora(self.lora)

        max_requests = 2 * max(1, config.scheduler.max_running_requests)
        bytes_per_token = kv_bytes_per_token(self.arch.num_layers, num_kv_heads, self.arch.head_dim, self.dtype)
        max_total_tokens = derive_max_total_tokens(
            requested=config.scheduler.max_total_tokens,
            bytes_per_token=bytes_per_token,
            device=self.device,
            memory_fraction=config.scheduler.kv_memory_fraction,
            max_requests=max_requests,
            max_context_len=self.context_len,
        )
        if group is not None:
            # Every rank holds every request's tokens (its own KV heads): the smallest budget.
            max_total_tokens = group.min_int(max_total_tokens)
        kv_args = dict(
            num_layers=self.arch.num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=self.arch.head_dim,
            dtype=self.dtype,
            device=self.device,
            max_total_tokens=max_total_tokens,
            max_requests=max_requests,
            max_context_len=self.context_len,
        )
        # Under tensor parallelism rank 0 keeps the prefix tree; the others replay its journal.
        prefix = prefix_cache_enabled(config, is_draft=is_draft, adapters=self.lora is not None) and (
            group is None or group.is_driver
        )
        if driver is not None:
            self.kv = driver.kv_cache(**kv_args, prefix_cache=prefix)
        else:
            self.kv = KVCache(**kv_args, prefix_cache=prefix)
        log.info(
            "%s runner: %s (%s, %s layers) on %s in %s%s; KV cache %d tokens (%.2f GiB)",
            "draft" if is_draft else "target",
            self.model_path,
            self.arch.architecture,
            self.arch.num_layers,
            self.device,
            self.dtype,
            f", tensor-parallel rank {group.rank} of {group.size}" if group is not None else "",
            max_total_tokens,
            max_total_tokens * bytes_per_token / 2**30,
        )

        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graph.enabled:
            from .cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(
                self, max_bs=config.cuda_graph.max_bs, max_prefill_tokens=config.cuda_graph.max_prefill_tokens
            )

        # Followers hold the adapters rank 0 loads, replayed from its journal. The pool's own
        # start-up list: a draft's is empty (its draft adapters come with their Adapters).
        if self.lora is not None and not is_draft and (self.tp is None or self.tp.group.is_driver):
            for name, path in config.lora.adapters.items():
                self.lora.load(name, path, pinned=name in config.lora.pinned)
        if driver is not None:
            driver.start_heartbeats()  # every rank is past the KV exchange: all weights are loaded

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
        """The BASE token embedding (no adapter delta), for drafts that share it.

        Whole even under tensor parallelism (gathered once, on first use, on rank 0).
        """
        if self.tp is None:
            return self.model.embed_tokens
        return self._gathered_vocab()[0]

    @property
    def lm_head(self) -> LMHead:
        """The BASE output projection (no adapter delta), for drafts that share it."""
        if self.tp is None:
            return self.model.lm_head
        return self._gathered_vocab()[1]

    def full_vocab_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embedding, lm_head)`` base weights of the whole vocabulary.

        Tensor-parallel: a collective every rank joins (rank 0 asks the others first).
        """
        if self.tp is None:
            return self.model.embed_tokens.weight, self.model.lm_head.weight
        group, driver = self.tp.group, self.tp.driver
        if driver is not None:
            with driver.forward_scope():
                driver.command(Kind.GATHER_VOCAB)
                return self._all_gather_vocab(group)
        return self._all_gather_vocab(group)

    @torch.inference_mode()
    def _all_gather_vocab(self, group) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = self.arch.vocab_size
        embed = group.all_gather_rows(self.model.embed_tokens.weight)[:vocab]
        if self.model.lm_head.tied:
            return embed, embed
        return embed, group.all_gather_rows(self.model.lm_head.weight)[:vocab]

    def _gathered_vocab(self) -> tuple[VocabEmbedding, LMHead]:
        if self._full_vocab is None:
            embed_w, head_w = self.full_vocab_weights()
            embed = VocabEmbedding(self.arch.vocab_size, self.arch.hidden_size, dtype=self.dtype, device="meta")
            embed.weight = torch.nn.Parameter(embed_w, requires_grad=False)
            head = LMHead(self.arch.hidden_size, self.arch.vocab_size, dtype=self.dtype, device="meta")
            head.weight = torch.nn.Parameter(head_w, requires_grad=False)
            self._full_vocab = (embed, head)
        return self._full_vocab

    def _checkpoint_vocab_tensor(self, module: str) -> torch.Tensor | None:
        """The whole base embedding / lm_head from the checkpoint (this rank holds a shard)."""
        if module == "lm_head" and not self.arch.tie_word_embeddings:
            return read_checkpoint_tensor(self.model_path, "lm_head.weight")
        if module in ("embed_tokens", "lm_head"):
            return read_checkpoint_tensor(self.model_path, "model.embed_tokens.weight")
        return None

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one batch; appends its tokens to the KV cache (rolled back on failure)."""
        batch.validate()
        if batch.tree_depths is not None and self.tp is not None:
            raise ForwardBatchError("tree_depths: a tree verify is not available with tensor parallelism (top_k 1)")
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
        driver = self.tp.driver if self.tp is not None else None
        if driver is not None:
            driver.check()
        slots = self.lora.prepare_batch(names) if self.lora is not None else [-1] * batch.batch_size
        alloc = self.kv.allocate(list(batch.request_ids), batch.per_request_tokens())
        if driver is not None:
            return self._forward_driver(driver, batch, slots, alloc, aux_layers)
        try:
            if self.graphs is not None and self.graphs.can_run(batch, slots, alloc):
                return self.graphs.run(batch, slots, alloc)
            return self._forward_eager(batch, slots, alloc, aux_layers)
        except BaseException:
            self.kv.rollback(alloc)
            raise

    def _forward_driver(
        self, driver, batch: ForwardBatch, slots: list[int], alloc: Allocation, aux_layers: tuple[int, ...]
    ) -> ForwardOutput:
        """Rank 0: describe the batch to the other ranks, then run it with them."""
        with driver.forward_scope():
            try:
                driver.publish(batch, slots, alloc, free_tokens=self.kv.num_unused_tokens)
            except BaseException:
                self.kv.rollback(alloc)
                raise
            try:
                return self._run(batch, slots, alloc, aux_layers)
            except BaseException as exc:
                self.kv.rollback(alloc)
                # The others are inside this forward's collectives: the group cannot recover.
                raise driver.fail(
                    f"a forward failed on rank 0 after the other ranks joined it (when a rank exited, its log "
                    f"says why): {exc!r}"
                ) from exc

    @torch.inference_mode()
    def follow(
        self,
        batch: ForwardBatch,
        slots: list[int],
        *,
        expect_free_tokens: int,
        expect_slot_ranks: list[int] | None,
    ) -> ForwardOutput:
        """A follower rank: run the forward rank 0 described (its KV ids and adapter slots).

        Raises :class:`TensorParallelError` when this rank's state disagrees with rank 0's.
        """
        if self.tp is None or self.tp.group.is_driver:
            raise TensorParallelError("follow() is for tensor-parallel ranks other than 0")
        rank = self.tp.group.rank
        try:
            alloc = self.kv.allocate(list(batch.request_ids), batch.per_request_tokens())
        except Exception as exc:
            raise TensorParallelError(f"rank {rank} diverged from rank 0: its KV cache refused the batch: {exc}") from exc
        if self.kv.num_unused_tokens != expect_free_tokens:
            raise TensorParallelError(
                f"rank {rank} diverged from rank 0: {self.kv.num_unused_tokens} KV tokens free, rank 0 has "
                f"{expect_free_tokens}"
            )
        if expect_slot_ranks is not None and self.lora is not None:
            ranks = self.lora.slot_ranks()
            if ranks != expect_slot_ranks:
                raise TensorParallelError(
                    f"rank {rank} diverged from rank 0: adapter slot ranks {ranks}, rank 0 has {expect_slot_ranks}"
                )
        aux_layers = tuple(int(i) for i in batch.hidden_layers or ())
        return self._run(batch, list(slots), alloc, aux_layers)

    def _run(
        self, batch: ForwardBatch, slots: list[int], alloc: Allocation, aux_layers: tuple[int, ...]
    ) -> ForwardOutput:
        if self.graphs is not None and self.graphs.can_run(batch, slots, alloc):
            return self.graphs.run(batch, slots, alloc)
        return self._forward_eager(batch, slots, alloc, aux_layers)

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
            # Bucketed like the graphs' contexts: eager shapes then repeat, so every
            # shape-keyed choice below (GEMM heuristics, attention plans) is reused.
            max_ctx=context_bucket(max(alloc.seq_lens), self.kv.max_context_len),
            groups=self.attn_groups,
            q_lens=(torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True) if mode is ForwardMode.EXTEND else None),
            sliding_window=self.arch.sliding_window,
            backend=self.attention_backend,
            tree_depths=None if batch.tree_depths is None else batch.tree_depths.to(device, non_blocking=True),
            tree_ancestors=None if batch.tree_ancestors is None else batch.tree_ancestors.to(device, non_blocking=True),
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


def prefix_cache_enabled(config: RuntimeConfig, *, is_draft: bool, adapters: bool = False) -> bool:
    """Whether this runner's KV pool keeps a prefix cache (``scheduler.prefix_cache``).

    The target's always; a STANDALONE draft's only without draft adapters (its KV then
    depends on the tokens alone, one key for every request; with draft adapters it
    prefills each prompt whole on its own, see ``loraserve.runtime.speculative.standalone``).
    """
    if is_draft and adapters:
        return False
    return bool(getattr(config.scheduler, "prefix_cache", False))


def _tensor_parallel_context(config: RuntimeConfig, is_draft: bool) -> tp_context.TPContext | None:
    """The group a target runner shards over (None: one device, or a draft)."""
    size = int(config.parallel.tensor_parallel_size)
    if is_draft or size <= 1:
        return None  # a draft is small: it runs whole, on rank 0 only
    ctx = tp_context.current()
    if ctx is None:
        raise TensorParallelConfigError(
            f"parallel.tensor_parallel_size={size} needs one process per GPU: start the runtime with "
            "loraserve-runtime (its launcher starts them) or call "
            "loraserve.runtime.executor.launch.start_tensor_parallel(config) before building the runner"
        )
    if ctx.group.size != size:
        raise TensorParallelConfigError(
            f"parallel.tensor_parallel_size={size} but this process's group has {ctx.group.size} ranks: "
            "build every runner of a process from the configuration its group was started with"
        )
    return ctx


def _fingerprint(config: RuntimeConfig, random_weights: bool) -> int:
    """A checksum of what a tensor-parallel rank's runner is built from."""
    text = json.dumps([config.to_dict(), bool(random_weights)], sort_keys=True, default=str)
    return zlib.crc32(text.encode())
