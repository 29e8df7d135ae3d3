"""The fused BERT embedding op: word + position + token-type gather, sum, LayerNorm, dropout.

Public API: :func:`embedding_layer_norm`. Registered torch ops:

* ``bert_fast::embedding_layer_norm_fwd`` -> (out, mean, rstd); mean/rstd are the fp32 (float64 for
  float64 tables) LayerNorm statistics per output row, saved for backward.
* ``bert_fast::embedding_layer_norm_bwd`` -> (d_word, d_position, d_token_type, d_weight, d_bias);
  x is recomputed from the tables and the dropout mask regenerated from the saved seed. A gradient
  that is not needed comes back as an empty tensor (None through autograd).

Dispatch (the rule of ops/_dispatch.py; ``_backend`` maps it to this op's four implementations):
  * CUDA tensors (fp32/fp16/bf16)      -> "cuda": the CUDA kernels of csrc/embedding_cuda.cu
  * CPU tensors with TRITON_INTERPRET=1 -> "cpu": the C++ CPU twin of csrc/embedding_cpu.cpp, our
    kernel with the GPU's exact semantics (same Philox dropout bits, fp32 statistics, fused
    unpadding): the "kernel" on the CPU, which the op tests check
  * CPU tensors otherwise, float64 on CUDA, BERT_FAST_BACKEND=torch, or a build without the
    extension                          -> "torch": bert_fast.ops.torch_impl (index_select gathers,
    in-place sum, aten native_layer_norm; backward native_layer_norm_backward + index_add_).
    Measured 1.4-3x faster than the twin on the 2-core CPU (the twin is single-threaded and
    scalar; benchmarks/notes/2026-11-24-cpu-path.md), so it is the production CPU path.
  * ``BERT_FAST_BACKEND=reference``    -> "reference": bert_fast.reference.embedding_layer_norm
    (plain torch autograd; dropout mask from _dispatch.reference_dropout_mask)
The torch path draws its dropout mask with ``_dispatch.reference_dropout_mask`` (the reference's
bits for one seed), the twin and CUDA with their shared Philox stream.
The kernel (CUDA or the twin) is checked against the torch implementation the first time each
specialization runs (bert_fast/ops/_verify.py; with dropout, on the kernel's own mask).
Deterministic mode (torch.use_deterministic_algorithms(True)) makes the CUDA backward atomics-free:
dx rows go to a workspace and each table row sums its tokens in stable-sorted order. The CPU twin is
always deterministic.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from bert_fast import reference
from bert_fast.ops import _dispatch, _verify, torch_impl
from bert_fast.ops.keep_mask import keep_mask

__all__ = ["embedding_layer_norm"]

try:  # the compiled extension; absent in a source checkout that was never built
    from bert_fast import _C as _ext
except ImportError:  # pragma: no cover
    _ext = None

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_INDEX_DTYPES = (torch.int32, torch.int64)
_WARPS_PER_BLOCK = 4  # rows per block of the CUDA kernels (kWarps in embedding_cuda.cu)


# ----------------------------------------------------------------------------- helpers
def _ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _is64(t: Optional[Tensor]) -> int:
    return 1 if t is None or t.dtype == torch.int64 else 0


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _backend(t: Tensor) -> str:
    """ "cuda", "cpu" (the C++ twin), "torch" or "reference" for tables ``t`` (module docstring)."""
    return _backend_for(t.device, t.dtype)


def _backend_for(device, dtype) -> str:
    impl = _dispatch.implementation_for(device, dtype)
    if impl != "kernel" or _ext is None:
        return impl if impl == "reference" else "torch"
    if torch.device(device).type == "cuda":
        return "cuda" if hasattr(_ext, "embedding_fwd_cuda") else "torch"
    return "cpu"


def backend(device, dtype) -> str:
    """What runs for tables of ``dtype`` on ``device`` (``bert-fast info``)."""
    b = _backend_for(device, dtype)
    if b == "cuda":
        return "CUDA kernel (bert_fast._C)"
    if b == "cpu":
        return "C++ CPU twin (bert_fast._C; TRITON_INTERPRET=1 runs the kernels)"
    impl = "torch" if b == "torch" else "reference"
    return _dispatch.describe(
        impl,
        device,
        "index_select + aten native_layer_norm" + ("" if _ext is not None else " (bert_fast._C not built)"),
    )


def _out_rows(input_ids: Tensor, indices: Optional[Tensor]) -> int:
    return indices.shape[0] if indices is not None else input_ids.numel()


def _common_params(input_ids, position_ids, token_type_ids, indices, word, pos, typ, rows, dropout_p, seed):
    return {
        "ids": _ptr(input_ids),
        "pos": _ptr(position_ids),
        "tt": _ptr(token_type_ids),
        "ids_i64": _is64(input_ids),
        "pos_i64": _is64(position_ids),
        "tt_i64": _is64(token_type_ids),
        "indices": _ptr(indices),
        "rows": int(rows),
        "seq_len": int(input_ids.shape[-1]) if input_ids.dim() > 0 and input_ids.shape[-1] > 0 else 1,
        "hidden": int(word.shape[1]),
        "word": _ptr(word),
        "posemb": _ptr(pos),
        "typeemb": _ptr(typ),
        "dtype": _DTYPE_CODES[word.dtype],
        "dropout_p": float(dropout_p) if seed is not None else 0.0,
        "seed": _dispatch.seed_value(seed),
    }


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _num_partials(rows: int, device: torch.device) -> int:
    """Blocks of the CUDA backward = rows of the dgamma/dbeta partials workspace. Depends only on
    (rows, device), so the reduction order, and the result, is reproducible."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-rows // _WARPS_PER_BLOCK), 4 * sms))


# ----------------------------------------------------------------------------- first-use check
def _kernel_label(word: Tensor) -> str:
    return "bert_fast._C embedding (" + ("CUDA)" if word.is_cuda else "C++ CPU twin)")


def _spec(input_ids, position_ids, token_type_ids, indices, word, dropout_p, rows) -> tuple:
    """What the kernels are instantiated for: dtype, hidden size (vectors per lane), the index
    dtypes and which of positions / types / indices are given, dropout, the row bucket. The backward
    adds deterministic mode and which gradients it computes."""
    dt = lambda t: None if t is None else str(t.dtype).replace("torch.", "")
    return (
        word.dtype,
        word.shape[1],
        dt(input_ids),
        dt(position_ids),
        dt(token_type_ids),
        indices is not None,
        dropout_p > 0.0,
        _verify.bucket(rows),
    )


def _kernel_mask(rows: int, hidden: int, dropout_p: float, seed: Optional[Tensor], device):
    if seed is None or dropout_p == 0.0:
        return None
    return lambda: embedding_dropout_mask(rows, hidden, dropout_p, seed, device)


def _gathered(input_ids, position_ids, token_type_ids, indices, word, pos_table, type_table):
    """(x, |x| terms, ids, position ids, type ids): the embedding sum recomputed in fp32 (float64 for
    float64) and the sum of its terms' magnitudes, [rows, H]."""
    ids, pos, tt = torch_impl.embedding_rows(input_ids, position_ids, token_type_ids, indices)
    rows = ids.numel()
    if pos is None:  # rows in order: position = row % S
        pos = torch.arange(rows, device=ids.device) % max(1, input_ids.shape[-1])
    if tt is None:
        tt = torch.zeros_like(ids)
    work = torch.float64 if word.dtype == torch.float64 else torch.float32
    parts = [
        table.detach().index_select(0, i.long()).to(work)
        for table, i in ((word, ids), (pos_table, pos), (type_table, tt))
    ]
    return sum(parts), sum(p.abs() for p in parts), ids.long(), pos.long(), tt.long()


def _fwd_checks(
    input_ids, position_ids, token_type_ids, indices, word, pos_table, type_table, weight, bias, dropout_p, keep, k, t
):
    # the torch implementation rounds the sum of three rows twice in the dtype (see layer_norm_checks)
    x, xmag, _, _, _ = _gathered(input_ids, position_ids, token_type_ids, indices, word, pos_table, type_table)
    scale = 1.0 / (1.0 - dropout_p) if (keep is not None and dropout_p > 0.0) else 1.0
    hidden = word.shape[1]
    flat = lambda outs: (outs[0].reshape(-1, hidden), outs[1], outs[2])
    return _verify.with_rel(
        _verify.layer_norm_checks(x, xmag, weight, bias, flat(k), flat(t), scale=scale),
        _verify.dropout_rel(word.dtype, dropout_p),
    )


def _bwd_checks(
    grad_out,
    input_ids,
    position_ids,
    token_type_ids,
    indices,
    word,
    pos_table,
    type_table,
    weight,
    mean,
    rstd,
    dropout_p,
    pads,
    need,
    keep,
    k,
    t,
):
    """LayerNorm's backward magnitudes (layer_norm_bwd_magnitudes), then summed into each table row
    the way the gradient is (a table row's gradient adds the rows that gathered it; a padding row,
    ``pads`` (word, position, type), adds none)."""
    x, xmag, ids, pos, tt = _gathered(input_ids, position_ids, token_type_ids, indices, word, pos_table, type_table)
    rows, hidden = x.shape
    dy = _verify.absf(grad_out).reshape(rows, hidden)
    if keep is not None and dropout_p > 0.0:
        dy = dy * keep.reshape(rows, hidden).to(dy.dtype) * (1.0 / (1.0 - dropout_p))
    dh, dw_terms, ady = _verify.layer_norm_bwd_magnitudes(x, xmag, dy, weight, mean, rstd)
    checks = []
    for i, (name, table, index) in enumerate(
        (("dword", word, ids), ("dposition", pos_table, pos), ("dtoken_type", type_table, tt))
    ):
        if need[i]:
            m = torch.zeros(table.shape, dtype=dh.dtype, device=dh.device).index_add_(0, index, dh)
            if pads[i] >= 0:
                m[pads[i]] = 0
            checks.append(_verify.Check(name, k[i], t[i], mag=2.0 * m, acc=(rows + hidden + 2) * m))
    for i, (name, terms) in ((3, ("dweight", dw_terms)), (4, ("dbias", ady))):
        if need[i]:
            m = terms.sum(dim=0)
            checks.append(_verify.Check(name, k[i], t[i], mag=m, acc=(rows + 2) * m))
    return _verify.with_rel(checks, _verify.dropout_rel(word.dtype, dropout_p))


# ----------------------------------------------------------------------------- forward op
@torch.library.custom_op("bert_fast::embedding_layer_norm_fwd", mutates_args=())
@_dispatch.op_impl
def embedding_layer_norm_fwd(
    input_ids: Tensor,
    position_ids: Optional[Tensor],
    token_type_ids: Optional[Tensor],
    indices: Optional[Tensor],
    word_embeddings: Tensor,
    position_embeddings: Tensor,
    token_type_embeddings: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float,
    dropout_p: float,
    seed: Optional[Tensor],
    padding_idx: int,
    validate: bool = False,
    position_padding_idx: int = -1,
    token_type_padding_idx: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs are validated by :func:`embedding_layer_norm`: ids/positions/types contiguous and of one
    shape (positions/types may be None), indices contiguous int64 or None, tables contiguous.

    ``validate``: check the index ranges here, before the launch. It runs inside the op (opaque to
    torch.compile, so the data-dependent check causes no graph break) and is skipped while a CUDA
    graph is being captured (a host sync is illegal there).

    ``padding_idx`` / ``position_padding_idx`` / ``token_type_padding_idx`` (-1: none, else in range)
    name the table rows that get no gradient (nn.Embedding's padding_idx): the forward ignores them,
    autograd hands them to the backward."""
    word = word_embeddings
    if validate and _dispatch.host_checks_allowed(input_ids):
        _validate_ranges(
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word.shape[0],
            position_embeddings.shape[0],
            token_type_embeddings.shape[0],
        )
    if _backend(word) == "torch":
        return torch_impl.embedding_fwd(
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word,
            position_embeddings,
            token_type_embeddings,
            weight,
            bias,
            eps,
            dropout_p,
            seed,
        )
    rows = _out_rows(input_ids, indices)
    hidden = word.shape[1]
    if rows == 0:
        return _launch_fwd(
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word,
            position_embeddings,
            token_type_embeddings,
            weight,
            bias,
            eps,
            dropout_p,
            seed,
        )
    spec = _spec(input_ids, position_ids, token_type_ids, indices, word, dropout_p, rows)
    return _verify.run(
        "embedding",
        "fwd",
        spec,
        word.device,
        label=_kernel_label(word),
        dtype=word.dtype,
        kernel=lambda: _launch_fwd(
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word,
            position_embeddings,
            token_type_embeddings,
            weight,
            bias,
            eps,
            dropout_p,
            seed,
        ),
        kernel_mask=_kernel_mask(rows, hidden, dropout_p, seed, word.device),
        fallback=lambda keep: torch_impl.embedding_fwd(
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word,
            position_embeddings,
            token_type_embeddings,
            weight,
            bias,
            eps,
            dropout_p,
            seed,
            keep=keep,
        ),
        checks=lambda k, t, keep: _fwd_checks(
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word,
            position_embeddings,
            token_type_embeddings,
            weight,
            bias,
            dropout_p,
            keep,
            k,
            t,
        ),
    )


def _launch_fwd(
    input_ids,
    position_ids,
    token_type_ids,
    indices,
    word,
    position_embeddings,
    token_type_embeddings,
    weight,
    bias,
    eps,
    dropout_p,
    seed,
):
    """The kernel's (out, mean, rstd): CUDA, or the C++ CPU twin on CPU tensors."""
    rows = _out_rows(input_ids, indices)
    hidden = word.shape[1]
    out_shape = (rows, hidden) if indices is not None else tuple(input_ids.shape) + (hidden,)
    out = torch.empty(out_shape, dtype=word.dtype, device=word.device)
    mean = torch.empty((rows,), dtype=_acc_dtype(word.dtype), device=word.device)
    rstd = torch.empty_like(mean)
    if rows == 0:
        return out, mean, rstd
    params = _common_params(
        input_ids,
        position_ids,
        token_type_ids,
        indices,
        word,
        position_embeddings,
        token_type_embeddings,
        rows,
        dropout_p,
        seed,
    )
    params.update(out=_ptr(out), mean=_ptr(mean), rstd=_ptr(rstd), gamma=_ptr(weight), beta=_ptr(bias), eps=float(eps))
    if word.is_cuda:  # on word's GPU: _dispatch.op_impl made it the current device
        params["stream"] = _stream(word.device)
        _ext.embedding_fwd_cuda(params)
    else:
        _ext.embedding_fwd_cpu(params)
    return out, mean, rstd


@embedding_layer_norm_fwd.register_fake
def _(
    input_ids,
    position_ids,
    token_type_ids,
    indices,
    word_embeddings,
    position_embeddings,
    token_type_embeddings,
    weight,
    bias,
    eps,
    dropout_p,
    seed,
    padding_idx,
    validate=False,
    position_padding_idx=-1,
    token_type_padding_idx=-1,
):
    word = word_embeddings
    hidden = word.shape[1]
    if indices is not None:
        rows = indices.shape[0]
        out = word.new_empty((rows, hidden))
    else:
        rows = input_ids.numel()
        out = word.new_empty(tuple(input_ids.shape) + (hidden,))
    mean = word.new_empty((rows,), dtype=_acc_dtype(word.dtype))
    return out, mean, torch.empty_like(mean)


# ----------------------------------------------------------------------------- backward op
@torch.library.custom_op("bert_fast::embedding_layer_norm_bwd", mutates_args=())
@_dispatch.op_impl
def embedding_layer_norm_bwd(
    grad_out: Tensor,
    input_ids: Tensor,
    position_ids: Optional[Tensor],
    token_type_ids: Optional[Tensor],
    indices: Optional[Tensor],
    word_embeddings: Tensor,
    position_embeddings: Tensor,
    token_type_embeddings: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    dropout_p: float,
    seed: Optional[Tensor],
    padding_idx: int,
    output_mask: Sequence[bool],
    deterministic: bool,
    position_padding_idx: int = -1,
    token_type_padding_idx: int = -1,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (word, position, token-type tables, weight, bias); output_mask says which are
    needed (the others come back as empty tensors). The ``padding_idx`` row of the word table, the
    ``position_padding_idx`` row of the position table and the ``token_type_padding_idx`` row of the
    type table (each -1: none) get zero, as nn.Embedding's padding_idx rows: RoBERTa / XLM-R gather
    the position row pad_token_id at every pad, and transformers gives that row no gradient."""
    pads = (int(padding_idx), int(position_padding_idx), int(token_type_padding_idx))
    word, pos, typ = word_embeddings, position_embeddings, token_type_embeddings
    need = [bool(m) for m in output_mask]
    dtype, device = word.dtype, word.device
    hidden = word.shape[1]
    rows = _out_rows(input_ids, indices)
    shapes = [word.shape, pos.shape, typ.shape, weight.shape, weight.shape]

    def final(i):
        return torch.zeros(shapes[i], dtype=dtype, device=device) if need[i] else word.new_empty((0,))

    if rows == 0 or not any(need):
        return tuple(final(i) for i in range(5))
    if _backend(word) == "torch":
        grads = torch_impl.embedding_bwd(
            grad_out,
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word,
            pos,
            typ,
            weight,
            mean,
            rstd,
            dropout_p,
            seed,
            padding_idx,
            need,
            position_padding_idx=pads[1],
            token_type_padding_idx=pads[2],
        )
        return tuple(g if g is not None else word.new_empty((0,)) for g in grads)
    spec = _spec(input_ids, position_ids, token_type_ids, indices, word, dropout_p, rows)

    def fallback(keep):
        grads = torch_impl.embedding_bwd(
            grad_out,
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word,
            pos,
            typ,
            weight,
            mean,
            rstd,
            dropout_p,
            seed,
            padding_idx,
            need,
            keep=keep,
            position_padding_idx=pads[1],
            token_type_padding_idx=pads[2],
        )
        return tuple(g if g is not None else word.new_empty((0,)) for g in grads)

    return _verify.run(
        "embedding",
        "bwd",
        spec + (bool(deterministic), tuple(need), _verify.aligned(grad_out)),
        device,
        label=_kernel_label(word),
        dtype=dtype,
        kernel=lambda: _launch_bwd(
            grad_out,
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word,
            pos,
            typ,
            weight,
            mean,
            rstd,
            dropout_p,
            seed,
            pads,
            need,
            deterministic,
        ),
        kernel_mask=_kernel_mask(rows, hidden, dropout_p, seed, device),
        fallback=fallback,
        checks=lambda k, t, keep: _bwd_checks(
            grad_out,
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word,
            pos,
            typ,
            weight,
            mean,
            rstd,
            dropout_p,
            pads,
            need,
            keep,
            k,
            t,
        ),
        follows=("fwd", spec),
    )


def _launch_bwd(
    grad_out,
    input_ids,
    position_ids,
    token_type_ids,
    indices,
    word,
    pos,
    typ,
    weight,
    mean,
    rstd,
    dropout_p,
    seed,
    pads,
    need,
    deterministic,
):
    """The kernel's five gradients (empty where not needed): CUDA, or the C++ CPU twin. ``pads``:
    the (word, position, type) rows that get no gradient, -1 for none."""
    dtype, device = word.dtype, word.device
    acc = _acc_dtype(dtype)
    hidden = word.shape[1]
    rows = _out_rows(input_ids, indices)
    shapes = [word.shape, pos.shape, typ.shape, weight.shape, weight.shape]
    grad_out = grad_out.reshape(rows, hidden).contiguous()
    params = _common_params(input_ids, position_ids, token_type_ids, indices, word, pos, typ, rows, dropout_p, seed)
    params.update(
        dy=_ptr(grad_out),
        gamma=_ptr(weight),
        mean=_ptr(mean),
        rstd=_ptr(rstd),
        padding_idx=pads[0],
        pos_padding_idx=pads[1],
        type_padding_idx=pads[2],
    )

    # fp32 accumulators (float64 for float64); an fp32 table's gradient is its own accumulator.
    def accum(i):
        if not need[i]:
            return None
        return torch.zeros(shapes[i], dtype=acc, device=device)

    if not word.is_cuda:
        bufs = [accum(i) for i in range(5)]
        params.update(
            dword=_ptr(bufs[0]), dpos=_ptr(bufs[1]), dtype_grad=_ptr(bufs[2]), dgamma=_ptr(bufs[3]), dbeta=_ptr(bufs[4])
        )
        _ext.embedding_bwd_cpu(params)
        return tuple(bufs[i].to(dtype) if need[i] else word.new_empty((0,)) for i in range(5))

    # on the tables' GPU: _dispatch.op_impl made it the current device
    stream = _stream(device)
    params["stream"] = stream
    nparts = _num_partials(rows, device)
    params["num_partials"] = nparts
    dgb = [accum(3), accum(4)]
    # Every workspace whose pointer goes into params must stay referenced until its kernels are
    # queued: a temporary would return its block to the caching allocator at once, and the
    # next allocation below (a table accumulator) could get the same memory, which the
    # kernel then writes as both partials and gradient.
    partials = None
    if need[3] or need[4]:
        partials = torch.empty((nparts, 2, hidden), dtype=torch.float32, device=device)
        params["partials"] = _ptr(partials)
        params.update(dgamma=_ptr(dgb[0]), dbeta=_ptr(dgb[1]))
    tables_needed = need[0] or need[1] or need[2]
    if not deterministic or not tables_needed:
        bufs = [accum(i) for i in range(3)]
        params.update(dword=_ptr(bufs[0]), dpos=_ptr(bufs[1]), dtype_grad=_ptr(bufs[2]))
        _ext.embedding_bwd_cuda(params)
        grads = [bufs[i].to(dtype) if need[i] else word.new_empty((0,)) for i in range(3)]
    else:
        dx = torch.empty((rows, hidden), dtype=torch.float32, device=device)
        params["dx_ws"] = _ptr(dx)
        _ext.embedding_bwd_cuda(params)
        ids, pos_ids, tt_ids = _row_ids(input_ids, position_ids, token_type_ids, indices)
        grads = []
        for i, (tbl, ids_i) in enumerate(((word, ids), (pos, pos_ids), (typ, tt_ids))):
            if not need[i]:
                grads.append(word.new_empty((0,)))
                continue
            g = torch.zeros(tbl.shape, dtype=dtype, device=device)
            perm = torch.argsort(ids_i, stable=True)
            seg_rows, counts = torch.unique_consecutive(ids_i[perm], return_counts=True)
            offsets = torch.zeros(seg_rows.numel() + 1, dtype=torch.int64, device=device)
            torch.cumsum(counts, 0, out=offsets[1:])
            _ext.embedding_segment_sum_cuda(
                _ptr(dx),
                _ptr(perm),
                _ptr(offsets),
                _ptr(seg_rows),
                int(seg_rows.numel()),
                hidden,
                pads[i],
                _ptr(g),
                _DTYPE_CODES[dtype],
                stream,
            )
            grads.append(g)
    grads += [
        dgb[0].to(dtype) if need[3] else word.new_empty((0,)),
        dgb[1].to(dtype) if need[4] else word.new_empty((0,)),
    ]
    return tuple(grads)


def _row_ids(input_ids, position_ids, token_type_ids, indices):
    """int64 word/position/type ids of each output row (the kernel's own gather, in torch)."""
    flat = input_ids.reshape(-1).long()
    n = flat.numel()
    src = indices if indices is not None else torch.arange(n, device=flat.device)
    ids = flat[src]
    if position_ids is not None:
        pos = position_ids.reshape(-1).long()[src]
    else:
        pos = src % max(1, input_ids.shape[-1])
    tt = token_type_ids.reshape(-1).long()[src] if token_type_ids is not None else torch.zeros_like(ids)
    return ids, pos, tt


@embedding_layer_norm_bwd.register_fake
def _(
    grad_out,
    input_ids,
    position_ids,
    token_type_ids,
    indices,
    word_embeddings,
    position_embeddings,
    token_type_embeddings,
    weight,
    mean,
    rstd,
    dropout_p,
    seed,
    padding_idx,
    output_mask,
    deterministic,
    position_padding_idx=-1,
    token_type_padding_idx=-1,
):
    shapes = [word_embeddings.shape, position_embeddings.shape, token_type_embeddings.shape, weight.shape, weight.shape]
    return tuple(word_embeddings.new_empty(shapes[i] if output_mask[i] else (0,)) for i in range(5))


# ----------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    (
        input_ids,
        position_ids,
        token_type_ids,
        indices,
        word,
        pos,
        typ,
        weight,
        bias,
        eps,
        dropout_p,
        seed,
        padding_idx,
        _validate,
        position_padding_idx,
        token_type_padding_idx,
    ) = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input_ids, position_ids, token_type_ids, indices, word, pos, typ, weight, seed, mean, rstd)
    ctx.dropout_p = dropout_p
    ctx.padding_idx = padding_idx
    ctx.position_padding_idx = position_padding_idx
    ctx.token_type_padding_idx = token_type_padding_idx


def _backward(ctx, grad_out, grad_mean, grad_rstd):
    (input_ids, position_ids, token_type_ids, indices, word, pos, typ, weight, seed, mean, rstd) = ctx.saved_tensors
    mask = list(ctx.needs_input_grad[4:9])
    grads = [None] * 16
    if not any(mask):
        return tuple(grads)
    out = torch.ops.bert_fast.embedding_layer_norm_bwd(
        grad_out,
        input_ids,
        position_ids,
        token_type_ids,
        indices,
        word,
        pos,
        typ,
        weight,
        mean,
        rstd,
        ctx.dropout_p,
        seed,
        ctx.padding_idx,
        mask,
        _dispatch.deterministic(),
        ctx.position_padding_idx,
        ctx.token_type_padding_idx,
    )
    for i in range(5):
        if mask[i]:
            grads[4 + i] = out[i]
    return tuple(grads)


embedding_layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public function
def _check_index_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must have an integer dtype (torch.int32 or torch.int64), got {t.dtype}")


def _broadcast_ids(name: str, t: Optional[Tensor], shape) -> Optional[Tensor]:
    if t is None:
        return None
    _check_index_tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        try:
            t = t.expand(shape)
        except RuntimeError:
            raise ValueError(
                f"{name} must have the shape of input_ids {tuple(shape)} (or broadcast to it), got {tuple(t.shape)}"
            ) from None
    return t.contiguous()


def _check_padding_idx(name: str, value, rows: int, what: str) -> Optional[int]:
    """None, or ``value`` in [-rows, rows) made non-negative (negative counts from the end, as
    nn.Embedding's padding_idx)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -rows <= value < rows:
        raise ValueError(f"{name} must be an int in [-{rows}, {rows}) ({what}), got {value!r}")
    return value % rows


def check_index_ranges(checks) -> None:
    """IndexError unless every index tensor lies in [0, limit): ``checks`` holds (name, tensor or
    None, limit, what the limit is) tuples, tensors on one device. One fused min/max reduction,
    i.e. a single host sync on CUDA."""
    present = [(name, t, limit, what) for name, t, limit, what in checks if t is not None and t.numel() > 0]
    if not present:
        return
    stats = [s for _, t, _, _ in present for s in (t.min(), t.max())]
    vals = torch.stack([s.to(torch.int64) for s in stats]).tolist()
    for i, (name, _, limit, what) in enumerate(present):
        lo, hi = vals[2 * i], vals[2 * i + 1]
        if lo < 0:
            raise IndexError(f"{name} contains {lo}, out of range [0, {limit})")
        if hi >= limit:
            raise IndexError(f"{name} contains {hi}, out of range [0, {limit}): must be < {what}")


def _validate_ranges(input_ids, position_ids, token_type_ids, indices, vocab, max_pos, type_vocab) -> None:
    """Every index tensor of the op in range (one host sync on CUDA), and positions for the sequence
    length when they are implicit. (indices are checked even when input_ids is empty: any index
    into no tokens is out of range, and the kernel would read ids[indices[t]] past the end.)"""
    check_index_ranges(
        (
            ("input_ids", input_ids, vocab, "the word vocabulary size (word_embeddings.shape[0])"),
            ("position_ids", position_ids, max_pos, "the number of positions (position_embeddings.shape[0])"),
            (
                "token_type_ids",
                token_type_ids,
                type_vocab,
                "the token type vocabulary size (token_type_embeddings.shape[0])",
            ),
            ("indices", indices, input_ids.numel(), "input_ids.numel()"),
        )
    )
    if position_ids is None and input_ids.numel() > 0 and input_ids.shape[-1] > max_pos:
        raise IndexError(
            f"sequence length {input_ids.shape[-1]} needs position ids up to "
            f"{input_ids.shape[-1] - 1}, out of range [0, {max_pos}) "
            f"(position_embeddings.shape[0] = {max_pos})"
        )


def embedding_layer_norm(
    input_ids: Tensor,
    position_ids: Optional[Tensor],
    token_type_ids: Optional[Tensor],
    word_embeddings: Tensor,
    position_embeddings: Tensor,
    token_type_embeddings: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float = 1e-12,
    dropout_p: float = 0.0,
    padding_idx: Optional[int] = None,
    indices: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    *,
    validate: bool = True,
    position_padding_idx: Optional[int] = None,
    token_type_padding_idx: Optional[int] = None,
) -> Tensor:
    """LayerNorm(word[ids] + position[pos] + token_type[tt]) * weight + bias, then dropout.

    Args:
        input_ids: int32/int64 ids of any shape [..., S].
        position_ids: same shape as input_ids (or broadcastable to it, e.g. [1, S]); None -> 0..S-1
            along the last dimension.
        token_type_ids: same shape (or broadcastable); None -> 0.
        word_embeddings [V, H], position_embeddings [P, H], token_type_embeddings [TT, H], weight [H],
            bias [H]: one float dtype (fp32/fp16/bf16; float64 too on the CPU), one device.
        eps: LayerNorm epsilon. dropout_p: dropout on the output (in [0, 1)).
        padding_idx: the word row that gets no gradient (as nn.Embedding), negative counts from the end.
        position_padding_idx, token_type_padding_idx: the same for the position and the token-type
            table. RoBERTa / XLM-R build position_embeddings with padding_idx=pad_token_id and give
            pads that position, so transformers leaves that row's gradient zero: pass the tables'
            own ``nn.Embedding.padding_idx`` (None for none) to get transformers' gradients.
        indices: int64 [T] into the flattened ids: keep only those tokens (unpadding fused into the
            gather); the output is then [T, H], else input_ids.shape + (H,).
        generator: CPU torch.Generator the dropout seed is drawn from (default: torch's global one).
        validate: check index ranges before launching (one device sync on CUDA). With False, out of
            range ids are undefined behaviour.

    Returns the output in the tables' dtype. Statistics are fp32; gradients flow to the tables,
    weight and bias (those that require grad).
    """
    # ---- types and shapes
    _check_index_tensor("input_ids", input_ids)
    if input_ids.dim() == 0:
        raise ValueError("input_ids must have at least one dimension, got a 0-d tensor")
    names = ("word_embeddings", "position_embeddings", "token_type_embeddings")
    tables = (word_embeddings, position_embeddings, token_type_embeddings)
    for name, t in zip(names, tables):
        _dispatch.check_tensor(name, t, ndim=2)
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        _dispatch.check_tensor(name, t, ndim=1)
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
    _dispatch.check_same_dtype(
        word_embeddings=word_embeddings,
        position_embeddings=position_embeddings,
        token_type_embeddings=token_type_embeddings,
        weight=weight,
        bias=bias,
    )
    dtype = word_embeddings.dtype
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"word_embeddings must have dtype float32, float16, bfloat16 or float64, got {dtype}")
    hidden = word_embeddings.shape[1]
    for name, t in zip(names[1:], tables[1:]):
        if t.shape[1] != hidden:
            raise ValueError(f"{name} has hidden size {t.shape[1]}, word_embeddings has {hidden}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape[0] != hidden:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({hidden},) (the hidden size)")
    if hidden == 0:
        raise ValueError("hidden size must be > 0, got 0")
    for name, t in zip(names, tables):
        if t.shape[0] == 0:
            raise ValueError(f"{name} has no rows (shape {tuple(t.shape)})")
    if indices is not None:
        _check_index_tensor("indices", indices)
        if indices.dim() != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    _dispatch.check_same_device(
        input_ids=input_ids,
        position_ids=position_ids,
        token_type_ids=token_type_ids,
        indices=indices,
        word_embeddings=word_embeddings,
        position_embeddings=position_embeddings,
        token_type_embeddings=token_type_embeddings,
        weight=weight,
        bias=bias,
    )
    dropout_p = _dispatch.check_dropout_p(dropout_p)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0.0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    vocab = word_embeddings.shape[0]
    padding_idx = _check_padding_idx("padding_idx", padding_idx, vocab, "the word vocabulary")
    position_padding_idx = _check_padding_idx(
        "position_padding_idx", position_padding_idx, position_embeddings.shape[0], "the position table's rows"
    )
    token_type_padding_idx = _check_padding_idx(
        "token_type_padding_idx", token_type_padding_idx, token_type_embeddings.shape[0], "the token type vocabulary"
    )
    shape = tuple(input_ids.shape)
    position_ids = _broadcast_ids("position_ids", position_ids, shape)
    token_type_ids = _broadcast_ids("token_type_ids", token_type_ids, shape)
    input_ids = input_ids.contiguous()
    if indices is not None:
        indices = indices.to(torch.int64).contiguous()
    seed = _dispatch.draw_seed(dropout_p, generator)
    if _backend(word_embeddings) == "reference":
        if validate and not torch.compiler.is_compiling() and _dispatch.host_checks_allowed(input_ids):
            _validate_ranges(
                input_ids,
                position_ids,
                token_type_ids,
                indices,
                vocab,
                position_embeddings.shape[0],
                token_type_embeddings.shape[0],
            )
        rows = _out_rows(input_ids, indices)
        out_shape = (rows, hidden) if indices is not None else shape + (hidden,)
        mask = _dispatch.reference_dropout_mask(out_shape, dropout_p, seed, word_embeddings.device)
        return reference.embedding_layer_norm(
            input_ids,
            position_ids,
            token_type_ids,
            word_embeddings,
            position_embeddings,
            token_type_embeddings,
            weight,
            bias,
            eps,
            dropout_p,
            padding_idx,
            indices,
            mask,
            position_padding_idx=position_padding_idx,
            token_type_padding_idx=token_type_padding_idx,
        )
    if (
        dropout_p == 0.0
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled(word_embeddings.device.type)
        and _backend(word_embeddings) == "torch"
    ):
        # No gradient, nothing to trace, no dropout: the custom op's plumbing (~50 us at 128 tokens,
        # ~0.4 ms at 1024 measured) buys nothing; the same torch implementation runs directly.
        if validate and _dispatch.host_checks_allowed(input_ids):
            _validate_ranges(
                input_ids,
                position_ids,
                token_type_ids,
                indices,
                vocab,
                position_embeddings.shape[0],
                token_type_embeddings.shape[0],
            )
        return torch_impl.embedding_fwd(
            input_ids,
            position_ids,
            token_type_ids,
            indices,
            word_embeddings,
            position_embeddings,
            token_type_embeddings,
            weight,
            bias,
            float(eps),
            0.0,
            None,
        )[0]
    out, _, _ = torch.ops.bert_fast.embedding_layer_norm_fwd(
        input_ids,
        position_ids,
        token_type_ids,
        indices,
        word_embeddings.contiguous(),
        position_embeddings.contiguous(),
        token_type_embeddings.contiguous(),
        weight.contiguous(),
        bias.contiguous(),
        float(eps),
        dropout_p,
        seed,
        -1 if padding_idx is None else padding_idx,
        validate,
        -1 if position_padding_idx is None else position_padding_idx,
        -1 if token_type_padding_idx is None else token_type_padding_idx,
    )
    return out


def embedding_dropout_mask(rows: int, hidden: int, dropout_p: float, seed: Optional[Tensor], device="cpu") -> Tensor:
    """The bool dropout keep-mask [rows, hidden] the embedding kernels apply for ``seed`` (the same
    bits on the CPU twin and on CUDA): for tests and the doctor, which compare against it."""
    device = torch.device(device)
    out = torch.empty((rows, hidden), dtype=torch.uint8, device=device)
    if rows == 0 or hidden == 0:
        return out.bool()
    p = dropout_p if seed is not None else 0.0
    s = _dispatch.seed_value(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            _ext.dropout_mask_cuda(_ptr(out), rows, hidden, s, float(p), _stream(device))
        return out.bool()
    return keep_mask((rows, hidden), p, s)  # the same stream, drawn on the host
