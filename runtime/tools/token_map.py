"""Build a token map for ``speculative.token_map`` (FR-Spec): a corpus's most frequent tokens.

    loraserve-token-map --model MODEL_DIR --size 32768 --out DRAFT_DIR/freq_32768.json CORPUS...

Counts token ids over text files (a directory: its files matching ``--glob``, recursively)
with the target's tokenizer, and writes the ``--size`` most frequent ids as a JSON list,
most frequent first. The model's end-of-sequence and other special tokens are always kept:
a draft that can never propose them could never draft a request's end. It prints the
coverage, the share of the corpus's tokens the map holds: on text like the serve's
traffic, that bounds how often a greedy draft can agree with the target at all. Use a
corpus like the traffic (its own logs, or outputs of the target) rather than generic text.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path


def corpus_files(paths: Sequence[str | Path], pattern: str = "*") -> list[Path]:
    """The files named, and the files below the folders named that match ``pattern``."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob(pattern) if p.is_file()))
        elif path.is_file():
            out.append(path)
        else:
            raise FileNotFoundError(f"corpus path {path} does not exist")
    return out


def count_tokens(encode, texts: Iterable[str]) -> Counter[int]:
    """How often each token id occurs in ``texts`` under ``encode`` (no special tokens added)."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(encode(text))
    return counts


def choose_token_map(counts: Counter[int], size: int, vocab_size: int, keep: Iterable[int] = ()) -> list[int]:
    """At most ``size`` ids: ``keep`` first (those within the vocabulary), then the most
    frequent others (ties by id), most frequent first after the kept ones."""
    if size < 1:
        raise ValueError(f"a token map holds at least one token, got size {size}")
    chosen = list(dict.fromkeys(int(i) for i in keep if 0 <= int(i) < vocab_size))[:size]
    taken = set(chosen)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if token not in taken and 0 <= token < vocab_size:
            chosen.append(token)
            taken.add(token)
    return chosen


def coverage(counts: Counter[int], ids: Iterable[int]) -> float:
    """Share of the counted tokens whose id is in ``ids``."""
    total = sum(counts.values())
    if total == 0:
        return 0.0
    held = set(ids)
    return sum(n for token, n in counts.items() if token in held) / total


def main(argv: list[str] | None = None) -> int:
    """Count, choose and write a token map; prints its size and coverage."""
    ap = argparse.ArgumentParser(prog="loraserve-token-map", description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", nargs="+", help="text files, or folders of them")
    ap.add_argument("--model", required=True, help="the target model's directory (its tokenizer)")
    ap.add_argument("--size", type=int, default=32768, help="tokens in the map (default 32768)")
    ap.add_argument("--out", required=True, help="the .json file to write (a list of token ids)")
    ap.add_argument("--glob", default="*", help="files of a corpus folder to read (default: all)")
    args = ap.parse_args(argv)

    from ..tokenizer import Tokenizer

    tokenizer = Tokenizer.load(args.model)
    files = corpus_files(args.corpus, args.glob)
    if not files:
        print("no corpus files found", file=sys.stderr)
        return 2
    texts = (f.read_text(encoding="utf-8", errors="ignore") for f in files)
    counts = count_tokens(lambda text: tokenizer.encode(text, add_special_tokens=False), texts)
    special = [*tokenizer.eos_token_ids, *getattr(tokenizer.hf, "all_special_ids", [])]
    ids = choose_token_map(counts, args.size, tokenizer.vocab_size, keep=sorted(set(special)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(ids) + "\n")
    print(
        f"{out}: {len(ids)} of {tokenizer.vocab_size} tokens; they hold {coverage(counts, ids):.2%} of the "
        f"{sum(counts.values()):,} tokens of {len(files)} corpus files"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
