// Layout moves that copy bits as they are (any storage type).

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
        const int Y = (int)(r % Ho);
        const long long q = r / Ho;
        const int tt = (int)(q % To) + start;
        const long long n = q / To;
        const int t0 = tt / ft, i = tt - t0 * ft, y0 = Y / fh, j = Y - y0 * fh;
        const T* xr = x + ((n * T_in + t0) * H + y0) * (long long)W * Ci;
        T* yr = y + r * (long long)row_len;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < row_len; e += gridDim.x * blockDim.x) {
            const int X = e / Co, o = e - X * Co;
            const int x0 = X / fw, k = X - x0 * fw;
            yr[e] = xr[(long long)x0 * Ci + (((o * ft + i) * fh + j) * fw + k) / repeats];
        }
    }
}

// upsample_conv2d's phase form (cuda_upsample.py): the four output phases, channel blocks of the
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
