// ReLU linear attention (models/nn/linear_attention.py) in two kernels that read q, k and v of each
// group straight from the channels-last projections (N, T, G * 3d: per group [q | k | v], d channels
// each) in their storage type and compute in float32. The generic route cast the whole buffer to
// float32, transposed and sliced it: its copies were about 40 of the 63 ms of a DC-AE 1024^2 bf16
// decode on one H200 (2026-11-29), for sums that are a few KiB a group.
// The projections may lie in two buffers, as DC-AE's base projection and its multiscale one: groups
// g < G1 in `qkv` (N, T, G1 * 3d), the rest in `qkv2` (N, T, (G - G1) * 3d), the order of their
// concatenation, which is then never made (one buffer: G1 = G, qkv2 = qkv). The concatenation's copies
// were among the 27 bfloat16 copies (2.0 ms) of a 24.7 ms DC-AE 1024^2 decode's profile (one H200, 2026-11-29).
// Launch: blockDim.x 256; grid.y runs over n * G + g (both kernels).

// Where group g's [q | k | v] of token 0 of image n starts, and the row stride of its buffer.
__device__ __forceinline__ const T* la_group(const T* qkv, const T* qkv2, int G, int G1, int d, long long n,
                                             long long tokens, int g, long long* stride) {
    const bool first = g < G1;
    const long long C = (long long)(first ? G1 : G - G1) * 3 * d;
    *stride = C;
    return (first ? qkv : qkv2) + n * tokens * C + (long long)(first ? g : g - G1) * 3 * d;
}

#define LA_TT 32    // tokens per shared-memory tile of la_sums
#define LA_MAXD 64  // the largest head dimension (the wrapper checks)
#define LA_MAXO 17  // sums per thread: ceil(LA_MAXD * (LA_MAXD + 1) / 256)

// Partial sums over one chunk of tokens (grid.x) of one (n, g): S[i][j] = scale * sum_t relu(k[t][i])
// * [v | 1][t][j], written to part[(n * G + g) * chunks + chunk][d][d + 1]. The caller adds the
// chunks in order: deterministic, no atomics.
extern "C" __global__ void la_sums(const T* qkv, const T* qkv2, float* part, long long tokens, int G, int G1,
                                   int d, long long chunk, float scale) {
    __shared__ float ks[LA_TT][LA_MAXD];
    __shared__ float vs[LA_TT][LA_MAXD + 1];
    const int ng = blockIdx.y, g = ng % G;
    const long long n = ng / G;
    long long C;
    const T* base = la_group(qkv, qkv2, G, G1, d, n, tokens, g, &C) + d;  // this group's k, then its v
    const int outs = d * (d + 1);
    float acc[LA_MAXO];
#pragma unroll
    for (int r = 0; r < LA_MAXO; ++r) acc[r] = 0.0f;
    const long long t0 = (long long)blockIdx.x * chunk;
    const long long t1 = t0 + chunk < tokens ? t0 + chunk : tokens;
    for (long long tb = t0; tb < t1; tb += LA_TT) {
        const int tt = t1 - tb < LA_TT ? (int)(t1 - tb) : LA_TT;
        for (int e = threadIdx.x; e < LA_TT * 2 * d; e += blockDim.x) {
            const int t = e / (2 * d), i = e % (2 * d);
            const float v = t < tt ? ld(base[(tb + t) * C + i]) : 0.0f;
            if (i < d) ks[t][i] = v > 0.0f ? v : 0.0f;
            else vs[t][i - d] = v;
        }
        for (int t = threadIdx.x; t < LA_TT; t += blockDim.x) vs[t][d] = t < tt ? 1.0f : 0.0f;
        __syncthreads();
#pragma unroll
        for (int r = 0; r < LA_MAXO; ++r) {
            const int o = threadIdx.x + r * blockDim.x;
            if (o < outs) {
                const int i = o / (d + 1), j = o % (d + 1);
                float a = acc[r];
                for (int t = 0; t < LA_TT; ++t) a = fmaf(ks[t][i], vs[t][j], a);
                acc[r] = a;
            }
        }
        __syncthreads();
    }
    float* out = part + ((long long)ng * gridDim.x + blockIdx.x) * outs;
#pragma unroll
    for (int r = 0; r < LA_MAXO; ++r) {
        const int o = threadIdx.x + r * blockDim.x;
        if (o < outs) out[o] = acc[r] * scale;
    }
}

// out[n, t, g * d + j] = (sum_i relu(q[t][i]) S[i][j]) / (sum_i relu(q[t][i]) S[i][d] + eps), S the
// (n, g) sums (float32, N, G, d, d + 1) in shared memory; a block takes `per_block` tokens (grid.x),
// a warp one token at a time.
extern "C" __global__ void la_apply(const T* qkv, const T* qkv2, const float* sums, T* y, long long tokens,
                                    int G, int G1, int d, float eps, long long per_block) {
    __shared__ float S[LA_MAXD * (LA_MAXD + 1)];
    __shared__ float qs[8][LA_MAXD];
    const int ng = blockIdx.y, g = ng % G;
    const long long n = ng / G;
    long long C;
    const T* q0 = la_group(qkv, qkv2, G, G1, d, n, tokens, g, &C);  // this group's q of token 0
    const int outs = d * (d + 1);
    for (int e = threadIdx.x; e < outs; e += blockDim.x) S[e] = sums[(long long)ng * outs + e];
    __syncthreads();
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long start = (long long)blockIdx.x * per_block;
    const long long end = start + per_block < tokens ? start + per_block : tokens;
    for (long long t = start + w; t < end; t += 8) {
        const T* qp = q0 + t * C;
        for (int i = lane; i < d; i += 32) {
            const float v = ld(qp[i]);
            qs[w][i] = v > 0.0f ? v : 0.0f;
        }
        __syncwarp();
        float den = 0.0f;
        for (int i = 0; i < d; ++i) den = fmaf(qs[w][i], S[i * (d + 1) + d], den);
        den += eps;
        T* yp = y + (n * tokens + t) * ((long long)G * d) + (long long)g * d;
        for (int j = lane; j < d; j += 32) {
            float a = 0.0f;
            for (int i = 0; i < d; ++i) a = fmaf(qs[w][i], S[i * (d + 1) + j], a);
            yp[j] = st(a / den);
        }
        __syncwarp();
    }
}
