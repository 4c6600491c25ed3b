/* What the compiled CPU kernels share: the 16-float vector type, the run-time ISA clones, the
 * rational erf/tanh on vectors, and the Python argument helpers. */
#ifndef CONVKERNELS_VEC_H
#define CONVKERNELS_VEC_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(CONVKERNELS_NO_CLONES) /* one build for one ISA (benchmarks of a clone's code) */
#define CLONES
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
/* One copy per micro-architecture level, picked when the module loads: x86-64-v4 (AVX-512),
 * x86-64-v3 (AVX2 + FMA + F16C: every x86 server since Haswell and Zen 1), baseline SSE2. Plain
 * "avx2" would leave FMA off (it is its own flag), and -march=native would break on another
 * machine. */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
/* GCC warns that a 64-byte vector argument's ABI differs between the clones; no such vector
 * crosses a call here (the helpers are always inlined) */
#pragma GCC diagnostic ignored "-Wpsabi"
#else
#define CLONES
#endif

#define INLINE static inline __attribute__((always_inline))

/* below this many multiply-adds a call stays on one thread */
#define PARALLEL_MIN_WORK 262144

/* the threads a parallel region will get (1 where the build has no OpenMP: macOS's clang) */
#ifdef _OPENMP
#include <omp.h>
#define CK_THREADS() omp_get_max_threads()
#else
#define CK_THREADS() 1
#endif

/* 16 floats: one AVX-512 register, two AVX2 ones; GCC lowers the vector type per clone */
typedef float vf16 __attribute__((vector_size(64)));
typedef int vi16 __attribute__((vector_size(64)));
#define DW_VEC 16

INLINE vf16 vload16(const float *p)
{
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void vstore16(float *p, vf16 v) { memcpy(p, &v, sizeof v); }

/* the first n (< 16) floats of p, zeros after: channel tails take the vector code too, so every
 * element is computed by the same instructions wherever it sits */
INLINE vf16 vload_part(const float *p, Py_ssize_t n)
{
    float t[DW_VEC] = {0};
    memcpy(t, p, sizeof(float) * (size_t)n);
    return vload16(t);
}

INLINE void vstore_part(float *p, vf16 v, Py_ssize_t n)
{
    float t[DW_VEC];
    vstore16(t, v);
    memcpy(p, t, sizeof(float) * (size_t)n);
}

INLINE vf16 vsplat(float v) { return (vf16){0} + v; }

/* The activations run on 8-float vectors: GCC lowers a 16-float compare (the clamps below) lane
 * by lane, in scalar code, where the ISA has no 64-byte registers, but an 8-float one to one
 * instruction on AVX2 and AVX-512 (two on SSE2). */
typedef float vf8 __attribute__((vector_size(32)));
typedef int vi8 __attribute__((vector_size(32)));
#define ACT_VEC 8

INLINE vf8 vload8(const float *p)
{
    vf8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void vstore8(float *p, vf8 v) { memcpy(p, &v, sizeof v); }

/* the first n (< 8) floats of p, zeros after, and the converse store: channel tails take the
 * vector code too, so every element is computed by the same instructions wherever it sits */
INLINE vf8 vload8_part(const float *p, Py_ssize_t n)
{
    float t[ACT_VEC] = {0};
    memcpy(t, p, sizeof(float) * (size_t)n);
    return vload8(t);
}

INLINE void vstore8_part(float *p, vf8 v, Py_ssize_t n)
{
    float t[ACT_VEC];
    vstore8(t, v);
    memcpy(p, t, sizeof(float) * (size_t)n);
}

/* The activations, written once for a vector type V (its int twin VI) and instantiated for 8 floats
 * (vclamp, verf, vtanh, vact: every loop of norms.c) and 16 floats (vact16 ...: gemm.c's AVX-512
 * tiles, whose epilogue would run at half width on 8-float vectors).
 *
 * clamp as compare + blend (C has no vector ?:): the scalar `z < lo ? lo : z` made GCC give up
 * vectorising ("control flow in loop") in every clone but AVX-512's, whose masks hid it. NaN
 * compares false and passes through, as in the scalar form.
 * erf(z) as z * P(z^2) / Q(z^2) on [-4, 4] (the float32 rational fit Eigen and XLA use; no exp).
 * tanh(x) as x * P(x^2) / Q(x^2) on [-7.9, 7.9] (Eigen's float32 rational fit).
 * activation codes shared with Python: 0 none, 1 silu, 2 gelu (exact-erf form). */
#define DEFINE_ACTIVATIONS(SFX, V, VI)                                                          \
    INLINE V vclamp##SFX(V x, float lo, float hi)                                              \
    {                                                                                          \
        V l = (V){0} + lo, h = (V){0} + hi;                                                    \
        VI m = x < l;                                                                          \
        x = (V)((m & (VI)l) | (~m & (VI)x));                                                   \
        m = x > h;                                                                             \
        return (V)((m & (VI)h) | (~m & (VI)x));                                                \
    }                                                                                          \
    INLINE V verf##SFX(V z)                                                                    \
    {                                                                                          \
        z = vclamp##SFX(z, -4.0f, 4.0f);                                                       \
        V z2 = z * z;                                                                          \
        V p = (V){0} - 2.72614225801306e-10f;                                                  \
        p = p * z2 + 2.77068142495902e-08f;                                                    \
        p = p * z2 - 2.10102402082508e-06f;                                                    \
        p = p * z2 - 5.69250639462346e-05f;                                                    \
        p = p * z2 - 7.34990630326855e-04f;                                                    \
        p = p * z2 - 2.95459980854025e-03f;                                                    \
        p = p * z2 - 1.60960333262415e-02f;                                                    \
        V q = (V){0} - 1.45660718464996e-05f;                                                  \
        q = q * z2 - 2.13374055278905e-04f;                                                    \
        q = q * z2 - 1.68282697438203e-03f;                                                    \
        q = q * z2 - 7.37332916720468e-03f;                                                    \
        q = q * z2 - 1.42647390514189e-02f;                                                    \
        return z * p / q;                                                                      \
    }                                                                                          \
    INLINE V vtanh##SFX(V x)                                                                   \
    {                                                                                          \
        x = vclamp##SFX(x, -7.90531110763549805f, 7.90531110763549805f);                       \
        V x2 = x * x;                                                                          \
        V p = (V){0} - 2.76076847742355e-16f;                                                  \
        p = p * x2 + 2.00018790482477e-13f;                                                    \
        p = p * x2 - 8.60467152213735e-11f;                                                    \
        p = p * x2 + 5.12229709037114e-08f;                                                    \
        p = p * x2 + 1.48572235717979e-05f;                                                    \
        p = p * x2 + 6.37261928875436e-04f;                                                    \
        p = p * x2 + 4.89352455891786e-03f;                                                    \
        V q = (V){0} + 1.19825839466702e-06f;                                                  \
        q = q * x2 + 1.18534705686654e-04f;                                                    \
        q = q * x2 + 2.26843463243900e-03f;                                                    \
        q = q * x2 + 4.89352518554385e-03f;                                                    \
        return x * p / q;                                                                      \
    }                                                                                          \
    INLINE V vact##SFX(V v, int act)                                                           \
    {                                                                                          \
        if (act == 1) return 0.5f * v * (1.0f + vtanh##SFX(0.5f * v)); /* v * sigmoid(v) */    \
        if (act == 2) return 0.5f * v * (1.0f + verf##SFX(v * 0.70710678118654752f));          \
        return v;                                                                              \
    }

DEFINE_ACTIVATIONS(, vf8, vi8)
DEFINE_ACTIVATIONS(16, vf16, vi16)

INLINE vf8 vsplat8(float v) { return (vf8){0} + v; }

/* the sum of a vector's lanes */
INLINE float vsum(vf8 v)
{
    float s = 0.0f;
    for (int i = 0; i < ACT_VEC; i++) s += v[i];
    return s;
}

INLINE int too_small(Py_buffer *buf, Py_ssize_t floats) { return buf->len < (Py_ssize_t)sizeof(float) * floats; }

INLINE void release(Py_buffer *bufs, int n)
{
    for (int i = 0; i < n; i++) PyBuffer_Release(&bufs[i]);
}

/* the Python faces of norms.c (kernels.c's method table lists them) */
PyObject *ck_bias_gelu(PyObject *self, PyObject *args);
PyObject *ck_epilogue(PyObject *self, PyObject *args);
PyObject *ck_layer_norm(PyObject *self, PyObject *args);
PyObject *ck_group_norm(PyObject *self, PyObject *args);
PyObject *ck_depthwise_layer_norm(PyObject *self, PyObject *args);
/* ... and of gemm.c */
PyObject *ck_gemm_panel_width(PyObject *self, PyObject *args);
PyObject *ck_pack_weight(PyObject *self, PyObject *args);
PyObject *ck_winograd_pack(PyObject *self, PyObject *args);
PyObject *ck_rms_norm(PyObject *self, PyObject *args);
PyObject *ck_gemm(PyObject *self, PyObject *args);
PyObject *ck_depthwise_ln_mlp(PyObject *self, PyObject *args);
/* the fused depthwise 'same' conv + LayerNorm (norms.c), callable from another kernel with the GIL released */
void ck_depthwise_ln(const float *x, const float *taps, const float *dwb, const float *lw, const float *lb,
                     float *out, Py_ssize_t n, Py_ssize_t h, Py_ssize_t wd, Py_ssize_t c, Py_ssize_t kh,
                     Py_ssize_t kw, Py_ssize_t ph, Py_ssize_t pw, float eps, int *failed);
/* ... and of gemm_bf16.c: the first three for gemm.c's depthwise_ln_mlp in bfloat16 */
int ck_runs_bf16(void);
Py_ssize_t ck_bf16_panels_size(Py_ssize_t n, Py_ssize_t k);
int ck_bf16_mlp(const float *t, Py_ssize_t c, const uint16_t *p1, const float *b1, const uint16_t *p2,
                const float *b2, const float *res, float *dst, float *hid, Py_ssize_t rows, Py_ssize_t hidden, int act);
PyObject *ck_gemm_bf16_available(PyObject *self, PyObject *args);
PyObject *ck_pack_weight_bf16(PyObject *self, PyObject *args);
PyObject *ck_gemm_bf16(PyObject *self, PyObject *args);

/* pool.c: fn(ctx, t) for t in 0..ntasks-1 on the caller and the pool's workers; returns when all
 * are done, waiting for no worker that took none */
typedef void (*ck_task_fn)(void *ctx, Py_ssize_t task);
void ck_pool_run(ck_task_fn fn, void *ctx, Py_ssize_t ntasks);

/* kernels.c's depthwise row, used by the fused depthwise + LayerNorm in norms.c */
void ck_depthwise_rows_s1(const float *x, const float *w, const float *bias, float *out, Py_ssize_t h,
                          Py_ssize_t wd, Py_ssize_t c, Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t ph,
                          Py_ssize_t pw, Py_ssize_t r0, Py_ssize_t r1);
#endif
