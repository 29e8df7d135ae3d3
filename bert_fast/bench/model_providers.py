"""Who ``bert-fast bench`` measures: the providers (bert_fast, transformers eager / SDPA /
torch.compile), built from one seeded state dict, and the step each one is timed on."""
from __future__ import annotations

import copy
import sys
import tempfile
from typing import Any, Callable, Dict, List

from bert_fast.bench.model_workload import BenchError


_STATE_CACHE: Dict[str, Dict[str, Any]] = {}


def reference_state_dict(config, key: str, seed: int = 0):
    """One set of random weights per model (fp32, CPU, seeded) shared by every provider."""
    import torch
    from transformers import BertModel as HFBertModel

    if key not in _STATE_CACHE:
        torch.manual_seed(seed)
        cfg = copy.deepcopy(config)
        cfg._attn_implementation = "eager"
        model = HFBertModel(cfg)
        _STATE_CACHE[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model
    return _STATE_CACHE[key]


def _hf_model(config, attn: str, device, dtype):
    import torch
    from transformers import BertModel as HFBertModel

    cfg = copy.deepcopy(config)
    try:
        cfg._attn_implementation = attn
    except Exception:  # noqa: BLE001 - older transformers: fall through to _from_config
        pass
    with torch.device(device):
        try:
            model = HFBertModel._from_config(cfg, attn_implementation=attn)
        except TypeError:
            model = HFBertModel(cfg)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != attn:
        raise RuntimeError(f"transformers built attention {impl!r} instead of {attn!r}")
    return model.to(dtype)


def bert_fast_model_class():
    """bert_fast.BertModel, imported lazily (None while it does not exist)."""
    import bert_fast

    cls = getattr(bert_fast, "BertModel", None)
    if cls is None:
        from bert_fast.modeling import BertModel as cls  # noqa: N813
    return cls


def _bert_fast_model(config, state, device, dtype):
    """bert_fast.BertModel exactly as a transformers user would build it: from the config, then
    the Hugging Face state dict (strict). Falls back to save_pretrained + from_pretrained if the
    model only fuses QKV in from_pretrained."""
    import torch

    cls = bert_fast_model_class()
    with torch.device(device):
        model = cls(copy.deepcopy(config))
    model = model.to(dtype)
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, KeyError) as exc:
        from transformers import BertModel as HFBertModel

        del model
        with tempfile.TemporaryDirectory(prefix="bert_fast_bench_") as tmp:
            cfg = copy.deepcopy(config)
            cfg._attn_implementation = "eager"
            hf = HFBertModel(cfg)
            hf.load_state_dict(state, strict=True)
            hf.save_pretrained(tmp)
            del hf
            try:
                model = cls.from_pretrained(tmp, dtype=dtype)
            except TypeError:
                model = cls.from_pretrained(tmp, torch_dtype=dtype)
        model = model.to(device=device, dtype=dtype)
        print(f"  note: bert_fast.BertModel.load_state_dict(HF state dict, strict=True) failed ({exc}); "
              f"loaded through save_pretrained/from_pretrained instead", file=sys.stderr)
    return model


def build_provider_model(provider: str, config, state, device, dtype, mode: str, cuda_graphs: bool):
    """(model, callable-like-the-model, notes) for one provider."""
    import torch

    notes: List[str] = []
    if provider == "hf-eager":
        model = _hf_model(config, "eager", device, dtype)
    elif provider in ("hf-sdpa", "hf-compile"):
        model = _hf_model(config, "sdpa", device, dtype)
    elif provider == "bert_fast":
        model = _bert_fast_model(config, state, device, dtype)
    else:  # validated earlier
        raise BenchError(f"unknown provider {provider!r}")
    if provider != "bert_fast":
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    model.train(mode == "train")
    runner: Callable = model
    if provider == "hf-compile":
        if cuda_graphs and torch.device(device).type == "cuda":
            runner = torch.compile(model, mode="reduce-overhead")
            notes.append("torch.compile(mode='reduce-overhead'): torch's own CUDA graphs")
        else:
            runner = torch.compile(model)
    elif provider == "bert_fast" and cuda_graphs:
        if torch.device(device).type != "cuda":
            notes.append("--cuda-graphs ignored: CUDA graphs need a CUDA GPU")
        else:
            from bert_fast.cuda_graphs import CudaGraphRunner

            runner = CudaGraphRunner(model)
            notes.append("bert_fast.cuda_graphs.CudaGraphRunner")
    elif cuda_graphs:
        notes.append("--cuda-graphs applies to bert_fast (CudaGraphRunner) and hf-compile "
                     "(mode='reduce-overhead'); this provider runs eagerly")
    return model, runner, notes


def _hidden(out):
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _pooled(out):
    if hasattr(out, "pooler_output"):
        return out.pooler_output
    if isinstance(out, (tuple, list)) and len(out) > 1:
        return out[1]
    return None


def make_step(runner, model, inputs: Dict[str, Any], mode: str, optimizer=None) -> Callable[[], Any]:
    """The timed call for one input set: a forward (no grad) or a full training step."""
    import torch

    if mode == "infer":
        def infer():
            with torch.no_grad():
                return runner(**inputs)
        return infer

    mask = inputs["attention_mask"]
    n_real = mask.sum().clamp_min(1)

    def train():
        optimizer.zero_grad(set_to_none=True)
        out = runner(**inputs)
        h = _hidden(out).float()
        loss = (h.square().mean(-1) * mask).sum() / n_real
        pooled = _pooled(out)
        if pooled is not None:
            loss = loss + pooled.float().square().mean()
        loss.backward()
        optimizer.step()
        return None
    return train


def _make_optimizer(model, device):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if torch.device(device).type == "cuda":
        try:
            return torch.optim.AdamW(params, lr=1e-5, fused=True)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(params, lr=1e-5)


# ----------------------------------------------------------------------------- running
