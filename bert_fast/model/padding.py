"""Unpad once, pad once: the real tokens of a padded batch, packed, and back.

The encoder runs on the T real tokens only (T = attention_mask.sum(), not B*S), so padding costs
nothing between the embedding gather and the final scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Unpadded:
    """Where the real tokens of a [B, S] batch are, packed row after row."""

    indices: torch.Tensor  # int64 [T]: flat positions (b * S + s) of the real tokens, in order
    cu_seqlens: torch.Tensor  # int32 [B+1]: sequence b is packed rows cu_seqlens[b]:cu_seqlens[b+1]
    max_seqlen: int  # longest sequence (host int: the attention grid needs it)
    batch: int
    seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.indices.numel()


def unpad(attention_mask: torch.Tensor) -> Unpadded:
    """Pack the positions where ``attention_mask`` [B, S] is non-zero.

    Any mask pattern works (right or left padding, holes): each row's real tokens stay in order, so
    attention among them equals key-padding-masked attention at the real positions. One host sync
    (for T and max_seqlen), which is why the CUDA-graph path uses the padded encoder instead.
    """
    b, s = attention_mask.shape
    keep = attention_mask.reshape(-1) != 0
    indices = torch.nonzero(keep, as_tuple=False).flatten()
    seqlens = (attention_mask != 0).sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.zeros(b + 1, dtype=torch.int32, device=attention_mask.device)
    if b:
        torch.cumsum(seqlens, dim=0, out=cu_seqlens[1:])
    max_seqlen = int(seqlens.max().item()) if b else 0
    return Unpadded(indices, cu_seqlens, max_seqlen, b, s)


def pad(hidden: torch.Tensor, where: Unpadded) -> torch.Tensor:
    """Scatter packed rows [T, ...] back to [B, S, ...]; pad positions are zero (differentiable)."""
    shape = (where.batch, where.seqlen) + tuple(hidden.shape[1:])
    if hidden.shape[0] == where.batch * where.seqlen:
        # no pads: the packed rows are already in [B, S] order (indices = 0..T-1)
        return hidden.view(shape)
    out = hidden.new_zeros((where.batch * where.seqlen,) + tuple(hidden.shape[1:]))
    out.index_copy_(0, where.indices, hidden)  # in place into the fresh zeros: one pass less
    return out.view(shape)
