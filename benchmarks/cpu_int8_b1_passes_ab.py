"""A/B of two batch-1 changes to the int8 forward (#32 item 5, 2026-11-27), in one process:

* casts: an int8 model's bf16 attention took its QKV through ``qkv.to(bfloat16)`` and gave its context
  back through ``ctx.to(float32)``; now the QKV GEMM's dequantize pass writes bf16 and the output GEMM
  quantizes the bf16 context as it is (the same values, tested bit for bit);
* split: the dequantize pass with the GELU epilogue ran on one thread below 2^17 elements (batch 1's
  FFN up, 128 x 1536, 67 us); split_rows now weighs an element by its cost (GELU 4x).

"before" runs the old code paths (the old attention block, and the GELU dequantize called with one
thread where the old rule kept it on one), "after" today's, interleaved (bert_fast.bench.timing.measure).

    python benchmarks/cpu_int8_b1_passes_ab.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import functools
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _env_ab import compare_variants  # noqa: E402  (benchmarks/, the script's folder)

from bert_fast.bench import model_providers, model_workload, timing  # noqa: E402
from bert_fast.model import direct_ops, int8, layer  # noqa: E402
from bert_fast.ops import int8_gemm  # noqa: E402

_NEW_BLOCK = layer.attention_block
_NEW_DEQUANTIZE = int8_gemm.dequantize
_OLD_MIN_ELEMENTS = 1 << 17  # the old split rule: elements per thread, whatever the pass


def _old_attention_block(sa, gemms, h, batch, heads, training):
    """attention_block as it was: the int8 model's QKV in fp32, cast to bf16, the context cast back."""
    if not (batch.int8 and batch.ops is direct_ops and int8.is_int8_layer(gemms)):
        return _NEW_BLOCK(sa, gemms, h, batch, heads, training)
    qkv = gemms.qkv(h)
    if not int8.attention_in_bf16(qkv):
        return _NEW_BLOCK(sa, gemms, h, batch, heads, training)
    ctx = layer.attention_block_ops(batch.ops, qkv.to(torch.bfloat16), batch, heads, h.shape[-1], 0.0)
    return ctx.to(h.dtype).reshape(h.shape)


def _old_dequantize(acc, sx, sw, bias, dtype, gelu=None):
    """dequantize under the old split rule: one thread below 2 x 2^17 elements, GELU or not (the pass
    called with threads=1 there; the plain pass's rule is unchanged)."""
    m, n = acc.shape
    if gelu is None or m * n >= 2 * _OLD_MIN_ELEMENTS:
        return _NEW_DEQUANTIZE(acc, sx, sw, bias, dtype, gelu)
    return _NEW_DEQUANTIZE(acc, sx, sw, bias, dtype, gelu, threads=1)


def use(old: bool) -> None:
    layer.attention_block = _old_attention_block if old else _NEW_BLOCK
    int8_gemm.dequantize = _old_dequantize if old else _NEW_DEQUANTIZE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    timing.fix_threads(args.threads)
    from bert_fast.bench import cpu_caps

    print(cpu_caps.describe(cpu_caps.capabilities()), f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    for name, batch in (("minilm", 1), ("minilm", 8), ("bert-base", 1)):
        key = model_workload.local_minilm() if name == "minilm" else "bert-base"
        config = model_workload.load_config(key)
        state = model_providers.reference_state_dict(config, key)
        inputs = model_workload.make_inputs(config, [128] * batch, 128, "cpu", n_sets=1)[0]
        model, runner, _ = model_providers.build_provider_model(
            model_providers.INT8, config, state, "cpu", torch.float32, "infer", False, key
        )
        model.eval()

        def call():
            with torch.no_grad():
                return runner(**inputs)

        line = compare_variants(
            {"before": functools.partial(use, True), "after": functools.partial(use, False)},
            call,
            args.rounds,
            restore=functools.partial(use, False),
            warmup=2,
        )
        print(f"{name} {batch}x128 int8: {line}")


if __name__ == "__main__":
    main()
