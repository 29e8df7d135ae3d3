"""``bert-fast prepare-data``: tokenize a corpus once, in parallel, into memory-mapped token shards.

    bert-fast prepare-data corpus.txt --output data/prep                 # text: blank line between documents,
                                                                         # or one document per line
    bert-fast prepare-data a.jsonl b.jsonl --text-field body --output data/prep --workers 8
    bert-fast prepare-data path/to/saved_dataset --output data/prep      # datasets' save_to_disk directory
    bert-fast train --data data/prep --max-len 128 ...                   # reads the shards lazily

The inputs are cut into chunks of about ``--chunk-mb`` MB (at line / document boundaries, or row
ranges of a dataset); each chunk is tokenized by one worker process (``--workers``) and written as
one shard, so the output does not depend on the number of workers. The format is described in
``token_shards.py``; the tokenizer is saved into ``<output>/tokenizer`` and training loads it from
there. At the end the counts are printed: documents, tokens, sequences and tokens reaching a
sequence at ``--max-len``, shards.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

PROG = "bert-fast prepare-data"
_BLANK = re.compile(rb"\n[ \t\r\f\v]*\n")
_TOK_CACHE: dict = {}


# ----------------------------------------------------------------------------- planning
def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _expand(inputs: Sequence[str]) -> List[Path]:
    from bert_fast.training.data import DataError

    if not inputs:
        raise DataError("no input corpus given")
    out: List[Path] = []
    for name in inputs:
        p = Path(name)
        if _is_hf_dataset(p):
            out.append(p)
        elif p.is_dir():
            files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".txt", ".jsonl", ".json"))
            if not files:
                raise DataError(f"input directory {p} holds no .txt/.jsonl files and is not a saved `datasets` dataset")
            out.extend(files)
        else:
            out.append(p)
    return out


def _text_mode(path: Path, mode: str) -> str:
    """'blank' (documents separated by blank lines) or 'lines' (one document per line)."""
    if mode != "auto":
        return mode
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return "blank" if _BLANK.search(mm) else "lines"


def _cut_points(path: Path, size: int, chunk: int, mode: str) -> List[int]:
    """Byte offsets [0, ..., size] cutting the file at line (lines/jsonl) or blank-line boundaries."""
    import mmap

    cuts = [0]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = chunk
        while pos < size:
            if mode == "blank":
                m = _BLANK.search(mm, pos - 1)
                nxt = m.end() if m else size
            else:
                j = mm.find(b"\n", pos - 1)
                nxt = j + 1 if j >= 0 else size
            if nxt >= size:
                break
            cuts.append(nxt)
            pos = nxt + chunk
    cuts.append(size)
    return cuts


def plan_chunks(
    paths: Sequence[Path], chunk_bytes: int, text_field: str, docs: str, split: Optional[str]
) -> List[tuple]:
    """The work items, in output order: ('text'|'jsonl', path, start, end, mode) or ('hf', path, lo, hi, split)."""
    from bert_fast.training import data as data_mod

    tasks: List[tuple] = []
    for path in paths:
        if _is_hf_dataset(path):
            n = len(_load_hf(path, split, text_field))
            rows = max(1, chunk_bytes // 1024)  # ~1 KB per row as a size estimate
            for lo in range(0, n, rows):
                tasks.append(("hf", str(path), lo, min(n, lo + rows), split))
            if n == 0:
                raise data_mod.DataError(f"dataset {path} has no rows")
            continue
        data_mod.check_corpus_file(path)
        try:
            kind = "jsonl" if data_mod.is_jsonl(path) else "text"
            mode = "lines" if kind == "jsonl" else _text_mode(path, docs)
            size = path.stat().st_size
            cuts = _cut_points(path, size, chunk_bytes, "lines" if kind == "jsonl" else mode)
        except OSError as exc:
            raise data_mod.DataError(f"cannot read corpus file {path}: {exc.strerror or exc}") from None
        for a, b in zip(cuts[:-1], cuts[1:]):
            tasks.append((kind, str(path), a, b, mode))
    return tasks


def _load_hf(path: Path, split: Optional[str], text_field: str):
    from bert_fast.training.data import DataError

    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a saved `datasets` dataset: install the `datasets` package to read it") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - report which path failed
        raise DataError(f"cannot load the dataset saved in {path}: {type(exc).__name__}: {exc}") from None
    if isinstance(ds, datasets.DatasetDict):
        name = split or ("train" if "train" in ds else None)
        if name not in ds:
            raise DataError(f"dataset {path} has splits {sorted(ds)}: choose one with --split")
        ds = ds[name]
    if text_field not in ds.column_names:
        raise DataError(f"dataset {path} has no column {text_field!r} (columns: {ds.column_names}); see --text-field")
    return ds


# ----------------------------------------------------------------------------- workers
def _worker_tokenizer(tok_dir: str):
    tok = _TOK_CACHE.get(tok_dir)
    if tok is None:
        from transformers import AutoTokenizer

        tok = _TOK_CACHE[tok_dir] = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    return tok


def _line_base(path: str, start: int) -> int:
    """Number of lines before byte ``start`` (only computed to name a bad line)."""
    n, pos = 0, 0
    with open(path, "rb") as f:
        while pos < start:
            block = f.read(min(1 << 24, start - pos))
            if not block:
                break
            n += block.count(b"\n")
            pos += len(block)
    return n


def _read_chunk(path: str, start: int, end: int) -> str:
    from bert_fast.training.data import DataError

    try:
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read(end - start)
    except OSError as exc:
        raise DataError(f"cannot read corpus file {path}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = _line_base(path, start) + raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text ({exc.reason})") from None


def _chunk_texts(task: tuple, text_field: str) -> List[List[str]]:
    """The documents of one chunk, each a list of texts (lines) to be joined by [SEP]."""
    from bert_fast.training import data as data_mod

    kind, path, a, b, extra = task
    if kind == "hf":
        ds = _load_hf(Path(path), extra, text_field)
        docs = []
        for lo in range(a, b, 1000):
            col = ds[lo : min(b, lo + 1000)][text_field]
            for j, t in enumerate(col):
                if not isinstance(t, str):
                    raise data_mod.DataError(
                        f"dataset {path}: row {lo + j} has a {type(t).__name__} in {text_field!r}, not a string"
                    )
                t = t.strip()
                if t:
                    docs.append([t])
        return docs
    text = _read_chunk(path, a, b)
    lines = text.split("\n")
    if kind == "jsonl":
        docs = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = data_mod.parse_jsonl_line(line, path, n, text_field)
            except data_mod.DataError:
                data_mod.parse_jsonl_line(line, path, _line_base(path, a) + n, text_field)  # raises, naming the line
                raise
            t = rec[text_field].strip()
            if t:
                docs.append([t])
        return docs
    if extra == "lines":
        return [[t] for t in (line.strip() for line in lines) if t]
    return data_mod.documents([line.strip() for line in lines])


def _work(args: tuple) -> dict:
    """Tokenize one chunk and write it as shard k (run in a worker process, or in-process)."""
    import numpy as np

    from bert_fast.training import token_shards as ts

    k, task, tok_dir, out_dir, text_field, dtype, body = args
    tok = _worker_tokenizer(tok_dir)
    sep = int(tok.sep_token_id)
    np_dtype = np.dtype(dtype)
    docs_texts = _chunk_texts(task, text_field)
    docs: List[np.ndarray] = []  # compact arrays: a chunk's Python int lists would take ~30x the memory
    text_tokens, truncated_keep = 0, 0
    for g in range(0, len(docs_texts), 512):
        group = docs_texts[g : g + 512]
        ids = tok([t for d in group for t in d], add_special_tokens=False)["input_ids"]
        pos = 0
        for d in group:
            seq: List[int] = []
            for line_ids in ids[pos : pos + len(d)]:
                text_tokens += len(line_ids)
                if line_ids:
                    if seq:
                        seq.append(sep)
                    seq.extend(line_ids)
            pos += len(d)
            if seq:
                truncated_keep += min(len(seq), body)
                seq.append(sep)
                docs.append(np.asarray(seq, dtype=np_dtype))
        del ids
    rec = ts.write_shard(out_dir, k, docs, dtype)
    rec["text_tokens"] = text_tokens
    rec["truncate_keep"] = truncated_keep
    return rec


# ----------------------------------------------------------------------------- driver
def _prepare_output(out: Path, overwrite: bool) -> None:
    from bert_fast.training.data import DataError
    from bert_fast.training.token_shards import INDEX_FILE, TOKENIZER_DIR

    if out.exists() and not out.is_dir():
        raise DataError(f"--output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise DataError(f"--output {out} is not empty: give --overwrite to replace prepared data there")
        ours = lambda f: (
            (f.name == TOKENIZER_DIR and f.is_dir())
            or (f.is_file() and (f.name == INDEX_FILE or f.name.startswith(("shard_", ".shard_", f".{INDEX_FILE}"))))
        )
        foreign = [f.name for f in out.iterdir() if not ours(f)]
        if foreign:  # an interrupted prepare-data leaves only its own files: those may go
            raise DataError(
                f"--output {out} holds files prepare-data did not write ({', '.join(sorted(foreign)[:3])}): "
                "refusing to delete anything"
            )
        for f in out.iterdir():
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _sample_texts(tasks: List[tuple], text_field: str, limit_bytes: int = 20 << 20) -> List[str]:
    """Texts of the first chunks (up to ~limit_bytes) to build a WordPiece vocabulary from."""
    texts, size = [], 0
    for task in tasks:
        for d in _chunk_texts(task, text_field):
            texts.extend(d)
            size += sum(len(t) for t in d)
        if size >= limit_bytes:
            break
    return texts


def prepare(
    inputs: Sequence[str],
    output: str,
    tokenizer: Optional[str] = None,
    workers: int = 1,
    text_field: str = "text",
    max_len: int = 128,
    chunk_mb: float = 64.0,
    docs: str = "auto",
    split: Optional[str] = None,
    overwrite: bool = False,
    log=None,
) -> dict:
    """Tokenize ``inputs`` into ``output``; returns the index plus the printed statistics."""
    from bert_fast.training import data as data_mod
    from bert_fast.training import token_shards as ts

    log = log or (lambda msg: print(msg, file=sys.stderr))
    t0 = time.perf_counter()
    if max_len < 3:
        raise data_mod.DataError(f"--max-len must be >= 3, got {max_len}")
    if workers < 1:
        raise data_mod.DataError(f"--workers must be >= 1, got {workers}")
    out = Path(output)
    paths = _expand(inputs)
    tasks = plan_chunks(paths, max(1, int(chunk_mb * (1 << 20))), text_field, docs, split)
    _prepare_output(out, overwrite)
    tok, tok_dir = _save_tokenizer(out, tokenizer, tasks, paths, text_field)
    vocab = len(tok)
    dtype = ts.token_dtype(vocab)
    body = max_len - 2
    jobs = [(k, task, str(tok_dir), str(out), text_field, dtype, body) for k, task in enumerate(tasks)]
    log(f"{PROG}: {len(paths)} input(s), {len(jobs)} chunk(s), {min(workers, len(jobs))} worker(s) -> {out}")
    records = _run_jobs(jobs, workers)
    if not any(r["docs"] for r in records):
        for r in records:
            for f in (out / r["bin"], out / r["idx"]):
                f.unlink(missing_ok=True)
        raise data_mod.DataError(f"the corpus {', '.join(map(str, paths))} holds no text (no document with tokens)")
    text_tokens = sum(r.pop("text_tokens") for r in records)
    truncate_keep = sum(r.pop("truncate_keep") for r in records)
    meta = dict(
        dtype=dtype,
        vocab_size=vocab,
        tokenizer_name=str(tokenizer or ("minilm" if data_mod.minilm_tokenizer_dir() else "build")),
        tokenizer_hash=ts.tokenizer_hash(tok),
        special_ids=ts.special_ids(tok),
        text_tokens=text_tokens,
        sources=[str(p) for p in paths],
        text_field=text_field,
    )
    index = ts.write_index(out, meta, records)
    stats = _stats(index, records, body, text_tokens, truncate_keep, dtype, vocab, t0)
    log(
        f"{PROG}: {stats['documents']:,} documents, {stats['tokens']:,} tokens ({dtype}, vocab {vocab:,}), "
        f"{stats['shards']} shard(s) in {stats['seconds']:.1f} s\n"
        f"  at --max-len {max_len}: {stats['sequences']:,} sequences; tokens reaching a sequence: "
        f"{stats['tokens_reaching']:,} of {stats['tokens']:,} ({100 * stats['coverage']:.2f}%) "
        f"[one sequence per document, truncated, would keep {100 * stats['truncate_coverage']:.2f}%]\n"
        f"  train with: bert-fast train --data {out} --max-len {max_len}"
    )
    return dict(index=index, stats=stats)


def _save_tokenizer(out: Path, tokenizer: Optional[str], tasks: List[tuple], paths: List[Path], text_field: str):
    """(tokenizer, its directory under ``out``): loaded, or built from the corpus' first chunks, and saved."""
    from bert_fast.training import data as data_mod
    from bert_fast.training import token_shards as ts

    build = tokenizer == "build" or (tokenizer in (None, "", "auto") and not data_mod.minilm_tokenizer_dir())
    texts = _sample_texts(tasks, text_field) if build else []
    if build and not any(t.strip() for t in texts):
        raise data_mod.DataError(f"the corpus {', '.join(map(str, paths))} holds no text (only blank lines)")
    tok = data_mod.load_tokenizer(tokenizer, texts)
    data_mod.require_special_tokens(tok)
    tok_dir = out / ts.TOKENIZER_DIR
    tok.save_pretrained(str(tok_dir))
    return _worker_tokenizer(str(tok_dir)), tok_dir  # what training loads: hash and ids from the saved copy


def _run_jobs(jobs: List[tuple], workers: int) -> List[dict]:
    """The shard record of every chunk, tokenized in this process or in ``workers`` processes."""
    if workers == 1 or len(jobs) == 1:
        return [_work(j) for j in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # fork where there is one: workers start at once with the tokenizer already loaded (tokenizers
    # turns its own thread pool off in forked children); spawn elsewhere
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        return list(pool.map(_work, jobs))


def _stats(index: dict, records: List[dict], body: int, text_tokens, truncate_keep, dtype, vocab, t0) -> dict:
    """The printed statistics: how many tokens training at --max-len (``body`` + 2 specials) reaches."""
    # sequences at --max-len: the stream of a shard (its last separator dropped) cut every body tokens
    seqs = sum(-(-max(r["stream_len"] - 1, 0) // body) for r in records)
    reach = sum(max(r["stream_len"] - 1, 0) for r in records) - sum(max(r["docs"] - 1, 0) for r in records)
    return dict(
        documents=index["num_docs"],
        tokens=index["num_tokens"],
        text_tokens=text_tokens,
        sequences=seqs,
        tokens_reaching=reach,
        coverage=reach / max(1, index["num_tokens"]),
        truncate_coverage=truncate_keep / max(1, index["num_tokens"]),
        shards=len(records),
        dtype=dtype,
        vocab_size=vocab,
        seconds=time.perf_counter() - t0,
    )


# ----------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "inputs", nargs="+", help="text files, JSONL files, directories of them, or a saved `datasets` dataset"
    )
    p.add_argument("--output", "-o", required=True, help="directory for the shards, index.json and tokenizer/")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer directory, 'minilm' or 'build' (WordPiece from the first ~20 MB of the corpus); "
        "default: minilm when installed, else build",
    )
    p.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="tokenizer processes")
    p.add_argument("--text-field", default="text", help="JSONL field / dataset column holding the text")
    p.add_argument("--split", default=None, help="split of a saved DatasetDict (default: train)")
    p.add_argument(
        "--docs",
        choices=("auto", "blank", "lines"),
        default="auto",
        help="text files: 'blank' = a blank line separates documents (lines of a document joined by [SEP]); "
        "'lines' = one document per line; auto: blank when the file has a blank line",
    )
    p.add_argument("--max-len", type=int, default=128, help="sequence length the printed counts are computed for")
    p.add_argument("--chunk-mb", type=float, default=64.0, help="text per chunk (= per shard), MB")
    p.add_argument("--overwrite", action="store_true", help="replace prepared data already in --output")
    return p


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from bert_fast.training.data import DataError

    try:
        prepare(
            args.inputs,
            args.output,
            tokenizer=args.tokenizer,
            workers=args.workers,
            text_field=args.text_field,
            max_len=args.max_len,
            chunk_mb=args.chunk_mb,
            docs=args.docs,
            split=args.split,
            overwrite=args.overwrite,
        )
    except DataError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def add_prepare_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``prepare-data`` on an argparse subparsers object (handler: ``run``)."""
    p = subparsers.add_parser(
        "prepare-data",
        help="tokenize a corpus once into memory-mapped token shards for `train --data DIR`",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(handler=run)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0])
    return run(add_arguments(p).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
