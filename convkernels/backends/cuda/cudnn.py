"""cuDNN frontend (1.28, Python `cudnn`) conv graphs for the CUDA backend: forward (conv_fprop,
grouped/depthwise by weight shape, 2D and 3D) and transposed (conv_dgrad) convolutions with the
fused epilogue `act(conv + bias) + residual` inside the graph where cuDNN builds it.

Fusion is tried from the whole epilogue down to the bare conv; the plan records which parts it
fused and the backend runs the rest as one elementwise kernel. A key cuDNN builds nothing for
raises NoPlan, which the plan cache turns into the cached FALLBACK answer (gemm_fallback).
float32 plans exclude tensor-core (TF32) and down-converting engines unless allow_tf32=True.
Autotune (optional) is bounded: it builds and times only the heuristic's first
`autotune_max_plans` plans that build (default 4), with CUDA events on the call's own buffers,
and pins the fastest; the plan cache persists the winner. Building every plan
(build_plan_policy.ALL, ~1 s for a 3x3 512-channel conv) for each of a decoder's ~40 keys made
the first SD-VAE 512 request take a minute; the fastest plan is almost always among
the heuristic's first few, and the first plan alone was far slower only sometimes (measured).
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from .plan_cache import NoPlan, PlanEntry, PlanKey, PlanSerializer

log = logging.getLogger("convkernels.cuda")


def channels_last_strides(dims) -> list[int]:
    """dims N,C,*spatial (cuDNN's logical order) -> strides of N,*spatial,C memory."""
    n, c, *sp = dims
    strides = [0] * len(dims)
    strides[1] = 1
    acc = c
    for i in range(len(sp) - 1, -1, -1):
        strides[2 + i] = acc
        acc *= sp[i]
    strides[0] = acc
    return strides


def ncx(shape) -> list[int]:
    """channels-last shape (N,*sp,C) -> cuDNN dims (N,C,*sp)."""
    return [int(shape[0]), int(shape[-1]), *(int(s) for s in shape[1:-1])]


@dataclass
class CudnnPlan:
    graph: object
    uids: dict              # role ("x", "w", "y", "b", "r") -> tensor uid
    workspace: int
    fused: tuple            # (bias, activation, residual) done inside the graph
    plan_index: int | None  # autotuned plan pinned in the graph, else None
    native: object = None   # cached direct executor (None: not resolved yet, False: unavailable)


def _fusion_levels(epilogue) -> list[tuple[bool, bool, bool]]:
    has_bias, has_res, activation = epilogue
    has_act = activation is not None
    levels = [(has_bias, has_act, has_res), (has_bias, has_act, False), (has_bias, False, False),
              (False, False, False)]
    out = []
    for lv in levels:
        if lv not in out:
            out.append(lv)
    return out


class CudnnConvBuilder(PlanSerializer):
    """Builds, runs, serializes and deserializes cuDNN conv plans for PlanKeys."""

    def __init__(self, cudnn, handle, allow_tf32: bool = False, autotune: bool = False,
                 autotune_max_plans: int = 4):
        self.cudnn = cudnn
        self.handle = handle
        self.allow_tf32 = allow_tf32
        self.autotune = autotune
        self.autotune_max_plans = autotune_max_plans
        dt = cudnn.data_type
        self.io_types = {"float16": dt.HALF, "bfloat16": dt.BFLOAT16, "float32": dt.FLOAT}
        self.float_type = dt.FLOAT

    # ---- graph construction -----------------------------------------------------------------
    def _graph(self, key: PlanKey, fuse):
        cudnn = self.cudnn
        io = self.io_types[key.dtype]
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=self.float_type,
                          compute_data_type=self.float_type, handle=self.handle)
        xd = ncx(key.x_shape)
        yd = ncx(key.y_shape)
        wd = [int(key.w_shape[0]), int(key.w_shape[-1]), *(int(k) for k in key.w_shape[1:-1])]
        x_t = g.tensor(name="X", dim=xd, stride=channels_last_strides(xd), data_type=io)
        w_t = g.tensor(name="W", dim=wd, stride=channels_last_strides(wd), data_type=io)
        conv_args = dict(pre_padding=list(key.pad_lo), post_padding=list(key.pad_hi),
                         stride=list(key.stride), dilation=list(key.dilation))
        if key.kind == "fprop":
            cur = g.conv_fprop(image=x_t, weight=w_t, **conv_args)
        else:
            cur = g.conv_dgrad(loss=x_t, filter=w_t, **conv_args)
            cur.set_dim(yd).set_stride(channels_last_strides(yd))
        uids = {"x": x_t.get_uid(), "w": w_t.get_uid()}
        fuse_bias, fuse_act, fuse_res = fuse
        if fuse_bias:
            bd = [1, yd[1]] + [1] * (len(yd) - 2)
            b_t = g.tensor(name="B", dim=bd, stride=channels_last_strides(bd), data_type=io)
            cur = g.bias(input=cur, bias=b_t)
            uids["b"] = b_t.get_uid()
        if fuse_act:
            act = key.epilogue[2]
            if act == "silu":
                cur = g.swish(input=cur, swish_beta=1.0)
            elif act == "gelu":
                cur = g.gelu(input=cur)
            elif act == "gelu_tanh":
                cur = g.gelu_approx_tanh(input=cur)
            elif act == "relu":
                cur = g.relu(input=cur)
            else:
                raise NoPlan(f"no cuDNN pointwise op for activation {act!r}")
        if fuse_res:
            r_t = g.tensor(name="R", dim=yd, stride=channels_last_strides(yd), data_type=io)
            cur = g.add(a=cur, b=r_t)
            uids["r"] = r_t.get_uid()
        cur.set_output(True).set_data_type(io)
        cur.set_dim(yd).set_stride(channels_last_strides(yd))
        uids["y"] = cur.get_uid()
        return g, uids

    def _finish(self, g, key: PlanKey):
        cudnn = self.cudnn
        g.validate()
        g.build_operation_graph()
        if key.dtype == "float32" and not self.allow_tf32:
            notes = [getattr(cudnn.numerical_note, n) for n in ("TENSOR_CORE", "DOWN_CONVERT_INPUTS")
                     if hasattr(cudnn.numerical_note, n)]
            if notes:
                g.deselect_numeric_notes(notes)
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()  # the heuristic's first plan that builds; autotune builds its rivals one by one

    def build(self, key: PlanKey, buffers: dict, workspace_for) -> PlanEntry:
        """Build (and optionally autotune) the plan for `key`. `buffers`: role -> device pointer
        of this call's operands (autotune times on them; the output is rewritten afterwards).
        `workspace_for(nbytes)` returns a device pointer to at least nbytes."""
        errors = []
        for fuse in _fusion_levels(key.epilogue):
            try:
                g, uids = self._graph(key, fuse)
                self._finish(g, key)
            except NoPlan as exc:
                errors.append(str(exc))
                continue
            except Exception as exc:  # cuDNN's not-supported / bad-param answers come as several types
                errors.append(f"fuse={fuse}: {exc.__class__.__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
                continue
            plan_index = None
            if self.autotune:
                plan_index = self._autotune(g, uids, buffers, workspace_for)
                if plan_index is not None:
                    g.select_plan(plan_index)
                    g.build_plans()
            ws = int(g.get_workspace_size())
            meta = {"uids": uids, "workspace": ws, "fused": list(fuse), "plan_index": plan_index}
            return PlanEntry(CudnnPlan(g, uids, ws, tuple(fuse), plan_index), meta)
        raise NoPlan("; ".join(errors) or "no plan")

    def _autotune(self, g, uids, buffers, workspace_for) -> int | None:
        """Index of the fastest of the heuristic's first `autotune_max_plans` plans that build
        and run, in the heuristic's order; None if none could be timed (the first plan stays)."""
        import cupy as cp

        count = g.get_execution_plan_count()
        pack = {uids[r]: buffers[r] for r in uids}
        stream = cp.cuda.get_current_stream()
        self.cudnn.set_stream(handle=self.handle, stream=stream.ptr)
        best, best_ms, first_built = None, float("inf"), None
        start, end = cp.cuda.Event(), cp.cuda.Event()
        timed = 0
        for i in range(count):
            if timed >= self.autotune_max_plans:
                break
            try:
                g.build_plan_at_index(i)  # only the plans timed are built (not build_plan_policy.ALL)
                if first_built is None:
                    first_built = i  # the heuristic's own choice: the first plan that builds
                ws = workspace_for(int(g.get_workspace_size_plan_at_index(i)))
                g.execute_plan_at_index(pack, ws, i, handle=self.handle)  # warm-up
                times = []
                for _ in range(3):
                    start.record(stream)
                    g.execute_plan_at_index(pack, ws, i, handle=self.handle)
                    end.record(stream)
                    end.synchronize()
                    times.append(cp.cuda.get_elapsed_time(start, end))
            except Exception as exc:  # a plan that did not build or run is not a candidate
                log.debug("autotune: plan %d skipped: %s", i, exc)
                continue
            ms = statistics.median(times)
            timed += 1
            if ms < best_ms:
                best, best_ms = i, ms
        # building a plan selects it: with none timed, pin the heuristic's choice back
        return best if best is not None else first_built

    # ---- execution ----------------------------------------------------------------------------
    def execute(self, plan: CudnnPlan, buffers: dict, workspace_ptr: int, stream_ptr: int) -> None:
        if self.handle.stream != stream_ptr:
            self.cudnn.set_stream(handle=self.handle, stream=stream_ptr)
        pack = {uid: buffers[role] for role, uid in plan.uids.items()}
        if plan.native is None:
            plan.native = self._native_executor(plan) or False
        if plan.native:
            plan.native(pack, workspace_ptr)
        else:
            plan.graph.execute(pack, workspace_ptr, handle=self.handle)

    def _native_executor(self, plan: CudnnPlan):
        """The C++ graph's execute, called directly with the uid -> pointer pack: the public
        pygraph.execute re-describes every operand per call (tens of microseconds from Python),
        which is most of a small conv's cost. Uses frontend 1.28 internals (the version is
        pinned); anything unexpected leaves the public path in place."""
        g = plan.graph
        try:
            lowered = g._lowered_graph
            if lowered is None or g.selected_engine is not None:
                return None
            cpp_index = g._materialize_backend_plan(g._plan_index).cpp_index if g._plans else None
            h = self.handle.backend_handle
        except Exception as exc:
            log.info("cuDNN direct execute unavailable (%s); using pygraph.execute", exc)
            return None
        if cpp_index is None:
            return lambda pack, ws: lowered._execute(pack, ws, h, None, None, None)
        return lambda pack, ws: lowered._execute_plan_at_index(pack, ws, cpp_index, h, None, None, None)

    # ---- persistence (PlanSerializer) ------------------------------------------------------------
    def dumps(self, entry: PlanEntry) -> bytes | None:
        data = entry.plan.graph.serialize()
        entry.meta["blob"] = "bytes" if isinstance(data, (bytes, bytearray)) else "list"
        return bytes(data)

    def loads(self, key: PlanKey, blob: bytes, meta: dict) -> PlanEntry:
        import cupy as cp

        t0 = time.perf_counter()
        # deserialize runs a warm-up capture on the handle's stream: make it this thread's live one
        self.cudnn.set_stream(handle=self.handle, stream=cp.cuda.get_current_stream().ptr)
        g = self.cudnn.pygraph(handle=self.handle)
        g.deserialize(self.handle, blob if meta.get("blob") == "bytes" else list(blob))
        uids = {str(r): int(u) for r, u in meta["uids"].items()}
        if not {"x", "w", "y"} <= set(uids):
            raise ValueError(f"stored plan lacks operand uids: {uids}")
        log.info("plan cache: loaded %s from disk in %.1f ms", key, 1e3 * (time.perf_counter() - t0))
        return PlanEntry(CudnnPlan(g, uids, int(meta["workspace"]), tuple(meta["fused"]), meta.get("plan_index")),
                         dict(meta))
