"""First-use verification of the kernels (bert_fast/ops/_verify.py, issue 16).

On the CPU the "kernel" is the Triton interpreter (the C++ twin for the embedding), so every path
runs here: for every op, forward and backward, a compile error, a launch error, perturbed values and
NaN are injected into the kernel by monkeypatching its launcher; the op then returns the torch
implementation's result, warns once naming the kernel, keeps the verdict on disk, and a fresh
process honours it without launching the kernel. A correct kernel passes and a second process
calls the torch implementation 0 times. Verdicts go to a temporary directory (BERT_FAST_VERIFY_DIR).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from bert_fast.ops import _verify, fused_sdpa, torch_impl
from bert_fast.ops import attention as _attention_fn  # noqa: F401  (registers the ops)
from bert_fast.ops._verify import KernelCheckError, KernelFallbackWarning

REPORT = "bert-fast doctor --json report.json"


# ----------------------------------------------------------------------------- the ops, small
class Case:
    """One op at a small shape: its inputs (leaf tensors), how to run it, where its kernel is
    launched (module, attribute) per direction, and the torch implementation's functions (torch_impl's
    ``<name>_fwd`` and ``<name>_bwd``)."""

    def __init__(self, name, label, patch, make, forward, dropout_forward=None):
        self.name, self.label, self.patch = name, label, patch
        self.impl = {"fwd": f"{name}_fwd", "bwd": f"{name}_bwd"}
        self._make, self._forward, self._dropout_forward = make, forward, dropout_forward

    def inputs(self, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        return {
            k: (v.to(device).requires_grad_() if v.is_floating_point() else v.to(device))
            for k, v in self._make(g).items()
        }

    def forward(self, inp, dropout_p=0.0):
        return self._forward(inp) if dropout_p == 0.0 else self._dropout_forward(inp, dropout_p)

    def __repr__(self):
        return self.name


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


def _ln(g, n):
    return {"w": 1.0 + 0.1 * _randn(g, n), "b": 0.1 * _randn(g, n)}


def _embedding_make(g):
    h = 24
    return {
        "ids": torch.randint(0, 30, (2, 5), generator=g),
        "tt": torch.randint(0, 2, (2, 5), generator=g),
        "word": _randn(g, 30, h),
        "pos": _randn(g, 8, h),
        "type": _randn(g, 2, h),
        **_ln(g, h),
    }


def _emb(i, p=0.0):
    from bert_fast.ops import embedding_layer_norm

    return embedding_layer_norm(
        i["ids"], None, i["tt"], i["word"], i["pos"], i["type"], i["w"], i["b"], 1e-12, p, padding_idx=0
    )


def _key_mask(device):
    m = torch.ones(2, 9, dtype=torch.bool, device=device)
    m[1, 6:] = False
    return m


CU = [0, 4, 4, 11]


def _launchers(module, fwd, bwd):
    """Where an op's kernels are launched (what the tests patch): ``module``'s functions ``fwd`` and ``bwd``."""
    return {"fwd": (module, fwd), "bwd": (module, bwd)}


def _cases():
    from bert_fast.ops import attention, bias_gelu, linear, residual_layer_norm, varlen_attention

    cu = lambda i: torch.tensor(CU, dtype=torch.int32, device=i["qkv"].device)
    return [
        Case(
            "linear",
            "bert_fast.kernels.linear",
            _launchers("bert_fast.kernels.linear", "linear_fwd", "gemm"),
            lambda g: {"x": _randn(g, 12, 32), "w": 0.2 * _randn(g, 24, 32), "b": _randn(g, 24)},
            # backend="triton": the GEMM kernel whose launchers are patched above. "auto" takes it
            # on the CPU (the interpreter), but on CUDA an fp32 / small-M call goes to cuBLAS plus
            # the bias_gelu kernel (linear.default_backend), and linear_fwd / gemm never launch
            lambda i: linear(i["x"], i["w"], i["b"], "gelu", backend="triton"),
        ),
        Case(
            "bias_gelu",
            "bert_fast.kernels.bias_gelu",
            _launchers("bert_fast.kernels.bias_gelu", "bias_gelu_fwd", "bias_gelu_bwd"),
            lambda g: {"x": _randn(g, 6, 40), "b": _randn(g, 40)},
            lambda i: bias_gelu(i["x"], i["b"]),
        ),
        Case(
            "residual_layer_norm",
            "bert_fast.kernels.residual_layer_norm",
            _launchers("bert_fast.kernels.residual_layer_norm", "residual_layer_norm_fwd", "residual_layer_norm_bwd"),
            lambda g: {"x": _randn(g, 6, 48), "r": _randn(g, 6, 48), **_ln(g, 48)},
            lambda i: residual_layer_norm(i["x"], i["r"], i["w"], i["b"], 1e-5),
            lambda i, p: residual_layer_norm(i["x"], i["r"], i["w"], i["b"], 1e-5, p),
        ),
        Case(
            "attention",
            "bert_fast.kernels.attention",
            _launchers("bert_fast.kernels.attention", "attention_fwd", "attention_bwd"),
            lambda g: {"qkv": _randn(g, 2, 9, 3, 2, 16)},
            lambda i: attention(i["qkv"], _key_mask(i["qkv"].device)),
            lambda i, p: attention(i["qkv"], _key_mask(i["qkv"].device), p),
        ),
        Case(
            "varlen_attention",
            "bert_fast.kernels.attention",
            _launchers("bert_fast.kernels.attention", "attention_fwd", "attention_bwd"),
            lambda g: {"qkv": _randn(g, 11, 3, 2, 16)},
            lambda i: varlen_attention(i["qkv"], cu(i), 7),
        ),
        Case(
            "embedding",
            "bert_fast._C embedding",
            _launchers("bert_fast.ops.embedding", "_launch_fwd", "_launch_bwd"),
            _embedding_make,
            _emb,
            _emb,
        ),
    ]


CASES = _cases()
BY_NAME = {c.name: c for c in CASES}
KINDS = ("compile", "launch", "perturb", "nan")
REASONS = {
    "compile": "raised CompilationError",
    "launch": "raised RuntimeError: CUDA error",
    "perturb": "exceeds the bound",
    "nan": "NaN/Inf",
}


def leaves(inp):
    return [v for v in inp.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def run(case, inp, dropout_p=0.0, seed=1234):
    """(output, gradients of the leaves) of one forward + backward (grads reset afterwards)."""
    torch.manual_seed(seed)
    out = case.forward(inp, dropout_p)
    g = torch.Generator().manual_seed(99)
    out.backward(torch.randn(out.shape, generator=g).to(out.device, out.dtype))
    grads = []
    for t in leaves(inp):
        grads.append(None if t.grad is None else t.grad.clone())
        t.grad = None
    return out.detach(), grads


# ----------------------------------------------------------------------------- instruments
def _compile_error():
    from triton.compiler.errors import CompilationError

    return CompilationError(None, None, "injected: ptxas fatal: Unsupported .target 'sm_999'")


def _spoil(out, kind):
    """A copy of the launcher's outputs with element 0 of its first floating tensor perturbed by
    1 + max|value| ("perturb"), by 1% of that ("small") or set to NaN (inputs are never modified:
    a launcher may return one of them)."""
    if isinstance(out, torch.Tensor):
        if out.is_floating_point() and out.numel():
            out = out.clone()
            flat = out.view(-1)
            size = (1.0 if kind == "perturb" else 0.01) * (1.0 + out.abs().max())
            flat[0] = float("nan") if kind == "nan" else flat[0] + size
            return out
        return None
    if isinstance(out, (tuple, list)):
        done, items = False, []
        for t in out:
            if not done and isinstance(t, torch.Tensor):
                new = _spoil(t, kind)
                if new is not None:
                    items.append(new)
                    done = True
                    continue
            items.append(t)
        return type(out)(items)
    return out


def inject(monkeypatch, case, direction, kind, calls):
    """Replace the launcher of ``direction`` by one that counts its calls and fails as ``kind``."""
    mod_name, attr = case.patch[direction]
    mod = importlib.import_module(mod_name)
    real = getattr(mod, attr)

    def launcher(*args, **kwargs):
        calls[direction] = calls.get(direction, 0) + 1
        if kind == "compile":
            raise _compile_error()
        if kind == "launch":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        out = real(*args, **kwargs)
        return _spoil(out, kind) if kind in ("perturb", "small", "nan") else out

    monkeypatch.setattr(mod, attr, launcher)


class Spy:
    """Counts the torch implementation's calls per direction and keeps the last outputs and keep=."""

    def __init__(self, monkeypatch, case):
        self.calls, self.last, self.keep = {}, {}, {}
        for direction, name in case.impl.items():
            real = getattr(torch_impl, name)

            def wrapper(*args, _real=real, _dir=direction, **kwargs):
                if getattr(fused_sdpa._SUSPENDED, "on", False):
                    # not a fallback: on CUDA the torch implementation's fused attention checks
                    # itself at first use, and the backward's bounds call these functions on CPU
                    # copies (fused_sdpa._compare); counting them would replace `last` by CPU tensors
                    return _real(*args, **kwargs)
                self.calls[_dir] = self.calls.get(_dir, 0) + 1
                self.keep[_dir] = kwargs.get("keep")
                out = _real(*args, **kwargs)
                self.last[_dir] = out
                return out

            monkeypatch.setattr(torch_impl, name, wrapper)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _verdicts(store: Path) -> dict:
    found = {}
    for f in store.glob("*.json"):
        for key, entry in json.loads(f.read_text())["verdicts"].items():
            found[(f.name.rsplit("-", 1)[0], key)] = entry
    return found


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Verdicts in a temporary directory, the default mode, nothing remembered in memory."""
    d = tmp_path / "verdicts"
    monkeypatch.setenv("BERT_FAST_VERIFY_DIR", str(d))
    monkeypatch.setenv("BERT_FAST_VERIFY", "first")
    monkeypatch.delenv("BERT_FAST_BACKEND", raising=False)
    _verify.reset()
    yield d
    _verify.reset()


def _fallback_warnings(record):
    return [w for w in record if issubclass(w.category, KernelFallbackWarning)]


# ----------------------------------------------------------------------------- injected failures
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_injected_failure_falls_back(case, direction, kind, store, monkeypatch, device):
    inp = case.inputs(device)
    calls = {}
    inject(monkeypatch, case, direction, kind, calls)
    spy = Spy(monkeypatch, case)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out1, grads1 = run(case, inp)
        launched = calls[direction]
        expected = spy.last[direction]
        out2, grads2 = run(case, inp)

    # the op returned the torch implementation's result
    if direction == "fwd":
        assert torch.equal(out1.reshape(-1), _first(expected).detach().reshape(-1))
    else:
        exp = [e for e in (expected if isinstance(expected, (tuple, list)) else [expected])]
        got = [g for g in grads1 if g is not None]
        exp = [e for e in exp if e is not None and e.numel()]
        assert len(got) == len(exp)
        for g, e in zip(got, exp):
            assert torch.equal(g.reshape(-1), e.reshape(-1))
    # later calls go straight to it: the same result, no launch, no new check
    assert torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(grads1, grads2) if a is not None)
    assert calls[direction] == launched, "a call after the failed check launched the kernel again"
    # exactly one warning, naming the kernel, the specialization, the reason and the report command
    fw = _fallback_warnings(record)
    assert len(fw) == 1, [str(w.message) for w in fw]
    msg = str(fw[0].message)
    assert case.label in msg and f"{direction}|" in msg and REPORT in msg and REASONS[kind] in msg, msg
    # the verdict is on disk
    fails = {k: v for k, v in _verdicts(store).items() if v["verdict"] == "fail"}
    assert len(fails) == 1, fails
    (op, key), entry = next(iter(fails.items()))
    assert key.startswith(direction + "|") and REASONS[kind] in entry["reason"]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_bound_catches_a_one_percent_error(case, direction, store, monkeypatch, device):
    """The bound is not vacuous: one element off by 1% of (1 + max |value|) fails every op's check in
    fp32, forward and backward (a bound 1000x looser passes it)."""
    monkeypatch.setenv("BERT_FAST_VERIFY", "strict")
    inject(monkeypatch, case, direction, "small", {})
    with pytest.raises(KernelCheckError, match="exceeds the bound"):
        run(case, case.inputs(device))


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_strict_mode_raises(case, direction, store, monkeypatch, device):
    monkeypatch.setenv("BERT_FAST_VERIFY", "strict")
    calls = {}
    inject(monkeypatch, case, direction, "perturb", calls)
    inp = case.inputs(device)
    with pytest.raises(KernelCheckError, match=case.label.replace(".", r"\.")):
        run(case, inp)
    # kept: strict raises again, now without launching
    n = calls[direction]
    with pytest.raises(KernelCheckError, match="failed its check earlier"):
        run(case, inp)
    assert calls[direction] == n


# ----------------------------------------------------------------------------- fresh processes
_CHILD = textwrap.dedent("""
    import json, sys, warnings
    sys.path.insert(0, {tests!r})
    import torch
    import test_verify as tv
    from bert_fast.ops import _verify
    import pytest
    report = {{}}
    mp = pytest.MonkeyPatch()
    for store in {stores!r}:
        mp.setenv("BERT_FAST_VERIFY_DIR", store)
        _verify.reset()
        for case in tv.CASES:
            calls = {{}}
            for direction in ("fwd", "bwd"):
                mod = __import__(case.patch[direction][0], fromlist=["x"])
                real = getattr(mod, case.patch[direction][1])
                def counted(*a, _real=real, _d=direction, **k):
                    calls[_d] = calls.get(_d, 0) + 1
                    return _real(*a, **k)
                mp.setattr(mod, case.patch[direction][1], counted)
            spy = tv.Spy(mp, case)
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                tv.run(case, case.inputs(torch.device({device!r})))
            report.setdefault(store, {{}})[case.name] = {{
                "launches": calls, "fallback": spy.calls,
                "warnings": [str(w.message) for w in rec if issubclass(w.category, _verify.KernelFallbackWarning)]}}
            mp.undo()
            mp.setenv("BERT_FAST_VERIFY_DIR", store)
    print("REPORT" + json.dumps(report))
""")


def _child(stores, device):
    code = _CHILD.format(tests=str(Path(__file__).parent), stores=[str(s) for s in stores], device=str(device))
    env = dict(os.environ, BERT_FAST_VERIFY="first")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT"))
    return json.loads(line[len("REPORT") :])


FOLLOWS = {"residual_layer_norm", "attention", "varlen_attention", "embedding"}  # backward follows forward


def test_fresh_process_honours_verdicts(tmp_path, monkeypatch, device):
    """Three stores written here: every forward failed (a), every backward failed (b), all passed (c).
    A fresh process then launches no failed kernel, calls the torch implementation exactly for
    them (a backward of a failed forward follows it where the forward saved what it reads), warns
    once per kept failure, and for passed verdicts calls the torch implementation 0 times."""
    stores = {name: tmp_path / name for name in ("a", "b", "c")}
    monkeypatch.setenv("BERT_FAST_VERIFY", "first")
    for name, failing in (("a", "fwd"), ("b", "bwd"), ("c", None)):
        monkeypatch.setenv("BERT_FAST_VERIFY_DIR", str(stores[name]))
        _verify.reset()
        for case in CASES:
            with monkeypatch.context() as mp:
                if failing:
                    inject(mp, case, failing, "launch", {})
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", KernelFallbackWarning)
                    run(case, case.inputs(device))
    _verify.reset()
    report = _child(stores.values(), device)
    a, b, c = (report[str(stores[n])] for n in ("a", "b", "c"))
    for case in CASES:
        n = case.name
        # (a) forward failed: never launched, the torch implementation once
        assert a[n]["launches"].get("fwd", 0) == 0 and a[n]["fallback"].get("fwd") == 1, (n, a[n])
        if n in FOLLOWS:
            assert a[n]["launches"].get("bwd", 0) == 0 and a[n]["fallback"].get("bwd") == 1, (n, a[n])
        else:
            assert a[n]["launches"].get("bwd", 0) > 0 and a[n]["fallback"].get("bwd", 0) == 0, (n, a[n])
        # (b) backward failed: the forward is the kernel, unchecked; the backward the torch implementation
        assert b[n]["launches"].get("fwd", 0) > 0 and b[n]["fallback"].get("fwd", 0) == 0, (n, b[n])
        assert b[n]["launches"].get("bwd", 0) == 0 and b[n]["fallback"].get("bwd") == 1, (n, b[n])
        # (c) passed: kernels only, 0 extra calls
        assert c[n]["launches"].get("fwd", 0) > 0 and c[n]["launches"].get("bwd", 0) > 0, (n, c[n])
        assert c[n]["fallback"] == {}, (n, c[n])
        assert not c[n]["warnings"]
        for side in (a, b):
            assert len(side[n]["warnings"]) == 1 and "failed its check earlier" in side[n]["warnings"][0]


# ----------------------------------------------------------------------------- dropout
DROPOUT_CASES = [BY_NAME["residual_layer_norm"], BY_NAME["attention"], BY_NAME["embedding"]]


def _kernel_mask(case, inp, seed):
    """The keep-mask the kernel applies for the op's seed (drawn the way the op draws it)."""
    mask = None
    torch.manual_seed(seed)
    if case.name == "residual_layer_norm":
        from bert_fast.ops import residual_layer_norm

        _, mask = residual_layer_norm(inp["x"], inp["r"], inp["w"], inp["b"], 1e-5, 0.25, return_dropout_mask=True)
    elif case.name == "attention":
        from bert_fast.ops import attention

        _, mask = attention(inp["qkv"], _key_mask(inp["qkv"].device), 0.25, return_dropout_mask=True)
    else:
        from bert_fast.ops import _dispatch
        from bert_fast.ops.embedding import embedding_dropout_mask

        seed_t = _dispatch.draw_seed(0.25)
        mask = embedding_dropout_mask(10, 24, 0.25, seed_t, inp["word"].device)
    return mask


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=repr)
def test_dropout_checked_with_the_kernels_mask(case, store, monkeypatch, device):
    """With dropout the check runs the torch implementation on the kernel's own keep-mask, and a
    correct kernel passes (no false alarm)."""
    spy = Spy(monkeypatch, case)
    inp = case.inputs(device)
    run(case, inp, dropout_p=0.25, seed=7)
    expected = _kernel_mask(case, inp, 7)
    for direction in ("fwd", "bwd"):
        keep = spy.keep[direction]
        assert keep is not None and torch.equal(keep.reshape(-1).cpu(), expected.reshape(-1).cpu())
    assert {v["verdict"] for v in _verdicts(store).values()} == {"pass"}


@pytest.mark.parametrize("kind", ["launch", "nan"])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=repr)
def test_dropout_forward_fallback_draws_its_own_stream(case, kind, store, monkeypatch, device):
    """A forward that fails (raising, or after a check on the kernel's mask) falls back to the torch
    implementation's own dropout stream, and so does its backward: the result is exactly
    BERT_FAST_BACKEND=torch's for the same seed."""
    inject(monkeypatch, case, "fwd", kind, {})
    inp = case.inputs(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        out, grads = run(case, inp, dropout_p=0.25, seed=7)
    monkeypatch.setenv("BERT_FAST_BACKEND", "torch")
    ref_out, ref_grads = run(case, inp, dropout_p=0.25, seed=7)
    assert torch.equal(out, ref_out)
    for g, r in zip(grads, ref_grads):
        assert (g is None and r is None) or torch.equal(g, r)
    if case.name != "embedding":  # the ops' return_dropout_mask names the torch implementation's mask
        monkeypatch.delenv("BERT_FAST_BACKEND")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KernelFallbackWarning)
            mask = _kernel_mask(case, inp, 7)
        from bert_fast.ops import _dispatch

        torch.manual_seed(7)
        seed_t = _dispatch.draw_seed(0.25)
        assert torch.equal(mask, _dispatch.reference_dropout_mask(mask.shape, 0.25, seed_t, mask.device))


@pytest.mark.parametrize("kind", ["launch", "nan"])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=repr)
def test_dropout_backward_fallback_keeps_the_kernels_mask(case, kind, store, monkeypatch, device):
    """A backward that fails (raising, or on the check) after a kernel forward stands in with the
    kernel's mask (the forward dropped those elements), not the torch implementation's stream."""
    inject(monkeypatch, case, "bwd", kind, {})
    spy = Spy(monkeypatch, case)
    inp = case.inputs(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        run(case, inp, dropout_p=0.25, seed=7)
    keep = spy.keep["bwd"]
    assert keep is not None and torch.equal(keep.reshape(-1).cpu(), _kernel_mask(case, inp, 7).reshape(-1).cpu())


# ----------------------------------------------------------------------------- modes, graphs, compile
def test_modes_always_and_off(store, monkeypatch, device):
    case = BY_NAME["bias_gelu"]
    spy = Spy(monkeypatch, case)
    inp = case.inputs(device)
    monkeypatch.setenv("BERT_FAST_VERIFY", "always")
    run(case, inp)
    run(case, inp)
    assert spy.calls == {"fwd": 2, "bwd": 2}  # a check every call
    monkeypatch.setenv("BERT_FAST_VERIFY", "off")
    calls = {}
    inject(monkeypatch, case, "fwd", "nan", calls)
    out, _ = run(case, inp)
    assert torch.isnan(out).any() and spy.calls["fwd"] == 2  # unchecked: the kernel's NaN comes through
    monkeypatch.setenv("BERT_FAST_VERIFY", "sometimes")
    with pytest.raises(ValueError, match="BERT_FAST_VERIFY"):
        run(case, inp)


def test_cuda_graph_capture_never_checks(store, monkeypatch, device):
    """While a graph is captured a specialization never seen runs the torch implementation,
    unchecked and unrecorded; a kept verdict is honoured (here: pass, the kernel)."""
    case = BY_NAME["bias_gelu"]
    calls = {}
    inject(monkeypatch, case, "fwd", "ok", calls)
    spy = Spy(monkeypatch, case)
    inp = case.inputs(device)
    monkeypatch.setattr(_verify, "_capturing", lambda dev: True)
    with torch.no_grad():
        case.forward(inp)
    assert calls.get("fwd", 0) == 0 and spy.calls == {"fwd": 1} and not _verdicts(store)
    monkeypatch.setattr(_verify, "_capturing", lambda dev: False)
    with torch.no_grad():
        case.forward(inp)  # the warm-up: checked, passes
    monkeypatch.setattr(_verify, "_capturing", lambda dev: True)
    with torch.no_grad():
        case.forward(inp)
    assert calls["fwd"] == 2 and spy.calls == {"fwd": 2}


def test_torch_compile_fullgraph(store, monkeypatch, device):
    """The check lives inside the custom op: torch.compile(fullgraph=True) traces the op without a
    break, and the compiled call is checked (and falls back) like the eager one."""
    from bert_fast.ops import bias_gelu

    case = BY_NAME["bias_gelu"]
    inject(monkeypatch, case, "fwd", "nan", {})
    spy = Spy(monkeypatch, case)
    inp = case.inputs(device)
    fn = torch.compile(lambda x, b: bias_gelu(x, b) * 2.0, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = fn(inp["x"], inp["b"])
    assert torch.equal(out, spy.last["fwd"] * 2.0)
    assert len(_fallback_warnings(record)) == 1
    assert any(v["verdict"] == "fail" for v in _verdicts(store).values())


# ----------------------------------------------------------------------------- the store
def test_store_merge_atomic_and_fail_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("BERT_FAST_VERIFY_DIR", str(tmp_path))
    path = tmp_path / "op-x.json"
    ident = {"op": "op"}
    assert _verify._write(path, ident, "fwd|a", {"verdict": "pass"})
    assert _verify._write(path, ident, "fwd|b", {"verdict": "fail", "reason": "r"})  # merged, not replaced
    assert _verify._write(path, ident, "fwd|b", {"verdict": "pass"})  # a pass never hides a fail
    entries = _verify._read(path)
    assert entries["fwd|a"]["verdict"] == "pass" and entries["fwd|b"]["verdict"] == "fail"
    assert not list(tmp_path.glob("*.tmp"))
    path.write_text("{not json")
    assert _verify._read(path) == {}  # corrupt: check again
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        assert not _verify._write(ro / "sub" / "op-y.json", ident, "fwd|a", {"verdict": "pass"})
    finally:
        ro.chmod(0o700)


def test_identity_names_versions_device_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("BERT_FAST_VERIFY_DIR", str(tmp_path))
    path, ident = _verify._store_path("attention", torch.device("cpu"))
    assert path.parent == tmp_path and path.name.startswith("attention-")
    assert {"torch", "triton", "cuda", "device", "source"} <= set(ident)
    assert ident["source"] == _verify.source_hash("attention") != _verify.source_hash("linear")


# ----------------------------------------------------------------------------- why the suite runs strict
_PLANT = """
    import os
    import pytest
    import bert_fast.kernels.bias_gelu as kernel

    _real = kernel.bias_gelu_fwd

    def planted(x2d, bias, approximate):          # a kernel bug: one element off
        y = _real(x2d, bias, approximate).clone()
        y.view(-1)[0] += 0.5 + y.abs().max()
        return y

    kernel.bias_gelu_fwd = planted

    @pytest.fixture(autouse=True)
    def _verify_mode(monkeypatch):
        monkeypatch.setenv("BERT_FAST_VERIFY", os.environ["PLANT_VERIFY"])
"""


def test_strict_mode_keeps_kernel_bugs_visible_to_the_parity_tests(tmp_path):
    """A kernel bug planted under tests/ops/test_bias_gelu.py's parity test: with the default
    BERT_FAST_VERIFY=first the op quietly returns the torch implementation's result and the parity
    test passes (the bug is hidden); with strict, the mode the test session runs in, it fails."""
    (tmp_path / "plant_bias_gelu.py").write_text(textwrap.dedent(_PLANT))
    tests_dir = Path(__file__).resolve().parent

    def parity(mode):
        env = dict(
            os.environ,
            PLANT_VERIFY=mode,
            BERT_FAST_VERIFY_DIR=str(tmp_path / mode),
            PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        )
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:cacheprovider",
                "-p",
                "plant_bias_gelu",
                str(tests_dir / "test_bias_gelu.py"),
                "-k",
                "test_bias_gelu_2x and none-7-312",
            ],
            cwd=tests_dir.parents[1],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    hidden, strict = parity("first"), parity("strict")
    assert hidden.returncode == 0 and "passed" in hidden.stdout, hidden.stdout[-2000:]
    assert strict.returncode != 0 and "KernelCheckError" in strict.stdout, strict.stdout[-2000:]
