// One-query (decode) attention straight out of the slot KV cache, for XLA:CPU.
//
// Legend: B rows, H query heads, K kv heads, G = H / K query heads per kv head, L layers,
// S slots, T slot capacity, D head dim, n live keys of a row; paged: NP pages of P tokens,
// MP pages per row.
//
// Why a kernel: XLA:CPU runs this op pattern far below the machine's read bandwidth (it
// materialises each row's gathered [K, T, D] keys and values and attends the whole
// power-of-two span of the longest row). Here every (row, kv head) pair reads its slot's
// first n keys and values exactly once, in place in the stacked [L, S, K, T, D] cache, for
// all G query heads of its group, and the pairs are spread over XLA's intra-op threads.
//
// The same kernel reads a paged cache (`treegrpo_jax/model/paged_cache.py`, [L, K, NP, P, D]
// pages of P tokens and a page table per row): a row's keys are then the first n rows of its
// pages in table order. The slot cache is the one-page case (P = T, the page is the slot), so
// both layouts share every line below except how a (layer, page, kv head) finds its rows.
//
// Math is f32 whatever the stored dtype (f32 or bf16); softmax is two-pass (max, then
// exp-sum), exp is a vectorisable polynomial with ~1 ulp error. The XLA path in
// `treegrpo_jax/model/decode_attention.py` is the reference this kernel is tested against.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using treegrpo::Load;
using treegrpo::Store;

constexpr int64_t kMaxHeadDim = 256;

struct Problem {
  const float* q;        // [B, H, D]
  const void* k;         // slots [L, S, K, T, D] or pages [L, K, NP, P, D]
  const void* v;         // the same layout as k
  const int32_t* pages;  // [B, MP] each row's pages in order (slots: MP = 1, the slot); out of range: padding
  const int32_t* lens;   // [B]; keys attended (clipped to [0, MP·P])
  float* out;            // [B, H, D]
  int64_t layer, B, H, K, D;
  int64_t P, MP, NP;     // tokens per page, pages per row, pages in the pool
  int64_t layer_stride, page_stride, head_stride;  // elements between layers / pages / kv heads
  float scale;

  int64_t Base(int64_t page, int64_t kh) const {
    return layer * layer_stride + page * page_stride + kh * head_stride;
  }
  bool RowValid(int64_t b) const {  // a padding row's first page is out of range
    const int64_t first = pages[b * MP];
    return first >= 0 && first < NP;
  }
};

// One (row, kv head) pair: G query heads against n keys of one slot. kD / kG > 0 fix the head
// dim and group size at compile time (the common shapes), so q and the accumulators stay in
// registers; 0 reads them from the problem.
template <typename KV, int64_t kD, int64_t kG>
void AttendPair(const Problem& p, int64_t b, int64_t kh, std::vector<float>& scratch) {
  const int64_t D = kD > 0 ? kD : p.D;
  const int64_t G = kG > 0 ? kG : p.H / p.K;
  float* out = p.out + (b * p.H + kh * G) * D;
  const int64_t n = std::clamp<int64_t>(p.lens[b], 0, p.MP * p.P);
  if (!p.RowValid(b) || n == 0) {
    std::fill(out, out + G * D, 0.0f);
    return;
  }
  const KV* k_base = static_cast<const KV*>(p.k);
  const KV* v_base = static_cast<const KV*>(p.v);
  const int32_t* row_pages = p.pages + b * p.MP;
  const float* q = p.q + (b * p.H + kh * G) * D;
  scratch.resize(static_cast<size_t>(G * n));
  float* scores = scratch.data();  // [G, n]
  // Cache lines per key row; the value rows are prefetched while the keys are read, so both
  // streams are in flight at once (one stream per core leaves DRAM bandwidth unused).
  constexpr int64_t kLine = 64 / sizeof(KV);
  for (int64_t t0 = 0; t0 < n; t0 += p.P) {  // one page at a time (the slot cache: one page)
    const int64_t base = p.Base(row_pages[t0 / p.P], kh);
    const KV* keys = k_base + base;
    const KV* values = v_base + base;
    const int64_t m = std::min(p.P, n - t0);
    for (int64_t u = 0; u < m; ++u) {
      const KV* __restrict kt = keys + u * D;
      for (int64_t off = 0; off < D; off += kLine) {
        __builtin_prefetch(values + u * D + off, 0, 0);
        __builtin_prefetch(kt + 32 * D + off, 0, 0);  // (past a page's end: harmless)
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* __restrict qg = q + g * D;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qg[d] * Load(kt, d);
        scores[g * n + t0 + u] = acc * p.scale;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict s = scores + g * n;
    const float m = treegrpo::MaxOf(s, n);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = treegrpo::ExpNonPositive(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
  // Weighted sum of values: one pass over V for all G heads, accumulators in registers.
  float acc[(kG > 0 ? kG : 1) * (kD > 0 ? kD : 1)];
  std::vector<float> heap;
  float* a = acc;
  if (kG == 0 || kD == 0) {
    heap.assign(G * D, 0.0f);
    a = heap.data();
  } else {
    std::fill(acc, acc + G * D, 0.0f);
  }
  for (int64_t t0 = 0; t0 < n; t0 += p.P) {
    const KV* values = v_base + p.Base(row_pages[t0 / p.P], kh);
    const int64_t m = std::min(p.P, n - t0);
    for (int64_t u = 0; u < m; ++u) {
      const KV* __restrict vt = values + u * D;
      for (int64_t g = 0; g < G; ++g) {
        const float wt = scores[g * n + t0 + u];
        float* __restrict ag = a + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += wt * Load(vt, d);
      }
    }
  }
  std::copy(a, a + G * D, out);
}

template <typename KV, int64_t kD>
void AttendPairAnyG(const Problem& p, int64_t b, int64_t kh, std::vector<float>& scratch) {
  switch (p.H / p.K) {
    case 1: return AttendPair<KV, kD, 1>(p, b, kh, scratch);
    case 2: return AttendPair<KV, kD, 2>(p, b, kh, scratch);
    case 3: return AttendPair<KV, kD, 3>(p, b, kh, scratch);  // SmolLM2, Llama-3.2-3B
    case 4: return AttendPair<KV, kD, 4>(p, b, kh, scratch);
    case 7: return AttendPair<KV, kD, 7>(p, b, kh, scratch);  // Qwen2.5-7B
    case 8: return AttendPair<KV, kD, 8>(p, b, kh, scratch);
    default: return AttendPair<KV, kD, 0>(p, b, kh, scratch);
  }
}

template <typename KV>
void AttendPairAnyD(const Problem& p, int64_t b, int64_t kh, std::vector<float>& scratch) {
  switch (p.D) {  // fixed head dims let the compiler unroll and vectorise the dot products
    case 32: return AttendPairAnyG<KV, 32>(p, b, kh, scratch);
    case 64: return AttendPairAnyG<KV, 64>(p, b, kh, scratch);
    case 128: return AttendPairAnyG<KV, 128>(p, b, kh, scratch);
    default: return AttendPair<KV, 0, 0>(p, b, kh, scratch);
  }
}

// Writes row b's new key and value of kv head kh at its position (if any), then attends.
template <typename KV>
void WriteThenAttend(const Problem& p, const float* k_new, const float* v_new, const int32_t* write_pos,
                     int64_t b, int64_t kh, std::vector<float>& scratch) {
  const int64_t pos = write_pos[b];
  const int64_t page = pos >= 0 && pos < p.MP * p.P ? p.pages[b * p.MP + pos / p.P] : -1;
  if (page >= 0 && page < p.NP) {
    const int64_t at = p.Base(page, kh) + (pos % p.P) * p.D;
    const int64_t from = (b * p.K + kh) * p.D;
    Store(static_cast<KV*>(const_cast<void*>(p.k)) + at, k_new + from, p.D);
    Store(static_cast<KV*>(const_cast<void*>(p.v)) + at, v_new + from, p.D);
  }
  AttendPairAnyD<KV>(p, b, kh, scratch);
}

// The cache results alias the cache operands (input_output_aliases in the caller): the new
// key and value are written in place and the pool is never copied. `paged` = 0: slots
// [L, S, K, T, D] with `pages` = [B, 1] slot ids; 1: pages [L, K, NP, P, D] and a page table
// [B, MP] per row.
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                           ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k_in, ffi::AnyBuffer v_in,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                           ffi::Buffer<ffi::S32> write_pos, ffi::Buffer<ffi::S32> lengths,
                           ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k,
                           ffi::Result<ffi::AnyBuffer> v, float scale, int32_t paged) {
  const auto qd = q.dimensions();
  const auto kd = k->dimensions();
  const auto pd = pages.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "decode_attention: q must be [B, H, D], k/v 5-D (slots or pages), the page table [B, MP]");
  }
  if (k->element_type() != v->element_type() || v->dimensions().size() != 5 ||
      (k->element_type() != ffi::F32 && k->element_type() != ffi::BF16)) {
    return ffi::Error::InvalidArgument("decode_attention: k and v must both be float32 or bfloat16");
  }
  for (size_t i = 0; i < 5; ++i) {
    if (kd[i] != v->dimensions()[i]) return ffi::Error::InvalidArgument("decode_attention: k/v shapes differ");
  }
  if (k->untyped_data() != k_in.untyped_data() || v->untyped_data() != v_in.untyped_data()) {
    return ffi::Error::Internal("decode_attention: the cache results must alias the cache operands");
  }
  Problem p;
  p.B = qd[0], p.H = qd[1], p.D = qd[2];
  p.MP = pd[1];
  if (paged) {  // [L, K, NP, P, D]
    p.K = kd[1], p.NP = kd[2], p.P = kd[3];
    p.head_stride = p.NP * p.P * p.D, p.page_stride = p.P * p.D, p.layer_stride = p.K * p.head_stride;
  } else {  // [L, S, K, T, D]: a slot is one page of T tokens
    p.NP = kd[1], p.K = kd[2], p.P = kd[3];
    if (p.MP != 1) return ffi::Error::InvalidArgument("decode_attention: the slot cache takes one page per row");
    p.head_stride = p.P * p.D, p.page_stride = p.K * p.head_stride, p.layer_stride = p.NP * p.page_stride;
  }
  if (kd[4] != p.D || p.H % p.K != 0 || pd[0] != p.B || lengths.element_count() != p.B ||
      write_pos.element_count() != p.B || k_new.element_count() != p.B * p.K * p.D ||
      v_new.element_count() != p.B * p.K * p.D) {
    return ffi::Error::InvalidArgument("decode_attention: inconsistent q / cache / pages / lengths shapes");
  }
  p.layer = layer.typed_data()[0];
  if (p.layer < 0 || p.layer >= kd[0]) return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  if (p.D > kMaxHeadDim) return ffi::Error::InvalidArgument("decode_attention: head dim above 256");
  p.q = q.typed_data();
  p.k = k->untyped_data();
  p.v = v->untyped_data();
  p.pages = pages.typed_data();
  p.lens = lengths.typed_data();
  p.out = out->typed_data();
  p.scale = scale;
  const bool bf16 = k->element_type() == ffi::BF16;
  const float* kn = k_new.typed_data();
  const float* vn = v_new.typed_data();
  const int32_t* wp = write_pos.typed_data();
  // One work item per (row, kv head): its keys and values are read once for the whole group.
  treegrpo::ParallelFor(pool, p.B * p.K, [&](int64_t i) {
    thread_local std::vector<float> scratch;
    const int64_t b = i / p.K, kh = i % p.K;
    if (bf16) {
      WriteThenAttend<uint16_t>(p, kn, vn, wp, b, kh, scratch);
    } else {
      WriteThenAttend<float>(p, kn, vn, wp, b, kh, scratch);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreegrpoDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // new keys [B, K, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // new values [B, K, D]
                                  .Arg<ffi::AnyBuffer>()          // k cache (slots or pages)
                                  .Arg<ffi::AnyBuffer>()          // v cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages [B, MP] (out of range: padding)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // write positions [B] (>= MP·P: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // keys attended [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [B, H, D]
                                  .Ret<ffi::AnyBuffer>()          // k cache, aliased
                                  .Ret<ffi::AnyBuffer>()          // v cache, aliased
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("paged"));
