"""Frozen inference weights: ``BertModel.freeze()`` packs each layer's linear weights once for
oneDNN, and no-grad eval forwards on the CPU run the layers on them (opt-in).

Why. On the CPU the encoder is GEMM-bound, and a GEMM through F.linear re-lays out its weight at
every call. oneDNN's prepacked weight (``mkldnn._reorder_linear_weight``: blocked for the CPU's
vector width, the same size as the weight, usable for any number of rows) skips that, and the
FFN-up GEMM takes its GELU in the same call. Measured at 2 threads: bf16 1.5-2.2x per GEMM at 128 rows and
1.1-1.3x at 1024; fp32 1.05-1.16x (benchmarks/notes/2026-11-24-cpu-masks-freeze-targets.md, "Frozen inference weights").
The QKV projection runs as one GEMM over the concatenated weight, built once here instead of at
every call (which is why the unfrozen path runs three GEMMs on dense batches).

Why opt-in. The packed copies are a cache of the weights (one more copy of every encoder linear
weight in memory), and a cache is only safe where one knows when the weights change. Each layer's
copies record every source tensor's identity, data pointer and version counter, and are rebuilt
at the next forward when any of them changed: optimizer steps, ``load_state_dict``, in-place ops
under ``torch.no_grad()``, ``.to()``, replaced parameters are all seen. Writes through ``.data``
are not (a tensor's ``.data`` has a version counter of its own), so after those call
``model.freeze()`` again (or ``unfreeze()``). ``train()``, autocast, gradients, torch.compile,
hooks and LoRA adapters take the normal path; the copies are never part of the state dict (they
live in a table beside the model, not on it: ``deepcopy``, pickling and ``save_pretrained`` never
see them).
"""

from __future__ import annotations

import functools
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from bert_fast.model import direct_ops, precision
from bert_fast.ops import cpu_linear
from bert_fast.ops.cpu_timing import median_pair as _median_pair
from bert_fast.ops.torch_impl import GELU_APPROXIMATE

_DTYPES = (torch.float32, torch.bfloat16)

# model -> {layer index: _FrozenLayer}; weak keys: a model that goes away takes its copies along
_STORE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """oneDNN's prepacked linear is in this torch build (and can run bf16 here when asked)."""
    try:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def dtype_supported(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return precision.onednn_runs_bf16()
    return False


class _PackedLinear:
    """One linear layer on a prepacked weight, y = act(x W^T + b), where packing wins: per row-count
    class (``packing_choice``) it runs either oneDNN's packed weight or the plain weight through
    the unfrozen path's own call (direct_ops.linear), so a frozen GEMM is never slower than it. On
    AVX-512 (BF16 for bf16) a third candidate, our one-call linear (bert_fast.ops.cpu_linear: the GEMM
    with its GELU, or with the residual add and LayerNorm that follow it, in one C++ call), runs for
    the row classes where it measured faster than that choice (``ours_choice``)."""

    __slots__ = ("weight", "plain_weight", "bias", "n", "k", "nbytes", "packed_for", "ours", "ours_for")

    def __init__(self, weight: Tensor, bias: Optional[Tensor], activation: Optional[str] = None):
        self.n, self.k = weight.shape
        self.plain_weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous().clone()
        packed = torch.ops.mkldnn._reorder_linear_weight(self.plain_weight, None)
        self.weight = packed
        # (rows <= SPLIT_ROWS, rows > SPLIT_ROWS) -> packed wins
        self.packed_for = packing_choice(self, activation)
        self.ours, self.ours_for = None, (False, False)
        if cpu_linear.available(weight.dtype) and (weight.dtype == torch.float32 or self.k % 2 == 0):
            self.ours = cpu_linear.OneCallLinear(self.plain_weight, self.bias)
            self.ours_for = ours_choice(self, activation)
            if not any(self.ours_for):
                self.ours = None
        if not any(p and not o for p, o in zip(self.packed_for, self.ours_for)):
            self.weight = None  # the packed copy never runs: do not keep it
        self.nbytes = (0 if self.weight is None else weight.numel() * weight.element_size()) + (
            0 if bias is None else bias.numel() * bias.element_size()
        )
        if self.ours is not None:
            self.nbytes += self.ours.weight.numel() * self.ours.weight.element_size()

    def run_packed(self, x2: Tensor, activation: Optional[str]) -> Tensor:
        if activation is None:
            return torch.ops.mkldnn._linear_pointwise(x2, self.weight, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise(x2, self.weight, self.bias, "gelu", [], GELU_APPROXIMATE[activation])

    def run_plain(self, x2: Tensor, activation: Optional[str]) -> Tensor:
        return direct_ops.linear(x2, self.plain_weight, self.bias, activation)

    def run_ours(self, x2: Tensor, activation: Optional[str]) -> Tensor:
        return self.ours.linear(x2, None if activation is None else GELU_APPROXIMATE[activation])

    def __call__(self, x: Tensor, activation: Optional[str] = None) -> Tensor:
        x2 = x.reshape(-1, self.k)
        rows = x2.shape[0]
        if rows == 0:
            return x.new_empty((*x.shape[:-1], self.n))
        large = rows > SPLIT_ROWS
        if self.ours_for[large]:
            y = self.run_ours(x2, activation)
        elif self.packed_for[large]:
            y = self.run_packed(x2.contiguous(), activation)
        else:
            y = self.run_plain(x2, activation)
        return y.view(*x.shape[:-1], self.n)

    def residual_ln(self, x: Tensor, residual: Tensor, ln_w: Tensor, ln_b: Tensor, eps: float) -> Optional[Tensor]:
        """LayerNorm(x W^T + b + residual) * ln_w + ln_b in one call where our linear runs for these
        rows (layer._gemm_residual_ln); None elsewhere (the caller runs the GEMM, then the op)."""
        x2 = x.reshape(-1, self.k)
        if not self.ours_for[x2.shape[0] > SPLIT_ROWS] or x2.shape[0] == 0 or residual.dtype != self.ours.dtype:
            return None
        return self.ours.linear_residual_ln(x2, residual, ln_w, ln_b, eps).view(*x.shape[:-1], self.n)


# ----------------------------------------------------------------------------- pack or not, measured
# Whether oneDNN's packed weight beats the plain call depends on the CPU, the dtype, the shape and
# the row count: on a Zen 4 (AVX-512 BF16, 2 threads) packing won 1.05-1.16x in fp32 and 1.5-2.2x in
# bf16, while on an Intel Xeon with AMX frozen fp32 all-MiniLM-L6-v2 batch 1 once ran 2x slower
# (issue #25). No rule measured on one vendor holds on the other, so freeze() measures each GEMM
# shape once per process, at a small and a large row count, and keeps packing only where it wins.
MEASURE_ROWS = (64, 1024)  # the row counts measured: one per class below
SPLIT_ROWS = 256  # calls with at most this many rows take the small class's choice
_CHOICES: Dict[tuple, Tuple[bool, bool]] = {}  # (n, k, dtype, activation, threads) -> choice
_FORCED: Optional[bool] = None  # tests: force packing on (True) or off (False)


def packing_choice(lin: "_PackedLinear", activation: Optional[str]) -> Tuple[bool, bool]:
    """(small rows, large rows): True where the packed weight ran at most as long as the plain call
    (timed once per shape, dtype, activation and thread count in this process, then cached)."""
    if _FORCED is not None:
        return (_FORCED, _FORCED)
    dtype = lin.plain_weight.dtype
    key = (lin.n, lin.k, dtype, activation, torch.get_num_threads())
    choice = _CHOICES.get(key)
    if choice is None:
        picks = []
        for rows in MEASURE_ROWS:
            x = torch.randn(rows, lin.k, dtype=dtype)
            # ~20 ms of GEMM per sample at most, 3 samples: a bert-base layer costs ~0.5 s once.
            reps = 3 if 2.0 * rows * lin.n * lin.k > 2e9 else 5
            with torch.no_grad():
                t_packed, t_plain = _median_pair(
                    lambda: lin.run_packed(x, activation), lambda: lin.run_plain(x, activation), reps
                )
            picks.append(t_packed <= t_plain)
        choice = _CHOICES[key] = (picks[0], picks[1])
    return choice


_OURS: Dict[tuple, Tuple[bool, bool]] = {}  # (n, k, dtype, activation, threads) -> our linear wins


def ours_choice(lin: "_PackedLinear", activation: Optional[str]) -> Tuple[bool, bool]:
    """(small rows, large rows): True where our one-call linear ran at most as long as the call
    packing_choice kept (timed once per shape, dtype, activation and thread count in this process)."""
    if _FORCED is not None:
        return (False, False)  # tests that force packing on or off get exactly that
    dtype = lin.plain_weight.dtype
    key = (lin.n, lin.k, dtype, activation, torch.get_num_threads())
    choice = _OURS.get(key)
    if choice is None:
        picks = []
        for rows, packed in zip(MEASURE_ROWS, lin.packed_for):
            x = torch.randn(rows, lin.k, dtype=dtype)
            theirs = lin.run_packed if packed else lin.run_plain
            reps = 3 if 2.0 * rows * lin.n * lin.k > 2e9 else 5
            with torch.no_grad():
                t_ours, t_theirs = _median_pair(
                    lambda: lin.run_ours(x, activation), lambda: theirs(x, activation), reps
                )
            picks.append(t_ours <= t_theirs)
        choice = _OURS[key] = (picks[0], picks[1])
    return choice


def packing_choices() -> Dict[tuple, Tuple[bool, bool]]:
    """What freeze() measured in this process (for the doctor and the benchmarks)."""
    return dict(_CHOICES)


def ours_choices() -> Dict[tuple, Tuple[bool, bool]]:
    """Where freeze() measured our one-call linear faster, in this process."""
    return dict(_OURS)


def layer_linears(layer):
    """The six nn.Linear modules of a transformers BertLayer, in a fixed order.

    Hot path (every layer of every frozen or int8 forward checks its copies are fresh): read through
    ``_modules``, the dict nn.Module.__getattr__ would search after two failed lookups (6.5 -> 0.2 us).
    A layer of another shape (a module the user replaced) takes the attribute path and its error."""
    try:
        m = layer._modules
        att = m["attention"]._modules
        sa = att["self"]._modules
        return (
            sa["query"],
            sa["key"],
            sa["value"],
            att["output"]._modules["dense"],
            m["intermediate"]._modules["dense"],
            m["output"]._modules["dense"],
        )
    except (KeyError, AttributeError):
        sa, att = layer.attention.self, layer.attention
        return (sa.query, sa.key, sa.value, att.output.dense, layer.intermediate.dense, layer.output.dense)


def weight_and_bias(m) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(weight, bias) of a Linear: from ``_parameters`` for a plain nn.Linear (no __getattr__), else as
    attributes (a LoRA layer's are properties over its base layer)."""
    if type(m) is torch.nn.Linear:
        p = m._parameters
        return p["weight"], p["bias"]
    return m.weight, m.bias


def _sources(linears) -> Tuple[Tensor, ...]:
    out = []
    for m in linears:
        out.extend(weight_and_bias(m))
    return tuple(out)


def _stamp(tensors) -> Tuple:
    return tuple(None if t is None else (t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)


class _FrozenLayer:
    """One layer's packed weights: a GEMM set for layer.layer_forward (see gemms.py): ``qkv``,
    ``out``, ``up`` (GELU fused) and ``down`` are callables ``(x, activation=None) -> y``."""

    __slots__ = ("sources", "stamp", "dtype", "qkv", "out", "up", "down")

    def __init__(self, linears, dtype: torch.dtype):
        self.sources = _sources(linears)
        self.stamp = _stamp(self.sources)
        self.dtype = dtype
        q, k, v, o, i, d = linears
        with torch.no_grad():
            w = torch.cat([q.weight, k.weight, v.weight]).to(dtype)
            b = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias]).to(dtype)
            self.qkv = _PackedLinear(w, b)
            self.out, self.down = (
                _PackedLinear(m.weight.to(dtype), None if m.bias is None else m.bias.to(dtype)) for m in (o, d)
            )
            self.up = _PackedLinear(i.weight.to(dtype), None if i.bias is None else i.bias.to(dtype), "gelu")

    def fresh(self, linears, dtype: torch.dtype) -> bool:
        if dtype != self.dtype:
            return False
        cur = _sources(linears)
        return all(a is b for a, b in zip(cur, self.sources)) and _stamp(cur) == self.stamp

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.out.nbytes + self.up.nbytes + self.down.nbytes

    def separate_qkv(self):
        """None: the packed QKV weight is one fused GEMM (the dense three-GEMM path is for the
        unpacked weights, whose concatenation it avoids)."""
        return None


def plain_linears(linears) -> bool:
    """Only exact nn.Linear modules (a LoRA layer, a quantized or subclassed Linear runs as it is),
    with both biases present or absent alike for Q/K/V, on the CPU."""
    if not all(type(m) is torch.nn.Linear for m in linears):
        return False
    q, k, v = linears[:3]
    if (q.bias is None) != (k.bias is None) or (q.bias is None) != (v.bias is None):
        return False
    return all(m.weight.device.type == "cpu" for m in linears)


def freeze(model) -> int:
    """Pack every layer of ``model`` (a bert_fast.BertModel) for inference in its parameters' dtype
    (a later ``.to()`` repacks at the next forward). Returns the bytes the packed copies take.
    Raises where there is nothing it could do: no oneDNN linear in this torch, a model off the CPU,
    a dtype oneDNN does not pack here."""
    if not available():
        raise RuntimeError("freeze() needs torch's oneDNN (mkldnn) linear ops, which this torch build lacks")
    weight = model.embeddings.word_embeddings.weight
    if weight.device.type != "cpu":
        raise ValueError(f"freeze() packs weights for CPU inference; this model is on {weight.device}")
    dtype = weight.dtype
    if not dtype_supported(dtype):
        raise ValueError(
            f"freeze() packs float32 or bfloat16 weights (bfloat16 where this CPU runs oneDNN bf16), got {dtype}"
        )
    store: Dict[int, _FrozenLayer] = {}
    for i, layer in enumerate(model.encoder.layer):
        linears = layer_linears(layer)
        if plain_linears(linears):
            store[i] = _FrozenLayer(linears, dtype)
    _STORE[model] = store
    return sum(e.nbytes for e in store.values())


def unfreeze(model) -> None:
    _STORE.pop(model, None)


def store_of(model) -> Optional[Dict[int, _FrozenLayer]]:
    return _STORE.get(model)


def entry_for(store: Dict[int, _FrozenLayer], index: int, layer, dtype: torch.dtype) -> Optional[_FrozenLayer]:
    """The packed layer ``index`` for ``dtype``, rebuilt when its weights changed; None where the
    layer cannot run frozen (not plain Linear modules, a dtype oneDNN does not pack here)."""
    if dtype not in _DTYPES:
        return None
    linears = layer_linears(layer)
    entry = store.get(index)
    if entry is not None and entry.fresh(linears, dtype):
        return entry
    store.pop(index, None)
    if not plain_linears(linears) or not dtype_supported(dtype):
        return None
    entry = store[index] = _FrozenLayer(linears, dtype)
    return entry
