#!/usr/bin/env bash
# One device call (under 9.5 minutes), most valuable first, each part cut by its own limit:
# (a) CUDA tests of the kernels, the fused MoE path and its graph capture, Gemma 3;
# (b) the MoE layer bench (base vs 8 expert adapters); (c) the step profile, fused ops off/on;
# (d) decode throughput at 8B dims, base and 8 rank-16 adapters, fused ops off/on.
# Usage (device machine, repository root): bash bench/gpu/all.sh "$OUT"
set -uo pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/lsv . >/tmp/lsv-install.log 2>&1 ||
  tail -20 /tmp/lsv-install.log
export PYTHONPATH=/tmp/lsv PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$out/gpu.txt"
part() {  # part NAME SECONDS COMMAND...: run, keep the log, print its tail
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  echo "exit $? after $((SECONDS - t0))s" >>"$out/$name.txt"
  grep -v "USDT\|^ERROR: \|Warning" "$out/$name.txt" | tail -25
}
part tests 170 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/runtime_model/test_moe_fused.py \
  tests/runtime_model/test_gemma3.py
part moe 90 python3 -P bench/moe.py --batch-sizes 1,32,64 --adapters 8 --out "$out/moe.json"
part profile 110 python3 -P bench/profile_step.py --size 8b --batch-size 32 --fused-ops off,on --out "$out/profile.md"
part runtime 170 python3 -P bench/runtime.py --sizes 8b --batch-sizes 1,32,64 --adapters 8 --steps 32 --repeats 3 \
  --fused-ops off,on --out "$out/runtime.md"
