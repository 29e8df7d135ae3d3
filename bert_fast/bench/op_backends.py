"""Which implementation of each op runs here: what ``bert-fast info`` prints and what the CPU
note of ``bert-fast bench`` quotes. Each op module's own ``backend(device, dtype)`` answers; this
module only asks them, and never fails (a broken op is reported as its error)."""

from __future__ import annotations

from typing import Dict, Optional

# Each op module's backend(): ``from <module> import`` reaches the module itself, where the package's
# attribute of the same name (bert_fast.ops.linear, .attention, ...) is the op function.
from bert_fast.ops.attention import backend as attention_backend
from bert_fast.ops.bias_gelu import backend as bias_gelu_backend
from bert_fast.ops.embedding import backend as embedding_backend
from bert_fast.ops.linear import backend as linear_backend
from bert_fast.ops.residual_layer_norm import backend as residual_layer_norm_backend

# The ops, in the order of a forward's data flow (also the op-case modules of bench-ops).
OP_KERNELS = ("embedding", "linear", "bias_gelu", "residual_layer_norm", "attention")
_BACKENDS = {
    "embedding": embedding_backend,
    "linear": linear_backend,
    "bias_gelu": bias_gelu_backend,
    "residual_layer_norm": residual_layer_norm_backend,
    "attention": attention_backend,
}


def op_backend(op: str, device, dtype, build: Optional[dict] = None) -> str:
    """Which implementation of ``op`` runs for tensors of ``dtype`` on ``device``: the op module's
    own ``backend(device, dtype)``, which applies bert_fast.ops._dispatch's rule. (``build`` is
    accepted for the callers' convenience; the modules read the build themselves.)"""
    import torch

    try:
        return str(_BACKENDS[op](torch.device(device), dtype))
    except Exception as exc:  # noqa: BLE001 - info must print whatever is broken, not die on it
        return f"error: {type(exc).__name__}: {exc}"


def gemm_uses_tma(device, dtype) -> bool:
    """Whether the Triton GEMM takes its TMA variant for ``dtype`` on ``device``."""
    import torch

    try:
        from bert_fast.kernels import linear_tma

        return linear_tma.enabled_for(torch.device(device), dtype)
    except Exception:  # noqa: BLE001
        return False


def linear_dispatch(device, dtype) -> Optional[Dict[str, str]]:
    """The backend bert_fast.ops.linear picks (auto) for bert-base's GEMMs at M=8192 tokens
    (its choose_backend(x, n, k, activation, direction))."""
    import torch

    # a from-import reaches the module through the import system, not through the package attribute
    # ``bert_fast.ops.linear``, which is the op function of the same name
    from bert_fast.ops.linear import choose_backend as choose

    h, m = 768, 8192
    out = {}
    for name, n, k, act in (
        ("qkv", 3 * h, h, "none"),
        ("ffn_up+gelu", 4 * h, h, "gelu"),
        ("ffn_down", h, 4 * h, "none"),
    ):
        x = torch.empty(1, device=device, dtype=dtype).expand(m, k)  # shape only, no allocation
        try:
            out[name] = str(choose(x, n, k, act, "fwd"))
        except Exception as exc:  # noqa: BLE001
            out[name] = f"error: {exc}"
        if out[name] == "triton":  # which Triton GEMM: BERT's rows are 16-byte aligned
            out[name] += " (TMA)" if gemm_uses_tma(device, dtype) else " (pointer)"
    return out


def cpu_summary() -> str:
    """One line: the implementation each op runs on CPU fp32 tensors (as `bert-fast info` says)."""
    try:
        import torch

        import bert_fast

        build = bert_fast.build_info()
        return "; ".join(f"{op}: {op_backend(op, 'cpu', torch.float32, build)}" for op in OP_KERNELS)
    except Exception as exc:  # noqa: BLE001 - a note must not stop the benchmark
        return f"per-op implementations unknown: {exc}"
