// Selection: the streaming top-k of a row (ties to the lower index) and the grouping of queries by expert.
// Part of the fused MiTA CPU kernel (fused_cpu.cpp, one translation unit; see README.md here).

#pragma once

#include "vec.h"

namespace {

// A signed integer key with the order of the floating-point values (-0 as +0; NaN of either sign
// at an end). The least key, INT_MIN, marks padded keys: real ones are clamped above it.
inline int32_t order_key(float f) {
  f += 0.0f;  // -0 + 0 = +0: equal scores must tie, as in torch.topk
  int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return std::max(i >= 0 ? i : i ^ 0x7fffffff, std::numeric_limits<int32_t>::min() + 1);
}
inline int64_t order_key(double f) {
  f += 0.0;
  int64_t i;
  std::memcpy(&i, &f, sizeof i);
  return std::max(i >= 0 ? i : i ^ 0x7fffffffffffffff, std::numeric_limits<int64_t>::min() + 1);
}

#if defined(CPU_CAPABILITY_AVX2)
// For each 8-bit mask, the lanes it selects, in order, as 8 bytes (then zeros): the permute that packs them.
constexpr auto kCompress8 = [] {
  std::array<uint64_t, 256> t{};
  for (int m = 0; m < 256; ++m)
    for (int l = 0, at = 0; l < 8; ++l)
      if (m >> l & 1) t[m] |= uint64_t(l) << (8 * at++);
  return t;
}();
#endif

#if defined(CPU_CAPABILITY_AVX512)
// Whether any of the 16 keys at u is above t.
inline bool above(const int32_t* u, int32_t t) {
  return _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(u), _mm512_set1_epi32(t)) != 0;
}
// The lanes `keep` of the 16 keys u and of their indices ix, packed to the front of kp and ip by one
// compress each (whole vectors stored); returns how many.
inline int64_t pack16(__m512i u, __m512i ix, __mmask16 keep, int32_t* kp, int32_t* ip) {
  _mm512_storeu_si512(kp, _mm512_maskz_compress_epi32(keep, u));
  _mm512_storeu_si512(ip, _mm512_maskz_compress_epi32(keep, ix));
  return __builtin_popcount(keep);
}
// The 16 keys at u above t, and their indices (first, first + 1, ...), packed into kp and ip.
inline int64_t pack_above(const int32_t* u, int32_t first, int32_t t, int32_t* kp, int32_t* ip) {
  const __m512i v = _mm512_loadu_si512(u);
  const __m512i ix = _mm512_add_epi32(_mm512_set1_epi32(first),
                                      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return pack16(v, ix, _mm512_cmpgt_epi32_mask(v, _mm512_set1_epi32(t)), kp, ip);
}
#elif defined(CPU_CAPABILITY_AVX2)
// The lanes of the 8 keys u above t, and of their indices ix: one permute from kCompress8 packs
// them to the front of kp and ip (whole vectors stored); returns how many.
inline int64_t pack8(__m256i u, __m256i ix, __m256i t, int32_t* kp, int32_t* ip) {
  const int bits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(u, t)));
  const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kCompress8.data() + bits)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(kp), _mm256_permutevar8x32_epi32(u, perm));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(ip), _mm256_permutevar8x32_epi32(ix, perm));
  return __builtin_popcount(bits);
}
inline bool above(const int32_t* u, int32_t t) {
  const __m256i vt = _mm256_set1_epi32(t);
  const __m256i a = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)), vt);
  const __m256i b = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 8)), vt);
  return !_mm256_testz_si256(_mm256_or_si256(a, b), _mm256_or_si256(a, b));
}
inline int64_t pack_above(const int32_t* u, int32_t first, int32_t t, int32_t* kp, int32_t* ip) {
  const __m256i vt = _mm256_set1_epi32(t), ix = _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const int64_t a = pack8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)), ix, vt, kp, ip);
  return a + pack8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 8)), _mm256_add_epi32(ix, _mm256_set1_epi32(8)),
                   vt, kp + a, ip + a);
}
#endif

// Top-k of one row, streamed block by block, by threshold selection: keys above the current
// k-th best join a candidate buffer, which is cut back to its k best when full (and at the
// end). The cut finds the k-th largest key by bisection on its bits, each step one vectorised
// count, so a row costs a few passes over its keys and no unpredictable branches; once the
// buffer holds good keys, most chunks of a long row are skipped by one vector comparison.
// Ties keep the lower index (candidates stay in index order).
template <typename T>
struct TopK {
  using S = std::conditional_t<std::is_same_v<T, float>, int32_t, int64_t>;
  using U = std::make_unsigned_t<S>;
  static constexpr S kPadded = std::numeric_limits<S>::min();
  S* key;          // cap candidates' keys, in index order (and room to pad to whole vectors)
  int32_t* index;  // and their key indices
  int64_t k = 0, cap = 0, size = 0;
  S floor = kPadded;  // a candidate needs a key above it

  // Offer keys j0 .. j0+n-1 with scores x; `real` (or null) marks the keys that take part.
  // `scratch` holds n keys.
  void offer(const T* x, int64_t n, int64_t j0, const bool* real, S* scratch) {
    // A row's first keys with room for them all (every key of a short row): each one a candidate,
    // written once (171 -> 58 ns for 197 keys, Zen 3); the cut keeps the same k either way.
    if (floor == kPadded && !real && size + n <= cap) {
      for (int64_t j = 0; j < n; ++j) {
        key[size + j] = order_key(x[j]);
        index[size + j] = static_cast<int32_t>(j0 + j);
      }
      size += n;
      return;
    }
    for (int64_t j = 0; j < n; ++j) scratch[j] = order_key(x[j]);
    if (real)
      for (int64_t j = 0; j < n; ++j) scratch[j] = real[j] ? scratch[j] : kPadded;
    constexpr int64_t W = 16;
    int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if constexpr (sizeof(S) == 4)  // whole chunks: the keys above the floor packed by vector permutes
      for (; c + W <= n; c += W) {
        if (!above(scratch + c, floor)) continue;  // the common case once the buffer holds good keys
        if (size + W > cap) cut();                 // full: keep the k best, raising the floor
        size += pack_above(scratch + c, static_cast<int32_t>(j0 + c), floor, key + size, index + size);
      }
#endif
    for (; c < n; c += W) {
      const int64_t e = std::min(n, c + W);
      S top = kPadded, low = std::numeric_limits<S>::max();
      for (int64_t j = c; j < e; ++j) {
        top = std::max(top, scratch[j]);
        low = std::min(low, scratch[j]);
      }
      if (top <= floor) continue;  // the common case once the buffer holds good keys
      if (size + W > cap) cut();   // full: keep the k best, raising the floor
      if (low > floor) {           // every key of the chunk is a candidate (a row's first keys)
        std::copy(scratch + c, scratch + e, key + size);
        for (int64_t j = c; j < e; ++j) index[size + j - c] = static_cast<int32_t>(j0 + j);
        size += e - c;
        continue;
      }
      S* const kp = key;
      int32_t* const ip = index;
      const S lo = floor;
      int64_t sz = size;
      for (int64_t j = c; j < e; ++j) {
        kp[sz] = scratch[j];
        ip[sz] = static_cast<int32_t>(j0 + j);
        sz += scratch[j] > lo;
      }
      size = sz;
    }
  }

  // How many of the n keys are >= t; kp holds padded keys up to a whole number of vectors.
  static int64_t count_at_least(const S* kp, int64_t n, S t) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (sizeof(S) == 4) {  // masks counted, no vector summed: 2-4% off the forward at N = 197, 1,025
      const __m512i vt = _mm512_set1_epi32(t);
      int64_t count = 0;
      for (int64_t i = 0; i < n; i += 16)
        count += __builtin_popcount(_mm512_cmpge_epi32_mask(_mm512_loadu_si512(kp + i), vt));
      return count;
    }
#endif
    using V = Vectorized<S>;
    constexpr int64_t L = V::size();
    const V vt(t);
    // Four sums, so that the adds' latency is not one chain (a cut of 197 keys 569 -> 389 ns, Zen 3).
    V a0(S(0)), a1(S(0)), a2(S(0)), a3(S(0));
    int64_t i = 0;
    for (; i + 4 * L <= n; i += 4 * L) {
      a0 = a0 - (V::loadu(kp + i) >= vt);  // true lanes are -1
      a1 = a1 - (V::loadu(kp + i + L) >= vt);
      a2 = a2 - (V::loadu(kp + i + 2 * L) >= vt);
      a3 = a3 - (V::loadu(kp + i + 3 * L) >= vt);
    }
    for (; i < n; i += L) a0 = a0 - (V::loadu(kp + i) >= vt);
    S lanes[L];
    ((a0 + a1) + (a2 + a3)).store(lanes);
    return std::accumulate(lanes, lanes + L, int64_t(0));
  }

  // Keep the k best candidates, in index order; `floor` becomes the least kept key.
  void cut() {
    if (size <= k) return;
    S* const kp = key;
    int32_t* const ip = index;
    const int64_t n = size;
    std::fill(kp + n, kp + whole_vectors<S>(n), kPadded);
    // The k-th largest key, bit by bit from the top in the unsigned order (u = key ^ min).
    U tau = 0;
    int64_t at_least = n;  // keys >= tau's key
    for (int bit = 8 * sizeof(U) - 1; bit >= 0; --bit) {
      const U t = tau | (U(1) << bit);
      const int64_t c = count_at_least(kp, n, static_cast<S>(t ^ U(kPadded)));
      if (c >= k) {
        tau = t;
        at_least = c;
        if (c == k) break;  // exactly k keys >= t: they are the k best
      }
    }
    const S th = static_cast<S>(tau ^ U(kPadded));
    int64_t kept = 0;
    S least = std::numeric_limits<S>::max();
    if (at_least == k) {  // the common case: exactly the keys >= th (branch-free, as which survive is data-dependent)
      int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (sizeof(S) == 4) {  // 16 at a time: the survivors of each vector packed by one compress
        const __m512i vth = _mm512_set1_epi32(th);
        __m512i low = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
        for (; i + 16 <= n; i += 16) {  // kept <= i: the stores reach no key not yet loaded
          const __m512i u = _mm512_loadu_si512(kp + i), ix = _mm512_loadu_si512(ip + i);
          const __mmask16 keep = _mm512_cmpge_epi32_mask(u, vth);
          low = _mm512_mask_min_epi32(low, keep, low, u);
          kept += pack16(u, ix, keep, kp + kept, ip + kept);
        }
        least = _mm512_reduce_min_epi32(low);
      }
#elif defined(CPU_CAPABILITY_AVX2)
      // 8 at a time: each vector's survivors packed by one permute from a table (the scalar loop took
      // about as long as the cut's counts: a cut 1.5x faster at n = 197, 2.0x at 1,025, Zen 3)
      if constexpr (sizeof(S) == 4) {
        const __m256i vth = _mm256_set1_epi32(th - 1);  // th > INT_MIN: padded keys are never kept
        const __m256i vmax = _mm256_set1_epi32(std::numeric_limits<int32_t>::max());
        __m256i low = vmax;
        for (; i + 8 <= n; i += 8) {  // kept <= i: the stores reach no key not yet loaded
          const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + i));
          const __m256i ix = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ip + i));
          low = _mm256_min_epi32(low, _mm256_blendv_epi8(vmax, u, _mm256_cmpgt_epi32(u, vth)));
          kept += pack8(u, ix, vth, kp + kept, ip + kept);
        }
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), low);
        least = *std::min_element(lanes, lanes + 8);
      }
#endif
      for (; i < n; ++i) {
        const S u = kp[i];
        const bool keep = u >= th;
        kp[kept] = u;
        ip[kept] = ip[i];
        kept += keep;
        least = std::min(least, keep ? u : least);
      }
    } else {  // keys equal to th beyond the k-th: the first ones (lower indices) stay
      int64_t ties = k - (at_least - std::count(kp, kp + n, th));
      for (int64_t i = 0; i < n; ++i) {
        const S u = kp[i];
        const bool tie = u == th, keep = u > th || (tie && ties > 0);
        ties -= tie & keep;
        kp[kept] = u;
        ip[kept] = ip[i];
        kept += keep;
        least = std::min(least, keep ? u : least);
      }
    }
    size = kept;
    floor = least;
  }

  // The kept key indices, best first (like torch.topk(sorted=True)), into out. Candidates are in
  // index order, so a key's place is the number of greater keys plus the number of equal keys before
  // it: k^2 comparisons, vectorised and branch-free, with the candidates as the lanes and each key in
  // turn broadcast (no horizontal sums). They beat a sort's mispredicted branches at the k of vision
  // and LRA models (an insertion sort was a fifth of the top-k phase at k = 49; packed 64-bit
  // (key, index) compares took 2.2x these lanes' time at k = 25, Zen 3); a sort above 256.
  void sorted_indices(int64_t* out) {
    cut();
    if constexpr (sizeof(S) == 4) {
      if (size <= 256) {
        using V = Vectorized<int32_t>;
        constexpr int64_t L = V::size();
        const int64_t n = size;
        std::fill(key + n, key + whole_vectors<S>(n), kPadded);
        int32_t place[L];
        for (int64_t i0 = 0; i0 < n; i0 += L) {
          const V ki = V::loadu(key + i0), iv = V::arange(static_cast<int32_t>(i0), 1);
          V c0(0), c1(0);  // two sums: two chains in flight
          int64_t j = 0;
          for (; j + 2 <= n; j += 2) {
            const V k0(key[j]), k1(key[j + 1]), j0(static_cast<int32_t>(j)), j1(static_cast<int32_t>(j + 1));
            c0 = c0 - ((k0 > ki) | ((k0 == ki) & (iv > j0)));  // true lanes are -1
            c1 = c1 - ((k1 > ki) | ((k1 == ki) & (iv > j1)));
          }
          if (j < n) {
            const V k0(key[j]), j0(static_cast<int32_t>(j));
            c0 = c0 - ((k0 > ki) | ((k0 == ki) & (iv > j0)));
          }
          (c0 + c1).store(place);
          for (int64_t l = 0; l < std::min(L, n - i0); ++l) out[place[l]] = index[i0 + l];
        }
        return;
      }
      std::vector<uint64_t> packed(size);  // higher = better: key, then the lower index
      for (int64_t i = 0; i < size; ++i)
        packed[i] = (uint64_t(uint32_t(key[i]) ^ 0x80000000u) << 32) | (0xffffffffu - uint32_t(index[i]));
      std::sort(packed.begin(), packed.end(), std::greater<>());
      for (int64_t i = 0; i < size; ++i) out[i] = 0xffffffffu - uint32_t(packed[i]);
    } else {
      std::vector<std::pair<S, int32_t>> v(size);
      for (int64_t i = 0; i < size; ++i) v[i] = {key[i], -index[i]};
      std::sort(v.begin(), v.end(), std::greater<>());
      for (int64_t i = 0; i < size; ++i) out[i] = -v[i].second;
    }
  }
};

// Counting sort of one head's (query, route) pairs by expert: members[start[e] .. start[e + 1])
// holds t * s + j for each query t routed to expert e as its j-th route, in query order.
// Padded queries take no part.
void group_by_expert(const int64_t* routes, const bool* qm, int64_t Nq, int64_t s, int64_t m, int64_t* start,
                     int64_t* members) {
  std::fill(start, start + m + 1, 0);
  for (int64_t t = 0; t < Nq; ++t)
    if (!qm || qm[t])
      for (int64_t j = 0; j < s; ++j) ++start[routes[t * s + j] + 1];
  for (int64_t e = 0; e < m; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start, start + m);
  for (int64_t t = 0; t < Nq; ++t)
    if (!qm || qm[t])
      for (int64_t j = 0; j < s; ++j) members[fill[routes[t * s + j]]++] = t * s + j;
}

}  // namespace
