// Depthwise 2-d convs, channels-last, weights pre-transposed to (KH, KW, C); dw_ln holds a row
// in registers as ln_rows_vec does (row_stats, LN_MAXV: norms.cu). Last, grouped 1x1 convs of small
// groups (grouped_pw).

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


// A grouped 1x1 conv (stride 1, no padding) of at most GP_MAXC input and output channels a group,
// channels-last: DC-AE's multiscale projection, 3 x heads groups of head_dim. cuDNN ran it as one
// sliced GEMM per group (hundreds of launches a layer) or a direct kernel of 2 ms a layer (one
// H200, 2026-11-29). One block per tile of GP_TT pixels (grid.x) and group (grid.y): the group's
// weights (og, 1, 1, cg) and the tile's inputs in shared memory, float32 sums, then
// act(sum + bias) + residual as the other conv epilogues.
#define GP_TT 64
#define GP_MAXC 64
extern "C" __global__ void grouped_pw(const T* x, const T* w, const T* bias, const T* res, T* y, long long P,
                                      int G, int cg, int og, int has_bias, int has_res, int a) {
    __shared__ float ws[GP_MAXC * (GP_MAXC + 1)];  // [o][i], rows padded against bank conflicts
    __shared__ float xs[GP_TT][GP_MAXC + 1];
    const int g = blockIdx.y;
    const long long p0 = (long long)blockIdx.x * GP_TT;
    const long long cin = (long long)G * cg, cout = (long long)G * og;
    for (int e = threadIdx.x; e < og * cg; e += blockDim.x) {
        const int o = e / cg, i = e % cg;
        ws[o * (cg + 1) + i] = ld(w[((long long)g * og + o) * cg + i]);
    }
    for (int e = threadIdx.x; e < GP_TT * cg; e += blockDim.x) {
        const int p = e / cg, i = e % cg;
        xs[p][i] = p0 + p < P ? ld(x[(p0 + p) * cin + (long long)g * cg + i]) : 0.0f;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < GP_TT * og; e += blockDim.x) {
        const int p = e / og, o = e % og;
        if (p0 + p >= P) continue;
        float s = 0.0f;
        for (int i = 0; i < cg; ++i) s = fmaf(xs[p][i], ws[o * (cg + 1) + i], s);
        const long long at = (p0 + p) * cout + (long long)g * og + o;
        if (has_bias) s += ld(bias[g * og + o]);
        s = act(s, a);
        if (has_res) s += ld(res[at]);
        y[at] = st(s);
    }
}
