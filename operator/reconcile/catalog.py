"""Keep every ready pod's adapter catalog equal to the serve's (observe, diff, act).

The ConfigMap gives a pod the catalog as it was when the pod started; Adapters created,
changed or deleted later reach running pods here: ``GET /v1/lora_catalog`` on each pod,
and ``PUT`` the serve's catalog where the digest differs. A pod that does not answer is
left for the next pass (a pod event or the resync brings one soon).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from loraserve.runtime.contract.catalog import CatalogEntry, catalog_digest

from ..runtime_client import RuntimeCallError
from .context import OperatorContext
from .pods import PodView

logger = logging.getLogger(__name__)


@dataclass
class CatalogSync:
    """What one pass did: pods already current, pods pushed, pods that failed (and why)."""

    current: list[str] = field(default_factory=list)
    pushed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


async def _sync_pod(
    ctx: OperatorContext, pod: PodView, token: str | None, entries: Sequence[CatalogEntry], digest: str
) -> str:
    runtime = ctx.runtime(pod, token)
    held = await runtime.catalog()
    if held.digest == digest:
        return "current"
    await runtime.put_catalog(entries)
    return "pushed"


async def sync_catalog(
    ctx: OperatorContext, pods: Sequence[PodView], token: str | None, entries: Sequence[CatalogEntry]
) -> CatalogSync:
    """Bring every usable pod's catalog to ``entries``."""
    digest = catalog_digest(entries)
    usable = sorted((p for p in pods if p.usable), key=lambda p: p.name)
    answers = await asyncio.gather(
        *(_sync_pod(ctx, pod, token, entries, digest) for pod in usable), return_exceptions=True
    )
    sync = CatalogSync()
    for pod, answer in zip(usable, answers, strict=True):
        if answer == "current":
            sync.current.append(pod.name)
        elif answer == "pushed":
            sync.pushed.append(pod.name)
        elif isinstance(answer, RuntimeCallError):
            sync.failed[pod.name] = answer.message
        elif isinstance(answer, Exception):
            sync.failed[pod.name] = f"{answer.__class__.__name__}: {answer}"
        else:
            raise answer  # type: ignore[misc]  # cancellation and the like
    if sync.failed:
        logger.info("catalog %s not pushed to %s", digest, sorted(sync.failed))
    return sync


async def pods_still_listing(
    ctx: OperatorContext, pods: Sequence[PodView], token: str | None, name: str
) -> dict[str, str]:
    """Usable pods whose catalog still lists ``name`` (or that did not answer), with why."""
    usable = [p for p in pods if p.usable]
    answers = await asyncio.gather(*(ctx.runtime(p, token).models() for p in usable), return_exceptions=True)
    left: dict[str, str] = {}
    for pod, answer in zip(usable, answers, strict=True):
        if isinstance(answer, BaseException):
            if not isinstance(answer, Exception):
                raise answer
            left[pod.name] = getattr(answer, "message", None) or str(answer)
        elif name in answer.adapters:
            left[pod.name] = f"still lists {name!r} ({answer.adapters[name].state})"
    return left
