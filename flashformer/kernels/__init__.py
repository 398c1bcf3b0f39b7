"""Machine-specific speed paths beneath the model code: the CPU matmul paths and the decode
step's compiler options (cpu.py), the weight-only quantized layers (quantized.py) over the tables
of packed layouts (layouts.py) and GGUF block types (block_types.py), the C++ CPU kernels (csrc/,
built by extension.py) and the table of their operators with its fallbacks (operators.py), huge
pages for the weights (huge_pages.py), and what machine this is (machine.py). The model calls `linear(...)` and reads the same
without them; the measurements behind each path are in docs/benchmarks.md."""
