#!/usr/bin/env bash
# One device call (under 9.5 minutes), most valuable first, each part cut by its own limit:
# (a) CUDA tests of the kernels, the fused MoE path and its graph capture, Gemma 3;
# (b) the MoE layer bench (base vs 8 expert adapters); (c) the step profile, fused ops off/on;
# (d) decode throughput at 8B dims, base and 8 rank-16 adapters, fused ops off/on.
# Usage (device machine, repository root): bash bench/gpu/all.sh "$OUT"
# CPU check of the same script (tiny shapes, the Triton interpreter): SMOKE=1 PY=.venv/bin/python bash bench/gpu/all.sh /tmp/out
set -uo pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
py=${PY:-python3}
tests=(tests/kernels tests/runtime_model/test_moe_fused.py tests/runtime_model/test_gemma3.py)
moe=(--batch-sizes 1,32,64 --adapters 8)
profile=(--size 8b --batch-size 32 --fused-ops off,on)
runtime=(--sizes 8b --batch-sizes 1,32,64 --adapters 8 --steps 32 --repeats 3 --fused-ops off,on)
if [[ "${SMOKE:-0}" == 1 ]]; then
  export TRITON_INTERPRET=1
  tests=(tests/kernels/test_moe_kernels.py -k "not capture")
  moe=(--smoke) profile=(--smoke) runtime=(--smoke --fused-ops off,on)
else
  "$py" -m pip install -q --no-deps --no-build-isolation --target /tmp/lsv . >/tmp/lsv-install.log 2>&1 ||
    tail -20 /tmp/lsv-install.log
  export PYTHONPATH=/tmp/lsv
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
fi
export PYTHONUNBUFFERED=1
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
part() {  # part NAME SECONDS COMMAND...: run, keep the log, print its tail
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  echo "exit $? after $((SECONDS - t0))s" >>"$out/$name.txt"
  grep -v "USDT\|^ERROR: \|Warning" "$out/$name.txt" | tail -25
}
part tests 170 "$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
part moe 90 "$py" -P bench/moe.py "${moe[@]}" --out "$out/moe.json"
part profile 110 "$py" -P bench/profile_step.py "${profile[@]}" --out "$out/profile.md"
part runtime 170 "$py" -P bench/runtime.py "${runtime[@]}" --out "$out/runtime.md"
