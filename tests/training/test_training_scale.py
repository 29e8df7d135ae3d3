"""Training at scale on the CPU: FSDP2 stays fused and mixed-precision (bf16 all-gathers, fp32
master weights), multi-node torchrun (two "nodes" of one rank on localhost, c10d rendezvous) under
DDP and FSDP2, and bf16-pure's fp32 master weights.

Every distributed run uses gloo and the reference backend (the point is the distributed and
precision logic, not kernels); tiny model, 5 steps. Loss tolerances: fp32 runs that only differ in
reduction order agree to 2e-5 (as tests/training/test_training.py); a bf16 run follows DESIGN.md's
tolerance rule: its distance to the fp32 oracle is at most 2x that of plain bf16 autocast on one
process, plus a small floor.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bert_fast.model import compat
from bert_fast.testing import tiny_train_args, train_env
from bert_fast.training import cli, loop

BASE = tiny_train_args(tokenizer="build", max_steps=5, dropout=0, device="cpu")
FP32_TOL = 2e-5

needs_fsdp2 = pytest.mark.skipif(compat._fsdp_module_class() is None, reason="this torch has no FSDP2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(out_dir) -> dict:
    rows = [json.loads(line) for line in Path(out_dir, "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in rows}


def _one_process(tmp_path_factory, precision: str) -> dict:
    """1 process, global batch 8 = micro 4 x accum 2: the oracle of the 2-rank runs."""
    out = tmp_path_factory.mktemp(f"single-{precision}")
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("BERT_FAST_BACKEND", "reference")
        argv = BASE + ["--grad-accum", "2", "--precision", precision, "--output-dir", str(out), "--no-save-final"]
        summary = loop.train(cli.parse_args(argv))
    finally:
        mp.undo()
    assert summary["steps"] == 5 and summary["strategy"] == "none"
    return _metrics(out)


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory):
    return _one_process(tmp_path_factory, "fp32")


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    return _one_process(tmp_path_factory, "bf16")


def _assert_fp32_match(losses: dict, ref: dict):
    assert sorted(losses) == sorted(ref) == [1, 2, 3, 4, 5]
    for step, r in ref.items():
        assert losses[step] == pytest.approx(r, rel=FP32_TOL, abs=FP32_TOL), (step, losses, ref)


# ----------------------------------------------------------------------------- FSDP2 fused + MP
# Runs loop.train under torchrun and reports, from inside the run, what the tests assert on: the
# model's own report of unfused pieces after sharding and after training (a probe hook on a layer
# would itself make that layer unfused, so there is none), FSDP2's policy on the layer's state and
# the weight its all-gather (layer.unshard(), what the forward pre-hook runs) produces, the
# sharded parameters' and the optimizer's dtypes.
PROBE = r"""
import json, sys
import torch
from bert_fast.training import cli, distributed, loop

seen = {}
wrap = distributed.wrap_model
build_optimizer = loop.build_optimizer

def probed_wrap(model, *a, **k):
    m, kind = wrap(model, *a, **k)
    seen["model"], seen["kind"] = m, kind
    seen["unfused_after_wrap"] = m.bert.unfused_pieces()
    return m, kind

def probed_optimizer(model, args, device):
    seen["optimizer"] = build_optimizer(model, args, device)
    return seen["optimizer"]

distributed.wrap_model = probed_wrap
loop.build_optimizer = probed_optimizer
args = cli.parse_args(sys.argv[2:])
args.keep_process_group = True
summary = loop.train(args)
m = seen["model"]
layer = m.bert.encoder.layer[0]
policy = layer._get_fsdp_state()._fsdp_param_group.mp_policy
layer.unshard()  # FSDP2's all-gather, as its forward pre-hook runs it
w = layer.attention.self.query.weight
gathered = [type(w).__name__, str(w.dtype), list(w.shape)]
layer.reshard()
report = {
    "kind": seen["kind"],
    "layer_class": type(layer).__name__,
    "unfused_after_wrap": seen["unfused_after_wrap"],
    "unfused_after_train": m.bert.unfused_pieces(),
    "policy": [str(policy.param_dtype), str(policy.reduce_dtype)],
    "reshard_after_forward": bool(layer._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None),
    "gathered": gathered,
    "sharded_param_types": sorted({type(p).__name__ for p in m.parameters()}),
    "sharded_param_dtypes": sorted({str(p.dtype) for p in m.parameters()}),
    "optimizer_param_dtypes": sorted({str(p.dtype) for g in seen["optimizer"].param_groups for p in g["params"]}),
    "optimizer_state_dtypes": sorted({str(v.dtype) for s in seen["optimizer"].state.values()
                                      for k, v in s.items() if k != "step"}),
}
torch.distributed.barrier()
if torch.distributed.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps(report))
torch.distributed.destroy_process_group()
"""


def _probe_run(tmp_path, argv, nproc=2) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
    cmd += [str(script), str(report)] + BASE + list(argv)
    proc = subprocess.run(cmd, env=train_env(GLOO_SOCKET_IFNAME="lo"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(report.read_text())


@needs_fsdp2
def test_fsdp2_bf16_mixed_precision_fused_and_within_tolerance(tmp_path, fp32_losses, bf16_losses):
    """2-rank FSDP2 with --precision bf16: the layers stay fused (the model reports no unfused
    piece), each layer's forward sees bf16 weights (MixedPrecisionPolicy's all-gather), the
    sharded parameters and the optimizer stay fp32, and the losses follow the tolerance rule."""
    out = tmp_path / "fsdp-bf16"
    rep = _probe_run(tmp_path, ["--strategy", "fsdp", "--precision", "bf16", "--output-dir", str(out)])
    assert rep["kind"] == "fsdp2" and rep["layer_class"].startswith("FSDP"), rep
    assert rep["unfused_after_wrap"] == {} and rep["unfused_after_train"] == {}, rep
    assert rep["policy"] == ["torch.bfloat16", "torch.float32"], rep
    assert rep["gathered"] == ["Parameter", "torch.bfloat16", [64, 64]] and rep["reshard_after_forward"], rep
    assert rep["sharded_param_types"] == ["DTensor"] and rep["sharded_param_dtypes"] == ["torch.float32"], rep
    assert rep["optimizer_param_dtypes"] == ["torch.float32"], rep
    assert rep["optimizer_state_dtypes"] == ["torch.float32"], rep
    losses = _metrics(out)
    assert sorted(losses) == [1, 2, 3, 4, 5]
    for step, ref in fp32_losses.items():
        err, base = abs(losses[step] - ref), abs(bf16_losses[step] - ref)
        assert err <= 2 * base + 2e-3, (step, losses[step], bf16_losses[step], ref)


@needs_fsdp2
def test_fsdp2_fp32_reshard_false_fused_and_equal_to_one_process(tmp_path, fp32_losses):
    """fp32 FSDP2 without resharding after forward: fp32 weights in the forward (no policy), fused,
    the same losses as one process."""
    out = tmp_path / "fsdp-fp32"
    argv = ["--strategy", "fsdp", "--precision", "fp32", "--fsdp-reshard-after-forward", "false"]
    rep = _probe_run(tmp_path, argv + ["--output-dir", str(out)])
    assert rep["kind"] == "fsdp2" and rep["unfused_after_train"] == {}, rep
    assert rep["policy"] == ["None", "None"] and rep["gathered"] == ["Parameter", "torch.float32", [64, 64]], rep
    assert not rep["reshard_after_forward"], rep
    _assert_fp32_match(_metrics(out), fp32_losses)


def test_reshard_flag_rejects_other_values():
    with pytest.raises(SystemExit):
        cli.parse_args(BASE + ["--fsdp-reshard-after-forward", "maybe"])
    from bert_fast.training.distributed import parse_bool

    with pytest.raises(ValueError, match="maybe"):
        parse_bool("maybe")
    assert parse_bool("false") is False and parse_bool("true") is True


# ----------------------------------------------------------------------------- multi-node
def _node_cmd(node_rank: int, port: int, run_id: str, argv) -> list:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(node_rank),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"is_host={1 if node_rank == 0 else 0}",
        "-m",
        "bert_fast.training.cli",
    ] + list(argv)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_on_localhost_match_one_process(strategy, tmp_path, fp32_losses):
    """Two torchrun launchers (--nnodes 2, one rank each, c10d rendezvous on 127.0.0.1) as two
    "nodes": the losses of one process with the same global batch (micro 4 x 2 ranks)."""
    if strategy == "fsdp" and compat._fsdp_module_class() is None:
        pytest.skip("this torch has no FSDP2")
    out = tmp_path / strategy
    argv = BASE + ["--strategy", strategy, "--output-dir", str(out)]
    port = _free_port()
    procs = [
        subprocess.Popen(
            _node_cmd(r, port, f"test-{strategy}-{port}", argv),
            env=train_env(GLOO_SOCKET_IFNAME="lo"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = []
    deadline = time.monotonic() + 240
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == ("ddp" if strategy == "ddp" else "fsdp2")
    _assert_fp32_match(_metrics(out), fp32_losses)


# ----------------------------------------------------------------------------- bf16-pure
PURE_OPTIONS = dict(tokenizer="build", micro_batch_size=8, lr="3e-4", device="cpu", max_steps=60, dropout=0)
PURE = tiny_train_args(**PURE_OPTIONS)
# mean |loss - bf16 autocast loss| over the last 10 of 60 steps. Measured on the CPU: fp32 master
# weights 5e-4 (fp32 itself: 3e-4 from bf16 autocast); plain AdamW on the bf16 weights 1.5e-2
# (updates below 1/256 of a weight round away: the LayerNorm gammas at 1.0 never move).
PURE_BAND = 5e-3


def _pure_run(monkeypatch, precision, master=True):
    monkeypatch.setenv("BERT_FAST_BACKEND", "reference")
    seen = {}
    build = loop.build_optimizer

    def probe(model, args, device):
        if not master:  # the optimizer bf16-pure had before: AdamW on the bf16 weights
            args = type(args)(**{**vars(args), "precision": "bf16-no-master"})
        seen["optimizer"], seen["model"] = build(model, args, device), model
        return seen["optimizer"]

    monkeypatch.setattr(loop, "build_optimizer", probe)
    summary = loop.train(cli.parse_args(PURE + ["--precision", precision]))
    monkeypatch.setattr(loop, "build_optimizer", build)
    assert summary["steps"] == 60
    return np.array(summary["losses"]), seen


def test_bf16_pure_keeps_fp32_master_weights_and_tracks_autocast(monkeypatch):
    ref, _ = _pure_run(monkeypatch, "bf16")
    pure, seen = _pure_run(monkeypatch, "bf16-pure")
    model, opt = seen["model"], seen["optimizer"]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    states = [opt.state[p] for g in opt.param_groups for p in g["params"]]
    assert states and all(s["master"].dtype == torch.float32 for s in states)
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
    for g in opt.param_groups:  # the bf16 weight is the master copy, rounded
        for p in g["params"]:
            assert torch.equal(p.detach(), opt.state[p]["master"].to(torch.bfloat16))
    gap = float(np.abs(pure - ref)[-10:].mean())
    assert gap < PURE_BAND, gap
    # the band separates: without master weights the same run drifts out of it
    nomaster, _ = _pure_run(monkeypatch, "bf16-pure", master=False)
    assert float(np.abs(nomaster - ref)[-10:].mean()) > PURE_BAND


def test_master_weights_state_dict_round_trip_stays_fp32():
    from bert_fast.training.master_weights import MasterWeightAdamW

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3).to(torch.bfloat16))
    opt = MasterWeightAdamW([w], lr=1e-3, weight_decay=0.1)
    w.grad = torch.randn(4, 3).to(torch.bfloat16)
    opt.step()
    master = opt.state[w]["master"].clone()
    assert master.dtype == torch.float32 and not torch.equal(master, master.to(torch.bfloat16).float())
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = MasterWeightAdamW([w2], lr=1e-3, weight_decay=0.1)
    opt2.load_state_dict(opt.state_dict())
    for k in ("master", "exp_avg", "exp_avg_sq"):
        assert opt2.state[w2][k].dtype == torch.float32
        assert torch.equal(opt2.state[w2][k], opt.state[w][k]), k
    # one more identical step on both: identical results
    w.grad = w2.grad = torch.randn(4, 3).to(torch.bfloat16)
    opt.step()
    opt2.step()
    assert torch.equal(opt.state[w]["master"], opt2.state[w2]["master"])


def test_master_weights_match_torch_adamw_in_fp32():
    """The update is torch.optim.AdamW's: on fp32 parameters the two agree."""
    from bert_fast.training.master_weights import MasterWeightAdamW

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 7))
    b = torch.nn.Parameter(a.detach().clone())
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
    oa, ob = torch.optim.AdamW([a], **kw), MasterWeightAdamW([b], **kw)
    for _ in range(5):
        g = torch.randn(5, 7)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- bench --mode train-mlm
@pytest.mark.parametrize(
    "dtype, expect",
    [("bf16", "bf16"), ("fp32", None), ("fp16", "fp16 needs loss scaling"), ("fp32,bf16", "one --dtype at a time")],
)
def test_bench_train_mlm_takes_its_dtype(dtype, expect):
    """--dtype reaches the training bench (it parses to a list: bf16 silently ran fp32 before)."""
    import argparse

    from bert_fast.bench import model_bench, train_bench
    from bert_fast.bench.model_workload import BenchError

    parser = argparse.ArgumentParser()
    model_bench.add_arguments(parser)
    args = parser.parse_args(["--mode", "train-mlm", "--model", "tiny", "--device", "cpu", "--dtype", dtype])
    if expect in (None, "bf16"):
        plan = train_bench._Plan(args)
        assert plan.dtype_name == dtype and (plan.amp_dtype is not None) == (dtype == "bf16")
    else:
        with pytest.raises(BenchError, match=expect):
            train_bench._Plan(args)


def test_bench_train_mlm_runs_and_reports_tokens_and_mfu(tmp_path, capsys, monkeypatch):
    """`bert-fast bench --mode train-mlm` at a tiny size: every provider (bert_fast and transformers
    through the same loop, transformers.Trainer) gets a time, tokens/s and MFU (no timing claim)."""
    from bert_fast import cli as top_cli
    from bert_fast.bench import train_bench
    from bert_fast.bench.model_workload import load_config

    cfg = load_config("tiny")
    b = train_bench.make_batches(cfg, 3, 16, [16, 9, 1], 2, 0)[0]
    assert b["attention_mask"].sum(1).tolist() == [16, 9, 1]
    real = b["attention_mask"].bool()
    assert ((b["labels"] != -100) <= real).all() and (b["labels"] != -100).any(1).all()
    assert (b["input_ids"][b["labels"] != -100] == 103).all() and (b["input_ids"][real] >= 5).all()

    monkeypatch.setenv("BERT_FAST_PEAK_TFLOPS", "1.0")  # no ceiling measurement: the test is not a timing
    out = tmp_path / "train.json"
    argv = ["bench", "--mode", "train-mlm", "--model", "tiny", "--batch", "2", "--seq", "16", "--device", "cpu"]
    argv += ["--warmup", "1", "--min-rounds", "2", "--max-rounds", "2", "--json", str(out)]
    assert top_cli.main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"bert_fast", "hf-sdpa", "hf-trainer"}
    for name, r in doc["results"].items():
        assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1, (name, r)
    assert doc["tokens_per_step"] == 32 and doc["flops_per_step"] > 0 and doc["peak_tflops"] == 1.0
    r = doc["results"]["bert_fast"]
    assert r["mfu"] == pytest.approx(doc["flops_per_step"] / (r["median_ms"] / 1e3) / 1e12)
    assert "hf-sdpa" in capsys.readouterr().out


def test_bf16_pure_resume_is_exact(monkeypatch, tmp_path):
    """A bf16-pure run stopped at step 4 and resumed gives the uninterrupted run's losses: the
    checkpoint keeps the fp32 master weights and moments (torch's Optimizer.load_state_dict would
    round them to the bf16 parameters' dtype)."""
    monkeypatch.setenv("BERT_FAST_BACKEND", "reference")
    argv = tiny_train_args(**{**PURE_OPTIONS, "max_steps": 8, "lr": "1e-3", "precision": "bf16-pure"})
    full = loop.train(cli.parse_args(argv + ["--output-dir", str(tmp_path / "full")]))
    part = tmp_path / "part"
    first = loop.train(cli.parse_args(argv + ["--output-dir", str(part), "--stop-at-step", "4"]))
    rest = loop.train(cli.parse_args(argv + ["--output-dir", str(part), "--resume", "latest"]))
    assert first["losses"] + rest["losses"] == full["losses"]
