"""Autotune winners kept on disk, for a kernel whose configs carry a pre-hook.

Triton's own disk cache of autotune results (``cache_results=True``) is skipped for any kernel
whose configs have a pre-hook, because hooks cannot be serialized. The TMA GEMM needs one: a host
tensor descriptor carries its box shape, which depends on the config. Without this store, every
new process re-measured every config of every GEMM shape it met.

The store remembers which of the autotuner's configs won, by position in its config list, under a
file whose name hashes what makes that position meaningful: the Triton version, the kernel's source
(its cache key), the config list and the device. A hit launches the JIT function directly with
that config after running its pre-hook; a miss goes through the autotuner, which measures, and the
winner is written (temp file, then rename: concurrent ranks at worst redo a measurement).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch
import triton


def _cache_root() -> Path:
    knobs = getattr(triton, "knobs", None)
    root = getattr(getattr(knobs, "cache", None), "dir", None) if knobs is not None else None
    return Path(root or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


@functools.lru_cache(maxsize=None)
def _device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type  # the interpreter
    cc = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{cc[0]}{cc[1]}"


class TunedConfigs:
    """Per-process memory plus a JSON file per (kernel source, configs, device)."""

    def __init__(self, autotuned, name: str, persist: bool = True):
        self.autotuned = autotuned  # the triton.autotune object
        self.jit = autotuned.fn  # the kernel it wraps
        self.name = name
        self.persist = persist  # False: this process only (the interpreter measures nothing)
        # (device label, the config objects) -> (path, {key: index}); a new config list (tests pin
        # one) gets its own file, since an index means nothing across lists
        self._files: dict[tuple, tuple[Path, dict]] = {}

    def _entries(self, device: torch.device) -> tuple[Path, dict]:
        label = _device_label(device)
        slot = (label, tuple(map(id, self.autotuned.configs)))
        if slot not in self._files:
            fn = self.jit
            while not isinstance(fn, triton.runtime.jit.JITFunction) and hasattr(fn, "fn"):
                fn = fn.fn
            ident = "\n".join(
                [triton.__version__, getattr(fn, "cache_key", fn.__name__), label]
                + [str(c) for c in self.autotuned.configs]
            )
            digest = hashlib.sha256(ident.encode()).hexdigest()[:20]
            path = _cache_root() / "bert_fast_autotune" / f"{self.name}-{digest}.json"
            entries = self._read(path) if self.persist else {}
            self._files[slot] = (path, entries)
        return self._files[slot]

    @staticmethod
    def _read(path: Path) -> dict:
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: measure again
            return {}
        return entries if isinstance(entries, dict) else {}

    def lookup(self, device: torch.device, key: tuple):
        """The config that won for ``key`` on this device, or None."""
        _, entries = self._entries(device)
        index = entries.get(repr(key))
        configs = self.autotuned.configs
        return configs[index] if isinstance(index, int) and 0 <= index < len(configs) else None

    def remember(self, device: torch.device, key: tuple, config) -> None:
        """Record the autotuner's winner for ``key`` (in memory, and on disk where writable)."""
        index = next((i for i, c in enumerate(self.autotuned.configs) if c is config), None)
        if index is None:
            return
        path, entries = self._entries(device)
        entries[repr(key)] = index
        if not self.persist:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for k, v in self._read(path).items():  # keep what other processes wrote meanwhile
                entries.setdefault(k, v)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=0, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass  # read-only cache: this process still remembers

    def launch(self, grid, device: torch.device, key: tuple, args: tuple, **meta):
        """Run the kernel on the positional ``args`` and keyword ``meta``: the stored winner
        directly if there is one, else through the autotuner, recording its choice."""
        config = self.lookup(device, key)
        if config is None:
            self.autotuned[grid](*args, **meta)
            self.remember(device, key, getattr(self.autotuned, "best_config", None))
            return
        if config.pre_hook is not None:  # it sees the arguments by name, as under the autotuner
            named = dict(zip(self.autotuned.arg_names, args))
            config.pre_hook({**named, **meta, **config.all_kwargs()})
        self.jit[grid](*args, **meta, **config.all_kwargs())
