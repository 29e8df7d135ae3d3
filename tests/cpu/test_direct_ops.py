"""bert_fast.model.direct_ops, the inference path without the custom-op plumbing: what it computes
its own way gives the torch implementation's numbers bit for bit."""

import pytest
import torch

from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import residual_layer_norm as residual_layer_norm_cases
from bert_fast.model import direct_ops
from bert_fast.ops import torch_impl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(128, 384), (1, 77, 768), (3, 100)])
def test_residual_layer_norm_equals_the_torch_implementation(shape, dtype):
    """y of LayerNorm(x + residual) from aten's LayerNorm in the input's dtype equals the torch
    implementation's (fp32 weights and statistics, for a backward) bit for bit."""
    n = shape[-1]
    t = residual_layer_norm_cases.sample_inputs(
        shape[0] if len(shape) == 2 else shape[0] * shape[1], n, seeded_randn(n, "cpu", dtype), affine_scale=0.5
    )
    x, r = t["x"].view(shape), t["residual"].view(shape)
    with torch.no_grad():
        direct = direct_ops.residual_layer_norm(x, r, t["weight"], t["bias"], 1e-12)
        via_impl = torch_impl.residual_layer_norm_fwd(x, r, t["weight"], t["bias"], 1e-12, 0.0, None)[0]
    assert direct.dtype == dtype and torch.equal(direct, via_impl)
