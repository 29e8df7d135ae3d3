"""bert_fast against the transformers / peft it finds installed (bert_fast/model/compat.py).

* no private name of transformers, peft, sentence-transformers or accelerate is used outside
  bert_fast/model/compat.py (an AST scan, not a string grep: attribute names, getattr strings, imports);
* every use inside compat works on the installed versions (the mask builder against transformers'
  own attention modules in eager and SDPA form, from 2-D, 3-D and 4-D masks; the hooks it
  understands; FSDP's class swap; peft's LoRA class);
* a change upstream becomes a warned fallback to transformers' forward naming the package, its
  version and the tested range, at optimize() / construction time (faked by monkeypatch), and a
  transformers older than the floor is refused at import;
* every keyword and config transformers' BertModel accepts either works as on transformers or
  gets the documented error, the same from the keyword and from the config.
"""

import ast
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import bert_fast
from bert_fast import versions
from bert_fast.model import compat
from bert_fast.testing import pick_test_device, tiny_bert_config

DEVICE = pick_test_device()
ROOT = Path(__file__).resolve().parents[2]
LIBS = ("transformers", "peft", "sentence_transformers", "accelerate")


def pair(config=None, attn="sdpa", seed=0):
    config = config or tiny_bert_config()
    compat.set_attention_implementation(config, attn)
    torch.manual_seed(seed)
    hf = transformers.BertModel(config).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    fast = bert_fast.BertModel(config).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict(), strict=True)
    return hf, fast


def inputs(config, b=3, s=9):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, 2:] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def real(t, mask):
    return t[mask.bool()]


# ----------------------------------------------------------------------------- no private use outside compat
def _private_names():
    """Underscore names defined by the classes of those libraries bert_fast touches (minus the
    nn.Module internals every module has: those are torch's, not theirs)."""
    classes = [
        transformers.PreTrainedModel,
        transformers.BertModel,
        transformers.BertConfig,
        transformers.BertForMaskedLM,
        transformers.Trainer,
    ]
    from transformers.models.bert import modeling_bert

    classes += [c for c in vars(modeling_bert).values() if isinstance(c, type)]
    try:
        import peft
        from peft.tuners.lora.layer import Linear as LoraLinear

        classes += [LoraLinear, peft.PeftModel]
    except ImportError:
        pass
    try:
        import sentence_transformers

        classes += [sentence_transformers.SentenceTransformer]
    except ImportError:
        pass
    names = set()
    for cls in classes:
        for klass in cls.__mro__:
            if (klass.__module__ or "").split(".")[0] in LIBS:
                names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
    names |= {n for n in vars(transformers.BertConfig()) if n.startswith("_") and not n.startswith("__")}
    names |= {"_attn_implementation", "_from_config", "_create_attention_masks"}  # known by name
    module_internals = {n for n in dir(nn.Module()) if n.startswith("_")} | set(vars(nn.Module))
    return names - module_internals


def _private_uses(source: str, names: set):
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append((node.lineno, repr(node.value)))  # getattr(x, "_name")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBS:
            if any(part.startswith("_") for part in node.module.split(".")) or any(
                a.name.startswith("_") for a in node.names
            ):
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBS and any(p.startswith("_") for p in a.name.split(".")):
                    found.append((node.lineno, f"import {a.name}"))
    return found


def test_no_private_use_outside_compat():
    names = _private_names()
    assert {"_attn_implementation", "_create_attention_masks"} <= names
    bad = []
    for path in sorted((ROOT / "bert_fast").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py")):
        if path.name == "compat.py":
            continue
        bad += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in _private_uses(path.read_text(), names)]
    assert not bad, (
        "private names of transformers/peft/sentence-transformers/accelerate outside compat.py:\n" + "\n".join(bad)
    )


def test_the_scan_finds_what_main_used_before():
    """The scan catches the private uses that broke on transformers 5.24 (a planted copy)."""
    planted = """
create = getattr(transformers.BertModel, "_create_attention_masks", None)
cfg._attn_implementation = "eager"
m = HFBertModel._from_config(cfg)
from transformers.models.bert.modeling_bert import _private_helper
"""
    found = _private_uses(planted, _private_names() | {"_private_helper"})
    assert len(found) == 4, found


# ----------------------------------------------------------------------------- the floor
def test_transformers_older_than_the_floor_is_refused_at_import():
    floor = versions.TRANSFORMERS_FLOOR
    with pytest.raises(ImportError, match=rf"transformers >= {re.escape(floor)}.*4\.30\.0"):
        versions.check_transformers_floor("4.30.0")
    versions.check_transformers_floor(versions.TRANSFORMERS_FLOOR)  # the floor itself is fine
    code = (
        "import importlib.metadata as m; real = m.version\n"
        "m.version = lambda p: '4.30.0' if p == 'transformers' else real(p)\n"
        "import bert_fast\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and f"needs transformers >= {floor}" in proc.stderr, proc.stderr[-2000:]


def test_setup_py_floor_matches_compat():
    setup = (ROOT / "setup.py").read_text()
    assert f'"transformers>={versions.TRANSFORMERS_FLOOR}"' in setup


# ----------------------------------------------------------------------------- the mask for unfused pieces
def _masks(mask, form, dtype):
    b, s = mask.shape
    if form == "2d":
        return mask
    if form == "3d":
        return mask[:, None, :].expand(b, s, s).contiguous()
    additive = (1.0 - mask.to(dtype)) * torch.finfo(dtype).min
    return additive[:, None, None, :]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("form", ["2d", "3d", "4d"])
def test_unfused_pieces_get_a_mask_their_attention_takes(attn, form):
    """A hook makes every block of layer 0 run through transformers' own modules on the mask
    bert_fast builds: the outputs equal transformers' own forward with the same mask."""
    hf, fast = pair(attn=attn)
    ids, mask = inputs(hf.config)
    m = _masks(mask, form, torch.float32)
    calls = []
    fast.encoder.layer[0].attention.self.register_forward_hook(lambda mod, a, o: calls.append(1))
    with torch.no_grad():
        # transformers 5 no longer takes 3-D masks, 4.41's eager path no 4-D ones: where the installed
        # version refuses a form, its answer for the equivalent 2-D mask is the reference
        try:
            ref = hf(ids, attention_mask=m).last_hidden_state
        except (ValueError, RuntimeError):
            ref = hf(ids, attention_mask=mask).last_hidden_state
        out = fast(ids, attention_mask=m).last_hidden_state
    assert calls == [1] and "encoder.layer.0.attention.self" in fast.unfused_pieces()
    torch.testing.assert_close(real(out, mask), real(ref, mask), atol=2e-5, rtol=1e-5)


def test_mask_builder_forms():
    keep = torch.tensor([[True, True, False], [True, True, True]])
    cfg = tiny_bert_config()
    for attn in ("eager", "sdpa"):
        compat.set_attention_implementation(cfg, attn)
        m = compat.attention_mask_for_modules(keep, torch.bfloat16, cfg)
        assert m.shape == (2, 1, 1, 3) and m.dtype == torch.bfloat16
        assert m[0, 0, 0, 2] == torch.finfo(torch.bfloat16).min and m[0, 0, 0, :2].eq(0).all()
    compat.set_attention_implementation(cfg, "flash_attention_2")
    assert compat.attention_mask_for_modules(keep, torch.float16, cfg).tolist() == [[1, 1, 0], [1, 1, 1]]
    assert compat.attention_mask_for_modules(torch.ones(2, 3, dtype=torch.bool), torch.float16, cfg) is None
    compat.set_attention_implementation(cfg, "flex_attention")
    with pytest.raises(compat.CompatibilityError, match="flex_attention.*transformers"):
        compat.attention_mask_for_modules(keep, torch.float32, cfg)


# ----------------------------------------------------------------------------- faked upstream changes
def test_a_changed_module_signature_is_a_warned_fallback(monkeypatch, fresh_probes):
    """transformers changes BertSelfOutput.forward (a keyword renamed): optimize() and the
    constructor warn, naming the package, its version and the tested range, and the model keeps
    transformers' forward: same answer, no TypeError inside forward."""
    from transformers.models.bert import modeling_bert

    original = modeling_bert.BertSelfOutput.forward

    def changed(self, hidden_states, *, residual):  # the residual became keyword-only
        return original(self, hidden_states, residual)

    monkeypatch.setattr(modeling_bert.BertSelfOutput, "forward", changed)
    config = tiny_bert_config()
    hf = transformers.BertModel(config).to(DEVICE).eval()  # inputs() are on DEVICE
    ids, mask = inputs(config)
    version = transformers.__version__
    with pytest.warns(RuntimeWarning, match=rf"transformers {version}.*tested with {versions.tested_range()}"):
        out_model = bert_fast.optimize(hf)
    assert type(out_model) is transformers.BertModel  # left as it was
    with pytest.warns(RuntimeWarning, match="BertSelfOutput.forward"):
        fast = bert_fast.BertModel(config).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict())
    with torch.no_grad():
        monkeypatch.setattr(modeling_bert.BertSelfOutput, "forward", original)  # transformers' own runs
        torch.testing.assert_close(
            fast(ids, attention_mask=mask).last_hidden_state, hf(ids, attention_mask=mask).last_hidden_state
        )


def test_a_changed_module_tree_is_a_warned_fallback(fresh_probes):
    config = tiny_bert_config()
    hf = transformers.BertModel(config).eval()
    layer = hf.encoder.layer[1].output
    layer.layer_norm = layer.LayerNorm  # renamed, as another version might
    del layer.LayerNorm
    assert "encoder.layer.1.output.LayerNorm" in compat.probe_model(hf)
    with pytest.warns(
        RuntimeWarning, match=r"transformers .*tested with.*missing encoder\.layer\.1\.output\.LayerNorm"
    ):
        bert_fast.optimize(hf)
    assert type(hf) is transformers.BertModel


# ----------------------------------------------------------------------------- touch points, on what is installed
def test_understood_hooks_and_checkpointing_layer():
    config = tiny_bert_config()
    hf, fast = pair(config)
    fast.enable_input_require_grads()
    assert compat.wants_input_grads(fast.embeddings.word_embeddings)
    assert fast.unfused_pieces() == {}
    with torch.no_grad():  # transformers 5 installs its output-capturing hooks for good here
        fast(*inputs(config)[:1], output_hidden_states=True)
    assert fast.unfused_pieces() == {}
    from transformers.models.bert import modeling_bert

    try:  # transformers 4.52+
        from transformers.modeling_layers import GradientCheckpointingLayer as gcl
    except ImportError:
        gcl = None
    assert compat.layer_checkpoints_itself() == (gcl is not None and issubclass(modeling_bert.BertLayer, gcl))


def test_fsdp2_class_swap_is_recognised():
    fsdp = compat._fsdp_module_class()
    if fsdp is None:
        pytest.skip("this torch has no FSDP2")
    from bert_fast.model.modeling import BertLayer

    swapped = type(f"FSDP{BertLayer.__name__}", (fsdp, BertLayer), {})
    assert compat.base_class(swapped) is BertLayer
    assert compat.base_class(BertLayer) is BertLayer


def test_peft_lora_class_has_what_dropin_reads():
    peft = pytest.importorskip("peft")
    cls = compat.lora_linear_class()
    assert cls is not None, f"peft {peft.__version__}: its LoRA Linear changed"
    base = nn.Linear(8, 8)
    model = nn.Sequential(base)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["0"]))
    lora = pm.base_model.model[0]
    assert type(lora) is cls
    for attr in (
        "base_layer",
        "lora_A",
        "lora_B",
        "lora_dropout",
        "scaling",
        "active_adapters",
        "merged",
        "disable_adapters",
    ):
        assert hasattr(lora, attr), attr
    assert compat.lora_variant_or_dora(lora, "default") is False


def test_hf_bert_model_builds_the_asked_attention():
    for attn in ("eager", "sdpa"):
        model = compat.hf_bert_model(tiny_bert_config(), attn)
        assert compat.attention_implementation(model.config) == attn


# ----------------------------------------------------------------------------- keywords and configs
def test_forwarded_kwargs_reach_unfused_modules_where_transformers_passes_them():
    hf, fast = pair()
    ids, mask = inputs(hf.config)
    seen = []
    fast.encoder.layer[1].attention.self.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True
    )
    with torch.no_grad():
        fast(ids, attention_mask=mask, shift_labels=ids, num_items_in_batch=torch.tensor(3))
    takes = compat.accepts_var_kwargs(type(fast.encoder.layer[1].attention.self).forward)
    assert ("shift_labels" in seen[0]) == takes and ("num_items_in_batch" in seen[0]) == takes


def test_head_forwards_its_kwargs_like_transformers():
    config = tiny_bert_config()
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(config).to(DEVICE).eval()  # inputs() are on DEVICE
    fast = bert_fast.BertForMaskedLM(config).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict())
    ids, mask = inputs(config)
    labels = ids.masked_fill(mask == 0, -100)
    if not compat.accepts_var_kwargs(transformers.BertForMaskedLM.forward):
        # transformers 4.x heads list their keywords: both refuse an unknown one alike
        for model in (hf, fast):
            with pytest.raises(TypeError, match="use_cache"):
                model(ids, attention_mask=mask, labels=labels, use_cache=True)
        return
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, labels=labels, use_cache=True)
        out = fast(ids, attention_mask=mask, labels=labels, use_cache=True)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)


def test_use_cache_is_ignored_from_keyword_and_config():
    config = tiny_bert_config(use_cache=True)
    hf, fast = pair(config)
    ids, mask = inputs(config)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, use_cache=True).last_hidden_state
        out = fast(ids, attention_mask=mask, use_cache=True).last_hidden_state
    torch.testing.assert_close(real(out, mask), real(ref, mask), atol=2e-5, rtol=1e-5)


def _expected_selection(select, n: int, mode: str):
    """(entries of hidden_states, {entry index: index into the n full states}) for ``select``."""
    if select is True or mode == "flag" or (mode == "layers" and isinstance(select, int)):
        return n, {i: i for i in range(n)}  # 4.x: any truthy value is a flag
    picks = [select] if isinstance(select, int) else select
    if mode == "layers":  # transformers 5.17: layer outputs only, literal membership
        return n - 1, {i: i + 1 for i in picks if 0 <= i < n - 1}
    return n, {i % n: i % n for i in picks if -n <= i < n}


@pytest.mark.parametrize("select", [True, False, [0, 2], [2], -1, [1, -3], [7], []])
def test_output_hidden_states_selects_layers_as_transformers(select):
    """As the installed transformers reads it (compat.hidden_states_selection, probed): 5.2x has one
    entry per state, None where not selected; 5.17 one entry per layer output; 4.x reads a list or
    an index as a truthy flag (every state), and so does bert_fast there. On any device: the H200
    run had transformers 5.17, whose meaning this once missed."""
    hf, fast = pair()
    ids, mask = inputs(hf.config)
    with torch.no_grad():
        full = fast(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        out = fast(ids, attention_mask=mask, output_hidden_states=select).hidden_states
        ref = hf(ids, attention_mask=mask, output_hidden_states=select).hidden_states
    n = len(full)
    if not select:  # False, [] (and 0): no hidden states, as transformers reads a falsy flag
        assert out is None and ref is None
        return
    size, want = _expected_selection(select, n, compat.hidden_states_selection())
    assert len(out) == size and {i for i, h in enumerate(out) if h is not None} == set(want)
    for i, j in want.items():
        torch.testing.assert_close(real(out[i], mask), real(full[j], mask))
    assert [h is None for h in ref] == [h is None for h in out]
    for a, b in zip(out, ref):
        if a is not None:
            torch.testing.assert_close(real(a, mask), real(b, mask), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["states", "layers", "flag"])
def test_output_hidden_states_selection_modes(mode, monkeypatch):
    """The three meanings transformers has given a list output_hidden_states, whichever is
    installed here: 5.2x's ("states"), 5.17's ("layers") and 4.x's ("flag"), faked by the probe's
    answer."""
    monkeypatch.setattr(compat, "hidden_states_selection", lambda: mode)
    hf, fast = pair()
    ids, mask = inputs(hf.config)
    with torch.no_grad():
        full = fast(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        for select in ([0, 2], [2], -1, [1, -3], [7]):
            out = fast(ids, attention_mask=mask, output_hidden_states=select).hidden_states
            size, want = _expected_selection(select, len(full), mode)
            assert len(out) == size and {i for i, h in enumerate(out) if h is not None} == set(want), select
            for i, j in want.items():
                torch.testing.assert_close(out[i], full[j])


def test_hidden_states_selection_probe_reads_the_installed_transformers():
    """The probe answers one of its three meanings; 5.x's BertModel accepts a list (4.x: a flag)."""
    mode = compat.hidden_states_selection()
    assert mode in ("states", "layers", "flag")
    if not compat.accepts_var_kwargs(transformers.BertModel.forward):
        assert mode == "flag"


def test_output_attentions_keyword_and_config_give_the_same_error():
    """On an sdpa model: the keyword and (where transformers' config accepts it) the config give one
    error, naming what to do; on an eager model both answer (tests/model/test_output_attentions.py)."""
    hf, fast = pair(attn="sdpa")
    ids, mask = inputs(hf.config)
    with pytest.raises(ValueError, match="attn_implementation='eager'") as by_keyword:
        fast(ids, attention_mask=mask, output_attentions=True)
    try:
        fast.config.output_attentions = True
    except ValueError as e:  # transformers 5's config refuses output_attentions with sdpa itself
        assert "eager" in str(e)
    else:
        with pytest.raises(ValueError, match="output_attentions") as by_config:
            fast(ids, attention_mask=mask)
        assert str(by_keyword.value) == str(by_config.value)
        fast(ids, attention_mask=mask, output_attentions=False)  # the keyword overrides the config


def test_answers_output_attentions_reads_the_attention_implementation():
    config = tiny_bert_config()
    for attn, answers in (("eager", True), ("sdpa", False)):
        compat.set_attention_implementation(config, attn)
        assert compat.answers_output_attentions(config) is answers


FAMILY_SELF_ATTENTIONS = [
    (transformers.BertConfig, "bert", "Bert"),
    (transformers.RobertaConfig, "roberta", "Roberta"),
    (transformers.XLMRobertaConfig, "xlm_roberta", "XLMRoberta"),
    (transformers.ElectraConfig, "electra", "Electra"),
]


@pytest.mark.parametrize("suffix", ["SelfAttention", "Attention"])
@pytest.mark.parametrize("config_cls,family,prefix", FAMILY_SELF_ATTENTIONS)
def test_eager_attention_modules_return_probabilities_under_probability_keywords(config_cls, family, prefix, suffix):
    """transformers' (Self)Attention modules, eager, called as exact mode calls them with
    probability_keywords: the second output is the softmax of the masked scores."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = config_cls(hidden_size=16, num_attention_heads=2, intermediate_size=32, attention_probs_dropout_prob=0.0)
    compat.set_attention_implementation(config, "eager")
    cls = getattr(modeling, prefix + suffix)
    torch.manual_seed(0)
    module = cls(config).eval()
    self_attention = module if suffix == "SelfAttention" else module.self
    h = torch.randn(2, 5, 16)
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    mask = compat.attention_mask_for_modules(keep, h.dtype, config)
    with torch.no_grad():
        args = (h, mask) if suffix == "Attention" else (h,)
        kw = {} if suffix == "Attention" else {"attention_mask": mask}
        out = module(*args, **kw, **compat.probability_keywords(cls.forward))
        probs = compat.attention_probabilities(out, cls.__name__)
        q = self_attention.query(h).view(2, 5, 2, 8).transpose(1, 2)
        k = self_attention.key(h).view(2, 5, 2, 8).transpose(1, 2)
        want = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + mask, dim=-1)
    torch.testing.assert_close(probs, want)
    assert probs[1, :, :, 2:].abs().max() == 0


def test_attention_probabilities_names_a_module_that_returned_none():
    with pytest.raises(compat.CompatibilityError, match="MySelfAttention returned no attention probabilities"):
        compat.attention_probabilities(torch.zeros(2, 3, 4), "MySelfAttention")
    with pytest.raises(compat.CompatibilityError, match="eager"):
        compat.attention_probabilities((torch.zeros(2, 3, 4), None), "BertSdpaSelfAttention")


def test_returns_cross_attentions_is_what_transformers_returns():
    config = tiny_bert_config()
    compat.set_attention_implementation(config, "eager")
    hf = transformers.BertModel(config).to(DEVICE).eval()
    ids, mask = inputs(config)
    with torch.no_grad():
        out = hf(ids, attention_mask=mask, output_attentions=True)
    assert ("cross_attentions" in out.keys()) is compat.returns_cross_attentions(transformers.BertModel)


def test_a_swapped_class_records_outputs_without_being_constructed():
    """register_output_recording: a model whose class is swapped to a bert_fast class (never
    constructed) returns what transformers' own output capture records (4.x: nothing to do)."""
    config = tiny_bert_config()
    compat.set_attention_implementation(config, "eager")
    hf = transformers.BertModel(config).to(DEVICE).eval()
    swapped = type("SwappedBert", (transformers.BertModel,), {})  # a class no instance was built of
    compat.register_output_recording(swapped)
    hf.__class__ = swapped
    ids, mask = inputs(config)
    with torch.no_grad():
        out = hf(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == len(out.hidden_states) - 1 == config.num_hidden_layers


@pytest.mark.parametrize(
    "model_cls,config_cls",
    [
        (transformers.BertModel, transformers.BertConfig),
        (transformers.RobertaModel, transformers.RobertaConfig),
        (transformers.ElectraModel, transformers.ElectraConfig),
    ],
)
def test_the_position_embedding_type_probe_says_what_transformers_does(model_cls, config_cls):
    """The probe (parameters of a layer built with relative_key) against behaviour: transformers'
    model with relative_key gives other outputs than with absolute positions on the same weights
    exactly where the probe says it honours the field."""
    kw = dict(vocab_size=50, hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32)
    absolute = config_cls(**kw, pad_token_id=1)
    relative = config_cls(**kw, pad_token_id=1)
    relative.position_embedding_type = "relative_key"
    for c in (absolute, relative):
        compat.set_attention_implementation(c, "eager")
    torch.manual_seed(0)
    a = model_cls(absolute).eval()
    r = model_cls(relative).eval()
    r.load_state_dict(a.state_dict(), strict=False)  # 4.x: r's distance embeddings stay its own
    ids = torch.randint(3, 50, (2, 6))
    with torch.no_grad():
        same = torch.allclose(a(ids).last_hidden_state, r(ids).last_hidden_state)
    layer_cls = type(a.encoder.layer[0])
    assert compat.reads_position_embedding_type(layer_cls, config_cls) is (not same)


@pytest.mark.parametrize("head_dim", [8, 160])
def test_head_dims_the_kernels_do_not_cover_run_correctly(head_dim):
    config = tiny_bert_config(hidden=2 * head_dim, heads=2, inter=128)
    hf, fast = pair(config)
    ids, mask = inputs(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            ref = hf(ids, attention_mask=mask).last_hidden_state
            out = fast(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(real(out, mask), real(ref, mask), atol=3e-5, rtol=1e-5)


def test_gradient_checkpointing_with_an_unfused_piece_matches_transformers():
    """transformers' own gradient_checkpointing_enable() on a head model, with a hook that makes a
    block run unfused (its mask is bert_fast's): loss and gradients equal transformers'. On
    transformers 5.24 this crashed with a TypeError inside forward before compat.py."""
    config = tiny_bert_config()
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(config)
    fast = bert_fast.BertForSequenceClassification(config)
    fast.load_state_dict(hf.state_dict())
    ids, mask = inputs(config)
    labels = torch.tensor([0, 1, 0], device=DEVICE)
    grads = []
    for model in (hf, fast):
        model.to(DEVICE).train()
        model.gradient_checkpointing_enable()
        model.bert.encoder.layer[1].attention.register_forward_hook(lambda mod, a, o: None)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l_hf, g_hf), (l_fast, g_fast) = grads
    torch.testing.assert_close(l_fast, l_hf, atol=1e-5, rtol=1e-5)
    assert g_fast.keys() == g_hf.keys()
    for name in g_hf:
        torch.testing.assert_close(g_fast[name], g_hf[name], atol=1e-4, rtol=1e-4, msg=name)


FSDP2_SCRIPT = r"""
import os, socket, sys
import torch, transformers, torch.distributed as dist
import bert_fast
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
cfg = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
torch.manual_seed(0)
m = bert_fast.BertForMaskedLM(cfg)
ids = torch.randint(1, 100, (2, 9)); mask = torch.ones(2, 9, dtype=torch.long); mask[1, 5:] = 0
ref = m(ids, attention_mask=mask).logits.detach()
mesh = init_device_mesh("cpu", (1,))
for layer in m.bert.encoder.layer:
    fully_shard(layer, mesh=mesh)
fully_shard(m, mesh=mesh)
assert type(m.bert.encoder.layer[0]).__name__.startswith("FSDP"), type(m.bert.encoder.layer[0])
assert m.bert.unfused_pieces() == {}, m.bert.unfused_pieces()
out = m(ids, attention_mask=mask).logits
out.sum().backward()
assert (out.detach() - ref).abs().max().item() < 1e-5
dist.destroy_process_group()
print("FUSED-OK")
"""


def test_fsdp2_wrapped_layers_stay_fused():
    """fully_shard swaps each layer's class for FSDP's subclass and hooks it: bert_fast still sees
    its own layers (nothing reported unfused), and forward/backward run with the same outputs."""
    if compat._fsdp_module_class() is None:
        pytest.skip("this torch has no FSDP2")
    proc = subprocess.run(
        [sys.executable, "-c", FSDP2_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )
    assert proc.returncode == 0 and "FUSED-OK" in proc.stdout, proc.stderr[-3000:]


def test_the_probes_a_forward_may_run_leave_the_callers_rng_alone():
    """The feature probes build small transformers models on first use, inside a user's forward:
    they must not move the global RNG (a training step's dropout masks would change)."""
    probes = (compat.tuple_keeps_empty_pooler, compat.hidden_states_selection, compat.mask_form_meaning)
    for probe in probes:
        probe.cache_clear()
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    compat.tuple_keeps_empty_pooler()
    compat.hidden_states_selection()
    compat.mask_form_meaning(transformers.BertModel, "eager", "4d_bool")
    assert torch.equal(torch.rand(4), want)
