"""The CUDA backend's settings, one typed and immutable object (`CudaBackend(CudaOptions(...))`).

Importable without CuPy: the service's settings and the tests name the fields without a GPU.
`get_backend("cuda", **options, cuda_options={...})` builds it from keywords; the service passes
its CONVSERVE_* settings that way (Settings.backend_options), and no field is read from the
environment.
"""
from __future__ import annotations

from dataclasses import dataclass

from .graphs import DEFAULT_CAPACITY as GRAPH_CAPACITY
from .graphs import DEFAULT_MAX_GRAPH_BYTES

#: upsample_conv2d's forms (upsample.py)
UPSAMPLE_FORMS = ("auto", "phases", "transposed")
#: bytes of one im2col / col2im buffer of gemm_fallback before it tiles
DEFAULT_UNFOLD_LIMIT = 1 << 30


@dataclass(frozen=True)
class CudaOptions:
    #: the compute (storage) dtype: float16, bfloat16 or float32
    dtype: str = "float16"
    #: CUDA device ordinal
    device: int = 0
    #: cuDNN plans held in memory (None: the plan cache's default)
    plan_cache_capacity: int | None = None
    #: a directory where cuDNN plans outlive the process (None: memory only)
    plan_cache_dir: str | None = None
    #: bytes of one gemm_fallback unfold buffer (None: DEFAULT_UNFOLD_LIMIT)
    unfold_limit_bytes: int | None = None
    #: every conv on gemm_fallback (the correctness path) instead of cuDNN
    force_fallback: bool = False
    #: time cuDNN's candidate plans, and the measured paths (small_kd_2d, depthwise_direct)
    #: against cuDNN, per new conv key (CONVSERVE_CUDA_AUTOTUNE)
    autotune: bool = False
    #: cuDNN plans timed per key when autotuning (CONVSERVE_CUDA_AUTOTUNE_PLANS)
    autotune_max_plans: int = 4
    #: let cuDNN and cuBLAS use TF32 for float32 (off: float32 answers to 1e-5)
    allow_tf32: bool = False
    #: share of convs whose device time is measured (two CUDA events each)
    timing_sample_rate: float = 0.1
    #: upsample_conv2d's form: "phases" (a forward 2x2 conv and a copy placing its phases),
    #: "transposed" (one transposed conv) or "auto" (by the input's size); upsample.py says
    #: why both exist (CONVSERVE_CUDA_UPSAMPLE_FORM)
    upsample_form: str = "auto"
    #: whole forwards replayed as CUDA graphs from their second call (graphs.py;
    #: CONVSERVE_CUDA_GRAPHS, CONVSERVE_CUDA_GRAPH_CAPACITY, CONVSERVE_CUDA_GRAPH_MAX_BYTES)
    cuda_graphs: bool = True
    graph_capacity: int = GRAPH_CAPACITY
    graph_max_bytes: int = DEFAULT_MAX_GRAPH_BYTES
    # ConvNeXt block fusions (fusions.py), on/off for A/B runs (benchmarks/gpu/convnext_fusion_ab.py);
    # the defaults are the measured best. CONVSERVE_CUDA_DW_LN, _DW_BIAS_IN_LN, _LT_EPILOGUES,
    # _LT_GELU_APPROX and _LN_VEC set them.
    #: depthwise conv + bias + LayerNorm as one kernel
    dw_ln: bool = False
    #: else the LayerNorm adds the depthwise conv's bias as it reads the conv output
    dw_bias_in_ln: bool = True
    #: linear bias / GELU / residual inside the cuBLASLt matmul
    lt_epilogues: bool = True
    #: cuBLASLt's tanh GELU for erf-GELU layers, float16 only
    lt_gelu_approx: bool = True
    #: ln_rows_vec (a row in one warp's registers) where it applies
    ln_vec: bool = True

    def __post_init__(self):
        if self.upsample_form not in UPSAMPLE_FORMS:
            raise ValueError(f"upsample_form must be one of {UPSAMPLE_FORMS}, not {self.upsample_form!r}")

    def fusions(self) -> dict:
        """The fusion switches, as describe() reports them."""
        return {"dw_ln": self.dw_ln, "dw_bias_in_ln": self.dw_bias_in_ln, "lt_epilogues": self.lt_epilogues,
                "lt_gelu_approx": self.lt_gelu_approx, "ln_vec": self.ln_vec}
