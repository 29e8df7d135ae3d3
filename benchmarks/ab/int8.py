"""int8 CPU inference (optimize(model, int8=True)): its attention's precision, our AVX2 GEMM against
fp32, and two changes to its passes (batch 1's casts and split, the residual + LayerNorm fold)."""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers

import bert_fast
from bert_fast.bench import cpu_caps, model_providers, model_workload, timing
from bert_fast.model import direct_ops, int8, int8_speed, layer
from bert_fast.ops import int8_gemm

from .harness import compare, compare_variants, dense_forward, load_minilm, variant

MODES = ("fp32", "bf16")


@variant("int8-attention", rounds=9)
def int8_attention(args) -> None:
    """An int8 model's attention: fp32 (torch's flash CPU kernel) against bf16 (our AVX-512 BF16 kernel).

    Whole no-grad forwards of the real all-MiniLM-L6-v2 and a bert-base config, side by side
    (timing.measure, 95% intervals), with the int8 attention switched by BERT_FAST_INT8_ATTENTION;
    and the accuracy of each (min cosine of the mean-pooled outputs on the 64 shipped sentences to
    the fp32 model).

        python benchmarks/cpu_ab.py int8-attention [--threads 2] [--rounds 9]
    """
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()))
    hf, tok = load_minilm()
    calib = int8.calibration_batch(tok, None)
    reference = bert_fast.optimize(copy.deepcopy(hf))
    m_int8 = bert_fast.optimize(copy.deepcopy(hf), int8=True, tokenizer=tok)
    with torch.no_grad():
        ref = int8._pooled(reference, calib)
        for mode in MODES:
            os.environ[int8.ATTENTION_ENV] = mode
            cos = int8.min_cosine_to(ref, int8._pooled(m_int8, calib))
            print(f"MiniLM int8, attention {mode}: min cosine to fp32 on the shipped sentences {cos:.5f}")
    bert = transformers.BertModel(transformers.BertConfig()).eval()
    b_int8 = bert_fast.optimize(bert, int8=True, tokenizer=tok)
    for name, model, batch in (("MiniLM", m_int8, 1), ("MiniLM", m_int8, 8), ("bert-base", b_int8, 1)):
        line = compare(int8.ATTENTION_ENV, MODES, dense_forward(model, batch), args.rounds)
        print(f"{name} int8 {batch}x128 no-grad, attention {line}")


def _avx2_arguments(ap) -> None:
    ap.add_argument("--budget-s", type=float, default=20.0, help="per case")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json / results.txt")


def _avx2_inputs(batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    ids = torch.randint(1000, min(vocab, 20000), (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _avx2_case(name: str, hf, models, cos: float, cal_s: float, batch: int, budget_s: float):
    """(the JSON row, the lines printed) of one model at ``batch`` x 128: fp32, frozen and int8 timed together."""
    x = _avx2_inputs(batch, 128, hf.config.vocab_size)
    runs = {p: (lambda m=m: m(**x)) for p, m in models.items()}
    with torch.inference_mode():
        meas = timing.measure(runs, "cpu", warmup=2, budget_s=budget_s)
    row = {"model": name, "batch": batch, "seq": 128, "int8_min_cosine": cos, "calibration_s": cal_s}
    text = [f"{name} b{batch} s128: int8 calibration min cosine {cos:.4f} ({cal_s:.1f} s)"]
    for p, t in meas.timings.items():
        row[p] = {"median_ms": t.median_ms, "ci_ms": [t.ci_low_ms, t.ci_high_ms], "unstable": t.unstable}
        text.append(f"  {p:<12} {t.median_ms:8.2f} ms  [{t.ci_low_ms:.2f}, {t.ci_high_ms:.2f}]")
    for base in ("fp32", "fp32-frozen"):
        sp = meas.speedup("int8-avx2", base)
        if sp is not None:
            row[f"int8_over_{base}"] = sp.to_dict()
            text.append(f"  int8-avx2 vs {base}: {sp.format()}")
    return row, text


def _avx2_model(name: str, hf, cal, budget_s: float):
    """The rows and lines of one model: fp32, fp32 frozen and int8 on our AVX2 GEMM, b1 and b8 x 128."""
    models = {
        "fp32": bert_fast.optimize(copy.deepcopy(hf)),
        "fp32-frozen": bert_fast.optimize(copy.deepcopy(hf), freeze=True),
    }
    q = bert_fast.optimize(copy.deepcopy(hf))
    t0 = time.perf_counter()
    cos = int8.quantize(q, cal, min_cosine=0.0, backend="avx2")  # the figure is reported, not gated here
    cal_s = time.perf_counter() - t0
    models["int8-avx2"] = q
    rows, lines = [], []
    for b in (1, 8):
        row, text = _avx2_case(name, hf, models, cos, cal_s, b, budget_s)
        print("\n".join(text), file=sys.stderr)
        rows.append(row)
        lines += text
    return rows, lines


@variant("int8-avx2", arguments=_avx2_arguments)
def int8_avx2(args) -> int:
    """int8 on CPUs without VNNI (#32 item 4): our AVX2 int8 GEMM against fp32 (plain and frozen).

    Whole no-grad forwards of bert_fast with int8 on our AVX2 GEMM against the same model in fp32
    (plain and frozen), side by side in one process, at b1 s128 and dense b8 s128, for all-MiniLM-L6-v2
    (real weights) and bert-base (random weights, its shapes).

    Run it on an AVX2-only CPU as it is. On an AVX-512 CPU, emulate one: ``ONEDNN_MAX_CPU_ISA=AVX2``
    makes oneDNN (the fp32 GEMMs) run its AVX2 code, and the int8 provider forces our AVX2 backend (on a
    real AVX2 CPU torch._int_mm is a slow loop that the speed check drops; under the emulation it would
    still run oneDNN's AVX2 int8 code, which a real AVX2 CPU never gets from torch: it is not timed).

        ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_ab.py int8-avx2 --threads 2 --out benchmarks/results/cpu-int8-avx2

    Prints, per case: medians with 95% intervals and the int8 / fp32 speedups with paired-bootstrap
    intervals, the min cosine of int8's pooled outputs to fp32, the CPU model and flags.
    """
    torch.set_num_threads(args.threads)
    caps = cpu_caps.capabilities()
    lines = [
        cpu_caps.describe(caps),
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}, threads {args.threads}, torch {torch.__version__}",
    ]
    speed = int8_speed.check()
    lines.append(f"int8 speed check: {speed.describe()}")
    print("\n".join(lines), file=sys.stderr)
    hf_minilm, tok = load_minilm()
    cal = int8.calibration_batch(tok)
    torch.manual_seed(0)
    bert_base = transformers.BertModel(transformers.BertConfig()).eval()
    results = []
    for name, hf in (("all-MiniLM-L6-v2", hf_minilm), ("bert-base (random weights)", bert_base)):
        rows, text = _avx2_model(name, hf, cal, args.budget_s)
        results += rows
        lines += text
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        env = {"cpu": caps, "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "threads": args.threads}
        env.update(torch=torch.__version__, int8_speed=speed.as_dict(), date=time.strftime("%Y-%m-%d"))
        (args.out / "results.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
        (args.out / "results.txt").write_text("\n".join(lines) + "\n")
    return 0


# --------------------------------------------------------------------- int8-b1-passes: the old code paths
_NEW_BLOCK = layer.attention_block
_NEW_DEQUANTIZE = int8_gemm.dequantize
_OLD_MIN_ELEMENTS = 1 << 17  # the old split rule: elements per thread, whatever the pass


def _old_attention_block(sa, gemms, h, batch, heads, training):
    """attention_block as it was: the int8 model's QKV in fp32, cast to bf16, the context cast back."""
    if not (batch.int8 and batch.ops is direct_ops and int8.is_int8_layer(gemms)):
        return _NEW_BLOCK(sa, gemms, h, batch, heads, training)
    qkv = gemms.qkv(h)
    if not int8.attention_in_bf16(qkv):
        return _NEW_BLOCK(sa, gemms, h, batch, heads, training)
    ctx = layer.attention_block_ops(batch.ops, qkv.to(torch.bfloat16), batch, heads, h.shape[-1], 0.0)
    return ctx.to(h.dtype).reshape(h.shape)


def _old_dequantize(acc, sx, sw, bias, dtype, gelu=None):
    """dequantize under the old split rule: one thread below 2 x 2^17 elements, GELU or not (the pass
    called with threads=1 there; the plain pass's rule is unchanged)."""
    m, n = acc.shape
    if gelu is None or m * n >= 2 * _OLD_MIN_ELEMENTS:
        return _NEW_DEQUANTIZE(acc, sx, sw, bias, dtype, gelu)
    return _NEW_DEQUANTIZE(acc, sx, sw, bias, dtype, gelu, threads=1)


def _use_old_passes(old: bool) -> None:
    layer.attention_block = _old_attention_block if old else _NEW_BLOCK
    int8_gemm.dequantize = _old_dequantize if old else _NEW_DEQUANTIZE


def _int8_provider_call(name: str, batch: int):
    """The bench's int8 provider (bert_fast.bench.model_providers) of ``name`` at ``batch`` x 128: a no-grad call."""
    key = model_workload.local_minilm() if name == "minilm" else "bert-base"
    config = model_workload.load_config(key)
    state = model_providers.reference_state_dict(config, key)
    inputs = model_workload.make_inputs(config, [128] * batch, 128, "cpu", n_sets=1)[0]
    model, runner, _ = model_providers.build_provider_model(
        model_providers.INT8, config, state, "cpu", torch.float32, "infer", False, key
    )
    model.eval()

    def call():
        with torch.no_grad():
            return runner(**inputs)

    return call


@variant("int8-b1-passes", rounds=40)
def int8_b1_passes(args) -> None:
    """Two batch-1 changes to the int8 forward (#32 item 5, 2026-11-27): the old code paths against today's.

    * casts: an int8 model's bf16 attention took its QKV through ``qkv.to(bfloat16)`` and gave its context
      back through ``ctx.to(float32)``; now the QKV GEMM's dequantize pass writes bf16 and the output GEMM
      quantizes the bf16 context as it is (the same values, tested bit for bit);
    * split: the dequantize pass with the GELU epilogue ran on one thread below 2^17 elements (batch 1's
      FFN up, 128 x 1536, 67 us); split_rows now weighs an element by its cost (GELU 4x).

    "before" runs the old code paths (the old attention block, and the GELU dequantize called with one
    thread where the old rule kept it on one), "after" today's, interleaved (bert_fast.bench.timing.measure),
    in one process.

        python benchmarks/cpu_ab.py int8-b1-passes [--rounds 40]
    """
    timing.fix_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()), f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    for name, batch in (("minilm", 1), ("minilm", 8), ("bert-base", 1)):
        line = compare_variants(
            {"before": functools.partial(_use_old_passes, True), "after": functools.partial(_use_old_passes, False)},
            _int8_provider_call(name, batch),
            args.rounds,
            restore=functools.partial(_use_old_passes, False),
            warmup=2,
        )
        print(f"{name} {batch}x128 int8: {line}")


# --------------------------------------------------------------------- int8-residual-ln
FUSED = int8._Int8Linear.residual_ln


def _unfused(self, *args, **kwargs):  # residual_ln declining: the caller runs the GEMM, then the ops
    return None


def _residual_ln(fn):
    return functools.partial(setattr, int8._Int8Linear, "residual_ln", fn)


@variant("int8-residual-ln", rounds=15)
def int8_residual_ln(args) -> None:
    """The int8 dequantize pass with the residual add and LayerNorm folded in, against the unfused path.

    #32 item 2's lever, csrc/int8_cpu.cpp ``int8_dequantize_residual_ln``, against the unfused path
    (dequantize, then aten's add and layer_norm), whole no-grad forwards of the real all-MiniLM-L6-v2
    (int8 with fp32 and with bf16 activations) and a bert-base config: bert_fast.bench.timing.measure,
    interleaved rounds, 95% intervals.

        python benchmarks/cpu_ab.py int8-residual-ln [--threads 2] [--rounds 15]
    """
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()), f"{args.threads} threads, torch {torch.__version__}")
    hf, tok = load_minilm()
    cases = [
        ("MiniLM int8", bert_fast.optimize(copy.deepcopy(hf), int8=True, tokenizer=tok), (1, 8)),
        ("MiniLM int8, bf16", bert_fast.optimize(copy.deepcopy(hf).to(torch.bfloat16), int8=True, tokenizer=tok), (1,)),
        (
            "bert-base int8",
            bert_fast.optimize(transformers.BertModel(transformers.BertConfig()).eval(), int8=True, tokenizer=tok),
            (1,),
        ),
    ]
    for name, model, batches in cases:
        for batch in batches:
            line = compare_variants(
                {"unfused": _residual_ln(_unfused), "fused": _residual_ln(FUSED)},
                dense_forward(model, batch),
                args.rounds,
                restore=_residual_ln(FUSED),
                warmup=2,
            )
            print(f"{name} {batch}x128 no-grad: {line}")


@variant("int8-vnni", rounds=15)
def int8_vnni(args) -> None:
    """The int8 GEMM: torch._int_mm (oneDNN, the weight laid out again at every call) against our AVX-512
    VNNI GEMM on weights packed once (csrc/int8_gemm_vnni.cpp), in whole no-grad forwards.

    Two copies of a model quantized with each backend (the same int32 sums: the outputs must be equal,
    checked first), the real all-MiniLM-L6-v2 and a bert-base config at 1 x 128 and 8 x 128:
    bert_fast.bench.timing.measure, interleaved rounds, 95% intervals.

        python benchmarks/cpu_ab.py int8-vnni [--threads 2] [--rounds 15]
    """
    if not int8_gemm.vnni_available():
        raise SystemExit("this CPU (or BERT_FAST_CPU_ISA) has no AVX-512 VNNI: nothing to compare")
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()), f"{args.threads} threads, torch {torch.__version__}")
    hf, tok = load_minilm()
    calib = int8.calibration_batch(tok, None)
    bert = transformers.BertModel(transformers.BertConfig()).eval()
    for name, source in (("MiniLM", hf), ("bert-base", bert)):
        models = {}
        for backend in ("int_mm", "vnni"):
            models[backend] = bert_fast.optimize(copy.deepcopy(source))
            int8.quantize(models[backend], calib, min_cosine=0.0, backend=backend)
        for batch in (1, 8):
            calls = {}
            for b, m in models.items():
                torch.manual_seed(batch)  # the same tokens for both
                calls[b] = dense_forward(m, batch)
            outs = [c().last_hidden_state for c in calls.values()]
            assert torch.equal(*outs), "the two backends' int32 sums differ"
            res = timing.measure(calls, warmup=2, min_rounds=args.rounds, max_rounds=args.rounds, catch=False)
            parts = [f"{b} {t.median_ms:.2f} ms ({t.ci_low_ms:.2f}-{t.ci_high_ms:.2f})" for b, t in res.timings.items()]
            print(
                f"{name} int8 {batch}x128 no-grad: {', '.join(parts)}; speedup of vnni {res.speedup('vnni', 'int_mm').format()}"
            )
