/* Compiled CPU kernels for the NumPy backend, channels-last float32.
 *
 * NumPy can only express these ops as many full passes over memory: a 7x7 depthwise conv is 49
 * multiply-add sweeps (50-100x behind oneDNN), exact GELU and LayerNorm about 8-30 temporaries.
 * Here each output pixel's channel vector stays in cache across all its work, loops vectorise
 * over channels (target_clones picks AVX-512/AVX2 at load time), rows split across OpenMP
 * threads only when the work is large enough to repay the fork (a busy box otherwise stalls
 * every call), and the GIL is released.
 */
#include "vec.h"
#include <math.h>
#include <stdlib.h>

/* depthwise convs fork only above this: right after a BLAS call OpenBLAS's threads still spin on
 * both cores, and a forked 14x14x384 7x7 conv then took 4.4 ms instead of 0.37 ms on one thread */
#define DEPTHWISE_PARALLEL_MIN_WORK (1LL << 23)

/* output columns sharing each loaded weight vector: OB accumulators stay in registers, so a tap
 * costs OB loads + OB FMAs instead of the load-FMA-store of an accumulator in memory */
#define DW_OB 4

/* One output row, one 16-channel vector, stride 1 and dilation 1 along W, KW a constant after
 * inlining: each kernel row loads the DW_OB + KW - 1 input vectors a block of DW_OB columns
 * touches once (zeros outside the image, so border columns need no other code) and reuses
 * each across its KW taps, instead of one load per tap per column. */
static inline __attribute__((always_inline)) void depthwise_row_s1(
    const float *xb, const float *w, vf16 init, float *orow, Py_ssize_t h, Py_ssize_t wd, Py_ssize_t c,
    Py_ssize_t c0, Py_ssize_t ih0, Py_ssize_t kh, Py_ssize_t dh, Py_ssize_t pw, Py_ssize_t wo, const int KW)
{
    for (Py_ssize_t ow = 0; ow < wo; ow += DW_OB) {
        vf16 acc[DW_OB];
#pragma GCC unroll 8
        for (int k = 0; k < DW_OB; k++) acc[k] = init;
        Py_ssize_t iw0 = ow - pw;
        for (Py_ssize_t i = 0; i < kh; i++) {
            Py_ssize_t ih = ih0 + i * dh;
            if (ih < 0 || ih >= h) continue; /* zero padding contributes nothing */
            const float *xrow = xb + (size_t)ih * wd * c + c0;
            const float *wt = w + (size_t)i * KW * c + c0;
            vf16 xv[DW_OB + 7 - 1];
#pragma GCC unroll 16
            for (int t = 0; t < DW_OB + KW - 1; t++) {
                Py_ssize_t iw = iw0 + t;
                xv[t] = (iw >= 0 && iw < wd) ? vload16(xrow + (size_t)iw * c) : (vf16){0};
            }
#pragma GCC unroll 8
            for (int j = 0; j < KW; j++) {
                vf16 wv = vload16(wt + (size_t)j * c);
#pragma GCC unroll 8
                for (int k = 0; k < DW_OB; k++) acc[k] += xv[k + j] * wv;
            }
        }
        Py_ssize_t n_out = wo - ow < DW_OB ? wo - ow : DW_OB;
        for (int k = 0; k < n_out; k++) vstore16(orow + (size_t)(ow + k) * c + c0, acc[k]);
    }
}

CLONES
static void depthwise_rows(const float *x, const float *w, const float *bias, float *out,
                           Py_ssize_t n, Py_ssize_t h, Py_ssize_t wd, Py_ssize_t c,
                           Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw,
                           Py_ssize_t dh, Py_ssize_t dw, Py_ssize_t ph, Py_ssize_t pw,
                           Py_ssize_t ho, Py_ssize_t wo)
{
    Py_ssize_t rows = n * ho;
    long long work = (long long)rows * wo * c * kh * kw;
    Py_ssize_t c_vec = c - c % DW_VEC;
    /* columns whose every tap lies inside the row: no bounds checks there */
    Py_ssize_t ow_in_lo = (pw + sw - 1) / sw;
    Py_ssize_t last = wd - 1 - (kw - 1) * dw + pw;
    Py_ssize_t ow_in_hi = last < 0 ? -1 : last / sw; /* inclusive */
    if (ow_in_hi > wo - 1) ow_in_hi = wo - 1;
    /* channel vector outermost, output rows inside: one vector's input rows (kh x wd x 64 B) stay
     * in L1 while the rows below reuse them; rows-outermost streamed every row's full channel
     * width through L2 per kernel row and ran ~2x slower at 14x14x384. Rows split into chunks
     * too, so a layer with few channel vectors still fills the threads. */
    Py_ssize_t n_vec = c_vec / DW_VEC;
    Py_ssize_t chunks = n_vec >= 8 ? 1 : (n_vec >= 2 ? 4 : 8);
    if (chunks > rows) chunks = rows;
    Py_ssize_t chunk_rows = chunks ? (rows + chunks - 1) / chunks : 0;
#pragma omp parallel for collapse(2) schedule(static) if (work > DEPTHWISE_PARALLEL_MIN_WORK)
    for (Py_ssize_t cv = 0; cv < n_vec; cv++) {
        for (Py_ssize_t chunk = 0; chunk < chunks; chunk++) {
            Py_ssize_t c0 = cv * DW_VEC;
            vf16 init = bias ? vload16(bias + c0) : (vf16){0};
            Py_ssize_t r_end = (chunk + 1) * chunk_rows < rows ? (chunk + 1) * chunk_rows : rows;
            for (Py_ssize_t r = chunk * chunk_rows; r < r_end; r++) {
                Py_ssize_t b = r / ho, oh = r % ho;
                const float *xb = x + (size_t)b * h * wd * c;
                float *orow = out + ((size_t)b * ho + oh) * wo * c;
                Py_ssize_t ih0 = oh * sh - ph;
                if (sw == 1 && dw == 1 && (kw == 7 || kw == 5 || kw == 3)) {
                    if (kw == 7) depthwise_row_s1(xb, w, init, orow, h, wd, c, c0, ih0, kh, dh, pw, wo, 7);
                    else if (kw == 5) depthwise_row_s1(xb, w, init, orow, h, wd, c, c0, ih0, kh, dh, pw, wo, 5);
                    else depthwise_row_s1(xb, w, init, orow, h, wd, c, c0, ih0, kh, dh, pw, wo, 3);
                    continue;
                }
                Py_ssize_t ow = 0;
                while (ow < wo) {
                    if (ow >= ow_in_lo && ow + DW_OB - 1 <= ow_in_hi) {
                        vf16 acc[DW_OB];
                        for (int k = 0; k < DW_OB; k++) acc[k] = init;
                        for (Py_ssize_t i = 0; i < kh; i++) {
                            Py_ssize_t ih = ih0 + i * dh;
                            if (ih < 0 || ih >= h) continue; /* zero padding contributes nothing */
                            const float *xp = xb + ((size_t)ih * wd + ow * sw - pw) * c + c0;
                            const float *wt = w + (size_t)i * kw * c + c0;
                            for (Py_ssize_t j = 0; j < kw; j++) {
                                vf16 wv = vload16(wt + (size_t)j * c);
                                const float *xj = xp + (size_t)j * dw * c;
                                for (int k = 0; k < DW_OB; k++) acc[k] += vload16(xj + (size_t)k * sw * c) * wv;
                            }
                        }
                        for (int k = 0; k < DW_OB; k++) vstore16(orow + (size_t)(ow + k) * c + c0, acc[k]);
                        ow += DW_OB;
                    } else {
                        vf16 acc = init;
                        Py_ssize_t iw0 = ow * sw - pw;
                        for (Py_ssize_t i = 0; i < kh; i++) {
                            Py_ssize_t ih = ih0 + i * dh;
                            if (ih < 0 || ih >= h) continue;
                            const float *xrow = xb + (size_t)ih * wd * c + c0;
                            const float *wt = w + (size_t)i * kw * c + c0;
                            for (Py_ssize_t j = 0; j < kw; j++) {
                                Py_ssize_t iw = iw0 + j * dw;
                                if (iw < 0 || iw >= wd) continue;
                                acc += vload16(xrow + (size_t)iw * c) * vload16(wt + (size_t)j * c);
                            }
                        }
                        vstore16(orow + (size_t)ow * c + c0, acc);
                        ow++;
                    }
                }
            }
        }
    }
    if (c_vec == c) return;
    /* channels past the last full vector: one at a time */
#pragma omp parallel for schedule(static) if ((long long)rows * wo * (c - c_vec) * kh * kw > DEPTHWISE_PARALLEL_MIN_WORK)
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t b = r / ho, oh = r % ho;
        const float *xb = x + (size_t)b * h * wd * c;
        float *orow = out + ((size_t)b * ho + oh) * wo * c;
        Py_ssize_t ih0 = oh * sh - ph;
        for (Py_ssize_t ow = 0; ow < wo; ow++) {
            float *acc = orow + (size_t)ow * c;
            for (Py_ssize_t ch = c_vec; ch < c; ch++) acc[ch] = bias ? bias[ch] : 0.0f;
            Py_ssize_t iw0 = ow * sw - pw;
            for (Py_ssize_t i = 0; i < kh; i++) {
                Py_ssize_t ih = ih0 + i * dh;
                if (ih < 0 || ih >= h) continue;
                const float *xrow = xb + (size_t)ih * wd * c;
                for (Py_ssize_t j = 0; j < kw; j++) {
                    Py_ssize_t iw = iw0 + j * dw;
                    if (iw < 0 || iw >= wd) continue;
                    const float *xp = xrow + (size_t)iw * c;
                    const float *wt = w + (size_t)(i * kw + j) * c;
                    for (Py_ssize_t ch = c_vec; ch < c; ch++) acc[ch] += xp[ch] * wt[ch];
                }
            }
        }
    }
}


/* Output rows [r0, r1) of one image's stride-1, dilation-1 depthwise conv with KW of 3, 5 or 7
 * (the caller checks), into out laid out (r1 - r0, Wo, C): the fused depthwise + LayerNorm of
 * norms.c convolves a block of rows into a cache-resident buffer with it. Channel vector
 * outermost within the block, as in depthwise_rows, so a vector's input rows stay in L1. */
CLONES
void ck_depthwise_rows_s1(const float *x, const float *w, const float *bias, float *out, Py_ssize_t h,
                          Py_ssize_t wd, Py_ssize_t c, Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t ph,
                          Py_ssize_t pw, Py_ssize_t r0, Py_ssize_t r1)
{
    Py_ssize_t wo = wd + 2 * pw - kw + 1;
    Py_ssize_t c_vec = c - c % DW_VEC;
    for (Py_ssize_t c0 = 0; c0 < c_vec; c0 += DW_VEC) {
        vf16 init = bias ? vload16(bias + c0) : (vf16){0};
        for (Py_ssize_t r = r0; r < r1; r++) {
            float *orow = out + (size_t)(r - r0) * wo * c;
            if (kw == 7) depthwise_row_s1(x, w, init, orow, h, wd, c, c0, r - ph, kh, 1, pw, wo, 7);
            else if (kw == 5) depthwise_row_s1(x, w, init, orow, h, wd, c, c0, r - ph, kh, 1, pw, wo, 5);
            else depthwise_row_s1(x, w, init, orow, h, wd, c, c0, r - ph, kh, 1, pw, wo, 3);
        }
    }
    if (c_vec == c) return;
    for (Py_ssize_t r = r0; r < r1; r++) { /* channels past the last full vector: one at a time */
        float *orow = out + (size_t)(r - r0) * wo * c;
        for (Py_ssize_t ow = 0; ow < wo; ow++) {
            float *acc = orow + (size_t)ow * c;
            for (Py_ssize_t ch = c_vec; ch < c; ch++) acc[ch] = bias ? bias[ch] : 0.0f;
            for (Py_ssize_t i = 0; i < kh; i++) {
                Py_ssize_t ih = r - ph + i;
                if (ih < 0 || ih >= h) continue;
                for (Py_ssize_t j = 0; j < kw; j++) {
                    Py_ssize_t iw = ow - pw + j;
                    if (iw < 0 || iw >= wd) continue;
                    const float *xp = x + ((size_t)ih * wd + iw) * c;
                    const float *wt = w + (size_t)(i * kw + j) * c;
                    for (Py_ssize_t ch = c_vec; ch < c; ch++) acc[ch] += xp[ch] * wt[ch];
                }
            }
        }
    }
}

static PyObject *depthwise2d(PyObject *self, PyObject *args)
{
    Py_buffer bf[4];
    Py_ssize_t n, h, wd, c, kh, kw, sh, sw, dh, dw, ph, pw, ho, wo;
    int has_bias;
    if (!PyArg_ParseTuple(args, "y*y*y*w*pnnnnnnnnnnnnnn", &bf[0], &bf[1], &bf[2], &bf[3], &has_bias,
                          &n, &h, &wd, &c, &kh, &kw, &sh, &sw, &dh, &dw, &ph, &pw, &ho, &wo))
        return NULL;
    int bad = too_small(&bf[0], n * h * wd * c) || too_small(&bf[1], kh * kw * c) ||
              too_small(&bf[3], n * ho * wo * c) || (has_bias && too_small(&bf[2], c));
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        depthwise_rows(bf[0].buf, bf[1].buf, has_bias ? bf[2].buf : NULL, bf[3].buf,
                       n, h, wd, c, kh, kw, sh, sw, dh, dw, ph, pw, ho, wo);
        Py_END_ALLOW_THREADS
    }
    release(bf, 4);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "depthwise2d: buffer sizes do not match the geometry");
        return NULL;
    }
    Py_RETURN_NONE;
}


/* Winograd F(2x2, 3x3) transforms for the NumPy backend's winograd_f2x3 path; the 16 gemms
 * between them stay in BLAS. In NumPy the transforms were a dozen strided passes per tile row and
 * cost more than the gemms they saved. Input: one image (H, W, C), zero padding implied by the
 * tile origin; V is (16, P, C) for tile rows [r0, r1). Output: M (16, P, O) -> out (Ho, Wo, O). */
/* B^T d B on 16 channels at once; the scalar loops below do the channel tail. GCC does not
 * vectorise the scalar form (16 gathered row pointers), and scalar transforms took 75-105 ms
 * of a 190 ms 3x3 128ch 256x256 conv on 2 EPYC cores */
/* tiles per task of the transforms: handed out as threads finish (pool.c), not split in equal
 * halves up front, so a thread whose core another process holds for a moment delays no one;
 * 16 tiles of 128 channels are ~15 us of work */
#define WINOGRAD_CHUNK 16

static inline __attribute__((always_inline)) void winograd_in16(const float *const d[16], Py_ssize_t ch,
                                                                 float *vp, size_t stride)
{
    vf16 t[16];
    for (int j = 0; j < 4; j++) {
        vf16 d0 = vload16(d[j] + ch), d1 = vload16(d[4 + j] + ch);
        vf16 d2 = vload16(d[8 + j] + ch), d3 = vload16(d[12 + j] + ch);
        t[j] = d0 - d2; t[4 + j] = d1 + d2; t[8 + j] = d2 - d1; t[12 + j] = d1 - d3;
    }
    for (int a = 0; a < 4; a++) {
        vf16 t0 = t[a * 4], t1 = t[a * 4 + 1], t2 = t[a * 4 + 2], t3 = t[a * 4 + 3];
        vstore16(vp + (a * 4 + 0) * stride + ch, t0 - t2);
        vstore16(vp + (a * 4 + 1) * stride + ch, t1 + t2);
        vstore16(vp + (a * 4 + 2) * stride + ch, t2 - t1);
        vstore16(vp + (a * 4 + 3) * stride + ch, t1 - t3);
    }
}

/* d[i * n + j] = the channel vector of input pixel (top + i, left + j) of an n x n Winograd tile,
 * or `zeros` where the tile hangs over the (implicitly zero-padded) border */
static inline __attribute__((always_inline)) void tile_pixels(const float **d, int n, const float *x,
                                                               const float *zeros, Py_ssize_t h, Py_ssize_t w,
                                                               Py_ssize_t c, Py_ssize_t top, Py_ssize_t left)
{
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            Py_ssize_t ih = top + i, iw = left + j;
            d[i * n + j] = (ih >= 0 && ih < h && iw >= 0 && iw < w) ? x + ((size_t)ih * w + iw) * c : zeros;
        }
}

CLONES
static void winograd_in(const float *x, float *v, const float *zeros, Py_ssize_t h, Py_ssize_t w, Py_ssize_t c,
                        Py_ssize_t tw, Py_ssize_t pt, Py_ssize_t pl, Py_ssize_t r0, Py_ssize_t r1,
                        size_t pstride, size_t stride, Py_ssize_t p0, Py_ssize_t p1)
{
    for (Py_ssize_t p = p0; p < p1; p++) {
        Py_ssize_t ti = r0 + p / tw, tj = p % tw;
        const float *d[16];
        tile_pixels(d, 4, x, zeros, h, w, c, 2 * ti - pt, 2 * tj - pl);
        float *vp = v + (size_t)p * pstride;
        Py_ssize_t ch = 0;
        for (; ch + DW_VEC <= c; ch += DW_VEC) winograd_in16(d, ch, vp, stride);
        for (; ch < c; ch++) {
            float t[16];
            for (int j = 0; j < 4; j++) { /* B^T d */
                float d0 = d[j][ch], d1 = d[4 + j][ch], d2 = d[8 + j][ch], d3 = d[12 + j][ch];
                t[j] = d0 - d2; t[4 + j] = d1 + d2; t[8 + j] = d2 - d1; t[12 + j] = d1 - d3;
            }
            for (int a = 0; a < 4; a++) { /* (B^T d) B */
                float t0 = t[a * 4], t1 = t[a * 4 + 1], t2 = t[a * 4 + 2], t3 = t[a * 4 + 3];
                vp[(a * 4 + 0) * stride + ch] = t0 - t2;
                vp[(a * 4 + 1) * stride + ch] = t1 + t2;
                vp[(a * 4 + 2) * stride + ch] = t2 - t1;
                vp[(a * 4 + 3) * stride + ch] = t1 - t3;
            }
        }
    }
}

/* A^T m A on 16 channels: the 2x2 outputs of one tile, y[0..3] = (0,0) (0,1) (1,0) (1,1) */
static inline __attribute__((always_inline)) void winograd_out16(const float *mp, size_t stride, Py_ssize_t ch,
                                                                  vf16 y[4])
{
    vf16 t[8];
    for (int b = 0; b < 4; b++) {
        vf16 m0 = vload16(mp + (0 + b) * stride + ch), m1 = vload16(mp + (4 + b) * stride + ch);
        vf16 m2 = vload16(mp + (8 + b) * stride + ch), m3 = vload16(mp + (12 + b) * stride + ch);
        t[b] = m0 + m1 + m2;
        t[4 + b] = m1 - m2 - m3;
    }
    for (int i = 0; i < 2; i++) {
        y[i * 2] = t[i * 4] + t[i * 4 + 1] + t[i * 4 + 2];
        y[i * 2 + 1] = t[i * 4 + 1] - t[i * 4 + 2] - t[i * 4 + 3];
    }
}

CLONES
static void winograd_out(const float *m, float *out, Py_ssize_t ho, Py_ssize_t wo, Py_ssize_t o,
                         Py_ssize_t tw, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t p0, Py_ssize_t p1)
{
    Py_ssize_t p_count = (r1 - r0) * tw;
    size_t stride = (size_t)p_count * o;
    for (Py_ssize_t p = p0; p < p1; p++) {
        Py_ssize_t ti = r0 + p / tw, tj = p % tw;
        const float *mp = m + (size_t)p * o;
        Py_ssize_t oh = 2 * ti, ow = 2 * tj;
        int h2 = oh + 1 < ho, w2 = ow + 1 < wo;
        float *y00 = out + ((size_t)oh * wo + ow) * o;
        Py_ssize_t ch = 0;
        for (; ch + DW_VEC <= o; ch += DW_VEC) {
            vf16 y[4];
            winograd_out16(mp, stride, ch, y);
            vstore16(y00 + ch, y[0]);
            if (w2) vstore16(y00 + o + ch, y[1]);
            if (h2) {
                vstore16(y00 + (size_t)wo * o + ch, y[2]);
                if (w2) vstore16(y00 + (size_t)wo * o + o + ch, y[3]);
            }
        }
        for (; ch < o; ch++) {
            float t[8];
            for (int b = 0; b < 4; b++) { /* A^T m */
                float m0 = mp[(0 + b) * stride + ch], m1 = mp[(4 + b) * stride + ch];
                float m2 = mp[(8 + b) * stride + ch], m3 = mp[(12 + b) * stride + ch];
                t[b] = m0 + m1 + m2;
                t[4 + b] = m1 - m2 - m3;
            }
            float y[4];
            for (int i = 0; i < 2; i++) { /* (A^T m) A */
                y[i * 2] = t[i * 4] + t[i * 4 + 1] + t[i * 4 + 2];
                y[i * 2 + 1] = t[i * 4 + 1] - t[i * 4 + 2] - t[i * 4 + 3];
            }
            y00[ch] = y[0];
            if (w2) y00[o + ch] = y[1];
            if (h2) {
                y00[(size_t)wo * o + ch] = y[2];
                if (w2) y00[(size_t)wo * o + o + ch] = y[3];
            }
        }
    }
}

/* Winograd F(4x4, 3x3) (points 0, +-1, +-2): 36 planes per 6x6 input tile, 4x4 outputs per tile,
 * 2.25 multiplies per output against F(2x2, 3x3)'s 4, at ~20x the rounding error of a direct conv
 * (fp32 relative L2 ~2e-6 at 512 channels). The bodies are written once for a 16-channel vector
 * and once for the scalar channel tail (GCC's vector extension takes the same expressions). */
#define WINO4_IN(T, LD, ST)                                                                               \
    do {                                                                                                  \
        T t_[36];                                                                                         \
        for (int j = 0; j < 6; j++) { /* B^T d, column j */                                               \
            T d0 = LD(d[j] + ch), d1 = LD(d[6 + j] + ch), d2 = LD(d[12 + j] + ch);                        \
            T d3 = LD(d[18 + j] + ch), d4 = LD(d[24 + j] + ch), d5 = LD(d[30 + j] + ch);                  \
            t_[j] = 4.0f * d0 - 5.0f * d2 + d4;                                                           \
            t_[6 + j] = d3 + d4 - 4.0f * (d1 + d2);                                                       \
            t_[12 + j] = 4.0f * (d1 - d2) + d4 - d3;                                                      \
            t_[18 + j] = 2.0f * (d3 - d1) + d4 - d2;                                                      \
            t_[24 + j] = 2.0f * (d1 - d3) + d4 - d2;                                                      \
            t_[30 + j] = 4.0f * d1 - 5.0f * d3 + d5;                                                      \
        }                                                                                                 \
        for (int a = 0; a < 6; a++) { /* (B^T d) B, row a */                                              \
            T e0 = t_[a * 6], e1 = t_[a * 6 + 1], e2 = t_[a * 6 + 2];                                     \
            T e3 = t_[a * 6 + 3], e4 = t_[a * 6 + 4], e5 = t_[a * 6 + 5];                                 \
            ST(vp + (a * 6 + 0) * stride + ch, 4.0f * e0 - 5.0f * e2 + e4);                               \
            ST(vp + (a * 6 + 1) * stride + ch, e3 + e4 - 4.0f * (e1 + e2));                               \
            ST(vp + (a * 6 + 2) * stride + ch, 4.0f * (e1 - e2) + e4 - e3);                               \
            ST(vp + (a * 6 + 3) * stride + ch, 2.0f * (e3 - e1) + e4 - e2);                               \
            ST(vp + (a * 6 + 4) * stride + ch, 2.0f * (e1 - e3) + e4 - e2);                               \
            ST(vp + (a * 6 + 5) * stride + ch, 4.0f * e1 - 5.0f * e3 + e5);                               \
        }                                                                                                 \
    } while (0)

#define WINO4_OUT(T, LD, ST)                                                                              \
    do {                                                                                                  \
        T s_[24];                                                                                         \
        for (int b = 0; b < 6; b++) { /* A^T m, column b */                                               \
            T m0 = LD(mp + (0 + b) * stride + ch), m1 = LD(mp + (6 + b) * stride + ch);                   \
            T m2 = LD(mp + (12 + b) * stride + ch), m3 = LD(mp + (18 + b) * stride + ch);                 \
            T m4 = LD(mp + (24 + b) * stride + ch), m5 = LD(mp + (30 + b) * stride + ch);                 \
            s_[b] = m0 + m1 + m2 + m3 + m4;                                                               \
            s_[6 + b] = m1 - m2 + 2.0f * (m3 - m4);                                                       \
            s_[12 + b] = m1 + m2 + 4.0f * (m3 + m4);                                                      \
            s_[18 + b] = m1 - m2 + 8.0f * (m3 - m4) + m5;                                                 \
        }                                                                                                 \
        for (int i = 0; i < 4 && oh + i < ho; i++) { /* (A^T m) A, row i */                               \
            T e0 = s_[i * 6], e1 = s_[i * 6 + 1], e2 = s_[i * 6 + 2];                                     \
            T e3 = s_[i * 6 + 3], e4 = s_[i * 6 + 4], e5 = s_[i * 6 + 5];                                 \
            T y_[4] = {e0 + e1 + e2 + e3 + e4, e1 - e2 + 2.0f * (e3 - e4), e1 + e2 + 4.0f * (e3 + e4),    \
                       e1 - e2 + 8.0f * (e3 - e4) + e5};                                                  \
            float *row = out + ((size_t)(oh + i) * wo + ow) * o + ch;                                     \
            for (int j = 0; j < 4 && ow + j < wo; j++) ST(row + (size_t)j * o, y_[j]);                    \
        }                                                                                                 \
    } while (0)

#define SCALAR_LD(p) (*(p))
#define SCALAR_ST(p, v) (*(p) = (v))

CLONES
static void winograd4_in(const float *x, float *v, const float *zeros, Py_ssize_t h, Py_ssize_t w, Py_ssize_t c,
                         Py_ssize_t tw, Py_ssize_t pt, Py_ssize_t pl, Py_ssize_t r0, Py_ssize_t r1,
                         size_t pstride, size_t stride, Py_ssize_t p0, Py_ssize_t p1)
{
    for (Py_ssize_t p = p0; p < p1; p++) {
        Py_ssize_t ti = r0 + p / tw, tj = p % tw;
        const float *d[36];
        tile_pixels(d, 6, x, zeros, h, w, c, 4 * ti - pt, 4 * tj - pl);
        float *vp = v + (size_t)p * pstride;
        Py_ssize_t ch = 0;
        for (; ch + DW_VEC <= c; ch += DW_VEC) WINO4_IN(vf16, vload16, vstore16);
        for (; ch < c; ch++) WINO4_IN(float, SCALAR_LD, SCALAR_ST);
    }
}

CLONES
static void winograd4_out(const float *m, float *out, Py_ssize_t ho, Py_ssize_t wo, Py_ssize_t o,
                          Py_ssize_t tw, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t p0, Py_ssize_t p1)
{
    Py_ssize_t p_count = (r1 - r0) * tw;
    size_t stride = (size_t)p_count * o;
    for (Py_ssize_t p = p0; p < p1; p++) {
        Py_ssize_t oh = 4 * (r0 + p / tw), ow = 4 * (p % tw);
        const float *mp = m + (size_t)p * o;
        Py_ssize_t ch = 0;
        for (; ch + DW_VEC <= o; ch += DW_VEC) WINO4_OUT(vf16, vload16, vstore16);
        for (; ch < o; ch++) WINO4_OUT(float, SCALAR_LD, SCALAR_ST);
    }
}

typedef void (*winograd_in_fn)(const float *, float *, const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                               Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, size_t, size_t, Py_ssize_t,
                               Py_ssize_t);
typedef void (*winograd_out_fn)(const float *, float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                                Py_ssize_t, Py_ssize_t, Py_ssize_t);

/* A transform's tiles in chunks of WINOGRAD_CHUNK on pool.c's threads (a late thread is not
 * waited for), one thread below PARALLEL_MIN_WORK */
typedef struct {
    winograd_in_fn in;
    winograd_out_fn out;
    const float *src, *zeros;
    float *dst;
    Py_ssize_t h, w, c, tw, pt, pl, r0, r1, p_count;
    size_t pstride, plane;
} winograd_job;

static void winograd_task(void *ctx, Py_ssize_t task)
{
    const winograd_job *j = ctx;
    Py_ssize_t p0 = task * WINOGRAD_CHUNK, p1 = p0 + WINOGRAD_CHUNK < j->p_count ? p0 + WINOGRAD_CHUNK : j->p_count;
    if (j->in)
        j->in(j->src, j->dst, j->zeros, j->h, j->w, j->c, j->tw, j->pt, j->pl, j->r0, j->r1, j->pstride, j->plane, p0,
              p1);
    else
        j->out(j->src, j->dst, j->h, j->w, j->c, j->tw, j->r0, j->r1, p0, p1);
}

static void winograd_run(const winograd_job *j, long long work)
{
    Py_ssize_t tasks = (j->p_count + WINOGRAD_CHUNK - 1) / WINOGRAD_CHUNK;
    if (work > PARALLEL_MIN_WORK)
        ck_pool_run(winograd_task, (void *)j, tasks);
    else
        for (Py_ssize_t t = 0; t < tasks; t++) winograd_task((void *)j, t);
}

/* The Python face of an input transform with `planes` planes: V is (planes, P, C) by default; a
 * caller interleaving several frames' transforms passes the distance between tiles (pstride) and
 * between planes (plane), in floats. */
static PyObject *winograd_input_call(PyObject *args, const char *name, int planes, winograd_in_fn fn)
{
    Py_buffer bf[3];
    Py_ssize_t h, w, c, tw, pt, pl, r0, r1, pstride = -1, plane = -1;
    if (!PyArg_ParseTuple(args, "y*w*y*nnnnnnnn|nn", &bf[0], &bf[1], &bf[2], &h, &w, &c, &tw, &pt, &pl, &r0, &r1,
                          &pstride, &plane))
        return NULL;
    Py_ssize_t p_count = (r1 - r0) * tw;
    if (pstride < 0) pstride = c;
    if (plane < 0) plane = p_count * c;
    int bad = r0 < 0 || r1 < r0 || pstride < c || too_small(&bf[0], h * w * c) || too_small(&bf[2], c) ||
              (p_count > 0 && too_small(&bf[1], (planes - 1) * plane + (p_count - 1) * pstride + c));
    if (!bad) {
        winograd_job j = {fn, NULL, bf[0].buf, bf[2].buf, bf[1].buf, h, w, c, tw, pt, pl, r0, r1, p_count,
                          (size_t)pstride, (size_t)plane};
        Py_BEGIN_ALLOW_THREADS
        winograd_run(&j, (long long)p_count * c * planes);
        Py_END_ALLOW_THREADS
    }
    release(bf, 3);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "%s: buffer sizes do not match", name);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The Python face of an output transform: M (planes, P, O) -> out (Ho, Wo, O), tiles of m x m. */
static PyObject *winograd_output_call(PyObject *args, const char *name, int planes, int m, winograd_out_fn fn)
{
    Py_buffer bf[2];
    Py_ssize_t ho, wo, o, tw, r0, r1;
    if (!PyArg_ParseTuple(args, "y*w*nnnnnn", &bf[0], &bf[1], &ho, &wo, &o, &tw, &r0, &r1)) return NULL;
    int bad = too_small(&bf[0], planes * (r1 - r0) * tw * o) || too_small(&bf[1], ho * wo * o) || r0 < 0 ||
              r1 < r0 || m * (r1 - 1) >= ho || m * (tw - 1) >= wo;
    if (!bad) {
        Py_ssize_t p_count = (r1 - r0) * tw;
        winograd_job j = {NULL, fn, bf[0].buf, NULL, bf[1].buf, ho, wo, o, tw, 0, 0, r0, r1, p_count, 0, 0};
        Py_BEGIN_ALLOW_THREADS
        winograd_run(&j, (long long)p_count * o * planes);
        Py_END_ALLOW_THREADS
    }
    release(bf, 2);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "%s: buffer sizes do not match", name);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *winograd_input(PyObject *self, PyObject *args)
{
    return winograd_input_call(args, "winograd_input", 16, winograd_in);
}

static PyObject *winograd_output(PyObject *self, PyObject *args)
{
    return winograd_output_call(args, "winograd_output", 16, 2, winograd_out);
}

static PyObject *winograd4_input(PyObject *self, PyObject *args)
{
    return winograd_input_call(args, "winograd4_input", 36, winograd4_in);
}

static PyObject *winograd4_output(PyObject *self, PyObject *args)
{
    return winograd_output_call(args, "winograd4_output", 36, 4, winograd4_out);
}

static PyMethodDef methods[] = {
    {"depthwise2d", depthwise2d, METH_VARARGS,
     "depthwise2d(x, w_taps_c, bias, out, has_bias, n, h, w, c, kh, kw, sh, sw, dh, dw, ph, pw, ho, wo)"},
    {"bias_gelu", ck_bias_gelu, METH_VARARGS, "bias_gelu(x, bias, out, has_bias, rows, c): exact-erf GELU(x + bias)"},
    {"epilogue", ck_epilogue, METH_VARARGS,
     "epilogue(x, bias, residual, out, has_bias, has_residual, rows, c, act): act(x + bias) + residual, "
     "act 0 none, 1 silu, 2 gelu; out may be x"},
    {"layer_norm", ck_layer_norm, METH_VARARGS, "layer_norm(x, w, b, out, has_w, has_b, rows, c, eps)"},
    {"rms_norm", ck_rms_norm, METH_VARARGS,
     "rms_norm(x, w, b, res, out, has_w, has_b, has_r, rows, c, eps, act): act(x * w / sqrt(mean(x^2) + eps) + b)"
     " + res over rows of c"},
    {"depthwise_layer_norm", ck_depthwise_layer_norm, METH_VARARGS,
     "depthwise_layer_norm(x, taps, dw_bias, ln_w, ln_b, out, has_bias, has_w, has_b, n, h, w, c, kh, kw, eps): "
     "LayerNorm(depthwise 'same' conv + bias), kw 3, 5 or 7"},
    {"winograd_input", winograd_input, METH_VARARGS, "winograd_input(x_hwc, v, zeros_c, h, w, c, tw, pad_top, pad_left, r0, r1[, tile_stride, plane_stride])"},
    {"winograd_output", winograd_output, METH_VARARGS, "winograd_output(m, out_hwo, ho, wo, o, tw, r0, r1)"},
    {"winograd4_input", winograd4_input, METH_VARARGS,
     "winograd4_input(x_hwc, v, zeros_c, h, w, c, tw, pad_top, pad_left, r0, r1[, tile_stride, plane_stride]): F(4x4,3x3)"},
    {"winograd4_output", winograd4_output, METH_VARARGS, "winograd4_output(m, out_hwo, ho, wo, o, tw, r0, r1): F(4x4,3x3)"},
    {"group_norm", ck_group_norm, METH_VARARGS,
     "group_norm(x, w, b, out, has_w, has_b, n, s, c, groups, eps, act): act 0 none, 1 silu, 2 gelu"},
    {"gemm_panel_width", ck_gemm_panel_width, METH_NOARGS,
     "gemm_panel_width(): the columns of gemm's packed panels on this CPU; 0: no compiled tiles"},
    {"pack_weight", ck_pack_weight, METH_VARARGS, "pack_weight(w_nk, packed, n, k, nr): a linear's weight as gemm's panels"},
    {"winograd_pack", ck_winograd_pack, METH_VARARGS,
     "winograd_pack(w_kt_3_3_c_o, g_px3_f64, packed, o, kt, c, p, nr): Winograd's U = G g G^T as gemm's panels, "
     "one row per plane"},
    {"gemm", ck_gemm, METH_VARARGS,
     "gemm(a, packed, bias, res, out_mn, m, k, n, nr, has_bias, has_res, act[, a_offset, lda, batch, sa, sb]): out = "
     "act(a @ w^T + bias) + res, A's rows `lda` floats apart from a_offset; `batch` products in one call, the i-th "
     "reading A at a_offset + i sa, the panels at i sb (default: one weight's panels) and writing out at i m n; nr: the panel width packed for (gemm_panel_width(), "
     "or 16 for the AVX2 tiles on an AVX-512 CPU)"},
    {"depthwise_ln_mlp", ck_depthwise_ln_mlp, METH_VARARGS,
     "depthwise_ln_mlp(x, out, spare, t, hid, blocks, has_dw_bias, has_ln_w, has_ln_b, n, h, w, c, kh, kw, hidden, "
     "eps, act, nr, bf16=False): ConvNeXt's block bodies one after another in one call, each block a tuple (taps, dw_bias, ln_w, "
     "ln_b, packed1, b1, packed2, b2): t = LayerNorm(depthwise 'same' conv(x) + dw_bias), hid = act(t @ w1^T + b1), "
     "x = hid @ w2^T + b2 + x, as depthwise_layer_norm and two gemm calls would compute them; the blocks alternate "
     "between out and spare (unused for one block) so the last lands in out; bf16: the products in bfloat16 on "
     "pack_weight_bf16's panels, as gemm_bf16 computes them (nr not read)"},
    {"gemm_bf16_available", ck_gemm_bf16_available, METH_NOARGS,
     "gemm_bf16_available(): whether this CPU runs gemm_bf16 (AVX-512 BF16)"},
    {"pack_weight_bf16", ck_pack_weight_bf16, METH_VARARGS,
     "pack_weight_bf16(w_nk, packed_u16, n, k): a linear's weight as gemm_bf16's bfloat16 panels"},
    {"gemm_bf16", ck_gemm_bf16, METH_VARARGS,
     "gemm_bf16(a, packed_u16, bias, res, out_mn, m, k, n, has_bias, has_res, act[, a_offset, lda, batch, sa, sb]): "
     "gemm with A and the weight rounded to bfloat16, float32 accumulation"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
