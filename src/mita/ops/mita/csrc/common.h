// What every part of the fused MiTA CPU kernel uses: ATen, the standard library, the ISA intrinsics, the BLAS.
// Part of the fused MiTA CPU kernel (fused_cpu.cpp, one translation unit; see README.md here).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <functional>
#include <numeric>
#include <type_traits>
#include <initializer_list>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>  // sysconf: the L2 size (products.h)
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
}

// Loops over a register array (tiles' accumulators, a transposed block) unrolled whole, so that the
// array stays in registers: GCC kept a rolled loop's array on the stack, a store and a reload around
// each multiply-add or permute (an expert's score tile ran at a third of its multiply-add rate).
#define MITA_UNROLL _Pragma("GCC unroll 32")

namespace {

using at::vec::Vectorized;

// MKL (which PyTorch links on x86) may start threads of its own for a product called inside
// a parallel region: measured 30% slower at N = 197. Keep each product on its calling thread.
// The symbol is weak: with another BLAS it is null and nothing is done.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
struct SingleThreadedBlas {
  int previous = MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0;
  ~SingleThreadedBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous);
  }
};

// Items 0 .. n split across the threads in shrinking runs from a shared counter (as OpenMP's guided
// schedule): each thread calls body(take) once, and take(begin, end) gives it its next run [begin,
// end), false when none is left. With a fixed share per thread, one thread's phase timers at N =
// 4,096 ran 10-13% busier than the other's, which then waited. Each item is done by one thread, so
// no result depends on which.
template <typename Body>
void guided_runs(int64_t n, const Body& body) {
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    body([&](int64_t& begin, int64_t& end) {
      const int64_t run = std::max<int64_t>(1, (n - next.load(std::memory_order_relaxed)) / (2 * threads));
      begin = next.fetch_add(run, std::memory_order_relaxed);
      end = std::min(begin + run, n);
      return begin < n;
    });
  });
}

// A thread's items from guided_runs' take, in order, each with the item it does after it: its next
// run is taken when the current run's last item starts, so that item too can read the next one's
// data ahead (with two threads the runs are short, 1-6 heads of 24 at B = 4, N = 1,025, and a
// run's last head had nothing to read ahead: the next head's first phases then read from memory).
//   for (Taken<std::decay_t<decltype(take)>> items(take); items.next();) use(items.x(), items.after());
template <typename Take>
class Taken {
 public:
  explicit Taken(const Take& take) : take_(take), more_(take_(next_, next_end_)) {}
  // Moves to the next item (false when none is left).
  bool next() {
    if (x_ + 1 < end_) {
      ++x_;
    } else {
      if (!more_) return false;
      x_ = next_, end_ = next_end_;
    }
    if (x_ + 1 == end_) more_ = take_(next_, next_end_);  // the run after this one, taken now
    return true;
  }
  int64_t x() const { return x_; }
  // The item this thread does after x (-1: none).
  int64_t after() const { return x_ + 1 < end_ ? x_ + 1 : (more_ ? next_ : -1); }

 private:
  const Take& take_;
  int64_t x_ = 0, end_ = 0, next_ = 0, next_end_ = 0;  // the current item and run's end; the next run
  bool more_;  // whether there is a next run
};

}  // namespace
