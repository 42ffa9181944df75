#!/usr/bin/env bash
# One device call (under 9 minutes on an H100): (a) the kernel tests on CUDA, (b) the step
# profile by op family with the fused ops off and on, (c) decode throughput, base and 8
# rank-16 adapters, at 8B dims with the fused ops off and on. Each part writes under OUT and
# is cut by its own time limit, so one slow part leaves the others their time.
# Usage (device machine, repository root): bash bench/gpu/step.sh "$OUT"
# CPU check of the same script (tiny dims, the Triton interpreter): SMOKE=1 bash bench/gpu/step.sh /tmp/out
set -uo pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
py=${PY:-python3}
if [[ "${SMOKE:-0}" == 1 ]]; then
  export TRITON_INTERPRET=1
  tests=(tests/kernels/test_model_ops.py tests/kernels/test_fused_model.py)
  profile=(--smoke)
  runtime=(--smoke --fused-ops off,on)
else
  # (the device call brings back at most 8 files: the install log stays on the machine)
  "$py" -m pip install -q --no-deps --no-build-isolation --target /tmp/lsv . >/tmp/lsv-install.log 2>&1 ||
    tail -20 /tmp/lsv-install.log
  export PYTHONPATH=/tmp/lsv
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  tests=(tests/kernels)
  profile=(--size 8b --batch-size 32 --fused-ops off,on)
  runtime=(--sizes 8b --batch-sizes 1,32,64 --adapters 8 --steps 32 --repeats 3 --fused-ops off,on)
fi
export PYTHONUNBUFFERED=1
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
echo "== (a) kernel tests"
timeout 150 "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" >"$out/kernel-tests.txt" 2>&1
echo "exit $?" >>"$out/kernel-tests.txt"
tail -15 "$out/kernel-tests.txt"
echo "== (b) step profile"
timeout 150 "$py" -P bench/profile_step.py "${profile[@]}" --out "$out/profile.md" >"$out/profile.log" 2>&1
echo "exit $?" >>"$out/profile.log"
grep -v "USDT\|ERROR:" "$out/profile.log" | tail -40
echo "== (c) decode throughput"
timeout 230 "$py" -P bench/runtime.py "${runtime[@]}" --out "$out/runtime.md" >"$out/runtime.log" 2>&1
echo "exit $?" >>"$out/runtime.log"
tail -30 "$out/runtime.log"
