"""Who ``bert-fast bench`` measures: the providers (bert_fast, transformers eager / SDPA /
torch.compile, ONNX Runtime), built from one state dict (seeded random weights, or the
checkpoint's own when ``--model`` names a folder that holds weights), and the step each one is
timed on."""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List

from bert_fast.bench.model_workload import BenchError
from bert_fast.model import compat

_STATE_CACHE: Dict[str, Dict[str, Any]] = {}


_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def checkpoint_has_weights(key: str) -> bool:
    path = Path(key).expanduser()
    return path.is_dir() and any((path / f).is_file() for f in _WEIGHT_FILES)


def reference_state_dict(config, key: str, seed: int = 0):
    """One set of weights per model (fp32, CPU) shared by every provider: the checkpoint's own when
    ``key`` is a folder holding weights (loaded offline), else random from the config (seeded)."""
    import torch
    from transformers import BertModel as HFBertModel

    if key not in _STATE_CACHE and checkpoint_has_weights(key):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never reach a hub
        model = HFBertModel.from_pretrained(
            str(Path(key).expanduser()), local_files_only=True, attn_implementation="eager"
        )
        _STATE_CACHE[key] = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        del model
    if key not in _STATE_CACHE:
        torch.manual_seed(seed)
        model = compat.hf_bert_model(config, "eager")
        _STATE_CACHE[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model
    return _STATE_CACHE[key]


def _hf_model(config, attn: str, device, dtype):
    return compat.hf_bert_model(config, attn, device=device).to(dtype)


def bert_fast_model_class():
    """bert_fast.BertModel, imported lazily (None while it does not exist)."""
    import bert_fast

    cls = getattr(bert_fast, "BertModel", None)
    if cls is None:
        from bert_fast.model.modeling import BertModel as cls  # noqa: N813
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
        del model
        with tempfile.TemporaryDirectory(prefix="bert_fast_bench_") as tmp:
            hf = compat.hf_bert_model(config, "eager")
            hf.load_state_dict(state, strict=True)
            hf.save_pretrained(tmp)
            del hf
            try:
                model = cls.from_pretrained(tmp, dtype=dtype)
            except TypeError:
                model = cls.from_pretrained(tmp, torch_dtype=dtype)
        model = model.to(device=device, dtype=dtype)
        print(
            f"  note: bert_fast.BertModel.load_state_dict(HF state dict, strict=True) failed ({exc}); "
            f"loaded through save_pretrained/from_pretrained instead",
            file=sys.stderr,
        )
    return model


# ----------------------------------------------------------------------------- ONNX Runtime
_ORT_CACHE: Dict[Any, Any] = {}  # (model key, config) -> (TemporaryDirectory, optimized path, fused ops)


class _OrtOutput:
    def __init__(self, last_hidden_state, pooler_output):
        self.last_hidden_state = last_hidden_state
        self.pooler_output = pooler_output


def _positional(model):
    """``model`` behind a forward that takes the three inputs by position and returns plain
    tensors: the ONNX exporter traces positional inputs, transformers' forward takes keywords."""
    import torch

    class Positional(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state, out.pooler_output

    return Positional(model)


def export_onnxruntime(config, state, key) -> tuple:
    """Export transformers' BertModel (eager attention, the graph ONNX Runtime's fusions know) to
    ONNX with dynamic batch and sequence axes, then fuse it with onnxruntime's transformer
    optimizer (EmbedLayerNormalization, Attention, SkipLayerNormalization, BiasGelu), as its users
    do. Once per model and process, into a temporary directory removed at exit.
    Returns (path of the optimized model, {fused op: count})."""
    import torch

    ckey = (key, config.to_json_string())
    if ckey in _ORT_CACHE:
        return _ORT_CACHE[ckey][1:]
    from onnxruntime.transformers.optimizer import optimize_model

    tmp = tempfile.TemporaryDirectory(prefix="bert_fast_ort_")
    hf = compat.hf_bert_model(config, "eager").eval()
    hf.load_state_dict(state, strict=True)
    raw, fused_path = os.path.join(tmp.name, "model.onnx"), os.path.join(tmp.name, "model.opt.onnx")
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {n: {0: "batch", 1: "seq"} for n in names + ["last_hidden_state"]}
    axes["pooler_output"] = {0: "batch"}
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about Python branches on shapes
        # dynamo=False: the TorchScript exporter, whose graph the transformer optimizer's fusion
        # patterns were written for (checked: 6/6 Attention fused on all-MiniLM-L6-v2).
        torch.onnx.export(
            _positional(hf),
            (ids, mask, torch.zeros_like(ids)),
            raw,
            input_names=names,
            output_names=["last_hidden_state", "pooler_output"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    opt = optimize_model(raw, model_type="bert", num_heads=config.num_attention_heads, hidden_size=config.hidden_size)
    opt.save_model_to_file(fused_path)
    fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
    del hf, opt
    _ORT_CACHE[ckey] = (tmp, fused_path, fused)
    return fused_path, fused


def onnxruntime_runner(config, state, key, device, dtype, mode):
    """(runner, notes): an InferenceSession of the optimized model, intra_op_num_threads = torch's
    thread count (what the other providers get), called like the model with torch tensors."""
    import torch

    from bert_fast.bench.timing import ProviderUnavailable

    try:
        import onnxruntime as ort
        from onnxruntime.transformers import optimizer  # noqa: F401
    except ImportError as exc:
        raise ProviderUnavailable(f'onnxruntime is not installed (pip install -e ".[ort]"): {exc}') from None
    if torch.device(device).type != "cpu":
        raise ProviderUnavailable("the onnxruntime provider runs on the CPU only (no CUDA execution provider set up)")
    if mode != "infer":
        raise ProviderUnavailable("the onnxruntime provider measures inference only")
    if dtype != torch.float32:
        raise ProviderUnavailable("the onnxruntime provider runs fp32 only on the CPU")
    path, fused = export_onnxruntime(config, state, key)
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ORT's intra-op threads spin-wait after each run by default; side by side in one process they
    # would then take the cores from the provider timed next (measured: a tiny transformers
    # forward went from ~1 ms to ~130 ms right after an ORT call). Without spinning, every
    # provider's call starts on idle cores, as a server running only ORT would see them.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

    def run(input_ids, attention_mask, token_type_ids=None, **_):
        feeds = {
            "input_ids": input_ids.numpy(),
            "attention_mask": attention_mask.numpy(),
            "token_type_ids": (token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)).numpy(),
        }
        hidden, pooled = sess.run(None, feeds)
        return _OrtOutput(torch.from_numpy(hidden), torch.from_numpy(pooled))

    ops = ", ".join(f"{k} x{v}" for k, v in fused.items())
    notes = [
        f"onnxruntime {ort.__version__}, transformer optimizer fused: {ops or 'nothing'}; "
        f"intra_op_num_threads={so.intra_op_num_threads}, no spin-wait between calls"
    ]
    return run, notes


def build_provider_model(provider: str, config, state, device, dtype, mode: str, cuda_graphs: bool, key: str = "model"):
    """(model, callable-like-the-model, notes) for one provider."""
    import torch

    notes: List[str] = []
    if provider == "onnxruntime":
        runner, notes = onnxruntime_runner(config, state, key, device, dtype, mode)
        return None, runner, notes
    if provider == "hf-eager":
        model = _hf_model(config, "eager", device, dtype)
    elif provider in ("hf-sdpa", "hf-compile"):
        model = _hf_model(config, "sdpa", device, dtype)
    elif provider == "bert_fast":
        model = _bert_fast_model(config, state, device, dtype)
    elif provider == "bert_fast-frozen":
        from bert_fast.bench.timing import ProviderUnavailable
        from bert_fast.model import frozen

        if mode != "infer" or torch.device(device).type != "cpu":
            raise ProviderUnavailable("bert_fast-frozen (BertModel.freeze()) is CPU inference only")
        if not (frozen.available() and frozen.dtype_supported(dtype)):
            raise ProviderUnavailable(f"this torch/CPU cannot pack {dtype} weights for oneDNN")
        model = _bert_fast_model(config, state, device, dtype)
        notes.append(f"BertModel.freeze(): packed copies {model.freeze() / 2**20:,.0f} MiB")
    else:  # validated earlier
        raise BenchError(f"unknown provider {provider!r}")
    if not provider.startswith("bert_fast"):
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    model.train(mode == "train")
    runner: Callable = model
    if provider == "hf-compile":
        if cuda_graphs and torch.device(device).type == "cuda":
            runner = torch.compile(model, mode="reduce-overhead")
            notes.append("torch.compile(mode='reduce-overhead'): torch's own CUDA graphs")
        else:
            runner = torch.compile(model)
    elif provider.startswith("bert_fast") and cuda_graphs:
        if torch.device(device).type != "cuda":
            notes.append("--cuda-graphs ignored: CUDA graphs need a CUDA GPU")
        else:
            from bert_fast.model.cuda_graphs import CudaGraphRunner

            runner = CudaGraphRunner(model)
            notes.append("bert_fast.model.cuda_graphs.CudaGraphRunner")
    elif cuda_graphs:
        notes.append(
            "--cuda-graphs applies to bert_fast (CudaGraphRunner) and hf-compile "
            "(mode='reduce-overhead'); this provider runs eagerly"
        )
    return model, runner, notes


def hidden_state(out):
    """The last hidden state of a provider's output (a model output, a tuple or a tensor)."""
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
        h = hidden_state(out).float()
        loss = (h.square().mean(-1) * mask).sum() / n_real
        pooled = _pooled(out)
        if pooled is not None:
            loss = loss + pooled.float().square().mean()
        loss.backward()
        optimizer.step()
        return None

    return train


def make_optimizer(model, device):
    """AdamW over the trainable parameters (fused on CUDA where torch has it), for ``--mode train``."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if torch.device(device).type == "cuda":
        try:
            return torch.optim.AdamW(params, lr=1e-5, fused=True)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(params, lr=1e-5)
