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

from typing import List, NamedTuple, Optional, Sequence, Tuple

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


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _num_partials(rows: int, device: torch.device) -> int:
    """Blocks of the CUDA backward = rows of the dgamma/dbeta partials workspace. Depends only on
    (rows, device), so the reduction order, and the result, is reproducible."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-rows // _WARPS_PER_BLOCK), 4 * sms))


# ----------------------------------------------------------------------------- one call's records
# Built once per call and handed to the kernel launch, the torch implementation and the first-use
# check, in place of the ops' 16-18 arguments spelled again at each of them.
class _Gather(NamedTuple):
    """What every output row gathers from, in the ops' (and torch_impl's) argument order, so that
    ``*g`` passes it on: ids, positions and types contiguous and of one shape (positions / types
    may be None: 0..S-1 along the last dimension / 0), indices contiguous int64 or None, tables."""

    input_ids: Tensor
    position_ids: Optional[Tensor]
    token_type_ids: Optional[Tensor]
    indices: Optional[Tensor]
    word: Tensor
    pos: Tensor
    typ: Tensor

    @property
    def rows(self) -> int:
        return self.indices.shape[0] if self.indices is not None else self.input_ids.numel()

    @property
    def hidden(self) -> int:
        return self.word.shape[1]

    @property
    def out_shape(self) -> tuple:
        """[T, H] with indices, else input_ids.shape + (H,)."""
        if self.indices is not None:
            return (self.rows, self.hidden)
        return tuple(self.input_ids.shape) + (self.hidden,)

    def params(self, dropout_p: float, seed: Optional[Tensor]) -> dict:
        """The kernels' parameters common to forward and backward (pointers, sizes, dropout)."""
        ids = self.input_ids
        return {
            "ids": _ptr(ids),
            "pos": _ptr(self.position_ids),
            "tt": _ptr(self.token_type_ids),
            "ids_i64": _is64(ids),
            "pos_i64": _is64(self.position_ids),
            "tt_i64": _is64(self.token_type_ids),
            "indices": _ptr(self.indices),
            "rows": int(self.rows),
            "seq_len": int(ids.shape[-1]) if ids.dim() > 0 and ids.shape[-1] > 0 else 1,
            "hidden": int(self.hidden),
            "word": _ptr(self.word),
            "posemb": _ptr(self.pos),
            "typeemb": _ptr(self.typ),
            "dtype": _DTYPE_CODES[self.word.dtype],
            "dropout_p": float(dropout_p) if seed is not None else 0.0,
            "seed": _dispatch.seed_value(seed),
        }

    def spec(self, dropout_p: float) -> tuple:
        """What the kernels are instantiated for: dtype, hidden size (vectors per lane), the index
        dtypes and which of positions / types / indices are given, dropout, the row bucket. The
        backward adds deterministic mode and which gradients it computes."""
        dt = lambda t: None if t is None else str(t.dtype).replace("torch.", "")
        return (
            self.word.dtype,
            self.hidden,
            dt(self.input_ids),
            dt(self.position_ids),
            dt(self.token_type_ids),
            self.indices is not None,
            dropout_p > 0.0,
            _verify.bucket(self.rows),
        )

    def kernel_mask(self, dropout_p: float, seed: Optional[Tensor]):
        """The kernel's keep-mask, for the first-use check (None without dropout)."""
        if seed is None or dropout_p == 0.0:
            return None
        return lambda: embedding_dropout_mask(self.rows, self.hidden, dropout_p, seed, self.word.device)

    def row_ids(self) -> Tuple[Tensor, Tensor, Tensor]:
        """int64 word/position/type ids of each output row (the kernel's own gather, in torch)."""
        flat = self.input_ids.reshape(-1).long()
        src = self.indices if self.indices is not None else torch.arange(flat.numel(), device=flat.device)
        ids = flat[src]
        if self.position_ids is not None:
            pos = self.position_ids.reshape(-1).long()[src]
        else:
            pos = src % max(1, self.input_ids.shape[-1])
        tt = self.token_type_ids.reshape(-1).long()[src] if self.token_type_ids is not None else torch.zeros_like(ids)
        return ids, pos, tt

    def validate(self) -> None:
        """Every index tensor of the op in range (one host sync on CUDA), and positions for the
        sequence length when they are implicit. (indices are checked even when input_ids is empty:
        any index into no tokens is out of range, and the kernel would read ids[indices[t]] past
        the end.)"""
        ids, max_pos = self.input_ids, self.pos.shape[0]
        check_index_ranges(
            (
                ("input_ids", ids, self.word.shape[0], "the word vocabulary size (word_embeddings.shape[0])"),
                ("position_ids", self.position_ids, max_pos, "the number of positions (position_embeddings.shape[0])"),
                (
                    "token_type_ids",
                    self.token_type_ids,
                    self.typ.shape[0],
                    "the token type vocabulary size (token_type_embeddings.shape[0])",
                ),
                ("indices", self.indices, ids.numel(), "input_ids.numel()"),
            )
        )
        if self.position_ids is None and ids.numel() > 0 and ids.shape[-1] > max_pos:
            raise IndexError(
                f"sequence length {ids.shape[-1]} needs position ids up to "
                f"{ids.shape[-1] - 1}, out of range [0, {max_pos}) "
                f"(position_embeddings.shape[0] = {max_pos})"
            )


class _Fwd(NamedTuple):
    """One forward: what the kernel, the torch implementation and the first-use check take."""

    g: _Gather
    weight: Tensor
    bias: Tensor
    eps: float
    dropout_p: float
    seed: Optional[Tensor]

    def run_torch(self, keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """torch_impl's (out, mean, rstd); ``keep``: a kernel's keep-mask to apply (_verify)."""
        return torch_impl.embedding_fwd(*self.g, self.weight, self.bias, self.eps, self.dropout_p, self.seed, keep=keep)


class _Bwd(NamedTuple):
    """One backward: the forward's inputs and statistics, and which gradients to compute."""

    grad_out: Tensor
    g: _Gather
    weight: Tensor
    mean: Tensor
    rstd: Tensor
    dropout_p: float
    seed: Optional[Tensor]
    pads: Tuple[int, int, int]  # the (word, position, type) rows that get no gradient, -1 for none
    need: List[bool]  # which of the (word, position, type, weight, bias) gradients to compute
    deterministic: bool

    def shape(self, i: int):
        g = self.g
        return (g.word.shape, g.pos.shape, g.typ.shape, self.weight.shape, self.weight.shape)[i]

    def empty(self) -> Tensor:
        """A gradient that is not needed (None through autograd)."""
        return self.g.word.new_empty((0,))

    def zeros(self) -> tuple:
        """The five gradients of no rows: zero where needed."""
        word = self.g.word
        return tuple(
            torch.zeros(self.shape(i), dtype=word.dtype, device=word.device) if self.need[i] else self.empty()
            for i in range(5)
        )

    def accum(self, i: int) -> Optional[Tensor]:
        """Gradient ``i``'s zeroed fp32 accumulator (float64 for float64; an fp32 table's gradient
        is its own accumulator), None when not needed."""
        if not self.need[i]:
            return None
        return torch.zeros(self.shape(i), dtype=_acc_dtype(self.g.word.dtype), device=self.g.word.device)

    def cast(self, i: int, acc: Optional[Tensor]) -> Tensor:
        """Gradient ``i`` from its accumulator, in the tables' dtype."""
        return acc.to(self.g.word.dtype) if self.need[i] else self.empty()

    def run_torch(self, keep: Optional[Tensor] = None) -> tuple:
        """torch_impl's five gradients; ``keep``: the kernel forward's keep-mask to apply (_verify)."""
        pads = self.pads
        grads = torch_impl.embedding_bwd(
            self.grad_out,
            *self.g,
            self.weight,
            self.mean,
            self.rstd,
            self.dropout_p,
            self.seed,
            pads[0],
            self.need,
            keep=keep,
            position_padding_idx=pads[1],
            token_type_padding_idx=pads[2],
        )
        return tuple(x if x is not None else self.empty() for x in grads)


# ----------------------------------------------------------------------------- first-use check
def _kernel_label(word: Tensor) -> str:
    return "bert_fast._C embedding (" + ("CUDA)" if word.is_cuda else "C++ CPU twin)")


def _gathered(g: _Gather):
    """(x, |x| terms, ids, position ids, type ids): the embedding sum recomputed in fp32 (float64 for
    float64) and the sum of its terms' magnitudes, [rows, H]."""
    ids, pos, tt = g.row_ids()
    work = torch.float64 if g.word.dtype == torch.float64 else torch.float32
    parts = [table.detach().index_select(0, i).to(work) for table, i in ((g.word, ids), (g.pos, pos), (g.typ, tt))]
    return sum(parts), sum(p.abs() for p in parts), ids, pos, tt


def _fwd_checks(call: _Fwd, keep, k, t):
    # the torch implementation rounds the sum of three rows twice in the dtype (see layer_norm_checks)
    x, xmag, _, _, _ = _gathered(call.g)
    dropout_p = call.dropout_p
    scale = 1.0 / (1.0 - dropout_p) if (keep is not None and dropout_p > 0.0) else 1.0
    hidden = call.g.hidden
    flat = lambda outs: (outs[0].reshape(-1, hidden), outs[1], outs[2])
    return _verify.with_rel(
        _verify.layer_norm_checks(x, xmag, call.weight, call.bias, flat(k), flat(t), scale=scale),
        _verify.dropout_rel(call.g.word.dtype, dropout_p),
    )


def _bwd_checks(call: _Bwd, keep, k, t):
    """LayerNorm's backward magnitudes (layer_norm_bwd_magnitudes), then summed into each table row
    the way the gradient is (a table row's gradient adds the rows that gathered it; a padding row,
    ``call.pads`` (word, position, type), adds none)."""
    g, need, dropout_p = call.g, call.need, call.dropout_p
    x, xmag, ids, pos, tt = _gathered(g)
    rows, hidden = x.shape
    dy = _verify.absf(call.grad_out).reshape(rows, hidden)
    if keep is not None and dropout_p > 0.0:
        dy = dy * keep.reshape(rows, hidden).to(dy.dtype) * (1.0 / (1.0 - dropout_p))
    dh, dw_terms, ady = _verify.layer_norm_bwd_magnitudes(x, xmag, dy, call.weight, call.mean, call.rstd)
    checks = []
    for i, (name, table, index) in enumerate(
        (("dword", g.word, ids), ("dposition", g.pos, pos), ("dtoken_type", g.typ, tt))
    ):
        if need[i]:
            m = torch.zeros(table.shape, dtype=dh.dtype, device=dh.device).index_add_(0, index, dh)
            if call.pads[i] >= 0:
                m[call.pads[i]] = 0
            checks.append(_verify.Check(name, k[i], t[i], mag=2.0 * m, acc=(rows + hidden + 2) * m))
    for i, (name, terms) in ((3, ("dweight", dw_terms)), (4, ("dbias", ady))):
        if need[i]:
            m = terms.sum(dim=0)
            checks.append(_verify.Check(name, k[i], t[i], mag=m, acc=(rows + 2) * m))
    return _verify.with_rel(checks, _verify.dropout_rel(g.word.dtype, dropout_p))


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
    tables = (word_embeddings, position_embeddings, token_type_embeddings)
    g = _Gather(input_ids, position_ids, token_type_ids, indices, *tables)
    if validate and _dispatch.host_checks_allowed(input_ids):
        g.validate()
    call = _Fwd(g, weight, bias, eps, dropout_p, seed)
    if _backend(g.word) == "torch":
        return call.run_torch()
    if g.rows == 0:
        return _launch_fwd(call)
    return _checked(call, "fwd", g.spec(dropout_p), lambda: _launch_fwd(call), _fwd_checks)


def _checked(call, direction: str, spec: tuple, kernel, checks, follows: Optional[tuple] = None):
    """``kernel()``'s result, checked against the torch implementation (``call.run_torch``) the
    first time ``spec`` runs (bert_fast/ops/_verify.py); ``checks(call, keep, k, t)``: its bounds."""
    g = call.g
    return _verify.run(
        "embedding",
        direction,
        spec,
        g.word.device,
        label=_kernel_label(g.word),
        dtype=g.word.dtype,
        kernel=kernel,
        kernel_mask=g.kernel_mask(call.dropout_p, call.seed),
        fallback=call.run_torch,
        checks=lambda k, t, keep: checks(call, keep, k, t),
        follows=follows,
    )


def _launch_fwd(call: _Fwd):
    """The kernel's (out, mean, rstd): CUDA, or the C++ CPU twin on CPU tensors."""
    g, word = call.g, call.g.word
    out = torch.empty(g.out_shape, dtype=word.dtype, device=word.device)
    mean = torch.empty((g.rows,), dtype=_acc_dtype(word.dtype), device=word.device)
    rstd = torch.empty_like(mean)
    if g.rows == 0:
        return out, mean, rstd
    params = g.params(call.dropout_p, call.seed)
    params.update(
        out=_ptr(out),
        mean=_ptr(mean),
        rstd=_ptr(rstd),
        gamma=_ptr(call.weight),
        beta=_ptr(call.bias),
        eps=float(call.eps),
    )
    if word.is_cuda:  # on word's GPU: _dispatch.op_impl made it the current device
        params["stream"] = _stream(word.device)
        _ext.embedding_fwd_cuda(params)
    else:
        _ext.embedding_fwd_cpu(params)
    return out, mean, rstd


@embedding_layer_norm_fwd.register_fake
def _(*args):
    """Shapes and dtypes only: they follow from the gather (the op's first seven arguments)."""
    g = _Gather(*args[:7])
    mean = g.word.new_empty((g.rows,), dtype=_acc_dtype(g.word.dtype))
    return g.word.new_empty(g.out_shape), mean, torch.empty_like(mean)


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
    tables = (word_embeddings, position_embeddings, token_type_embeddings)
    g = _Gather(input_ids, position_ids, token_type_ids, indices, *tables)
    pads = (int(padding_idx), int(position_padding_idx), int(token_type_padding_idx))
    need = [bool(m) for m in output_mask]
    call = _Bwd(grad_out, g, weight, mean, rstd, dropout_p, seed, pads, need, deterministic)
    if g.rows == 0 or not any(need):
        return call.zeros()
    if _backend(g.word) == "torch":
        return call.run_torch()
    spec = g.spec(dropout_p)
    bwd_spec = spec + (bool(deterministic), tuple(need), _verify.aligned(grad_out))
    return _checked(call, "bwd", bwd_spec, lambda: _launch_bwd(call), _bwd_checks, follows=("fwd", spec))


def _launch_bwd(call: _Bwd):
    """The kernel's five gradients (empty where not needed): CUDA, or the C++ CPU twin."""
    g = call.g
    dy = call.grad_out.reshape(g.rows, g.hidden).contiguous()  # referenced until the launch
    params = g.params(call.dropout_p, call.seed)
    params.update(
        dy=_ptr(dy),
        gamma=_ptr(call.weight),
        mean=_ptr(call.mean),
        rstd=_ptr(call.rstd),
        padding_idx=call.pads[0],
        pos_padding_idx=call.pads[1],
        type_padding_idx=call.pads[2],
    )
    if not g.word.is_cuda:
        bufs = [call.accum(i) for i in range(5)]
        params.update(
            dword=_ptr(bufs[0]), dpos=_ptr(bufs[1]), dtype_grad=_ptr(bufs[2]), dgamma=_ptr(bufs[3]), dbeta=_ptr(bufs[4])
        )
        _ext.embedding_bwd_cpu(params)
        return tuple(call.cast(i, bufs[i]) for i in range(5))
    return _launch_bwd_cuda(call, params)


def _launch_bwd_cuda(call: _Bwd, params: dict) -> tuple:
    """The CUDA backward, on the tables' GPU (_dispatch.op_impl made it the current device)."""
    g, need = call.g, call.need
    device = g.word.device
    stream = _stream(device)
    params["stream"] = stream
    nparts = _num_partials(g.rows, device)
    params["num_partials"] = nparts
    dgb = [call.accum(3), call.accum(4)]
    # Every workspace whose pointer goes into params must stay referenced until its kernels are
    # queued: a temporary would return its block to the caching allocator at once, and the
    # next allocation below (a table accumulator) could get the same memory, which the
    # kernel then writes as both partials and gradient.
    partials = None
    if need[3] or need[4]:
        partials = torch.empty((nparts, 2, g.hidden), dtype=torch.float32, device=device)
        params["partials"] = _ptr(partials)
        params.update(dgamma=_ptr(dgb[0]), dbeta=_ptr(dgb[1]))
    tables_needed = need[0] or need[1] or need[2]
    if not call.deterministic or not tables_needed:
        bufs = [call.accum(i) for i in range(3)]
        params.update(dword=_ptr(bufs[0]), dpos=_ptr(bufs[1]), dtype_grad=_ptr(bufs[2]))
        _ext.embedding_bwd_cuda(params)
        grads = [call.cast(i, bufs[i]) for i in range(3)]
    else:
        dx = torch.empty((g.rows, g.hidden), dtype=torch.float32, device=device)
        params["dx_ws"] = _ptr(dx)
        _ext.embedding_bwd_cuda(params)
        grads = _segment_sums(call, dx, stream)
    return tuple(grads + [call.cast(3, dgb[0]), call.cast(4, dgb[1])])


def _segment_sums(call: _Bwd, dx: Tensor, stream: int) -> List[Tensor]:
    """Deterministic mode's table gradients: the kernel wrote the dx rows to the workspace ``dx``,
    and each table row sums its tokens' rows in stable-sorted order (no atomics)."""
    g = call.g
    dtype, device = g.word.dtype, g.word.device
    ids, pos_ids, tt_ids = g.row_ids()
    grads = []
    for i, (tbl, ids_i) in enumerate(((g.word, ids), (g.pos, pos_ids), (g.typ, tt_ids))):
        if not call.need[i]:
            grads.append(call.empty())
            continue
        grad = torch.zeros(tbl.shape, dtype=dtype, device=device)
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
            g.hidden,
            call.pads[i],
            _ptr(grad),
            _DTYPE_CODES[dtype],
            stream,
        )
        grads.append(grad)
    return grads


@embedding_layer_norm_bwd.register_fake
def _(grad_out, *args):
    """Shapes only: each gradient its parameter's shape where output_mask asks for it, else empty."""
    g = _Gather(*args[:7])
    weight, _mean, _rstd, _dropout_p, _seed, _padding_idx, output_mask = args[7:14]
    shapes = [g.word.shape, g.pos.shape, g.typ.shape, weight.shape, weight.shape]
    return tuple(g.word.new_empty(shapes[i] if output_mask[i] else (0,)) for i in range(5))


# ----------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    g = _Gather(*inputs[:7])
    weight, _bias, _eps, dropout_p, seed, padding_idx, _validate, position_padding_idx, token_type_padding_idx = inputs[
        7:
    ]
    _, mean, rstd = output
    ctx.save_for_backward(*g, weight, seed, mean, rstd)
    ctx.dropout_p = dropout_p
    ctx.pads = (padding_idx, position_padding_idx, token_type_padding_idx)


def _backward(ctx, grad_out, grad_mean, grad_rstd):
    *gather, weight, seed, mean, rstd = ctx.saved_tensors
    mask = list(ctx.needs_input_grad[4:9])
    grads = [None] * 16
    if not any(mask):
        return tuple(grads)
    padding_idx, position_padding_idx, token_type_padding_idx = ctx.pads
    out = torch.ops.bert_fast.embedding_layer_norm_bwd(
        grad_out,
        *gather,
        weight,
        mean,
        rstd,
        ctx.dropout_p,
        seed,
        padding_idx,
        mask,
        _dispatch.deterministic(),
        position_padding_idx,
        token_type_padding_idx,
    )
    for i in range(5):
        if mask[i]:
            grads[4 + i] = out[i]
    return tuple(grads)


embedding_layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- input checks
# One home for the checks of the public function's inputs: it runs them once, before choosing the
# implementation (reference, torch or the custom op), so every implementation sees checked inputs.
_TABLE_NAMES = ("word_embeddings", "position_embeddings", "token_type_embeddings")


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


def _check_float_tensors(tables: Sequence[Tensor], weight: Tensor, bias: Tensor) -> None:
    """The three tables, weight and bias: float tensors of one supported dtype, one hidden size."""
    named = (*zip(_TABLE_NAMES, tables), ("weight", weight), ("bias", bias))
    for name, t in named:
        _dispatch.check_tensor(name, t, ndim=2 if name in _TABLE_NAMES else 1)
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
    _dispatch.check_same_dtype(**dict(named))
    if tables[0].dtype not in _DTYPE_CODES:
        raise TypeError(f"word_embeddings must have dtype float32, float16, bfloat16 or float64, got {tables[0].dtype}")
    hidden = tables[0].shape[1]
    for name, t in zip(_TABLE_NAMES[1:], tables[1:]):
        if t.shape[1] != hidden:
            raise ValueError(f"{name} has hidden size {t.shape[1]}, word_embeddings has {hidden}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape[0] != hidden:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({hidden},) (the hidden size)")
    if hidden == 0:
        raise ValueError("hidden size must be > 0, got 0")
    for name, t in zip(_TABLE_NAMES, tables):
        if t.shape[0] == 0:
            raise ValueError(f"{name} has no rows (shape {tuple(t.shape)})")


def _check_pads(pads: Sequence[Optional[int]], tables: Sequence[Tensor]) -> Tuple[Optional[int], ...]:
    """The (word, position, type) padding rows, each None or made non-negative."""
    whats = ("the word vocabulary", "the position table's rows", "the token type vocabulary")
    names = ("padding_idx", "position_padding_idx", "token_type_padding_idx")
    return tuple([_check_padding_idx(n, p, t.shape[0], w) for n, p, t, w in zip(names, pads, tables, whats)])


def check_embedding_inputs(
    input_ids, position_ids, token_type_ids, indices, tables, weight, bias, eps, dropout_p, pads
):
    """:func:`embedding_layer_norm`'s inputs checked (TypeError / ValueError naming the argument, in
    this order) and made ready for every implementation: (_Gather, eps, dropout_p, pads) with ids
    contiguous, positions / types broadcast to the ids' shape, indices int64, the padding rows
    non-negative. ``tables``: (word, position, token type); ``pads``: their padding_idx arguments."""
    _check_index_tensor("input_ids", input_ids)
    if input_ids.dim() == 0:
        raise ValueError("input_ids must have at least one dimension, got a 0-d tensor")
    _check_float_tensors(tables, weight, bias)
    if indices is not None:
        _check_index_tensor("indices", indices)
        if indices.dim() != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    _dispatch.check_same_device(
        input_ids=input_ids,
        position_ids=position_ids,
        token_type_ids=token_type_ids,
        indices=indices,
        **dict(zip(_TABLE_NAMES, tables)),
        weight=weight,
        bias=bias,
    )
    dropout_p = _dispatch.check_dropout_p(dropout_p)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0.0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    pads = _check_pads(pads, tables)
    shape = tuple(input_ids.shape)
    position_ids = _broadcast_ids("position_ids", position_ids, shape)
    token_type_ids = _broadcast_ids("token_type_ids", token_type_ids, shape)
    if indices is not None:
        indices = indices.to(torch.int64).contiguous()
    g = _Gather(input_ids.contiguous(), position_ids, token_type_ids, indices, *tables)
    return g, float(eps), dropout_p, pads


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


# ----------------------------------------------------------------------------- public function
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
    tables = (word_embeddings, position_embeddings, token_type_embeddings)
    pads = (padding_idx, position_padding_idx, token_type_padding_idx)
    g, eps, dropout_p, pads = check_embedding_inputs(
        input_ids, position_ids, token_type_ids, indices, tables, weight, bias, eps, dropout_p, pads
    )
    call = _Fwd(g, weight, bias, eps, dropout_p, _dispatch.draw_seed(dropout_p, generator))
    impl = _backend(word_embeddings)
    if impl == "reference":
        return _reference_forward(call, pads, validate)
    if impl == "torch" and _plumbing_buys_nothing(call):
        # No gradient, nothing to trace, no dropout: the custom op's plumbing (~50 us at 128 tokens,
        # ~0.4 ms at 1024 measured) buys nothing; the same torch implementation runs directly.
        if validate and _dispatch.host_checks_allowed(g.input_ids):
            g.validate()
        return torch_impl.embedding_fwd(*g, weight, bias, eps, 0.0, None)[0]
    return _op_forward(call, pads, validate)


def _plumbing_buys_nothing(call: _Fwd) -> bool:
    """No dropout, no gradient, no tracing, no autocast: nothing the custom op would do."""
    return (
        call.dropout_p == 0.0
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled(call.g.word.device.type)
    )


def _op_forward(call: _Fwd, pads, validate: bool) -> Tensor:
    """The custom op's output (autograd, torch.compile): contiguous tables, -1 for no padding row."""
    g = call.g
    op_pads = [-1 if p is None else p for p in pads]
    tensors = [t.contiguous() for t in (*g[4:], call.weight, call.bias)]  # the tables, weight, bias
    out, _, _ = _dispatch.call_op(
        "embedding_layer_norm_fwd",
        *g[:4],
        *tensors,
        call.eps,
        call.dropout_p,
        call.seed,
        op_pads[0],
        validate,
        op_pads[1],
        op_pads[2],
    )
    return out


def _reference_forward(call: _Fwd, pads, validate: bool) -> Tensor:
    """BERT_FAST_BACKEND=reference: plain torch autograd, the dropout mask from the reference's bits."""
    g = call.g
    if validate and not torch.compiler.is_compiling() and _dispatch.host_checks_allowed(g.input_ids):
        g.validate()
    mask = _dispatch.reference_dropout_mask(g.out_shape, call.dropout_p, call.seed, g.word.device)
    return reference.embedding_layer_norm(
        g.input_ids,
        g.position_ids,
        g.token_type_ids,
        *g[4:],
        call.weight,
        call.bias,
        call.eps,
        call.dropout_p,
        pads[0],
        g.indices,
        mask,
        position_padding_idx=pads[1],
        token_type_padding_idx=pads[2],
    )


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
