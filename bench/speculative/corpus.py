"""The training corpus and the prompts: Python sources tokenized with the local tokenizer.

The standard library's own sources train the models; a few of its modules (``HELD_OUT``)
are kept out of every training set and give the benchmark's prompts.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

HELD_OUT = ("difflib.py", "heapq.py", "textwrap.py", "shlex.py", "fractions.py", "bisect.py", "sched.py")


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
    """All ``files`` tokenized with the tokenizer in ``tokenizer_dir``, each followed by ``</s>``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    ids: list[int] = []
    eos = tok.token_to_id("</s>")
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)
