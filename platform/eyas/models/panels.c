/* eyas.models.panels: x[M, I] @ W^T for a few rows (a decode step, a tree verify) on CPU in float32 (and bfloat16, below).

W lies in panels of 32 outputs, [ceil(O/32), I, 32] (zero-padded), so a product streams the weight once, in order,
and keeps each row's 32 sums in registers. Every row's sums run over i in the same order whatever M is: a row's
outputs are bit-identical at any number of rows, so a decode step and a verify compute the same numbers.
Built by panels.py with the host's compiler (-O3 -march=native); GCC's vector extensions give AVX-512 or AVX2. */
#include <stdint.h>
#include <string.h>
#define W 32
/* One vector register's floats: a panel's 32 sums per row are NV of them. AVX-512 holds 8 rows' sums (16 of its 32
registers) beside a panel line's 2 vectors; AVX2 has 16 registers, so 2 rows (8 sums and 4 weight vectors) a pass.
A vector wider than the registers (a 64-byte vector on AVX2) went through the stack: 9 GB/s at 1 row. */
#if defined(__AVX512F__)
#define VW 16
#define MAX_MB 8
#elif defined(__AVX__)
#define VW 8
#define MAX_MB 2
#else
#define VW 4
#define MAX_MB 2
#endif
#define NV (W / VW)
typedef float vf __attribute__((vector_size(VW * 4), aligned(4), may_alias));  /* unaligned loads and stores: a
                                                   memcpy into a vector went through the stack on AVX2 */
static inline vf ld(const float* p) { return *(const vf*)p; }
static inline void st(float* p, vf v) { *(vf*)p = v; }
static inline __attribute__((always_inline)) void chunk(const float* x, int64_t ldx, const float* panel, int64_t I,
                                                         float* y, int64_t ldy, int mb, int64_t nvalid) {
  vf acc[MAX_MB][NV];  /* every loop over k and m unrolled, so the arrays live in registers (GCC keeps a rolled
                          loop's arrays on the stack) */
#pragma GCC unroll 8
  for (int m = 0; m < mb; ++m)
#pragma GCC unroll 8
    for (int k = 0; k < NV; ++k) acc[m][k] = (vf){0};
  for (int64_t i = 0; i < I; ++i) {
    vf w[NV];
#pragma GCC unroll 8
    for (int k = 0; k < NV; ++k) w[k] = ld(panel + i * W + k * VW);
#pragma GCC unroll 8
    for (int m = 0; m < mb; ++m) {
      const float xv = x[m * ldx + i];
#pragma GCC unroll 8
      for (int k = 0; k < NV; ++k) acc[m][k] += w[k] * xv;
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < mb; ++m) {
    if (nvalid == W) {
#pragma GCC unroll 8
      for (int k = 0; k < NV; ++k) st(y + m * ldy + k * VW, acc[m][k]);
    } else {
      float t[W];
#pragma GCC unroll 8
      for (int k = 0; k < NV; ++k) st(t + k * VW, acc[m][k]);
      memcpy(y + m * ldy, t, nvalid * 4);
    }
  }
}
#define CHUNK(MB) static void chunk##MB(const float* x, int64_t ldx, const float* p, int64_t I, float* y, int64_t ldy, int64_t nv) { chunk(x, ldx, p, I, y, ldy, MB < MAX_MB ? MB : MAX_MB, nv); }
CHUNK(1) CHUNK(2) CHUNK(3) CHUNK(4) CHUNK(5) CHUNK(6) CHUNK(7) CHUNK(8)
typedef void (*chunk_fn)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
static const chunk_fn CHUNKS[9] = {0, chunk1, chunk2, chunk3, chunk4, chunk5, chunk6, chunk7, chunk8};
/* y[M, O] = x[M, I] @ W^T, W given as panels [ceil(O/32), I, 32] (zero-padded) */
static void panels_f32(const float* x, int64_t M, int64_t ldx, const float* panels, int64_t I, int64_t O, float* y,
                       int64_t ldy, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = panels + p * I * W;
    const int64_t nv = (O - p * W) < W ? (O - p * W) : W;
    for (int64_t m = 0; m < M; m += MAX_MB) {
      const int mb = (M - m) < MAX_MB ? (int)(M - m) : MAX_MB;
      CHUNKS[mb](x + m * ldx, ldx, panel, I, y + m * ldy + p * W, ldy, nv);
    }
  }
}
/* The thread pool: a product's panels split over up to num_threads threads (the caller and num_threads - 1 workers
this library starts on first use). Each panel's outputs are one thread's, summed exactly as on one thread, so the
bits do not depend on the thread count. Threads claim tasks (a few panels each) from a shared counter until none
are left: where another process holds a worker's core, the caller takes the tasks it cannot, and waits at most for
the one task that worker holds. A worker spins on the counter for a while after a product (the next one follows
within microseconds in a decode step), then sleeps on a condition variable. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef struct job job_t;
struct job {
  void (*task)(const job_t*, int64_t, int64_t);  /* panels [p0, p1) */
  const void* x; int64_t M, ldx; const void* panels; int64_t I, O; void* y; int64_t ldy;
  int64_t num_panels, panels_per_task, num_tasks;
  void (*fn)(void*, int64_t, int64_t); void* ctx;  /* eyas_parallel_for's range function and its argument */
};
#define MAX_WORKERS 63
#define POOL_MIN_BYTES (256 << 10)  /* a smaller weight is one thread's: waking a worker costs more than it saves */
static job_t pool_job;
/* one word, so that a claim sees its job whole: generation (bits 40-63), tasks (20-39), next task (0-19). A claim
succeeds only in the job it was meant for, and before that task's done count, so the job cannot change under it. */
static _Atomic uint64_t pool_next;
#define GEN(word) ((uint32_t)((word) >> 40))
#define TASKS(word) ((int64_t)(((word) >> 20) & 0xfffff))
#define NEXT(word) ((int64_t)((word) & 0xfffff))
static _Atomic int64_t pool_done;
static _Atomic int pool_sleepers, pool_workers_wanted;
static _Atomic int pool_taken;  /* a caller is using the pool: another one (a second Python thread) runs alone */
static int pool_started;
static int64_t pool_spin_ns = 0;  /* EYAS_PANEL_SPIN_US: how long an idle worker spins (past 256 pauses) before it
                                     sleeps; 0: a spinning worker only takes the core from other processes */
static pthread_mutex_t pool_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
static inline int64_t now_ns(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
/* claims and runs tasks of generation gen until none are left */
static void run_tasks(uint32_t gen) {
  for (;;) {
    uint64_t seen = atomic_load(&pool_next);
    if (GEN(seen) != gen || NEXT(seen) >= TASKS(seen)) return;
    if (!atomic_compare_exchange_weak(&pool_next, &seen, seen + 1)) continue;
    const job_t* j = &pool_job;
    const int64_t p0 = NEXT(seen) * j->panels_per_task, p1 = p0 + j->panels_per_task;
    j->task(j, p0, p1 < j->num_panels ? p1 : j->num_panels);
    atomic_fetch_add(&pool_done, 1);
  }
}
static void* worker_main(void* arg) {
  const int worker = (int)(intptr_t)arg;
  uint32_t last = GEN(atomic_load(&pool_next));
  for (;;) {
    int64_t since = now_ns();
    for (int spins = 0;; ++spins) {
      if (GEN(atomic_load(&pool_next)) != last) break;
      cpu_relax();
      if ((spins & 255) == 255 && now_ns() - since > pool_spin_ns) {
        pthread_mutex_lock(&pool_mutex);
        atomic_fetch_add(&pool_sleepers, 1);
        while (GEN(atomic_load(&pool_next)) == last) pthread_cond_wait(&pool_wake, &pool_mutex);
        atomic_fetch_sub(&pool_sleepers, 1);
        pthread_mutex_unlock(&pool_mutex);
        break;
      }
    }
    last = GEN(atomic_load(&pool_next));
    if (worker <= atomic_load(&pool_workers_wanted)) run_tasks(last);
  }
  return NULL;
}
static void forget_workers(void) {  /* a forked child has none of its parent's threads */
  pool_started = 0;
  atomic_store(&pool_sleepers, 0);
  atomic_store(&pool_taken, 0);
  pthread_mutex_init(&pool_mutex, NULL);
  pthread_cond_init(&pool_wake, NULL);
}
/* starts workers up to wanted (once: EYAS_PANEL_SPIN_US is read then); returns how many run, at most wanted */
static int64_t start_workers(int64_t wanted) {
  if (pool_started == 0) {
    static int once = 0;
    const char* spin = getenv("EYAS_PANEL_SPIN_US");
    if (spin) pool_spin_ns = (int64_t)atol(spin) * 1000;
    if (!once) once = 1, pthread_atfork(NULL, NULL, forget_workers);
  }
  while (pool_started < wanted && pool_started < MAX_WORKERS) {
    pthread_t thread;
    if (pthread_create(&thread, NULL, worker_main, (void*)(intptr_t)(pool_started + 1)) != 0) break;
    pthread_detach(thread);
    ++pool_started;
  }
  return pool_started < wanted ? pool_started : wanted;
}
/* runs job j over num_panels panels of panel_bytes each: on the caller alone for a small weight, one thread, or
while another caller holds the pool; else split with up to num_threads - 1 workers */
static void run_job(job_t* j, int64_t num_panels, int64_t panel_bytes, int64_t num_threads) {
  if (num_threads < 2 || num_panels < 2 || num_panels * panel_bytes < POOL_MIN_BYTES ||
      atomic_exchange(&pool_taken, 1)) {
    j->task(j, 0, num_panels);
    return;
  }
  const int64_t workers = start_workers(num_threads - 1);
  if (workers == 0) { j->task(j, 0, num_panels); atomic_store(&pool_taken, 0); return; }
  j->num_panels = num_panels;
  j->panels_per_task = num_panels / (8 * (workers + 1)) > 1 ? num_panels / (8 * (workers + 1)) : 1;
  j->num_tasks = (num_panels + j->panels_per_task - 1) / j->panels_per_task;
  pool_job = *j;
  atomic_store(&pool_workers_wanted, (int)workers);
  atomic_store(&pool_done, 0);
  const uint32_t gen = (GEN(atomic_load(&pool_next)) + 1) & 0xffffff;
  atomic_store(&pool_next, ((uint64_t)gen << 40) | ((uint64_t)j->num_tasks << 20));  /* seq_cst: before the
                                                                                         sleepers' count below */
  if (atomic_load(&pool_sleepers) > 0) {
    pthread_mutex_lock(&pool_mutex);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_mutex);
  }
  run_tasks(gen);
  for (int spins = 0; atomic_load(&pool_done) < j->num_tasks; ++spins) {
    cpu_relax();
    if (spins > 4096) sched_yield();  /* a worker lost its core mid-task: let it have ours */
  }
  atomic_store(&pool_taken, 0);
}
/* fn(ctx, i0, i1) over the ranges of [0, n) on the same pool as the products (forward.c's attention, a few rows
or queries a task): the caller and up to num_threads - 1 workers claim ranges until none are left. Each index is one
thread's whole call, so what fn computes for it does not depend on the thread count. */
typedef void (*range_fn)(void* ctx, int64_t i0, int64_t i1);
static void task_range(const job_t* j, int64_t i0, int64_t i1) { j->fn(j->ctx, i0, i1); }
void eyas_parallel_for(range_fn fn, void* ctx, int64_t n, int64_t num_threads) {
  job_t j = {task_range};
  j.fn = fn, j.ctx = ctx;
  run_job(&j, n, POOL_MIN_BYTES, num_threads);
}
static void task_f32(const job_t* j, int64_t p0, int64_t p1) {
  panels_f32(j->x, j->M, j->ldx, j->panels, j->I, j->O, j->y, j->ldy, p0, p1);
}
/* y[M, O] = x[M, I] @ W^T, W given as panels [ceil(O/32), I, 32] (zero-padded); the panels split over up to
num_threads threads (each output is one thread's, summed as on one thread) */
void eyas_panel_matmul(const float* x, int64_t M, int64_t ldx, const float* panels, int64_t I, int64_t O,
                       float* y, int64_t ldy, int64_t num_threads) {
  job_t j = {task_f32, x, M, ldx, panels, I, O, y, ldy};
  run_job(&j, (O + W - 1) / W, (int64_t)4 * I * W, num_threads);
}

/* Q8_0 weights (GGUF's: blocks of 32 inputs, int8 values q in [-127, 127] and one float16 scale each), float32
activations quantized per row and block of 32 as llama.cpp quantizes them (scale d = max|x| / 127 rounded to
float16, q = x * 127 / max|x| rounded to nearest even). A panel is nb = I / 32 blocks of Q8_BLOCK bytes: the 32
outputs' scales (float16), then the weights plus 128 as uint8, laid out for vpdpbusd: group g of 4 inputs, half h
of 16 outputs, output j, input k at byte 128 g + 64 h + 4 j + k. Output o sums, block by block in input order,
(float)(integer dot of the block) * (weight scale * row scale) in float32 (one fma a block); the integer dot is
exact, so the AVX512_VNNI kernel and the portable one below give the same bits, and a row's bits do not depend on
the other rows or the thread count. The +128 makes the weights unsigned for vpdpbusd (u8 x s8); each row's block
carries -128 * (sum of its q) to take it back out. */
#define QK 32
#define Q8_BLOCK (2 * W + QK * W)
typedef struct { const int8_t* q; const float* d; const int32_t* c; int64_t nb; } q8_rows_t;
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (e == 0) { const float f = (float)man * 5.9604644775390625e-08f; return sign ? -f : f; }  /* man * 2^-24 */
  u = sign | (e == 31 ? 0x7f800000u | (man << 13) : ((e + 112) << 23) | (man << 13));
  float f; memcpy(&f, &u, 4); return f;
}
static inline float round_to_half(float f) {  /* f >= 0 to the nearest float16 value, ties to even */
  if (f >= 65520.0f) return __builtin_inff();
  if (f < 6.103515625e-05f) return __builtin_nearbyintf(f * 16777216.0f) / 16777216.0f;  /* subnormal: 2^-24 steps */
  uint32_t u; memcpy(&u, &f, 4);
  u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
  memcpy(&f, &u, 4); return f;
}
/* rows x[M, I] (I a multiple of 32) to q[M, I], d[M, nb], c[M, nb] = -128 * sum of the block's q */
static void quantize_rows(const float* x, int64_t M, int64_t ldx, int64_t I, int8_t* q, float* d, int32_t* c) {
  const int64_t nb = I / QK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * ldx + b * QK;
      float amax = 0.0f;
      for (int k = 0; k < QK; ++k) amax = __builtin_fmaxf(amax, __builtin_fabsf(xb[k]));
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int k = 0; k < QK; ++k) {
        const int32_t v = (int32_t)__builtin_nearbyintf(xb[k] * id);
        q[m * I + b * QK + k] = (int8_t)v;
        sum += v;
      }
      d[m * nb + b] = round_to_half(amax / 127.0f);
      c[m * nb + b] = -128 * sum;
    }
}
static inline __attribute__((always_inline)) void chunk_q8_portable(const q8_rows_t* x, int64_t m0, const uint8_t* panel,
                                                                     float* y, int64_t ldy, int mb, int64_t nvalid) {
  float acc[4][W];
  for (int m = 0; m < mb; ++m) for (int o = 0; o < W; ++o) acc[m][o] = 0.0f;
  for (int64_t b = 0; b < x->nb; ++b) {
    const uint8_t* block = panel + b * Q8_BLOCK;
    float scale[W];
    for (int o = 0; o < W; ++o) { uint16_t h; memcpy(&h, block + 2 * o, 2); scale[o] = half_to_float(h); }
    for (int m = 0; m < mb; ++m) {
      const int8_t* q = x->q + (m0 + m) * x->nb * QK + b * QK;
      const float dx = x->d[(m0 + m) * x->nb + b];
      for (int o = 0; o < W; ++o) {
        int32_t dot = x->c[(m0 + m) * x->nb + b];
        for (int g = 0; g < QK / 4; ++g)
          for (int k = 0; k < 4; ++k)
            dot += (int32_t)block[2 * W + 128 * g + 64 * (o / 16) + 4 * (o % 16) + k] * (int32_t)q[4 * g + k];
        acc[m][o] = __builtin_fmaf((float)dot, scale[o] * dx, acc[m][o]);
      }
    }
  }
  for (int m = 0; m < mb; ++m) memcpy(y + m * ldy, acc[m], (size_t)nvalid * 4);
}
#ifdef __AVX512VNNI__
#include <immintrin.h>
static inline __attribute__((always_inline)) void chunk_q8_vnni(const q8_rows_t* x, int64_t m0, const uint8_t* panel,
                                                                 float* y, int64_t ldy, int mb, int64_t nvalid) {
  __m512 acc[4][2];
  for (int m = 0; m < mb; ++m) { acc[m][0] = _mm512_setzero_ps(); acc[m][1] = _mm512_setzero_ps(); }
  for (int64_t b = 0; b < x->nb; ++b) {
    const uint8_t* block = panel + b * Q8_BLOCK;
    const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)block));
    const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + 32)));
    __m512i dot[4][2];
    for (int m = 0; m < mb; ++m) dot[m][0] = dot[m][1] = _mm512_set1_epi32(x->c[(m0 + m) * x->nb + b]);
    if (mb == 1) {  /* one row: its two chains of 8 vpdpbusd split in four (integer sums: the same bits) */
      __m512i odd0 = _mm512_setzero_si512(), odd1 = _mm512_setzero_si512();
      const int8_t* q = x->q + m0 * x->nb * QK + b * QK;
      for (int g = 0; g < QK / 4; g += 2) {
        int32_t four[2]; memcpy(four, q + 4 * g, 8);
        const __m512i xe = _mm512_set1_epi32(four[0]), xo = _mm512_set1_epi32(four[1]);
        const uint8_t* wg = block + 2 * W + 128 * g;
        dot[0][0] = _mm512_dpbusd_epi32(dot[0][0], _mm512_loadu_si512(wg), xe);
        dot[0][1] = _mm512_dpbusd_epi32(dot[0][1], _mm512_loadu_si512(wg + 64), xe);
        odd0 = _mm512_dpbusd_epi32(odd0, _mm512_loadu_si512(wg + 128), xo);
        odd1 = _mm512_dpbusd_epi32(odd1, _mm512_loadu_si512(wg + 192), xo);
      }
      dot[0][0] = _mm512_add_epi32(dot[0][0], odd0); dot[0][1] = _mm512_add_epi32(dot[0][1], odd1);
    } else {
      for (int g = 0; g < QK / 4; ++g) {
        const __m512i w0 = _mm512_loadu_si512(block + 2 * W + 128 * g), w1 = _mm512_loadu_si512(block + 2 * W + 128 * g + 64);
        for (int m = 0; m < mb; ++m) {
          int32_t four; memcpy(&four, x->q + (m0 + m) * x->nb * QK + b * QK + 4 * g, 4);
          const __m512i xv = _mm512_set1_epi32(four);
          dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], w0, xv); dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], w1, xv);
        }
      }
    }
    for (int m = 0; m < mb; ++m) {
      const __m512 dx = _mm512_set1_ps(x->d[(m0 + m) * x->nb + b]);
      acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), _mm512_mul_ps(s0, dx), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][1]), _mm512_mul_ps(s1, dx), acc[m][1]);
    }
  }
  for (int m = 0; m < mb; ++m) {
    float t[W]; _mm512_storeu_ps(t, acc[m][0]); _mm512_storeu_ps(t + 16, acc[m][1]);
    memcpy(y + m * ldy, t, (size_t)nvalid * 4);
  }
}
/* one row on two panels at once (p and p + 1, np panels apart in memory): twice the independent chains and two
weight streams in flight; each output's sums run exactly as in chunk_q8_vnni */
static void pair_q8_vnni(const q8_rows_t* x, int64_t m0, const uint8_t* panel, int64_t panel_bytes, float* y,
                         int64_t nvalid) {
  __m512 acc[2][2];
  for (int p = 0; p < 2; ++p) acc[p][0] = acc[p][1] = _mm512_setzero_ps();
  const int8_t* q = x->q + m0 * x->nb * QK;
  for (int64_t b = 0; b < x->nb; ++b) {
    const __m512i c = _mm512_set1_epi32(x->c[m0 * x->nb + b]);
    __m512i even[2][2], odd[2][2];
    for (int p = 0; p < 2; ++p) {
      even[p][0] = even[p][1] = c; odd[p][0] = odd[p][1] = _mm512_setzero_si512();
    }
    for (int g = 0; g < QK / 4; g += 2) {
      int32_t four[2]; memcpy(four, q + b * QK + 4 * g, 8);
      const __m512i xe = _mm512_set1_epi32(four[0]), xo = _mm512_set1_epi32(four[1]);
      for (int p = 0; p < 2; ++p) {
        const uint8_t* wg = panel + p * panel_bytes + b * Q8_BLOCK + 2 * W + 128 * g;
        even[p][0] = _mm512_dpbusd_epi32(even[p][0], _mm512_loadu_si512(wg), xe);
        even[p][1] = _mm512_dpbusd_epi32(even[p][1], _mm512_loadu_si512(wg + 64), xe);
        odd[p][0] = _mm512_dpbusd_epi32(odd[p][0], _mm512_loadu_si512(wg + 128), xo);
        odd[p][1] = _mm512_dpbusd_epi32(odd[p][1], _mm512_loadu_si512(wg + 192), xo);
      }
    }
    const __m512 dx = _mm512_set1_ps(x->d[m0 * x->nb + b]);
    for (int p = 0; p < 2; ++p) {
      const uint8_t* block = panel + p * panel_bytes + b * Q8_BLOCK;
      const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)block));
      const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + 32)));
      acc[p][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even[p][0], odd[p][0])), _mm512_mul_ps(s0, dx),
                                  acc[p][0]);
      acc[p][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even[p][1], odd[p][1])), _mm512_mul_ps(s1, dx),
                                  acc[p][1]);
    }
  }
  _mm512_storeu_ps(y, acc[0][0]); _mm512_storeu_ps(y + 16, acc[0][1]);  /* the first panel is whole */
  float t[W]; _mm512_storeu_ps(t, acc[1][0]); _mm512_storeu_ps(t + 16, acc[1][1]);
  memcpy(y + W, t, (size_t)nvalid * 4);
}
#define Q8_VNNI 1
#else
#define Q8_VNNI 0
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
/* AVX2 without VNNI: the weights back to signed (xor 0x80), each 4-input dot as vpmaddubsw(|x|, sign(w, x)) (at most
127 * 127 * 2 a pair: no saturation) and vpmaddwd by ones, so the integer dot is exact and the bits are VNNI's */
static inline __attribute__((always_inline)) void chunk_q8_avx2(const q8_rows_t* x, int64_t m0, const uint8_t* panel,
                                                                 float* y, int64_t ldy, int mb, int64_t nvalid) {
  const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  for (int m = 0; m < mb; ++m) {
    __m256 acc[4];
    for (int v = 0; v < 4; ++v) acc[v] = _mm256_setzero_ps();
    const int8_t* q = x->q + (m0 + m) * x->nb * QK;
    for (int64_t b = 0; b < x->nb; ++b) {
      const uint8_t* block = panel + b * Q8_BLOCK;
      __m256i dot[4];
      for (int v = 0; v < 4; ++v) dot[v] = _mm256_setzero_si256();
      for (int g = 0; g < QK / 4; ++g) {
        int32_t four; memcpy(&four, q + b * QK + 4 * g, 4);
        const __m256i xv = _mm256_set1_epi32(four), xabs = _mm256_sign_epi8(xv, xv);
        for (int v = 0; v < 4; ++v) {  /* outputs 8v .. 8v + 7 */
          const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(block + 2 * W + 128 * g + 32 * v)),
                                             flip);
          dot[v] = _mm256_add_epi32(dot[v], _mm256_madd_epi16(_mm256_maddubs_epi16(xabs, _mm256_sign_epi8(w, xv)),
                                                              ones));
        }
      }
      const __m256 dx = _mm256_set1_ps(x->d[(m0 + m) * x->nb + b]);
      for (int v = 0; v < 4; ++v) {
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(block + 16 * v)));
        acc[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[v]), _mm256_mul_ps(scale, dx), acc[v]);
      }
    }
    float t[W];
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(t + 8 * v, acc[v]);
    memcpy(y + m * ldy, t, (size_t)nvalid * 4);
  }
}
#define Q8_AVX2 1
#else
#define Q8_AVX2 0
#endif
#define CHUNK_Q8(KIND, MB) static void chunk_q8_##KIND##_##MB(const q8_rows_t* x, int64_t m0, const uint8_t* p, float* y, int64_t ldy, int64_t nv) { chunk_q8_##KIND(x, m0, p, y, ldy, MB, nv); }
typedef void (*chunk_q8_fn)(const q8_rows_t*, int64_t, const uint8_t*, float*, int64_t, int64_t);
CHUNK_Q8(portable, 1) CHUNK_Q8(portable, 2) CHUNK_Q8(portable, 3) CHUNK_Q8(portable, 4)
static const chunk_q8_fn CHUNKS_Q8_PORTABLE[5] = {0, chunk_q8_portable_1, chunk_q8_portable_2, chunk_q8_portable_3,
                                                  chunk_q8_portable_4};
#if Q8_AVX2
CHUNK_Q8(avx2, 1) CHUNK_Q8(avx2, 2) CHUNK_Q8(avx2, 3) CHUNK_Q8(avx2, 4)
static const chunk_q8_fn CHUNKS_Q8_AVX2[5] = {0, chunk_q8_avx2_1, chunk_q8_avx2_2, chunk_q8_avx2_3, chunk_q8_avx2_4};
#endif
#if Q8_VNNI
CHUNK_Q8(vnni, 1) CHUNK_Q8(vnni, 2) CHUNK_Q8(vnni, 3) CHUNK_Q8(vnni, 4)
static const chunk_q8_fn CHUNKS_Q8[5] = {0, chunk_q8_vnni_1, chunk_q8_vnni_2, chunk_q8_vnni_3, chunk_q8_vnni_4};
#elif Q8_AVX2
static const chunk_q8_fn* const CHUNKS_Q8 = CHUNKS_Q8_AVX2;
#else
static const chunk_q8_fn* const CHUNKS_Q8 = CHUNKS_Q8_PORTABLE;
#endif
/* the loop Q8_0 products run on here: "avx512_vnni", "avx2" (vpmaddubsw) or "portable" (plain C, far slower) */
const char* eyas_panel_q8_0_loop(void) { return Q8_VNNI ? "avx512_vnni" : Q8_AVX2 ? "avx2" : "portable"; }
static void panels_q8(const q8_rows_t* x, int64_t M, const uint8_t* panels, int64_t O, float* y, int64_t ldy,
                      int64_t p0, int64_t p1, const chunk_q8_fn* chunks) {
#if Q8_VNNI
  if (M == 1 && chunks == CHUNKS_Q8)  /* one row: two panels at a time */
    for (; p0 + 1 < p1; p0 += 2) {
      const int64_t nv = (O - (p0 + 1) * W) < W ? (O - (p0 + 1) * W) : W;
      pair_q8_vnni(x, 0, panels + p0 * x->nb * Q8_BLOCK, x->nb * Q8_BLOCK, y + p0 * W, nv);
    }
#endif
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = panels + p * x->nb * Q8_BLOCK;
    const int64_t nv = (O - p * W) < W ? (O - p * W) : W;
    for (int64_t m = 0; m < M; m += 4) {
      const int mb = (M - m) < 4 ? (int)(M - m) : 4;
      chunks[mb](x, m, panel, y + m * ldy + p * W, ldy, nv);
    }
  }
}
static void task_q8(const job_t* j, int64_t p0, int64_t p1) {
  panels_q8(j->x, j->M, j->panels, j->O, j->y, j->ldy, p0, p1, CHUNKS_Q8);
}
static void task_q8_portable(const job_t* j, int64_t p0, int64_t p1) {
  panels_q8(j->x, j->M, j->panels, j->O, j->y, j->ldy, p0, p1, CHUNKS_Q8_PORTABLE);
}
#if Q8_AVX2
static void task_q8_avx2(const job_t* j, int64_t p0, int64_t p1) {
  panels_q8(j->x, j->M, j->panels, j->O, j->y, j->ldy, p0, p1, CHUNKS_Q8_AVX2);
}
#endif
/* the caller's quantized rows, kept between products (one buffer per calling thread) */
static __thread void* q8_scratch;
static __thread size_t q8_scratch_bytes;
static void matmul_q8(const float* x, int64_t M, int64_t ldx, const uint8_t* panels, int64_t I, int64_t O, float* y,
                      int64_t ldy, int64_t num_threads, void (*task)(const job_t*, int64_t, int64_t)) {
  const int64_t nb = I / QK;
  const size_t bytes = (size_t)(M * I) + (size_t)(M * nb) * 8 + 64;
  if (bytes > q8_scratch_bytes) {
    free(q8_scratch);
    q8_scratch = malloc(bytes);
    q8_scratch_bytes = q8_scratch ? bytes : 0;
    if (!q8_scratch) { fprintf(stderr, "eyas panels.c: out of memory for %zu bytes of Q8_0 rows\n", bytes); abort(); }
  }
  float* d = (float*)q8_scratch;
  int32_t* c = (int32_t*)(d + M * nb);
  int8_t* q = (int8_t*)(c + M * nb);
  quantize_rows(x, M, ldx, I, q, d, c);
  const q8_rows_t rows = {q, d, c, nb};
  job_t j = {task, &rows, M, 0, panels, I, O, y, ldy};
  run_job(&j, (O + W - 1) / W, nb * Q8_BLOCK, num_threads);
}
/* y[M, O] = x[M, I] @ W^T for Q8_0 panels [ceil(O/32), I/32, Q8_BLOCK] (I a multiple of 32: panels.py pads it) */
void eyas_panel_matmul_q8_0(const float* x, int64_t M, int64_t ldx, const uint8_t* panels, int64_t I, int64_t O,
                            float* y, int64_t ldy, int64_t num_threads) {
  matmul_q8(x, M, ldx, panels, I, O, y, ldy, num_threads, task_q8);
}
#if Q8_AVX2
/* the same on the AVX2 loop (where it builds: tests compare the loops bit for bit) */
void eyas_panel_matmul_q8_0_avx2(const float* x, int64_t M, int64_t ldx, const uint8_t* panels, int64_t I, int64_t O,
                                 float* y, int64_t ldy, int64_t num_threads) {
  matmul_q8(x, M, ldx, panels, I, O, y, ldy, num_threads, task_q8_avx2);
}
#endif
/* the same on the portable loop whatever the CPU (tests compare the loops bit for bit) */
void eyas_panel_matmul_q8_0_portable(const float* x, int64_t M, int64_t ldx, const uint8_t* panels, int64_t I,
                                     int64_t O, float* y, int64_t ldy, int64_t num_threads) {
  matmul_q8(x, M, ldx, panels, I, O, y, ldy, num_threads, task_q8_portable);
}

/* bfloat16, where the CPU has AVX512_BF16 (elsewhere panels.py keeps torch's kernels): W in panels
[ceil(O/32), I/2, 32, 2] (each output's inputs i, i+1 side by side, zero-padded), x[M, I] bfloat16 with I even (the
caller pads), y bfloat16 rounded to nearest even from the float32 sums. Half the bytes of float32 per weight, and
each pair of inputs is one vdpbf16ps. As in float32, a row's sums run in the same order at any M. */
static inline uint16_t to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#ifdef __AVX512BF16__
#include <immintrin.h>
static inline __attribute__((always_inline)) void chunk_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel,
                                                              int64_t I2, uint16_t* y, int64_t ldy, int mb,
                                                              int64_t nvalid) {
  __m512 acc[8][2];
  for (int m = 0; m < mb; ++m) { acc[m][0] = _mm512_setzero_ps(); acc[m][1] = _mm512_setzero_ps(); }
  for (int64_t i = 0; i < I2; ++i) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * W);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * W + W);
    for (int m = 0; m < mb; ++m) {
      uint32_t pair; memcpy(&pair, x + m * ldx + 2 * i, 4);
      __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xv); acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xv);
    }
  }
  for (int m = 0; m < mb; ++m) {
    float t[W]; _mm512_storeu_ps(t, acc[m][0]); _mm512_storeu_ps(t + 16, acc[m][1]);
    for (int64_t j = 0; j < nvalid; ++j) y[m * ldy + j] = to_bf16(t[j]);
  }
}
#define CHUNK_BF16(MB) static void chunk_bf16_##MB(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t I2, uint16_t* y, int64_t ldy, int64_t nv) { chunk_bf16(x, ldx, p, I2, y, ldy, MB, nv); }
CHUNK_BF16(1) CHUNK_BF16(2) CHUNK_BF16(3) CHUNK_BF16(4) CHUNK_BF16(5) CHUNK_BF16(6) CHUNK_BF16(7) CHUNK_BF16(8)
typedef void (*chunk_bf16_fn)(const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
static const chunk_bf16_fn CHUNKS_BF16[9] = {0, chunk_bf16_1, chunk_bf16_2, chunk_bf16_3, chunk_bf16_4, chunk_bf16_5,
                                             chunk_bf16_6, chunk_bf16_7, chunk_bf16_8};

/* With AMX (Sapphire Rapids and later), the same panels feed the tile unit: a B tile is 16 input pairs of a panel's
first or last 16 outputs (rows 128 bytes apart), an A tile up to 16 rows' 32 inputs, and one tdpbf16ps per tile pair
does what 16 vdpbf16ps per row do. A decode step and a verify then cost the same weight stream (the vector kernel
spends ~2 vdpbf16ps per row per weight line and becomes compute-bound past 2 rows). Each output's float32 sum runs
over the same 32-input blocks in the same order for every row, so the row invariance holds; the sums differ from the
vector kernel's only in order, and a process uses one kernel or the other throughout (eyas_panel_amx). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <unistd.h>
#include <sys/syscall.h>
static int amx_on = 0;
/* Asks Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) when want is set; returns
whether the AMX kernel is on. panels.py calls it once when it loads this library (and jobs.bench_linear
between products, to time both kernels side by side). */
int eyas_panel_amx(int want) {
  amx_on = want && syscall(SYS_arch_prctl, 0x1023, 18) == 0;  /* idempotent once granted */
  return amx_on;
}
int eyas_panel_uses_amx(void) { return amx_on; }
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
static void amx_configure(int mb) {
  tile_config c; memset(&c, 0, sizeof c); c.palette = 1;
  c.rows[0] = c.rows[1] = c.rows[2] = (uint8_t)mb;  /* C0, C1: mb rows x 16 float32 sums; A: mb rows x 32 inputs */
  c.rows[3] = c.rows[4] = 16;                      /* B0, B1: 16 input pairs x 16 outputs x 2 */
  for (int t = 0; t < 5; ++t) c.colsb[t] = 64;
  _tile_loadconfig(&c);
}
/* x[M, I] @ W^T through the tiles; I a multiple of 32 (pack pads it) */
static void matmul_amx(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* panels, int64_t I, int64_t O,
                       uint16_t* y, int64_t ldy) {
  const int64_t npanel = (O + W - 1) / W, blocks = I / 32;
  float sums[16][W];
  for (int64_t m = 0; m < M; m += 16) {
    const int mb = (M - m) < 16 ? (int)(M - m) : 16;
    amx_configure(mb);
    for (int64_t p = 0; p < npanel; ++p) {
      const uint16_t* panel = panels + p * I * W;
      const int64_t nv = (O - p * W) < W ? (O - p * W) : W;
      _tile_zero(0); _tile_zero(1);
      for (int64_t k = 0; k < blocks; ++k) {
        const uint16_t* pairs = panel + k * 16 * 2 * W;  /* input pairs 16k .. 16k+15 */
        _tile_loadd(2, x + m * ldx + k * 32, ldx * 2);
        _tile_loadd(3, pairs, 4 * W); _tile_loadd(4, pairs + W, 4 * W);
        _tile_dpbf16ps(0, 2, 3); _tile_dpbf16ps(1, 2, 4);
      }
      _tile_stored(0, &sums[0][0], 4 * W); _tile_stored(1, &sums[0][16], 4 * W);
      for (int r = 0; r < mb; ++r)
        for (int64_t j = 0; j < nv; ++j) y[(m + r) * ldy + p * W + j] = to_bf16(sums[r][j]);
    }
  }
  _tile_release();
}
#else
int eyas_panel_amx(int want) { (void)want; return 0; }
int eyas_panel_uses_amx(void) { return 0; }
#endif

/* y[M, O] = x[M, I] @ W^T in bfloat16, W given as bfloat16 panels [ceil(O/32), I/2, 32, 2]; I even */
static void panels_bf16(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* panels, int64_t I, int64_t O,
                        uint16_t* y, int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t I2 = I / 2;
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* panel = panels + p * I * W;
    const int64_t nv = (O - p * W) < W ? (O - p * W) : W;
    for (int64_t m = 0; m < M; m += 8) {
      const int mb = (M - m) < 8 ? (int)(M - m) : 8;
      CHUNKS_BF16[mb](x + m * ldx, ldx, panel, I2, y + m * ldy + p * W, ldy, nv);
    }
  }
}
static void task_bf16(const job_t* j, int64_t p0, int64_t p1) {
  panels_bf16(j->x, j->M, j->ldx, j->panels, j->I, j->O, j->y, j->ldy, p0, p1);
}
void eyas_panel_matmul_bf16(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* panels, int64_t I, int64_t O,
                            uint16_t* y, int64_t ldy, int64_t num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_on && I % 32 == 0) { matmul_amx(x, M, ldx, panels, I, O, y, ldy); return; }
#endif
  job_t j = {task_bf16, x, M, ldx, panels, I, O, y, ldy};
  run_job(&j, (O + W - 1) / W, (int64_t)2 * I * W, num_threads);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* bfloat16 on AVX2 (no vdpbf16ps): the same pair panels. A 32-bit lane holds one output's inputs 2i (low half) and
2i + 1 (high half); a shift and a mask widen them to float32 exactly, and two FMAs per row add them in that order.
Up to 2 rows a pass (their 8 sums, 4 widened inputs and the weights fit AVX2's 16 registers). Each row's sums run
in the same order at any M and any thread count, as above; they differ from vdpbf16ps's in rounding, and a CPU has
one kernel or the other. The weights stream at half float32's bytes. */
#include <immintrin.h>
static inline __attribute__((always_inline)) void chunk_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel,
                                                              int64_t I2, uint16_t* y, int64_t ldy, int mb,
                                                              int64_t nvalid) {
  __m256 acc[2][4];
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  for (int m = 0; m < mb; ++m)
    for (int k = 0; k < 4; ++k) acc[m][k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < I2; ++i) {
    __m256 even[2], odd[2];
    for (int m = 0; m < mb; ++m) {
      uint32_t pair; memcpy(&pair, x + m * ldx + 2 * i, 4);
      even[m] = _mm256_castsi256_ps(_mm256_set1_epi32((int)(pair << 16)));
      odd[m] = _mm256_castsi256_ps(_mm256_set1_epi32((int)(pair & 0xffff0000u)));
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(panel + i * 2 * W + k * 16));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(w, high));
      for (int m = 0; m < mb; ++m) acc[m][k] = _mm256_fmadd_ps(wo, odd[m], _mm256_fmadd_ps(we, even[m], acc[m][k]));
    }
  }
  for (int m = 0; m < mb; ++m) {
    float t[W];
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(t + 8 * k, acc[m][k]);
    for (int64_t j = 0; j < nvalid; ++j) y[m * ldy + j] = to_bf16(t[j]);
  }
}
static void chunk_bf16_1(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t I2, uint16_t* y, int64_t ldy, int64_t nv) { chunk_bf16(x, ldx, p, I2, y, ldy, 1, nv); }
static void chunk_bf16_2(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t I2, uint16_t* y, int64_t ldy, int64_t nv) { chunk_bf16(x, ldx, p, I2, y, ldy, 2, nv); }
static void task_bf16(const job_t* j, int64_t p0, int64_t p1) {
  const uint16_t* x = j->x; uint16_t* y = j->y;
  const uint16_t* panels = j->panels;
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* panel = panels + p * j->I * W;
    const int64_t nv = (j->O - p * W) < W ? (j->O - p * W) : W;
    for (int64_t m = 0; m < j->M; m += 2) {
      if (j->M - m >= 2) chunk_bf16_2(x + m * j->ldx, j->ldx, panel, j->I / 2, y + m * j->ldy + p * W, j->ldy, nv);
      else chunk_bf16_1(x + m * j->ldx, j->ldx, panel, j->I / 2, y + m * j->ldy + p * W, j->ldy, nv);
    }
  }
}
void eyas_panel_matmul_bf16(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* panels, int64_t I, int64_t O,
                            uint16_t* y, int64_t ldy, int64_t num_threads) {
  job_t j = {task_bf16, x, M, ldx, panels, I, O, y, ldy};
  run_job(&j, (O + W - 1) / W, (int64_t)2 * I * W, num_threads);
}
#endif
