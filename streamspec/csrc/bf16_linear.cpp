// streamspec's bfloat16 linear kernel for decoding on CPUs with AVX-512 BF16.
//
// A decoding pass multiplies a few rows (one token, a draft tree) by every weight of the model:
// the time is reading the weights. oneDNN's bf16 inner product streamed ~9 GB/s of the ~27 GB/s
// one core of this project's machines reads; this kernel reads a weight as one sequential stream,
// laid out once by `pack` as [N/64][K/2][64][2] (tiles of 64 outputs, each pair of inputs' weights
// of the tile together; N and K padded with zeros), and keeps up to six input rows' sums of a tile
// in registers (24 of the 32), each row's pair of inputs broadcast against four registers of
// weights, so a tile is read from memory once for six rows and the sums need no horizontal
// reduction. (An earlier layout, [N/8][K/32][8][32] with three rows in registers and a reduction
// of 16 lanes per output, took 1.3-2x the time for 1-28 rows.) Products of bf16 pairs accumulate
// in float32 (`vdpbf16ps`); the output is rounded to bfloat16 once, after the bias.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 64;   // outputs a tile: four registers of 16 float32 sums
constexpr int64_t kRowsMax = 6;  // input rows a pass over a tile: 6 x 4 sums + 4 weights in registers
// float32: 7 rows, 7 x 4 sums + 4 weights = all 32 registers, each row's input broadcast from memory
// into its products (`vfmadd ... {1to16}`), where bf16's pair needs a register of its own. On the
// AMD EPYC (Zen 4) of the sixteenth session a 7-row float32 pass over SmolLM2's layers took 21.1 ms
// in one pass against 25.6 in two (4 + 3), 6 rows 19.7.
constexpr int64_t kRowsMaxF32 = 7;

bool cpu_supported() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack: the weight must be 2-D (out_features, in_features), got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "pack: the weight must be bfloat16 or float32, got ", weight.scalar_type());
  TORCH_CHECK(weight.device().is_cpu(), "pack: the weight must be on the CPU");
  const int64_t n = weight.size(0), k = weight.size(1);
  if (weight.scalar_type() == at::kFloat) {  // [N/64][K][64]: each input's 64 weights of a tile together
    const int64_t np = (n + kTile - 1) / kTile * kTile;
    auto padded = torch::zeros({np, k}, weight.options());
    padded.narrow(0, 0, n).copy_(weight);
    return padded.view({np / kTile, kTile, k}).permute({0, 2, 1}).contiguous();
  }
  const int64_t np = (n + kTile - 1) / kTile * kTile, kp = (k + 1) / 2 * 2;
  auto padded = torch::zeros({np, kp}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [N/64][K/2][64][2]: a tile's weights one sequential stream, each pair of inputs of its 64 outputs together
  return padded.view({np / kTile, kTile, kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// One pass of MB input rows over one tile: for each pair of inputs, the 64 outputs' weight pairs
// (four registers) meet each row's pair broadcast to every lane (`vdpbf16ps`: sums of the two
// products, accumulated in float32). Each output's sum runs over the input pairs in order whatever
// MB is, so a row's bits do not depend on the rows beside it.
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void tile_rows(const at::BFloat16* x, int64_t ldx, int64_t k, const at::BFloat16* w, const at::BFloat16* bias,
                      at::BFloat16* out, int64_t ldo, int64_t valid) {
  // (the loops are unrolled so that GCC keeps the sums in registers, not in an array on the stack)
  __m512 acc[MB][4];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const at::BFloat16* wp = w + p * kTile * 2;
    __m512bh wv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512((const void*)(wp + j * 32));
    const bool half = (k & 1) && p + 1 == pairs;  // an odd K's last input pairs with a zero
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      if (half) {
        uint16_t last;
        std::memcpy(&last, x + m * ldx + 2 * p, 2);
        pair = last;
      } else {
        std::memcpy(&pair, x + m * ldx + 2 * p, 4);
      }
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int64_t c0 = j * 16;
    if (c0 >= valid) break;
    const __mmask16 cm = valid - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (valid - c0)) - 1u);
    __m512 bv = _mm512_setzero_ps();
    if (bias != nullptr)  // bf16 -> f32: the 16 bits on top of a zero half
      bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cm, bias + c0)), 16));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], bv));
      _mm256_mask_storeu_epi16((void*)(out + m * ldo + c0), cm, r);
    }
  }
}

// The float32 kernel: the same tiles, one input a step ([N/64][K][64]), each row's input broadcast
// against four registers of weights (`vfmadd`), sums in input order (a row's bits do not depend on
// the rows beside it).
template <int MB>
__attribute__((target("avx512f")))
inline void tile_rows(const float* x, int64_t ldx, int64_t k, const float* w, const float* bias, float* out,
                          int64_t ldo, int64_t valid) {
  __m512 acc[MB][4];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < k; ++d) {
    const float* wd = w + d * kTile;
    __m512 wv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(wd + j * 16);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + d]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int64_t c0 = j * 16;
    if (c0 >= valid) break;
    const __mmask16 cm = valid - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (valid - c0)) - 1u);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(cm, bias + c0) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(out + m * ldo + c0, cm, _mm512_add_ps(acc[m][j], bv));
  }
}

// The tiles t0..t1 of a weight for every row: bf16 or float32 (`tile_rows`' overloads).
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void tiles(const T* x, int64_t rows, int64_t k, const T* w, const T* bias, T* out, int64_t n, int64_t t0, int64_t t1) {
  const int64_t depth = std::is_same<T, float>::value ? k : (k + 1) / 2 * 2;  // a tile's inputs, padded
  for (int64_t t = t0; t < t1; ++t) {
    const T* wt = w + t * depth * kTile;
    const int64_t c = t * kTile, valid = std::min<int64_t>(kTile, n - c);
    const T* bt = bias != nullptr ? bias + c : nullptr;
    // more rows than a pass holds (bf16 6, float32 7): passes over the tile again (from cache),
    // rows spread evenly (bf16: 7 = 4 + 3)
    constexpr int64_t most = std::is_same<T, float>::value ? kRowsMaxF32 : kRowsMax;
    for (int64_t m = 0, passes = (rows + most - 1) / most; m < rows; --passes) {
      const int64_t mb = (rows - m + passes - 1) / passes;
      const T* xm = x + m * k;
      T* om = out + m * n + c;
      switch (mb) {
        case 7:
          if constexpr (std::is_same<T, float>::value) tile_rows<7>(xm, k, k, wt, bt, om, n, valid);
          else TORCH_CHECK(false, "linear: a bf16 pass holds at most ", kRowsMax, " rows");  // (never: most is 6)
          break;
        case 6: tile_rows<6>(xm, k, k, wt, bt, om, n, valid); break;
        case 5: tile_rows<5>(xm, k, k, wt, bt, om, n, valid); break;
        case 4: tile_rows<4>(xm, k, k, wt, bt, om, n, valid); break;
        case 3: tile_rows<3>(xm, k, k, wt, bt, om, n, valid); break;
        case 2: tile_rows<2>(xm, k, k, wt, bt, om, n, valid); break;
        default: tile_rows<1>(xm, k, k, wt, bt, om, n, valid); break;
      }
      m += mb;
    }
  }
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                     const c10::optional<torch::Tensor>& bias) {
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || f32) && packed.scalar_type() == x.scalar_type(),
              "linear: x and the packed weight must be both bfloat16 or both float32, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear: x and the weight must be on the CPU");
  const int64_t k = x.size(-1);
  if (f32) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kTile && packed.is_contiguous(),
                "linear: the weight was not laid out by pack(): ", packed.sizes());
    TORCH_CHECK(packed.size(1) == k, "linear: x has ", k, " inputs, the weight ", packed.size(1));
  } else {
    TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2 && packed.is_contiguous(),
                "linear: the weight was not laid out by pack(): ", packed.sizes());
    TORCH_CHECK((k + 1) / 2 == packed.size(1), "linear: x has ", k, " inputs, the weight ", packed.size(1) * 2, " (padded)");
  }
  TORCH_CHECK(packed.size(0) * kTile >= n && n > packed.size(0) * kTile - kTile, "linear: the packed weight ",
              packed.sizes(), " does not have ", n, " outputs");
  auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2.size(0);
  auto out = torch::empty({rows, n}, x.options());
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == x.scalar_type() && b.numel() == n, "linear: the bias must be ", x.scalar_type(),
                " with ", n, " values");
  }
  const int64_t nt = (n + kTile - 1) / kTile;
  if (rows > 0 && f32) {
    const float* xp = x2.data_ptr<float>();
    const float* wp = packed.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* op = out.data_ptr<float>();
    at::parallel_for(0, nt, 2, [&](int64_t t0, int64_t t1) { tiles<float>(xp, rows, k, wp, bp, op, n, t0, t1); });
  } else if (rows > 0) {
    const at::BFloat16* xp = x2.data_ptr<at::BFloat16>();
    const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, nt, 2, [&](int64_t t0, int64_t t1) { tiles<at::BFloat16>(xp, rows, k, wp, bp, op, n, t0, t1); });
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}


// -- attention of a decoding pass ----------------------------------------------------------------
// A few query rows (one token, a draft tree) against a long cache, q/k/v all bf16 or all float32:
// scores, softmax and the weighted sum of values in float32 (a bf16 output rounded once). Each key-value head's
// keys and values are read in place (no float32 copies of the cache, no copies per query head).
#define SS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// 16 vectors of partial sums -> one vector of their 16 totals (lane j: the sum of v[j]), by
// halving: 30 lane permutations and 15 additions for 16 dot products, where a horizontal sum
// each would take ~8 dependent instructions.
SS_TARGET inline __m512 sum16(__m512* v) {
  const __m512i a_lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i a_hi = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i b_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i b_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i c_lo = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i c_hi = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const __m512i d_lo = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i d_hi = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    v[j] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * j], a_lo, v[2 * j + 1]), _mm512_permutex2var_ps(v[2 * j], a_hi, v[2 * j + 1]));
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
    v[j] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * j], b_lo, v[2 * j + 1]), _mm512_permutex2var_ps(v[2 * j], b_hi, v[2 * j + 1]));
#pragma GCC unroll 2
  for (int j = 0; j < 2; ++j)
    v[j] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * j], c_lo, v[2 * j + 1]), _mm512_permutex2var_ps(v[2 * j], c_hi, v[2 * j + 1]));
  return _mm512_add_ps(_mm512_permutex2var_ps(v[0], d_lo, v[1]), _mm512_permutex2var_ps(v[0], d_hi, v[1]));
}

SS_TARGET inline __m512 bf16_to_f32(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// e^x for 16 lanes (x <= 0 here: scores minus their maximum), to float32's precision: 2^n e^r with
// |r| <= ln2/2 (ln 2 split in two parts) and a degree-6 polynomial for e^r; x below -87.3 (and -inf, a
// masked key) gives exactly 0.
SS_TARGET inline __m512 exp_ps(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  // times 2^n (n >= -126 for x >= -87.3: a normal number)
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps((__mmask16)~zero, y, _mm512_castsi512_ps(e));
}

// A query row against one key: its dot product as 16 partial sums (a vector), per element type.
// bf16: 32-wide chunks of the dim, pairs of products accumulated by `vdpbf16ps`; float32: 16-wide
// chunks, `vfmadd`. `load` takes the row (dim <= 16 V), `partial` one key's partial sums.
template <typename T, int V> struct KeyDot;

template <int V> struct KeyDot<at::BFloat16, V> {
  static constexpr int C = (V + 1) / 2;
  __mmask32 kmask[C];
  __m512bh qv[C];
  SS_TARGET void load(const at::BFloat16* q, int64_t dim) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const int64_t left = dim - c * 32;
      kmask[c] = left >= 32 ? (__mmask32)0xFFFFFFFFu : left <= 0 ? (__mmask32)0 : (__mmask32)((1u << left) - 1u);
      qv[c] = (__m512bh)_mm512_maskz_loadu_epi16(kmask[c], q + c * 32);
    }
  }
  SS_TARGET __m512 partial(const at::BFloat16* kl) const {
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_maskz_loadu_epi16(kmask[c], kl + c * 32));
    return a;
  }
};

template <int V> struct KeyDot<float, V> {
  static constexpr int C = V;
  __mmask16 kmask[C];
  __m512 qv[C];
  SS_TARGET void load(const float* q, int64_t dim) {
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const int64_t left = dim - c * 16;
      kmask[c] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
      qv[c] = _mm512_maskz_loadu_ps(kmask[c], q + c * 16);
    }
  }
  SS_TARGET __m512 partial(const float* kl) const {
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(kmask[c], kl + c * 16), a);
    return a;
  }
};

// 16 values of a row (masked lanes 0) as float32, and back (bf16: rounded once, to nearest even).
SS_TARGET inline __m512 load16(const at::BFloat16* p, __mmask16 m) { return bf16_to_f32(p, m); }
SS_TARGET inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
SS_TARGET inline void store16(at::BFloat16* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16((void*)p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
SS_TARGET inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }

// One query row's scores against `length` keys (times `scale`, plus its mask), into `scores`;
// returns their maximum (-inf: the row may see no key).
template <typename T, int V>
SS_TARGET float row_scores(const T* q, const T* k, int64_t k_stride, const float* mask,
                           const bool* allowed, int64_t mask_stride, int64_t length, int64_t dim, float scale,
                           float* scores) {
  KeyDot<T, V> dot;
  dot.load(q, dim);
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 best_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t l = 0;
  for (; l + 16 <= length; l += 16) {
    __m512 part[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) part[j] = dot.partial(k + (l + j) * k_stride);
    __m512 sv = _mm512_mul_ps(sum16(part), scale_v);
    if (mask != nullptr) {
      if (mask_stride == 1) sv = _mm512_add_ps(sv, _mm512_loadu_ps(mask + l));
      else for (int j = 0; j < 16; ++j) sv[j] += mask[(l + j) * mask_stride];
    } else if (allowed != nullptr) {  // a boolean mask: a key it does not allow scores -inf
      for (int j = 0; j < 16; ++j)
        if (!allowed[(l + j) * mask_stride]) sv[j] = -std::numeric_limits<float>::infinity();
    }
    _mm512_storeu_ps(scores + l, sv);
    best_v = _mm512_max_ps(best_v, sv);
  }
  if (l < length) {  // the last few keys the same way (the other lanes zeros), so that a key's score
                     // has the same bits wherever the row's keys end
    const int64_t left = length - l;
    __m512 part[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) part[j] = j < left ? dot.partial(k + (l + j) * k_stride) : _mm512_setzero_ps();
    __m512 sv = _mm512_mul_ps(sum16(part), scale_v);
    for (int j = 0; j < left; ++j) {
      if (mask != nullptr) sv[j] += mask[(l + j) * mask_stride];
      else if (allowed != nullptr && !allowed[(l + j) * mask_stride]) sv[j] = -std::numeric_limits<float>::infinity();
    }
    const __mmask16 m = (__mmask16)((1u << left) - 1u);
    _mm512_mask_storeu_ps(scores + l, m, sv);
    best_v = _mm512_mask_max_ps(best_v, m, best_v, sv);
  }
  return _mm512_reduce_max_ps(best_v);
}

// Scores -> e^(score - best) in place (16 lanes at a time, the last block masked); returns their sum.
SS_TARGET float row_exp(float* scores, int64_t length, float best) {
  const __m512 best_v = _mm512_set1_ps(best);
  __m512 total = _mm512_setzero_ps();
  for (int64_t l = 0; l < length; l += 16) {
    const __mmask16 m = length - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (length - l)) - 1u);
    const __m512 p = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + l), best_v)));
    _mm512_mask_storeu_ps(scores + l, m, p);
    total = _mm512_add_ps(total, p);
  }
  return _mm512_reduce_add_ps(total);
}

// How many of a row's keys to score: up to its last key the mask does not shut out (a boolean false,
// or an additive value of -1e30 or less: -inf, float32's or bf16's lowest), the whole `length` when it
// shuts out every key. A compiled pass attends over a cache buffer of a fixed capacity, its tail
// not yet written; those keys' weights are exactly 0 (see `attend_rows`), so they are skipped.
constexpr float kShut = -1e30f;
inline int64_t keys_to_score(const float* mask, const bool* allowed, int64_t mask_stride, int64_t length) {
  int64_t end = length;
  if (allowed != nullptr) {
    while (end > 0 && !allowed[(end - 1) * mask_stride]) --end;
  } else if (mask != nullptr) {
    while (end > 0 && mask[(end - 1) * mask_stride] <= kShut) --end;
  }
  return end > 0 ? end : length;
}

// NQ query rows (of one key-value head: its query heads and rows) against its `length` keys: each
// row's scores and softmax, then the weighted sums of values for all NQ rows at once, each value
// read (and, bf16, widened to float32) once for them. `V` 16-lane vectors of the head's dim
// (dim <= 16 V); `T` bf16 or float32, the output in `T`.
template <typename T, int V, int NQ>
SS_TARGET void attend_rows(const T* const* q, const T* k, int64_t k_stride, const T* v,
                           int64_t v_stride, const float* const* mask, const bool* const* allowed, int64_t mask_stride,
                           int64_t length, int64_t dim, float scale, float* scores /* [NQ][length + 16] */,
                           T* const* out) {
  const int64_t ld = length + 16;
  float inv[NQ];
  bool any = false;
  int64_t last = 0;  // the keys any row of the group weighs: [0, last)
  for (int i = 0; i < NQ; ++i) {
    float* s = scores + i * ld;
    // Keys past the row's last open one (`keys_to_score`) score <= -1e30 + |q.k| scale: with the row's
    // best score over the others above -1e29 their e^(score - best) is exactly 0 (as `exp_ps` gives
    // below -87.3), so they are left out of the scores, the sum and the values, and the row's
    // output bits are the same as over every key. Otherwise (every key shut out but a few at
    // -1e30 or so): all of them, as before.
    int64_t end = keys_to_score(mask[i], allowed[i], mask_stride, length);
    float best = row_scores<T, V>(q[i], k, k_stride, mask[i], allowed[i], mask_stride, end, dim, scale, s);
    if (end < length && !(best > -1e29f)) {
      end = length;
      best = row_scores<T, V>(q[i], k, k_stride, mask[i], allowed[i], mask_stride, end, dim, scale, s);
    }
    for (int64_t j = end; j < length; ++j) s[j] = 0.f;
    if (best == -std::numeric_limits<float>::infinity()) {  // a row that may see nothing: zeros, as sdpa
      for (int64_t j = 0; j < end; ++j) s[j] = 0.f;
      inv[i] = 0.f;
    } else {
      inv[i] = 1.f / row_exp(s, end, best);
      any = true;
      last = std::max(last, end);
    }
  }
  __mmask16 vmask[V];
  __m512 acc[NQ][V];
#pragma GCC unroll 16
  for (int c = 0; c < V; ++c) {
    const int64_t left = dim - c * 16;
    vmask[c] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
#pragma GCC unroll 8
    for (int i = 0; i < NQ; ++i) acc[i][c] = _mm512_setzero_ps();
  }
  if (any) {
    for (int64_t j = 0; j < last; ++j) {
      // a key no row of the group may see adds nothing (and a masked slot's value is never read)
      bool seen = false;
#pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) seen |= scores[i * ld + j] != 0.f;
      if (!seen) continue;
      const T* vl = v + j * v_stride;
      __m512 vv[V];
#pragma GCC unroll 16
      for (int c = 0; c < V; ++c) vv[c] = load16(vl + c * 16, vmask[c]);
#pragma GCC unroll 8
      for (int i = 0; i < NQ; ++i) {
        const __m512 pv = _mm512_set1_ps(scores[i * ld + j]);
#pragma GCC unroll 16
        for (int c = 0; c < V; ++c) acc[i][c] = _mm512_fmadd_ps(pv, vv[c], acc[i][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NQ; ++i) {
    const __m512 iv = _mm512_set1_ps(inv[i]);
#pragma GCC unroll 16
    for (int c = 0; c < V; ++c)  // (a row that sees nothing: exact zeros, whatever the values hold)
      store16(out[i] + c * 16, vmask[c], inv[i] == 0.f ? _mm512_setzero_ps() : _mm512_mul_ps(acc[i][c], iv));
  }
}

// Query rows a group, by the head's dim: the value sums of all of them in registers.
constexpr int kGroupMax = 4;  // the pointer arrays of a group in `decode_attention`
constexpr int group_rows(int V) { return V <= 4 ? 4 : V <= 8 ? 2 : 1; }
static_assert(group_rows(2) <= kGroupMax && group_rows(4) <= kGroupMax && group_rows(8) <= kGroupMax &&
              group_rows(16) <= kGroupMax, "a group's rows must fit decode_attention's arrays");

template <typename T>
using AttendRows = void (*)(const T* const*, const T*, int64_t, const T*, int64_t, const float* const*,
                            const bool* const*, int64_t, int64_t, int64_t, float, float*, T* const*);

template <typename T, int V>
AttendRows<T> attend_rows_for(int n) {
  constexpr int G = group_rows(V);
  if (n >= G) return attend_rows<T, V, G>;
  if (G >= 3 && n == 3) return attend_rows<T, V, (G >= 3 ? 3 : 1)>;
  if (G >= 2 && n == 2) return attend_rows<T, V, (G >= 2 ? 2 : 1)>;
  return attend_rows<T, V, 1>;
}

template <typename T>
AttendRows<T> attend_rows_for(int64_t dim, int n) {
  if (dim <= 32) return attend_rows_for<T, 2>(n);
  if (dim <= 64) return attend_rows_for<T, 4>(n);
  if (dim <= 128) return attend_rows_for<T, 8>(n);
  return attend_rows_for<T, 16>(n);  // dim <= 256
}

// (the same choice as attend_rows_for's: a group of n <= group_rows_for(dim) rows runs attend_rows<T, V, n>)
int group_rows_for(int64_t dim) {
  return dim <= 32 ? group_rows(2) : dim <= 64 ? group_rows(4) : dim <= 128 ? group_rows(8) : group_rows(16);
}

// The pass's rows over the batch's key-value heads, in groups of rows that share each value's read.
template <typename T>
void attend_all(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value, const torch::Tensor& m,
                double scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), dim = q.size(3);
  const int64_t groups = key.size(1), length = key.size(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  const bool boolean = m.defined() && m.scalar_type() == at::kBool;
  const float* mp = m.defined() && !boolean ? m.data_ptr<float>() : nullptr;
  const bool* ap = boolean ? m.data_ptr<bool>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t per_group = heads / groups;
  // the rows of one key-value head (its query heads x the pass's rows), in groups that share each value's read
  const int64_t shared = per_group * rows, per = group_rows_for(dim);
  const int64_t blocks = (shared + per - 1) / per;
  at::parallel_for(0, batch * groups * blocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(per * (length + 16));
    const T* qs[kGroupMax];
    const float* ms[kGroupMax];
    const bool* as[kGroupMax];
    T* os[kGroupMax];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (groups * blocks), g = (i / blocks) % groups, first = (i % blocks) * per;
      const int n = static_cast<int>(std::min<int64_t>(per, shared - first));
      for (int r = 0; r < n; ++r) {
        const int64_t h = g * per_group + (first + r) / rows, t = (first + r) % rows;
        const int64_t at = m.defined() ? b * m.stride(0) + h * m.stride(1) + t * m.stride(2) : 0;
        qs[r] = qp + ((b * heads + h) * rows + t) * dim;
        ms[r] = mp != nullptr ? mp + at : nullptr;
        as[r] = ap != nullptr ? ap + at : nullptr;
        os[r] = op + ((b * rows + t) * heads + h) * dim;
      }
      const T* kb = kp + b * key.stride(0) + g * key.stride(1);
      const T* vb = vp + b * value.stride(0) + g * value.stride(1);
      attend_rows_for<T>(dim, n)(qs, kb, key.stride(2), vb, value.stride(2), ms, as, m.defined() ? m.stride(3) : 0,
                                 length, dim, static_cast<float>(scale), scores.data(), os);
    }
  });
}

torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                               const c10::optional<torch::Tensor>& mask, double scale) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && key.scalar_type() == dtype &&
                  value.scalar_type() == dtype,
              "decode_attention: query, key and value must all be bfloat16 or all float32, got ", query.scalar_type(),
              ", ", key.scalar_type(), ", ", value.scalar_type());
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "decode_attention: [batch, heads, rows, dim] tensors");
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t groups = key.size(1), length = key.size(2);
  TORCH_CHECK(key.size(0) == batch && value.size(0) == batch && value.size(1) == groups && value.size(2) == length &&
                  key.size(3) == dim && value.size(3) == dim && heads % groups == 0 && dim <= 256,
              "decode_attention: shapes do not fit: query ", query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "decode_attention: keys and values must be contiguous in their last dim");
  TORCH_CHECK(groups > 0 && query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "decode_attention: CPU tensors with at least one key-value head");
  auto q = query.contiguous();
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK((mask->scalar_type() == at::kFloat || mask->scalar_type() == at::kBool) && mask->dim() == 4 &&
                    mask->device().is_cpu(),
                "decode_attention: the mask must be a 4-D float32 additive or boolean mask on the CPU");
    m = mask->narrow(3, 0, length).expand({batch, heads, rows, length});
  }
  auto out = torch::empty({batch, rows, heads, dim}, query.options());
  if (dtype == at::kFloat) attend_all<float>(q, key, value, m, scale, out);
  else attend_all<at::BFloat16>(q, key, value, m, scale, out);
  return out;
}

// -- packs by weight, for compiled graphs -----------------------------------------------------------
// A compiled decoding step calls `linear_of(x, weight, bias)` with the layer's weight tensor; its
// pack is found here by the weight's TensorImpl (held weakly, so its address is not reused while
// an entry names it) and is served only while that weight is unchanged: the same data pointer,
// version counter, sizes, strides and dtype. A weight changed in place (its version moves) or
// replaced is packed again on its next call (as the eager path: a change through ``.data`` that
// keeps the address and version is not seen). Python seeds the entries with the packs it made
// (`remember_pack`), so that a layer's pack exists once, and drops them when a layer is unpacked
// or its weight dies (`forget_impl`, from the weight's finalizer). Packs leave the registry only
// after its lock is released (`Dropped`): a pack's last reference may be a Python object, whose
// destruction takes the GIL, and Python-side calls take the GIL before this lock.
struct PackEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  int64_t version;
  const void* data;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  torch::Tensor packed;
};

std::mutex& packs_mutex() {
  static auto* mutex = new std::mutex();  // never destroyed: no order of destruction at exit
  return *mutex;
}

std::unordered_map<const c10::TensorImpl*, PackEntry>& packs() {
  static auto* map = new std::unordered_map<const c10::TensorImpl*, PackEntry>();
  return *map;
}

using Dropped = std::vector<torch::Tensor>;  // declared before a lock: destroyed after its release

bool entry_is(const PackEntry& e, const torch::Tensor& w) {
  const auto alive = e.impl.lock();
  return alive.get() == w.unsafeGetTensorImpl() && e.version == static_cast<int64_t>(w._version()) &&
         e.data == w.data_ptr() && e.dtype == w.scalar_type() && c10::IntArrayRef(e.sizes).equals(w.sizes()) &&
         c10::IntArrayRef(e.strides).equals(w.strides());
}

void drop_expired_locked(Dropped& dropped) {
  auto& map = packs();
  for (auto it = map.begin(); it != map.end();) {
    if (it->second.impl.expired()) {
      dropped.push_back(std::move(it->second.packed));
      it = map.erase(it);
    } else {
      ++it;
    }
  }
}

void erase_locked(const c10::TensorImpl* key, Dropped& dropped) {
  auto& map = packs();
  const auto it = map.find(key);
  if (it != map.end()) {
    dropped.push_back(std::move(it->second.packed));
    map.erase(it);
  }
}

void store_locked(const torch::Tensor& w, const torch::Tensor& packed, Dropped& dropped) {
  if (packs().size() % 64 == 63) drop_expired_locked(dropped);  // the entries of weights that died unseen
  erase_locked(w.unsafeGetTensorImpl(), dropped);
  packs().emplace(w.unsafeGetTensorImpl(),
                  PackEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr()),
                            static_cast<int64_t>(w._version()), w.data_ptr(), w.sizes().vec(), w.strides().vec(),
                            w.scalar_type(), packed});
}

void remember_pack(const torch::Tensor& weight, const torch::Tensor& packed) {
  TORCH_CHECK(weight.dim() == 2 && packed.scalar_type() == weight.scalar_type(),
              "remember_pack: a 2-D weight and its pack, in one dtype");
  Dropped dropped;
  std::lock_guard<std::mutex> lock(packs_mutex());
  store_locked(weight, packed, dropped);
}

void forget_pack(const torch::Tensor& weight) {
  Dropped dropped;
  std::lock_guard<std::mutex> lock(packs_mutex());
  erase_locked(weight.unsafeGetTensorImpl(), dropped);
}

// The entry of the weight whose TensorImpl was at `address` (its finalizer's call: the weight may
// be mid-destruction, so only the address is compared), and those of weights that died.
void forget_impl(int64_t address) {
  Dropped dropped;
  std::lock_guard<std::mutex> lock(packs_mutex());
  erase_locked(reinterpret_cast<const c10::TensorImpl*>(address), dropped);
  drop_expired_locked(dropped);
}

// How many entries the registry holds (`sweep`: after dropping those of weights that died).
int64_t packs_held(bool sweep) {
  Dropped dropped;
  std::lock_guard<std::mutex> lock(packs_mutex());
  if (sweep) drop_expired_locked(dropped);
  return static_cast<int64_t>(packs().size());
}

torch::Tensor pack_of(const torch::Tensor& weight) {
  {
    std::lock_guard<std::mutex> lock(packs_mutex());
    const auto it = packs().find(weight.unsafeGetTensorImpl());
    if (it != packs().end() && entry_is(it->second, weight)) return it->second.packed;
  }
  torch::NoGradGuard no_grad;
  auto packed = pack(weight.detach());
  Dropped dropped;
  std::lock_guard<std::mutex> lock(packs_mutex());
  store_locked(weight, packed, dropped);
  return packed;
}

// x @ weight.T (+ bias) for a few rows, the weight's pack found (or made) by `pack_of`.
torch::Tensor linear_of(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), "linear_of: x has ", x.size(-1),
              " inputs, the weight ", weight.sizes());
  return linear(x, pack_of(weight), weight.size(0), bias);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX-512 BF16");
  m.def("pack", &pack, "lay a bfloat16 or float32 (out, in) weight out for `linear`");
  m.def("linear", &linear, "x @ weight.T (+ bias) with a weight laid out by `pack`");
  m.def("decode_attention", &decode_attention, "attention of a few bf16 or float32 query rows against a cache, [B, T, H, D] out");
  m.def("remember_pack", &remember_pack, "the pack `linear_of` serves for this weight while it is unchanged");
  m.def("forget_pack", &forget_pack, "drop the pack remembered for this weight");
  m.def("forget_impl", &forget_impl, "drop the pack of the weight whose TensorImpl was at this address (and the dead ones')");
  m.def("packs_held", &packs_held, "how many weights' packs `linear_of` holds (sweep: the dead ones' dropped first)",
        py::arg("sweep") = true);
  m.def("pack_of", &pack_of, "the pack `linear_of` serves for this weight (made now if none is fresh)");
}

// The kernels as dispatcher operators (``torch.ops.streamspec_native.*``), for compiled decoding
// steps: a graph calls them with no Python between the graph and the kernel (the Python-defined
// ``streamspec::packed_linear`` looks its weight's pack up in Python at every call, ~4 us more).
TORCH_LIBRARY(streamspec_native, m) {
  m.def("linear_of(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamspec_native, CPU, m) {
  m.impl("linear_of", &linear_of);
  m.impl("decode_attention", &decode_attention);
}
