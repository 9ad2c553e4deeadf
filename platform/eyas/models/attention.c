/* eyas.models.attention: grouped-query attention for a few new tokens (a decode step, a tree verify, a short
prefill) on CPU in float32, giving a query the same bits whatever else is computed with it.

torch's batched matmuls and softmax pick their blocking by shape, so a token decoded alone and the same token
verified among a tree's nodes (more queries, more keys, some hidden) got outputs that differ in the last bits; in
bfloat16 those bits flip roundings and then greedy tokens. Here every step for a query (b, h, t) is a fixed
function of its own row and the keys it sees, in slot order:
  - a score is one dot product over D: 16-wide partial sums over D in order, added by a fixed tree (a D off the
    16-lane grid is padded with zeros, which add exact zeros);
  - the max is exact in any order;
  - exp is one polynomial applied alike to every element;
  - the denominator and the weighted sum of values run over the visible keys in slot order, the i-th visible key
    into chain i % 4, the chains added in a fixed order (a hidden key is skipped, an exp that underflowed adds an
    exact zero).
So a query's output depends only on its visible keys and their order, which tree verification keeps (ancestors
lie in slot order, as the tokens they stand for were decoded).

Layouts: q [B, H, T, D] by strides (D contiguous); k, v [B, G, S, D] by strides (D contiguous: the KV cache's
view); mask uint8 [B, T, S] by strides or NULL (then causal: key s visible to query t iff s <= S - T + t, or every
key when causal is 0); out [B, T, H, D] contiguous (o_proj's input, no transpose). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64), aligned(4)));
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
static const float ZEROS[128] = {0};  /* the row of a missing key (D <= 128) */

static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void st(float* p, v16 v) { memcpy(p, &v, 64); }

/* Every sum of products here starts from zero and adds one product at a time (acc += x * y), so where the
compiler contracts a product and a sum into an FMA (GCC's default) there is one way to: two products added
directly (x * y + z * w) could be fused either way, and two copies of such code could round differently. */
#define SH(P, Q, ...) __builtin_shufflevector(P, Q, __VA_ARGS__)

/* the scores of one query against 16 keys (kp: their rows; a missing key points at zeros), as a vector in key
order. Each is 16-wide partial sums over D in order, then the 16 lanes added by halves: lanes j and j + 8, then j
and j + 4, then j and j + 2, then the last two. The 16 keys go through that tree together, two vectors' halves per
shuffle, so a key's score is the same at any position in a block and in any block. ND = D / 16. */
#define DOT16(ND)                                                                                                 \
  static inline __attribute__((always_inline)) v16 dot16_##ND(const float* qr, const float* const* kp) {       \
    v16 qv[ND], a[16];                                                                                         \
    for (int d = 0; d < ND; ++d) qv[d] = ld(qr + 16 * d);                                                      \
    for (int j = 0; j < 16; ++j) {                                                                             \
      v16 acc = (v16){0};                                                                                      \
      for (int d = 0; d < ND; ++d) acc += qv[d] * ld(kp[j] + 16 * d);                                          \
      a[j] = acc;                                                                                              \
    }                                                                                                          \
    return tree16(a);                                                                                          \
  }
/* the same 16 scores from the keys laid out transposed (kt[d] holds the 16 keys' d-th values): lane sums j over
d = j, j + 16, ... in that order, the same products and the same tree, as vector adds. Bit-identical to dot16, and
cheaper where many queries share a block (the transposition is paid once). */
#define DOT16T(ND)                                                                                                \
  static inline __attribute__((always_inline)) v16 dot16t_##ND(const float* qr, const v16* kt) {               \
    v16 a[16];                                                                                                 \
    for (int j = 0; j < 16; ++j) a[j] = (v16){0};                                                              \
    for (int d = 0; d < ND; ++d)                                                                               \
      for (int j = 0; j < 16; ++j) a[j] += ((v16){0} + qr[16 * d + j]) * kt[16 * d + j];                       \
    for (int j = 0; j < 8; ++j) a[j] = a[j] + a[j + 8];                                                        \
    for (int j = 0; j < 4; ++j) a[j] = a[j] + a[j + 4];                                                        \
    for (int j = 0; j < 2; ++j) a[j] = a[j] + a[j + 2];                                                        \
    return a[0] + a[1];                                                                                        \
  }
static inline __attribute__((always_inline)) v16 tree16(const v16* a) {
  v16 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)  /* keys 2i, 2i+1: lanes j + j+8 -> 8 lanes each */
    l1[i] = SH(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            SH(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  /* keys 4i..4i+3: j + j+4 -> 4 lanes each */
    l2[i] = SH(l1[2 * i], l1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            SH(l1[2 * i], l1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  /* keys 8i..8i+7: j + j+2 -> 2 lanes each */
    l3[i] = SH(l2[2 * i], l2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            SH(l2[2 * i], l2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SH(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +  /* keys 0..15 */
         SH(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* exp(x) for x <= 0 (scores minus their max), 16 at a time; below -87 (and -inf: a hidden key) it is 0.
Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, scaled by 2^n through the exponent bits. */
static inline v16 vexp(v16 x) {
  const v16 lo = (v16){0} - 87.0f;
  i16 keep = x >= lo;                                  /* -1 where the result is not flushed to 0 */
  i16 low = ~keep;
  x = (v16)(((i16)x & keep) | ((i16)lo & low));        /* clamp: no -inf or overflow below */
  v16 fx = x * 1.44269504088896341f - 0.5f;            /* x <= 0: truncation of fx - 0.5 rounds to nearest */
  i16 n = __builtin_convertvector(fx, i16);
  v16 nf = __builtin_convertvector(n, v16);
  v16 r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  v16 y = 1.9875691500E-4f * r + 1.3981999507E-3f;
  y = y * r + 8.3334519073E-3f;
  y = y * r + 4.1665795894E-2f;
  y = y * r + 1.6666665459E-1f;
  y = y * r + 5.0000001201E-1f;
  y = y * (r * r) + r + 1.0f;
  i16 scale = (n + 127) << 23;
  return (v16)((i16)(y * (v16)scale) & keep);
}

/* the weighted sum of values for one query over the visible keys (n of them, in slot order: idx; weights p by
slot, 0 where exp underflowed, which adds an exact zero), and the sum of the weights. Four chains take the keys in
turn (key i into chain i % 4: the same chain for a key whatever hides between) and are added as (0 + 1) + (2 + 3);
ND = D / 16 sums in registers. */
#define ADD_KEY(ND, c, key)                                                                                       \
  do {                                                                                                         \
    const float* vr = vg + (int64_t)(key) * vss;                                                               \
    const float w = p[key];                                                                                    \
    const v16 pv = (v16){0} + w;                                                                               \
    den[c] += w;                                                                                               \
    for (int j = 0; j < ND; ++j) acc[c][j] += pv * ld(vr + 16 * j);                                            \
  } while (0)
#define WEIGHTED_SUM(ND)                                                                                          \
  static inline __attribute__((always_inline)) float weighted_sum_##ND(const int32_t* idx, const float* p,      \
                                                                      int64_t n, const float* vg, int64_t vss, \
                                                                      float* o) {                              \
    v16 acc[4][ND];                                                                                            \
    float den[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                                                   \
    for (int c = 0; c < 4; ++c)                                                                                \
      for (int j = 0; j < ND; ++j) acc[c][j] = (v16){0};                                                       \
    int64_t i = 0;                                                                                             \
    for (; i + 4 <= n; i += 4)                                                                                 \
      for (int c = 0; c < 4; ++c) ADD_KEY(ND, c, idx[i + c]);                                                  \
    for (int c = 0; i + c < n; ++c) ADD_KEY(ND, c, idx[i + c]);                                                \
    for (int j = 0; j < ND; ++j) st(o + 16 * j, (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]));            \
    return (den[0] + den[1]) + (den[2] + den[3]);                                                              \
  }

/* the raw scores (q . k, unscaled) of the R x T queries of one kv head (query r, t at q0 + r * qsh + t * qst)
against keys [0, end) into e (rows S16 apart; keys past end score 0). Many queries: the keys transposed once per
block of 16 (dot16t); few: straight from their rows (dot16). The two give the same bits. */
#define SCORES(ND)                                                                                                \
  static void scores_##ND(const float* q0, int64_t qsh, int64_t qst, int64_t R, int64_t T, const float* kg,     \
                          int64_t kss, int64_t end, int64_t S16, float* e) {                                    \
    const int transposed = R * T >= 8;                                                                         \
    v16 kt[16 * ND];                                                                                           \
    for (int64_t s = 0; s < S16; s += 16) {                                                                    \
      const float* kp[16];                                                                                     \
      for (int j = 0; j < 16; ++j) kp[j] = s + j < end ? kg + (s + j) * kss : ZEROS;                           \
      if (transposed)                                                                                          \
        for (int d = 0; d < 16 * ND; ++d)                                                                      \
          for (int j = 0; j < 16; ++j) kt[d][j] = kp[j][d];                                                    \
      for (int64_t r = 0; r < R; ++r)                                                                          \
        for (int64_t t = 0; t < T; ++t) {                                                                      \
          const float* qr = q0 + r * qsh + t * qst;                                                            \
          st(e + (r * T + t) * S16 + s, s >= end ? (v16){0} : transposed ? dot16t_##ND(qr, kt)                 \
                                                                           : dot16_##ND(qr, kp));              \
        }                                                                                                      \
    }                                                                                                          \
  }

/* the R query heads of one kv head at one new token (they see the same keys: the mask is per token): raw score
rows e (row r at e + r * es, S16 floats each, turned into weights in place), visibility (the mask row mr, or keys
[0, end)), output rows o (row r at o + r * 16 ND). The visible keys, in slot order, go into idx once; each head's
scores are scaled, hidden keys set to -inf, their max taken (exact in any order), exp applied, and its weighted sum
of values divided by the weights' sum. */
#define QUERY(ND)                                                                                                 \
  DOT16(ND) DOT16T(ND) SCORES(ND) WEIGHTED_SUM(ND)                                                             \
  static void query_##ND(float* e, int64_t es, int64_t R, const float* vg, int64_t vss, const uint8_t* mr,      \
                         int64_t end, int64_t S, float scale, int32_t* idx, float* o) {                        \
    const int64_t S16 = (S + 15) / 16 * 16;                                                                    \
    const v16 minus_inf = (v16){0} - INFINITY;                                                                 \
    v16 iota;                                                                                                  \
    for (int j = 0; j < 16; ++j) iota[j] = (float)j;                                                           \
    int64_t n = 0;                                                                                             \
    for (int64_t s = 0; s < S; ++s)                                                                            \
      if (mr ? mr[s] != 0 : s < end) idx[n++] = (int32_t)s;                                                    \
    for (int64_t r = 0; r < R; ++r) {                                                                          \
      float* er = e + r * es;                                                                                  \
      v16 mv = minus_inf;                                                                                      \
      for (int64_t s = 0; s < S16; s += 16) {                                                                  \
        v16 x = ld(er + s) * scale;                                                                            \
        i16 visible;                                                                                           \
        if (mr) {                                                                                              \
          u8x16 bytes = {0};                                                                                   \
          memcpy(&bytes, mr + s, (size_t)(S - s < 16 ? S - s : 16));                                           \
          visible = __builtin_convertvector(bytes, i16) != 0;                                                  \
        } else {                                                                                               \
          visible = iota + (float)s < (float)end;                                                              \
        }                                                                                                      \
        x = (v16)(((i16)x & visible) | ((i16)minus_inf & ~visible));                                           \
        st(er + s, x);                                                                                         \
        mv = (v16)(((i16)mv & (mv >= x)) | ((i16)x & (mv < x)));                                               \
      }                                                                                                        \
      float m = mv[0];                                                                                         \
      for (int j = 1; j < 16; ++j) m = mv[j] > m ? mv[j] : m;                                                  \
      mv = (v16){0} + m;                                                                                       \
      for (int64_t s = 0; s < S16; s += 16) st(er + s, vexp(ld(er + s) - mv));                                \
      float* orow = o + r * 16 * ND;                                                                           \
      const float den = weighted_sum_##ND(idx, er, n, vg, vss, orow);                                          \
      for (int d = 0; d < 16 * ND; ++d) orow[d] = orow[d] / den;                                               \
    }                                                                                                          \
  }
QUERY(1) QUERY(2) QUERY(3) QUERY(4) QUERY(5) QUERY(6) QUERY(7) QUERY(8)
typedef void (*scores_fn)(const float*, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, int64_t,
                          float*);
static const scores_fn SCORES_BY_ND[9] = {0, scores_1, scores_2, scores_3, scores_4, scores_5, scores_6, scores_7,
                                          scores_8};
typedef void (*query_fn)(float*, int64_t, int64_t, const float*, int64_t, const uint8_t*, int64_t, int64_t, float,
                         int32_t*, float*);
static const query_fn QUERIES[9] = {0, query_1, query_2, query_3, query_4, query_5, query_6, query_7, query_8};

/* 1 where eyas_attend can run this head dim (D <= 128) */
int eyas_attend_supports(int64_t D) { return D >= 1 && D <= 128; }

void eyas_attend(const float* q, int64_t qsb, int64_t qsh, int64_t qst,
                 const float* k, int64_t ksb, int64_t ksg, int64_t kss,
                 const float* v, int64_t vsb, int64_t vsg, int64_t vss,
                 const uint8_t* mask, int64_t msb, int64_t mst, int causal,
                 float* out, int64_t B, int64_t H, int64_t G, int64_t T, int64_t S, int64_t D, float scale) {
  const int64_t R = H / G, S16 = (S + 15) / 16 * 16, ND = (D + 15) / 16, Dp = 16 * ND;
  const int padded = Dp != D;  /* a head dim off the 16-lane grid: q, k, v copied with zeros up to Dp */
  const scores_fn scores = SCORES_BY_ND[ND];
  const query_fn query = QUERIES[ND];
  float* e = malloc(sizeof(float) * (size_t)(S16 * R * T));  /* a kv head's score rows */
  int32_t* idx = malloc(sizeof(int32_t) * (size_t)S16);
  float* pad = padded ? calloc((size_t)(2 * S + 2 * R * T) * (size_t)Dp, sizeof(float)) : NULL;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + b * qsb + g * R * qsh;
      const float* kg = k + b * ksb + g * ksg;
      const float* vg = v + b * vsb + g * vsg;
      int64_t qh = qsh, qt = qst, ks = kss, vs = vss;
      if (padded) {  /* rows Dp apart: k [S], v [S], q [R * T], then R output rows */
        for (int64_t s = 0; s < S; ++s) {
          memcpy(pad + s * Dp, kg + s * kss, sizeof(float) * (size_t)D);
          memcpy(pad + (S + s) * Dp, vg + s * vss, sizeof(float) * (size_t)D);
        }
        for (int64_t r = 0; r < R; ++r)
          for (int64_t t = 0; t < T; ++t)
            memcpy(pad + (2 * S + r * T + t) * Dp, qg + r * qsh + t * qst, sizeof(float) * (size_t)D);
        kg = pad, vg = pad + S * Dp, qg = pad + 2 * S * Dp;
        qh = T * Dp, qt = Dp, ks = vs = Dp;
      }
      scores(qg, qh, qt, R, T, kg, ks, S, S16, e);
      for (int64_t t = 0; t < T; ++t) {
        const uint8_t* mr = mask ? mask + b * msb + t * mst : NULL;
        const int64_t end = mr ? S : causal ? S - T + t + 1 : S;  /* keys from here on are hidden */
        float* o = out + ((b * T + t) * H + g * R) * D;            /* the R heads' rows are adjacent */
        float* rows = padded ? pad + (2 * S + R * T) * Dp : o;
        query(e + t * S16, T * S16, R, vg, vs, mr, end, S, scale, idx, rows);
        if (padded)
          for (int64_t r = 0; r < R; ++r) memcpy(o + r * D, rows + r * Dp, sizeof(float) * (size_t)D);
      }
    }
  free(e);
  free(idx);
  free(pad);
}
