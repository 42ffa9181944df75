"""Reading runtime pods: readiness, address, serve."""

from __future__ import annotations

from loraserve.operator import desired as ds
from loraserve.operator.reconcile.pods import pod_view


def _pod(**status) -> dict:
    return {
        "metadata": {
            "name": "llama-abc",
            "namespace": "ml",
            "uid": "u1",
            "labels": {ds.SERVE_LABEL: ds.label_value("llama")},
            "annotations": {ds.SERVE_NAME_ANNOTATION: "llama"},
        },
        "spec": {"containers": [{"name": "runtime", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
            **status,
        },
    }


def test_ready_pod_is_usable_at_its_ip_and_port() -> None:
    view = pod_view(_pod())
    assert view is not None and view.usable
    assert (view.serve, view.url, view.uid) == ("llama", "http://10.1.2.3:8000", "u1")


def test_unusable_pods_skipped() -> None:
    """Not ready unaddressed or terminating pods are not usable."""
    assert not pod_view(_pod(conditions=[{"type": "Ready", "status": "False"}])).usable
    assert not pod_view(_pod(podIP=None)).usable
    assert not pod_view(_pod(phase="Succeeded")).usable
    terminating = _pod()
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not pod_view(terminating).usable


def test_other_pods_are_ignored() -> None:
    other = _pod()
    other["metadata"]["labels"] = {}
    other["metadata"]["annotations"] = {}
    assert pod_view(other) is None


def test_long_serve_names_from_annotation() -> None:
    """Long serve names are read from the annotation."""
    name = "s" * 80
    pod = _pod()
    pod["metadata"]["labels"] = {ds.SERVE_LABEL: ds.label_value(name)}
    pod["metadata"]["annotations"] = {ds.SERVE_NAME_ANNOTATION: name}
    assert pod_view(pod).serve == name


def test_unready_pod_takes_catalog() -> None:
    """--catalog-confirm: the pod turns Ready only after the operator's push, so the push
    must reach pods that are running and addressed but not Ready."""
    loading = pod_view(_pod(conditions=[{"type": "Ready", "status": "False"}]))
    assert loading.pushable and loading.starting and not loading.usable
    ready = pod_view(_pod())
    assert ready.pushable and not ready.starting
    assert not pod_view(_pod(phase="Pending", conditions=[])).pushable
    assert not pod_view(_pod(podIP=None, conditions=[])).pushable
    terminating = _pod(conditions=[])
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not pod_view(terminating).pushable
