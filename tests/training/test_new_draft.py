"""``loraserve-distill-draft --new eagle|dflash``: a new draft trained over a target from a
corpus, written as the runtime reads one (that the trainers learn is tested beside them)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from loraserve.runtime.dev.devmodels import build_tiny_model
from loraserve.runtime.speculative.dflash.format import dflash_config_from_dict
from loraserve.runtime.speculative.eagle.format import eagle_config_from_dict
from loraserve.runtime.tools import distill_draft


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("new")
    target = build_tiny_model(root / "target", seed=0, initializer_range=0.2)
    corpus = root / "corpus.txt"  # Python source: the text the tiny tokenizer was trained on
    corpus.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8"))
    return target, corpus


def _new(inputs, out: Path, kind: str, steps: int, capsys) -> dict:
    target, corpus = inputs
    argv = ["--new", kind, "--target", str(target), "--corpus", str(corpus), "--out", str(out), "--steps",
            str(steps), "--seq-len", "32", "--batch-size", "8", "--lr", "3e-3", "--device", "cpu", "--quiet"]  # fmt: skip
    assert distill_draft.main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_eagle(inputs, tmp_path, capsys):
    info = _new(inputs, tmp_path / "e", "eagle", 3, capsys)
    raw = json.loads((tmp_path / "e" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle"] and (tmp_path / "e" / "model.safetensors").is_file()
    assert eagle_config_from_dict(raw).tensor_shapes()  # the runtime's reading of it
    assert info["steps"] == 3 and len(info["heldout_top1"]) == 2


def test_dflash(inputs, tmp_path, capsys):
    info = _new(inputs, tmp_path / "d", "dflash", 3, capsys)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    config = dflash_config_from_dict(raw, target_num_layers=raw["num_target_layers"])
    assert raw["architectures"] == ["DFlashDraftModel"] and config.tensor_shapes()
    assert info["steps"] == 3 and "heldout_walk_mean" in info


def test_refusals(inputs, tmp_path, capsys):
    target, corpus = inputs
    base = ["--target", str(target), "--corpus", str(corpus), "--out", str(tmp_path / "x")]
    assert distill_draft.main([*base, "--new", "eagle", "--adapter", str(target)]) == 2
    assert "leave --adapter and --draft out" in capsys.readouterr().err
    assert distill_draft.main(base) == 2
    assert "--adapter and --draft required" in capsys.readouterr().err
    assert distill_draft.main([*base, "--new", "eagle", "--seq-len", "4"]) == 2
    assert "--seq-len must be at least 10" in capsys.readouterr().err
