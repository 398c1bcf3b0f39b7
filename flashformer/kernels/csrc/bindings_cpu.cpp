// The extension's side that meets PyTorch, as one translation unit: the operators' glue
// (operators_cpu.cpp) and the native decoder's class (decoder_cpu.cpp). They are the only code that
// includes ATen's and torch's headers, which take ~9 s to compile each time a unit includes them:
// once here instead of twice (the first build's critical path on 2 cores; docs/benchmarks.md,
// "Building the C++ kernels"). The kernels' units include none (quantized_common.h).

#include "operators_cpu.cpp"
#include "decoder_cpu.cpp"
