"""int8 inference GEMMs on the CPU, behind an accuracy guard: ``optimize(model, int8=True)``.

What runs. Each encoder GEMM y = act(x W^T + b) becomes bert_fast.ops.int8_gemm.int8_linear:
    x_q, s_x = quantize_rows(x)           int8 [M, K], one fp32 scale per row (symmetric, dynamic)
    acc      = torch._int_mm(x_q, W_q)     int32 [M, N] (oneDNN / VNNI, AMX-INT8 where the CPU has it);
                                           or our AVX-512 VNNI GEMM on weights packed once, the same sums
                                           (VnniLinear: the lines above and below in the same call); on CPUs
                                           without VNNI our AVX2 GEMM (int8_linear_avx2, likewise):
                                           whichever measured fastest
    y        = act(acc * s_x * s_w + b)    in the model's dtype (fp32 or bf16)
with W_q int8 per output channel (symmetric, s_w [N]), quantized once here. Why per-row activations
and per-channel weights: on all-MiniLM-L6-v2 (64 shipped sentences, min cosine of mean-pooled
embeddings to fp32), per-tensor dynamic int8 of every Linear (torch.ao's quantize_dynamic, what
most CPU int8 recipes do) gave 0.902, per-channel weights 0.967, per-row activations and
per-channel weights 0.9965 (benchmarks/notes/2026-11-25-cpu-low-precision-25.md). LayerNorm and the residual
stream stay in the model's dtype (LayerNorm statistics and softmax in fp32).

Attention. Where our AVX-512 BF16 attention kernel runs (bert_fast.ops.cpu_attention), an int8 fp32
model's attention runs on it in bf16 (Q, K, V rounded to bf16, fp32 softmax and accumulation): at
batch 1 torch's fp32 flash kernel was a quarter of a MiniLM int8 forward. Measured on a Zen 5 (2
threads, benchmarks/cpu_ab.py int8-attention): MiniLM b1 1.22x, b8 1.37x, bert-base b1 1.15x, the
shipped sentences' min cosine to fp32 0.99606 -> 0.99599; the accuracy guard below measures the
model as it runs, bf16 attention included. ``BERT_FAST_INT8_ATTENTION=auto|bf16|fp32``.

Why a speed check. torch runs a fast int8 GEMM only on CPUs with AVX-512 VNNI or AMX-INT8 (elsewhere
torch._int_mm is 35-55x slower than fp32, and our AVX2 GEMM runs instead). bert_fast.model.int8_speed
times each int8 GEMM against fp32 once per process before anything is calibrated, picks the faster
one, and refuses (Int8SpeedError, with the measured rates) where even that is slower than fp32.

Why a guard. int8 keeps bert-base near fp32 and degrades some small models badly: it is never
applied without measuring. ``quantize(model, calibration)`` runs the calibration batch with and
without the int8 GEMMs and refuses (``Int8AccuracyError``, naming the measured cosine and pointing
to bf16) when the min cosine of the mean-pooled outputs to the fp32 model is below ``min_cosine``
(0.99 by default). The int8 copies are a cache of the weights like freeze()'s: built from the
weights at quantize() time; when a weight changes afterwards the layers run their own weights
again, with a warning, until quantize() is called again (a re-quantized model is re-checked).
Inference only: training, gradients and autocast take the normal path (with a warning once).
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_fast.model import frozen, int8_speed
from bert_fast.ops import cpu_attention, int8_gemm
from bert_fast.ops.torch_impl import GELU_APPROXIMATE

DEFAULT_MIN_COSINE = 0.99
# BERT_FAST_INT8_ATTENTION: "auto" (bf16 where our AVX-512 BF16 attention kernel runs), "bf16", "fp32"
ATTENTION_ENV = "BERT_FAST_INT8_ATTENTION"


def attention_in_bf16(h: Tensor) -> bool:
    """Whether an int8 model's attention over these hidden states (fp32) runs in bf16 (module
    docstring, "Attention")."""
    if h.dtype != torch.float32 or h.device.type != "cpu":
        return False
    setting = os.environ.get(ATTENTION_ENV, "auto").strip().lower()
    if setting == "fp32":
        return False
    return setting == "bf16" or cpu_attention.available()


# model -> {layer index: _Int8Layer}; weak keys, as frozen.py's store
_STORE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Int8AccuracyError(ValueError):
    """int8 would degrade this model beyond the accuracy bound: it was not applied."""


def available() -> bool:
    """torch._int_mm runs on the CPU in this torch build."""
    return int8_speed.int8_available()


def quantize_weight(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """(W_q^T int8 [K, N] contiguous, s_w fp32 [N]): symmetric per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.t().contiguous(), scale


_BACKENDS = ("int_mm", "vnni", "avx2")


class _Int8Linear:
    """One linear layer on int8 weights: y = act(x W^T + b), output in x's dtype (or ``out_dtype``).
    ``backend``: "int_mm" (torch._int_mm on W_q^T int8 [K, N]), "vnni" (our AVX-512 VNNI GEMM on the
    panels it wants, packed once: the same int32 sums) or "avx2" (our AVX2 GEMM on int16-pair panels)."""

    __slots__ = ("wq", "scale", "bias", "n", "k", "nbytes", "backend", "one_call")

    def __init__(self, weight: Tensor, bias: Optional[Tensor], backend: str = "int_mm"):
        if backend not in _BACKENDS:
            raise ValueError(f"int8 backend must be one of {_BACKENDS}, got {backend!r}")
        self.n, self.k = weight.shape
        self.backend = backend
        wq, self.scale = quantize_weight(weight)
        pack = {"avx2": int8_gemm.pack_weight_avx2, "vnni": int8_gemm.pack_weight_vnni}.get(backend)
        self.wq = wq if pack is None else pack(wq)
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        # vnni: quantize, GEMM and dequantize in one C++ call where K allows (a multiple of 4: BERT's all)
        vnni_call = backend == "vnni" and self.k % 4 == 0
        self.one_call = int8_gemm.VnniLinear(self.wq, self.k, self.n, self.scale, self.bias) if vnni_call else None
        self.nbytes = self.wq.numel() * self.wq.element_size() + 4 * self.n + (0 if bias is None else 4 * self.n)

    def _acc(self, xq: Tensor) -> Tensor:
        """The int32 sums x_q W_q^T (backends "int_mm" and "vnni": the same, bit for bit)."""
        if self.backend == "vnni":
            return int8_gemm.int_mm_vnni(xq, self.wq, self.n)
        return torch._int_mm(xq, self.wq)

    def __call__(self, x: Tensor, activation: Optional[str] = None, out_dtype: Optional[torch.dtype] = None) -> Tensor:
        """act(x W^T + b) in ``out_dtype`` (default x's dtype): the pass that dequantizes writes it."""
        x2 = x.reshape(-1, self.k)
        if x2.shape[0] == 0:
            return x.new_empty((*x.shape[:-1], self.n), dtype=out_dtype or x.dtype)
        gelu = None if activation is None else GELU_APPROXIMATE[activation]
        if self.backend == "avx2":
            y = int8_gemm.int8_linear_avx2(x2, self.wq, self.n, self.scale, self.bias, gelu, out_dtype)
        elif self.one_call is not None:
            y = self.one_call.linear(x2, gelu, out_dtype or x2.dtype)
        else:  # torch._int_mm, or the VNNI GEMM where K is not a multiple of 4: the separate passes
            xq, sx = int8_gemm.quantize_rows(x2)
            y = int8_gemm.dequantize(self._acc(xq), sx, self.scale, self.bias, out_dtype or x2.dtype, gelu)
        return y.view(*x.shape[:-1], self.n)

    def residual_ln(self, x: Tensor, residual: Tensor, ln_w: Tensor, ln_b: Tensor, eps: float) -> Optional[Tensor]:
        """LayerNorm(x W^T + b + residual) * ln_w + ln_b, with the add and the LayerNorm in the dequantize
        pass after the int32 GEMM (int8_gemm.dequantize_residual_ln: fp32 throughout, one cast), in the
        residual's dtype (x may be bf16 where the residual is fp32: the bf16 attention's output is
        quantized as it is); None where that does not apply (the AVX2 backend, whose GEMM dequantizes
        in its own epilogue; an empty batch), and the caller runs the GEMM and its residual LayerNorm."""
        x2 = x.reshape(-1, self.k)
        if self.backend == "avx2" or x2.shape[0] == 0:
            return None
        if self.one_call is not None:
            return self.one_call.linear_residual_ln(x2, residual, ln_w, ln_b, eps).view(*x.shape[:-1], self.n)
        xq, sx = int8_gemm.quantize_rows(x2)
        y = int8_gemm.dequantize_residual_ln(self._acc(xq), sx, self.scale, self.bias, residual, ln_w, ln_b, eps)
        return y.view(*x.shape[:-1], self.n)


def _stamp(linears) -> Tuple:
    out = []
    for m in linears:
        for t in frozen.weight_and_bias(m):
            out.append(None if t is None else (id(t), t.data_ptr(), t._version))
    return tuple(out)


class _Int8Layer:
    """One layer's int8 GEMM set for layer.layer_forward (see gemms.py)."""

    __slots__ = ("stamp", "qkv", "out", "up", "down")

    def __init__(self, linears, backend: str = "int_mm"):
        self.stamp = _stamp(linears)
        q, k, v, o, i, d = linears
        with torch.no_grad():
            b = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])
            self.qkv = _Int8Linear(torch.cat([q.weight, k.weight, v.weight]), b, backend)
            self.out, self.up, self.down = (_Int8Linear(m.weight, m.bias, backend) for m in (o, i, d))

    def fresh(self, linears) -> bool:
        return _stamp(linears) == self.stamp

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.out.nbytes + self.up.nbytes + self.down.nbytes

    def separate_qkv(self):
        return None  # one fused int8 QKV GEMM


def is_int8_layer(gemms) -> bool:
    """Whether a layer's GEMM set (layer.gemms_for) is an int8 one."""
    return isinstance(gemms, _Int8Layer)


def is_int8_linear(gemm) -> bool:
    """Whether a GEMM is an int8 one (it then takes ``out_dtype``: its dequantize pass writes it)."""
    return isinstance(gemm, _Int8Linear)


def store_of(model) -> Optional[Dict[int, _Int8Layer]]:
    return _STORE.get(model)


def drop(model) -> None:
    _STORE.pop(model, None)


_WARNED: "weakref.WeakSet" = weakref.WeakSet()


_STALE_WARNED: set = set()  # id() of stores already warned about


def entry_for(store: Dict[int, _Int8Layer], index: int, layer) -> Optional[_Int8Layer]:
    """The int8 layer ``index`` when its weights are the ones quantize() checked; else None (the
    layer runs its own weights), with one warning per model."""
    entry = store.get(index)
    if entry is None:
        return None
    if entry.fresh(frozen.layer_linears(layer)):
        return entry
    store.pop(index, None)
    if id(store) not in _STALE_WARNED:
        _STALE_WARNED.add(id(store))
        warnings.warn(
            "bert_fast: weights changed after int8 quantization; those layers now run their own "
            "(unquantized) weights. Call bert_fast.optimize(model, int8=True) again to re-quantize "
            "and re-check accuracy.",
            RuntimeWarning,
            stacklevel=4,
        )
    return None


def usable(t: Tensor, training: bool) -> bool:
    """The int8 GEMMs run for tensors like ``t``: no-grad eval forwards on the CPU, not under autocast
    or torch.compile (whatever op namespace the rest of the layer runs on)."""
    return (
        t.device.type == "cpu"
        and not training
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
    )


def warn_not_inference(model) -> None:
    """An int8 model asked to train / take gradients / autocast: the normal path runs, said once."""
    if model not in _WARNED:
        _WARNED.add(model)
        warnings.warn(
            "bert_fast: int8 weights are for no-grad inference without hooks or autocast; this forward "
            "(training, gradients, autocast, torch.compile or a hooked module) runs the model's own weights",
            RuntimeWarning,
            stacklevel=4,
        )


# ----------------------------------------------------------------------------- the guard
def _pooled(model, batch: Dict[str, Tensor]) -> Tensor:
    with torch.inference_mode():
        h = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].to(h.dtype).unsqueeze(-1)
    return (h * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def min_cosine_to(reference: Tensor, pooled: Tensor) -> float:
    return F.cosine_similarity(pooled.double(), reference.double(), dim=-1).min().item()


def quantize(
    model,
    calibration: Dict[str, Tensor],
    min_cosine: float = DEFAULT_MIN_COSINE,
    reference: Optional[Tensor] = None,
    backend: Optional[str] = None,
) -> float:
    """Build int8 GEMMs for every layer of ``model`` (a bert_fast BertModel-like FastModel) and keep
    them only if the calibration batch's mean-pooled outputs keep ``min cosine >= min_cosine`` to
    the fp32 model (``reference``: those pooled outputs, computed here from the model's current
    weights in fp32 when not given). Returns the measured min cosine; raises Int8AccuracyError
    (nothing applied) below the bound, and int8_speed.Int8SpeedError (before any calibration) where
    int8 GEMMs measure slower than fp32 on this CPU. ``backend``: the int8 GEMM ("int_mm": torch._int_mm,
    "vnni" and "avx2": ours); by default the fastest as measured by that check."""
    speed = int8_speed.require_faster()  # RuntimeError without a CPU int8 GEMM; cached after the first call
    backend = backend or speed.backend
    if backend == "vnni" and not int8_gemm.vnni_available():
        raise ValueError("int8 backend 'vnni' needs AVX-512 VNNI (and bert_fast._C built with int8_gemm_vnni)")
    if backend == "avx2" and not int8_gemm.avx2_available():
        raise ValueError("int8 backend 'avx2' needs AVX2 (and bert_fast._C built with int8_linear_avx2)")
    if backend == "int_mm" and not int8_speed.int_mm_exact():
        raise ValueError(f"int8 backend 'int_mm' refused: {int8_speed.INEXACT_NOTE}")
    weight = model.embeddings.word_embeddings.weight
    if weight.device.type != "cpu":
        raise ValueError(f"int8 quantization is for CPU inference; this model is on {weight.device}")
    if "attention_mask" not in calibration or "input_ids" not in calibration:
        raise ValueError("calibration must hold input_ids and attention_mask (a tokenizer's output)")
    drop(model)
    was_training = model.training
    model.eval()
    try:
        if reference is None:
            reference = reference_pooled(model, calibration)
        store: Dict[int, _Int8Layer] = {}
        for i, layer in enumerate(model.encoder.layer):
            linears = frozen.layer_linears(layer)
            if frozen.plain_linears(linears):
                store[i] = _Int8Layer(linears, backend)
        if not store:
            raise ValueError("no layer of this model has plain nn.Linear weights to quantize to int8")
        _STORE[model] = store
        cos = min_cosine_to(reference, _pooled(model, calibration))
    finally:
        model.train(was_training)
    if not cos >= min_cosine:  # NaN refuses too
        drop(model)
        raise Int8AccuracyError(
            f"int8 would degrade {type(model).__name__}: min cosine of mean-pooled outputs to fp32 on the "
            f"{len(reference)} calibration sequences is {cos:.4f}, below the bound {min_cosine}. int8 was not "
            "applied; use bf16 instead (bert_fast.optimize(model, dtype=torch.bfloat16)), which keeps "
            ">= 0.999 on the models tested."
        )
    return cos


def reference_pooled(model, calibration: Dict[str, Tensor]) -> Tensor:
    """The fp32 model's mean-pooled outputs (the model itself when fp32, else an fp32 copy of it),
    without int8 GEMMs, in eval mode."""
    was_training = model.training
    saved = _STORE.pop(model, None)
    try:
        model.eval()
        if next(model.parameters()).dtype == torch.float32:
            return _pooled(model, calibration)
        import copy

        return _pooled(copy.deepcopy(model).float(), calibration)
    finally:
        model.train(was_training)
        if saved is not None:
            _STORE[model] = saved


def calibration_batch(tokenizer, sentences: Optional[Sequence[str]] = None, max_length: int = 128) -> dict:
    """The tokenizer's batch of ``sentences`` (default: the shipped encode sentences)."""
    if sentences is None:
        from importlib import resources

        text = resources.files("bert_fast").joinpath("data/encode_sentences.txt").read_text(encoding="utf-8")
        sentences = [s.strip() for s in text.splitlines() if s.strip()][:64]
    if not sentences:
        raise ValueError("calibration needs at least one sentence")
    enc = tokenizer(list(sentences), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
