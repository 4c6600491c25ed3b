// One element per thread, grid-stride: the conv epilogue and the casts for the host.

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

// y[r, c] = x[r, c] * act(x[r, h + c]) for rows of 2h channels: a gated linear unit's halves
// (DC-AE's GLUMBConv), read in place and rounded once. Sliced, activated and multiplied, the gate
// half was copied to be contiguous, activated into a new array and read again: 7 passes over a
// half where this makes 3.
extern "C" __global__ void gated(const T* x, T* y, long long n, int h, int a) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / h;
        const int c = (int)(i - r * h);
        const T* row = x + r * 2 * h;
        y[i] = st(ld(row[c]) * act(ld(row[h + c]), a));
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
// into an FMA), as NumPy computes it on the host (convkernels.host.pixels_to_uint8); the sum
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

