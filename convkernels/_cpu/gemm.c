/* Float32 matrix products with the linear layer's epilogue inside the micro-tile, for the NumPy
 * backend's linears (ConvNeXt's MLPs: about 70 % of a CPU encode).
 *
 * Why not OpenBLAS's sgemm: on ConvNeXt-T at batch 1 its calls ran at about 70 GFLOP/s per core
 * where ONNX Runtime's MLAS ran the same products at about 105 (2-core Xeon, 2026-11-29); MLAS
 * keeps its weights packed once, splits small products over N as well as M, and adds bias,
 * activation and residual while a tile is still in registers. This file does the same:
 *
 * - out (M, N) = act(A (M, K) @ w^T + bias) + residual, w (N, K) a linear layer's weight;
 * - w packed once (pack_weight) into panels of NR columns, k-major: panel p holds, for every k,
 *   the NR floats w[p NR .. p NR + NR - 1][k], zeros past N, so a tile's loads are contiguous;
 * - a tile of MR rows x NR columns keeps its MR x NR/16 accumulators in registers over all of K,
 *   broadcasting one A element per row and step; the finished tile goes to a stack scratch in L1,
 *   and the epilogue runs from there into `out`, so `out` is written once;
 * - tiles per ISA, chosen when the module loads: AVX-512 (x86-64-v4) 12 x 32 (24 of 32 zmm),
 *   AVX2 + FMA (x86-64-v3) 6 x 16 (12 of 16 ymm). Elsewhere gemm_panel_width() is 0 and the
 *   backend keeps NumPy's matmul;
 * - work is split in tasks of one row block x a chunk of panels, so a product of few rows (a
 *   7 x 7 stage's 49 tokens) still spreads over the threads.
 *
 * Every element of K is summed in order, one fused multiply-add per step: the result differs from
 * BLAS's (which blocks K) by float32 rounding only. */
#include "vec.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define HAVE_GEMM_TILES 1
#endif

/* ---- packing --------------------------------------------------------------------------------- */

static void pack_panels(const float *w, float *out, Py_ssize_t n, Py_ssize_t k, Py_ssize_t nr)
{
    Py_ssize_t panels = (n + nr - 1) / nr;
#pragma omp parallel for schedule(static) if (n * k > PARALLEL_MIN_WORK)
    for (Py_ssize_t p = 0; p < panels; p++)
        for (Py_ssize_t kk = 0; kk < k; kk++)
            for (Py_ssize_t j = 0; j < nr; j++) {
                Py_ssize_t col = p * nr + j;
                out[(p * k + kk) * nr + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

/* Winograd's transformed weights U = G g G^T, computed and packed into panels in one pass: for a
 * weight laid out (KT, 3, 3, C, O) and G (P x 3), plane q = a P + b's row holds the panels of its
 * (KT C, O) matrix, U[a][b] of (o, t, c) at reduction index t C + c. The same numbers as NumPy's
 * transform (float64, rounded once) followed by pack_panels, without its (P^2, KT C, O) temporaries
 * and per-plane transposes: those made up 4.4 s of an SD-VAE 256 decode's 7 s first call (2-core
 * Xeon, 2026-11-29), against 1.5 s for a steady call. O is the contiguous axis so that a panel's
 * columns are read and written as runs (one (o, c) at a time, 36 scattered stores and 9 strided
 * loads each, ran at 40 ms per 512 x 512 conv, TLB-bound). */
#define WINOGRAD_PACK_MAX_NR 32
CLONES static void winograd_pack(const float *w, const double *g, float *out, Py_ssize_t o_n, Py_ssize_t kt,
                          Py_ssize_t c_n, int p, Py_ssize_t nr)
{
    Py_ssize_t panels = (o_n + nr - 1) / nr, k = kt * c_n, row = panels * k * nr, tap = c_n * o_n;
    /* One thread: two threads faulting in fresh pages side by side ran 7x slower once a few hundred
     * MB were mapped (2-core Xeon VM, transparent huge pages: 180 ms against 24 ms per 512 x 512
     * conv); at load, and about 7 ms of arithmetic per such conv, one thread is enough. */
    for (Py_ssize_t pn = 0; pn < panels; pn++) {
        double tg[8][3][WINOGRAD_PACK_MAX_NR]; /* G along the kernel's columns: tg[b][i] = sum_j G[b][j] g[i][j] */
        Py_ssize_t o0 = pn * nr, cols = o_n - o0 < nr ? o_n - o0 : nr;
        for (Py_ssize_t t = 0; t < kt; t++)
            for (Py_ssize_t c = 0; c < c_n; c++) {
                const float *src = w + t * 9 * tap + c * o_n + o0; /* tap (i, j) at src + (3 i + j) tap */
                for (int b = 0; b < p; b++)
                    for (int i = 0; i < 3; i++) {
                        const float *s0 = src + 3 * i * tap, *s1 = s0 + tap, *s2 = s1 + tap;
                        for (Py_ssize_t j = 0; j < cols; j++)
                            tg[b][i][j] = g[b * 3] * s0[j] + g[b * 3 + 1] * s1[j] + g[b * 3 + 2] * s2[j];
                    }
                float *base = out + (pn * k + t * c_n + c) * nr;
                for (int a = 0; a < p; a++) /* and along its rows */
                    for (int b = 0; b < p; b++) {
                        float *dst = base + (a * p + b) * row;
                        for (Py_ssize_t j = 0; j < cols; j++)
                            dst[j] = (float)(g[a * 3] * tg[b][0][j] + g[a * 3 + 1] * tg[b][1][j] + g[a * 3 + 2] * tg[b][2][j]);
                        for (Py_ssize_t j = cols; j < nr; j++) dst[j] = 0.0f;
                    }
            }
    }
}

/* ---- the epilogue of one finished tile ----------------------------------------------------- */

/* rows x cols of the scratch tile (row stride nr) -> out, with bias, activation and residual; on
 * vectors of W floats (VF, its loads and activation), 16 in the AVX-512 tiles, 8 in the AVX2 ones */
#define DEFINE_TILE_EPILOGUE(NAME, VF, W, LOAD, LOAD_PART, STORE, STORE_PART, ACT)                      \
    INLINE void NAME(const float *t, Py_ssize_t nr, Py_ssize_t rows, Py_ssize_t cols, const float *bias, \
                     const float *res, float *out, Py_ssize_t n, int act)                                \
    {                                                                                                    \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                          \
            const float *tr = t + r * nr;                                                                \
            const float *rr = res ? res + r * n : NULL;                                                  \
            float *o = out + r * n;                                                                      \
            Py_ssize_t c = 0;                                                                            \
            for (; c + W <= cols; c += W) {                                                              \
                VF v = LOAD(tr + c);                                                                     \
                if (bias) v += LOAD(bias + c);                                                           \
                v = ACT(v, act);                                                                         \
                if (rr) v += LOAD(rr + c);                                                               \
                STORE(o + c, v);                                                                         \
            }                                                                                            \
            if (c < cols) { /* the scratch row is whole (nr is a multiple of W); bias and out are not */ \
                Py_ssize_t m = cols - c;                                                                 \
                VF v = LOAD(tr + c);                                                                     \
                if (bias) v += LOAD_PART(bias + c, m);                                                   \
                v = ACT(v, act);                                                                         \
                if (rr) v += LOAD_PART(rr + c, m);                                                       \
                STORE_PART(o + c, v, m);                                                                 \
            }                                                                                            \
        }                                                                                                \
    }

DEFINE_TILE_EPILOGUE(tile_epilogue8, vf8, ACT_VEC, vload8, vload8_part, vstore8, vstore8_part, vact)
DEFINE_TILE_EPILOGUE(tile_epilogue16, vf16, DW_VEC, vload16, vload_part, vstore16, vstore_part, vact16)

#ifdef HAVE_GEMM_TILES
/* all lanes = x (written out: `(vf16){0} + x` costs an add, as -0.0 + 0.0 is not -0.0) */
#define BCAST16(x) ((vf16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x})
#define BCAST8(x) ((vf8){x, x, x, x, x, x, x, x})

/* B's panel rows fetched this many steps of K ahead (past the panel's end it is a harmless hint) */
#ifndef GEMM_PREFETCH_K
#define GEMM_PREFETCH_K 16
#endif

/* One MR x (L NV) tile over all of K into the scratch t (row stride L NV), on vectors V of L floats
 * (one register each: 16-float vectors on AVX2 lived on the stack, 10 GFLOP/s); a: MR rows, stride lda. */
#define DEFINE_TILE(NAME, TARGET, MR, NV, V, L, LOAD, STORE, BCAST)                                   \
    TARGET static void NAME(const float *a, Py_ssize_t lda, const float *bp, Py_ssize_t k, float *t)   \
    {                                                                                                  \
        V acc[MR][NV];                                                                                 \
        for (int r = 0; r < MR; r++)                                                                   \
            for (int j = 0; j < NV; j++) acc[r][j] = (V){0};                                           \
        for (Py_ssize_t kk = 0; kk < k; kk++) {                                                        \
            V b[NV];                                                                                   \
            for (int j = 0; j < NV; j++) {                                                             \
                __builtin_prefetch(bp + (kk + GEMM_PREFETCH_K) * L * NV + L * j);                      \
                b[j] = LOAD(bp + kk * L * NV + L * j);                                                 \
            }                                                                                          \
            for (int r = 0; r < MR; r++) {                                                             \
                float s = a[r * lda + kk];                                                             \
                V av = BCAST(s);                                                                       \
                for (int j = 0; j < NV; j++) acc[r][j] += av * b[j];                                   \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < MR; r++)                                                                   \
            for (int j = 0; j < NV; j++) STORE(t + r * L * NV + L * j, acc[r][j]);                     \
    }

typedef void (*tile_fn)(const float *a, Py_ssize_t lda, const float *bp, Py_ssize_t k, float *t);

/* The whole product for one ISA, for `batch` products at once (Winograd's 16 or 36 planes: one
 * parallel region for all of them instead of one per plane, whose fork and join cost more than a
 * small plane's product on a loaded box; a, bp, out, res advance by sa, sb, m n, m n per product).
 * The larger of A (M x K) and the packed B (K x N) is read once:
 * with more columns than rows, each task takes a chunk of panels and runs every row block on a
 * panel while it is in L2 (ConvNeXt-T's 49 x 3072 x 768: 9.4 MB of panels, which the other order
 * read from L3 once per row block); otherwise a chunk of row blocks and every panel on each. About
 * 16 tasks in all, handed out one at a time, keep two or more threads even; a batch of products
 * splits each product only as far as that needs (36 planes: one task each, each plane's B in L2). The last row
 * block, shorter than MR, takes the tile of its own height (TILES[rows]), not MR rows of padding: at
 * that stage a padded 12-row tile for the 49th row cost 3x the 1-row tile. */
#define GEMM_TASKS 16
typedef struct {
    const float *a, *bp, *bias, *res;
    float *out;
    Py_ssize_t lda, m, k, n, sa, sb, chunk, tasks, outer, inner;
    int act, by_panel;
} gemm_args;

#define DEFINE_GEMM(NAME, TILES, EPILOGUE, TARGET, MR, NR)                                                  \
    TARGET static void NAME##_task(void *ctx, Py_ssize_t job)                                               \
    {                                                                                                       \
        const gemm_args *g = ctx;                                                                           \
        const Py_ssize_t m = g->m, n = g->n, k = g->k, lda = g->lda, nr = NR;                              \
        float t[MR * NR] __attribute__((aligned(64)));                                                      \
        Py_ssize_t bi = job / g->tasks, task = job % g->tasks;                                              \
        const float *ab = g->a + bi * g->sa, *bb = g->bp + bi * g->sb;                                      \
        const float *rb = g->res ? g->res + bi * m * n : NULL;                                              \
        float *ob = g->out + bi * m * n;                                                                    \
        Py_ssize_t o1 = (task + 1) * g->chunk < g->outer ? (task + 1) * g->chunk : g->outer;                \
        for (Py_ssize_t o = task * g->chunk; o < o1; o++)                                                   \
            for (Py_ssize_t i = 0; i < g->inner; i++) {                                                     \
                Py_ssize_t blk = g->by_panel ? i : o, p = g->by_panel ? o : i;                              \
                Py_ssize_t r0 = blk * MR, rows = m - r0 < MR ? m - r0 : MR;                                 \
                Py_ssize_t col = p * nr, cols = n - col < nr ? n - col : nr;                                \
                TILES[rows](ab + r0 * lda, lda, bb + p * k * nr, k, t);                                     \
                EPILOGUE(t, nr, rows, cols, g->bias ? g->bias + col : NULL, rb ? rb + r0 * n + col : NULL,  \
                         ob + r0 * n + col, n, g->act);                                                     \
            }                                                                                               \
    }                                                                                                       \
    static void NAME(const float *a, Py_ssize_t lda, const float *bp, const float *bias, const float *res,  \
                     float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, int act, Py_ssize_t batch,       \
                     Py_ssize_t sa, Py_ssize_t sb)                                                          \
    {                                                                                                       \
        gemm_args g = {a, bp, bias, res, out, lda, m, k, n, sa, sb, 0, 0, 0, 0, act, n > m};                \
        const Py_ssize_t blocks = (m + MR - 1) / MR, panels = (n + NR - 1) / NR;                           \
        g.outer = g.by_panel ? panels : blocks;                                                             \
        g.inner = g.by_panel ? blocks : panels;                                                             \
        const Py_ssize_t want = batch >= GEMM_TASKS ? 1 : (GEMM_TASKS + batch - 1) / batch;              \
        g.chunk = (g.outer + want - 1) / want;                                                              \
        g.tasks = (g.outer + g.chunk - 1) / g.chunk;                                                        \
        if ((double)m * k * n * batch > PARALLEL_MIN_WORK)                                                  \
            ck_pool_run(NAME##_task, &g, g.tasks * batch);                                                  \
        else                                                                                                \
            for (Py_ssize_t job = 0; job < g.tasks * batch; job++) NAME##_task(&g, job);                    \
    }

#define TARGET_V4 __attribute__((target("arch=x86-64-v4")))
#define TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#define TILE_V4(R) DEFINE_TILE(tile_v4_##R, TARGET_V4, R, 2, vf16, 16, vload16, vstore16, BCAST16)
#define TILE_V3(R) DEFINE_TILE(tile_v3_##R, TARGET_V3, R, 2, vf8, 8, vload8, vstore8, BCAST8)
TILE_V4(1) TILE_V4(2) TILE_V4(3) TILE_V4(4) TILE_V4(5) TILE_V4(6)
TILE_V4(7) TILE_V4(8) TILE_V4(9) TILE_V4(10) TILE_V4(11) TILE_V4(12)
TILE_V3(1) TILE_V3(2) TILE_V3(3) TILE_V3(4) TILE_V3(5) TILE_V3(6)
/* by height: tiles_v4[r] is r rows x 32 columns (AVX-512), tiles_v3[r] r rows x 16 (AVX2) */
static const tile_fn tiles_v4[13] = {NULL, tile_v4_1, tile_v4_2, tile_v4_3, tile_v4_4, tile_v4_5, tile_v4_6,
                                     tile_v4_7, tile_v4_8, tile_v4_9, tile_v4_10, tile_v4_11, tile_v4_12};
static const tile_fn tiles_v3[7] = {NULL, tile_v3_1, tile_v3_2, tile_v3_3, tile_v3_4, tile_v3_5, tile_v3_6};
DEFINE_GEMM(gemm_v4, tiles_v4, tile_epilogue16, TARGET_V4, 12, 32)
DEFINE_GEMM(gemm_v3, tiles_v3, tile_epilogue8, TARGET_V3, 6, 16)

/* the product on the tiles its panels were packed for: nr 32 (AVX-512) or 16 (AVX2) */
static void gemm_nr(Py_ssize_t nr, const float *a, Py_ssize_t lda, const float *bp, const float *bias, const float *res,
                    float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, int act, Py_ssize_t batch, Py_ssize_t sa,
                    Py_ssize_t sb)
{
    if (nr == 32)
        gemm_v4(a, lda, bp, bias, res, out, m, k, n, act, batch, sa, sb);
    else
        gemm_v3(a, lda, bp, bias, res, out, m, k, n, act, batch, sa, sb);
}
#endif

/* this CPU runs the tiles of panel width nr: 32 (AVX-512), 16 (AVX2 + FMA) */
static int runs_tiles(Py_ssize_t nr)
{
#ifdef HAVE_GEMM_TILES
    __builtin_cpu_init();
    if (nr == 32) return __builtin_cpu_supports("x86-64-v4");
    if (nr == 16) return __builtin_cpu_supports("x86-64-v3");
#endif
    return 0;
}

/* the panel width of the widest tiles this CPU runs; 0: none (NumPy's matmul stays) */
static Py_ssize_t panel_width(void) { return runs_tiles(32) ? 32 : runs_tiles(16) ? 16 : 0; }

/* ---- Python faces ---------------------------------------------------------------------------- */

PyObject *ck_gemm_panel_width(PyObject *self, PyObject *args) { return PyLong_FromSsize_t(panel_width()); }

PyObject *ck_pack_weight(PyObject *self, PyObject *args)
{
    Py_buffer bf[2];
    Py_ssize_t n, k, nr;
    if (!PyArg_ParseTuple(args, "y*w*nnn", &bf[0], &bf[1], &n, &k, &nr)) return NULL;
    Py_ssize_t panels = nr > 0 ? (n + nr - 1) / nr : 0;
    int bad = n < 1 || k < 1 || nr < 1 || too_small(&bf[0], n * k) || too_small(&bf[1], panels * k * nr);
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        pack_panels(bf[0].buf, bf[1].buf, n, k, nr);
        Py_END_ALLOW_THREADS
    }
    release(bf, 2);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "pack_weight: buffer sizes do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *ck_winograd_pack(PyObject *self, PyObject *args)
{
    Py_buffer bf[3];
    Py_ssize_t o, kt, c, nr;
    int p;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnin", &bf[0], &bf[1], &bf[2], &o, &kt, &c, &p, &nr)) return NULL;
    Py_ssize_t panels = nr > 0 ? (o + nr - 1) / nr : 0;
    int bad = o < 1 || kt < 1 || c < 1 || p < 1 || p > 8 || nr < 1 || nr > WINOGRAD_PACK_MAX_NR || too_small(&bf[0], o * kt * 9 * c) ||
              bf[1].len < (Py_ssize_t)sizeof(double) * p * 3 || too_small(&bf[2], (Py_ssize_t)p * p * panels * kt * c * nr);
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        winograd_pack(bf[0].buf, bf[1].buf, bf[2].buf, o, kt, c, p, nr);
        Py_END_ALLOW_THREADS
    }
    release(bf, 3);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "winograd_pack: buffer sizes do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *ck_gemm(PyObject *self, PyObject *args)
{
    Py_buffer bf[5];
    Py_ssize_t m, k, n, nr, a_offset = 0, lda = -1, batch = 1, sa = 0, sb = -1;
    int has_bias, has_res, act;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*nnnnppi|nnnnn", &bf[0], &bf[1], &bf[2], &bf[3], &bf[4], &m, &k, &n, &nr,
                          &has_bias, &has_res, &act, &a_offset, &lda, &batch, &sa, &sb))
        return NULL;
    if (lda < 0) lda = k;
    Py_ssize_t panels = nr > 0 ? (n + nr - 1) / nr : 0;
    if (sb < 0) sb = panels * k * nr;
    /* batch products: plane i reads A from a_offset + i sa, B from i sb, writes out (and reads the
     * residual) at i m n; the strides must not make planes overlap in what they read */
    int bad = m < 0 || k < 1 || n < 1 || !runs_tiles(nr) || a_offset < 0 || lda < k || batch < 1 ||
              sa < 0 || sb < panels * k * nr || (batch > 1 && m > 0 && sa < 1) ||
              (m > 0 && too_small(&bf[0], a_offset + (batch - 1) * sa + (m - 1) * lda + k)) ||
              too_small(&bf[1], (batch - 1) * sb + panels * k * nr) ||
              (has_bias && too_small(&bf[2], n)) || (has_res && too_small(&bf[3], batch * m * n)) ||
              too_small(&bf[4], batch * m * n) || act < 0 || act > 2;
#ifdef HAVE_GEMM_TILES
    if (!bad) {
        const float *a = (const float *)bf[0].buf + a_offset;
        const float *bias = has_bias ? bf[2].buf : NULL, *res = has_res ? bf[3].buf : NULL;
        Py_BEGIN_ALLOW_THREADS
        gemm_nr(nr, a, lda, bf[1].buf, bias, res, bf[4].buf, m, k, n, act, batch, sa, sb);
        Py_END_ALLOW_THREADS
    }
#endif
    release(bf, 5);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "gemm: buffer sizes, panel width, row stride or activation do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ConvNeXt's block bodies in one call, one block after another: for each block, the fused depthwise
 * conv + LayerNorm, then both products of the MLP (GELU in the first one's tiles, the bias and the
 * block's input added in the second one's), in the order and with the kernels that
 * depthwise_layer_norm and two gemm calls use, so the result is theirs to the bit. Why one call:
 * the Python between calls ran 200-360 us a hand-over after the big kernels had left the caches
 * cold (2-core Xeon, 2026-12-01: 17 ms of a ~100 ms ConvNeXt-T batch-1 encode); a stage's blocks
 * share their shapes, so a stage is one call. The blocks alternate between out and spare, so the
 * last one lands in out; t and hid are the caller's scratch, shared by all blocks. With bf16 set (the
 * backend's opt-in dtype=bfloat16) the products are gemm_bf16.c's on its bfloat16 panels (ck_bf16_mlp:
 * the bits of its gemm_bf16 call a product, the hidden rows handed on in bfloat16), and nr is not read. */
#define DLM_PER_BLOCK 8 /* taps, dw bias, ln weight, ln bias, packed1, b1, packed2, b2 */

static int overlaps(const Py_buffer *a, const Py_buffer *b)
{
    const char *p = a->buf, *q = b->buf;
    return a->len > 0 && b->len > 0 && p < q + b->len && q < p + a->len;
}

PyObject *ck_depthwise_ln_mlp(PyObject *self, PyObject *args)
{
    Py_buffer bf[5];
    PyObject *blocks;
    Py_ssize_t n, h, wd, c, kh, kw, hidden, nr;
    int has_dwb, has_lw, has_lb, act, bf16 = 0;
    float eps;
    if (!PyArg_ParseTuple(args, "y*w*w*w*w*Opppnnnnnnnfin|p", &bf[0], &bf[1], &bf[2], &bf[3], &bf[4], &blocks,
                          &has_dwb, &has_lw, &has_lb, &n, &h, &wd, &c, &kh, &kw, &hidden, &eps, &act, &nr, &bf16))
        return NULL;
    PyObject *seq = PySequence_Fast(blocks, "depthwise_ln_mlp: blocks must be a sequence of 8-tuples");
    Py_ssize_t nb = seq ? PySequence_Fast_GET_SIZE(seq) : 0, got = 0;
    Py_buffer *wb = seq && nb > 0 ? PyMem_Calloc((size_t)nb * DLM_PER_BLOCK, sizeof(Py_buffer)) : NULL;
    if (!seq || (nb > 0 && !wb)) {
        if (seq) PyErr_NoMemory();
        Py_XDECREF(seq);
        release(bf, 5);
        return NULL;
    }
    int parsed = 1;
    for (; got < nb && parsed; got++) {
        Py_buffer *b = wb + got * DLM_PER_BLOCK;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, got);
        parsed = PyTuple_Check(item) && PyArg_ParseTuple(item, "y*y*y*y*y*y*y*y*", &b[0], &b[1], &b[2], &b[3], &b[4],
                                                         &b[5], &b[6], &b[7]);
        if (!parsed && !PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "depthwise_ln_mlp: each block is a tuple of 8 buffers");
    }
    if (!parsed) got--; /* the failed tuple acquired nothing */
    Py_ssize_t rows = n * h * wd;
    Py_ssize_t p1 = nr > 0 ? (hidden + nr - 1) / nr : 0, p2 = nr > 0 ? (c + nr - 1) / nr : 0;
    /* each weight's panels, in floats (bfloat16 ones: two to a float, rounded up) */
    Py_ssize_t size1 = bf16 ? (ck_bf16_panels_size(hidden, c) + 1) / 2 : p1 * c * nr;
    Py_ssize_t size2 = bf16 ? (ck_bf16_panels_size(c, hidden) + 1) / 2 : p2 * hidden * nr;
    int bad = !parsed || nb < 1 || n < 1 || h < 1 || wd < 1 || c < 1 || hidden < 1 || kh < 1 || kh % 2 == 0 ||
              (kw != 3 && kw != 5 && kw != 7) || (bf16 ? !ck_runs_bf16() : !runs_tiles(nr)) || act < 0 || act > 2 ||
              too_small(&bf[0], rows * c) || too_small(&bf[1], rows * c) || (nb > 1 && too_small(&bf[2], rows * c)) ||
              too_small(&bf[3], rows * c) || too_small(&bf[4], rows * hidden) ||
              overlaps(&bf[0], &bf[1]) || (nb > 1 && (overlaps(&bf[0], &bf[2]) || overlaps(&bf[1], &bf[2])));
    for (Py_ssize_t i = 0; i < nb && !bad; i++) {
        Py_buffer *b = wb + i * DLM_PER_BLOCK;
        bad = too_small(&b[0], kh * kw * c) || (has_dwb && too_small(&b[1], c)) || (has_lw && too_small(&b[2], c)) ||
              (has_lb && too_small(&b[3], c)) || too_small(&b[4], size1) || too_small(&b[5], hidden) ||
              too_small(&b[6], size2) || too_small(&b[7], c);
    }
    int failed = 0;
#ifdef HAVE_GEMM_TILES
    if (!bad) {
        float *t = bf[3].buf, *hid = bf[4].buf;
        Py_BEGIN_ALLOW_THREADS
        const float *src = bf[0].buf;
        for (Py_ssize_t i = 0; i < nb && !failed; i++) {
            Py_buffer *b = wb + i * DLM_PER_BLOCK;
            float *dst = (nb - 1 - i) % 2 == 0 ? bf[1].buf : bf[2].buf;
            ck_depthwise_ln(src, b[0].buf, has_dwb ? b[1].buf : NULL, has_lw ? b[2].buf : NULL,
                            has_lb ? b[3].buf : NULL, t, n, h, wd, c, kh, kw, kh / 2, kw / 2, eps, &failed);
            if (!failed && bf16) {
                failed = ck_bf16_mlp(t, c, b[4].buf, b[5].buf, b[6].buf, b[7].buf, src, dst, hid, rows, hidden, act);
            } else if (!failed) {
                gemm_nr(nr, t, c, b[4].buf, b[5].buf, NULL, hid, rows, c, hidden, act, 1, 0, p1 * c * nr);
                gemm_nr(nr, hid, hidden, b[6].buf, b[7].buf, src, dst, rows, hidden, c, 0, 1, 0, p2 * hidden * nr);
            }
            src = dst;
        }
        Py_END_ALLOW_THREADS
    }
#endif
    for (Py_ssize_t i = 0; i < got; i++) release(wb + i * DLM_PER_BLOCK, DLM_PER_BLOCK);
    PyMem_Free(wb);
    Py_DECREF(seq);
    release(bf, 5);
    if (!parsed) return NULL;
    if (bad) {
        PyErr_SetString(PyExc_ValueError,
                        "depthwise_ln_mlp: buffer sizes, kernel, panel width or activation do not match, or out, spare "
                        "and x overlap");
        return NULL;
    }
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
