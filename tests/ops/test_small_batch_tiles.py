"""The fixed tiles a GPU lease runs (BERT_FAST_AUTOTUNE=0) at batch 1: small tiles where the large
ones would leave most of the SMs idle (benchmarks/NOTES.md, "Batch 1 on the GPU")."""

import pytest
import torch

from bert_fast.kernels import attention, linear_tma


@pytest.mark.no_kernels("the fixed tile choice: no launch")
def test_fixed_tiles_take_64x64_at_small_m(monkeypatch):
    """BERT_FAST_AUTOTUNE=0 (a GPU lease's benchmarks) keeps exactly one tile: 64 x 64 up to 256
    rows, so that a 128-token GEMM has 24-96 tiles (and split-K fills the rest), 128 x 128 above."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("BERT_FAST_AUTOTUNE", "0")
    configs = linear_tma._configs()
    tile = lambda m: [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in linear_tma._prune(configs, {"M_BUCKET": m})]
    assert tile(128) == tile(256) == [(64, 64)] and tile(512) == tile(16384) == [(128, 128)]


@pytest.mark.no_kernels("the fixed tile choice: no launch")
def test_attention_forward_takes_64_row_tiles_for_a_short_batch(monkeypatch):
    """12 heads x one 128-row tile (batch 1 at 128 tokens) is 12 CTAs for 132 SMs: the forward takes
    64-row tiles (a tile of the autotune space, compiled offline); a full batch and the backward keep theirs."""
    big = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    monkeypatch.setattr(attention, "_configs", lambda *args: dict(big))
    monkeypatch.setattr(attention, "_num_sms", lambda device: 132)
    meta = {"BLOCK_D": 64, "HAS_DROPOUT": False}
    cfg = lambda kind, sequences: attention._fixed_config(
        attention._Launch(kind, (), meta, "BLOCK_M", sequences, 128), torch.empty(0)
    )
    small = cfg("fwd", 12)
    assert (small["BLOCK_M"], small["BLOCK_N"], small["num_warps"], small["num_stages"]) in attention._TUNE_SPACE["fwd"]
    assert small["BLOCK_M"] == 64 and cfg("fwd", 32 * 12) == big and cfg("dq", 12) == big
