"""``bert-fast doctor``: every kernel checked on this machine, with a report to send back (issue 16).

Every kernel x dtype (fp32, fp16, bf16) x representative shapes (MiniLM, bert-base, bert-large;
dense and varlen; forward and backward; dropout on and off where the op has dropout). Each check
runs the kernel (the op with the first-use check off, ``BERT_FAST_VERIFY=off``), the torch
implementation (bert_fast.ops.torch_impl) and the float64 oracle (bert_fast.reference) on the same
inputs, with dropout on the kernel's own keep-mask, and gives:

  * verdict: ``pass`` when the kernel's error against the oracle is within the 2x rule of
    bert_fast.testing (at most twice plain torch's error in the same dtype, plus the rounding floor)
    for every output and gradient, and it has no NaN/Inf where the oracle is finite; ``fail``
    otherwise; ``error`` when the kernel raised; ``fault`` when the check's process died (an illegal
    address, a misaligned access, an abort) or hung; ``skip`` with the reason where the check cannot
    run here;
  * err/torch: the kernel's error against the oracle as a multiple of plain torch's (the worst
    output or gradient);
  * kernel ms / torch ms: the median time of the kernel and of the torch implementation.

Each group of checks (one op) runs in its own process, which reports each check as it finishes: a
device fault kills that process only; the check it was running is reported as a fault, named, and
the rest of the group goes on in a fresh process. The run prints a table, writes JSON with
``--json PATH`` (attach it to an issue), and exits 1 when any check failed, raised or faulted.

On a machine without a GPU the same checks run through the Triton interpreter (the C++ twin for
the embedding) at small shapes, bf16 skipped for the kernels built on ``tl.dot`` (the interpreter's
bf16 dot is wrong); that says the kernels' logic is right with this Triton, not that they compile
and run on a GPU: a GPU verdict needs a GPU.

On the CPU the doctor also says which precision this machine should run inference in, and why
(bert_fast.doctor_precision: the CPU's bf16/int8 units, GEMM rates measured here, the call to use).

``BERT_FAST_DOCTOR_PRELOAD=file.py``: each check process runs that file first (to instrument or
patch kernels while debugging; the tests use it to plant failures).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import attention as attention_cases
from bert_fast.bench.op_cases import bias_gelu as bias_gelu_cases
from bert_fast.bench.op_cases import embedding as embedding_cases
from bert_fast.bench.op_cases import linear as linear_cases
from bert_fast.bench.op_cases import residual_layer_norm as residual_layer_norm_cases
from bert_fast.model.facts import kernel_shape

OPS = ("linear", "bias_gelu", "residual_layer_norm", "attention", "embedding")
DTYPES = ("fp32", "fp16", "bf16")
# hidden, heads, head dim, FFN width, vocabulary of the presets the kernels are checked at
SHAPES = {name: kernel_shape(name) for name in ("minilm", "bert-base", "bert-large")}
LAYOUTS = ("dense", "varlen")
# tokens: dense B x S, varlen B sequences of these lengths (max S); the CPU runs small ones
GPU_TOKENS = {"batch": 8, "seq": 128, "lengths": [128, 97, 64, 33, 120, 7, 77, 1]}
CPU_TOKENS = {"batch": 2, "seq": 16, "lengths": [16, 9, 1]}
CPU_LIMITS = {"heads": 2, "linear_n": 64, "linear_k": 256, "vocab": 512}
DOT_OPS = ("linear", "attention")  # kernels on tl.dot: the interpreter's bf16 dot is wrong
DROPOUT_OPS = ("residual_layer_norm", "attention", "embedding")
DROPOUT_P = 0.1
PRELOAD_ENV = "BERT_FAST_DOCTOR_PRELOAD"
PROTOCOL = "@@bert-fast-doctor "
EXIT_FAIL = 1


# ----------------------------------------------------------------------------- the plan
def _linear_gemms(h: int, ffn: int) -> Dict[str, tuple]:
    """The linear checks' (N, K, activation) by case name: the GEMMs of bench.op_cases.linear, the
    one with GELU named "+gelu"."""
    return {(name + "+gelu" if act else name): (n, k, act) for name, n, k, act in linear_cases.gemm_shapes(h, ffn)}


LINEAR_CASES = tuple(_linear_gemms(1, 4))  # "qkv", "ffn_up+gelu", "ffn_down"


def plan(gpu: bool, ops=OPS, dtypes=DTYPES, shapes=tuple(SHAPES), layouts=LAYOUTS) -> List[dict]:
    """Every check, in order: op, case, dtype, shape, layout, dropout, direction (and an id)."""
    checks = []
    for op in ops:
        cases = LINEAR_CASES if op == "linear" else ("",)
        dropouts = (0.0, DROPOUT_P) if op in DROPOUT_OPS else (0.0,)
        for dtype, shape, layout, case, p, direction in itertools.product(
            dtypes, shapes, layouts, cases, dropouts, ("fwd", "bwd")
        ):
            checks.append(
                dict(op=op, case=case, dtype=dtype, shape=shape, layout=layout, dropout=p, direction=direction, gpu=gpu)
            )
    for i, c in enumerate(checks):
        c["id"] = i
    return checks


def skip_reason(check: dict) -> Optional[str]:
    if not check["gpu"] and check["dtype"] == "bf16" and check["op"] in DOT_OPS:
        return (
            "the Triton interpreter's bf16 tl.dot is wrong (triton 3.6/3.9): this kernel is checked in "
            "bf16 on a GPU only"
        )
    return None


# ----------------------------------------------------------------------------- one check (child)
def _dims(check: dict) -> dict:
    s = dict(SHAPES[check["shape"]])
    tok = GPU_TOKENS if check["gpu"] else CPU_TOKENS
    if not check["gpu"]:
        s["heads"] = min(s["heads"], CPU_LIMITS["heads"])
        s["vocab"] = CPU_LIMITS["vocab"]
    lengths = tok["lengths"] if check["layout"] == "varlen" else [tok["seq"]] * tok["batch"]
    s.update(
        lengths=lengths,
        seq=max(lengths) if check["layout"] == "varlen" else tok["seq"],
        batch=len(lengths),
        tokens=sum(lengths),
    )
    return s


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


class _Op:
    """One op's check: inputs, the kernel (through the op), the torch implementation and the oracle.
    ``leaves``: the float inputs gradients flow to; ``reductions``: those summed over rows. The
    inputs are the op's ``sample_inputs`` of bert_fast.bench.op_cases (the bench's), at the check's
    shape, from this check's seeded generator."""

    reductions: tuple = ()

    def __init__(self, check: dict, device):
        import torch

        self.check, self.device = check, device
        self.dtype = _torch_dtype(check["dtype"])
        self.dims = _dims(check)
        self.p = check["dropout"]
        self.gen = torch.Generator().manual_seed(1000 + check["id"])
        self._randn = seeded_randn(self.gen, device, self.dtype)
        self.mask = None

    def randn(self, *shape, scale=1.0):
        return self._randn(*shape, scale=scale)


class _Linear(_Op):
    reductions = ("weight", "bias")

    def setup(self):
        d = self.dims
        n, k, self.act = _linear_gemms(d["hidden"], d["ffn"])[self.check["case"]]
        if not self.check["gpu"]:
            n, k = min(n, CPU_LIMITS["linear_n"]), min(k, CPU_LIMITS["linear_k"])
        self.label = f"M={d['tokens']} N={n} K={k}"
        self.inputs = linear_cases.sample_inputs(d["tokens"], n, k, self.randn)

    def kernel(self, t):
        from bert_fast.ops import linear

        return linear(t["x"], t["weight"], t["bias"], self.act, backend="triton")

    def torch_fwd(self, t):
        from bert_fast.ops import torch_impl

        y, z = torch_impl.linear_fwd(t["x"], t["weight"], t["bias"], self.act, True)
        return y, z

    def torch_bwd(self, t, dy, saved):
        from bert_fast.ops import torch_impl

        return list(torch_impl.linear_bwd(dy, t["x"], t["weight"], saved, self.act, True, True, True))

    def oracle(self, t):
        from bert_fast import reference

        return reference.linear(t["x"], t["weight"], t["bias"], self.act)


class _BiasGelu(_Op):
    reductions = ("bias",)

    def setup(self):
        d = self.dims
        self.label = f"M={d['tokens']} N={d['ffn']}"
        self.inputs = bias_gelu_cases.sample_inputs(d["tokens"], d["ffn"], self.randn)

    def kernel(self, t):
        from bert_fast.ops import bias_gelu

        return bias_gelu(t["x"], t["bias"])

    def torch_fwd(self, t):
        from bert_fast.ops import torch_impl

        return torch_impl.bias_gelu_fwd(t["x"], t["bias"], "none"), None

    def torch_bwd(self, t, dy, saved):
        from bert_fast.ops import torch_impl

        return list(torch_impl.bias_gelu_bwd(dy, t["x"], t["bias"], "none"))

    def oracle(self, t):
        from bert_fast import reference

        return reference.bias_gelu(t["x"], t["bias"])


class _ResidualLayerNorm(_Op):
    reductions = ("weight", "bias")

    def setup(self):
        d = self.dims
        self.label = f"M={d['tokens']} N={d['hidden']}"
        self.inputs = residual_layer_norm_cases.sample_inputs(d["tokens"], d["hidden"], self.randn)

    def kernel(self, t):
        from bert_fast.ops import residual_layer_norm

        y, self.mask = residual_layer_norm(
            t["x"], t["residual"], t["weight"], t["bias"], 1e-12, self.p, generator=self.gen, return_dropout_mask=True
        )
        if self.p == 0.0:
            self.mask = None
        return y

    def torch_fwd(self, t):
        from bert_fast.ops import torch_impl

        y, mean, rstd = torch_impl.residual_layer_norm_fwd(
            t["x"], t["residual"], t["weight"], t["bias"], 1e-12, self.p, None, keep=self.mask
        )
        return y, (mean, rstd)

    def torch_bwd(self, t, dy, saved):
        from bert_fast.ops import torch_impl

        return list(
            torch_impl.residual_layer_norm_bwd(
                dy, t["x"], t["residual"], t["weight"], t["bias"], saved[0], saved[1], self.p, None, keep=self.mask
            )
        )

    def oracle(self, t):
        from bert_fast import reference

        return reference.residual_layer_norm(t["x"], t["residual"], t["weight"], t["bias"], 1e-12, self.p, self.mask)


class _Attention(_Op):
    def setup(self):
        d = self.dims
        h, hd = d["heads"], d["head_dim"]
        self.scale = hd**-0.5
        self.varlen = self.check["layout"] == "varlen"
        lengths = d["lengths"]
        if not self.varlen:  # padded, with a ragged key-padding mask (the last row without keys)
            b, s = d["batch"], d["seq"]
            lengths = [max(0, s - (i * s) // b) for i in range(b)]
            lengths[-1] = 0
        qkv, layout = attention_cases.sample_inputs(lengths, d["seq"], h, hd, self.randn, self.device, self.varlen)
        self.cu, self.key_mask = (layout, None) if self.varlen else (None, layout)
        self.inputs = {"qkv": qkv}
        self.label = (
            f"T={d['tokens']} max={d['seq']}" if self.varlen else f"B={d['batch']} S={d['seq']}"
        ) + f" h={h} d={hd}"

    def kernel(self, t):
        from bert_fast.ops import attention, varlen_attention

        if self.varlen:
            out, self.mask = varlen_attention(
                t["qkv"], self.cu, self.dims["seq"], self.p, generator=self.gen, return_dropout_mask=True
            )
        else:
            out, self.mask = attention(t["qkv"], self.key_mask, self.p, generator=self.gen, return_dropout_mask=True)
        return out

    def torch_fwd(self, t):
        from bert_fast.ops import torch_impl

        if self.varlen:
            out, lse = torch_impl.varlen_attention_fwd(
                t["qkv"], self.cu, self.dims["seq"], self.p, self.scale, None, keep=self.mask
            )
        else:
            out, lse = torch_impl.attention_fwd(t["qkv"], self.key_mask, self.p, self.scale, None, keep=self.mask)
        return out, (out, lse)

    def torch_bwd(self, t, dy, saved):
        from bert_fast.ops import torch_impl

        out, lse = saved
        if self.varlen:
            return [
                torch_impl.varlen_attention_bwd(
                    dy, t["qkv"], self.cu, self.dims["seq"], out, lse, self.p, self.scale, None, keep=self.mask
                )
            ]
        return [
            torch_impl.attention_bwd(dy, t["qkv"], self.key_mask, out, lse, self.p, self.scale, None, keep=self.mask)
        ]

    def oracle(self, t):
        from bert_fast import reference

        if self.varlen:
            return reference.varlen_attention(t["qkv"], self.cu, self.dims["seq"], self.p, self.scale, self.mask)
        return reference.attention(t["qkv"], self.key_mask, self.p, self.scale, self.mask)


class _Embedding(_Op):
    """``t``'s values are the op's float inputs in its order (word, position and token-type tables,
    LayerNorm weight and bias: bench.op_cases.embedding.sample_inputs)."""

    reductions = ("word", "position", "token_type", "weight", "bias")

    def setup(self):
        import torch

        d = self.dims
        h, v = d["hidden"], d["vocab"]
        b, s = d["batch"], d["seq"]
        self.ids, self.tt = embedding_cases.sample_ids(b, s, v, self.device, self.gen)
        self.indices = None
        if self.check["layout"] == "varlen":  # unpadding fused into the gather
            keep = torch.arange(s)[None, :] < torch.tensor(d["lengths"])[:, None]
            self.indices = keep.reshape(-1).nonzero().reshape(-1).to(self.device)
        self.rows = d["tokens"]
        self.label = f"{'T' if self.indices is not None else 'B x S'}={self.rows} H={h} V={v}"
        self.inputs = embedding_cases.sample_inputs(h, v, self.randn)

    def kernel(self, t):
        import torch

        from bert_fast.ops import draw_seed, embedding_dropout_mask, embedding_layer_norm

        state = self.gen.get_state()
        out = embedding_layer_norm(
            self.ids, None, self.tt, *t.values(), 1e-12, self.p, padding_idx=0, indices=self.indices, generator=self.gen
        )
        self.mask = None
        if self.p > 0.0:  # the seed the op drew, again: the kernel's mask for it
            g = torch.Generator()
            g.set_state(state)
            seed = draw_seed(self.p, g)
            self.mask = embedding_dropout_mask(self.rows, t["word"].shape[1], self.p, seed, self.device)
        return out

    def torch_fwd(self, t):
        from bert_fast.ops import torch_impl

        fwd = torch_impl.embedding_fwd
        out, mean, rstd = fwd(self.ids, None, self.tt, self.indices, *t.values(), 1e-12, self.p, None, keep=self.mask)
        return out, (mean, rstd)

    def torch_bwd(self, t, dy, saved):
        from bert_fast.ops import torch_impl

        tables = list(t.values())[:4]  # word, position, token_type, weight: the backward needs no bias
        return torch_impl.embedding_bwd(
            dy, self.ids, None, self.tt, self.indices, *tables, *saved, self.p, None, 0, [True] * 5, keep=self.mask
        )

    def oracle(self, t):
        from bert_fast import reference

        rows_shape = (self.rows,) if self.indices is not None else tuple(self.ids.shape)
        mask = None if self.mask is None else self.mask.reshape(*rows_shape, -1)
        return reference.embedding_layer_norm(
            self.ids, None, self.tt, *t.values(), 1e-12, self.p, 0, self.indices, mask
        )


_OPS = {
    "linear": _Linear,
    "bias_gelu": _BiasGelu,
    "residual_layer_norm": _ResidualLayerNorm,
    "attention": _Attention,
    "embedding": _Embedding,
}


def kernel_label(op: str, gpu: bool, dtype_name: str = "fp16") -> str:
    if op == "embedding":
        return "embedding (CUDA)" if gpu else "embedding (C++ twin)"
    name = {
        "linear": "linear GEMM",
        "bias_gelu": "bias_gelu",
        "residual_layer_norm": "residual_layer_norm",
        "attention": "attention",
    }[op]
    if op == "linear" and gpu:
        from bert_fast.bench.op_backends import gemm_uses_tma

        if gemm_uses_tma("cuda", _torch_dtype(dtype_name)):
            name = "linear TMA GEMM"
    return f"{name} (Triton{'' if gpu else ' interpreter'})"


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _identity(check: dict) -> dict:
    """The fields that name a check, first in its result."""
    return {k: check[k] for k in ("id", "op", "case", "dtype", "shape", "layout", "dropout", "direction")}


def _broken(check: dict, gpu: bool, verdict: str, reason: str) -> dict:
    """The result of a check that gave no figures: its process died, or the check itself raised."""
    return dict(_identity(check), verdict=verdict, kernel=kernel_label(check["op"], gpu, check["dtype"]), reason=reason)


def run_check(check: dict) -> dict:
    """Run one check in this process; the result dict (verdict, errors, times, reason)."""
    import torch

    reason = skip_reason(check)
    result = _identity(check)
    result["kernel"] = kernel_label(check["op"], check["gpu"], check["dtype"])
    if reason:
        return dict(result, verdict="skip", reason=reason)
    device = torch.device("cuda" if check["gpu"] else "cpu")
    op = _OPS[check["op"]](check, device)
    op.setup()
    result["size"] = op.label
    run = _CheckRun(op, device, backward=check["direction"] == "bwd")
    try:
        run.kernel()
    except Exception as exc:  # noqa: BLE001 - the kernel raised: its verdict
        return dict(result, verdict="error", reason=f"the kernel raised {type(exc).__name__}: {str(exc).strip()[:500]}")
    result.update(_verdict(run.pairs(), op))
    try:
        run.times(result, reps=5 if check["gpu"] else 1)
    except Exception as exc:  # noqa: BLE001 - timing is informative only
        result["timing_error"] = f"{type(exc).__name__}: {exc}"
    return result


class _CheckRun:
    """One check's calls on the same inputs: the kernel (through the op, with autograd), then the
    torch implementation and the float64 oracle; forward, or backward with the same ``dy``."""

    def __init__(self, op: _Op, device, backward: bool):
        self.op, self.device, self.backward = op, device, backward
        self.names = list(op.inputs)
        self.leaves = {k: v.detach().clone().requires_grad_() for k, v in op.inputs.items()}
        self.plain = {k: v.detach() for k, v in op.inputs.items()}
        self.dy = self.grads = self.saved = None

    def kernel(self) -> None:
        """The kernel's output (and gradients); raises what the kernel raises."""
        import torch

        self.out = self.op.kernel(self.leaves)
        if self.backward:
            self.dy = self.op.randn(*self.out.shape)
            self.grads = torch.autograd.grad(self.out, [self.leaves[n] for n in self.names], self.dy, retain_graph=True)
        _sync(self.device)

    def pairs(self) -> List[tuple]:
        """(name, kernel's, torch's, oracle's, rows it sums or None) of the output or each gradient."""
        import torch

        op = self.op
        out_t, self.saved = op.torch_fwd(self.plain)
        wide = {k: v.detach().double().requires_grad_() for k, v in op.inputs.items()}
        out_o = op.oracle(wide)
        if not self.backward:
            return [("out", self.out.detach(), out_t, out_o.detach(), None)]
        grads_t = op.torch_bwd(self.plain, self.dy, self.saved)
        grads_o = torch.autograd.grad(out_o, [wide[n] for n in self.names], self.dy.double(), allow_unused=True)
        rows = op.dims["tokens"]
        return [
            (f"d{n}", gk, gt, go if go is not None else torch.zeros_like(wide[n]), rows if n in op.reductions else None)
            for n, gk, gt, go in zip(self.names, self.grads, grads_t, grads_o)
        ]

    def times(self, result: dict, reps: int) -> None:
        """Median ms of the kernel (through the op) and of the torch implementation (directly)."""
        import torch

        op, plain, device = self.op, self.plain, self.device
        if not self.backward:
            with torch.no_grad():
                result["kernel_ms"] = _time_ms(lambda: op.kernel(plain), device, reps)
                result["torch_ms"] = _time_ms(lambda: op.torch_fwd(plain), device, reps)
            return
        params = [self.leaves[n] for n in self.names]
        result["kernel_ms"] = _time_ms(
            lambda: torch.autograd.grad(self.out, params, self.dy, retain_graph=True), device, reps
        )
        result["torch_ms"] = _time_ms(lambda: op.torch_bwd(plain, self.dy, self.saved), device, reps)


def _verdict(pairs: List[tuple], op: _Op) -> dict:
    """pass when every output or gradient is within the 2x rule and finite where the oracle is;
    the worst of them (closest to or furthest over its bound), and why it failed."""
    import torch

    from bert_fast.testing import max_abs_err, reduction_floor, rounding_floor

    worst, verdict, why = None, "pass", []
    for name, k, tt, o, rows in pairs:
        k, tt, o = k.reshape(o.shape), tt.reshape(o.shape), o
        fin = torch.isfinite(o)
        if bool((fin & ~torch.isfinite(k)).any()):
            verdict = "fail"
            why.append(f"{name}: NaN/Inf where the oracle is finite")
            continue
        err_k, err_t = max_abs_err(k, o), max_abs_err(tt, o)
        floor = reduction_floor(o, op.dtype, rows) if rows else rounding_floor(o, op.dtype)
        bound = 2.0 * err_t + floor
        ratio = err_k / err_t if err_t > 0 else (0.0 if err_k == 0 else math.inf)
        item = {"output": name, "err": err_k, "torch_err": err_t, "bound": bound, "ratio": ratio}
        if worst is None or err_k / bound > worst["err"] / worst["bound"]:
            worst = item
        if not err_k <= bound:
            verdict = "fail"
            why.append(f"{name}: error {err_k:.3e} > 2 x torch's {err_t:.3e} + floor {floor:.1e}")
    return dict(verdict=verdict, worst=worst, reason="; ".join(why) or None)


def _child_main(argv: List[str]) -> int:
    """``python -m bert_fast.doctor --child``: the checks (JSON on stdin) one by one, each announced
    before it starts and reported when it ends (protocol lines on stdout)."""
    preload = os.environ.get(PRELOAD_ENV)
    if preload:
        import runpy

        runpy.run_path(preload, run_name="__bert_fast_doctor_preload__")
    checks = json.loads(sys.stdin.read())
    for check in checks:
        print(PROTOCOL + json.dumps({"start": check["id"]}), flush=True)
        try:
            res = run_check(check)
        except Exception as exc:  # noqa: BLE001 - the check itself broke (not the kernel): say so, go on
            why = f"the check itself raised (after the kernel ran): {type(exc).__name__}: {str(exc).strip()[:500]}"
            res = _broken(check, check["gpu"], "error", why)
        print(PROTOCOL + json.dumps({"result": res}, default=float), flush=True)
    return 0


# ----------------------------------------------------------------------------- the run (parent)
def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _child_env(gpu: bool) -> dict:
    env = dict(os.environ)
    env["BERT_FAST_VERIFY"] = "off"  # the doctor checks the kernels themselves
    env.pop("BERT_FAST_BACKEND", None)
    env["PYTHONUNBUFFERED"] = "1"
    if gpu:
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_group(checks: List[dict], gpu: bool, timeout_s: float, on_result=None) -> List[dict]:
    """Run ``checks`` in child processes: one while it lives; after a fault the rest in a new one."""
    results: Dict[int, dict] = {}

    def record(res: dict) -> None:
        results[res["id"]] = res
        if on_result:
            on_result(res)

    pending = [c for c in checks]
    while pending:
        child = _Child(pending, gpu)
        current, timed_out = child.watch(timeout_s, record)
        pending = [c for c in pending if c["id"] not in results]
        if not pending:
            break
        # the process ended with checks left: the one it was running (or the first) is a fault
        culprit = next((c for c in pending if c["id"] == current), pending[0])
        tail = "".join(child.stderr_chunks).strip().splitlines()[-6:]
        why = (
            f"the check's process timed out after {timeout_s:.0f} s"
            if timed_out
            else f"the check's process died ({_signal_name(child.proc.returncode)})"
        )
        record(_broken(culprit, gpu, "fault", why + (": " + " | ".join(t.strip() for t in tail) if tail else "")))
        pending = [c for c in pending if c["id"] != culprit["id"]]
    return [results[c["id"]] for c in checks]


class _Child:
    """One check process, given its checks on stdin; threads read its stderr and, line by line, its
    stdout, which ``watch`` follows as the lines arrive."""

    def __init__(self, checks: List[dict], gpu: bool):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bert_fast.doctor", "--child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(gpu),
        )
        self.stderr_chunks: List[str] = []
        self.reader = threading.Thread(target=lambda: self.stderr_chunks.append(self.proc.stderr.read()), daemon=True)
        self.reader.start()
        self.proc.stdin.write(json.dumps(checks))
        self.proc.stdin.close()
        self.lines: List[str] = []
        self.line_reader = threading.Thread(target=self._read_lines, daemon=True)
        self.line_reader.start()

    def _read_lines(self) -> None:  # line by line: watch() follows them as they arrive
        for ln in self.proc.stdout:
            self.lines.append(ln)

    def watch(self, timeout_s: float, record) -> Tuple[Optional[int], bool]:
        """Follow the protocol until the process ends (killed when one check runs over ``timeout_s``),
        each result to ``record``; (the check it was running, or None; whether it timed out)."""
        current, deadline = None, time.monotonic() + timeout_s
        timed_out = False
        seen = 0
        while True:
            while seen < len(self.lines):
                ln = self.lines[seen]
                seen += 1
                if not ln.startswith(PROTOCOL):
                    continue
                msg = json.loads(ln[len(PROTOCOL) :])
                if "start" in msg:
                    current, deadline = msg["start"], time.monotonic() + timeout_s
                elif "result" in msg:
                    record(msg["result"])
                    current = None
            if self.proc.poll() is not None and not self.line_reader.is_alive():
                break
            if time.monotonic() > deadline:
                timed_out = True
                self.proc.kill()
                self.proc.wait()
                self.line_reader.join(5)
                continue
            time.sleep(0.02)
        self.reader.join(5)
        return current, timed_out


COLUMNS = ("kernel", "dtype", "shape", "layout", "case", "dir", "verdict", "err/torch", "kernel ms", "torch ms")


def _row(r: dict) -> List[str]:
    worst = r.get("worst") or {}
    ratio = worst.get("ratio")
    ratio_s = "-" if ratio is None else ("inf" if ratio == math.inf else f"{ratio:.2f}")
    case = r.get("case") or ""
    if r.get("dropout"):
        case = (case + " " if case else "") + f"dropout {r['dropout']:g}"
    ms = lambda v: "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")
    return [
        r.get("kernel", r["op"]),
        r["dtype"],
        f"{r['shape']} {r.get('size', '')}".strip(),
        r["layout"],
        case or "-",
        r["direction"],
        r["verdict"],
        ratio_s,
        ms(r.get("kernel_ms")),
        ms(r.get("torch_ms")),
    ]


def format_table(results: List[dict]) -> str:
    rows = [list(COLUMNS)] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summarize(results: List[dict]) -> Dict[str, int]:
    counts = {v: 0 for v in ("pass", "fail", "error", "fault", "skip")}
    for r in results:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    return counts


def _csv(value: Optional[str], allowed, what: str) -> tuple:
    if value is None:
        return tuple(allowed)
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return items


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON (attach it to an issue)")
    p.add_argument(
        "--device",
        default=None,
        choices=("cuda", "cpu"),
        help="cuda (default when a GPU is visible) or cpu (the Triton interpreter, small shapes)",
    )
    p.add_argument("--ops", default=None, help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--dtypes", default=None, help=f"comma-separated subset of {','.join(DTYPES)}")
    p.add_argument("--shapes", default=None, help=f"comma-separated subset of {','.join(SHAPES)}")
    p.add_argument("--layouts", default=None, help=f"comma-separated subset of {','.join(LAYOUTS)}")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds one check may run before its process is killed and the check reported as a fault (default 600)",
    )


def run(args) -> int:
    """``bert-fast doctor``: every check, one process per op; the table, problems, summary, the
    CPU's precision advice and the JSON report. Exit status EXIT_FAIL when a check failed."""
    import torch

    gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if gpu and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible")
    ops = _csv(args.ops, OPS, "ops")
    checks = plan(
        gpu,
        ops,
        _csv(args.dtypes, DTYPES, "dtypes"),
        _csv(args.shapes, SHAPES, "shapes"),
        _csv(args.layouts, LAYOUTS, "layouts"),
    )
    where = (
        ("on " + torch.cuda.get_device_name(0))
        if gpu
        else "on the CPU, through the Triton interpreter (the C++ twin for the embedding), at small shapes"
    )
    print(f"bert-fast doctor: {len(checks)} checks {where}; each op's checks in their own process", flush=True)
    t0 = time.monotonic()
    done: List[dict] = []
    interrupted = False
    try:
        results = _run_ops(ops, checks, gpu, args.timeout, done.append)
    except KeyboardInterrupt:  # Ctrl-C, or a GPU check's time cap (timeout -s INT): report what ran
        # GNU timeout signals the command and then its whole process group, so a second SIGINT
        # follows the first: ignored while the report is written (the 11-28 lease lost it so)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        interrupted = True
        ran = {r["id"] for r in done}
        why = "not run: interrupted (Ctrl-C, or the time cap of the GPU check's stage)"
        results = done + [_broken(c, gpu, "skip", why) for c in checks if c["id"] not in ran]
        print(f"\ninterrupted after {len(done)} of {len(checks)} checks", flush=True)
    bad = _print_report(results, t0)
    note, precision = (None, None) if interrupted else _cpu_advice(gpu)
    status = EXIT_FAIL if bad else (130 if interrupted else 0)
    if args.json:
        _write_report(args.json, gpu, results, status, note, precision, t0)
    if bad:
        print(
            "some kernels failed their checks: bert_fast's first-use check falls back to the torch "
            "implementation for them on this machine; please send the JSON report (--json) with an issue."
        )
    return status


def _run_ops(ops, checks: List[dict], gpu: bool, timeout_s: float, on_result=None) -> List[dict]:
    """Each op's checks in their own processes (run_group), a line per op as it ends; each result
    also to ``on_result`` as it arrives."""
    results: List[dict] = []
    for op in ops:
        group = [c for c in checks if c["op"] == op]
        t_op = time.monotonic()
        results += run_group(group, gpu, timeout_s, on_result)
        done = [r for r in results if r["op"] == op]
        s = summarize(done)
        print(
            f"  {op}: {len(done)} checks in {time.monotonic() - t_op:.1f} s "
            f"({', '.join(f'{v} {k}' for k, v in s.items() if v)})",
            flush=True,
        )
    return results


def _print_report(results: List[dict], t0: float) -> List[dict]:
    """The table, the problems, why checks were skipped and the counts; returns the checks that
    failed, raised or faulted."""
    print()
    print(format_table(results))
    bad = [r for r in results if r["verdict"] in ("fail", "error", "fault")]
    skipped = {r["reason"] for r in results if r["verdict"] == "skip"}
    if bad:
        print("\nproblems:")
        for r in bad:
            print(
                f"  [{r['verdict']}] {r['kernel']} {r['dtype']} {r['shape']} {r['layout']} "
                f"{r.get('case') or ''} dropout={r['dropout']:g} {r['direction']}: {r.get('reason')}"
            )
    for reason in sorted(skipped):
        print(f"\nskipped: {reason}")
    counts = summarize(results)
    print(
        f"\n{len(results)} checks: "
        + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        + f" ({time.monotonic() - t0:.0f} s)"
    )
    return bad


def _cpu_advice(gpu: bool) -> Tuple[Optional[str], Optional[dict]]:
    """Without a GPU: (what the interpreter's verdicts say, and not; which precision this CPU should
    run inference in, issue 25: a few seconds of GEMMs); (None, None) on a GPU."""
    if gpu:
        return None, None
    from bert_fast import doctor_precision

    note = (
        "No GPU here: the kernels ran through the Triton interpreter at small shapes. This says their "
        "logic is right with this Triton; a GPU verdict (compile, launch, speed on real hardware) needs "
        "a GPU: run `bert-fast doctor` there."
    )
    print("note: " + note)
    precision = doctor_precision.report()
    print("\n" + doctor_precision.format_report(precision))
    return note, precision


def _write_report(path, gpu: bool, results: List[dict], status: int, note, precision, t0: float) -> None:
    """The JSON report to attach to an issue."""
    import bert_fast
    from bert_fast.bench.results import environment, write_json

    report = {
        "bert_fast": getattr(bert_fast, "__version__", None),
        "gpu_verdict": gpu,
        "device": "cuda" if gpu else "cpu",
        "environment": environment("cuda" if gpu else "cpu"),
        "checks": results,
        "summary": summarize(results),
        "exit_status": status,
        "note": note,
        "precision": precision,
        "seconds": round(time.monotonic() - t0, 1),
    }
    write_json(path, report)
    print(f"wrote {path}" + ("" if not status else " (attach it to an issue of the bert_fast project)"))


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child_main(argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m bert_fast.doctor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
