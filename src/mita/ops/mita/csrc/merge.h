// The merges of partial softmaxes: log-sum-exps added, weights as sigmoids of their differences.
// Part of the fused MiTA CPU kernel (fused_cpu.cpp, one translation unit; see README.md here).

#pragma once

#include "vec.h"

namespace {

// out = a + log(sum), element-wise (the tail in one partial vector: experts hold few queries).
template <typename T>
void log_add(const T* sum, const T* a, T* out, int64_t n) {
  using V = Vectorized<T>;
  for (int64_t i = 0; i < n; i += V::size()) {
    const int64_t c = std::min<int64_t>(V::size(), n - i);
    (V::loadu(a + i, c) + V::loadu(sum + i, c).log()).store(out + i, c);
  }
}

// log(1 + e) for e in [0, 1] (floats): 2 atanh(z) with z = e / (2 + e) <= 1/3, the odd series
// to z^13 (relative error at most 1.5e-8 in exact arithmetic, under float32's rounding); exact to
// rounding for small e, like log1p. One
// division and a polynomial: Sleef's log1p was 3% of the forward at N = 197 (perf, AVX-512).
inline Vectorized<float> log1p_unit(const Vectorized<float>& e) {
  using V = Vectorized<float>;
  const V z = e / (V(2.f) + e), z2 = z * z;
  V p(1.f / 13);
  for (const float c : {1.f / 11, 1.f / 9, 1.f / 7, 1.f / 5, 1.f / 3, 1.f}) p = at::vec::fmadd(p, z2, V(c));
  return V(2.f) * z * p;
}

// Two partial softmaxes with log-sum-exps a (shared) and c (routed): w = sigmoid(c - a), the
// routed one's share, and a <- logaddexp(a, c), the joint log-sum-exp; element-wise. One
// exponential, e = exp(-|a - c|): w = e / (1 + e) where a >= c, else 1 / (1 + e).
template <typename T>
void sigmoid_logaddexp(const T* c, T* a, T* w, int64_t n) {
  using V = Vectorized<T>;
  const V one(T(1));
  for (int64_t i = 0; i < n; i += V::size()) {
    const int64_t m = std::min<int64_t>(V::size(), n - i);
    const V va = V::loadu(a + i, m), vc = V::loadu(c + i, m), d = va - vc;
    const V e = vexp(-d.abs());
    (V::blendv(one, e, d >= V(T(0))) / (one + e)).store(w + i, m);
    if constexpr (std::is_same_v<T, float>) {
      (at::vec::maximum(va, vc) + log1p_unit(e)).store(a + i, m);
    } else {
      (at::vec::maximum(va, vc) + e.log1p()).store(a + i, m);
    }
  }
}

}  // namespace
