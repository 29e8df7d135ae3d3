"""Triton kernels of bert_fast, one file per fused op (installed as bert_fast.kernels)."""
