#!/usr/bin/env bash
# One device call: the fused MoE kernels' tests on the GPU, then one Qwen3-30B-A3B-shaped MoE
# layer, base vs 8 rank-16 adapters on the experts, at decode batch sizes 1, 32 and 64
# (eager and CUDA-graph replay). Installs the project only (no dependencies).
# Usage (device machine, repository root): bash bench/gpu/moe.sh "$OUT"
set -uo pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/lsv . >"$out/install.log" 2>&1
export PYTHONPATH=/tmp/lsv
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_kernels.py 2>&1 | tail -15 | tee "$out/kernel-tests.txt"
python3 -P bench/moe.py --batch-sizes 1,32,64 --adapters 8 --out "$out/moe.json" 2>&1 | tee "$out/moe.md" | tail -40
