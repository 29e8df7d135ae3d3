"""One benchmark case of one op, shared by `bert-fast bench-ops` and benchmarks/bench_<op>.py.

Each op contributes ``bert_fast/bench/op_cases/<op>.py`` with a function
``cases(device, dtype) -> list[OpCase]``. A provider is a *factory*: calling it builds fresh random
inputs (never zeros) and returns the zero-argument callable to time. The timer calls the factory
several times and rotates through the input sets, so caches do not flatter the figures; for a
backward case the factory runs the forward itself and the timed callable is the backward alone.

A provider that cannot run on the device or build at hand is not a failure: ``cases()`` names it
in ``OpCase.unavailable`` with a one-line reason when that is known up front (say a cuBLAS path on
the CPU), and a provider that only finds out by trying raises ``ProviderUnavailable`` (say an
SDPA backend that torch reports has no kernel here). Both are reported as skipped, with the
reason, and do not fail the command.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict

from bert_fast.bench.timing import ProviderUnavailable  # noqa: F401 - re-exported for the op case modules

Factory = Callable[[], Callable[[], Any]]


@dataclass
class OpCase:
    op: str  # "embedding", "linear", "bias_gelu", "residual_layer_norm", "attention"
    label: str  # shape description, e.g. "T=16384 H=768"
    direction: str  # "fwd" or "bwd"
    bound: str  # "memory" (report GB/s vs copy bandwidth) or "compute" (TFLOP/s vs matrix rate)
    flops: float = 0.0  # useful FLOPs of one call
    bytes: float = 0.0  # minimal bytes one call must move (read + write)
    providers: Dict[str, Factory] = field(default_factory=dict)  # "bert_fast", "torch", "torch.compile", ...
    params: Dict[str, Any] = field(default_factory=dict)  # shape parameters, for JSON
    unavailable: Dict[str, str] = field(default_factory=dict)  # provider -> why it cannot run here

    @property
    def name(self) -> str:
        return f"{self.op}/{self.direction}/{self.label}"


def with_env(name: str, value: str, run: Callable[[], Any]) -> Any:
    """run() with the environment variable ``name`` set to ``value``, restored afterwards: for
    providers that pin a kernel variant our launchers read from the environment at each call."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return run()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
