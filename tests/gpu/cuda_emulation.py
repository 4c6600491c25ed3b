"""The CPU emulation of the CUDA backend's kernels (cuda/kernels.py's SOURCE, compiled as C++):
one host thread per CUDA thread of a block (the same threads run the blocks one after another),
a barrier for __syncthreads, a barrier per warp for warp shuffles,
locked atomics. A test adds `extern "C"` runners that launch its kernels with the grid the
backend's wrapper uses, and calls them through ctypes, where there is no GPU."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from convkernels.backends.cuda.kernels import BLOCK, DTYPE_CODES, SOURCE

PRELUDE = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint4 { unsigned x, y, z, w; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static std::barrier<>* g_bar;
static std::mutex g_atomic;
static unsigned char g_smem[48 * 1024];

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline double atomicAdd(double* p, double v) { std::lock_guard<std::mutex> l(g_atomic); double o = *p; *p = o + v; return o; }
// a warp's shuffle: the 32 threads of a warp meet at their warp's barrier (a warp that returns
// early, as a LayerNorm warp past the last row does, leaves the others' barriers alone)
static std::barrier<>* g_warp_bar[32];
static float g_shfl[1024];
static inline float __shfl_xor_sync(unsigned, float v, int o) {
    std::barrier<>* bar = g_warp_bar[threadIdx.x >> 5];
    g_shfl[threadIdx.x] = v;
    bar->arrive_and_wait();
    float r = g_shfl[threadIdx.x ^ o];
    bar->arrive_and_wait();
    return r;
}
// a warp's threads meet (its barrier; every kernel here calls it on all 32 lanes)
static inline void __syncwarp(unsigned = 0xffffffffu) { g_warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
static inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
// one IEEE rounding each (x86-64 without -mfma never contracts them); NaN -> 0 as PTX's cvt.rzi
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __frcp_rn(float v) { return 1.0f / v; }
#define __expf(v) std::exp(v)  // glibc declares a __expf of its own
static inline unsigned __float2uint_rz(float v) {
    return v != v || v <= 0.0f ? 0u : (v >= 4294967295.0f ? 4294967295u : (unsigned)v);
}

SOURCE

// The blocks run one after another, each block's threads together. A block's threads are the
// same host threads block after block (started once a launch, not once a block: a GroupNorm
// launch of 264 blocks started 67,000 threads), and a block starts once every thread has left
// the one before (they share g_smem). The barriers are reused: each of a block's __syncthreads
// (and each warp's shuffle) is one phase of its barrier, as it was on the block's own barrier.
template <typename K>
static void launch(dim3 grid, K body) {
    gridDim = grid;
    std::barrier<> bar(blockDim.x);
    std::barrier<> block_done(blockDim.x);
    g_bar = &bar;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) {
        warps.emplace_back(new std::barrier<>(32));
        g_warp_bar[w] = warps.back().get();
    }
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < blockDim.x; ++t)
        ts.emplace_back([=, &block_done] {
            threadIdx.x = t;
            for (unsigned by = 0; by < grid.y; ++by)
                for (unsigned bx = 0; bx < grid.x; ++bx) {
                    blockIdx.x = bx;
                    blockIdx.y = by;
                    body();
                    block_done.arrive_and_wait();
                }
        });
    for (auto& th : ts) th.join();
}
"""


def build(tmp_path_factory, runners: str, dtype: str = "float32") -> ctypes.CDLL:
    """The kernels of `dtype`'s build (T: float, or the half types' uint16 bit patterns) with
    `runners` after them; skips where there is no C++20 compiler."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the emulation")
    src = SOURCE.replace("extern __shared__ double shg[];", "double* shg = (double*)g_smem;")
    src = src.replace("extern __shared__ float shm[];", "float* shm = (float*)g_smem;")
    src = src.replace("extern __shared__ float part[];", "float* part = (float*)g_smem;")
    assert "extern __shared__" not in src, "a kernel with dynamic shared memory the harness does not map"
    code = (PRELUDE.replace("SOURCE", src) + runners).replace("BLOCK_THREADS", str(BLOCK))
    d = tmp_path_factory.mktemp("cuda_emulation")
    (d / "k.cpp").write_text(f"#define DT {DTYPE_CODES[dtype]}\n" + code)
    out = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(d / "k.cpp"),
                          "-o", str(d / "k.so")], capture_output=True, text=True)
    if out.returncode:
        if "barrier" in out.stderr and "No such file" in out.stderr:
            pytest.skip("the C++ compiler has no <barrier>")
        raise AssertionError(out.stderr[-4000:])
    return ctypes.CDLL(str(d / "k.so"))
