"""Rules on where weights come from: an ``hf://`` source pinned to a commit, a volume path
that stays inside its volume, a download host on the allowed list."""

from __future__ import annotations

import re
from collections.abc import Iterable

from .cel import CelRule
from .findings import PolicyWarning

_HF_COMMIT = re.compile(r"[0-9a-f]{40}")


def check_source_revision(
    field: str,
    source: str | None,
    *,
    revision: str | None = None,
    sha256: str | None = None,
    revision_field: str | None = None,
) -> PolicyWarning | None:
    """A warning for an ``hf://`` source that is not pinned to a commit: without
    ``@<revision>`` (or a separate ``revision``) it follows the repository's main branch, so
    a new pod, a restart or a reload may fetch other weights than the running ones; a branch
    or tag can move too. None for other schemes and for a commit sha."""
    if not source or not source.startswith("hf://"):
        return None
    repo, _, pinned = source.partition("@")
    rev = pinned or revision
    if rev and _HF_COMMIT.fullmatch(rev):
        return None
    if not rev:
        effect = (
            "a change there makes the sha256 check fail, so new pods stop loading it"
            if sha256
            else "a new pod, a restart or a reload may fetch other weights than the running ones"
        )
        return PolicyWarning(
            "source-floating-revision",
            field,
            f"{source} names no revision, so it follows the repository's main branch: {effect}; "
            f"pin a commit: {repo}@<40-character commit sha>",
        )
    if not pinned and revision_field:
        return PolicyWarning(
            "source-floating-revision",
            revision_field,
            f"{rev!r} is a branch or tag, which can move: set it to a 40-character commit sha",
        )
    return PolicyWarning(
        "source-floating-revision",
        field,
        f"{source if pinned else f'{source} at revision {rev}'}: {rev!r} is a branch or tag, which can move; "
        f"pin a commit: {repo}@<40-character commit sha>",
    )


def source_path_problem(source: str | None) -> str | None:
    """Why a ``pvc://<claim>/<path>`` or absolute-path source would leave its volume, else None.

    The path after ``pvc://<claim>/`` must be relative and plain: no ``..`` segment, no
    empty segment (``//``) and no leading ``/`` (joined onto a mount path, an absolute tail
    replaces the mount). An absolute path may hold no ``..`` segment. One rule for the CRD
    (CEL), the webhook, the operator's path mapping and the runtime.
    """
    if not source:
        return None
    if source.startswith("pvc://"):
        claim, _, tail = source[len("pvc://") :].partition("/")
        segments = (tail[:-1] if tail.endswith("/") else tail).split("/")
        if tail.startswith("/"):
            why = "an absolute path after the claim"
        elif "" in segments:
            why = "an empty path segment ('//')"
        elif ".." in segments:
            why = "a '..' segment"
        else:
            return None
        return (
            f"{source!r} leaves the claim's mount ({why}); fix: write pvc://{claim or '<claim>'}/<relative path> "
            "with no '..', '//' or leading '/'"
        )
    if source.startswith("/") and ".." in source.split("/"):
        return f"{source!r} has a '..' segment; fix: write the absolute path without '..'"
    return None


INSIDE_VOLUME = CelRule(
    "!self.matches('^(pvc://[^/]*)?/(.*/)?[.][.](/.*)?$') && "
    "(!self.startsWith('pvc://') || self.matches('^pvc://[^/]*/[^/]+(/[^/]+)*/?$'))",
    "must stay inside its volume: no '..' segments, and after pvc://<claim>/ a relative path with no "
    "empty segments ('//'); write pvc://<claim>/<relative path>",
    check=source_path_problem,
)
""":func:`source_path_problem` in CEL (RE2), on every source field of the CRDs."""


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether ``host`` is one of ``allowed`` (``*.example.com``: any subdomain of example.com,
    not example.com itself); case and a trailing dot do not matter."""
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if entry.startswith("*.") and host.endswith(entry[1:]) and len(host) > len(entry) - 1:
            return True
        if host == entry:
            return True
    return False
