// Layout moves that copy bits as they are (any storage type).

// Where output row r = (n, t, Y) of a pixel shuffle over (ft, fh, .) reads: x's row (n, t0, y0) and
// the row's block offsets in time (i) and height (j). Shared by the shuffle kernels below.
struct ShuffleRow { const T* x; int i, j; };
__device__ __forceinline__ ShuffleRow shuffle_row(const T* x, long long r, int T_in, int H, int W, int Ci, int To,
                                                  int Ho, int ft, int fh, int start) {
    const int Y = (int)(r % Ho);
    const long long q = r / Ho;
    const int tt = (int)(q % To) + start;
    const long long n = q / To;
    const int t0 = tt / ft, y0 = Y / fh;
    return {x + ((n * T_in + t0) * H + y0) * (long long)W * Ci, tt - t0 * ft, Y - y0 * fh};
}

// Channels to space (TensorOps.pixel_shuffle) over 3 spatial axes: y (N, To, Ho, Wo, Co) from
// x (N, T, H, W, Ci), To = T*ft - start, Ho = H*fh, Wo = W*fw. Output channel o at block offsets
// (i, j, k) reads the repeated channel ((o*ft + i)*fh + j)*fw + k, which is input channel that
// over `repeats`. Blocks step over output rows (n, t, y) in y and over a row's Wo*Co elements in
// x, so each row's index split is done once and the writes are contiguous.
extern "C" __global__ void pixel_shuffle3(const T* x, T* y, long long rows, int T_in, int H, int W, int Ci,
                                          int To, int Ho, int Wo, int Co, int ft, int fh, int fw,
                                          int repeats, int start) {
    const int row_len = Wo * Co;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        const ShuffleRow sr = shuffle_row(x, r, T_in, H, W, Ci, To, Ho, ft, fh, start);
        const T* xr = sr.x;
        const int i = sr.i, j = sr.j;
        T* yr = y + r * (long long)row_len;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < row_len; e += gridDim.x * blockDim.x) {
            const int X = e / Co, o = e - X * Co;
            const int x0 = X / fw, k = X - x0 * fw;
            yr[e] = xr[(long long)x0 * Ci + (((o * ft + i) * fh + j) * fw + k) / repeats];
        }
    }
}

// upsample_conv2d's phase form (upsample.py): the four output phases, channel blocks of the
// 2x2 conv's y (N, H+1, W+1, 4C), to their places in out (N, 2H, 2W, C):
// out[n, 2i+a, 2j+b, c] = y[n, i+a, j+b, (2a+b)C + c], plus r[n, 2i+a, 2j+b, c] where has_r (added
// in float32, rounded once; r is any valid pointer otherwise). Blocks step over output rows (n, Y)
// in y and over a row's 2W*C elements in x, as pixel_shuffle3, so the writes are contiguous.
extern "C" __global__ void phase_interleave(const T* y, const T* r, T* out, long long rows, int H, int W, int C,
                                            int has_r) {
    const int row_len = 2 * W * C;
    for (long long q = blockIdx.y; q < rows; q += gridDim.y) {
        const int Y = (int)(q % (2 * H));
        const long long n = q / (2 * H);
        const int a = Y & 1, i = Y >> 1;
        const T* yr = y + (n * (H + 1) + i + a) * (long long)(W + 1) * 4 * C;
        const T* rr = r + q * (long long)row_len;
        T* orow = out + q * (long long)row_len;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < row_len; e += gridDim.x * blockDim.x) {
            const int X = e / C, c = e - X * C;
            const int b = X & 1, j = X >> 1;
            const T v = yr[(long long)(j + b) * 4 * C + (2 * a + b) * C + c];
            orow[e] = has_r ? st(ld(v) + ld(rr[e])) : v;
        }
    }
}

// The two copies above in 16-byte vectors, where a row's channels come in whole vectors (Kernels
// picks them): the scalar kernels split each element's index and move 2 bytes at a time, and
// pixel_shuffle3 reached about a sixth of the H100's bandwidth in a Wan 2.2 720p profile.
// pixel_shuffle3_vec: the repeat count divides ft*fh*fw, so output channel o reads input channel
// o*g + s (g = ft*fh*fw / repeats, s = the block offset's index / repeats): with g == 1 one
// vector load (Ci a whole number of vectors keeps it aligned), else a strided gather.
extern "C" __global__ void pixel_shuffle3_vec(const T* x, T* y, long long rows, int T_in, int H, int W, int Ci,
                                              int To, int Ho, int Wo, int Co, int ft, int fh, int fw,
                                              int repeats, int start) {
    const int g = ft * fh * fw / repeats, cv = Co / VEC, row_vecs = Wo * cv;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        const ShuffleRow sr = shuffle_row(x, r, T_in, H, W, Ci, To, Ho, ft, fh, start);
        const T* xr = sr.x;
        const int i = sr.i, j = sr.j;
        T* yr = y + r * (long long)Wo * Co;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < row_vecs; e += gridDim.x * blockDim.x) {
            const int X = e / cv, o = (e - X * cv) * VEC;
            const int x0 = X / fw, k = X - x0 * fw;
            const T* src = xr + (long long)x0 * Ci + o * g + ((i * fh + j) * fw + k) / repeats;
            union { uint4 u; T t[VEC]; } v;
            if (g == 1) {
                v.u = *reinterpret_cast<const uint4*>(src);
            } else {
#pragma unroll
                for (int p = 0; p < VEC; ++p) v.t[p] = src[p * g];
            }
            *reinterpret_cast<uint4*>(yr + (long long)e * VEC) = v.u;
        }
    }
}

// phase_interleave_vec: C a whole number of vectors, so a vector of output channels is one vector
// of one phase's block.
extern "C" __global__ void phase_interleave_vec(const T* y, const T* r, T* out, long long rows, int H, int W, int C,
                                                int has_r) {
    const int cv = C / VEC, row_vecs = 2 * W * cv;
    for (long long q = blockIdx.y; q < rows; q += gridDim.y) {
        const int Y = (int)(q % (2 * H));
        const long long n = q / (2 * H);
        const int a = Y & 1, i = Y >> 1;
        const T* yr = y + (n * (H + 1) + i + a) * (long long)(W + 1) * 4 * C;
        const T* rr = r + q * (long long)W * 2 * C;
        T* orow = out + q * (long long)W * 2 * C;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < row_vecs; e += gridDim.x * blockDim.x) {
            const int X = e / cv, c = (e - X * cv) * VEC;
            const int b = X & 1, j = X >> 1;
            const T* src = yr + (long long)(j + b) * 4 * C + (2 * a + b) * C + c;
            T* dst = orow + (long long)e * VEC;
            if (has_r) {
                float f[VEC], s[VEC];
                load_vec(src, f);
                load_vec(rr + (long long)e * VEC, s);
#pragma unroll
                for (int p = 0; p < VEC; ++p) f[p] += s[p];
                store_vec(dst, f);
            } else {
                *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
            }
        }
    }
}

// phase_interleave_vec with the residual a pixel_shuffle (Wan 2.2's DupUp3D shortcut, TensorOps.
// pixel_shuffle) read from its source where it lies, not from a shuffled copy of output size:
// x (N, T_in, H, W, Ci) shuffled by (ft, 2, 2) with `repeats`, dropping `start` leading frames, is
// To = T_in * ft - start frames of (2H, 2W, C); y and out hold N * To frames. Output channel o at
// offsets (i, a, b) (time, row, column) reads x's channel ((o*ft + i)*2 + a)*2 + b over `repeats`,
// i.e. o*g + s with g = 4 ft / repeats (a whole number) and s = ((i*2 + a)*2 + b) / repeats: one
// vector load where g == 1 (s is then 0), else a strided gather. Sums in float32, rounded once.
extern "C" __global__ void phase_interleave_shuffled_vec(const T* y, const T* x, T* out, long long rows, int H, int W,
                                                         int C, int T_in, int Ci, int To, int ft, int repeats,
                                                         int start) {
    const int cv = C / VEC, row_vecs = 2 * W * cv, g = ft * 4 / repeats;
    for (long long q = blockIdx.y; q < rows; q += gridDim.y) {
        const int Y = (int)(q % (2 * H));
        const long long f = q / (2 * H);
        const int a = Y & 1, i = Y >> 1;
        const T* yr = y + (f * (H + 1) + i + a) * (long long)(W + 1) * 4 * C;
        // the shortcut's source row: x's row i of the frame f's time step reads, time offset ti
        const ShuffleRow sr = shuffle_row(x, q, T_in, H, W, Ci, To, 2 * H, ft, 2, start);
        const T* xr = sr.x;
        const int ti = sr.i;
        T* orow = out + q * (long long)W * 2 * C;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < row_vecs; e += gridDim.x * blockDim.x) {
            const int X = e / cv, c = (e - X * cv) * VEC;
            const int b = X & 1, j = X >> 1;
            float fv[VEC], s[VEC];
            load_vec(yr + (long long)(j + b) * 4 * C + (2 * a + b) * C + c, fv);
            const T* sp = xr + (long long)j * Ci + c * g + ((ti * 2 + a) * 2 + b) / repeats;
            if (g == 1) {
                load_vec(sp, s);
            } else {
#pragma unroll
                for (int p = 0; p < VEC; ++p) s[p] = ld(sp[p * g]);
            }
#pragma unroll
            for (int p = 0; p < VEC; ++p) fv[p] += s[p];
            store_vec(orow + (long long)e * VEC, fv);
        }
    }
}

// TensorOps.pad over 3 spatial axes in one copy, each axis with its own mode: y (N, To, Ho, Wo, C)
// from x (N, T, H, W, C), To = pt + T + its after-pad, and so on; output line i of an axis reads x's
// line pad_src(i - before, n, mode): mode 0 zeros (-1: a zero), 1 replicate (the edge line), 2
// reflect (the edge not repeated; the pad is narrower than the axis, TensorOps checks it). LTX-2's
// 3x3x3 convs pad rows and columns by reflection and frames by replication: built in three copies,
// they were 43 % of its 720p decode's device time (one H200, 2026-11-29). Blocks step over output
// rows (n, t, y) in y and over a row's Wo*C elements in x, as pixel_shuffle3.
__device__ __forceinline__ int pad_src(int i, int n, int mode) {
    if (i >= 0 && i < n) return i;
    if (mode == 0) return -1;
    if (mode == 1) return i < 0 ? 0 : n - 1;
    return i < 0 ? -i : 2 * (n - 1) - i;
}

// Output row r = (n, t, Y) of pad3: x's row it reads, or null where the row is a zero pad.
__device__ __forceinline__ const T* pad_row(const T* x, long long r, int T_in, int H, int W, int C, int To, int Ho,
                                            int pt, int ph, int mt, int mh) {
    const int Y = (int)(r % Ho);
    const long long q = r / Ho;
    const int t = pad_src((int)(q % To) - pt, T_in, mt), h = pad_src(Y - ph, H, mh);
    return (t < 0 || h < 0) ? nullptr : x + ((q / To * T_in + t) * H + h) * (long long)W * C;
}

extern "C" __global__ void pad3(const T* x, T* y, long long rows, int T_in, int H, int W, int C, int To, int Ho,
                                int Wo, int pt, int ph, int pw, int mt, int mh, int mw) {
    const int row_len = Wo * C;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        const T* xr = pad_row(x, r, T_in, H, W, C, To, Ho, pt, ph, mt, mh);
        T* yr = y + r * (long long)row_len;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < row_len; e += gridDim.x * blockDim.x) {
            const int X = e / C, c = e - X * C;
            const int w = pad_src(X - pw, W, mw);
            yr[e] = (xr == nullptr || w < 0) ? (T)0 : xr[(long long)w * C + c];
        }
    }
}

// pad3 in 16-byte vectors, where C is a whole number of vectors (and x aligned): a vector of a
// line's channels is one load.
extern "C" __global__ void pad3_vec(const T* x, T* y, long long rows, int T_in, int H, int W, int C, int To, int Ho,
                                    int Wo, int pt, int ph, int pw, int mt, int mh, int mw) {
    const int cv = C / VEC, row_vecs = Wo * cv;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        const T* xr = pad_row(x, r, T_in, H, W, C, To, Ho, pt, ph, mt, mh);
        T* yr = y + r * (long long)Wo * C;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < row_vecs; e += gridDim.x * blockDim.x) {
            const int X = e / cv, o = (e - X * cv) * VEC;
            const int w = pad_src(X - pw, W, mw);
            uint4 v = {0u, 0u, 0u, 0u};
            if (xr != nullptr && w >= 0) v = *reinterpret_cast<const uint4*>(xr + (long long)w * C + o);
            *reinterpret_cast<uint4*>(yr + (long long)e * VEC) = v;
        }
    }
}
