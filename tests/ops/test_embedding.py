"""bert_fast.ops.embedding_layer_norm: the fused embedding sum + LayerNorm + dropout op.

Runs on the CPU (the C++ twin of the CUDA kernel) and on CUDA (the kernel), same file, in fp32, fp16 and
bf16 on both (the twin has its own bf16 conversions, forward and backward). Accuracy is the 2x rule
of DESIGN.md against a float64 reference, forward and every gradient.
"""

import numpy as np
import pytest
import torch

from bert_fast import reference
from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import embedding as embedding_cases
from bert_fast.ops import _dispatch, embedding_layer_norm
from bert_fast.ops import embedding as emb
from bert_fast.testing import assert_close_2x, dtypes_for, philox4x32_10

# every test launches one of these kernels (tests/conftest.py counts them) unless marked no_kernels
pytestmark = pytest.mark.kernels("embedding")
VOCAB, MAX_POS, TYPES = 97, 160, 2
NAMES = ("word", "position", "token_type", "weight", "bias")


def make_params(device, dtype, hidden, vocab=VOCAB, max_pos=MAX_POS, types=TYPES, requires_grad=True):
    """The op's float inputs (embedding_cases.sample_inputs) in its order, seeded by ``hidden``."""
    randn = seeded_randn(hidden, device, dtype)
    params = embedding_cases.sample_inputs(hidden, vocab, randn, max_pos=max_pos, types=types).values()
    return [p.requires_grad_(requires_grad) for p in params]


def make_ids(device, batch, seq, id_dtype=torch.int64, vocab=VOCAB, types=TYPES, seed=0):
    """(word ids, token-type ids) of embedding_cases.sample_ids, seeded."""
    g = torch.Generator().manual_seed(seed)
    ids, tt = embedding_cases.sample_ids(batch, seq, vocab, device, g, types=types)
    return ids.to(id_dtype), tt.to(id_dtype)


def ragged_indices(device, batch, seq):
    """Indices of the real tokens of a padded batch: lengths seq, seq//2+1, ..., and one empty row."""
    lengths = [max(1, seq - (seq * i) // max(1, batch - 1)) for i in range(batch - 1)] + [0]
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    return mask.reshape(-1).nonzero().reshape(-1).to(device)


def run_all(
    ids, pos, tt, params, indices=None, padding_idx=None, dropout_mask=None, dropout_p=0.0, seed=None, dy_seed=0
):
    """(ours, oracle, torch same dtype): each a tuple (output, 5 gradients)."""

    def grads(fn, ps):
        out = fn(ps)
        dy = seeded_randn(dy_seed, out.device, out.dtype)(*out.shape)
        return (out,) + torch.autograd.grad(out, ps, dy)

    def ours(ps):
        if seed is None:
            return embedding_layer_norm(ids, pos, tt, *ps, padding_idx=padding_idx, indices=indices)
        return torch.ops.bert_fast.embedding_layer_norm_fwd(
            ids.contiguous(), pos, tt, indices, *ps, 1e-12, dropout_p, seed, -1 if padding_idx is None else padding_idx
        )[0]

    def ref(ps):
        return reference.embedding_layer_norm(
            ids, pos, tt, *ps, padding_idx=padding_idx, indices=indices, dropout_p=dropout_p, dropout_mask=dropout_mask
        )

    p64 = [p.detach().double().requires_grad_() for p in params]
    return grads(ours, params), grads(ref, p64), grads(ref, params)


def check_all(ours, oracle, same):
    for i, name in enumerate(("output",) + NAMES):
        assert_close_2x(ours[i], oracle[i], same[i], name=name)


def assert_kernel_ran(launches, dtype):
    """The forward and the backward ran our kernel (the C++ twin on the CPU, CUDA on the GPU) for
    ``dtype`` since ``launches`` was last reset, not the torch implementation."""
    names = launches.names("embedding")
    for part in ("fwd", "bwd"):
        assert any(n.startswith(f"embedding_{part}_") for n in names), (
            f"{dtype}: the embedding {part} did not run the kernel (extension calls: {dict(names)})"
        )


# ----------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("hidden", [312, 384, 1000, 768])
@pytest.mark.parametrize("seq", [1, 7, 17, 129])
@pytest.mark.parametrize("unpad", [False, True])
def test_forward_backward_2x(device, hidden, seq, unpad, kernel_launches):
    batch = 3
    ids, tt = make_ids(device, batch, seq, seed=seq)
    indices = ragged_indices(device, batch, seq) if unpad else None
    for dtype in dtypes_for(device, uses_dot=False):
        kernel_launches.reset()
        params = make_params(device, dtype, hidden)
        check_all(*run_all(ids, None, tt, params, indices=indices))
        assert_kernel_ran(kernel_launches, dtype)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("unpad", [False, True])
def test_int32_int64_ids_explicit_positions(device, id_dtype, unpad):
    batch, seq, hidden = 4, 17, 384
    ids, tt = make_ids(device, batch, seq, id_dtype)
    pos = torch.randint(0, MAX_POS, (batch, seq)).to(device=device, dtype=id_dtype)
    indices = ragged_indices(device, batch, seq) if unpad else None
    if unpad:
        indices = indices.to(id_dtype)  # int32 indices are accepted too
    for dtype in dtypes_for(device, uses_dot=False):
        params = make_params(device, dtype, hidden)
        check_all(*run_all(ids, pos, tt, params, indices=indices))
    # int32 and int64 ids give identical results
    params = make_params(device, torch.float32, hidden, requires_grad=False)
    a = embedding_layer_norm(ids.int(), pos.int(), tt.int(), *params, indices=indices)
    b = embedding_layer_norm(ids.long(), pos.long(), tt.long(), *params, indices=indices)
    assert torch.equal(a, b)


def test_broadcast_positions_noncontiguous_ids_defaults(device):
    hidden = 312
    params = make_params(device, torch.float32, hidden, requires_grad=False)
    big, _ = make_ids(device, 3, 40)
    ids = big[:, ::2]  # non-contiguous
    assert not ids.is_contiguous()
    pos = torch.arange(20, device=device)[None]  # [1, S] as Hugging Face passes it
    out = embedding_layer_norm(ids, pos, None, *params)
    ref = reference.embedding_layer_norm(ids, None, None, *[p.double() for p in params])
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    assert out.shape == (3, 20, hidden)
    # 1-D and 3-D ids: positions along the last dimension
    ids3 = ids.reshape(3, 4, 5)
    out3 = embedding_layer_norm(ids3, None, None, *params)
    ref3 = reference.embedding_layer_norm(ids3, None, None, *[p.double() for p in params])
    torch.testing.assert_close(out3.double(), ref3, atol=1e-4, rtol=1e-4)


def test_padding_idx_gets_no_gradient(device):
    hidden = 384
    ids, tt = make_ids(device, 3, 17)
    ids[:, -4:] = 5
    for dtype in dtypes_for(device, uses_dot=False):
        params = make_params(device, dtype, hidden)
        ours, oracle, same = run_all(ids, None, tt, params, padding_idx=5)
        check_all(ours, oracle, same)
        assert torch.count_nonzero(ours[1][5]) == 0
        assert torch.count_nonzero(ours[1][ids[0, 0]]) > 0
    # negative padding_idx counts from the end, as nn.Embedding
    ids[:, 0] = VOCAB - 1
    params = make_params(device, torch.float32, hidden)
    out = embedding_layer_norm(ids, None, tt, *params, padding_idx=-1)
    (gw,) = torch.autograd.grad(out.sum(), params[0])
    assert torch.count_nonzero(gw[VOCAB - 1]) == 0


def test_only_requested_gradients(device):
    hidden = 312
    ids, tt = make_ids(device, 2, 7)
    params = make_params(device, torch.float32, hidden, requires_grad=False)
    params[1].requires_grad_(True)  # only the position table
    out = embedding_layer_norm(ids, None, tt, *params)
    out.sum().backward()
    assert params[1].grad is not None and params[1].grad.shape == params[1].shape
    assert all(p.grad is None for i, p in enumerate(params) if i != 1)


def test_deterministic_mode_bitwise(device):
    hidden = 768
    ids, tt = make_ids(device, 8, 129)
    indices = ragged_indices(device, 8, 129)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    params = make_params(device, dtype, hidden)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            out = embedding_layer_norm(ids, None, tt, *params, indices=indices, padding_idx=3)
            runs.append(torch.autograd.grad(out, params, torch.ones_like(out)))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        # and it still matches the reference
        check_all(*run_all(ids, None, tt, params, indices=indices, padding_idx=3))
    finally:
        torch.use_deterministic_algorithms(prev)


# ----------------------------------------------------------------------------- dropout
def numpy_keep_mask(rows, hidden, p, seed):
    """The embedding's dropout stream, re-derived in numpy from its definition (csrc/embedding_common.h):
    element j of output row t is kept iff word j % 4 of Philox4x32-10 at counter
    (j // 4, 0, lo32(t), hi32(t)) under the 64-bit key ``seed`` is >= round(p * 2^32)."""
    t = np.arange(rows, dtype=np.uint64)[:, None]
    j = np.arange(hidden, dtype=np.uint64)[None, :]
    c0, c2 = np.broadcast_arrays(j // np.uint64(4), t & np.uint64(0xFFFFFFFF))
    c3 = np.broadcast_to(t >> np.uint64(32), c0.shape)
    words = philox4x32_10(c0, np.zeros_like(c0), c2, c3, seed)
    word = np.choose(np.broadcast_to((j % np.uint64(4)).astype(np.int64), c0.shape), words)
    threshold = min(int(p * 4294967296.0 + 0.5), 1 << 32) if p > 0 else 0
    return torch.from_numpy(word.astype(np.int64) >= threshold)


def drawn_seed(generator=None) -> int:
    """The seed the op draws from torch's generator (the contract of _dispatch.draw_seed)."""
    return int(_dispatch.draw_seed(0.5, generator).reshape(-1)[0].item())


@pytest.mark.parametrize("p", [0.25, 0.7])
def test_dropout_mask_matches_numpy_philox(device, p):
    """The kernel's debug mask is the numpy Philox stream bit for bit (a seed above 2^32, so the
    high key word matters; a hidden size that is not a multiple of 4). test_dropout_seeds holds the
    forward's applied mask to the same oracle."""
    rows, hidden, seed = 37, 45, 0x299F31D0A4093822
    want = numpy_keep_mask(rows, hidden, p, seed)
    got = emb.embedding_dropout_mask(rows, hidden, p, torch.tensor([seed], dtype=torch.int64), device)
    assert torch.equal(got.cpu(), want)


def test_dropout_seeds(device):
    """Same seed, same output (bitwise); and each output is its seed's: the seed torch's generator
    (global or given) drew, its Philox mask (numpy oracle) applied to the reference (2x rule), the
    dropped elements exactly zero."""
    hidden, p = 384, 0.25
    ids, tt = make_ids(device, 4, 17)
    params = make_params(device, torch.float32, hidden, requires_grad=False)

    def run(seed):
        return embedding_layer_norm(ids, None, tt, *params, dropout_p=p, generator=torch.Generator().manual_seed(seed))

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.manual_seed(7)
    d = embedding_layer_norm(ids, None, tt, *params, dropout_p=p)
    torch.manual_seed(7)
    e = embedding_layer_norm(ids, None, tt, *params, dropout_p=p)
    assert torch.equal(d, e)
    torch.manual_seed(7)
    seeds = {
        "generator seeded 1": (a, drawn_seed(torch.Generator().manual_seed(1))),
        "generator seeded 2": (c, drawn_seed(torch.Generator().manual_seed(2))),
        "torch.manual_seed(7)": (d, drawn_seed()),
    }
    p64 = [t.double() for t in params]
    for what, (got, seed) in seeds.items():
        mask = numpy_keep_mask(4 * 17, hidden, p, seed).reshape(4, 17, hidden).to(device)
        want = reference.embedding_layer_norm(ids, None, tt, *p64, dropout_p=p, dropout_mask=mask)
        same = reference.embedding_layer_norm(ids, None, tt, *params, dropout_p=p, dropout_mask=mask)
        assert torch.equal(got == 0, ~mask), f"{what}: the zeros are not the Philox mask of seed {seed}"
        assert_close_2x(got, want, same, name=f"output ({what})")


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_fraction(device, p):
    rows, hidden = 200, 1000
    seed = torch.tensor([123456789123], dtype=torch.int64)
    keep = emb.embedding_dropout_mask(rows, hidden, p, seed, device)
    n = keep.numel()
    kept = keep.sum().item()
    sd = (n * p * (1 - p)) ** 0.5
    assert abs(kept - n * (1 - p)) < 5 * sd, (kept, n * (1 - p), sd)
    # no visible structure: each column and each row keeps about 1 - p
    col = keep.float().mean(0)
    assert (col - (1 - p)).abs().max() < 6 * (p * (1 - p) / rows) ** 0.5
    row = keep.float().mean(1)
    assert (row - (1 - p)).abs().max() < 6 * (p * (1 - p) / hidden) ** 0.5


@pytest.mark.parametrize("unpad", [False, True])
def test_dropout_mask_reused_in_backward(device, unpad, kernel_launches):
    hidden, p = 312, 0.2
    batch, seq = 3, 17
    ids, tt = make_ids(device, batch, seq)
    indices = ragged_indices(device, batch, seq) if unpad else None
    seed = torch.tensor([987654321], dtype=torch.int64)
    rows = indices.numel() if unpad else batch * seq
    keep = emb.embedding_dropout_mask(rows, hidden, p, seed, device)
    mask = keep if unpad else keep.reshape(batch, seq, hidden)
    for dtype in dtypes_for(device, uses_dot=False):
        kernel_launches.reset()
        params = make_params(device, dtype, hidden)
        ours, oracle, same = run_all(ids, None, tt, params, indices=indices, dropout_mask=mask, dropout_p=p, seed=seed)
        check_all(ours, oracle, same)
        assert torch.equal(ours[0] != 0, mask)
        assert_kernel_ran(kernel_launches, dtype)


def test_dropout_public_function_backward(device):
    # through the public function (seed drawn inside): the zeros of the output are the mask, and the
    # gradients equal the reference's with that mask
    hidden, p = 384, 0.3
    ids, tt = make_ids(device, 2, 17)
    params = make_params(device, torch.float32, hidden)
    out = embedding_layer_norm(ids, None, tt, *params, dropout_p=p, generator=torch.Generator().manual_seed(5))
    dy = torch.randn_like(out)
    g = torch.autograd.grad(out, params, dy)
    p64 = [x.detach().double().requires_grad_() for x in params]
    ref = reference.embedding_layer_norm(ids, None, tt, *p64, dropout_p=p, dropout_mask=out != 0)
    gr = torch.autograd.grad(ref, p64, dy.double())
    for a, b, name in zip(g, gr, NAMES):
        torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=2e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_twin():
    hidden, p = 1000, 0.3
    seed = torch.tensor([2**40 + 17], dtype=torch.int64)
    for rows, h in ((5, 1), (33, 7), (129, hidden)):
        assert torch.equal(
            emb.embedding_dropout_mask(rows, h, p, seed, "cuda").cpu(),
            emb.embedding_dropout_mask(rows, h, p, seed, "cpu"),
        )
    ids, tt = make_ids("cpu", 3, 17)
    indices = ragged_indices("cpu", 3, 17)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        cpu = make_params("cpu", dtype, hidden, requires_grad=False)
        gpu = [x.cuda() for x in cpu]
        args = (1e-12, p, seed, -1)
        a = torch.ops.bert_fast.embedding_layer_norm_fwd(ids, None, tt, indices, *cpu, *args)[0]
        b = torch.ops.bert_fast.embedding_layer_norm_fwd(ids.cuda(), None, tt.cuda(), indices.cuda(), *gpu, *args)[
            0
        ].cpu()
        assert torch.equal(a == 0, b == 0)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(a.float(), b.float(), atol=tol * 4, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hidden", [1000, 3000, 4100])
def test_cuda_unaligned_and_wide_rows(hidden):
    # odd hidden sizes take the scalar path, very wide rows the generic block-per-row kernels
    device = torch.device("cuda")
    ids, tt = make_ids(device, 2, 33)
    for dtype in (torch.float32, torch.bfloat16):
        params = make_params(device, dtype, hidden + 1)
        check_all(*run_all(ids, None, tt, params))
        params = make_params(device, dtype, hidden)
        check_all(*run_all(ids, None, tt, params, indices=ragged_indices(device, 2, 33)))


# ----------------------------------------------------------------------------- op checks
def test_opcheck(device):
    hidden = 40
    ids, tt = make_ids(device, 2, 5)
    indices = ragged_indices(device, 2, 5)
    params = make_params(device, torch.float32, hidden)
    seed = torch.tensor([11], dtype=torch.int64)
    fwd = torch.ops.bert_fast.embedding_layer_norm_fwd.default
    for args in (
        (ids, None, tt, None, *params, 1e-12, 0.0, None, -1),
        (ids.int(), None, None, indices, *params, 1e-5, 0.1, seed, 3),
    ):
        torch.library.opcheck(fwd, args)
    with torch.no_grad():
        out, mean, rstd = torch.ops.bert_fast.embedding_layer_norm_fwd(
            ids, None, tt, None, *params, 1e-12, 0.1, seed, 2
        )
    bwd = torch.ops.bert_fast.embedding_layer_norm_bwd.default
    dy = torch.randn_like(out)
    weights = [p.detach() for p in params[:4]]
    for output_mask in ([True, True, True, True, True], [False, True, False, True, False]):
        torch.library.opcheck(bwd, (dy, ids, None, tt, None, *weights, mean, rstd, 0.1, seed, 2, output_mask, False))


@pytest.fixture
def cpu_twin(monkeypatch):
    """CPU tensors take the C++ twin in every session. The dispatch picks it under TRITON_INTERPRET=1
    (read at each call), which tests/conftest.py sets only for a CPU session: on the H200 these tests
    ran the torch implementation instead ('torch' == 'cpu'; NaN where the twin gives 0). The twin is
    C++, no Triton runs, so setting the variable in a CUDA session is safe for these tests, which
    call nothing but the embedding on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert emb._backend(torch.empty(0)) == "cpu"


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("unpad", [False, True])
def test_gradcheck_float64_cpu_twin(cpu_twin, dropout_p, unpad):
    hidden = 6
    ids, tt = make_ids("cpu", 2, 4, vocab=5)
    ids[0, 1] = ids[1, 1]  # a word row used twice
    indices = ragged_indices("cpu", 2, 4) if unpad else None
    params = [p.detach().requires_grad_() for p in make_params("cpu", torch.float64, hidden, vocab=5, max_pos=6)]

    def fn(*ps):
        # (no padding_idx: its zero gradient is by design, not the derivative)
        return embedding_layer_norm(
            ids,
            None,
            tt,
            *ps,
            eps=1e-5,
            dropout_p=dropout_p,
            indices=indices,
            generator=torch.Generator().manual_seed(3),
        )

    assert emb._backend(params[0]) == "cpu"
    assert torch.autograd.gradcheck(fn, params, eps=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- bad input
def _bad_cases():
    def base(device):
        ids, tt = make_ids(device, 2, 5)
        kw = dict(input_ids=ids, position_ids=None, token_type_ids=tt)
        w, p, t, g, b = make_params(device, torch.float32, 16, requires_grad=False)
        kw.update(word_embeddings=w, position_embeddings=p, token_type_embeddings=t, weight=g, bias=b)
        return kw

    def with_(**changes):
        def f(device):
            kw = base(device)
            for k, v in changes.items():
                kw[k] = v(kw, device) if callable(v) else v
            return kw

        return f

    def ids_with(value, key="input_ids"):
        def f(kw, device):
            t = kw[key].clone() if kw.get(key) is not None else torch.zeros_like(kw["input_ids"])
            t[1, 2] = value
            return t

        return f

    return [
        ("word id too big", with_(input_ids=ids_with(VOCAB)), IndexError, str(VOCAB)),
        ("negative word id", with_(input_ids=ids_with(-3)), IndexError, "-3"),
        ("position too big", with_(position_ids=ids_with(MAX_POS + 4, "position_ids")), IndexError, str(MAX_POS + 4)),
        (
            "sequence longer than positions",
            with_(input_ids=lambda kw, d: torch.zeros(1, MAX_POS + 1, dtype=torch.long, device=d), token_type_ids=None),
            IndexError,
            str(MAX_POS),
        ),
        ("token type too big", with_(token_type_ids=ids_with(TYPES)), IndexError, str(TYPES)),
        ("indices out of range", with_(indices=lambda kw, d: torch.tensor([0, 10], device=d)), IndexError, "10"),
        ("negative index", with_(indices=lambda kw, d: torch.tensor([-1, 2], device=d)), IndexError, "-1"),
        (
            "indices into empty ids",
            with_(
                input_ids=lambda kw, d: torch.zeros(0, 5, dtype=torch.long, device=d),
                token_type_ids=None,
                indices=lambda kw, d: torch.tensor([0], device=d),
            ),
            IndexError,
            "out of range [0, 0)",
        ),
        (
            "position shape",
            with_(position_ids=lambda kw, d: torch.zeros(2, 4, dtype=torch.long, device=d)),
            ValueError,
            "(2, 4)",
        ),
        (
            "type shape",
            with_(token_type_ids=lambda kw, d: torch.zeros(3, 5, dtype=torch.long, device=d)),
            ValueError,
            "(3, 5)",
        ),
        (
            "2-D indices",
            with_(indices=lambda kw, d: torch.zeros(2, 2, dtype=torch.long, device=d)),
            ValueError,
            "(2, 2)",
        ),
        ("float ids", with_(input_ids=lambda kw, d: kw["input_ids"].float()), TypeError, "torch.float32"),
        (
            "float token types",
            with_(token_type_ids=lambda kw, d: kw["token_type_ids"].double()),
            TypeError,
            "torch.float64",
        ),
        ("int table", with_(word_embeddings=lambda kw, d: kw["word_embeddings"].long()), TypeError, "torch.int64"),
        (
            "mixed table dtypes",
            with_(position_embeddings=lambda kw, d: kw["position_embeddings"].half()),
            TypeError,
            "torch.float16",
        ),
        ("gamma hidden", with_(weight=lambda kw, d: torch.ones(15, device=d)), ValueError, "(15,)"),
        ("beta hidden", with_(bias=lambda kw, d: torch.ones(17, device=d)), ValueError, "(17,)"),
        ("table hidden", with_(token_type_embeddings=lambda kw, d: torch.ones(2, 12, device=d)), ValueError, "12"),
        ("1-D table", with_(word_embeddings=lambda kw, d: torch.ones(16, device=d)), ValueError, "(16,)"),
        ("device mismatch", with_(weight=lambda kw, d: torch.ones(16, device="meta")), ValueError, "meta"),
        ("padding_idx too big", with_(padding_idx=VOCAB), ValueError, str(VOCAB)),
        ("padding_idx too small", with_(padding_idx=-VOCAB - 1), ValueError, str(-VOCAB - 1)),
        ("dropout_p 1", with_(dropout_p=1.0), ValueError, "1.0"),
    ]


@pytest.mark.no_kernels("validation raises before any launch")
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises(device, case):
    _, make, exc, text = case
    kw = make(device)
    with pytest.raises(exc) as info:
        embedding_layer_norm(**kw)
    assert text in str(info.value), str(info.value)


# ----------------------------------------------------------------------------- empty batches
@pytest.mark.no_kernels("empty batches return before any launch")
@pytest.mark.parametrize("shape,unpad", [((0, 5), False), ((2, 0), False), ((2, 5), True), ((0,), False)])
def test_empty_batch(device, shape, unpad):
    hidden = 24
    params = make_params(device, torch.float32, hidden)
    ids = torch.zeros(shape, dtype=torch.long, device=device)
    indices = torch.zeros(0, dtype=torch.long, device=device) if unpad else None
    out = embedding_layer_norm(ids, None, None, *params, dropout_p=0.1, indices=indices)
    assert out.shape == ((0, hidden) if unpad else shape + (hidden,))
    grads = torch.autograd.grad(out.sum(), params)
    for g, p in zip(grads, params):
        assert g.shape == p.shape and torch.count_nonzero(g) == 0


@pytest.mark.no_kernels("BERT_FAST_BACKEND=reference on purpose")
def test_reference_backend_env(device, monkeypatch):
    # BERT_FAST_BACKEND=reference routes to the pure-torch reference
    monkeypatch.setenv("BERT_FAST_BACKEND", "reference")
    params = make_params(device, torch.float32, 64)
    ids, tt = make_ids(device, 2, 7)
    assert emb._backend(params[0]) == "reference"
    out = embedding_layer_norm(ids, None, tt, *params)
    ref = reference.embedding_layer_norm(ids, None, tt, *params)
    torch.testing.assert_close(out, ref)
    assert _dispatch.reference_forced()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rounding_cpu_twin(cpu_twin, dtype):
    # gamma = 0: the output is dropout(beta) = beta * 1/(1-p) rounded once to dtype; covers the twin's
    # manual fp16/bf16 conversions (normals, subnormals, ties, overflow to inf) against torch's.
    hidden, p = 4096, 0.3
    g = torch.Generator().manual_seed(0)
    beta = (torch.randn(hidden, generator=g) * torch.logspace(-9, 4.9, hidden)).to(dtype)
    if dtype == torch.float16:
        beta[:64] = torch.arange(64, dtype=torch.float16) * 2.0**-24  # subnormals
    w, pe, t, gamma, _ = make_params("cpu", dtype, hidden, requires_grad=False)
    gamma = torch.zeros_like(gamma)
    ids = torch.zeros(1, 1, dtype=torch.long)
    seed = torch.tensor([5], dtype=torch.int64)
    out = torch.ops.bert_fast.embedding_layer_norm_fwd(
        ids, None, None, None, w, pe, t, gamma, beta, 1e-12, p, seed, -1
    )[0].reshape(-1)
    keep = emb.embedding_dropout_mask(1, hidden, p, seed).reshape(-1)
    expect = torch.where(keep, beta.float() * torch.tensor(1 / (1 - p), dtype=torch.float32), 0.0).to(dtype)
    assert torch.equal(out, expect)


# ----------------------------------------------------------------------------- GPU-only hazards
def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data pointer is one element past an allocation start (so
    not 16-byte aligned): the kernels must take their scalar path, never a misaligned vector load."""
    buf = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    v = buf[1:].view(t.shape)
    v.copy_(t.detach())
    assert v.is_contiguous() and v.data_ptr() % 16 != 0
    return v


@pytest.mark.parametrize("hidden", [384, 1000, 3000])
def test_misaligned_tables_and_grad_out(device, hidden):
    # H % VEC == 0 here, so only the alignment check keeps these off the 16-byte vector loads
    # (a misaligned vector load is a CUDA "misaligned address" error, no CPU symptom).
    ids, tt = make_ids(device, 2, 17)
    indices = ragged_indices(device, 2, 17)
    for dtype in dtypes_for(device, uses_dot=False):
        base = make_params(device, dtype, hidden, requires_grad=False)
        for which in ([0], [1], [2], [3], [4], [0, 1, 2, 3, 4]):
            params = [(_misaligned_copy(p) if i in which else p.clone()).requires_grad_() for i, p in enumerate(base)]
            ours, oracle, same = run_all(ids, None, tt, params, indices=indices)
            check_all(ours, oracle, same)
        # misaligned grad_out (the backward vector-loads dy)
        params = [p.clone().requires_grad_() for p in base]
        out = embedding_layer_norm(ids, None, tt, *params, indices=indices)
        dy = seeded_randn(1, device, dtype)(*out.shape)
        g_aligned = torch.autograd.grad(out, params, dy, retain_graph=True)
        g_mis = torch.autograd.grad(out, params, _misaligned_copy(dy))
        # The table gradients are fp32 sums (CUDA: atomicAdd, in whatever order the blocks run; the
        # vector and the scalar path also add in different orders) rounded once to dtype: two correct
        # runs may differ by one ulp of dtype, eps(dtype) relative at most. On the H200, bf16 at
        # hidden 3000 did (1 of 6000 elements, 0.0039 at 0.855), over the former rtol of 1e-3.
        rtol = max(1e-3, torch.finfo(dtype).eps)
        for a, b, name in zip(g_aligned, g_mis, NAMES):
            torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=rtol, msg=lambda m: f"{name}: {m}")


def _poison_cuda_cache() -> None:
    """Leave NaN in the caching allocator's free blocks (both pools), so that a workspace read
    before it is written, or a gradient buffer aliased with a freed workspace, shows up."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(16)]  # small pool
    junk.append(torch.full((1 << 24,), float("nan"), device="cuda"))  # large pool
    del junk


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hidden", [384, 3000])
def test_cuda_backward_workspaces_not_aliased(hidden):
    # The dgamma/dbeta partials workspace [num_partials, 2, H] must stay alive while the backward
    # runs: freed early, the caching allocator hands its block to the next allocation, here a table
    # accumulator of exactly its size (vocab = types = 2 * num_partials), which the kernel then
    # writes both as partials and as gradient.
    device = torch.device("cuda")
    batch, seq = 2, 4
    nparts = emb._num_partials(batch * seq, device)
    vocab = types = 2 * nparts
    ids, tt = make_ids(device, batch, seq, vocab=vocab, types=types)
    for dtype in (torch.float32, torch.bfloat16):
        params = make_params(device, dtype, hidden, vocab=vocab, types=types)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        check_all(*run_all(ids, None, tt, params))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("hidden", [3000, 3001])
def test_cuda_generic_backward_poisoned_workspace(hidden, deterministic):
    # Wide rows take the block-per-row backward, whose per-block dgamma/dbeta partials live in an
    # uninitialised (torch.empty) workspace that the kernel zeroes itself; H % 256 != 0 so a zeroing
    # by the wrong thread would race with the first row's updates.
    device = torch.device("cuda")
    ids, tt = make_ids(device, 2, 33)
    indices = ragged_indices(device, 2, 33)
    prev = torch.are_deterministic_algorithms_enabled()
    for dtype in (torch.float32, torch.bfloat16):
        params = make_params(device, dtype, hidden)
        out = embedding_layer_norm(ids, None, tt, *params, indices=indices, padding_idx=3)
        dy = seeded_randn(2, device, dtype)(*out.shape)
        _poison_cuda_cache()
        torch.use_deterministic_algorithms(deterministic)
        try:
            ours = torch.autograd.grad(out, params, dy)
        finally:
            torch.use_deterministic_algorithms(prev)
        p64 = [p.detach().double().requires_grad_() for p in params]
        ref = reference.embedding_layer_norm(ids, None, tt, *p64, indices=indices, padding_idx=3)
        oracle = torch.autograd.grad(ref, p64, dy.double())
        ref_same = reference.embedding_layer_norm(ids, None, tt, *params, indices=indices, padding_idx=3)
        same = torch.autograd.grad(ref_same, params, dy)
        for a, o, s, name in zip(ours, oracle, same, NAMES):
            assert_close_2x(a, o, s, name=name)
