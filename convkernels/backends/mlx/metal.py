"""Tail-aware depthwise conv2d as an `mx.fast.metal_kernel` (seed: MLX PR 3446).

MLX before 0.32.0 only sends a depthwise conv2d to its Metal depthwise kernel when both output
sizes are multiples of 8; 60x60, 30x30, 15x15 and ConvNeXt's 28/14/7 fall to the generic gemm.
This kernel tiles the output in (TC channels, TW columns, TH rows) threadgroups with a ceil-div
grid, so tail tiles are launched; threads past the output still help fill the shared-memory
input tile (the load is bounds-checked), and only the final store is guarded.

The index math is written once, below, as Python-syntax integer expressions. `render_source`
turns them into the Metal body; the tests evaluate the very same expressions with NumPy over
the whole thread grid (tests/mlx_metal_emulation.py). That emulation is how the tiling is tested
on machines without Metal (coverage of every output exactly once, each tap reading the right input).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Threadgroup shape: channels fastest (coalesced NHWC loads), then columns, then rows.
TC, TW, TH = 8, 8, 4

# Per threadgroup (all names on the right are ints; divisions only on non-negative values,
# where Python's // and Metal's / agree).
GROUP_STMTS = (
    ("tiles_h", "(OH + TH - 1) // TH"),
    ("n", "tg_z // tiles_h"),
    ("oh0", "(tg_z % tiles_h) * TH"),
    ("ow0", "tg_y * TW"),
    ("c0", "tg_x * TC"),
    ("ih0", "oh0 * SH - PT"),
    ("iw0", "ow0 * SW - PL"),
    ("lin", "(lid_z * TW + lid_y) * TC + lid_x"),
)
# Per shared-tile element i (every thread loads elements lin, lin + NT, ... below TILE).
LOAD_STMTS = (
    ("lc", "i % TC"),
    ("lw", "(i // TC) % TGW"),
    ("lh", "i // (TC * TGW)"),
    ("ih", "ih0 + lh"),
    ("iw", "iw0 + lw"),
    ("ci", "c0 + lc"),
)
LOAD_IN_BOUNDS = "(ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & (ci < C)"
LOAD_SRC = "((n * H + ih) * W + iw) * C + ci"
# Per thread after the barrier: its output element, the store guard, and its taps.
STORE_STMTS = (
    ("oh", "oh0 + lid_z"),
    ("ow", "ow0 + lid_y"),
    ("co", "c0 + lid_x"),
)
STORE_GUARD = "(oh < OH) & (ow < OW) & (co < C)"
TAP_TILE = "((lid_z * SH + kh) * TGW + lid_y * SW + kw) * TC + lid_x"
TAP_WEIGHT = "(kh * KW + kw) * C + co"
STORE_DST = "((n * OH + oh) * OW + ow) * C + co"

_ALL_EXPRS = [e for _, e in GROUP_STMTS + LOAD_STMTS + STORE_STMTS] + [
    LOAD_IN_BOUNDS, LOAD_SRC, STORE_GUARD, TAP_TILE, TAP_WEIGHT, STORE_DST]
# A lone '/' would be float division in Python but integer division in Metal.
assert not any(re.search(r"(?<!/)/(?!/)", e) for e in _ALL_EXPRS), "use // in the shared index math"


@dataclass(frozen=True)
class DepthwiseTiling:
    """Compile-time geometry of one kernel instance: kernel size and stride."""

    kh: int
    kw: int
    sh: int
    sw: int

    @property
    def tgh(self) -> int:
        return (TH - 1) * self.sh + self.kh

    @property
    def tgw(self) -> int:
        return (TW - 1) * self.sw + self.kw

    @property
    def tile_elems(self) -> int:
        return self.tgh * self.tgw * TC

    @property
    def threads(self) -> int:
        return TC * TW * TH

    @property
    def threadgroup(self) -> tuple[int, int, int]:
        return (TC, TW, TH)

    def groups(self, n: int, c: int, oh: int, ow: int) -> tuple[int, int, int]:
        """Threadgroups per axis (x: channel tiles, y: column tiles, z: row tiles x batch)."""
        return (-(-c // TC), -(-ow // TW), -(-oh // TH) * n)

    def grid(self, n: int, c: int, oh: int, ow: int) -> tuple[int, int, int]:
        """Threads per axis for dispatchThreads: whole threadgroups only, so no tail thread is
        missing from the cooperative shared-memory load."""
        gx, gy, gz = self.groups(n, c, oh, ow)
        return (gx * TC, gy * TW, gz * TH)

    def constants(self) -> dict[str, int]:
        return {"KH": self.kh, "KW": self.kw, "SH": self.sh, "SW": self.sw, "TC": TC, "TW": TW, "TH": TH,
                "TGH": self.tgh, "TGW": self.tgw, "TILE": self.tile_elems, "NT": self.threads}


def _metal(expr: str) -> str:
    return expr.replace("//", "/")


def render_source(tiling: DepthwiseTiling, has_bias: bool) -> str:
    """The Metal body for mx.fast.metal_kernel (inputs x, wt, bias, dims; output out)."""
    lines = [f"constexpr int {k} = {v};" for k, v in tiling.constants().items()]
    lines.append("threadgroup T tile[TILE];")
    for i, name in enumerate(("H", "W", "C", "OH", "OW", "PT", "PL")):
        lines.append(f"const int {name} = dims[{i}];")
    for axis in "xyz":
        lines.append(f"const int tg_{axis} = int(threadgroup_position_in_grid.{axis});")
        lines.append(f"const int lid_{axis} = int(thread_position_in_threadgroup.{axis});")
    lines += [f"const int {k} = {_metal(e)};" for k, e in GROUP_STMTS]
    lines.append("for (int i = lin; i < TILE; i += NT) {")
    lines += [f"  const int {k} = {_metal(e)};" for k, e in LOAD_STMTS]
    lines.append(f"  tile[i] = ({_metal(LOAD_IN_BOUNDS)}) ? x[{_metal(LOAD_SRC)}] : T(0);")
    lines.append("}")
    lines.append("threadgroup_barrier(mem_flags::mem_threadgroup);")
    lines += [f"const int {k} = {_metal(e)};" for k, e in STORE_STMTS]
    # Past-the-end threads leave only here, after the barrier they had to reach.
    lines.append(f"if (!({_metal(STORE_GUARD)})) return;")
    lines.append("float acc = " + ("float(bias[co]);" if has_bias else "0.0f;"))
    lines.append("for (int kh = 0; kh < KH; ++kh) {")
    lines.append("  for (int kw = 0; kw < KW; ++kw) {")
    lines.append(f"    acc += float(tile[{_metal(TAP_TILE)}]) * float(wt[{_metal(TAP_WEIGHT)}]);")
    lines.append("  }")
    lines.append("}")
    lines.append(f"out[{_metal(STORE_DST)}] = T(acc);")
    return "\n".join(lines)


_KERNELS: dict[tuple[DepthwiseTiling, bool], Any] = {}


def depthwise_metal(x, w, bias, out_hw: tuple[int, int], pad_top: int, pad_left: int, stride: tuple[int, int]):
    """Run the kernel (Metal only). x: (N,H,W,C) mx array, w: (C,KH,KW,1), bias: (C,) or None."""
    import mlx.core as mx

    n, h, wd, c = x.shape
    kh, kw = w.shape[1], w.shape[2]
    tiling = DepthwiseTiling(kh, kw, stride[0], stride[1])
    kern = _KERNELS.get((tiling, bias is not None))
    if kern is None:
        kern = mx.fast.metal_kernel(
            name=f"convserve_depthwise_tail_k{kh}x{kw}_s{stride[0]}x{stride[1]}{'_b' if bias is not None else ''}",
            input_names=["x", "wt", "bias", "dims"], output_names=["out"],
            source=render_source(tiling, bias is not None))
        _KERNELS[(tiling, bias is not None)] = kern
    oh, ow = out_hw
    taps = w.reshape(c, kh * kw).T.astype(x.dtype)
    b = bias.astype(mx.float32) if bias is not None else mx.zeros((1,), mx.float32)
    dims = mx.array([h, wd, c, oh, ow, pad_top, pad_left], dtype=mx.int32)
    (out,) = kern(inputs=[x, taps, b, dims], template=[("T", x.dtype)],
                  grid=tiling.grid(n, c, oh, ow), threadgroup=tiling.threadgroup,
                  output_shapes=[(n, oh, ow, c)], output_dtypes=[x.dtype])
    return out
