"""Per-device limits that decide which kernel configurations can launch at all."""

from __future__ import annotations

import torch


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
