"""Runs the exact Metal body of the depthwise_tail kernel (mlx_metal.render_source) on the CPU:
compiled as C++ with a few shims (uint3, `threadgroup` storage, threadgroup_barrier as a
std::barrier) and executed with one OS thread per Metal thread of a threadgroup, threadgroups
one after another. Catches what the NumPy emulation cannot: typos, wrong operand order, a
return before the barrier (that deadlocks: the test times out), reads past the tile."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from torch_reference import fresh_rng, ref_conv, rel_l2  # noqa: E402

from convkernels.backends.mlx import metal as mlx_metal  # noqa: E402

HARNESS = r"""
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

struct uint3 { unsigned x, y, z; };
#define threadgroup static  // one tile shared by the threads of the running threadgroup
#define device
enum class mem_flags { mem_threadgroup };
static std::barrier<>* tg_barrier;
inline void threadgroup_barrier(mem_flags) { tg_barrier->arrive_and_wait(); }
typedef float T;

static void kernel_body(const device T* x, const device T* wt, const device float* bias,
                        const device int32_t* dims, device T* out,
                        uint3 threadgroup_position_in_grid, uint3 thread_position_in_threadgroup) {
#include "body.inc"
}

template <typename V> static std::vector<V> read(size_t n) {
  std::vector<V> v(n);
  if (n && fread(v.data(), sizeof(V), n, stdin) != n) { fprintf(stderr, "short read\n"); std::exit(2); }
  return v;
}

int main() {
  auto hdr = read<int32_t>(16);  // N,H,W,C,OH,OW,PT,PL, grid x,y,z, tg x,y,z, taps, pad
  int N = hdr[0], H = hdr[1], W = hdr[2], C = hdr[3], OH = hdr[4], OW = hdr[5];
  int gx = hdr[8], gy = hdr[9], gz = hdr[10], tx = hdr[11], ty = hdr[12], tz = hdr[13], taps = hdr[14];
  auto x = read<float>((size_t)N * H * W * C);
  auto wt = read<float>((size_t)taps * C);
  auto bias = read<float>(C);
  int32_t dims[7] = {H, W, C, OH, OW, hdr[6], hdr[7]};
  std::vector<float> out((size_t)N * OH * OW * C, -12345.0f);  // unwritten outputs stay visible
  int nthreads = tx * ty * tz;
  std::barrier<> inner(nthreads), outer(nthreads);
  tg_barrier = &inner;
  std::vector<std::thread> pool;
  for (int t = 0; t < nthreads; ++t) {
    pool.emplace_back([&, t] {
      uint3 lid{(unsigned)(t % tx), (unsigned)((t / tx) % ty), (unsigned)(t / (tx * ty))};
      for (int bz = 0; bz < gz / tz; ++bz)
        for (int by = 0; by < gy / ty; ++by)
          for (int bx = 0; bx < gx / tx; ++bx) {
            kernel_body(x.data(), wt.data(), bias.data(), dims, out.data(),
                        uint3{(unsigned)bx, (unsigned)by, (unsigned)bz}, lid);
            outer.arrive_and_wait();  // the next threadgroup's load must not overwrite this tile early
          }
    });
  }
  for (auto& th : pool) th.join();
  fwrite(out.data(), sizeof(float), out.size(), stdout);
  return 0;
}
"""


def compile_kernel(tmp_path, tiling, has_bias):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to run the Metal body on the CPU")
    (tmp_path / "body.inc").write_text(mlx_metal.render_source(tiling, has_bias))
    (tmp_path / "harness.cpp").write_text(HARNESS)
    exe = tmp_path / "kernel"
    res = subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-w", "-o", str(exe), "harness.cpp"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    if res.returncode != 0 and "barrier" in res.stderr and "No such file" in res.stderr:
        pytest.skip("C++ standard library without <barrier>")
    assert res.returncode == 0, f"the Metal body does not compile:\n{res.stderr[-4000:]}"
    return exe


# (N, H, W, C, kernel, stride, pad_top, pad_left, pad_bottom, pad_right, bias)
CASES = [
    (1, 15, 15, 16, 3, 1, 1, 1, 1, 1, True),     # PR 3446's 15x15
    (2, 7, 7, 16, 7, 1, 3, 3, 3, 3, False),      # ConvNeXt's last stage
    (1, 14, 14, 24, 7, 1, 3, 3, 3, 3, True),
    (1, 15, 17, 20, 3, 2, 0, 1, 1, 0, True),     # stride 2, asymmetric padding, C not a multiple of 8
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}x{c[2]}-k{c[4]}-s{c[5]}-c{c[3]}")
def test_metal_body_runs_as_cpp_and_matches_torch(tmp_path, case):
    n, h, w, c, k, s, pt, pl, pb, pr, has_bias = case
    oh, ow = (h + pt + pb - k) // s + 1, (w + pl + pr - k) // s + 1
    tiling = mlx_metal.DepthwiseTiling(k, k, s, s)
    exe = compile_kernel(tmp_path, tiling, has_bias)
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    wt = rng.standard_normal((c, k, k, 1)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    grid, tg = tiling.grid(n, c, oh, ow), tiling.threadgroup
    hdr = np.array([n, h, w, c, oh, ow, pt, pl, *grid, *tg, k * k, 0], np.int32)
    taps = np.ascontiguousarray(wt.reshape(c, k * k).T)  # (KH*KW, C), as the runner passes it
    payload = hdr.tobytes() + x.tobytes() + taps.tobytes() + b.tobytes()
    res = subprocess.run([str(exe)], input=payload, capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    out = np.frombuffer(res.stdout, np.float32).reshape(n, oh, ow, c)
    assert not (out == -12345.0).any(), "some outputs were never stored"
    ref = ref_conv(x, wt, b if has_bias else None, (s, s), ((pt, pb), (pl, pr)), (1, 1), c)
    assert rel_l2(out, ref) < 1e-5, f"seed {seed}"
