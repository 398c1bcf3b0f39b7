#!/usr/bin/env bash
# Paged attention on a GPU: its tests compiled for the GPU (float64 references,
# bitwise batch invariance of the Triton kernel, the slow SmolLM2-shaped case),
# the split-KV decode tests that share its kernel, then the per-step benchmark
# on CUDA (Triton at several split lengths, the per-sequence path) and on the
# machine's CPU. Sized for about 5 minutes on an H100/H200.
#
#     bash scripts/gpu_check_paged.sh      # results in $OUT if set, else gpu-results/
#
# Like scripts/gpu_check.sh it uses the machine's own python3. Where that lacks
# the (pure Python) gguf package that `import flashformer` needs, put a copy of
# it on PYTHONPATH first (e.g. the venv's site-packages/gguf folder, copied into
# an ignored folder that travels with the tree).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-gpu-results}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$RESULTS/environment.log"
workers=""
if python3 -c "import xdist" 2>/dev/null; then workers="-n 8"; fi

echo "== tests (timeout 180 s) =="
timeout 180 python3 -m pytest tests/test_attention_paged.py tests/test_attention_triton.py -k "paged or decode" \
    -m "slow or not slow" -q -p no:cacheprovider $workers --durations=8 2>&1 | tee "$RESULTS/tests.log"
tests_status=${PIPESTATUS[0]}

echo "== benchmark, CUDA (timeout 120 s) =="
timeout 120 python3 scripts/bench_paged_attention.py --device cuda --rounds 10 --out "$RESULTS" 2>&1 \
    | tee "$RESULTS/bench_cuda.log"
bench_status=${PIPESTATUS[0]}

echo "== benchmark, CPU (timeout 150 s) =="
timeout 150 python3 scripts/bench_paged_attention.py --device cpu --rounds 3 --out "$RESULTS" 2>&1 \
    | tee "$RESULTS/bench_cpu.log"

echo "tests exit status: $tests_status, CUDA benchmark exit status: $bench_status"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
