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
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List

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
    from tqdm.auto import tqdm

    if args.precision not in PRECISIONS:
        raise TrainError(f"--precision must be one of {PRECISIONS}, got {args.precision!r}")
    device = info.device
    world, rank = info.world_size, info.rank
    micro = args.micro_batch_size
    accum = args.grad_accum
    global_batch = micro * accum * world
    out_dir = Path(args.output_dir) if args.output_dir else None
    # run safety and self-contained checkpoints (checkpoint.py): a non-empty --output-dir needs
    # --resume or --overwrite; --init-from a checkpoint without --tokenizer uses its tokenizer
    ckpt.prepare_output_dir(out_dir, args.resume, getattr(args, "overwrite", False), info)
    ckpt.default_tokenizer_to_init_from(args)
    if getattr(args, "tensorboard", False):
        try:
            eval_mod.check_tensorboard()
        except eval_mod.TensorBoardMissing as exc:
            raise TrainError(str(exc)) from None

    tokenizer, dataset, collate, task, num_labels, label_map = build_data(args, info)
    nsp = task == "mlm" and args.nsp

    torch.manual_seed(args.seed)
    np.random.seed(args.seed % 2**32)
    import random as _random

    _random.seed(args.seed)
    model = build_model(args, tokenizer, task, num_labels)
    n_params = count_params(model)
    cfg = model.config
    ckpt.describe_config(cfg, model, label_map if task == "cls" else None)  # architectures, id2label
    if args.init_from:
        ckpt.check_tokenizer(tokenizer, cfg, args.init_from, what="--init-from")
    if args.precision == "bf16-pure":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    unwrapped = model
    model, kind = dist_mod.wrap_model(
        model,
        args.strategy,
        info,
        precision=args.precision,
        reshard_after_forward=getattr(args, "fsdp_reshard_after_forward", True),
    )
    optimizer = build_optimizer(model, args, device)

    steps_per_epoch = len(
        coll.epoch_batches(dataset.lengths, global_batch, args.seed, 0, shuffle=args.shuffle, bucket=args.bucket)
    )
    if steps_per_epoch == 0:
        raise TrainError(
            f"the dataset has {len(dataset)} examples, fewer than one global batch of "
            f"{global_batch} (micro {micro} x accum {accum} x world {world})"
        )
    total_steps = args.max_steps if args.max_steps else steps_per_epoch * args.epochs
    warmup = args.warmup_steps if args.warmup_steps is not None else int(round(args.warmup_ratio * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(warmup, total_steps))

    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = None
    if args.precision == "fp16":
        if kind == "fsdp1":
            # FSDP1's flat-parameter shards are plain tensors: its scaler all-reduces found_inf.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device.type)
        else:
            # DDP: every rank holds the averaged gradient. FSDP2: gradients are DTensors, and
            # DTensor's _amp_foreach_non_finite_check_and_unscale_ already reduces found_inf over
            # the mesh, so the plain GradScaler is the one upstream pairs with fully_shard.
            scaler = torch.amp.GradScaler(device.type)

    def autocast():
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=amp_dtype)

    # ---- resume
    epoch, step_in_epoch, global_step, tokens_seen = 0, 0, 0, 0
    if args.resume:
        if out_dir is None and args.resume == "latest":
            raise TrainError("--resume latest needs --output-dir")
        path = ckpt.resolve(args.resume, out_dir)
        ckpt.check_tokenizer(tokenizer, cfg, path, what="--resume")
        state = ckpt.load_checkpoint(path, model, optimizer, scheduler, scaler, info)
        epoch, step_in_epoch = int(state["epoch"]), data_mod.restore_data_position(dataset, state, global_batch, path)
        global_step, tokens_seen = int(state["step"]), int(state.get("tokens_seen", 0))
        if int(state.get("global_batch", global_batch)) != global_batch:
            _log(
                info,
                f"warning: resuming with global batch {global_batch}, the checkpoint used "
                f"{state.get('global_batch')}: the data position is kept in steps",
            )
        _log(info, f"resumed from {path} at step {global_step} (epoch {epoch}, step {step_in_epoch} of the epoch)")

    if out_dir is not None and info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not (out_dir / "tokenizer").exists():
            tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    # metrics.jsonl (+ TensorBoard); a resumed run drops the rows after its checkpoint's step
    logger = eval_mod.MetricsLogger(
        out_dir, info.is_main, global_step if args.resume else None, getattr(args, "tensorboard", False)
    )
    evaluator = None
    if getattr(args, "eval_data", None):
        evaluator = eval_mod.Evaluator.build(args.eval_data, args, tokenizer, task, nsp, label_map, num_labels, info)
        _log(info, f"evaluation: {evaluator.n_examples} examples of {args.eval_data}")

    peak = args.peak_tflops
    if not peak:
        peak = measure_peak_tflops(
            device, amp_dtype or (torch.bfloat16 if args.precision == "bf16-pure" else torch.float32)
        )
    if info.is_main:
        _log(
            info,
            f"bert-fast train: task={task}{'+nsp' if nsp else ''} impl={args.impl} model={n_params / 1e6:.2f}M params "
            f"(L={cfg.num_hidden_layers}, H={cfg.hidden_size}) examples={len(dataset)} "
            f"global_batch={global_batch} (micro {micro} x accum {accum} x world {world}) steps={total_steps} "
            f"strategy={kind} precision={args.precision} device={device} peak={peak:.3g} TFLOP/s "
            f"({'given' if args.peak_tflops else 'measured'})",
        )

    def trainer_state():
        return {
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "data_position": data_mod.data_position(dataset, epoch, step_in_epoch, global_batch),
            "tokens_seen": tokens_seen,
            "global_batch": global_batch,
            "total_steps": total_steps,
            "seed": args.seed,
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
        }

    def save(step):
        if out_dir is None:
            return None
        path = ckpt.save_checkpoint(
            out_dir,
            step,
            model,
            optimizer,
            scheduler,
            scaler,
            trainer_state(),
            info,
            unwrapped,
            keep=args.keep_checkpoints,
            tokenizer=tokenizer,
            run_args=args,
        )
        _log(info, f"saved checkpoint {path}")
        return path

    model.train()
    pbar = tqdm(
        total=total_steps,
        initial=global_step,
        disable=not info.is_main or args.no_progress,
        desc="train",
        dynamic_ncols=True,
        file=sys.stderr,
    )
    losses: List[float] = []
    pending: List[torch.Tensor] = []  # per-step local loss sums since the last log
    pending_counts: List[float] = []  # per-step global target counts
    window_tokens, window_flops, window_t0 = 0, 0.0, time.perf_counter()
    last_tok_s, last_mfu = 0.0, 0.0
    stopped_on_signal = False
    last_saved = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def lr_of_step(s: int) -> float:
        """The learning rate optimizer step s (1-based) used: LambdaLR's factor before its s-th step."""
        lambdas = getattr(scheduler, "lr_lambdas", None)
        if lambdas:
            return float(scheduler.base_lrs[0] * lambdas[0](s - 1))
        return float(scheduler.get_last_lr()[0])

    def flush_logs(extra=None):
        nonlocal window_tokens, window_flops, window_t0, last_tok_s, last_mfu
        if not pending:
            return
        sums = torch.stack(pending).to(torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        step_losses = (sums.cpu() / torch.tensor(pending_counts, dtype=torch.float64).clamp_min(1)).tolist()
        tok_window = dist_mod.all_reduce_sum([window_tokens, window_flops], info)
        elapsed = time.perf_counter() - window_t0
        last_tok_s = tok_window[0] / max(elapsed, 1e-9)
        last_mfu = tok_window[1] / max(elapsed, 1e-9) / (peak * 1e12 * world)
        first = global_step - len(step_losses) + 1
        lr = lr_of_step(global_step)
        for i, l in enumerate(step_losses):
            losses.append(l)
            row = {
                "step": first + i,
                "loss": l,
                "lr": lr_of_step(first + i),
                "tokens_per_s": last_tok_s,
                "mfu": last_mfu,
                "tokens_seen": tokens_seen,
            }
            if extra and first + i == global_step:
                row.update(extra)
            logger.log(row)
        logger.flush()
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        pbar.set_postfix(
            loss=f"{step_losses[-1]:.4f}",
            tok_s=f"{last_tok_s:,.0f}",
            mfu=f"{100 * last_mfu:.1f}%",
            **({"mem": f"{mem:.1f}G"} if mem else {}),
        )
        if args.log_lines:
            _log(
                info,
                f"step {global_step}/{total_steps} loss {step_losses[-1]:.4f} lr {lr:.3e} "
                f"tok/s {last_tok_s:,.0f} MFU {100 * last_mfu:.1f}%",
            )
        pending.clear()
        pending_counts.clear()
        window_tokens, window_flops, window_t0 = 0, 0.0, time.perf_counter()

    def run_eval(step: int) -> dict:
        res = evaluator.run(model, device, info, autocast)
        _log(info, f"eval step {step}: " + " ".join(f"{k[5:]} {v:.4f}" for k, v in res.items()))
        eval_history.append(dict(res, step=step))
        return res

    eval_history: List[dict] = []
    stop_at = args.stop_at_step or 0
    done = global_step >= total_steps
    while not done:
        plan = coll.epoch_batches(
            dataset.lengths, global_batch, args.seed, epoch, shuffle=args.shuffle, bucket=args.bucket
        )
        sampler = coll.StepBatchSampler(plan, epoch, world, rank, accum, start_step=step_in_epoch)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=args.num_workers,
            pin_memory=device.type == "cuda",
            persistent_workers=False,
            # its own generator: creating the iterator draws a base seed,
            # which must not shift the global stream (dropout) on resume
            generator=torch.Generator().manual_seed(args.seed * 1000 + epoch),
        )
        it = iter(loader)
        while step_in_epoch < len(plan):
            micro_batches = [next(it) for _ in range(accum)]
            local = [
                sum(b["num_targets"] for b in micro_batches),
                sum(b.get("num_sequences", 0) for b in micro_batches),
                1.0 if stop.requested else 0.0,
            ]
            g = dist_mod.all_reduce_sum(local, info)
            counts = {"targets": g[0], "sequences": g[1]}
            stop_now = g[2] > 0
            step_sum = None
            for a, batch in enumerate(micro_batches):
                with dist_mod.no_sync(model, kind, sync=(a == accum - 1)):
                    with autocast():
                        loss, total = micro_loss(model, batch, task, nsp, device, counts, world)
                    if scaler is not None:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                step_sum = total if step_sum is None else step_sum + total
                n_tok = int(batch["num_tokens"])
                lens = batch["attention_mask"].sum(dim=1).double()
                window_tokens += n_tok
                window_flops += train_flops(cfg, n_tok, float((lens * lens).sum()))
                tokens_seen += n_tok * world
            if scaler is not None:
                scaler.unscale_(optimizer)
            if args.max_grad_norm and args.max_grad_norm > 0:
                if kind == "fsdp1":
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
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            step_in_epoch += 1
            pending.append(step_sum.float())
            pending_counts.append(counts["targets"])
            pbar.update(1)
            epoch_over = step_in_epoch >= len(plan)
            if epoch_over:
                epoch, step_in_epoch = epoch + 1, 0
            finished = global_step >= total_steps
            eval_now = (
                evaluator is not None
                and not stop_now
                and (finished or global_step == stop_at or (args.eval_every and global_step % args.eval_every == 0))
            )
            if eval_now or global_step % args.log_every == 0 or finished or stop_now or global_step == stop_at:
                flush_logs(run_eval(global_step) if eval_now else None)
            if stop_now:
                _log(info, f"SIGTERM: stopping at step {global_step}, saving a checkpoint")
                last_saved = save(global_step)
                stopped_on_signal = True
                done = True
                break
            if finished or global_step == stop_at:
                done = True
                break
            if args.save_every and global_step % args.save_every == 0:
                last_saved = save(global_step)
            if epoch_over:
                break  # next epoch: a new plan and loader
        del it, loader
    flush_logs()
    pbar.close()
    if not stopped_on_signal and (args.save_final or global_step == stop_at) and out_dir is not None:
        if last_saved is None or last_saved.name != ckpt.checkpoint_dir(out_dir, global_step).name:
            last_saved = save(global_step)
    logger.close()
    summary = {
        "steps": global_step,
        "losses": losses,
        "tokens_per_s": last_tok_s,
        "mfu": last_mfu,
        "peak_tflops": peak,
        "params": n_params,
        "checkpoint": str(last_saved) if last_saved else None,
        "eval": eval_history,
        "stopped_on_signal": stopped_on_signal,
        "strategy": kind,
        "world_size": world,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None),
    }
    if info.is_main:
        _log(
            info,
            f"done: {global_step} steps, final loss {losses[-1] if losses else float('nan'):.4f}, "
            f"{last_tok_s:,.0f} tokens/s, MFU {100 * last_mfu:.1f}%"
            + (f", checkpoint {last_saved}" if last_saved else ""),
        )
        if out_dir is not None:
            ckpt.atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
