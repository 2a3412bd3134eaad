// The compact-state Adam(W) step on the CPU: one pass per block, decode -> update -> encode.
//
// A plain C ABI over raw pointers (no torch headers), built and loaded by host_adam.py. The
// float32 arithmetic is the sequence of computectx.memory.optim.fused._update (its twin),
// without contraction (-ffp-contract=off, no -ffast-math): lerp, mul, addcmul, sqrt, div,
// add, addcdiv, each rounded once. Every element is computed from its own inputs and its
// block's scale, each block by one thread, so the result does not depend on the thread
// count. The nearest-code search is the table search of maps.py (bucketize, exactly).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int32_t kPlain = 0, kBf16 = 1, kInt8 = 2, kFp8 = 3, kInt4 = 4, kRank1 = 5;
constexpr int32_t kF32 = 0, kBF16 = 1, kF16 = 2;
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr float kBf16Max = 3.38953138925153547590e+38f;  // 0x7F7F0000
constexpr int64_t kPlainTile = 2048;

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
  const int32_t* table;  // int8/int4: the nearest-entry table (65536)
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

int cc_host_adam_abi(void) { return 1; }

// Whether float16 parameters and gradients are read and written (the F16C instructions).
int cc_host_adam_f16(void) {
#if defined(__F16C__)
  return 1;
#else
  return 0;
#endif
}

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
inline float f16_to_f32(uint16_t) { return NAN; }
inline uint16_t f32_to_f16(float) { return 0x7E00; }
#endif

// Round to nearest even into float8 e4m3fn, as torch's conversion (480 and beyond, and NaN,
// give NaN: the format has no infinity).
inline uint8_t f32_to_e4m3(float f) {
  uint32_t b = bits_of(f);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  b &= 0x7FFFFFFFu;
  if (b >= 0x43F00000u) return sign | 0x7F;
  if (b < 0x3C800000u) {  // below 2**-6: a subnormal, a multiple of 2**-9
    return sign | static_cast<uint8_t>(std::nearbyint(float_of(b) * 512.0f));
  }
  b += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u);
  return sign | static_cast<uint8_t>(b >> 20);
}

// The 64 random bits of element ``i`` under ``key`` (splitmix64's finalizer on
// key + (i + 1) * golden); _rounding.keyed_bits is the same in int64 torch ops.
inline uint64_t mix(uint64_t key, uint64_t i) {
  uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline float nan_min(float a, float b) {  // torch.minimum: NaN wins
  if (a != a) return a;
  if (b != b) return b;
  return a < b ? a : b;
}

inline float clamp_finite(float x) {  // NaN stays NaN
  return x > kFltMax ? kFltMax : (x < -kFltMax ? -kFltMax : x);
}

inline float safe(float s) { return s > 0.0f ? s : 1.0f; }

inline int32_t nearest(const CcMoment& mo, float n) {
  const int32_t code = mo.table[bits_of(n) >> 16];
  return code + (n > mo.bounds[code] ? 1 : 0);
}

struct Buffers {
  std::vector<float> p, g, m, v, scale;
  explicit Buffers(int64_t tile) : p(tile), g(tile), m(tile), v(tile), scale(tile) {}
};

// The per-element scale of a rank-1 moment over flat elements [lo, lo + len).
void rank1_scales(const float* rows, const float* cols, int64_t ncols, int64_t lo, int64_t len,
                  float* out) {
  int64_t r = lo / ncols, c = lo % ncols;
  for (int64_t i = 0; i < len; ++i) {
    out[i] = nan_min(rows[r], cols[c]);
    if (++c == ncols) {
      c = 0;
      ++r;
    }
  }
}

// Decode elements [lo, lo + len) of ``mo`` into ``out`` (a tile never crosses a block).
void decode(const CcMoment& mo, int64_t numel, int64_t lo, int64_t len, float* out,
            float* scale) {
  switch (mo.fmt) {
    case kPlain:
      std::memcpy(out, static_cast<const float*>(mo.data) + lo, len * 4);
      return;
    case kBf16: {
      const uint16_t* d = static_cast<const uint16_t*>(mo.data) + lo;
      for (int64_t i = 0; i < len; ++i) out[i] = bf16_to_f32(d[i]);
      return;
    }
    case kInt8: {
      const uint8_t* d = static_cast<const uint8_t*>(mo.data) + lo;
      const float s = mo.absmax[lo / mo.block];
      for (int64_t i = 0; i < len; ++i) out[i] = mo.map[d[i]] * s;
      return;
    }
    case kFp8: {
      const uint8_t* d = static_cast<const uint8_t*>(mo.data) + lo;
      const float s = mo.absmax[lo / mo.block];
      for (int64_t i = 0; i < len; ++i) out[i] = mo.map[d[i]] / 448.0f * s;
      return;
    }
    default: {  // int4, blocked or rank-1; lo is even
      const uint8_t* d = static_cast<const uint8_t*>(mo.data) + lo / 2;
      for (int64_t i = 0; i < len; ++i) {
        const uint8_t b = d[i >> 1];
        out[i] = mo.map[(i & 1) ? (b >> 4) : (b & 15)];
      }
      if (mo.fmt == kInt4) {
        const float s = mo.absmax[lo / mo.block];
        for (int64_t i = 0; i < len; ++i) out[i] = out[i] * s;
      } else {
        rank1_scales(mo.absmax, mo.cols, numel / mo.rows, lo, len, scale);
        for (int64_t i = 0; i < len; ++i) out[i] = out[i] * scale[i];
      }
      (void)numel;
    }
  }
}

// Encode the new values x[0, len) of elements [lo, lo + len) into ``mo`` (in place).
void encode(const CcMoment& mo, int64_t numel, int64_t lo, int64_t len, float* x, float* scale) {
  if (mo.fmt == kPlain) {
    std::memcpy(static_cast<float*>(mo.data) + lo, x, len * 4);
    return;
  }
  if (mo.fmt == kBf16) {
    uint16_t* d = static_cast<uint16_t*>(mo.data) + lo;
    for (int64_t i = 0; i < len; ++i) {
      const float c = x[i] > kBf16Max ? kBf16Max : (x[i] < -kBf16Max ? -kBf16Max : x[i]);
      uint16_t h = f32_to_bf16(c);
      if (!mo.is_signed && c > 0.0f && (h & 0x7FFFu) == 0) h = 1;  // 2**-133, not 0
      d[i] = h;
    }
    return;
  }
  uint32_t amax_bits = 0;
  for (int64_t i = 0; i < len; ++i) {
    x[i] = clamp_finite(x[i]);
    const uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
    amax_bits = a > amax_bits ? a : amax_bits;  // above 0x7F800000: a NaN (amax is NaN)
  }
  if (mo.fmt == kRank1) {
    rank1_scales(mo.new_rows, mo.new_cols, numel / mo.rows, lo, len, scale);
    for (int64_t i = 0; i < len; ++i) x[i] = x[i] / safe(scale[i]);
  } else {
    const float amax = float_of(amax_bits);
    mo.absmax[lo / mo.block] = amax;
    const float s = safe(amax);
    for (int64_t i = 0; i < len; ++i) x[i] = x[i] / s;  // keeps x > 0 as the sign of x32
  }
  uint8_t* d = static_cast<uint8_t*>(mo.data);
  if (mo.fmt == kFp8) {
    for (int64_t i = 0; i < len; ++i) {
      uint8_t c = f32_to_e4m3(x[i] * 448.0f);
      if (!mo.is_signed && x[i] > 0.0f && c == 0) c = 1;
      d[lo + i] = c;
    }
    return;
  }
  if (mo.fmt == kInt8) {
    for (int64_t i = 0; i < len; ++i) {
      int32_t c = nearest(mo, x[i]);
      if (!mo.is_signed && x[i] > 0.0f && c == 0) c = 1;
      d[lo + i] = static_cast<uint8_t>(c);
    }
    return;
  }
  uint8_t* q = d + lo / 2;  // int4: lo is even; an odd tail's high nibble is 0
  for (int64_t i = 0; i + 1 < len; i += 2) {
    q[i >> 1] = static_cast<uint8_t>(nearest(mo, x[i]) | (nearest(mo, x[i + 1]) << 4));
  }
  if (len & 1) q[len >> 1] = static_cast<uint8_t>(nearest(mo, x[len - 1]));
}

inline float load(const void* base, int32_t dtype, int64_t i) {
  if (dtype == kF32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return dtype == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// The Adam math on a tile: g, m, v, p in; m, v, p out (the twin's float32 operations).
template <bool L2, bool MAXIMIZE>
void math(const CcStep& s, int64_t len, float* p, float* g, float* m, float* v) {
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

void tile_update(const CcStep& s, int64_t lo, int64_t len, Buffers& b) {
  for (int64_t i = 0; i < len; ++i) b.p[i] = load(s.param, s.param_dtype, lo + i);
  for (int64_t i = 0; i < len; ++i) b.g[i] = load(s.grad, s.grad_dtype, lo + i);
  decode(s.m, s.n, lo, len, b.m.data(), b.scale.data());
  decode(s.v, s.n, lo, len, b.v.data(), b.scale.data());
  if (s.l2) {
    if (s.maximize) math<true, true>(s, len, b.p.data(), b.g.data(), b.m.data(), b.v.data());
    else math<true, false>(s, len, b.p.data(), b.g.data(), b.m.data(), b.v.data());
  } else {
    if (s.maximize) math<false, true>(s, len, b.p.data(), b.g.data(), b.m.data(), b.v.data());
    else math<false, false>(s, len, b.p.data(), b.g.data(), b.m.data(), b.v.data());
  }
}

void write_param(const CcStep& s, int64_t lo, int64_t len, const float* x) {
  if (s.param_dtype == kF32) {
    std::memcpy(static_cast<float*>(s.param) + lo, x, len * 4);
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
        const uint32_t noise = static_cast<uint32_t>(mix(s.key, lo + i) >> 48);
        d[i] = static_cast<uint16_t>((u + noise) >> 16);
      }
    }
    return;
  }
  for (int64_t i = 0; i < len; ++i) {  // f16: to the other neighbour with p = distance / gap
    const float xi = x[i];
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

int64_t tile_of(const CcStep& s) {
  for (const CcMoment* mo : {&s.m, &s.v})
    if (mo->fmt == kInt8 || mo->fmt == kFp8 || mo->fmt == kInt4) return mo->block;
  return kPlainTile;
}

// Pass 1 of a rank-1 moment: the new rows/cols maxima of |clamped new value| over [lo, hi).
void rank1_maxima(const CcStep& s, int64_t lo, int64_t hi, int64_t tile, uint32_t* rows,
                  uint32_t* cols, const CcMoment& mo, bool is_m) {
  Buffers b(tile);
  const int64_t ncols = s.n / mo.rows;
  for (int64_t t = lo; t < hi; t += tile) {
    const int64_t len = t + tile < hi ? tile : hi - t;
    tile_update(s, t, len, b);
    const float* x = is_m ? b.m.data() : b.v.data();
    int64_t r = t / ncols, c = t % ncols;
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t a = bits_of(clamp_finite(x[i])) & 0x7FFFFFFFu;
      if (a > rows[r]) rows[r] = a;
      if (a > cols[c]) cols[c] = a;
      if (++c == ncols) {
        c = 0;
        ++r;
      }
    }
  }
}

void pass2(const CcStep& s, int64_t lo, int64_t hi, int64_t tile) {
  Buffers b(tile);
  for (int64_t t = lo; t < hi; t += tile) {
    const int64_t len = t + tile < hi ? tile : hi - t;
    tile_update(s, t, len, b);
    write_param(s, t, len, b.p.data());
    encode(s.m, s.n, t, len, b.m.data(), b.scale.data());
    encode(s.v, s.n, t, len, b.v.data(), b.scale.data());
  }
}

template <typename F>
void parallel(int64_t n, int64_t tile, int threads, F&& body) {
  const int64_t tiles = (n + tile - 1) / tile;
  if (threads > tiles) threads = static_cast<int>(tiles);
  if (threads <= 1) {
    body(0, 0, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = tiles / threads, extra = tiles % threads;
  int64_t start = 0;
  for (int k = 0; k < threads; ++k) {
    const int64_t count = per + (k < extra ? 1 : 0);
    const int64_t lo = start * tile, hi = (start + count) * tile < n ? (start + count) * tile : n;
    start += count;
    if (k + 1 == threads) body(k, lo, hi);
    else pool.emplace_back([&body, k, lo, hi] { body(k, lo, hi); });
  }
  for (auto& th : pool) th.join();
}

}  // namespace

extern "C" int cc_host_adam_step(const CcStep* sp) {
  const CcStep& s = *sp;
  if (s.n <= 0) return 0;
  const int64_t tile = tile_of(s);
  const int threads = s.threads < 1 ? 1 : s.threads;
  for (const CcMoment* mo : {&s.m, &s.v}) {
    if (mo->fmt != kRank1) continue;
    const bool is_m = mo == &s.m;
    const int64_t nrows = mo->rows, ncols = s.n / mo->rows;
    const int64_t tiles = (s.n + tile - 1) / tile;
    const int used = static_cast<int>(threads < tiles ? threads : tiles);
    std::vector<std::vector<uint32_t>> rows(used, std::vector<uint32_t>(nrows, 0));
    std::vector<std::vector<uint32_t>> cols(used, std::vector<uint32_t>(ncols, 0));
    parallel(s.n, tile, threads, [&](int k, int64_t lo, int64_t hi) {
      rank1_maxima(s, lo, hi, tile, rows[k].data(), cols[k].data(), *mo, is_m);
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
  parallel(s.n, tile, threads, [&](int, int64_t lo, int64_t hi) { pass2(s, lo, hi, tile); });
  return 0;
}
