"""Machine-specific speed paths beneath the model code: the CPU matmul paths
(cpu.py) and the weight-only quantized layers (quantized.py, with their C++
kernels in csrc/). The model calls `linear(...)` and reads the same without them."""
