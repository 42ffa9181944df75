"""Desired vs observed: decide whether an owned object must be written, and what to send.

The API server fills defaults into what it stores (``imagePullPolicy``, ``protocol``,
``dnsPolicy``...), so an observed object is never equal to the desired one. Two checks
decide instead, both pure:

* every field the operator sets has the same value in the observed object (drift, such as
  a hand edit, is undone), and
* the observed object carries the hash of the desired one in an annotation (a field the
  operator used to set and no longer does is removed, which the first check cannot see).

The write is a merge patch that sets the desired owned fields and nulls whatever the
observed object holds under them that the desired one does not, guarded by the observed
``resourceVersion`` so a concurrent writer makes it fail with 409 instead of being lost.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

DESIRED_HASH_ANNOTATION = "loraserve.io/desired-hash"


def stable_hash(value: object, length: int = 16) -> str:
    """A short sha256 of a JSON-able value, independent of dict ordering."""
    raw = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:length]


def contains(observed: object, desired: object) -> bool:
    """Whether ``observed`` holds every field of ``desired`` with the same value.

    Dicts may carry extra keys (server defaults); lists must have the same length and each
    item must contain the desired item (defaults are filled inside list items too).
    """
    if isinstance(desired, Mapping):
        if not isinstance(observed, Mapping):
            return False
        return all(key in observed and contains(observed[key], value) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(observed, list) or len(observed) != len(desired):
            return False
        return all(contains(o, d) for o, d in zip(observed, desired, strict=True))
    if isinstance(desired, bool) or isinstance(observed, bool):
        return observed is desired
    if isinstance(desired, (int, float)) and isinstance(observed, (int, float)):
        return observed == desired
    return observed == desired


def replace_patch(observed: object, desired: object) -> Any:
    """A merge-patch value that turns ``observed`` into exactly ``desired``.

    Dict keys the observed value has and the desired lacks are set to None (removed); lists
    and scalars are replaced whole, as merge patch always does with them.
    """
    if isinstance(desired, Mapping) and isinstance(observed, Mapping):
        patch: dict[str, Any] = {}
        for key, value in desired.items():
            patch[key] = replace_patch(observed.get(key), value) if key in observed else value
        for key in observed:
            if key not in desired:
                patch[key] = None
        return patch
    return desired


def with_desired_hash(obj: dict) -> dict:
    """Return ``obj`` with the desired-hash annotation over everything but that annotation."""
    body = json.loads(json.dumps(obj))
    annotations = body.setdefault("metadata", {}).setdefault("annotations", {})
    annotations.pop(DESIRED_HASH_ANNOTATION, None)
    annotations[DESIRED_HASH_ANNOTATION] = stable_hash(body)
    return body


def needs_update(observed: Mapping, desired: Mapping, owned: tuple[str, ...]) -> bool:
    """Whether ``observed`` differs from ``desired`` on the fields the operator owns."""
    want = desired.get("metadata", {}).get("annotations", {}).get(DESIRED_HASH_ANNOTATION)
    have = (observed.get("metadata") or {}).get("annotations", {}) or {}
    if want is not None and have.get(DESIRED_HASH_ANNOTATION) != want:
        return True
    meta_o = observed.get("metadata") or {}
    meta_d = desired.get("metadata") or {}
    if not contains(meta_o.get("labels") or {}, meta_d.get("labels") or {}):
        return True
    if not contains(meta_o.get("annotations") or {}, meta_d.get("annotations") or {}):
        return True
    if not _has_owner_refs(meta_o.get("ownerReferences") or [], meta_d.get("ownerReferences") or []):
        return True
    # A desired None means "unset": the server may default it, and the hash covers its removal.
    return any(
        not contains(_get(observed, path), _get(desired, path))
        for path in owned
        if _get(desired, path) is not None
    )


def update_patch(observed: Mapping, desired: Mapping, owned: tuple[str, ...]) -> dict:
    """The merge patch that brings the owned fields of ``observed`` to ``desired``.

    ``owned`` lists dotted paths (``spec.template``, ``spec.replicas``) replaced exactly;
    labels and annotations are merged (others' keys stay); owner references are replaced by
    the observed ones plus any desired one missing (others' references stay).
    """
    meta_o = observed.get("metadata") or {}
    meta_d = desired.get("metadata") or {}
    refs = list(meta_o.get("ownerReferences") or [])
    for ref in meta_d.get("ownerReferences") or []:
        if not any(r.get("uid") == ref.get("uid") and r.get("kind") == ref.get("kind") for r in refs):
            refs = [
                r for r in refs if not (r.get("kind") == ref.get("kind") and r.get("name") == ref.get("name"))
            ]
            refs.append(ref)
    metadata: dict[str, Any] = {
        "labels": dict(meta_d.get("labels") or {}),
        "annotations": dict(meta_d.get("annotations") or {}),
        "ownerReferences": refs,
    }
    if meta_o.get("resourceVersion"):
        metadata["resourceVersion"] = meta_o["resourceVersion"]
    patch: dict[str, Any] = {"metadata": metadata}
    for path in owned:
        keys = path.split(".")
        node = patch
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = replace_patch(_get(observed, path), _get(desired, path))
    return patch


def _get(obj: Mapping, path: str) -> Any:
    node: Any = obj
    for key in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def _has_owner_refs(observed: list, desired: list) -> bool:
    return all(
        any(
            o.get("kind") == d.get("kind") and o.get("name") == d.get("name") and o.get("uid") == d.get("uid")
            for o in observed
        )
        for d in desired
    )
