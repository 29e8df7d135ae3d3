"""Which code runs a forward: the fp32 linear's backend (aten against oneDNN), and another build of
bert_fast._C against this one."""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.util
import itertools
import os
import sys
from typing import Any, Callable, Dict, List, Tuple
from unittest import mock

import torch
import transformers

import bert_fast
from bert_fast import _C as this_build
from bert_fast.bench import cpu_caps, timing
from bert_fast.model import direct_ops
from bert_fast.ops import cpu_attention, cpu_fp32_gemm, torch_impl

from .harness import compare, compare_variants, dense_forward, load_minilm, variant

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
FP32_CASES = (("bert-base", {}, 8, 128), ("bert-base", {}, 1, 128), ("MiniLM", MINILM, 1, 128))


@variant("fp32-gemm", rounds=7)
def fp32_gemm(args) -> None:
    """The CPU path's fp32 linear: aten (F.linear: MKL/OpenBLAS) against oneDNN's linear on the plain weight.

    bert_fast/ops/cpu_fp32_gemm.py's two backends, switched by BERT_FAST_CPU_FP32_GEMM, whole no-grad
    forwards side by side (timing.measure, 95% intervals).

        python benchmarks/cpu_ab.py fp32-gemm [--threads 2] [--rounds 7]

    Prints the CPU model and what the automatic choice picked first (benchmarks/notes/2026-11-27-cpu-inference-32.md,
    "The plain fp32 path on oneDNN").
    """
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()))
    print(f"automatic choice at {args.threads} threads: {'oneDNN' if cpu_fp32_gemm.use_onednn() else 'aten'}")
    for name, overrides, batch, seq in FP32_CASES:
        model = bert_fast.BertModel(transformers.BertConfig(**overrides)).eval()
        ids = torch.randint(0, 30000, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.long)
        with torch.no_grad():
            line = compare(
                cpu_fp32_gemm.ENV, ("aten", "onednn"), lambda: model(input_ids=ids, attention_mask=mask), args.rounds
            )
        print(f"{name} {batch}x{seq} fp32 no-grad: {line}")


# --------------------------------------------------------------------- build: another bert_fast._C
def load_other_build(path: str):
    """The module at ``path`` as a second bert_fast._C (its init function is PyInit__C: the name's last
    part must be _C)."""
    loader = importlib.machinery.ExtensionFileLoader("other_build._C", path)
    spec = importlib.util.spec_from_file_location("other_build._C", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def holders() -> List[Tuple[Any, str]]:
    """(module, attribute) of every reference bert_fast's modules hold to this build's extension."""
    out = []
    for name, module in list(sys.modules.items()):
        if name.startswith("bert_fast") and module is not None and module is not this_build:
            out += [(module, attr) for attr, value in vars(module).items() if value is this_build]
    return out


def swapper(ext, where: List[Tuple[Any, str]]) -> Callable[[], None]:
    def swap() -> None:
        for module, attr in where:
            setattr(module, attr, ext)

    return swap


def _build_variants(old_ext: str, where: List[Tuple[Any, str]]) -> Dict[str, Callable[[], None]]:
    """old / this: each swaps its build into every holder of ``where``."""
    return {"old": swapper(load_other_build(old_ext), where), "this": swapper(this_build, where)}


def _build_per_call(variants: Dict[str, Callable[[], None]], restore, rounds: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        if not cpu_attention.available(dtype):
            print(f"  attention {str(dtype)[6:]}: our kernel does not run on this CPU, skipped")
            continue
        for b, heads, d in ((1, 12, 32), (8, 12, 32), (1, 12, 64), (8, 12, 64)):
            qkv = torch.randn(b, 128, 3, heads, d).to(dtype)
            line = compare_variants(
                variants, lambda: cpu_attention.padded(qkv, None, d**-0.5), rounds, restore=restore, warmup=3
            )
            print(f"  attention per call {str(dtype)[6:]} b{b} x 128, {heads} heads x d{d}: {line}")


def _build_models() -> Dict[str, Any]:
    """fp32 and (where our bf16 kernel runs) bf16 frozen, and int8, of MiniLM (real weights) and bert-base."""
    hf, tok = load_minilm()
    base = transformers.BertModel(transformers.BertConfig()).eval()
    models = {
        "MiniLM fp32 frozen": bert_fast.optimize(copy.deepcopy(hf), freeze=True),
        "bert-base fp32 frozen": bert_fast.optimize(copy.deepcopy(base), freeze=True),
    }
    if cpu_attention.available(torch.bfloat16):
        models["MiniLM bf16 frozen"] = bert_fast.optimize(copy.deepcopy(hf), freeze=True, dtype=torch.bfloat16)
        models["bert-base bf16 frozen"] = bert_fast.optimize(copy.deepcopy(base), freeze=True, dtype=torch.bfloat16)
    models["MiniLM int8"] = bert_fast.optimize(copy.deepcopy(hf), int8=True, tokenizer=tok)
    models["bert-base int8"] = bert_fast.optimize(copy.deepcopy(base), int8=True, tokenizer=tok)
    return models


def _build_arguments(ap) -> None:
    ap.add_argument("--old-ext", required=True, help="the other build's _C*.so")
    ap.add_argument("--per-call-only", action="store_true", help="the attention calls, no whole forwards")


@variant("build", rounds=15, arguments=_build_arguments)
def build(args) -> None:
    """Another build of bert_fast._C (say, the previous commit's) against this build, in one process.

    Per call of the CPU attention kernels at BERT's shapes, and whole no-grad forwards (fp32 and bf16
    frozen, int8) of all-MiniLM-L6-v2 (real weights) and bert-base (random weights). The other build's
    module is loaded beside ours and swapped into every bert_fast module that holds the extension
    (``from bert_fast import _C as _ext``) inside each timed call, so both variants run the same Python,
    weights and inputs (timing.measure: interleaved rounds, 95% intervals, paired speedups). Our
    attention kernels run in both variants (BERT_FAST_CPU_ATTENTION=1), not torch's.

        git worktree add /tmp/old <commit> && cmake -S /tmp/old -B /tmp/old/build -DBERT_FAST_CUDA=OFF \\
            -DCMAKE_BUILD_TYPE=Release -DBERT_FAST_OUTPUT_DIR=/tmp/old/out && cmake --build /tmp/old/build
        python benchmarks/cpu_ab.py build --old-ext /tmp/old/out/_C*.so [--threads 2] [--rounds 15] [--per-call-only]

    BERT_FAST_CPU_ISA=avx2 in the environment runs both builds' AVX2 code (what an AVX2-only CPU runs).
    An A/A run (--old-ext a copy of this build's module) measures the floor: what code placement alone
    moves.
    """
    torch.set_num_threads(args.threads)
    os.environ["BERT_FAST_CPU_ATTENTION"] = "1"
    print(cpu_caps.describe(cpu_caps.capabilities()))
    print(f"BERT_FAST_CPU_ISA={os.environ.get('BERT_FAST_CPU_ISA', '')!r}, other build: {args.old_ext}")
    if args.per_call_only:
        variants = _build_variants(args.old_ext, holders())
        _build_per_call(variants, variants["this"], args.rounds)
        return
    models = _build_models()
    where = holders()  # after every import the models above needed
    print(f"swapping the extension in {len(where)} places: " + ", ".join(sorted({m.__name__ for m, _ in where})))
    variants = _build_variants(args.old_ext, where)
    _build_per_call(variants, variants["this"], args.rounds)
    for name, model in models.items():
        for batch in (1, 8) if name.startswith("MiniLM") else (1,):
            line = compare_variants(variants, dense_forward(model, batch), args.rounds, restore=variants["this"])
            print(f"  {name} {batch}x128 no-grad: {line}")


# --------------------------------------------------------------------- direct-ln: the direct path's LayerNorm
def _fp32_statistics_ln(x, residual, weight, bias, eps, dropout_p=0.0):
    """The direct path's residual LayerNorm before 2026-11-28: the torch implementation's, with the fp32
    weight copies and statistics a backward needs."""
    return torch_impl.residual_layer_norm_fwd(x, residual, weight, bias, eps, 0.0, None)[0]


@variant("direct-ln", rounds=15)
def direct_ln(args) -> None:
    """The direct (inference) path's residual LayerNorm: the torch implementation's (fp32 weights and statistics)
    against aten's LayerNorm in the input's dtype (bert_fast/model/direct_ops.py; the same y bit for bit).

    all-MiniLM-L6-v2 frozen, fp32 and bf16 (where the CPU has bf16 units), 1x128 and 8x128, the function swapped
    inside the timed call.

        python benchmarks/cpu_ab.py direct-ln [--threads 2] [--rounds 15]
    """
    torch.set_num_threads(args.threads)
    caps = cpu_caps.capabilities()
    print(cpu_caps.describe(caps))
    own_dtype = direct_ops.residual_layer_norm
    hf, _ = load_minilm()
    for dtype in (torch.float32,) + ((torch.bfloat16,) if caps.get("bf16") else ()):
        model = bert_fast.optimize(copy.deepcopy(hf), dtype=dtype)
        model.freeze()
        for batch in (1, 8):
            variants = {
                "fp32-statistics": lambda: setattr(direct_ops, "residual_layer_norm", _fp32_statistics_ln),
                "own-dtype": lambda: setattr(direct_ops, "residual_layer_norm", own_dtype),
            }
            restore = variants["own-dtype"]
            line = compare_variants(variants, dense_forward(model, batch), args.rounds, restore=restore)
            print(f"MiniLM frozen {str(dtype)[6:]} {batch}x128: {line}")


@variant("one-call", rounds=15)
def one_call(args) -> None:
    """Frozen bf16 and fp32 inference: oneDNN's packed linear (and the residual LayerNorm op after it)
    against our one-call linear (bert_fast/ops/cpu_linear.py) where freeze() measured it faster.

    Per dtype this CPU runs it in, two frozen copies of the real all-MiniLM-L6-v2 and of a bert-base
    config, one frozen with our linear ruled out; whole no-grad forwards at 1 x 128 and 8 x 128 side by
    side (bert_fast.bench.timing), and each one's largest difference to the other.

        python benchmarks/cpu_ab.py one-call [--threads 2] [--rounds 15]
    """
    from bert_fast.model import frozen
    from bert_fast.ops import cpu_linear

    dtypes = [d for d in (torch.bfloat16, torch.float32) if cpu_linear.available(d)]
    if not dtypes:
        raise SystemExit("this CPU (or BERT_FAST_CPU_ISA) has no AVX-512: nothing to compare")
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()), f"{args.threads} threads, torch {torch.__version__}")
    hf, _ = load_minilm()
    bert = transformers.BertModel(transformers.BertConfig()).eval()
    for dtype, (name, source) in itertools.product(dtypes, (("MiniLM", hf), ("bert-base", bert))):
        label_dtype = str(dtype)[6:]
        models = {}
        for label, allowed in (("onednn", False), ("ours", True)):
            model = bert_fast.optimize(copy.deepcopy(source).to(dtype))
            with mock.patch.object(cpu_linear, "available", lambda *_, allowed=allowed: allowed):
                frozen._OURS.clear()  # measured anew for the copy that may use it
                model.freeze()
            models[label] = model
        kept = sorted(set(frozen.ours_choices().values()))
        print(f"{name} {label_dtype}: our linear kept for (small, large) rows: {kept}")
        for batch in (1, 8):
            calls = {}
            for label, model in models.items():
                torch.manual_seed(batch)  # the same tokens for both
                calls[label] = dense_forward(model, batch)
            a, b = (c().last_hidden_state.float() for c in calls.values())
            res = timing.measure(calls, warmup=2, min_rounds=args.rounds, max_rounds=args.rounds, catch=False)
            parts = [f"{k} {t.median_ms:.2f} ms ({t.ci_low_ms:.2f}-{t.ci_high_ms:.2f})" for k, t in res.timings.items()]
            sp = res.speedup("ours", "onednn").format()
            print(
                f"{name} {label_dtype} frozen {batch}x128: {', '.join(parts)}; speedup of ours {sp}; "
                f"max|diff| {(a - b).abs().max():.3g}"
            )
