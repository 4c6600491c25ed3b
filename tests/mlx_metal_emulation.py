"""The depthwise Metal kernel's index math (convkernels/backends/mlx/metal.py) run over its whole
thread grid with NumPy: the very expressions `render_source` turns into the Metal body, evaluated
here, so the tiling is tested on machines without Metal. The expressions are read from the
module at call time, so a test that patches one sees its patch emulated."""
from __future__ import annotations

from typing import Any

import numpy as np

from convkernels.backends.mlx import metal


def _ev(expr: str, ns: dict[str, Any]):
    return eval(expr, {"__builtins__": {}}, ns)  # noqa: S307 - our own constant expressions


def emulate(tiling: metal.DepthwiseTiling, n: int, h: int, w: int, c: int, oh: int, ow: int,
            pad_top: int, pad_left: int, x: np.ndarray | None = None, taps: np.ndarray | None = None,
            bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Run the kernel's index math over its whole grid with NumPy.

    Returns `stores` (how many threads store each output element), `tile_loads` (how many
    times each shared-tile slot of each threadgroup is written), `bad_reads` (taps of storing
    threads whose tile slot holds a different input coordinate than the convolution needs, or
    lies outside the tile), and, when x (N,H,W,C) and taps (KH*KW, C) are given, `out`."""
    k = tiling.constants()
    gx, gy, gz = tiling.groups(n, c, oh, ow)
    ns: dict[str, Any] = dict(k, H=h, W=w, C=c, OH=oh, OW=ow, PT=pad_top, PL=pad_left)
    # axes: (group z, group y, group x, lid z, lid y, lid x)
    ns["tg_z"] = np.arange(gz).reshape(-1, 1, 1, 1, 1, 1)
    ns["tg_y"] = np.arange(gy).reshape(1, -1, 1, 1, 1, 1)
    ns["tg_x"] = np.arange(gx).reshape(1, 1, -1, 1, 1, 1)
    ns["lid_z"] = np.arange(metal.TH).reshape(1, 1, 1, -1, 1, 1)
    ns["lid_y"] = np.arange(metal.TW).reshape(1, 1, 1, 1, -1, 1)
    ns["lid_x"] = np.arange(metal.TC).reshape(1, 1, 1, 1, 1, -1)
    full = (gz, gy, gx, metal.TH, metal.TW, metal.TC)
    for name, expr in metal.GROUP_STMTS:
        ns[name] = np.broadcast_to(_ev(expr, ns), full)

    n_groups = gz * gy * gx
    group_id = np.broadcast_to(np.arange(n_groups).reshape(gz, gy, gx, 1, 1, 1), full)
    tile = np.zeros((n_groups, k["TILE"]), np.float64)
    tile_src = np.full((n_groups, k["TILE"], 3), -(10 ** 9), np.int64)  # (ih, iw, ci) or padding marker
    tile_loads = np.zeros((n_groups, k["TILE"]), np.int64)
    xf = None if x is None else np.asarray(x, np.float64).reshape(-1)
    for step in range(-(-k["TILE"] // k["NT"])):
        i = ns["lin"] + step * k["NT"]
        active = i < k["TILE"]
        lns = dict(ns, i=i)
        for name, expr in metal.LOAD_STMTS:
            lns[name] = _ev(expr, lns)
        inb = np.broadcast_to(_ev(metal.LOAD_IN_BOUNDS, lns), full) & active
        g_act, i_act = group_id[active], np.broadcast_to(i, full)[active]
        np.add.at(tile_loads, (g_act, i_act), 1)
        coords = np.stack([np.broadcast_to(lns[v], full) for v in ("ih", "iw", "ci")], -1)
        src_marker = np.where(inb[..., None], coords, -1)  # -1: a zero (padding or channel tail)
        tile_src[g_act, i_act] = src_marker[active]
        if xf is not None:
            src = np.where(inb, _ev(metal.LOAD_SRC, lns), 0)
            tile[g_act, i_act] = np.where(inb, xf[src], 0.0)[active]

    for name, expr in metal.STORE_STMTS:
        ns[name] = np.broadcast_to(_ev(expr, ns), full)
    guard = np.broadcast_to(_ev(metal.STORE_GUARD, ns), full)
    stores = np.zeros(n * oh * ow * c, np.int64)
    dst = _ev(metal.STORE_DST, ns)[guard]
    np.add.at(stores, dst, 1)

    bad_reads = 0
    acc = np.zeros(int(guard.sum()), np.float64)
    g_st = group_id[guard]
    want_h0 = ns["oh"][guard] * tiling.sh - pad_top
    want_w0 = ns["ow"][guard] * tiling.sw - pad_left
    co = ns["co"][guard]
    for kh in range(tiling.kh):
        for kw in range(tiling.kw):
            tns = dict(ns, kh=kh, kw=kw)
            t_idx = np.broadcast_to(_ev(metal.TAP_TILE, tns), full)[guard]
            inside = (t_idx >= 0) & (t_idx < k["TILE"])
            bad_reads += int((~inside).sum())
            t_idx = np.clip(t_idx, 0, k["TILE"] - 1)
            held = tile_src[g_st, t_idx]
            ih, iw = want_h0 + kh, want_w0 + kw
            in_image = (ih >= 0) & (ih < h) & (iw >= 0) & (iw < w)
            expect = np.where(in_image[:, None], np.stack([ih, iw, co], -1), -1)
            bad_reads += int((inside & (held != expect).any(-1)).sum())
            if taps is not None:
                w_idx = np.broadcast_to(_ev(metal.TAP_WEIGHT, tns), full)[guard]
                acc += tile[g_st, t_idx] * np.asarray(taps, np.float64).reshape(-1)[w_idx]
    result = {"stores": stores.reshape(n, oh, ow, c), "tile_loads": tile_loads, "bad_reads": np.int64(bad_reads)}
    if x is not None and taps is not None:
        if bias is not None:
            acc += np.asarray(bias, np.float64)[co]
        out = np.zeros(n * oh * ow * c, np.float64)
        out[dst] = acc
        result["out"] = out.reshape(n, oh, ow, c)
    return result
