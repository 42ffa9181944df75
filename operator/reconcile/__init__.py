"""Reconcile loops of the operator: LoRAServe → runtime pods, Adapter → loaded in ready pods.

``kube`` talks to the Kubernetes API, ``serve`` and ``adapters`` run one observe → diff →
act → report pass each, ``optional`` keeps a serve's routing and autoscaling objects and
``pods`` reads runtime pods. What decides lives below this package, as pure functions
(``desired``, ``status``, ``diff``, ``adapter_state``...); the passes only fetch, call and
write.
"""
