/* eyas.models.forward: every decoder layer of the target over a few new tokens (a decode step, a tree verify) on CPU
in one call, float32 or bfloat16 weights.

A decode step of a small target runs ~50 torch ops per layer around its four products, each a few microseconds of
dispatch: on smollm2 (30 layers) that overhead cost more than the weights' stream. Here a layer is RMSNorm, the
q/k/v product, RoPE, the KV-cache write, attention, o_proj, the residual, RMSNorm, gate/up, SiLU * up, down_proj and
the residual, with the products on the panel kernel (panels.c, its thread pool included) and attention on
attention.c's kernel, both reached through the function pointers the caller hands over. Attention, RoPE with the
KV-cache write and SiLU * up run on the same pool (panels.c's eyas_parallel_for), a few rows or queries a task: on an
8-row bfloat16 decode step attention alone had taken a quarter of the step on one thread. Every step for a token is
a fixed function of its own row (and, in attention, of the keys it sees in slot order), so a token's outputs are
the same bits whether it is decoded alone or verified among others, at any thread count.

bfloat16 rounds where torch's ops on bfloat16 tensors round (eyas.models.decoder's forward): the norms' outputs,
each product, RoPE's two products and their sum, attention's output, SiLU, SiLU * up and each residual sum; the KV
cache and attention are float32. Sums of squares and exp differ from torch's only in order and last bits.

Layouts: x [N, E] (N = B * T rows, row b * T + t), the activations' dtype, updated in place; positions [N]; cos,
sin the decoder's RoPE tables [P, D]; the cache k, v [L, B, G, S_max, D] float32 by strides (the last two
contiguous); starts [B] the first new slot per row; mask uint8 [B, T, S] by strides or NULL (then causal as
attention.c's). A product's input is padded with zeros to the panels' input width (a multiple of 32 in bfloat16). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*matmul_fn)(const void* x, int64_t M, int64_t ldx, const void* panels, int64_t I, int64_t O, void* y,
                          int64_t ldy, int64_t num_threads);
typedef void (*attend_fn)(const float* q, int64_t qsb, int64_t qsh, int64_t qst, const float* k, int64_t ksb,
                          int64_t ksg, int64_t kss, const float* v, int64_t vsb, int64_t vsg, int64_t vss,
                          const uint8_t* mask, int64_t msb, int64_t mst, int causal, float* out, int64_t B, int64_t H,
                          int64_t G, int64_t T, int64_t S, int64_t D, float scale);

typedef void (*parallel_fn)(void (*fn)(void*, int64_t, int64_t), void* ctx, int64_t n, int64_t num_threads);
typedef struct {  /* one layer's weights: pointers into tensors the caller keeps alive; a bias may be NULL */
  const void *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
} layer_t;

typedef struct {
  int64_t num_layers, E, H, G, D, I;       /* hidden, query heads, kv heads, head dim, MLP width */
  int64_t E_in, HD_in, I_in;               /* the panels' input widths (padded) of E, H * D and I */
  int64_t bf16;                            /* 1: bfloat16 weights and activations, 0: float32 */
  float eps, scale;                        /* RMSNorm's epsilon; attention's 1 / sqrt(D) */
  matmul_fn matmul;
  attend_fn attend;
  const layer_t* layers;
  const void* final_norm;                  /* the norm before the LM head, applied after the last layer */
  parallel_fn parallel_for;                /* panels.c's pool: fn(ctx, i0, i1) over the ranges of [0, n) */
} model_t;

static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf(float f) {  /* round to nearest even, as torch */
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* element i of an activation or weight vector in the model's dtype, as float32; r(): a value rounded to it */
static inline __attribute__((always_inline)) float get(const int bf16, const void* p, int64_t i) {
  return bf16 ? bf(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline __attribute__((always_inline)) void put(const int bf16, void* p, int64_t i, float v) {
  if (bf16) ((uint16_t*)p)[i] = to_bf(v); else ((float*)p)[i] = v;
}
static inline __attribute__((always_inline)) float r(const int bf16, float v) { return bf16 ? bf(to_bf(v)) : v; }
static inline __attribute__((always_inline)) size_t elem(const int bf16) { return bf16 ? 2 : 4; }

/* out[n] = RMSNorm(x[n]) * w for N rows (out rows ldo apart). bfloat16 as torch: the normed row rounded, then the
product with the weight rounded; float32 as F.rms_norm. The sum of squares in 16 chains, added in a fixed order. */
static inline __attribute__((always_inline)) void rms_norm(const int bf16, const model_t* m, const void* x, const void* w, void* out, int64_t ldo, int64_t N) {
  const int64_t E = m->E;
  for (int64_t n = 0; n < N; ++n) {
    float acc[16] = {0};
    for (int64_t i = 0; i < E; ++i) { const float v = get(bf16, x, n * E + i); acc[i & 15] += v * v; }
    for (int s = 8; s > 0; s /= 2)
      for (int j = 0; j < s; ++j) acc[j] += acc[j + s];
    const float scale = 1.0f / sqrtf(acc[0] / (float)E + m->eps);
    for (int64_t i = 0; i < E; ++i) {
      const float v = get(bf16, x, n * E + i);
      put(bf16, out, n * ldo + i, bf16 ? bf(to_bf(v * scale)) * get(bf16, w, i) : v * scale * get(bf16, w, i));
    }
  }
}

/* zeros in columns [width, ld) of N rows ld apart: a product's padded input */
static inline __attribute__((always_inline)) void pad(const int bf16, void* in, int64_t width, int64_t ld, int64_t N) {
  if (width < ld)
    for (int64_t n = 0; n < N; ++n) memset((char*)in + (size_t)(n * ld + width) * elem(bf16), 0, (size_t)(ld - width) * elem(bf16));
}

/* y[N, O] (+ bias, rounded) = x[N, in] @ W^T on the panel kernel */
static inline __attribute__((always_inline)) void product(const int bf16, const model_t* m, const void* x, int64_t in, const void* panels, const void* bias, int64_t O,
                    void* y, int64_t N, int64_t num_threads) {
  m->matmul(x, N, in, panels, in, O, y, O, num_threads);
  if (bias)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < O; ++o) put(bf16, y, n * O + o, get(bf16, y, n * O + o) + get(bf16, bias, o));
}

/* RoPE (Hugging Face's half split) of one head's D values at src, as torch rounds it: x * cos + rotate_half(x) * sin,
each product and the sum in the dtype; into float32 dst */
static inline __attribute__((always_inline)) void rope(const int bf16, const model_t* m, const void* src, int64_t at, const void* cos, const void* sin, int64_t pos,
                 float* dst) {
  const int64_t D = m->D, half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -get(bf16, src, at + d + half) : get(bf16, src, at + d - half);
    const float a = r(bf16, get(bf16, src, at + d) * get(bf16, cos, pos * D + d));
    const float b = r(bf16, rot * get(bf16, sin, pos * D + d));
    dst[d] = r(bf16, a + b);
  }
}

/* x[n] += y[n] for N rows of E, rounded */
static inline __attribute__((always_inline)) void residual(const int bf16, const model_t* m, void* x, const void* y, int64_t N) {
  for (int64_t i = 0; i < N * m->E; ++i) put(bf16, x, i, get(bf16, x, i) + get(bf16, y, i));
}

/* One layer's attention, split over the pool: task i is row b = i / C's queries [t0, t1), chunk c = i % C of T in
chunks of TC. A task passes attention.c its rows' pointers, and for a causal pass without a mask the keys up to its
last query (S - (T - t1)), so every query sees the same keys in the same slots as in one call over the whole batch:
attention.c computes a query from its own row and its visible keys alone, and its bits stay the same. */
typedef struct {
  const model_t* m; const float *q, *k, *v; float* att; const uint8_t* mask;
  int64_t ksb, ksg, msb, mst, T, S, C, TC; int causal;
} attend_job;
static void attend_range(void* arg, int64_t i0, int64_t i1) {
  const attend_job* a = arg;
  const model_t* m = a->m;
  const int64_t H = m->H, D = m->D, T = a->T;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / a->C, t0 = i % a->C * a->TC, t1 = t0 + a->TC < T ? t0 + a->TC : T;
    if (t0 >= t1) continue;
    const int64_t S = a->causal && !a->mask ? a->S - (T - t1) : a->S, row = (b * T + t0) * H * D;
    m->attend(a->q + row, T * H * D, D, H * D, a->k + b * a->ksb, a->ksb, a->ksg, D, a->v + b * a->ksb, a->ksb,
              a->ksg, D, a->mask ? a->mask + b * a->msb + t0 * a->mst : NULL, a->msb, a->mst, a->causal,
              a->att + row, 1, H, m->G, t1 - t0, S, D, m->scale);
  }
}
/* A layer's row-wise steps split over the pool as attention is (a few rows a task; each row is one thread's, so its
bits do not depend on the split): RoPE with the KV-cache write (rows_rope), and SiLU(gate) * up into the down
product's input (rows_silu). */
typedef struct {
  const model_t* m; void* out; void* in; float *q, *kl, *vl; const int64_t *positions, *starts;
  const void *cos, *sin; int64_t T, ksb, ksg;
} rows_job;
static inline __attribute__((always_inline)) void rope_rows(const int bf16, const rows_job* j, int64_t n0, int64_t n1) {
  const model_t* m = j->m;
  const int64_t H = m->H, G = m->G, D = m->D, QKV = (H + 2 * G) * D, T = j->T;
  for (int64_t n = n0; n < n1; ++n) {  /* row n is token t of sequence b, in cache slot starts[b] + t */
    const int64_t b = n / T, slot = j->starts[b] + n % T, pos = j->positions[n];
    for (int64_t h = 0; h < H; ++h) rope(bf16, m, j->out, n * QKV + h * D, j->cos, j->sin, pos, j->q + (n * H + h) * D);
    for (int64_t g = 0; g < G; ++g) {
      float* kr = j->kl + b * j->ksb + g * j->ksg + slot * D;
      float* vr = j->vl + b * j->ksb + g * j->ksg + slot * D;
      rope(bf16, m, j->out, n * QKV + (H + g) * D, j->cos, j->sin, pos, kr);
      for (int64_t d = 0; d < D; ++d) vr[d] = get(bf16, j->out, n * QKV + (H + G + g) * D + d);
    }
  }
}
static void rows_rope(void* arg, int64_t n0, int64_t n1) {
  const rows_job* j = arg;
  if (j->m->bf16) rope_rows(1, j, n0, n1); else rope_rows(0, j, n0, n1);
}
static inline __attribute__((always_inline)) void silu_rows(const int bf16, const rows_job* j, int64_t n0, int64_t n1) {
  const int64_t I = j->m->I;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t i = 0; i < I; ++i) {
      const float gate = get(bf16, j->out, n * 2 * I + i), up = get(bf16, j->out, n * 2 * I + I + i);
      put(bf16, j->in, n * j->m->I_in + i, r(bf16, gate / (1.0f + expf(-gate))) * up);
    }
}
static void rows_silu(void* arg, int64_t n0, int64_t n1) {
  const rows_job* j = arg;
  if (j->m->bf16) silu_rows(1, j, n0, n1); else silu_rows(0, j, n0, n1);
}
/* the layers for one dtype (bf16 a constant: each dtype's code is compiled apart, without a branch per value) */
static inline __attribute__((always_inline)) int forward(const int bf16, const model_t* m, void* x, int64_t B, int64_t T,
                                               const int64_t* positions, const void* cos, const void* sin, float* k,
                                               float* v, int64_t ksl, int64_t ksb, int64_t ksg, const int64_t* starts,
                                               int64_t S, const uint8_t* mask, int64_t msb, int64_t mst, int causal,
                                               void* const* taps, int64_t num_threads) {
  const int64_t N = B * T, E = m->E, H = m->H, G = m->G, D = m->D, I = m->I, QKV = (H + 2 * G) * D;
  const size_t es = elem(bf16);
  const int64_t widest = m->E_in > m->HD_in ? (m->E_in > m->I_in ? m->E_in : m->I_in)
                                           : (m->HD_in > m->I_in ? m->HD_in : m->I_in);
  /* in: a product's padded input; out: its output (q/k/v, o, gate/up, down); q, att: float32 attention rows */
  void* in = calloc((size_t)(N * widest), es);
  void* out = malloc((size_t)(N * (QKV > 2 * I ? QKV : 2 * I)) * es);
  float* q = malloc(sizeof(float) * (size_t)(N * H * D));
  float* att = malloc(sizeof(float) * (size_t)(N * H * D));
  if (!in || !out || !q || !att) { free(in); free(out); free(q); free(att); return 1; }
  for (int64_t l = 0; l < m->num_layers; ++l) {
    const layer_t* w = &m->layers[l];
    float* kl = k + l * ksl;
    float* vl = v + l * ksl;
    rms_norm(bf16, m, x, w->input_norm, in, m->E_in, N);
    pad(bf16, in, E, m->E_in, N);
    product(bf16, m, in, m->E_in, w->qkv, w->qkv_bias, QKV, out, N, num_threads);
    rows_job rows = {m, out, in, q, kl, vl, positions, starts, cos, sin, T, ksb, ksg};
    m->parallel_for(rows_rope, &rows, N, num_threads);
    {  /* about 8 tasks: whole rows for a batch, query chunks for one long row (a tree, a prefill chunk) */
      const int64_t C = B >= 8 ? 1 : (T < 8 / B ? T : 8 / B), TC = (T + C - 1) / C;
      attend_job job = {m, q, kl, vl, att, mask, ksb, ksg, msb, mst, T, S, C, TC, causal};
      m->parallel_for(attend_range, &job, B * C, num_threads);
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < H * D; ++i) put(bf16, in, n * m->HD_in + i, att[n * H * D + i]);
    pad(bf16, in, H * D, m->HD_in, N);
    product(bf16, m, in, m->HD_in, w->o, w->o_bias, E, out, N, num_threads);
    residual(bf16, m, x, out, N);
    rms_norm(bf16, m, x, w->post_norm, in, m->E_in, N);
    pad(bf16, in, E, m->E_in, N);
    product(bf16, m, in, m->E_in, w->gate_up, w->gate_up_bias, 2 * I, out, N, num_threads);
    m->parallel_for(rows_silu, &rows, N, num_threads);
    pad(bf16, in, I, m->I_in, N);
    product(bf16, m, in, m->I_in, w->down, w->down_bias, E, out, N, num_threads);
    residual(bf16, m, x, out, N);
    if (taps && taps[l]) memcpy(taps[l], x, (size_t)(N * E) * es);
  }
  rms_norm(bf16, m, x, m->final_norm, x, E, N);  /* in place: a row's sum is taken before it is overwritten */
  free(in); free(out); free(q); free(att);
  return 0;
}

int eyas_forward(const model_t* m, void* x, int64_t B, int64_t T, const int64_t* positions, const void* cos,
                 const void* sin, float* k, float* v, int64_t ksl, int64_t ksb, int64_t ksg, const int64_t* starts,
                 int64_t S, const uint8_t* mask, int64_t msb, int64_t mst, int causal, void* const* taps,
                 int64_t num_threads) {
  if (m->bf16)
    return forward(1, m, x, B, T, positions, cos, sin, k, v, ksl, ksb, ksg, starts, S, mask, msb, mst, causal, taps,
                   num_threads);
  return forward(0, m, x, B, T, positions, cos, sin, k, v, ksl, ksb, ksg, starts, S, mask, msb, mst, causal, taps,
                 num_threads);
}
