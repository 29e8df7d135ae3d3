"""bert_fast.bench.timing: interleaved rounds, the stopping rule, intervals and flags.

Every test feeds a synthetic timer and clock (no real timing: the machine is shared, and timings
live in benchmarks, never in tests), so each runs in milliseconds.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from bert_fast import cli
from bert_fast.bench import timing

# A run of the command as quick as the CPU allows: no warm-up, one input set, no progress bar.
QUICK = "--device cpu --warmup 0 --inputs 1 --no-progress".split()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class SyntheticTimer:
    """Draws each call's time from ``dists[provider](rng, round)``; the provider is known from the
    callable, which records its name in ``self.last`` when called. Advances the fake clock."""

    method = "synthetic"

    def __init__(self, dists, clock, seed=0):
        self.dists, self.clock, self.rng = dists, clock, random.Random(seed)
        self.order = []  # provider names, call by call (timed rounds only)
        self.last = None
        self.round = 0

    def provider(self, name):
        def call():
            self.last = name

        return call

    def time_round(self, calls):
        out = []
        names = []
        for call in calls:
            call()
            names.append(self.last)
            ms = self.dists[self.last](self.rng, self.round)
            self.clock.now += ms * 1e-3
            out.append(ms)
        self.order.append(names)
        self.round += 1
        return out


def _setup(dists, seed=0):
    clock = FakeClock()
    t = SyntheticTimer(dists, clock, seed)
    return t, clock, {name: t.provider(name) for name in dists}


def test_median_ci_order_statistics():
    # n = 100: the textbook distribution-free 95% interval is [x_(40), x_(61)]
    vals = list(range(1, 101))
    lo, hi, level = timing.median_ci(vals)
    assert (lo, hi) == (40, 61) and level >= 0.95
    # n = 6 is the smallest n whose extreme order statistics reach 95% (1 - 2/64)
    assert timing.median_ci([3, 1, 2, 6, 5, 4]) == (1, 6, pytest.approx(1 - 2 / 64))
    # n = 5 cannot: [min, max] with its real, lower level
    lo, hi, level = timing.median_ci([1, 2, 3, 4, 5])
    assert (lo, hi) == (1, 5) and level == pytest.approx(1 - 2 / 32) and level < 0.95


def test_stable_timer_converges_before_the_budget():
    """1% noise: the interval shrinks under +-3% and the rounds stop early, not at max_rounds."""
    t, clock, providers = _setup(
        {"a": lambda r, i: 10.0 * (1 + 0.01 * r.gauss(0, 1)), "b": lambda r, i: 20.0 * (1 + 0.01 * r.gauss(0, 1))}
    )
    m = timing.measure(providers, warmup=1, min_rounds=6, max_rounds=500, budget_s=60, timer=t, clock=clock)
    assert m.stop_reason == "converged" and len(m.rounds) < 500
    for name, med in (("a", 10.0), ("b", 20.0)):
        tm = m.timings[name]
        assert tm.converged and not tm.unstable and tm.ci_rel <= 0.03
        assert tm.ci_low_ms <= tm.median_ms <= tm.ci_high_ms
        assert tm.median_ms == pytest.approx(med, rel=0.02) and tm.p20_ms <= tm.median_ms <= tm.p80_ms
        assert tm.method == "synthetic" and tm.iters == len(m.rounds)
    sp = m.speedup("a", "b")
    assert sp.value == pytest.approx(2.0, rel=0.02) and sp.ci_low <= sp.value <= sp.ci_high
    assert not sp.unstable


def test_noisy_timer_is_flagged_unstable_and_stops_at_the_budget():
    """Heavy-tailed noise (lognormal, sigma 1): the budget runs out before +-3%; the interval is
    wider than +-10%, so the figure is flagged unstable rather than reported as if precise."""
    t, clock, providers = _setup({"noisy": lambda r, i: 10.0 * math.exp(r.gauss(0, 1.0)), "calm": lambda r, i: 10.0})
    m = timing.measure(providers, warmup=0, min_rounds=6, max_rounds=10_000, budget_s=0.5, timer=t, clock=clock)
    assert m.stop_reason == "budget"
    noisy = m.timings["noisy"]
    assert noisy.unstable and not noisy.converged and noisy.ci_rel > 0.10
    assert not m.timings["calm"].unstable
    sp = m.speedup("calm", "noisy")
    assert sp.unstable and sp.ci_rel > 0.10


def test_rounds_interleave_in_the_orders_of_a_williams_design():
    t, clock, providers = _setup({n: (lambda r, i: 1.0) for n in ("a", "b", "c")})
    timing.measure(providers, warmup=0, min_rounds=6, max_rounds=6, timer=t, clock=clock)
    names = "abc"
    assert t.order == [[names[j] for j in o] for o in timing.round_orders(3)]


@pytest.mark.parametrize("p", range(1, 10))
def test_round_orders_balance_first_place_and_predecessors(p):
    """Every provider first equally often, and every ordered pair adjacent equally often: no provider
    always runs right after the same neighbour (a plain rotation fails this for p >= 3)."""
    from collections import Counter

    orders = timing.round_orders(p)
    assert all(sorted(o) == list(range(p)) for o in orders)
    assert len(set(Counter(o[0] for o in orders).values())) == 1
    pairs = Counter((o[k], o[k + 1]) for o in orders for k in range(p - 1))
    if p > 1:
        assert len(pairs) == p * (p - 1) and len(set(pairs.values())) == 1


def test_paired_rounds_cancel_shared_drift():
    """Each round the machine is 1x..3x slower for both providers alike: the medians' own intervals
    are wide, but the paired speedup is exactly 2 with a zero-width interval."""
    drift = lambda i: 1.0 + (i % 3)  # noqa: E731
    t, clock, providers = _setup({"fast": lambda r, i: 5.0 * drift(i), "slow": lambda r, i: 10.0 * drift(i)})
    m = timing.measure(providers, warmup=0, min_rounds=30, max_rounds=30, timer=t, clock=clock)
    assert m.timings["fast"].unstable
    sp = m.speedup("fast", "slow")
    assert (sp.value, sp.ci_low, sp.ci_high) == (2.0, 2.0, 2.0) and not sp.unstable


def test_failing_and_unavailable_providers_do_not_stop_the_others():
    t, clock, providers = _setup({"ok": lambda r, i: 1.0})

    def unavailable():
        raise timing.ProviderUnavailable("No viable backend for scaled_dot_product_attention\nmore")

    calls = {"n": 0}

    def breaks_later():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("kernel exploded")
        t.last = "ok"

    providers.update(unavailable=unavailable, broken=breaks_later)
    m = timing.measure(providers, warmup=1, min_rounds=6, max_rounds=8, timer=t, clock=clock)
    assert m.skipped == {"unavailable": "No viable backend for scaled_dot_product_attention"}
    assert isinstance(m.errors["broken"], RuntimeError)
    assert m.stop_reason == "converged" and m.timings["ok"].iters == len(m.samples("ok")) == 6
    with pytest.raises(RuntimeError, match="exploded"):
        calls["n"] = 10
        timing.measure({"broken": breaks_later}, warmup=1, timer=t, clock=clock, catch=False)


def test_few_rounds_are_never_called_precise():
    """Fewer than 6 rounds: no 95% interval exists, so even identical times are not 'converged'."""
    t, clock, providers = _setup({"a": lambda r, i: 1.0})
    m = timing.measure(providers, warmup=0, min_rounds=3, max_rounds=3, timer=t, clock=clock)
    tm = m.timings["a"]
    assert tm.iters == 3 and tm.ci_level < 0.95 and tm.unstable and not tm.converged


def test_fix_threads_reports_the_count():
    import torch

    before = torch.get_num_threads()
    try:
        assert timing.fix_threads(1) == 1 and torch.get_num_threads() == 1
        assert timing.fix_threads() == 1
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- through the CLI
class NoisyTimer:
    """Runs the calls, reports heavy-tailed synthetic times (lognormal, sigma 1)."""

    method = "synthetic-noisy"

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def time_round(self, calls):
        out = []
        for call in calls:
            call()
            out.append(5.0 * math.exp(self.rng.gauss(0, 1.0)))
        return out


def _figure_texts(plot_fn, doc, monkeypatch):
    """Every text drawn by ``plot_fn(doc)``: titles, annotations, tick labels, legends."""
    from bert_fast.bench import plots

    seen = []

    def capture(plt, fig, ok, doc, path, dpi=110):
        seen.extend(t.get_text() for t in fig.findobj(lambda o: hasattr(o, "get_text")))
        plt.close(fig)
        return ok

    monkeypatch.setattr(plots, "_finish", capture)
    assert plot_fn(doc, "unused.png")
    return "\n".join(seen)


def test_noisy_timer_flags_unstable_in_table_json_and_plot(tmp_path, monkeypatch, capsys):
    from bert_fast.bench import plots

    monkeypatch.setattr(timing, "default_timer", lambda device, flush_l2=False: NoisyTimer())
    out_json = tmp_path / "b.json"
    argv = "bench --model tiny --batch 1 --seq 8 --providers hf-eager,hf-sdpa --min-rounds 6 --max-rounds 8".split()
    # --in-process: the monkeypatch must reach the timer / the builds
    assert cli.main([*argv, "--in-process", *QUICK, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("tiny infer")]
    assert len(rows) == 2 and all(ln.rstrip().endswith("unstable") for ln in rows), out
    doc = json.loads(out_json.read_text())
    results = doc["runs"][0]["results"]
    assert all(r["unstable"] and r["ci_rel"] > 0.10 for r in results)
    assert all(r["threads"] == doc["threads"] >= 1 for r in results)
    assert doc["timing"]["median_ci"].startswith("distribution-free")
    assert "unstable" in _figure_texts(plots.plot_model, doc, monkeypatch)


def _copy_case(n, *providers, device="cpu", dtype=None, **extra):
    """A memory-bound toy op case: ``providers`` each copy ``n`` values (fp32 bytes read + written)."""
    import torch

    from bert_fast.bench.op_case import OpCase

    def factory():
        x = torch.randn(n, device=device, dtype=dtype)
        return lambda: x.clone()

    return OpCase(
        op="toy",
        label=f"N={n}",
        direction="fwd",
        bound="memory",
        bytes=8.0 * n,
        providers=dict.fromkeys(providers, factory),
        **extra,
    )


def test_figure_above_its_ceiling_is_flagged(tmp_path, monkeypatch, capsys, fake_ceilings):
    """An op measured above 100% of its ceiling (here a ceiling made absurdly low) is never shown
    bare: the table, the JSON and the plot say "ceiling unstable"."""
    import types

    from bert_fast.bench import ops_bench, plots

    def cases(device, dtype):
        return [_copy_case(256, "torch", "bert_fast", device=device, dtype=dtype)]

    fake_ceilings.update(copy_bandwidth_gbs=1e-6, copy_bandwidth_ci_gbs=[1e-6, 1e-6], threads=1)
    fake_ceilings.update(matmul_tflops=1.0, matmul_tflops_ci=[1.0, 1.0], matmul_shape=[1, 1, 1])
    toy = {"toy": types.SimpleNamespace(cases=cases)}
    monkeypatch.setattr(ops_bench, "discover_modules", lambda ops=None: (toy, {}))
    out_json = tmp_path / "ops.json"
    assert cli.main(["bench-ops", *QUICK, "--max-rounds", "6", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("toy/fwd")]
    assert len(rows) == 2 and all("ceiling unstable" in ln for ln in rows), out
    doc = json.loads(out_json.read_text())
    for r in doc["cases"][0]["results"]:
        assert r["pct_of_ceiling"] > 100 and r["ceiling_unstable"] is True
    assert "ceiling unstable" in _figure_texts(plots.plot_ops, doc, monkeypatch)


def test_pytest_benchmark_suites_measure_interleaved_on_toy_cases():
    """benchmarks/ops/bench_ops.py and model/bench_model.py (CUDA suites) time a case's providers together
    through bert_fast.bench.timing; their measurement runs here on the CPU at toy size."""
    import importlib.util
    from pathlib import Path

    import torch

    root = Path(__file__).resolve().parents[2] / "benchmarks"

    def load(rel):
        path = root / f"{rel}.py"
        spec = importlib.util.spec_from_file_location(f"_suite_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    case = _copy_case(64, "bert_fast", "torch", unavailable={"cublas": "needs a GPU"})
    out = load("ops/bench_ops").measure_case(case, torch.device("cpu"), budget_s=0.2, warmup=1)
    assert set(out["providers"]) == {"bert_fast", "torch"} and out["skipped"] == {"cublas": "needs a GPU"}
    sp = out["speedups"]["torch"]
    assert sp["ci_low"] <= sp["value"] <= sp["ci_high"]

    bm = load("model/bench_model")
    case = bm.make_case("tiny", 1, 8, "full", "infer", "fp32")
    out = bm.measure_case(
        case, torch.device("cpu"), torch.float32, providers=["hf-eager", "hf-sdpa"], budget_s=0.5, warmup=0
    )
    assert [p["status"] for p in out["providers"].values()] == ["ok", "ok"] and out["timing"]["rounds"] >= 1
    assert out["providers"]["hf-sdpa"]["speedup_ci"] is None or len(out["providers"]["hf-sdpa"]["speedup_ci"]) == 2


# ----------------------------------------------------------------------------- bounded time (budget)


def test_estimate_skips_an_oversized_case(tmp_path, monkeypatch, capsys, fake_ceilings):
    """The README's old CPU example (bert-large, 16 x 512) ran over 20 minutes with no output. At
    0.1 TFLOP/s it is estimated at about an hour and skipped, with what it would cost, before any
    model is built; the small case beside it still runs."""
    from bert_fast.bench import model_providers

    built = []
    real_build = model_providers.build_provider_model
    monkeypatch.setattr(
        model_providers,
        "build_provider_model",
        lambda *a, **k: (built.append(a[1].hidden_size), real_build(*a, **k))[1],
    )
    out_json = tmp_path / "b.json"
    argv = "bench --model bert-large,tiny --batch 16 --seq 512 --lengths random:0.2 --providers hf-sdpa".split()
    # --in-process: the monkeypatch must reach the timer / the builds
    argv += ["--in-process", *QUICK, "--max-minutes", "3", "--max-rounds", "2", "--json", str(out_json)]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "skipping bert-large infer B=16 S=512" in err and "over the budget of --max-minutes 3" in err
    assert " min at least" in err and "GFLOP/s" in err
    assert built == [128]  # only the tiny model was ever built
    big, tiny = json.loads(out_json.read_text())["runs"]
    assert big["skipped"] and big["results"][0]["status"] == "skipped"
    assert not tiny.get("skipped") and tiny["results"][0]["status"] == "ok"


def test_estimate_and_eta():
    import io

    from bert_fast.bench.budget import Progress, estimate_case

    est = estimate_case(["a", "b"], 1e12, 0.1, "cpu", warmup=1, min_rounds=6, max_rounds=100, max_seconds=30)
    assert est.call_s == pytest.approx(12.5)  # 1 TFLOP at 0.8 x 0.1 TFLOP/s
    assert est.min_s == pytest.approx(2 * (1 + 1 + 6) * 12.5) and est.expected_s >= est.min_s
    compiled = estimate_case(["hf-compile"], 1e12, 0.1, "cpu", warmup=1, min_rounds=6, max_rounds=100, max_seconds=30)
    assert compiled.fixed_s > 0 and compiled.min_s > est.min_s / 2
    assert estimate_case(["a"], 1e12, None, "cpu", warmup=1, min_rounds=6, max_rounds=9, max_seconds=1) is None

    clock = FakeClock()
    out = io.StringIO()
    p = Progress([40.0, None, 40.0], stream=out, clock=clock, every_s=5)
    p.start_case(0, "first")
    clock.now = 3.0
    p.on_round(1)  # throttled: nothing within 5 s
    clock.now = 20.0
    p.on_round(2)
    p.end_case()  # took half its estimate...
    p.start_case(2, "third")  # ...so the rest is expected in half the time
    text = out.getvalue().splitlines()
    assert text[0] == "[1/3] first: estimated 40 s, ETA for the run 80 s"
    assert text[1] == "    round 2, 20 s into this case, ETA for the run 60 s"
    assert text[2] == "[3/3] third: estimated 20 s, ETA for the run 20 s"


def test_cuda_graphs_on_the_cpu_are_not_labelled_graphs(tmp_path, capsys):
    """--cuda-graphs on a CPU: nothing runs under graphs, so no case says "graphs" (it did), and
    the last column says what it is ("speedup of bert_fast", not "bf speedup")."""
    out_json = tmp_path / "g.json"
    argv = "bench --model tiny --batch 1 --seq 8 --cuda-graphs --providers hf-eager --max-rounds 2".split()
    assert cli.main([*argv, *QUICK, "--json", str(out_json)]) == 0
    captured = capsys.readouterr()
    rows = [ln for ln in captured.out.splitlines() if ln.startswith("tiny infer")]
    assert rows and not any("graphs" in ln for ln in rows), rows
    assert "speedup of bert_fast" in captured.out and "bf speedup" not in captured.out
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["cuda_graphs"] is False and run["cuda_graphs_requested"] is True
    assert run["results"][0]["cuda_graphs"] is False
