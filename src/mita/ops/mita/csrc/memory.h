// The kernels' outputs and scratch in memory kept for reuse: freed blocks stay mapped, so the next
// call's output and buffers do not fault their pages in again.
// Part of the fused MiTA CPU kernel (fused_cpu.cpp, one translation unit; see README.md here).

#pragma once

#include "common.h"

#include <ATen/EmptyTensor.h>
#include <ATen/native/TensorFactories.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#if __has_include(<pthread.h>)
#include <pthread.h>
#endif

namespace {

// glibc maps a block above its mmap threshold (at most 32 MiB) anew on every allocation and gives it
// back when it is freed, and trims the top of its heap: a large output's first write then faults once
// per 4 KiB page, 1-2 us a page on the VMs measured (8 ms of a 66 ms forward at N = 16,384). SDPA's
// calls are long enough not to notice; MiTA's are not. So the outputs the kernels make (out,
// v~, the log-sum-exps, dq, dk, dv; blocks of at least kMinBlock bytes) come from this allocator:
// a freed block is kept for the next request of its size (rounded to whole pages), up to a limit
// in all (MITA_CPU_CACHE_MB MiB, default 256, read at the first output; fused.empty_cache() gives
// the blocks back). It is PyTorch's CUDA caching allocator's idea on CPU, for these tensors only:
// the process's allocator is left as the user set it. Blocks come from c10::alloc_cpu, as torch's
// own CPU tensors do (its alignment, THP_MEM_ALLOC_ENABLE), and the profiler's memory events see each
// tensor's bytes as torch's allocator reports them (a kept block is not a tensor's: reported freed).
class KeptBlocks final : public c10::Allocator {
 public:
  static constexpr size_t kMinBlock = size_t(1) << 18, kPage = 4096;

  // Never destroyed: a tensor may be freed after static destructors ran (at exit).
  static KeptBlocks& get() {
    static KeptBlocks* blocks = [] {
      auto* b = new KeptBlocks(limit_from_env());
#if __has_include(<pthread.h>)
      // A child forked while another thread held the lock would wait on it for ever: it starts empty.
      pthread_atfork(nullptr, nullptr, [] { new (&get().mutex_) std::mutex(); get().free_.clear(); get().held_ = 0; });
#endif
      return b;
    }();
    return *blocks;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBlock) return c10::GetCPUAllocator()->allocate(n);
    void* p = take(n);
    c10::profiledCPUMemoryReporter().New(p, n);
    return {p, new Block{p, n}, &KeptBlocks::release, c10::Device(c10::DeviceType::CPU)};
  }
  // n bytes: under kMinBlock from c10::alloc_cpu, else whole pages, a kept block of that size if any.
  void* take(size_t n) {
    if (n < kMinBlock) return c10::alloc_cpu(n);
    const size_t size = pages(n);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = free_.find(size);
      if (it != free_.end()) {
        void* p = it->second.back();
        it->second.pop_back();
        if (it->second.empty()) free_.erase(it);
        held_ -= size;
        return p;
      }
    }
    trim(size);  // a size not kept: room for it first (the shapes changed)
    return c10::alloc_cpu(size);
  }
  // Gives back p = take(n): kept for the next request of its size, or freed (small, or over the limit).
  void give(void* p, size_t n) {
    if (n >= kMinBlock) {
      const size_t size = pages(n);
      std::lock_guard<std::mutex> lock(mutex_);
      if (held_ + size <= limit_) {
        free_[size].push_back(p);
        held_ += size;
        return;
      }
    }
    c10::free_cpu(p);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // Sets the limit in bytes (0: keep nothing) and frees the blocks over it; returns {kept bytes, limit}.
  std::pair<size_t, size_t> set_limit(std::optional<size_t> bytes) {
    if (bytes) {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_ = *bytes;
    }
    trim(0);
    std::lock_guard<std::mutex> lock(mutex_);
    return {held_, limit_};
  }

 private:
  explicit KeptBlocks(size_t limit) : limit_(limit) {}

  static size_t limit_from_env() {
    const char* env = std::getenv("MITA_CPU_CACHE_MB");
    const std::string value = env && *env ? env : "256";  // (unset or empty: the default)
    const bool digits = !value.empty() && value.size() <= 12 &&
                        std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
    TORCH_CHECK(digits, "MITA_CPU_CACHE_MB='", value, "': use a whole number of MiB >= 0 (0 keeps no freed output)");
    return size_t(std::stoull(value)) << 20;
  }

  static size_t pages(size_t n) { return (n + kPage - 1) / kPage * kPage; }

  struct Block {
    void* p;
    size_t bytes;
  };

  static void release(void* ctx) {
    const Block b = *static_cast<Block*>(ctx);
    delete static_cast<Block*>(ctx);
    c10::profiledCPUMemoryReporter().Delete(b.p);
    get().give(b.p, b.bytes);
  }
  // Frees kept blocks, the largest first, until `room` more bytes fit under the limit.
  void trim(size_t room) {
    std::vector<void*> spill;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (held_ > 0 && held_ + room > limit_) {
        auto it = std::prev(free_.end());
        spill.push_back(it->second.back());
        held_ -= it->first;
        it->second.pop_back();
        if (it->second.empty()) free_.erase(it);
      }
    }
    for (void* p : spill) c10::free_cpu(p);
  }

  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;  // kept blocks by size
  size_t held_ = 0, limit_;
};

// at::empty through KeptBlocks; NaN-filled (integers: their maximum) under torch's deterministic
// mode with fill_uninitialized_memory, as at::empty is.
at::Tensor kept_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::detail::empty_generic(sizes, &KeptBlocks::get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                           c10::typeMetaToScalarType(options.dtype()), std::nullopt);
  if (at::globalContext().deterministicAlgorithms() && at::globalContext().deterministicFillUninitializedMemory())
    at::native::fill_empty_deterministic_(t);
  return t;
}

// The kernels' scratch buffers (std::vector<T, Kept<T>>, as Buffer<T>): a buffer of kMinBlock bytes
// or more comes from KeptBlocks and goes back to it, so a call's scratch does not fault its pages in
// again either (bfloat16 products at N = 4,096: 232 faults a forward; scratch is not reported to the
// profiler, as a std::vector's is not). Smaller ones from c10::alloc_cpu (64-byte aligned).
template <typename T>
struct Kept {
  using value_type = T;
  Kept() = default;
  template <typename U>
  Kept(const Kept<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(KeptBlocks::get().take(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { KeptBlocks::get().give(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const Kept<U>&) const { return true; }
};
template <typename T>
using Buffer = std::vector<T, Kept<T>>;
}  // namespace
