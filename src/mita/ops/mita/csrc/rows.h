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
// 64 columns at a time are summed in registers over the bin's tokens (C vectors: 8 with AVX2, 4 with
// AVX-512); the sum in memory, a load and a store around each token's add, was 5.5% of the forward
// at N = 197 (Zen 3). Columns past the last multiple of 64 take the vector-at-a-time loop.
template <typename T, typename In>
void pool_head(const In* Qx, int64_t st, int64_t m, int64_t D, Bins bins, T* Lx) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size(), C = std::max<int64_t>(1, 64 / W);
  const int64_t whole = D / (C * W) * (C * W);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t p0 = bins.offsets[i], p1 = bins.offsets[i + 1];
    const V n(static_cast<T>(p1 - p0));
    T* l = Lx + i * D;
    for (int64_t d0 = 0; d0 < whole; d0 += C * W) {
      V acc[C];
      for (int64_t c = 0; c < C; ++c) acc[c] = V(T(0));
      for (int64_t p = p0; p < p1; ++p) {
        const In* row = Qx + bins.tokens[p] * st + d0;
        for (int64_t c = 0; c < C; ++c) acc[c] = acc[c] + load_as<T>(row + c * W);
      }
      for (int64_t c = 0; c < C; ++c) (acc[c] / n).store(l + d0 + c * W);
    }
    for (int64_t d = whole; d < D; d += W) {
      const int64_t cnt = std::min<int64_t>(W, D - d);
      V acc(T(0));
      for (int64_t p = p0; p < p1; ++p) acc = acc + load_as<T>(Qx + bins.tokens[p] * st + d, cnt);
      (acc / n).store(l + d, cnt);
    }
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
