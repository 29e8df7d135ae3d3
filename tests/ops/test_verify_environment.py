"""A kernel that fails because of the machine around it (an OSError while compiling: no C compiler
for Triton's launcher, an unwritable cache; memory exhausted) falls back for this process only: its
verdict is not kept on disk, so the next process checks the kernel again. Seen on an H200: a
clobbered CC made every kernel "fail", the kept verdicts then sent a later run's benchmarks to the
torch fallbacks. A kernel that raises anything else (a compile error of its own, a launch fault)
keeps its verdict as before."""

from __future__ import annotations

import warnings

import pytest
import torch

from bert_fast.ops import _verify
from bert_fast.ops._verify import KernelFallbackWarning


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("BERT_FAST_VERIFY_DIR", str(tmp_path))
    monkeypatch.setenv("BERT_FAST_VERIFY", "first")
    _verify.reset()
    yield tmp_path
    _verify.reset()


def _run(kernel, spec=("fp32", 4)):
    x = torch.arange(4.0)
    return _verify.run(
        "bias_gelu",
        "fwd",
        spec,
        torch.device("cpu"),
        label="test kernel",
        dtype=torch.float32,
        kernel=kernel,
        fallback=lambda keep: x * 2,
        checks=lambda k, t, keep: [_verify.Check("y", k, t, mag=t.abs())],
    )


def _kept(store) -> list:
    return [p for p in store.glob("*.json") if '"fail"' in p.read_text()]


def _raise(exc):
    def kernel():
        raise exc

    return kernel


@pytest.mark.parametrize(
    "exc",
    [FileNotFoundError(2, "No such file or directory", "90-real"), PermissionError(13, "denied"), MemoryError()],
    ids=["no-compiler", "unwritable-cache", "memory"],
)
def test_environment_error_falls_back_for_this_process_only(store, exc):
    with pytest.warns(KernelFallbackWarning, match="not kept"):
        out = _run(_raise(exc))
    assert torch.equal(out, torch.arange(4.0) * 2)  # the torch implementation's result
    assert _kept(store) == []  # nothing on disk
    # this process goes on with the fallback without trying the kernel again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_run(_raise(AssertionError("must not run"))), torch.arange(4.0) * 2)
    # a new process (reset: no memory) checks the kernel again and it passes
    _verify.reset()
    assert torch.equal(_run(lambda: torch.arange(4.0) * 2), torch.arange(4.0) * 2)
    assert _verify.verdict("bias_gelu", "fwd", ("fp32", 4), torch.device("cpu")) == _verify.PASS


def test_a_kernel_error_is_still_kept(store):
    with pytest.warns(KernelFallbackWarning):
        _run(_raise(RuntimeError("illegal memory access")))
    assert len(_kept(store)) == 1
    _verify.reset()
    assert _verify.verdict("bias_gelu", "fwd", ("fp32", 4), torch.device("cpu")) == _verify.FAIL
