"""The decoders a run times: the plain one, and one speculative decoder per timed draft run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraserve.runtime.contract.config import RuntimeConfig, SpecAlgorithm
from loraserve.runtime.engine.decoder import StandardDecoder
from loraserve.runtime.sampling import Sampler
from loraserve.runtime.speculative import build_decoder

from .serving import Serving
from .settings import Settings


@dataclass
class Decoders:
    """Per speculative run name: its runtime configuration and decoder; and the plain decoder."""

    sampler: Sampler
    plain: StandardDecoder
    configs: dict[str, RuntimeConfig]
    spec: dict  # name -> speculative decoder

    def order(self) -> list[str]:
        """EAGLE first at every level: under ``--deadline-s`` a later draft's run is the one skipped."""
        return sorted(self.spec, key=lambda name: (not name.startswith("eagle"), name))


def spec_runs(s: Settings) -> list[tuple[str, str, bool, tuple[int, int] | None]]:
    """(run name, draft, auto_disable, tree shape) of every speculative run: each draft, each
    draft again with the auto-disable switch (``--auto-disable-ab``), each ``--tree`` shape (and,
    with ``--auto-disable-ab``, the switch choosing per batch bucket among that tree, a chain and
    no drafting)."""
    args = s.args
    runs = [(name, name, args.auto_disable, None) for name in s.drafts]
    if args.auto_disable_ab:
        runs += [(f"{name}+auto", name, True, None) for name in s.drafts if not args.auto_disable]
    for top, tokens in s.trees:
        runs.append((f"eagle-t{top}-n{tokens}", "eagle", args.auto_disable, (top, tokens)))
        if args.auto_disable_ab and not args.auto_disable:
            # The switch over this tree: each batch bucket picks tree, chain or no drafting.
            runs.append((f"eagle-t{top}-n{tokens}+auto", "eagle", True, (top, tokens)))
    return runs


def build_decoders(s: Settings, serving: Serving, draft_dir: Path | None) -> Decoders:
    """A decoder per :func:`spec_runs` entry over the serving runner, and the plain one."""
    sampler = Sampler(0)
    configs, spec = {}, {}
    for name, draft, auto, tree in spec_runs(s):
        configs[name] = spec_config(s, serving, draft_dir, draft, auto, tree)
        spec[name] = build_decoder(config=configs[name], runner=serving.runner, sampler=sampler)
    return Decoders(sampler, StandardDecoder(serving.runner, sampler), configs, spec)


def spec_config(
    s: Settings,
    serving: Serving,
    draft_dir: Path | None,
    draft: str,
    auto: bool,
    tree: tuple[int, int] | None,
) -> RuntimeConfig:
    """The serving configuration with speculation by ``draft`` (a chain of ``s.k``, or ``tree``)."""
    config = serving.config.copy()
    spec = config.speculative
    spec.algorithm = {"eagle": SpecAlgorithm.EAGLE, "dflash": SpecAlgorithm.DFLASH}.get(
        draft, SpecAlgorithm.STANDALONE
    )
    spec.draft_model_path = str(
        {"eagle": serving.head_dir, "dflash": serving.dflash_dir}.get(draft, draft_dir)
    )
    spec.num_steps = s.k - 1
    spec.num_draft_tokens = s.k
    if draft == "dflash":  # one forward drafts the whole block: its width is the block trained on
        spec.num_draft_tokens = s.dflash_block
    if tree is not None:
        spec.top_k, spec.num_draft_tokens = tree
        spec.tree_max_batch_size = s.args.tree_max_batch_size
    spec.disable_batch_size = s.args.disable_batch_size
    spec.auto_disable = auto
    return config
