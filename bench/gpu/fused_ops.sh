#!/usr/bin/env bash
# One device call: the fused decoder kernels' tests on the GPU, then decode throughput with the
# fused ops off and on (8B dims; base and 8 rank-16 adapters) in the same run.
# Usage (device machine, repository root): bash bench/gpu/fused_ops.sh "$OUT"
set -uo pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/lsv . >"$out/install.log" 2>&1
export PYTHONPATH=/tmp/lsv
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_model_ops.py 2>&1 | tail -15 | tee "$out/kernel-tests.txt"
python3 -P bench/runtime.py --sizes 8b --batch-sizes 1,32,64 --adapters 8 --steps 32 --repeats 3 \
  --fused-ops off,on --out "$out/runtime-fused.md" 2>&1 | tail -40
