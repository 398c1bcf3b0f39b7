"""Machine-specific speed paths beneath the model code: the CPU matmul paths
(cpu.py). The model calls `linear(...)` and reads the same without them."""
