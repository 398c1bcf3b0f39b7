// The threads of one native-decoder call (decoder_cpu.cpp): a barrier of its own between the steps
// of a layer, a counter per step from which the threads claim its units, and the profile of where
// the time goes. Inline and in an anonymous namespace: one translation unit includes it.

#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace flashformer_cpu {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Threads wait for each other spinning, then (past kSpin) asleep on a futex. Spinning is what makes
// a barrier cost well under a microsecond between the steps of a layer; sleeping is what keeps a
// thread whose partner was descheduled (a loaded machine) from burning the core it needs.
// OpenMP's own barrier follows OMP_WAIT_POLICY: under "passive" (set for llama.cpp's benefit in our
// benchmarks) every barrier would be a sleep and a wake-up.
class Barrier {
 public:
  void reset(int threads) { threads_ = threads, arrived_.store(0), sleepers_.store(0); }

  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) {
        syscall(SYS_futex, reinterpret_cast<int*>(&generation_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
      }
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (int64_t spin = 1;; ++spin) {
      if (generation_.load(std::memory_order_acquire) != generation) return;
      cpu_relax();
      if (spin % 64 == 0 && std::chrono::steady_clock::now() - start > kSpin) break;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (generation_.load(std::memory_order_seq_cst) == generation) {
      syscall(SYS_futex, reinterpret_cast<int*>(&generation_), FUTEX_WAIT_PRIVATE, generation, nullptr, nullptr, 0);
    }
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

 private:
  static constexpr std::chrono::microseconds kSpin{200};
  int threads_ = 1;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> generation_{0};
  alignas(64) std::atomic<int> sleepers_{0};
};

struct alignas(64) Counter {
  std::atomic<int64_t> next{0};
};

// The kinds of step, for the profile (set_profiling): where a call's time goes.
enum Phase : int {
  kEmbed, kNorm, kQkv, kRope, kAttention, kPrepare, kOut, kResidualNorm, kUp, kAct, kDown, kResidual, kHead,
  kPhases
};
constexpr const char* kPhaseNames[kPhases] = {"embed", "norm", "qkv", "rope_cache", "attention", "prepare", "out",
                                              "residual_norm", "up", "act", "down", "residual", "head"};

// One thread's view of a call: its steps in the program's order, each step's units claimed from
// that step's counter a few at a time, then the barrier. With a profile, thread 0 adds each
// step's time (from the barrier before to the barrier after it) to its phase.
struct Worker {
  int thread, threads;
  Barrier* barrier;
  Counter* counters;
  double* profile;  // kPhases seconds, or nullptr
  int64_t step = 0;
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();

  // A claim takes a share of what is left (guided scheduling): large while there is much, down
  // to one unit at the end, so that the threads finish close together.
  template <class F>
  void run(Phase phase, int64_t units, F&& f) {
    std::atomic<int64_t>& next = counters[step++].next;
    int64_t first = next.load(std::memory_order_relaxed);
    while (first < units) {
      const int64_t chunk = std::max<int64_t>(1, (units - first) / (2 * threads));
      if (!next.compare_exchange_weak(first, first + chunk, std::memory_order_relaxed)) continue;
      f(first, std::min(units, first + chunk));
      first = next.load(std::memory_order_relaxed);
    }
    barrier->wait();
    if (profile && thread == 0) {
      const auto now = std::chrono::steady_clock::now();
      profile[phase] += std::chrono::duration<double>(now - last).count();
      last = now;
    }
  }

  // run() over `count` rows (or tasks), f(i) for each one claimed.
  template <class F>
  void each(Phase phase, int64_t count, F&& f) {
    run(phase, count, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) f(i);
    });
  }
};

}  // namespace
}  // namespace flashformer_cpu
