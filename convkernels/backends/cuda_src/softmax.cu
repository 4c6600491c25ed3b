// Row softmax of the attention scores.

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
