"""The admission webhooks over real HTTPS, with kopf's indexes fed by a watch.

See conftest.py: kmock's KubernetesEmulator stands in for the API server (none exists on
these machines); kopf, its webhook server and the indexes are real.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from loraserve.operator import webhooks
from loraserve.operator.specs import API_VERSION
from loraserve.runtime.contract.capabilities import CAPABILITIES
from loraserve.runtime.contract.config import SpecAlgorithm

pytestmark = pytest.mark.asyncio(loop_scope="module")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WEBHOOK_NEGATIVES = [
    p for p in sorted((EXAMPLES / "invalid").glob("*.yaml")) if "expect-rejected-by: webhook" in p.read_text()
]


PINNED = "0123456789abcdef0123456789abcdef01234567"
"""A commit sha: adapters of these tests are pinned, so no revision warning is expected."""


def serve(name: str, namespace: str, **spec) -> dict:
    body = {"model": {"source": "/models/llama"}, **spec}
    return {
        "apiVersion": API_VERSION,
        "kind": "LoRAServe",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def adapter(name: str, namespace: str, serve_name: str, **spec) -> dict:
    body = {"serve": serve_name, "source": f"hf://acme/{name}@{PINNED}", **spec}
    return {
        "apiVersion": API_VERSION,
        "kind": "Adapter",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


async def test_valid_examples_follow_table(lab, manifest):
    """Valid examples follow the capability table."""
    ns = "examples"
    docs = [manifest(p.name, ns) for p in sorted(EXAMPLES.glob("*.yaml"))]
    docs.sort(key=lambda d: d["kind"] != "LoRAServe")
    admitted_serves = set()
    for doc in docs:
        applied = await lab.apply(doc)
        if doc["kind"] == "LoRAServe":
            algorithm = SpecAlgorithm(doc["spec"].get("speculative", {}).get("algorithm", "NONE"))
            assert applied.allowed == CAPABILITIES.implements(algorithm), applied.validation.message
            if applied.allowed:
                admitted_serves.add(doc["metadata"]["name"])
            else:
                assert applied.validation.code == webhooks.ADMISSION_ERROR_CODE
                assert "not available in this runtime" in applied.validation.message
        else:
            # Adapters fit their serves; a serve that was refused is only a warning.
            assert applied.allowed, applied.validation.message
            missing = doc["spec"]["serve"] not in admitted_serves
            assert any("does not exist" in w for w in applied.warnings) == missing
            assert await lab.get("Adapter", doc["metadata"]["name"], ns) is not None


@pytest.mark.parametrize("path", WEBHOOK_NEGATIVES, ids=lambda p: p.name)
async def test_negative_examples_refused(lab, manifest, path):
    """Negative examples are refused with their message."""
    ns = "negatives"
    for name in ("llama3-1b-plain.yaml", "adapter-style-https.yaml"):
        await lab.apply(manifest(name, ns))  # the serve they refer to, and its adapter
    needed = re.search(r"^# Needs the LoRAServe of examples/(\S+\.yaml)", path.read_text(), re.M)
    if needed and needed.group(1) != "llama3-1b-plain.yaml":
        await lab.apply(manifest(needed.group(1), ns))  # another serve (draft adapters' ones)
    expected = re.search(r"^# expect-message: (.+)$", path.read_text(), re.M).group(1).strip().strip('"')
    obj = manifest(f"invalid/{path.name}", ns)
    applied = await lab.apply(obj)
    assert not applied.allowed
    assert applied.validation.code == 422
    assert expected in applied.validation.message
    assert await lab.get(obj["kind"], obj["metadata"]["name"], ns) is None  # nothing stored


async def test_mutation_fills_unset_defaults(lab):
    """Mutation fills derived defaults only where unset."""
    ns = "mutation"
    review = await lab.review(
        serve(
            "s",
            ns,
            model={"source": "hf://meta-llama/Llama-3.2-1B"},
            speculative={"algorithm": "NGRAM", "numSteps": 5},
        ),
        path=webhooks.MUTATE_LORASERVE,
    )
    assert review.allowed
    assert sorted(review.patch, key=lambda op: op["path"]) == [
        {"op": "add", "path": "/spec/model/servedName", "value": "meta-llama/Llama-3.2-1B"},
        {"op": "add", "path": "/spec/speculative/numDraftTokens", "value": 6},
    ]
    written = serve(
        "s",
        ns,
        model={"source": "/m", "servedName": "mine"},
        speculative={"algorithm": "NGRAM", "numSteps": 5, "numDraftTokens": 6},
    )
    assert (await lab.review(written, path=webhooks.MUTATE_LORASERVE)).patch == []
    # A chain of topK 1 is the only derivable case; trees must say.
    tree = serve(
        "t", ns, model={"source": "/m", "servedName": "x"}, speculative={"algorithm": "EAGLE", "topK": 2}
    )
    assert (await lab.review(tree, path=webhooks.MUTATE_LORASERVE)).patch == []


async def test_adapter_mutation_labels(lab):
    """Adapter mutation labels with the serve but keeps user labels."""
    ns = "labels"
    review = await lab.review(adapter("a", ns, "s1"), path=webhooks.MUTATE_ADAPTER)
    assert review.patch == [{"op": "add", "path": "/metadata/labels", "value": {webhooks.SERVE_LABEL: "s1"}}]
    mine = adapter("b", ns, "s1")
    mine["metadata"]["labels"] = {webhooks.SERVE_LABEL: "other"}
    assert (await lab.review(mine, path=webhooks.MUTATE_ADAPTER)).patch == []
    review = await lab.review(mine, path=webhooks.VALIDATE_ADAPTER)
    assert review.allowed and any("selections by this label will miss" in w for w in review.warnings)


async def test_adapter_before_serve_warns(lab):
    """Adapter before its serve is admitted with a warning then checked."""
    ns = "order"
    early = await lab.apply(adapter("early", ns, "late-serve", rank=32))
    assert early.allowed
    assert early.warnings[-1].startswith(
        "spec.serve: LoRAServe 'late-serve' does not exist in namespace 'order'"
    )
    # The serve arrives; it cannot hold that adapter, which creation reports without refusing.
    created = await lab.apply(serve("late-serve", ns, lora={"maxRank": 16}))
    assert created.allowed
    assert any(
        "Adapter 'early' spec.rank: rank 32 exceeds spec.lora.maxRank (16)" in w for w in created.warnings
    )
    # From now on the index knows the serve: a second such adapter is refused.
    second = await lab.apply(adapter("second", ns, "late-serve", rank=32))
    assert (
        not second.allowed
        and "exceeds LoRAServe 'late-serve' spec.lora.maxRank (16)" in second.validation.message
    )


async def test_stranding_serve_change_refused(lab):
    """Serve change that strands adapters is refused naming them."""
    ns = "strand"
    assert (await lab.apply(serve("s", ns, lora={"maxRank": 64}))).allowed
    for name, rank in (("a16", 16), ("a32", 32), ("a64", 64)):
        assert (await lab.apply(adapter(name, ns, "s", rank=rank))).allowed
    lowered = await lab.apply(serve("s", ns, lora={"maxRank": 16}))
    assert not lowered.allowed and lowered.validation.code == 422
    message = lowered.validation.message
    assert message.startswith("2 problems:")
    assert "existing Adapter 'a32' spec.rank: rank 32 exceeds spec.lora.maxRank (16)" in message
    assert "existing Adapter 'a64'" in message and "'a16'" not in message
    stored = await lab.get("LoRAServe", "s", ns)
    assert stored["spec"]["lora"]["maxRank"] == 64  # nothing changed
    # Deleting the adapters that stand in the way lets the change through.
    for name in ("a32", "a64"):
        await lab.delete(adapter(name, ns, "s"))
    assert (await lab.apply(serve("s", ns, lora={"maxRank": 16}))).allowed


async def test_old_misfit_not_blamed(lab):
    """Serve update that keeps an old misfit is not blamed for it."""
    ns = "misfit"
    # An adapter admitted before its serve existed, which the serve never could hold.
    assert (await lab.apply(adapter("big", ns, "s", rank=128))).allowed
    assert (await lab.apply(serve("s", ns, lora={"maxRank": 64}))).allowed
    # Unrelated change: the misfit is not new, so it does not refuse the update.
    changed = await lab.apply(serve("s", ns, lora={"maxRank": 64}, replicas=3))
    assert changed.allowed, changed.validation.message


async def test_pinned_adapters_counted(lab):
    """Pinned adapters are counted across the index."""
    ns = "pinned"
    assert (await lab.apply(serve("s", ns, lora={"maxLorasPerBatch": 3, "maxLoadedLoras": 8}))).allowed
    first = await lab.apply(adapter("p1", ns, "s", pinned=True))
    assert first.allowed and first.warnings == []
    second = await lab.apply(adapter("p2", ns, "s", pinned=True))
    assert second.allowed and any("hold 2 of the 3 GPU slots" in w for w in second.warnings)
    # The runtime's pool keeps one slot for unpinned adapters: the third pin is refused here.
    third = await lab.apply(adapter("p3", ns, "s", pinned=True))
    assert not third.allowed and "3 pinned adapters would leave no GPU slot" in third.validation.message
    assert (await lab.apply(adapter("p3", ns, "s", pinned=False))).allowed


async def test_spec_unchanged_never_refused(lab):
    """Updates that leave the spec alone are never refused."""
    ns = "finalizers"
    bad = serve("s", ns, runtime={"overlapSchedule": True})
    refused = await lab.review(bad, path=webhooks.VALIDATE_LORASERVE)
    assert not refused.allowed
    finalized = copy.deepcopy(bad)
    finalized["metadata"]["finalizers"] = ["loraserve.io/cleanup"]
    # Removing a finalizer from an object that no longer passes must not wedge its deletion.
    review = await lab.review(bad, path=webhooks.VALIDATE_LORASERVE, operation="UPDATE", old=finalized)
    assert review.allowed
    changed = copy.deepcopy(bad)
    changed["spec"]["replicas"] = 2
    review = await lab.review(changed, path=webhooks.VALIDATE_LORASERVE, operation="UPDATE", old=bad)
    assert not review.allowed


async def test_all_problems_at_once(lab):
    """All problems come back at once with warnings."""
    ns = "many"
    obj = serve(
        "s",
        ns,
        speculative={"algorithm": "FROZEN_KV_MTP", "draftModel": {"source": "/models/assistant"}},
        runtime={
            "overlapSchedule": True,
            "twoBatchOverlap": True,
            "extraArgs": ["--foo"],
            "image": "acme/rt:2",
        },
        lora={"overlapLoading": True, "maxRank": 512},
    )
    review = await lab.review(obj, path=webhooks.VALIDATE_LORASERVE)
    assert not review.allowed and review.code == 422
    for field in (
        "spec.speculative.algorithm",
        "spec.runtime.overlapSchedule",
        "spec.runtime.twoBatchOverlap",
        "spec.lora.overlapLoading",
    ):
        assert f"- {field}: " in review.message
    assert any(w.startswith("spec.lora.maxRank:") for w in review.warnings)
    assert any(w.startswith("spec.runtime.extraArgs:") for w in review.warnings)
    assert any(w.startswith("spec.runtime.image:") and "acme/rt:2" in w for w in review.warnings)


async def test_token_map_needs_eagle_draft(lab):
    """A token map is refused without an EAGLE draft naming the field."""
    ns = "token-map"
    draft = {"source": "/models/draft", "tokenMap": "maps/freq_32768.json"}
    standalone = serve("s", ns, speculative={"algorithm": "STANDALONE", "draftModel": draft})
    review = await lab.review(standalone, path=webhooks.VALIDATE_LORASERVE)
    assert not review.allowed and review.code == 422
    assert review.message.startswith("spec.speculative.draftModel.tokenMap: ")
    assert "fix:" in review.message and "EAGLE" in review.message
    eagle = serve("e", ns, speculative={"algorithm": "EAGLE", "draftModel": draft})
    assert SpecAlgorithm.EAGLE in CAPABILITIES.algorithms
    assert (await lab.review(eagle, path=webhooks.VALIDATE_LORASERVE)).allowed


async def test_malformed_specs_refused(lab):
    """Malformed specs are refused with the field."""
    ns = "malformed"
    review = await lab.review(serve("s", ns, lora={"maxRank": "big"}), path=webhooks.VALIDATE_LORASERVE)
    assert not review.allowed and review.message.startswith("spec.lora.maxRank:")
    broken = serve("s", ns)
    broken["spec"] = ["not", "an", "object"]
    review = await lab.review(broken, path=webhooks.VALIDATE_LORASERVE)
    assert not review.allowed and review.message == "spec: must be an object"
    assert (await lab.review(broken, path=webhooks.MUTATE_LORASERVE)).patch == []


async def test_deleted_serve_leaves_the_index(lab):
    ns = "deleted"
    obj = serve("s", ns, lora={"maxRank": 8})
    assert (await lab.apply(obj)).allowed
    assert not (await lab.apply(adapter("a", ns, "s", rank=16))).allowed
    await lab.delete(obj)
    again = await lab.apply(adapter("a", ns, "s", rank=16))
    assert again.allowed and any("does not exist" in w for w in again.warnings)


async def test_unmounting_an_adapters_claim_is_refused(lab):
    ns = "claims"
    pvc = {"adapters": {"type": "PersistentVolumeClaim", "claimName": "lora"}}
    assert (await lab.apply(serve("s", ns, storage=pvc))).allowed
    assert (await lab.apply(adapter("x", ns, "s", source="pvc://lora/x/v1"))).allowed
    unmounted = await lab.apply(serve("s", ns, storage={"adapters": {"type": "EmptyDir"}}))
    assert not unmounted.allowed
    assert "existing Adapter 'x' spec.source: claim 'lora' is not mounted by LoRAServe 's'" in (
        unmounted.validation.message
    )


async def test_unpinned_hf_source_warns(lab):
    """``hf://org/repo`` without ``@revision`` follows main: admitted, with a warning naming
    the field and the fix, for Adapter sources and for model and draft sources alike."""
    ns = "revisions"
    created = await lab.apply(serve("s", ns))
    assert created.allowed and created.warnings == []
    floating = await lab.apply(adapter("floating", ns, "s", source="hf://acme/sql-lora"))
    assert floating.allowed
    assert [w for w in floating.warnings if w.startswith("spec.source:")] == [
        "spec.source: hf://acme/sql-lora names no revision, so it follows the repository's main branch: a new "
        "pod, a restart or a reload may fetch other weights than the running ones; pin a commit: "
        "hf://acme/sql-lora@<40-character commit sha>"
    ]
    branch = await lab.apply(adapter("branch", ns, "s", source="hf://acme/sql-lora@main"))
    assert branch.allowed and any(
        w.startswith("spec.source: hf://acme/sql-lora@main: 'main' is a branch or tag")
        for w in branch.warnings
    ), branch.warnings
    checked = await lab.apply(adapter("checked", ns, "s", source="hf://acme/sql-lora", sha256="a" * 64))
    assert checked.allowed and any("the sha256 check fail" in w for w in checked.warnings), checked.warnings
    pinned = await lab.apply(adapter("pinned", ns, "s", source=f"hf://acme/sql-lora@{PINNED}"))
    assert pinned.allowed and pinned.warnings == []
    for other in ("pvc://adapters/sql", "s3://bucket/sql", "https://example.com/sql.tar.gz"):
        quiet = await lab.review(adapter("other", ns, "s", source=other), path=webhooks.VALIDATE_ADAPTER)
        assert not any(w.startswith("spec.source:") for w in quiet.warnings), (other, quiet.warnings)

    models = await lab.apply(
        serve(
            "hub",
            ns,
            model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
            speculative={
                "algorithm": "EAGLE3",
                "draftModel": {"source": "hf://yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
            },
            storage={
                "models": {"type": "PersistentVolumeClaim", "claimName": "models", "mountPath": "/models"}
            },
        )
    )
    assert models.allowed, models.validation.message
    assert any(
        w.startswith("spec.model.source: hf://meta-llama/Llama-3.1-8B-Instruct names no revision")
        for w in models.warnings
    )
    assert any(
        w.startswith(
            "spec.speculative.draftModel.source: hf://yuhuili/EAGLE3-LLaMA3.1-Instruct-8B names no revision"
        )
        for w in models.warnings
    ), models.warnings
    # A separate revision field pins the model as well as an @revision does.
    pinned_models = await lab.review(
        serve(
            "hub2",
            ns,
            model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "revision": PINNED},
            speculative={
                "algorithm": "EAGLE3",
                "draftModel": {"source": f"hf://yuhuili/EAGLE3-LLaMA3.1-Instruct-8B@{PINNED}"},
            },
            storage={
                "models": {"type": "PersistentVolumeClaim", "claimName": "models", "mountPath": "/models"}
            },
        ),
        path=webhooks.VALIDATE_LORASERVE,
    )
    assert pinned_models.allowed
    assert not any("names no revision" in w or "branch or tag" in w for w in pinned_models.warnings)
    branch_field = await lab.review(
        serve(
            "hub3",
            ns,
            model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "revision": "main"},
            storage={
                "models": {"type": "PersistentVolumeClaim", "claimName": "models", "mountPath": "/models"}
            },
        ),
        path=webhooks.VALIDATE_LORASERVE,
    )
    assert branch_field.allowed
    assert (
        "spec.model.revision: 'main' is a branch or tag, which can move: set it to a 40-character commit sha"
        in (branch_field.warnings)
    ), branch_field.warnings
