/* bfloat16 matrix products on CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later Xeons,
 * Zen 4): out (M, N) float32 = A (M, K) float32, rounded to bfloat16 as it is read, times B, packed
 * once per weight as bfloat16 pairs. Products of bfloat16 pairs accumulate in float32
 * (vdpbf16ps), twice the multiply-adds per instruction of a float32 FMA.
 *
 * Only the NumPy backend's dtype=bfloat16 uses it (convkernels/backends/numpy/bf16.py): rounding the
 * operands to 8 mantissa bits is an error far above float32's, so it is never a float32 path.
 *
 * B's packed layout, for the micro-tile's loads: panels of NR = 32 columns; in a panel, for every
 * pair of rows k2 = (2 k2, 2 k2 + 1) of B, 32 columns x 2 bfloat16 (column j's two values side by
 * side), zeros past K and N. A micro-tile of MR rows x NR columns keeps 2 MR accumulators; per k2
 * it loads B's two vectors once and broadcasts each row's bfloat16 pair. */
#include "vec.h"
#include <stdint.h>
#include <stdlib.h>

#define GEMM_NR 32
#define GEMM_MR 8

/* round-to-nearest-even float32 -> bfloat16 bits (NaN stays NaN: a quiet bit is kept set) */
static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* w (N, K) float32, as a linear layer's weight (B = w^T) -> packed bfloat16 pairs */
static void pack_b(const float *w, uint16_t *out, Py_ssize_t n, Py_ssize_t k)
{
    Py_ssize_t k2n = (k + 1) / 2, panels = (n + GEMM_NR - 1) / GEMM_NR;
    for (Py_ssize_t p = 0; p < panels; p++)
        for (Py_ssize_t k2 = 0; k2 < k2n; k2++)
            for (Py_ssize_t j = 0; j < GEMM_NR; j++)
                for (int t = 0; t < 2; t++) {
                    Py_ssize_t col = p * GEMM_NR + j, row = 2 * k2 + t;
                    out[((p * k2n + k2) * GEMM_NR + j) * 2 + t] = col < n && row < k ? to_bf16(w[col * k + row]) : 0;
                }
}

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10 && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_BF16_CODE 1
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* MR rows of A (K floats each, `rows` of them real) -> bfloat16 pairs, a zero row past `rows` */
BF16_TARGET static void rows_to_bf16(const float *a, Py_ssize_t rows, Py_ssize_t k, uint16_t *dst, Py_ssize_t k2n)
{
    for (Py_ssize_t r = 0; r < GEMM_MR; r++) {
        uint16_t *d = dst + r * 2 * k2n;
        Py_ssize_t c = 0;
        if (r < rows) {
            const float *s = a + r * k;
            for (; c + 16 <= k; c += 16)
                _mm256_storeu_si256((__m256i *)(d + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + c)));
            for (; c < k; c++) d[c] = to_bf16(s[c]);
        }
        for (; c < 2 * k2n; c++) d[c] = 0;
    }
}

BF16_TARGET static void gemm_rows(const float *a, const uint16_t *bp, float *out, Py_ssize_t r0, Py_ssize_t rows,
                                  Py_ssize_t k, Py_ssize_t n, uint16_t *apk)
{
    Py_ssize_t k2n = (k + 1) / 2, panels = (n + GEMM_NR - 1) / GEMM_NR;
    rows_to_bf16(a + r0 * k, rows, k, apk, k2n);
    const uint32_t *ap = (const uint32_t *)apk;
    for (Py_ssize_t p = 0; p < panels; p++) {
        const uint16_t *b = bp + p * k2n * GEMM_NR * 2;
        __m512 c0[GEMM_MR], c1[GEMM_MR];
        for (int r = 0; r < GEMM_MR; r++) c0[r] = c1[r] = _mm512_setzero_ps();
        for (Py_ssize_t k2 = 0; k2 < k2n; k2++) {
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + k2 * 64);
            __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + k2 * 64 + 32);
            for (int r = 0; r < GEMM_MR; r++) {
                __m512bh av = (__m512bh)_mm512_set1_epi32((int)ap[r * k2n + k2]);
                c0[r] = _mm512_dpbf16_ps(c0[r], av, b0);
                c1[r] = _mm512_dpbf16_ps(c1[r], av, b1);
            }
        }
        Py_ssize_t col = p * GEMM_NR, left = n - col;
        __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
        for (Py_ssize_t r = 0; r < rows; r++) {
            float *o = out + (r0 + r) * n + col;
            _mm512_mask_storeu_ps(o, m0, c0[r]);
            _mm512_mask_storeu_ps(o + 16, m1, c1[r]);
        }
    }
}

BF16_TARGET static void gemm(const float *a, const uint16_t *bp, float *out, Py_ssize_t m, Py_ssize_t k,
                             Py_ssize_t n)
{
    Py_ssize_t blocks = (m + GEMM_MR - 1) / GEMM_MR, k2n = (k + 1) / 2;
    int parallel = (double)m * k * n >= PARALLEL_MIN_WORK;
#pragma omp parallel if (parallel)
    {
        uint16_t *apk = malloc(sizeof(uint16_t) * GEMM_MR * 2 * k2n);
#pragma omp for schedule(static)
        for (Py_ssize_t blk = 0; blk < blocks; blk++) {
            Py_ssize_t r0 = blk * GEMM_MR, rows = m - r0 < GEMM_MR ? m - r0 : GEMM_MR;
            if (apk) gemm_rows(a, bp, out, r0, rows, k, n, apk);
        }
        free(apk);
    }
}
#endif

static int bf16_supported(void)
{
#ifdef HAVE_BF16_CODE
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* ---- Python faces ------------------------------------------------------------------------ */

PyObject *ck_has_bf16_gemm(PyObject *self, PyObject *args) { return PyBool_FromLong(bf16_supported()); }

PyObject *ck_pack_bf16(PyObject *self, PyObject *args)
{
    Py_buffer bf[2];
    Py_ssize_t n, k;
    if (!PyArg_ParseTuple(args, "y*w*nn", &bf[0], &bf[1], &n, &k)) return NULL;
    Py_ssize_t packed = ((n + GEMM_NR - 1) / GEMM_NR) * ((k + 1) / 2) * GEMM_NR * 2;
    int bad = n < 1 || k < 1 || too_small(&bf[0], n * k) || bf[1].len < (Py_ssize_t)sizeof(uint16_t) * packed;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        pack_b(bf[0].buf, bf[1].buf, n, k);
        Py_END_ALLOW_THREADS
    }
    release(bf, 2);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "pack_bf16: buffer sizes do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *ck_gemm_bf16(PyObject *self, PyObject *args)
{
    Py_buffer bf[3];
    Py_ssize_t m, k, n;
    if (!PyArg_ParseTuple(args, "y*y*w*nnn", &bf[0], &bf[1], &bf[2], &m, &k, &n)) return NULL;
    Py_ssize_t packed = ((n + GEMM_NR - 1) / GEMM_NR) * ((k + 1) / 2) * GEMM_NR * 2;
    int bad = m < 0 || k < 1 || n < 1 || too_small(&bf[0], m * k) || too_small(&bf[2], m * n) ||
              bf[1].len < (Py_ssize_t)sizeof(uint16_t) * packed;
    int unsupported = !bf16_supported();
#ifdef HAVE_BF16_CODE
    if (!bad && !unsupported) {
        Py_BEGIN_ALLOW_THREADS
        gemm(bf[0].buf, bf[1].buf, bf[2].buf, m, k, n);
        Py_END_ALLOW_THREADS
    }
#endif
    release(bf, 3);
    if (bad || unsupported) {
        PyErr_SetString(PyExc_ValueError, bad ? "gemm_bf16: buffer sizes do not match"
                                              : "gemm_bf16: this CPU has no AVX512-BF16");
        return NULL;
    }
    Py_RETURN_NONE;
}
