"""The NumPy backend's compiled linear (convkernels/_cpu/gemm.c): weights packed once into panels,
act(x @ w^T + bias) + residual with the epilogue applied in the tile, against torch in float64.
Every tile this CPU runs is checked (AVX-512's 12 x 32 and AVX2's 6 x 16 on an AVX-512 machine),
at row counts that leave a short last row block, column counts that leave a short last panel,
few rows over many columns (split over threads by panel), and ConvNeXt's long K."""
from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from torch_reference import F, fresh_rng, rel_l2, torch

from convkernels import _cpu, get_backend
from convkernels.backends.numpy import fused

TOL = 1e-5
CPU_SRC = Path(__file__).resolve().parents[1] / "convkernels" / "_cpu"
ACTS = {None: lambda t: t, "gelu": F.gelu, "silu": F.silu}


def widths() -> list[int]:
    if not _cpu.AVAILABLE or fused.panel_width() == 0:
        return []
    return [nr for nr in (32, 16) if nr <= fused.panel_width()]


needs_tiles = pytest.mark.skipif(not widths(), reason="no compiled gemm tiles here (no compiler, or not x86-64 v3/v4)")


def packed(w: np.ndarray, nr: int) -> np.ndarray:
    n, k = w.shape
    out = np.empty(-(-n // nr) * k * nr, np.float32)
    _cpu._kernels.pack_weight(w, out, n, k, nr)
    return out


def run(x, w, nr, bias=None, res=None, act=None):
    m, k = x.shape
    n = w.shape[0]
    out = np.full((m, n), np.nan, np.float32)
    none = np.zeros(1, np.float32)
    _cpu._kernels.gemm(x, packed(w, nr), none if bias is None else bias, none if res is None else res, out, m, k, n,
                       nr, bias is not None, res is not None, fused.ACT_CODES[act])
    return out


def scaled_err(got, want) -> float:
    """rel L2 with a floor of unit scale: a lone GELU output near 0 (1 - erf cancels there) would
    otherwise turn the rational erf's ~1e-8 absolute error into a large relative one"""
    diff = np.linalg.norm(np.asarray(got, np.float64) - want)
    return float(diff / max(np.linalg.norm(want), np.sqrt(want.size)))


def reference(x, w, bias, res, act):
    t = F.linear(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(w.astype(np.float64)),
                 None if bias is None else torch.from_numpy(bias.astype(np.float64)))
    t = ACTS[act](t)
    return (t if res is None else t + torch.from_numpy(res.astype(np.float64))).numpy()


@needs_tiles
@pytest.mark.parametrize("nr", widths())
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (13, 17, 33), (37, 5, 16), (12, 96, 31), (49, 768, 71), (200, 45, 130)])
@pytest.mark.parametrize("act", [None, "gelu", "silu"])
def test_tiles_match_torch(nr, m, k, n, act):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((m, k)) * 2).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32)
    for bias, r in [(b, res), (None, None), (b, None), (None, res)]:
        got, want = run(x, w, nr, bias, r, act), reference(x, w, bias, r, act)
        assert not np.isnan(got).any(), f"nr {nr} {(m, k, n)}: some output never written"
        err = scaled_err(got, want)
        assert err < TOL, f"nr {nr} {(m, k, n)} {act} bias {bias is not None} res {r is not None} seed {seed}: {err:.2e}"


@needs_tiles
@pytest.mark.parametrize("nr", widths())
def test_convnext_shapes_on_threads(nr):
    """ConvNeXt-T's last stage at batch 1: 49 rows (5 row blocks, the last of one row) over 3072 and
    768 columns, K up to 3072; the work is split by panel as well as by row."""
    rng, seed = fresh_rng()
    for m, k, n, act, with_res in [(49, 768, 3072, "gelu", False), (49, 3072, 768, None, True), (196, 384, 1536, "gelu", False)]:
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32)
        res = rng.standard_normal((m, n)).astype(np.float32) if with_res else None
        err = rel_l2(run(x, w, nr, b, res, act), reference(x, w, b, res, act))
        assert err < TOL, f"nr {nr} {(m, k, n)} seed {seed}: {err:.2e}"


@needs_tiles
def test_mismatched_buffers_and_widths_are_refused():
    k = _cpu._kernels
    x, w = np.ones((4, 8), np.float32), np.ones((5, 8), np.float32)
    nr, out, none = widths()[0], np.empty((4, 5), np.float32), np.zeros(1, np.float32)
    p = packed(w, nr)
    with pytest.raises(ValueError, match="gemm"):
        k.gemm(x, p[:-1], none, none, out, 4, 8, 5, nr, False, False, 0)  # panels too short
    with pytest.raises(ValueError, match="gemm"):
        k.gemm(x, p, none, none, out, 4, 8, 5, 24, False, False, 0)  # no such tile
    with pytest.raises(ValueError, match="gemm"):
        k.gemm(x, p, none, none, out, 4, 8, 5, nr, True, False, 0)  # a bias of one float for 5 columns
    with pytest.raises(ValueError, match="pack_weight"):
        k.pack_weight(w, np.empty(3, np.float32), 5, 8, nr)


@needs_tiles
def test_the_backend_packs_a_weight_once_and_follows_a_new_one(monkeypatch):
    """The backend's linear packs through its weight cache: the same weight is packed once, and a
    new weight array (another layer, or one replaced) is packed anew, never served stale panels."""
    be = get_backend("numpy")
    rng, seed = fresh_rng()
    x = rng.standard_normal((3, 7, 40)).astype(np.float32)
    w1, w2 = (rng.standard_normal((2, 50, 40)) / 7).astype(np.float32)
    calls = []
    real = fused.pack_panels

    def counting(w):
        calls.append(w.shape)
        return real(w)

    monkeypatch.setattr(fused, "pack_panels", counting)
    for w in (w1, w1, w2, w1):
        got = be.linear(x, w, None, activation="gelu")
        assert rel_l2(got, reference(x.reshape(-1, 40), w, None, None, "gelu").reshape(got.shape)) < TOL, f"seed {seed}"
    assert len(calls) == 2, f"packed {len(calls)} times for two weights"


@pytest.mark.skipif(shutil.which("gcc") is None or platform.machine() != "x86_64", reason="needs gcc on x86-64")
def test_each_tile_keeps_its_accumulators_in_registers(tmp_path):
    """The full-height tiles multiply-add registers only: 24 zmm FMAs per step of K for AVX-512's
    12 x 32, 12 ymm ones for AVX2's 6 x 16, none reading the stack. On 16-float vectors the AVX2
    tile kept its accumulators on the stack and ran at 10 GFLOP/s, an eighth of OpenBLAS's."""
    asm = tmp_path / "gemm.s"
    run = subprocess.run(["gcc", "-O3", "-fopenmp", "-Wno-psabi", "-I", sysconfig.get_paths()["include"], "-S",
                          str(CPU_SRC / "gemm.c"), "-o", str(asm)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    bodies: dict[str, list[str]] = {}
    current = None
    for line in asm.read_text().splitlines():
        if line and not line[0].isspace() and line.endswith(":") and not line.startswith("."):
            current = line[:-1]
            bodies[current] = []
        elif current:
            bodies[current].append(line.strip())
    for name, reg, fmas in [("tile_v4_12", "%zmm", 24), ("tile_v3_6", "%ymm", 12)]:
        body = bodies.get(name)
        assert body, f"{name} not found in the build"
        fma = [ln for ln in body if ln.startswith("vfmadd")]
        assert len(fma) == fmas and all(reg in ln and "(%rsp)" not in ln for ln in fma), f"{name}: {fma}"


@needs_tiles
@pytest.mark.parametrize("nr", widths())
def test_rows_read_in_place_from_a_wider_matrix(nr):
    """A's rows `lda` floats apart from an offset (the 3-D Winograd reads a run of frames of each
    tile's row in place): equal to the product of the copied slice; a stride that would read past
    the buffer is refused."""
    rng, seed = fresh_rng()
    p, frames, c, first, count, o = 29, 5, 7, 1, 3, 45
    v = rng.standard_normal((p, frames, c)).astype(np.float32)
    w = (rng.standard_normal((o, count * c)) / 5).astype(np.float32)
    out, none = np.full((p, o), np.nan, np.float32), np.zeros(1, np.float32)
    _cpu._kernels.gemm(v, packed(w, nr), none, none, out, p, count * c, o, nr, False, False, 0, first * c, frames * c)
    want = reference(np.ascontiguousarray(v[:, first:first + count].reshape(p, -1)), w, None, None, None)
    assert scaled_err(out, want) < TOL, f"nr {nr} seed {seed}"
    with pytest.raises(ValueError, match="row stride"):
        _cpu._kernels.gemm(v, packed(w, nr), none, none, out, p, count * c, o, nr, False, False, 0, 3 * c, frames * c)


@needs_tiles
@pytest.mark.parametrize("nr", widths())
@pytest.mark.parametrize("q,p,c,o", [(7, 29, 19, 45), (36, 13, 33, 70), (3, 1, 5, 1)])
def test_a_batch_of_products_in_one_call(nr, q, p, c, o):
    """Winograd's planes as one call (one fork and join for all of them): each plane's product,
    bias and residual equal its own product in float64; planes read in place from a run of frames
    (the 3-D Winograd) too; strides that would read past a buffer are refused."""
    rng, seed = fresh_rng()
    k = _cpu._kernels
    v = rng.standard_normal((q, p, c)).astype(np.float32)
    ws = (rng.standard_normal((q, o, c)) / np.sqrt(c)).astype(np.float32)
    pk = np.stack([packed(w, nr) for w in ws])
    b = rng.standard_normal(o).astype(np.float32)
    res = rng.standard_normal((q, p, o)).astype(np.float32)
    out = np.full((q, p, o), np.nan, np.float32)
    k.gemm(v, pk, b, res, out, p, c, o, nr, True, True, 2, 0, c, q, p * c, pk.shape[1])
    for i in range(q):
        err = scaled_err(out[i], reference(v[i], ws[i], b, res[i], "gelu"))
        assert err < TOL, f"nr {nr} plane {i} of {q} {(p, c, o)} seed {seed}: {err:.2e}"
    frames, first, count = 4, 1, 2
    vf = rng.standard_normal((q, p, frames, c)).astype(np.float32)
    wf = (rng.standard_normal((q, o, count * c)) / np.sqrt(c)).astype(np.float32)
    pf = np.stack([packed(w, nr) for w in wf])
    out = np.full((q, p, o), np.nan, np.float32)
    k.gemm(vf, pf, b, res, out, p, count * c, o, nr, False, False, 0, first * c, frames * c, q, p * frames * c,
           pf.shape[1])
    for i in range(q):
        want = reference(np.ascontiguousarray(vf[i][:, first:first + count].reshape(p, -1)), wf[i], None, None, None)
        assert scaled_err(out[i], want) < TOL, f"nr {nr} frames, plane {i} seed {seed}"
    none = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="gemm"):  # one plane more than v holds
        k.gemm(v, pk, none, none, np.empty((q + 1, p, o), np.float32), p, c, o, nr, False, False, 0, 0, c, q + 1,
               p * c, pk.shape[1])
    with pytest.raises(ValueError, match="gemm"):  # planes of B closer than one packed weight
        k.gemm(v, pk, none, none, out, p, c, o, nr, False, False, 0, 0, c, q, p * c, pk.shape[1] - 1)


@needs_tiles
def test_winograd_planes_match_numpy_matmul():
    """fused.planes_matmul (all planes in one call, 2-D and in place over frames) against NumPy's
    batched matmul of the unpacked weights"""
    rng, seed = fresh_rng()
    q, p, c, o = 36, 23, 40, 33
    u = (rng.standard_normal((q, c, o)) / np.sqrt(c)).astype(np.float32)
    v = rng.standard_normal((q, p, c)).astype(np.float32)
    out = np.full((q, p, o), np.nan, np.float32)
    fused.planes_matmul(v, fused.pack_planes(u), out)
    assert scaled_err(out, np.matmul(v.astype(np.float64), u)) < TOL, f"seed {seed}"
    frames, first, count = 5, 2, 3
    u3 = (rng.standard_normal((q, count * c, o)) / np.sqrt(c)).astype(np.float32)
    v3 = rng.standard_normal((q, p, frames, c)).astype(np.float32)
    fused.planes_matmul(v3, fused.pack_planes(u3), out, (first, count))
    want = np.matmul(v3[:, :, first:first + count].reshape(q, p, -1).astype(np.float64), u3)
    assert scaled_err(out, want) < TOL, f"frames, seed {seed}"


@needs_tiles
@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("taps", [0, 3])
def test_winograd_panels_are_the_float64_transform_rounded_once(m, taps):
    """fused.winograd_panels (U = G g G^T straight into gemm.c's panels, one compiled pass) against
    U in float64, rounded once and packed by fused.pack_planes: the same floats up to one unit in the
    last place (float64's summation order), odd O leaving a short zero-padded last panel, 2-D and
    3-D (KT taps stacked along the reduction). A kernel read transposed would be far off."""
    from convkernels.backends.numpy import conv as nc

    tile = nc.F2X3 if m == 2 else nc.F4X3
    rng, seed = fresh_rng()
    o, c = 37, 19
    w = rng.standard_normal((o, taps, 3, 3, c) if taps else (o, 3, 3, c)).astype(np.float32)
    w5 = w if taps else w[:, None]
    g = tile.g
    u = np.einsum("ai,otijc,bj->abtco", g, w5.astype(np.float64), g)  # (P, P, KT, C, O)
    want = fused.pack_planes(u.reshape(tile.planes, -1, o).astype(np.float32))
    got = fused.winograd_panels(w, g)
    assert got.shape == want.shape and got.ctypes.data % 64 == 0
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1 and (ulps > 0).mean() < 0.01, f"seed {seed}"
    wrong = fused.winograd_panels(np.ascontiguousarray(np.swapaxes(w, -3, -2)), g)
    assert np.abs(wrong - want).max() > 0.1
    with pytest.raises(ValueError, match="winograd_pack"):
        _cpu._kernels.winograd_pack(np.moveaxis(w5, 0, -1).copy(), g, np.empty(got.size - 1, np.float32), o,
                                    max(taps, 1), c, tile.m + 2,
                                    fused.panel_width())


#: the stage the depthwise_ln_mlp tests run: two images, odd rows and channels (an odd K), 7x7
STAGE = (2, 5, 9, 21, 84)


def stage_case(blocks: int, pack, gemm, shape: tuple = STAGE) -> tuple:
    """x, the blocks as depthwise_ln_mlp takes them (weights packed by pack(w)) and the expected output:
    the compiled depthwise conv + LayerNorm, then gemm(a, panels, bias, residual, out, m, k, n,
    has_residual, act) twice, a block at a time; fresh random values. shape: (n, h, w, c, hidden)"""
    rng, seed = fresh_rng()
    n, h, w, c, hidden = shape
    rows, none = n * h * w, np.zeros(1, np.float32)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    params, want = [], x
    for _ in range(blocks):
        taps = (rng.standard_normal((49, c)) / 7).astype(np.float32)
        dwb, lw, lb, b2 = (rng.standard_normal(c).astype(np.float32) for _ in range(4))
        b1 = rng.standard_normal(hidden).astype(np.float32)
        w1, w2 = (rng.standard_normal(s).astype(np.float32) / 5 for s in ((hidden, c), (c, hidden)))
        p1, p2 = pack(w1), pack(w2)
        params.append((taps, dwb, lw, lb, p1, b1, p2, b2))
        t = np.empty((rows, c), np.float32)
        _cpu._kernels.depthwise_layer_norm(want, taps, dwb, lw, lb, t, True, True, True, n, h, w, c, 7, 7, 1e-6)
        hid = np.empty((rows, hidden), np.float32)
        gemm(t, p1, b1, none, hid, rows, c, hidden, False, fused.ACT_CODES["gelu"])
        out = np.empty((n, h, w, c), np.float32)
        gemm(hid, p2, b2, want, out, rows, hidden, c, True, 0)
        want = out
    return x, params, want, seed


@needs_tiles
@pytest.mark.parametrize("nr", widths())
@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_depthwise_ln_mlp_is_depthwise_layer_norm_and_two_gemms_on_each_tile_width(nr, blocks):
    """gemm.c's depthwise_ln_mlp on every tile width this CPU runs (AVX2's panels of 16 on an AVX-512
    machine too), one to three blocks in one call: the bits of the compiled depthwise conv + LayerNorm
    and two gemm calls a block on the same panels, odd channels and rows. A buffer of the wrong size,
    an output over the input and a malformed block are errors, not reads past a buffer."""
    def gemm(a, p, bias, res, out, m, k, n, has_res, act):
        _cpu._kernels.gemm(a, p, bias, res, out, m, k, n, nr, True, has_res, act)
    x, params, want, seed = stage_case(blocks, lambda w: packed(w, nr), gemm)
    n, h, w, c, hidden = STAGE
    rows = n * h * w

    def call(out, spare=None, scratch=None, given=None):
        _cpu._kernels.depthwise_ln_mlp(x, out, np.empty_like(x) if spare is None else spare,
                                       np.empty((rows, c), np.float32),
                                       np.empty((rows, hidden), np.float32) if scratch is None else scratch,
                                       params if given is None else given, True, True, True, n, h, w, c, 7, 7,
                                       hidden, 1e-6, fused.ACT_CODES["gelu"], nr)
    got = np.full((n, h, w, c), np.nan, np.float32)
    call(got)
    assert np.array_equal(got, want), f"nr {nr} seed {seed}"
    with pytest.raises(ValueError, match="depthwise_ln_mlp"):
        call(got, scratch=np.empty((rows, hidden - 1), np.float32))
    with pytest.raises(ValueError, match="overlap"):
        call(x)
    with pytest.raises(ValueError, match="depthwise_ln_mlp"):
        call(got, given=[])
    with pytest.raises(TypeError, match="8 buffers"):
        call(got, given=params[:-1] + [list(params[-1])])
    with pytest.raises(ValueError, match="depthwise_ln_mlp"):
        call(got, given=params[:-1] + [params[-1][:5] + (params[-1][5][:-1],) + params[-1][6:]])
