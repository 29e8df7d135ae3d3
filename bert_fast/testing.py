"""Test helpers shared by tests/ and benchmarks/: the tolerance rule of DESIGN.md, test devices, a
numpy Philox4x32-10 that pins the kernels' dropout streams bit for bit, and the tiny models, training
runs and gradient comparisons several test files share.

The rule (after flash-attention's suites): against a float64 oracle, a kernel's error may be at
most ``factor`` (2) times the error of plain PyTorch run in the same dtype, plus a small floor
for rounding. A fixed atol/rtol band is only a second, looser check.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np
import torch

# Second check: fixed bands per dtype (loose on purpose; the 2x rule is the real test).
FIXED_BANDS = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def pick_test_device() -> torch.device:
    """CUDA when present (or BERT_FAST_TEST_DEVICE), else the CPU."""
    name = os.environ.get("BERT_FAST_TEST_DEVICE")
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dtypes_for(device: torch.device, include_fp32: bool = True, uses_dot: bool = True) -> list[torch.dtype]:
    """Float dtypes a kernel is tested in on ``device``: fp32 (unless ``include_fp32`` is False) and
    fp16 everywhere, bf16 on CUDA, and bf16 on the CPU too for kernels without ``tl.dot``
    (``uses_dot=False``: residual_layer_norm, bias_gelu, the embedding's C++ twin). The Triton
    interpreter's bf16 problem is ``tl.dot`` alone (it returns garbage for bf16 operands, triton 3.6
    and 3.9); its bf16 loads, stores and casts around fp32 math are right, and ops/_dispatch.py sends
    those kernels bf16 tensors under the interpreter."""
    dts = [torch.float32] if include_fp32 else []
    dts.append(torch.float16)
    if torch.device(device).type == "cuda" or not uses_dot:
        dts.append(torch.bfloat16)
    return dts


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype, ulps: float = 4.0) -> float:
    """A few ulps of ``dtype`` at the magnitude of ``ref``: the error no kernel can avoid."""
    scale = max(1.0, ref.detach().abs().max().item()) if ref.numel() else 1.0
    return ulps * torch.finfo(dtype).eps * scale


def reduction_floor(oracle: torch.Tensor, dtype: torch.dtype, rows: int) -> float:
    """The rounding floor of a gradient that a kernel sums over ``rows`` rows (dweight, dbias), for
    :func:`assert_close_2x`. The one rule of every weight-gradient check (linear, residual_layer_norm,
    bias_gelu):

        max(1, max|oracle|) * (eps(dtype) + 4 * sqrt(rows) * eps(accumulator))

    Why. Every such kernel accumulates in fp32 (fp64 for fp64 inputs): per-program partial sums,
    folded by a fixed-order fp32 sum, converted to the output dtype once at the end. The output dtype
    therefore costs one rounding, at most half an ulp of the result whatever ``rows`` is, and
    eps(dtype) at the largest value is at least twice that. What grows with the row count is the
    accumulator's own rounding, which a sum of ``rows`` terms accrues like a random walk: sqrt(rows)
    roundings of eps(accumulator), taken 4 times. In fp32 that second term is the one that matters;
    in fp16/bf16 it is below 1% of an ulp. (The rule this replaces multiplied 4 eps of the output
    dtype by sqrt(rows), as if every addition rounded to bf16/fp16, which no kernel does: at 129 rows
    the bf16 floor was 35% of the largest value, more than one row's whole contribution, so a kernel
    that dropped a row passed. tests/ops/test_tolerance.py shows that every dropped row fails this rule
    and that a round-once result passes it with room.)
    """
    scale = max(1.0, oracle.detach().abs().max().item()) if oracle.numel() else 1.0
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return scale * (torch.finfo(dtype).eps + 4.0 * math.sqrt(max(1, rows)) * torch.finfo(acc).eps)


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def error_and_bound_2x(
    actual: torch.Tensor,
    oracle: torch.Tensor,
    torch_same_dtype: torch.Tensor,
    *,
    factor: float = 2.0,
    floor: Optional[float] = None,
) -> tuple[float, float]:
    """(max |actual - oracle|, factor * max |torch_same_dtype - oracle| + floor): the two sides of
    the 2x rule; ``floor`` defaults to :func:`rounding_floor` of ``actual``'s dtype."""
    if floor is None:
        floor = rounding_floor(oracle, actual.dtype)
    return max_abs_err(actual, oracle), factor * max_abs_err(torch_same_dtype, oracle) + floor


def assert_close_2x(
    actual: torch.Tensor,
    oracle: torch.Tensor,
    torch_same_dtype: torch.Tensor,
    *,
    name: str = "output",
    factor: float = 2.0,
    floor: Optional[float] = None,
    check_band: bool = True,
) -> None:
    """Assert |actual - oracle| <= factor * |torch_same_dtype - oracle| + floor (max norms).

    actual: the kernel's result; oracle: the float64 reference; torch_same_dtype: the reference
    run in the kernel's dtype. Also checks shapes, dtype, finiteness and (``check_band``) the
    fixed band of FIXED_BANDS. ``floor``: :func:`rounding_floor` unless given (gradients summed over
    rows: :func:`assert_reduction_close_2x`).
    """
    assert actual.shape == oracle.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(oracle.shape)}"
    assert actual.dtype == torch_same_dtype.dtype, f"{name}: dtype {actual.dtype} != {torch_same_dtype.dtype}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    if floor is None:
        floor = rounding_floor(oracle, actual.dtype)
    err, bound = error_and_bound_2x(actual, oracle, torch_same_dtype, factor=factor, floor=floor)
    assert err <= bound, (
        f"{name}: max error {err:.3e} > {factor} x torch's {max_abs_err(torch_same_dtype, oracle):.3e} "
        f"+ floor {floor:.1e}"
    )
    if check_band:
        atol, rtol = FIXED_BANDS[actual.dtype]
        torch.testing.assert_close(
            actual.double(),
            oracle.double(),
            atol=atol * max(1.0, oracle.abs().max().item() if oracle.numel() else 1.0),
            rtol=rtol,
            msg=lambda m: f"{name}: {m}",
        )


def assert_reduction_close_2x(
    actual: torch.Tensor, oracle: torch.Tensor, torch_same_dtype: torch.Tensor, rows: int, *, name: str = "dweight"
) -> None:
    """:func:`assert_close_2x` for a gradient summed over ``rows`` rows (dweight, dbias), with the
    floor of :func:`reduction_floor`."""
    assert_close_2x(actual, oracle, torch_same_dtype, name=name, floor=reduction_floor(oracle, actual.dtype, rows))


# ----------------------------------------------------------------------------- autotune spaces
def gpu_config_space(config_fn) -> list:
    """The configs ``config_fn()`` gives on a GPU, whatever this process runs on: its autotune list
    (TRITON_INTERPRET and BERT_FAST_AUTOTUNE unset), then its BERT_FAST_AUTOTUNE=0 choice. For the
    config functions of kernels/linear.py and kernels/linear_tma.py, which read both variables when
    called (under the interpreter they return one small config)."""
    names = ("TRITON_INTERPRET", "BERT_FAST_AUTOTUNE")
    saved = {k: os.environ.get(k) for k in names}
    try:
        for k in names:
            os.environ.pop(k, None)
        configs = list(config_fn())
        os.environ["BERT_FAST_AUTOTUNE"] = "0"
        configs += list(config_fn())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return configs


TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "EPILOGUE_SPLIT")


def tile_of(kwargs) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, EPILOGUE_SPLIT) of a config's or a launch's constexprs (None where absent)."""
    return tuple(kwargs.get(k) for k in TILE_KEYS)


def distinct_tiles(configs) -> list:
    """The first config of each distinct tile (:func:`tile_of`). The Triton interpreter runs a
    program's tile as one block, so configs that differ only in warps or pipeline stages compute the
    same thing there (those differences are compile-checked for sm_80/sm_90 offline)."""
    out = {}
    for c in configs:
        out.setdefault(tile_of(c.kwargs), c)
    return list(out.values())


# ----------------------------------------------------------------------------- Philox, in numpy
# A re-implementation of Triton's stream (triton/language/random.py: philox -> philox_impl, and
# uint_to_uniform_float), independent of the kernels: the dropout tests compare the masks the
# kernels draw with masks built from it, which pins each kernel's counter layout and word order.
_M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, seed: int):
    """Philox-4x32-10 of the counters (c0, c1, c2, c3) (uint32 values, any broadcastable arrays)
    under the 64-bit key ``seed`` (low word first, as Triton splits it): four uint64 arrays of
    32-bit words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _M32 for c in (c0, c1, c2, c3))
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        pa, pb = round_a * c0, round_b * c2  # < 2^64: exact in uint64
        c0, c1, c2, c3 = (
            (pb >> np.uint64(32)) ^ c1 ^ np.uint64(k0),
            pb & _M32,
            (pa >> np.uint64(32)) ^ c3 ^ np.uint64(k1),
            pa & _M32,
        )
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c0, c1, c2, c3


def uint32_to_uniform_float(r) -> np.ndarray:
    """Triton's uint_to_uniform_float for 32-bit words: float32 in [0, 1)."""
    x = (np.asarray(r, dtype=np.uint64) & _M32).astype(np.uint32).view(np.int32).astype(np.int64)
    x = np.where(x < 0, -x - 1, x)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


# The options of a tiny, quick ``bert-fast train`` run (the "tiny" model: H=64, 2 layers), shared by the
# training tests. Each test passes what it needs beyond these (or instead of them) to tiny_train_args.
TINY_TRAIN = {
    "max_len": 32,
    "micro_batch_size": 4,
    "log_every": 1,
    "no_progress": True,
    "model_size": "tiny",
    "lr": "2e-3",
    "warmup_steps": 2,
    "seed": 3,
}


def tiny_train_args(**options) -> list[str]:
    """The command-line arguments of a tiny ``bert-fast train`` run: TINY_TRAIN updated with ``options``
    (``max_steps=5`` -> ``--max-steps 5``; True: a bare flag; None or False: the option left out), each
    option once, so a test's own value replaces the default rather than following it."""
    argv: list[str] = []
    for name, value in {**TINY_TRAIN, **options}.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def train_env(**extra) -> dict:
    """The environment of a ``bert-fast train`` (or torchrun) subprocess in the tests: the reference ops
    (no interpreter), offline, one thread, unbuffered output; ``extra`` added last."""
    env = dict(os.environ)
    env.update(BERT_FAST_BACKEND="reference", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env.update(extra)
    return env


def tiny_bert_config(
    hidden=64, heads=4, layers=2, inter=None, act="gelu", vocab=101, max_pos=32, dropout=0.0, **fields
):
    """A small transformers BertConfig: no dropout unless ``dropout`` (hidden and attention), an
    intermediate size of 2 * hidden unless ``inter``; ``fields``: any other BertConfig field."""
    import transformers

    return transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        intermediate_size=inter or 2 * hidden,
        hidden_act=act,
        max_position_embeddings=max_pos,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        type_vocab_size=2,
        **fields,
    )


# BertConfig's field names -> DistilBertConfig's names for the same fields.
_DISTILBERT_NAMES = {
    "hidden_size": "dim",
    "num_attention_heads": "n_heads",
    "num_hidden_layers": "n_layers",
    "intermediate_size": "hidden_dim",
    "hidden_act": "activation",
    "hidden_dropout_prob": "dropout",
    "attention_probs_dropout_prob": "attention_dropout",
}


def distilbert_config(**fields):
    """A transformers DistilBertConfig from fields named as BertConfig names them (hidden_size ->
    dim, ...), so that a test builds every family from one set of fields; DistilBERT's own names pass."""
    import transformers

    return transformers.DistilBertConfig(**{_DISTILBERT_NAMES.get(k, k): v for k, v in fields.items()})


def padded_key_mask(b: int, s: int, seed: int) -> torch.Tensor:
    """A random [b, s] bool key mask (about 70% of the keys kept, every row's first one) whose last row
    is all padding when b > 1: that sequence's attention rows must come out as zeros."""
    mask = torch.rand(b, s, generator=torch.Generator().manual_seed(seed)) > 0.3
    mask[:, 0] = True
    if b > 1:
        mask[-1] = False
    return mask


def max_grad_diff(model, reference) -> float:
    """The largest |gradient difference| between two models' same-named parameters after a backward;
    a parameter whose ``reference`` twin got no gradient must get none (or zeros) either."""
    ref_params = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        ref = ref_params[name].grad
        if ref is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        assert p.grad is not None, name
        worst = max(worst, (p.grad - ref).abs().max().item())
    return worst
