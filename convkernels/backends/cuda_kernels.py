"""The CUDA backend's non-conv kernels (CuPy RawModule, compiled once per storage dtype):
conv epilogue (bias, activation, residual), activations, GroupNorm (+activation) in two
passes, channels-last LayerNorm and RMS norm (+activation), row softmax, float32 casts, and 8-bit
pixels for the host.

Storage types: float32 is `float`; float16 and bfloat16 are both `unsigned short` bit
patterns converted to float in registers (bfloat16 has no CuPy dtype, so bf16 arrays live
as uint16; this also keeps the kernels free of cuda_fp16.h / cuda_bf16.h includes, which
NVRTC may not find). All arithmetic is float32; GroupNorm statistics are combined in float64.
"""
from __future__ import annotations

import threading

import numpy as np

ACT_CODES = {None: 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
BLOCK = 256
DW_TW = 4  # output columns per thread of dw2d_vec (the kernel's DW_TW)

_SOURCE = r"""
#if DT == 0
typedef float T;
__device__ __forceinline__ float ld(T v) { return v; }
__device__ __forceinline__ T st(float f) { return f; }
#elif DT == 1
typedef unsigned short T;
__device__ __forceinline__ float ld(T v) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f; }
__device__ __forceinline__ T st(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#else
typedef unsigned short T;
__device__ __forceinline__ float ld(T v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ T st(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (T)0x7fc0;   // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                          // round to nearest even
    return (T)(u >> 16);
}
#endif

__device__ __forceinline__ float act(float v, int a) {
    if (a == 1) return v / (1.0f + expf(-v));
    if (a == 2) return 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    if (a == 3) return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    if (a == 4) return v > 0.0f ? v : 0.0f;
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// block-wide reductions for blockDim.x == 256 (8 warps); every thread gets the result
__device__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = l < (blockDim.x >> 5) ? sh[l] : 0.0f;
    return warp_sum(v);
}
__device__ float block_max(float v, float* sh) {
    v = warp_max(v);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = l < (blockDim.x >> 5) ? sh[l] : -__int_as_float(0x7f800000);
    return warp_max(v);
}

// y = act(x + bias[c]) + res   (y may alias x)
extern "C" __global__ void epilogue(const T* x, const T* bias, const T* res, T* y,
                                    long long n, int C, int has_bias, int has_res, int a) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = ld(x[i]);
        if (has_bias) v += ld(bias[i % C]);
        v = act(v, a);
        if (has_res) v += ld(res[i]);
        y[i] = st(v);
    }
}

// widened for the host, clipped to [lo, hi] on the way (+-inf: no clip); NaN stays NaN as in np.clip
extern "C" __global__ void to_f32(const T* x, float* y, long long n, float lo, float hi) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = ld(x[i]);
        y[i] = v < lo ? lo : (v > hi ? hi : v);
    }
}

// 8-bit pixels for the host: floor(clip(x, 0, 1) * 255 + 0.5) on the widened float32 value,
// the multiply and the add each rounded on its own (__fmul_rn / __fadd_rn are never contracted
// into an FMA), as NumPy computes it on the host (convkernels.backend.pixels_to_uint8); the sum
// is in [0.5, 255.5], so truncation is the floor; NaN -> 0 (__float2uint_rz's answer for NaN)
extern "C" __global__ void to_u8(const T* x, unsigned char* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = ld(x[i]);
        v = v < 0.0f ? 0.0f : (v > 1.0f ? 1.0f : v);
        y[i] = (unsigned char)__float2uint_rz(__fadd_rn(__fmul_rn(v, 255.0f), 0.5f));
    }
}

extern "C" __global__ void from_f32(const float* x, T* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) y[i] = st(x[i]);
}

// ---- GroupNorm over channels-last x (N, S, C) in two passes, fp32 in registers, statistics in
// fp64. A block covers one chunk of rows of one batch item; its threads own fixed columns of
// VEC channels (one 16-byte load each when vec != 0, i.e. C % VEC == 0; one channel otherwise)
// and walk the chunk's rows, several rows side by side when a row has fewer columns than threads.
#define VEC (16 / (int)sizeof(T))

__device__ __forceinline__ void load_vec(const T* p, float* f) {
    union { uint4 u; T t[VEC]; } v;
    v.u = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] = ld(v.t[j]);
}

__device__ __forceinline__ void store_vec(T* p, const float* f) {
    union { uint4 u; T t[VEC]; } v;
#pragma unroll
    for (int j = 0; j < VEC; ++j) v.t[j] = st(f[j]);
    *reinterpret_cast<uint4*>(p) = v.u;
}

// The chunk of rows (s0..s1) of the block and the column tc / row offset tr of the thread, as
// both GroupNorm passes map them: cpb threads side by side cover up to a row's `cols` columns
// of V channels, rpar rows are walked side by side.
struct GnTile { long long s0, s1; int V, cols, Cg, cpb, rpar, tc, tr; };
__device__ __forceinline__ GnTile gn_tile(long long S, int C, int G, long long rows_per_chunk, int vec) {
    GnTile t;
    t.s0 = (long long)blockIdx.x * rows_per_chunk;
    t.s1 = t.s0 + rows_per_chunk; if (t.s1 > S) t.s1 = S;
    t.V = vec ? VEC : 1;
    t.cols = C / t.V; t.Cg = C / G;
    t.cpb = t.cols < (int)blockDim.x ? t.cols : (int)blockDim.x;
    t.rpar = blockDim.x / t.cpb;
    t.tc = threadIdx.x % t.cpb; t.tr = threadIdx.x / t.cpb;
    return t;
}

// pass 1: per-group sum and sum of squares of one chunk, added into acc (N, G, 2), which the
// caller zeroes. Dynamic shared memory: 2 * G doubles.
extern "C" __global__ void gn_stats(const T* x, double* acc, long long S, int C, int G,
                                    long long rows_per_chunk, int vec) {
    extern __shared__ double shg[];
    int n = blockIdx.y;
    for (int i = threadIdx.x; i < 2 * G; i += blockDim.x) shg[i] = 0.0;
    __syncthreads();
    GnTile t = gn_tile(S, C, G, rows_per_chunk, vec);
    long long s0 = t.s0, s1 = t.s1;
    int V = t.V, cols = t.cols, Cg = t.Cg, cpb = t.cpb, rpar = t.rpar, tc = t.tc, tr = t.tr;
    const T* item = x + (long long)n * S * C;
    if (tr < rpar) {
        for (int col = tc; col < cols; col += cpb) {
            float s[VEC], q[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) { s[j] = 0.0f; q[j] = 0.0f; }
            for (long long r = s0 + tr; r < s1; r += rpar) {
                const T* p = item + r * C + (long long)col * V;
                if (vec) {
                    float f[VEC];
                    load_vec(p, f);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) { s[j] += f[j]; q[j] += f[j] * f[j]; }
                } else {
                    float f = ld(*p);
                    s[0] += f; q[0] += f * f;
                }
            }
            // fold the column's channels into their groups (a column may span several groups)
            int c0 = col * V;
            int g = c0 / Cg;
            double gs = 0.0, gq = 0.0;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                if (j < V) {
                    int gj = (c0 + j) / Cg;
                    if (gj != g) {
                        atomicAdd(&shg[2 * g], gs); atomicAdd(&shg[2 * g + 1], gq);
                        g = gj; gs = 0.0; gq = 0.0;
                    }
                    gs += (double)s[j]; gq += (double)q[j];
                }
            }
            atomicAdd(&shg[2 * g], gs); atomicAdd(&shg[2 * g + 1], gq);
        }
    }
    __syncthreads();
    double* out = acc + (long long)n * 2 * G;
    for (int i = threadIdx.x; i < 2 * G; i += blockDim.x) atomicAdd(&out[i], shg[i]);
}

// pass 2: y = act((x - mean) * rstd * w + b) with the statistics of pass 1, as one FMA per
// element: each thread folds its channels' mean, rstd, weight and bias into scale and shift
// once. Dynamic shared memory: 2 * G floats (mean, rstd).
extern "C" __global__ void gn_norm(const T* x, T* y, const double* acc, const T* w, const T* b,
                                   long long S, int C, int G, long long rows_per_chunk, double count,
                                   float eps, int has_w, int has_b, int a, int vec) {
    extern __shared__ float shm[];
    int n = blockIdx.y;
    const double* st_n = acc + (long long)n * 2 * G;
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
        double m = st_n[2 * g] / count;
        double var = st_n[2 * g + 1] / count - m * m;
        if (var < 0.0) var = 0.0;
        shm[g] = (float)m;
        shm[G + g] = (float)(1.0 / sqrt(var + (double)eps));
    }
    __syncthreads();
    GnTile t = gn_tile(S, C, G, rows_per_chunk, vec);
    long long s0 = t.s0, s1 = t.s1;
    int V = t.V, cols = t.cols, Cg = t.Cg, cpb = t.cpb, rpar = t.rpar, tc = t.tc, tr = t.tr;
    if (tr >= rpar) return;
    const T* xi = x + (long long)n * S * C;
    T* yi = y + (long long)n * S * C;
    for (int col = tc; col < cols; col += cpb) {
        float scale[VEC], shift[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            int c = col * V + (j < V ? j : 0);
            int g = c / Cg;
            float wc = has_w ? ld(w[c]) : 1.0f;
            float bc = has_b ? ld(b[c]) : 0.0f;
            scale[j] = shm[G + g] * wc;
            shift[j] = bc - shm[g] * scale[j];
        }
        for (long long r = s0 + tr; r < s1; r += rpar) {
            long long o = r * C + (long long)col * V;
            if (vec) {
                float f[VEC];
                load_vec(xi + o, f);
#pragma unroll
                for (int j = 0; j < VEC; ++j) f[j] = act(fmaf(f[j], scale[j], shift[j]), a);
                store_vec(yi + o, f);
            } else {
                yi[o] = st(act(fmaf(ld(xi[o]), scale[0], shift[0]), a));
            }
        }
    }
}

// RMS norm over the last axis (Wan's norm): one warp per row, y = act(x * rsqrt(mean(x^2) + eps) * w).
extern "C" __global__ void rms_rows(const T* x, T* y, const T* w, long long rows, int C, int has_w,
                                    float eps, int a) {
    long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + row * C;
    T* yr = y + row * C;
    float q = 0.0f;
    for (int c = lane; c < C; c += 32) { float v = ld(xr[c]); q += v * v; }
    float r = rsqrtf(warp_sum(q) / C + eps);
    for (int c = lane; c < C; c += 32) {
        float v = ld(xr[c]) * r;
        if (has_w) v *= ld(w[c]);
        yr[c] = st(act(v, a));
    }
}

// The same RMS norm when C % VEC == 0, C / VEC <= blockDim and the buffers are 16-byte aligned:
// one 16-byte vector per thread, a row on C / VEC consecutive threads (rows may straddle warps, so
// the row's sum goes through shared memory), x read once. Wan's C = 96 fills 12 of a warp's lanes
// in rms_rows' layout; here every thread of a block but a few carries a vector.
extern "C" __global__ void rms_rows_vec(const T* x, T* y, const T* w, long long rows, int C, int has_w,
                                        float eps, int a) {
    extern __shared__ float part[];  // one partial sum of squares per thread
    int nv = C / VEC;
    int per_block = blockDim.x / nv;
    int local = threadIdx.x / nv;
    int cv = threadIdx.x - local * nv;
    long long row = (long long)blockIdx.x * per_block + local;
    bool live = local < per_block && row < rows;
    float v[VEC];
    float q = 0.0f;
    if (live) {
        load_vec(x + row * C + cv * VEC, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) q += v[j] * v[j];
    }
    part[threadIdx.x] = q;
    __syncthreads();
    if (!live) return;
    const float* pr = part + local * nv;
    float s = 0.0f;
    for (int i = 0; i < nv; ++i) s += pr[i];
    float r = rsqrtf(s / C + eps);
    float wv[VEC];
    if (has_w) load_vec(w + cv * VEC, wv);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        float o = v[j] * r;
        if (has_w) o *= wv[j];
        v[j] = act(o, a);
    }
    store_vec(y + row * C + cv * VEC, v);
}

// LayerNorm over the last axis: one warp per row (8 rows per 256-thread block), two passes.
// xb (has_xb): a per-channel bias added to x before the norm (the bias of the conv before it).
extern "C" __global__ void ln_rows(const T* x, T* y, const T* w, const T* b, const T* xb, long long rows, int C,
                                   int has_w, int has_b, int has_xb, float eps, int a) {
    long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + row * C;
    T* yr = y + row * C;
#define LN_X(c) (ld(xr[c]) + (has_xb ? ld(xb[c]) : 0.0f))
    float s = 0.0f;
    for (int c = lane; c < C; c += 32) s += LN_X(c);
    float m = warp_sum(s) / C;
    float q = 0.0f;
    for (int c = lane; c < C; c += 32) { float d = LN_X(c) - m; q += d * d; }
    float r = rsqrtf(warp_sum(q) / C + eps);
    for (int c = lane; c < C; c += 32) {
        float v = (LN_X(c) - m) * r;
        if (has_w) v *= ld(w[c]);
        if (has_b) v += ld(b[c]);
        yr[c] = st(act(v, a));
    }
#undef LN_X
}

// LayerNorm over the last axis with the row held in registers: one warp per row, each lane owns
// up to LN_MAXV 16-byte vectors of channels (C % VEC == 0, C <= 32 * LN_MAXV * VEC, 16-byte
// aligned rows), so the row is read once instead of three times (ln_rows) and with full-width
// loads. Same arithmetic as ln_rows: the mean first, then the centred variance, in fp32.
#define LN_MAXV 4
// mean m and 1 / sqrt(var + eps) r of a row held across a warp's lanes (lane owns vectors lane,
// lane + 32, ... of the row's nv): the mean first, then the centred variance
__device__ __forceinline__ void row_stats(float (*v)[VEC], int nv, int lane, int C, float eps, float& m, float& r) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < LN_MAXV; ++i) {
        if (lane + 32 * i < nv) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) s += v[i][j];
        }
    }
    m = warp_sum(s) / C;
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < LN_MAXV; ++i) {
        if (lane + 32 * i < nv) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) { float d = v[i][j] - m; q += d * d; }
        }
    }
    r = rsqrtf(warp_sum(q) / C + eps);
}

extern "C" __global__ void ln_rows_vec(const T* x, T* y, const T* w, const T* b, const T* xb, long long rows,
                                       int C, int has_w, int has_b, int has_xb, float eps, int a) {
    long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + row * C;
    T* yr = y + row * C;
    int nv = C / VEC;
    float v[LN_MAXV][VEC];
#pragma unroll
    for (int i = 0; i < LN_MAXV; ++i) {
        int cv = lane + 32 * i;
        if (cv < nv) {
            load_vec(xr + cv * VEC, v[i]);
            if (has_xb) {
                float bv[VEC];
                load_vec(xb + cv * VEC, bv);
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[i][j] += bv[j];
            }
        }
    }
    float m, r;
    row_stats(v, nv, lane, C, eps, m, r);
#pragma unroll
    for (int i = 0; i < LN_MAXV; ++i) {
        int cv = lane + 32 * i;
        if (cv < nv) {
            float wv[VEC], bv[VEC];
            if (has_w) load_vec(w + cv * VEC, wv);
            if (has_b) load_vec(b + cv * VEC, bv);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float o = (v[i][j] - m) * r;
                if (has_w) o *= wv[j];
                if (has_b) o += bv[j];
                v[i][j] = act(o, a);
            }
            store_vec(yr + cv * VEC, v[i]);
        }
    }
}

// ConvNeXt's depthwise conv (stride 1, 'same' padding) + bias with the LayerNorm over channels
// that follows it, in one pass: one warp per output pixel holds the pixel's C channels in
// registers as ln_rows_vec does (same conditions: C % VEC == 0, C <= 32 * LN_MAXV * VEC, 16-byte
// aligned buffers), so the conv output is never written and read back. Weights (KH, KW, C).
extern "C" __global__ void dw_ln(const T* x, const T* wt, const T* bias, const T* nw, const T* nb, T* y,
                                 int H, int W, int C, int KH, int KW, int ph, int pw, int has_bias,
                                 float eps, long long pixels) {
    long long pix = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (pix >= pixels) return;
    int ow = (int)(pix % W);
    long long t = pix / W;
    int oh = (int)(t % H);
    long long n = t / H;
    int nv = C / VEC;
    float acc[LN_MAXV][VEC];
#pragma unroll
    for (int i = 0; i < LN_MAXV; ++i) {
        int cv = lane + 32 * i;
        if (has_bias && cv < nv) load_vec(bias + cv * VEC, acc[i]);
        else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[i][j] = 0.0f;
        }
    }
    for (int kh = 0; kh < KH; ++kh) {
        int ih = oh - ph + kh;
        if (ih < 0 || ih >= H) continue;
        for (int kw = 0; kw < KW; ++kw) {
            int iw = ow - pw + kw;
            if (iw < 0 || iw >= W) continue;
            const T* xp = x + ((n * H + ih) * (long long)W + iw) * C;
            const T* wp = wt + ((long long)kh * KW + kw) * C;
#pragma unroll
            for (int i = 0; i < LN_MAXV; ++i) {
                int cv = lane + 32 * i;
                if (cv < nv) {
                    float xv[VEC], wv[VEC];
                    load_vec(xp + cv * VEC, xv);
                    load_vec(wp + cv * VEC, wv);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[i][j] = fmaf(xv[j], wv[j], acc[i][j]);
                }
            }
        }
    }
    // the conv output rounds to the storage type, as the unfused conv's would before the norm
#pragma unroll
    for (int i = 0; i < LN_MAXV; ++i) {
        if (lane + 32 * i < nv) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[i][j] = ld(st(acc[i][j]));
        }
    }
    float m, r;
    row_stats(acc, nv, lane, C, eps, m, r);
    T* yp = y + pix * C;
#pragma unroll
    for (int i = 0; i < LN_MAXV; ++i) {
        int cv = lane + 32 * i;
        if (cv < nv) {
            float wv[VEC], bv[VEC];
            load_vec(nw + cv * VEC, wv);
            load_vec(nb + cv * VEC, bv);
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[i][j] = fmaf((acc[i][j] - m) * r, wv[j], bv[j]);
            store_vec(yp + cv * VEC, acc[i]);
        }
    }
}

// Depthwise 2-d conv, channels-last, one thread per output element (coalesced over channels),
// weights pre-transposed to (KH, KW, C); fused epilogue act(conv + bias) + residual.
extern "C" __global__ void dw2d(const T* x, const T* wt, const T* bias, const T* res, T* y,
                                int H, int W, int C, int OH, int OW, int KH, int KW, int sh, int sw,
                                int ph, int pw, int dh, int dw, int has_bias, int has_res, int a,
                                long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int c = (int)(i % C);
        long long t = i / C;
        int ow = (int)(t % OW); t /= OW;
        int oh = (int)(t % OH);
        long long n = t / OH;
        int ih0 = oh * sh - ph, iw0 = ow * sw - pw;
        float acc = 0.0f;
        for (int kh = 0; kh < KH; ++kh) {
            int ih = ih0 + kh * dh;
            if (ih < 0 || ih >= H) continue;
            const T* xrow = x + ((n * H + ih) * (long long)W) * C + c;
            const T* wrow = wt + (long long)kh * KW * C + c;
            for (int kw = 0; kw < KW; ++kw) {
                int iw = iw0 + kw * dw;
                if (iw < 0 || iw >= W) continue;
                acc += ld(xrow[(long long)iw * C]) * ld(wrow[kw * C]);
            }
        }
        if (has_bias) acc += ld(bias[c]);
        acc = act(acc, a);
        if (has_res) acc += ld(res[i]);
        y[i] = st(acc);
    }
}

// Depthwise 2-d conv, stride 1, dilation 1, C a multiple of VEC: each thread computes DW_TW
// consecutive output columns of one 16-byte vector of channels (consecutive threads: consecutive
// vectors, coalesced), so each loaded input vector serves up to DW_TW outputs and each weight
// vector DW_TW of them, where dw2d re-reads both per output element. Fused epilogue as dw2d.
#define DW_TW 4
extern "C" __global__ void dw2d_vec(const T* x, const T* wt, const T* bias, const T* res, T* y,
                                    int H, int W, int C, int OH, int OW, int KH, int KW, int ph, int pw,
                                    int has_bias, int has_res, int a, long long items) {
    int CV = C / VEC, OWB = (OW + DW_TW - 1) / DW_TW;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < items;
         i += (long long)gridDim.x * blockDim.x) {
        int cv = (int)(i % CV);
        long long t = i / CV;
        int owb = (int)(t % OWB); t /= OWB;
        int oh = (int)(t % OH);
        long long n = t / OH;
        int c0 = cv * VEC, ow0 = owb * DW_TW;
        float acc[DW_TW][VEC];
#pragma unroll
        for (int k = 0; k < DW_TW; ++k)
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[k][j] = 0.0f;
        for (int kh = 0; kh < KH; ++kh) {
            int ih = oh - ph + kh;
            if (ih < 0 || ih >= H) continue;
            const T* xrow = x + ((n * H + ih) * (long long)W) * C + c0;
            for (int kw = 0; kw < KW; ++kw) {
                float wv[VEC];
                load_vec(wt + ((long long)kh * KW + kw) * C + c0, wv);
#pragma unroll
                for (int k = 0; k < DW_TW; ++k) {
                    int iw = ow0 + k - pw + kw;
                    if (iw < 0 || iw >= W) continue;
                    float xv[VEC];
                    load_vec(xrow + (long long)iw * C, xv);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[k][j] = fmaf(xv[j], wv[j], acc[k][j]);
                }
            }
        }
        float bv[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) bv[j] = 0.0f;
        if (has_bias) load_vec(bias + c0, bv);
#pragma unroll
        for (int k = 0; k < DW_TW; ++k) {
            if (ow0 + k >= OW) break;
            long long o = ((n * OH + oh) * (long long)OW + ow0 + k) * C + c0;
            float v[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[j] = act(acc[k][j] + bv[j], a);
            if (has_res) {
                float rv[VEC];
                load_vec(res + o, rv);
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[j] += rv[j];
            }
            store_vec(y + o, v);
        }
    }
}

// Softmax over rows of length L, of x * scale: one 256-thread block per row.
extern "C" __global__ void softmax_rows(const T* x, T* y, long long rows, int L, float scale) {
    __shared__ float sh[32];
    long long row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + row * L;
    T* yr = y + row * L;
    float m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < L; j += blockDim.x) m = fmaxf(m, ld(xr[j]) * scale);
    m = block_max(m, sh);
    float s = 0.0f;
    for (int j = threadIdx.x; j < L; j += blockDim.x) s += expf(ld(xr[j]) * scale - m);
    s = block_sum(s, sh);
    float inv = 1.0f / s;
    for (int j = threadIdx.x; j < L; j += blockDim.x) yr[j] = st(expf(ld(xr[j]) * scale - m) * inv);
}
"""


def _grid(n: int) -> int:
    return max(1, min((n + BLOCK - 1) // BLOCK, 132 * 32))


#: blocks per GroupNorm pass to aim for: about 4 per SM of an H100 (132 SMs)
GN_TARGET_BLOCKS = 4 * 132


def gn_chunks(n: int, rows: int) -> tuple[int, int]:
    """(rows per chunk, chunks per batch item) of the GroupNorm passes: about GN_TARGET_BLOCKS
    blocks over the batch, never an empty chunk."""
    want = max(1, min(rows, -(-GN_TARGET_BLOCKS // n)))
    per_chunk = -(-rows // want)
    return per_chunk, -(-rows // per_chunk)


#: 16-byte vectors of channels one lane of ln_rows_vec holds (the kernel's LN_MAXV)
LN_MAXV = 4


def row_in_registers(channels: int, itemsize: int, ptrs) -> bool:
    """Whether a warp can hold a row of `channels` in registers (ln_rows_vec, dw_ln): whole
    16-byte vectors, at most LN_MAXV of them per lane, every buffer 16-byte aligned (rows then
    are too: C * itemsize % 16 == 0)."""
    vec = 16 // itemsize
    return channels % vec == 0 and channels // vec <= 32 * LN_MAXV and all(p % 16 == 0 for p in ptrs)


def rms_vectorised(channels: int, itemsize: int, ptrs) -> bool:
    """Whether rms_rows_vec takes an RMS norm: whole 16-byte vectors per row, a row on at most
    one block's threads, every buffer 16-byte aligned."""
    vec = 16 // itemsize
    return channels % vec == 0 and channels // vec <= BLOCK and all(p % 16 == 0 for p in ptrs)


#: ln_rows_vec (a row in one warp's registers) won at few rows and lost at many on the H100
#: (benchmarks/convnext_fusion_ab.py, 2026-11-24, ConvNeXt-T: b1 0.617 vs 0.722 ms with it,
#: b32 2.31 vs 2.22 ms, b128 7.73 vs 7.29 ms); ln_rows takes norms over more rows than this
LN_VEC_MAX_ROWS = 16384


def ln_vectorised(channels: int, itemsize: int, ptrs, rows: int = 0, enabled: bool = True) -> bool:
    """Whether ln_rows_vec takes a LayerNorm; enabled=False keeps ln_rows (the backend's ln_vec
    option, for A/B)."""
    return enabled and rows <= LN_VEC_MAX_ROWS and row_in_registers(channels, itemsize, ptrs)


def dw_ln_applies(channels: int, itemsize: int, kernel: tuple, w_shape: tuple, ptrs) -> bool:
    """Whether dw_ln computes LayerNorm(depthwise conv + bias): one filter per channel, an odd
    kernel ('same' padding k // 2 on both sides), a row that fits a warp's registers."""
    kh, kw = kernel
    return (tuple(w_shape) == (channels, kh, kw, 1) and kh % 2 == 1 and kw % 2 == 1
            and row_in_registers(channels, itemsize, ptrs))


class Kernels:
    """The compiled kernels for one storage dtype ('float32', 'float16', 'bfloat16')."""

    _cache: dict[str, "Kernels"] = {}
    _lock = threading.Lock()

    @classmethod
    def for_dtype(cls, dtype: str) -> "Kernels":
        with cls._lock:
            k = cls._cache.get(dtype)
            if k is None:
                k = cls._cache[dtype] = cls(dtype)
            return k

    def __init__(self, dtype: str):
        import cupy as cp

        self.cp = cp
        self.dtype = dtype
        self.module = cp.RawModule(code=_SOURCE, options=(f"-DDT={DTYPE_CODES[dtype]}",))
        self._fns = {}

    def fn(self, name: str):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self.module.get_function(name)
        return f

    # ---- wrappers (inputs must be C-contiguous) -------------------------------------------
    def epilogue(self, x, bias, residual, activation, out=None):
        y = out if out is not None else self.cp.empty_like(x)
        n = x.size
        c = x.shape[-1]
        self.fn("epilogue")((_grid(n),), (BLOCK,), (
            x, bias if bias is not None else x, residual if residual is not None else x, y,
            np.int64(n), np.int32(c), np.int32(bias is not None), np.int32(residual is not None),
            np.int32(ACT_CODES[activation])))
        return y

    def to_f32(self, x, clip=None):
        """x as a new float32 array, clipped to clip = (lo, hi) when given."""
        lo, hi = (-np.inf, np.inf) if clip is None else clip
        y = self.cp.empty(x.shape, dtype=self.cp.float32)
        self.fn("to_f32")((_grid(x.size),), (BLOCK,), (x, y, np.int64(x.size), np.float32(lo), np.float32(hi)))
        return y

    def to_u8(self, x):
        """x (C-contiguous, values meant in [0, 1]) as a new uint8 array, pixels_to_uint8's
        formula on each widened float32 value."""
        y = self.cp.empty(x.shape, dtype=self.cp.uint8)
        if x.size:
            self.fn("to_u8")((_grid(x.size),), (BLOCK,), (x, y, np.int64(x.size)))
        return y

    def from_f32(self, x, storage_dtype):
        y = self.cp.empty(x.shape, dtype=storage_dtype)
        self.fn("from_f32")((_grid(x.size),), (BLOCK,), (x, y, np.int64(x.size)))
        return y

    def group_norm(self, x, groups, weight, bias, eps, activation):
        """Two launches (and a memset of the (N, G, 2) fp64 accumulator): statistics, then the
        normalisation with the finalize folded in. 16-byte loads where C is a multiple of the
        vector width (always for the hosted models); chunks of rows sized so that ~4 blocks per
        SM of the H100 run in each pass."""
        cp = self.cp
        n, c = x.shape[0], x.shape[-1]
        s = x.size // (n * c)
        vec = int(c % (16 // x.itemsize) == 0 and x.data.ptr % 16 == 0)
        rows_per_chunk, nchunks = gn_chunks(n, s)
        acc = cp.zeros((n, groups, 2), dtype=cp.float64)
        i64, i32 = np.int64, np.int32
        self.fn("gn_stats")((nchunks, n), (BLOCK,), (
            x, acc, i64(s), i32(c), i32(groups), i64(rows_per_chunk), i32(vec)),
            shared_mem=2 * groups * 8)
        y = cp.empty_like(x)
        self.fn("gn_norm")((nchunks, n), (BLOCK,), (
            x, y, acc, weight if weight is not None else x, bias if bias is not None else x,
            i64(s), i32(c), i32(groups), i64(rows_per_chunk), np.float64(s * (c // groups)), np.float32(eps),
            i32(weight is not None), i32(bias is not None), i32(ACT_CODES[activation]), i32(vec)),
            shared_mem=2 * groups * 4)
        return y

    def rms_norm(self, x, weight, eps, activation, out=None):
        """out: a C-contiguous array of x's size to write into (part of a larger buffer)."""
        c = x.shape[-1]
        rows = x.size // c
        y = self.cp.empty_like(x) if out is None else out
        w = weight if weight is not None else x
        args = (x, y, w, np.int64(rows), np.int32(c), np.int32(weight is not None), np.float32(eps),
                np.int32(ACT_CODES[activation]))
        if rms_vectorised(c, x.itemsize, (x.data.ptr, y.data.ptr, w.data.ptr)):
            per_block = BLOCK // (c // (16 // x.itemsize))
            self.fn("rms_rows_vec")((-(-rows // per_block),), (BLOCK,), args, shared_mem=4 * BLOCK)
        else:
            per_block = BLOCK // 32
            self.fn("rms_rows")(((rows + per_block - 1) // per_block,), (BLOCK,), args)
        return y

    def layer_norm(self, x, weight, bias, eps, activation, input_bias=None, vectorised=True):
        """act(LayerNorm(x + input_bias) * weight + bias) over the last axis; `input_bias` is a
        per-channel bias of the op before the norm, added here instead of in its own pass;
        vectorised=False never takes ln_rows_vec."""
        c = x.shape[-1]
        rows = x.size // c
        y = self.cp.empty_like(x)
        per_block = BLOCK // 32
        operands = [x, y] + [v for v in (weight, bias, input_bias) if v is not None]
        vec = ln_vectorised(c, x.itemsize, [v.data.ptr for v in operands], rows, enabled=vectorised)
        name = "ln_rows_vec" if vec else "ln_rows"
        self.fn(name)(((rows + per_block - 1) // per_block,), (BLOCK,), (
            x, y, weight if weight is not None else x, bias if bias is not None else x,
            input_bias if input_bias is not None else x,
            np.int64(rows), np.int32(c), np.int32(weight is not None), np.int32(bias is not None),
            np.int32(input_bias is not None), np.float32(eps), np.int32(ACT_CODES[activation])))
        return y

    def depthwise2d(self, x, wt, bias, residual, activation, stride, pad_lo, dilation, out_shape):
        """x (N,H,W,C), wt (KH,KW,C) contiguous -> act(conv + bias) + residual, (N,OH,OW,C)."""
        y = self.cp.empty(out_shape, dtype=x.dtype)
        n, h, w, c = x.shape
        kh, kw = wt.shape[0], wt.shape[1]
        total = y.size
        i32 = np.int32
        vec = 16 // x.itemsize
        operands = [x, wt, y] + [v for v in (bias, residual) if v is not None]
        if (tuple(stride) == (1, 1) and tuple(dilation) == (1, 1) and c % vec == 0
                and all(v.data.ptr % 16 == 0 for v in operands)):
            items = n * out_shape[1] * -(-out_shape[2] // DW_TW) * (c // vec)
            self.fn("dw2d_vec")((_grid(items),), (BLOCK,), (
                x, wt, bias if bias is not None else x, residual if residual is not None else x, y,
                i32(h), i32(w), i32(c), i32(out_shape[1]), i32(out_shape[2]), i32(kh), i32(kw),
                i32(pad_lo[0]), i32(pad_lo[1]), i32(bias is not None), i32(residual is not None),
                i32(ACT_CODES[activation]), np.int64(items)))
            return y
        self.fn("dw2d")((_grid(total),), (BLOCK,), (
            x, wt, bias if bias is not None else x, residual if residual is not None else x, y,
            i32(h), i32(w), i32(c), i32(out_shape[1]), i32(out_shape[2]), i32(kh), i32(kw),
            i32(stride[0]), i32(stride[1]), i32(pad_lo[0]), i32(pad_lo[1]), i32(dilation[0]), i32(dilation[1]),
            i32(bias is not None), i32(residual is not None), i32(ACT_CODES[activation]), np.int64(total)))
        return y

    def depthwise_layer_norm(self, x, wt, bias, norm_w, norm_b, eps, pad_lo):
        """LayerNorm(depthwise stride-1 'same' conv(x) + bias) over channels, one kernel; x
        (N,H,W,C), wt (KH,KW,C). The caller checks dw_ln_applies first."""
        y = self.cp.empty_like(x)
        n, h, w, c = x.shape
        pixels = n * h * w
        per_block = BLOCK // 32
        i32 = np.int32
        self.fn("dw_ln")(((pixels + per_block - 1) // per_block,), (BLOCK,), (
            x, wt, bias if bias is not None else x, norm_w, norm_b, y, i32(h), i32(w), i32(c),
            i32(wt.shape[0]), i32(wt.shape[1]), i32(pad_lo[0]), i32(pad_lo[1]), i32(bias is not None),
            np.float32(eps), np.int64(pixels)))
        return y

    def softmax_rows(self, x, scale: float = 1.0):
        """Softmax over the last axis of contiguous x (times `scale` first)."""
        length = x.shape[-1]
        rows = x.size // length
        y = self.cp.empty_like(x)
        if rows:
            self.fn("softmax_rows")((rows,), (BLOCK,), (x, y, np.int64(rows), np.int32(length),
                                                         np.float32(scale)))
        return y
