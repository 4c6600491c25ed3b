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
