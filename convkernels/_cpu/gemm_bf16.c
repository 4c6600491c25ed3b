/* Linear-layer products with bfloat16 operands and float32 accumulation, for the NumPy backend's
 * opt-in dtype=bfloat16 (convkernels/backends/numpy/bf16.py), on CPUs with AVX-512 BF16.
 *
 * Same contract as gemm.c's float32 tiles: out (M, N) = act(A (M, K) @ w^T + bias) + residual,
 * weights packed once, the epilogue applied to each finished tile from an L1 scratch, `batch`
 * products per call, tasks of row blocks x panel chunks on pool.c's threads. What differs:
 *
 * - vdpbf16ps multiplies pairs of bfloat16 and adds both products to a float32 lane, so the panels
 *   hold, per pair of consecutive k (k odd: the last pair's second half is zero), 32 columns x 2
 *   bfloat16 (two zmm), and A's rows are read as 32-bit pairs broadcast to every lane;
 * - A (float32 in memory, as every activation of the backend) is rounded to bfloat16 once per
 *   call, before the tiles, with round-to-nearest-even (vcvtne2ps2bf16, as PyTorch's cast), into a
 *   scratch of pairs; the weights with the same rounding in C when packed;
 * - the accumulators and everything after the products stay float32: the result is the exact
 *   product of the rounded operands up to float32 rounding of the sums (and the pair's own
 *   internal rounding: vdpbf16ps flushes denormals, which bfloat16 weights and activations of a
 *   network never are in practice).
 *
 * Only the tiles need the instruction set: they are compiled for it with a function attribute and
 * called only where __builtin_cpu_supports("avx512bf16") says so, so the module still builds and
 * loads on every x86-64 (and elsewhere, without them: gemm_bf16_available() is then False). */
#include "vec.h"
#include <stdint.h>
#include <stdlib.h>

/* GCC 12 or later: the oldest we build and check the BF16 intrinsics and the avx512bf16 run-time
 * check with; an older compiler builds the module without these tiles rather than fail the whole
 * (optional) extension */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 12
#define HAVE_BF16_TILES 1
#include <immintrin.h>
#endif

/* columns per panel (two zmm of float32 accumulators per row), rows per full tile (24 of 32 zmm) */
#define BF16_NR 32
#define BF16_MR 12

/* bfloat16 elements in the panels of an (N, K) weight: 32 columns x 2 per k pair, per panel */
Py_ssize_t ck_bf16_panels_size(Py_ssize_t n, Py_ssize_t k)
{
    return n > 0 && k > 0 ? (n + BF16_NR - 1) / BF16_NR * ((k + 1) / 2) * 2 * BF16_NR : 0;
}

/* float32 -> bfloat16, round to nearest even (NaN stays a quiet NaN), as PyTorch rounds */
static inline uint16_t bf16_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* w (N, K) -> panels: for panel p, k pair q, column j: out[((p kp + q) NR + j) 2 + e] =
 * bf16(w[p NR + j][2 q + e]), zeros past N and past K */
static void pack_bf16(const float *w, uint16_t *out, Py_ssize_t n, Py_ssize_t k)
{
    Py_ssize_t panels = (n + BF16_NR - 1) / BF16_NR, kp = (k + 1) / 2;
    for (Py_ssize_t p = 0; p < panels; p++)
        for (Py_ssize_t q = 0; q < kp; q++)
            for (Py_ssize_t j = 0; j < BF16_NR; j++)
                for (int e = 0; e < 2; e++) {
                    Py_ssize_t col = p * BF16_NR + j, kk = 2 * q + e;
                    out[((p * kp + q) * BF16_NR + j) * 2 + e] = col < n && kk < k ? bf16_round(w[col * k + kk]) : 0;
                }
}

#ifdef HAVE_BF16_TILES
#define TARGET_BF16 __attribute__((target("arch=x86-64-v4,avx512bf16")))

/* B's k pairs fetched this many steps ahead (past the panel's end it is a harmless hint) */
#define BF16_PREFETCH_Q 8

/* One R x 32 tile over all k pairs into the scratch t (row stride 32); a: R rows of kp pairs,
 * lda pairs apart */
#define DEFINE_BF16_TILE(R)                                                                               \
    TARGET_BF16 static void tile_bf16_##R(const uint32_t *a, Py_ssize_t lda, const uint16_t *bp,           \
                                          Py_ssize_t kp, float *t)                                        \
    {                                                                                                     \
        __m512 acc[R][2];                                                                                 \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                          \
        for (Py_ssize_t q = 0; q < kp; q++) {                                                             \
            const uint16_t *b = bp + q * 2 * BF16_NR;                                                     \
            __builtin_prefetch(b + BF16_PREFETCH_Q * 2 * BF16_NR);                                        \
            __builtin_prefetch(b + BF16_PREFETCH_Q * 2 * BF16_NR + 32);                                   \
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 32);     \
            for (int r = 0; r < R; r++) {                                                                 \
                __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r * lda + q]);                           \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);                                          \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);                                          \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < R; r++) {                                                                     \
            _mm512_storeu_ps(t + r * BF16_NR, acc[r][0]);                                                 \
            _mm512_storeu_ps(t + r * BF16_NR + 16, acc[r][1]);                                            \
        }                                                                                                 \
    }

DEFINE_BF16_TILE(1) DEFINE_BF16_TILE(2) DEFINE_BF16_TILE(3) DEFINE_BF16_TILE(4)
DEFINE_BF16_TILE(5) DEFINE_BF16_TILE(6) DEFINE_BF16_TILE(7) DEFINE_BF16_TILE(8)
DEFINE_BF16_TILE(9) DEFINE_BF16_TILE(10) DEFINE_BF16_TILE(11) DEFINE_BF16_TILE(12)

typedef void (*bf16_tile_fn)(const uint32_t *a, Py_ssize_t lda, const uint16_t *bp, Py_ssize_t kp, float *t);
/* by height: a last row block shorter than MR takes the tile of its own height (as in gemm.c) */
static const bf16_tile_fn tiles_bf16[BF16_MR + 1] = {
    NULL, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4, tile_bf16_5, tile_bf16_6,
    tile_bf16_7, tile_bf16_8, tile_bf16_9, tile_bf16_10, tile_bf16_11, tile_bf16_12};

/* The finished tile's rows x cols (row stride 32) -> out with bias, activation and residual: the
 * operations of gemm.c's 16-float epilogue (vec.h's vact16), so the two paths differ only in the
 * products */
INLINE void tile_epilogue_bf16(const float *t, Py_ssize_t rows, Py_ssize_t cols, const float *bias,
                               const float *res, float *out, Py_ssize_t n, int act)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *tr = t + r * BF16_NR, *rr = res ? res + r * n : NULL;
        float *o = out + r * n;
        for (Py_ssize_t c = 0; c < cols; c += DW_VEC) {
            Py_ssize_t w = cols - c < DW_VEC ? cols - c : DW_VEC;
            vf16 v = vload16(tr + c); /* the scratch row is whole; bias, residual and out may not be */
            if (bias) v += w == DW_VEC ? vload16(bias + c) : vload_part(bias + c, w);
            v = vact16(v, act);
            if (rr) v += w == DW_VEC ? vload16(rr + c) : vload_part(rr + c, w);
            if (w == DW_VEC) vstore16(o + c, v);
            else vstore_part(o + c, v, w);
        }
    }
}

/* The same epilogue (no residual: a first product's), its result rounded to bfloat16 as the next
 * product's A: rows of n2 (n rounded up to even) bfloat16, the odd n's pad zero. vcvtneps2bf16
 * rounds as convert_task's vcvtne2ps2bf16 does, so the next product reads the bits it would have
 * read from float32 rows converted on their own, without that pass over memory (write 4 bytes an
 * element, read 4, write 2: at batch 8 most of a ConvNeXt stage's hidden rows left the caches) */
TARGET_BF16 INLINE void tile_epilogue_to_bf16(const float *t, Py_ssize_t rows, Py_ssize_t cols, const float *bias,
                                              uint16_t *out, Py_ssize_t n2, int act, int pad)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *tr = t + r * BF16_NR;
        uint16_t *o = out + r * n2;
        for (Py_ssize_t c = 0; c < cols; c += DW_VEC) {
            Py_ssize_t w = cols - c < DW_VEC ? cols - c : DW_VEC;
            vf16 v = vload16(tr + c);
            if (bias) v += w == DW_VEC ? vload16(bias + c) : vload_part(bias + c, w);
            v = vact16(v, act);
            __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
            if (w == DW_VEC) _mm256_storeu_si256((__m256i *)(o + c), h);
            else _mm256_mask_storeu_epi16(o + c, (__mmask16)((1u << w) - 1), h);
        }
        if (pad) o[cols] = 0;
    }
}

/* ---- A's rows rounded to bfloat16 pairs, once per call ---------------------------------------- */

typedef struct {
    const float *a;
    uint32_t *dst;
    Py_ssize_t m, k, kp, lda, sa, rows_per_task, tasks_per_product;
} convert_args;

#define CONVERT_ROWS 64 /* rows per task: handed out as threads finish */

TARGET_BF16 static void convert_task(void *ctx, Py_ssize_t job)
{
    const convert_args *g = ctx;
    Py_ssize_t bi = job / g->tasks_per_product, r0 = (job % g->tasks_per_product) * g->rows_per_task;
    Py_ssize_t r1 = r0 + g->rows_per_task < g->m ? r0 + g->rows_per_task : g->m;
    for (Py_ssize_t r = r0; r < r1; r++) {
        const float *src = g->a + bi * g->sa + r * g->lda;
        uint16_t *dst = (uint16_t *)(g->dst + (bi * g->m + r) * g->kp);
        Py_ssize_t c = 0, k2 = 2 * g->kp;
        for (; c + 32 <= g->k; c += 32) {
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + c + 16), _mm512_loadu_ps(src + c));
            _mm512_storeu_si512(dst + c, (__m512i)v);
        }
        if (c < k2) { /* the row's tail, zeros up to the whole last pair */
            Py_ssize_t left = g->k - c;
            __mmask16 lo = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            __mmask16 hi = left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + c + 16), _mm512_maskz_loadu_ps(lo, src + c));
            _mm512_mask_storeu_epi16(dst + c, (__mmask32)((1ull << (k2 - c)) - 1), (__m512i)v);
        }
    }
}

/* ---- the whole product ------------------------------------------------------------------------ */

#define BF16_TASKS 16
typedef struct {
    const uint32_t *a;
    const uint16_t *bp;
    const float *bias, *res;
    float *out;
    uint16_t *out16; /* set: the output as bfloat16 rows of n2 (tile_epilogue_to_bf16), out not written */
    Py_ssize_t m, kp, n, n2, sb, chunk, tasks, outer, inner;
    int act, by_panel;
} bf16_args;

/* task `job` of product job / tasks: a chunk of panels x every row block (more columns than rows:
 * each panel read once while in L2) or a chunk of row blocks x every panel, as gemm.c splits */
TARGET_BF16 static void gemm_bf16_task(void *ctx, Py_ssize_t job)
{
    const bf16_args *g = ctx;
    const Py_ssize_t m = g->m, n = g->n, kp = g->kp;
    float t[BF16_MR * BF16_NR] __attribute__((aligned(64)));
    Py_ssize_t bi = job / g->tasks, task = job % g->tasks;
    const uint32_t *ab = g->a + bi * m * kp;
    const uint16_t *bb = g->bp + bi * g->sb;
    const float *rb = g->res ? g->res + bi * m * n : NULL;
    float *ob = g->out + bi * m * n;
    Py_ssize_t o1 = (task + 1) * g->chunk < g->outer ? (task + 1) * g->chunk : g->outer;
    for (Py_ssize_t o = task * g->chunk; o < o1; o++)
        for (Py_ssize_t i = 0; i < g->inner; i++) {
            Py_ssize_t blk = g->by_panel ? i : o, p = g->by_panel ? o : i;
            Py_ssize_t r0 = blk * BF16_MR, rows = m - r0 < BF16_MR ? m - r0 : BF16_MR;
            Py_ssize_t col = p * BF16_NR, cols = n - col < BF16_NR ? n - col : BF16_NR;
            tiles_bf16[rows](ab + r0 * kp, kp, bb + p * kp * 2 * BF16_NR, kp, t);
            if (g->out16)
                tile_epilogue_to_bf16(t, rows, cols, g->bias ? g->bias + col : NULL,
                                      g->out16 + (bi * m + r0) * g->n2 + col, g->n2, g->act, col + cols == n && n < g->n2);
            else
                tile_epilogue_bf16(t, rows, cols, g->bias ? g->bias + col : NULL, rb ? rb + r0 * n + col : NULL,
                                   ob + r0 * n + col, n, g->act);
        }
}

/* A's rows (a, lda floats apart, product i at a + i sa) -> bfloat16 pairs at ab (kp a row) */
static void convert_rows(const float *a, Py_ssize_t lda, Py_ssize_t sa, uint32_t *ab, Py_ssize_t m, Py_ssize_t k,
                         Py_ssize_t batch, int parallel)
{
    const Py_ssize_t kp = (k + 1) / 2;
    convert_args c = {a, ab, m, k, kp, lda, sa, CONVERT_ROWS, (m + CONVERT_ROWS - 1) / CONVERT_ROWS};
    if (parallel) ck_pool_run(convert_task, &c, c.tasks_per_product * batch);
    else
        for (Py_ssize_t job = 0; job < c.tasks_per_product * batch; job++) convert_task(&c, job);
}

/* The products on A's pairs (ab, kp a row): out (float32, with residual) or, with out16 set, out16
 * (bfloat16 rows of n rounded up to even, no residual) */
static void gemm_bf16_pairs(const uint32_t *ab, const uint16_t *bp, const float *bias, const float *res,
                            float *out, uint16_t *out16, Py_ssize_t m, Py_ssize_t kp, Py_ssize_t n, int act,
                            Py_ssize_t batch, Py_ssize_t sb, int parallel)
{
    bf16_args g = {ab, bp, bias, res, out, out16, m, kp, n, (n + 1) / 2 * 2, sb, 0, 0, 0, 0, act, n > m};
    const Py_ssize_t blocks = (m + BF16_MR - 1) / BF16_MR, panels = (n + BF16_NR - 1) / BF16_NR;
    g.outer = g.by_panel ? panels : blocks;
    g.inner = g.by_panel ? blocks : panels;
    const Py_ssize_t want = batch >= BF16_TASKS ? 1 : (BF16_TASKS + batch - 1) / batch;
    g.chunk = (g.outer + want - 1) / want;
    g.tasks = (g.outer + g.chunk - 1) / g.chunk;
    if (parallel) ck_pool_run(gemm_bf16_task, &g, g.tasks * batch);
    else
        for (Py_ssize_t job = 0; job < g.tasks * batch; job++) gemm_bf16_task(&g, job);
}

/* 0 on success, -1 where the scratch for A could not be had */
static int gemm_bf16(const float *a, Py_ssize_t lda, const uint16_t *bp, const float *bias, const float *res,
                     float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, int act, Py_ssize_t batch,
                     Py_ssize_t sa, Py_ssize_t sb)
{
    const Py_ssize_t kp = (k + 1) / 2;
    const int parallel = (double)m * k * n * batch > PARALLEL_MIN_WORK;
    uint32_t *ab = malloc(sizeof(uint32_t) * (size_t)(batch * m * kp) + 64);
    if (!ab) return -1;
    convert_rows(a, lda, sa, ab, m, k, batch, parallel);
    gemm_bf16_pairs(ab, bp, bias, res, out, NULL, m, kp, n, act, batch, sb, parallel);
    free(ab);
    return 0;
}
#endif

/* A ConvNeXt block's two products for gemm.c's depthwise_ln_mlp in bfloat16: dst = (act(t @ w1^T + b1)
 * @ w2^T + b2) + res, t (rows, c), the panels p1 (hidden, c) and p2 (c, hidden). Their results are the
 * bits of two gemm_bf16 calls; the hidden rows go from the first product's epilogue to the second as
 * bfloat16 (tile_epilogue_to_bf16), in hid (rows x hidden floats, the caller's), and t's pairs in
 * hid's upper part where they fit there, else in a scratch of their own. 0, or -1 where that scratch
 * could not be had. */
int ck_bf16_mlp(const float *t, Py_ssize_t c, const uint16_t *p1, const float *b1, const uint16_t *p2,
                const float *b2, const float *res, float *dst, float *hid, Py_ssize_t rows, Py_ssize_t hidden, int act)
{
#ifdef HAVE_BF16_TILES
    const Py_ssize_t kc = (c + 1) / 2, kh = (hidden + 1) / 2;
    const int parallel = (double)rows * c * hidden > PARALLEL_MIN_WORK;
    uint32_t *hid_pairs = (uint32_t *)hid, *t_pairs = NULL, *own = NULL;
    if (kh + kc <= hidden) t_pairs = hid_pairs + rows * kh;
    else if (!(t_pairs = own = malloc(sizeof(uint32_t) * (size_t)(rows * kc) + 64))) return -1;
    convert_rows(t, c, 0, t_pairs, rows, c, 1, parallel);
    gemm_bf16_pairs(t_pairs, p1, b1, NULL, NULL, (uint16_t *)hid_pairs, rows, kc, hidden, act, 1, 0, parallel);
    gemm_bf16_pairs(hid_pairs, p2, b2, res, dst, NULL, rows, kh, c, 0, 1, 0, parallel);
    free(own);
    return 0;
#else
    return -1;
#endif
}

/* this CPU runs the tiles: AVX-512 BF16 (Cooper Lake, Sapphire Rapids and later Xeons; Zen 4 and 5) */
int ck_runs_bf16(void)
{
#ifdef HAVE_BF16_TILES
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* ---- Python faces ---------------------------------------------------------------------------- */

INLINE int too_small_u16(Py_buffer *buf, Py_ssize_t count) { return buf->len < (Py_ssize_t)sizeof(uint16_t) * count; }

PyObject *ck_gemm_bf16_available(PyObject *self, PyObject *args) { return PyBool_FromLong(ck_runs_bf16()); }

PyObject *ck_pack_weight_bf16(PyObject *self, PyObject *args)
{
    Py_buffer bf[2];
    Py_ssize_t n, k;
    if (!PyArg_ParseTuple(args, "y*w*nn", &bf[0], &bf[1], &n, &k)) return NULL;
    Py_ssize_t size = ck_bf16_panels_size(n, k);
    int bad = n < 1 || k < 1 || too_small(&bf[0], n * k) || too_small_u16(&bf[1], size);
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        pack_bf16(bf[0].buf, bf[1].buf, n, k);
        Py_END_ALLOW_THREADS
    }
    release(bf, 2);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "pack_weight_bf16: buffer sizes do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *ck_gemm_bf16(PyObject *self, PyObject *args)
{
    Py_buffer bf[5];
    Py_ssize_t m, k, n, a_offset = 0, lda = -1, batch = 1, sa = 0, sb = -1;
    int has_bias, has_res, act, failed = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*nnnppi|nnnnn", &bf[0], &bf[1], &bf[2], &bf[3], &bf[4], &m, &k, &n,
                          &has_bias, &has_res, &act, &a_offset, &lda, &batch, &sa, &sb))
        return NULL;
    if (lda < 0) lda = k;
    Py_ssize_t size = ck_bf16_panels_size(n, k);
    if (sb < 0) sb = size;
    /* as gemm.c's: product i reads A at a_offset + i sa, the panels at i sb (in bfloat16 elements),
     * writes out (and reads the residual) at i m n */
    int bad = m < 0 || k < 1 || n < 1 || !ck_runs_bf16() || a_offset < 0 || lda < k || batch < 1 || sa < 0 ||
              sb < size || (batch > 1 && m > 0 && sa < 1) ||
              (m > 0 && too_small(&bf[0], a_offset + (batch - 1) * sa + (m - 1) * lda + k)) ||
              too_small_u16(&bf[1], (batch - 1) * sb + size) || (has_bias && too_small(&bf[2], n)) ||
              (has_res && too_small(&bf[3], batch * m * n)) || too_small(&bf[4], batch * m * n) || act < 0 || act > 2;
#ifdef HAVE_BF16_TILES
    if (!bad && m > 0) {
        const float *a = (const float *)bf[0].buf + a_offset;
        Py_BEGIN_ALLOW_THREADS
        failed = gemm_bf16(a, lda, bf[1].buf, has_bias ? bf[2].buf : NULL, has_res ? bf[3].buf : NULL, bf[4].buf,
                           m, k, n, act, batch, sa, sb);
        Py_END_ALLOW_THREADS
    }
#endif
    release(bf, 5);
    if (bad) {
        PyErr_SetString(PyExc_ValueError,
                        "gemm_bf16: no AVX-512 BF16 here, or buffer sizes, row stride or activation do not match");
        return NULL;
    }
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
