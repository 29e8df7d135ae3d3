"""Evaluation during training (``--eval-data FILE --eval-every N``) and the run's metric log.

Evaluation data is read like the training data (text, JSONL, or CSV/TSV with the same column
flags) with the training run's tokenizer, and held in memory (an evaluation set is small).

  MLM (+NSP): ``eval_loss`` (mean cross-entropy over the masked tokens), ``eval_accuracy`` (the
      share of masked tokens predicted exactly) and ``eval_perplexity``; with --nsp also
      ``eval_nsp_loss`` and ``eval_nsp_accuracy``. The masks are deterministic: drawn with the
      fixed seed EVAL_SEED from each example's index, so every evaluation of a run (and of any run
      on the same file and tokenizer) scores the same masked positions.
  classification: ``eval_loss``, ``eval_accuracy`` and ``eval_f1_macro`` (the unweighted mean of
      the per-class F1 over the classes of the training label set that occur in the evaluation
      data or are predicted). Evaluation labels outside the training label set are an error.

Under torchrun each rank evaluates every world_size-th batch and the sums are all-reduced; every
rank runs the same number of forward passes (FSDP needs it), padding with a zero-weight batch.

MetricsLogger writes ``metrics.jsonl`` (one row per optimizer step: step, loss, the learning rate
that step used, throughput; eval_* keys on the steps that evaluated) and, with ``--tensorboard``,
the same scalars to TensorBoard under ``<output_dir>/tb`` (train/<key>, eval/<key>). A resumed
run first drops the rows of steps after the checkpoint it resumes from (those steps run again), and
TensorBoard's ``purge_step`` hides their events, so neither log holds a step twice.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from bert_fast.training import collator as coll
from bert_fast.training import data as data_mod
from bert_fast.training import distributed as dist_mod
from bert_fast.training import table_data

EVAL_SEED = 1234567  # fixed: eval masks do not depend on --seed


class EvalError(data_mod.DataError):
    """Evaluation data that cannot be used with this run; the message names the file."""


class Evaluator:
    """Evaluate ``model`` on a fixed, pre-collated evaluation set (see the module doc)."""

    def __init__(self, batches: List[dict], task: str, nsp: bool, num_labels: int, path: Path, n_examples: int):
        self.batches = batches
        self.task = task
        self.nsp = nsp
        self.num_labels = num_labels
        self.path = path
        self.n_examples = n_examples

    @classmethod
    def build(
        cls,
        path: os.PathLike,
        args,
        tokenizer,
        task: str,
        nsp: bool,
        label_map: Optional[dict],
        num_labels: int,
        info: dist_mod.DistInfo,
    ) -> "Evaluator":
        path = Path(path)
        if not path.is_file():
            raise EvalError(f"--eval-data file not found: {path}")
        records, lines = table_data.read_records(path, args, need_labels=(task == "cls"))
        if task == "cls":
            if records is None:
                raise EvalError(
                    f"--eval-data {path}: classification needs JSONL or CSV/TSV with text and label columns"
                )
            missing = [i for i, r in enumerate(records, 1) if r.get("label") is None]
            if missing:
                raise EvalError(f"--eval-data {path}: record {missing[0]} has no label")
            unknown = sorted({str(r["label"]) for r in records if not _in_map(r["label"], label_map)})
            if unknown:
                raise EvalError(
                    f"--eval-data {path}: labels {unknown[:5]} are not in the training label set "
                    f"{sorted(map(str, label_map or {}))}"
                )
            examples = data_mod.classification_examples(tokenizer, records, args.max_len, label_map)
        elif nsp:
            examples = data_mod.nsp_examples(tokenizer, lines, args.max_len, seed=EVAL_SEED)
        else:
            examples = data_mod.mlm_examples(tokenizer, lines, args.max_len, pack=args.pack)
        if not examples:
            raise EvalError(f"--eval-data {path} produced no examples")
        collate = coll.MaskingCollator(
            tokenizer,
            mlm=(task == "mlm"),
            mlm_probability=args.mlm_probability,
            seed=EVAL_SEED,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )
        mb, world, rank = args.micro_batch_size, info.world_size, info.rank
        # sort by length (little padding), cut into micro-batches, deal them round-robin to ranks
        order = np.argsort([len(e["input_ids"]) for e in examples], kind="stable")
        chunks = [order[i : i + mb] for i in range(0, len(order), mb)]
        per_rank = math.ceil(len(chunks) / world)
        batches = []
        for j in range(per_rank):
            k = j * world + rank
            if k < len(chunks):
                exs = [dict(examples[i], _key=(0, int(i))) for i in chunks[k]]
                batch = collate(exs)
                batch["_weight"] = 1.0
            else:  # this rank has no batch left: a zero-weight copy keeps the forward passes in step
                batch = collate([dict(examples[0], _key=(0, 0))])
                batch["_weight"] = 0.0
            batches.append(batch)
        return cls(batches, task, nsp, num_labels, path, len(examples))

    @torch.no_grad()
    def run(
        self, model, device: torch.device, info: dist_mod.DistInfo, autocast: Optional[Callable] = None
    ) -> Dict[str, float]:
        """The eval_* metrics of ``model`` (all ranks call this and get the same numbers)."""
        was_training = model.training
        model.eval()
        ctx = autocast or contextlib.nullcontext
        k = self.num_labels if self.task == "cls" else 0
        # sums: loss, targets, correct, nsp loss, nsp count, nsp correct, then a k x k confusion matrix
        sums = torch.zeros(6 + k * k, dtype=torch.float64)
        try:
            for batch in self.batches:
                w = float(batch["_weight"])
                ids = batch["input_ids"].to(device)
                mask = batch["attention_mask"].to(device)
                tt = batch["token_type_ids"].to(device)
                labels = batch["labels"].to(device)
                with ctx():
                    if self.task == "cls":
                        logits = model(input_ids=ids, attention_mask=mask, token_type_ids=tt).logits
                    else:
                        out = model(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels)
                if w == 0.0:
                    continue
                if self.task == "cls":
                    logits = logits.float()
                    pred = logits.argmax(-1)
                    sums[0] += float(F.cross_entropy(logits, labels, reduction="sum"))
                    sums[1] += labels.numel()
                    sums[2] += float((pred == labels).sum())
                    idx = (labels * k + pred).cpu()
                    sums[6:] += torch.bincount(idx, minlength=k * k).to(torch.float64)
                    continue
                logits = (out.prediction_logits if self.nsp else out.logits).float()
                v = logits.shape[-1]
                flat = labels.reshape(-1)
                if logits.dim() == 2 and logits.shape[0] == int(batch["num_targets"]):  # masked rows only
                    targets = flat[flat != -100]
                    logits = logits.reshape(-1, v)
                else:
                    keep = flat != -100
                    targets = flat[keep]
                    logits = logits.reshape(-1, v)[keep]
                sums[0] += float(F.cross_entropy(logits, targets, reduction="sum")) if targets.numel() else 0.0
                sums[1] += targets.numel()
                sums[2] += float((logits.argmax(-1) == targets).sum())
                if self.nsp:
                    nsl = batch["next_sentence_label"].to(device)
                    rel = out.seq_relationship_logits.float()
                    sums[3] += float(F.cross_entropy(rel, nsl, reduction="sum"))
                    sums[4] += nsl.numel()
                    sums[5] += float((rel.argmax(-1) == nsl).sum())
        finally:
            if was_training:
                model.train()
        total = torch.tensor(dist_mod.all_reduce_sum(sums.tolist(), info), dtype=torch.float64)
        n = max(total[1].item(), 1.0)
        res = {"eval_loss": total[0].item() / n, "eval_accuracy": total[2].item() / n}
        if self.task == "cls":
            res["eval_f1_macro"] = macro_f1(total[6:].reshape(k, k))
        else:
            res["eval_perplexity"] = math.exp(min(res["eval_loss"], 700.0))
            if self.nsp:
                m = max(total[4].item(), 1.0)
                res["eval_nsp_loss"] = total[3].item() / m
                res["eval_nsp_accuracy"] = total[5].item() / m
        return res


def _in_map(label, label_map) -> bool:
    return bool(label_map) and (label in label_map or str(label) in label_map)


def macro_f1(confusion: torch.Tensor) -> float:
    """Unweighted mean F1 over the classes that occur (true or predicted); ``confusion[t, p]``."""
    c = confusion.to(torch.float64)
    tp = c.diag()
    support = c.sum(1)
    predicted = c.sum(0)
    present = (support + predicted) > 0
    if not bool(present.any()):
        return 0.0
    f1 = torch.where(present, 2 * tp / (support + predicted).clamp_min(1e-12), torch.zeros_like(tp))
    return float(f1[present].mean())


# ----------------------------------------------------------------------------- metric log
def _rows(path: Path) -> List[dict]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
    return rows


def truncate_metrics(path: os.PathLike, last_step: int) -> int:
    """Drop the rows of ``path`` whose step is after ``last_step`` (a resumed run logs them again);
    returns how many were dropped. The file is rewritten atomically."""
    from bert_fast.training.checkpoint import atomic_write_text

    path = Path(path)
    if not path.is_file():
        return 0
    rows = _rows(path)
    keep = [r for r in rows if isinstance(r.get("step"), int) and r["step"] <= last_step]
    dropped = len(path.read_text(encoding="utf-8").splitlines()) - len(keep)
    if dropped:
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
    return dropped


class TensorBoardMissing(RuntimeError):
    """--tensorboard without the tensorboard package."""


def check_tensorboard() -> None:
    """TensorBoardMissing (with what to do) when torch.utils.tensorboard cannot be imported."""
    open_tensorboard(None, None)


def open_tensorboard(log_dir: Optional[Path], purge_step: Optional[int]):
    """A SummaryWriter on ``log_dir`` (None: only check that one can be made)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise TensorBoardMissing(
            f"--tensorboard needs the 'tensorboard' package ({exc}); install it with "
            "`pip install tensorboard`, or leave out --tensorboard (metrics.jsonl has the same numbers)"
        ) from None
    if log_dir is None:
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


class MetricsLogger:
    """metrics.jsonl (+ TensorBoard) of a run, on rank 0 only (see the module doc)."""

    def __init__(
        self,
        output_dir: Optional[os.PathLike],
        is_main: bool,
        resumed_step: Optional[int] = None,
        tensorboard: bool = False,
    ):
        self.f = None
        self.tb = None
        if output_dir is None or not is_main:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "metrics.jsonl"
        if resumed_step is not None:
            truncate_metrics(path, resumed_step)
        if tensorboard:
            self.tb = open_tensorboard(out / "tb", resumed_step + 1 if resumed_step is not None else None)
        self.f = open(path, "a", encoding="utf-8")

    def log(self, row: dict) -> None:
        if self.f is not None:
            self.f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            step = int(row["step"])
            for key, value in row.items():
                if key == "step" or not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                tag = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
                self.tb.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self.f is not None:
            self.f.flush()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
