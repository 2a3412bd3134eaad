// The compact-state Adam(W) step on the CPU: one pass per block, decode -> update -> encode.
//
// A plain C ABI over raw pointers (no torch headers), built and loaded by host_adam.py. The
// float32 arithmetic is the sequence of computectx.memory.optim.fused._update (its twin),
// without contraction (-ffp-contract=off, no -ffast-math): lerp, mul, addcmul, sqrt, div,
// add, addcdiv, each rounded once. Every element is computed from its own inputs and its
// block's scale, each block by one thread, so the result does not depend on the thread
// count. The nearest-code search is the table search of maps.py (bucketize, exactly).
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

constexpr int32_t kPlain = 0, kBf16 = 1, kInt8 = 2, kFp8 = 3, kInt4 = 4, kRank1 = 5;
constexpr int32_t kF32 = 0, kBF16 = 1, kF16 = 2;
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr float kBf16Max = 3.38953138925153547590e+38f;  // 0x7F7F0000
constexpr float kF16Max = 65504.0f;
constexpr int64_t kPlainTile = 2048;
constexpr int64_t kNearestMin = 65536;  // elements from which int8 takes the one-load table

}  // namespace

extern "C" {

struct CcMoment {
  int32_t fmt;  // kPlain .. kRank1
  int32_t is_signed;
  int64_t block;       // elements per block (blocked formats)
  int64_t rows;        // rank-1: rows of the 2-D view
  void* data;          // f32 values / bf16 values / uint8 codes, written in place
  float* absmax;       // blocked: per-block absmax (in place); rank-1: the old rows
  float* cols;         // rank-1: the old cols
  float* new_rows;     // rank-1: the new rows (out)
  float* new_cols;     // rank-1: the new cols (out)
  const float* map;    // int8/int4: the map; fp8: the 256 values of the codes
  const uint8_t* table;  // int8/int4: the nearest-entry table (65536 codes)
  const float* bounds;   // int8/int4: the midpoints followed by +inf
};

struct CcStep {
  int64_t n;
  void* param;
  const void* grad;
  int32_t param_dtype;
  int32_t grad_dtype;
  int32_t l2;          // weight decay added to the gradient (Adam)
  int32_t maximize;
  int32_t stochastic;  // a bf16/f16 parameter written by stochastic rounding
  int32_t threads;
  uint64_t key;        // the stochastic rounding's key for this step
  float hp[8];         // decay, wd, 1-b1, b2, 1-b2, sqrt(bc2), eps, -step_size
  CcMoment m;
  CcMoment v;
};

int cc_host_adam_abi(void) { return 3; }

}  // extern "C"

namespace {

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, as torch's float -> bfloat16 (NaN -> 0x7FC0).
inline uint16_t f32_to_bf16(float x) {
  if (x != x) return 0x7FC0;
  uint32_t u = bits_of(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__F16C__)
inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f32_to_f16(float x) {
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
// Without F16C: the same conversions in integer and exact float32 arithmetic (the same bits,
// NaN payloads included: tested against the F16C build).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 31u, m = h & 0x3FFu;
  if (e == 31) return float_of(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e == 0) {  // a subnormal: m * 2**-24, exact
    const float x = static_cast<float>(m) * 5.9604644775390625e-08f;
    return float_of(sign | bits_of(x));
  }
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}
inline uint16_t f32_to_f16(float x) {  // round to nearest even
  const uint32_t u = bits_of(x);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7C00u);  // 2**16 and up: inf
  if (a < 0x38800000u) {  // below 2**-14: a multiple of 2**-24, |x| * 2**24 (exact) rounded
    const float t = float_of(a) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>((t + 8388608.0f) - 8388608.0f));
  }
  return static_cast<uint16_t>(sign | ((a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13));
}
#endif

// Round to nearest even into float8 e4m3fn, as torch's conversion (480 and beyond, and NaN,
// give NaN: the format has no infinity).
inline uint8_t f32_to_e4m3(float f) {
  const uint32_t all = bits_of(f);
  const uint32_t sign = (all >> 24) & 0x80u;
  const uint32_t b = all & 0x7FFFFFFFu;
  // Below 2**-6: a subnormal, a multiple of 2**-9: round f * 512 (< 8) to an integer, to
  // nearest even, by adding and subtracting 2**23 (exact IEEE arithmetic).
  const float t = float_of(b) * 512.0f;
  const uint32_t sub = static_cast<uint32_t>((t + 8388608.0f) - 8388608.0f);
  const uint32_t normal = (b + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
  const uint32_t mag = b >= 0x43F00000u ? 0x7Fu : (b < 0x3C800000u ? sub : normal);
  return static_cast<uint8_t>(sign | mag);
}

// The 64 random bits of element ``i`` under ``key`` (splitmix64's finalizer on
// key + (i + 1) * golden); _rounding.keyed_bits is the same in int64 torch ops.
inline uint64_t mix(uint64_t key, uint64_t i) {
  // (bf16 rounding takes 16 bits an element: element k the (k % 4)-th 16 bits, from the
  // lowest, of mix(key, k / 4); float16 takes the top 24 bits of mix(key, k).)
  uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The loops below are written without branches (selects), so that they vectorize.

inline float nan_min(float a, float b) {  // torch.minimum: NaN wins
  const float lo = a < b ? a : b;
  return b != b ? b : (a != a ? a : lo);
}

inline float clamp_finite(float x) {  // NaN stays NaN
  return x > kFltMax ? kFltMax : (x < -kFltMax ? -kFltMax : x);
}

// A finite x clamped to [-top, top] (the stochastic rounding's: a finite value never rounds
// to an infinity); inf and NaN as they are.
inline float saturated(float x, float top) {
  return x > top && x <= kFltMax ? top : (x < -top && x >= -kFltMax ? -top : x);
}

inline float safe(float s) { return s > 0.0f ? s : 1.0f; }

// Division by a divisor ``b`` fixed for the loop, as a product by its reciprocal r = 1 / b
// (correctly rounded) and one correction: q = a * r, rem = a - q * b (exact, by a fused
// multiply-add), q + rem * r rounded once. Markstein's theorem: with r within half an ulp of
// 1 / b and q within one ulp of a / b, that is a / b correctly rounded, so the same bits as
// the division (vdivps: a third of the element's time where it is the bound), provided
// nothing underflows: the callers hold a >= 2**-100 or 0 (then q is a, which is a / b), and
// b and r normal (``reciprocal_ok``). rem is NaN only for an infinite or NaN a, whose q is
// already a / b. Without FMA, the division itself (the same bits).
inline bool reciprocal_ok(float b) { return b >= 0x1p-60f && b <= 0x1p60f; }

inline float over(float a, float b, float r) {
#if defined(__FMA__) && !defined(CC_HOST_ADAM_PORTABLE)
  const float q = a * r;
  const float rem = std::fma(-q, b, a);
  const float fixed = std::fma(rem, r, q);
  return rem != rem || a == 0.0f ? q : fixed;
#else
  (void)r;
  return a / b;
#endif
}

// A plain loop, not memcpy: glibc's copy of a few KB (rep movsb) is slow on some CPUs.
inline void copy(float* __restrict dst, const float* __restrict src, int64_t len) {
  for (int64_t i = 0; i < len; ++i) dst[i] = src[i];
}

// A moment's 256 decoded values per code before the block scale (int8: the map, 0 past its
// end; fp8: the code's value / 448, the same float32 division as the twin's), as floats and,
// for the in-register lookup, as four planes of bytes (byte k of each value's bits).
struct Lut {
  alignas(64) float f[256];
  alignas(64) uint8_t plane[4][256];
  // int8: each code's upper bound (bounds[c]; NaN past the codes) as byte planes, for the
  // check that a code is still the nearest (search).
  alignas(64) uint8_t upper[4][256];
  const uint32_t* nearest = nullptr;  // int8: nearest_table's (below), else nullptr
};

// The nearest-entry table and the bound compare in one 32-bit word per bucket (the top 16
// bits of the pattern): the bucket's code c = table[bucket] in the low byte, and in the high
// half the low 16 bits of bounds[c]'s pattern (complemented for a negative bucket) where
// bounds[c] lies in the bucket, else 0xFFFF. For n in the bucket, n > bounds[c] exactly when
// n's low 16 bits (complemented if negative) are above that half: the same sign and top 16
// bits, so the patterns order as the values (reversed below zero); where bounds[c] lies in a
// higher bucket, n is below it. So code = c + (that compare), which is table[bucket] + (n >
// bounds[c]) for every n, NaN and infinities included: one load an element instead of two.
// Built once per (table, bounds) and kept for the process (a few maps; checked by content).
struct Nearest {
  std::vector<uint8_t> table;
  std::vector<float> bounds;
  std::vector<uint32_t> words;
};

const uint32_t* nearest_table(const uint8_t* table, const float* bounds, int count) {
  static std::mutex lock;
  static std::vector<std::unique_ptr<Nearest>> built;
  const std::lock_guard<std::mutex> hold(lock);
  for (const auto& e : built) {
    if (static_cast<int>(e->bounds.size()) == count &&
        std::memcmp(e->bounds.data(), bounds, 4 * count) == 0 &&
        std::memcmp(e->table.data(), table, 65536) == 0)
      return e->words.data();
  }
  if (built.size() >= 16) return nullptr;  // not a fixed set of maps: the two-load search
  auto e = std::make_unique<Nearest>();
  e->table.assign(table, table + 65536);
  e->bounds.assign(bounds, bounds + count);
  e->words.resize(65536);
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint32_t c = table[b];
    if (static_cast<int>(c) >= count) return nullptr;  // not a table of these bounds
    const uint32_t m = bits_of(bounds[c]), flip = b >> 15 ? 0xFFFFu : 0u;
    const uint32_t half = m >> 16 == b ? (m & 0xFFFFu) ^ flip : 0xFFFFu;
    e->words[b] = c | (half << 16);
  }
  built.push_back(std::move(e));
  return built.back()->words.data();
}

struct Buffers {
  std::vector<float> p, g, m, v, scale;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> noise;
  std::vector<uint64_t> draws;
  std::vector<uint32_t> words;
  const Lut* lut[2];  // the moments' decode tables (int8, fp8), else nullptr
  int skip[2] = {0, 0};  // int8: tiles to go before the moment's old-code check (search)
  Buffers(int64_t tile, const Lut* const* luts)
      : p(tile),
        g(tile),
        m(tile),
        v(tile),
        scale(tile),
        codes(tile),
        noise(tile + 4),
        draws(tile / 4 + 1),
        words(tile),
        lut{luts[0], luts[1]} {}
};

// The per-element scale of a rank-1 moment over flat elements [lo, lo + len) into ``out``
// (TIMES: ``out`` times it, each product rounded once).
template <bool TIMES = false>
void rank1_scales(const float* __restrict rows, const float* __restrict cols, int64_t ncols,
                  int64_t lo, int64_t len, float* __restrict out) {
  int64_t r = lo / ncols, c = lo % ncols, i = 0;
  while (i < len) {
    const int64_t run = ncols - c < len - i ? ncols - c : len - i;
    const float row = rows[r];
    for (int64_t k = 0; k < run; ++k) {
      const float scale = nan_min(row, cols[c + k]);
      out[i + k] = TIMES ? out[i + k] * scale : scale;
    }
    i += run;
    c = 0;
    ++r;
  }
}

// The value of an e4m3fn code (as torch's table of the 256 codes: exact).
inline float e4m3_to_f32(uint32_t c) {
  const uint32_t e = (c >> 3) & 15u, m = c & 7u;
  const uint32_t sub = bits_of(static_cast<float>(m) * 0.001953125f);  // m * 2**-9
  const uint32_t normal = ((e + 120u) << 23) | (m << 20);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(e == 0);  // masks: no branch
  const uint32_t is_nan = 0u - static_cast<uint32_t>((c & 0x7Fu) == 0x7Fu);
  const uint32_t mag = (((sub & is_sub) | (normal & ~is_sub)) & ~is_nan) | (0x7FC00000u & is_nan);
  return float_of(((c & 0x80u) << 24) | mag);
}

void make_lut(const CcMoment& mo, Lut& lut) {
  const int entries = mo.fmt == kFp8 || !mo.is_signed ? 256 : 255;  // the signed map: 255
  for (int c = 0; c < 256; ++c) {
    const float x = c >= entries ? 0.0f : (mo.fmt == kFp8 ? mo.map[c] / 448.0f : mo.map[c]);
    lut.f[c] = x;
    const uint32_t u = bits_of(x);
    for (int k = 0; k < 4; ++k) lut.plane[k][c] = static_cast<uint8_t>(u >> (8 * k));
    const uint32_t up = mo.fmt == kInt8 && c < entries ? bits_of(mo.bounds[c]) : 0x7FC00000u;
    for (int k = 0; k < 4; ++k) lut.upper[k][c] = static_cast<uint8_t>(up >> (8 * k));
  }
}

#if defined(__AVX512VBMI__) && !defined(CC_HOST_ADAM_PORTABLE)
// The order in which 64 codes are permuted before a byte-plane lookup (lookup64): the
// interleave of the planes (within 128-bit lanes) then comes out in order: position
// 16L + 4q + j takes code 16q + 4L + j.
alignas(64) const uint8_t kOrder[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,  //
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,  //
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,  //
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

// A 256-entry table of 32-bit values held as four byte planes in registers (tab[k][h]: byte
// k of entries 64h .. 64h + 63).
inline void load_planes(const uint8_t (&planes)[4][256], __m512i (&tab)[4][4]) {
  for (int k = 0; k < 4; ++k)
    for (int h = 0; h < 4; ++h) tab[k][h] = _mm512_load_si512(planes[k] + 64 * h);
}

// The entries of 64 codes (permuted by kOrder), as 4 x 16 values in the codes' order: each
// byte plane looked up by two vpermi2b (codes below and above 128) and a blend on the
// code's top bit, the planes interleaved back into 32-bit values.
inline void lookup64(const __m512i (&tab)[4][4], __m512i c, __m512i (&q)[4]) {
  const __mmask64 high = _mm512_movepi8_mask(c);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const __m512i lo = _mm512_permutex2var_epi8(tab[k][0], c, tab[k][1]);
    const __m512i hi = _mm512_permutex2var_epi8(tab[k][2], c, tab[k][3]);
    b[k] = _mm512_mask_blend_epi8(high, lo, hi);
  }
  const __m512i w0 = _mm512_unpacklo_epi8(b[0], b[1]), w1 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i x0 = _mm512_unpacklo_epi8(b[2], b[3]), x1 = _mm512_unpackhi_epi8(b[2], b[3]);
  q[0] = _mm512_unpacklo_epi16(w0, x0);
  q[1] = _mm512_unpackhi_epi16(w0, x0);
  q[2] = _mm512_unpacklo_epi16(w1, x1);
  q[3] = _mm512_unpackhi_epi16(w1, x1);
}
#endif

// out[i] = lut(d[i]) * s for i < len (a product rounded once, as the twin's).
void decode256(const Lut& lut, const uint8_t* __restrict d, int64_t len, float s,
               float* __restrict out) {
  int64_t i = 0;
#if defined(__AVX512VBMI__) && !defined(CC_HOST_ADAM_PORTABLE)
  // 64 codes at a time, looked up in registers (lookup64).
  const __m512i perm = _mm512_load_si512(kOrder);
  __m512i tab[4][4];
  load_planes(lut.plane, tab);
  const __m512 scale = _mm512_set1_ps(s);
  for (; i + 64 <= len; i += 64) {
    __m512i q[4];
    lookup64(tab, _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(d + i)), q);
    for (int k = 0; k < 4; ++k)
      _mm512_storeu_ps(out + i + 16 * k, _mm512_mul_ps(_mm512_castsi512_ps(q[k]), scale));
  }
#endif
  for (; i < len; ++i) out[i] = lut.f[d[i]] * s;
}

// Decode elements [lo, lo + len) of ``mo`` into ``out`` (a tile never crosses a block);
// ``lut``: int8 and fp8's (make_lut).
void decode(const CcMoment& mo, int64_t numel, int64_t lo, int64_t len, float* __restrict out,
            const Lut* lut) {
  const float* __restrict map = mo.map;
  switch (mo.fmt) {
    case kPlain:
      copy(out, static_cast<const float*>(mo.data) + lo, len);
      return;
    case kBf16: {
      const uint16_t* __restrict d = static_cast<const uint16_t*>(mo.data) + lo;
      for (int64_t i = 0; i < len; ++i) out[i] = bf16_to_f32(d[i]);
      return;
    }
    case kInt8:
    case kFp8:
      decode256(*lut, static_cast<const uint8_t*>(mo.data) + lo, len, mo.absmax[lo / mo.block],
                out);
      return;
    default: {  // int4, blocked or rank-1; lo is even
      const uint8_t* __restrict d = static_cast<const uint8_t*>(mo.data) + lo / 2;
      const uint32_t entries = mo.is_signed ? 15 : 16;  // the signed map has 15 entries
      auto value = [map, entries](uint32_t c) { return c < entries ? map[c] : 0.0f; };
      int64_t j = 0;
#if defined(__AVX512F__)
      // 16 codes at a time, looked up in a register (the compiler's gathers go to memory);
      // blocked: times the block's scale there too.
      const bool blockwise = mo.fmt == kInt4;
      const float s = blockwise ? mo.absmax[lo / mo.block] : 1.0f;
      const __m512 table = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << entries) - 1u), map);
      const __m512 sv = _mm512_set1_ps(s);
      const __m128i low4 = _mm_set1_epi8(15);
      for (; 2 * j + 16 <= len; j += 8) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(d + j));
        const __m128i lo_n = _mm_and_si128(bytes, low4);
        const __m128i hi_n = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo_n, hi_n));
        const __m512 val = _mm512_permutexvar_ps(idx, table);
        _mm512_storeu_ps(out + 2 * j, blockwise ? _mm512_mul_ps(val, sv) : val);
      }
#endif
      const int64_t scaled = 2 * j;  // elements already times their block's scale
      for (; j < len / 2; ++j) {
        out[2 * j] = value(d[j] & 15u);
        out[2 * j + 1] = value(d[j] >> 4);
      }
      if (len & 1) out[len - 1] = value(d[len / 2] & 15u);
      if (mo.fmt == kInt4) {
        const float s = mo.absmax[lo / mo.block];
        for (int64_t i = scaled; i < len; ++i) out[i] = out[i] * s;
      } else {
        rank1_scales<true>(mo.absmax, mo.cols, numel / mo.rows, lo, len, out);
      }
    }
  }
}

// bucketize(n, mids) for NM midpoints and no NaN: the number of midpoints below n.
template <int NM>
void count_codes(const float* __restrict n, int64_t len, const float* __restrict mids,
                 uint8_t* __restrict codes) {
  float m[NM];
  for (int j = 0; j < NM; ++j) m[j] = mids[j];
  for (int64_t i = 0; i < len; ++i) {
    int32_t c = 0;
    for (int j = 0; j < NM; ++j) c += n[i] > m[j] ? 1 : 0;
    codes[i] = static_cast<uint8_t>(c);
  }
}

// The bf16 code of x, as encode_tensors: clamped to bf16's range, rounded to nearest even;
// an unsigned x > 0 never 0 (bf16's smallest subnormal, 2**-133, instead). In integer
// arithmetic on the magnitude (few masks, so the loops that call it stay in registers): its
// rounding never carries into the sign, a magnitude rounded above bf16's largest (an inf
// included) is clamped to it, and only a NaN takes the select.
inline uint16_t bf16_code(float x, bool is_unsigned) {
  const uint32_t u = bits_of(x), a = u & 0x7FFFFFFFu, sign = (u >> 16) & 0x8000u;
  uint32_t mag = (a + 0x7FFFu + ((a >> 16) & 1u)) >> 16;
  mag = mag < 0x7F7Fu ? mag : 0x7F7Fu;  // kBf16Max's code
  const uint32_t lift = static_cast<uint32_t>(is_unsigned) & static_cast<uint32_t>(sign == 0) &
                        static_cast<uint32_t>(a != 0);  // x > 0 (a NaN: the select below)
  mag = mag > lift ? mag : lift;
  return static_cast<uint16_t>(a > 0x7F800000u ? 0x7FC0u : (sign | mag));
}

#if defined(__AVX512F__) && !defined(CC_HOST_ADAM_PORTABLE)
// The int8 codes of 16 elements by the one-load table (nearest_table): the words looked up
// by scalar loads (a hardware gather is slower), compared in a vector; an unsigned x > 0
// lifted from code 0 to 1 (floor = 1).
inline void word_codes16(const uint32_t* __restrict nearest, const uint32_t* __restrict u,
                         const float* __restrict x, uint32_t floor, uint8_t* __restrict out) {
  alignas(64) uint32_t words[16];
  for (int i = 0; i < 16; i += 4) {
    uint64_t p0, p1;
    std::memcpy(&p0, u + i, 8);
    std::memcpy(&p1, u + i + 2, 8);
    asm("" : "+r"(p0), "+r"(p1));
    words[i] = nearest[static_cast<uint32_t>(p0) >> 16];
    words[i + 1] = nearest[p0 >> 48];
    words[i + 2] = nearest[static_cast<uint32_t>(p1) >> 16];
    words[i + 3] = nearest[p1 >> 48];
  }
  const __m512i b = _mm512_loadu_si512(u), w = _mm512_load_si512(words);
  const __m512i low = _mm512_and_si512(_mm512_xor_si512(b, _mm512_srai_epi32(b, 31)), _mm512_set1_epi32(0xFFFF));
  __m512i c = _mm512_and_si512(w, _mm512_set1_epi32(0xFF));
  c = _mm512_mask_add_epi32(c, _mm512_cmpgt_epu32_mask(low, _mm512_srli_epi32(w, 16)), c, _mm512_set1_epi32(1));
  const __mmask16 pos = _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_setzero_ps(), _CMP_GT_OQ);
  c = _mm512_mask_or_epi32(c, pos & _mm512_testn_epi32_mask(c, c), c, _mm512_set1_epi32(static_cast<int32_t>(floor)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(c));
}
#endif

// The codes of int8 and int4 (blocked or rank-1) from the normalized values ``n`` of the
// values ``x`` (amax_bits: the tile's largest |x| as bits, above 0x7F800000 for a NaN).
void search(const CcMoment& mo, int64_t lo, int64_t len, const float* __restrict x,
            const float* __restrict n, uint8_t* __restrict codes, uint32_t* __restrict words,
            const Lut* lut, uint32_t amax_bits, int& skip) {
  const bool is_unsigned = !mo.is_signed;
  uint8_t* __restrict d = static_cast<uint8_t*>(mo.data);
  const uint8_t* __restrict table = mo.table;
  const float* __restrict bounds = mo.bounds;
  if (mo.fmt == kInt8 && lut != nullptr && lut->nearest != nullptr) {
    const uint32_t* __restrict nearest = lut->nearest;
    const uint32_t* __restrict u = reinterpret_cast<const uint32_t*>(n);
    uint8_t* __restrict out = static_cast<uint8_t*>(mo.data) + lo;
    const uint32_t floor = is_unsigned ? 1u : 0u;  // code 0 lifted to 1 (c | 1 where c = 0)
    // The code of element k from its word in the one-load table (looked up below).
    auto word_code = [&](int64_t k) {
      const uint32_t b = u[k], w = words[k];
      const uint32_t low = (b ^ (0u - (b >> 31))) & 0xFFFFu;
      const uint32_t c = (w & 0xFFu) + static_cast<uint32_t>(low > (w >> 16));
      return static_cast<uint8_t>(c | (static_cast<uint32_t>(x[k] > 0.0f) & (c == 0) & floor));
    };
    int64_t start = 0;
#if defined(__AVX512VBMI__) && !defined(CC_HOST_ADAM_PORTABLE)
    // First the element's old code c (still in ``out``), kept where it is still the nearest:
    // bucketize(n, mids) is c exactly when bounds[c - 1] < n <= bounds[c] (no lower bound
    // for c = 0; a NaN n fails both): its bounds looked up in registers, 64 codes at a
    // time; a group of 16 with a code that moved takes the table (word_codes16).
    if (skip > 0) {
      --skip;
    } else {
      int64_t kept_groups = 0;  // groups of 16 whose old codes all stay
      const __m512i perm = _mm512_load_si512(kOrder), one8 = _mm512_set1_epi8(1);
      const __m512i lift = _mm512_set1_epi32(static_cast<int32_t>(floor));
      __m512i tab[4][4];
      load_planes(lut->upper, tab);
      for (; start + 64 <= len; start += 64) {
        const __m512i raw = _mm512_loadu_si512(out + start);
        const __m512i c = _mm512_permutexvar_epi8(perm, raw);
        const __mmask64 zeros = _mm512_testn_epi8_mask(raw, raw);  // old code 0, in order
        // The upper bounds compared first, then the lower ones in the same registers (fewer
        // live at once: the tables take 16).
        __m512i q[4];
        __mmask16 le[4];
        lookup64(tab, c, q);
        for (int k = 0; k < 4; ++k)
          le[k] = _mm512_cmp_ps_mask(_mm512_loadu_ps(n + start + 16 * k), _mm512_castsi512_ps(q[k]), _CMP_LE_OQ);
        lookup64(tab, _mm512_sub_epi8(c, one8), q);
        for (int k = 0; k < 4; ++k) {
          const int64_t at = start + 16 * k;
          const __mmask16 zero = static_cast<__mmask16>(zeros >> (16 * k));
          const __mmask16 hit = le[k] & (zero | _mm512_cmp_ps_mask(_mm512_loadu_ps(n + at), _mm512_castsi512_ps(q[k]), _CMP_GT_OQ));
          if (hit == 0xFFFF) {
            // Kept: the codes in ``out`` stand, but an unsigned x > 0 at code 0 takes 1.
            if (floor != 0 && zero != 0) {
              const __mmask16 pos = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + at), _mm512_setzero_ps(), _CMP_GT_OQ);
              if ((pos & zero) != 0) {
                const __m512i c32 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(out + at)));
                const __m512i kept = _mm512_mask_or_epi32(c32, pos & zero, c32, lift);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(out + at), _mm512_cvtepi32_epi8(kept));
              }
            }
            ++kept_groups;
          } else {
            word_codes16(nearest, u + at, x + at, floor, out + at);
          }
        }
      }
      // Most old codes no longer the nearest (a gradient unlike the last): the next tiles of
      // this moment skip the check (the table alone is cheaper), then try it again.
      if (kept_groups < 3 * start / 64) skip = 32;  // under 3 in 4 groups kept
    }
#endif
    // The one-load table (nearest_table): the words looked up two elements a 64-bit load,
    // the compare and the unsigned floor vectorized. (The barrier keeps the lookups scalar:
    // hardware gathers are slower than scalar loads on the CPUs measured.)
    int64_t i = start;
    for (; i + 4 <= len; i += 4) {
      uint64_t p0, p1;
      std::memcpy(&p0, u + i, 8);
      std::memcpy(&p1, u + i + 2, 8);
#if defined(__GNUC__)
      asm("" : "+r"(p0), "+r"(p1));
#endif
      words[i] = nearest[static_cast<uint32_t>(p0) >> 16];
      words[i + 1] = nearest[p0 >> 48];
      words[i + 2] = nearest[static_cast<uint32_t>(p1) >> 16];
      words[i + 3] = nearest[p1 >> 48];
    }
    for (; i < len; ++i) words[i] = nearest[u[i] >> 16];
    int64_t k = start;
#if defined(__AVX512F__) && !defined(CC_HOST_ADAM_PORTABLE)
    const __m512i ones = _mm512_set1_epi32(1), byte = _mm512_set1_epi32(0xFF);
    const __m512i half = _mm512_set1_epi32(0xFFFF), lift = _mm512_set1_epi32(floor);
    for (; k + 16 <= len; k += 16) {
      const __m512i b = _mm512_loadu_si512(u + k), w = _mm512_loadu_si512(words + k);
      const __m512i low = _mm512_and_si512(_mm512_xor_si512(b, _mm512_srai_epi32(b, 31)), half);
      __m512i c = _mm512_and_si512(w, byte);
      c = _mm512_mask_add_epi32(c, _mm512_cmpgt_epu32_mask(low, _mm512_srli_epi32(w, 16)), c, ones);
      const __mmask16 pos = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + k), _mm512_setzero_ps(), _CMP_GT_OQ);
      c = _mm512_mask_or_epi32(c, pos & _mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()), c, lift);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(c));
    }
#endif
    for (; k < len; ++k) out[k] = word_code(k);
    return;
  }
  int64_t done = 0;  // elements whose int4 codes are written (packed) already
#if defined(__AVX512F__) && !defined(CC_HOST_ADAM_PORTABLE)
  if (mo.fmt != kInt8 && amax_bits <= 0x7F800000u) {
    // int4 without NaN, 16 lanes at a time: the count of midpoints below n by a binary
    // search in one register (the 14 or 15 midpoints, then +inf: never below n; sorted, so
    // the midpoints below n are a prefix and four probes find its length), the codes packed
    // two a byte (a 64-bit lane holds two codes: low | high << 4).
    const __mmask16 first = static_cast<__mmask16>((1u << (mo.is_signed ? 14 : 15)) - 1u);
    const __m512 mids = _mm512_mask_loadu_ps(_mm512_set1_ps(INFINITY), first, bounds);
    uint8_t* __restrict q = d + lo / 2;  // lo is even
    for (; done + 16 <= len; done += 16) {
      const __m512 v = _mm512_loadu_ps(n + done);
      __m512i c = _mm512_setzero_si512();
      for (int step = 8; step >= 1; step >>= 1) {
        const __m512i probe = _mm512_add_epi32(c, _mm512_set1_epi32(step - 1));
        const __mmask16 gt = _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(probe, mids), _CMP_GT_OQ);
        c = _mm512_mask_add_epi32(c, gt, c, _mm512_set1_epi32(step));
      }
      const __m512i pair = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + done / 2), _mm512_cvtepi64_epi8(pair));
    }
    if (done == len) return;
  }
#endif
  // The nearest entry: bucketize(n, mids), by the table of maps.py (its bucket's code, plus
  // one above the bucket's midpoint).
  if (mo.fmt != kInt8 && amax_bits <= 0x7F800000u) {
    // int4: bucketize as the count of the 14 or 15 midpoints below n (no NaN in the tile;
    // the table gives the same code, and a NaN's as bucketize does).
    if (mo.is_signed) count_codes<14>(n + done, len - done, bounds, codes + done);
    else count_codes<15>(n + done, len - done, bounds, codes + done);
  } else {
    for (int64_t i = 0; i < len; ++i) {
      const int32_t code = table[bits_of(n[i]) >> 16];
      codes[i] = static_cast<uint8_t>(code + (n[i] > bounds[code] ? 1 : 0));
    }
  }
  if (mo.fmt == kInt8) {  // an unsigned x > 0 never takes code 0 (the map's zero)
    uint8_t* __restrict out = d + lo;
    const uint8_t floor = is_unsigned ? 1 : 0;
    for (int64_t i = 0; i < len; ++i) {
      out[i] = x[i] > 0.0f && codes[i] < floor ? floor : codes[i];
    }
    return;
  }
  uint8_t* __restrict q = d + lo / 2;  // int4: lo is even; an odd tail's high nibble is 0
  for (int64_t j = done / 2; j < len / 2; ++j) q[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
  if (len & 1) q[len / 2] = codes[len - 1];
}

#if defined(__AVX512F__) && !defined(CC_HOST_ADAM_PORTABLE)
// x clamped as clamp_finite (an inf's pattern less one: +-FLT_MAX; NaN stays): only where
// the block holds an inf or a NaN (CLAMP).
template <bool CLAMP>
inline __m512 clamped(const float* x) {
  __m512i b = _mm512_loadu_si512(x);
  if constexpr (CLAMP) {
    const __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 inf = _mm512_cmpeq_epi32_mask(a, _mm512_set1_epi32(0x7F800000));
    b = _mm512_mask_sub_epi32(b, inf, b, _mm512_set1_epi32(1));
  }
  return _mm512_castsi512_ps(b);
}

// x / s for 16 lanes, by over()'s product and correction (s and r = 1 / s normal:
// reciprocal_ok): a zero or NaN x takes q (its quotient already: +-0, NaN); a lane with a
// quotient below 2**-124 or 0 < |x| < 2**-100, where the quotient or the remainder could
// underflow, is divided (a branch per 16 lanes, rarely taken: such a value is 2**-100 of
// its block's largest).
inline __m512 over16(__m512 x, __m512 s, __m512 r) {
  const __m512 q = _mm512_mul_ps(x, r);
  const __m512 rem = _mm512_fnmadd_ps(q, s, x);
  const __m512 fixed = _mm512_fmadd_ps(rem, r, q);
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 plain = _mm512_cmp_ps_mask(x, zero, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(rem, rem, _CMP_UNORD_Q);
  const __m512 ax = _mm512_abs_ps(x), aq = _mm512_abs_ps(q);
  const __mmask16 tiny = (_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ) |
                          _mm512_cmp_ps_mask(aq, _mm512_set1_ps(0x1p-124f), _CMP_LT_OQ)) & ~plain;
  const __m512 out = _mm512_mask_mov_ps(fixed, plain, q);
  return tiny ? _mm512_mask_div_ps(out, tiny, x, s) : out;
}

// x / s, 16 lanes: over16 where reciprocal_ok(s) (``FAST``), else the division.
template <bool FAST>
inline __m512 divided(__m512 x, __m512 s, __m512 r) {
  if constexpr (FAST) return over16(x, s, r);
  (void)r;
  return _mm512_div_ps(x, s);
}

// n = clamped x / s, 16 lanes at a time; returns the elements done.
template <bool CLAMP, bool FAST>
int64_t normalized_as(const float* __restrict x, int64_t len, float s, float* __restrict n) {
  const __m512 sv = _mm512_set1_ps(s), rv = _mm512_set1_ps(1.0f / s);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) _mm512_storeu_ps(n + i, divided<FAST>(clamped<CLAMP>(x + i), sv, rv));
  return i;
}

template <bool CLAMP>
int64_t normalized(const float* __restrict x, int64_t len, float s, float* __restrict n) {
  return reciprocal_ok(s) ? normalized_as<CLAMP, true>(x, len, s, n) : normalized_as<CLAMP, false>(x, len, s, n);
}

// fp8 codes of clamped x / s (f32_to_e4m3 of the normalized value * 448; an unsigned x > 0
// never code 0), 16 lanes at a time; returns the elements done.
template <bool UNSIGNED, bool CLAMP, bool FAST>
int64_t fp8_codes_as(const float* __restrict x, int64_t len, float s, uint8_t* __restrict out) {
  const __m512 sv = _mm512_set1_ps(s), k448 = _mm512_set1_ps(448.0f), k512 = _mm512_set1_ps(512.0f);
  const __m512 rv = _mm512_set1_ps(1.0f / s);
  const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
  const __m512i bias = _mm512_set1_epi32(static_cast<int32_t>(0xC407FFFFu));  // (7-127)<<23 + 0x7FFFF
  const __m512i sub_top = _mm512_set1_epi32(0x3C800000), sat = _mm512_set1_epi32(0x43F00000);
  const __m512i nan_code = _mm512_set1_epi32(0x7F), sign_bit = _mm512_set1_epi32(0x80);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 xv = clamped<CLAMP>(x + i);
    const __m512i y = _mm512_castps_si512(_mm512_mul_ps(divided<FAST>(xv, sv, rv), k448));
    const __m512i ya = _mm512_and_si512(y, abs);
    // Below 2**-6: a multiple of 2**-9, |y| * 512 (< 8, exact) rounded to nearest even.
    const __m512i sub = _mm512_cvt_roundps_epu32(_mm512_mul_ps(_mm512_castsi512_ps(ya), k512),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(ya, 20), one);
    __m512i mag = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(ya, bias), odd), 20);
    mag = _mm512_mask_mov_epi32(mag, _mm512_cmplt_epu32_mask(ya, sub_top), sub);
    mag = _mm512_mask_mov_epi32(mag, _mm512_cmpge_epu32_mask(ya, sat), nan_code);
    __m512i c = _mm512_ternarylogic_epi32(_mm512_srli_epi32(y, 24), sign_bit, mag, 0xEA);  // (a & b) | c
    if constexpr (UNSIGNED)  // x > 0: a positive code, at least 1
      c = _mm512_mask_max_epu32(c, _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_GT_OQ), c, one);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(c));
  }
  return i;
}

template <bool UNSIGNED, bool CLAMP>
int64_t fp8_codes(const float* __restrict x, int64_t len, float s, uint8_t* __restrict out) {
  return reciprocal_ok(s) ? fp8_codes_as<UNSIGNED, CLAMP, true>(x, len, s, out)
                          : fp8_codes_as<UNSIGNED, CLAMP, false>(x, len, s, out);
}
#endif

#if defined(__AVX512BW__) && !defined(CC_HOST_ADAM_PORTABLE)
// bf16_code of 16 values, the same integer arithmetic in a register (g++'s vectorization of
// the scalar code takes about twice the instructions): round the magnitude to nearest even,
// clamp it to the largest finite code, lift an unsigned x > 0 to at least 1, put the sign
// back, a NaN's code 0x7FC0.
//
// ``lift``: the lanes whose x > 0 is lifted (all of them for an unsigned moment, none else).
inline __m256i bf16_codes_of(__m512 xv, __mmask16 lift) {
  const __m512i u = _mm512_castps_si512(xv);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 16), _mm512_set1_epi32(1));
  __m512i mag = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFF)), odd), 16);
  mag = _mm512_min_epu32(mag, _mm512_set1_epi32(0x7F7F));
  // x > 0 (false for NaN, which the select below takes)
  mag = _mm512_mask_max_epu32(mag, lift & _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_GT_OQ), mag, _mm512_set1_epi32(1));
  __m512i code = _mm512_ternarylogic_epi32(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000), mag, 0xEA);  // (a & b) | c
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(code);
}

template <bool UNSIGNED>
inline void bf16_codes16(uint16_t* __restrict d, const float* __restrict x) {
  const __m512 xv = _mm512_loadu_ps(x);
  const __m512i u = _mm512_castps_si512(xv);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 16), _mm512_set1_epi32(1));
  __m512i mag = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFF)), odd), 16);
  mag = _mm512_min_epu32(mag, _mm512_set1_epi32(0x7F7F));
  if constexpr (UNSIGNED)  // x > 0 (false for NaN, which the select below takes)
    mag = _mm512_mask_max_epu32(mag, _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_GT_OQ), mag, _mm512_set1_epi32(1));
  __m512i code = _mm512_ternarylogic_epi32(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000), mag, 0xEA);  // (a & b) | c
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm512_cvtepi32_epi16(code));
}
#endif

// A bf16 moment's codes, out of line: inlined into encode, its loop changed the code of the
// blocked formats beside it (int8 measured 1-10% slower in A/B runs; out of line, 0-4%).
#if defined(__GNUC__)
__attribute__((noinline))
#endif
void encode_bf16(uint16_t* __restrict d, const float* __restrict x, int64_t len, bool is_unsigned) {
  int64_t i = 0;
#if defined(__AVX512BW__) && !defined(CC_HOST_ADAM_PORTABLE)
  if (is_unsigned) {
    for (; i + 16 <= len; i += 16) bf16_codes16<true>(d + i, x + i);
  } else {
    for (; i + 16 <= len; i += 16) bf16_codes16<false>(d + i, x + i);
  }
#endif
  for (; i < len; ++i) d[i] = bf16_code(x[i], is_unsigned);
}

// Encode the new values x[0, len) of elements [lo, lo + len) into ``mo`` (in place); ``n``
// is scratch for the normalized values.
void encode(const CcMoment& mo, int64_t numel, int64_t lo, int64_t len, float* __restrict x,
            float* __restrict n, uint8_t* __restrict codes, uint32_t* __restrict words,
            const Lut* lut, int& skip) {
  const bool is_unsigned = !mo.is_signed;
  if (mo.fmt == kBf16) {
    encode_bf16(static_cast<uint16_t*>(mo.data) + lo, x, len, is_unsigned);
    return;
  }
#if defined(__AVX512F__) && !defined(CC_HOST_ADAM_PORTABLE)
  if (mo.fmt == kInt8 || mo.fmt == kFp8 || mo.fmt == kInt4) {
    // The scalar code below in two passes of 16 lanes: the block's amax, then each value
    // normalized and fp8's code written (the others' normalized values, for their search).
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i acc = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16)
      acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_loadu_si512(x + i), abs));
    uint32_t raw = _mm512_reduce_max_epu32(acc);  // |x| before the clamp
    for (; i < len; ++i) {
      const uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
      raw = a > raw ? a : raw;
    }
    // Clamped, an inf becomes FLT_MAX, the pattern below it; a NaN stays above.
    const uint32_t amax_bits = raw == 0x7F800000u ? 0x7F7FFFFFu : raw;
    const float amax = float_of(amax_bits);
    mo.absmax[lo / mo.block] = amax;
    const float s = safe(amax);
    uint8_t* __restrict out = static_cast<uint8_t*>(mo.data) + lo;
    const bool clamp = raw >= 0x7F800000u;  // an inf or a NaN in the block
    if (mo.fmt == kFp8) {
      if (is_unsigned) i = clamp ? fp8_codes<true, true>(x, len, s, out) : fp8_codes<true, false>(x, len, s, out);
      else i = clamp ? fp8_codes<false, true>(x, len, s, out) : fp8_codes<false, false>(x, len, s, out);
    } else {
      i = clamp ? normalized<true>(x, len, s, n) : normalized<false>(x, len, s, n);
    }
    for (; i < len; ++i) {
      x[i] = clamp_finite(x[i]);
      n[i] = x[i] / s;
      if (mo.fmt == kFp8) {
        const uint8_t c = f32_to_e4m3(n[i] * 448.0f);
        out[i] = is_unsigned && x[i] > 0.0f && c == 0 ? 1 : c;
      }
    }
    if (mo.fmt != kFp8) search(mo, lo, len, x, n, codes, words, lut, amax_bits, skip);
    return;
  }
#endif
  uint32_t amax_bits = 0;
  for (int64_t i = 0; i < len; ++i) {
    x[i] = clamp_finite(x[i]);
    const uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
    amax_bits = a > amax_bits ? a : amax_bits;  // above 0x7F800000: a NaN (amax is NaN)
  }
  if (mo.fmt == kRank1) {
    rank1_scales(mo.new_rows, mo.new_cols, numel / mo.rows, lo, len, n);
    for (int64_t i = 0; i < len; ++i) n[i] = x[i] / safe(n[i]);
  } else {
    const float amax = float_of(amax_bits);
    mo.absmax[lo / mo.block] = amax;
    const float s = safe(amax);
    for (int64_t i = 0; i < len; ++i) n[i] = x[i] / s;
  }
  uint8_t* __restrict d = static_cast<uint8_t*>(mo.data);
  if (mo.fmt == kFp8) {
    for (int64_t i = 0; i < len; ++i) {
      const uint8_t c = f32_to_e4m3(n[i] * 448.0f);
      d[lo + i] = is_unsigned && x[i] > 0.0f && c == 0 ? 1 : c;
    }
    return;
  }
  search(mo, lo, len, x, n, codes, words, lut, amax_bits, skip);
}

inline float load(const void* base, int32_t dtype, int64_t i) {
  if (dtype == kF32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return dtype == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// The Adam math on a tile: g, m, v, p in; m, v, p out (the twin's float32 operations).
// The Adam math on a tile (the twin's float32 operations), in place on four distinct arrays.
// Each stream is read and written in the one loop, which keeps the memory busy (a copy loop
// per stream, through buffers, runs at half the speed).
template <bool L2, bool MAXIMIZE>
void math(const CcStep& s, int64_t len, float* __restrict p, const float* __restrict g,
          float* __restrict m, float* __restrict v) {
  const float decay = s.hp[0], wd = s.hp[1], w = s.hp[2], b2 = s.hp[3], omb2 = s.hp[4];
  const float bc2 = s.hp[5], eps = s.hp[6], neg_step = s.hp[7];
  const bool low = w < 0.5f;  // torch's lerp: two formulas, by the weight
  const float omw = 1.0f - w;
  for (int64_t i = 0; i < len; ++i) {
    float gi = MAXIMIZE ? -g[i] : g[i];
    float pi = p[i];
    if (L2) {
      gi = gi + pi * wd;
    } else {
      pi = pi * decay;  // decay is 1 without decoupled weight decay (exact)
    }
    const float mi = m[i];
    const float mn = low ? mi + w * (gi - mi) : gi - (gi - mi) * omw;
    const float vn = v[i] * b2 + (omb2 * gi) * gi;
    const float denom = std::sqrt(vn) / bc2 + eps;
    p[i] = pi + (neg_step * mn) / denom;
    m[i] = mn;
    v[i] = vn;
  }
}

// A tile's array of float32 ``x`` (elements [lo, lo + len)): the tensor itself when ``write``
// (updated in place), else a copy in ``buf``.
float* in_place(float* x, int64_t lo, int64_t len, bool write, std::vector<float>& buf) {
  if (write) return x + lo;
  copy(buf.data(), x + lo, len);
  return buf.data();
}

// Update the tile [lo, lo + len): a float32 parameter and plain moments are updated in place
// when ``write``; everything else is left in ``b`` (p, m, v) for the caller to encode.
void tile_update(const CcStep& s, int64_t lo, int64_t len, Buffers& b, bool write) {
  float *p, *m, *v;
  const float* g;
  if (s.param_dtype == kF32) {
    p = in_place(static_cast<float*>(s.param), lo, len, write, b.p);
  } else {
    for (int64_t i = 0; i < len; ++i) b.p[i] = load(s.param, s.param_dtype, lo + i);
    p = b.p.data();
  }
  if (s.grad_dtype == kF32) {
    g = static_cast<const float*>(s.grad) + lo;
  } else {
    for (int64_t i = 0; i < len; ++i) b.g[i] = load(s.grad, s.grad_dtype, lo + i);
    g = b.g.data();
  }
  if (s.m.fmt == kPlain) {
    m = in_place(static_cast<float*>(s.m.data), lo, len, write, b.m);
  } else {
    decode(s.m, s.n, lo, len, b.m.data(), b.lut[0]);
    m = b.m.data();
  }
  if (s.v.fmt == kPlain) {
    v = in_place(static_cast<float*>(s.v.data), lo, len, write, b.v);
  } else {
    decode(s.v, s.n, lo, len, b.v.data(), b.lut[1]);
    v = b.v.data();
  }
  if (s.l2) {
    if (s.maximize) math<true, true>(s, len, p, g, m, v);
    else math<true, false>(s, len, p, g, m, v);
  } else {
    if (s.maximize) math<false, true>(s, len, p, g, m, v);
    else math<false, false>(s, len, p, g, m, v);
  }
}

void write_param(const CcStep& s, int64_t lo, int64_t len, const float* x) {
  if (s.param_dtype == kF32) {
    copy(static_cast<float*>(s.param) + lo, x, len);
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(s.param) + lo;
  if (!s.stochastic) {
    for (int64_t i = 0; i < len; ++i)
      d[i] = s.param_dtype == kBF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
    return;
  }
  if (s.param_dtype == kBF16) {
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t u = bits_of(x[i]);
      if ((u & 0x7F800000u) == 0x7F800000u) {  // inf and NaN: never perturbed
        d[i] = f32_to_bf16(x[i]);
      } else {
        const uint64_t k = static_cast<uint64_t>(lo + i);
        const uint32_t noise = static_cast<uint32_t>(mix(s.key, k >> 2) >> (16 * (k & 3))) & 0xFFFFu;
        d[i] = static_cast<uint16_t>((bits_of(saturated(x[i], kBf16Max)) + noise) >> 16);
      }
    }
    return;
  }
  for (int64_t i = 0; i < len; ++i) {  // f16: to the other neighbour with p = distance / gap
    const float xi = saturated(x[i], kF16Max);
    const uint16_t near = f32_to_f16(xi);
    const float near32 = f16_to_f32(near);
    uint16_t other;
    const bool down = near32 > xi;
    if ((near & 0x7FFFu) == 0) other = down ? 0x8001 : 0x0001;
    else if (((near & 0x8000u) != 0) == down) other = static_cast<uint16_t>(near + 1);
    else other = static_cast<uint16_t>(near - 1);
    const float gap = std::fabs(f16_to_f32(other) - near32);
    const float pr = std::fabs(xi - near32) / gap;
    const float u = static_cast<float>(mix(s.key, lo + i) >> 40) * 5.9604644775390625e-08f;
    const bool pick = std::isfinite(xi) && std::isfinite(pr) && u < pr;
    d[i] = pick ? other : near;
  }
}

// ----- the fused tile: every stream read and written in one loop -------------------------
//
// The path for the usual configurations (both moments of one format, a float32 or bf16
// parameter, a float32 or bf16 gradient): one loop reads the parameter, the gradient and
// both moments (decoded inline; int4 decoded just before), computes, and writes the
// parameter and the element-wise moments (plain, bf16); a blocked moment's new values go
// to a buffer that its block's encode reads after. The other configurations take
// ``tile_update`` (the same arithmetic, in phases).

enum ParamMode { kPF32 = 0, kPBf16 = 1, kPBf16Sr = 2 };

template <int F>
inline float moment_in(const void* __restrict data, const float* __restrict buf,
                       const float* __restrict map, float scale, int64_t k, int64_t i) {
  if constexpr (F == kPlain) return static_cast<const float*>(data)[k];
  if constexpr (F == kBf16) return bf16_to_f32(static_cast<const uint16_t*>(data)[k]);
  (void)map;
  (void)scale;
  return buf[i];  // blocked: decoded before the loop (an inline table lookup on the codes
                  // stops the loop's vectorization)
}

template <int F>
inline void moment_out(void* __restrict data, float* __restrict buf, bool is_unsigned,
                       int64_t k, int64_t i, float x) {
  if constexpr (F == kPlain) {
    static_cast<float*>(data)[k] = x;
  } else {
    // Blocked: encoded by block after the loop. bf16: encoded after the loop as well, by
    // encode_bf16's vector code (from the buffer, in L1).
    (void)data;
    (void)is_unsigned;
    (void)k;
    buf[i] = x;
  }
}

template <int MF, int VF, int PM, bool GBF, bool L2, bool PASS1, typename PT, typename GT>
void fused_loop(const CcStep& s, int64_t lo, int64_t len, PT* __restrict param,
                const GT* __restrict grad, void* __restrict md, float* __restrict mb,
                void* __restrict vd, float* __restrict vb, float ms, float vs,
                const uint16_t* __restrict noise16) {
  const float decay = s.hp[0], wd = s.hp[1], w = s.hp[2], b2 = s.hp[3], omb2 = s.hp[4];
  const float bc2 = s.hp[5], eps = s.hp[6], neg_step = s.hp[7];
  const float rbc2 = 1.0f / bc2;  // pick() takes this loop only where reciprocal_ok(bc2)
  const float sgn = s.maximize ? -1.0f : 1.0f;  // g * -1 is -g, exactly
  const bool low = w < 0.5f;
  const float coef = low ? w : -(1.0f - w);
  const float* __restrict m_map = s.m.map;
  const float* __restrict v_map = s.v.map;
  const bool m_uns = !s.m.is_signed, v_uns = !s.v.is_signed;
  for (int64_t i = 0; i < len; ++i) {
    const int64_t k = lo + i;
    float pi, gi;
    if constexpr (PM == kPF32) pi = param[k];
    else pi = bf16_to_f32(param[k]);
    if constexpr (GBF) gi = bf16_to_f32(grad[k]) * sgn;
    else gi = grad[k] * sgn;
    if (L2) {
      gi = gi + pi * wd;
    } else {
      pi = pi * decay;
    }
    const float vi = moment_in<VF>(vd, vb, v_map, vs, k, i);
    const float vn = vi * b2 + (omb2 * gi) * gi;
    if (PASS1) {
      vb[i] = vn;
      continue;
    }
    const float mi = moment_in<MF>(md, mb, m_map, ms, k, i);
    // torch's lerp, by the weight: m + w * (g - m), or g - (g - m) * (1 - w) written as
    // g + (-(1 - w)) * (g - m) (the same rounding): one formula, no per-element branch.
    const float mn = (low ? mi : gi) + coef * (gi - mi);
    // sqrt(vn) is 0, at least 2**-75 (the root of the least subnormal), inf or NaN: over()'s
    // range. vn is never -0: its second term (omb2 * g) * g is +0 or more.
    const float denom = over(std::sqrt(vn), bc2, rbc2) + eps;
    const float pn = pi + (neg_step * mn) / denom;
    if constexpr (PM == kPF32) {
      param[k] = pn;
    } else if constexpr (PM == kPBf16) {
      param[k] = f32_to_bf16(pn);
    } else {
      // On the magnitude (its sum with the noise never carries into the sign): a finite
      // value's clamped to bf16's largest (saturated, then rounded: the same), an inf plus
      // noise below 2**16 keeps its bf16 (never perturbed), a NaN takes f32_to_bf16's 0x7FC0.
      const uint32_t u = bits_of(pn), a = u & 0x7FFFFFFFu;
      const uint32_t top = a < 0x7F800000u ? 0x7F7Fu : 0x7F80u;
      uint32_t mag = (a + static_cast<uint32_t>(noise16[i])) >> 16;
      mag = mag < top ? mag : top;
      param[k] = static_cast<uint16_t>(a > 0x7F800000u ? 0x7FC0u : (((u >> 16) & 0x8000u) | mag));
    }
    moment_out<MF>(md, mb, m_uns, k, i, mn);
    moment_out<VF>(vd, vb, v_uns, k, i, vn);
  }
}

#if defined(__AVX512BW__) && defined(__FMA__) && !defined(CC_HOST_ADAM_PORTABLE)
// fused_loop's arithmetic on 16 lanes: the same float32 operations in the same order (each
// rounded once; over()'s product and correction for sqrt(v) / sqrt(bc2)).
struct Adam16 {
  __m512 decay, wd, b2, omb2, bc2, rbc2, eps, neg_step, sgn, coef;
  bool low;
  explicit Adam16(const CcStep& s) {
    const float w = s.hp[2];
    low = w < 0.5f;
    decay = _mm512_set1_ps(s.hp[0]);
    wd = _mm512_set1_ps(s.hp[1]);
    b2 = _mm512_set1_ps(s.hp[3]);
    omb2 = _mm512_set1_ps(s.hp[4]);
    bc2 = _mm512_set1_ps(s.hp[5]);
    rbc2 = _mm512_set1_ps(1.0f / s.hp[5]);
    eps = _mm512_set1_ps(s.hp[6]);
    neg_step = _mm512_set1_ps(s.hp[7]);
    sgn = _mm512_set1_ps(s.maximize ? -1.0f : 1.0f);
    coef = _mm512_set1_ps(low ? w : -(1.0f - w));
  }
  // p (read and written), g, m, v in; the new m and v out.
  template <bool L2>
  inline void step(float* __restrict p, const float* __restrict g, __m512 mi, __m512 vi,
                   __m512& mn, __m512& vn) const {
    __m512 pi = _mm512_loadu_ps(p);
    __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g), sgn);
    if constexpr (L2) gi = _mm512_add_ps(gi, _mm512_mul_ps(pi, wd));
    else pi = _mm512_mul_ps(pi, decay);
    vn = _mm512_add_ps(_mm512_mul_ps(vi, b2), _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    mn = _mm512_add_ps(low ? mi : gi, _mm512_mul_ps(coef, _mm512_sub_ps(gi, mi)));
    const __m512 a = _mm512_sqrt_ps(vn);
    const __m512 q = _mm512_mul_ps(a, rbc2);
    const __m512 rem = _mm512_fnmadd_ps(q, bc2, a);
    const __m512 fixed = _mm512_fmadd_ps(rem, rbc2, q);
    const __mmask16 plain = _mm512_cmp_ps_mask(rem, rem, _CMP_UNORD_Q) |
                            _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_EQ_OQ);
    const __m512 denom = _mm512_add_ps(_mm512_mask_mov_ps(fixed, plain, q), eps);
    _mm512_storeu_ps(p, _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(neg_step, mn), denom)));
  }
};

inline __m512 bf16_values16(const uint16_t* d) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

// fused_loop for bf16 moments, a float32 parameter and gradient, 16 lanes at a time, each
// moment's bf16 code written at once (bf16_codes_of, bf16_code's arithmetic), so no phase of
// the tile leaves the memory idle. Returns the elements done (the caller's loop does the rest).
template <bool L2>
int64_t bf16_moments16(const CcStep& s, int64_t lo, int64_t len, float* __restrict param,
                       const float* __restrict grad, uint16_t* __restrict md,
                       uint16_t* __restrict vd) {
  const Adam16 hp(s);
  const __mmask16 m_lift = s.m.is_signed ? 0 : 0xFFFF, v_lift = s.v.is_signed ? 0 : 0xFFFF;
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const int64_t k = lo + i;
    __m512 mn, vn;
    hp.step<L2>(param + k, grad + k, bf16_values16(md + k), bf16_values16(vd + k), mn, vn);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(md + k), bf16_codes_of(mn, m_lift));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(vd + k), bf16_codes_of(vn, v_lift));
  }
  return i;
}
#endif

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__FMA__) && !defined(CC_HOST_ADAM_PORTABLE)
// fused_loop for int8 or fp8 moments (a 256-entry table, ``Lut``), a float32 parameter and
// gradient, 64 lanes at a time: the codes decoded in registers (decode256's lookup64, times
// the block's scale), the new moments left in the buffers for the block's encode. Returns the
// elements done.
template <bool L2>
int64_t lut_moments64(const CcStep& s, int64_t lo, int64_t len, Buffers& b, float ms, float vs) {
  const Adam16 hp(s);
  const __m512i perm = _mm512_load_si512(kOrder);
  const __m512 msv = _mm512_set1_ps(ms), vsv = _mm512_set1_ps(vs);
  __m512i mt[4][4], vt[4][4];
  load_planes(b.lut[0]->plane, mt);
  load_planes(b.lut[1]->plane, vt);
  const uint8_t* __restrict md = static_cast<const uint8_t*>(s.m.data) + lo;
  const uint8_t* __restrict vd = static_cast<const uint8_t*>(s.v.data) + lo;
  float* __restrict param = static_cast<float*>(s.param) + lo;
  const float* __restrict grad = static_cast<const float*>(s.grad) + lo;
  float* __restrict mb = b.m.data();
  float* __restrict vb = b.v.data();
  int64_t i = 0;
  for (; i + 64 <= len; i += 64) {
    __m512i qm[4], qv[4];
    lookup64(mt, _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(md + i)), qm);
    lookup64(vt, _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(vd + i)), qv);
    for (int k = 0; k < 4; ++k) {
      const int64_t at = i + 16 * k;
      const __m512 mi = _mm512_mul_ps(_mm512_castsi512_ps(qm[k]), msv);
      const __m512 vi = _mm512_mul_ps(_mm512_castsi512_ps(qv[k]), vsv);
      __m512 mn, vn;
      hp.step<L2>(param + at, grad + at, mi, vi, mn, vn);
      _mm512_storeu_ps(mb + at, mn);
      _mm512_storeu_ps(vb + at, vn);
    }
  }
  return i;
}
#endif

inline bool blocked(int32_t fmt) { return fmt != kPlain && fmt != kBf16; }

inline float block_scale(const CcMoment& mo, int64_t lo) {
  return mo.fmt == kInt8 || mo.fmt == kFp8 ? mo.absmax[lo / mo.block] : 0.0f;
}

template <int MF, int VF, int PM, bool GBF, bool L2, bool PASS1>
void fused_tile(const CcStep& s, int64_t lo, int64_t len, Buffers& b) {
  if (blocked(MF) || blocked(VF)) {
    // The next tile's weight and gradient asked for now: the decode and encode phases
    // between two tiles' loops leave the hardware prefetcher's streams idle (no result
    // depends on a prefetch).
    using PT0 = std::conditional_t<PM == kPF32, float, uint16_t>;
    using GT0 = std::conditional_t<GBF, uint16_t, float>;
    const int64_t next = lo + len, end = next + len < s.n ? next + len : s.n;
    const char* pp = reinterpret_cast<const char*>(static_cast<const PT0*>(s.param) + next);
    const char* pe = reinterpret_cast<const char*>(static_cast<const PT0*>(s.param) + end);
    const char* gp = reinterpret_cast<const char*>(static_cast<const GT0*>(s.grad) + next);
    for (int64_t o = 0; pp + o < pe; o += 64) {
      __builtin_prefetch(pp + o, 1, 3);
      __builtin_prefetch(gp + o * sizeof(GT0) / sizeof(PT0), 0, 3);
    }
  }
  int64_t head = 0;  // elements already updated (their new moments in the buffers)
#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__FMA__) && !defined(CC_HOST_ADAM_PORTABLE)
  if constexpr (MF == VF && (MF == kInt8 || MF == kFp8) && PM == kPF32 && !GBF && !PASS1)
    head = lut_moments64<L2>(s, lo, len, b, block_scale(s.m, lo), block_scale(s.v, lo));
#endif
  if (head < len) {  // (decode reads the scale of the block at lo + head)
    if (blocked(MF) && !PASS1) decode(s.m, s.n, lo + head, len - head, b.m.data() + head, b.lut[0]);
    if (blocked(VF)) decode(s.v, s.n, lo + head, len - head, b.v.data() + head, b.lut[1]);
  }
  if (PM == kPBf16Sr && !PASS1) {  // lo is a multiple of 4 (of the tile)
    const int64_t quads = (len + 3) / 4;
    uint64_t* __restrict z = b.draws.data();
    const uint64_t base = static_cast<uint64_t>(lo / 4), key = s.key;
    for (int64_t q = 0; q < quads; ++q) z[q] = mix(key, base + q);
    std::memcpy(b.noise.data(), z, 8 * quads);  // element 4q + r: the r-th 16 bits of z[q]
  }
  using PT = std::conditional_t<PM == kPF32, float, uint16_t>;
  using GT = std::conditional_t<GBF, uint16_t, float>;
#if defined(__AVX512BW__) && defined(__FMA__) && !defined(CC_HOST_ADAM_PORTABLE)
  if constexpr (MF == kBf16 && VF == kBf16 && PM == kPF32 && !GBF && !PASS1) {
    const int64_t done = bf16_moments16<L2>(s, lo, len, static_cast<float*>(s.param),
                                            static_cast<const float*>(s.grad),
                                            static_cast<uint16_t*>(s.m.data),
                                            static_cast<uint16_t*>(s.v.data));
    lo += done;
    len -= done;
    if (len == 0) return;
  }
#endif
  fused_loop<MF, VF, PM, GBF, L2, PASS1>(
      s, lo + head, len - head, static_cast<PT*>(s.param), static_cast<const GT*>(s.grad),
      s.m.data, b.m.data() + head, s.v.data, b.v.data() + head, block_scale(s.m, lo),
      block_scale(s.v, lo), b.noise.data() + head);
  if (PASS1) return;
  if (MF == kBf16) encode_bf16(static_cast<uint16_t*>(s.m.data) + lo, b.m.data(), len, !s.m.is_signed);
  if (VF == kBf16) encode_bf16(static_cast<uint16_t*>(s.v.data) + lo, b.v.data(), len, !s.v.is_signed);
  if (blocked(MF)) encode(s.m, s.n, lo, len, b.m.data(), b.scale.data(), b.codes.data(), b.words.data(), b.lut[0], b.skip[0]);
  if (blocked(VF)) encode(s.v, s.n, lo, len, b.v.data(), b.scale.data(), b.codes.data(), b.words.data(), b.lut[1], b.skip[1]);
}

using TileFn = void (*)(const CcStep&, int64_t, int64_t, Buffers&);

template <int MF, int VF, int PM, bool GBF, bool L2>
TileFn pick_pass(bool pass1) {
  if constexpr (VF == kRank1) {
    if (pass1) return &fused_tile<MF, VF, PM, GBF, L2, true>;
  } else {
    if (pass1) return nullptr;
  }
  return &fused_tile<MF, VF, PM, GBF, L2, false>;
}

template <int MF, int VF>
TileFn pick_formats(int pm, bool gbf, bool l2, bool pass1) {
#define CC_PICK(PM, GBF)                                                                   \
  if (pm == PM && gbf == GBF)                                                              \
    return l2 ? pick_pass<MF, VF, PM, GBF, true>(pass1) : pick_pass<MF, VF, PM, GBF, false>(pass1);
  CC_PICK(kPF32, false)
  CC_PICK(kPF32, true)
  CC_PICK(kPBf16, false)
  CC_PICK(kPBf16, true)
  CC_PICK(kPBf16Sr, false)
  CC_PICK(kPBf16Sr, true)
#undef CC_PICK
  return nullptr;
}

// The fused tile for this step (pass 1 of a rank-1 moment, or the update), or nullptr.
TileFn pick(const CcStep& s, bool pass1) {
  if (!reciprocal_ok(s.hp[5])) return nullptr;  // the fused loop divides by its reciprocal
  int pm;
  if (s.param_dtype == kF32) pm = kPF32;
  else if (s.param_dtype == kBF16) pm = s.stochastic ? kPBf16Sr : kPBf16;
  else return nullptr;
  if (s.grad_dtype == kF16) return nullptr;
  const bool gbf = s.grad_dtype == kBF16, l2 = s.l2 != 0;
  const int mf = s.m.fmt, vf = s.v.fmt;
  if (mf == kPlain && vf == kPlain) return pick_formats<kPlain, kPlain>(pm, gbf, l2, pass1);
  if (mf == kBf16 && vf == kBf16) return pick_formats<kBf16, kBf16>(pm, gbf, l2, pass1);
  if (mf == kInt8 && vf == kInt8) return pick_formats<kInt8, kInt8>(pm, gbf, l2, pass1);
  if (mf == kFp8 && vf == kFp8) return pick_formats<kFp8, kFp8>(pm, gbf, l2, pass1);
  if (mf == kInt4 && vf == kInt4) return pick_formats<kInt4, kInt4>(pm, gbf, l2, pass1);
  if (mf == kInt4 && vf == kRank1) return pick_formats<kInt4, kRank1>(pm, gbf, l2, pass1);
  return nullptr;
}

int64_t tile_of(const CcStep& s) {
  for (const CcMoment* mo : {&s.m, &s.v})
    if (mo->fmt == kInt8 || mo->fmt == kFp8 || mo->fmt == kInt4) return mo->block;
  return kPlainTile;
}

// Pass 1 of a rank-1 moment: the new rows/cols maxima of |clamped new value| over [lo, hi).
void rank1_maxima(const CcStep& s, int64_t lo, int64_t hi, int64_t tile, uint32_t* rows,
                  uint32_t* cols, const CcMoment& mo, bool is_m, Buffers& b) {
  const int64_t ncols = s.n / mo.rows;
  const TileFn fused = is_m ? nullptr : pick(s, true);
  for (int64_t t = lo; t < hi; t += tile) {
    const int64_t len = t + tile < hi ? tile : hi - t;
    if (fused != nullptr) fused(s, t, len, b);
    else tile_update(s, t, len, b, false);
    const float* x = is_m ? b.m.data() : b.v.data();  // write=false: the buffers
    int64_t r = t / ncols, c = t % ncols, i = 0;
    while (i < len) {  // row by row: |x| as bits (NaN above every number), maxima
      const int64_t run = ncols - c < len - i ? ncols - c : len - i;
      uint32_t row = rows[r];
      uint32_t* __restrict col = cols + c;
      const float* __restrict xs = x + i;
      for (int64_t k = 0; k < run; ++k) {
        const uint32_t a = bits_of(clamp_finite(xs[k])) & 0x7FFFFFFFu;
        row = a > row ? a : row;
        col[k] = a > col[k] ? a : col[k];
      }
      rows[r] = row;
      i += run;
      c = 0;
      ++r;
    }
  }
}

void pass2(const CcStep& s, int64_t lo, int64_t hi, int64_t tile, Buffers& b) {
  const TileFn fused = pick(s, false);
  for (int64_t t = lo; t < hi; t += tile) {
    const int64_t len = t + tile < hi ? tile : hi - t;
    if (fused != nullptr) {
      fused(s, t, len, b);
      continue;
    }
    tile_update(s, t, len, b, true);
    if (s.param_dtype != kF32) write_param(s, t, len, b.p.data());
    if (s.m.fmt != kPlain) encode(s.m, s.n, t, len, b.m.data(), b.scale.data(), b.codes.data(), b.words.data(), b.lut[0], b.skip[0]);
    if (s.v.fmt != kPlain) encode(s.v, s.n, t, len, b.v.data(), b.scale.data(), b.codes.data(), b.words.data(), b.lut[1], b.skip[1]);
  }
}

constexpr int64_t kChunk = 4096;  // elements a thread claims at a time (whole tiles, at least one)

// The chunks [0, chunks) shared by ``threads`` threads: thread k owns a contiguous run of them
// (its share, as a static split makes it, so each thread streams through memory in order)
// and claims them in turn from its own counter; once its run is all claimed it claims from
// the other threads' runs, so a thread that the machine's other work holds back takes fewer
// chunks and no thread waits for it at the end.
class Claims {
 public:
  Claims(int64_t chunks, int threads) : chunks_(chunks), threads_(threads), next_(threads) {
    for (int k = 0; k < threads; ++k) next_[k].at.store(first(k), std::memory_order_relaxed);
  }
  // The next chunk for thread k, or -1 when every chunk is claimed.
  int64_t next(int k) {
    for (int j = 0; j < threads_; ++j) {
      const int owner = (k + j) % threads_;
      const int64_t c = next_[owner].at.fetch_add(1, std::memory_order_relaxed);
      if (c < first(owner + 1)) return c;
    }
    return -1;
  }

 private:
  int64_t first(int k) const { return chunks_ * k / threads_; }
  struct alignas(64) Counter {
    std::atomic<int64_t> at{0};
  };
  int64_t chunks_;
  int threads_;
  std::vector<Counter> next_;
};

// body(k, b, lo, hi) over [0, n) in chunks of whole tiles, on ``threads`` threads (k: the
// thread's number, b: its buffers), claimed as ``Claims`` hands them out. Every element's
// result is the same whichever thread computes it.
//
// The threads are OpenMP's (built with -fopenmp): in a torch process that is torch's own
// pool (its libgomp is loaded first, and this library's libgomp.so.1 resolves to it), whose
// threads spin a while after each of torch's parallel ops (the optimizer's non-finite check
// just before): threads of our own would share the cores with those spinning ones (measured:
// three times the CPU time a step). Without OpenMP, std::thread.
template <typename F>
void parallel(int64_t n, int64_t tile, int threads, const Lut* const* luts, F&& body) {
  const int64_t tiles = (n + tile - 1) / tile;
  if (threads > tiles) threads = static_cast<int>(tiles);
  if (threads <= 1) {
    Buffers b(tile, luts);
    body(0, b, 0, n);
    return;
  }
  const int64_t per_chunk = kChunk > tile ? kChunk / tile : 1;
  const int64_t chunks = (tiles + per_chunk - 1) / per_chunk;
  Claims claims(chunks, threads);
  auto work = [&, tile, n](int k) {
    Buffers b(tile, luts);
    for (int64_t c = claims.next(k); c >= 0; c = claims.next(k)) {
      const int64_t lo = c * per_chunk * tile, end = lo + per_chunk * tile;
      body(k, b, lo, end < n ? end : n);
    }
  };
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  work(omp_get_thread_num());
#else
  std::vector<std::thread> pool;
  for (int k = 1; k < threads; ++k) pool.emplace_back(work, k);
  work(0);
  for (auto& th : pool) th.join();
#endif
}

}  // namespace

extern "C" int cc_host_adam_step(const CcStep* sp) {
  const CcStep& s = *sp;
  if (s.n <= 0) return 0;
  const int64_t tile = tile_of(s);
  const int threads = s.threads < 1 ? 1 : s.threads;
  std::vector<Lut> tables(2);
  const Lut* luts[2] = {nullptr, nullptr};
  for (int k = 0; k < 2; ++k) {
    const CcMoment& mo = k == 0 ? s.m : s.v;
    if (mo.fmt != kInt8 && mo.fmt != kFp8) continue;
    make_lut(mo, tables[k]);
    if (mo.fmt == kInt8 && s.n >= kNearestMin)
      tables[k].nearest = nearest_table(mo.table, mo.bounds, mo.is_signed ? 255 : 256);
    luts[k] = &tables[k];
  }
  for (const CcMoment* mo : {&s.m, &s.v}) {
    if (mo->fmt != kRank1) continue;
    const bool is_m = mo == &s.m;
    const int64_t nrows = mo->rows, ncols = s.n / mo->rows;
    const int64_t tiles = (s.n + tile - 1) / tile;
    const int used = static_cast<int>(threads < tiles ? threads : tiles);
    std::vector<std::vector<uint32_t>> rows(used, std::vector<uint32_t>(nrows, 0));
    std::vector<std::vector<uint32_t>> cols(used, std::vector<uint32_t>(ncols, 0));
    parallel(s.n, tile, threads, luts, [&](int k, Buffers& b, int64_t lo, int64_t hi) {
      rank1_maxima(s, lo, hi, tile, rows[k].data(), cols[k].data(), *mo, is_m, b);
    });
    for (int64_t r = 0; r < nrows; ++r) {
      uint32_t a = 0;
      for (int k = 0; k < used; ++k) a = rows[k][r] > a ? rows[k][r] : a;
      mo->new_rows[r] = float_of(a);
    }
    for (int64_t c = 0; c < ncols; ++c) {
      uint32_t a = 0;
      for (int k = 0; k < used; ++k) a = cols[k][c] > a ? cols[k][c] : a;
      mo->new_cols[c] = float_of(a);
    }
  }
  parallel(s.n, tile, threads, luts,
           [&](int, Buffers& b, int64_t lo, int64_t hi) { pass2(s, lo, hi, tile, b); });
  return 0;
}

// ----- the non-finite check of the gradients ------------------------------------------------

namespace {

// The largest magnitude pattern (sign bit cleared) of x[0, len): one read, no branch, so that
// it vectorizes (an unsigned max).
template <typename U>
U max_magnitude(const U* __restrict x, int64_t len) {
  constexpr U kMagnitude = static_cast<U>(~static_cast<U>(0)) >> 1;
  U top = 0;
  for (int64_t i = 0; i < len; ++i) {
    const U a = static_cast<U>(x[i] & kMagnitude);
    top = a > top ? a : top;
  }
  return top;
}

// Whether every pattern of x[0, n) is below ``limit`` in magnitude, over ``threads`` threads
// claiming chunks as parallel() does (Claims); a chunk over the limit stops the others early.
template <typename U>
bool below(const U* x, int64_t n, U limit, int threads) {
  constexpr int64_t kCheckChunk = 1 << 16;
  const int64_t chunks = (n + kCheckChunk - 1) / kCheckChunk;
  if (threads > chunks) threads = static_cast<int>(chunks);
  if (threads <= 1) return max_magnitude(x, n) < limit;
  Claims claims(chunks, threads);
  std::atomic<bool> over{false};
  auto work = [&](int k) {
    for (int64_t c = claims.next(k); c >= 0; c = claims.next(k)) {
      if (over.load(std::memory_order_relaxed)) return;
      const int64_t lo = c * kCheckChunk, len = lo + kCheckChunk < n ? kCheckChunk : n - lo;
      if (max_magnitude(x + lo, len) >= limit) over.store(true, std::memory_order_relaxed);
    }
  };
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  work(omp_get_thread_num());
#else
  std::vector<std::thread> pool;
  for (int k = 1; k < threads; ++k) pool.emplace_back(work, k);
  work(0);
  for (auto& th : pool) th.join();
#endif
  return !over.load();
}

}  // namespace

// 1 when every element of x[0, n) (dtype: kF32, kBF16, kF16) is finite with a finite float32
// square (|x| < 2**64), else 0: the condition of _grad_health.all_applicable, exactly. On the
// bits: a magnitude pattern below 2**64's (float32 0x5F800000, bfloat16 0x5F80; every finite
// float16 is below 65505) is finite and below 2**64, and inf and every NaN are above it; a
// subnormal or -0 is below. -1 for another dtype.
extern "C" int cc_host_adam_cleared(const void* x, int64_t n, int32_t dtype, int32_t threads) {
  if (n <= 0) return 1;
  const int t = threads < 1 ? 1 : threads;
  if (dtype == kF32) return below(static_cast<const uint32_t*>(x), n, uint32_t{0x5F800000}, t);
  if (dtype == kBF16) return below(static_cast<const uint16_t*>(x), n, uint16_t{0x5F80}, t);
  if (dtype == kF16) return below(static_cast<const uint16_t*>(x), n, uint16_t{0x7C00}, t);
  return -1;
}
