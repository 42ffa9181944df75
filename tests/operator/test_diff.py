"""Desired vs observed: what counts as a difference, and the patch that removes it."""

from __future__ import annotations

import copy

from kmock._internal.dicts import merge_patch_dict

from loraserve.operator import diff

OWNED = ("spec.template", "spec.replicas")


def _desired() -> dict:
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "s",
            "namespace": "ns",
            "labels": {"app.kubernetes.io/name": "loraserve-runtime"},
            "annotations": {},
            "ownerReferences": [
                {"apiVersion": "loraserve.io/v1alpha1", "kind": "LoRAServe", "name": "s", "uid": "u1"}
            ],
        },
        "spec": {
            "replicas": 2,
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {
                    "nodeSelector": {"gpu": "h100"},
                    "containers": [{"name": "runtime", "image": "img:1"}],
                },
            },
        },
    }
    return diff.with_desired_hash(body)


def _as_served(body: dict) -> dict:
    """What an API server stores: defaults filled in, bookkeeping added."""
    served = copy.deepcopy(body)
    served["metadata"].update({"resourceVersion": "7", "uid": "d1", "generation": 3})
    served["metadata"]["labels"]["someone-else"] = "x"
    served["spec"]["template"]["spec"].update({"dnsPolicy": "ClusterFirst", "restartPolicy": "Always"})
    served["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
    served["spec"]["progressDeadlineSeconds"] = 600
    served["status"] = {"readyReplicas": 2}
    return served


def test_server_defaults_are_not_a_difference() -> None:
    desired = _desired()
    assert not diff.needs_update(_as_served(desired), desired, OWNED)


def test_hand_edit_is_a_difference() -> None:
    """Hand edit of an owned field is a difference."""
    desired = _desired()
    observed = _as_served(desired)
    observed["spec"]["template"]["spec"]["containers"][0]["image"] = "img:hacked"
    assert diff.needs_update(observed, desired, OWNED)
    observed = _as_served(desired)
    observed["spec"]["replicas"] = 5
    assert diff.needs_update(observed, desired, OWNED)
    observed = _as_served(desired)
    observed["metadata"]["ownerReferences"] = []
    assert diff.needs_update(observed, desired, OWNED)


def test_removed_field_is_a_difference() -> None:
    """Removed field is a difference through the hash."""
    old = _desired()
    new_body = copy.deepcopy(old)
    del new_body["spec"]["template"]["spec"]["nodeSelector"]
    new = diff.with_desired_hash(new_body)
    observed = _as_served(old)
    # Every field of `new` is present in `observed`: only the hash can tell.
    assert diff.contains(observed["spec"], new["spec"])
    assert diff.needs_update(observed, new, OWNED)


def test_patch_touches_owned_fields_only() -> None:
    """Patch turns observed into desired on owned fields only."""
    old = _desired()
    new_body = copy.deepcopy(old)
    del new_body["spec"]["template"]["spec"]["nodeSelector"]
    new_body["spec"]["template"]["spec"]["containers"][0]["image"] = "img:2"
    new_body["spec"]["replicas"] = 3
    new = diff.with_desired_hash(new_body)
    observed = _as_served(old)
    patch = diff.update_patch(observed, new, OWNED)
    assert patch["metadata"]["resourceVersion"] == "7", "the write is guarded by what was observed"
    result = merge_patch_dict(observed, patch)  # RFC 7386 merge, as the API server applies it
    assert result["spec"]["template"] == new["spec"]["template"]
    assert result["spec"]["replicas"] == 3
    assert result["spec"]["progressDeadlineSeconds"] == 600, "fields not owned are left alone"
    assert result["metadata"]["labels"]["someone-else"] == "x", "others' labels are left alone"
    assert not diff.needs_update(result, new, OWNED)


def test_owner_reference_is_added_next_to_others() -> None:
    desired = _desired()
    observed = _as_served(desired)
    other = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u9"}
    observed["metadata"]["ownerReferences"] = [other]
    patch = diff.update_patch(observed, desired, OWNED)
    refs = patch["metadata"]["ownerReferences"]
    assert other in refs and desired["metadata"]["ownerReferences"][0] in refs


def test_stable_hash_ignores_key_order() -> None:
    """Stable hash ignores key order and sees values."""
    assert diff.stable_hash({"a": 1, "b": [1, 2]}) == diff.stable_hash({"b": [1, 2], "a": 1})
    assert diff.stable_hash({"a": 1}) != diff.stable_hash({"a": 2})
    assert diff.stable_hash({"a": [1, 2]}) != diff.stable_hash({"a": [2, 1]})


def test_contains_is_type_strict() -> None:
    """Contains distinguishes bools from numbers and list lengths."""
    assert not diff.contains({"x": 1}, {"x": True})
    assert not diff.contains({"x": [1, 2, 3]}, {"x": [1, 2]})
    assert diff.contains({"x": [{"a": 1, "b": 2}]}, {"x": [{"a": 1}]})
