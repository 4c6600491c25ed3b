// GroupNorm, RMS norm and LayerNorm over the channels-last last axis, arithmetic in float32.

// ---- GroupNorm over channels-last x (N, S, C) in two passes, fp32 in registers, statistics in
// fp64. A block covers one chunk of rows of one batch item; its threads own fixed columns of
// VEC channels (one 16-byte load each when vec != 0, i.e. C % VEC == 0; one channel otherwise)
// and walk the chunk's rows, several rows side by side when a row has fewer columns than threads.

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

// RMS norm over the last axis (Wan's norm): one warp per row, y = act(x * rsqrt(mean(x^2) + eps) * w + b)
// + res (b and res where has_b / has_r: DC-AE's norm with a bias before its block's residual; res
// is read in x's row layout).
// y's rows may lie in groups of `grp` rows every `gstride` rows (grp == gstride: contiguous): a
// piece of a larger buffer, e.g. a band of rows of every frame of a video (a sharded conv's halo
// rows and its own, each written where the joined input would hold it).
__device__ __forceinline__ long long out_row(long long row, long long grp, long long gstride) {
    return grp == gstride ? row : (row / grp) * gstride + row % grp;
}

extern "C" __global__ void rms_rows(const T* x, T* y, const T* w, long long rows, int C, int has_w,
                                    float eps, int a, long long grp, long long gstride, const T* b,
                                    const T* res, int has_b, int has_r) {
    long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + row * C;
    T* yr = y + out_row(row, grp, gstride) * C;
    float q = 0.0f;
    for (int c = lane; c < C; c += 32) { float v = ld(xr[c]); q += v * v; }
    float r = rsqrtf(warp_sum(q) / C + eps);
    for (int c = lane; c < C; c += 32) {
        float v = ld(xr[c]) * r;
        if (has_w) v *= ld(w[c]);
        if (has_b) v += ld(b[c]);
        v = act(v, a);
        if (has_r) v += ld(res[row * C + c]);
        yr[c] = st(v);
    }
}

// The same RMS norm when C % VEC == 0, C / VEC <= blockDim and the buffers are 16-byte aligned:
// one 16-byte vector per thread, a row on C / VEC consecutive threads (rows may straddle warps, so
// the row's sum goes through shared memory), x read once. Wan's C = 96 fills 12 of a warp's lanes
// in rms_rows' layout; here every thread of a block but a few carries a vector.
extern "C" __global__ void rms_rows_vec(const T* x, T* y, const T* w, long long rows, int C, int has_w,
                                        float eps, int a, long long grp, long long gstride, const T* b,
                                        const T* res, int has_b, int has_r) {
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
    float s = 0.0f;
    if ((nv & 31) == 0) {
        // rows of whole warps (Wan 2.2's 256 to 1024 channels): each warp sums its lanes by
        // shuffles, then a row adds its nv / 32 warps' sums, not nv partial sums one by one
        q = warp_sum(q);
        if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = q;
        __syncthreads();
        if (!live) return;
        const float* pw = part + ((local * nv) >> 5);
        for (int i = 0; i < (nv >> 5); ++i) s += pw[i];
    } else {
        part[threadIdx.x] = q;
        __syncthreads();
        if (!live) return;
        const float* pr = part + local * nv;
        for (int i = 0; i < nv; ++i) s += pr[i];
    }
    float r = rsqrtf(s / C + eps);
    float wv[VEC], bv[VEC], rv[VEC];
    if (has_w) load_vec(w + cv * VEC, wv);
    if (has_b) load_vec(b + cv * VEC, bv);
    if (has_r) load_vec(res + row * C + cv * VEC, rv);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        float o = v[j] * r;
        if (has_w) o *= wv[j];
        if (has_b) o += bv[j];
        o = act(o, a);
        v[j] = has_r ? o + rv[j] : o;
    }
    store_vec(y + out_row(row, grp, gstride) * C + cv * VEC, v);
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

