"""Prepared corpora on disk: sharded memory-mapped token files + one JSON index (``bert-fast prepare-data``).

The layout of Megatron's indexed datasets (a ``.bin`` of raw token ids + an ``.idx`` of document
offsets), sharded so that ``prepare-data`` writes one shard per worker chunk in parallel::

    <dir>/index.json            format, version, dtype, vocab size, tokenizer name + hash, special ids,
                                totals and one record per shard (written last: its presence commits the set)
    <dir>/shard_00000.bin       token ids, ``dtype`` (uint16 when vocab < 65536, else uint32), raw
    <dir>/shard_00000.idx.npy   int64 document offsets into the .bin, ``docs + 1`` entries
    <dir>/tokenizer/            the tokenizer the ids were made with (training loads it from here)

Each document is stored as its token ids followed by one separator ([SEP]); lines of a multi-line
text document are joined by [SEP] too, as ``data.mlm_examples(pack=True)`` joins them. Document d of
a shard is ``bin[off[d] : off[d + 1] - 1]``.

Sequences (``TokenSequenceDataset``): a shard's stream (without its final separator) is cut into
windows of ``max_len - 2`` tokens, each becoming ``[CLS] window [SEP]``: a document longer than a
sequence continues in the next one, nothing is truncated, every stored token reaches exactly one
sequence (the last window of a shard may be shorter). With ``truncate=True`` one sequence per
document instead, cut to ``max_len - 2`` tokens (the old behaviour).

Lazy by construction: opening reads ``index.json`` and stats the shard files; token windows are
read from ``np.memmap`` views on demand (the mapping is released after each read so that resident
pages do not accumulate), document offsets are memory-mapped only in ``truncate`` mode. The epoch
order comes from ``collator.epoch_batches`` on a ``collator.LazyLengths`` (a keyed permutation
computed per index): no array of corpus size is ever built.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from bert_fast.training.collator import LazyLengths
from bert_fast.training.data import DataError

INDEX_FILE = "index.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = "bert_fast.token_shards"
VERSION = 1
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# After each read the shard's mapping is madvise(DONTNEED)-ed: a page fault on a file mapping maps
# a whole fault-around window or large folio (measured: +2 MB of RSS per random read on Linux 6.x),
# so without it resident pages pile up to the size of the corpus. The page cache keeps the pages;
# the call costs a page-table walk over one shard (shards are tens of MB).
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size < 65536 else "uint32"


def shard_names(k: int):
    return f"shard_{k:05d}.bin", f"shard_{k:05d}.idx.npy"


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id, sorted) and the special token ids."""
    h = hashlib.sha256()
    for tok, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{tok}\n".encode("utf-8", "surrogatepass"))
    for attr in ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id"):
        h.update(f"{attr}={getattr(tokenizer, attr, None)}\n".encode())
    return h.hexdigest()


def special_ids(tokenizer) -> Dict[str, Optional[int]]:
    return {a: getattr(tokenizer, a, None) for a in ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id")}


# ----------------------------------------------------------------------------- writing
def write_shard(out_dir: os.PathLike, k: int, docs: Sequence, dtype: str) -> dict:
    """Write shard ``k`` from documents (lists or arrays of ids) already ending in their separator;
    returns its record."""
    out_dir = Path(out_dir)
    bin_name, idx_name = shard_names(k)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np_dtype = _DTYPES[dtype]
    tmp_bin = out_dir / f".{bin_name}.tmp-{os.getpid()}"
    with open(tmp_bin, "wb") as f:
        for i in range(0, len(docs), 4096):
            part = [np.asarray(d, dtype=np_dtype) for d in docs[i : i + 4096]]
            if part:
                f.write(np.concatenate(part).tobytes())
    os.replace(tmp_bin, out_dir / bin_name)
    tmp_idx = out_dir / f".{idx_name}.tmp-{os.getpid()}.npy"
    np.save(tmp_idx, offsets)
    os.replace(tmp_idx, out_dir / idx_name)
    return {
        "bin": bin_name,
        "idx": idx_name,
        "docs": int(len(docs)),
        "stream_len": int(offsets[-1]),
        "tokens": int(offsets[-1] - len(docs)),  # without the separators
    }


def write_index(out_dir: os.PathLike, meta: dict, shards: List[dict]) -> dict:
    index = dict(meta)
    index.update(
        format=FORMAT,
        version=VERSION,
        num_shards=len(shards),
        num_docs=sum(s["docs"] for s in shards),
        num_tokens=sum(s["tokens"] for s in shards),
        shards=shards,
    )
    path = Path(out_dir) / INDEX_FILE
    tmp = path.with_name(f".{INDEX_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, path)
    return index


# ----------------------------------------------------------------------------- reading
def is_prepared_dir(path: os.PathLike) -> bool:
    """True for a directory (which must then hold an index: see ``read_index``)."""
    return Path(path).is_dir()


def read_index(path: os.PathLike) -> dict:
    """The validated index of a prepared directory; DataError naming the file otherwise."""
    path = Path(path)
    f = path / INDEX_FILE
    if not f.is_file():
        raise DataError(
            f"{path} is not a prepared-data directory: {INDEX_FILE} is missing "
            "(create it with `bert-fast prepare-data CORPUS --output DIR`)"
        )
    try:
        index = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"corrupt index {f}: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"corrupt index {f}: not a {FORMAT} index")
    if index.get("version") != VERSION:
        raise DataError(f"{f}: index version {index.get('version')!r}, this bert_fast reads version {VERSION}")
    try:
        if index["dtype"] not in _DTYPES:
            raise ValueError(f"dtype {index['dtype']!r}")
        vocab = int(index["vocab_size"])
        shards = index["shards"]
        if len(shards) != int(index["num_shards"]) or not shards:
            raise ValueError("num_shards does not match the shard list")
        for s in shards:
            for key in ("bin", "idx", "docs", "stream_len", "tokens"):
                s[key]
            if int(s["stream_len"]) != int(s["tokens"]) + int(s["docs"]):
                raise ValueError(f"shard {s['bin']}: token counts disagree")
        if sum(int(s["tokens"]) for s in shards) != int(index["num_tokens"]):
            raise ValueError("num_tokens does not match the shards")
        int(index["special_ids"]["sep_token_id"]), int(index["special_ids"]["cls_token_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"corrupt index {f}: {type(exc).__name__}: {exc}") from None
    itemsize = np.dtype(_DTYPES[index["dtype"]]).itemsize
    for s in shards:
        b = path / s["bin"]
        if not b.is_file():
            raise DataError(f"prepared data {path}: shard {b} listed in {INDEX_FILE} is missing")
        if b.stat().st_size != int(s["stream_len"]) * itemsize:
            raise DataError(
                f"prepared data {path}: shard {b} has {b.stat().st_size} bytes, the index says "
                f"{int(s['stream_len']) * itemsize} (truncated or corrupt: run prepare-data again)"
            )
        if not (path / s["idx"]).is_file():
            raise DataError(f"prepared data {path}: offsets {path / s['idx']} listed in {INDEX_FILE} are missing")
    if vocab < 1:
        raise DataError(f"corrupt index {f}: vocab_size {vocab}")
    return index


class TokenShards:
    """Read access to a prepared directory: memory-mapped on first use, one shard at a time."""

    def __init__(self, path: os.PathLike, index: Optional[dict] = None):
        self.path = Path(path)
        self.index = index if index is not None else read_index(self.path)
        self.dtype = _DTYPES[self.index["dtype"]]
        self.shards = self.index["shards"]
        self._tokens: Dict[int, np.memmap] = {}
        self._offsets: Dict[int, np.ndarray] = {}
        self._reads = 0

    def __getstate__(self):  # DataLoader workers reopen their own mappings
        state = dict(self.__dict__)
        state["_tokens"], state["_offsets"] = {}, {}
        return state

    def tokens(self, k: int) -> np.memmap:
        mm = self._tokens.get(k)
        if mm is None:
            s = self.shards[k]
            if int(s["stream_len"]) == 0:
                mm = np.zeros(0, dtype=self.dtype)
            else:
                mm = np.memmap(self.path / s["bin"], dtype=self.dtype, mode="r", shape=(int(s["stream_len"]),))
            self._tokens[k] = mm
        return mm

    def offsets(self, k: int) -> np.ndarray:
        off = self._offsets.get(k)
        if off is None:
            f = self.path / self.shards[k]["idx"]
            try:
                off = np.load(f, mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise DataError(f"corrupt offsets file {f}: {exc}") from None
            if off.ndim != 1 or len(off) != int(self.shards[k]["docs"]) + 1:
                raise DataError(f"corrupt offsets file {f}: {off.shape} entries for {self.shards[k]['docs']} documents")
            self._offsets[k] = off
        return off

    def read(self, k: int, lo: int, hi: int) -> np.ndarray:
        """A copy of tokens [lo, hi) of shard k as int64."""
        mm = self.tokens(k)
        out = np.array(mm[lo:hi], dtype=np.int64)
        self._reads += 1
        self._release(mm)
        return out

    def document(self, k: int, d: int) -> np.ndarray:
        off = self.offsets(k)
        return self.read(k, int(off[d]), int(off[d + 1]) - 1)

    @staticmethod
    def _release(mm) -> None:
        raw = getattr(mm, "_mmap", None)
        if raw is not None and _DONTNEED is not None:
            try:
                raw.madvise(_DONTNEED)
            except (OSError, ValueError):
                pass

    def release(self) -> None:
        """Drop this process's mapped pages of every shard (the page cache keeps them)."""
        for mm in self._tokens.values():
            self._release(mm)


def check_tokenizer(tokenizer, index: dict, path: os.PathLike) -> None:
    """DataError when ``tokenizer`` cannot be the one the prepared ids were made with."""
    n = len(tokenizer)
    if n != int(index["vocab_size"]):
        raise DataError(
            f"the tokenizer has {n} tokens but the prepared data {path} was tokenized with a vocabulary of "
            f"{index['vocab_size']} ({index.get('tokenizer_name')}); use its tokenizer ({Path(path) / TOKENIZER_DIR}) "
            "or prepare the data again"
        )
    ours = special_ids(tokenizer)
    for key, want in index["special_ids"].items():
        if want is not None and ours.get(key) != want:
            raise DataError(
                f"the tokenizer's {key} is {ours.get(key)}, the prepared data {path} used {want}: "
                "not the same vocabulary"
            )


class TokenSequenceDataset(torch.utils.data.Dataset):
    """MLM sequences from a prepared directory; ``dataset[(epoch, i)]`` as data.ExampleDataset."""

    def __init__(self, path: os.PathLike, max_len: int, truncate: bool = False, index: Optional[dict] = None):
        if max_len < 3:
            raise DataError(f"max_len must be >= 3, got {max_len}")
        self.store = TokenShards(path, index)
        self.path = Path(path)
        self.index = self.store.index
        self.max_len, self.body, self.truncate = int(max_len), int(max_len) - 2, bool(truncate)
        sp = self.index["special_ids"]
        self.cls, self.sep = int(sp["cls_token_id"]), int(sp["sep_token_id"])
        if truncate:
            counts = [int(s["docs"]) for s in self.store.shards]
        else:
            counts = [-(-max(int(s["stream_len"]) - 1, 0) // self.body) for s in self.store.shards]
        self.cum = np.zeros(len(counts) + 1, dtype=np.int64)  # one entry per shard
        np.cumsum(counts, out=self.cum[1:])
        self.lengths = LazyLengths(int(self.cum[-1]), self.max_len)
        if len(self) == 0:
            raise DataError(f"prepared data {path}: no tokens")

    def __len__(self) -> int:
        return int(self.cum[-1])

    def locate(self, i: int):
        """(shard, window or document index within it) of sample i."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} sequences")
        k = int(np.searchsorted(self.cum, i, side="right")) - 1
        return k, i - int(self.cum[k])

    def body_tokens(self, i: int) -> np.ndarray:
        """The corpus tokens of sample i (without the added [CLS] ... [SEP])."""
        k, w = self.locate(int(i))
        if self.truncate:
            return self.store.document(k, w)[: self.body]
        end = int(self.store.shards[k]["stream_len"]) - 1
        lo = w * self.body
        return self.store.read(k, lo, min(lo + self.body, end))

    def __getitem__(self, key):
        epoch, i = key if isinstance(key, tuple) else (0, key)
        body = self.body_tokens(int(i))
        ids = np.empty(len(body) + 2, dtype=np.int32)
        ids[0], ids[-1] = self.cls, self.sep
        ids[1:-1] = body
        return {"input_ids": ids, "_key": (int(epoch), int(i))}

    def fingerprint(self) -> dict:
        return {
            "path": str(self.path),
            "num_tokens": int(self.index["num_tokens"]),
            "num_docs": int(self.index["num_docs"]),
            "tokenizer_hash": self.index.get("tokenizer_hash"),
            "num_samples": len(self),
            "max_len": self.max_len,
            "truncate": self.truncate,
        }


def open_for_training(args):
    """(tokenizer, dataset) for ``bert-fast train --data <prepared dir>``: the prepared directory's own
    tokenizer unless --tokenizer names one (checked against the index)."""
    from bert_fast.training.data import load_tokenizer

    path = Path(args.data)
    index = read_index(path)
    if getattr(args, "task", "mlm") != "mlm" or getattr(args, "nsp", False):
        raise DataError(
            f"--data {path} is prepared data (token shards): it trains --task mlm without --nsp; "
            "classification and NSP read text/JSONL files"
        )
    name = getattr(args, "tokenizer", None)
    if name in (None, "", "auto"):
        tok_dir = path / TOKENIZER_DIR
        if not tok_dir.is_dir():
            raise DataError(f"prepared data {path}: {tok_dir} is missing (give --tokenizer, or prepare the data again)")
        name = str(tok_dir)
    elif name == "build":
        raise DataError("--tokenizer build cannot be used with prepared data: its ids come from the saved tokenizer")
    tokenizer = load_tokenizer(name)
    check_tokenizer(tokenizer, index, path)
    dataset = TokenSequenceDataset(path, args.max_len, truncate=bool(getattr(args, "truncate", False)), index=index)
    return tokenizer, dataset
