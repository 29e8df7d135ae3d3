"""linear: act(x @ W^T + b) as the torch ops ``bert_fast::linear_fwd`` / ``bert_fast::linear_bwd``.

Backends (one is chosen per call, forward and backward separately):
  "triton"     our Triton GEMM (bert_fast.kernels.linear; on sm_90+ the TMA / persistent one of
               bert_fast.kernels.linear_tma) with bias + GELU fused in the epilogue;
               backward: fused dZ = dY * gelu'(z) + deterministic db kernel, Triton GEMMs for dX, dW
  "cublas"     torch.mm / F.linear (cuBLAS) + our fused bias+GELU Triton kernel
               (bert_fast.kernels.bias_gelu); backward: bias_gelu_bwd + torch.mm. On the CPU
               interpreter: torch's CPU matmul + the bias_gelu kernel through the interpreter.
  "torch"      the torch implementation (bert_fast.ops.torch_impl: F.linear (MKL / oneDNN / cuBLAS)
               + aten GELU, oneDNN's fused linear + GELU for bf16 inference on the CPU; backward
               aten.gelu_backward + two mm): the CPU path without the interpreter, the bf16 path
               under the interpreter (its tl.dot is wrong in bf16), float64 on CUDA, and every
               path with BERT_FAST_BACKEND=torch
  "reference"  pure torch (bert_fast.reference), only with BERT_FAST_BACKEND=reference
Wherever a kernel of ours runs ("triton", or "cublas" with its GELU kernel) the call is checked
against the torch implementation the first time its specialization runs, forward and backward
(bert_fast/ops/_verify.py; the cuBLAS path's GELU as the bias_gelu op).

Choosing between "triton" and "cublas" ("dispatch decided by measurement"):
  1. ``backend=`` argument of :func:`linear`, else ``BERT_FAST_LINEAR_BACKEND=triton|cublas|auto``;
  2. "auto" on CUDA: the table bert_fast/data/linear_dispatch.json, written on the GPU by
     benchmarks/ops/tune_linear_dispatch.py, keyed by device name (then compute capability) and
     "<fwd|bwd>|<activation>|<dtype>|M<next pow2 of M>|N<N>|K<K>". This lookup runs inside the
     ops (linear() passes them the backend "auto"), never in traced Python: reading the table
     file and the device name would be a graph break under torch.compile(fullgraph=True);
  3. no entry: :func:`default_backend` below, an *assumption* until measured on that GPU:
       - fp32, or M < 128 (bucketed)      -> cublas  (our fp32 dot is true-IEEE FMA; tiny M wastes tiles)
       - forward with GELU                -> triton  (the fused epilogue saves writing + re-reading
                                             the [M, N] pre-activation: at FFN-up shapes ~1/3 of
                                             the GEMM's own time; a Triton GEMM at ~80% of cuBLAS
                                             still wins)
       - plain forward, every backward    -> cublas  (nothing to fuse: cuBLASLt fuses the bias
                                             itself; our Hopper GEMM (TMA, persistent, but not
                                             warp-specialised) is predicted close to it, not
                                             ahead, so only a measured win in the table moves
                                             these to triton; the backward's fusion,
                                             dZ = dY * gelu'(z) + db, is our kernel in both
                                             backends)
  On CPU with the interpreter "auto" means "triton" (the kernel is what is being tested).

Save z or recompute it. With an activation the backward needs the pre-activation z. We save it
(forward writes M*N extra elements, backward reads them) instead of recomputing x @ W^T + b in the
backward (a whole extra GEMM, 2*M*N*K FLOPs). At BERT-base FFN-up (M=16384, N=3072, K=768, bf16):
saving costs ~100 MB written + read = ~65 us at ~3 TB/s, recomputing ~77 GFLOP = ~100 us at a
realistic ~750 TFLOP/s, plus its own 100 MB write. In general saving (4*M*N bytes of traffic)
beats recomputing (2*M*N*K FLOPs) when K > 2 * (FLOP rate / bandwidth), ~500-600 on H100: true for
every BERT-base/large GEMM with an activation (K = 768, 1024). For K = 384 (MiniLM) the two are
close, and recomputing would only win with dZ fused into the recomputing GEMM; not done. Saving
costs M*N activation memory, which activation checkpointing can trade back. z is only saved when a
gradient is needed (not under no_grad / inference).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_fast.ops import _dispatch, _verify, cpu_fp32_gemm, torch_impl

__all__ = ["linear"]

_DTYPES = _dispatch.FLOAT_DTYPES + (torch.float64,)
_ACTIVATIONS = {None: "none", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}
BACKENDS = ("triton", "cublas", "torch", "reference")
_ENV = "BERT_FAST_LINEAR_BACKEND"
DISPATCH_TABLE = Path(__file__).resolve().parent.parent / "data" / "linear_dispatch.json"


# ----------------------------------------------------------------------------- dispatch table
def m_bucket(m: int, cap: int = 16384) -> int:
    """Next power of two of M in [16, cap] (the table's and the autotuner's M key)."""
    b = 16
    while b < m and b < cap:
        b *= 2
    return b


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def table_key(direction: str, activation: str, dtype: torch.dtype, m: int, n: int, k: int) -> str:
    return f"{direction}|{activation}|{_DTYPE_NAMES[dtype]}|M{m_bucket(m)}|N{n}|K{k}"


@functools.lru_cache(maxsize=None)
def _load_table(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


@functools.lru_cache(maxsize=None)
def _device_entries(index: int) -> dict:
    """Table entries of CUDA device ``index``: by exact name, else by compute capability."""
    devices = _load_table(str(DISPATCH_TABLE)).get("devices", {})
    name = torch.cuda.get_device_name(index)
    if name in devices:
        return devices[name].get("entries", {})
    major, minor = torch.cuda.get_device_capability(index)
    for dev in devices.values():
        if dev.get("capability") == f"sm{major}{minor}":
            return dev.get("entries", {})
    return {}


def default_backend(
    capability: Tuple[int, int], direction: str, activation: str, dtype: torch.dtype, m: int, n: int, k: int
) -> str:
    """The documented guess used when the table has no entry (see the module docstring)."""
    if dtype == torch.float32 or m_bucket(m) < 128:
        return "cublas"
    if direction == "fwd" and activation != "none":
        return "triton"
    return "cublas"


def requested_backend(backend: Optional[str]) -> str:
    """The backend asked for: ``backend``, else BERT_FAST_LINEAR_BACKEND, else "auto" (checked)."""
    req = backend if backend is not None else os.environ.get(_ENV, "auto")
    req = req.strip().lower()
    if req not in ("auto", "triton", "cublas"):
        raise ValueError(f"linear backend must be 'auto', 'triton' or 'cublas' (argument or {_ENV}), got {req!r}")
    return req


def _table_backend(x: Tensor, n: int, k: int, activation: str, direction: str) -> str:
    """ "auto" on CUDA: the dispatch table's entry for this GPU and shape, else default_backend.

    Reads a file, the device name and capability: host work that torch.compile cannot trace
    (``open`` is a hard graph break). So it never runs at trace time: :func:`linear` passes the
    backend "auto" into the ops, whose implementations (opaque to dynamo) call this with real
    tensors. It depends only on the device, dtype and shapes, so the backward op recomputes the
    forward's choice exactly."""
    m = x.numel() // max(k, 1) if x.dim() else 0
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    entry = _device_entries(index).get(table_key(direction, activation, x.dtype, m, n, k))
    if entry is not None:
        return entry["backend"] if isinstance(entry, dict) else str(entry)
    return default_backend(_capability(index), direction, activation, x.dtype, m, n, k)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # asked at every un-tabled GEMM: once per GPU


def choose_backend(
    x: Tensor, n: int, k: int, activation: str, direction: str, backend: Optional[str] = None, defer_auto: bool = False
) -> str:
    """The backend ("triton", "cublas", "torch" or "reference") of one forward or backward call.

    ``defer_auto``: on CUDA with "auto" requested, return "auto" instead of reading the dispatch
    table (the ops resolve it at run time, see :func:`_table_backend`); what :func:`linear` uses,
    so that it traces under torch.compile(fullgraph=True) on CUDA too."""
    req = requested_backend(backend)
    impl = _dispatch.implementation(x, uses_dot=True)  # float64 on CUDA: "torch" (cuBLAS DGEMM)
    if impl != "kernel":
        return impl
    if req != "auto":
        return req
    if not x.is_cuda:
        return "triton"  # interpreter: test our kernel
    if defer_auto:
        return "auto"
    return _table_backend(x, n, k, activation, direction)


def _resolve(backend: str, x: Tensor, weight: Tensor, activation: str, direction: str) -> str:
    """Inside an op (real tensors): a deferred "auto" becomes the table's / default backend."""
    if backend != "auto":
        return backend
    n, k = weight.shape
    if x.is_cuda and x.dtype != torch.float64:
        return _table_backend(x, n, k, activation, direction)  # env-free: fwd and bwd agree
    return choose_backend(x, n, k, activation, direction, backend="auto")


# ----------------------------------------------------------------------------- forward op
def _split_backend(backend: str) -> Tuple[str, str]:
    """ "fwd[:bwd]" -> (fwd, bwd); each one of BACKENDS or "auto" (resolved inside the ops)."""
    fwd, _, bwd = backend.partition(":")
    bwd = bwd or fwd
    for b in (fwd, bwd):
        if b not in BACKENDS + ("auto",):
            raise ValueError(f"unknown linear backend {b!r} (expected one of {BACKENDS + ('auto',)})")
    return fwd, bwd


def _bias_or_zeros(bias: Optional[Tensor], n: int, like: Tensor) -> Tensor:
    return bias if bias is not None else like.new_zeros((n,))


# ----------------------------------------------------------------------------- first-use check
def _kernel_label(x: Tensor, backends: str) -> str:
    """The kernels a call runs: the GEMM (the TMA one where linear_tma takes fp16/bf16 on Hopper)
    and/or the bias+GELU kernel of the cuBLAS path."""
    if "triton" not in backends:
        return "bert_fast.kernels.bias_gelu (Triton, the cuBLAS path's GELU)"
    tma = False
    try:
        from bert_fast.kernels import linear_tma

        tma = linear_tma.enabled_for(x.device, x.dtype)
    except Exception:  # noqa: BLE001
        pass
    return "bert_fast.kernels.linear_tma (Triton TMA GEMM)" if tma else "bert_fast.kernels.linear (Triton GEMM)"


def _gemm_magnitude(a: Tensor, b: Tensor) -> Tensor:
    """|a| @ |b| in fp32 (float64 for float64): sum |a_ik b_kj| of every dot product."""
    work = torch.float64 if a.dtype == torch.float64 else torch.float32
    return torch.mm(a.detach().abs().to(work), b.detach().abs().to(work))


def _fwd_checks(x, weight, bias, act, k, t):
    """z = x W^T + b: sum |x||w| + |b| (dot), accumulated over K; y = gelu(z): |gelu'| <= 1.13 times
    that, plus the torch implementation's rounding of z in the dtype (mag)."""
    dot = _gemm_magnitude(x, weight.t())
    if bias is not None:
        dot = dot + _verify.absf(bias, dot.dtype)
    kk = x.shape[1] + 2
    checks = []
    if k[1] is not None or t[1] is not None:
        checks.append(_verify.Check("z", k[1], t[1], dot=dot, acc=kk * dot))
    if act is None:
        checks.append(_verify.Check("y", k[0], t[0], dot=dot, acc=kk * dot))
    else:
        g = _verify.GELU_SLOPE * dot
        checks.append(_verify.Check("y", k[0], t[0], mag=g, dot=g, acc=kk * g))
    return checks


def _bwd_checks(dy, x, weight, z_full, act, need, k, t):
    """dz = dy gelu'(z) is at most |dy| (1.13 + |z|) (|gelu''| <= 0.8 times the rounding of z);
    dx = dz W, dw = dz^T x, db = sum dz: the GEMMs of those magnitudes, rounded once more in the
    dtype (dz) and accumulated over N, M, M."""
    g = _verify.absf(dy)
    if act is not None:
        g = g * (_verify.GELU_SLOPE + _verify.absf(z_full, g.dtype))
    m, n = g.shape
    checks = []
    if need[0]:
        dot = _gemm_magnitude(g, weight)
        checks.append(_verify.Check("dx", k[0], t[0], mag=dot, dot=dot, acc=(n + 2) * dot))
    if need[1]:
        dot = _gemm_magnitude(g.t(), x)
        checks.append(_verify.Check("dweight", k[1], t[1], mag=dot, dot=dot, acc=(m + 2) * dot))
    if need[2]:
        s = g.sum(dim=0)
        checks.append(_verify.Check("dbias", k[2], t[2], mag=s, acc=(m + 2) * s))
    return checks


@torch.library.custom_op("bert_fast::linear_fwd", mutates_args=())
@_dispatch.op_impl
def linear_fwd(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str, save_z: bool
) -> Tuple[Tensor, Tensor]:
    """(y, z) for x [M, K] (any strides), weight [N, K]. z is what the backward needs when an
    activation is set and ``save_z``: x @ W^T + b ("triton", "torch", "reference") or x @ W^T without the
    bias ("cublas", whose bias+GELU kernel adds the bias itself); otherwise an empty tensor.

    ``backend``: "<forward backend>" or "<forward backend>:<backward backend>" (the backward part
    is only read by the autograd formula); "auto" is resolved here, at run time (see
    ``_table_backend``)."""
    act = None if activation == "none" else activation
    backend = _resolve(_split_backend(backend)[0], x, weight, activation, "fwd")
    keep_z = save_z and act is not None
    if backend == "triton":

        def kernel():
            from bert_fast.kernels.linear import linear_fwd as launch

            return launch(x, weight, bias, act, save_z=keep_z)

        n, k = weight.shape
        spec = (
            "triton",
            x.dtype,
            activation,
            bias is not None,
            keep_z,
            _verify.bucket(x.shape[0]),
            n,
            k,
            _verify.aligned(x, weight, bias),
        )
        y, z = _verify.run(
            "linear",
            "fwd",
            spec,
            x.device,
            label=lambda: _kernel_label(x, "triton"),
            dtype=x.dtype,
            kernel=kernel,
            fallback=lambda _keep: torch_impl.linear_fwd(x, weight, bias, act, keep_z),
            checks=lambda kout, tout, _keep: _fwd_checks(x, weight, bias, act, kout, tout),
        )
    elif backend == "cublas":
        if act is None:
            y, z = F.linear(x, weight, bias).contiguous(), None
        else:  # cuBLAS GEMM, then our bias+GELU kernel (checked as the bias_gelu op)
            from bert_fast.ops.bias_gelu import verified_fwd

            z = torch.mm(x, weight.t())
            y = verified_fwd(z, _bias_or_zeros(bias, weight.shape[0], z), torch_impl.GELU_APPROXIMATE[act])
    elif backend == "torch":
        y, z = torch_impl.linear_fwd(x, weight, bias, act, keep_z)
    else:  # reference
        z = F.linear(x, weight, bias)
        y = z if act is None else F.gelu(z, approximate=torch_impl.GELU_APPROXIMATE[act])
        y = y.contiguous()
        z = z.contiguous() if act is not None else None
    if not keep_z or z is None:
        z = x.new_empty((0,))
    return y, z


@linear_fwd.register_fake
def _(x, weight, bias, activation, backend, save_z):
    y = x.new_empty((x.shape[0], weight.shape[0]))
    z = x.new_empty(y.shape) if (save_z and activation != "none") else x.new_empty((0,))
    return y, z


# ----------------------------------------------------------------------------- backward op
@torch.library.custom_op("bert_fast::linear_bwd", mutates_args=())
@_dispatch.op_impl
def linear_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    z: Tensor,
    activation: str,
    fwd_backend: str,
    bwd_backend: str,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db) of linear_fwd given dy [M, N] (any strides); a gradient not asked for is an
    empty tensor. ``fwd_backend`` says what z holds (see linear_fwd); ``bwd_backend`` picks the GEMMs."""
    act = None if activation == "none" else activation
    # "auto" (deferred by linear()): the same pure function of device/dtype/shapes the forward
    # used, so fwd_backend still says what z holds
    fwd_backend = _resolve(fwd_backend, x, weight, activation, "fwd")
    bwd_backend = _resolve(bwd_backend, x, weight, activation, "bwd")
    n = weight.shape[0]
    if act is not None and z.numel() != dy.numel():
        raise RuntimeError(
            "bert_fast::linear_bwd: the forward did not save the pre-activation "
            "(call linear_fwd with save_z=True when gradients are needed)"
        )
    if fwd_backend == "torch" and bwd_backend == "torch":
        return _torch_bwd(dy, x, weight, z if act is not None else None, act, need_dx, need_dw, need_db)
    uses_kernel = (act is not None and fwd_backend == "cublas") or "triton" in (fwd_backend, bwd_backend)
    if not uses_kernel:
        return _kernel_bwd(dy, x, weight, bias, z, act, fwd_backend, bwd_backend, need_dx, need_dw, need_db)
    # z as the torch implementation reads it: the cuBLAS path saved it without the bias
    z_full = None
    if act is not None:
        z_full = z + bias if (fwd_backend == "cublas" and bias is not None) else z
    need = (need_dx, need_dw, need_db)
    spec = (
        fwd_backend,
        bwd_backend,
        dy.dtype,
        activation,
        need,
        _verify.bucket(x.shape[0]),
        n,
        x.shape[1],
        _verify.aligned(dy, x, weight, z if act is not None else None),
    )
    return _verify.run(
        "linear",
        "bwd",
        spec,
        x.device,
        label=lambda: _kernel_label(x, fwd_backend + ":" + bwd_backend),
        dtype=dy.dtype,
        kernel=lambda: _kernel_bwd(dy, x, weight, bias, z, act, fwd_backend, bwd_backend, need_dx, need_dw, need_db),
        fallback=lambda _keep: _torch_bwd(dy, x, weight, z_full, act, need_dx, need_dw, need_db),
        checks=lambda kout, tout, _keep: _bwd_checks(dy, x, weight, z_full, act, need, kout, tout),
    )


def _torch_bwd(dy, x, weight, z, act, need_dx, need_dw, need_db):
    """linear_bwd's outputs from the torch implementation (z: the pre-activation with the bias)."""
    dx, dw, db = torch_impl.linear_bwd(dy, x, weight, z, act, need_dx, need_dw, need_db)
    empty = dy.new_empty((0,))
    return (dx if need_dx else empty), (dw if need_dw else empty.clone()), (db if need_db else empty.clone())


def _kernel_bwd(dy, x, weight, bias, z, act, fwd_backend, bwd_backend, need_dx, need_dw, need_db):
    """linear_bwd's outputs from our kernels (and cuBLAS where the backends say so)."""
    need_dz = need_dx or need_dw
    n = weight.shape[0]
    # 1. dZ = dY * act'(z) and db, fused
    db = None
    if act is not None and fwd_backend == "cublas":
        from bert_fast.kernels.bias_gelu import bias_gelu_bwd

        dz, db = bias_gelu_bwd(dy, z, _bias_or_zeros(bias, n, dy), torch_impl.GELU_APPROXIMATE[act])
    elif fwd_backend == "triton" or (act is None and bwd_backend == "triton"):
        from bert_fast.kernels.linear import linear_bwd_dz

        dz, db = linear_bwd_dz(dy, z if act is not None else None, act, need_dz=need_dz, need_db=need_db)
    else:  # torch / reference (and plain cuBLAS: dz is dy)
        dz = dy if act is None else torch.ops.aten.gelu_backward(dy, z, approximate=torch_impl.GELU_APPROXIMATE[act])
        if need_db:
            db = dz.sum(0, dtype=torch.float64 if dz.dtype == torch.float64 else torch.float32)
    # 2. dX = dZ @ W, dW = dZ^T @ X (dZ^T read by strides, never copied)
    dx = dw = None
    if bwd_backend == "triton":
        from bert_fast.kernels.linear import KIND_DW, KIND_DX, gemm

        if need_dx:
            dx = gemm(dz, weight, KIND_DX)
        if need_dw:
            dw = gemm(dz.t(), x, KIND_DW)
    else:
        if need_dx:
            dx = torch.mm(dz, weight)
        if need_dw:
            dw = torch.mm(dz.t(), x)
    empty = dy.new_empty((0,))
    dx = dx.to(x.dtype) if need_dx else empty
    dw = dw.to(weight.dtype) if need_dw else empty.clone()
    db = db.to(dy.dtype) if (need_db and db is not None) else empty.clone()
    return dx, dw, db


@linear_bwd.register_fake
def _(dy, x, weight, bias, z, activation, fwd_backend, bwd_backend, need_dx, need_dw, need_db):
    dx = x.new_empty(x.shape) if need_dx else dy.new_empty((0,))
    dw = weight.new_empty(weight.shape) if need_dw else dy.new_empty((0,))
    db = dy.new_empty((weight.shape[0],)) if need_db else dy.new_empty((0,))
    return dx, dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, activation, backend, save_z = inputs
    _, z = output
    ctx.save_for_backward(x, weight, bias, z)
    ctx.activation = activation
    ctx.backend, ctx.bwd_backend = _split_backend(backend)
    ctx.has_bias = bias is not None


def _backward(ctx, dy, _dz_unused):
    x, weight, bias, z = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    if not (need_dx or need_dw or need_db):
        return None, None, None, None, None, None
    dx, dw, db = torch.ops.bert_fast.linear_bwd(
        dy, x, weight, bias, z, ctx.activation, ctx.backend, ctx.bwd_backend, need_dx, need_dw, need_db
    )
    return (dx if need_dx else None), (dw if need_dw else None), (db if need_db else None), None, None, None


linear_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public API
def _autocast_inputs(x: Tensor, weight: Tensor, bias: Optional[Tensor]):
    """Under torch.autocast, what nn.Linear does: fp32/fp16/bf16 operands are cast to the autocast
    dtype (fp64 is left alone). The op itself then runs with autocast off (``_dispatch.op_impl``)."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(dev)
    cast = lambda t: t if t is None or t.dtype in (dtype, torch.float64) else t.to(dtype)
    return cast(x), cast(weight), cast(bias)


def backend(device, dtype) -> str:
    """What runs for tensors of ``dtype`` on ``device`` (``bert-fast info``)."""
    device = torch.device(device)
    impl = _dispatch.implementation_for(device, dtype, uses_dot=True)
    kernel = "Triton or cuBLAS (auto, per shape)" if device.type == "cuda" else "Triton"
    fused = (
        " (no-grad: oneDNN fused GELU)"
        if (device.type == "cpu" and dtype == torch.bfloat16 and torch_impl.onednn_bf16())
        else ""
    )
    if device.type == "cpu" and dtype == torch.float32 and impl == "torch" and cpu_fp32_gemm.use_onednn():
        # measured faster than F.linear on this CPU (bert_fast/ops/cpu_fp32_gemm.py)
        return _dispatch.describe(impl, device, "oneDNN linear, GELU fused (measured faster than F.linear)", kernel)
    return _dispatch.describe(impl, device, f"F.linear + aten GELU{fused}", kernel)


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
    backend: Optional[str] = None,
) -> Tensor:
    """act(x @ weight^T + bias) for x [..., K], weight [N, K], bias [N] or None -> [..., N].

    activation: None, "gelu" (exact erf GELU) or "gelu_tanh" (tanh approximation).
    backend: None (``BERT_FAST_LINEAR_BACKEND``, default "auto"), "auto", "triton" or "cublas";
    see the module docstring. Any strides of x and weight are accepted.

    Raises TypeError (non-tensor, non-floating or mismatched dtypes) and ValueError (shapes,
    devices, unknown activation or backend). Zero rows give an empty [..., N] output.
    """
    _dispatch.check_tensor("x", x, dtypes=_DTYPES)
    _dispatch.check_tensor("weight", weight, dtypes=_DTYPES)
    if bias is not None:
        _dispatch.check_tensor("bias", bias, dtypes=_DTYPES)
    x, weight, bias = _autocast_inputs(x, weight, bias)
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: the last dimension of x (shape {tuple(x.shape)}) must equal "
            f"K = weight.shape[1] (weight shape {tuple(weight.shape)})"
        )
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"linear: bias shape {tuple(bias.shape)} must be (N,) = "
                f"({weight.shape[0]},) for weight shape {tuple(weight.shape)}"
            )
    _dispatch.check_same_dtype(x=x, weight=weight, bias=bias)
    _dispatch.check_same_device(x=x, weight=weight, bias=bias)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"linear: activation must be one of {list(_ACTIVATIONS)}, got {activation!r}")
    act = _ACTIVATIONS[activation]
    n, k = weight.shape
    x2d = x if x.dim() == 2 else x.reshape(-1, k)
    # With a backward, both directions are chosen now (same shapes), so a forced backend holds for
    # the backward too. On CUDA an "auto" request stays "auto" here and is resolved inside the ops:
    # the table lookup (file read, device name) would be a graph break under torch.compile(fullgraph=True).
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    chosen = choose_backend(x2d, n, k, act, "fwd", backend, defer_auto=True)
    if needs_grad:
        chosen += ":" + choose_backend(x2d, n, k, act, "bwd", backend, defer_auto=True)
    y, _ = _dispatch.call_op("linear_fwd", x2d, weight, bias, act, chosen, act != "none" and needs_grad)
    return y.view(*x.shape[:-1], n)
