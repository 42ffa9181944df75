"""A DFLASH serve that leaves ``numDraftTokens`` out verifies the draft checkpoint's block
(``dflash_config.block_size``), as the reference engine defaults it; chains keep
``numSteps + 1``. The default is stated once (``contract.config.default_draft_tokens``) and
reaches every layer: the mutating webhook leaves the field unset, the operator writes no
``--num-draft-tokens`` on the pod's command line, and the runtime's start-up reads the
block from the checkpoint (a real ``loraserve-runtime --check-config`` process here)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraserve.operator.desired import runtime_args
from loraserve.operator.specs import parse_loraserve_spec
from loraserve.operator.translate import effective_status, to_runtime_config
from loraserve.operator.webhooks import derived_defaults
from loraserve.runtime.cli import build_parser, config_from_args
from loraserve.runtime.contract import policy
from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.dev.dflash_builder import build_dflash_draft
from loraserve.runtime.model.arch import ModelConfigError
from loraserve.runtime.speculative.dflash.format import UNSTATED_BLOCK, load_dflash_config


@pytest.fixture(scope="module")
def blocks(spec_assets, tmp_path_factory) -> dict[str, Path]:
    """DFLASH drafts for the tiny target trained on a block of 6, and one that states no block."""
    root = tmp_path_factory.mktemp("dflash-blocks")
    return {
        "six": build_dflash_draft(root / "six", spec_assets.target, target_layer_ids=[1], block_size=6),
        "unstated": build_dflash_draft(root / "unstated", spec_assets.target, target_layer_ids=[1], block_size=None),
    }  # fmt: skip


def _runtime(argv: list[str]) -> RuntimeConfig:
    return config_from_args(build_parser().parse_args(argv), env={})


def _dflash_argv(spec_assets, draft: Path, *extra: str) -> list[str]:
    return ["--model", str(spec_assets.target), "--device", "cpu", "--speculative-algorithm", "DFLASH",
            "--draft-model", str(draft), *extra]  # fmt: skip


def _serve(**speculative) -> dict:
    return {
        "model": {"source": "pvc://models/llama"},
        "speculative": {"algorithm": "DFLASH", "draftModel": {"source": "pvc://models/dflash"}, **speculative},
        "storage": {"models": {"type": "PersistentVolumeClaim", "claimName": "models", "mountPath": "/models"}},
    }


def test_runtime_takes_checkpoint_block(spec_assets, blocks, tmp_path):
    """The runtime takes the checkpoints block when none is given."""
    assert _runtime(_dflash_argv(spec_assets, blocks["six"])).speculative.num_draft_tokens == 6
    given = _runtime(_dflash_argv(spec_assets, blocks["six"], "--num-draft-tokens", "3"))
    assert given.speculative.num_draft_tokens == 3  # a smaller block than trained, as the user asked
    # z-lab's Qwen3 checkpoints state the block at the top level only (``"block_size": 16``).
    top_level = tmp_path / "top-level"
    top_level.mkdir()
    raw = json.loads((blocks["six"] / "config.json").read_text())
    del raw["dflash_config"]["block_size"]
    (top_level / "config.json").write_text(json.dumps({**raw, "block_size": 16}))
    assert _runtime(_dflash_argv(spec_assets, top_level)).speculative.num_draft_tokens == 16
    eagle = _runtime(["--model", str(spec_assets.target), "--speculative-algorithm", "EAGLE",
                      "--draft-model", str(spec_assets.eagle), "--num-steps", "2"])  # fmt: skip
    assert eagle.speculative.num_draft_tokens == 3  # a chain: num_steps + 1


def test_no_block_uses_default(spec_assets, blocks, caplog):
    """A draft stating no block verifies the references default and says so."""
    with caplog.at_level(logging.WARNING, logger="loraserve.runtime"):
        config = _runtime(_dflash_argv(spec_assets, blocks["unstated"], "--num-steps", "4"))
    assert config.speculative.num_draft_tokens == UNSTATED_BLOCK == 16  # the reference engine's, not num_steps + 1
    assert "states no block_size" in caplog.text and "--num-draft-tokens" in caplog.text
    # A directory without config.json is the start-up checks' to name; parsing does not fail on it.
    missing = _runtime(_dflash_argv(spec_assets, blocks["six"].parent / "nothing-here"))
    assert missing.speculative.num_draft_tokens == UNSTATED_BLOCK



@pytest.mark.parametrize("bad", ["16", 0, -4, True, 2.5])
def test_malformed_block_size_named(spec_assets, blocks, tmp_path, bad):
    """A malformed block size parses and the draft loader names it."""
    draft = tmp_path / "bad"
    draft.mkdir()
    raw = json.loads((blocks["six"] / "config.json").read_text())
    raw["dflash_config"]["block_size"] = bad
    (draft / "config.json").write_text(json.dumps(raw))
    assert _runtime(_dflash_argv(spec_assets, draft)).speculative.num_draft_tokens == UNSTATED_BLOCK
    with pytest.raises(ModelConfigError, match=r"dflash_config\.block_size must be a positive integer"):
        load_dflash_config(draft, target_num_layers=3)


def test_operator_leaves_block_to_pod(spec_assets, blocks):
    """The operator leaves the block to the pod and the pod reads it."""
    spec = parse_loraserve_spec(_serve())
    assert derived_defaults(_serve()) == {"model": {"servedName": "llama"}}  # no numDraftTokens filled in
    config = to_runtime_config(spec)
    assert config.speculative.num_draft_tokens is None
    report = policy.check_config(config)
    assert not report.violations, [v.render() for v in report.violations]
    assert effective_status(report).num_draft_tokens is None  # the pod's start-up decides it
    argv = runtime_args(config)
    assert "--num-draft-tokens" not in argv
    # The pod: the same command line, its claim mounted where the checkpoint is.
    pod = [str(blocks["six"]) if word == "/models/dflash" else word for word in argv]
    pod = [str(spec_assets.target) if word == "/models/llama" else word for word in pod]
    assert _runtime(pod).speculative.num_draft_tokens == 6
    # A block the serve states is written, and kept.
    stated = to_runtime_config(parse_loraserve_spec(_serve(numDraftTokens=5)))
    assert runtime_args(stated)[runtime_args(stated).index("--num-draft-tokens") + 1] == "5"
    assert derived_defaults(_serve(numDraftTokens=5)) == {"model": {"servedName": "llama"}}


def test_blockless_tree_refused(spec_assets):
    """A DFlash tree without a block is refused as a tree."""
    config = to_runtime_config(parse_loraserve_spec(_serve(topK=2, numSteps=2)))
    assert config.speculative.num_draft_tokens is None
    report = policy.check_config(config)
    rules = {v.rule for v in report.violations}
    assert "tree-algorithm" in rules and "tree-draft-tokens" not in rules
    # nor warned of as a costly tree: it is no tree (the warning would print the unset width)
    assert "tree-large-batches" not in report.warning_rules()


@pytest.mark.slow
def test_check_config_shows_block(spec_assets, blocks):
    """Check config of a real process shows the checkpoints block."""
    proc = subprocess.run(
        [sys.executable, "-m", "loraserve.runtime", *_dflash_argv(spec_assets, blocks["six"]), "--check-config"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["speculative"]["num_draft_tokens"] == 6
