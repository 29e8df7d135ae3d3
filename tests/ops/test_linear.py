"""linear: act(x @ W^T + b), forward and every gradient, both dispatch paths.

Runs on CUDA (kernels, fp32/fp16/bf16) and on the CPU through the Triton interpreter (fp32/fp16; the
interpreter's tl.dot is wrong in bf16). Shapes are small because the interpreter is slow.
Tolerance: the 2x rule of DESIGN.md (bert_fast.testing.assert_close_2x) against a float64 oracle,
for y, dX, dW and db.
"""

import importlib
import json

import pytest
import torch
from triton.runtime.errors import OutOfResources

from bert_fast import reference
from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import linear as linear_cases
from bert_fast.ops import _dispatch
from bert_fast.ops.linear import linear
from bert_fast.testing import (
    assert_close_2x,
    assert_reduction_close_2x,
    distinct_tiles,
    dtypes_for,
    gpu_config_space,
    pick_test_device,
    tile_of,
)

linear_mod = importlib.import_module("bert_fast.ops.linear")

# every test launches one of these kernels (tests/conftest.py counts them) unless marked no_kernels
pytestmark = pytest.mark.kernels("linear", "linear_tma")
ACTS = [None, "gelu", "gelu_tanh"]
BACKENDS = ["triton", "cublas"]
DTYPES = dtypes_for(pick_test_device())


@pytest.fixture(autouse=True)
def _kernels_of_the_backend(request):
    """Which of our kernels a test must launch (tests/conftest.py counts them): the Triton GEMM
    (pointer or TMA) for backend "triton" and the default; for "cublas" the GEMM is torch's, and
    ours is the fused bias+GELU kernel when there is an activation, none without one."""
    params = getattr(request.node, "callspec", None)
    params = params.params if params is not None else {}
    cuda = pick_test_device().type == "cuda"
    if cuda and request.node.originalname == "test_gradcheck_float64":
        request.applymarker(pytest.mark.no_kernels("float64 on CUDA is the torch implementation (cuBLAS DGEMM)"))
    elif cuda and "backend" in params and params["backend"] is None:
        # the default on CUDA follows the dispatch table, which picks cuBLAS for small shapes: our
        # GEMM or, with an activation, at least the bias+GELU kernel
        if params.get("act") is None:
            request.applymarker(pytest.mark.no_kernels("the default backend on CUDA may be cuBLAS alone"))
        else:
            request.applymarker(pytest.mark.kernels("linear", "linear_tma", "bias_gelu"))
    elif params.get("backend") == "cublas":
        if "act" in params and params["act"] is None:
            request.applymarker(pytest.mark.no_kernels("cublas without an activation: torch.mm / F.linear only"))
        else:
            request.applymarker(pytest.mark.kernels("bias_gelu"))


def _inputs(device, dtype, m, k, n, seed=0):
    """x [M, K], W [N, K], b [N]: linear's sample_inputs (the bias at scale 1, to spread the
    activation's input), and an upstream gradient dy [M, N] from the same seeded randn."""
    randn = seeded_randn(seed, device, dtype)
    x, w, b = linear_cases.sample_inputs(m, n, k, randn, bias_scale=1.0).values()
    return x, w, b, randn(m, n)


def _fwd_bwd(fn, x, w, b, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w)]
    if b is not None:
        leaves.append(b.detach().clone().requires_grad_(True))
    xl, wl = leaves[0], leaves[1]
    bl = leaves[2] if b is not None else None
    y = fn(xl, wl, bl)
    grads = torch.autograd.grad(y, leaves, dy)
    return [y.detach()] + list(grads)


def _check(x, w, b, act, dy, backend, x_view=None, w_view=None):
    """Compare linear(...) against the float64 oracle: y, dx by the 2x rule; dw, db (sums over the rows
    of x) by the 2x rule with the weight-gradient floor of bert_fast.testing.reduction_floor.
    x_view(leaf), w_view(leaf): the x and the W fed in."""
    xv, wv = x_view or (lambda t: t), w_view or (lambda t: t)
    ours = _fwd_bwd(lambda a, c, d: linear(xv(a), wv(c), d, act, backend=backend), x, w, b, dy)
    ref = lambda a, c, d: reference.linear(xv(a), wv(c), d, act)
    oracle = _fwd_bwd(ref, x.double(), w.double(), None if b is None else b.double(), dy.double())
    same = _fwd_bwd(ref, x, w, b, dy)
    rows, label = dy.numel() // dy.shape[-1], f" ({backend}, {act}, {x.dtype})"
    for name, a, o, s in zip(["y", "dx", "dw", "db"], ours, oracle, same):
        if name in ("dw", "db"):
            assert_reduction_close_2x(a, o, s, rows, name=name + label)
        else:
            assert_close_2x(a, o, s, name=name + label)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mkn", [(1, 312, 1000), (7, 384, 1152), (129, 64, 48)])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_reference(device, dtype, act, mkn, backend):
    m, k, n = mkn
    x, w, b, dy = _inputs(device, dtype, m, k, n)
    _check(x, w, b, act, dy, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_129x312x1000(device, backend):
    # all of M, N, K off the tiles at once (one case only: ~5 s per GEMM triple in the interpreter)
    x, w, b, dy = _inputs(device, DTYPES[-1], 129, 312, 1000, seed=13)
    _check(x, w, b, "gelu", dy, backend)


@pytest.mark.parametrize("act", ["gelu", None])
def test_pointer_gemm_split_epilogue(device, act, monkeypatch):
    """The pointer kernel's epilogue on two column halves (tiles at least 128 wide with an
    activation or z): N = 200 is one full 128-wide tile and one whose right half is all outside."""
    from bert_fast.kernels import linear as K

    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "0")
    monkeypatch.setattr(K._linear_fwd_kernel, "configs", [K._cfg(32, 128, 32, 4, 1 if device.type == "cpu" else 3)])
    x, w, b, dy = _inputs(device, DTYPES[-1], 45, 40, 200, seed=31)
    _check(x, w, b, act, dy, "triton")


@pytest.mark.parametrize("k", [1000, 3000])
def test_long_odd_k(device, k):
    x, w, b, dy = _inputs(device, torch.float32, 7, k, 48, seed=1)
    _check(x, w, b, "gelu", dy, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_x_and_dy(device, dtype, backend):
    m, k, n = 33, 96, 80
    x, w, b, dy = _inputs(device, dtype, m, k, n, seed=2)
    # x: a transposed view (column-major [M, K]); dY: a transposed view too
    dy = dy.t().contiguous().t()  # column-major
    assert not dy.is_contiguous()
    _check(x.t().contiguous(), w, b, "gelu", dy, backend, x_view=lambda t: t.t())
    # x: a column slice of a wider tensor (row stride != K)
    wide = torch.nn.functional.pad(x, (3, 14))  # [M, K + 17]
    _check(wide, w, b, "gelu_tanh", dy, backend, x_view=lambda t: t[:, 3 : 3 + k])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ACTS)
def test_leading_dims_no_bias(device, act, backend):
    x, w, _, dy = _inputs(device, DTYPES[0], 10, 64, 48, seed=6)
    x, dy = x.view(2, 5, 64), dy.view(2, 5, 48)
    _check(x, w, None, act, dy, backend)
    y = linear(x, w, None, act, backend=backend)
    assert y.shape == (2, 5, 48)


def test_non_contiguous_weight(device):
    # weight given as a transposed view (column-major [N, K])
    x, w, b, dy = _inputs(device, DTYPES[0], 9, 40, 24, seed=7)
    _check(x, w.t().contiguous(), b, "gelu", dy, "triton", w_view=lambda t: t.t())


@pytest.mark.no_kernels("empty inputs return before any launch")
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_m(device, backend):
    x = torch.randn(0, 3, 16, device=device, requires_grad=True)
    w = torch.randn(8, 16, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    y = linear(x, w, b, "gelu", backend=backend)
    assert y.shape == (0, 3, 8)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
    assert dx.shape == x.shape and (dw == 0).all() and (db == 0).all()


def test_only_some_grads(device):
    x, w, b, dy = _inputs(device, torch.float32, 7, 32, 24, seed=9)
    w.requires_grad_(True)
    y = linear(x, w, b, "gelu", backend="triton")  # x and b need no gradient
    (dw,) = torch.autograd.grad(y, (w,), dy)
    wr = w.detach().double().requires_grad_(True)
    (dwr,) = torch.autograd.grad(reference.linear(x.double(), wr, b.double(), "gelu"), (wr,), dy.double())
    torch.testing.assert_close(dw.double(), dwr, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # inference: no z saved, same y
        y2 = linear(x, w, b, "gelu", backend="triton")
    torch.testing.assert_close(y2, y.detach())


def test_db_deterministic(device):
    x, w, b, dy = _inputs(device, torch.float32, 129, 16, 40, seed=10)
    runs = [_fwd_bwd(lambda a, c, d: linear(a, c, d, "gelu", backend="triton"), x, w, b, dy)[3] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


# ----------------------------------------------------------------------------- dispatch
def test_backend_env_and_argument(device, monkeypatch, kernel_launches):
    x, w, b, _ = _inputs(device, torch.float32, 4, 16, 8)
    expect_kernel = _dispatch.use_triton(x, uses_dot=True)
    for forced in ("triton", "cublas"):
        monkeypatch.setenv("BERT_FAST_LINEAR_BACKEND", forced)
        got = linear_mod.choose_backend(x, 8, 16, "gelu", "fwd")
        assert got == (forced if expect_kernel else _dispatch.implementation(x, uses_dot=True))
        assert linear_mod.choose_backend(x, 8, 16, "gelu", "fwd", backend="cublas") in ("cublas", "torch", "reference")
    monkeypatch.setenv("BERT_FAST_LINEAR_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="cuda-magic"):
        linear(x, w, b)
    monkeypatch.setenv("BERT_FAST_LINEAR_BACKEND", "auto")
    with pytest.raises(ValueError, match="nope"):
        linear(x, w, b, backend="nope")
    # auto: the dispatch table's choice. On CUDA that is cuBLAS for fp32 (default_backend) with our
    # bias+GELU kernel as the epilogue, so the H200 saw no GEMM launch; under the interpreter, ours.
    kernel_launches.reset()
    y = linear(x, w, b, "gelu")
    assert y.shape == (4, 8)
    if expect_kernel:
        assert kernel_launches.count("linear", "linear_tma", "bias_gelu") > 0, kernel_launches
    # the argument reaches the kernel: backend="triton" launches our GEMM on every device
    kernel_launches.reset()
    torch.testing.assert_close(linear(x, w, b, "gelu", backend="triton"), y, rtol=1e-5, atol=1e-5)
    if expect_kernel:
        assert kernel_launches.count("linear", "linear_tma") > 0, kernel_launches


@pytest.mark.no_kernels("the dispatch table, host side")
def test_dispatch_table_and_default():
    table = json.loads(linear_mod.DISPATCH_TABLE.read_text())
    assert isinstance(table["devices"], dict)
    for dev in table["devices"].values():
        for entry in dev["entries"].values():
            assert (entry["backend"] if isinstance(entry, dict) else entry) in ("triton", "cublas")
    assert linear_mod.table_key("fwd", "gelu", torch.bfloat16, 16000, 3072, 768) == "fwd|gelu|bf16|M16384|N3072|K768"
    assert linear_mod.m_bucket(1) == 16 and linear_mod.m_bucket(129) == 256
    assert linear_mod.m_bucket(10**6) == 16384
    d = linear_mod.default_backend
    assert d((9, 0), "fwd", "gelu", torch.bfloat16, 16384, 3072, 768) == "triton"
    assert d((9, 0), "fwd", "none", torch.bfloat16, 16384, 2304, 768) == "cublas"
    assert d((9, 0), "bwd", "gelu", torch.bfloat16, 16384, 3072, 768) == "cublas"
    assert d((8, 0), "fwd", "gelu", torch.float32, 16384, 3072, 768) == "cublas"
    assert d((8, 0), "fwd", "gelu", torch.float16, 8, 3072, 768) == "cublas"


@pytest.mark.no_kernels("the tuning tool's merge, host side")
def test_tune_linear_dispatch_merges_a_partial_run():
    """benchmarks/ops/tune_linear_dispatch.py (the GPU check runs it under a time limit) adds what it
    measured to the device's table and keeps the shapes it did not reach."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ops" / "tune_linear_dispatch.py"
    spec = importlib.util.spec_from_file_location("tune_linear_dispatch", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    old = {"backend": "cublas", "triton_ms": 2.0, "cublas_ms": 1.0}
    new = {"backend": "triton", "triton_ms": 0.5, "cublas_ms": 1.0}
    table = {
        "schema": 1,
        "devices": {
            "GPU A": {"capability": "sm90", "entries": {"k1": old, "k2": old}},
            "GPU B": {"capability": "sm80", "entries": {"k1": old}},
        },
    }
    tool.merge_device_entries(table, "GPU A", {"capability": "sm90", "torch": "x"}, {"k2": new, "k3": new})
    assert table["devices"]["GPU A"] == {
        "capability": "sm90",
        "torch": "x",
        "entries": {"k1": old, "k2": new, "k3": new},
    }
    assert table["devices"]["GPU B"]["entries"] == {"k1": old}
    tool.merge_device_entries(table, "GPU C", {"capability": "sm100"}, {"k1": new})
    assert table["devices"]["GPU C"]["entries"] == {"k1": new}


# ----------------------------------------------------------------------------- the autotune search space
def _gemm_space():
    from bert_fast.kernels import linear as K

    return distinct_tiles(gpu_config_space(K._gemm_configs))


def _tile_id(cfg):
    bm, bn, bk, _ = tile_of(cfg.kwargs)
    return f"{bm}x{bn}x{bk}"


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16] if pick_test_device().type == "cpu" else [torch.float16, torch.bfloat16]
)
@pytest.mark.parametrize("cfg", _gemm_space(), ids=_tile_id)
def test_every_autotune_tile_of_the_gemm(device, cfg, dtype, monkeypatch, kernel_launches):
    """Each tile the pointer GEMM's autotuner may pick on a GPU (kernels/linear.py: the Hopper,
    Ampere and small-M lists, and the BERT_FAST_AUTOTUNE=0 choice), pinned as the only config:
    y (bias + GELU + z: the split epilogue where BLOCK_N >= 128), dX and dW (A read transposed, plain
    epilogue) at M = N = max(BLOCK_M, BLOCK_N) + 9, K = BLOCK_K + 9: the forward has two or more
    tiles along both output dimensions, partial last tiles, two K steps and a K tail, and each
    backward GEMM several tiles along M or N. The 2x rule against the oracle; the launch record
    proves all three GEMMs ran that tile. (The suite otherwise runs one config per
    kernel; a tile that indexes wrongly would only show on a GPU whose autotuner picked it.)"""
    from bert_fast.kernels import linear as K

    # judged here against the oracle, tile by tile: the ops' first-use check keys its verdicts on the
    # specialization, not the tile, so a verdict must not carry over from one tile's test to the next
    monkeypatch.setenv("BERT_FAST_VERIFY", "off")
    monkeypatch.setenv("BERT_FAST_GEMM_TMA", "0")
    if device.type == "cpu":  # warps and stages mean nothing to the interpreter
        cfg = K._cfg(*tile_of(cfg.kwargs)[:3], 4, 1, group=cfg.kwargs["GROUP_M"])
    monkeypatch.setattr(K._linear_fwd_kernel, "configs", [cfg])
    bm, bn, bk, _ = tile_of(cfg.kwargs)
    s = max(bm, bn) + 9
    x, w, b, dy = _inputs(device, dtype, s, bk + 9, s, seed=bm + 3 * bn + 7 * bk)
    try:
        _check(x, w, b, "gelu", dy, "triton")
    except OutOfResources as err:  # the Hopper tiles on a smaller part: the autotuner skips them too
        pytest.skip(f"{_tile_id(cfg)} does not fit this GPU: {err}")
    ran = [tile_of(t)[:3] for t in kernel_launches.tiles("_linear_fwd_kernel")]
    assert ran == [(bm, bn, bk)] * 3, ran


# ----------------------------------------------------------------------------- op checks
@pytest.mark.parametrize("backend", ["triton", "cublas"])
def test_opcheck(device, backend):
    x, w, b, dy = _inputs(device, torch.float32, 7, 32, 24, seed=11)
    if not _dispatch.use_triton(x, uses_dot=True):
        backend = "reference"
    for t in (x, w, b):
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.bert_fast.linear_fwd.default, (x, w, b, "gelu", backend, True))
    torch.library.opcheck(torch.ops.bert_fast.linear_fwd.default, (x, w, None, "none", backend, False))
    z = (x.detach() @ w.detach().t() + (b.detach() if backend != "cublas" else 0)).contiguous()
    args = (dy, x.detach(), w.detach(), b.detach(), z, "gelu", backend, backend, True, True, True)
    torch.library.opcheck(torch.ops.bert_fast.linear_bwd.default, args)
    args = (dy, x.detach(), w.detach(), None, z, "gelu_tanh", backend, backend, True, False, False)
    torch.library.opcheck(torch.ops.bert_fast.linear_bwd.default, args)


@pytest.mark.parametrize("backend", ["triton", "cublas"])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", None])
def test_gradcheck_float64(device, act, backend):
    # float64 runs the Triton kernels in the interpreter (its tl.dot takes fp64); on CUDA float64
    # takes the torch implementation (cuBLAS DGEMM; fp64 tl.dot on the GPU is not relied on).
    x, w, b, _ = (t.requires_grad_(True) for t in _inputs(device, torch.float64, 3, 8, 5, seed=12))
    assert torch.autograd.gradcheck(lambda a, c, d: linear(a, c, d, act, backend=backend), (x, w, b))


@pytest.mark.parametrize("backend", ["triton", "cublas", None])
@pytest.mark.parametrize("act", ["gelu", None])
def test_autocast_casts_like_nn_linear(device, act, backend):
    """Under torch.autocast fp32 operands are cast to the autocast dtype, as nn.Linear's are, on
    every backend: the output has F.linear's dtype and value, and the fp32 leaves get fp32
    gradients. (Before, autocast also reached the torch.mm inside the op, so the output dtype
    depended on the backend and the cuBLAS path crashed.) fp16 on the CPU: the interpreter's bf16
    dot is unreliable."""
    import torch.nn.functional as F

    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    x, w, b, _ = _inputs(device, torch.float32, 33, 32, 24, seed=13)
    for t in (x, w, b):
        t.requires_grad_(True)
    with torch.autocast(device.type, dtype=dtype):
        y = linear(x, w, b, act, backend=backend)
        want = F.linear(x, w, b)
        want = F.gelu(want) if act else want
    assert y.dtype == want.dtype == dtype
    torch.testing.assert_close(y.float(), want.float(), atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32


# ----------------------------------------------------------------------------- bad input
@pytest.mark.no_kernels("validation raises before any launch")
def test_bad_inputs(device):
    x = torch.randn(4, 16, device=device)
    w = torch.randn(8, 16, device=device)
    b = torch.randn(8, device=device)
    with pytest.raises(ValueError, match=r"\(4, 12\)"):
        linear(torch.randn(4, 12, device=device), w, b)
    with pytest.raises(ValueError, match=r"\(7,\)"):
        linear(x, w, torch.randn(7, device=device))
    with pytest.raises(ValueError, match="2-D"):
        linear(x, torch.randn(8, 16, 1, device=device))
    with pytest.raises(TypeError, match="dtype"):
        linear(x, w.half(), b)
    with pytest.raises(TypeError, match="dtype"):
        linear(x.long(), w.long())
    with pytest.raises(TypeError):
        linear(x.numpy(), w)
    with pytest.raises(ValueError, match="relu"):
        linear(x, w, b, activation="relu")


# ----------------------------------------------------------------------------- "auto" and torch.compile
# "auto" on CUDA may resolve to cuBLAS + our bias+GELU kernel (the dispatch table, small shapes)
@pytest.mark.kernels("linear", "linear_tma", "bias_gelu")
def test_auto_backend_resolved_inside_the_ops(device):
    """linear() hands "auto" to the ops on CUDA (the table lookup reads a file: a graph break under
    torch.compile); the ops must resolve it themselves, forward and backward alike."""
    x, w, b, dy = _inputs(device, torch.float32, 7, 32, 24, seed=15)
    assert _dispatch.use_triton(x, uses_dot=True), "the Triton GEMM must run here (tests/conftest.py)"
    xs, ws, bs = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    y, z = torch.ops.bert_fast.linear_fwd(xs, ws, bs, "gelu", "auto:auto", True)
    ref = reference.linear(x.double(), w.double(), b.double(), "gelu")
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
    dx, dw, db = torch.autograd.grad(y, (xs, ws, bs), dy)
    gx, gw, gb = _fwd_bwd(
        lambda a, c, d: reference.linear(a, c, d, "gelu"), x.double(), w.double(), b.double(), dy.double()
    )[1:]
    for a, r in ((dx, gx), (dw, gw), (db, gb)):
        torch.testing.assert_close(a.double(), r, atol=1e-4, rtol=1e-4)
    if x.is_cuda:  # what linear() passes on CUDA with the default "auto"
        assert linear_mod.choose_backend(x, 24, 32, "gelu", "fwd", "auto", defer_auto=True) == "auto"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA dispatch path (table lookup) needs a GPU")
@pytest.mark.kernels("linear", "linear_tma", "bias_gelu")
def test_torch_compile_fullgraph_cuda_auto(monkeypatch):
    monkeypatch.setenv("BERT_FAST_LINEAR_BACKEND", "auto")
    x, w, b, _ = _inputs(torch.device("cuda"), torch.float16, 33, 64, 96, seed=16)
    torch._dynamo.reset()
    fn = torch.compile(lambda a, c, d: linear(a, c, d, "gelu"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(x, w, b), linear(x, w, b, "gelu"))


# ----------------------------------------------------------------------------- GPU targets, offline
@pytest.mark.no_kernels("offline sm_80/sm_90 compile in a subprocess")
def test_gemm_kernels_compile_for_sm90_sm80():
    """The GEMM (BERT_FAST_AUTOTUNE=0 config and the largest autotune tiles) with the GELU epilogue,
    and the dZ/db kernels, compiled for sm_90 and sm_80 without a GPU or the interpreter; shared
    memory within each target's limit for fp16/bf16 (fp32 tiles too big for sm_80 are expected to
    fail at launch, which the autotuner skips)."""
    from test_bias_gelu import run_offline_compile

    rows = run_offline_compile(r"""
from bert_fast.kernels import linear as K
names = "M N K M_BUCKET K_BUCKET KIND stride_am stride_bn stride_ym stride_zm".split()
for cc in (90, 80):
    for dt in ("fp16", "bf16", "fp32"):
        tiles = [(64, 128, 32, 4, 3)] + ([(128, 256, 64, 8, 3), (16, 64, 128, 4, 4)] if dt != "fp32" else [])
        for bm, bn, bk, w, s in tiles:
            types = {**{n: "i32" for n in names}, **{n: "*" + dt for n in "A B BIAS Y Z".split()}}
            c = dict(stride_ak=1, stride_bk=1, stride_yn=1, stride_zn=1, HAS_BIAS=True, ACTIVATION=1,
                     SAVE_Z=True, DOT_PRECISION="ieee" if dt == "fp32" else "native", ACC_DTYPE=tl.float32,
                     INTERPRET=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EVEN_K=False,
                     EPILOGUE_SPLIT=2 if bn >= 128 else 1)
            comp(K._linear_fwd_kernel, types, c, cc, warps=w, stages=s, label=f"gemm {dt} {bm}x{bn}x{bk}")
        p = "*" + dt
        comp(K._linear_bwd_kernel, dict(DY=p, Z=p, DZ=p, PARTIAL="*fp32", M="i32", N="i32", stride_dym="i32",
             stride_dyn="i32", stride_zm="i32", stride_zn="i32", stride_dzm="i32", stride_dzn="i32"),
             dict(ACTIVATION=2, WRITE_DZ=True, WRITE_DB=True, ACC_DTYPE=tl.float32, BLOCK_M=64, BLOCK_N=128),
             cc, warps=8, label=f"dz {dt}")
    comp(K._linear_bwd_db_kernel, dict(PARTIAL="*fp32", DB="*fp32", R="i32", N="i32"),
         dict(BLOCK_R=32, BLOCK_N=128, INTERPRET=False), cc, label="db")
""")
    assert len(rows) == 2 * (2 * 4 + 2 + 1)


@pytest.mark.no_kernels("offline sm_90 compile in a subprocess")
def test_fp32_ieee_gemm_sums_k_in_two_levels(tmp_path):
    """The fp32 ("ieee", FMA) GEMM adds fresh partials of 128 values of K instead of one FMA chain
    over all of K (kernels/linear.py, _linear_fwd_kernel): on an H200 the flat chain's error at
    K = 1000-3000 broke the 2x rule against cuBLAS, which the interpreter cannot show (its tl.dot is
    numpy's). So the compiled TTIR is read: the fp32 dot sits in an inner loop (Triton's
    CombineDotAddFPattern would fold `acc + tl.dot(a, b)` back into one chain, a loop result it
    cannot), the fp16 tensor-core dot in the one flat loop."""
    from test_bias_gelu import run_offline_compile
    from test_linear_tma import _loop_depth_of_dots

    run_offline_compile(
        r"""
from bert_fast.kernels import linear as K
names = "M N K M_BUCKET K_BUCKET KIND stride_am stride_bn stride_ym stride_zm".split()
for dt, prec in (("fp32", "ieee"), ("fp16", "native")):
    types = {**{n: "i32" for n in names}, **{n: "*" + dt for n in "A B BIAS Y Z".split()}}
    c = dict(stride_ak=1, stride_bk=1, stride_yn=1, stride_zn=1, HAS_BIAS=True, ACTIVATION=1,
             SAVE_Z=True, DOT_PRECISION=prec, ACC_DTYPE=tl.float32, INTERPRET=False,
             BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, EVEN_K=False, EPILOGUE_SPLIT=2)
    comp(K._linear_fwd_kernel, types, c, 90, warps=4, stages=3, label="gemm " + dt)
    open(OUT_DIR + "/" + dt + ".ttir", "w").write(LAST["ttir"])
""".replace("OUT_DIR", repr(str(tmp_path)))
    )
    assert _loop_depth_of_dots((tmp_path / "fp32.ttir").read_text()) == [2]
    assert _loop_depth_of_dots((tmp_path / "fp16.ttir").read_text()) == [1]
