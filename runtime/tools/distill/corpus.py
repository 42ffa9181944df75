"""The distillation corpus: plain UTF-8 text files, tokenized with the target's tokenizer,
packed into fixed-length sequences, with a held-out slice for the before/after report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

HELD_OUT_FRACTION = 0.05
# Files are encoded in pieces of about this many characters, cut at line ends: one call on
# a whole multi-megabyte file would hold every intermediate of the fast tokenizer at once.
_PIECE_CHARS = 100_000


class CorpusError(ValueError):
    """A corpus path or its text cannot be used; the message says which and what to do."""


@dataclass
class Corpus:
    """Packed token sequences: ``train`` and ``held_out`` are ``[n, seq_len]`` int64."""

    train: torch.Tensor
    held_out: torch.Tensor
    files: int
    tokens: int  # tokens read (the packed ones plus the dropped remainder)

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1])


def check_corpus_paths(paths: Sequence[str | Path]) -> list[Path]:
    """The corpus files, each an existing regular file; anything else is refused by name."""
    if not paths:
        raise CorpusError("no corpus files given: pass --corpus FILE [FILE ...] (plain UTF-8 text)")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            raise CorpusError(
                f"corpus path {str(path)!r} is a directory: give the text files themselves "
                f"(e.g. --corpus {path}/*.txt)"
            )
        if not path.is_file():
            raise CorpusError(f"corpus file {str(path)!r} does not exist (or is not a regular file)")
        files.append(path)
    return files


def read_text(path: Path) -> str:
    """A file's text; refuses bytes that are not UTF-8 rather than train on mojibake."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(
            f"corpus file {str(path)!r} is not UTF-8 text (byte {exc.start}): convert it "
            "(e.g. iconv -t UTF-8) or leave it out"
        ) from exc


def _pieces(text: str, size: int = _PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters at line ends (concatenating to it)."""
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            newline = text.rfind("\n", start, end)
            end = newline + 1 if newline > start else end
        pieces.append(text[start:end])
        start = end
    return pieces


def encode_document(tokenizer, text: str) -> list[int]:
    """One document's ids: the tokenizer's BOS (if it has one), then the text, no other specials."""
    ids: list[int] = [] if tokenizer.bos_token_id is None else [int(tokenizer.bos_token_id)]
    pieces = _pieces(text)
    if pieces:
        for piece_ids in tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"]:
            ids.extend(piece_ids)
    return ids


def pack(documents: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """Documents concatenated and cut into ``[n, seq_len]`` rows; the remainder is dropped."""
    flat = torch.tensor([t for doc in documents for t in doc], dtype=torch.int64)
    n = flat.numel() // seq_len
    return flat[: n * seq_len].view(n, seq_len)


def split_held_out(
    sequences: torch.Tensor, fraction: float = HELD_OUT_FRACTION, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held_out)``: a seeded random ``fraction`` of the rows (at least one) held out.

    Rows are chosen at random rather than the tail, so a corpus of several files is
    represented in both parts."""
    n = sequences.shape[0]
    held = max(1, round(n * fraction))
    if n - held < 1:
        raise CorpusError(
            f"the corpus makes {n} sequence(s) of {sequences.shape[1]} tokens; at least 2 are needed "
            "(one is held out to measure the draft): give more text or a smaller --seq-len"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return sequences[order[held:]], sequences[order[:held]]


def load_corpus(paths: Sequence[str | Path], tokenizer, seq_len: int, *, seed: int = 0) -> Corpus:
    """Check, read, tokenize, pack and split the corpus files."""
    if seq_len < 2:
        raise CorpusError(f"--seq-len must be at least 2, got {seq_len}")
    files = check_corpus_paths(paths)
    documents = [encode_document(tokenizer, read_text(path)) for path in files]
    tokens = sum(len(doc) for doc in documents)
    sequences = pack(documents, seq_len)
    train, held_out = split_held_out(sequences, seed=seed)
    return Corpus(train=train, held_out=held_out, files=len(files), tokens=tokens)


@torch.no_grad()
def teacher_sequences(
    model,
    data: torch.Tensor,
    device: torch.device,
    *,
    count: int,
    prompt_len: int,
    new_tokens: int,
    seed: int,
) -> torch.Tensor:
    """Greedy continuations by ``model`` of random windows of ``data``, ``[count, prompt+new]``.

    ``data`` must not hold the text the draft is judged on.
    """
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - prompt_len - 1, (count,), generator=gen)
    prompts = data[starts[:, None] + torch.arange(prompt_len)[None, :]].to(device)
    chunks = []
    # large batches on a GPU: generation of a small model is bound by per-step latency, and
    # 4,096 continuations' KV (~7 GiB for the small target) fits beside the model
    for part in prompts.split(4096 if device.type == "cuda" else 512):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model.generate(
                input_ids=part,
                attention_mask=torch.ones_like(part),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        chunks.append(out[:, : prompt_len + new_tokens])
    return torch.cat(chunks)


def sample_windows(
    data: torch.Tensor, teacher_data: torch.Tensor | None, gen: torch.Generator, *, count: int, n_teacher: int,
    seq: int,
) -> torch.Tensor:  # fmt: skip
    """``[count, seq + 1]`` training windows on ``data``'s device: ``count - n_teacher`` at
    random offsets of the token stream ``data``, then ``n_teacher`` random rows of
    ``teacher_data`` (the target's own continuations), cut to ``seq + 1``. Every trainer's batch."""
    device = data.device
    starts = torch.randint(0, data.numel() - seq - 1, (count - n_teacher,), generator=gen)
    window = data[(starts[:, None] + torch.arange(seq + 1)[None, :]).to(device)]
    if n_teacher:
        rows = torch.randint(0, teacher_data.shape[0], (n_teacher,), generator=gen)
        window = torch.cat([window, teacher_data[rows.to(teacher_data.device)][:, : seq + 1].to(device)])
    return window
