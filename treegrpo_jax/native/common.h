// Helpers shared by the CPU kernels: a vectorisable exp and a parallel loop on XLA's pool.
#ifndef TREEGRPO_NATIVE_COMMON_H_
#define TREEGRPO_NATIVE_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace treegrpo {

// The stored K/V dtypes: f32, or bf16 as the high half of an f32 (uint16_t).
inline float Load(const float* p, int64_t i) { return p[i]; }
inline float Load(const uint16_t* p, int64_t i) {  // bf16: the high half of an f32
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// f32 -> bf16 with round-to-nearest-even, as XLA's convert (NaN stays a quiet NaN).
inline uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline void Store(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void Store(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = ToBf16(src[i]);
}

// exp(x) for x <= 0 (scores minus their max): Cephes' expf polynomial after range reduction
// by ln 2, written without branches so the compiler vectorises the loop that calls it.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// max / min of x[0..n), n > 0. Sixteen running lanes written as elementwise selects: GCC keeps a
// float max/min *reduction* scalar (NaN ordering), but vectorises the elementwise form.
inline float MaxOf(const float* x, int64_t n) {
  float lane[16];
  for (int j = 0; j < 16; ++j) lane[j] = x[0];
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) lane[j] = lane[j] < x[i + j] ? x[i + j] : lane[j];
  }
  float m = x[0];
  for (int j = 0; j < 16; ++j) m = m < lane[j] ? lane[j] : m;
  for (; i < n; ++i) m = m < x[i] ? x[i] : m;
  return m;
}

inline float MinOf(const float* x, int64_t n) {
  float lane[16];
  for (int j = 0; j < 16; ++j) lane[j] = x[0];
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) lane[j] = x[i + j] < lane[j] ? x[i + j] : lane[j];
  }
  float m = x[0];
  for (int j = 0; j < 16; ++j) m = lane[j] < m ? lane[j] : m;
  for (; i < n; ++i) m = x[i] < m ? x[i] : m;
  return m;
}

// Runs fn(i) for i in [0, n) on the calling thread and the pool's threads, items handed out
// one at a time (rows have ragged costs). The state is shared: a task that starts after all
// items are done (its thread was busy) finds nothing left and touches only that state, so the
// caller waits for the work to be finished, never for a task to start.
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct State {
    explicit State(Fn f, int64_t total) : fn(std::move(f)), total(total) {}
    Fn fn;
    int64_t total;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    void Work() {
      int64_t finished = 0;
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total; ++finished) fn(i);
      if (finished) done.fetch_add(finished, std::memory_order_release);
    }
  };
  if (n <= 0) return;
  auto state = std::make_shared<State>(std::move(fn), n);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->Work(); });
  state->Work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace treegrpo

#endif  // TREEGRPO_NATIVE_COMMON_H_
