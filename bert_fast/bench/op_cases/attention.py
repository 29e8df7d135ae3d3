"""Benchmark cases of attention: B*S = 16384 tokens, S in {128, 256, 512}, 12 heads, d = 64
(bert-base shapes), forward and backward; compute-bound, figure of merit TFLOP/s.

FLOPs are counted on real tokens only: forward 4 * L^2 * d * heads per sequence of length L
(QK^T and PV, 2 FLOPs per multiply-add), backward 2.5x the forward (5 matmuls instead of 2), so a
provider that computes on padding gets no credit for it.

Dense cases (every sequence full): providers
  * "bert_fast": our varlen op on the packed batch (cu_seqlens = 0, S, 2S, ...). It calls the op
    with ``validate=False``: the default cu_seqlens check costs one host sync per call, an API
    choice (the model builds cu_seqlens itself), not kernel time;
  * "torch-sdpa-flash" / "torch-sdpa-efficient": F.scaled_dot_product_attention pinned to one
    backend with torch.nn.attention.sdpa_kernel, q/k/v [B, heads, S, d] strided views of qkv;
  * "torch-eager": softmax(q k^T * scale) v in the same dtype; "torch.compile": the same compiled;
  * "bert_fast-dq-separate": bert_fast with the atomics-free dQ kernel (BERT_FAST_ATTN_DQ=separate,
    the deterministic path) instead of the atomic one, to choose the default by measurement;
  * "bert_fast-dropout": bert_fast with attention dropout 0.1 (as in BERT training), to measure
    what the Philox draw costs (benchmarks/notes/2026-11-21-gpu-kernels.md, Attention; same FLOPs).
Padded case (lengths uniform in [0.2, 1.0] x S, fixed seed): "bert_fast" runs varlen on the real
tokens only, "bert_fast-padded" our padded kernel with the key-padding mask, "torch-sdpa-efficient"
SDPA with a bool key mask [B, 1, 1, S] (the flash backend takes no mask).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from bert_fast.bench.op_case import OpCase, ProviderUnavailable, device_randn, dtype_name, fwd_bwd, with_env

TOKENS = 16384
SEQLENS = (128, 256, 512)
HEADS = 12
HEAD_DIM = 64
PADDED_SEQLEN = 512


def _eager(q, k, v, mask=None):
    s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    return torch.matmul(torch.softmax(s, dim=-1), v)


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(_eager, dynamic=False)


def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]

    def run(q, k, v, mask=None):
        try:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        except RuntimeError as exc:
            # A pinned backend this device, dtype or shape has no kernel for (the efficient one on
            # the CPU: "No viable backend for scaled_dot_product_attention was found"; on GPUs
            # "No available kernel") cannot be measured here: a skip with torch's reason, not an error.
            msg = str(exc)
            if "No viable backend" in msg or "No available kernel" in msg:
                raise ProviderUnavailable(f"torch-sdpa-{backend_name}: {msg.splitlines()[0]}") from exc
            raise

    return run


def _lengths(batch, seqlen, padded, seed=0):
    if not padded:
        return [seqlen] * batch
    g = torch.Generator().manual_seed(seed)
    frac = 0.2 + 0.8 * torch.rand(batch, generator=g)
    return [max(1, min(seqlen, int(round(f * seqlen)))) for f in frac.tolist()]


def cu_seqlens(lengths, device):
    """The int32 offsets [B + 1] of sequences of these lengths packed one after the other."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu.to(device)


def key_padding_mask(lengths, seq, device):
    """The bool mask [B, S] of the real keys of sequences of these lengths padded to ``seq``; None
    where every sequence is full."""
    if not any(n < seq for n in lengths):
        return None
    return (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).to(device)


def sample_inputs(lengths, seq, heads, head_dim, randn, device, varlen: bool, scale: float = 1.0):
    """One call's inputs, (qkv, layout): varlen, qkv [T, 3, heads, d] of the real tokens packed and
    their cu_seqlens; padded, qkv [B, S, 3, heads, d] and its key-padding mask. ``scale``: the
    standard deviation of q, k and v (above 1, sharper softmax rows)."""
    if varlen:
        return randn(sum(lengths), 3, heads, head_dim, scale=scale), cu_seqlens(lengths, device)
    return randn(len(lengths), seq, 3, heads, head_dim, scale=scale), key_padding_mask(lengths, seq, device)


def _make_inputs(provider, lengths, seqlen, device, dtype):
    """(callable taking the leaf tensor, leaf tensor) for one provider, fresh random data."""
    randn = device_randn(device, dtype)
    if provider in ("bert_fast", "bert_fast-dq-separate", "bert_fast-dropout"):
        from bert_fast.ops import varlen_attention

        qkv, cu = sample_inputs(lengths, seqlen, HEADS, HEAD_DIM, randn, device, varlen=True)
        p = 0.1 if provider == "bert_fast-dropout" else 0.0
        return (lambda x: varlen_attention(x, cu, max(lengths), p, validate=False)), qkv
    qkv, key_mask = sample_inputs(lengths, seqlen, HEADS, HEAD_DIM, randn, device, varlen=False)
    if provider == "bert_fast-padded":
        from bert_fast.ops import attention

        return (lambda x: attention(x, key_mask)), qkv
    fn = {
        "torch-sdpa-flash": _sdpa("flash"),
        "torch-sdpa-efficient": _sdpa("efficient"),
        "torch-eager": _eager,
        "torch.compile": _compiled(),
    }[provider]
    mask4 = None if key_mask is None else key_mask[:, None, None, :]

    def call(x):
        q, k, v = (u.transpose(1, 2) for u in x.unbind(2))  # [B, heads, S, d] views
        return fn(q, k, v, mask4)

    return call, qkv


def _factory(provider, direction, lengths, seqlen, device, dtype):
    def make():
        fn, qkv = _make_inputs(provider, lengths, seqlen, device, dtype)
        if direction == "fwd":
            return lambda: fn(qkv)
        qkv.requires_grad_(True)
        out = fn(qkv)
        dout = torch.randn_like(out)
        if provider == "bert_fast-dq-separate":
            return lambda: with_env(
                "BERT_FAST_ATTN_DQ", "separate", lambda: torch.autograd.grad(out, qkv, dout, retain_graph=True)
            )
        return lambda: torch.autograd.grad(out, qkv, dout, retain_graph=True)

    return make


def cases(device, dtype) -> list[OpCase]:
    device = torch.device(device)
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    specs = [(s, False) for s in SEQLENS] + [(PADDED_SEQLEN, True)]
    for seqlen, padded in specs:
        batch = TOKENS // seqlen
        lengths = _lengths(batch, seqlen, padded)
        real = sum(lengths)
        fwd_flops = float(sum(4 * n * n * HEAD_DIM * HEADS for n in lengths))
        row = HEADS * HEAD_DIM * es  # bytes of one token's q (or k, v, out)
        if padded:
            providers = ("bert_fast", "bert_fast-padded", "torch-sdpa-efficient")
            label = f"B={batch} S={seqlen} padded(0.2-1.0, T={real}) h={HEADS} d={HEAD_DIM}"
        else:
            providers = (
                "bert_fast",
                "torch-sdpa-flash",
                "torch-sdpa-efficient",
                "torch-eager",
                "torch.compile",
                "bert_fast-dropout",
            )
            label = f"B={batch} S={seqlen} h={HEADS} d={HEAD_DIM}"
        costs = {
            "fwd": (fwd_flops, float(real * (4 * row + HEADS * 4))),  # read qkv, write out and the fp32 lse
            "bwd": (2.5 * fwd_flops, float(real * (8 * row + HEADS * 4))),  # read qkv, out, dout, lse; write dqkv
        }
        params = {"B": batch, "S": seqlen, "heads": HEADS, "head_dim": HEAD_DIM, "padded": padded, "real_tokens": real}
        params["dtype"] = dtype_name(dtype)
        factory = lambda p, direction: _factory(p, direction, lengths, seqlen, device, dtype)
        # the dQ kernel choice only exists in the backward
        bwd_only = () if padded else ("bert_fast-dq-separate",)
        out += fwd_bwd("attention", label, "compute", costs, factory, providers, params, bwd_only=bwd_only)
    return out
