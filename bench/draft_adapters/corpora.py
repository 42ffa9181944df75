"""The task corpora the adapters train on: sources unlike the target's own (the standard
library's Python), each a different kind of text found in packages every run has installed.

Each corpus is split by file: most files train the task adapter (and its draft adapter's
distillation), a few are held out and give that adapter's requests their prompts and the
measure of how far the adapter moved the target.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..speculative.corpus import tokenize


def _package_root(name: str) -> Path | None:
    """The installed package ``name``'s folder, or None when it is not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _cpp_headers() -> list[Path]:
    """C++: the headers torch ships (ATen, c10, torch's C++ API): another language."""
    root = _package_root("torch")
    return [] if root is None else sorted((root / "include").rglob("*.h"))


def _transformers_models() -> list[Path]:
    """Deep-learning model code: transformers' ``modeling_*.py``, a narrow house style."""
    root = _package_root("transformers")
    return [] if root is None else sorted((root / "models").rglob("modeling_*.py"))


def _sympy_modules() -> list[Path]:
    """Symbolic mathematics in Python: sympy's modules (its tests left out)."""
    root = _package_root("sympy")
    if root is None:
        return []
    return sorted(p for p in root.rglob("*.py") if "tests" not in p.parts and "benchmarks" not in p.parts)


def _type_stubs() -> list[Path]:
    """Type stubs: torch's ``.pyi`` files, signatures without bodies."""
    root = _package_root("torch")
    return [] if root is None else sorted(root.rglob("*.pyi"))


@dataclass(frozen=True)
class Source:
    """Where a task corpus comes from."""

    describe: str
    files: Callable[[], list[Path]]


SOURCES: dict[str, Source] = {
    "cpp": Source("C++ headers of torch (torch/include)", _cpp_headers),
    "transformers": Source("transformers' modeling_*.py", _transformers_models),
    "sympy": Source("sympy's modules", _sympy_modules),
    "stubs": Source("torch's .pyi type stubs", _type_stubs),
}


@dataclass
class TaskCorpus:
    """One adapter's text: training tokens and files, held-out tokens, the distillation file."""

    name: str
    describe: str
    train_files: list[Path]
    held_files: list[Path]
    train_ids: torch.Tensor
    held_ids: torch.Tensor
    text_file: Path  # a slice of the training files' text in one UTF-8 file: for the draft adapter

    def info(self) -> dict:
        """What the report says of the corpus."""
        return {
            "source": self.describe,
            "train_files": len(self.train_files),
            "train_tokens": self.train_ids.numel(),
            "held_files": len(self.held_files),
            "held_tokens": self.held_ids.numel(),
        }


def split_files(files: list[Path], train_bytes: int, held_bytes: int) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): files spread over the whole package (every n-th, so
    no one folder dominates), one in ten held out until ``held_bytes``, the others trained on
    until ``train_bytes``. Files under 1 kB (stubs of stubs, ``__init__`` lines) are skipped."""
    usable = [p for p in files if p.stat().st_size >= 1000]
    total = sum(p.stat().st_size for p in usable)
    stride = max(1, int(total // max(train_bytes + held_bytes, 1)))
    train, held, t_bytes, h_bytes = [], [], 0, 0
    for i, path in enumerate(usable[::stride] + [p for j, p in enumerate(usable) if j % stride]):
        size = path.stat().st_size
        if i % 10 == 5 and h_bytes < held_bytes:
            held.append(path)
            h_bytes += size
        elif t_bytes < train_bytes:
            train.append(path)
            t_bytes += size
        if t_bytes >= train_bytes and h_bytes >= held_bytes:
            break
    return train, held


def load_task_corpus(
    name: str, tokenizer_dir: Path, work: Path, *, train_bytes: int, held_bytes: int, distill_bytes: int
) -> TaskCorpus:
    """Task corpus ``name`` (a key of :data:`SOURCES`), tokenized with the local tokenizer;
    the first ``distill_bytes`` characters of its training files' text written out for the
    draft adapter's distillation."""
    source = SOURCES[name]
    train_files, held_files = split_files(source.files(), train_bytes, held_bytes)
    if not train_files or not held_files:
        raise SystemExit(
            f"--adapters {name}: {source.describe} found no files to train on here; choose others of {list(SOURCES)}"
        )
    text_file = work / f"corpus-{name}.txt"
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in train_files)
    text_file.write_text(text[:distill_bytes], encoding="utf-8")
    return TaskCorpus(
        name, source.describe, train_files, held_files,
        tokenize(tokenizer_dir, train_files), tokenize(tokenizer_dir, held_files), text_file,
    )  # fmt: skip
