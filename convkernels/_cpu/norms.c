/* Per-channel-vector kernels of the NumPy backend: a gemm's epilogue (bias, activation,
 * residual in one pass), LayerNorm, the ConvNeXt block's depthwise conv + LayerNorm in one pass,
 * and GroupNorm with its activation. Every loop is written on 16-float vectors (vec.h), not left
 * to the auto-vectoriser: it gave up on the activations' clamps in the AVX2 and SSE clones, which
 * then ran scalar (exact GELU 57 ms of a 174 ms ConvNeXt-T call on a Zen 3). */
#include "vec.h"
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

/* depthwise + LayerNorm forks above this many multiply-adds: ConvNeXt-T's 7 x 7 stage at batch 1
 * (1.8 M, ~0.15 ms) gains from a second thread now that threads spin between regions; at the
 * plain depthwise conv's 8 M, 15 of its 18 blocks ran on one thread (6.6 ms one thread, 7.2 two) */
#define DW_LN_PARALLEL_MIN_WORK (1LL << 20)
/* about this many blocks per thread, so a thread that starts late (another process held its
 * core) leaves its share to the others */
#define DW_LN_JOBS_PER_THREAD 8
/* rows of depthwise output one fused block keeps for its LayerNorm: about a core's L2 share */
#define DW_LN_BLOCK_BYTES (128 * 1024)

/* tasks 0 .. tasks - 1 of fn on pool.c's threads, or in order on this one where the work is too small */
static void run_tasks(ck_task_fn fn, void *job, Py_ssize_t tasks, int parallel)
{
    if (parallel)
        ck_pool_run(fn, job, tasks);
    else
        for (Py_ssize_t t = 0; t < tasks; t++) fn(job, t);
}

/* out = act(x + bias) + residual over rows of c channels; out may be x (in place). Tasks of about
 * 16 K floats on pool.c's threads. */
typedef struct {
    const float *x, *bias, *res;
    float *out;
    Py_ssize_t rows, c, chunk;
    int act;
} epilogue_job;

CLONES
static void epilogue_task(void *ctx, Py_ssize_t task)
{
    const epilogue_job *j = ctx;
    const float *bias = j->bias;
    Py_ssize_t c = j->c, c_vec = c - c % ACT_VEC, r1 = (task + 1) * j->chunk < j->rows ? (task + 1) * j->chunk : j->rows;
    int act = j->act;
    for (Py_ssize_t r = task * j->chunk; r < r1; r++) {
        const float *xr = j->x + (size_t)r * c;
        const float *rr = j->res ? j->res + (size_t)r * c : NULL;
        float *o = j->out + (size_t)r * c;
        Py_ssize_t ch = 0;
        for (; ch < c_vec; ch += ACT_VEC) {
            vf8 v = vload8(xr + ch);
            if (bias) v += vload8(bias + ch);
            v = vact(v, act);
            if (rr) v += vload8(rr + ch);
            vstore8(o + ch, v);
        }
        if (ch < c) {
            Py_ssize_t n = c - ch;
            vf8 v = vload8_part(xr + ch, n);
            if (bias) v += vload8_part(bias + ch, n);
            v = vact(v, act);
            if (rr) v += vload8_part(rr + ch, n);
            vstore8_part(o + ch, v, n);
        }
    }
}

static void epilogue_rows(const float *x, const float *bias, const float *res, float *out, Py_ssize_t rows,
                          Py_ssize_t c, int act)
{
    Py_ssize_t chunk = 16384 / c > 0 ? 16384 / c : 1;
    epilogue_job j = {x, bias, res, out, rows, c, chunk, act};
    run_tasks(epilogue_task, &j, (rows + chunk - 1) / chunk, (long long)rows * c * (act ? 16 : 2) > PARALLEL_MIN_WORK);
}

/* LayerNorm of one pixel's c channels in float lanes, by the corrected two-pass algorithm
 * (Chan, Golub and LeVeque): a first mean, then the deviations' sum corrects it and their
 * squares give the variance, so a large mean costs no accuracy (the scalar kernel summed in
 * double instead; converting to double lanes is done lane by lane on AVX2) */
INLINE void ln_pixel(const float *xr, const float *w, const float *b, float *o, Py_ssize_t c, float eps)
{
    Py_ssize_t c_vec = c - c % ACT_VEC, ch;
    vf8 acc = {0};
    for (ch = 0; ch < c_vec; ch += ACT_VEC) acc += vload8(xr + ch);
    float sum = vsum(acc);
    for (; ch < c; ch++) sum += xr[ch];
    float mean = sum / (float)c;
    vf8 vm = vsplat8(mean), dev = {0}, sq = {0};
    for (ch = 0; ch < c_vec; ch += ACT_VEC) {
        vf8 d = vload8(xr + ch) - vm;
        dev += d;
        sq += d * d;
    }
    float dsum = vsum(dev), ssum = vsum(sq);
    for (; ch < c; ch++) {
        float d = xr[ch] - mean;
        dsum += d;
        ssum += d * d;
    }
    float shift = dsum / (float)c;
    float var = ssum / (float)c - shift * shift;
    vm = vsplat8(mean + shift);
    vf8 rstd = vsplat8((float)(1.0 / sqrt((double)(var > 0.0f ? var : 0.0f) + eps)));
    for (ch = 0; ch < c; ch += ACT_VEC) {
        Py_ssize_t n = c - ch < ACT_VEC ? c - ch : ACT_VEC;
        vf8 v = (n == ACT_VEC ? vload8(xr + ch) : vload8_part(xr + ch, n)) - vm;
        v *= rstd;
        if (w) v *= n == ACT_VEC ? vload8(w + ch) : vload8_part(w + ch, n);
        if (b) v += n == ACT_VEC ? vload8(b + ch) : vload8_part(b + ch, n);
        if (n == ACT_VEC) vstore8(o + ch, v);
        else vstore8_part(o + ch, v, n);
    }
}

CLONES
static void layer_norm_rows(const float *x, const float *w, const float *b, float *out, Py_ssize_t rows,
                            Py_ssize_t c, float eps)
{
#pragma omp parallel for schedule(static) if ((long long)rows * c * 4 > PARALLEL_MIN_WORK)
    for (Py_ssize_t r = 0; r < rows; r++) ln_pixel(x + (size_t)r * c, w, b, out + (size_t)r * c, c, eps);
}

/* RMSNorm of each row's c channels, x * weight / sqrt(mean(x^2) + eps), plus a bias, then the
 * activation, plus a residual, in one pass over the row (its sum of squares stays in registers, and
 * the row in L1): the Wan decoders' norm + SiLU, DC-AE's norm + bias + its block's residual, where NumPy's four passes took 0.43 s of a 1.9 s Wan 2.1 5 x 128 x 128 decode on
 * two cores (2026-11-29). Tasks of about 16 K floats on pool.c's threads. */
typedef struct {
    const float *x, *w, *b, *res; /* b: a per-channel bias after the weight; res: added last (x's layout) */
    float *out;
    Py_ssize_t rows, c, chunk;
    float eps;
    int act;
} rms_job;

CLONES
static void rms_task(void *ctx, Py_ssize_t task)
{
    const rms_job *j = ctx;
    Py_ssize_t c = j->c, c_vec = c - c % ACT_VEC, r1 = (task + 1) * j->chunk < j->rows ? (task + 1) * j->chunk : j->rows;
    for (Py_ssize_t r = task * j->chunk; r < r1; r++) {
        const float *xr = j->x + (size_t)r * c;
        float *o = j->out + (size_t)r * c;
        vf8 acc = {0};
        Py_ssize_t ch = 0;
        for (; ch < c_vec; ch += ACT_VEC) {
            vf8 v = vload8(xr + ch);
            acc += v * v;
        }
        float ss = vsum(acc);
        for (; ch < c; ch++) ss += xr[ch] * xr[ch];
        vf8 scale = vsplat8((float)(1.0 / sqrt((double)ss / (double)c + (double)j->eps)));
        for (ch = 0; ch < c; ch += ACT_VEC) {
            Py_ssize_t n = c - ch < ACT_VEC ? c - ch : ACT_VEC;
            vf8 v = (n == ACT_VEC ? vload8(xr + ch) : vload8_part(xr + ch, n)) * scale;
            if (j->w) v *= n == ACT_VEC ? vload8(j->w + ch) : vload8_part(j->w + ch, n);
            if (j->b) v += n == ACT_VEC ? vload8(j->b + ch) : vload8_part(j->b + ch, n);
            v = vact(v, j->act);
            if (j->res) {
                const float *rr = j->res + (size_t)r * c + ch;
                v += n == ACT_VEC ? vload8(rr) : vload8_part(rr, n);
            }
            if (n == ACT_VEC) vstore8(o + ch, v);
            else vstore8_part(o + ch, v, n);
        }
    }
}

static void rms_norm_rows(const float *x, const float *w, const float *b, const float *res, float *out,
                          Py_ssize_t rows, Py_ssize_t c, float eps, int act)
{
    Py_ssize_t chunk = 16384 / c > 0 ? 16384 / c : 1;
    rms_job j = {x, w, b, res, out, rows, c, chunk, eps, act};
    run_tasks(rms_task, &j, (rows + chunk - 1) / chunk, (long long)rows * c * (act ? 16 : 4) > PARALLEL_MIN_WORK);
}

/* LayerNorm(depthwise stride-1 conv(x) + bias), output size = input size: each block of output
 * rows is convolved into a buffer that stays in cache and normalised from there, so the conv's
 * output never makes the round trip through memory that a separate LayerNorm pass costs. The
 * blocks are pool.c's tasks; each thread keeps its block buffer between calls. */
typedef struct {
    const float *x, *taps, *dwb, *lw, *lb;
    float *out;
    Py_ssize_t h, wd, c, kh, kw, ph, pw, block, per_image;
    float eps;
    _Atomic int failed;
} dw_ln_job;

CLONES
static void depthwise_ln_task(void *ctx, Py_ssize_t job)
{
    static __thread float *buf;
    static __thread size_t cap;
    dw_ln_job *j = ctx;
    Py_ssize_t h = j->h, wd = j->wd, c = j->c, row_floats = wd * c;
    size_t need = (size_t)(j->block * row_floats);
    if (cap < need) {
        free(buf);
        buf = malloc(sizeof(float) * need);
        cap = buf ? need : 0;
        if (!buf) {
            j->failed = 1;
            return;
        }
    }
    Py_ssize_t img = job / j->per_image, r0 = (job % j->per_image) * j->block;
    Py_ssize_t r1 = r0 + j->block < h ? r0 + j->block : h;
    const float *xb = j->x + (size_t)img * h * row_floats;
    ck_depthwise_rows_s1(xb, j->taps, j->dwb, buf, h, wd, c, j->kh, j->kw, j->ph, j->pw, r0, r1);
    float *ob = j->out + ((size_t)img * h + r0) * row_floats;
    for (Py_ssize_t p = 0; p < (r1 - r0) * wd; p++)
        ln_pixel(buf + (size_t)p * c, j->lw, j->lb, ob + (size_t)p * c, c, j->eps);
}

void ck_depthwise_ln(const float *x, const float *taps, const float *dwb, const float *lw, const float *lb,
                     float *out, Py_ssize_t n, Py_ssize_t h, Py_ssize_t wd, Py_ssize_t c, Py_ssize_t kh,
                     Py_ssize_t kw, Py_ssize_t ph, Py_ssize_t pw, float eps, int *failed)
{
    Py_ssize_t row_floats = wd * c;
    long long work = (long long)n * h * wd * c * kh * kw;
    int parallel = work > DW_LN_PARALLEL_MIN_WORK;
    Py_ssize_t block = DW_LN_BLOCK_BYTES / (Py_ssize_t)sizeof(float) / row_floats;
    if (parallel) { /* blocks of fewer rows where the images alone make too few */
        Py_ssize_t jobs = (Py_ssize_t)DW_LN_JOBS_PER_THREAD * CK_THREADS();
        Py_ssize_t per_image = (jobs + n - 1) / n, rows = (h + per_image - 1) / per_image;
        if (rows < block) block = rows;
    }
    if (block < 1) block = 1;
    if (block > h) block = h;
    dw_ln_job j = {x, taps, dwb, lw, lb, out, h, wd, c, kh, kw, ph, pw, block, (h + block - 1) / block, eps, 0};
    if (parallel)
        ck_pool_run(depthwise_ln_task, &j, n * j.per_image);
    else
        for (Py_ssize_t t = 0; t < n * j.per_image; t++) depthwise_ln_task(&j, t);
    *failed = j.failed;
}

/* GroupNorm over channels-last (N, S, C): per-channel sums in double (S can be 10^6 positions),
 * group statistics, then one vector pass of x * scale[c] + shift[c] with the activation fused.
 * Both passes are pool.c tasks over runs of positions; each sum task has its own row of partial
 * sums (no lock), added up in task order, so the result does not depend on which thread ran what. */
#define GN_MAX_TASKS 64

typedef struct {
    const float *x, *scale, *shift;
    float *out;
    double *part; /* tasks x 2c: each task's sums, then its sums of squares */
    Py_ssize_t s, c, chunk;
    int act;
} gn_job;

CLONES
static void gn_sum_task(void *ctx, Py_ssize_t task)
{
    const gn_job *j = ctx;
    Py_ssize_t c = j->c, p1 = (task + 1) * j->chunk < j->s ? (task + 1) * j->chunk : j->s;
    double *ls = j->part + (size_t)task * 2 * c, *lq = ls + c;
    memset(ls, 0, sizeof(double) * 2 * c);
    for (Py_ssize_t p = task * j->chunk; p < p1; p++) {
        const float *xr = j->x + (size_t)p * c;
        for (Py_ssize_t ch = 0; ch < c; ch++) {
            double v = xr[ch];
            ls[ch] += v;
            lq[ch] += v * v;
        }
    }
}

CLONES
static void gn_apply_task(void *ctx, Py_ssize_t task)
{
    const gn_job *j = ctx;
    Py_ssize_t c = j->c, c_vec = c - c % ACT_VEC, p1 = (task + 1) * j->chunk < j->s ? (task + 1) * j->chunk : j->s;
    const float *scale = j->scale, *shift = j->shift;
    int act = j->act;
    for (Py_ssize_t p = task * j->chunk; p < p1; p++) {
        const float *xr = j->x + (size_t)p * c;
        float *o = j->out + (size_t)p * c;
        Py_ssize_t ch = 0;
        for (; ch < c_vec; ch += ACT_VEC)
            vstore8(o + ch, vact(vload8(xr + ch) * vload8(scale + ch) + vload8(shift + ch), act));
        if (ch < c) {
            Py_ssize_t k = c - ch;
            vf8 v = vload8_part(xr + ch, k) * vload8_part(scale + ch, k) + vload8_part(shift + ch, k);
            vstore8_part(o + ch, vact(v, act), k);
        }
    }
}

/* part: GN_MAX_TASKS x 2c doubles of scratch */
static void group_norm_image(const float *x, const float *w, const float *b, float *out, Py_ssize_t s,
                             Py_ssize_t c, Py_ssize_t groups, float eps, int act, double *sum, double *sq,
                             float *scale, float *shift, double *part)
{
    int parallel = (long long)s * c > PARALLEL_MIN_WORK;
    Py_ssize_t tasks = parallel ? ((long long)s * c + 16383) / 16384 : 1;
    if (tasks > GN_MAX_TASKS) tasks = GN_MAX_TASKS;
    if (tasks > s) tasks = s > 0 ? s : 1;
    gn_job j = {x, scale, shift, out, part, s, c, (s + tasks - 1) / tasks, act};
    tasks = j.chunk > 0 ? (s + j.chunk - 1) / j.chunk : 0;
    memset(sum, 0, sizeof(double) * c);
    memset(sq, 0, sizeof(double) * c);
    run_tasks(gn_sum_task, &j, tasks, parallel);
    for (Py_ssize_t t = 0; t < tasks; t++)
        for (Py_ssize_t ch = 0; ch < c; ch++) {
            sum[ch] += part[(size_t)t * 2 * c + ch];
            sq[ch] += part[(size_t)t * 2 * c + c + ch];
        }
    Py_ssize_t cg = c / groups;
    double count = (double)s * cg;
    for (Py_ssize_t g = 0; g < groups; g++) {
        double m = 0.0, q = 0.0;
        for (Py_ssize_t ch = g * cg; ch < (g + 1) * cg; ch++) {
            m += sum[ch];
            q += sq[ch];
        }
        m /= count;
        double var = q / count - m * m;
        if (var < 0.0) var = 0.0;
        float rstd = (float)(1.0 / sqrt(var + eps));
        for (Py_ssize_t ch = g * cg; ch < (g + 1) * cg; ch++) {
            float gw = w ? w[ch] : 1.0f;
            scale[ch] = rstd * gw;
            shift[ch] = (b ? b[ch] : 0.0f) - (float)m * rstd * gw;
        }
    }
    run_tasks(gn_apply_task, &j, tasks, parallel);
}

/* ---- Python faces ------------------------------------------------------------------------ */

PyObject *ck_epilogue(PyObject *self, PyObject *args)
{
    Py_buffer bf[4];
    Py_ssize_t rows, c;
    int has_bias, has_res, act;
    if (!PyArg_ParseTuple(args, "y*y*y*w*ppnni", &bf[0], &bf[1], &bf[2], &bf[3], &has_bias, &has_res, &rows, &c,
                          &act))
        return NULL;
    int bad = rows < 0 || c < 1 || too_small(&bf[0], rows * c) || too_small(&bf[3], rows * c) ||
              (has_bias && too_small(&bf[1], c)) || (has_res && too_small(&bf[2], rows * c)) || act < 0 || act > 2;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        epilogue_rows(bf[0].buf, has_bias ? bf[1].buf : NULL, has_res ? bf[2].buf : NULL, bf[3].buf, rows, c, act);
        Py_END_ALLOW_THREADS
    }
    release(bf, 4);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "epilogue: buffer sizes or activation do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *ck_bias_gelu(PyObject *self, PyObject *args)
{
    Py_buffer bf[3];
    Py_ssize_t rows, c;
    int has_bias;
    if (!PyArg_ParseTuple(args, "y*y*w*pnn", &bf[0], &bf[1], &bf[2], &has_bias, &rows, &c)) return NULL;
    int bad = rows < 0 || c < 1 || too_small(&bf[0], rows * c) || too_small(&bf[2], rows * c) ||
              (has_bias && too_small(&bf[1], c));
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        epilogue_rows(bf[0].buf, has_bias ? bf[1].buf : NULL, NULL, bf[2].buf, rows, c, 2);
        Py_END_ALLOW_THREADS
    }
    release(bf, 3);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "bias_gelu: buffer sizes do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *ck_layer_norm(PyObject *self, PyObject *args)
{
    Py_buffer bf[4];
    Py_ssize_t rows, c;
    int has_w, has_b;
    float eps;
    if (!PyArg_ParseTuple(args, "y*y*y*w*ppnnf", &bf[0], &bf[1], &bf[2], &bf[3], &has_w, &has_b, &rows, &c, &eps))
        return NULL;
    int bad = rows < 0 || c < 1 || too_small(&bf[0], rows * c) || too_small(&bf[3], rows * c) ||
              (has_w && too_small(&bf[1], c)) || (has_b && too_small(&bf[2], c));
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        layer_norm_rows(bf[0].buf, has_w ? bf[1].buf : NULL, has_b ? bf[2].buf : NULL, bf[3].buf, rows, c, eps);
        Py_END_ALLOW_THREADS
    }
    release(bf, 4);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "layer_norm: buffer sizes do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *ck_rms_norm(PyObject *self, PyObject *args)
{
    Py_buffer bf[5];
    Py_ssize_t rows, c;
    int has_w, has_b, has_r, act;
    float eps;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*pppnnfi", &bf[0], &bf[1], &bf[2], &bf[3], &bf[4], &has_w, &has_b, &has_r,
                          &rows, &c, &eps, &act))
        return NULL;
    int bad = rows < 0 || c < 1 || act < 0 || act > 2 || too_small(&bf[0], rows * c) || too_small(&bf[4], rows * c) ||
              (has_w && too_small(&bf[1], c)) || (has_b && too_small(&bf[2], c)) || (has_r && too_small(&bf[3], rows * c));
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        rms_norm_rows(bf[0].buf, has_w ? bf[1].buf : NULL, has_b ? bf[2].buf : NULL, has_r ? bf[3].buf : NULL,
                      bf[4].buf, rows, c, eps, act);
        Py_END_ALLOW_THREADS
    }
    release(bf, 5);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: buffer sizes or activation do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *ck_depthwise_layer_norm(PyObject *self, PyObject *args)
{
    Py_buffer bf[6];
    Py_ssize_t n, h, wd, c, kh, kw;
    int has_bias, has_w, has_b;
    float eps;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*pppnnnnnnf", &bf[0], &bf[1], &bf[2], &bf[3], &bf[4], &bf[5],
                          &has_bias, &has_w, &has_b, &n, &h, &wd, &c, &kh, &kw, &eps))
        return NULL;
    /* 'same' output: odd kernels of 3, 5 or 7 columns (the specialised rows), padding k // 2 */
    int bad = n < 0 || h < 1 || wd < 1 || c < 1 || kh < 1 || kh % 2 == 0 || (kw != 3 && kw != 5 && kw != 7) ||
              too_small(&bf[0], n * h * wd * c) || too_small(&bf[1], kh * kw * c) ||
              too_small(&bf[5], n * h * wd * c) || (has_bias && too_small(&bf[2], c)) ||
              (has_w && too_small(&bf[3], c)) || (has_b && too_small(&bf[4], c));
    int failed = 0;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        ck_depthwise_ln(bf[0].buf, bf[1].buf, has_bias ? bf[2].buf : NULL, has_w ? bf[3].buf : NULL,
                        has_b ? bf[4].buf : NULL, bf[5].buf, n, h, wd, c, kh, kw, kh / 2, kw / 2, eps, &failed);
        Py_END_ALLOW_THREADS
    }
    release(bf, 6);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "depthwise_layer_norm: buffer sizes or kernel do not match");
        return NULL;
    }
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyObject *ck_group_norm(PyObject *self, PyObject *args)
{
    Py_buffer bf[4];
    Py_ssize_t n, s, c, groups;
    int has_w, has_b, act;
    float eps;
    if (!PyArg_ParseTuple(args, "y*y*y*w*ppnnnnfi", &bf[0], &bf[1], &bf[2], &bf[3], &has_w, &has_b, &n, &s, &c,
                          &groups, &eps, &act))
        return NULL;
    int bad = n < 0 || s < 0 || c < 1 || too_small(&bf[0], n * s * c) || too_small(&bf[3], n * s * c) ||
              groups < 1 || c % groups || (has_w && too_small(&bf[1], c)) || (has_b && too_small(&bf[2], c)) ||
              act < 0 || act > 2;
    /* sums, squares, GN_MAX_TASKS x 2c partial sums, then scale and shift as floats */
    double *stats = bad ? NULL : malloc(sizeof(double) * (2 + 2 * GN_MAX_TASKS) * c + sizeof(float) * 2 * c);
    if (!bad && stats) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            group_norm_image((const float *)bf[0].buf + (size_t)i * s * c, has_w ? bf[1].buf : NULL,
                             has_b ? bf[2].buf : NULL, (float *)bf[3].buf + (size_t)i * s * c, s, c, groups, eps,
                             act, stats, stats + c, (float *)(stats + (2 + 2 * GN_MAX_TASKS) * c),
                             (float *)(stats + (2 + 2 * GN_MAX_TASKS) * c) + c, stats + 2 * c);
        Py_END_ALLOW_THREADS
    }
    free(stats);
    release(bf, 4);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "group_norm: buffer sizes or groups do not match");
        return NULL;
    }
    if (!stats) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
