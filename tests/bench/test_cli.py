"""The bert-fast CLI: parsing, info, bench / bench-ops JSON schema and plots, clear errors.

Runs on the CPU in CI (tiny configs, few iterations); main(argv) is called in-process to keep it fast.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bert_fast import cli
from bert_fast.bench import model_bench, model_workload, op_backends, ops_bench, results
from bert_fast.bench.op_case import OpCase
from bert_fast.model import facts
from bert_fast.testing import tiny_bert_config

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The JSON schema is declared once, in bert_fast/bench/results.py (its key constants and
# new_record): a file written here must hold every key it declares. READ_BY_DOCS pins the keys that
# readers outside the package take (benchmarks/report/make_docs_results.py, make_readme_performance.py,
# make_readme_cpu_performance.py): the declaration must keep them.
CEILING_KEYS = {"copy_bandwidth_gbs", "matmul_tflops", "matmul_dtype", "matmul_shape"}
READ_BY_DOCS = {
    "run": {"model", "mode", "batch", "seq", "lengths", "dtype", "cuda_graphs", "results"},
    "model result": {"provider", "status", "error", "median_ms", "unstable", "speedup_of_bert_fast", "speedup_ci"}
    | {"speedup_unstable", "tokens_per_s", "tflops", "mfu", "peak_mem_mb"},
    "ops case": {"op", "label", "direction", "bound", "results"},
    "ops result": {"provider", "status", "error", "median_ms", "gbs", "tflops", "pct_of_ceiling"},
}

FAST = ["--device", "cpu", "--warmup", "1", "--iters", "2", "--inputs", "2", "--no-progress"]
QUICK = "--device cpu --warmup 0 --inputs 1 --no-progress".split()


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A local checkpoint directory holding only config.json (hidden 32, 1 layer, head dim 16)."""
    d = tmp_path_factory.mktemp("tiny_bert")
    tiny_bert_config(hidden=32, heads=2, layers=1, vocab=128, max_pos=64, dropout=0.1).save_pretrained(d)
    return d


# ----------------------------------------------------------------------------- parsing
def test_parser_subcommands_and_defaults():
    p = cli.build_parser()
    args = p.parse_args(["bench", "--batch", "2,4", "--seq", "16", "--providers", "hf-eager,bert_fast"])
    assert args.command == "bench" and args.batch == [2, 4] and args.seq == [16]
    assert args.providers == ["hf-eager", "bert_fast"] and args.mode == "infer" and args.lengths is None
    args = p.parse_args(["bench-ops", "--ops", "linear", "--dtype", "fp16"])
    assert args.command == "bench-ops" and args.ops == "linear" and args.dtype == "fp16"
    assert p.parse_args(["info"]).command == "info"
    help_text = p.format_help()
    for name in ("info", "bench", "bench-ops", "train"):
        assert name in help_text


def test_cpu_defaults_measure_real_models_not_a_toy():
    """(tests/bench/test_bench_cpu.py checks the whole CPU suite.)"""
    args = cli.build_parser().parse_args(["bench", "--device", "cpu"])
    device, notes = model_bench.apply_defaults(args)
    assert device.type == "cpu" and "tiny" not in args.model and args.dtype == "fp32"
    assert "bert_fast" in args.providers and "hf-sdpa" in args.providers
    assert any("This measures the CPU path" in n for n in notes)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["bench", "--providers", "hf-eager,nope"],
            "valid providers: bert_fast, hf-eager, hf-sdpa, hf-compile, onnxruntime",
        ),
        (["bench", "--batch", "0"], "--batch"),
        (["bench", "--mode", "serve"], "invalid choice"),
        (["bench", "--dtype", "int8"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_nonzero(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code != 0
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("command", ["info", "bench", "bench-ops", "train", None])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_subcommand_help_works(command, flag, capsys):
    """--help of every subcommand prints its usage and exits 0 (bench-ops --help used to crash on
    an unescaped % in the --plot help: "TypeError: %o format: an integer is required, not dict")."""
    argv = [flag] if command is None else [command, flag]
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc in (0, None)
    out = capsys.readouterr().out
    assert "usage:" in out and "--help" in out, out[:500]
    if command in ("bench", "bench-ops"):
        assert "--max-rounds" in out and "--threads" in out


def test_bench_ops_default_providers_exit_0_on_the_cpu(tmp_path, monkeypatch, capsys):
    """`bert-fast bench-ops` with its default providers, on the CPU, at the smallest case sizes:
    providers that cannot run here (torch-sdpa-efficient: "No viable backend for
    scaled_dot_product_attention"; the GPU-only linear backends) are skipped with a one-line reason
    and the command exits 0 (it exited 1)."""
    from bert_fast.bench.op_cases import (
        attention,
        bias_gelu,
        embedding,
        linear,
        linear_residual_layer_norm,
        residual_layer_norm,
    )

    for mod, values in (
        (attention, dict(TOKENS=64, SEQLENS=(32,), PADDED_SEQLEN=32, HEADS=2, HEAD_DIM=16)),
        (linear, dict(HIDDEN=(32,), TOKENS=(16,))),
        (bias_gelu, dict(HIDDEN=(32,), TOKENS=(16,))),
        (residual_layer_norm, dict(HIDDEN=(32,), TOKENS=(16,))),
        (linear_residual_layer_norm, dict(HIDDEN=(32,), TOKENS=(16,))),
        (embedding, dict(TOKENS=64, SEQ=32, HIDDEN=(32,), VOCAB=100)),
    ):
        for name, value in values.items():
            monkeypatch.setattr(mod, name, value)
    out_json = tmp_path / "ops.json"
    rc = cli.main(["bench-ops", *QUICK, "--max-rounds", "6", "--json", str(out_json)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    doc = json.loads(out_json.read_text())
    status = {(c["op"], r["provider"]): (r["status"], r["error"]) for c in doc["cases"] for r in c["results"]}
    assert set(op for op, _ in status) == {
        "embedding",
        "linear",
        "bias_gelu",
        "residual_layer_norm",
        "linear_residual_layer_norm",
        "attention",
    }
    st, why = status[("attention", "torch-sdpa-efficient")]
    assert st == "skipped" and "No viable backend" in why and "\n" not in why
    assert status[("linear", "bert_fast-cublas")] == ("skipped", "cuBLAS needs a CUDA GPU")
    assert all(st in ("ok", "skipped") for st, _ in status.values()), status
    assert all(s == "ok" for (op, p), (s, _) in status.items() if p in ("bert_fast", "torch"))
    assert "SKIPPED" in captured.out and "torch-sdpa-efficient: No viable backend" in captured.err


def test_no_command_is_an_error(capsys):
    assert cli.main([]) == 2
    assert "a command is required" in capsys.readouterr().err


def test_missing_checkpoint_directory(tmp_path, capsys):
    missing = tmp_path / "no_such_checkpoint"
    assert cli.main(["bench", "--model", str(missing), *FAST]) == 2
    err = capsys.readouterr().err
    assert "checkpoint directory not found" in err and str(missing) in err
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    assert cli.main(["bench", "--model", str(empty), *FAST]) == 2
    assert f"no config.json in checkpoint directory {empty}" in capsys.readouterr().err


def test_unknown_model_name(capsys):
    assert cli.main(["bench", "--model", "bert-gigantic", *FAST]) == 2
    assert "unknown model 'bert-gigantic'" in capsys.readouterr().err


def test_cuda_graphs_need_infer(capsys):
    assert cli.main(["bench", "--mode", "train", "--cuda-graphs", *FAST]) == 2
    assert "--cuda-graphs applies to --mode infer only" in capsys.readouterr().err


def test_train_hook_without_module(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load_train_module", lambda: None)
    assert cli.main(["train", "--help"]) == 2
    assert "train subcommand is not available" in capsys.readouterr().err


def test_train_hook_forwards_argv(monkeypatch):
    seen = {}
    fake = types.SimpleNamespace(main=lambda argv: seen.setdefault("argv", argv) and 0)
    monkeypatch.setattr(cli, "_load_train_module", lambda: fake)
    assert cli.main(["train", "--epochs", "1", "--help"]) == 0
    assert seen["argv"] == ["--epochs", "1", "--help"]


# ----------------------------------------------------------------------------- lengths and FLOPs
def test_lengths(tmp_path):
    assert model_workload.parse_lengths("full", 3, 16) == [16, 16, 16]
    r = model_workload.parse_lengths("random:0.25", 64, 100)
    assert r == model_workload.parse_lengths("random:0.25", 64, 100)  # fixed seed
    assert min(r) >= 25 and max(r) <= 100 and len(set(r)) > 1
    f = tmp_path / "lens.txt"
    f.write_text("3, 5\n7")
    assert model_workload.parse_lengths(str(f), 5, 8) == [3, 5, 7, 3, 5]
    for bad in ("random:0", "random:1.5", "random:x", str(tmp_path / "nope.txt")):
        with pytest.raises(model_workload.BenchError):
            model_workload.parse_lengths(bad, 2, 8)
    f.write_text("9")
    with pytest.raises(model_workload.BenchError, match=r"\[1, 8\]"):
        model_workload.parse_lengths(str(f), 2, 8)


def test_inputs_never_zero_at_real_tokens():
    cfg = model_workload.load_config("tiny")
    (inp,) = model_workload.make_inputs(cfg, [5, 8], 8, "cpu", n_sets=1)
    mask = inp["attention_mask"].bool()
    assert (inp["input_ids"][mask] > 0).all() and (inp["input_ids"][~mask] == 0).all()
    assert mask.sum(1).tolist() == [5, 8]


def test_flops_formula_bert_base():
    cfg = model_workload.load_config("bert-base")
    per_token = facts.step_flops(cfg, [128] * 4, "infer") / (4 * 128)
    assert per_token == pytest.approx(174.6e6, rel=1e-3)
    assert per_token == facts.flops_per_token(768, 12, 3072, 128)
    assert facts.step_flops(cfg, [128], "train") == pytest.approx(3 * 128 * per_token)


def test_kernel_shapes_of_the_presets():
    assert facts.kernel_shape("bert-base") == dict(hidden=768, heads=12, head_dim=64, ffn=3072, vocab=30522)
    assert facts.kernel_shape("minilm")["head_dim"] == 32 and facts.kernel_shape("bert-large")["heads"] == 16


# ----------------------------------------------------------------------------- imports flow one way
PACKAGE = ROOT / "bert_fast"
PRIVATE_ALLOWED: set = set()  # (file, module, name) of underscore imports still allowed: none


def _imports(path):
    """(module, name) of every `from M import N` and (M, None) of every `import M` in ``path``."""
    import ast

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None


@pytest.mark.parametrize(
    "path",
    sorted(
        str(p.relative_to(ROOT))
        for p in [
            *(PACKAGE / "bench").rglob("*.py"),
            PACKAGE / "cli.py",
            PACKAGE / "doctor.py",
            PACKAGE / "model" / "facts.py",
        ]
    ),
)
def test_imports_flow_one_way(path):
    """cli -> bench, doctor -> model -> ops: the benches and doctor never import the CLI, the model
    facts import nothing of bert_fast, and no module takes another module's underscore names."""
    mods = list(_imports(ROOT / path))
    pulled = {m if n is None else f"{m}.{n}" for m, n in mods}
    if path != "bert_fast/cli.py":
        assert not any(p == "bert_fast.cli" or p.startswith("bert_fast.cli.") for p in pulled), path
    if path == "bert_fast/model/facts.py":
        assert not any(p.startswith("bert_fast") for p in pulled), pulled
    private = {(path, m, n) for m, n in mods if m.startswith("bert_fast") and n and n.startswith("_")}
    assert private <= PRIVATE_ALLOWED, private - PRIVATE_ALLOWED


def test_model_facts_import_neither_torch_nor_transformers():
    code = "import sys, bert_fast.model.facts; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------- info
def test_info_output(capsys, tmp_path):
    out_json = tmp_path / "info.json"
    assert cli.main(["info", "--device", "cpu", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for needle in (
        "build_info",
        "cuda_compiled",
        "torch",
        "triton",
        "transformers",
        "driver",
        "embedding",
        "linear",
        "bias_gelu",
        "residual_layer_norm",
        "attention",
        "need a CUDA GPU",
    ):
        assert needle in out, needle
    info = json.loads(out_json.read_text())
    assert set(info["kernels"]) == {"embedding", "linear", "bias_gelu", "residual_layer_norm", "attention"}
    assert set(info["kernels"]["linear"]) == {"fp32", "fp16", "bf16"}
    _has_keys(info["environment"], results.ENV_KEYS)


def test_op_backend_reference_forced(monkeypatch):
    monkeypatch.setenv("BERT_FAST_BACKEND", "reference")
    assert op_backends.op_backend("linear", "cpu", torch.float32).startswith("reference")


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_op_backend_embedding_cpu_says_what_runs(monkeypatch, interpret):
    """`bert-fast info` names the implementation the embedding op really takes on CPU tensors: the
    C++ twin whenever the extension loaded, with or without the Triton interpreter."""
    from bert_fast.ops import embedding

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    import bert_fast

    label = op_backends.op_backend("embedding", "cpu", torch.float32, bert_fast.build_info())
    runs = embedding._backend(torch.empty(0))
    # "torch": the CPU path built from torch's own ops (bert_fast.ops.torch_impl, issue 14)
    assert label.startswith({"cpu": "C++ CPU twin", "reference": "reference", "torch": "torch"}[runs]), (label, runs)


# ----------------------------------------------------------------------------- bench
def _has_keys(d, keys):
    """Assert that dict ``d`` holds every one of ``keys``, naming the missing ones."""
    missing = set(keys) - set(d)
    assert not missing, missing


def _check_model_doc(doc, providers):
    _has_keys(doc, results.TOP_KEYS)
    assert doc["schema"] == "bert_fast.bench/1" and doc["kind"] == "model" and doc["status"] == "complete"
    _has_keys(doc["environment"], results.ENV_KEYS)
    _has_keys(doc["ceilings"], CEILING_KEYS)
    assert doc["ceilings"]["copy_bandwidth_gbs"] > 0
    assert doc["ceilings"]["matmul_tflops"] > 0
    assert doc["arguments"]["providers"] == providers
    for run in doc["runs"]:
        _has_keys(run, results.MODEL_RUN_KEYS)
        assert [r["provider"] for r in run["results"]] == providers
        for r in run["results"]:
            _has_keys(r, results.new_record(r["provider"]))  # every declared figure, iters and method too
            assert r["status"] == "ok", r["error"]
            assert 0 < r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
            assert r["tokens_per_s"] > 0 and r["mfu"] > 0


def test_bench_hf_eager_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = "bench --model tiny --batch 2 --seq 16,32 --lengths random:0.5 --providers hf-eager,hf-sdpa".split()
    assert cli.main([*argv, *FAST, "--json", str(out_json), "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "hf-eager" in out and "median ms" in out and "This measures the CPU path" in out
    doc = json.loads(out_json.read_text())
    _check_model_doc(doc, ["hf-eager", "hf-sdpa"])
    assert [r["seq"] for r in doc["runs"]] == [16, 32]
    assert doc["runs"][0]["real_tokens"] < 2 * 16
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_bench_train_mode(tmp_path, tiny_ckpt):
    out_json = tmp_path / "train.json"
    argv = "--batch 2 --seq 8 --mode train --providers hf-sdpa".split()
    assert cli.main(["bench", "--model", str(tiny_ckpt), *argv, *FAST, "--json", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    _check_model_doc(doc, ["hf-sdpa"])
    run = doc["runs"][0]
    assert run["mode"] == "train" and run["config"]["hidden_size"] == 32


def test_bench_bert_fast_provider(tmp_path, tiny_ckpt):
    # No skip: bert_fast.BertModel must run here (a skip on any exception, as this test once had,
    # hid every failure of the model behind "not runnable yet").
    out_json = tmp_path / "bf.json"
    argv = "--batch 2 --seq 8 --lengths random:0.5 --providers bert_fast,hf-eager".split()
    assert cli.main(["bench", "--model", str(tiny_ckpt), *argv, *QUICK, "--iters", "1", "--json", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    _check_model_doc(doc, ["bert_fast", "hf-eager"])
    run = doc["runs"][0]
    assert run["parity"]["reference"] == "hf-eager" and run["parity"]["max_abs_diff"] < 1e-3
    assert run["results"][0]["speedup_of_bert_fast"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- bench-ops
def _tiny_cases(device, dtype):
    def copy_factory():
        x = torch.randn(64, 64, device=device, dtype=dtype)
        return lambda: x.clone()

    def mm_factory():
        a = torch.randn(32, 32, device=device, dtype=dtype)
        b = torch.randn(32, 32, device=device, dtype=dtype)
        return lambda: a @ b

    def broken_factory():
        raise RuntimeError("kernel exploded")

    n = 64 * 64 * torch.tensor([], dtype=dtype).element_size()
    return [
        OpCase(
            op="toy",
            label="N=4096",
            direction="fwd",
            bound="memory",
            bytes=2 * n,
            providers={"torch": copy_factory, "bert_fast": copy_factory},
            params={"N": 4096},
        ),
        OpCase(
            op="toy",
            label="M=N=K=32",
            direction="fwd",
            bound="compute",
            flops=2 * 32**3,
            bytes=3 * 32 * 32 * 4,
            providers={"torch": mm_factory, "bert_fast": broken_factory},
        ),
    ]


def test_bench_ops_tiny_cases(tmp_path, monkeypatch, capsys):
    fake = types.SimpleNamespace(cases=_tiny_cases)
    monkeypatch.setattr(ops_bench, "discover_modules", lambda ops=None: ({"toy": fake}, {}))
    out_json, out_png = tmp_path / "ops.json", tmp_path / "ops.png"
    argv = "bench-ops --device cpu --max-cases 5 --warmup 1 --iters 3 --no-progress".split()
    rc = cli.main([*argv, "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 1  # the broken provider is reported, not hidden
    captured = capsys.readouterr()
    assert "kernel exploded" in captured.err + captured.out and "This measures the CPU path" in captured.out
    doc = json.loads(out_json.read_text())
    _has_keys(doc, results.TOP_KEYS)
    assert doc["kind"] == "ops"
    assert len(doc["cases"]) == 2
    for case in doc["cases"]:
        _has_keys(case, results.OPS_CASE_KEYS)
        for r in case["results"]:
            _has_keys(r, results.new_record(r["provider"], "ops"))
    mem, comp = doc["cases"]
    assert all(r["status"] == "ok" and r["gbs"] > 0 and r["pct_of_ceiling"] > 0 for r in mem["results"])
    assert comp["results"][0]["tflops"] > 0 and comp["results"][0]["ceiling"] == "matmul_tflops"
    assert comp["results"][1]["status"] == "error" and "kernel exploded" in comp["results"][1]["error"]
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_attention_op_cases_providers_run(monkeypatch):
    """The attention bench cases at a toy size: every bert_fast provider builds and runs, forward and
    backward (dropout 0.1; the separate-dQ one sets BERT_FAST_ATTN_DQ for its call only)."""
    from bert_fast.bench.op_cases import attention as cases_mod

    for name, value in (("TOKENS", 64), ("SEQLENS", (32,)), ("PADDED_SEQLEN", 32), ("HEADS", 2), ("HEAD_DIM", 16)):
        monkeypatch.setattr(cases_mod, name, value)
    monkeypatch.delenv("BERT_FAST_ATTN_DQ", raising=False)
    cases = cases_mod.cases("cpu", torch.float32)
    assert [(c.direction, c.params["padded"]) for c in cases] == [
        ("fwd", False),
        ("bwd", False),
        ("fwd", True),
        ("bwd", True),
    ]
    assert "bert_fast-dq-separate" in cases[1].providers and "bert_fast-dq-separate" not in cases[0].providers
    seen = set()
    for case in cases:
        for provider, factory in case.providers.items():
            if not provider.startswith("bert_fast"):
                continue
            result = factory()()
            tensors = result if isinstance(result, tuple) else (result,)
            assert all(torch.isfinite(t).all() for t in tensors), (case.label, provider)
            assert "BERT_FAST_ATTN_DQ" not in os.environ
            seen.add(provider)
    assert seen == {"bert_fast", "bert_fast-padded", "bert_fast-dropout", "bert_fast-dq-separate"}


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="runs the Triton kernels: the interpreter or a GPU",
)
def test_linear_op_cases_providers_run(monkeypatch):
    """The linear bench cases at a toy size: every bert_fast provider runs forward and backward,
    and "bert_fast-triton-pointer" really keeps the TMA GEMM out (forced on with
    BERT_FAST_GEMM_TMA=1, which that provider overrides for its calls only)."""
    from bert_fast.bench.op_cases import linear as cases_mod
    from bert_fast.kernels import linear_tma

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    monkeypatch.setattr(cases_mod, "HIDDEN", (32,))
    monkeypatch.setattr(cases_mod, "TOKENS", (40,))
    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "1")
    tma_launches = []
    launch = linear_tma.launch
    monkeypatch.setattr(linear_tma, "launch", lambda *a: (tma_launches.append(a[6]), launch(*a))[1])
    tma_capable = device == "cpu" or torch.cuda.get_device_capability()[0] >= 9
    for case in cases_mod.cases(device, dtype):
        for provider, factory in case.providers.items():
            if not provider.startswith("bert_fast"):
                continue
            tma_launches.clear()
            result = factory()()
            tensors = result if isinstance(result, tuple) else (result,)
            assert all(torch.isfinite(t).all() for t in tensors), (case.name, provider)
            assert os.environ["BERT_FAST_GEMM_TMA"] == "1"
            if provider == "bert_fast-triton-pointer":
                assert tma_launches == [], case.name
            elif provider == "bert_fast-triton" and tma_capable:
                # forward: y; backward case: its forward (in the factory), then dX and dW
                assert len(tma_launches) == (1 if case.direction == "fwd" else 3), case.name


def test_bench_ops_no_modules(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ops_bench, "discover_modules", lambda ops=None: ({}, {}))
    out_json = tmp_path / "ops.json"
    assert cli.main(["bench-ops", "--device", "cpu", "--no-progress", "--json", str(out_json)]) == 0
    assert "no op case modules found" in capsys.readouterr().err
    assert json.loads(out_json.read_text())["cases"] == []


def test_bench_ops_unknown_op(capsys):
    assert cli.main(["bench-ops", "--device", "cpu", "--ops", "convolution"]) == 2
    assert "unknown op(s) convolution" in capsys.readouterr().err


# ----------------------------------------------------------------------------- results, README, script
def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "report" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_keys_the_docs_read_are_declared():
    assert READ_BY_DOCS["run"] <= set(results.MODEL_RUN_KEYS)
    assert READ_BY_DOCS["model result"] <= set(results.new_record("p", "model"))
    assert READ_BY_DOCS["ops case"] <= set(results.OPS_CASE_KEYS)
    assert READ_BY_DOCS["ops result"] <= set(results.new_record("p", "ops"))
    # the declared result keys are among those of the record every provider starts from
    assert set(results.MODEL_RESULT_KEYS) <= set(results.new_record("p", "model"))
    assert set(results.OPS_RESULT_KEYS) <= set(results.new_record("p", "ops"))


def test_merge_and_readme(tmp_path):
    run_dir = tmp_path / "results" / "run"
    run_dir.mkdir(parents=True)
    argv = "bench --model tiny --batch 1 --seq 8 --providers hf-eager".split()
    assert cli.main([*argv, *FAST, "--json", str(run_dir / "model-a.json")]) == 0
    (run_dir / "pytest.log").write_text("....s\n=== 4 passed, 1 skipped, 2 failed in 3.2s ===\n")
    (run_dir / "stages.tsv").write_text("tests\t1\t3.5\tfailed\nbench\t0\t9.0\tok\n")
    out = tmp_path / "results" / "20250101-000000-h100-abc.json"
    doc = results.merge(
        out,
        run_dir=run_dir,
        stages_file=run_dir / "stages.tsv",
        model_jsons=[run_dir / "model-a.json"],
        pytest_log=run_dir / "pytest.log",
        plot=run_dir / "summary.png",
    )
    assert doc["schema"] == "bert_fast.gpu_check/1"
    assert (doc["tests"]["passed"], doc["tests"]["failed"], doc["tests"]["skipped"]) == (4, 2, 1)
    assert [s["status"] for s in doc["stages"]] == ["failed", "ok"]
    assert len(doc["model"]["runs"]) == 1 and doc["plots"]

    mk = _load_script("make_readme_performance")
    readme = tmp_path / "README.md"
    readme.write_text("# proj\n")
    empty = tmp_path / "none"
    empty.mkdir()
    assert mk.main(["--results-dir", str(empty), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert mk.START in text and mk.END in text and "No GPU results exist yet" in text
    assert mk.main(["--results-dir", str(out.parent), "--readme", str(readme)]) == 0
    assert "No GPU results exist yet" in readme.read_text()  # a CPU run is not a GPU result
    assert mk.main(["--results-dir", str(out.parent), "--readme", str(readme), "--allow-cpu"]) == 0
    text = readme.read_text()
    assert "No GPU results" not in text and "hf-eager" in text and "4 passed, 2 failed" in text
    assert text.count(mk.START) == 1 and "summary.png" in text
    assert mk.main(["--results-dir", str(out.parent), "--readme", str(readme), "--check", "--allow-cpu"]) == 0
    assert mk.main(["--results-dir", str(empty), "--readme", str(readme), "--check"]) == 1


def test_pytest_counts_parse():
    from bert_fast.bench.results import parse_pytest_counts

    c = parse_pytest_counts("x\n==== 120 passed, 3 skipped, 1 xfailed, 2 errors in 61.2s (0:01:01) ====\n")
    assert (c["passed"], c["skipped"], c["xfailed"], c["errors"], c["failed"]) == (120, 3, 1, 2, 0)
    assert parse_pytest_counts("no summary")["summary_found"] is False


def test_gpu_check_script_syntax():
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")]).returncode == 0


def test_python_m_bert_fast(monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["bert_fast", "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("bert_fast", run_name="__main__")
    assert exc.value.code == 0 and "bench-ops" in capsys.readouterr().out


def test_pytest_counts_parse_xdist_output():
    """The tests stage runs under pytest-xdist (-n 4) on the GPU machine: worker lines, a crashed
    worker and -rs reasons must not hide the final summary."""
    from bert_fast.bench.results import parse_pytest_counts

    log = (
        "created: 4/4 workers\n4 workers [812 items]\n\n...s..F. [  8%]\n"
        "[gw2] node down: Not properly terminated\nreplacing crashed worker gw2\n"
        "SKIPPED [2] tests/ops/test_attention.py:554: needs 2 passed GPUs\n"
        "1 failed, 800 passed, 11 skipped, 2 warnings in 312.54s (0:05:12)\n"
    )
    c = parse_pytest_counts(log)
    assert (c["passed"], c["failed"], c["skipped"]) == (800, 1, 11)


def test_gpu_check_detached_mode(tmp_path):
    """--detach starts the check in its own session and returns; --wait blocks until it ends and
    copies few files (json, tarball, README) into $OUT. Run on a copy of the repo with a budget
    too small for any stage, so every stage is recorded as skipped and only the merge runs."""
    import os
    import shutil

    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("bert_fast", "benchmarks"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("results", "__pycache__", "*.so"))
    shutil.copy(ROOT / "README.md", repo / "README.md")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(
        os.environ,
        OUT=str(out),
        BERT_FAST_CHECK_LOG=str(tmp_path / "check.log"),
        BERT_FAST_CHECK_SKIP_INSTALL="1",
        BERT_FAST_CHECK_BUDGET_S="40",
        PYTHONPATH=str(ROOT),
    )
    script = str(repo / "benchmarks" / "gpu_check.sh")
    r = subprocess.run(["bash", script, "--detach"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "started detached" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["bash", script, "--wait", "240"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "GPU check finished" in r.stdout, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 3 and "README.md" in files
    assert any(f.endswith(".tar.gz") for f in files) and any(f.endswith(".json") for f in files)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_timing_cuda_events_and_peak_memory_without_flush_buffer():
    """CUDA path of time_callables: event timings, and peak memory that does not count the
    256 MB L2-flush buffer (allocated once and kept between calls)."""
    from bert_fast.bench.timing import peak_memory, reset_peak_memory, time_callables

    dev = torch.device("cuda")
    x = torch.ones(1024, device=dev)
    # What this process already holds (other tests of an xdist worker keep CUDA tensors alive:
    # 65 MiB on the H200 run) is the baseline; the peak counts from it, in the same accounting.
    reset_peak_memory(dev)
    before = peak_memory(dev)
    t = time_callables([lambda: x.mul_(1.0)], dev, warmup=1, iters=6, flush_l2=True, reset_memory=True)
    assert t.method == "cuda_event" and t.iters == 6 and t.median_ms > 0 and t.l2_flush
    assert t.peak_mem_bytes - before < 64 << 20, (t.peak_mem_bytes, before)
