"""Training at scale for bert_fast: MLM (+NSP) pretraining and sequence-classification fine-tuning.

One job per module:
  data.py        read a local corpus (text lines or JSONL), tokenize offline, build examples
  collator.py    BERT masking (15%, 80/10/10), padding, length-bucketed global batches
  distributed.py process group, device, DDP / FSDP2 (FSDP1 fallback) wrapping
  checkpoint.py  atomic checkpoints (safetensors weights, optimizer, scheduler, RNG, data position)
  loop.py        the training loop (AMP, accumulation, AdamW + warmup/decay, logging, MFU, SIGTERM)
  cli.py         ``bert-fast train`` (``python -m bert_fast.training.cli``)
"""
