"""Bound oneDNN's shape-keyed caches before their first use (#32 item 7: resident memory flat by default).

Why (benchmarks/notes/2026-11-27-memory-32.md): oneDNN keeps every
primitive it builds in an LRU cache of 1024 entries (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), and torch's
ideep layer keeps its own of 1024 (``LRU_CACHE_CAPACITY``). Their keys include the row count of each
GEMM (and eltwise op), which on bert_fast's unpadded path is the batch's real token count: a new key at
nearly every forward of a server. Each entry holds some heap memory for as long as it lives, scattered
between the activations, so glibc can reuse neither and the heaps grow. On all-MiniLM-L6-v2 (1 layer,
1500 random shapes) the defaults held 588 MiB live and RSS grew +40% from forward 500 to 1500; with both
bounded at 64 entries, 173 MiB live and +5.7%, at no measured cost in time (a forward builds its
handful of GEMM primitives once and reuses them in every layer; a server with fixed shapes never misses).

Both settings are read by the libraries once, when their cache is first made: this runs when
bert_fast is imported, before bert_fast calls any oneDNN op. A value already in the environment wins
(set either to oneDNN's 1024 to keep its default); if the process used oneDNN before importing
bert_fast, its caches are already made and this changes nothing.
"""

from __future__ import annotations

import os
from typing import Dict

CAPACITY = 64
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound() -> Dict[str, str]:
    """Set each cache capacity the environment leaves unset to CAPACITY; return the values in force."""
    for name in VARIABLES:
        os.environ.setdefault(name, str(CAPACITY))
    return {name: os.environ[name] for name in VARIABLES}
