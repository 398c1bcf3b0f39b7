// What the kernels share (quantized_cpu.cpp: int4, int5, int8; kquants_cpu.cpp: the K-quants;
// float_cpu.cpp; the row operations and attention): where a kernel's results go and which ISA runs.
// No ATen here: the kernels' translation units compile without its headers (a third of the build's
// time when each parsed them); operators_common.h holds what the operators and the decoder need of
// it. Functions are inline, so that use_isa() is one switch for all: every family of kernels (the
// products, the row operations, attention) runs the build of the ISA it says, and records which
// (kernels_ran), never one chosen by the CPU's flags behind its back.

#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define FF_X86 1
#else
#define FF_X86 0
#endif

// The widest Isa this library was built for (kernels/extension.py passes the CPU's: a CPU without
// AVX-512 compiles neither the AVX-512 nor the AMX kernels, half the products' compile time). The
// builds past it are left out, best_isa() stops at it, and each translation unit names what it
// leaves out once, for the dispatch code to compile (those names are never run).
#ifndef FF_WIDEST_ISA
#define FF_WIDEST_ISA 3
#endif
#define FF_BUILDS_VNNI (FF_X86 && FF_WIDEST_ISA >= 2)
#define FF_BUILDS_AMX (FF_X86 && FF_WIDEST_ISA >= 3)

namespace flashformer_cpu {

constexpr int64_t kBlock = 32;  // values per quantization block along K (GGUF's QK4_1, QK5_1, QK8_0)

// Where a kernel's results go: x row m0 + t (t in the tile) at out + t * ld, the kernel's first
// output row first; only `rows` of its rows are stored (fewer at the end of the matrix), each
// plus bias[r] when there is a bias. The x86 kernels take it by value: their vector stores may
// write any memory as far as the compiler knows, and a copy of their own keeps its fields in
// registers.
struct Output {
  float* out;
  int64_t ld;
  int64_t rows;
  const float* bias;  // at the first row, or nullptr
};

// Which kernels run: the best this CPU has, or one chosen by quantized_kernel_isa (tests compare them).
// kAmx: AMX's int8 tiles (Sapphire Rapids and later) for the K-quants' many-row products, and the
// VNNI kernels for the rest.
enum Isa : int { kScalar = 0, kAvx2 = 1, kVnni = 2, kAmx = 3 };

// Whether this CPU has AMX's int8 tiles and the kernel lets this process use them (Linux asks a
// process to request the tiles' state before its first tile instruction: arch_prctl).
inline bool amx_usable() {
#if FF_X86 && defined(__linux__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // asm/prctl.h, the tile data's state component
  return tile && int8 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
  return false;
#endif
}

inline int best_isa() {
#if FF_X86
  __builtin_cpu_init();
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                    __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  if (!avx2) return kScalar;
  if (!vnni || FF_WIDEST_ISA < kVnni) return kAvx2;
  static const bool amx = FF_WIDEST_ISA >= kAmx && amx_usable();
  return amx ? kAmx : kVnni;
#else
  return kScalar;
#endif
}

// The vector kernels an ISA runs where it has no kernel of its own (AMX: VNNI's).
inline int vector_isa(int isa) { return isa < kVnni ? isa : kVnni; }

inline std::atomic<int>& use_isa() {
  static std::atomic<int> isa{best_isa()};
  return isa;
}

// The families of kernels, each of which records the ISAs whose build it ran (a bit per Isa) for
// kernels_ran: the tests check that a forced path runs that ISA's code in every family, and the
// emulated CPU without AVX-512 (docs/architecture.md, "Instruction sets") that nothing else runs.
enum Family : int {
  kNibbleProducts = 0,  // int4, int5 (quantized_cpu.cpp)
  kInt8Products,        // int8 (quantized_cpu.cpp)
  kKQuantProducts,      // Q4_K, Q5_K, Q6_K (kquants_cpu.cpp)
  kFloatProducts,       // float32 (float_cpu.cpp)
  kQuantizingX,         // x quantized per block for int8 activations (products.h's prepare_x)
  kRowOperations,       // norms, RoPE, activations, adds (row_ops.h)
  kAttention,           // a task of attention over cached keys (paged_attention_cpu.cpp)
  kWideningKv,          // float16 / q8_0 / q4_0 cache rows widened to float32 (paged_attention_cpu.cpp)
  kMxfp4Products,       // MXFP4 (mxfp4_cpu.cpp)
  kFamilies
};

inline std::atomic<unsigned>* families_ran() {
  static std::atomic<unsigned> ran[kFamilies] = {};
  return ran;
}

// Family `family` runs ISA `isa`'s build. Written only when new, so that the hot calls read a line
// every thread shares and never contend for it.
inline void note_ran(int family, int isa) {
  std::atomic<unsigned>& ran = families_ran()[family];
  const unsigned bit = 1u << isa;
  if (!(ran.load(std::memory_order_relaxed) & bit)) ran.fetch_or(bit, std::memory_order_relaxed);
}

// The instruction sets of the vector ISAs' builds, the same for the products' #pragma sections
// (quantized_cpu.cpp, kquants_cpu.cpp) and run_built_for below: what best_isa() asks of the CPU.
#define FF_AVX2_TARGET "avx2,fma,f16c"
#define FF_VNNI_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"

#if FF_X86
template <class Op, class... Args>
__attribute__((target(FF_AVX2_TARGET))) void run_avx2_build(Args&&... args) {
  Op::run(std::forward<Args>(args)...);
}
#endif
#if FF_BUILDS_VNNI
template <class Op, class... Args>
__attribute__((target(FF_VNNI_TARGET))) void run_vnni_build(Args&&... args) {
  Op::run(std::forward<Args>(args)...);
}
#endif
template <class Op, class... Args>
void run_baseline_build(Args&&... args) {
  Op::run(std::forward<Args>(args)...);
}

// Op::run(args...) compiled for `isa` (its vector build: AMX runs VNNI's): the baseline x86-64,
// AVX2 or AVX-512, and recorded as `family`'s. Op::run and everything it calls must be
// always_inline, so that each build compiles them for its own target (a plain function called from
// it would run its baseline code). GCC's target_clones did this by the CPU's flags alone: the
// AVX-512 clone ran under FLASHFORMER_CPU_ISA=avx2.
template <class Op, class... Args>
inline void run_built_for(int isa, int family, Args&&... args) {
  isa = vector_isa(isa);
  note_ran(family, isa);
#if FF_BUILDS_VNNI
  if (isa == kVnni) return run_vnni_build<Op>(std::forward<Args>(args)...);
#endif
#if FF_X86
  if (isa == kAvx2) return run_avx2_build<Op>(std::forward<Args>(args)...);
#endif
  run_baseline_build<Op>(std::forward<Args>(args)...);
}

// AMX's tile configuration (palette 1), as _tile_loadconfig reads it: each tile's rows and bytes
// per row (kquants_amx.inc, quantized_amx.inc).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline float half_to_float(uint16_t bits) {
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// The 8-lane horizontal sum in the order of hsum8 below.
inline float hsum8_scalar(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

// Tile row t's results (o.rows of them) plus their bias.
__attribute__((always_inline)) inline void store_rows(const float* acc, const Output& o, int t) {
  float* out = o.out + t * o.ld;
  for (int64_t r = 0; r < o.rows; ++r) out[r] = o.bias ? acc[r] + o.bias[r] : acc[r];
}

// Groups of output rows per task: at least kTaskBlocks (x row, weight row, block) triples, so that
// a small product is not split finer than a fork/join (a few microseconds) is worth.
constexpr int64_t kTaskBlocks = 4096;

inline int64_t group_grain(int64_t nb, int64_t rows, int64_t group_rows) {
  return std::max<int64_t>(1, kTaskBlocks / std::max<int64_t>(1, nb * rows * group_rows));
}

// The product's output (M, N) and bias (N,), and the part of them a kernel writes.
// out's rows are ld floats apart (ld >= n: a product may fill some columns of a wider matrix).
struct OutputMatrix {
  float* out;
  int64_t n;
  const float* bias;  // or nullptr
  int64_t ld;
  // x rows from m0, output rows row0 .. row0 + rows - 1 (fewer at the end of the matrix)
  Output part(int64_t m0, int64_t row0, int64_t rows) const {
    return {out + m0 * ld + row0, ld, std::min(rows, n - row0), bias ? bias + row0 : nullptr};
  }
};

}  // namespace flashformer_cpu
