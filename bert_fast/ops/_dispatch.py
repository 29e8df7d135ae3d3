"""Shared plumbing of the bert_fast ops: which implementation runs, input validation, dropout seeds.

Every op has three implementations, and :func:`implementation` picks one per call (one rule, every
op follows it):

  * ``"kernel"``    our kernels: Triton (bert_fast.kernels), or the CUDA extension (embedding);
  * ``"torch"``     the op built from torch's own fast operations (bert_fast.ops.torch_impl: oneDNN /
                    MKL / cuBLAS GEMMs, aten GELU and LayerNorm with their backward ops, the SDPA
                    flash kernel): the production CPU path, and on CUDA the fallback a user selects
                    with ``BERT_FAST_BACKEND=torch``;
  * ``"reference"`` the pure-torch oracle (bert_fast.reference): simple, float64-capable, slow; it
                    runs only when forced (tests, bisecting).

The rule, in order:
  1. ``BERT_FAST_BACKEND=reference`` -> reference everywhere; ``BERT_FAST_BACKEND=torch`` -> torch
     everywhere (CUDA too). Unset / ``auto``: the rules below. The variable is read at every call.
  2. CUDA tensors -> kernel (float64 -> torch: no kernel is built for it).
  3. CPU tensors with ``TRITON_INTERPRET=1`` -> the kernels through the Triton interpreter (tests),
     except where the interpreter is known wrong: ``tl.dot`` on bf16 operands returns garbage
     (triton 3.6 and 3.9, measured), so ops whose kernel uses ``tl.dot`` take torch for bf16.
  4. CPU tensors otherwise (and any other device) -> torch.
The embedding is the one op with a compiled CPU kernel: see bert_fast/ops/embedding.py for how it
maps these three names.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


IMPLEMENTATIONS = ("kernel", "torch", "reference")
_BACKEND_ENV = "BERT_FAST_BACKEND"


def requested_backend() -> str:
    """``BERT_FAST_BACKEND``: "auto" (unset), "torch" or "reference". ValueError names a bad value."""
    req = os.environ.get(_BACKEND_ENV, "").strip().lower()
    if req in ("", "auto"):
        return "auto"
    if req in ("torch", "reference"):
        return req
    raise ValueError(f"{_BACKEND_ENV} must be 'auto', 'torch' or 'reference', got {req!r}")


def reference_forced() -> bool:
    return requested_backend() == "reference"


def implementation_for(device, dtype: torch.dtype, uses_dot: bool = False) -> str:
    """Which implementation of an op runs on tensors of ``dtype`` on ``device``: "kernel", "torch"
    or "reference" (the rule of this module's docstring). Allocates nothing.

    ``uses_dot``: the op's kernel uses ``tl.dot``, which the CPU interpreter gets wrong in bf16.
    Ops whose kernel lacks a dtype (attention: no float64) map "kernel" to "torch" themselves.
    """
    req = requested_backend()
    if req != "auto":
        return req
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cuda":
        return "torch" if dtype == torch.float64 else "kernel"
    if kind == "cpu" and interpreter_enabled():
        return "torch" if (uses_dot and dtype == torch.bfloat16) else "kernel"
    return "torch"


def implementation(t: torch.Tensor, uses_dot: bool = False) -> str:
    """:func:`implementation_for` the device and dtype of tensor ``t``."""
    return implementation_for(t.device, t.dtype, uses_dot)


def use_triton(t: torch.Tensor, uses_dot: bool = False) -> bool:
    """Whether the op on ``t`` runs our kernel (``implementation(t, uses_dot) == "kernel"``)."""
    return implementation(t, uses_dot) == "kernel"


def describe(impl: str, device, torch_label: str, kernel_label: str = "Triton") -> str:
    """The ``bert-fast info`` label of implementation ``impl`` on ``device`` (op modules' backend())."""
    kind = torch.device(device).type
    if impl == "kernel":
        return kernel_label if kind == "cuda" else f"{kernel_label} interpreter (TRITON_INTERPRET=1)"
    if impl == "torch":
        if requested_backend() == "torch":
            why = " (BERT_FAST_BACKEND=torch)"
        elif kind == "cpu" and interpreter_enabled():
            why = " (the interpreter's bf16 tl.dot is wrong)"
        else:
            why = ""
        return f"torch: {torch_label}{why}"
    return "reference (pure PyTorch oracle" + (", BERT_FAST_BACKEND=reference)" if reference_forced() else ")")


def deterministic() -> bool:
    """Kernels take their deterministic (atomics-free) path when torch asks for it."""
    return torch.are_deterministic_algorithms_enabled()


# ----------------------------------------------------------------------------- validation
def check_tensor(
    name: str, t, *, ndim: Optional[int | Sequence[int]] = None, dtypes: Optional[Iterable[torch.dtype]] = None
) -> None:
    """Raise TypeError/ValueError naming ``name`` when ``t`` is not a tensor of the right kind."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {tuple(t.shape)}"
            )
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def check_same_device(**tensors) -> None:
    """Raise ValueError naming the tensors when they are not all on one device."""
    devices = {k: v.device for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError("tensors must be on one device, got " + ", ".join(f"{k} on {d}" for k, d in devices.items()))


def check_same_dtype(**tensors) -> None:
    dtypes = {k: v.dtype for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    if len(set(dtypes.values())) > 1:
        raise TypeError("tensors must share one dtype, got " + ", ".join(f"{k}: {d}" for k, d in dtypes.items()))


def check_dropout_p(p) -> float:
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {p!r}")
    return float(p)


# ----------------------------------------------------------------------------- dropout seeds
def draw_seed(dropout_p: float, generator: Optional[torch.Generator] = None) -> Optional[torch.Tensor]:
    """One int64 seed for an op's Philox dropout stream, drawn from torch's CPU generator.

    Returns None when dropout is off. The seed is a CPU tensor (not a Python int) so that
    torch.compile traces it without a graph break; drawing it from torch's generator means
    ``torch.manual_seed`` reproduces masks and ``torch.utils.checkpoint`` (which restores the RNG
    state before recomputing) regenerates exactly the same masks. The op saves the seed for
    backward, so backward rebuilds the forward's mask instead of storing it.
    """
    if dropout_p == 0.0:
        return None
    # device="cpu" explicitly: under torch.set_default_device("cuda") (or `with torch.device(...)`)
    # the seed would otherwise live on the GPU, and reading it costs a sync per dropout op.
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=generator, device="cpu")


def seed_value(seed: Optional[torch.Tensor]) -> int:
    """The Python int inside a seed tensor (0 when there is none)."""
    return 0 if seed is None else int(seed.reshape(-1)[0].item())


def reference_dropout_mask(shape, dropout_p: float, seed: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """The keep-mask of the torch and reference implementations: a function of (seed, shape)
    alone (bert_fast/ops/keep_mask.py: a Philox stream, vectorized and threaded on the host), so
    backward and checkpoint recomputation rebuild the forward's mask. (The Triton kernels draw
    their own Philox layouts; all are Bernoulli(1 - p), none claims to reproduce another's bits.)"""
    if seed is None or dropout_p == 0.0:
        return None
    from bert_fast.ops.keep_mask import keep_mask  # deferred: keep_mask imports the compiled module

    return keep_mask(shape, dropout_p, seed_value(seed), device)


def host_checks_allowed(t: torch.Tensor) -> bool:
    """Whether a validation that reads tensor values on the host (one sync) may run now.

    Not while a CUDA graph is being captured (a sync there is illegal); the CUDA-graph runner
    validates its inputs on the host before each replay instead.
    """
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def op_impl(fn):
    """Run an op implementation on its first argument's GPU, with autocast off.

    * Triton launches on the *current* CUDA device, so without the device guard a model on cuda:1
      in a process whose current device is cuda:0 would launch on the wrong GPU (an illegal address).
    * Custom ops fall through autocast, so the torch calls inside an implementation (the cuBLAS
      GEMM, the references) would still be autocast: their output dtype would then depend on the
      backend and disagree with the fake implementation. Inside, every op computes in its inputs'
      dtype; the public functions decide the dtype (``linear`` casts as nn.Linear does).
    Wraps the function, keeping its signature, so torch.library.custom_op can infer the schema.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = args[0]
        other_gpu = t.is_cuda and t.device.index != torch.cuda.current_device()
        autocast_on = torch.is_autocast_enabled(t.device.type)
        if not (other_gpu or autocast_on):  # the usual case: no context managers
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            if other_gpu:
                stack.enter_context(torch.cuda.device(t.device))
            if autocast_on:
                stack.enter_context(torch.autocast(t.device.type, enabled=False))
            return fn(*args, **kwargs)

    # Resolved annotations: the op modules use `from __future__ import annotations`, whose strings
    # would otherwise be evaluated in this module when custom_op infers the schema.
    wrapper.__signature__ = inspect.signature(fn, eval_str=True)
    _IMPLS[fn.__name__] = wrapper
    return wrapper


# ----------------------------------------------------------------------------- direct calls
# The implementation behind each custom op, by name (op_impl records it).
_IMPLS: dict = {}
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (int, float, str, bool, type(None))
_functorch_stack = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)


def call_op(name: str, *args):
    """``torch.ops.bert_fast.<name>(*args)``, or the op's implementation called directly where the
    dispatcher would add nothing but its cost: ~18 us of the ~65 us a linear call takes on the host
    (benchmarks/model/host_overhead.py), and the H200 lease found the un-graphed forward host-bound.

    Direct only when nothing can be watching the op: no input needs a gradient (no autograd node to
    record), nothing is compiling or tracing, no functorch transform, dispatch mode (FakeTensorMode,
    ...) or torch function mode is active, no profiler runs (its trace keeps the op's name), and
    every tensor is a plain tensor or parameter (no DTensor, no fake or functional tensor). The
    same function runs either way, with the same device guard and autocast rule (op_impl), so the
    outputs are the same (tests/ops/test_direct_calls.py)."""
    impl = _IMPLS.get(name)
    if impl is None or not _direct_allowed(args):
        return getattr(torch.ops.bert_fast, name)(*args)
    return impl(*args)


def _direct_allowed(args) -> bool:
    if (
        _functorch_stack is None
        or _dispatch_modes is None
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._is_torch_function_mode_enabled()
        or _dispatch_modes() != 0
        or _functorch_stack() is not None
        or torch.autograd._profiler_enabled()
    ):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN or (grad and a.requires_grad):
                return False
        elif not isinstance(a, _SCALARS):  # an fx Proxy, say: the op records itself there
            return False
    return True
