"""Run quality of ``bert-fast train``: complete checkpoints (tokenizer, architectures, id2label,
training args), --init-from a pretraining checkpoint without --tokenizer, CSV/TSV classification
data, evaluation metrics and per-step learning rates in metrics.jsonl (and TensorBoard), no
duplicate rows after a resume, output-directory safety, atomic checkpoints (an interrupted or
disk-full save leaves the previous checkpoint valid), and clear errors for a resume with another
model shape or a tokenizer that is not the checkpoint's vocabulary.

Tiny models (H=64, 2 layers), a few steps, the pure-torch reference ops (the point is the run's
bookkeeping, not the kernels), all on the CPU.
"""

from __future__ import annotations

import csv
import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from bert_fast.testing import tiny_train_args
from bert_fast.training import checkpoint as ckpt
from bert_fast.training import cli, data, evaluate, loop, table_data

BASE = tiny_train_args(peak_tflops=1, device="cpu")
LINES = [t for t in data.read_lines(data.DEMO_CORPUS) if t]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is fastest (and far faster on a loaded machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def train(monkeypatch, argv, tokenizer="build"):
    monkeypatch.setenv("BERT_FAST_BACKEND", "reference")
    extra = ["--tokenizer", tokenizer] if tokenizer else []
    return loop.train(cli.parse_args(BASE + extra + list(argv)))


def rows(out_dir) -> list:
    return [json.loads(line) for line in Path(out_dir, "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("corpus") / "small.txt"
    p.write_text("\n".join(LINES[:40]) + "\n")
    return p


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus) -> Path:
    """A 2-step MLM pretraining run (WordPiece built from the corpus); its final checkpoint."""
    out = tmp_path_factory.mktemp("pre") / "run"
    mp = pytest.MonkeyPatch()
    try:
        s = train(mp, ["--data", str(corpus), "--max-steps", "2", "--output-dir", str(out)])
    finally:
        mp.undo()
    return Path(s["checkpoint"])


def write_table(path: Path, header, table_rows, delimiter=","):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(header)
        w.writerows(table_rows)
    return path


# ----------------------------------------------------------------------------- complete checkpoints
def test_pretraining_checkpoint_is_complete(pretrained, corpus):
    ck = pretrained
    for name in ("model.safetensors", "config.json", ckpt.ARGS_FILE, ckpt.COMPLETE, "trainer_state.json"):
        assert (ck / name).is_file(), name
    tok = transformers.AutoTokenizer.from_pretrained(str(ck), local_files_only=True)
    run_tok = data.build_wordpiece_tokenizer(data.read_lines(corpus))
    assert tok.get_vocab() == run_tok.get_vocab()
    assert tok("the sea")["input_ids"] == run_tok("the sea")["input_ids"]
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["architectures"] == ["BertForMaskedLM"]
    args = json.loads((ck / ckpt.ARGS_FILE).read_text())
    assert args["max_steps"] == 2 and args["data"] == str(corpus) and args["task"] == "mlm"
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(ck))
    assert type(model).__name__ == "BertForMaskedLM"
    # the run's directory keeps the tokenizer too
    assert (
        transformers.AutoTokenizer.from_pretrained(str(ck.parent.parent / "tokenizer")).get_vocab() == tok.get_vocab()
    )


def test_nsp_checkpoint_says_bert_for_pretraining(monkeypatch, tmp_path, corpus):
    s = train(monkeypatch, ["--data", str(corpus), "--nsp", "--max-steps", "1", "--output-dir", str(tmp_path / "n")])
    cfg = json.loads((Path(s["checkpoint"]) / "config.json").read_text())
    assert cfg["architectures"] == ["BertForPreTraining"]


def test_init_from_pretraining_finetunes_csv_with_string_labels(monkeypatch, tmp_path, pretrained):
    """No --tokenizer: the fine-tuning run tokenizes with the pretraining checkpoint's vocabulary;
    string labels are numbered in sorted order and recorded as id2label/label2id."""
    names = ["sea", "land", "air"]
    path = write_table(
        tmp_path / "train.csv",
        ["id", "sentence", "topic"],
        [[i, t, names[i % 3]] for i, t in enumerate(LINES[:24])],
    )
    s = train(
        monkeypatch,
        [
            "--task",
            "cls",
            "--data",
            str(path),
            "--text-column",
            "sentence",
            "--label-column",
            "topic",
            "--init-from",
            str(pretrained),
            "--max-steps",
            "2",
            "--output-dir",
            str(tmp_path / "ft"),
        ],
        tokenizer=None,
    )
    ck = Path(s["checkpoint"])
    cfg = transformers.AutoConfig.from_pretrained(str(ck))
    assert cfg.architectures == ["BertForSequenceClassification"]
    assert cfg.id2label == {0: "air", 1: "land", 2: "sea"} and cfg.label2id == {"air": 0, "land": 1, "sea": 2}
    assert json.loads((ck / ckpt.ARGS_FILE).read_text())["tokenizer"] == str(pretrained)
    tok = transformers.AutoTokenizer.from_pretrained(str(ck))
    assert tok.get_vocab() == transformers.AutoTokenizer.from_pretrained(str(pretrained)).get_vocab()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(ck))
    assert model.config.num_labels == 3
    # the fine-tuned encoder started from the pretrained one (same vocabulary rows)
    pre = transformers.AutoModelForMaskedLM.from_pretrained(str(pretrained))
    assert pre.bert.embeddings.word_embeddings.weight.shape == model.bert.embeddings.word_embeddings.weight.shape


def test_tsv_pairs_with_integer_labels(monkeypatch, tmp_path):
    path = write_table(
        tmp_path / "pairs.tsv",
        ["a", "b", "label"],
        [[LINES[i], LINES[i + 1], i % 2] for i in range(16)],
        delimiter="\t",
    )
    records, texts = table_data.read_records(
        path, type("A", (), {"text_column": "a", "text_pair_column": "b", "label_column": "label"})(), True
    )
    assert records[1] == {"text": LINES[1], "text_b": LINES[2], "label": 1} and texts[0] == LINES[0]
    s = train(
        monkeypatch,
        ["--task", "cls", "--data", str(path), "--text-column", "a", "--text-pair-column", "b"]
        + ["--max-steps", "2", "--output-dir", str(tmp_path / "out")],
    )
    cfg = transformers.AutoConfig.from_pretrained(s["checkpoint"])
    assert cfg.id2label == {0: "0", 1: "1"} and cfg.architectures == ["BertForSequenceClassification"]


def test_missing_labels_and_columns_are_errors_naming_the_row(monkeypatch, tmp_path, capsys):
    path = write_table(tmp_path / "t.csv", ["text", "label"], [["a b", "x"], ["c d", "y"], ["e f", ""], ["g", "x"]])
    with pytest.raises(data.DataError, match=r"t\.csv:4: missing label \(column 'label'"):
        table_data.read_table(path)
    with pytest.raises(
        data.DataError, match=r"no column 'sentence' \(--text-column\); the header has \['text', 'label'\]"
    ):
        table_data.read_table(path, text_column="sentence")
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": 0}\n{"text": "c"}\n')
    with pytest.raises(data.DataError, match=r"t\.jsonl: record 3 .* has no 'label' field"):
        table_data.read_records(jl, None, need_labels=True)
    # through the CLI: exit status 2 and the message, no traceback
    assert cli.main(BASE + ["--task", "cls", "--data", str(path), "--max-steps", "1"]) == 2
    assert "t.csv:4: missing label" in capsys.readouterr().err
    empty = tmp_path / "e.tsv"
    empty.write_text("")
    with pytest.raises(data.DataError, match=r"e\.tsv: the file is empty"):
        table_data.read_table(empty)


# ----------------------------------------------------------------------------- evaluation and logs
def test_eval_metrics_and_the_lr_of_each_step(monkeypatch, tmp_path, corpus):
    ev = tmp_path / "eval.txt"
    ev.write_text("\n".join(LINES[40:70]) + "\n")
    out = tmp_path / "run"
    s = train(
        monkeypatch,
        ["--data", str(corpus), "--max-steps", "5", "--log-every", "3", "--eval-data", str(ev), "--eval-every", "2"]
        + ["--output-dir", str(out)],
    )
    r = rows(out)
    assert [x["step"] for x in r] == [1, 2, 3, 4, 5]
    factor = loop.linear_schedule(2, 5)
    for x in r:  # the rate the step's update used, not the next one's (warmup 2: 1e-3, 2e-3, ...)
        assert x["lr"] == pytest.approx(2e-3 * factor(x["step"] - 1), rel=1e-12), x
    assert [x["lr"] for x in r][:2] == pytest.approx([1e-3, 2e-3])
    evaluated = [x["step"] for x in r if "eval_loss" in x]
    assert evaluated == [2, 4, 5]  # every 2 steps and at the end
    for x in r:
        if "eval_loss" in x:
            assert 0.0 <= x["eval_accuracy"] <= 1.0 and x["eval_loss"] > 0
            assert x["eval_perplexity"] == pytest.approx(2.718281828459045 ** x["eval_loss"])
    assert [e["step"] for e in s["eval"]] == [2, 4, 5]
    assert s["eval"][-1]["eval_loss"] < s["eval"][0]["eval_loss"] + 1.0


def test_eval_masks_are_deterministic_and_classification_scores(tmp_path):
    tok = data.build_wordpiece_tokenizer(LINES)
    args = cli.parse_args(BASE + ["--max-steps", "1"])
    info = loop.dist_mod.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    ev = tmp_path / "e.txt"
    ev.write_text("\n".join(LINES[:20]))
    config = transformers.BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    e1 = evaluate.Evaluator.build(ev, args, tok, "mlm", False, None, 2, info)
    e2 = evaluate.Evaluator.build(ev, args, tok, "mlm", False, None, 2, info)
    assert e1.run(model, torch.device("cpu"), info) == e2.run(model, torch.device("cpu"), info)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(e1.batches, e2.batches))
    assert model.training  # restored
    # macro F1 by hand: classes 0 (tp 2, fp 1, fn 0) and 1 (tp 1, fp 0, fn 1)
    conf = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    f1_0, f1_1 = 2 * 2 / (2 + 3), 2 * 1 / (2 + 1)
    assert evaluate.macro_f1(conf) == pytest.approx((f1_0 + f1_1) / 2)
    # an eval label the training data never had is an error naming it
    bad = tmp_path / "bad.csv"
    write_table(bad, ["text", "label"], [["a", "sea"], ["b", "moon"]])
    with pytest.raises(data.DataError, match=r"bad\.csv: labels \['moon'\] are not in the training label set"):
        evaluate.Evaluator.build(bad, args, tok, "cls", False, {"land": 0, "sea": 1}, 2, info)


def test_resume_writes_no_duplicate_rows(monkeypatch, tmp_path, corpus):
    """A run killed after logging past its last checkpoint (steps 4, 5 logged, checkpoint at 3) and
    resumed: metrics.jsonl and TensorBoard hold every step once, the resumed rows those of an
    uninterrupted run."""
    common = ["--data", str(corpus), "--max-steps", "5", "--dropout", "0", "--tensorboard"]
    full = tmp_path / "full"
    train(monkeypatch, common + ["--output-dir", str(full), "--no-save-final"])
    out = tmp_path / "cut"
    train(monkeypatch, common + ["--output-dir", str(out), "--save-every", "3", "--no-save-final"])
    assert [x["step"] for x in rows(out)] == [1, 2, 3, 4, 5]
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000003"]
    train(monkeypatch, common + ["--output-dir", str(out), "--resume", "latest"])
    got = rows(out)
    assert [x["step"] for x in got] == [1, 2, 3, 4, 5]
    assert [x["loss"] for x in got] == [x["loss"] for x in rows(full)]
    assert [x["lr"] for x in got] == [x["lr"] for x in rows(full)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert sorted(steps) == [1, 2, 3, 4, 5], steps
    assert "train/lr" in acc.Tags()["scalars"]


def test_tensorboard_missing_is_a_clear_error(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_tb(name, *a, **kw):
        if name.startswith("torch.utils.tensorboard") or name == "tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    with pytest.raises(
        loop.TrainError, match=r"--tensorboard needs the 'tensorboard' package.*pip install tensorboard"
    ):
        train(monkeypatch, ["--max-steps", "1", "--tensorboard", "--output-dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()  # refused before anything was written


# ----------------------------------------------------------------------------- safety
def test_non_empty_output_dir_is_refused_unless_overwrite(monkeypatch, tmp_path, corpus, capsys):
    out = tmp_path / "busy"
    (out / "checkpoints" / "step_00000099").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 99, "loss": 1.0}\n')
    (out / "notes.txt").write_text("mine")
    argv = ["--data", str(corpus), "--max-steps", "1", "--output-dir", str(out)]
    with pytest.raises(ckpt.CheckpointError, match=rf"output directory {out} is not empty .*--overwrite"):
        train(monkeypatch, argv)
    assert (out / "metrics.jsonl").read_text() == '{"step": 99, "loss": 1.0}\n'  # untouched
    assert cli.main(BASE + ["--tokenizer", "build"] + argv) == 2
    assert "is not empty" in capsys.readouterr().err
    s = train(monkeypatch, argv + ["--overwrite"])
    assert [x["step"] for x in rows(out)] == [1]
    assert not (out / "checkpoints" / "step_00000099").exists() and (out / "notes.txt").read_text() == "mine"
    assert Path(s["checkpoint"]).name == "step_00000001"
    # --resume of that run is allowed without --overwrite
    s = train(monkeypatch, ["--data", str(corpus), "--max-steps", "2", "--output-dir", str(out), "--resume", "latest"])
    assert s["steps"] == 2


def test_interrupted_save_is_never_a_checkpoint(monkeypatch, tmp_path, corpus):
    """A save killed half-way (here: KeyboardInterrupt while writing the optimizer state of step 4)
    leaves a temporary directory that list_checkpoints and --resume latest ignore; a step directory
    without its COMPLETE marker is not a checkpoint either."""
    out = tmp_path / "run"
    real = ckpt.atomic_torch_save

    def killed(obj, path):
        if path.name == ckpt.OPTIM_FILE and "step_00000004" in str(path):
            Path(path).write_bytes(b"half")
            raise KeyboardInterrupt
        return real(obj, path)

    monkeypatch.setattr(ckpt, "atomic_torch_save", killed)
    with pytest.raises(KeyboardInterrupt):
        train(monkeypatch, ["--data", str(corpus), "--max-steps", "4", "--save-every", "2", "--output-dir", str(out)])
    monkeypatch.setattr(ckpt, "atomic_torch_save", real)
    assert list((out / "checkpoints").glob("step_00000004.tmp-*"))
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002"]
    assert ckpt.resolve("latest", out).name == "step_00000002"
    # a step directory whose marker never got written (a copy or a rename cut short)
    fake = out / "checkpoints" / "step_00000004"
    shutil.copytree(out / "checkpoints" / "step_00000002", fake)
    (fake / ckpt.COMPLETE).unlink()
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002"]
    (out / "latest").write_text("step_00000004\n")
    assert ckpt.resolve("latest", out).name == "step_00000002"
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000004: no COMPLETE marker"):
        ckpt.validate(fake)
    shutil.rmtree(fake)
    s = train(monkeypatch, ["--data", str(corpus), "--max-steps", "4", "--output-dir", str(out), "--resume", "latest"])
    assert s["steps"] == 4 and not list((out / "checkpoints").glob("*.tmp-*"))


def test_disk_full_during_save_keeps_the_previous_checkpoint(monkeypatch, tmp_path, corpus):
    out = tmp_path / "run"
    real = ckpt.atomic_torch_save

    def full_disk(obj, path):
        if path.name == ckpt.OPTIM_FILE and "step_00000004" in str(path):
            Path(path).write_bytes(b"partial")  # some bytes made it, then the disk filled
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(obj, path)

    monkeypatch.setattr(ckpt, "atomic_torch_save", full_disk)
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000004 .*No space left on device.*still .*step_00000002"):
        train(monkeypatch, ["--data", str(corpus), "--max-steps", "4", "--save-every", "2", "--output-dir", str(out)])
    monkeypatch.setattr(ckpt, "atomic_torch_save", real)
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002"]
    assert (out / "latest").read_text().strip() == "step_00000002"
    assert not list((out / "checkpoints").glob("*.tmp-*"))  # the partial save was removed
    prev = out / "checkpoints" / "step_00000002"
    assert ckpt.validate(prev)["step"] == 2 and ckpt.load_model_weights(prev)
    s = train(monkeypatch, ["--data", str(corpus), "--max-steps", "4", "--output-dir", str(out), "--resume", "latest"])
    assert s["steps"] == 4


def test_resume_with_another_model_shape_names_both(monkeypatch, tmp_path, corpus):
    out = tmp_path / "run"
    train(monkeypatch, ["--data", str(corpus), "--max-steps", "1", "--output-dir", str(out)])
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"checkpoint's model is BertForMaskedLM\(.*H=64, L=2.*this run builds BertForMaskedLM\(.*H=256, L=4",
    ):
        train(
            monkeypatch,
            [
                "--data",
                str(corpus),
                "--max-steps",
                "2",
                "--model-size",
                "mini",
                "--output-dir",
                str(out),
                "--resume",
                "latest",
            ],
        )


def swapped_vocab_tokenizer(tokenizer, path: Path) -> Path:
    """``tokenizer`` saved to ``path`` with the ids of two ordinary tokens exchanged: the same size,
    another vocabulary."""
    tokenizer.save_pretrained(str(path))
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = [t for t in vocab if t.isalpha() and len(t) > 2][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def test_tokenizer_that_is_not_the_checkpoints_vocabulary(monkeypatch, tmp_path, corpus, pretrained):
    n_model = transformers.AutoConfig.from_pretrained(str(pretrained)).vocab_size
    path = write_table(tmp_path / "c.csv", ["text", "label"], [[t, i % 2] for i, t in enumerate(LINES[:16])])
    argv = ["--task", "cls", "--data", str(path), "--init-from", str(pretrained), "--max-steps", "1"]
    # another, larger vocabulary: the size check
    other = data.build_wordpiece_tokenizer(LINES[200:] + ["zebra quartz jukebox"] * 3, vocab_size=600)
    other.save_pretrained(str(tmp_path / "other_tok"))
    assert len(other) == 600 > n_model
    with pytest.raises(
        ckpt.CheckpointError, match=rf"has 600 tokens but the model of --init-from .*vocab_size={n_model}"
    ):
        train(monkeypatch, argv, tokenizer=str(tmp_path / "other_tok"))
    # the same size, other ids: the vocabulary check (the checkpoint holds its tokenizer files)
    run_tok = data.build_wordpiece_tokenizer(data.read_lines(corpus))
    swapped = swapped_vocab_tokenizer(run_tok, tmp_path / "swapped_tok")
    assert len(transformers.AutoTokenizer.from_pretrained(str(swapped))) == len(run_tok)
    with pytest.raises(ckpt.CheckpointError, match=r"is not the vocabulary of --init-from .*step_00000002"):
        train(monkeypatch, argv, tokenizer=str(swapped))
    # and on --resume
    out = tmp_path / "run"
    train(monkeypatch, ["--data", str(corpus), "--max-steps", "1", "--output-dir", str(out)])
    resume = ["--data", str(corpus), "--max-steps", "2", "--output-dir", str(out), "--resume", "latest"]
    with pytest.raises(ckpt.CheckpointError, match=r"is not the vocabulary of --resume"):
        train(monkeypatch, resume, tokenizer=str(swapped))
