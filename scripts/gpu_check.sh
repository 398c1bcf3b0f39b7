#!/usr/bin/env bash
# The GPU session's one command: the Triton tests compiled for the GPU, then the
# CUDA attention benchmark (TFLOP/s of triton, flash, SDPA's flash / efficient /
# cudnn backends and FlexAttention). Sized to finish in under 8 minutes on an
# H100/H200 (tests <= 230 s, each of the 6 benchmark methods <= 35 s).
#
#     bash scripts/gpu_check.sh            # results in $OUT if set, else gpu-results/
#
# It uses the machine's own python3 with its torch and triton (nothing is
# installed: the repository is put on PYTHONPATH), and pytest-xdist when present
# to compile kernel variants on several cores at once.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-gpu-results}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

python3 - <<'PY' 2>&1 | tee "$RESULTS/environment.log"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, "SMs")
PY
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv 2>&1 | tee -a "$RESULTS/environment.log"

workers=""
if python3 -c "import xdist" 2>/dev/null; then workers="-n 12"; fi
echo "== tests (timeout 230 s) =="
timeout 230 python3 -m pytest tests/test_attention_triton.py -q -p no:cacheprovider $workers \
    --durations=10 2>&1 | tee "$RESULTS/tests.log"
tests_status=${PIPESTATUS[0]}

echo "== benchmark =="
timeout 240 python3 -m flashformer.cli bench attention --device cuda --quick --method-timeout 35 \
    --out "$RESULTS" 2>&1 | tee "$RESULTS/bench.log"
bench_status=${PIPESTATUS[0]}

echo "tests exit status: $tests_status, benchmark exit status: $bench_status"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
