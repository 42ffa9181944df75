"""``python -m loraserve.operator.crd [--check] [--root DIR]``: write the CRDs, or check them."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from loraserve.operator.crd import outputs

REPO = Path(__file__).resolve().parents[2]


def check(root: Path) -> list[str]:
    """A unified diff per generated file whose committed text differs (or that is missing)."""
    diffs = []
    for path, text in outputs(root).items():
        committed = path.read_text() if path.exists() else ""
        if committed != text:
            name = str(path.relative_to(root))
            lines = difflib.unified_diff(
                committed.splitlines(keepends=True), text.splitlines(keepends=True), name, f"{name} (generated)"
            )
            diffs.append("".join(lines))
    return diffs


def write(root: Path) -> list[Path]:
    """Write every generated file; the paths whose text changed."""
    changed = []
    for path, text in outputs(root).items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraserve.operator.crd", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff if the files differ")
    parser.add_argument("--root", type=Path, default=REPO, help="the repository root (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        diffs = check(args.root)
        for diff in diffs:
            sys.stdout.write(diff)
        if diffs:
            print("the CRDs differ from loraserve.operator.specs: run `make crds`", file=sys.stderr)
        return 1 if diffs else 0
    for path in write(args.root):
        print(f"wrote {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
