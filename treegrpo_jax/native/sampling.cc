// Top-k / top-p (nucleus) sampling of one token per row in O(V), for XLA:CPU.
//
// Legend: B rows, V vocab, NB value bins.
//
// Same contract as `treegrpo_jax/rollout/sampling.py` (`_filtered_logits` + inverse CDF), the
// reference this kernel is tested against. A greedy row takes the first maximum of its logits.
// Otherwise, with `scaled` = logits / temperature and p its
// softmax, a row keeps the tokens whose value is >= max(kth, c), where kth is the k-th largest
// value (top-k) and c the smallest value v whose mass strictly above it, S(v), is < top_p (the
// token crossing top_p is kept, ties of a kept value are kept). It then draws by inverse CDF
// in vocabulary order with the row's one uniform number u: the first token whose cumulative
// kept probability exceeds u times the total.
//
// The reference sorts every row (V log V, and XLA:CPU's sort is slow: ~80 ms for 128 x 4096).
// Here both thresholds come from one histogram of the row's values over NB equal-width bins:
// the bin where the cumulative count reaches k, or the cumulative mass reaches top_p, holds the
// threshold, and only that bin's few tokens are ordered. Sums run in another order than the
// reference's sorted cumulative sum, so a token can differ only where u lands within float
// rounding of a cumulative-mass boundary. The log-prob of the chosen token under
// softmax(scaled) (unfiltered) comes out too: scaled[tok] - max - log(sum exp(scaled - max)).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBins = 256;
constexpr int64_t kBlock = 64;  // the inverse-CDF walk finds its block first, then its token

struct Row {
  const float* logits;  // [V]
  int64_t V;
  float temperature, top_p;
  int32_t top_k;
  bool greedy;
  float u;
};

struct Scratch {
  std::vector<float> x;        // scaled logits
  std::vector<float> e;        // exp(scaled - max), then zero outside the kept set
  std::vector<uint16_t> bin;   // value bin of each token (0: highest values)
  std::vector<float> members;  // values of the top-k threshold bin
  std::vector<std::pair<float, float>> weighted;  // (value, mass) of the top-p threshold bin
  std::vector<float> block;    // kept mass per block of kBlock tokens
};

// The value bin of every token: kBins equal widths over [lo, hi], highest first. Monotone in the
// value (rounding included), so ties share a bin and bin order is value order.
uint16_t* Bins(const float* x, int64_t V, float hi, float lo, Scratch& s) {
  const float inv_width = kBins / (hi - lo);
  s.bin.resize(V);
  uint16_t* bin = s.bin.data();
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) {
    bin[i] = static_cast<uint16_t>(std::min(static_cast<float>(kBins - 1), (hi - x[i]) * inv_width));
  }
  return bin;
}

// The top-p threshold c given the top-k one (kth; -inf when off); masses unnormalised.
float TopPThreshold(const float* x, const float* e, int64_t V, float hi, float lo, float kth, float target,
                    Scratch& s) {
  // c <= kth exactly when kth itself has less than top_p strictly above it: then kth decides.
  if (kth > -std::numeric_limits<float>::infinity()) {
    float above_kth = 0.0f;
#pragma omp simd reduction(+ : above_kth)
    for (int64_t i = 0; i < V; ++i) above_kth += x[i] > kth ? e[i] : 0.0f;
    if (above_kth < target) return kth;
  }
  uint16_t* bin = Bins(x, V, hi, lo, s);
  // Four interleaved histograms: consecutive tokens in one bin do not wait on each other.
  float mass[4][kBins] = {};
  int64_t i = 0;
  for (; i + 4 <= V; i += 4) {
    mass[0][bin[i]] += e[i];
    mass[1][bin[i + 1]] += e[i + 1];
    mass[2][bin[i + 2]] += e[i + 2];
    mass[3][bin[i + 3]] += e[i + 3];
  }
  for (; i < V; ++i) mass[0][bin[i]] += e[i];
  float above = 0.0f;
  int b = 0;
  for (; b < kBins - 1; ++b) {
    const float m = mass[0][b] + mass[1][b] + mass[2][b] + mass[3][b];
    if (!(above + m < target)) break;
    above += m;
  }
  // Every value in a bin before b has less than top_p strictly above it: the smallest of them
  // is valid (the largest value always is: nothing lies above it).
  float c = hi;
  s.weighted.clear();
  for (int64_t j = 0; j < V; ++j) {
    if (bin[j] < b) {
      c = std::min(c, x[j]);
    } else if (bin[j] == b) {
      s.weighted.emplace_back(x[j], e[j]);
    }
  }
  std::sort(s.weighted.begin(), s.weighted.end(), [](const auto& p, const auto& q) { return p.first > q.first; });
  // Walk the bin's values downwards; `above` is the mass strictly above the current value.
  for (size_t j = 0; j < s.weighted.size();) {
    const float v = s.weighted[j].first;
    if (!(above < target)) break;
    c = v;
    for (; j < s.weighted.size() && s.weighted[j].first == v; ++j) above += s.weighted[j].second;
  }
  return std::max(kth, c);
}

// The k-th largest value (0 < k < V) from a histogram of counts.
float KthLargest(const float* x, int64_t V, float hi, float lo, int32_t k, Scratch& s) {
  if (k == 1) return hi;
  uint16_t* bin = Bins(x, V, hi, lo, s);
  int64_t count[kBins] = {};
  for (int64_t i = 0; i < V; ++i) ++count[bin[i]];
  int64_t above = 0;
  int b = 0;
  while (above + count[b] < k) above += count[b++];
  s.members.clear();
  for (int64_t i = 0; i < V; ++i) {
    if (bin[i] == b) s.members.push_back(x[i]);
  }
  const int64_t nth = k - 1 - above;
  std::nth_element(s.members.begin(), s.members.begin() + nth, s.members.end(), std::greater<float>());
  return s.members[nth];
}

void SampleRow(const Row& r, Scratch& s, int32_t* token, float* logp, float* entropy) {
  const int64_t V = r.V;
  s.x.resize(V);
  s.e.resize(V);
  float* x = s.x.data();
  float* e = s.e.data();
  const float* raw = r.logits;
  const float temperature = r.temperature;
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) x[i] = raw[i] / temperature;  // a true division, as the reference's
  // Separate passes: a division and two reductions in one loop stay scalar.
  const float hi = treegrpo::MaxOf(x, V), lo = treegrpo::MinOf(x, V);
  // The normaliser in f64: near-one-hot rows add thousands of terms far below f32's spacing
  // at 1, which an f32 sum drops (log-prob errors of ~1e-5 against XLA's tree reduction).
  double zd = 0.0;
#pragma omp simd reduction(+ : zd)
  for (int64_t i = 0; i < V; ++i) {
    e[i] = treegrpo::ExpNonPositive(x[i] - hi);
    zd += e[i];
  }
  const float z = static_cast<float>(zd);
  // Entropy of the same distribution: log Z - Σ e·(x - hi) / Z (before filtering zeroes e).
  double wd = 0.0;
#pragma omp simd reduction(+ : wd)
  for (int64_t i = 0; i < V; ++i) wd += static_cast<double>(e[i]) * static_cast<double>(x[i] - hi);
  *entropy = static_cast<float>(std::log(zd) - wd / zd);
  int32_t tok = 0;
  if (r.greedy) {  // the first maximum of the raw logits (as argmax): a vector max, then a scan
    const float best = treegrpo::MaxOf(raw, V);
    while (tok < V - 1 && !(raw[tok] == best)) ++tok;
  } else {
    const bool use_k = r.top_k > 0 && r.top_k < V;
    const bool use_p = r.top_p < 1.0f;
    float threshold = -std::numeric_limits<float>::infinity();
    if (hi > lo) {
      if (use_k) threshold = KthLargest(x, V, hi, lo, r.top_k, s);
      if (use_p) threshold = TopPThreshold(x, e, V, hi, lo, threshold, r.top_p * z, s);
    }
    // Inverse CDF in vocabulary order over the kept tokens, unnormalised: first the block,
    // then the token within it.
    const int64_t nblocks = (V + kBlock - 1) / kBlock;
    s.block.resize(nblocks);
    float kept = 0.0f;
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t end = std::min(V, (blk + 1) * kBlock);
      float m = 0.0f;
#pragma omp simd reduction(+ : m)
      for (int64_t i = blk * kBlock; i < end; ++i) {
        e[i] = x[i] >= threshold ? e[i] : 0.0f;
        m += e[i];
      }
      s.block[blk] = m;
      kept += m;
    }
    const float target = r.u * kept;
    float run = 0.0f;
    int64_t blk = 0;
    while (blk < nblocks - 1 && !(run + s.block[blk] > target)) run += s.block[blk++];
    tok = static_cast<int32_t>(std::min(V, (blk + 1) * kBlock) - 1);  // rounding: the block's last
    for (int64_t i = blk * kBlock; i < std::min(V, (blk + 1) * kBlock); ++i) {
      run += e[i];
      if (run > target) {
        tok = static_cast<int32_t>(i);
        break;
      }
    }
    while (e[tok] == 0.0f && tok > 0) --tok;  // never a token outside the kept set
  }
  *token = tok;
  *logp = static_cast<float>(static_cast<double>(x[tok] - hi) - std::log(zd));
}

ffi::Error Sample(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                  ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::PRED> greedy,
                  ffi::Buffer<ffi::F32> u, ffi::ResultBuffer<ffi::S32> tokens,
                  ffi::ResultBuffer<ffi::F32> logps, ffi::ResultBuffer<ffi::F32> entropies) {
  // Any leading dims are rows (vmap adds one): [..., V] logits, [...] per-row arrays.
  const auto d = logits.dimensions();
  if (d.size() < 1 || d.back() <= 0) return ffi::Error::InvalidArgument("sample: logits must be [..., V], V > 0");
  const int64_t V = d.back(), B = logits.element_count() / V;
  for (int64_t n : {temperature.element_count(), top_p.element_count(), top_k.element_count(),
                    greedy.element_count(), u.element_count()}) {
    if (n != B) return ffi::Error::InvalidArgument("sample: per-row arrays must have B entries");
  }
  const float* xs = logits.typed_data();
  const float* ts = temperature.typed_data();
  const float* ps = top_p.typed_data();
  const int32_t* ks = top_k.typed_data();
  const bool* gs = greedy.typed_data();
  const float* us = u.typed_data();
  int32_t* out_tok = tokens->typed_data();
  float* out_logp = logps->typed_data();
  float* out_ent = entropies->typed_data();
  treegrpo::ParallelFor(pool, B, [&](int64_t b) {
    thread_local Scratch scratch;
    SampleRow(Row{xs + b * V, V, ts[b], ps[b], ks[b], gs[b], us[b]}, scratch, out_tok + b, out_logp + b,
              out_ent + b);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreegrpoSample, Sample,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [B, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [B] (> 0)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p [B] (>= 1: off)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // top_k [B] (0 or >= V: off)
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // greedy [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // u [B] in [0, 1)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // log-probs [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // entropies [B]
