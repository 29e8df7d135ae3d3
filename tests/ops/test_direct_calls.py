"""_dispatch.call_op: an op's implementation called without the dispatcher where nothing watches the
op (no gradient, no compile, no mode, no profiler, plain tensors), the op itself everywhere else;
the same outputs either way. Runs on the CPU interpreter and on CUDA (the kernel path)."""

import pytest
import torch

import bert_fast
from bert_fast import ops
from bert_fast.ops import _dispatch
from bert_fast.testing import pick_test_device, tiny_bert_config

pytestmark = pytest.mark.kernels("linear")


@pytest.fixture
def device():
    return pick_test_device()


@pytest.fixture
def calls(monkeypatch):
    """Counts the direct calls of linear_fwd's implementation."""
    seen = []
    impl = _dispatch._IMPLS["linear_fwd"]
    monkeypatch.setitem(_dispatch._IMPLS, "linear_fwd", lambda *a: seen.append(1) or impl(*a))
    return seen


def _linear_inputs(device, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).to(device) for s in ((24, 32), (48, 32), (48,)))
    return x, w.requires_grad_(requires_grad), b


def test_direct_under_no_grad_and_the_same_outputs(device, calls):
    x, w, b = _linear_inputs(device)
    with torch.no_grad():
        direct = ops.linear(x, w, b, "gelu")
        assert len(calls) == 1
        via_op = torch.ops.bert_fast.linear_fwd(x, w, b, "gelu", "auto:auto", False)[0]
    assert torch.equal(direct, via_op)


def test_direct_with_grad_enabled_when_nothing_requires_it(device, calls):
    x, w, b = _linear_inputs(device)
    ops.linear(x, w, b)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "watcher",
    [
        "requires_grad",
        "profiler",
        "function_mode",
        pytest.param("fake_tensors", marks=pytest.mark.no_kernels("fake tensors run the op's fake implementation")),
        "vmap",
        "compiling",
        "jit_trace",
    ],
)
def test_the_op_where_something_watches(device, calls, monkeypatch, watcher):
    x, w, b = _linear_inputs(device, requires_grad=watcher == "requires_grad")
    if watcher == "requires_grad":
        y = ops.linear(x, w, b, "gelu")
        assert y.grad_fn is not None
    elif watcher == "profiler":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
            ops.linear(x, w, b)
        assert any(e.name == "bert_fast::linear_fwd" for e in prof.events())
    elif watcher == "function_mode":
        with torch.device(device), torch.no_grad():
            ops.linear(x, w, b)
    elif watcher == "fake_tensors":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode, torch.no_grad():
            y = ops.linear(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b))
        assert tuple(y.shape) == (24, 48)
    elif watcher == "vmap":
        with torch.no_grad():
            y = torch.vmap(lambda xi: ops.linear(xi, w, b))(x.view(2, 12, 32))
        assert tuple(y.shape) == (2, 12, 48)
    elif watcher == "jit_trace":
        with torch.no_grad():
            traced = torch.jit.trace(lambda xx: ops.linear(xx, w, b), (x,), check_trace=False)
        assert "bert_fast::linear_fwd" in str(traced.graph)
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        with torch.no_grad():
            ops.linear(x, w, b)
    assert calls == []


def test_a_model_forward_is_the_same_with_and_without_direct_calls(device, monkeypatch):
    """Every op of an encoder forward (embedding, QKV, attention, GELU, residual LayerNorms) direct,
    then through the dispatcher: the same bits."""
    torch.manual_seed(0)
    model = bert_fast.BertModel(tiny_bert_config()).to(device).eval()
    ids = torch.randint(1, 101, (3, 12), device=device)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padding: the varlen path
    used = set()
    for name, impl in list(_dispatch._IMPLS.items()):
        monkeypatch.setitem(_dispatch._IMPLS, name, lambda *a, _n=name, _f=impl: used.add(_n) or _f(*a))
    with torch.no_grad():
        direct = model(ids, attention_mask=mask).last_hidden_state
        assert {"linear_fwd", "varlen_attention_fwd", "embedding_layer_norm_fwd"} <= used
        monkeypatch.setattr(_dispatch, "_direct_allowed", lambda args: False)
        via_ops = model(ids, attention_mask=mask).last_hidden_state
    assert torch.equal(direct, via_ops)
