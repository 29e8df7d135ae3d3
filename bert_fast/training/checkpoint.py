"""Atomic training checkpoints.

A checkpoint is a directory ``<output>/checkpoints/step_00000123/``:

  model.safetensors   the model's full state dict, transformers' key names (under FSDP gathered to
                      rank 0 with get_model_state_dict(full_state_dict=True, cpu_offload=True))
  config.json         the model config with ``architectures`` naming the trained head
                      (BertForMaskedLM, BertForPreTraining, BertForSequenceClassification) and, for
                      classification, ``id2label``/``label2id``: transformers' ``from_pretrained(dir)``
                      and ``pipeline(..., model=dir)`` load it directly
  tokenizer files     the run's tokenizer (``AutoTokenizer.from_pretrained(dir)``), so a checkpoint is
                      self-contained: ``--init-from`` it fine-tunes with the vocabulary it was trained on
  training_args.json  every command-line argument of the run
  optimizer.pt        the full optimizer state (parameter names as keys; torch.load weights_only)
  scheduler.pt        LR scheduler (+ GradScaler) state
  rng_rank<r>.pt      python, numpy, torch CPU and CUDA generator states of rank r
  trainer_state.json  epoch, step within the epoch, global step, tokens seen, world size, args
  COMPLETE            the completion marker, written last: the name and size of every file above

Atomicity: rank 0 creates ``step_N.tmp-<pid>``, every rank writes its files there (each file itself
via temp file + fsync + os.replace), then, after the ranks agree that every write succeeded, rank 0
writes ``COMPLETE``, fsyncs the directory, renames it to ``step_N`` (the commit) and atomically
rewrites ``latest`` (a text file naming it). Only a directory named ``step_N`` holding a
``COMPLETE`` whose listed files are all there with their sizes is a checkpoint (list_checkpoints,
``--resume latest`` and validate agree on that): a kill at any point leaves the previous checkpoint
and at most an ignored ``*.tmp-*`` directory, removed by the next save. A write that fails (a full
disk: OSError ENOSPC) removes the temporary directory, leaves ``latest`` and every earlier
checkpoint as they were, and raises CheckpointError naming the checkpoint and the error.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from bert_fast.training.distributed import DistInfo, any_rank, barrier

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.pt"
SCHED_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
ARGS_FILE = "training_args.json"
COMPLETE = "COMPLETE"
LATEST = "latest"
# files a tokenizer's save_pretrained may write (any one of the first two makes a loadable tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")
# the config fields that make a model's parameter shapes
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
)
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


def is_complete(path: os.PathLike) -> bool:
    """True when ``path`` holds a COMPLETE marker and every file it lists, with its size."""
    try:
        manifest = json.loads((Path(path) / COMPLETE).read_text())
        files = manifest["files"]
        return all((Path(path) / name).stat().st_size == int(size) for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def list_checkpoints(output_dir: os.PathLike):
    """The complete checkpoints of ``output_dir``, oldest first (incomplete ones are ignored)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def architecture_of(model: torch.nn.Module) -> str:
    """The class name to record in ``architectures``: the model's own class, not a wrapper's
    (FSDP2's ``fully_shard`` swaps the class for a dynamic ``FSDP<Name>`` subclass)."""
    for klass in type(model).__mro__:
        if not klass.__name__.startswith("FSDP"):
            return klass.__name__
    return type(model).__name__


def _json_args(args) -> dict:
    if args is None:
        return {}
    items = vars(args) if not isinstance(args, dict) else args
    out = {}
    for k, v in items.items():
        if callable(v):  # argparse's handler=... of the subcommand
            continue
        out[k] = v if isinstance(v, (int, float, str, bool, type(None), list, tuple, dict)) else str(v)
    return out


def _write_model_files(tmp: Path, tensors, config, tokenizer, run_args) -> None:
    _atomic_write(tmp / MODEL_FILE, lambda f: f.write(_safetensors_bytes(tensors)))
    config.to_json_file(str(tmp / "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if run_args is not None:
        atomic_write_text(tmp / ARGS_FILE, json.dumps(_json_args(run_args), indent=2, default=str))


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _write_manifest(path: Path) -> None:
    files = {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file() and f.name != COMPLETE}
    atomic_write_text(path / COMPLETE, json.dumps({"files": files}, indent=1))


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
    tokenizer=None,
    run_args=None,
) -> Path:
    """Write the checkpoint of ``step`` atomically (all ranks call this). Returns its path.

    ``tokenizer`` (saved beside the weights) and ``run_args`` (an argparse namespace or dict, saved
    as training_args.json) make the checkpoint self-contained. The config written is the model's
    with ``architectures`` set to the model's class. Raises CheckpointError on every rank when any
    rank's write fails (e.g. a full disk); the previous checkpoints stay valid."""
    root = Path(output_dir) / "checkpoints"
    final = checkpoint_dir(output_dir, step)
    tmp = _make_tmp_dir(root, final, info)
    error = _write_files(tmp, model, optimizer, scheduler, scaler, info, unwrapped, tokenizer, run_args)
    _fail_on_any_rank(tmp, final, error, info)
    state = dict(trainer_state, step=step, world_size=info.world_size)
    error = _commit(tmp, final, state, output_dir) if info.is_main else None
    _fail_on_any_rank(tmp, final, error, info)
    if info.is_main and keep and keep > 0:
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(info)
    return final


def _make_tmp_dir(root: Path, final: Path, info: DistInfo) -> Path:
    """Rank 0 makes the checkpoint's temporary directory (removing stale ones); all ranks get its path."""
    tmp = root / f"{final.name}.tmp-{os.getpid() if info.is_main else 0}"
    # Every rank must know rank 0's pid: broadcast the temp name.
    name = [tmp.name]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    tmp = root / name[0]
    error: Optional[BaseException] = None
    if info.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob("*.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            error = exc
    _fail_on_any_rank(tmp, final, error, info)
    barrier(info)
    return tmp


def _write_files(
    tmp: Path, model, optimizer, scheduler, scaler, info: DistInfo, unwrapped, tokenizer, run_args
) -> Optional[BaseException]:
    """This rank's files (all ranks call it: gathering the full state dicts is collective); any write error."""
    model_sd = full_model_state_dict(model)
    optim_sd = full_optimizer_state_dict(model, optimizer)
    try:
        if info.is_main:
            tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in model_sd.items()}
            config = copy.deepcopy(unwrapped.config)
            config.architectures = [architecture_of(unwrapped)]
            _write_model_files(tmp, tensors, config, tokenizer, run_args)
            del tensors
            atomic_torch_save(optim_sd, tmp / OPTIM_FILE)
            sched = {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None}
            atomic_torch_save(sched, tmp / SCHED_FILE)
        del model_sd, optim_sd
        atomic_torch_save(rng_state(), tmp / f"rng_rank{info.rank}.pt")
    except Exception as exc:  # noqa: BLE001 - torch.save turns a failed write into RuntimeError
        return exc
    return None


def _commit(tmp: Path, final: Path, state: dict, output_dir: os.PathLike) -> Optional[OSError]:
    """Rank 0: the trainer state, COMPLETE last, the rename to ``final`` and ``latest``; the error of a failed write."""
    try:
        atomic_write_text(tmp / STATE_FILE, json.dumps(state, indent=2, default=str))
        _fsync_tree(tmp)
        _write_manifest(tmp)  # the completion marker: written last
        _fsync_dir(tmp)
        trash = None
        if final.exists():  # a re-save of the same step (e.g. SIGTERM right after a periodic save)
            trash = final.with_name(f"{final.name}.tmp-old-{os.getpid()}")
            os.replace(final, trash)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        atomic_write_text(Path(output_dir) / LATEST, final.name + "\n")
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    except OSError as exc:
        return exc
    return None


def _fail_on_any_rank(tmp: Path, final: Path, error: Optional[BaseException], info: DistInfo) -> None:
    """When a write failed on any rank (all ranks call this, and agree): remove the partial
    checkpoint and raise CheckpointError on every rank."""
    if not any_rank(error is not None, info):
        return
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    prev = list_checkpoints(final.parent.parent)
    what = f"{type(error).__name__}: {error}" if error is not None else "a write failed on another rank"
    raise CheckpointError(
        f"could not write checkpoint {final} ({what}); nothing was committed: "
        + (f"the newest valid checkpoint is still {prev[-1]}" if prev else "there is no earlier checkpoint")
    )


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
            if is_complete(cand):
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
    if not (path / COMPLETE).is_file():
        raise CheckpointError(
            f"incomplete checkpoint {path}: no {COMPLETE} marker (its save was interrupted); resume from an earlier one"
        )
    return state


def load_checkpoint(path: Path, model, optimizer, scheduler, scaler, info: DistInfo) -> dict:
    """Restore model, optimizer, scheduler, scaler and this rank's RNG from ``path`` (all ranks
    read the files: a shared filesystem is assumed). Returns the trainer state."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    state = validate(path)
    check_same_shape(path, getattr(model, "module", model).config)
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


# ----------------------------------------------------------------------------- run set-up checks
# what --overwrite removes from an output directory (a run's own files; anything else stays)
RUN_ARTIFACTS = ("checkpoints", LATEST, "metrics.jsonl", "summary.json", "tokenizer", "tb", ARGS_FILE)


def prepare_output_dir(output_dir: Optional[os.PathLike], resume, overwrite: bool, info: DistInfo) -> None:
    """Refuse a non-empty ``output_dir`` unless the run resumes (``--resume``) or ``overwrite``, which
    removes the previous run's files (RUN_ARTIFACTS) first. All ranks call this; rank 0 decides."""
    if output_dir is None:
        return
    out = Path(output_dir)
    busy = []
    if info.is_main:
        if out.exists() and not out.is_dir():
            raise CheckpointError(f"--output-dir {out} exists and is not a directory")
        busy = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    refuse = bool(busy) and not resume and not overwrite
    if any_rank(refuse, info):
        shown = ", ".join(busy[:5]) + (", ..." if len(busy) > 5 else "")
        raise CheckpointError(
            f"output directory {out} is not empty ({shown}): pass --resume latest to continue that run, "
            "--overwrite to replace it, or another --output-dir"
            if info.is_main
            else f"output directory {out} is not empty (see rank 0)"
        )
    if overwrite and not resume and info.is_main and busy:
        for name in RUN_ARTIFACTS:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    if overwrite:
        barrier(info)


def has_tokenizer(path: Optional[os.PathLike]) -> bool:
    """True when the directory holds tokenizer files (AutoTokenizer.from_pretrained can load it)."""
    if not path:
        return False
    p = Path(path)
    return any((p / name).is_file() for name in ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer_config.json"))


def default_tokenizer_to_init_from(args) -> None:
    """``--init-from DIR`` without ``--tokenizer``: use DIR's tokenizer when DIR has one (every
    bert_fast checkpoint does), so fine-tuning keeps the vocabulary the weights were trained with."""
    init = getattr(args, "init_from", None)
    if getattr(args, "tokenizer", None) in (None, "", "auto") and init and has_tokenizer(init):
        args.tokenizer = str(init)


def check_tokenizer(tokenizer, config, model_dir: Optional[os.PathLike], what: str = "--init-from") -> None:
    """CheckpointError when ``tokenizer`` cannot be the vocabulary of a model with ``config`` (from
    ``model_dir``): more tokens than ``vocab_size``, far fewer (a different vocabulary; up to 128
    rows of padding are allowed), or, when ``model_dir`` holds tokenizer files, another vocabulary."""
    n = len(tokenizer)
    v = int(config.vocab_size)
    src = getattr(tokenizer, "name_or_path", "") or "the run's tokenizer"
    if n > v or v - n >= 128:
        raise CheckpointError(
            f"tokenizer {src} has {n} tokens but the model of {what} {model_dir} has vocab_size={v}: not the "
            f"vocabulary it was trained with (leave out --tokenizer to use the checkpoint's own, or pass the "
            f"tokenizer the model was trained with)"
        )
    if not model_dir or not has_tokenizer(model_dir):
        return
    try:
        same_dir = Path(src).resolve() == Path(model_dir).resolve()
    except (OSError, ValueError):
        same_dir = False
    if same_dir:
        return
    try:
        from transformers import AutoTokenizer

        own = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception:  # noqa: BLE001 - an unreadable tokenizer there: the size check above stands
        return
    if own.get_vocab() != tokenizer.get_vocab():
        diff = sorted(set(tokenizer.get_vocab().items()) ^ set(own.get_vocab().items()))[:3]
        raise CheckpointError(
            f"tokenizer {src} ({n} tokens) is not the vocabulary of {what} {model_dir} ({len(own)} tokens, "
            f"e.g. {diff} differ): leave out --tokenizer to use the checkpoint's own"
        )


def _shape(config) -> Dict[str, object]:
    return {k: getattr(config, k, None) for k in SHAPE_KEYS}


def _fmt_shape(shape: dict, arch) -> str:
    short = {
        "vocab_size": "vocab",
        "hidden_size": "H",
        "num_hidden_layers": "L",
        "num_attention_heads": "heads",
        "intermediate_size": "I",
        "max_position_embeddings": "positions",
        "type_vocab_size": "types",
        "num_labels": "labels",
    }
    body = ", ".join(f"{short.get(k, k)}={v}" for k, v in shape.items())
    return f"{arch or 'model'}({body})"


def check_same_shape(path: os.PathLike, config) -> None:
    """CheckpointError naming both shapes when the checkpoint at ``path`` was trained with another
    model shape (or head) than ``config`` describes."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return
    try:
        saved = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"corrupt checkpoint file {f}: {exc}") from None
    from transformers import BertConfig

    defaults = BertConfig()
    ck = {k: saved.get(k, getattr(defaults, k, None)) for k in SHAPE_KEYS}
    run = _shape(config)
    ck_arch = (saved.get("architectures") or [None])[0]
    run_arch = (getattr(config, "architectures", None) or [None])[0]
    if ck_arch and run_arch and "SequenceClassification" in ck_arch and "SequenceClassification" in run_arch:
        ck["num_labels"] = len(saved.get("id2label") or {}) or 2
        run["num_labels"] = int(config.num_labels)
    if ck != run or (ck_arch and run_arch and ck_arch != run_arch):
        raise CheckpointError(
            f"--resume {path}: the checkpoint's model is {_fmt_shape(ck, ck_arch)} but this run builds "
            f"{_fmt_shape(run, run_arch)}; resume with the run's own --model-size/--init-from/--tokenizer/--task "
            "(see its training_args.json), or start a new --output-dir"
        )


def describe_config(config, model: torch.nn.Module, label_map: Optional[dict] = None) -> None:
    """Record on ``config`` what a checkpoint needs to be used without this run: ``architectures``
    (the head's class) and, for classification, ``id2label``/``label2id`` from the data's labels
    (``label_map``: label -> class id; ids without a label are named LABEL_<i>)."""
    config.architectures = [architecture_of(model)]
    if label_map:
        n = max(int(config.num_labels), max(label_map.values()) + 1)
        names = {int(i): str(label) for label, i in label_map.items()}
        config.id2label = {i: names.get(i, f"LABEL_{i}") for i in range(n)}
        config.label2id = {name: i for i, name in config.id2label.items()}
