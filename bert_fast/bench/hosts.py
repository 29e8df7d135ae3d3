"""Where ``bert-fast bench`` builds and times its providers: each alone in its own process
(``SoloHost``, the CPU inference default; on a GPU with ``--solo``) or all in this one
(``InProcessHost``: ``--in-process``, training, GPUs, ``--encode``).

Why. A server runs one engine per process. Side by side in one process the engines' thread pools
slow each other: OpenVINO took 13.4-13.9 ms at MiniLM batch 1 beside torch where alone it takes
9.8-10.6 ms (issue 43, Zen 4, 2 threads), so an in-process table overstates the lead at batch 1.

How. One worker process per provider for the whole run, forked from a server process that has
imported torch and transformers and run nothing (multiprocessing's "forkserver": a worker starts in
a fraction of a second and inherits no OpenMP pool). A worker builds its provider for each case
from the case's description (the same seeded weights and inputs as the parent's), keeps the first
call's output for the accuracy columns, and times bursts on request. Only one worker runs at a
time: the parent asks one for a burst (``_burst``: a call timed in the worker by perf_counter;
below LEAD_BELOW_S that call is an untimed lead and the median of ``CALLS_PER_BURST`` more is the
sample; on a GPU the worker times by CUDA events, as the in-process mode does) and waits for its
answer before asking the next. measure() interleaves the providers'
bursts in balanced orders, one sample per provider per round, so the intervals and the stopping rule
are those of the in-process mode. The lead call absorbs what the previous worker left in the caches
and any spin-wait of its threads, so short calls are timed as a server's back-to-back requests run.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

# A burst: the first call, timed; where it is shorter than LEAD_BELOW_S it is instead the untimed
# lead call and CALLS_PER_BURST more are timed (their median is the sample). A short call depends on
# what the previous worker left in the caches (an int8 MiniLM's weights fit in L3; a server's
# back-to-back requests find them there); a long one is dominated by streaming its weights anyway.
CALLS_PER_BURST = 3
LEAD_BELOW_S = 0.05
_PRELOAD = ["torch", "transformers", "transformers.models.bert.modeling_bert"]


@dataclass
class CaseSpec:
    """What a worker needs to rebuild a case: the parent's seeded weights and inputs come from these."""

    config: Any  # transformers config
    key: str  # model name (a checkpoint folder loads its weights)
    seed: int
    lengths: Sequence[int]
    seq: int
    n_inputs: int
    dtype: Any
    mode: str
    cuda_graphs: bool = False
    dtype_name: Optional[str] = None  # the table's dtype ("fp32", "bf16"), the precision a record defaults to
    artifacts: Optional[str] = None  # the run's shared directory of exported models (model_providers.ARTIFACTS)
    device: str = "cpu"  # where the worker builds and runs the provider


@dataclass
class Built:
    """A provider ready to time: its calls, its record's fields and its first output."""

    steps: List[Any]
    fields: Dict[str, Any]
    parity: Any  # the last hidden state of the first call (float32, CPU), for the accuracy columns


class SoloTimer:
    """measure()'s timer for worker calls: each call returns the milliseconds its worker measured."""

    method = (
        "own process per provider: perf_counter in the worker, CUDA events on a GPU (calls under "
        f"{LEAD_BELOW_S * 1e3:.0f} ms: median of {CALLS_PER_BURST} after a lead call)"
    )

    def time_round(self, calls) -> List[float]:
        return [float(call()) for call in calls]


class _WorkerError(Exception):
    """An exception a worker raised that could not be sent back as itself."""


class Worker:
    """One provider's process."""

    def __init__(self, ctx, provider: str, threads: int):
        self.provider = provider
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, provider, threads), daemon=True, name=f"bench-{provider}")
        self.proc.start()
        child.close()

    def ask(self, *message):
        self.conn.send(message)
        kind, payload = self.conn.recv()
        if kind == "error":
            raise payload
        return payload

    def close(self) -> None:
        try:
            self.conn.send(("close",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


class SoloHost:
    """The providers of a run, each in its own worker process (started on first use)."""

    isolation = "solo"
    timer = SoloTimer()

    def __init__(self, threads: int):
        self.threads = threads
        self.workers: Dict[str, Worker] = {}
        # ONNX exports and OpenVINO conversions, made once by one worker and read by the others
        self.artifacts = tempfile.TemporaryDirectory(prefix="bert_fast_bench_artifacts_")
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(_PRELOAD)

    def build(self, provider: str, spec: CaseSpec, state=None, inputs=None) -> Built:
        """``provider`` built for the case in its worker (which makes the weights and inputs itself:
        ``state`` and ``inputs``, the parent's, are not sent)."""
        worker = self.workers.get(provider)
        if worker is None or not worker.proc.is_alive():
            worker = self.workers[provider] = Worker(self.ctx, provider, self.threads)
        fields, parity = worker.ask("build", dataclasses.replace(spec, artifacts=self.artifacts.name))
        steps = [(lambda i=i: worker.ask("burst", i)) for i in range(spec.n_inputs)]
        return Built(steps, fields, parity)

    def end_case(self) -> None:
        """Free every provider's model of the case (its process stays for the next case)."""
        for worker in self.workers.values():
            if worker.proc.is_alive():
                worker.ask("drop")

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()
        self.artifacts.cleanup()


class InProcessHost:
    """The providers of a case built and timed in this process (``--in-process``; training, GPUs
    and the encode bench always run this way). Keeps each built model until the case ends."""

    isolation = "in-process"

    def __init__(self, device, timer=None):
        self.device = device
        self.timer = timer  # None: measure()'s default (perf_counter on the CPU, CUDA events on a GPU)
        self.built: Dict[str, Any] = {}  # provider -> (model, runner, optimizer): alive while timed

    def build(self, provider: str, spec: CaseSpec, state, inputs) -> Built:
        import torch

        from bert_fast.bench.timing import allocated_memory, peak_memory, reset_peak_memory, synchronize
        from bert_fast.ops._verify import fallback_counts

        device = self.device
        base = allocated_memory(device)
        reset_peak_memory(device)
        fell_back_before = fallback_counts()
        t_build = time.perf_counter()
        from bert_fast.bench.model_providers import build_provider_model, hidden_state, make_optimizer, make_step

        model, runner, notes = build_provider_model(
            provider, spec.config, state, device, spec.dtype, spec.mode, spec.cuda_graphs, key=spec.key
        )
        fields: Dict[str, Any] = {"notes": notes}
        fields.update(
            getattr(runner, "bench_info", None)
            or {"precision": spec.dtype_name, "provider_threads": torch.get_num_threads()}
        )
        optimizer = make_optimizer(model, device) if spec.mode == "train" else None
        self.built[provider] = (model, runner, optimizer)
        steps = [make_step(runner, model, inp, spec.mode, optimizer) for inp in inputs]
        parity = None
        if spec.mode == "infer":  # the first call, on the first input set, is kept for the accuracy checks
            with torch.no_grad():
                parity = hidden_state(runner(**inputs[0])).detach().float().cpu()
        else:
            steps[0]()
        synchronize(device)
        # build + first call (compile, export, calibration): what budget.py's estimate charges
        fields["build_seconds"] = time.perf_counter() - t_build
        # kernels that failed their first-use check (or carry a kept "fail") ran the torch
        # implementation here: the figure is not the kernels' and the flags column says so
        before = fell_back_before
        fell_back = {k: n - before.get(k, 0) for k, n in fallback_counts().items() if n > before.get(k, 0)}
        if fell_back:
            fields["kernel_fallbacks"] = sorted(fell_back)
        peak = peak_memory(device)
        if peak is not None and base is not None:
            fields["peak_mem_bytes"] = max(0, peak - base)
            fields["peak_mem_mb"] = fields["peak_mem_bytes"] / 2**20
        # graphs ran: asked for, on CUDA, a provider with a graph path, built and captured
        fields["cuda_graphs"] = bool(
            spec.cuda_graphs and torch.device(device).type == "cuda" and provider in ("bert_fast", "hf-compile")
        )
        return Built(steps, fields, parity)

    def end_case(self) -> None:
        self.built.clear()

    def close(self) -> None:
        self.built.clear()


# ----------------------------------------------------------------------------- in the worker
def _serve(conn, provider: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    steps: Optional[list] = None
    cuda = False
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "close":
            return
        try:
            if kind == "build":
                steps = None
                gc.collect()
                steps, answer = build_here(provider, message[1])
                cuda = torch.device(message[1].device).type == "cuda"
            elif kind == "burst":
                answer = _burst(steps[message[1] % len(steps)], cuda)
            elif kind == "drop":
                steps, answer = None, None
                gc.collect()
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as exc:  # noqa: BLE001 - sent to the parent, which records it
            conn.send(("error", _sendable(exc)))
            continue
        conn.send(("ok", answer))


def build_here(provider: str, spec: CaseSpec):
    """(steps, (record fields, first output)) of ``provider`` for the case, built in this process."""
    import torch

    from bert_fast.bench import model_providers
    from bert_fast.bench.model_providers import build_provider_model, hidden_state, make_step, reference_state_dict
    from bert_fast.bench.model_workload import make_inputs

    model_providers.ARTIFACTS = spec.artifacts
    t0 = time.perf_counter()
    device = torch.device(spec.device)
    graphs = spec.cuda_graphs and device.type == "cuda"
    state = reference_state_dict(spec.config, spec.key, spec.seed)
    inputs = make_inputs(spec.config, spec.lengths, spec.seq, device, spec.n_inputs, spec.seed)
    model, runner, notes = build_provider_model(
        provider, spec.config, state, device, spec.dtype, spec.mode, graphs, key=spec.key
    )
    del state
    # graphs ran: asked for, on CUDA, a provider with a graph path (as InProcessHost records it)
    fields = {"notes": notes, "cuda_graphs": graphs and provider in ("bert_fast", "hf-compile")}
    fields.update(
        getattr(runner, "bench_info", None)
        or {"precision": spec.dtype_name, "provider_threads": torch.get_num_threads()}
    )
    steps = [make_step(runner, model, inp, spec.mode) for inp in inputs]
    out = steps[0]()
    parity = hidden_state(out).detach().float().cpu().clone()
    fields["build_seconds"] = time.perf_counter() - t0
    return steps, (fields, parity)


def _burst(step, cuda: bool = False) -> float:
    """Milliseconds of one round's sample (see LEAD_BELOW_S)."""
    first = _call_ms(step, cuda)
    if first >= LEAD_BELOW_S * 1e3:
        return first
    return statistics.median(_call_ms(step, cuda) for _ in range(CALLS_PER_BURST))


def _call_ms(step, cuda: bool) -> float:
    """One call's milliseconds: perf_counter, or on a GPU CUDA events around it (the GPU's time from
    the call's first launch to its last kernel's end, host gaps included), then a sync."""
    if not cuda:
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles (ProviderUnavailable must arrive as itself), else its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception that does not survive pickling
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return _WorkerError(text)
