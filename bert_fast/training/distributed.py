"""Process group, device and model wrapping (DDP, FSDP2 ``fully_shard``, FSDP1 fallback).

Under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK in the environment) the default process group is
initialised with NCCL on CUDA and gloo on the CPU; without it the run is a single process.

FSDP: every encoder layer is its own FSDP2 unit (bert_fast's layers are ordinary module calls, so
the per-layer all-gather / free hooks fire), the root holds embeddings and heads. bert_fast
recognises FSDP2's dynamic layer subclasses (bert_fast.model.compat.base_class), so sharded layers
stay on the fused path.

Mixed precision under FSDP (``--precision bf16``): ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: the sharded parameters, their gradients and the optimizer stay fp32 (the
master weights); each layer's all-gather sends bf16 (half the bytes), the forward and backward run
on those bf16 copies, and the gradient reduce-scatter runs in fp32. ``--precision bf16-pure``
shards bf16 parameters (fp32 master copies live in the optimizer, training/master_weights.py).

Resharding (``--fsdp-reshard-after-forward``): true (default, ZeRO-3 like) frees each layer's
gathered parameters after its forward and all-gathers them again in the backward: the least memory,
one extra all-gather per layer per micro-batch. false keeps them gathered from the forward to the
backward (ZeRO-2 like): one all-gather fewer per layer, at the cost of holding every layer's
full (param_dtype) parameters through the backward. The root module is never resharded after
forward (its backward runs first). With gradient accumulation, sync-free micro-batches keep
FSDP2's unsharded gradients until the last one.
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


def _mixed_precision_policy(precision: str):
    """FSDP2's MixedPrecisionPolicy for ``--precision`` (None: parameters are all-gathered in their
    own dtype: fp32 for fp32/fp16, bf16 for bf16-pure)."""
    if precision != "bf16":
        return None
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def parse_bool(value) -> bool:
    """``true``/``false`` (also 1/0, yes/no) of a CLI flag; ValueError naming the value otherwise."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def wrap_model(
    model: torch.nn.Module,
    strategy: str,
    info: DistInfo,
    precision: str = "fp32",
    reshard_after_forward: bool = True,
):
    """Return (wrapped model, kind) with kind in {"none", "ddp", "fsdp2", "fsdp1"}.

    ``precision`` picks FSDP's mixed-precision policy (bf16: bf16 all-gathers, fp32 reduce and
    master weights); ``reshard_after_forward`` is FSDP2's choice of the same name (module doc)."""
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"--strategy must be ddp or fsdp, got {strategy!r}")
    reshard_after_forward = parse_bool(reshard_after_forward)
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
        kw = {"mesh": mesh}
        policy = _mixed_precision_policy(precision)
        if policy is not None:
            kw["mp_policy"] = policy
        # One FSDP unit per encoder layer (bert_fast's layers are module calls, so the per-layer
        # all-gather hooks fire), then the root for embeddings and heads.
        for layer in getattr(model, "bert", model).encoder.layer:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
        fully_shard(model, **kw)  # the root: FSDP2 keeps it gathered after forward
        return model, "fsdp2"
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    extra = {}
    if precision == "bf16":
        extra["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if not reshard_after_forward:
        extra["sharding_strategy"] = ShardingStrategy.SHARD_GRAD_OP
    return FSDP(
        model,
        device_id=info.device if info.device.type == "cuda" else None,
        use_orig_params=True,
        sync_module_states=False,
        **extra,
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
