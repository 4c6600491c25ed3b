"""The CUDA backend's kernel source (cuda.kernels.SOURCE, what CuPy's RawModule compiles on the
GPU) compiled by NVRTC itself, where there is no GPU: NVRTC compiles to PTX without a device. The
emulation tests build the same source as C++ and check what the kernels compute. This checks what
only NVRTC can: that every storage dtype's build compiles (inline PTX, intrinsics, the arch
branches), and that each branch is taken where it should be: bfloat16 stores are one
cvt.rn.bf16.f32 from sm80 on, integer rounding before. NVRTC comes from the `nvidia-cuda-nvrtc`
wheel of the test extra (Linux and Windows); without it these tests skip."""
from __future__ import annotations

import ctypes
import importlib.metadata
import re
from pathlib import Path

import pytest

from convkernels.backends.cuda.kernels import DTYPE_CODES, SOURCE


def _nvrtc_path() -> Path | None:
    # from the wheel's own file list, not the `nvidia` package's folders: another NVIDIA wheel
    # (nvImageCodec's) makes `nvidia` a package of its own whose path pkgutil extends only on
    # import, and until then the search sees that wheel's folder alone
    try:
        dist = importlib.metadata.distribution("nvidia-cuda-nvrtc")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted(Path(dist.locate_file(f)) for f in dist.files or []
                   if re.fullmatch(r"libnvrtc\.so[.\d]*|nvrtc64.*\.dll", f.name))
    return found[0] if found else None


@pytest.fixture(scope="module")
def nvrtc():
    path = _nvrtc_path()
    if path is None:
        try:
            importlib.metadata.distribution("nvidia-cuda-nvrtc")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("NVRTC is not installed (the nvidia-cuda-nvrtc wheel of the test extra)")
        pytest.fail("nvidia-cuda-nvrtc is installed, but no libnvrtc among its files: has its layout changed?")
    # NVRTC opens its builtins library by name: loaded first, from the wheel's folder, it is found
    for builtins in sorted(path.parent.glob("*nvrtc-builtins*")):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(path))


#: (dtype, arch) -> its PTX: the bfloat16 branch test reads the builds the compile test made
_PTX: dict[tuple[str, str], str] = {}


def compile_ptx(lib, dtype: str, arch: str) -> str:
    """SOURCE built as CuPy builds it for `dtype`, for virtual architecture `arch` (compute_XX)."""
    if (dtype, arch) not in _PTX:
        _PTX[dtype, arch] = _compile_ptx(lib, dtype, arch)
    return _PTX[dtype, arch]


def _compile_ptx(lib, dtype: str, arch: str) -> str:
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), b"convkernels_cuda_source", 0, None, None) == 0
    try:
        opts = [f"-DDT={DTYPE_CODES[dtype]}".encode(), f"--gpu-architecture={arch}".encode()]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, f"{dtype} {arch}: NVRTC error {rc}\n{log.value.decode(errors='replace')}"
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


#: every kernel the source defines (the wrappers in cuda/kernels.py launch them by these names)
KERNELS = re.findall(r'extern "C" __global__ void (\w+)\(', SOURCE)


@pytest.mark.parametrize("arch", ["compute_90", "compute_75"])
@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES))
def test_every_dtype_build_compiles_with_every_kernel(nvrtc, dtype, arch):
    ptx = compile_ptx(nvrtc, dtype, arch)
    entries = set(re.findall(r"\.entry (\w+)\(", ptx))
    assert len(KERNELS) >= 20 and not set(KERNELS) - entries, f"missing from the PTX: {set(KERNELS) - entries}"


def _function(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    return ptx[start:ptx.index("\n}\n", start)]


def test_bfloat16_stores_take_the_conversion_instruction_from_sm80_only(nvrtc):
    # rms_rows_vec stores each result through st(): one cvt per element on sm80 and later
    new = _function(compile_ptx(nvrtc, "bfloat16", "compute_90"), "rms_rows_vec")
    old = _function(compile_ptx(nvrtc, "bfloat16", "compute_75"), "rms_rows_vec")
    assert "cvt.rn.bf16.f32" in new and "32767" not in new
    # before sm80: round to nearest even by adding 0x7fff (+ the lowest kept bit); NaN is 0x7fc0
    assert "cvt.rn.bf16.f32" not in old and "32767" in old and "32704" in old
