"""A differential fuzzer of the drop-in: bert_fast against transformers on random cases.

Each case draws (hypothesis) a family and a model class (the base model or a head), a tiny config
(head dims 8-64, odd widths, ELECTRA's embedding_size, position types, activations), how bert_fast
gets the model (``optimize()`` on a copy of transformers' model, or bert_fast's class loaded with
its state dict) and in which mode (plain, frozen, int8; unpadded or padded; eval or train), the
keywords (output_attentions / output_hidden_states by keyword or config, return_dict,
token_type_ids, position_ids, inputs_embeds, head_mask where transformers takes it, 2-D / 3-D /
4-D masks, labels) and the inputs (lengths 1..max, all-pad rows, left padding).

Every case must end one of two ways:
  answered: the same outputs as transformers (structure and values by the 2x rule against
            transformers in float64, at the positions bert_fast promises: tests/dropin/dropin_diff.py),
            and where it trains, the same gradients;
  refused:  a clear error (tests/dropin/dropin_diff.REFUSALS) raised before any output; or transformers
            refuses the same call and so does bert_fast.
Anything else fails: a None where transformers gives a value, a missing field, another shape or
number, a crash.

Run by tests/dropin/test_dropin_fuzz.py (one process per family, a fixed seed, a bounded number of
cases), or longer on demand:
    python tests/dropin/dropin_fuzz.py --examples 400 --seed 1 [--family bert ...]
It prints how many cases ran, how many were answered and the refusals by reason (JSON).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import inspect
import json
import os
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch
import transformers
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dropin_diff import (  # noqa: E402
    FAMILIES,
    MODEL_CLASSES,
    NUM_LABELS,
    PAD,
    Positions,
    assert_same_grads,
    assert_same_outputs,
    cosine_rows,
    make_config,
    max_tokens,
    refusal_reason,
)

# Activations transformers' ACT2FN accepts (bert_fast runs the GELUs, refuses the others).
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "gelu_fast", "quick_gelu", "tanh")
MASKS = ("none", "long", "bool", "float01", "3d", "4d_bool", "4d_bool_full", "4d_additive", "4d_additive_full")
MAX_POS = 24


@dataclass
class Case:
    family: str
    model_class: str
    config: dict
    load: str  # "optimize" (a copy of transformers' model converted) or "class" (bert_fast's own)
    mode: str  # plain / frozen / int8
    padded: bool
    train: bool
    lengths: list  # real tokens per row (0: an all-pad row)
    left: list  # per row: pads on the left
    seqlen: int
    choices: int  # ForMultipleChoice: 2, else 0
    mask: str
    kw: dict = field(default_factory=dict)  # output_attentions, output_hidden_states, return_dict, ...
    via_config: tuple = ()  # flags set on the config instead of passed
    labels: bool = False
    seed: int = 0


@functools.lru_cache(maxsize=None)
def takes_sdpa(family: str) -> bool:
    """Whether the installed transformers builds the family with sdpa attention (4.41: BERT only)."""
    try:
        getattr(transformers, MODEL_CLASSES[family][0])(make_config(family, attn="sdpa"))
    except ValueError:
        return False
    return True


@st.composite
def cases(draw, family: str):
    base, *heads_of = MODEL_CLASSES[family]
    model_class = base if draw(st.integers(0, 2)) == 0 else draw(st.sampled_from(heads_of))
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from((8, 9, 13, 16, 26, 32, 40, 64)))  # odd widths: 9, 13 x odd heads
    train = draw(st.booleans())
    config = dict(
        attn=draw(st.sampled_from(("eager", "sdpa") if takes_sdpa(family) else ("eager",))),
        head_dim=head_dim,
        heads=heads,
        layers=draw(st.integers(1, 3)),
        intermediate=draw(st.sampled_from((17, 48, 64, 100))),
        act=draw(st.sampled_from(ACTIVATIONS)) if draw(st.integers(0, 4)) == 0 else "gelu",
        max_pos=MAX_POS,
        dropout=0.1 if train and draw(st.integers(0, 5)) == 0 else 0.0,
        model_class=model_class,
    )
    if family == "electra":
        config["embedding_size"] = draw(st.sampled_from((None, 12, 20)))
    if family != "distilbert" and draw(st.integers(0, 6)) == 0:
        config["position_embedding_type"] = draw(st.sampled_from(("relative_key", "relative_key_query")))
    longest = MAX_POS - PAD[family] - 1 if family in ("roberta", "xlm_roberta") else MAX_POS
    seqlen = draw(st.integers(1, min(longest, 16)))
    choices = 2 if model_class.endswith("ForMultipleChoice") else 0
    rows = draw(st.integers(1, 3))
    mask = draw(st.sampled_from(("none", "long", "long", "bool") if choices else MASKS))
    full = [seqlen] * rows
    lengths = full if mask == "none" else draw(st.lists(st.integers(0, seqlen), min_size=rows, max_size=rows))
    left = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    kw = {}
    via_config = []
    flag = draw(st.sampled_from((None, None, False, True, "config")))
    if flag == "config":
        via_config.append("output_attentions")
    elif flag is not None:
        kw["output_attentions"] = flag
    hidden = draw(st.sampled_from((None, None, False, True, "config", "index", "list")))
    if hidden == "config":
        via_config.append("output_hidden_states")
    elif hidden == "index":
        kw["output_hidden_states"] = draw(st.integers(-4, 3))
    elif hidden == "list":
        kw["output_hidden_states"] = draw(st.lists(st.integers(-4, 3), min_size=1, max_size=3))
    elif hidden is not None:
        kw["output_hidden_states"] = hidden
    return_dict = draw(st.sampled_from((None, True, False)))
    if return_dict is not None:
        kw["return_dict"] = return_dict
    for name, one_in in (("token_type_ids", 4), ("position_ids", 4), ("inputs_embeds", 4), ("head_mask", 8)):
        if draw(st.integers(1, one_in)) == 1:
            kw[name] = True  # built in make_inputs, where transformers' forward takes it
    return Case(
        family=family,
        model_class=model_class,
        config=config,
        load=draw(st.sampled_from(("optimize", "class"))),
        mode="plain" if train else draw(st.sampled_from(("plain", "frozen", "int8"))),
        padded=draw(st.booleans()),
        train=train,
        lengths=lengths,
        left=left,
        seqlen=seqlen,
        choices=choices,
        mask=mask,
        kw=kw,
        via_config=tuple(via_config),
        labels=model_class.endswith("Model") is False and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


# ----------------------------------------------------------------------------- building a case
def keep_mask(case: Case) -> torch.Tensor:
    """[rows, S] bool: True at real tokens."""
    keep = torch.zeros(len(case.lengths), case.seqlen, dtype=torch.bool)
    for i, (n, left) in enumerate(zip(case.lengths, case.left)):
        if left:
            keep[i, case.seqlen - n :] = n > 0
        else:
            keep[i, :n] = True
    return keep


def _mask_form(keep: torch.Tensor, form: str):
    b, s = keep.shape
    if form == "none":
        return None
    if form == "long":
        return keep.long()
    if form == "bool":
        return keep
    if form == "float01":
        return keep.float()
    if form == "3d":
        return keep[:, None, :].expand(b, s, s).long()
    four = keep[:, None, None, :] if not form.endswith("_full") else keep[:, None, None, :].expand(b, 1, s, s)
    if form.startswith("4d_bool"):
        return four
    return torch.zeros(four.shape).masked_fill(~four, torch.finfo(torch.float32).min)


def _takes(model: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(type(model).forward).parameters


def make_inputs(case: Case, config, hf) -> tuple[dict, torch.Tensor]:
    """The call's keywords for transformers and bert_fast alike, and the [N, S] keep mask."""
    g = torch.Generator().manual_seed(case.seed)
    keep = keep_mask(case)
    ids = torch.randint(3, config.vocab_size, keep.shape, generator=g).masked_fill(~keep, config.pad_token_id)
    mask = _mask_form(keep, case.mask)
    shape = keep.shape
    if case.choices:  # [B, C, S]: each row repeated per choice, the choices differing in their ids
        b = shape[0]
        keep = keep[:, None].expand(b, case.choices, case.seqlen).reshape(-1, case.seqlen)
        ids = torch.randint(3, config.vocab_size, keep.shape, generator=g).masked_fill(~keep, config.pad_token_id)
        shape = (b, case.choices, case.seqlen)
        ids = ids.view(shape)
        mask = None if mask is None else mask[:, None].expand(b, case.choices, case.seqlen).contiguous()
    inputs = {"attention_mask": mask} if mask is not None else {}
    kw = case.kw
    if kw.get("inputs_embeds"):
        with torch.no_grad():
            inputs["inputs_embeds"] = hf.get_input_embeddings()(ids).detach()
    else:
        inputs["input_ids"] = ids
    types = getattr(config, "type_vocab_size", 0)
    if kw.get("token_type_ids") and types and _takes(hf, "token_type_ids"):
        inputs["token_type_ids"] = torch.randint(0, types, shape, generator=g)
    if kw.get("position_ids") and _takes(hf, "position_ids"):
        inputs["position_ids"] = torch.randint(0, max_tokens(case.family, config), shape, generator=g)
    if kw.get("head_mask") and _takes(hf, "head_mask"):
        heads = config.num_attention_heads
        layers = getattr(config, "num_hidden_layers", getattr(config, "n_layers", 1))
        inputs["head_mask"] = torch.randint(0, 2, (layers, heads), generator=g).float()
    for name in ("output_attentions", "output_hidden_states", "return_dict"):
        if name in kw:
            inputs[name] = kw[name]
    if case.labels:
        inputs.update(_labels(case, config, ids, keep.view(shape), g))
    return inputs, keep


def _labels(case: Case, config, ids, keep, g) -> dict:
    name = case.model_class
    b = ids.shape[0]
    if name.endswith(("ForSequenceClassification",)):
        return {"labels": torch.randint(0, NUM_LABELS, (b,), generator=g)}
    if name.endswith("ForMultipleChoice"):
        return {"labels": torch.randint(0, case.choices, (b,), generator=g)}
    if name.endswith("ForNextSentencePrediction"):
        return {"labels": torch.randint(0, 2, (b,), generator=g)}
    if name.endswith("ForQuestionAnswering"):
        s = ids.shape[-1]
        return {
            "start_positions": torch.randint(0, s, (b,), generator=g),
            "end_positions": torch.randint(0, s, (b,), generator=g),
        }
    if name.endswith("ForTokenClassification"):
        return {"labels": torch.randint(0, NUM_LABELS, ids.shape, generator=g).masked_fill(~keep, -100)}
    if name == "ElectraForPreTraining":
        return {"labels": torch.randint(0, 2, ids.shape, generator=g)}
    mlm = ids.masked_fill(~keep | (torch.rand(ids.shape, generator=g) < 0.5), -100)  # MaskedLM, BertForPreTraining
    if name == "BertForPreTraining":
        return {"labels": mlm, "next_sentence_label": torch.randint(0, 2, (b,), generator=g)}
    return {"labels": mlm}


def loss_reads(case: Case) -> str:
    """Which positions the head's loss reads: "rows" (the CLS of each sequence), "all" (every
    position: the span softmax of question answering; ELECTRA's discriminator where its mask is
    not 2-D) or "labelled" (labels set at real tokens only)."""
    name = case.model_class
    if name.endswith(("ForSequenceClassification", "ForMultipleChoice", "ForNextSentencePrediction")):
        return "rows"
    if name == "BertForPreTraining":
        return "rows"
    if name.endswith("ForQuestionAnswering"):
        return "all"
    if name == "ElectraForPreTraining":
        return "labelled" if case.mask in ("long", "bool", "float01") else "all"
    return "labelled"


# ----------------------------------------------------------------------------- running a case
def _build_transformers(case: Case):
    config = make_config(case.family, **case.config)
    torch.manual_seed(case.seed)
    hf = getattr(transformers, case.model_class)(config)
    with torch.no_grad():  # nonzero biases and LayerNorm shifts, so that a missed term shows
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return config, hf.train(case.train)


def _build_ours(case: Case, config, hf, calibration):
    import bert_fast

    if case.load == "optimize":
        ours = copy.deepcopy(hf)
    else:
        ours = getattr(bert_fast, case.model_class)(copy.deepcopy(config), padded=case.padded)
        ours.load_state_dict(hf.state_dict(), strict=True)
    bert_fast.optimize(
        ours,
        padded=case.padded,
        freeze=case.mode == "frozen",
        int8=case.mode == "int8",
        calibration=calibration if case.mode == "int8" else None,
    )
    return ours.train(case.train)


def _call(model, inputs, flags):
    for f in flags:
        setattr(model.config, f, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.set_grad_enabled(model.training):
            return model(**inputs)


def _double(inputs: dict) -> dict:
    return {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "attention_mask" else v
        for k, v in inputs.items()
    }


# Calls bert_fast answers where the installed transformers raises, each held to transformers'
# answer on the equivalent call: bert_fast takes every key-padding mask form (docs/models.md), and
# where transformers refuses one (5.x: 4.x's 3-D [B, S, S] mask fails inside its mask code; 4.41: 4-D
# masks) it must equal transformers with the 2-D mask.
EQUIVALENT_CALL = {form: "long" for form in MASKS if form.startswith(("3d", "4d"))}


def run_case(case: Case) -> str:
    """'answered', 'refused: <reason>' or 'transformers refuses: <type>'; AssertionError otherwise."""
    theirs = case  # the call transformers answers: the same one, or its equivalent (EQUIVALENT_CALL)
    refusal = _transformers_refusal(case) if case.mask in EQUIVALENT_CALL else None
    if refusal is not None:
        theirs = dataclasses.replace(case, mask=EQUIVALENT_CALL[case.mask])
    try:
        config, hf = _build_transformers(theirs)
        _call(copy.deepcopy(hf), make_inputs(theirs, config, hf)[0], case.via_config)
    except Exception as e:  # noqa: BLE001 - transformers' own refusal: bert_fast must refuse too
        return _both_refuse(case, e)
    calib = {
        "input_ids": torch.randint(3, config.vocab_size, (4, 8)),
        "attention_mask": torch.ones(4, 8, dtype=torch.long),
    }
    try:
        ours = _build_ours(case, config, hf, calib)
        inputs, keep = make_inputs(case, config, hf)
        got = _call(ours, inputs, case.via_config)
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - classified below: a clear refusal or a crash
        reason = refusal_reason(e)
        if reason is None and refusal is not None:
            # transformers refuses this call itself, so any refusal will do (a head of
            # transformers' reading the mask as 2-D in its loss raises inside bert_fast too)
            return f"transformers refuses: {type(refusal).__name__}: {str(refusal)[:60]}"
        if reason is None:
            raise AssertionError(f"bert_fast crashed: {type(e).__name__}: {e}") from e
        return f"refused: {reason}"
    want = _call(hf, make_inputs(theirs, config, hf)[0], case.via_config)
    inputs64 = _double(dict(make_inputs(theirs, config, hf)[0], return_dict=True))
    hf64 = copy.deepcopy(hf).double()
    oracle = _call(hf64, inputs64, case.via_config)
    runs = Runs(ours, hf, hf64, got, want, oracle)
    _compare(case, keep, runs)
    return "answered" if theirs is case else f"answered ({case.mask} mask, as transformers answers {theirs.mask})"


def _transformers_refusal(case: Case) -> Optional[Exception]:
    """What transformers raises on ``case``'s call, or None when it answers."""
    try:
        config, hf = _build_transformers(case)
        _call(hf, make_inputs(case, config, hf)[0], case.via_config)
    except Exception as e:  # noqa: BLE001 - any refusal
        return e
    return None


def _both_refuse(case: Case, theirs: Exception) -> str:
    """transformers refused the call: bert_fast must raise too (any exception: the same code paths
    or bert_fast's own checks), never answer."""
    try:
        config = make_config(case.family, **case.config)
        torch.manual_seed(case.seed)
        hf = getattr(transformers, case.model_class)(config)
        ours = _build_ours(case, config, hf.train(case.train), None)
        _call(ours, make_inputs(case, config, hf)[0], case.via_config)
    except Exception:  # noqa: BLE001 - refused as transformers refuses
        return f"transformers refuses: {type(theirs).__name__}: {str(theirs)[:60]}"
    raise AssertionError(f"bert_fast answered a call transformers refuses ({type(theirs).__name__}: {theirs})")


@dataclass
class Runs:
    """One case's models and outputs: bert_fast's, transformers' fp32 and float64."""

    ours: torch.nn.Module
    hf: torch.nn.Module
    hf64: torch.nn.Module
    got: object
    want: object
    oracle: object


def _compare(case: Case, keep, runs: Runs) -> None:
    exact = bool(case.kw.get("output_attentions")) or "output_attentions" in case.via_config
    where = Positions.of(keep, padded=case.padded, exact=exact)
    dropout = case.train and case.config["dropout"] > 0
    int8_ran = case.mode == "int8" and not case.train and not exact
    reads = loss_reads(case)
    comparable = where.everything or reads == "labelled" or (reads == "rows" and bool(where.rows.all()))
    comparable = comparable or where.all_real()
    names = list(runs.oracle.keys()) if not isinstance(runs.want, transformers.utils.ModelOutput) else None
    assert_same_outputs(
        runs.got,
        runs.want,
        runs.oracle,
        where,
        case.model_class,
        values=not (dropout or int8_ran),
        loss_comparable=comparable,
        names=names,
    )
    if int8_ran and case.model_class.endswith("Model"):
        _assert_int8_close(runs.got, runs.want, where)
    if case.train and not dropout:
        _compare_grads(case, where, runs, comparable, names)


def _assert_int8_close(got, want, where) -> None:
    """int8's promise (the accuracy guard): mean-pooled outputs within min cosine 0.99 of fp32.
    Held on the call's rows that hold real tokens, a looser bound than calibration's (0.97)
    because these inputs were not the calibration batch."""
    a, b = got[0], want[0]
    m = where.tokens[:, :, None].to(a.dtype)
    alive = where.tokens.any(dim=1)
    pooled = [(t * m).sum(1)[alive] / m.sum(1)[alive] for t in (a, b)]
    cos = cosine_rows(*pooled)
    assert cos >= 0.97, f"int8 mean-pooled min cosine {cos:.4f} < 0.97"


def _loss(case, where, out, names, comparable):
    """The scalar every model backpropagates: the head's loss where it is comparable, else a fixed
    weighted sum of the first output's comparable values."""
    fields = dict(out.items()) if isinstance(out, transformers.utils.ModelOutput) else dict(zip(names, out))
    if "loss" in fields and comparable:
        return fields["loss"]
    name, first = next((k, v) for k, v in fields.items() if k != "loss")
    from dropin_diff import _field_kind, _select

    picked = _select(first, _field_kind(name, case.model_class), where)
    w = torch.linspace(-1.0, 1.0, picked.numel(), dtype=picked.dtype).view_as(picked)
    return (picked * w).sum()


def _compare_grads(case: Case, where: Positions, runs: Runs, comparable: bool, names) -> None:
    pairs = ((runs.ours, runs.got), (runs.hf, runs.want), (runs.hf64, runs.oracle))
    for model, out in pairs:
        model.zero_grad(set_to_none=True)
        _loss(case, where, out, names or list(runs.oracle.keys()), comparable).backward()
    assert_same_grads(runs.ours, runs.hf, runs.hf64, rows=int(where.tokens.numel()))


# ----------------------------------------------------------------------------- the fuzz loop
def fuzz(families, examples: int, seed: int, budget_s: float = 0.0) -> dict:
    """Run ``examples`` cases per family; returns the report. Raises on the first failing case
    (hypothesis shrinks it and prints it)."""
    report = {"cases": 0, "answered": Counter(), "refused": Counter(), "families": {}}
    coverage = Counter()
    start = time.monotonic()
    for family in families:
        t0 = time.monotonic()
        counts = Counter()

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=(Phase.explicit, Phase.generate, Phase.shrink),
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        )
        @hypothesis_seed(seed)
        @given(case=cases(family))
        def run(case):
            if budget_s and time.monotonic() - start > budget_s:
                return  # over the budget: the rest of the cases are drawn but not run
            outcome = run_case(case)
            counts[outcome] += 1
            if outcome.startswith("answered"):
                coverage.update(_traits(case))

        run()
        report["families"][family] = {"cases": sum(counts.values()), "seconds": round(time.monotonic() - t0, 1)}
        for outcome, n in counts.items():
            report["cases"] += n
            if outcome.startswith("answered"):
                report["answered"][outcome] += n
            else:
                report["refused"][outcome] += n
    report["answered"] = dict(report["answered"].most_common())
    report["answered_with"] = dict(sorted(coverage.items()))
    report["refused"] = dict(report["refused"].most_common())
    return report


def _traits(case: Case) -> list:
    """What an answered case exercised, for the report's coverage counts."""
    attn = bool(case.kw.get("output_attentions")) or "output_attentions" in case.via_config
    hidden = case.kw.get("output_hidden_states") not in (None, False) or "output_hidden_states" in case.via_config
    traits = [f"model={'base' if case.model_class.endswith('Model') else 'head'}", f"load={case.load}"]
    traits += [f"mode={case.mode}", f"layout={'padded' if case.padded else 'unpadded'}"]
    traits += [f"{'train' if case.train else 'eval'}", f"mask={case.mask}", f"attn={case.config['attn']}"]
    traits += ["output_attentions"] * attn + ["output_hidden_states"] * hidden + ["labels"] * case.labels
    traits += [k for k in ("inputs_embeds", "position_ids", "token_type_ids") if case.kw.get(k)]
    traits += ["all-pad row"] * (0 in case.lengths) + ["left padding"] * any(
        left and 0 < n < case.seqlen for n, left in zip(case.lengths, case.left)
    )
    return traits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=FAMILIES, help="default: all five")
    parser.add_argument("--examples", type=int, default=100, help="cases per family")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=0.0, help="stop running cases after this many seconds")
    args = parser.parse_args(argv)
    report = fuzz(args.family or FAMILIES, args.examples, args.seed, args.budget_s)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
