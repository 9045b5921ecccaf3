// Where the rows of q, k, v lie (any layout with contiguous rows) and landmark pooling by bins.
// Part of the fused MiTA CPU kernel (fused_cpu.cpp, one translation unit; see README.md here).

#pragma once

#include "vec.h"

namespace {

// Where the rows of a (B, H, N, D) tensor lie: element (b, h, t, d) at b * sb + h * sh + t * st + d.
// The kernels read q, k, v, out and dout in any such layout (a timm block's q, k, v are views of
// one qkv buffer; the output is written as (B, N, H, D), ready for the projection), so the
// layers pass them without copies.
struct Rows {
  int64_t sb = 0, sh = 0, st = 0;
  explicit Rows(const at::Tensor& t) : sb(t.stride(0)), sh(t.stride(1)), st(t.stride(2)) {}
  // Every head's rows at the same place, st apart (one head's rows in scratch).
  explicit Rows(int64_t st_) : st(st_) {}
  int64_t head(int64_t b, int64_t h) const { return b * sb + h * sh; }
};

// Landmark pooling (step 1) as bins: bin i holds tokens[offsets[i] .. offsets[i + 1]), each bin
// a mean of its tokens' rows (the adaptive-pooling bins, built once per shape in pooling.py).
struct Bins {
  const int64_t* offsets = nullptr;  // m + 1
  const int64_t* tokens = nullptr;
  explicit operator bool() const { return offsets != nullptr; }
};

// Lx[i] = mean of Qx[t] over the tokens t of bin i (summed in token order, then divided, as
// adaptive_avg_pool does), in T whatever Qx's type (half-precision rows converted a vector at a time).
template <typename T, typename In>
void pool_head(const In* Qx, int64_t st, int64_t m, int64_t D, Bins bins, T* Lx) {
  using V = Vectorized<T>;
  for (int64_t i = 0; i < m; ++i) {
    T* l = Lx + i * D;
    std::fill(l, l + D, T(0));
    for (int64_t p = bins.offsets[i]; p < bins.offsets[i + 1]; ++p) {
      const In* row = Qx + bins.tokens[p] * st;
      for (int64_t d = 0; d < D; d += V::size()) {
        const int64_t n = std::min<int64_t>(V::size(), D - d);
        (V::loadu(l + d, n) + load_as<T>(row + d, n)).store(l + d, n);
      }
    }
    const T n = static_cast<T>(bins.offsets[i + 1] - bins.offsets[i]);
    for (int64_t d = 0; d < D; ++d) l[d] /= n;
  }
}

// The transpose of pool_head: dQx[t] += dLx[i] / |bin i| for the tokens t of bin i.
template <typename T>
void unpool_head(const T* dLx, int64_t m, int64_t D, Bins bins, T* dQx) {
  for (int64_t i = 0; i < m; ++i) {
    const T w = T(1) / static_cast<T>(bins.offsets[i + 1] - bins.offsets[i]);
    for (int64_t p = bins.offsets[i]; p < bins.offsets[i + 1]; ++p) {
      T* row = dQx + bins.tokens[p] * D;
      for (int64_t d = 0; d < D; ++d) row[d] += w * dLx[i * D + d];
    }
  }
}

}  // namespace
