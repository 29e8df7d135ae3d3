"""Atomic training checkpoints.

A checkpoint is a directory ``<output>/checkpoints/step_00000123/``:

  model.safetensors   the model's full state dict, transformers' key names (under FSDP gathered to
                      rank 0 with get_model_state_dict(full_state_dict=True, cpu_offload=True))
  config.json         the model config, so transformers' ``from_pretrained(dir)`` loads it directly
  optimizer.pt        the full optimizer state (parameter names as keys; torch.load weights_only)
  scheduler.pt        LR scheduler (+ GradScaler) state
  rng_rank<r>.pt      python, numpy, torch CPU and CUDA generator states of rank r
  trainer_state.json  epoch, step within the epoch, global step, tokens seen, world size, args;
                      written last

Atomicity: rank 0 creates ``step_N.tmp-<pid>``, every rank writes its files there (each file itself
via temp file + os.replace), then, after a barrier, rank 0 renames the directory to ``step_N`` (the
commit) and atomically rewrites ``latest`` (a text file naming it). A crash at any point leaves
either the previous checkpoint or the complete new one; stray ``*.tmp-*`` directories are ignored
and removed by the next save.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Dict

import numpy as np
import torch
import torch.distributed as dist

from bert_fast.training.distributed import DistInfo, barrier

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.pt"
SCHED_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A missing, incomplete or unreadable checkpoint; the message names the path."""


# ----------------------------------------------------------------------------- atomic files
def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(Path(path), lambda f: f.write(text.encode("utf-8")))


def atomic_torch_save(obj, path: Path) -> None:
    _atomic_write(Path(path), lambda f: torch.save(obj, f))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- state pieces
def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # different GPU count: restore this process's device only
            torch.cuda.set_rng_state(cuda[min(torch.cuda.current_device(), len(cuda) - 1)])


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def full_model_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The full (unsharded) state dict on the CPU with the user module's key names (all ranks
    must call it; under FSDP only rank 0 gets the tensors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))


def full_optimizer_state_dict(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))


# ----------------------------------------------------------------------------- save
def checkpoint_dir(output_dir: os.PathLike, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:08d}"


def list_checkpoints(output_dir: os.PathLike):
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def save_checkpoint(
    output_dir: os.PathLike,
    step: int,
    model,
    optimizer,
    scheduler,
    scaler,
    trainer_state: dict,
    info: DistInfo,
    unwrapped: torch.nn.Module,
    keep: int = 0,
) -> Path:
    """Write the checkpoint of ``step`` atomically (all ranks call this). Returns its path."""
    root = Path(output_dir) / "checkpoints"
    final = checkpoint_dir(output_dir, step)
    tmp = root / f"{final.name}.tmp-{os.getpid() if info.is_main else 0}"
    # Every rank must know rank 0's pid: broadcast the temp name.
    name = [tmp.name]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    tmp = root / name[0]
    if info.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier(info)

    model_sd = full_model_state_dict(model)
    optim_sd = full_optimizer_state_dict(model, optimizer)
    if info.is_main:
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in model_sd.items()}
        _atomic_write(tmp / MODEL_FILE, lambda f: f.write(_safetensors_bytes(tensors)))
        unwrapped.config.to_json_file(str(tmp / "config.json"))
        atomic_torch_save(optim_sd, tmp / OPTIM_FILE)
        sched = {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None}
        atomic_torch_save(sched, tmp / SCHED_FILE)
    del model_sd, optim_sd
    atomic_torch_save(rng_state(), tmp / f"rng_rank{info.rank}.pt")
    barrier(info)
    if info.is_main:
        state = dict(trainer_state, step=step, world_size=info.world_size)
        atomic_write_text(tmp / STATE_FILE, json.dumps(state, indent=2, default=str))
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (e.g. SIGTERM right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        atomic_write_text(Path(output_dir) / LATEST, final.name + "\n")
        if keep and keep > 0:
            for old in list_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier(info)
    return final


def _safetensors_bytes(tensors: Dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt"})


# ----------------------------------------------------------------------------- load
def resolve(resume: str, output_dir: os.PathLike) -> Path:
    """``latest`` -> the newest complete checkpoint of output_dir; else the given directory."""
    if resume == "latest":
        pointer = Path(output_dir) / LATEST
        if pointer.is_file():
            cand = Path(output_dir) / "checkpoints" / pointer.read_text().strip()
            if (cand / STATE_FILE).is_file():
                return cand
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(f"--resume latest: no checkpoint found in {Path(output_dir) / 'checkpoints'}")
        return found[-1]
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path} (expected a directory)")
    return path


def read_trainer_state(path: Path) -> dict:
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise CheckpointError(f"incomplete checkpoint {path}: {STATE_FILE} is missing")
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"corrupt checkpoint file {f}: {exc}") from None


def _torch_load(path: Path):
    if not path.is_file():
        raise CheckpointError(f"incomplete checkpoint: {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"corrupt checkpoint file {path}: {type(exc).__name__}: {exc}") from None


def load_model_weights(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    f = Path(path) / MODEL_FILE
    if not f.is_file():
        raise CheckpointError(f"incomplete checkpoint: {f} is missing")
    try:
        return load_file(str(f), device="cpu")
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"corrupt checkpoint file {f}: {type(exc).__name__}: {exc}") from None


def validate(path: Path) -> dict:
    """Check that every file of the checkpoint is there and readable; returns the trainer state."""
    path = Path(path)
    state = read_trainer_state(path)
    for name in (MODEL_FILE, OPTIM_FILE, SCHED_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"incomplete checkpoint: {path / name} is missing")
    return state


def load_checkpoint(path: Path, model, optimizer, scheduler, scaler, info: DistInfo) -> dict:
    """Restore model, optimizer, scheduler, scaler and this rank's RNG from ``path`` (all ranks
    read the files: a shared filesystem is assumed). Returns the trainer state."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    state = validate(path)
    weights = load_model_weights(path)
    try:
        set_model_state_dict(model, weights, options=_options(full_state_dict=True, strict=True))
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path / MODEL_FILE} does not fit this model: {exc}") from None
    optim_sd = _torch_load(path / OPTIM_FILE)
    try:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=_options(full_state_dict=True))
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path / OPTIM_FILE} does not fit this optimizer: {exc}") from None
    sched = _torch_load(path / SCHED_FILE)
    scheduler.load_state_dict(sched["scheduler"])
    if scaler is not None and sched.get("scaler"):
        scaler.load_state_dict(sched["scaler"])
    rng_file = path / f"rng_rank{info.rank}.pt"
    if rng_file.is_file():
        set_rng_state(_load_rng(rng_file))
    elif info.is_main:
        print(f"warning: {rng_file} missing (different world size?): RNG streams are not restored")
    return state


def _load_rng(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"corrupt checkpoint file {path}: {type(exc).__name__}: {exc}") from None
