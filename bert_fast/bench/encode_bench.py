"""``bert-fast bench --encode``: sentence-transformers' encode() with and without bert_fast.optimize().

What a user of sentence embeddings runs: ``SentenceTransformer(folder).encode(sentences)`` on a
list of real, mixed-length sentences (bert_fast/data/encode_sentences.txt: 200 lines of one to ten
sentences from the shipped demo corpus; ``--encode-sentences FILE`` for your own, one per line).
Each provider is its own SentenceTransformer loaded from the same folder:

  st+optimize            the model after ``bert_fast.optimize(model)`` (the subject of the speedup)
  st+optimize+freeze     after ``bert_fast.optimize(model, freeze=True)`` (packed inference
                         weights; on the CPU where this torch can pack them)
  sentence-transformers  the model as loaded

timed side by side in interleaved rounds (bert_fast.bench.timing.measure), one call = one
encode() of the whole list at ``--encode-batch`` (default 32, sentence-transformers' own default).
Parity: the largest |difference| and the smallest cosine between the two embeddings of each sentence.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from bert_fast.bench.model_workload import BenchError
from bert_fast.bench.results import fill_speedups, new_record, record_failure, take_timings
from bert_fast.model.facts import step_flops

SUBJECT = "st+optimize"
FROZEN = "st+optimize+freeze"
BASELINE = "sentence-transformers"
DEFAULT_SENTENCES = Path(__file__).resolve().parents[1] / "data" / "encode_sentences.txt"


def read_sentences(path: Optional[str]) -> List[str]:
    p = Path(path).expanduser() if path else DEFAULT_SENTENCES
    if not p.is_file():
        raise BenchError(f"--encode-sentences: no such file {p}")
    sentences = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not sentences:
        raise BenchError(f"--encode-sentences: {p} holds no sentences")
    return sentences


def _load(folder: str, device):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never reach a hub
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise BenchError(f'--encode needs sentence-transformers (pip install -e ".[test]"): {exc}') from None
    return SentenceTransformer(folder, device=str(device))


def make_case(
    folder: str, sentences: List[str], batch_size: int, dtype_name: str, name: str, sentences_file: Optional[str]
) -> Dict[str, Any]:
    return {
        "model": folder,
        "model_name": name,
        "mode": "encode",
        "batch": len(sentences),
        "seq": None,
        "lengths": f"sentences:{Path(sentences_file).name if sentences_file else DEFAULT_SENTENCES.name}",
        "encode_batch_size": batch_size,
        "dtype": dtype_name,
        "cuda_graphs": False,
        "subject": SUBJECT,
        "frozen_provider": FROZEN,
        "parity": None,
        "results": [],
        "_sentences": sentences,
    }


def run_encode_case(
    case: Dict[str, Any],
    device,
    *,
    rounds: Dict[str, Any],
    max_seconds: Optional[float],
    ceilings: Dict[str, Any],
    timer=None,
    on_round=None,
) -> Dict[str, Any]:
    """Time the --encode case's providers side by side; ``rounds``: measure()'s warmup, min_rounds,
    max_rounds and target (model_options.rounds_args)."""
    from bert_fast.bench.timing import measure

    recs: Dict[str, Dict[str, Any]] = {}
    models, fns = _load_providers(case, device, recs)
    st = next(iter(models.values()), None)
    if st is not None:
        _count_tokens(case, st)
    _parity(case, _first_calls(fns, recs))
    if fns:
        m = measure(fns, device, **rounds, budget_s=max_seconds, timer=timer, on_round=on_round)
        case["timing"] = m.summary(target_rel=rounds["target"])
        _fill_rates(case, m, recs, ceilings.get("matmul_tflops"))
        fill_speedups(case, m, subject=SUBJECT, frozen=FROZEN)
    models.clear()
    return case


def _load_providers(case: Dict[str, Any], device, recs: Dict[str, Dict[str, Any]]):
    """(models, encode callables) of the providers that load, each with its record in ``recs`` and
    case["results"] (FROZEN only on a CPU where this torch packs the weights)."""
    import torch

    import bert_fast
    from bert_fast.model import frozen

    sentences = case["_sentences"]
    bs = case["encode_batch_size"]
    models, fns = {}, {}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(case["dtype"])
    can_freeze = (
        torch.device(device).type == "cpu" and frozen.available() and (dtype is None or frozen.dtype_supported(dtype))
    )
    for provider in (SUBJECT, FROZEN, BASELINE) if can_freeze else (SUBJECT, BASELINE):
        rec = recs[provider] = new_record(provider)
        case["results"].append(rec)
        try:
            st = _load(case["model"], device)
            if provider == SUBJECT:
                bert_fast.optimize(st)
                rec["notes"] = ["bert_fast.optimize(SentenceTransformer)"]
            elif provider == FROZEN:
                bert_fast.optimize(st, freeze=True)
                rec["notes"] = ["bert_fast.optimize(SentenceTransformer, freeze=True)"]
            models[provider] = st
            fns[provider] = lambda m=st: m.encode(
                sentences, batch_size=bs, convert_to_tensor=True, show_progress_bar=False
            )
        except BenchError:
            raise
        except Exception as exc:  # noqa: BLE001 - one provider failing must not lose the other
            record_failure(rec, exc)
    return models, fns


def _count_tokens(case: Dict[str, Any], st) -> None:
    """The real tokens of one call (after the model's own truncation), their FLOPs and the config."""
    sentences = case["_sentences"]
    # the model's own tokenizer and truncation, as encode() applies them
    lens = [len(ids) for ids in st.tokenizer(sentences, truncation=True, max_length=st.max_seq_length)["input_ids"]]
    cfg = st[0].auto_model.config
    case.update(
        real_tokens=int(sum(lens)),
        seq=int(max(lens)),
        max_seq_length=st.max_seq_length,
        flops_per_step=float(step_flops(cfg, lens, "infer")),
        config={
            k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        },
    )


def _first_calls(fns: Dict[str, Any], recs: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Each provider's first call (warm, and its embeddings kept for parity); one that fails is
    recorded and leaves ``fns``."""
    import torch

    outs = {}
    for provider, fn in list(fns.items()):
        try:
            with torch.no_grad():
                outs[provider] = fn().float().cpu()
        except Exception as exc:  # noqa: BLE001
            record_failure(recs[provider], exc)
            fns.pop(provider)
    return outs


def _parity(case: Dict[str, Any], outs: Dict[str, Any]) -> None:
    """case["parity"] (SUBJECT) and case["parity_frozen"] (FROZEN) against BASELINE's embeddings."""
    import torch

    for key, who in (("parity", SUBJECT), ("parity_frozen", FROZEN)):
        if BASELINE in outs and who in outs:
            a, b = outs[BASELINE], outs[who]
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            case[key] = {
                "reference": BASELINE,
                "max_abs_diff": float((a - b).abs().max()),
                "min_cosine": float(cos.min()),
                "ref_max_abs": float(a.abs().max()),
            }


def _fill_rates(case: Dict[str, Any], m, recs: Dict[str, Dict[str, Any]], rate: Optional[float]) -> None:
    """The timed providers' figures, tokens/s, TFLOP/s and MFU against ``rate`` (the GEMM ceiling)."""
    for provider in take_timings(m, recs, log=False):
        rec = recs[provider]
        sec = rec["median_ms"] * 1e-3
        rec["tokens_per_s"] = case.get("real_tokens", 0) / sec
        rec["padded_tokens_per_s"] = None
        rec["tflops"] = case.get("flops_per_step", 0.0) / sec / 1e12
        rec["mfu"] = rec["tflops"] / rate if rate else None
