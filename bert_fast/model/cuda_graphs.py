"""CUDA-graph capture for small-batch inference: one graph per (batch, seq) bucket, replayed.

At batch 1 x 128 a BERT forward is launch-bound (about 7 kernels per layer), so replaying one
captured graph is what reaches sub-millisecond latency. A graph needs static shapes and no host
syncs, so the runner uses the padded encoder (masked attention; no unpadding, whose token count is
data-dependent): inputs are copied into the bucket's static buffers with the extra rows and
columns masked out, which leaves the real positions' results unchanged.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from bert_fast.model.gemms import frozen_qkv
from bert_fast.model.modeling import BertModel
from bert_fast.ops.embedding import check_index_ranges

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_SEQ_BUCKETS = (16, 32, 64, 128, 256, 384, 512)


class CudaGraphRunner:
    """Callable like the model (input_ids, attention_mask, token_type_ids) for inference.

    ``model`` is a bert_fast.BertModel in eval mode on a CUDA device. Graphs are captured lazily,
    the first time a bucket is used (``capture(batch, seq)`` captures ahead of time). A request
    larger than the largest bucket runs the model eagerly. Outputs are fresh tensors (cloned out of
    the static buffers), so they stay valid after the next call. If the weights change after a
    capture, call ``reset()``.
    """

    def __init__(
        self,
        model: BertModel,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        seq_buckets: Sequence[int] = DEFAULT_SEQ_BUCKETS,
        warmup: int = 2,
    ):
        if not isinstance(model, BertModel):
            raise TypeError(f"CudaGraphRunner needs a bert_fast.BertModel, got {type(model).__name__}")
        device = model.embeddings.word_embeddings.weight.device
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need the model on a CUDA device, it is on {device}")
        if model.training:
            raise RuntimeError("CudaGraphRunner is for inference: call model.eval() first")
        max_pos = model.config.max_position_embeddings
        self.model = model
        self.device = device
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.seq_buckets = tuple(sorted(s for s in seq_buckets if s <= max_pos)) or (max_pos,)
        # At least one warm-up forward: Triton compiles and autotunes on the first call of a shape
        # (with host syncs), which must never happen inside the capture.
        self.warmup = max(1, int(warmup))
        self._graphs: Dict[Tuple[int, int], dict] = {}
        self._pool = None
        # The fused QKV weights every graph reads (frozen_qkv): one copy shared by all buckets.
        self._qkv: dict = {}

    def reset(self) -> None:
        """Forget every graph and the fused QKV weights they read: the next call captures again
        from the current weights (call after the weights change)."""
        self._graphs.clear()
        self._pool = None
        self._qkv = {}

    def bucket(self, batch: int, seq: int) -> Optional[Tuple[int, int]]:
        bb = next((x for x in self.batch_buckets if x >= batch), None)
        sb = next((x for x in self.seq_buckets if x >= seq), None)
        return None if bb is None or sb is None else (bb, sb)

    @torch.no_grad()
    def capture(self, batch: int, seq: int) -> dict:
        key = (batch, seq)
        if key in self._graphs:
            return self._graphs[key]
        # Everything on the model's GPU: the capture stream, the static buffers and the graph
        # (torch.cuda.graph's default capture stream belongs to the *current* device).
        with torch.cuda.device(self.device):
            ids = torch.ones((batch, seq), dtype=torch.long, device=self.device)
            mask = torch.ones((batch, seq), dtype=torch.long, device=self.device)
            types = torch.zeros((batch, seq), dtype=torch.long, device=self.device)
            # Warm up on a side stream (Triton compiles and autotunes here, cuBLAS sets up its
            # workspace for that stream), then capture on the same stream.
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            # The fused QKV weights are built once (in the first warm-up, outside any capture) and
            # read by address by every graph; the entry keeps them alive, reset() drops them.
            with frozen_qkv(self.model, self._qkv) as qkv:
                with torch.cuda.stream(side):
                    for _ in range(self.warmup):
                        self.model(ids, attention_mask=mask, token_type_ids=types, padded=True)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=side):
                    out = self.model(ids, attention_mask=mask, token_type_ids=types, padded=True)
            self._pool = graph.pool()
        entry = {
            "graph": graph,
            "ids": ids,
            "mask": mask,
            "types": types,
            "last": out.last_hidden_state,
            "pooled": out.pooler_output,
            "qkv": qkv,
        }
        self._graphs[key] = entry
        return entry

    def _check_inputs(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], token_type_ids: Optional[torch.Tensor]
    ) -> None:
        """Host-side validation before a replay (the kernels' own range checks are skipped inside
        a graph): shapes, and the id ranges in one fused min/max reduction (one sync)."""
        shape = tuple(input_ids.shape)
        if attention_mask is not None and (
            not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != shape
        ):
            got = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise ValueError(f"attention_mask must have the shape of input_ids {shape}, got {got}")
        if token_type_ids is not None:  # as the model: the shape of input_ids or broadcastable to it
            ok = isinstance(token_type_ids, torch.Tensor)
            if ok:
                try:
                    token_type_ids.expand(shape)
                except RuntimeError:
                    ok = False
            if not ok:
                got = (
                    tuple(token_type_ids.shape)
                    if isinstance(token_type_ids, torch.Tensor)
                    else type(token_type_ids).__name__
                )
                raise ValueError(
                    f"token_type_ids must have the shape of input_ids {shape} (or broadcast to it), got {got}"
                )
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must have an integer dtype, got {input_ids.dtype}")
        if input_ids.numel() == 0:
            return
        config = self.model.config
        check_index_ranges(
            (
                ("input_ids", input_ids, config.vocab_size, "the config's vocab_size"),
                (
                    "token_type_ids",
                    None if token_type_ids is None else token_type_ids.to(input_ids.device),
                    config.type_vocab_size,
                    "the config's type_vocab_size",
                ),
            )
        )

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
    ):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        self._check_inputs(input_ids, attention_mask, token_type_ids)
        key = self.bucket(b, s)
        if key is None or b == 0 or s == 0:
            return self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        # Replay launches on the current stream of the *current* device: make it the model's.
        with torch.cuda.device(self.device):
            g = self.capture(*key)
            g["ids"].zero_()
            g["mask"].zero_()
            g["types"].zero_()
            g["ids"][:b, :s].copy_(input_ids)
            if attention_mask is not None:
                g["mask"][:b, :s].copy_(attention_mask)
            else:
                g["mask"][:b, :s].fill_(1)
            if token_type_ids is not None:
                g["types"][:b, :s].copy_(token_type_ids)
            g["graph"].replay()
            pooled = g["pooled"][:b].clone() if g["pooled"] is not None else None
            last = g["last"][:b, :s].clone()
        return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=last, pooler_output=pooled)
