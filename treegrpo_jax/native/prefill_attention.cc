// Chunked-prefill attention straight out of the KV cache, for XLA:CPU: a ragged chunk of new
// tokens per row is written in place into the row's sequence, and every new token attends
// the row's keys up to and including itself (causal), reading each row's *live* keys only.
//
// Legend: N tokens of the call (all rows' chunks, concatenated; padding at the end), R rows,
// H query heads, K kv heads, G = H / K, D head dim, L layers; slots [L, S, K, T, D] or pages
// [L, K, NP, P, D] with a page table [R, MP] per row (a slot is one page of T tokens).
//
// Why a kernel: the XLA path pads every row to the chunk bucket and attends a power-of-two
// span of the longest row (rows x chunk x span), through gathers, scatters and transposes that
// XLA:CPU runs far below its matmul rate (measured: a 32-row x 72-token append at offset 200
// spent ~170 of its ~240 ms on attention over the padded span). Here the tokens are flat (no
// chunk padding) and each (row, kv head, tile of 16 queries) reads the row's keys once for the
// whole tile, as an outer product with the queries in the vector lanes.
//
// Math is f32 whatever the stored dtype; softmax is two-pass per query (max, then exp-sum), keys
// a query may not see get exactly zero weight. The reference is the decoder's XLA append path
// (`Decoder.append` with kernels=xla), which `tests/model/test_prefill_attention.py` holds it to.

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

constexpr int64_t kLanes = 16;  // queries per tile: one AVX-512 register of f32, two of AVX2
constexpr int64_t kMaxHeadDim = 256;
constexpr float kMasked = -3.0e38f;

struct Problem {
  const float* q;            // [N, H, D]
  const float* k_new;        // [N, K, D]
  const float* v_new;        // [N, K, D]
  void* k;                   // the cache, updated in place
  void* v;
  const int32_t* pages;      // [R, MP]; out of range: no page
  const int32_t* row_start;  // [R + 1]: row r's tokens are [row_start[r], row_start[r + 1])
  const int32_t* offsets;    // [R]: keys the row held before this chunk
  float* out;                // [N, H, D]
  int64_t layer, N, R, H, K, D;
  int64_t P, MP, NP;
  int64_t layer_stride, page_stride, head_stride;
  float scale;

  int64_t Base(int64_t page, int64_t kh) const {
    return layer * layer_stride + page * page_stride + kh * head_stride;
  }
  // Page holding position `pos` of row r, or -1 (no page / past the row's capacity).
  int64_t PageOf(int64_t r, int64_t pos) const {
    if (pos < 0 || pos >= MP * P) return -1;
    const int64_t page = pages[r * MP + pos / P];
    return page >= 0 && page < NP ? page : -1;
  }
  int64_t Tokens(int64_t r) const { return std::max<int64_t>(0, row_start[r + 1] - row_start[r]); }
};

// Phase 1: row r's new keys and values of kv head kh, at positions offset .. offset + n - 1.
template <typename KV>
void WriteRow(const Problem& p, int64_t r, int64_t kh) {
  const int64_t n = p.Tokens(r);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = p.offsets[r] + j;
    const int64_t page = p.PageOf(r, pos);
    if (page < 0) continue;  // dropped, as the XLA scatter drops out-of-range writes
    const int64_t at = p.Base(page, kh) + (pos % p.P) * p.D;
    const int64_t from = ((p.row_start[r] + j) * p.K + kh) * p.D;
    Store(static_cast<KV*>(p.k) + at, p.k_new + from, p.D);
    Store(static_cast<KV*>(p.v) + at, p.v_new + from, p.D);
  }
}

// Phase 2: queries [q0, q0 + kLanes) of row r's tokens x G heads of kv head kh (query i is
// token i / G, head kh * G + i % G) against the row's keys 0 .. offset + last token.
template <typename KV, int64_t kD>
void AttendTile(const Problem& p, int64_t r, int64_t kh, int64_t q0, std::vector<float>& scratch) {
  const int64_t D = kD > 0 ? kD : p.D;
  const int64_t G = p.H / p.K;
  const int64_t nq = std::min(kLanes, p.Tokens(r) * G - q0);
  const int64_t first = p.row_start[r];
  const int64_t offset = p.offsets[r];
  // Keys visible to each lane: offset + token + 1 (lanes past nq see none).
  int64_t limit[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) limit[l] = l < nq ? offset + (q0 + l) / G + 1 : 0;
  const int64_t n = limit[nq - 1];  // the tile's last query sees the most keys
  auto out_of = [&](int64_t l) { return p.out + ((first + (q0 + l) / G) * p.H + kh * G + (q0 + l) % G) * D; };
  bool valid = true;
  for (int64_t t0 = 0; t0 < n && valid; t0 += p.P) valid = p.PageOf(r, t0) >= 0;
  if (!valid) {  // a row without pages for its keys: zeros, as for padding
    for (int64_t l = 0; l < nq; ++l) std::fill(out_of(l), out_of(l) + D, 0.0f);
    return;
  }
  // The tile's queries transposed, [D, lanes], pre-scaled: a key row then updates every lane's
  // score with one broadcast-multiply-add per dimension.
  alignas(64) float qt[kMaxHeadDim * kLanes];
  std::fill(qt, qt + D * kLanes, 0.0f);  // lanes past nq stay zero
  for (int64_t l = 0; l < nq; ++l) {
    const float* ql = p.q + (out_of(l) - p.out);  // q and out share the [N, H, D] layout
    for (int64_t d = 0; d < D; ++d) qt[d * kLanes + l] = ql[d] * p.scale;
  }
  scratch.resize(static_cast<size_t>(n * kLanes));
  float* s = scratch.data();  // [n, lanes]
  const KV* k_base = static_cast<const KV*>(p.k);
  const KV* v_base = static_cast<const KV*>(p.v);
  for (int64_t t0 = 0; t0 < n; t0 += p.P) {
    const KV* keys = k_base + p.Base(p.PageOf(r, t0), kh);
    const int64_t m = std::min(p.P, n - t0);
    for (int64_t u = 0; u < m; ++u) {
      const KV* __restrict kt = keys + u * D;
      alignas(64) float acc[kLanes] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float kd = Load(kt, d);
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) acc[l] += qt[d * kLanes + l] * kd;
      }
      float* __restrict st = s + (t0 + u) * kLanes;
      const int64_t t = t0 + u;
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) st[l] = t < limit[l] ? acc[l] : kMasked;
    }
  }
  // Softmax per lane over t (vectorised across lanes); masked keys weigh exactly 0.
  alignas(64) float mx[kLanes], sum[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) mx[l] = kMasked, sum[l] = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    const float* st = s + t * kLanes;
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) mx[l] = mx[l] < st[l] ? st[l] : mx[l];
  }
  for (int64_t t = 0; t < n; ++t) {
    float* st = s + t * kLanes;
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      const float e = treegrpo::ExpNonPositive(st[l] - mx[l]);
      st[l] = t < limit[l] ? e : 0.0f;
      sum[l] += st[l];
    }
  }
  // Weighted values, accumulated transposed [D, lanes] like the scores.
  alignas(64) float ot[kMaxHeadDim * kLanes];
  std::fill(ot, ot + D * kLanes, 0.0f);
  for (int64_t t0 = 0; t0 < n; t0 += p.P) {
    const KV* values = v_base + p.Base(p.PageOf(r, t0), kh);
    const int64_t m = std::min(p.P, n - t0);
    for (int64_t u = 0; u < m; ++u) {
      const KV* __restrict vt = values + u * D;
      const float* __restrict w = s + (t0 + u) * kLanes;
      for (int64_t d = 0; d < D; ++d) {
        const float vd = Load(vt, d);
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) ot[d * kLanes + l] += w[l] * vd;
      }
    }
  }
  for (int64_t l = 0; l < nq; ++l) {
    float* o = out_of(l);
    const float inv = 1.0f / sum[l];
    for (int64_t d = 0; d < D; ++d) o[d] = ot[d * kLanes + l] * inv;
  }
}

template <typename KV>
void AttendTileAnyD(const Problem& p, int64_t r, int64_t kh, int64_t q0, std::vector<float>& scratch) {
  switch (p.D) {
    case 32: return AttendTile<KV, 32>(p, r, kh, q0, scratch);
    case 64: return AttendTile<KV, 64>(p, r, kh, q0, scratch);
    case 128: return AttendTile<KV, 128>(p, r, kh, q0, scratch);
    default: return AttendTile<KV, 0>(p, r, kh, q0, scratch);
  }
}

// `attend` = 0 writes the keys and values only (the last layer of a prefill whose hidden states
// nobody reads); its output is then zeros.
ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                            ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k_in, ffi::AnyBuffer v_in,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> attend,
                            ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> row_start,
                            ffi::Buffer<ffi::S32> offsets, ffi::ResultBuffer<ffi::F32> out,
                            ffi::Result<ffi::AnyBuffer> k, ffi::Result<ffi::AnyBuffer> v, float scale,
                            int32_t paged) {
  const auto qd = q.dimensions();
  const auto kd = k->dimensions();
  const auto pd = pages.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "prefill_attention: q must be [N, H, D], k/v 5-D (slots or pages), the page table [R, MP]");
  }
  if (k->element_type() != v->element_type() || v->dimensions().size() != 5 ||
      (k->element_type() != ffi::F32 && k->element_type() != ffi::BF16)) {
    return ffi::Error::InvalidArgument("prefill_attention: k and v must both be float32 or bfloat16");
  }
  for (size_t i = 0; i < 5; ++i) {
    if (kd[i] != v->dimensions()[i]) return ffi::Error::InvalidArgument("prefill_attention: k/v shapes differ");
  }
  if (k->untyped_data() != k_in.untyped_data() || v->untyped_data() != v_in.untyped_data()) {
    return ffi::Error::Internal("prefill_attention: the cache results must alias the cache operands");
  }
  Problem p;
  p.N = qd[0], p.H = qd[1], p.D = qd[2];
  p.R = pd[0], p.MP = pd[1];
  if (paged) {
    p.K = kd[1], p.NP = kd[2], p.P = kd[3];
    p.head_stride = p.NP * p.P * p.D, p.page_stride = p.P * p.D, p.layer_stride = p.K * p.head_stride;
  } else {
    p.NP = kd[1], p.K = kd[2], p.P = kd[3];
    if (p.MP != 1) return ffi::Error::InvalidArgument("prefill_attention: the slot cache takes one page per row");
    p.head_stride = p.P * p.D, p.page_stride = p.K * p.head_stride, p.layer_stride = p.NP * p.page_stride;
  }
  if (kd[4] != p.D || p.H % p.K != 0 || row_start.element_count() != p.R + 1 || offsets.element_count() != p.R ||
      k_new.element_count() != p.N * p.K * p.D || v_new.element_count() != p.N * p.K * p.D) {
    return ffi::Error::InvalidArgument("prefill_attention: inconsistent q / cache / pages / rows shapes");
  }
  p.layer = layer.typed_data()[0];
  if (p.layer < 0 || p.layer >= kd[0]) return ffi::Error::InvalidArgument("prefill_attention: layer out of range");
  if (p.D > kMaxHeadDim) return ffi::Error::InvalidArgument("prefill_attention: head dim above 256");
  const int32_t* rs = row_start.typed_data();
  for (int64_t r = 0; r < p.R; ++r) {
    if (rs[r] < 0 || rs[r + 1] < rs[r] || rs[r + 1] > p.N) {
      return ffi::Error::InvalidArgument("prefill_attention: row_start must be non-decreasing within [0, N]");
    }
  }
  p.q = q.typed_data();
  p.k_new = k_new.typed_data();
  p.v_new = v_new.typed_data();
  p.k = k->untyped_data();
  p.v = v->untyped_data();
  p.pages = pages.typed_data();
  p.row_start = rs;
  p.offsets = offsets.typed_data();
  p.out = out->typed_data();
  p.scale = scale;
  const bool bf16 = k->element_type() == ffi::BF16;
  treegrpo::ParallelFor(pool, p.R * p.K, [&](int64_t i) {
    if (bf16) {
      WriteRow<uint16_t>(p, i / p.K, i % p.K);
    } else {
      WriteRow<float>(p, i / p.K, i % p.K);
    }
  });
  const int64_t G = p.H / p.K;
  const int64_t done = p.R > 0 ? rs[p.R] : 0;
  if (!attend.typed_data()[0]) {
    std::fill(p.out, p.out + p.N * p.H * p.D, 0.0f);
    return ffi::Error::Success();
  }
  std::fill(p.out + done * p.H * p.D, p.out + p.N * p.H * p.D, 0.0f);  // padding tokens
  // Work items: (row, kv head, tile of kLanes queries), handed out one at a time, so ragged rows
  // balance over the threads.
  std::vector<int64_t> item_start(p.R + 1, 0);
  for (int64_t r = 0; r < p.R; ++r) {
    item_start[r + 1] = item_start[r] + p.K * ((p.Tokens(r) * G + kLanes - 1) / kLanes);
  }
  treegrpo::ParallelFor(pool, item_start[p.R], [&](int64_t i) {
    thread_local std::vector<float> scratch;
    const int64_t r = std::upper_bound(item_start.begin(), item_start.end(), i) - item_start.begin() - 1;
    const int64_t tiles = (p.Tokens(r) * G + kLanes - 1) / kLanes;
    const int64_t j = i - item_start[r];
    const int64_t kh = j / tiles, q0 = (j % tiles) * kLanes;
    if (bf16) {
      AttendTileAnyD<uint16_t>(p, r, kh, q0, scratch);
    } else {
      AttendTileAnyD<float>(p, r, kh, q0, scratch);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreegrpoPrefillAttention, PrefillAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [N, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // new keys [N, K, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // new values [N, K, D]
                                  .Arg<ffi::AnyBuffer>()          // k cache (slots or pages)
                                  .Arg<ffi::AnyBuffer>()          // v cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // attend [] (0: write only)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages [R, MP] (out of range: none)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_start [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // offsets [R]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [N, H, D]
                                  .Ret<ffi::AnyBuffer>()          // k cache, aliased
                                  .Ret<ffi::AnyBuffer>()          // v cache, aliased
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("paged"));
