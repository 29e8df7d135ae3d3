"""Where a kernel runs: the GPU's limits that decide which kernel configurations can launch at all,
and the Triton interpreter (TRITON_INTERPRET=1, the CPU tests), whose loops need Python bounds."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def smem_per_block(device: torch.device) -> int:
    """Opt-in shared memory per block (bytes) of ``device``: what a Triton kernel may use
    (232,448 B on H100/H200 and B200, 166,912 B on A100, ~99 KB on consumer parts)."""
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    if not smem:  # older torch: by compute capability
        major, minor = props.major, props.minor
        smem = (
            232448
            if (major, minor) in ((9, 0), (10, 0), (10, 3))
            else (166912 if (major, minor) in ((8, 0), (8, 7)) else 101376)
        )
    return int(smem)


def num_sms(device: torch.device) -> int:
    """The SMs of ``device``, which persistent grids and small-batch tile choices size themselves by;
    4 in the interpreter (a few programs, each walking several tiles)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    # once per GPU: the launchers ask at every launch (a device-properties query is 1-3 us on a
    # lease's host, ~240 of them with the capability queries per eager bert-base forward)
    return torch.cuda.get_device_properties(index).multi_processor_count


def interpreting() -> bool:
    """Whether kernels run in Triton's CPU interpreter (the kernels' INTERPRET constexpr)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def loop_bound(n, INTERPRET: tl.constexpr):
    """``n``, a run-time scalar, as a range() bound. Compiled, it is ``n`` itself (the loop stays a
    pipelinable for loop). Triton 3.6's interpreter turns a tensor bound into int() of a 1-element
    array, which NumPy 2.x deprecates and 2.4 rejects, so there it is a Python int (returned, not
    assigned: the interpreter turns every assigned value back into a tensor)."""
    if INTERPRET:
        return n.handle.data.item()
    return n
