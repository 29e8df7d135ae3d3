"""``bert-fast bench --mode train-mlm``: one MLM training step of bert_fast against transformers.

Providers, all from one state dict (seeded random weights, or a --model checkpoint's own), on the
same input batches (random token ids, never special ids; 15% of the real positions masked: the
label is the id, the input is [MASK]) and the same micro batch:

  bert_fast    bert_fast.BertForMaskedLM, MLM head on the masked positions only (what
               ``bert-fast train`` runs by default)
  hf-sdpa      transformers.BertForMaskedLM, attn_implementation="sdpa"
  hf-compile   that model under torch.compile (bert_fast.bench.model_providers.hf_compile_mode: on
               CUDA mode="max-autotune-no-cudagraphs", on the CPU the default), same loop; asked
               for by name only (--providers), it is not in the default set
  hf-trainer   transformers.Trainer training that transformers model over the same examples
               (AdamW, grad-norm clipping 1.0, its own data loader and loop; bf16=True on bf16)

bert_fast, hf-sdpa and hf-compile run the same step: zero_grad, forward with labels (the model's own MLM loss),
backward, clip_grad_norm_(1.0), AdamW step (fused on CUDA), under torch.autocast in --dtype bf16
(fp32 master weights, as ``bert-fast train --precision bf16``) and in fp32 otherwise. They are
timed side by side in interleaved rounds after warm-up (bert_fast.bench.timing.measure); Trainer
runs its own loop, timed from one step's end to the next (a TrainerCallback), after warm-up steps.
Figures: median ms per step and its 95% interval, tokens/s on real tokens, MFU = model FLOPs
(bert_fast.model.facts.step_flops, x3 for forward + backward, the encoder's matmuls and attention)
/ time / the measured GEMM rate of the device in the compute dtype (or BERT_FAST_PEAK_TFLOPS, e.g. 989
for an H100 SXM's dense bf16).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

PROVIDERS = ("bert_fast", "hf-sdpa", "hf-compile", "hf-trainer")
DEFAULT_PROVIDERS = ("bert_fast", "hf-sdpa", "hf-trainer")
MASK_PROB = 0.15


def make_batches(config, batch: int, seq: int, lengths: List[int], n: int, seed: int) -> List[Dict[str, Any]]:
    """``n`` MLM batches [batch, seq]: random ids in [5, vocab) (never pad/CLS/SEP/MASK of a BERT
    vocabulary), padding past each length, ~15% of the real positions masked (at least one)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mask_id = 103 if config.vocab_size > 103 else 4
    lens = torch.tensor(lengths)
    out = []
    for _ in range(n):
        ids = torch.randint(5, config.vocab_size, (batch, seq), generator=g)
        attn = (torch.arange(seq)[None, :] < lens[:, None]).long()
        pick = (torch.rand(batch, seq, generator=g) < MASK_PROB) & attn.bool()
        pick[torch.arange(batch), torch.zeros(batch, dtype=torch.long)] |= ~pick.any(dim=1)
        labels = torch.where(pick, ids, torch.full_like(ids, -100))
        inputs = torch.where(pick, torch.full_like(ids, mask_id), ids) * attn
        out.append(dict(input_ids=inputs, attention_mask=attn, token_type_ids=torch.zeros_like(ids), labels=labels))
    return out


def _optimizer(model, device):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(params, lr=1e-5, fused=True)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(params, lr=1e-5)


def loop_step(model, optimizer, batch: Dict[str, Any], amp_dtype, device):
    """The step both loop providers run (see the module doc)."""
    import contextlib

    import torch

    ctx = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with ctx:
            loss = model(**batch).loss
        loss.float().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def build_models(config, device, seed: int):
    """(bert_fast model, transformers model factory) with one state dict."""
    import torch
    import transformers

    import bert_fast
    from bert_fast.model import compat

    config = transformers.BertConfig.from_dict(config.to_dict())
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.1
    torch.manual_seed(seed)
    fast = bert_fast.BertForMaskedLM(config, mlm_masked_positions_only=True)
    state = {k: v.detach().clone() for k, v in fast.state_dict().items()}

    def hf():
        cfg = transformers.BertConfig.from_dict(config.to_dict())
        compat.set_attention_implementation(cfg, "sdpa")
        m = transformers.BertForMaskedLM(cfg)
        m.load_state_dict(state, strict=True)
        return m.to(device).train()

    return fast.to(device).train(), hf


def trainer_step_times(make_model, batches, batch: int, dtype_name: str, device, warmup: int, steps: int, seed: int):
    """Per-step seconds of transformers.Trainer over the rows of ``batches`` (after ``warmup``
    steps), measured between consecutive on_step_end callbacks."""
    import torch
    import transformers

    from bert_fast.bench.timing import synchronize

    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(v_len(b))]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    stamps: List[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ARG002
            synchronize(device)
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        targs = transformers.TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=batch,
            max_steps=warmup + steps + 1,
            learning_rate=1e-5,
            optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
            max_grad_norm=1.0,
            logging_strategy="no",
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
            bf16=dtype_name == "bf16",
            use_cpu=device.type == "cpu",
            seed=seed,
        )
        trainer = transformers.Trainer(
            model=make_model(),
            args=targs,
            train_dataset=Rows(),
            data_collator=transformers.default_data_collator,
            callbacks=[Clock()],
        )
        trainer.train()
        del trainer
    deltas = [b - a for a, b in zip(stamps, stamps[1:])]
    return deltas[warmup:]


def _device(name, error):
    """--device as a torch.device (the checks of model_bench.resolve_device, which this module
    cannot import: model_bench imports it)."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise error(f"--device {name!r} is not a device (use cuda, cuda:N or cpu)") from None
    if dev.type not in ("cuda", "cpu"):
        raise error(f"--device {name}: only cuda and cpu are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise error(f"--device {name}: torch sees no CUDA GPU (torch {torch.__version__})")
    return dev


def v_len(batch: Dict[str, Any]) -> int:
    return int(batch["input_ids"].shape[0])


class _Plan:
    """What one --mode train-mlm run measures: the arguments with their defaults filled (sets
    args.threads); a BenchError for what it cannot run."""

    def __init__(self, args):
        import torch

        from bert_fast.bench import timing
        from bert_fast.bench.model_workload import BenchError, load_config, parse_lengths

        self.device = _device(args.device, BenchError)
        cuda = self.device.type == "cuda"
        args.threads = timing.fix_threads(args.threads)
        self.model = (args.model or "bert-base").split(",")[0]
        self.batch = (args.batch or [32 if cuda else 8])[0]
        self.seq = seq = (args.seq or [128])[0]
        # the bench's --dtype parses to a list (a table each for inference); a training run times one
        dtypes = [args.dtype] if isinstance(args.dtype, str) else list(args.dtype or [])
        if len(dtypes) > 1:
            raise BenchError(f"--mode train-mlm times one --dtype at a time; got {','.join(dtypes)}")
        self.dtype_name = dtypes[0] if dtypes else ("bf16" if cuda else "fp32")
        if self.dtype_name == "fp16":
            raise BenchError("--mode train-mlm runs fp32 or bf16 (autocast); fp16 needs loss scaling")
        self.providers = [p for p in (args.providers or DEFAULT_PROVIDERS) if p in PROVIDERS] or list(DEFAULT_PROVIDERS)
        unknown = [p for p in (args.providers or []) if p not in PROVIDERS]
        if unknown:
            raise BenchError(f"--mode train-mlm providers are {', '.join(PROVIDERS)}; got {', '.join(unknown)}")
        self.config = config = load_config(self.model)
        if seq > config.max_position_embeddings:
            raise BenchError(
                f"--seq {seq} exceeds the model's max_position_embeddings={config.max_position_embeddings}"
            )
        self.lengths = parse_lengths(args.lengths or "full", self.batch, seq, args.seed)
        self.amp_dtype = torch.bfloat16 if self.dtype_name == "bf16" else None  # None: fp32, no autocast
        self.warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
        self.min_rounds = args.min_rounds or (10 if cuda else 6)
        self.max_rounds = args.max_rounds or (200 if cuda else 100)
        self.budget = args.max_seconds if args.max_seconds is not None else (20.0 if cuda else 60.0)
        self.n_inputs = max(1, getattr(args, "n_inputs", 3))
        self.notes: List[str] = []


def _peak(device, amp_dtype):
    """(TFLOP/s the MFU divides by, where it comes from)."""
    import torch

    from bert_fast.bench import ceilings as ceil_mod

    peak_env = os.environ.get("BERT_FAST_PEAK_TFLOPS")  # as benchmarks/training/bench_train.py: a given peak
    if peak_env:
        return float(peak_env), "BERT_FAST_PEAK_TFLOPS"
    gemm_dtype = torch.bfloat16 if amp_dtype is not None else torch.float32
    return ceil_mod.measure(device, gemm_dtype)["matmul_tflops"], "measured GEMM rate"


def _time_loops(plan: _Plan, fast, make_hf, batches):
    """(results, measurement) of the loop providers, timed side by side (None: neither asked for)."""
    from bert_fast.bench import timing

    loop_providers: Dict[str, Any] = {}
    for name, make_model in (("bert_fast", lambda: fast), ("hf-sdpa", make_hf), ("hf-compile", make_hf)):
        if name in plan.providers:
            model = make_model()
            if name == "hf-compile":
                model = _compiled(model, plan)
            opt = _optimizer(model, plan.device)
            loop_providers[name] = [loop_step(model, opt, b, plan.amp_dtype, plan.device) for b in batches]
    results: Dict[str, Dict[str, Any]] = {}
    if not loop_providers:
        return results, None
    m = timing.measure(
        loop_providers,
        plan.device,
        warmup=plan.warmup,
        min_rounds=plan.min_rounds,
        max_rounds=plan.max_rounds,
        budget_s=plan.budget,
    )
    for name, err in m.errors.items():
        results[name] = {"error": f"{type(err).__name__}: {err}"}
    for name, t in m.timings.items():
        results[name] = {"timing": t.to_dict(), "median_ms": t.median_ms}
    return results, m


def _compiled(model, plan: _Plan):
    """``model`` under torch.compile in the hf-compile rival's mode, which the run's notes name."""
    import torch

    from bert_fast.bench.model_providers import HF_COMPILE_MODES, hf_compile_mode

    mode = hf_compile_mode(plan.device, cuda_graphs=False)
    plan.notes.append("hf-compile: " + HF_COMPILE_MODES[mode])
    return torch.compile(model, mode=mode)


def _time_trainer(plan: _Plan, make_hf, batches_cpu, seed: int) -> Dict[str, Any]:
    """hf-trainer's result: its median step over min_rounds timed steps after warm-up."""
    steps = plan.min_rounds  # timed Trainer steps after warm-up
    try:
        deltas = trainer_step_times(
            make_hf, batches_cpu, plan.batch, plan.dtype_name, plan.device, max(1, plan.warmup), steps, seed
        )
        return {"median_ms": 1e3 * statistics.median(deltas), "steps_timed": len(deltas)}
    except Exception as exc:  # noqa: BLE001 - a broken Trainer install must not hide the other figures
        return {"error": f"{type(exc).__name__}: {exc}"}


def _add_rates(results: Dict[str, Dict[str, Any]], m, tokens: int, flops: float, peak: float) -> None:
    """Tokens/s and MFU of every timed provider, and bert_fast's speedup over each other one."""
    for r in results.values():
        if "median_ms" in r:
            s = r["median_ms"] / 1e3
            r["tokens_per_s"] = tokens / s
            r["mfu"] = flops / s / (peak * 1e12)
    base = results.get("bert_fast", {}).get("median_ms")
    for name, r in results.items():
        if name != "bert_fast" and base and "median_ms" in r:
            r["bert_fast_speedup"] = r["median_ms"] / base  # > 1: bert_fast's step is faster
            if m is not None and name in m.timings and "bert_fast" in m.timings:
                sp = m.speedup("bert_fast", name)
                if sp is not None:
                    r["bert_fast_speedup_ci"] = [sp.ci_low, sp.ci_high]


def _print_table(plan: _Plan, results, peak: float, peak_source: str, flops: float) -> None:
    """The MFU peak, then one row per provider: ms per step, tokens/s, MFU, bert_fast's speedup."""
    print(
        f"MFU peak ({plan.dtype_name}, {peak_source}): {peak:.3g} TFLOP/s; model FLOPs per step {flops / 1e9:.2f} GFLOP"
    )
    print(f"{'provider':<12} {'ms/step':>10} {'tokens/s':>12} {'MFU':>7}  bert_fast speedup")
    for name in plan.providers:
        r = results.get(name, {})
        if "error" in r:
            print(f"{name:<12} error: {r['error']}")
            continue
        if "median_ms" not in r:
            continue
        sp = r.get("bert_fast_speedup")
        ci = r.get("bert_fast_speedup_ci")
        sp_text = "" if sp is None else f"{sp:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
        print(f"{name:<12} {r['median_ms']:>10.2f} {r['tokens_per_s']:>12,.0f} {100 * r['mfu']:>6.1f}%  {sp_text}")


def run(args) -> int:
    """Run the MLM training-step benchmark for the parsed ``bert-fast bench`` arguments (the first
    --model, --batch and --seq; --lengths; --dtype; --providers among PROVIDERS; --warmup,
    --min-rounds, --max-rounds, --max-seconds; --json)."""
    import torch

    from bert_fast.model.facts import step_flops

    plan = _Plan(args)
    device = plan.device
    print(
        f"bert-fast bench --mode train-mlm: {plan.model} B={plan.batch} S={plan.seq} "
        f"lengths={args.lengths or 'full'} {plan.dtype_name} on {device}, {args.threads} thread(s); "
        f"providers {', '.join(plan.providers)}",
        file=sys.stderr,
    )
    peak, peak_source = _peak(device, plan.amp_dtype)
    batches_cpu = make_batches(plan.config, plan.batch, plan.seq, plan.lengths, plan.n_inputs, args.seed)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches_cpu]
    flops = step_flops(plan.config, plan.lengths, "train")
    tokens = sum(plan.lengths)

    fast, make_hf = build_models(plan.config, device, args.seed)
    results, m = _time_loops(plan, fast, make_hf, batches)
    if "hf-trainer" in plan.providers:
        results["hf-trainer"] = _time_trainer(plan, make_hf, batches_cpu, args.seed)
    _add_rates(results, m, tokens, flops, peak)
    _print_table(plan, results, peak, peak_source, flops)
    for note in plan.notes:
        print(f"note: {note}")
    if args.json:
        from bert_fast.bench.results import write_json

        write_json(
            args.json,
            {
                "kind": "train-mlm",
                "model": plan.model,
                "batch": plan.batch,
                "seq": plan.seq,
                "lengths": plan.lengths,
                "dtype": plan.dtype_name,
                "device": str(device),
                "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                "threads": args.threads,
                "peak_tflops": peak,
                "peak_source": peak_source,
                "flops_per_step": flops,
                "tokens_per_step": tokens,
                "results": results,
                "notes": plan.notes,
                "timing": m.summary() if m is not None else None,
            },
        )
    return 0 if all("error" not in r for r in results.values()) else 1
