"""Reconcile loops of the operator: LoRAServe → runtime pods, Adapter → loaded in ready pods.

``kube`` talks to the Kubernetes API, ``diff`` decides what differs, ``serve`` and
``adapters`` run one observe → diff → act → report pass each, ``adapter_state`` holds the
per-pod adapter state machine and ``pods`` reads runtime pods. Everything that decides is
a pure function; the passes only fetch, call and write.
"""
