"""Machine-specific speed paths beneath the model code: the CPU matmul paths and the decode
step's compiler options (cpu.py), the weight-only quantized layers (quantized.py), the C++ CPU
kernels and their fallbacks (extension.py, csrc/), huge pages for the weights (huge_pages.py),
and what machine this is (machine.py). The model calls `linear(...)` and reads the same
without them; the measurements behind each path are in docs/benchmarks.md."""
