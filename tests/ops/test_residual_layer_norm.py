"""residual_layer_norm: LayerNorm(dropout(x) + residual), forward and all four gradients vs a float64
oracle under the 2x rule, dropout statistics/reproducibility, checkpointing, determinism, opcheck,
gradcheck and input validation. Runs on the CPU interpreter and on CUDA."""

import math

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from bert_fast import reference
from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import residual_layer_norm as residual_layer_norm_cases
from bert_fast.ops import _dispatch, residual_layer_norm, residual_layer_norm_dropout_mask
from bert_fast.testing import (
    assert_close_2x,
    assert_reduction_close_2x,
    dtypes_for,
    philox4x32_10,
    pick_test_device,
    uint32_to_uniform_float,
)

# every test launches one of these kernels (tests/conftest.py counts them) unless marked no_kernels
pytestmark = pytest.mark.kernels("residual_layer_norm")
# bf16 too on the CPU: the kernels have no tl.dot, the interpreter runs them right in bf16
DTYPES = dtypes_for(pick_test_device(), uses_dot=False)
NAMES = ("dx", "dresidual", "dweight", "dbias")


def _inputs(m, n, dtype, device, seed=0):
    """The op's sample_inputs (weight and bias 0.5 off the identity: wider than the bench's) and a dy."""
    randn = seeded_randn(seed, device, dtype)
    x, r, w, b = residual_layer_norm_cases.sample_inputs(m, n, randn, affine_scale=0.5).values()
    return x, r, w, b, randn(m, n)


def _fwd_bwd(fn, tensors, dy, dtype=None):
    ins = [(t if dtype is None else t.to(dtype)).detach().requires_grad_(True) for t in tensors]
    y = fn(*ins)
    grads = torch.autograd.grad(y, ins, dy if dtype is None else dy.to(dtype))
    return y, grads


def _ref(dropout_p=0.0, mask=None, eps=1e-12):
    return lambda x, r, w, b: reference.residual_layer_norm(x, r, w, b, eps, dropout_p, mask)


def _check_2x(y, grads, tensors, dy, dropout_p=0.0, mask=None):
    y64, g64 = _fwd_bwd(_ref(dropout_p, mask), tensors, dy, torch.float64)
    yt, gt = _fwd_bwd(_ref(dropout_p, mask), tensors, dy)
    assert_close_2x(y, y64, yt, name="y")
    _check_grads_2x(grads, g64, gt, rows=tensors[0].numel() // max(1, tensors[0].shape[-1]))


def _check_grads_2x(grads, g64, gt, rows, ulps=None):
    """dx, dresidual: the 2x rule (floor: ``ulps`` ulps of the dtype, or the default); dweight,
    dbias (sums over ``rows`` rows): the 2x rule with bert_fast.testing.reduction_floor, the
    weight-gradient rule."""
    for name, a, o, t in zip(NAMES, grads, g64, gt):
        if name in ("dweight", "dbias"):
            assert_reduction_close_2x(a, o, t, rows, name=name)
        else:
            floor = None if ulps is None else ulps * torch.finfo(a.dtype).eps * max(1.0, o.abs().max().item())
            assert_close_2x(a, o, t, name=name, floor=floor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [312, 384, 1000, 3000])
@pytest.mark.parametrize("m", [1, 7, 129])
def test_residual_layer_norm_2x(device, m, n, dtype):
    x, r, w, b, dy = _inputs(m, n, dtype, device, seed=m * 10000 + n)
    y, grads = _fwd_bwd(residual_layer_norm, (x, r, w, b), dy)
    assert y.is_contiguous()
    _check_2x(y, grads, (x, r, w, b), dy)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_layer_norm_noncontiguous(device, dtype):
    n = 384
    randn = seeded_randn(5, device, dtype)
    x0, r0, w, b = residual_layer_norm_cases.sample_inputs(2 * 9, n + 40, randn, affine_scale=0.5).values()
    x = x0[::2, :n]  # strided rows
    r = r0[1::2, 40:]  # other row stride, column offset
    dy = randn(n, 9).t()  # transposed gradient
    w, b = w[:n], b[:n]
    assert not (x.is_contiguous() or r.is_contiguous() or dy.is_contiguous())
    y, grads = _fwd_bwd(residual_layer_norm, (x, r, w, b), dy)
    _check_2x(y, grads, (x, r, w, b), dy)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_layer_norm_leading_dims(device, dtype):
    x, r, w, b, dy = _inputs(10, 768, dtype, device, seed=6)
    x, r, dy = (t.view(2, 5, 768) for t in (x, r, dy))  # [B, S, N]
    y, grads = _fwd_bwd(lambda *t: residual_layer_norm(*t, eps=1e-5), (x, r, w, b), dy)
    assert y.shape == (2, 5, 768)
    y64, g64 = _fwd_bwd(_ref(eps=1e-5), (x, r, w, b), dy, torch.float64)
    yt, gt = _fwd_bwd(_ref(eps=1e-5), (x, r, w, b), dy)
    assert_close_2x(y, y64, yt, name="y")
    _check_grads_2x(grads, g64, gt, rows=10, ulps=8)


# ----------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", [(7, 1000), (33, 384)])
def test_dropout_exact_mask_rebuilds_reference(device, dtype, m, n):
    p = 0.2
    x, r, w, b, dy = _inputs(m, n, dtype, device, seed=7)
    torch.manual_seed(123)
    ins = [t.detach().requires_grad_(True) for t in (x, r, w, b)]
    y, mask = residual_layer_norm(*ins, dropout_p=p, return_dropout_mask=True)
    grads = torch.autograd.grad(y, ins, dy)
    assert mask.dtype == torch.bool and mask.shape == x.shape
    assert 0 < mask.sum() < mask.numel()
    _check_2x(y, grads, (x, r, w, b), dy, dropout_p=p, mask=mask)
    # dropped positions of x get exactly zero gradient
    assert torch.all(grads[0][~mask] == 0)


def test_dropout_keep_fraction_binomial(device):
    m, n, p = 64, 1000, 0.1
    for s in (11, 12):
        torch.manual_seed(s)
        x, r, w, b, _ = _inputs(m, n, torch.float32, device)
        _, mask = residual_layer_norm(x, r, w, b, dropout_p=p, return_dropout_mask=True)
        count, total = mask.sum().item(), mask.numel()
        sigma = math.sqrt(total * p * (1 - p))
        assert abs(count - total * (1 - p)) <= 5 * sigma, (count, total)
        # no structure: each row and each column keeps about 1 - p of its entries
        assert abs(mask.float().mean(0).mean().item() - (1 - p)) < 0.01
        assert mask.float().mean(1).min().item() > 1 - p - 6 * math.sqrt(p * (1 - p) / n)


def _drawn_seed(generator=None) -> int:
    """The seed the op draws from torch's generator for dropout (the contract of
    _dispatch.draw_seed), read as a plain int here, independently of the op's own plumbing."""
    return int(_dispatch.draw_seed(0.5, generator).reshape(-1)[0].item())


def test_dropout_applied_mask_is_the_philox_mask_of_the_drawn_seed(device):
    """The mask the op applied, read off its result (dx is zero exactly where x was dropped, and
    the random dresidual is nonzero everywhere), is the numpy Philox mask (the oracle) of the seed
    torch's generator gave, forward and backward; the debug mask of that seed is the same; and y and
    every gradient follow the reference fed that mask (2x rule)."""
    m, n, p = 5, 312, 0.3
    x, r, w, b, dy = _inputs(m, n, torch.float32, device, seed=8)
    torch.manual_seed(5)
    ins = [t.detach().requires_grad_(True) for t in (x, r, w, b)]
    y = residual_layer_norm(*ins, dropout_p=p)
    grads = torch.autograd.grad(y, ins, dy)
    torch.manual_seed(5)
    seed = _drawn_seed()
    want = torch.from_numpy(_numpy_keep_mask(m, n, p, seed)).to(device)
    assert torch.all(grads[1] != 0)
    assert torch.equal(grads[0] != 0, want), "the backward's mask is not the Philox mask of the drawn seed"
    seed_t = torch.tensor([seed], dtype=torch.int64)
    assert torch.equal(residual_layer_norm_dropout_mask(x.shape, p, seed_t, device), want)
    _check_2x(y, grads, (x, r, w, b), dy, dropout_p=p, mask=want)  # the forward's mask too


@pytest.mark.no_kernels("seed drawing, host side")
def test_dropout_seeds_stay_on_the_cpu_under_another_default_device():
    """Seeds live on the CPU whatever torch's default device is (with a CUDA default they would
    cost a host sync per dropout op): drawn from the CPU generator, and the reference mask too."""
    with torch.device("meta"):
        torch.manual_seed(3)
        seed = _dispatch.draw_seed(0.1)
        mask = _dispatch.reference_dropout_mask((4, 8), 0.1, seed, "cpu")
    assert seed.device.type == "cpu" and mask.device.type == "cpu"
    torch.manual_seed(3)
    assert torch.equal(seed, _dispatch.draw_seed(0.1))


def test_dropout_seed_reproducibility(device):
    x, r, w, b, _ = _inputs(9, 384, torch.float32, device, seed=9)
    torch.manual_seed(0)
    y1 = residual_layer_norm(x, r, w, b, dropout_p=0.1)
    torch.manual_seed(0)
    y2 = residual_layer_norm(x, r, w, b, dropout_p=0.1)
    torch.manual_seed(1)
    y3 = residual_layer_norm(x, r, w, b, dropout_p=0.1)
    y4 = residual_layer_norm(x, r, w, b, dropout_p=0.1, generator=torch.Generator().manual_seed(0))
    y5 = residual_layer_norm(x, r, w, b, dropout_p=0.1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(y1, y2) and torch.equal(y4, y5)  # bitwise: the kernels are deterministic
    assert not torch.equal(y1, y3)
    y0 = residual_layer_norm(x, r, w, b, dropout_p=0.0)
    assert not torch.equal(y0, y1)
    # ... and each output is the one of its seed: torch.manual_seed(0) / the generator seeded 0 drew
    # the seed, its Philox mask (numpy oracle) is what the kernel applied (2x rule vs the reference)
    torch.manual_seed(0)
    by_global = _drawn_seed()
    by_generator = _drawn_seed(torch.Generator().manual_seed(0))
    for got, seed in ((y1, by_global), (y4, by_generator)):
        mask = torch.from_numpy(_numpy_keep_mask(9, 384, 0.1, seed)).to(device)
        want = reference.residual_layer_norm(x.double(), r.double(), w.double(), b.double(), 1e-12, 0.1, mask)
        same = reference.residual_layer_norm(x, r, w, b, 1e-12, 0.1, mask)
        assert_close_2x(got, want, same, name=f"y (seed {seed})")


# The Philox tests below call the kernels' debug launcher directly: they run on the CPU (interpreter)
# and on CUDA, never skip, and the launch counter of tests/conftest.py proves the kernel ran.
def test_dropout_offsets_do_not_wrap(device):
    """Rows whose Philox counter row * cdiv(N, 4) + col // 4 passes 2^32 get fresh random numbers
    (int64 offsets: the high word feeds the second counter word)."""
    from bert_fast.kernels.residual_layer_norm import dropout_keep_mask

    n, seed = 1024, 987654321
    groups = n // 4
    base = dropout_keep_mask((4, n), 0.5, seed, device)
    wrapped = dropout_keep_mask((4, n), 0.5, seed, device, row_start=2**32 // groups)  # counter 2^32 + ...
    assert not torch.equal(base, wrapped)
    far = dropout_keep_mask((4, n), 0.5, seed, device, row_start=3 * 2**31 // groups)
    assert 0.3 < far.float().mean().item() < 0.7
    # independent of tiling / rows requested: row 2 alone equals row 2 of the block
    assert torch.equal(dropout_keep_mask((1, n), 0.5, seed, device, row_start=2)[0], base[2])


def _numpy_keep_mask(m, n, p, seed, row_start=0):
    """keep[i, col] of row row_start + i: word col % 4 of Philox at counter row * cdiv(n, 4) + col // 4."""
    rows = np.arange(row_start, row_start + m, dtype=np.uint64)[:, None]
    cols = np.arange(n, dtype=np.uint64)[None, :]
    off = rows * np.uint64((n + 3) // 4) + cols // np.uint64(4)
    zero = np.zeros_like(off)
    words = philox4x32_10(off, off >> np.uint64(32), zero, zero, seed)  # (lo32, hi32, 0, 0)
    word = np.choose(np.broadcast_to((cols % np.uint64(4)).astype(np.int64), off.shape), words)
    return uint32_to_uniform_float(word) >= np.float32(p)


@pytest.mark.no_kernels("the numpy Philox oracle against known answers")
def test_numpy_philox_known_answers():
    """bert_fast.testing.philox4x32_10 against the Random123 known-answer vectors (key = (seed_lo, seed_hi))."""
    kat = [
        ((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, 0xFFFFFFFFFFFFFFFF, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            0x299F31D0A4093822,
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for ctr, key, want in kat:
        got = tuple(int(w) for w in philox4x32_10(*ctr, key))
        assert got == want, [hex(g) for g in got]


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_dropout_mask_matches_numpy_philox(device, n):
    """One Philox4x32-10 per 4 columns: counter row * cdiv(N, 4) + col // 4 (int64, split lo/hi),
    key = 64-bit seed, word j -> column 4g + j, keep = uniform >= p. Bit-exact, incl. rows whose
    element offset passes 2^32 (row_start 2^32 // N) and whose counter passes 2^32."""
    from bert_fast.kernels.residual_layer_norm import dropout_keep_mask

    m, p = 6, 0.4
    for seed in (12345, 0x299F31D0A4093822):
        for row_start in (0, 2**32 // n, 2**32 // ((n + 3) // 4) + 1):
            got = dropout_keep_mask((m, n), p, seed, device, row_start=row_start).cpu().numpy()
            want = _numpy_keep_mask(m, n, p, seed, row_start)
            assert (got == want).all(), (seed, row_start, np.argwhere(got != want)[:5])


@pytest.mark.parametrize("m,n", [(9, 3), (9, 7), (21, 13), (5, 3000)])
def test_dropout_mask_same_in_fwd_bwd_and_debug_kernel(device, m, n):
    """The mask the forward and backward kernels apply equals dropout_keep_mask's bit for bit, whatever
    their tiles: N = 3000 runs the forward/backward as one 4096-column tile, the debug kernel as 1024-column
    tiles; small N packs several rows per program."""
    from bert_fast.kernels import residual_layer_norm as K

    p, seed, eps = 0.5, 0x123456789AB, 1e-5
    debug = K.dropout_keep_mask((m, n), p, seed, device)
    assert torch.equal(debug.cpu(), torch.from_numpy(_numpy_keep_mask(m, n, p, seed)))
    # forward: x = 4 everywhere, residual 0, w = 1, b = 0 -> kept h = 4 / (1 - p) > mean >= dropped h = 0,
    # so y > 0 exactly where kept (rows with every element kept have zero variance and y == 0).
    ones = torch.ones(m, n, device=device)
    w, b = torch.ones(n, device=device), torch.zeros(n, device=device)
    y, _, _ = K.residual_layer_norm_fwd(4 * ones, 0 * ones, w, b, eps, p, seed)
    assert torch.equal(y > 0, debug & ~debug.all(dim=1, keepdim=True))
    # backward: dx = dres * keep / (1 - p); with random inputs dres (= dh) is nonzero everywhere.
    x, r, w, b, dy = _inputs(m, n, torch.float32, device, seed=n)
    _, mean, rstd = K.residual_layer_norm_fwd(x, r, w, b, eps, p, seed)
    dx, dres, _, _ = K.residual_layer_norm_bwd(dy, x, r, w, b, mean, rstd, p, seed)
    assert torch.all(dres != 0)
    assert torch.equal(dx != 0, debug)
    torch.testing.assert_close(dx[debug], dres[debug] * 2.0, rtol=0, atol=0)


def test_dropout_checkpoint_recompute(device):
    x, r, w, b, dy = _inputs(7, 312, torch.float32, device, seed=10)

    def run(use_ckpt):
        ins = [t.detach().requires_grad_(True) for t in (x, r, w, b)]
        torch.manual_seed(42)
        fn = lambda *a: residual_layer_norm(*a, dropout_p=0.25) * 1.5
        y = checkpoint(fn, *ins, use_reentrant=False) if use_ckpt else fn(*ins)
        torch.manual_seed(777)  # the RNG moves on before backward; checkpoint must restore it
        return y, torch.autograd.grad(y, ins, dy)

    y1, g1 = run(False)
    y2, g2 = run(True)
    assert torch.equal(y1, y2)
    for a, c in zip(g1, g2):
        assert torch.equal(a, c)


# ----------------------------------------------------------------------------- properties
def test_deterministic_dweight(device):
    x, r, w, b, dy = _inputs(129, 1000, torch.float32, device, seed=11)
    runs = [_fwd_bwd(residual_layer_norm, (x, r, w, b), dy)[1] for _ in range(2)]
    for a, c in zip(runs[0], runs[1]):
        assert torch.equal(a, c)


def test_grads_only_where_required(device):
    x, r, w, b, dy = _inputs(3, 312, torch.float32, device, seed=12)
    x.requires_grad_(True)
    residual_layer_norm(x, r, w, b).backward(dy)
    assert x.grad is not None and r.grad is None and w.grad is None
    w.requires_grad_(True)
    x.grad = None
    residual_layer_norm(x.detach(), r, w, b).backward(dy)
    assert w.grad is not None and x.grad is None


@pytest.mark.no_kernels("empty inputs return before any launch")
def test_empty(device):
    x, r, w, b, _ = _inputs(0, 384, torch.float32, device)
    ins = [t.requires_grad_(True) for t in (x, r, w, b)]
    y = residual_layer_norm(*ins, dropout_p=0.1)
    assert y.shape == (0, 384)
    y.sum().backward()
    assert ins[0].grad.shape == (0, 384) and torch.equal(ins[2].grad, torch.zeros_like(w))


# float64 has no kernel on CUDA (bert_fast/ops/_dispatch.py, rule 2: it takes the torch
# implementation), so there this gradchecks the torch implementation under the op's autograd
# registration; on the H200 the kernel-test marker failed it ("launched none of its kernels"). The CPU
# session runs the kernels in float64 through the interpreter: there it gradchecks their backward.
_FP64_GRADCHECK = (
    pytest.mark.no_kernels("float64 on CUDA runs the torch implementation (the dispatch rule)")
    if pick_test_device().type == "cuda"
    else pytest.mark.kernels("residual_layer_norm")
)


@_FP64_GRADCHECK
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_gradcheck_fp64(device, p):
    x, r, w, b, _ = _inputs(3, 6, torch.float64, device, seed=13)
    ins = [t.requires_grad_(True) for t in (x, r, w, b)]

    def fn(*a):  # a fresh generator per call: every evaluation uses the same mask
        return residual_layer_norm(*a, eps=1e-5, dropout_p=p, generator=torch.Generator().manual_seed(3))

    assert torch.autograd.gradcheck(fn, ins)


def test_opcheck(device):
    x, r, w, b, dy = _inputs(4, 312, torch.float32, device, seed=14)
    ins = [t.requires_grad_(True) for t in (x, r, w, b)]
    seed = torch.tensor([12345], dtype=torch.int64)
    op = torch.ops.bert_fast.residual_layer_norm_fwd.default
    torch.library.opcheck(op, (*ins, 1e-5, 0.0, None))
    torch.library.opcheck(op, (*ins, 1e-5, 0.1, seed))
    _, mean, rstd = op(x, r, w, b, 1e-5, 0.1, seed)
    torch.library.opcheck(
        torch.ops.bert_fast.residual_layer_norm_bwd.default,
        (dy, x.detach(), r.detach(), w.detach(), b.detach(), mean, rstd, 1e-5, 0.1, seed),
    )


@pytest.mark.no_kernels("validation raises before any launch")
def test_bad_inputs(device):
    x, r, w, b, _ = _inputs(4, 8, torch.float32, device)
    with pytest.raises(ValueError, match=r"\(4, 7\)"):
        residual_layer_norm(x, r[:, :7], w, b)
    with pytest.raises(ValueError, match=r"\(7,\)"):
        residual_layer_norm(x, r, w[:7], b)
    with pytest.raises(ValueError):
        residual_layer_norm(x, r, w, b.reshape(2, 4))
    with pytest.raises(TypeError):
        residual_layer_norm(x, r.half(), w, b)
    with pytest.raises(TypeError):
        residual_layer_norm(x.long(), r.long(), w.long(), b.long())
    with pytest.raises(TypeError):
        residual_layer_norm("x", r, w, b)
    for p in (-0.1, 1.0, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="dropout_p"):
            residual_layer_norm(x, r, w, b, dropout_p=p)


# ----------------------------------------------------------------------------- GPU targets, offline
@pytest.mark.no_kernels("offline sm_80/sm_90 compile in a subprocess")
def test_kernels_compile_for_sm90_sm80():
    """Compile fwd/bwd (dropout on/off, every dtype) and the mask kernel for sm_90 and sm_80 without
    a GPU and without the interpreter (see tests/ops/test_bias_gelu.py::run_offline_compile)."""
    from test_bias_gelu import run_offline_compile

    rows = run_offline_compile(r"""
from bert_fast.kernels import residual_layer_norm as K
for cc in (90, 80):
    for dt in ("fp16", "bf16", "fp32", "fp64"):
        p, st = "*" + dt, ("*fp64" if dt == "fp64" else "*fp32")
        comp_t = tl.float64 if dt == "fp64" else tl.float32
        for n in (768, 3000):
            for drop in (False, True):
                bm, bn, w = K._config(n)
                c = dict(HAS_DROPOUT=drop, COMPUTE=comp_t, BLOCK_M=bm, BLOCK_N=bn)
                comp(K._residual_layer_norm_fwd_kernel, dict(X=p, R=p, W=p, B=p, Y=p, MEAN=st, RSTD=st,
                     M="i32", N="i32", stride_xm="i32", stride_rm="i32", stride_ym="i32", eps="fp32",
                     dropout_p="fp32", dropout_scale="fp32", seed="i64"), c, cc, warps=w,
                     label=f"fwd {dt} N{n} drop={drop}")
                comp(K._residual_layer_norm_bwd_kernel, dict(DY=p, X=p, R=p, W=p, MEAN=st, RSTD=st, DX=p,
                     DRES=p, DW_PARTIAL=st, DB_PARTIAL=st, M="i32", N="i32", stride_dym="i32",
                     stride_xm="i32", stride_rm="i32", stride_dxm="i32", stride_drm="i32",
                     dropout_p="fp32", dropout_scale="fp32", seed="i64", rows_per_prog="i32",
                     n_iters="i32"), c, cc, warps=w, label=f"bwd {dt} N{n} drop={drop}")
    comp(K._dropout_keep_mask_kernel, dict(OUT="*i8", M="i32", N="i32", row_start="i64",
         dropout_p="fp32", seed="i64"), dict(BLOCK_M=8, BLOCK_N=1024), cc, warps=8, label="keep mask")
""")
    assert len(rows) == 2 * (4 * 2 * 2 * 2 + 1)


@pytest.mark.parametrize("partials", [False, True], ids=["residual", "split-k-partials"])
def test_forward_writes_every_output_row(device, monkeypatch, partials):
    """The forwards allocate y, mean and rstd unfilled (no zero-fill launches): every row must be
    written. Allocations poisoned with NaN, a row count off the row blocks: no NaN comes back, and
    mean and rstd are the rows' own."""
    import bert_fast.kernels.residual_layer_norm as K

    real_empty = torch.empty
    monkeypatch.setattr(K.torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    m, n = 37, 48
    x, r, w, b, _ = _inputs(m, n, torch.float32, device)
    if partials:
        part = torch.stack([x * 0.25, x * 0.75])  # two K-slices' partial sums adding up to x
        y, mean, rstd = K.partials_residual_layer_norm_fwd(part, torch.zeros(n, device=device), r, w, b, 1e-12)
    else:
        y, mean, rstd = K.residual_layer_norm_fwd(x, r, w, b, 1e-12, 0.0, None)
    h = (x + r).double()
    assert not any(t.isnan().any() for t in (y, mean, rstd))
    torch.testing.assert_close(mean.double(), h.mean(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd.double(), h.var(-1, unbiased=False).add(1e-12).rsqrt(), rtol=1e-4, atol=1e-6)
