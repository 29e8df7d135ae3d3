"""One benchmark case of one op, shared by `bert-fast bench-ops` and benchmarks/bench_<op>.py.

Each op contributes ``bert_fast/bench/op_cases/<op>.py`` with a function
``cases(device, dtype) -> list[OpCase]``. A provider is a *factory*: calling it builds fresh random
inputs (never zeros) and returns the zero-argument callable to time. The timer calls the factory
several times and rotates through the input sets, so caches do not flatter the figures; for a
backward case the factory runs the forward itself and the timed callable is the backward alone.

Each op module also defines ``sample_inputs(...)``: the named tensors of one call of the op at a
shape, from a ``randn(*shape, scale=1.0)`` it is given. The same definition feeds the bench's
factories (``device_randn``: fresh values), ``bert-fast doctor``'s checks and the op's tests in
tests/ops (``seeded_randn``: values drawn on the CPU from a seeded generator, the same on any device).

A provider that cannot run on the device or build at hand is not a failure: ``cases()`` names it
in ``OpCase.unavailable`` with a one-line reason when that is known up front (say a cuBLAS path on
the CPU), and a provider that only finds out by trying raises ``ProviderUnavailable`` (say an
SDPA backend that torch reports has no kernel here). Both are reported as skipped, with the
reason, and do not fail the command.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

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


def device_randn(device, dtype) -> Callable[..., Any]:
    """The ``randn(*shape, scale=1.0)`` of the bench's inputs: fresh normal values on ``device``."""
    import torch

    def randn(*shape, scale=1.0):
        x = torch.randn(*shape, device=device, dtype=dtype)
        return x if scale == 1.0 else x * scale

    return randn


def seeded_randn(generator, device, dtype) -> Callable[..., Any]:
    """The ``randn(*shape, scale=1.0)`` of the doctor's and the tests' inputs: values drawn on the CPU
    from ``generator`` (a torch.Generator, or an int seed for a new one), then moved to ``device`` and
    cast to ``dtype``, so a seed gives the same inputs on the CPU and on a GPU."""
    import torch

    gen = torch.Generator().manual_seed(generator) if isinstance(generator, int) else generator

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    return randn


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the cases' params, in the JSON)."""
    return str(dtype).replace("torch.", "")


def fwd_bwd(op, label, bound, costs, factory, providers, params, unavailable=None, bwd_only=()) -> List[OpCase]:
    """One shape's forward and backward cases: ``costs[direction]`` is (flops, bytes) of one call,
    ``factory(provider, direction)`` a provider's factory; ``bwd_only``: providers of the backward only."""
    return [
        OpCase(
            op=op,
            label=label,
            direction=direction,
            bound=bound,
            flops=costs[direction][0],
            bytes=costs[direction][1],
            providers={p: factory(p, direction) for p in tuple(providers) + (bwd_only if direction == "bwd" else ())},
            params=dict(params),
            unavailable=unavailable if unavailable is not None else {},
        )
        for direction in ("fwd", "bwd")
    ]
