"""The weight-gradient rule of bert_fast.testing (reduction_floor / assert_reduction_close_2x) can fail.

dweight / dbias of linear, residual_layer_norm and bias_gelu are sums over the M rows of a batch. The
rule that judges them must pass a kernel that accumulates in fp32 and rounds once (the float64
oracle rounded to the dtype) and fail one that loses a single row. Each row's share of the gradient
is computed exactly (float64), so every possible dropped row is tried, at the M = 129 of the op tests
and at their hidden sizes. No kernel runs here: the rule itself is under test (the op files apply it
to the kernels).
"""

import pytest
import torch

from bert_fast import reference
from bert_fast.testing import error_and_bound_2x, max_abs_err, reduction_floor

M = 129


def _grad(fn, inputs, dy, which):
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    return torch.autograd.grad(fn(*leaves), [leaves[i] for i in which], dy)


def _residual_layer_norm(m, n, dtype, g):
    """(oracle, per-row shares [m, ...], torch in dtype) of dweight and of dbias."""
    x, r, dy = (torch.randn(m, n, generator=g).to(dtype) for _ in range(3))
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype)
    b = (0.5 * torch.randn(n, generator=g)).to(dtype)
    fn = lambda x_, r_, w_, b_: reference.residual_layer_norm(x_, r_, w_, b_, 1e-12, 0.0, None)
    same = _grad(fn, (x, r, w, b), dy, (2, 3))
    # row i's share: dweight_i = dy_i * xhat_i, dbias_i = dy_i (xhat: the normalized row, float64)
    xhat = torch.nn.functional.layer_norm(x.double() + r.double(), (n,), eps=1e-12)
    shares = (dy.double() * xhat, dy.double())
    return [(s.sum(0), s, t) for s, t in zip(shares, same)]


def _bias_gelu(m, n, dtype, g):
    x = (2 * torch.randn(m, n, generator=g)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    fn = lambda x_, b_: reference.bias_gelu(x_, b_, "none")
    (same,) = _grad(fn, (x, b), dy, (1,))
    (shares,) = _grad(fn, (x.double(), b.double().expand(m, n).clone()), dy.double(), (1,))
    return [(shares.sum(0), shares, same)]


def _linear(m, k, n, dtype, g):
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    fn = lambda x_, w_, b_: reference.linear(x_, w_, b_, "gelu")
    same_dw, same_db = _grad(fn, (x, w, b), dy, (1, 2))
    z = (x.double() @ w.double().t() + b.double()).requires_grad_(True)
    (dz,) = torch.autograd.grad(torch.nn.functional.gelu(z), z, dy.double())
    dw_shares = dz[:, :, None] * x.double()[:, None, :]  # row i: outer(dz_i, x_i), [m, n, k]
    return [(dw_shares.sum(0), dw_shares, same_dw), (dz.sum(0), dz, same_db)]


CASES = {
    "residual_layer_norm n=384": lambda dt, g: _residual_layer_norm(M, 384, dt, g),
    "residual_layer_norm n=1000": lambda dt, g: _residual_layer_norm(M, 1000, dt, g),
    "bias_gelu n=312": lambda dt, g: _bias_gelu(M, 312, dt, g),
    "bias_gelu n=3000": lambda dt, g: _bias_gelu(M, 3000, dt, g),
    "linear 64x48": lambda dt, g: _linear(M, 64, 48, dt, g),
    "linear 312x1000": lambda dt, g: _linear(M, 312, 1000, dt, g),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_a_dropped_row_fails_the_weight_gradient_rule(case, dtype):
    for oracle, shares, same in CASES[case](dtype, torch.Generator().manual_seed(len(case))):
        floor = reduction_floor(oracle, dtype, M)
        # a correct kernel: fp32 accumulation, one rounding to dtype at the end
        err, bound = error_and_bound_2x(oracle.to(dtype), oracle, same, floor=floor)
        assert err <= bound / 2, f"{case}: a round-once result uses {err / bound:.0%} of the bound"
        # ... that lost row i, for every i: the error is row i's share, rounded
        dropped = (oracle[None] - shares).to(dtype).double()
        errs = (dropped - oracle[None]).flatten(1).abs().amax(1)
        passed = (errs <= bound).nonzero().flatten().tolist()
        assert not passed, (
            f"{case}: dropping row(s) {passed[:5]} passes (error {errs.min().item():.3g} "
            f"<= bound {bound:.3g}: 2 x torch's {max_abs_err(same, oracle):.3g} + "
            f"floor {floor:.3g})"
        )
