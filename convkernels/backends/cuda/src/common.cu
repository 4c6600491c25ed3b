// Shared by every kernel of kernels.py, compiled once per storage dtype with -DDT=0 (float32),
// 1 (float16) or 2 (bfloat16): the storage type T and its loads/stores to float (half types are
// unsigned short bit patterns converted in registers, so no cuda_fp16.h / cuda_bf16.h include is
// needed), the activations, warp and block reductions, and 16-byte vector loads and stores.

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
#if __CUDA_ARCH__ >= 800
    // one instruction where the chip has it (sm80 on): with the rounding below, a bf16 RMS norm +
    // SiLU was compute-bound on an H100 (benchmarks/gpu/rms_norm_bandwidth.py, benchmarks/RESULTS.md)
    unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
#else
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (T)0x7fc0;   // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                          // round to nearest even
    return (T)(u >> 16);
#endif
}
#endif

__device__ __forceinline__ float act(float v, int a) {
#if DT == 0
    if (a == 1) return v / (1.0f + expf(-v));
#else
    // half storage: the fast exponential and reciprocal (about 1e-5 relative at worst, far below
    // a half type's rounding); the exact pair made bf16 RMS + SiLU compute-bound on an H100
    if (a == 1) return v * __frcp_rn(1.0f + __expf(-v));
#endif
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

