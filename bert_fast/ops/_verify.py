"""First-use verification: every kernel specialization is checked once, on the user's own machine,
against the torch implementation, and a kernel that fails is replaced by it (issue 16).

Where the check sits. Inside the custom ops' implementations (bert_fast/ops/<op>.py), at the point
where the dispatch (``_dispatch.implementation``) picked "kernel". The op hands :func:`run` the kernel
call, the torch implementation of the same computation (bert_fast.ops.torch_impl, on the same
inputs) and how to bound their difference. Dynamo never traces a custom op's body, so none of this
breaks a torch.compile graph; autocast is off inside the bodies (``_dispatch.op_impl``); nothing here
communicates across ranks (DDP and FSDP see the same ops).

The specialization (the key). ``(op, direction, spec, device)``: ``spec`` is the op's tuple of what
its kernel is compiled and tuned for (dtype, flags such as mask/dropout/activation, the shape bucket:
the next power of two of the rows or sequence length, the exact hidden/head sizes, 16-byte alignment,
which Triton specializes on). The rest of the identity (device name and capability, torch, CUDA
runtime and Triton versions, a SHA-256 of the kernel's sources, of its op module and of this
checker) names the file the verdicts are kept in, so that a new driver stack, a new Triton or an
edited kernel is checked again.

Outcomes of a check:
  * pass: the kernel's result is returned; the verdict is kept in memory (every later call of the
    specialization is one dict lookup, no extra launch) and on disk, beside the autotune winners
    (``<Triton cache>/bert_fast_verify/<op>-<identity hash>.json``, or ``$BERT_FAST_VERIFY_DIR``),
    written to a temporary file and renamed, merged with what other processes wrote meanwhile (a
    "fail" is never overwritten by a "pass"), so a later process does not check again;
  * fail (the kernel raised at compile or launch, returned NaN/Inf where the torch implementation
    has none, or differs from it by more than the bound): the op returns the torch implementation's
    result, one warning (:class:`KernelFallbackWarning`) names the kernel, the specialization, the
    reason and the command that produces a report (``bert-fast doctor --json report.json``), and the
    verdict is kept so that later calls and later processes go straight to the torch implementation
    (they warn once too, quoting the kept reason). A failure of the environment rather than the
    kernel (an OSError while compiling, e.g. no C compiler for Triton's launcher; memory exhausted)
    falls back for this process only and is not kept: the next process checks again;
  * inconclusive (the torch implementation itself raised, e.g. out of memory): the kernel's result
    is returned and this process does not check that specialization again.

``BERT_FAST_VERIFY`` (read at every call): ``first`` (default, the above), ``always`` (check every
call until a check fails; for debugging), ``off`` (kernels run unchecked and kept verdicts are
ignored), ``strict`` (as ``first``, but a failed check, or a kept failed verdict, raises
:class:`KernelCheckError` instead of falling back: the test suite runs so, the safety net must
never hide a kernel bug from our own tests).

A backward follows its forward (``follows``): when the forward's specialization failed, the
backward takes the torch implementation without a check, because what the forward saved comes from
it (its dropout stream, its log-sum-exp convention). When the forward is the kernel and only the
backward fails, the torch backward stands in with the kernel's own dropout mask (``kernel_mask``).

Dropout. The kernels draw Philox streams, the torch implementation draws ``reference_dropout_mask``
from the same seed: the bits differ. A check with dropout on compares with the same keep-mask:
the op exposes the exact mask its kernel applied (each kernel file has a mask kernel calling the same
Philox function), and the torch implementation is run with that mask. A forward that falls back
uses the torch implementation's own stream (a mask kernel may be what fails), and so does its
backward.

CUDA graphs. A check synchronizes and reads values on the host, which is illegal while a graph is
being captured: a specialization never seen before runs the torch implementation during a
capture, unchecked (the CUDA-graph runner warms every bucket up before capturing, so the check
happens there); a kept verdict is honoured as usual.

The bound (:func:`compare`). No oracle runs at first use (a float64 run of a bert-large attention
would not fit beside the model), so the kernel (K) is compared with the torch implementation (T)
in the same dtype, element by element:

    |K - T| <= 4 * ( u * (|T| + mag + dot) + u_tf32 * dot + u_acc * (acc + 16 * (|T| + mag + dot)) )
               + 4 * tiny(dtype)

with u the unit roundoff of the op's dtype (2^-11 fp16, 2^-8 bf16, 2^-24 fp32), u_acc that of the
fp32 accumulators, u_tf32 = 2^-11 for fp32 GEMMs where TF32 is allowed (else 0), and three
magnitude tensors the op derives from its inputs (its ``_checks`` functions): ``mag`` bounds what
one rounding in the op's dtype can move the output by (an intermediate rounded in the dtype: x + b
before GELU, the attention scores and probabilities of the materialized softmax, the LayerNorm
input), ``dot`` is sum |a_i b_i| of the dot products behind the element (reduced-precision split-K
reductions and TF32 round each product or partial sum relative to it) and ``acc`` is the length of
the accumulation times that magnitude (the worst-case error of an fp32 sum of n terms is
(n - 1) u_acc sum |terms|). Why it cannot false-alarm on a correct kernel: each of K and T computes
the exact result with an error the same first-order analysis bounds by u (|T| + mag + dot) +
u_tf32 dot + u_acc acc (worst case over rounding, not a statistical estimate: the attention and
LayerNorm magnitudes are upper bounds from Cauchy-Schwarz and sum p <= 1); the difference of two
such results is within twice that, and the factor 4 leaves another 2x for second-order terms and
the few-ulp error of exp/erf/tanh (the ``16 u_acc`` term). It is the 2x rule of
bert_fast.testing with the float64 oracle replaced by this worst case. tests/ops/test_verify.py runs
every op test file with ``BERT_FAST_VERIFY=strict`` (no false alarm on any parity case) and shows
that a perturbation of one element by (1 + max |T|) fails it. It is looser than the 2x rule where
the inputs are badly conditioned (large scores, rows whose mean dwarfs their spread), as it must
be: there the torch implementation's own error is that large.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "KernelCheckError",
    "KernelFallbackWarning",
    "Check",
    "run",
    "compare",
    "mode",
    "reset",
    "verdict",
    "store_dir",
    "REPORT_COMMAND",
]

ENV = "BERT_FAST_VERIFY"
DIR_ENV = "BERT_FAST_VERIFY_DIR"
MODES = ("first", "always", "off", "strict")
REPORT_COMMAND = "bert-fast doctor --json report.json"
SAFETY = 4.0
PASS, FAIL, UNCHECKED = "pass", "fail", "unchecked"

_log = logging.getLogger("bert_fast.verify")


class KernelCheckError(RuntimeError):
    """A kernel failed its check (or has a kept failed verdict) with ``BERT_FAST_VERIFY=strict``."""


class KernelFallbackWarning(UserWarning):
    """A kernel failed its first-use check: the op uses the torch implementation instead."""


def mode() -> str:
    """``BERT_FAST_VERIFY``: first (default), always, off or strict. ValueError names a bad value."""
    m = os.environ.get(ENV, "").strip().lower()
    if m in ("", "first"):
        return "first"
    if m not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {m!r}")
    return m


# ----------------------------------------------------------------------------- specialization helpers
def bucket(n: int) -> int:
    """Next power of two of ``n``, at least 16: the shape bucket of rows / sequence lengths."""
    b = 16
    while b < n:
        b *= 2
    return b


def aligned(*tensors: Optional[Tensor]) -> bool:
    """Every tensor's base and row pitches 16-byte aligned (what Triton specializes pointers and
    strides on, and what the TMA GEMM needs)."""
    for t in tensors:
        if t is None:
            continue
        if t.data_ptr() % 16:
            return False
        es = t.element_size()
        for s in t.stride()[:-1]:
            if (s * es) % 16:
                return False
    return True


# ----------------------------------------------------------------------------- identity and store
_COMMON_SOURCES = ("bert_fast.ops._verify", "bert_fast.ops.torch_impl", "bert_fast.ops._dispatch")
SOURCES = {
    "linear": (
        "bert_fast.kernels.linear",
        "bert_fast.kernels.linear_tma",
        "bert_fast.kernels._linear_common",
        "bert_fast.kernels.bias_gelu",
        "bert_fast.kernels.tuned_configs",
        "bert_fast.kernels._device",
        "bert_fast.ops.linear",
    ),
    "bias_gelu": ("bert_fast.kernels.bias_gelu", "bert_fast.ops.bias_gelu"),
    "residual_layer_norm": ("bert_fast.kernels.residual_layer_norm", "bert_fast.ops.residual_layer_norm"),
    "linear_residual_layer_norm": (
        "bert_fast.kernels.linear",
        "bert_fast.kernels.linear_tma",
        "bert_fast.kernels.residual_layer_norm",
        "bert_fast.ops.linear_residual_layer_norm",
    ),
    "attention": ("bert_fast.kernels.attention", "bert_fast.kernels._device", "bert_fast.ops.attention"),
    "embedding": ("bert_fast._C", "bert_fast.ops.embedding"),
}


def _module_file(name: str) -> Optional[str]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


@functools.lru_cache(maxsize=None)
def source_hash(op: str) -> str:
    """SHA-256 (hex, 16 digits) of the files of ``op``'s kernels (the compiled extension for the
    embedding), its op module and the checker itself."""
    h = hashlib.sha256()
    for name in SOURCES.get(op, ()) + _COMMON_SOURCES:
        path = _module_file(name)
        h.update(name.encode())
        if path is None:
            h.update(b"<missing>")
            continue
        try:
            h.update(Path(path).read_bytes())
        except OSError:
            h.update(b"<unreadable>")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def device_label(device: torch.device) -> str:
    """ "NVIDIA H100 80GB HBM3 sm_90" on CUDA; "cpu (Triton interpreter)" under TRITON_INTERPRET=1."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return f"{device.type} (Triton interpreter)"
    return device.type


@functools.lru_cache(maxsize=None)
def _versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - the embedding's kernel needs no Triton
        triton_version = None
    import bert_fast

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "bert_fast": getattr(bert_fast, "__version__", None),
    }


def store_dir() -> Path:
    """Where verdicts are kept: ``$BERT_FAST_VERIFY_DIR``, else ``bert_fast_verify`` in Triton's cache
    directory (beside the autotune winners of kernels/tuned_configs.py)."""
    d = os.environ.get(DIR_ENV)
    if d:
        return Path(d)
    root = None
    try:
        import triton

        knobs = getattr(triton, "knobs", None)
        root = getattr(getattr(knobs, "cache", None), "dir", None) if knobs is not None else None
    except Exception:  # noqa: BLE001
        pass
    return Path(root or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache") / "bert_fast_verify"


def _identity(op: str, device: torch.device) -> dict:
    return {"op": op, "device": device_label(device), **_versions(), "source": source_hash(op)}


def _store_path(op: str, device: torch.device) -> tuple[Path, dict]:
    ident = _identity(op, device)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return store_dir() / f"{op}-{digest}.json", ident


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: check again
        return {}
    entries = data.get("verdicts") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        return {}
    return {k: v for k, v in entries.items() if isinstance(v, dict) and v.get("verdict") in (PASS, FAIL)}


def _write(path: Path, ident: dict, entry_key: str, entry: dict) -> bool:
    """Merge one verdict into the file (a kept "fail" is never replaced by a "pass"); atomic
    (temporary file + rename). False where the directory is not writable (memory only then)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read(path)
        old = entries.get(entry_key)
        if old is None or old.get("verdict") != FAIL or entry["verdict"] == FAIL:
            entries[entry_key] = entry
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"identity": ident, "verdicts": entries}, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def _spec_str(direction: str, spec: tuple) -> str:
    return direction + "|" + "|".join(str(s).replace("torch.", "") for s in spec)


# ----------------------------------------------------------------------------- in-memory state
_VERDICTS: dict = {}  # (op, direction, spec, device) -> PASS | FAIL | UNCHECKED
_REASONS: dict = {}  # key -> reason of a FAIL
_WARNED: set = set()


def reset() -> None:
    """Forget every verdict and warning of this process (tests; a changed BERT_FAST_VERIFY_DIR)."""
    _VERDICTS.clear()
    _REASONS.clear()
    _WARNED.clear()
    _FALLBACKS.clear()


# (op, direction) -> calls that took the torch implementation in a kernel's place (a failed check or
# a kept "fail"); the benchmark reads it around a provider's calls so that a figure measured on the
# fallbacks says so (fallback_counts)
_FALLBACKS: "collections.Counter[tuple]" = collections.Counter()


def fallback_counts() -> dict:
    """{"op direction": calls} of this process so far that ran the torch implementation in place of
    a kernel that failed its check (now or in a kept verdict)."""
    return {f"{op} {d}": n for (op, d), n in _FALLBACKS.items()}


def _fell_back(key) -> None:
    _FALLBACKS[(key[0], key[1])] += 1


def _load(op: str, direction: str, spec: tuple, device: torch.device, key) -> Optional[str]:
    """The kept verdict of ``key`` (memory, else its file), or None."""
    v = _VERDICTS.get(key)
    if v is not None:
        return v
    path, _ = _store_path(op, device)
    entry = _read(path).get(_spec_str(direction, spec))
    if entry is None:
        return None
    _VERDICTS[key] = entry["verdict"]
    if entry["verdict"] == FAIL:
        _REASONS[key] = f"{entry.get('reason', '?')} (kept verdict from {path})"
    return entry["verdict"]


def verdict(op: str, direction: str, spec: tuple, device: torch.device) -> Optional[str]:
    """ "pass", "fail", "unchecked" or None (never checked) for one specialization."""
    return _load(op, direction, spec, device, (op, direction, spec, device))


def kernel_selected(op: str, direction: str, spec: tuple, device: torch.device) -> bool:
    """Whether calls of this specialization run the kernel (False once it failed its check).
    The ops' dropout-mask helpers use it: after a fallback the mask is the torch implementation's."""
    if mode() == "off":
        return True
    return verdict(op, direction, spec, device) != FAIL


def _record(
    op,
    direction,
    spec,
    device,
    key,
    v: str,
    reason: Optional[str] = None,
    ratio: Optional[float] = None,
    keep: bool = True,
) -> Optional[Path]:
    if v == PASS and _VERDICTS.get(key) == PASS:  # BERT_FAST_VERIFY=always: already on disk
        return None
    _VERDICTS[key] = v
    if v == FAIL:
        _REASONS[key] = reason
    if not keep:  # this process only
        return None
    path, ident = _store_path(op, device)
    entry = {"verdict": v, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid()}
    if reason is not None:
        entry["reason"] = reason
    if ratio is not None:
        entry["worst_ratio"] = round(float(ratio), 6)
    return path if _write(path, ident, _spec_str(direction, spec), entry) else None


def _describe(label, op, direction, spec, device) -> str:
    if callable(label):  # a label that costs something to build is built only when needed
        label = label()
    return f"kernel {label} ({op} {direction}, specialization {_spec_str(direction, spec)}, on {device_label(device)})"


def _fail_message(label, op, direction, spec, device, reason, where: Optional[Path], kept: bool) -> str:
    what = _describe(label, op, direction, spec, device)
    head = (
        f"bert_fast: {what} failed its check earlier on this machine: {reason}."
        if kept
        else f"bert_fast: {what} failed its first-use check: {reason}."
    )
    store = f" (verdict kept in {where})" if where is not None else ""
    return (
        f"{head} This op uses the torch implementation for it from now on{store}; results stay "
        f"correct, only slower. Please run `{REPORT_COMMAND}` and attach report.json to an issue "
        f"of the bert_fast project."
    )


def _warn_once(key, message: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    _log.warning(message)
    warnings.warn(message, KernelFallbackWarning, stacklevel=4)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _first_line(exc: BaseException) -> str:
    """ "Type: message" on one line: the first line and, when the message has more (a Triton compile
    error starts with the source location), its last."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = "" if not lines else lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"  # "" : MemoryError()
    text = text if len(text) <= 400 else text[:397] + "..."
    return f"{type(exc).__name__}: {text}".strip()


# ----------------------------------------------------------------------------- the check
def run(
    op: str,
    direction: str,
    spec: tuple,
    device: torch.device,
    *,
    label,
    dtype: torch.dtype,
    kernel: Callable[[], Any],
    fallback: Callable[[Optional[Tensor]], Any],
    checks: Callable[[Any, Any, Optional[Tensor]], Sequence["Check"]],
    kernel_mask: Optional[Callable[[], Tensor]] = None,
    follows: Optional[tuple] = None,
) -> Any:
    """The kernel's result for one call of ``op``, checked the first time its specialization runs.

    label:           the kernel's name for messages (a string, or a function returning it).
    kernel():        runs the kernel, returns its outputs.
    fallback(keep):  the torch implementation on the same inputs, the same outputs; ``keep`` is the
                     kernel's dropout keep-mask to apply (None: its own stream from the seed).
    checks(k, t, keep): the :class:`Check` list comparing the kernel's outputs ``k`` with ``t``.
    kernel_mask():   the kernel's exact dropout keep-mask (None when dropout is off).
    follows:         (direction, spec) of the forward whose saved tensors a backward reads.
    """
    m = mode()
    if m == "off":
        return kernel()
    key = (op, direction, spec, device)
    if follows is not None and _load(op, follows[0], follows[1], device, (op,) + tuple(follows) + (device,)) == FAIL:
        _fell_back(key)
        return fallback(None)  # the forward fell back: its saved tensors are the torch implementation's
    v = _VERDICTS.get(key)
    if v is None:
        v = _load(op, direction, spec, device, key)
    if v == UNCHECKED or (v == PASS and m != "always"):
        return kernel()
    if v == FAIL:
        message = _fail_message(label, op, direction, spec, device, _REASONS.get(key, "?"), None, kept=True)
        if m == "strict":
            raise KernelCheckError(message)
        _warn_once(key, message)
        _fell_back(key)
        return _stand_in(direction, fallback, kernel_mask)
    if _capturing(device):  # never checked, and no host reads are allowed now
        return _stand_in(direction, fallback, kernel_mask)
    return _check(op, direction, spec, device, key, m, label, dtype, kernel, fallback, checks, kernel_mask)


def _stand_in(direction: str, fallback, kernel_mask):
    """The torch implementation in the kernel's place: a forward draws its own dropout stream; a
    backward whose forward was the kernel reuses the kernel's mask."""
    if direction == "fwd" or kernel_mask is None:
        return fallback(None)
    try:
        keep = kernel_mask()
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(
            "bert_fast: the backward cannot stand in for the kernel: the kernel's dropout "
            f"mask could not be rebuilt ({_first_line(exc)})"
        ) from exc
    return fallback(keep)


def _environment_error(exc: BaseException) -> bool:
    """A failure of the machine around the kernel, not of the kernel: an OSError while compiling
    (no C compiler for Triton's launcher, an unwritable cache: seen on an H200 whose CC was
    overwritten, after which every kernel's "fail" was kept and later runs measured the torch
    fallbacks) or memory exhausted. Such a verdict holds for this process only; the next process
    checks again."""
    return isinstance(exc, (OSError, torch.cuda.OutOfMemoryError, MemoryError))


def _check(op, direction, spec, device, key, m, label, dtype, kernel, fallback, checks, kernel_mask):
    def failed(reason: str, cause: Optional[BaseException], result: Callable[[], Any]):
        transient = cause is not None and _environment_error(cause)
        if transient:
            reason += " (an error of the environment, not kept: the next process checks again)"
        where = _record(op, direction, spec, device, key, FAIL, reason, keep=not transient)
        message = _fail_message(label, op, direction, spec, device, reason, where, kept=False)
        if m == "strict":
            raise KernelCheckError(message) from cause
        _warn_once(key, message)
        _fell_back(key)
        return result()

    try:
        kout = kernel()
        keep = kernel_mask() if kernel_mask is not None else None
        if device.type == "cuda":  # an asynchronous launch fault surfaces here, named as the kernel's
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any compile or launch failure of the kernel
        return failed(f"it raised {_first_line(exc)}", exc, lambda: _stand_in(direction, fallback, kernel_mask))
    try:
        tout = fallback(keep)
    except Exception as exc:  # noqa: BLE001 - nothing to compare with: keep the kernel, unchecked
        _VERDICTS[key] = UNCHECKED
        _log.warning(
            "bert_fast: could not check %s: the torch implementation raised %s",
            _describe(label, op, direction, spec, device),
            _first_line(exc),
        )
        return kout
    try:
        reason, ratio = compare(checks(kout, tout, keep), dtype, device)
    except Exception as exc:  # noqa: BLE001 - a bug in the bounds is not the kernel's
        if m == "strict":
            raise
        _VERDICTS[key] = UNCHECKED
        _log.warning(
            "bert_fast: could not compare %s: %s", _describe(label, op, direction, spec, device), _first_line(exc)
        )
        return kout
    if reason is None:
        _record(op, direction, spec, device, key, PASS, ratio=ratio)
        return kout
    # with dropout, a forward falls back to its own stream (its backward will follow it); a
    # backward keeps the kernel forward's mask, which ``tout`` was computed with
    return failed(
        reason, None, (lambda: fallback(None)) if (direction == "fwd" and keep is not None) else (lambda: tout)
    )


# ----------------------------------------------------------------------------- the bound
@dataclasses.dataclass
class Check:
    """One output compared: ``actual`` (the kernel's) against ``expected`` (the torch
    implementation's), with the magnitudes of the bound (module docstring); each magnitude is None,
    a number or a tensor broadcastable to the output. ``where``: the positions compared (bool,
    broadcastable), None for all."""

    name: str
    actual: Tensor
    expected: Tensor
    mag: Any = None
    dot: Any = None
    acc: Any = None
    where: Optional[Tensor] = None
    rel: float = 0.0  # a further relative error the kernel is documented to have (dropout_rel)


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _tf32(dtype: torch.dtype, device: torch.device) -> float:
    """2^-11 when fp32 GEMMs on this device may run in TF32 (the kernels follow
    torch.backends.cuda.matmul.allow_tf32, cuBLAS also the float32 matmul precision)."""
    if dtype != torch.float32 or device.type != "cuda":
        return 0.0
    on = bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    return 2.0**-11 if on else 0.0


def _as(t, like: Tensor, work: torch.dtype):
    if t is None:
        return 0.0
    if isinstance(t, Tensor):
        return t.detach().to(device=like.device, dtype=work)
    return float(t)


def compare(checks: Sequence[Check], dtype: torch.dtype, device: torch.device) -> tuple[Optional[str], float]:
    """(None, worst |K - T| / bound) when every check holds, else (the reason, worst ratio)."""
    u = unit_roundoff(dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    ua = unit_roundoff(work)
    utf = _tf32(dtype, device)
    worst = 0.0
    for c in checks:
        a, e = c.actual, c.expected
        if not isinstance(a, Tensor) or not isinstance(e, Tensor):
            return f"{c.name}: the kernel returned {type(a).__name__}, expected a tensor", float("inf")
        if tuple(a.shape) != tuple(e.shape):
            return f"{c.name}: shape {tuple(a.shape)}, the torch implementation's is {tuple(e.shape)}", float("inf")
        if a.dtype != e.dtype:
            return f"{c.name}: dtype {a.dtype}, the torch implementation's is {e.dtype}", float("inf")
        if a.numel() == 0:
            continue
        w = torch.float64 if a.dtype == torch.float64 else work
        aa, ee = a.detach().to(w), e.detach().to(w)
        fin_a, fin_e = torch.isfinite(aa), torch.isfinite(ee)
        where = torch.ones_like(fin_e) if c.where is None else c.where.to(fin_e.device).expand_as(fin_e)
        # NaN/Inf in the kernel's output where the torch implementation is finite (and not at the edge
        # of the dtype's range, where one rounding may overflow)
        bad = where & fin_e & ~fin_a & (ee.abs() < 0.5 * torch.finfo(a.dtype).max)
        if bool(bad.any()):
            idx = _index(bad)
            return (
                f"{c.name}: {int(bad.sum())} of {bad.numel()} values are NaN/Inf where the torch "
                f"implementation's are finite (first at index {idx}: {aa[idx].item()} vs "
                f"{ee[idx].item()})"
            ), float("inf")
        mag, dot, acc = _as(c.mag, ee, w), _as(c.dot, ee, w), _as(c.acc, ee, w)
        te = ee.abs()
        tol = (
            SAFETY * ((u + c.rel) * (te + mag + dot) + utf * dot + ua * (acc + 16.0 * (te + mag + dot)))
            + SAFETY * torch.finfo(a.dtype).tiny
        )
        if not isinstance(tol, Tensor):
            tol = torch.full_like(ee, float(tol))
        tol = torch.nan_to_num(tol.expand_as(ee), nan=float("inf"))
        comp = where & fin_a & fin_e
        ratio = torch.where(comp, (aa - ee).abs() / tol, torch.zeros_like(ee))
        r = float(ratio.max())
        worst = max(worst, r)
        if not r <= 1.0:
            idx = _index(ratio == ratio.max())
            outside = int((ratio > 1.0).sum())
            return (
                f"{c.name}: |kernel - torch| = {abs(aa[idx] - ee[idx]).item():.4g} at index {idx} "
                f"(kernel {aa[idx].item():.6g}, torch {ee[idx].item():.6g}) exceeds the bound "
                f"{tol[idx].item():.3g}; {outside} of {ratio.numel()} values outside it"
            ), r
    return None, worst


def _index(mask: Tensor) -> tuple:
    flat = int(mask.reshape(-1).nonzero()[0, 0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape))


# ----------------------------------------------------------------------------- shared magnitudes
GELU_SLOPE = 1.13  # max |gelu'(z)| (erf: 1.129 at z = 2.42; the tanh form 1.130); |gelu''| <= 0.8


def dropout_rel(dtype: torch.dtype, dropout_p: float) -> float:
    """The kernels take the dropout scale 1 / (1 - p) as an fp32 number (a Triton float argument,
    a float in csrc/embedding_common.h): in float64 that is a relative error of up to u(fp32), which
    the float64 torch implementation does not have. 0 otherwise."""
    return unit_roundoff(torch.float32) if (dtype == torch.float64 and dropout_p > 0.0) else 0.0


def with_rel(checks: list, rel: float) -> list:
    for c in checks:
        c.rel = rel
    return checks


def absf(t: Optional[Tensor], dtype: torch.dtype = torch.float32) -> Optional[Tensor]:
    """|t| in ``dtype`` (float64 stays float64), detached."""
    if t is None:
        return None
    work = torch.float64 if t.dtype == torch.float64 else dtype
    return t.detach().abs().to(work)


def layer_norm_checks(
    h: Tensor, hmag: Tensor, weight: Tensor, bias: Tensor, outs_k, outs_t, scale: float = 1.0, prefix: str = ""
) -> list:
    """Checks of a LayerNorm forward (y [rows, N] (times the dropout ``scale``), mean, rstd [rows])
    whose input ``h`` [rows, N] (recomputed in fp32) is a sum of terms of magnitude ``hmag``.

    The torch implementation rounds h in the op's dtype (up to 2 roundings: delta_h <= 2 u hmag);
    LayerNorm then moves y by at most rstd |w| (2 + |yhat|) max_row(delta_h) (the projection that
    removes the mean and the yhat component amplifies a perturbation by at most that), the mean by
    max_row(delta_h) and rstd by rstd^2 max_row(delta_h) (delta var / var <= 2 max delta_h / sigma).
    The fp32 statistics of N terms add N u_acc times the same magnitudes. kappa = 1 + rstd max|h|
    is the row's conditioning."""
    y_k, mean_k, rstd_k = outs_k
    y_t, mean_t, rstd_t = outs_t
    n = h.shape[-1]
    rstd = rstd_t.detach().reshape(-1, 1).to(h.dtype)
    mean = mean_t.detach().reshape(-1, 1).to(h.dtype)
    yhat = ((h - mean) * rstd).abs()
    hmax = hmag.amax(dim=-1, keepdim=True)
    kappa = 1.0 + rstd * hmax
    base = absf(weight, h.dtype) * (2.0 + yhat) * kappa
    y_shape = y_t.shape
    return [
        Check(
            prefix + "y", y_k, y_t, mag=(scale * 2.0 * base).reshape(y_shape), acc=(scale * n * base).reshape(y_shape)
        ),
        Check(
            prefix + "mean",
            mean_k,
            mean_t,
            mag=(2.0 * hmax).reshape(mean_t.shape),
            acc=(n * hmax).reshape(mean_t.shape),
        ),
        Check(
            prefix + "rstd",
            rstd_k,
            rstd_t,
            mag=(2.0 * rstd * kappa).reshape(rstd_t.shape),
            acc=(n * rstd * kappa).reshape(rstd_t.shape),
        ),
    ]


def layer_norm_bwd_magnitudes(
    h: Tensor, hmag: Tensor, dy: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dh magnitude [rows, N], |dy| (1 + |yhat| + 2 kappa) [rows, N], |dy| [rows, N]) of a LayerNorm
    backward from the saved statistics, all fp32: dh = rstd (g - mean(g) - yhat mean(g yhat)) with
    g = dy w is at most rstd G (2 + |yhat|) (G = max_row |g|), and the torch implementation's
    rounding of h moves yhat by 2 u kappa, hence the factor kappa. The second and third are the
    per-row terms of dweight and dbias."""
    rstd = rstd.detach().reshape(-1, 1).to(h.dtype)
    mean = mean.detach().reshape(-1, 1).to(h.dtype)
    yhat = ((h - mean) * rstd).abs()
    kappa = 1.0 + rstd * hmag.amax(dim=-1, keepdim=True)
    ady = absf(dy, h.dtype).reshape(h.shape)
    g = (ady * absf(weight, h.dtype)).amax(dim=-1, keepdim=True)
    dh = rstd * g * (2.0 + yhat) * kappa
    return dh, ady * (1.0 + yhat + 2.0 * kappa), ady
