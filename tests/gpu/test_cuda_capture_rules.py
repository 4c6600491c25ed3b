"""What may run inside a captured CUDA graph (convkernels/backends/cuda/graphs.py), checked in the
source of the code a model forward runs on the CUDA backend: no CuPy cuBLAS (cp.matmul, `@`,
dot, einsum, tensordot: CuPy refuses them during capture), no host synchronisation (.get(),
asnumpy, .item(), synchronize), no cuRAND, no cp.array / cp.concatenate (host-built buffers a
replay would read after they are gone). Eager-only functions (host copies, timing, autotune)
are listed with the reason. Runs everywhere; the GPU tests prove the same by capturing."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "convkernels" / "backends"
MODULES = ["cuda/backend.py", "cuda/arrays.py", "cuda/conv_paths.py", "cuda/fusions.py", "cuda/kernels.py",
           "../unfold.py", "cuda/blas.py", "cuda/blas_lt.py", "cuda/cudnn.py"]

#: (module, function) -> why it may do what a capture forbids
EAGER_ONLY = {
    ("cuda/backend.py", "to_host"): "the device -> host copy after the forward",
    ("cuda/backend.py", "synchronize"): "called by the host between forwards",
    ("cuda/backend.py", "flush_timings"): "reads conv timings after the batch",
    ("cuda/conv_paths.py", "measure"): "path measurement; raises CaptureMissed under capture",
    ("cuda/cudnn.py", "_autotune"): "plan timing while a plan is built; never under capture",
}

CUBLAS = {"matmul", "dot", "einsum", "tensordot", "inner", "outer", "vdot"}
HOST_SYNC = {"asnumpy", "synchronize"}
NO_ARG_SYNC = {"get", "item", "tolist"}
HOST_BUFFERS = {"array", "concatenate"}


def _chain(node) -> list[str]:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def violations(module: str) -> list[str]:
    tree = ast.parse((ROOT / module).read_text())
    found = []

    def visit(node, func: str):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if (module, name) in EAGER_ONLY:
                continue
            where = f"{module}:{getattr(child, 'lineno', '?')} in {name}"
            if isinstance(child, ast.BinOp) and isinstance(child.op, ast.MatMult):
                found.append(f"{where}: `@` (CuPy cuBLAS on device arrays)")
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                chain = _chain(child.func)
                attr = child.func.attr
                on_cupy = len(chain) >= 2 and chain[-2] in ("cp", "cupy") or chain[:2] == ["self", "cp"]
                if attr in CUBLAS and "blas" not in chain:  # self.blas.matmul is cuda/blas.py's C-API route
                    found.append(f"{where}: {'.'.join(chain)} (CuPy cuBLAS)")
                elif attr in HOST_SYNC:
                    found.append(f"{where}: {'.'.join(chain)} (host synchronisation)")
                elif attr in NO_ARG_SYNC and not child.args and not child.keywords:
                    found.append(f"{where}: {'.'.join(chain)}() (device -> host copy)")
                elif attr in HOST_BUFFERS and on_cupy:
                    found.append(f"{where}: {'.'.join(chain)} (buffer copied from host memory)")
                elif "random" in chain[:-1] and ("cp" in chain or "cupy" in chain):
                    found.append(f"{where}: {'.'.join(chain)} (cuRAND)")
            visit(child, name)

    visit(tree, "<module>")
    return found


@pytest.mark.parametrize("module", MODULES)
def test_forward_code_keeps_to_what_a_capture_allows(module):
    bad = violations(module)
    assert not bad, "calls a CUDA graph capture cannot take:\n" + "\n".join(bad)


def test_the_audit_sees_each_kind_of_violation(tmp_path, monkeypatch):
    """The checker itself: a module that breaks every rule is caught on each line."""
    src = '''
import cupy as cp
def forward(self, a, b, x):
    y = a @ b
    z = cp.matmul(a, b)
    w = self.cp.einsum("ij,jk->ik", a, b)
    h = x.get()
    s = float(x.max().item())
    cp.cuda.get_current_stream().synchronize()
    n = cp.asnumpy(x)
    t = cp.array([1, 2])
    c = cp.concatenate([a, b, x])
    r = cp.random.standard_normal((2, 2))
    ok = {}.get("key")
    fine = self.blas.matmul(a, b)
    return y
'''
    (tmp_path / "bad.py").write_text(src)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    bad = violations("bad.py")
    kinds = " ".join(bad)
    for needle in ("`@`", "cp.matmul", "self.cp.einsum", "x.get()", "item()", "synchronize", "cp.asnumpy",
                   "cp.array", "cp.concatenate", "cp.random.standard_normal"):
        assert needle in kinds, f"{needle} not caught: {bad}"
    assert len(bad) == 10, bad  # dict.get(key) and the cuBLAS C-API matmul are not violations
