"""Attention masks as transformers accepts them, reduced to the key-padding mask bert_fast runs on.

Accepted forms (B = batch, S = sequence):
  * [B, S]            bool, integer or 0/1 floats; 1/True = attend (a tokenizer's mask)
  * [B, S, S]         the same values per (query, key): transformers 4.x's 3-D form
  * [B, 1, 1, S], [B, 1, S, S] (or [B, heads, S, S])
                      bool (True = attend) or additive floats (0 = attend, a large negative
                      value or -inf = masked): the "extended" masks transformers builds itself
A 3-D or 4-D mask is accepted when it *is* a key-padding mask: every query row of a sequence
allows the same keys, except rows of pad positions, which may be fully masked (their output is
not a real token's). That is checked exactly on the host; a real [S, S] pattern (causal, block,
per-query) raises ValueError, because the kernels implement key-padding masks only.
"""

from __future__ import annotations

import torch

# An additive mask value at or below this counts as "masked" (transformers uses finfo.min, old
# code -10000.0, some users -inf); anything between it and 0 is a bias, not a mask.
_ADDITIVE_MASKED_AT = -1e4


def _two_d(mask: torch.Tensor) -> torch.Tensor:
    """A [B, S] bool/integer/0-1 float mask as bool (True = attend)."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"attention_mask dtype {mask.dtype} is not supported: use bool, an integer type or 0/1 floats")
    if mask.is_floating_point() and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(
            "a 2-D or 3-D floating attention_mask must hold only 0 and 1 (1 = attend); "
            "additive masks (0 / large negative) are 4-D, [batch, 1, 1 or seq, seq]"
        )
    return mask != 0


def _four_d_keep(mask: torch.Tensor) -> torch.Tensor:
    """A 4-D mask as bool keep [B, heads or 1, S or 1, S] (bool, or additive floats)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise TypeError(
            f"a 4-D attention_mask must be bool (True = attend) or additive floats "
            f"(0 = attend, large negative = masked), got {mask.dtype}: transformers "
            "refuses integer 4-D masks too"
        )
    keep = mask == 0
    bias = ~keep & (mask > _ADDITIVE_MASKED_AT)
    if bool(bias.any()):
        bad = mask[bias][0].item()
        raise ValueError(
            f"a 4-D float attention_mask is additive, as in transformers: 0 to attend "
            f"and a large negative value (<= {_ADDITIVE_MASKED_AT:g}, or -inf) to mask; "
            f"it holds {bad!r}, an attention bias that bert_fast does not support"
        )
    return keep


def key_padding_mask(mask, batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """The [batch, seqlen] bool key-padding mask (True = real token) of any accepted ``mask``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"attention_mask is on {mask.device} but input is on {device}")
    shape = tuple(mask.shape)
    if mask.dim() == 2:
        if shape != (batch, seqlen):
            raise ValueError(f"attention_mask must have shape {(batch, seqlen)} (batch, seq), got {shape}")
        return _two_d(mask)
    if mask.dim() == 3:
        if shape != (batch, seqlen, seqlen):
            raise ValueError(f"a 3-D attention_mask must have shape {(batch, seqlen, seqlen)}, got {shape}")
        keep = _two_d(mask)[:, None]  # [B, 1, S, S]
    elif mask.dim() == 4:
        if shape[0] != batch or shape[3] != seqlen or shape[2] not in (1, seqlen):
            raise ValueError(
                f"a 4-D attention_mask must have shape (batch, 1 or heads, 1 or seq, seq) = "
                f"({batch}, 1, 1 or {seqlen}, {seqlen}), got {shape}"
            )
        keep = _four_d_keep(mask)
    else:
        raise ValueError(
            f"attention_mask must be 2-D [batch, seq], 3-D [batch, seq, seq] or 4-D "
            f"[batch, 1, 1 or seq, seq], got shape {shape}"
        )
    return _reduce(keep, batch, seqlen)


def _reduce(keep: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """keep [B, h, q, S] (q = 1 or S) -> [B, S], after checking it is a key-padding mask."""
    # The key mask: keys any query row may attend. A row equal to it, or a fully masked row at a
    # pad position, is consistent with key padding; anything else is a real pattern.
    keys = keep.any(dim=2).any(dim=1)  # [B, S]
    if keep.shape[2] == 1 and keep.shape[1] == 1:
        return keys
    same = (keep == keys[:, None, None, :]).all(dim=-1)  # [B, h, q]
    empty_pad_row = ~keep.any(dim=-1) & ~keys[:, None, :]  # [B, h, q]
    if not bool((same | empty_pad_row).all()):
        raise ValueError(
            "attention_mask is not a key-padding mask: its query rows allow different "
            "keys (a causal, block or per-query pattern). bert_fast supports only masks "
            "that hide pad keys, the same for every query of a sequence"
        )
    return keys
