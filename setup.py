"""Only the optional C kernel lives here; all metadata is in pyproject.toml. `optional=True`
keeps `pip install` working on machines without a compiler (the NumPy paths remain)."""
import sys

from setuptools import Extension, setup

openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
setup(ext_modules=[Extension(
    "convkernels._cpu._kernels", ["convkernels/_cpu/kernels.c", "convkernels/_cpu/norms.c",
                                   "convkernels/_cpu/gemm.c", "convkernels/_cpu/pool.c",
                                   "convkernels/_cpu/gemm_bf16.c"],
    depends=["convkernels/_cpu/vec.h"], extra_compile_args=["-O3", *openmp], extra_link_args=openmp,
    optional=True)])
