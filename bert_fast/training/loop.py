"""The training loop: MLM (+NSP) pretraining and sequence-classification fine-tuning.

Loss normalisation (why 1 rank == N ranks): a step's loss is the sum of the per-target losses of
the whole global batch divided by the global number of targets (masked tokens for MLM, sequences
for NSP and classification), counted on the host by the collator and summed over ranks with one
small all-reduce per step. Each micro-batch backpropagates ``local_sum * world_size / global_count``
so that DDP/FSDP's gradient *average* over ranks is the gradient of that global loss, whatever the
world size, accumulation steps or how the masked tokens fall into micro-batches.

Precision (``--precision``): fp32; bf16 (torch.autocast bf16, fp32 master weights: bert_fast's
modeling casts the weights to the autocast dtype per call); fp16 (autocast fp16 + GradScaler;
ShardedGradScaler under FSDP1; FSDP2's gradients are DTensors, whose unscale reduces found_inf over
the mesh, so it keeps the plain GradScaler); bf16-pure (bf16 weights and grads, no autocast; the
optimizer, training/master_weights.py, keeps fp32 master weights and moments and copies each
step's result into the bf16 weights). Under FSDP2, bf16 adds MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32): bf16 all-gathers, fp32 sharded master weights (training/distributed.py).
The loss is always reduced in fp32.

Throughput: tokens/s counts real tokens (attention_mask == 1). MFU = model FLOPs / time / peak with
the model FLOPs of ``bert-fast bench`` (bert_fast.model.facts.flops_per_token, x3 for
forward + backward): the encoder's matmuls and attention on real lengths, without embeddings and
heads, the convention of the issue's "50% MFU = ~0.95M tokens/s for bert-base at S=128". (Counting
6 * all parameters instead would include the ~24M embedding parameters, which are gathers, not
matmuls, and overstate BERT-base's MFU by ~20%.) Peak = --peak-tflops or, when not given, a
measured dense GEMM rate on the device in the compute dtype.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from bert_fast.model import compat
from bert_fast.model.facts import flops_per_token
from bert_fast.training import checkpoint as ckpt
from bert_fast.training import collator as coll
from bert_fast.training import data as data_mod
from bert_fast.training import distributed as dist_mod
from bert_fast.training import evaluate as eval_mod
from bert_fast.training import table_data

MODEL_SIZES: Dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256),
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure")
EXIT_PREEMPTED = 143  # 128 + SIGTERM: the run stopped on SIGTERM after saving a checkpoint


class TrainError(RuntimeError):
    """A user-facing problem (bad arguments, data); the CLI prints it and exits 2."""


# ----------------------------------------------------------------------------- model
def build_model(args, tokenizer, task: str, num_labels: int = 2) -> torch.nn.Module:
    import transformers

    import bert_fast

    if args.init_from:
        config = transformers.BertConfig.from_pretrained(args.init_from, local_files_only=True)
    else:
        if args.model_size not in MODEL_SIZES:
            raise TrainError(f"--model-size must be one of {sorted(MODEL_SIZES)}, got {args.model_size!r}")
        vocab = len(tokenizer)
        vocab = (vocab + 7) // 8 * 8  # GEMM-friendly decoder width (extra rows are never targets)
        config = transformers.BertConfig(
            vocab_size=vocab,
            max_position_embeddings=max(512, args.max_len),
            type_vocab_size=2,
            pad_token_id=tokenizer.pad_token_id,
            **MODEL_SIZES[args.model_size],
        )
    if args.dropout is not None:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = float(args.dropout)
    if args.max_len > config.max_position_embeddings:
        raise TrainError(
            f"--max-len {args.max_len} exceeds the model's max_position_embeddings={config.max_position_embeddings}"
        )
    if task == "cls":
        config.num_labels = num_labels
    fast = args.impl == "fast"
    if task == "mlm":
        cls = (
            (bert_fast.BertForPreTraining if fast else transformers.BertForPreTraining)
            if args.nsp
            else (bert_fast.BertForMaskedLM if fast else transformers.BertForMaskedLM)
        )
    else:
        cls = bert_fast.BertForSequenceClassification if fast else transformers.BertForSequenceClassification
    kwargs = {}
    if fast and task == "mlm":
        kwargs["mlm_masked_positions_only"] = not args.mlm_full_logits
    if not fast:
        compat.set_attention_implementation(config, args.hf_attn)
    if args.init_from:
        model = cls.from_pretrained(args.init_from, config=config, local_files_only=True, **kwargs)
    else:
        model = cls(config, **kwargs)
    if args.grad_checkpointing:
        # transformers >= 5.23 names it activation_checkpointing_enable (the old name warns)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_params(model: torch.nn.Module) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def train_flops(config, tokens: int, sum_len_sq: float) -> float:
    """Forward + backward model FLOPs of a batch with ``tokens`` real tokens whose sequences'
    squared lengths sum to ``sum_len_sq``: 3x the sum of len * flops_per_token(len) over the
    sequences, which is linear in len and len^2."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token = flops_per_token(h, layers, i, 0.0)  # the matmuls
    per_len_sq = flops_per_token(h, layers, i, 1.0) - per_token  # attention: 4 * H * L per unit
    return 3.0 * (per_token * tokens + per_len_sq * sum_len_sq)


def measure_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """A dense GEMM rate measured on ``device`` (the MFU denominator when --peak-tflops is absent)."""
    n = 8192 if device.type == "cuda" else 512
    dtype = dtype if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)  # never touch the training RNG streams
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    iters = 20 if device.type == "cuda" else 5
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2.0 * n**3 * iters / (time.perf_counter() - t0) / 1e12


# ----------------------------------------------------------------------------- optimizer
def build_optimizer(model: torch.nn.Module, args, device: torch.device) -> torch.optim.Optimizer:
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=args.lr, betas=(args.beta1, args.beta2), eps=args.adam_eps)
    if getattr(args, "precision", None) == "bf16-pure":
        from bert_fast.training.master_weights import MasterWeightAdamW

        return MasterWeightAdamW(groups, **kw)  # fp32 master weights of the bf16 parameters
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(groups, fused=True, **kw)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(groups, **kw)


def linear_schedule(warmup: int, total: int):
    """LR factor of step s: linear warmup over ``warmup`` steps, then linear decay to 0 at ``total``."""

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


# ----------------------------------------------------------------------------- data
def build_data(args, info: dist_mod.DistInfo):
    """(tokenizer, dataset, collator, task, num_labels, label_map)."""
    from bert_fast.training import token_shards

    if args.data and token_shards.is_prepared_dir(args.data):  # bert-fast prepare-data output: read lazily
        tokenizer, dataset = token_shards.open_for_training(args)
        collate = coll.MaskingCollator(
            tokenizer,
            mlm=True,
            mlm_probability=args.mlm_probability,
            seed=args.seed,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )
        return tokenizer, dataset, collate, "mlm", 2, None
    path = Path(args.data) if args.data else data_mod.DEMO_CORPUS
    task = args.task
    # CSV/TSV (named columns: --text-column, --text-pair-column, --label-column), JSONL or text
    records, lines = table_data.read_records(path, args, need_labels=(task == "cls"))
    tok_name = args.tokenizer
    saved = Path(args.output_dir) / "tokenizer" if args.output_dir else None
    if tok_name in (None, "", "auto", "build") and saved is not None and saved.is_dir():
        tok_name = str(saved)  # a continued run keeps the ids its checkpoints were trained with
    tokenizer = data_mod.load_tokenizer(tok_name, lines)
    label_map, num_labels = None, 2
    if task == "mlm":
        if args.nsp:
            examples = data_mod.nsp_examples(tokenizer, lines, args.max_len, seed=args.seed)
        else:
            examples = data_mod.mlm_examples(
                tokenizer, lines, args.max_len, pack=args.pack, truncate=getattr(args, "truncate", False)
            )
    elif task == "cls":
        if records is None:
            raise TrainError(f"--task cls needs a JSONL file with 'text' and 'label' fields, got {path}")
        label_map = data_mod.label_map_of(records)
        num_labels = max(len(label_map), max(label_map.values()) + 1)
        if num_labels < 2:
            raise TrainError(f"--task cls needs at least two classes, {path} has labels {sorted(map(str, label_map))}")
        examples = data_mod.classification_examples(tokenizer, records, args.max_len, label_map)
    else:
        raise TrainError(f"--task must be mlm or cls, got {task!r}")
    dataset = data_mod.ExampleDataset(examples)
    collate = coll.MaskingCollator(
        tokenizer,
        mlm=(task == "mlm"),
        mlm_probability=args.mlm_probability,
        seed=args.seed,
        pad_to_multiple_of=args.pad_to_multiple_of,
    )
    return tokenizer, dataset, collate, task, num_labels, label_map


# ----------------------------------------------------------------------------- loss
def micro_loss(model, batch: dict, task: str, nsp: bool, device, counts: dict, world: int):
    """(loss to backpropagate, local loss sum for logging) of one micro-batch (see module doc)."""
    ids = batch["input_ids"].to(device, non_blocking=True)
    mask = batch["attention_mask"].to(device, non_blocking=True)
    tt = batch["token_type_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    if task == "cls":
        logits = model(input_ids=ids, attention_mask=mask, token_type_ids=tt).logits
        total = F.cross_entropy(logits.float(), labels, reduction="sum")
        return total * (world / max(counts["targets"], 1)), total.detach()
    out = model(input_ids=ids, attention_mask=mask, token_type_ids=tt, labels=labels)
    logits = out.prediction_logits if nsp else out.logits
    v = logits.shape[-1]
    if logits.dim() == 2 and logits.shape[0] == int(batch["num_targets"]):  # masked positions only
        targets = labels.reshape(-1)[labels.reshape(-1) != -100]
    else:
        targets = labels.reshape(-1)
    mlm = F.cross_entropy(logits.reshape(-1, v).float(), targets, ignore_index=-100, reduction="sum")
    loss = mlm * (world / max(counts["targets"], 1))
    total = mlm.detach()
    if nsp:
        nsl = batch["next_sentence_label"].to(device, non_blocking=True)
        nsp_sum = F.cross_entropy(out.seq_relationship_logits.float(), nsl, reduction="sum")
        loss = loss + nsp_sum * (world / max(counts["sequences"], 1))
        # logged loss = mlm mean + nsp mean: keep the parts' sums weighted by their global counts
        total = total + nsp_sum.detach() * (counts["targets"] / max(counts["sequences"], 1))
    return loss, total


# ----------------------------------------------------------------------------- SIGTERM
class StopFlag:
    """SIGTERM (and SIGUSR1) set a flag; the loop finishes its step, saves a checkpoint and exits."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def _handler(self, signum, frame):  # noqa: ARG002
        self.requested = True

    def install(self):
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)):
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


# ----------------------------------------------------------------------------- train
def train(args) -> dict:
    """Run training as configured by ``args`` (the namespace of cli.build_parser). Returns a
    summary: steps, per-step losses (rank 0), throughput, checkpoint, stopped_on_signal."""
    info = dist_mod.setup(args.device)
    stop = StopFlag().install()
    try:
        return _train(args, info, stop)
    finally:
        stop.restore()
        if not getattr(args, "keep_process_group", False):
            dist_mod.teardown()


def _log(info, msg: str) -> None:
    if info.is_main:
        from tqdm.auto import tqdm

        tqdm.write(msg, file=sys.stderr)


def _train(args, info: dist_mod.DistInfo, stop: StopFlag) -> dict:
    """train() inside its process group and signal handlers."""
    run = _Run(args, info, stop)
    run.setup()
    run.train()
    return run.finish()


def _grad_scaler(precision: str, kind: str, device: torch.device):
    """fp16's loss scaler (None for the other precisions)."""
    if precision != "fp16":
        return None
    if kind == "fsdp1":
        # FSDP1's flat-parameter shards are plain tensors: its scaler all-reduces found_inf.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    # DDP: every rank holds the averaged gradient. FSDP2: gradients are DTensors, and
    # DTensor's _amp_foreach_non_finite_check_and_unscale_ already reduces found_inf over
    # the mesh, so the plain GradScaler is the one upstream pairs with fully_shard.
    return torch.amp.GradScaler(device.type)


class _Run:
    """One training run: the state its steps share (model, optimizer, data position, logs).

    Every rank builds one and calls the same methods in the same order, so the ranks make the same
    collective calls (all-reduces, barriers, checkpoint gathers) in the same order."""

    def __init__(self, args, info: dist_mod.DistInfo, stop: StopFlag):
        if args.precision not in PRECISIONS:
            raise TrainError(f"--precision must be one of {PRECISIONS}, got {args.precision!r}")
        self.args, self.info, self.stop = args, info, stop
        self.device = info.device
        self.world, self.rank = info.world_size, info.rank
        self.micro, self.accum = args.micro_batch_size, args.grad_accum
        self.global_batch = self.micro * self.accum * self.world
        self.out_dir = Path(args.output_dir) if args.output_dir else None
        # run safety and self-contained checkpoints (checkpoint.py): a non-empty --output-dir needs
        # --resume or --overwrite; --init-from a checkpoint without --tokenizer uses its tokenizer
        ckpt.prepare_output_dir(self.out_dir, args.resume, getattr(args, "overwrite", False), info)
        ckpt.default_tokenizer_to_init_from(args)
        if getattr(args, "tensorboard", False):
            try:
                eval_mod.check_tensorboard()
            except eval_mod.TensorBoardMissing as exc:
                raise TrainError(str(exc)) from None

    def log(self, msg: str) -> None:
        """A line on stderr, rank 0 only."""
        _log(self.info, msg)

    # ---- setup: everything before the first step
    def setup(self) -> None:
        """Everything before the first step, in the order the RNG streams and the logs expect."""
        self._build()
        self._schedule()
        self._resume()
        self._open_outputs()
        self._start()

    def _build(self) -> None:
        """Data, model (seeded, wrapped for DDP/FSDP) and optimizer."""
        args = self.args
        self.tokenizer, self.dataset, self.collate, self.task, num_labels, label_map = build_data(args, self.info)
        self.num_labels, self.label_map = num_labels, label_map
        self.nsp = self.task == "mlm" and args.nsp
        torch.manual_seed(args.seed)
        np.random.seed(args.seed % 2**32)
        random.seed(args.seed)
        model = build_model(args, self.tokenizer, self.task, num_labels)
        self.n_params = count_params(model)
        self.cfg = model.config
        ckpt.describe_config(self.cfg, model, label_map if self.task == "cls" else None)  # architectures, id2label
        if args.init_from:
            ckpt.check_tokenizer(self.tokenizer, self.cfg, args.init_from, what="--init-from")
        if args.precision == "bf16-pure":
            model = model.to(torch.bfloat16)
        self.unwrapped = model.to(self.device)
        self.model, self.kind = dist_mod.wrap_model(
            self.unwrapped,
            args.strategy,
            self.info,
            precision=args.precision,
            reshard_after_forward=getattr(args, "fsdp_reshard_after_forward", True),
        )
        self.optimizer = build_optimizer(self.model, args, self.device)

    def _schedule(self) -> None:
        """Steps, LR schedule, autocast dtype and fp16's loss scaler."""
        args, global_batch = self.args, self.global_batch
        steps_per_epoch = len(self._plan(0))
        if steps_per_epoch == 0:
            raise TrainError(
                f"the dataset has {len(self.dataset)} examples, fewer than one global batch of "
                f"{global_batch} (micro {self.micro} x accum {self.accum} x world {self.world})"
            )
        self.total_steps = total = args.max_steps if args.max_steps else steps_per_epoch * args.epochs
        warmup = args.warmup_steps if args.warmup_steps is not None else int(round(args.warmup_ratio * total))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, linear_schedule(warmup, total))
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
        self.scaler = _grad_scaler(args.precision, self.kind, self.device)

    def _resume(self) -> None:
        """The data position, step and states of --resume's checkpoint (zeros for a fresh run)."""
        self.epoch, self.step_in_epoch, self.global_step, self.tokens_seen = 0, 0, 0, 0
        args, global_batch = self.args, self.global_batch
        if not args.resume:
            return
        if self.out_dir is None and args.resume == "latest":
            raise TrainError("--resume latest needs --output-dir")
        path = ckpt.resolve(args.resume, self.out_dir)
        ckpt.check_tokenizer(self.tokenizer, self.cfg, path, what="--resume")
        state = ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.scaler, self.info)
        self.epoch = int(state["epoch"])
        self.step_in_epoch = data_mod.restore_data_position(self.dataset, state, global_batch, path)
        self.global_step, self.tokens_seen = int(state["step"]), int(state.get("tokens_seen", 0))
        if int(state.get("global_batch", global_batch)) != global_batch:
            self.log(
                f"warning: resuming with global batch {global_batch}, the checkpoint used "
                f"{state.get('global_batch')}: the data position is kept in steps"
            )
        where = f"step {self.global_step} (epoch {self.epoch}, step {self.step_in_epoch} of the epoch)"
        self.log(f"resumed from {path} at {where}")

    def _open_outputs(self) -> None:
        """The tokenizer's copy, metrics log, evaluator and MFU peak; the run's opening line."""
        args, info, out_dir = self.args, self.info, self.out_dir
        if out_dir is not None and info.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            if not (out_dir / "tokenizer").exists():
                self.tokenizer.save_pretrained(str(out_dir / "tokenizer"))
        # metrics.jsonl (+ TensorBoard); a resumed run drops the rows after its checkpoint's step
        self.logger = eval_mod.MetricsLogger(
            out_dir, info.is_main, self.global_step if args.resume else None, getattr(args, "tensorboard", False)
        )
        self.evaluator = None
        if getattr(args, "eval_data", None):
            self.evaluator = eval_mod.Evaluator.build(
                args.eval_data, args, self.tokenizer, self.task, self.nsp, self.label_map, self.num_labels, info
            )
            self.log(f"evaluation: {self.evaluator.n_examples} examples of {args.eval_data}")
        self.peak = args.peak_tflops
        if not self.peak:
            dtype = self.amp_dtype or (torch.bfloat16 if args.precision == "bf16-pure" else torch.float32)
            self.peak = measure_peak_tflops(self.device, dtype)
        if info.is_main:
            cfg = self.cfg
            self.log(
                f"bert-fast train: task={self.task}{'+nsp' if self.nsp else ''} impl={args.impl} "
                f"model={self.n_params / 1e6:.2f}M params (L={cfg.num_hidden_layers}, H={cfg.hidden_size}) "
                f"examples={len(self.dataset)} global_batch={self.global_batch} (micro {self.micro} x accum "
                f"{self.accum} x world {self.world}) steps={self.total_steps} strategy={self.kind} "
                f"precision={args.precision} device={self.device} peak={self.peak:.3g} TFLOP/s "
                f"({'given' if args.peak_tflops else 'measured'})"
            )

    def _start(self) -> None:
        """Training mode, the progress bar and the empty logs window."""
        from tqdm.auto import tqdm

        self.model.train()
        self.pbar = tqdm(
            total=self.total_steps,
            initial=self.global_step,
            disable=not self.info.is_main or self.args.no_progress,
            desc="train",
            dynamic_ncols=True,
            file=sys.stderr,
        )
        self.losses: List[float] = []
        self.pending: List[torch.Tensor] = []  # per-step local loss sums since the last log
        self.pending_counts: List[float] = []  # per-step global target counts
        self.window_tokens, self.window_flops, self.window_t0 = 0, 0.0, time.perf_counter()
        self.last_tok_s, self.last_mfu = 0.0, 0.0
        self.stopped_on_signal = False
        self.last_saved = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.eval_history: List[dict] = []
        self.stop_at = self.args.stop_at_step or 0

    # ---- the loop
    def train(self) -> None:
        """Steps until --max-steps / the epochs, --stop-at-step or a stop signal."""
        done = self.global_step >= self.total_steps
        while not done:
            done = self._epoch()

    def _epoch(self) -> bool:
        """Steps from the data position to the end of its epoch; True when training is over."""
        args, plan = self.args, self._plan(self.epoch)
        sampler = coll.StepBatchSampler(
            plan, self.epoch, self.world, self.rank, self.accum, start_step=self.step_in_epoch
        )
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=sampler,
            collate_fn=self.collate,
            num_workers=args.num_workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=False,
            # its own generator: creating the iterator draws a base seed,
            # which must not shift the global stream (dropout) on resume
            generator=torch.Generator().manual_seed(args.seed * 1000 + self.epoch),
        )
        it = iter(loader)
        while self.step_in_epoch < len(plan):
            stop_now = self.step([next(it) for _ in range(self.accum)])
            epoch_over = self.step_in_epoch >= len(plan)
            if epoch_over:
                self.epoch, self.step_in_epoch = self.epoch + 1, 0
            if self._after_step(stop_now):
                return True
            if epoch_over:
                return False  # next epoch: a new plan and loader
        return False

    def _plan(self, epoch: int) -> list:
        """The epoch's global batches: the same on every rank (seeded by --seed and the epoch)."""
        a = self.args
        return coll.epoch_batches(
            self.dataset.lengths, self.global_batch, a.seed, epoch, shuffle=a.shuffle, bucket=a.bucket
        )

    def step(self, micro_batches: List[dict]) -> bool:
        """One optimizer step over the global batch; True when a rank was asked to stop (SIGTERM)."""
        local = [
            sum(b["num_targets"] for b in micro_batches),
            sum(b.get("num_sequences", 0) for b in micro_batches),
            1.0 if self.stop.requested else 0.0,
        ]
        g = dist_mod.all_reduce_sum(local, self.info)
        counts = {"targets": g[0], "sequences": g[1]}
        step_sum = self._forward_backward(micro_batches, counts)
        self._optimizer_step()
        self.global_step += 1
        self.step_in_epoch += 1
        self.pending.append(step_sum.float())
        self.pending_counts.append(counts["targets"])
        self.pbar.update(1)
        return g[2] > 0

    def _forward_backward(self, micro_batches: List[dict], counts: dict) -> torch.Tensor:
        """Accumulate the micro-batches' gradients (synced on the last); their local loss sum."""
        model, world, step_sum = self.model, self.world, None
        for a, batch in enumerate(micro_batches):
            with dist_mod.no_sync(model, self.kind, sync=(a == self.accum - 1)):
                with self.autocast():
                    loss, total = micro_loss(model, batch, self.task, self.nsp, self.device, counts, world)
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            step_sum = total if step_sum is None else step_sum + total
            n_tok = int(batch["num_tokens"])
            lens = batch["attention_mask"].sum(dim=1).double()
            self.window_tokens += n_tok
            self.window_flops += train_flops(self.cfg, n_tok, float((lens * lens).sum()))
            self.tokens_seen += n_tok * world
        return step_sum

    def _optimizer_step(self) -> None:
        """Unscale, clip, step the optimizer and the schedule."""
        args, model, optimizer, scaler = self.args, self.model, self.optimizer, self.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        if args.max_grad_norm and args.max_grad_norm > 0:
            if self.kind == "fsdp1":
                model.clip_grad_norm_(args.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.grad is not None], args.max_grad_norm
                )
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def _after_step(self, stop_now: bool) -> bool:
        """Evaluate, log, save or stop as the step asks; True when training is over."""
        args, step = self.args, self.global_step
        finished = step >= self.total_steps
        eval_now = (
            self.evaluator is not None
            and not stop_now
            and (finished or step == self.stop_at or (args.eval_every and step % args.eval_every == 0))
        )
        if eval_now or step % args.log_every == 0 or finished or stop_now or step == self.stop_at:
            self.flush_logs(self.evaluate(step) if eval_now else None)
        if stop_now:
            self.log(f"SIGTERM: stopping at step {step}, saving a checkpoint")
            self.last_saved = self.save(step)
            self.stopped_on_signal = True
            return True
        if finished or step == self.stop_at:
            return True
        if args.save_every and step % args.save_every == 0:
            self.last_saved = self.save(step)
        return False

    def autocast(self):
        """The forward's autocast context (a no-op for fp32 and bf16-pure)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # ---- evaluation, logs, checkpoints
    def evaluate(self, step: int) -> dict:
        """Evaluate on --eval-data (every rank: the metrics are reduced over ranks); the eval_* metrics."""
        res = self.evaluator.run(self.model, self.device, self.info, self.autocast)
        self.log(f"eval step {step}: " + " ".join(f"{k[5:]} {v:.4f}" for k, v in res.items()))
        self.eval_history.append(dict(res, step=step))
        return res

    def lr_of_step(self, s: int) -> float:
        """The learning rate optimizer step s (1-based) used: LambdaLR's factor before its s-th step."""
        lambdas = getattr(self.scheduler, "lr_lambdas", None)
        if lambdas:
            return float(self.scheduler.base_lrs[0] * lambdas[0](s - 1))
        return float(self.scheduler.get_last_lr()[0])

    def flush_logs(self, extra=None) -> None:
        """Log the steps since the last flush (a row each; ``extra`` joins the last step's row)."""
        if not self.pending:
            return
        step_losses = self._reduce_window()
        step, tok_s, mfu = self.global_step, self.last_tok_s, self.last_mfu
        first = step - len(step_losses) + 1
        lr = self.lr_of_step(step)
        for i, l in enumerate(step_losses):
            self.losses.append(l)
            row = {"step": first + i, "loss": l, "lr": self.lr_of_step(first + i)}
            row.update(tokens_per_s=tok_s, mfu=mfu, tokens_seen=self.tokens_seen)
            if extra and first + i == step:
                row.update(extra)
            self.logger.log(row)
        self.logger.flush()
        mem = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
        self.pbar.set_postfix(
            loss=f"{step_losses[-1]:.4f}",
            tok_s=f"{tok_s:,.0f}",
            mfu=f"{100 * mfu:.1f}%",
            **({"mem": f"{mem:.1f}G"} if mem else {}),
        )
        if self.args.log_lines:
            self.log(
                f"step {step}/{self.total_steps} loss {step_losses[-1]:.4f} lr {lr:.3e} "
                f"tok/s {tok_s:,.0f} MFU {100 * mfu:.1f}%"
            )
        self.pending.clear()
        self.pending_counts.clear()
        self.window_tokens, self.window_flops, self.window_t0 = 0, 0.0, time.perf_counter()

    def _reduce_window(self) -> List[float]:
        """The pending steps' global losses, and the window's tokens/s and MFU (two all-reduces)."""
        sums = torch.stack(self.pending).to(torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        counts = torch.tensor(self.pending_counts, dtype=torch.float64).clamp_min(1)
        step_losses = (sums.cpu() / counts).tolist()
        tok_window = dist_mod.all_reduce_sum([self.window_tokens, self.window_flops], self.info)
        elapsed = time.perf_counter() - self.window_t0
        self.last_tok_s = tok_window[0] / max(elapsed, 1e-9)
        self.last_mfu = tok_window[1] / max(elapsed, 1e-9) / (self.peak * 1e12 * self.world)
        return step_losses

    def trainer_state(self) -> dict:
        """What a checkpoint needs to resume: the data position and the run's arguments."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "data_position": data_mod.data_position(self.dataset, self.epoch, self.step_in_epoch, self.global_batch),
            "tokens_seen": self.tokens_seen,
            "global_batch": self.global_batch,
            "total_steps": self.total_steps,
            "seed": self.args.seed,
            "args": {k: v for k, v in vars(self.args).items() if isinstance(v, (int, float, str, bool, type(None)))},
        }

    def save(self, step: int) -> Optional[Path]:
        """Write the checkpoint of ``step`` (every rank); its path, None without --output-dir."""
        if self.out_dir is None:
            return None
        path = ckpt.save_checkpoint(
            self.out_dir,
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.trainer_state(),
            self.info,
            self.unwrapped,
            keep=self.args.keep_checkpoints,
            tokenizer=self.tokenizer,
            run_args=self.args,
        )
        self.log(f"saved checkpoint {path}")
        return path

    # ---- the end
    def finish(self) -> dict:
        """Last logs and checkpoint; the summary (also written to summary.json)."""
        args, out_dir, step = self.args, self.out_dir, self.global_step
        self.flush_logs()
        self.pbar.close()
        if not self.stopped_on_signal and (args.save_final or step == self.stop_at) and out_dir is not None:
            if self.last_saved is None or self.last_saved.name != ckpt.checkpoint_dir(out_dir, step).name:
                self.last_saved = self.save(step)
        self.logger.close()
        cuda = self.device.type == "cuda"
        summary = {
            "steps": step,
            "losses": self.losses,
            "tokens_per_s": self.last_tok_s,
            "mfu": self.last_mfu,
            "peak_tflops": self.peak,
            "params": self.n_params,
            "checkpoint": str(self.last_saved) if self.last_saved else None,
            "eval": self.eval_history,
            "stopped_on_signal": self.stopped_on_signal,
            "strategy": self.kind,
            "world_size": self.world,
            "peak_memory_gib": (torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None),
        }
        if self.info.is_main:
            last = self.losses[-1] if self.losses else float("nan")
            self.log(
                f"done: {step} steps, final loss {last:.4f}, {self.last_tok_s:,.0f} tokens/s, "
                f"MFU {100 * self.last_mfu:.1f}%" + (f", checkpoint {self.last_saved}" if self.last_saved else "")
            )
            if out_dir is not None:
                ckpt.atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))
        return summary
