#!/usr/bin/env bash
# The GPU session's one command: the Triton tests compiled for the GPU, then the
# CUDA attention benchmark (TFLOP/s of triton, flash, SDPA's flash / efficient /
# cudnn backends and FlexAttention). Sized to finish in under 8 minutes on an
# H100/H200: tests <= 200 s; the benchmark's Triton and FlexAttention kernels
# compiled in parallel processes first (<= 80 s; compilers cache on disk); then
# each of the 6 benchmark methods <= 30 s.
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
echo "== tests (timeout 200 s) =="
timeout 200 python3 -m pytest tests/test_attention_triton.py -q -p no:cacheprovider $workers \
    --durations=10 2>&1 | tee "$RESULTS/tests.log"
tests_status=${PIPESTATUS[0]}

echo "== compiling the benchmark's kernels, 8 processes at once (timings discarded) =="
for method in triton flex; do
    for dim in 64 128; do
        for causal in false true; do
            config="{\"method\": \"$method\", \"head_dims\": [$dim], \"causal\": [$causal], \"ns\": [1024, 4096, 8192]}"
            timeout 80 python3 -m flashformer.bench.attention_cuda --worker "$config" >/dev/null 2>>"$RESULTS/warmup.log" &
        done
    done
done
wait

echo "== benchmark =="
timeout 210 python3 -m flashformer.cli bench attention --device cuda --quick --method-timeout 30 \
    --out "$RESULTS" 2>&1 | tee "$RESULTS/bench.log"
bench_status=${PIPESTATUS[0]}

echo "tests exit status: $tests_status, benchmark exit status: $bench_status"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
