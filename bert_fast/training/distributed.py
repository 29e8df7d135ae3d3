"""Process group, device and model wrapping (DDP, FSDP2 ``fully_shard``, FSDP1 fallback).

Under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK in the environment) the default process group is
initialised with NCCL on CUDA and gloo on the CPU; without it the run is a single process.

FSDP: every encoder layer is its own FSDP2 unit (bert_fast's layers are ordinary module calls, so
the per-layer all-gather / free hooks fire), the root holds embeddings and heads.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or (dist.is_available() and dist.is_initialized())


def setup(device: Optional[str] = None, timeout_s: int = 1800) -> DistInfo:
    """Initialise torch.distributed when launched by torchrun; pick this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device in (None, "", "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {device}: CUDA is not available")
        if dev.index is None:
            n_gpus = torch.cuda.device_count()
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if local_world > n_gpus or local_rank >= n_gpus:
                # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): say so up front.
                raise RuntimeError(
                    f"{max(local_world, local_rank + 1)} ranks on this node but {n_gpus} visible CUDA GPU(s): "
                    f"launch at most {n_gpus} processes per node (torchrun "
                    f"--nproc_per_node) or train on the CPU with --device cpu"
                )
            dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if "RANK" in os.environ and world >= 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        try:
            dist.init_process_group(**kwargs)
        except TypeError:  # older torch: no device_id
            kwargs.pop("device_id", None)
            dist.init_process_group(**kwargs)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if dist.is_initialized():
        if info.device.type == "cuda":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def all_reduce_sum(values, info: DistInfo) -> list:
    """Sum a few host numbers over ranks (one small all-reduce); identity for one process."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True when ``flag`` holds on any rank (the ranks agree, e.g. on stopping after SIGTERM)."""
    if not dist.is_initialized():
        return bool(flag)
    return all_reduce_sum([1.0 if flag else 0.0], info)[0] > 0


# ----------------------------------------------------------------------------- wrapping
def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return False
    return True


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def wrap_model(model: torch.nn.Module, strategy: str, info: DistInfo):
    """Return (wrapped model, kind) with kind in {"none", "ddp", "fsdp2", "fsdp1"}."""
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"--strategy must be ddp or fsdp, got {strategy!r}")
    if not dist.is_initialized():
        return model, "none"
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DDP(
            model,
            device_ids=ids,
            output_device=ids[0] if ids else None,
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
        ), "ddp"
    if fsdp2_available():
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = _fully_shard()
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        # One FSDP unit per encoder layer (bert_fast's layers are module calls, so the per-layer
        # all-gather hooks fire), then the root for embeddings and heads.
        for layer in getattr(model, "bert", model).encoder.layer:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, "fsdp2"
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(
        model,
        device_id=info.device if info.device.type == "cuda" else None,
        use_orig_params=True,
        sync_module_states=False,
    ), "fsdp1"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP / FSDP1 wrapper (FSDP2 wraps in place)."""
    return getattr(model, "module", model)


def no_sync(model: torch.nn.Module, kind: str, sync: bool):
    """Context for one micro-batch: skip the gradient all-reduce / reduce-scatter unless ``sync``
    (the last micro-batch of an accumulation)."""
    if kind in ("ddp", "fsdp1") and not sync:
        return model.no_sync()
    if kind == "fsdp2":
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
