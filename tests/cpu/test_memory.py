"""Memory under load (issue 25, item 7): bert_fast.memory's remedies and the bound of every cache of
ours that a stream of shapes could grow (benchmarks/memory/soak.py measures the whole model)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import bert_fast
from bert_fast import memory
from bert_fast.model import frozen
from bert_fast.ops import fused_sdpa, torch_impl

glibc = pytest.mark.skipif(not memory.trim_available(), reason="malloc_trim is glibc's")


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU path a server runs (the torch implementation)


@glibc
def test_malloc_trim_gives_the_heaps_free_pages_back():
    # 96 tensors of 1 MiB on the heap (mmap threshold at its 32 MiB maximum, no automatic trim), a small
    # tensor allocated after them pins the heap's top, then the 96 are freed: RSS stays until malloc_trim.
    code = textwrap.dedent(
        """
        import torch
        from bert_fast import memory
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
        big = [torch.ones(1 << 18) for _ in range(96)]
        pin = torch.ones(16)
        del big
        before = rss()
        released = memory.malloc_trim()
        print(before - rss(), released)
        """
    )
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="33554432", MALLOC_TRIM_THRESHOLD_="4294967296")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    dropped, released = out.stdout.split()
    assert float(dropped) > 48 and released == "True", out.stdout


def test_memory_trimmer_trims_every_k_steps(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "malloc_trim", lambda: calls.append(1) or True)
    t = memory.MemoryTrimmer(every=3)
    for _ in range(10):
        t.step()
    assert t.trims == 3 and len(calls) == 3
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="every"):
            memory.MemoryTrimmer(every=bad)


def test_bucket_shape_and_bucketed_forward_equal_on_real_tokens():
    assert memory.bucket_shape(1, 1) == (1, 64)
    assert memory.bucket_shape(5, 65, 32) == (8, 96)
    assert memory.bucket_shape(16, 256) == (16, 256)
    with pytest.raises(ValueError, match="multiple=0"):
        memory.bucket_shape(2, 3, 0)
    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=50
    )
    torch.manual_seed(0)
    model = bert_fast.optimize(transformers.BertModel(cfg).eval())
    ids = torch.randint(1, 50, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    bids, bmask, btt, b = memory.bucket(ids, mask, torch.zeros_like(ids), multiple=16)
    assert bids.shape == bmask.shape == btt.shape == (4, 16) and b == 3
    assert bmask[:3, 11:].sum() == 0 and bmask[3].tolist() == [1] + [0] * 15
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = model(input_ids=bids, attention_mask=bmask, token_type_ids=btt).last_hidden_state[:b, :11]
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attention_mask"):
        memory.bucket(ids, mask[:, :5])


def test_varlen_plan_cache_stays_bounded_over_many_shapes():
    torch_impl._PLAN_CACHE.clear()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(1, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        torch_impl._varlen_plan(cu, 64)
    assert 0 < len(torch_impl._PLAN_CACHE) <= torch_impl._PLAN_CACHE_SIZE


@pytest.mark.parametrize("freeze", [False, True])
def test_no_cache_of_ours_grows_with_the_shapes_of_a_stream(freeze):
    # a stream of random shapes through a plain and a frozen model: the per-process verdicts of fused
    # attention and freeze()'s packing choices are keyed by weight shape, dtype, head dim, not by batch shape
    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=50
    )
    torch.manual_seed(0)
    model = bert_fast.optimize(transformers.BertModel(cfg).eval(), freeze=freeze)
    g = torch.Generator().manual_seed(1)

    def forward():
        b, s = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        ids = torch.randint(1, 50, (b, s), generator=g)
        mask = (torch.arange(s)[None, :] < torch.randint(1, s + 1, (b, 1), generator=g)).long()
        model(input_ids=ids, attention_mask=mask)

    with torch.inference_mode():
        for _ in range(5):
            forward()
        sizes = (len(fused_sdpa.verdicts()), len(frozen.packing_choices()), len(torch_impl._PLAN_CACHE))
        for _ in range(60):
            forward()
    assert len(fused_sdpa.verdicts()) == sizes[0] and len(frozen.packing_choices()) == sizes[1]
    assert len(torch_impl._PLAN_CACHE) <= torch_impl._PLAN_CACHE_SIZE
