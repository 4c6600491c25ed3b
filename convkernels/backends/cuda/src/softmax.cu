// Row softmax of the attention scores.

// The scores' loads: T (softmax_rows), or float32 (softmax_rows_f32, bfloat16 attention's scores).
template <typename In> __device__ __forceinline__ float score(In v) { return ld(v); }
template <> __device__ __forceinline__ float score<float>(float v) { return v; }

// One row of length L, of x * scale, by one 256-thread block: its maximum and the reciprocal of
// its sum of exp(x * scale - max), which both softmax kernels normalise by.
template <typename In>
__device__ __forceinline__ void row_max_inv_sum(const In* xr, int L, float scale, float* sh, float& m, float& inv) {
    m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < L; j += blockDim.x) m = fmaxf(m, score(xr[j]) * scale);
    m = block_max(m, sh);
    float s = 0.0f;
    for (int j = threadIdx.x; j < L; j += blockDim.x) s += expf(score(xr[j]) * scale - m);
    s = block_sum(s, sh);
    inv = 1.0f / s;
}

// Softmax over rows of length L, of x * scale: one 256-thread block per row.
extern "C" __global__ void softmax_rows(const T* x, T* y, long long rows, int L, float scale) {
    __shared__ float sh[32];
    long long row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + row * L;
    T* yr = y + row * L;
    float m, inv;
    row_max_inv_sum(xr, L, scale, sh, m, inv);
    for (int j = threadIdx.x; j < L; j += blockDim.x) yr[j] = st(expf(ld(xr[j]) * scale - m) * inv);
}

// bfloat16 attention's softmax, of float32 scores: bfloat16's 8-bit mantissa would round a score
// of 100 to a multiple of 0.5, so the scores stay float32 (cuBLAS writes them so). Each
// probability p leaves as two bfloat16 values, hi = p rounded and lo = p - hi rounded, in the two
// halves of a row of 2L: the second product multiplies [hi | lo] by [v; v] and so sums p v with
// 16 bits of p, not 8. With hi alone the attention's error was 1.4x PyTorch's own bfloat16
// attention's (whose kernels keep p in float32); with both it is PyTorch's.
extern "C" __global__ void softmax_rows_f32(const float* x, T* y, long long rows, int L, float scale) {
    __shared__ float sh[32];
    long long row = blockIdx.x;
    if (row >= rows) return;
    const float* xr = x + row * L;
    T* yr = y + row * 2 * (long long)L;
    float m, inv;
    row_max_inv_sum(xr, L, scale, sh, m, inv);
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        const float p = expf(xr[j] * scale - m) * inv;
        const T hi = st(p);
        yr[j] = hi;
        yr[L + j] = st(p - ld(hi));
    }
}
