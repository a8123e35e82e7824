// Routed-expert SwiGLU MLPs for a few tokens on x86 CPUs with AVX-512 (BF16 and VNNI), reading each weight once.
//
//   y[t] = sum_j w[t, j] * down[s] @ (silu(gate[s] @ x[t]) * (up[s] @ x[t])),   s = slots[t, j]
//
// Formats (runtime/quant.py writes them and documents the layouts):
//   bf16: gate_up [S, 2I, H] (gate rows first), down [S, H, I]; activations rounded to bf16, fp32 accumulation
//         (_mm512_dpbf16_ps), as torch's bf16 linear does.
//   int8: weights q (int8, symmetric) with one fp16 scale per group of G inputs: w = s * q.
//   int4: weights q (0..15, two per byte: byte b of each 64-input chunk holds input b in its low nibble and input
//         32 + b in its high nibble) with an fp16 scale and an fp16 minimum per group: w = s * q + m.
//   Quantized formats multiply in integers (_mm512_dpbusd_epi32): the activations are quantized to int8 with one
//   scale per 32 inputs (as llama.cpp's Q8_0 activations), so a result differs from the dequantized reference
//   by that rounding (the tests state the tolerance).
// Work is split with at::parallel_for (torch's intra-op threads): the up projection over (expert, row block), the
// down projection over output row blocks (each thread owns its outputs: no atomics).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t UP_ROWS = 16;    // rows of gate (and of up) per work item
constexpr int64_t DOWN_ROWS = 32;  // output rows per work item
// Software prefetch distances, per weight format: how far along a row (and on into the next rows) the weights are
// fetched ahead of where they are read. What suits one machine does not suit another (a host with half the memory
// bandwidth ran the integer kernels at half the fraction of it), so these are settings: `set_tuning` sets them,
// and cpu_kernels.py chooses them by a short measurement at first use on each machine, cached beside the build.
// 0 turns a format's software prefetch off. The defaults are what the first host measured best.
enum PfFormat { PF_BF16 = 0, PF_INT8 = 1, PF_INT4 = 2 };
int64_t g_pf_bytes[3] = {8192, 8192, 8192};
// Rows ahead whose scales and minimums the int4 group-32 kernels prefetch: streams beside the weights' that the
// hardware alone left cold (int4 g32 decode, 4 layers: 6.58 -> 6.11 ms at one thread, 5.16-5.44 -> 4.92 at two).
// 0: none. A setting too (`set_tuning`).
int64_t g_scale_pf = 16;

inline int64_t pf_bytes(int bits) { return g_pf_bytes[bits == 16 ? PF_BF16 : bits == 8 ? PF_INT8 : PF_INT4]; }

// The prefetch distance for rows read `step` rows at a time (each `row_bytes` long, consecutive in memory): a whole
// number of steps, at least the format's distance, so that every row of a later step is fetched at the offset being
// read (with the distance alone, rows of 4 KiB read 4 at a time had half of the next step's rows never prefetched).
// 0 where the format's prefetch is off.
inline int64_t pf_rows(int64_t step, int64_t row_bytes, int bits) {
  const int64_t d = pf_bytes(bits), s = step * row_bytes;
  return d <= 0 ? 0 : s * ((d + s - 1) / s);
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

inline uint16_t to_bf16(float f) {  // round to nearest even (no NaNs reach here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// The dots of one bf16 weight row with NT bf16 vectors `ldx` apart, fp32 accumulation (two accumulators per vector),
// each 32 weights loaded once for all of them: out[t] is bit for bit the one-vector dot of x + t * ldx (the same
// additions in the same order). With PF, the weights `pf` bytes ahead are fetched as it goes (rows read one after
// another: along this row and on into the next ones), for rows that come from memory slower than one vector's
// pace: the expert kernels' and a few tokens' linears. A few tokens' rows one at a time re-ran the row's loads and
// reductions per token, and linear_bf16 fell from 13.5 GB/s at one token to 5.3 at eight (lm_head 32768x2048:
// 10 -> 25 ms, torch: 12).
constexpr int DOT_TOKENS = 8;

template <int NT, bool PF>
inline void dot_bf16_n(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t n, int64_t pf, float* out) {
  __m512 a0[NT], a1[NT];
  for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    if (PF) {
      _mm_prefetch(reinterpret_cast<const char*>(w + i) + pf, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + i + 32) + pf, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + i + 32);
    for (int t = 0; t < NT; ++t) {
      a0[t] = _mm512_dpbf16_ps(a0[t], w0, (__m512bh)_mm512_loadu_si512(x + t * ldx + i));
      a1[t] = _mm512_dpbf16_ps(a1[t], w1, (__m512bh)_mm512_loadu_si512(x + t * ldx + i + 32));
    }
  }
  for (; i < n; i += 32) {
    const int64_t left = n - i;
    const __mmask32 m = left >= 32 ? 0xFFFFFFFFu : ((1u << left) - 1u);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i);
    for (int t = 0; t < NT; ++t)
      a0[t] = _mm512_dpbf16_ps(a0[t], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * ldx + i));
  }
  for (int t = 0; t < NT; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}

inline float dot_bf16(const uint16_t* w, const uint16_t* x, int64_t n) {
  float out;
  dot_bf16_n<1, false>(w, x, 0, n, 0, &out);
  return out;
}

inline float dot_bf16_pf(const uint16_t* w, const uint16_t* x, int64_t n, int64_t pf) {
  float out;
  dot_bf16_n<1, true>(w, x, 0, n, pf, &out);
  return out;
}

// dot_bf16_n for 1 <= nt <= DOT_TOKENS vectors: one vector as dot_bf16 (no prefetch), more with it (bf16's distance)
inline void dot_bf16_tokens(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t n, int64_t nt, float* out) {
  switch (nt) {
    case 1: dot_bf16_n<1, false>(w, x, ldx, n, 0, out); break;
    case 2: dot_bf16_n<2, true>(w, x, ldx, n, g_pf_bytes[PF_BF16], out); break;
    case 3: dot_bf16_n<3, true>(w, x, ldx, n, g_pf_bytes[PF_BF16], out); break;
    case 4: dot_bf16_n<4, true>(w, x, ldx, n, g_pf_bytes[PF_BF16], out); break;
    case 5: dot_bf16_n<5, true>(w, x, ldx, n, g_pf_bytes[PF_BF16], out); break;
    case 6: dot_bf16_n<6, true>(w, x, ldx, n, g_pf_bytes[PF_BF16], out); break;
    case 7: dot_bf16_n<7, true>(w, x, ldx, n, g_pf_bytes[PF_BF16], out); break;
    default: dot_bf16_n<8, true>(w, x, ldx, n, g_pf_bytes[PF_BF16], out); break;
  }
}

// (pair index p = t * k + j) grouped by slot: slot u's pairs are order[start[u] .. start[u + 1])
struct Groups {
  std::vector<int64_t> slot, start, order;
};

Groups group_pairs(const at::Tensor& slots) {
  auto s = slots.contiguous().to(at::kLong);
  const int64_t* p = s.data_ptr<int64_t>();
  const int64_t n = s.numel();
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(), [p](int64_t a, int64_t b) { return p[a] < p[b]; });
  Groups g;
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || p[idx[i]] != p[idx[i - 1]]) {
      g.slot.push_back(p[idx[i]]);
      g.start.push_back(i);
    }
    g.order.push_back(idx[i]);
  }
  g.start.push_back(n);
  return g;
}

void check_common(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& weights, int64_t n_slots) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a [T, H] CPU tensor");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == x.size(0), "slots must be [T, k]");
  TORCH_CHECK(weights.sizes() == slots.sizes(), "weights must be [T, k] like slots");
  if (slots.numel()) {
    auto mn = slots.min().item<int64_t>(), mx = slots.max().item<int64_t>();
    TORCH_CHECK(mn >= 0 && mx < n_slots, "slot index out of range [0, ", n_slots, "): ", mn, "..", mx);
  }
}

// ------------------------------------------------------------------------------------------------- bf16 ----------

at::Tensor swiglu_bf16(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& slots,
                       const at::Tensor& weights) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && down.scalar_type() == at::kBFloat16, "bf16 weights expected");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3, "gate_up [S, 2I, H] and down [S, H, I] expected");
  const int64_t T = x.size(0), H = x.size(1), K = slots.size(1), I = down.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(1) == H && down.size(0) == gate_up.size(0),
              "gate_up [S, 2I, H] and down [S, H, I] disagree with x [T, H]");
  TORCH_CHECK(gate_up.stride(2) == 1 && gate_up.stride(1) == H && down.stride(2) == 1 && down.stride(1) == I,
              "each slot's matrices must be contiguous");
  check_common(x, slots, weights, gate_up.size(0));
  auto xb = x.to(at::kBFloat16).contiguous();
  auto wf = weights.to(at::kFloat).contiguous();
  const Groups g = group_pairs(slots);
  const int64_t U = static_cast<int64_t>(g.slot.size()), P = T * K;
  auto a = at::empty({std::max<int64_t>(P, 1), I}, at::kBFloat16);
  auto y = at::zeros({T, H}, at::kFloat);
  if (P == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const uint16_t* gu = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  const uint16_t* dn = reinterpret_cast<const uint16_t*>(down.data_ptr());
  uint16_t* ap = reinterpret_cast<uint16_t*>(a.data_ptr());
  const float* wp = wf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t gus = gate_up.stride(0), dns = down.stride(0);
  const int64_t nb = (I + UP_ROWS - 1) / UP_ROWS;
  at::parallel_for(0, U * nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t it = b0; it < b1; ++it) {
      const int64_t u = it / nb, r0 = (it % nb) * UP_ROWS, r1 = std::min(I, r0 + UP_ROWS);
      const uint16_t* base = gu + g.slot[u] * gus;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t q = g.start[u]; q < g.start[u + 1]; ++q) {
          const int64_t p = g.order[q], t = p / K;
          const float gv = dot_bf16_pf(base + r * H, xp + t * H, H, g_pf_bytes[PF_BF16]);
          const float uv = dot_bf16_pf(base + (r + I) * H, xp + t * H, H, g_pf_bytes[PF_BF16]);
          ap[p * I + r] = to_bf16(silu(gv) * uv);
        }
      }
    }
  });
  const int64_t no = (H + DOWN_ROWS - 1) / DOWN_ROWS;
  // each thread owns a range of output rows and reads each slot's rows in it as one stream (slot by slot, so every
  // output adds its experts in slot order whatever the split)
  at::parallel_for(0, no, 1, [&](int64_t b0, int64_t b1) {
    const int64_t o0 = b0 * DOWN_ROWS, o1 = std::min(H, b1 * DOWN_ROWS);
    for (int64_t u = 0; u < U; ++u) {
      const uint16_t* base = dn + g.slot[u] * dns;
      for (int64_t o = o0; o < o1; ++o) {
        for (int64_t q = g.start[u]; q < g.start[u + 1]; ++q) {
          const int64_t p = g.order[q];
          yp[(p / K) * H + o] += wp[p] * dot_bf16_pf(base + o * I, ap + p * I, I, g_pf_bytes[PF_BF16]);
        }
      }
    }
  });
  return y;
}

// y [T, out] = x [T, in] @ w[out, in]^T (+ bias): the non-expert projections and the lm head of a decode step, bf16
// weights read once for all T tokens, fp32 accumulation.
// A linear layer's optional bias as contiguous fp32 (held by `keep`), or nullptr when there is none.
const float* bias_f32(const c10::optional<at::Tensor>& bias, int64_t O, const char* what, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == O, what, ": bias of the wrong size");
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_bf16: x [T, in], w [out, in] expected");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.stride(1) == 1, "linear_bf16: bf16 weights with contiguous rows");
  const int64_t T = x.size(0), N = w.size(1), O = w.size(0), ws = w.stride(0);
  auto xb = x.to(at::kBFloat16).contiguous();
  auto y = at::empty({T, O}, at::kFloat);
  at::Tensor bf;
  const float* bp = bias_f32(bias, O, "linear_bf16", bf);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  constexpr int64_t ROWS = 16;
  at::parallel_for(0, (O + ROWS - 1) / ROWS, 8, [&](int64_t b0, int64_t b1) {
    float acc[DOT_TOKENS];
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = b * ROWS; r < std::min(O, (b + 1) * ROWS); ++r)
        for (int64_t t0 = 0; t0 < T; t0 += DOT_TOKENS) {  // each weight row loaded once per DOT_TOKENS tokens
          const int64_t nt = std::min<int64_t>(DOT_TOKENS, T - t0);
          dot_bf16_tokens(wp + r * ws, xp + t0 * N, N, N, nt, acc);
          for (int64_t t = 0; t < nt; ++t) yp[(t0 + t) * O + r] = acc[t] + (bp ? bp[r] : 0.0f);
        }
  });
  return y;
}

// ------------------------------------------------------------------------------------------ int8 / int4 ----------

// One activation vector quantized for the integer dot: xq[n] int8 with one scale per 32 inputs, spread over the
// lanes of each 64-input step (lanes 0-7: block 2c, 8-15: block 2c + 1), and per weight group (G inputs) the sum of
// the quantized activations times their scales, so that
//   sum_i w_i x_i = sum_g s_g * sum_{b in g} xs_b * isum_b + sum_g m_g * gsum_g      (int8: m_g = -128 s_g).
// For int4 the activations are also kept in pairs of 64-input chunks (2c, 2c + 1), reordered to match one 64-byte
// load of packed weights: [chunk 2c inputs 0-31 | 2c+1 inputs 0-31 | 2c inputs 32-63 | 2c+1 inputs 32-63] (`q4`), with
// the lanes of the low and high halves (`lanes4`: [n / 128, 32]: blocks 4p, 4p+2, then 4p+1, 4p+3, eight lanes each),
// and the block scales in order (`d4`: [n / 32]). The high nibbles are read in place, masked with 0xF0 (16 q: one
// shift fewer per load), so the high half's scales in `lanes4` and the odd blocks' in `d4` carry a factor 1/16 (exact).
struct QAct {
  const int8_t* q;
  const float* lanes;  // [n / 64, 16]
  const float* gsum;   // [n / G]
  const int8_t* q4;    // [n / 128 * 128]
  const float* lanes4;
  const float* d4;     // [n / 32]
};

constexpr int64_t qact_floats(int64_t n) { return n / 64 * 16 + n / 32 + n / 128 * 32 + n / 32; }
constexpr int64_t qact_bytes(int64_t n) { return 2 * n; }

QAct quantize_act(const float* x, int64_t n, int64_t G, int8_t* q, float* f, bool pairs) {
  float* lanes = f;
  float* gsum = f + n / 64 * 16;
  const int64_t bpg = G / 32;
  std::fill(gsum, gsum + n / G, 0.0f);
  for (int64_t b = 0; b < n / 32; ++b) {
    const float* xb = x + b * 32;
    __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(v0)), _mm512_reduce_max_ps(_mm512_abs_ps(v1)));
    const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));  // nearest even
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
    for (int l = 0; l < 8; ++l) lanes[(b >> 1) * 16 + (b & 1) * 8 + l] = d;
    gsum[b / bpg] += d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
  int8_t* q4 = q + n;
  float* l4 = gsum + n / 32;
  float* d4 = l4 + n / 128 * 32;
  for (int64_t p = 0; pairs && p < n / 128; ++p) {  // (int4 reads them; int8 does not)
    const int8_t* a = q + p * 128;  // chunk 2p: a[0, 64), chunk 2p + 1: a[64, 128)
    int8_t* o = q4 + p * 128;
    std::memcpy(o, a, 32);
    std::memcpy(o + 32, a + 64, 32);
    std::memcpy(o + 64, a + 32, 32);
    std::memcpy(o + 96, a + 96, 32);
    for (int j = 0; j < 4; ++j) {  // block 4p + j: its scale, from the lanes of its chunk (odd blocks: the high
      const int64_t b = 4 * p + j;  // nibbles, read as 16 q: 1/16 of it)
      const float d = lanes[(b >> 1) * 16 + (b & 1) * 8] * ((j & 1) ? 0.0625f : 1.0f);
      float* dst = l4 + p * 32 + (j & 1) * 16 + (j >> 1) * 8;  // lo: blocks 4p, 4p+2; hi: 4p+1, 4p+3
      for (int l = 0; l < 8; ++l) dst[l] = d;
      d4[b] = d;
    }
  }
  return QAct{q, lanes, gsum, q4, l4, d4};
}

template <int BITS>
inline __m512i load_q(const uint8_t* w, int64_t c) {
  if constexpr (BITS == 8) {
    return _mm512_xor_si512(_mm512_loadu_si512(w + c * 64), _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    // the 32 bytes in both halves, the upper half shifted down a nibble, then the low nibbles: inputs 0-31, 32-63
    const __m512i p = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32)));
    return _mm512_and_si512(_mm512_mask_srli_epi16(p, 0xFFFF0000u, p, 4), _mm512_set1_epi8(0x0F));
  }
}

// int4, chunks 2p and 2p + 1 of one weight row against activations `xlo`/`xhi` (`QAct::q4`): the dots of the low
// nibbles (inputs 0-31 of both chunks) and of the high ones (inputs 32-63, masked in place: 16x their dot, which the
// high half's activation scales undo), as floats.
inline void pair_dots(const uint8_t* w, int64_t p, __m512i xlo, __m512i xhi, __m512& flo, __m512& fhi, int64_t pf) {
  _mm_prefetch(reinterpret_cast<const char*>(w + p * 64 + pf), _MM_HINT_T0);
  const __m512i pw = _mm512_loadu_si512(w + p * 64);
  flo = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(pw, _mm512_set1_epi8(0x0F)),
                                               xlo));
  fhi = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(
      _mm512_setzero_si512(), _mm512_and_si512(pw, _mm512_set1_epi8(static_cast<char>(0xF0))), xhi));
}

inline float vdot(const float* a, const float* b, int64_t n) {
  __m512 s = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s);
  }
  return _mm512_reduce_add_ps(s);
}

// R rows at once (sharing each activation load): n inputs (n % 64 == 0) of BITS-bit weights w[r] with per-group
// (G inputs, G % 32 == 0) fp32 scales sf[r] and (int4) minimums mf[r]; int8 weights are stored signed and read as
// unsigned (q + 128), their minimum being -128 * s. Each row is prefetched `pf` bytes ahead of where it is read.
template <int BITS, int R>
inline void dot_q(const uint8_t* const* w, const float* const* sf, const float* const* mf, int64_t n, int64_t G,
                  const QAct& x, float* out, int64_t pf) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t steps = n / 64, groups = n / G;
  int64_t c0 = 0;  // chunks done by the int4 pair loop
  if constexpr (BITS == 4) {
    // two 64-input chunks per 64-byte load: the low nibbles are inputs 0-31 of both chunks, the high nibbles
    // inputs 32-63 (the activations reordered to match, `QAct::q4`)
    const int64_t pairs = (G == 32 || G == 64 || G % 128 == 0) ? steps / 2 : 0;
    if (G == 32 || G == 64) {  // weight scales per 8 lanes: blocks 4p, 4p+2 | 4p+1, 4p+3 (G 32); groups 2p | 2p+1 (G 64)
      const __m512i ilo = G == 32 ? _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0)
                                  : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      const __m512i ihi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
      for (int64_t p = 0; p < pairs; ++p) {
        const __m512i xlo = _mm512_loadu_si512(x.q4 + p * 128), xhi = _mm512_loadu_si512(x.q4 + p * 128 + 64);
        const __m512 llo = _mm512_loadu_ps(x.lanes4 + p * 32), lhi = _mm512_loadu_ps(x.lanes4 + p * 32 + 16);
        const __m128 d4 = _mm_loadu_ps(x.d4 + 4 * p);  // the pair's four activation block scales
        for (int r = 0; r < R; ++r) {
          __m512 flo, fhi;
          pair_dots(w[r], p, xlo, xhi, flo, fhi, pf);
          if (G == 32) {  // weight x activation scale per block, one 128-bit multiply, then spread over the lanes
            const __m512 s4 = _mm512_castps128_ps512(_mm_mul_ps(_mm_loadu_ps(sf[r] + 4 * p), d4));
            acc[r] = _mm512_fmadd_ps(flo, _mm512_permutexvar_ps(ilo, s4), acc[r]);
            acc[r] = _mm512_fmadd_ps(fhi, _mm512_permutexvar_ps(ihi, s4), acc[r]);
          } else {  // both halves share the pair's two group scales
            const __m512 s2 = _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sf[r] + 2 * p))));
            const __m512 t = _mm512_fmadd_ps(fhi, lhi, _mm512_mul_ps(flo, llo));
            acc[r] = _mm512_fmadd_ps(t, _mm512_permutexvar_ps(ilo, s2), acc[r]);
          }
        }
      }
    } else if (pairs) {  // G / 128 pairs per group: the activation scales per lane, the weight scale once per group
      const int64_t ppg = G / 128;
      for (int64_t gi = 0; gi < groups; ++gi) {
        __m512 ga[R];
        for (int r = 0; r < R; ++r) ga[r] = _mm512_setzero_ps();
        for (int64_t p = gi * ppg; p < (gi + 1) * ppg; ++p) {
          const __m512i xlo = _mm512_loadu_si512(x.q4 + p * 128), xhi = _mm512_loadu_si512(x.q4 + p * 128 + 64);
          const __m512 llo = _mm512_loadu_ps(x.lanes4 + p * 32), lhi = _mm512_loadu_ps(x.lanes4 + p * 32 + 16);
          for (int r = 0; r < R; ++r) {
            __m512 flo, fhi;
            pair_dots(w[r], p, xlo, xhi, flo, fhi, pf);
            ga[r] = _mm512_fmadd_ps(fhi, lhi, _mm512_fmadd_ps(flo, llo, ga[r]));
          }
        }
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(ga[r], _mm512_set1_ps(sf[r][gi]), acc[r]);
      }
    }
    c0 = 2 * pairs;
  }
  if (c0 == steps) {
    // every chunk done above
  } else if (G == 32) {  // two groups per step: the weight scales of the step's two groups spread over the lanes
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t c = c0; c < steps; ++c) {
      const __m512i xv = _mm512_loadu_si512(x.q + c * 64);
      const __m512 xl = _mm512_loadu_ps(x.lanes + c * 16);
      for (int r = 0; r < R; ++r) {
        if (BITS == 8 || !(c & 1)) _mm_prefetch(reinterpret_cast<const char*>(w[r] + c * BITS * 8 + pf), _MM_HINT_T0);
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), load_q<BITS>(w[r], c), xv);
        const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sf[r] + 2 * c)));
        const __m512 ws = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ws, xl), acc[r]);
      }
    }
  } else {  // G / 64 steps per group: activation scales per lane inside the group, the weight scale once per group
    const int64_t spg = G / 64;
    for (int64_t gi = c0 / spg; gi < groups; ++gi) {  // (a pair loop leaves at most the last chunk, when G is 64)
      __m512 ga[R];
      for (int r = 0; r < R; ++r) ga[r] = _mm512_setzero_ps();
      for (int64_t c = gi * spg; c < (gi + 1) * spg; ++c) {
        const __m512i xv = _mm512_loadu_si512(x.q + c * 64);
        const __m512 xl = _mm512_loadu_ps(x.lanes + c * 16);
        for (int r = 0; r < R; ++r) {
          if (BITS == 8 || !(c & 1)) _mm_prefetch(reinterpret_cast<const char*>(w[r] + c * BITS * 8 + pf), _MM_HINT_T0);
          ga[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), load_q<BITS>(w[r], c), xv)),
                                  xl, ga[r]);
        }
      }
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(ga[r], _mm512_set1_ps(sf[r][gi]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    // stored minimums, or none (mf[r] null: `qrow`): int8's minimum is -128 s, symmetric int4's -8 s
    const float mins = mf[r] ? vdot(mf[r], x.gsum, groups)
                             : (BITS == 8 ? -128.0f : -8.0f) * vdot(sf[r], x.gsum, groups);
    out[r] = _mm512_reduce_add_ps(acc[r]) + mins;
  }
}

inline void half_row(const at::Half* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  for (; i < n; ++i) out[i] = static_cast<float>(h[i]);
}

// A quantized [S, R, n] matrix stack: q bytes [S, R, n * BITS / 8], scales (and int4 minimums) fp16 [S, R, n / G].
// Symmetric int4 has no minimums (m null): w = s (q - 8), llama.cpp's Q4_0.
struct QMat {
  const uint8_t* q;
  const at::Half* s;
  const at::Half* m;
  int64_t qs0, qs1, ss0, ss1;  // slot and row strides (elements)
};

// Row `row` of slot `s`: its packed bytes `w`, and its scales (and int4 minimums) converted to fp32 into `sc`
// (`mn`), `groups` of them; `mr` null where the format has no minimums.
template <int BITS>
inline void qrow(const QMat& m, int64_t s, int64_t row, int64_t groups, float* sc, float* mn, const uint8_t*& w,
                 const float*& sr, const float*& mr, bool pf_scales) {
  w = m.q + s * m.qs0 + row * m.qs1;
  if (BITS == 4 && pf_scales && g_scale_pf > 0) {  // int4 group 32 (a scale and a minimum per 16 bytes: a fifth of the bytes read)
    // prefetches the scales and minimums of the row g_scale_pf rows on, streams the hardware left cold; where they
    // are a sixteenth the extra instructions did not pay for int8 (int4 group 128 was not measured)
    const char* ps = reinterpret_cast<const char*>(m.s + s * m.ss0 + (row + g_scale_pf) * m.ss1);
    for (int64_t o = 0; o < groups * 2; o += 64) _mm_prefetch(ps + o, _MM_HINT_T0);
    if (m.m) {
      const char* pm = reinterpret_cast<const char*>(m.m + s * m.ss0 + (row + g_scale_pf) * m.ss1);
      for (int64_t o = 0; o < groups * 2; o += 64) _mm_prefetch(pm + o, _MM_HINT_T0);
    }
  }
  half_row(m.s + s * m.ss0 + row * m.ss1, groups, sc);
  if (BITS == 4 && m.m) half_row(m.m + s * m.ss0 + row * m.ss1, groups, mn);
  sr = sc;
  mr = (BITS == 4 && m.m) ? mn : nullptr;
}

QMat qmat(const at::Tensor& q, const at::Tensor& s, const c10::optional<at::Tensor>& m, int bits, int64_t rows,
          int64_t n, int64_t G, const char* what) {
  TORCH_CHECK(q.dim() == 3 && s.dim() == 3, what, ": q and scales must be [S, rows, ...]");
  TORCH_CHECK(q.scalar_type() == (bits == 8 ? at::kChar : at::kByte), what, ": q must be ", bits == 8 ? "int8" : "uint8");
  TORCH_CHECK(s.scalar_type() == at::kHalf, what, ": scales must be fp16");
  TORCH_CHECK(q.size(1) == rows && q.size(2) == n * bits / 8 && q.stride(2) == 1, what, ": q has the wrong shape");
  TORCH_CHECK(s.size(0) == q.size(0) && s.size(1) == rows && s.size(2) == n / G && s.stride(2) == 1, what,
              ": scales have the wrong shape");
  QMat r{reinterpret_cast<const uint8_t*>(q.data_ptr()), s.data_ptr<at::Half>(), nullptr, q.stride(0), q.stride(1),
         s.stride(0), s.stride(1)};
  if (bits == 4 && m.has_value()) {  // (none: symmetric int4)
    TORCH_CHECK(m->sizes() == s.sizes() && m->scalar_type() == at::kHalf && m->strides() == s.strides(),
                what, ": int4 minimums must be fp16, shaped and strided like the scales");
    r.m = m->data_ptr<at::Half>();
  }
  return r;
}

template <int BITS>
at::Tensor swiglu_q_impl(const at::Tensor& x, const QMat& gu, const QMat& dn, int64_t I, int64_t G,
                         const at::Tensor& slots, const at::Tensor& weights) {
  const int64_t T = x.size(0), H = x.size(1), K = slots.size(1), P = T * K;
  auto y = at::zeros({T, H}, at::kFloat);
  if (P == 0) return y;
  auto xf = x.to(at::kFloat).contiguous();
  auto wf = weights.to(at::kFloat).contiguous();
  const Groups g = group_pairs(slots);
  const int64_t U = static_cast<int64_t>(g.slot.size());
  std::vector<int8_t> xq(T * qact_bytes(H));  // the up projection's activations: one per token
  std::vector<float> xfl(T * qact_floats(H));
  std::vector<QAct> xa(T);
  for (int64_t t = 0; t < T; ++t)
    xa[t] = quantize_act(xf.data_ptr<float>() + t * H, H, G, xq.data() + t * qact_bytes(H),
                         xfl.data() + t * qact_floats(H), BITS == 4);
  std::vector<float> a(P * I);
  const int64_t nb = I / UP_ROWS;  // I % 64 == 0
  const int64_t gH = H / G, gI = I / G;
  const int64_t pf_up = pf_rows(2, H * BITS / 8, BITS), pf_dn = pf_rows(4, I * BITS / 8, BITS);  // rows read 2 (4) at a time
  at::parallel_for(0, U * nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> sc(4 * gH), mn(4 * gH);
    for (int64_t it = b0; it < b1; ++it) {
      const int64_t u = it / nb, r0 = (it % nb) * UP_ROWS, s = g.slot[u];
      for (int64_t r = r0; r < r0 + UP_ROWS; r += 2) {
        const int64_t rows[4] = {r, r + 1, r + I, r + I + 1};  // gate r, r + 1; up r, r + 1
        const uint8_t* wr[4];
        const float* sr[4];
        const float* mr[4];
        for (int j = 0; j < 4; ++j)
          qrow<BITS>(gu, s, rows[j], gH, sc.data() + j * gH, mn.data() + j * gH, wr[j], sr[j], mr[j], G == 32);
        for (int64_t q = g.start[u]; q < g.start[u + 1]; ++q) {
          const int64_t p = g.order[q];
          float o[4];
          dot_q<BITS, 4>(wr, sr, mr, H, G, xa[p / K], o, pf_up);
          a[p * I + r] = silu(o[0]) * o[2];
          a[p * I + r + 1] = silu(o[1]) * o[3];
        }
      }
    }
  });
  std::vector<int8_t> aq(P * qact_bytes(I));  // the down projection's activations: one per (token, choice)
  std::vector<float> afl(P * qact_floats(I));
  std::vector<QAct> aa(P);
  for (int64_t p = 0; p < P; ++p)
    aa[p] = quantize_act(a.data() + p * I, I, G, aq.data() + p * qact_bytes(I), afl.data() + p * qact_floats(I),
                         BITS == 4);
  const float* wp = wf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t no = H / DOWN_ROWS;  // H % 64 == 0
  at::parallel_for(0, no, 1, [&](int64_t b0, int64_t b1) {  // as in swiglu_bf16: a thread's rows, slot by slot
    std::vector<float> sc(4 * gI), mn(4 * gI);
    for (int64_t u = 0; u < U; ++u) {
      const int64_t s = g.slot[u];
      for (int64_t o = b0 * DOWN_ROWS; o < b1 * DOWN_ROWS; o += 4) {
        const uint8_t* wr[4];
        const float* sr[4];
        const float* mr[4];
        for (int j = 0; j < 4; ++j)
          qrow<BITS>(dn, s, o + j, gI, sc.data() + j * gI, mn.data() + j * gI, wr[j], sr[j], mr[j], G == 32);
        for (int64_t q = g.start[u]; q < g.start[u + 1]; ++q) {
          const int64_t p = g.order[q];
          float r4[4];
          dot_q<BITS, 4>(wr, sr, mr, I, G, aa[p], r4, pf_dn);
          float* yt = yp + (p / K) * H + o;
          for (int j = 0; j < 4; ++j) yt[j] += wp[p] * r4[j];
        }
      }
    }
  });
  return y;
}

at::Tensor swiglu_q(const at::Tensor& x, const at::Tensor& gu_q, const at::Tensor& gu_s,
                    const c10::optional<at::Tensor>& gu_m, const at::Tensor& dn_q, const at::Tensor& dn_s,
                    const c10::optional<at::Tensor>& dn_m, int64_t bits, int64_t group, const at::Tensor& slots,
                    const at::Tensor& weights) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, not ", bits);
  const int64_t H = x.size(1), I = dn_s.size(2) * group;
  TORCH_CHECK(group == 32 || (group >= 64 && group % 64 == 0), "group size must be 32 or a multiple of 64, not ", group);
  TORCH_CHECK(H % 64 == 0 && I % 64 == 0 && H % group == 0 && I % group == 0,
              "the integer kernels need hidden and intermediate sizes that are multiples of 64 and of the group size");
  check_common(x, slots, weights, gu_q.size(0));
  const QMat gu = qmat(gu_q, gu_s, gu_m, static_cast<int>(bits), 2 * I, H, group, "gate_up");
  const QMat dn = qmat(dn_q, dn_s, dn_m, static_cast<int>(bits), H, I, group, "down");
  TORCH_CHECK(dn_q.size(0) == gu_q.size(0), "gate_up and down have different slot counts");
  return bits == 8 ? swiglu_q_impl<8>(x, gu, dn, I, group, slots, weights)
                   : swiglu_q_impl<4>(x, gu, dn, I, group, slots, weights);
}

// A packed linear layer (the non-expert matrices of `expertcache quantize --linears true`): x [T, n] -> y [T, O]
// fp32, weights q [O, n * BITS / 8] with fp16 group scales (and int4 minimums) [O, n / G]; each token's activations
// quantized once, four rows per step sharing each activation load (a tail of O % 4 rows one at a time).
template <int BITS>
at::Tensor linear_q_impl(const at::Tensor& x, const QMat& w, int64_t O, int64_t G, const float* bp) {
  const int64_t T = x.size(0), N = x.size(1);
  auto y = at::empty({T, O}, at::kFloat);
  auto xf = x.to(at::kFloat).contiguous();
  std::vector<int8_t> xq(T * qact_bytes(N));
  std::vector<float> xfl(T * qact_floats(N));
  std::vector<QAct> xa(T);
  for (int64_t t = 0; t < T; ++t)
    xa[t] = quantize_act(xf.data_ptr<float>() + t * N, N, G, xq.data() + t * qact_bytes(N),
                         xfl.data() + t * qact_floats(N), BITS == 4);
  float* yp = y.data_ptr<float>();
  const int64_t gN = N / G, pf = pf_rows(4, N * BITS / 8, BITS);
  at::parallel_for(0, (O + 3) / 4, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> sc(4 * gN), mn(4 * gN);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * 4, nr = std::min<int64_t>(4, O - r0);
      const uint8_t* wr[4];
      const float* sr[4];
      const float* mr[4];
      for (int j = 0; j < nr; ++j)
        qrow<BITS>(w, 0, r0 + j, gN, sc.data() + j * gN, mn.data() + j * gN, wr[j], sr[j], mr[j], G == 32);
      for (int64_t t = 0; t < T; ++t) {
        float o[4];
        if (nr == 4) {
          dot_q<BITS, 4>(wr, sr, mr, N, G, xa[t], o, pf);
        } else {
          for (int j = 0; j < nr; ++j) dot_q<BITS, 1>(wr + j, sr + j, mr + j, N, G, xa[t], o + j, pf);
        }
        for (int j = 0; j < nr; ++j) yp[t * O + r0 + j] = o[j] + (bp ? bp[r0 + j] : 0.0f);
      }
    }
  });
  return y;
}

at::Tensor linear_q(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const c10::optional<at::Tensor>& m,
                    int64_t bits, int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 8 || bits == 4, "linear_q: bits must be 8 or 4, not ", bits);
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && s.dim() == 2, "linear_q: x [T, in], q [out, ...], scales [out, ...]");
  const int64_t N = x.size(1), O = q.size(0);
  TORCH_CHECK((group == 32 || (group >= 64 && group % 64 == 0)) && N % group == 0 && N % 64 == 0,
              "linear_q: the group size must be 32 or a multiple of 64, the input size a multiple of 64 and of it");
  const c10::optional<at::Tensor> m3 = m.has_value() ? c10::optional<at::Tensor>(m->unsqueeze(0)) : c10::nullopt;
  const QMat w = qmat(q.unsqueeze(0), s.unsqueeze(0), m3, static_cast<int>(bits), O, N, group, "linear_q");
  at::Tensor bf;
  const float* bp = bias_f32(bias, O, "linear_q", bf);
  return bits == 8 ? linear_q_impl<8>(x, w, O, group, bp) : linear_q_impl<4>(x, w, O, group, bp);
}

// ------------------------------------------------------------------------------------------- attention ----------
// One query token per (batch row, head) against a KV cache, the decode step's attention:
//   out[b, h] = sum_l softmax_l(scale * q[b, h] . k[b, h / R, l] + mask[b, l]) v[b, h / R, l],   R = Hq / Hkv
// q [B, Hq, D], k and v [B, Hkv, L, D] (rows of D contiguous, any other strides: the cache as it is), bf16 or fp32,
// mask optional fp32 [B, L] (additive: 0 or -inf). Each key and value row is read once for the R query heads that
// share it; scores, softmax and sums in fp32, the output rounded to q's dtype. A row whose keys are all masked
// gives zeros. torch's CPU scaled_dot_product_attention took 2.7 ms per layer for one bf16 query against 512 keys
// on this machine (its flash kernel tiles for many queries); this takes about 0.12 ms (4 key/value heads, 1 thread).

// exp for the softmax (its arguments <= 0): 2^n * p(f), f in [-ln2/2, ln2/2], a degree-6 polynomial (~2 ulp)
inline __m512 exp_ps(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);  // -inf (masked) and below: 0
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // (a NaN stays NaN: max returns its second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, f), f, _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// 16 elements (the first n of them under `m`, the rest zero) as fp32
template <typename T>
inline __m512 load16(const T* p, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {  // bf16: the 16 bits are a float's upper half
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
}

template <typename T>
inline void store16(T* p, __m512 v, int n) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
  } else {
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    uint16_t* u = reinterpret_cast<uint16_t*>(p);
    for (int i = 0; i < n; ++i) u[i] = to_bf16(f[i]);
  }
}

constexpr int ATT_MAX_D = 256, ATT_MAX_R = 16;
constexpr int64_t ATT_PF = 16;  // key / value rows prefetched ahead: a layer's cache comes from memory (each pass
                                // over a head's values after the first reads its other columns from L2)

inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}

// The horizontal sums of 8 vectors, one float each, in out[0..8): a shuffle-and-add tree (about 23 instructions
// where 8 separate reductions take about 80).
inline void sum8(const __m512* a, float* out) {
  __m512 x[4];
  for (int i = 0; i < 4; ++i)  // 128-bit blocks 0+2 and 1+3: a[2i] in the low half, a[2i + 1] in the high one
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  __m512 y[2];
  for (int i = 0; i < 2; ++i)  // block j of y[i]: 4 partial sums of a[4i + j]
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512 t = _mm512_add_ps(w, _mm512_permute_ps(w, 0xB1));  // block j: [a[j], a[j], a[4+j], a[4+j]]
  alignas(64) float f[16];
  _mm512_store_ps(f, t);
  for (int j = 0; j < 4; ++j) {
    out[j] = f[4 * j];
    out[4 + j] = f[4 * j + 2];
  }
}

template <typename T>
void attend_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* mask, double scale,
                 at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1), L = k.size(2), R = Hq / Hk;
  const int64_t C = (D + 15) / 16;  // 16-lane chunks of a head, the last one masked to D % 16 lanes
  auto lanes = [&](int64_t c) { return static_cast<int>(std::min<int64_t>(16, D - c * 16)); };
  auto mask16 = [&](int64_t c) { return static_cast<__mmask16>((1u << lanes(c)) - 1u); };
  const int64_t C2 = (D + 31) / 32;  // (bf16) 32-element chunks, the last one masked
  auto mask32 = [&](int64_t c) {
    const int64_t n = std::min<int64_t>(32, D - c * 32);
    return n == 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1u);
  };
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t kb = k.stride(0), kh = k.stride(1), kl = k.stride(2), vb = v.stride(0), vh = v.stride(1), vl = v.stride(2);
  const float sc_f = static_cast<float>(scale);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, B * Hk, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(R * L);
    std::vector<float> inv(R);
    alignas(64) __m512 qv[ATT_MAX_R][ATT_MAX_D / 16];
    alignas(64) __m512i qb[ATT_MAX_R][ATT_MAX_D / 32];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hk, h = i % Hk;
      const float* mb = mask ? mask + b * L : nullptr;
      const T* kr = kp + b * kb + h * kh;
      const T* vr = vp + b * vb + h * vh;
      // the R query heads that read this key/value head: fp32 and scaled, or (bf16) as they are, 32 per vector
      for (int64_t r = 0; r < R; ++r) {
        const T* qr = qp + (b * Hq + h * R + r) * D;
        if constexpr (std::is_same_v<T, float>) {
          for (int64_t c = 0; c < C; ++c) qv[r][c] = _mm512_mul_ps(load16(qr + c * 16, mask16(c)), _mm512_set1_ps(sc_f));
        } else {
          for (int64_t c = 0; c < C2; ++c) qb[r][c] = _mm512_maskz_loadu_epi16(mask32(c), qr + c * 32);
        }
      }
      // scores, 8 query heads at a time: each key row is loaded once per group and the 8 dots summed in one tree
      // (bf16: pairs of products in one instruction, _mm512_dpbf16_ps, then scaled)
      for (int64_t r0 = 0; r0 < R; r0 += 8) {
        const int64_t nr = std::min<int64_t>(8, R - r0);
        for (int64_t l = 0; l < L; ++l) {
          const T* krow = kr + l * kl;
          if (r0 == 0 && l + ATT_PF < L) prefetch_row(krow + ATT_PF * kl, row_bytes);  // from memory, ahead
          __m512 acc[8];
          for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
          if constexpr (std::is_same_v<T, float>) {
            for (int64_t c = 0; c < C; ++c) {
              const __m512 kc = load16(krow + c * 16, mask16(c));
              for (int64_t j = 0; j < nr; ++j) acc[j] = _mm512_fmadd_ps(qv[r0 + j][c], kc, acc[j]);
            }
          } else {
            for (int64_t c = 0; c < C2; ++c) {
              const __m512bh kc = (__m512bh)_mm512_maskz_loadu_epi16(mask32(c), krow + c * 32);
              for (int64_t j = 0; j < nr; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qb[r0 + j][c], kc);
            }
          }
          float s8[8];
          sum8(acc, s8);
          const float m = mb ? mb[l] : 0.0f;
          const float f = std::is_same_v<T, float> ? 1.0f : sc_f;
          for (int64_t j = 0; j < nr; ++j) sc[(r0 + j) * L + l] = s8[j] * f + m;
        }
      }
      for (int64_t r = 0; r < R; ++r) {  // softmax over the keys
        float* s = sc.data() + r * L;
        float mx = -INFINITY;
        for (int64_t l = 0; l < L; ++l) mx = std::max(mx, s[l]);
        if (mx == -INFINITY) {  // every key masked: the row reads zeros
          std::fill(s, s + L, 0.0f);
          inv[r] = 0.0f;
          continue;
        }
        __m512 tot = _mm512_setzero_ps();
        int64_t l = 0;
        for (; l + 16 <= L; l += 16) {
          const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + l), _mm512_set1_ps(mx)));
          _mm512_storeu_ps(s + l, e);
          tot = _mm512_add_ps(tot, e);
        }
        if (l < L) {
          const __mmask16 mk = static_cast<__mmask16>((1u << (L - l)) - 1u);
          const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + l), _mm512_set1_ps(mx)));
          _mm512_mask_storeu_ps(s + l, mk, e);
          tot = _mm512_add_ps(tot, _mm512_maskz_mov_ps(mk, e));
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(tot);
      }
      // the weighted sum of the values, 8 heads x 2 chunks of 16 at a time (16 accumulators in registers): each
      // pass reads its 32 columns of every value row once
      for (int64_t r0 = 0; r0 < R; r0 += 8) {
        const int64_t nr = std::min<int64_t>(8, R - r0);
        for (int64_t c0 = 0; c0 < C; c0 += 2) {
          const bool two = c0 + 1 < C;
          __m512 acc[8][2];
          for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
          for (int64_t l = 0; l < L; ++l) {
            const T* vrow = vr + l * vl;
            if (r0 == 0 && c0 == 0 && l + ATT_PF < L) prefetch_row(vrow + ATT_PF * vl, row_bytes);  // (later passes: L2)
            const __m512 v0 = load16(vrow + c0 * 16, mask16(c0));
            const __m512 v1 = two ? load16(vrow + (c0 + 1) * 16, mask16(c0 + 1)) : _mm512_setzero_ps();
            for (int64_t j = 0; j < nr; ++j) {
              const __m512 p = _mm512_set1_ps(sc[(r0 + j) * L + l]);
              acc[j][0] = _mm512_fmadd_ps(p, v0, acc[j][0]);
              acc[j][1] = _mm512_fmadd_ps(p, v1, acc[j][1]);
            }
          }
          for (int64_t j = 0; j < nr; ++j) {
            const int64_t r = r0 + j;
            T* o = op + (b * Hq + h * R + r) * D;
            store16(o + c0 * 16, _mm512_mul_ps(acc[j][0], _mm512_set1_ps(inv[r])), lanes(c0));
            if (two) store16(o + (c0 + 1) * 16, _mm512_mul_ps(acc[j][1], _mm512_set1_ps(inv[r])), lanes(c0 + 1));
          }
        }
      }
    }
  });
}

at::Tensor attend_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                      double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "attend_one: q [B, Hq, D], k and v [B, Hkv, L, D]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1), L = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D, "attend_one: q, k and v disagree");
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0 && Hq / Hk <= ATT_MAX_R, "attend_one: query heads must be a multiple (<= ",
              ATT_MAX_R, "x) of the key/value heads");
  TORCH_CHECK(D > 0 && D <= ATT_MAX_D, "attend_one: the head size must be at most ", ATT_MAX_D);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "attend_one: q, k and v must all be fp32 or all bf16");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attend_one: k and v rows must be contiguous");
  auto qc = q.contiguous();
  at::Tensor mf;
  const float* mp = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == B && mask->size(1) == L && at::isFloatingType(mask->scalar_type()),
                "attend_one: the mask must be an additive floating [B, L] (0 or -inf)");
    mf = mask->to(at::kFloat).contiguous();
    mp = mf.data_ptr<float>();
  }
  auto out = at::empty({B, Hq, D}, q.options());
  if (L == 0) return out.zero_();
  if (q.scalar_type() == at::kFloat) {
    attend_impl<float>(qc, k, v, mp, scale, out);
  } else {
    attend_impl<c10::BFloat16>(qc, k, v, mp, scale, out);
  }
  return out;
}

// ------------------------------------------------------------------------------------------ norm, router ----------
// The decode step's small ops, one call each where the model's own modules take 5-10 torch calls (a few µs each: at
// 21 norms and 4 routers per token of a 4-layer model, about a tenth of a one-thread token).

inline float bf(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One bf16 RMSNorm output: the normalized value rounded to bf16, then times the weight (bf16 x bf16 -> bf16), as
// transformers' `weight * hidden.to(input_dtype)` rounds it.
inline uint16_t norm_bf16(float x, float inv, float w) { return to_bf16(w * bf(to_bf16(x * inv))); }

// y = w * (x / sqrt(mean(x^2) + eps)) over the last dim, as transformers' RMSNorm computes it: in fp32, the
// normalized row rounded to x's dtype before the weight multiplies it (bf16 x bf16 -> bf16): equal to the module's
// output bit for bit.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: x [..., n] and w [n] expected");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "rms_norm: x and w must both be bf16 or both fp32");
  auto xf = x.to(at::kFloat).contiguous();
  // the mean of squares through the same ATen reduction as the module's `pow(2).mean(-1)`: its summation order,
  // so the result is the module's bit for bit
  auto var = xf.pow(2).mean(-1).contiguous();
  auto wf = w.to(at::kFloat).contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto out = at::empty(x.sizes(), x.options());
  const float* wp = wf.data_ptr<float>();
  const float* vp = var.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* f = xf.data_ptr<float>() + r * n;
    const float inv = 1.0f / std::sqrt(vp[r] + static_cast<float>(eps));
    if (x.scalar_type() == at::kFloat) {
      float* o = out.data_ptr<float>() + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = wp[i] * (f[i] * inv);
    } else {
      uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = norm_bf16(f[i], inv, wp[i]);
    }
  }
  return out;
}

// One head row (D bf16 values) through RMSNorm (weight wf, fp32) and the rotary embedding (cos, sin: D bf16), in
// the order and with the roundings of transformers' bf16 ops: the normalized row rounded to bf16, times the weight
// (bf16); then bf16(x * cos) + bf16(rotate_half(x) * sin), rounded again.
inline void norm_rope_row(const uint16_t* x, float var, const float* wf, float eps, const uint16_t* c,
                          const uint16_t* s, int64_t D, uint16_t* n, uint16_t* out) {
  const float inv = 1.0f / std::sqrt(var + eps);
  for (int64_t i = 0; i < D; ++i) n[i] = norm_bf16(bf(x[i]), inv, wf[i]);
  const int64_t h = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float rot = i < h ? -bf(n[i + h]) : bf(n[i - h]);
    out[i] = to_bf16(bf(to_bf16(bf(n[i]) * bf(c[i]))) + bf(to_bf16(rot * bf(s[i]))));
  }
}

// The decode step's query and key heads through their RMSNorms and the rotary embedding, one call (Qwen3-MoE's
// attention: norms over each head's D values). q [B, 1, Hq, D], k [B, 1, Hk, D] (the projections' outputs, viewed
// per head), wq / wk [D], cos / sin [B, 1, D], all bf16 -> (q, k) [B, H, 1, D] contiguous, what the module's q_norm,
// k_norm, transpose and apply_rotary_pos_emb give.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& wq,
                                                const at::Tensor& wk, double eps_q, double eps_k,
                                                const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(1) == 1 && k.size(1) == 1 && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3), "qk_norm_rope: q [B, 1, Hq, D] and k [B, 1, Hk, D] expected");
  const int64_t B = q.size(0), Hq = q.size(2), Hk = k.size(2), D = q.size(3);
  TORCH_CHECK(D % 2 == 0 && wq.numel() == D && wk.numel() == D && cos.numel() == B * D && sin.numel() == B * D,
              "qk_norm_rope: norm weights [D] and cos / sin [B, 1, D] expected");
  for (const at::Tensor* t : {&q, &k, &wq, &wk, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "qk_norm_rope: bf16 tensors expected");
  auto qc = q.contiguous(), kc = k.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  // each head's mean of squares through the modules' own ATen reduction (bit for bit, as in rms_norm)
  auto vq = qc.to(at::kFloat).pow(2).mean(-1).contiguous(), vk = kc.to(at::kFloat).pow(2).mean(-1).contiguous();
  auto wqf = wq.to(at::kFloat).contiguous(), wkf = wk.to(at::kFloat).contiguous();
  auto qo = at::empty({B, Hq, 1, D}, q.options()), ko = at::empty({B, Hk, 1, D}, k.options());
  std::vector<uint16_t> n(D);
  auto u16 = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  for (int64_t b = 0; b < B; ++b) {
    const uint16_t* c = u16(cc) + b * D;
    const uint16_t* s = u16(sc) + b * D;
    for (int64_t h = 0; h < Hq; ++h)
      norm_rope_row(u16(qc) + (b * Hq + h) * D, vq.data_ptr<float>()[b * Hq + h], wqf.data_ptr<float>(),
                    static_cast<float>(eps_q), c, s, D, n.data(), reinterpret_cast<uint16_t*>(qo.data_ptr()) + (b * Hq + h) * D);
    for (int64_t h = 0; h < Hk; ++h)
      norm_rope_row(u16(kc) + (b * Hk + h) * D, vk.data_ptr<float>()[b * Hk + h], wkf.data_ptr<float>(),
                    static_cast<float>(eps_k), c, s, D, n.data(), reinterpret_cast<uint16_t*>(ko.data_ptr()) + (b * Hk + h) * D);
  }
  return {qo, ko};
}

// A top-k router's step for a few bf16 tokens: logits = x w^T (linear_bf16, rounded to bf16), then what
// transformers' top-k routers do with them, through the same ATen calls (so ties among equal probabilities, common
// with bf16 logits, fall as torch.topk orders them): softmax in fp32, the k largest, renormalized to sum 1 when
// `norm`, in bf16. Returns (logits [T, E], weights [T, k], experts [T, k] int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor> route_topk(const at::Tensor& x, const at::Tensor& w, int64_t k, bool norm) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "route_topk: x [T, H] and w [E, H] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "route_topk: bf16 x and w expected");
  TORCH_CHECK(w.stride(1) == 1 && w.stride(0) == w.size(1), "route_topk: w must be contiguous");
  const int64_t E = w.size(0);
  TORCH_CHECK(k >= 1 && k <= E, "route_topk: k must be in [1, ", E, "]");
  auto logits = linear_bf16(x, w, c10::nullopt).to(at::kBFloat16);  // as the routers' F.linear ran before
  auto probs = at::softmax(logits, -1, at::kFloat);
  auto top = at::topk(probs, k, -1);
  at::Tensor vals = std::get<0>(top);
  if (norm) vals = vals / vals.sum(-1, true);
  return {logits, vals.to(at::kBFloat16), std::get<1>(top)};
}

// Reads every byte of `buf` (one pass, split over torch's threads) and returns a checksum, so the read cannot be
// optimised away: the memory read bandwidth the kernels are measured against.
double read_bytes(const at::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == at::kByte, "a contiguous uint8 buffer expected");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t n = buf.numel() / 256;
  std::vector<uint64_t> parts(at::get_num_threads() + 1, 0);
  at::parallel_for(0, n, 4096, [&](int64_t b0, int64_t b1) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = b0; i < b1; ++i) {
      const uint8_t* q = p + i * 256;
      a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(q));
      a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(q + 64));
      a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(q + 128));
      a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(q + 192));
    }
    const uint64_t s = _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
    parts[at::get_thread_num()] += s;
  });
  uint64_t s = 0;
  for (auto v : parts) s += v;
  return static_cast<double>(s & 0xFFFFFFFF);
}

// A packed tensor's codes: q rows of `qrow` bytes, fp16 scales (and int4 minimums, or none: symmetric int4) per
// `group` inputs, `ng` groups a row.
struct QCodes {
  const uint8_t* q;
  const at::Half* s;
  const at::Half* m;
  int64_t qrow, ng, group;
  int bits;
};

// Rows [r0, r1) and inputs [c0, c1) (16-aligned) of the weights, as `quant.dequantize` computes them (below), into
// `out` (row stride `ld`): bf16 rounded to nearest even, or fp32.
// int4 to bf16 by table: the 16 values a group's codes stand for, computed as below (so the same bits), as bf16
// words in a register, then 32 codes looked up per instruction (`vpermw`), 64 per 32 bytes of codes.
inline __m512i int4_table(const QCodes& c, int64_t g) {
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512 v = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if (c.m == nullptr) v = _mm512_sub_round_ps(v, _mm512_set1_ps(8.0f), R);
  v = _mm512_mul_round_ps(v, _mm512_set1_ps(static_cast<float>(c.s[g])), R);
  if (c.m != nullptr) v = _mm512_add_round_ps(v, _mm512_set1_ps(static_cast<float>(c.m[g])), R);
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));  // (words 16-31 never indexed)
}

inline void dequant_rows_int4_bf16(const QCodes& c, int64_t r0, int64_t r1, int64_t c0, int64_t c1, at::BFloat16* out,
                                   int64_t ld) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* qr = c.q + r * c.qrow;
    at::BFloat16* o = out + (r - r0) * ld - c0;
    __m512i tlo = _mm512_setzero_si512(), thi = tlo;
    int64_t glo = -1;
    for (int64_t i = c0; i < c1; i += 64) {  // one 64-input chunk: low nibbles inputs 0-31, high ones 32-63
      const int64_t g = r * c.ng + i / c.group;  // (group 32: the high half is the next group)
      if (g != glo) {
        glo = g;
        tlo = int4_table(c, g);
        thi = c.group == 32 ? int4_table(c, g + 1) : tlo;
      }
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + (i / 64) * 32));
      const __m512i ilo = _mm512_cvtepu8_epi16(_mm256_and_si256(b, lo4));
      const __m512i ihi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), lo4));
      _mm512_storeu_si512(o + i, _mm512_permutexvar_epi16(ilo, tlo));
      _mm512_storeu_si512(o + i + 32, _mm512_permutexvar_epi16(ihi, thi));
    }
  }
}

template <typename T>
inline void dequant_tile(const QCodes& c, int64_t r0, int64_t r1, int64_t c0, int64_t c1, T* out, int64_t ld) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (c.bits == 4 && c0 % 64 == 0 && c1 % 64 == 0 && (c.group == 32 || c.group % 64 == 0)) {
      dequant_rows_int4_bf16(c, r0, r1, c0, c1, out, ld);
      return;
    }
  }
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.0f);
  const bool sym4 = c.bits == 4 && c.m == nullptr;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* qr = c.q + r * c.qrow;
    T* o = out + (r - r0) * ld - c0;
    int64_t g = r * c.ng + c0 / c.group, gend = (c0 / c.group + 1) * c.group;  // (no division in the loop)
    __m512 vs = _mm512_set1_ps(static_cast<float>(c.s[g]));
    __m512 vm = c.m != nullptr ? _mm512_set1_ps(static_cast<float>(c.m[g])) : vs;
    for (int64_t i = c0; i < c1; i += 16) {
      if (i == gend) {  // the next group: its scale and minimum, converted once
        ++g;
        gend += c.group;
        vs = _mm512_set1_ps(static_cast<float>(c.s[g]));
        if (c.m != nullptr) vm = _mm512_set1_ps(static_cast<float>(c.m[g]));
      }
      __m512 v;
      if (c.bits == 4) {
        const int64_t off = i % 64;
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + (i / 64) * 32 + (off & 31)));
        const __m128i lo = off < 32 ? _mm_and_si128(b, lo4) : _mm_and_si128(_mm_srli_epi16(b, 4), lo4);
        v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
        if (sym4) v = _mm512_sub_round_ps(v, eight, R);
      } else {
        v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + i))));
      }
      v = _mm512_mul_round_ps(v, vs, R);
      if (c.m != nullptr) v = _mm512_add_round_ps(v, vm, R);
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), (__m256i)_mm512_cvtneps_pbh(v));
      } else {
        _mm512_storeu_ps(o + i, v);
      }
    }
  }
}

// The weights a packed tensor stands for, as `quant.dequantize` computes them in fp32 (the code as a float, minus 8
// for symmetric int4; times its group's scale; plus its group's minimum), then rounded to bf16 (to nearest even)
// or kept in fp32: bit for bit the reference, one pass over the codes instead of five over fp32 copies (streamed
// training multiplies packed experts as float weights, forward and backward). The multiply and the add are
// rounded apart (the `_round` forms, which the compiler cannot fuse into an FMA), as torch's two in-place ops do.
// q: [..., rows, n / 2] uint8 (int4, the 64-input chunks of the header) or [..., rows, n] int8; scales (and mins)
// [..., rows, n / group] fp16. Writes `out` (contiguous bf16 or fp32, rows x n values): a buffer the caller reuses
// (a fresh one of 100 MB costs as much in page faults as the pass itself).
void dequant_q(const at::Tensor& q, const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
               int64_t group, const at::Tensor& out) {
  TORCH_CHECK(bits == 4 || bits == 8, "dequant_q: bits must be 4 or 8");
  TORCH_CHECK(q.is_contiguous() && scales.is_contiguous() && q.dim() >= 1, "dequant_q: contiguous q and scales");
  TORCH_CHECK(q.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "dequant_q: q must be ",
              bits == 4 ? "uint8" : "int8", " for ", bits, " bits");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "dequant_q: fp16 scales expected");
  const int64_t n = q.size(-1) * (bits == 4 ? 2 : 1);
  const int64_t rows = q.numel() / std::max<int64_t>(q.size(-1), 1);
  TORCH_CHECK(group >= 16 && group % 16 == 0 && n % group == 0 && (bits == 8 || n % 64 == 0),
              "dequant_q: group ", group, " and ", n, " inputs do not fit the format");
  const int64_t ng = n / group;
  TORCH_CHECK(scales.numel() == rows * ng, "dequant_q: scales hold ", scales.numel(), " values, expected ", rows * ng);
  const at::Half* mp = nullptr;
  if (mins.has_value()) {
    TORCH_CHECK(bits == 4, "dequant_q: minimums are int4's");
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == at::kHalf && mins->numel() == rows * ng,
                "dequant_q: mins must be contiguous fp16 of the scales' shape");
    mp = mins->data_ptr<at::Half>();
  }
  const bool to_bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.is_contiguous() && (to_bf16 || out.scalar_type() == at::kFloat) && out.numel() == rows * n,
              "dequant_q: out must be contiguous bf16 or fp32 of ", rows * n, " values");
  const QCodes c{reinterpret_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<at::Half>(), mp, q.size(-1), ng,
                 group, static_cast<int>(bits)};
  at::BFloat16* ob = to_bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  float* of = to_bf16 ? nullptr : out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    if (ob != nullptr) dequant_tile(c, r0, r1, 0, n, ob + r0 * n, n);
    else dequant_tile(c, r0, r1, 0, n, of + r0 * n, n);
  });
}


// ------------------------------------------------------------------------- AMX: packed experts for training ------
// Streamed training multiplies each packed expert by the ~10-60 tokens that chose it, forward (x W^T) and through
// its transpose for the backward (g W). ATen's bf16 matmul needs W dequantized to memory first, and at these sizes
// runs at a fraction of the matrix units' rate. Here the tile matrix units (AMX) multiply tiles of W dequantized
// into registers one 16 x 32 block at a time (the values of `quant.dequantize`, rounded to bf16), against the
// tokens' tiles; W is never written out. fp32 accumulation in the tiles, bf16 out (as a bf16 matmul rounds it).
// The CPU must have AMX-BF16 and the kernel must have been granted the tile state (`amx_init`).

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct TileCfg {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_init() {
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): Linux grants the tile data state per process
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

inline void tiles_on() {  // 8 tiles of 16 rows x 64 bytes
  TileCfg cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// 32 codes (inputs k0..k0+31, 32-aligned) of a packed row, as 16-bit indices: the low nibbles of the 64-input chunk's
// 32 bytes for its first half, the high ones for its second.
inline __m512i codes32(const uint8_t* qr, int64_t k0) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + (k0 / 64) * 32));
  const __m256i c = (k0 & 32) ? _mm256_srli_epi16(b, 4) : b;
  return _mm512_cvtepu8_epi16(_mm256_and_si256(c, _mm256_set1_epi8(0x0F)));
}

// Tiles: 0 the weights' block, 1 the tokens' block (loaded in turn for each of up to 6 token blocks), 2-7 sums.
constexpr int MAX_MB = 6;

// (the tile intrinsics take their register numbers as literals: one case per sum tile)
#define EC_TILE_CASES(F) F(0, 2) F(1, 3) F(2, 4) F(3, 5) F(4, 6) F(5, 7)

inline void tile_step_fwd(int64_t nb, const uint32_t* bb, int64_t stride) {  // sums[j] += weights x tokens[j]
  for (int64_t j = 0; j < nb; ++j) {
    _tile_loadd(1, bb + j * 16, stride);
    switch (j) {
#define F(J, T) case J: _tile_dpbf16ps(T, 0, 1); break;
      EC_TILE_CASES(F)
#undef F
    }
  }
}

inline void tile_step_bwd(int64_t nb, const uint16_t* aa, int64_t N) {  // sums[j] += tokens[j] x weights
  for (int64_t j = 0; j < nb; ++j) {
    _tile_loadd(1, aa + j * 16 * N, N * 2);
    switch (j) {
#define F(J, T) case J: _tile_dpbf16ps(T, 1, 0); break;
      EC_TILE_CASES(F)
#undef F
    }
  }
}

inline void tiles_zero(int64_t nb) {
  for (int64_t j = 0; j < nb; ++j) switch (j) {
#define F(J, T) case J: _tile_zero(T); break;
      EC_TILE_CASES(F)
#undef F
    }
}

inline void tile_store(int64_t j, float* c) {
  switch (j) {
#define F(J, T) case J: _tile_stored(T, c, 64); break;
    EC_TILE_CASES(F)
#undef F
  }
}

// x [M, K] (trans false: y = x W^T, [M, N]) or [M, N] (trans true: y = x W, [M, K]), W [N, K] int4 (q [N, K / 2],
// fp16 scales and minimums [N, K / G], or no minimums: symmetric). Needs N % 32 == 0, K % 64 == 0, G % 32 == 0.
// The weights are dequantized by table (`int4_table`: each group's 16 values, the bits of `quant.dequantize`).
at::Tensor qmm_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& mins, int64_t group, bool trans) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte, "qmm_amx: int4 q [N, K / 2] expected");
  const int64_t N = q.size(0), K = q.size(1) * 2;
  TORCH_CHECK(N % 32 == 0 && K % 64 == 0 && group % 32 == 0 && K % group == 0, "qmm_amx: N % 32, K % 64 and group % 32 expected");
  const int64_t ng = K / group;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * ng,
              "qmm_amx: contiguous fp16 scales [N, K / group] expected");
  TORCH_CHECK(!mins.has_value() || (mins->scalar_type() == at::kHalf && mins->is_contiguous() && mins->numel() == N * ng),
              "qmm_amx: contiguous fp16 mins expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == (trans ? N : K), "qmm_amx: bf16 x [M, ",
              trans ? N : K, "] expected");
  const int64_t M = x.size(0), Mp = (M + 15) / 16 * 16;
  auto y = at::empty({M, trans ? K : N}, x.options());
  if (M == 0) return y;
  const QCodes qc{q.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.has_value() ? mins->data_ptr<at::Half>() : nullptr,
                  K / 2, ng, group, 4};
  auto xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (!trans) {
    // y^T = W x^T. B: x^T in pairs, [K / 2][Mp][2] (zero past M); C: y^T blocks [16 n][16 m], written out transposed
    std::vector<uint32_t> xb(static_cast<size_t>(K / 2 * Mp), 0);
    for (int64_t m = 0; m < M; ++m) {
      const uint32_t* xr = reinterpret_cast<const uint32_t*>(xp + m * K);
      for (int64_t kp = 0; kp < K / 2; ++kp) xb[kp * Mp + m] = xr[kp];
    }
    const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
      tiles_on();
      alignas(64) uint16_t a[16 * 32];
      alignas(64) float c[16 * 16];
      __m512i tab[16];
      for (int64_t m0 = 0; m0 < Mp; m0 += 16 * MAX_MB) {  // up to 6 token blocks share each dequantized block
        const int64_t nb = std::min<int64_t>(MAX_MB, (Mp - m0) / 16);
        for (int64_t blk = b0; blk < b1; ++blk) {
          const int64_t n0 = blk * 16;
          tiles_zero(nb);
          int64_t gcur = -1;
          for (int64_t k0 = 0; k0 < K; k0 += 32) {
            if (k0 / group != gcur) {
              gcur = k0 / group;
              for (int r = 0; r < 16; ++r) tab[r] = int4_table(qc, (n0 + r) * ng + gcur);
            }
            for (int r = 0; r < 16; ++r)
              _mm512_store_si512(a + r * 32, _mm512_permutexvar_epi16(codes32(qc.q + (n0 + r) * qc.qrow, k0), tab[r]));
            _tile_loadd(0, a, 64);
            tile_step_fwd(nb, xb.data() + (k0 / 2) * Mp + m0, Mp * 4);
          }
          for (int64_t j = 0; j < nb; ++j) {
            tile_store(j, c);
            for (int mm = 0; mm < 16; ++mm) {
              const int64_t t = m0 + j * 16 + mm;
              if (t >= M) break;
              const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32(mm)), c, 4);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + t * N + n0), (__m256i)_mm512_cvtneps_pbh(v));
            }
          }
        }
      }
      _tile_release();
    });
  } else {
    // y = x W. A: x padded to Mp rows (zeros); B: W's rows in interleaved pairs, 16 inputs a tile; C: y blocks.
    // Inputs go 32 at a time (two tiles of B from one lookup per row): the second tile of every 32 rows is kept
    // (`odd`, N / 32 tiles) for the second pass over the rows.
    std::vector<uint16_t> xa(static_cast<size_t>(Mp * N), 0);
    std::memcpy(xa.data(), xp, static_cast<size_t>(M * N) * 2);
    at::parallel_for(0, K / 32, 1, [&](int64_t b0, int64_t b1) {
      tiles_on();
      alignas(64) uint16_t b[16 * 32];
      alignas(64) float c[16 * 16];
      std::vector<__m512i> tabs(static_cast<size_t>(N));  // each row's table for the current group
      std::vector<__m512i> odd(static_cast<size_t>(N / 2));  // [N / 32][16]: the second 16 inputs' tiles
      const __m512i ilo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
      auto out = [&](int64_t m0, int64_t nb, int64_t k0) {
        for (int64_t j = 0; j < nb; ++j) {
          tile_store(j, c);
          for (int mm = 0; mm < 16; ++mm) {
            const int64_t t = m0 + j * 16 + mm;
            if (t >= M) break;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + t * K + k0),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + mm * 16)));
          }
        }
      };
      for (int64_t m0 = 0; m0 < Mp; m0 += 16 * MAX_MB) {
        const int64_t nb = std::min<int64_t>(MAX_MB, (Mp - m0) / 16);
        int64_t gcur = -1;
        for (int64_t blk = b0; blk < b1; ++blk) {
          const int64_t k0 = blk * 32;
          if (k0 / group != gcur) {
            gcur = k0 / group;
            for (int64_t r = 0; r < N; ++r) tabs[r] = int4_table(qc, r * ng + gcur);
          }
          tiles_zero(nb);
          for (int64_t n0 = 0; n0 < N; n0 += 32) {
            __m512i* keep = odd.data() + (n0 / 32) * 16;
            for (int p = 0; p < 16; ++p) {  // tile row p: W rows n0 + 2p and n0 + 2p + 1, interleaved
              const int64_t r0 = n0 + 2 * p;
              const __m512i v0 = _mm512_permutexvar_epi16(codes32(qc.q + r0 * qc.qrow, k0), tabs[r0]);
              const __m512i v1 = _mm512_permutexvar_epi16(codes32(qc.q + (r0 + 1) * qc.qrow, k0), tabs[r0 + 1]);
              _mm512_store_si512(b + p * 32, _mm512_permutex2var_epi16(v0, ilo, v1));
              keep[p] = _mm512_permutex2var_epi16(v0, ihi, v1);
            }
            _tile_loadd(0, b, 64);
            tile_step_bwd(nb, xa.data() + m0 * N + n0, N);
          }
          out(m0, nb, k0);
          tiles_zero(nb);
          for (int64_t n0 = 0; n0 < N; n0 += 32) {
            _tile_loadd(0, odd.data() + (n0 / 32) * 16, 64);
            tile_step_bwd(nb, xa.data() + m0 * N + n0, N);
          }
          out(m0, nb, k0 + 16);
        }
      }
      _tile_release();
    });
  }
  return y;
}

#else  // a compiler without AMX: the tile code is not built, and `amx_init` says no

bool amx_init() { return false; }

at::Tensor qmm_amx(const at::Tensor& x, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t,
                   bool) {
  TORCH_CHECK(false, "qmm_amx: this build has no AMX code (the compiler lacked -mamx-tile / -mamx-bf16)");
  return x;
}
#endif

}  // namespace

// The prefetch settings as they were (bf16, int8 and int4 distances in bytes, scale rows ahead), after setting each
// given one (a negative one is left as it is). Set between calls, never during one.
std::vector<int64_t> set_tuning(int64_t bf16, int64_t int8, int64_t int4, int64_t scale_rows) {
  std::vector<int64_t> was{g_pf_bytes[PF_BF16], g_pf_bytes[PF_INT8], g_pf_bytes[PF_INT4], g_scale_pf};
  const int64_t want[3] = {bf16, int8, int4};
  for (int f = 0; f < 3; ++f) {
    TORCH_CHECK(want[f] < (int64_t{1} << 20), "set_tuning: a prefetch distance of ", want[f], " bytes is beyond 1 MiB");
    if (want[f] >= 0) g_pf_bytes[f] = want[f];
  }
  TORCH_CHECK(scale_rows < 1024, "set_tuning: ", scale_rows, " scale rows ahead is beyond 1023");
  if (scale_rows >= 0) g_scale_pf = scale_rows;
  return was;
}

TORCH_LIBRARY(expertcache_cpu, m) {
  m.def("swiglu_bf16(Tensor x, Tensor gate_up, Tensor down, Tensor slots, Tensor weights) -> Tensor");
  m.def("swiglu_q(Tensor x, Tensor gu_q, Tensor gu_s, Tensor? gu_m, Tensor dn_q, Tensor dn_s, Tensor? dn_m, "
        "int bits, int group, Tensor slots, Tensor weights) -> Tensor");
  m.def("read_bytes(Tensor buf) -> float");
  m.def("dequant_q(Tensor q, Tensor scales, Tensor? mins, int bits, int group, Tensor(a!) out) -> ()");
  m.def("qmm_amx(Tensor x, Tensor q, Tensor scales, Tensor? mins, int group, bool trans) -> Tensor");
  m.def("amx_init() -> bool");
  m.def("set_tuning(int bf16, int int8, int int4, int scale_rows) -> int[]");
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_q(Tensor x, Tensor q, Tensor scales, Tensor? mins, int bits, int group, Tensor? bias) -> Tensor");
  m.def("attend_one(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("route_topk(Tensor x, Tensor w, int k, bool norm) -> (Tensor, Tensor, Tensor)");
  m.def("qk_norm_rope(Tensor q, Tensor k, Tensor wq, Tensor wk, float eps_q, float eps_k, Tensor cos, Tensor sin) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(expertcache_cpu, CompositeExplicitAutograd, m) {
  m.impl("amx_init", &amx_init);
  m.impl("set_tuning", &set_tuning);
}

TORCH_LIBRARY_IMPL(expertcache_cpu, CPU, m) {
  m.impl("swiglu_bf16", &swiglu_bf16);
  m.impl("swiglu_q", &swiglu_q);
  m.impl("read_bytes", &read_bytes);
  m.impl("dequant_q", &dequant_q);
  m.impl("qmm_amx", &qmm_amx);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_q", &linear_q);
  m.impl("attend_one", &attend_one);
  m.impl("rms_norm", &rms_norm);
  m.impl("route_topk", &route_topk);
  m.impl("qk_norm_rope", &qk_norm_rope);
}
