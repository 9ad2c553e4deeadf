/* eyas.models.panels: x[M, I] @ W^T for a few rows (a decode step, a tree verify) on CPU in float32.

W lies in panels of 32 outputs, [ceil(O/32), I, 32] (zero-padded), so a product streams the weight once, in order,
and keeps each row's 32 sums in registers. Every row's sums run over i in the same order whatever M is: a row's
outputs are bit-identical at any number of rows, so a decode step and a verify compute the same numbers.
Built by panels.py with the host's compiler (-O3 -march=native); GCC's vector extensions give AVX-512 or AVX2. */
#include <stdint.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define W 32
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void st(float* p, v16 v) { memcpy(p, &v, 64); }
static inline __attribute__((always_inline)) void chunk(const float* x, int64_t ldx, const float* panel, int64_t I,
                                                         float* y, int64_t ldy, int mb, int64_t nvalid) {
  v16 acc[8][2];
  for (int m = 0; m < mb; ++m) { acc[m][0] = (v16){0}; acc[m][1] = (v16){0}; }
  for (int64_t i = 0; i < I; ++i) {
    v16 w0 = ld(panel + i * W), w1 = ld(panel + i * W + 16);
    for (int m = 0; m < mb; ++m) { float xv = x[m * ldx + i]; acc[m][0] += w0 * xv; acc[m][1] += w1 * xv; }
  }
  for (int m = 0; m < mb; ++m) {
    if (nvalid == W) { st(y + m * ldy, acc[m][0]); st(y + m * ldy + 16, acc[m][1]); }
    else { float t[W]; st(t, acc[m][0]); st(t + 16, acc[m][1]); memcpy(y + m * ldy, t, nvalid * 4); }
  }
}
#define CHUNK(MB) static void chunk##MB(const float* x, int64_t ldx, const float* p, int64_t I, float* y, int64_t ldy, int64_t nv) { chunk(x, ldx, p, I, y, ldy, MB, nv); }
CHUNK(1) CHUNK(2) CHUNK(3) CHUNK(4) CHUNK(5) CHUNK(6) CHUNK(7) CHUNK(8)
typedef void (*chunk_fn)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
static const chunk_fn CHUNKS[9] = {0, chunk1, chunk2, chunk3, chunk4, chunk5, chunk6, chunk7, chunk8};
/* y[M, O] = x[M, I] @ W^T, W given as panels [ceil(O/32), I, 32] (zero-padded) */
void eyas_panel_matmul(const float* x, int64_t M, int64_t ldx, const float* panels, int64_t I, int64_t O,
                       float* y, int64_t ldy) {
  const int64_t npanel = (O + W - 1) / W;
  for (int64_t p = 0; p < npanel; ++p) {
    const float* panel = panels + p * I * W;
    const int64_t nv = (O - p * W) < W ? (O - p * W) : W;
    for (int64_t m = 0; m < M; m += 8) {
      const int mb = (M - m) < 8 ? (int)(M - m) : 8;
      CHUNKS[mb](x + m * ldx, ldx, panel, I, y + m * ldy + p * W, ldy, nv);
    }
  }
}
