"""The three decoders every request kind is timed with, over one serving runner.

- ``plain``: no speculation (the baseline of every speedup).
- ``shared``: speculation with the draft (``--draft``: STANDALONE, or an EAGLE chain of k
  as ``bench/speculative`` serves its head) unadapted for every request: the production
  default without draft adapters (no draft pool: the draft runs no LoRA kernels).
- ``adapted``: the same draft with its own adapter pool (``speculative.draft_max_loras``)
  holding each task adapter's draft adapter under the task adapter's name, as the engine's
  ``load_draft_adapter`` loads them: a request of a task adapter drafts with its draft
  adapter, a base request drafts unadapted in the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.engine.decoder import StandardDecoder
from loraserve.runtime.sampling import Sampler
from loraserve.runtime.speculative import build_decoder

from ..speculative.decoders import spec_config
from ..speculative.serving import Serving
from ..speculative.settings import Settings

SPEC_RUNS = ("shared", "adapted")


@dataclass
class Decoders:
    """The plain decoder, and per speculative run its configuration and decoder."""

    plain: StandardDecoder
    configs: dict[str, RuntimeConfig]
    spec: dict  # "shared" / "adapted" -> speculative decoder


def build_decoders(
    s: Settings, serving: Serving, draft_dir: Path | None, draft_adapters: dict[str, Path], rank: int,
    draft: str = "standalone",
) -> Decoders:  # fmt: skip
    """The plain, shared-draft and draft-adapter decoders; the draft adapters (as served:
    ``serving.served_draft_adapters``) loaded. ``draft``: ``standalone`` (``draft_dir``) or
    ``eagle`` (``serving.head_dir``)."""
    sampler = Sampler(0)
    shared = spec_config(s, serving, draft_dir, draft, False, None)
    adapted = shared.copy()
    adapted.speculative.draft_max_loras = max(len(draft_adapters), 1)
    adapted.speculative.draft_max_lora_rank = rank
    configs = {"shared": shared, "adapted": adapted}
    spec = {
        name: build_decoder(config=cfg, runner=serving.runner, sampler=sampler)
        for name, cfg in configs.items()
    }
    pool = spec["adapted"].drafter.lora
    for name, path in draft_adapters.items():
        pool.load(name, path)  # what Engine.load_draft_adapter does, without an engine running
    return Decoders(StandardDecoder(serving.runner, sampler), configs, spec)
