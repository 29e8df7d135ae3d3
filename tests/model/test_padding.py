"""bert_fast.model.padding: unpad / pad round trips on any mask pattern, zeros at pads, gradients."""

from __future__ import annotations

import pytest
import torch

from bert_fast.model.padding import pad, unpad

pytestmark = pytest.mark.no_kernels("host-side layout helpers")


def _mask(kind: str) -> torch.Tensor:
    m = torch.ones(4, 7, dtype=torch.long)
    if kind == "right":
        m[0, 3:] = 0
        m[2, 6:] = 0
    elif kind == "holes":
        m[1, ::2] = 0
        m[3] = 0  # a fully padded row
    elif kind == "left":
        m[0, :4] = 0
    return m


@pytest.mark.parametrize("kind", ["dense", "right", "holes", "left"])
def test_round_trip_and_zero_pads(kind):
    mask = _mask(kind)
    x = torch.randn(4, 7, 5, dtype=torch.float64)
    u = unpad(mask)
    packed = x.reshape(28, 5).index_select(0, u.indices)
    assert u.num_tokens == int(mask.sum()) and u.max_seqlen == int(mask.sum(1).max())
    assert u.cu_seqlens.tolist() == [0] + mask.sum(1).cumsum(0).tolist()
    out = pad(packed, u)
    keep = mask.bool()
    assert out.shape == x.shape
    assert torch.equal(out[keep], x[keep])
    assert torch.all(out[~keep] == 0)


@pytest.mark.parametrize("kind", ["dense", "holes"])
def test_gradient_flows_to_the_packed_rows_only(kind):
    mask = _mask(kind)
    u = unpad(mask)
    packed = torch.randn(u.num_tokens, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda p: pad(p, u), (packed,))
    g = torch.randn(4, 7, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad(pad(packed, u), packed, g)
    assert torch.equal(grad, g.reshape(28, 3).index_select(0, u.indices))
