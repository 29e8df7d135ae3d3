"""Classification (and MLM) data from CSV / TSV tables with named columns.

    text,label                 sentence,other,label            (--text-column sentence
    "good film",pos            ...                              --text-pair-column other)
    "dull",neg

A file ending in ``.csv`` is comma-separated, ``.tsv`` / ``.tab`` tab-separated (Python's csv
module: quoted fields may hold the delimiter and newlines). The first row names the columns.
``--text-column`` (default ``text``), ``--text-pair-column`` (optional second segment) and
``--label-column`` (default ``label``) pick them; the other columns are ignored.

Rows become the records the JSONL reader returns: ``{"text", "text_b"?, "label"?}``. Labels keep
their text; when every label of the file is an integer (``0``, ``1``, ``-1``) they become ints, so
data.label_map_of numbers string labels in sorted order (recorded as the checkpoint's
``id2label``) and keeps integer ids as they are. A row without a label (an empty cell, or a short
row) is an error naming the file, the line and the column.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import List, Optional

from bert_fast.training.data import DataError

TABLE_SUFFIXES = {".csv": ",", ".tsv": "\t", ".tab": "\t"}
_INT = re.compile(r"^[+-]?\d+$")


class TableError(DataError):
    """A table that cannot be read as asked; the message names the file (and line, column).
    (data.py imports this module lazily, inside its reader dispatch: no import cycle.)"""


def is_table(path: os.PathLike) -> bool:
    return Path(path).suffix.lower() in TABLE_SUFFIXES


def _open_rows(path: Path):
    delimiter = TABLE_SUFFIXES[path.suffix.lower()]
    if not path.is_file():
        raise TableError(f"data file not found: {path}")
    try:
        f = open(path, encoding="utf-8", newline="")
        f.read(1)
        f.seek(0)
    except (OSError, UnicodeDecodeError) as exc:
        raise TableError(f"cannot read {path}: {exc}") from None
    return f, csv.reader(f, delimiter=delimiter)


def _column(header: List[str], name: Optional[str], path: Path, flag: str) -> Optional[int]:
    if name is None:
        return None
    try:
        return header.index(name)
    except ValueError:
        raise TableError(f"{path}: no column {name!r} ({flag}); the header has {header}") from None


def read_table(
    path: os.PathLike,
    text_column: str = "text",
    text_pair_column: Optional[str] = None,
    label_column: Optional[str] = "label",
    need_labels: bool = True,
) -> List[dict]:
    """Records ``{"text", "text_b"?, "label"?}`` of a CSV/TSV file (see the module doc).

    ``need_labels``: every row must have a label (classification); otherwise a missing label
    column is allowed (MLM on the text column)."""
    path = Path(path)
    text_column = text_column or "text"
    f, reader = _open_rows(path)
    with f:
        try:
            header = next(reader)
        except StopIteration:
            raise TableError(f"{path}: the file is empty (expected a header row naming the columns)") from None
        except (csv.Error, UnicodeDecodeError) as exc:
            raise TableError(f"{path}:1: {exc}") from None
        header = [h.strip().lstrip("\ufeff") for h in header]
        ti = _column(header, text_column, path, "--text-column")
        pi = _column(header, text_pair_column, path, "--text-pair-column")
        if label_column and not need_labels and label_column not in header:
            label_column = None
        li = _column(header, label_column if (need_labels or label_column) else None, path, "--label-column")
        records = []
        try:
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if ti >= len(row):
                    raise TableError(f"{path}:{line}: the row has {len(row)} fields, no {text_column!r} column")
                rec = {"text": row[ti]}
                if pi is not None:
                    rec["text_b"] = row[pi] if pi < len(row) else ""
                if li is not None:
                    label = row[li].strip() if li < len(row) else ""
                    if not label:
                        raise TableError(
                            f"{path}:{line}: missing label (column {label_column!r} is empty in this row); "
                            "every row of classification data needs a label"
                        )
                    rec["label"] = label
                records.append(rec)
        except csv.Error as exc:
            raise TableError(f"{path}:{reader.line_num}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise TableError(f"{path}: not UTF-8 text ({exc})") from None
    if not records:
        raise TableError(f"{path}: no data rows after the header")
    if li is not None and all(_INT.match(r["label"]) for r in records):
        for r in records:
            r["label"] = int(r["label"])
    return records


def read_table_texts(path: os.PathLike, text_column: str = "text") -> List[str]:
    """The text column of a table, one entry per row (MLM on a table)."""
    return [r["text"] for r in read_table(path, text_column, None, None, need_labels=False)]


def read_records(path: os.PathLike, args=None, need_labels: bool = False):
    """``(records or None, texts)`` of a data file, by its suffix: CSV/TSV (this module), JSONL
    (data.read_jsonl) or a text file (records None). ``args`` supplies --text-column,
    --text-pair-column and --label-column, which apply to JSONL fields too. ``need_labels``
    (classification): every record must have a label, else an error naming the record."""
    from bert_fast.training import data as data_mod

    text_column = getattr(args, "text_column", None) or "text"
    pair_column = getattr(args, "text_pair_column", None)
    label_column = getattr(args, "label_column", None) or "label"
    if is_table(path):
        records = read_table(path, text_column, pair_column, label_column, need_labels=need_labels)
        return records, [r["text"] for r in records]
    if not data_mod.is_jsonl(path):
        return None, data_mod.read_lines(path)
    records = data_mod.read_jsonl(path, text_field=text_column)
    for n, rec in enumerate(records, 1):
        if pair_column and pair_column != "text_b":
            rec["text_b"] = rec.get(pair_column) or ""
        if label_column != "label":
            rec["label"] = rec.get(label_column)
        if need_labels and rec.get("label") in (None, ""):
            raise TableError(
                f"{path}: record {n} (text {rec['text'][:40]!r}) has no {label_column!r} field; "
                "every record of classification data needs a label"
            )
    return records, [r["text"] for r in records]
