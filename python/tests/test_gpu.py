"""Device tests (skipped without CUDA): kernels against pure-torch fp32 references on the spec case grid, streams,
no host synchronisation, CUDA graphs, multi-GPU placement, torch.compile and a tiny training loop.

Ops whose CUDA kernel is not wired into this build raise NotImplementedError; their tests are skipped with that
message (so a run lists exactly what is missing). Run on the GPU machine (see docs/python.md):
``python -m pytest -q python/tests/test_gpu.py -rs``.
"""

import math
import time

import pytest
import torch

import flashmla
from flashmla.reference import sparse_mla_backward_reference, sparse_mla_reference
from mla_cases import (
    TOL_BWD,
    TOL_PREFILL_OUT,
    TOL_PREFILL_STATS,
    assert_spec_close,
    make_sparse_case,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

F32 = torch.float32
#: Cycles `torch.cuda._sleep` spins to keep a stream busy long enough to observe ordering (~0.1-0.3 s on H100).
BUSY_CYCLES = 400_000_000


def call_or_skip(fn, *args, **kwargs):
    """Runs an op; a NotImplementedError (kernel not in this build, or a shape it does not cover) skips the test."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        pytest.skip(f"NotImplementedError: {e}")


def gpu_case(seed, **kw):
    return make_sparse_case(seed, device="cuda", **kw)


def ref_forward(case):
    sink = None if case.attn_sink is None else case.attn_sink.to(F32)
    return sparse_mla_reference(case.q.to(F32), case.kv.to(F32), case.indices, case.sm_scale, sink, case.topk_length)


def check_forward(case):
    out, max_logits, lse = call_or_skip(flashmla.sparse_fwd, *case.args())
    assert out.device == case.q.device
    ref = ref_forward(case)
    ctx = case.describe()
    assert_spec_close("out", out, ref[0], TOL_PREFILL_OUT, ctx)
    assert_spec_close("max_logits", max_logits, ref[1], TOL_PREFILL_STATS, ctx)
    assert_spec_close("lse", lse, ref[2], TOL_PREFILL_STATS, ctx)
    return out, max_logits, lse


# ------------------------------------------------------------------------------------------------------------
# Sparse prefill forward


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("topk", [128, 2048])
@pytest.mark.parametrize("extras", ["plain", "sink+topk_length"])
def test_sparse_fwd_grid(h_q, d_qk, topk, extras):
    rich = extras != "plain"
    case = gpu_case(
        h_q * 7 + d_qk + topk + rich, s_q=96, s_kv=4096, h_q=h_q, d_qk=d_qk, topk=topk,
        sink="random" if rich else None, topk_length=rich,
    )
    check_forward(case)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("empty rows", dict(empty_rows=7)),
        ("topk > s_kv", dict(s_kv=100, topk=256)),
        ("many invalid", dict(invalid_frac=0.6)),
        ("sinks mixed", dict(sink="mixed")),
        ("sink +inf", dict(sink="inf")),
        ("sink -inf", dict(sink="-inf")),
        ("topk_length incl 0", dict(topk_length=True)),
        ("non-contiguous", dict(noncontig=True, sink="random", topk_length=True)),
        ("NaN in unreferenced KV", dict(nan_unreferenced=True, topk_length=True)),
        ("topk not a multiple of 64", dict(topk=100)),
        ("h_q 16", dict(h_q=16)),
        ("s_q 1", dict(s_q=1)),
    ],
)
def test_sparse_fwd_adversarial(name, kw):
    base = dict(s_q=64, s_kv=2048, h_q=64, d_qk=576, topk=256)
    base.update(kw)
    out, _, lse = check_forward(gpu_case(sum(map(ord, name)), **base))
    assert not torch.isnan(out).any(), name


def test_sparse_fwd_s_q_above_65535():
    """s_q past the CUDA grid's y/z limit (65535). The reference covers the first and the last rows."""
    case = gpu_case(77, s_q=70000, s_kv=1024, h_q=64, d_qk=512, topk=128, topk_length=True)
    out, max_logits, lse = call_or_skip(flashmla.sparse_fwd, *case.args())
    for rows in (slice(0, 512), slice(65024, 70000)):
        ref = sparse_mla_reference(
            case.q[rows].to(F32), case.kv.to(F32), case.indices[rows], case.sm_scale, None, case.topk_length[rows]
        )
        ctx = f"{case.describe()} rows {rows.start}..{rows.stop}"
        assert_spec_close("out", out[rows], ref[0], TOL_PREFILL_OUT, ctx)
        assert_spec_close("max_logits", max_logits[rows], ref[1], TOL_PREFILL_STATS, ctx)
        assert_spec_close("lse", lse[rows], ref[2], TOL_PREFILL_STATS, ctx)


# ------------------------------------------------------------------------------------------------------------
# Sparse prefill backward


def check_backward(case, d_kv_f32=False, deterministic=False):
    out, _, lse = call_or_skip(flashmla.sparse_fwd, *case.args())
    g = torch.Generator(device="cuda").manual_seed(case.seed)
    d_out = (torch.randn(out.shape, generator=g, device="cuda") / 10).to(torch.bfloat16)
    args = (case.q, case.kv, out, d_out, case.indices, lse, case.sm_scale, case.attn_sink, case.topk_length, d_kv_f32)
    d_q, d_kv, delta, d_sink = call_or_skip(flashmla.sparse_bwd, *args, deterministic=deterministic)
    ref = sparse_mla_backward_reference(
        case.q.to(F32), case.kv.to(F32), out, d_out, case.indices, lse, case.sm_scale,
        None if case.attn_sink is None else case.attn_sink.to(F32), case.topk_length,
    )
    # The kernel rounds the MMA operands P and dS to bf16; errors are judged net of the bound that puts on each
    # element (2^-8 times the sum of the absolute products), which only matters for tokens with few entries.
    mag = sparse_mla_backward_reference(
        case.q.to(F32), case.kv.to(F32), out, d_out, case.indices, lse, case.sm_scale,
        None if case.attn_sink is None else case.attn_sink.to(F32), case.topk_length, magnitudes=True,
    )
    # With h_q > 64 and a bf16 d_kv (not deterministic) the two head groups also exchange their d_kv partials as
    # bf16: twice the bound.
    kv_bound = mag[1] / (128 if (case.q.shape[1] > 64 and not d_kv_f32 and not deterministic) else 256)
    ctx = case.describe()
    assert_spec_close("d_q", d_q, ref[0], TOL_BWD, ctx, allowance=mag[0] / 256)
    assert_spec_close("d_kv", d_kv, ref[1], TOL_BWD, ctx, allowance=kv_bound)
    assert_spec_close("delta", delta, ref[2], (1e-5, 1e-4, None), ctx)
    if case.attn_sink is not None:
        assert_spec_close("d_attn_sink", d_sink, ref[3], (1e-4, 1e-3, None), ctx)
    if deterministic:
        again = flashmla.sparse_bwd(*args, deterministic=True)
        for name, a, b in zip(("d_q", "d_kv", "delta", "d_attn_sink"), (d_q, d_kv, delta, d_sink), again):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} differs bitwise on a rerun, {ctx}"


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("d_kv_f32", [False, True])
def test_sparse_bwd_deterministic(h_q, d_kv_f32):
    """Deterministic mode: within the bounds, and bitwise the same on a rerun (s_kv 16384 at topk 2048 also runs it
    in KV-row buckets and waves)."""
    case = gpu_case(
        55 + h_q + d_kv_f32, s_q=140, s_kv=16384, h_q=h_q, d_qk=576, topk=2048, sink="random", topk_length=True,
        empty_rows=2,
    )
    check_backward(case, d_kv_f32=d_kv_f32, deterministic=True)


def test_sparse_mla_backward_under_torch_deterministic_algorithms():
    """`torch.use_deterministic_algorithms(True)` gives the autograd backward a bitwise-reproducible `kv.grad`."""
    case = gpu_case(57, s_q=140, s_kv=16384, h_q=128, d_qk=576, topk=2048)
    call_or_skip(flashmla.sparse_fwd, *case.args())
    before = torch.are_deterministic_algorithms_enabled()
    grads = []
    try:
        torch.use_deterministic_algorithms(True)
        for _ in range(2):
            kv = case.kv.clone().requires_grad_()
            flashmla.sparse_mla(case.q, kv, case.indices, case.sm_scale).float().square().sum().backward()
            grads.append(kv.grad)
    finally:
        torch.use_deterministic_algorithms(before)
    assert torch.equal(grads[0].view(torch.uint8), grads[1].view(torch.uint8))


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("topk", [128, 2048])
@pytest.mark.parametrize("extras", ["plain", "sink+topk_length"])
def test_sparse_bwd_grid(h_q, d_qk, topk, extras):
    rich = extras != "plain"
    case = gpu_case(
        h_q * 5 + d_qk + topk + rich, s_q=64, s_kv=4096, h_q=h_q, d_qk=d_qk, topk=topk,
        sink="random" if rich else None, topk_length=rich, empty_rows=2,
    )
    check_backward(case)


def test_sparse_bwd_adversarial_f32_dkv():
    case = gpu_case(
        88, s_q=64, s_kv=1024, h_q=64, d_qk=576, topk=256, sink="mixed", topk_length=True, noncontig=True,
        nan_unreferenced=True, invalid_frac=0.3,
    )
    check_backward(case, d_kv_f32=True)


@pytest.mark.parametrize("h_q", [64, 128])
def test_cuda_graph_sparse_bwd_in_overlapped_waves(h_q):
    """The backward at a shape it runs as several overlapped waves (KV-row buckets: the 16384 x 576 accumulator plus
    KV exceed 40 MiB, topk 2048; 140 tokens > one wave of 132 tokens at h_q 64 or 66 at h_q 128 on an H100), captured
    into a CUDA graph and replayed with a new d_out: programmatic dependent launches inside a graph."""
    case = gpu_case(99 + h_q, s_q=140, s_kv=16384, h_q=h_q, d_qk=576, topk=2048)
    out, _, lse = call_or_skip(flashmla.sparse_fwd, *case.args())
    d_out = torch.zeros_like(out)

    def bwd():
        return flashmla.sparse_bwd(case.q, case.kv, out, d_out, case.indices, lse, case.sm_scale, None, None, False)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bwd()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        d_q, d_kv, delta, _ = bwd()
    g = torch.Generator(device="cuda").manual_seed(7)
    d_out.copy_((torch.randn(out.shape, generator=g, device="cuda") / 10).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    args = (case.q.to(F32), case.kv.to(F32), out, d_out, case.indices, lse, case.sm_scale, None, None)
    ref = sparse_mla_backward_reference(*args)
    mag = sparse_mla_backward_reference(*args, magnitudes=True)
    ctx = case.describe() + " (graph replay)"
    assert_spec_close("d_q", d_q, ref[0], TOL_BWD, ctx, allowance=mag[0] / 256)
    assert_spec_close("d_kv", d_kv, ref[1], TOL_BWD, ctx, allowance=mag[1] / (128 if h_q > 64 else 256))
    assert_spec_close("delta", delta, ref[2], (1e-5, 1e-4, None), ctx)


# ------------------------------------------------------------------------------------------------------------
# FP8 KV cache: the GPU kernels are bit-exact with the CPU path


@pytest.mark.parametrize("d_qk", [576, 512])
def test_kv_quant_gpu_bit_exact_with_cpu(d_qk):
    g = torch.Generator().manual_seed(d_qk)
    kv = (torch.randn(9, 64, 1, d_qk, generator=g) * 2).to(torch.bfloat16)
    kv[0, 0, 0, :7] = torch.tensor([0.0, -0.0, 1e-30, 448.0, -1e5, float("inf"), float("nan")])
    cpu_cache = flashmla.kv_quantize(kv)
    gpu_cache = call_or_skip(flashmla.kv_quantize, kv.cuda())
    assert torch.equal(gpu_cache.cpu(), cpu_cache)
    cpu_back = flashmla.kv_dequantize(cpu_cache)
    gpu_back = flashmla.kv_dequantize(gpu_cache)
    assert torch.equal(gpu_back.cpu().view(torch.int16), cpu_back.view(torch.int16))


def test_kv_quant_gpu_padded_cache_and_strided_input():
    kv = (torch.randn(4, 32, 1, 576) / 10).to(torch.bfloat16)
    big = torch.full((5, 33, 1, 576 + 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    kv_strided = big[:4, :32, :, :576]
    kv_strided.copy_(kv)
    bpt, pad = 656, 256
    storage = torch.full((4, 32 * bpt + pad), 0x77, dtype=torch.uint8, device="cuda")
    cache = storage[:, : 32 * bpt].view(4, 32, 1, bpt)
    call_or_skip(flashmla.kv_quantize, kv_strided, out=cache)
    assert torch.equal(cache.cpu(), flashmla.kv_quantize(kv))
    assert torch.all(storage[:, 32 * bpt :] == 0x77)
    if hasattr(torch, "float8_e4m3fn"):
        back = flashmla.kv_dequantize(cache.view(torch.float8_e4m3fn))
        assert torch.equal(back.cpu(), flashmla.kv_dequantize(cache.cpu()))


# ------------------------------------------------------------------------------------------------------------
# Streams, synchronisation, graphs, devices


def _small_case(seed=5):
    return gpu_case(seed, s_q=64, s_kv=1024, h_q=64, d_qk=576, topk=128, sink="random")


def test_runs_on_torchs_current_stream():
    """Work goes to the caller's current stream: it sees a copy queued just before it on that (busy) stream."""
    case = _small_case()
    call_or_skip(flashmla.sparse_fwd, *case.args())  # warm-up: module load, handle creation
    new_q = (torch.randn_like(case.q, dtype=F32) / 10).to(torch.bfloat16)
    q_buf = case.q.clone()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
        q_buf.copy_(new_q)
        out = flashmla.sparse_fwd(q_buf, *case.args()[1:])[0]
    side.synchronize()
    case.q = new_q
    assert_spec_close("out (after the queued copy)", out, ref_forward(case)[0], TOL_PREFILL_OUT)


def test_decode_runs_on_torchs_current_stream():
    """The decodes' three launches go to the caller's current stream too (their q is written just before there)."""
    q, cache, idx, _ = _sparse_decode_inputs(15, b=2, s_q=1, h_q=64, topk=128)
    q, cache, idx = q.cuda(), cache.cuda(), idx.cuda()
    flashmla.decode_sparse(q, cache, idx)
    q_buf = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
        q_buf.copy_(q)
        got = flashmla.decode_sparse(q_buf, cache, idx)
    side.synchronize()
    want = flashmla.decode_sparse(q, cache, idx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_does_not_synchronise():
    """A call returns while its stream is still busy with earlier work."""
    case = _small_case()
    call_or_skip(flashmla.sparse_fwd, *case.args())
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    t0 = time.perf_counter()
    flashmla.sparse_fwd(*case.args())
    elapsed = time.perf_counter() - t0
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "the stream drained during the call: something synchronised"
    assert elapsed < 0.05, f"the call took {elapsed:.3f} s while the stream was busy"


def test_kv_quant_does_not_synchronise():
    kv = (torch.randn(64, 64, 1, 576, device="cuda") / 10).to(torch.bfloat16)
    call_or_skip(flashmla.kv_quantize, kv)
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    flashmla.kv_quantize(kv)
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy


def _capture_and_replay(capture_stream, warm_up_there):
    case = _small_case()
    call_or_skip(flashmla.sparse_fwd, *case.args())
    if warm_up_there:
        capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture_stream):
            flashmla.sparse_fwd(*case.args())
        torch.cuda.current_stream().wait_stream(capture_stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        out = flashmla.sparse_fwd(*case.args())[0]
    case.q.copy_((torch.randn_like(case.q, dtype=F32) / 10).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert_spec_close("out (graph replay)", out, ref_forward(case)[0], TOL_PREFILL_OUT)


def test_cuda_graph_capture_and_replay():
    """Capture after a warm-up on the capture stream (as torch recommends), then replay with new inputs."""
    _capture_and_replay(torch.cuda.Stream(), warm_up_there=True)


def test_cuda_graph_capture_on_a_fresh_stream():
    """Capture on a stream flashmla has not seen: its per-stream handle (and module load) is created mid-capture."""
    _capture_and_replay(torch.cuda.Stream(), warm_up_there=False)


def test_mixed_devices_rejected():
    case = _small_case()
    with pytest.raises(ValueError, match="kv.device"):
        flashmla.sparse_fwd(case.q, case.kv.cpu(), case.indices, case.sm_scale)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_second_device_keeps_current_device():
    torch.cuda.set_device(0)
    case = make_sparse_case(9, s_q=32, s_kv=512, h_q=64, d_qk=512, topk=128, device="cuda:1")
    out = call_or_skip(flashmla.sparse_fwd, *case.args())[0]
    assert out.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0
    assert_spec_close("out (cuda:1)", out, ref_forward(case)[0], TOL_PREFILL_OUT)
    q, cache, idx, lengths = _sparse_decode_inputs(19, b=2, s_q=1, h_q=64, topk=128)
    got = flashmla.decode_sparse(q.to("cuda:1"), cache.to("cuda:1"), idx.to("cuda:1"), lengths.to("cuda:1"))
    assert got[0].device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    want = flashmla.decode_sparse(q, cache, idx, lengths)
    assert_spec_close("decode out (cuda:1)", got[0], want[0], (1e-3, 2.01 / 128, 5e-6))


# ------------------------------------------------------------------------------------------------------------
# Autograd, torch.compile, training


def test_autograd_gpu_matches_reference():
    case = gpu_case(101, s_q=64, s_kv=2048, h_q=64, d_qk=576, topk=256, sink="random", topk_length=True)
    q = case.q.clone().requires_grad_()
    kv = case.kv.clone().requires_grad_()
    sink = case.attn_sink.clone().requires_grad_()
    out = call_or_skip(flashmla.sparse_mla, q, kv, case.indices, case.sm_scale, sink, case.topk_length)
    d_out = (torch.randn_like(out, dtype=F32) / 10).to(torch.bfloat16)
    call_or_skip(out.backward, d_out)
    q32 = case.q.to(F32).requires_grad_()
    kv32 = case.kv.to(F32).requires_grad_()
    s32 = case.attn_sink.to(F32).requires_grad_()
    ref = sparse_mla_reference(q32, kv32, case.indices, case.sm_scale, s32, case.topk_length)[0]
    ref.backward(d_out.to(F32))
    assert_spec_close("d_q", q.grad, q32.grad, TOL_BWD)
    assert_spec_close("d_kv", kv.grad, kv32.grad, TOL_BWD)


def test_compile_inductor_gpu():
    torch._dynamo.reset()
    case = _small_case()

    def f(q, kv, idx, sink):
        return flashmla.sparse_mla(q, kv, idx, case.sm_scale, sink).float().square().mean()

    eager = call_or_skip(f, case.q, case.kv, case.indices, case.attn_sink)
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(case.q, case.kv, case.indices, case.attn_sink), eager)


def _train_sparse_layer(attention, steps):
    """Trains a projection + latent KV + sink through one sparse-attention layer towards a teacher's output (a
    learnable target); returns the loss of every step. Same seed, same data for every ``attention``."""
    torch.manual_seed(0)
    s_q, s_kv, h_q, d_qk, topk, d_model = 128, 1024, 64, 576, 128, 256
    x = torch.randn(s_q, d_model, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), device="cuda", dtype=torch.int32)
    with torch.no_grad():
        teacher = torch.nn.Linear(d_model, h_q * d_qk, device="cuda", dtype=torch.bfloat16)
        kv_t = (torch.randn(s_kv, 1, d_qk, device="cuda") / 10).to(torch.bfloat16)
        q_t = teacher(x).view(s_q, h_q, d_qk)
        target = sparse_mla_reference(q_t.float(), kv_t.float(), idx, d_qk**-0.5)[0]
    proj = torch.nn.Linear(d_model, h_q * d_qk, device="cuda", dtype=torch.bfloat16)
    kv = torch.nn.Parameter((torch.randn(s_kv, 1, d_qk, device="cuda") / 10).to(torch.bfloat16))
    sink = torch.nn.Parameter(torch.zeros(h_q, device="cuda"))
    opt = torch.optim.Adam([*proj.parameters(), kv, sink], lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        q = proj(x).view(s_q, h_q, d_qk)
        out = attention(q, kv, idx, sink)
        loss = (out.float() - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tiny_training_loop():
    """200 Adam steps of a sparse-attention layer with the kernels follow the pure-torch version's loss curve to
    bf16 precision, and learn (the target is a teacher's output)."""
    steps = 200

    def ours(q, kv, idx, sink):
        return call_or_skip(flashmla.sparse_mla, q, kv, idx, attn_sink=sink)

    def torch_version(q, kv, idx, sink):
        # The pure-torch reference in float32 (autograd through gather and einsum), rounded to bf16 like ours.
        out = sparse_mla_reference(q.float(), kv.float(), idx, q.shape[-1] ** -0.5, sink)[0]
        return out.to(torch.bfloat16)

    a = _train_sparse_layer(ours, steps)
    b = _train_sparse_layer(torch_version, steps)
    assert all(map(math.isfinite, a)), a
    assert a[-1] < 0.5 * a[0], f"did not learn: {a[0]} -> {a[-1]}"
    # bf16 rounding differs between the two paths at every step; the curves must agree to a few bf16 ulps.
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert worst < 2e-2, f"loss curves differ by {worst:.3g} (relative); ours {a[::40]} torch {b[::40]}"


# ------------------------------------------------------------------------------------------------------------
# Decode (through the compat API)


def test_decode_sparse_gpu_matches_cpu():
    import flashmla.compat as flash_mla

    g = torch.Generator().manual_seed(5)
    kv = (torch.randn(16, 64, 1, 576, generator=g) / 10).to(torch.bfloat16)
    cache = flashmla.kv_quantize(kv)
    q = (torch.randn(4, 1, 64, 576, generator=g) / 10).to(torch.bfloat16)
    idx = torch.randint(-1, 16 * 64, (4, 1, 256), generator=g, dtype=torch.int32)
    cpu = flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, None, is_fp8_kvcache=True, indices=idx)
    gpu = call_or_skip(
        flash_mla.flash_mla_with_kvcache, q.cuda(), cache.cuda(), None, None, 512, None, is_fp8_kvcache=True,
        indices=idx.cuda(),
    )
    assert_spec_close("out", gpu[0], cpu[0], (1e-3, 2.01 / 128, 5e-6))
    assert_spec_close("lse", gpu[1], cpu[1], (1e-6, 8.01 / 65536, None))


def _sparse_decode_inputs(seed, b=4, s_q=2, h_q=64, d_qk=576, topk=256, blocks=16, page=64):
    """An FP8 cache (quantised; tokens no index names are NaN), q, indices (some invalid) and lengths."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(blocks, page, 1, d_qk, generator=g) / 10).to(torch.bfloat16)
    n_tok = blocks * page
    live = torch.randperm(n_tok, generator=g)[: n_tok // 2]
    dead = torch.ones(n_tok, dtype=torch.bool)
    dead[live] = False
    kv.view(n_tok, d_qk)[dead] = float("nan")  # quantised to NaN codes: any read of a dead token shows
    cache = flashmla.kv_quantize(kv)
    idx = live[torch.randint(0, live.numel(), (b, s_q, topk), generator=g)].to(torch.int32)
    idx[torch.rand(b, s_q, topk, generator=g) < 0.1] = -1
    idx[0, 0, :7] = torch.tensor([2**31 - 1, -(2**31), n_tok, 114514, -123456, -1, 1919810], dtype=torch.int32)
    lengths = torch.randint(-3, topk + 40, (b,), generator=g, dtype=torch.int32)
    q = (torch.randn(b, s_q, h_q, d_qk, generator=g) / 10).to(torch.bfloat16)
    return q, cache, idx, lengths


@pytest.mark.parametrize("d_qk,h_q,s_q", [(576, 128, 2), (576, 16, 1), (512, 64, 2), (512, 5, 3)])
def test_decode_sparse_gpu_any_heads_with_lengths_and_sink(d_qk, h_q, s_q):
    q, cache, idx, lengths = _sparse_decode_inputs(8, s_q=s_q, h_q=h_q, d_qk=d_qk, topk=200)
    sink = torch.randn(h_q, generator=torch.Generator().manual_seed(2))
    cpu = flashmla.decode_sparse(q, cache, idx, lengths, attn_sink=sink)
    gpu = flashmla.decode_sparse(q.cuda(), cache.cuda(), idx.cuda(), lengths.cuda(), attn_sink=sink.cuda())
    assert_spec_close("out", gpu[0], cpu[0], (1e-3, 2.01 / 128, 5e-6))
    assert_spec_close("lse", gpu[1], cpu[1], (1e-6, 8.01 / 65536, None))


def _sparse_decode_graph_replay(seeds, **shape):
    """Captures a sparse decode step on inputs of seeds[0], replays it after q, cache, indices and lengths changed in
    place to those of each later seed, and checks each replay against an eager call on the new inputs."""
    q, cache, idx, lengths = (t.cuda() for t in _sparse_decode_inputs(seeds[0], **shape))
    flashmla.decode_sparse(q, cache, idx, lengths)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashmla.decode_sparse(q, cache, idx, lengths)
    for seed in seeds[1:]:
        q2, cache2, idx2, len2 = _sparse_decode_inputs(seed, **shape)
        for dst, src in ((q, q2), (cache, cache2), (idx, idx2), (lengths, len2)):
            dst.copy_(src.cuda())
        graph.replay()
        want = flashmla.decode_sparse(q2, cache2, idx2, len2)
        assert_spec_close("out", out, want[0], (1e-3, 2.01 / 128, 5e-6))
        assert_spec_close("lse", lse, want[1], (1e-6, 8.01 / 65536, None))


def test_decode_sparse_cuda_graph_replay_with_changed_indices():
    """A captured sparse decode step replayed after the indices, lengths, q and cache changed in place."""
    _sparse_decode_graph_replay((9, 21, 22), b=6, h_q=128, topk=512)


def test_decode_sparse_cuda_graph_replay_past_the_inline_schedule():
    """140 requests with lengths: the schedule kernel runs, and the split and combine kernels after it are
    programmatic launches; captured and replayed after the indices and lengths changed in place."""
    _sparse_decode_graph_replay((23, 24, 25), b=70, h_q=64, topk=128)


def test_decode_sparse_batch_invariant_and_compile():
    q, cache, idx, lengths = (t.cuda() for t in _sparse_decode_inputs(10, b=5, h_q=64, topk=1024))
    full = flashmla.decode_sparse(q, cache, idx, lengths, batch_invariant=True)
    alone = flashmla.decode_sparse(q[2:3], cache, idx[2:3], lengths[2:3], batch_invariant=True)
    assert torch.equal(full[0][2:3], alone[0]) and torch.equal(full[1][2:3], alone[1])
    step = torch.compile(lambda q: flashmla.decode_sparse(q, cache, idx, lengths), fullgraph=True)
    got = step(q)
    want = flashmla.decode_sparse(q, cache, idx, lengths)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _dense_decode_inputs(seed, b=5, s_q=2, h_q=64, h_kv=1, page=64, max_len=900, dtype=torch.bfloat16):
    """A paged cache with shuffled blocks, NaN in every slot no request reads, and its block table."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = (max_len + page - 1) // page
    num_blocks = b * max_blocks + 3
    cache = torch.full((num_blocks, page, h_kv, 576), float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g)[: b * max_blocks].to(torch.int32)
    block_table = perm.view(b, max_blocks).contiguous()
    seqlens = torch.randint(0, max_len + 1, (b,), generator=g, dtype=torch.int32)
    seqlens[0] = 0
    for i in range(b):
        n = int(seqlens[i])
        for p in range(n):
            blk = int(block_table[i, p // page])
            cache[blk, p % page] = (torch.randn(h_kv, 576, generator=g) / 10).to(dtype)
    q = (torch.randn(b, s_q, h_q, 576, generator=g) / 10).to(dtype)
    return q, cache, block_table, seqlens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,h_kv,s_q,causal", [(128, 1, 1, False), (64, 1, 2, True), (16, 2, 3, True)])
def test_decode_dense_gpu_matches_cpu(dtype, h_q, h_kv, s_q, causal):
    import flashmla.compat as flash_mla

    q, cache, bt, sl = _dense_decode_inputs(3, s_q=s_q, h_q=h_q, h_kv=h_kv, dtype=dtype)
    sink = torch.randn(h_q, generator=torch.Generator().manual_seed(1))
    cpu = flash_mla.flash_mla_with_kvcache(q, cache, bt, sl, 512, None, causal=causal, attn_sink=sink)
    gpu = flash_mla.flash_mla_with_kvcache(
        q.cuda(), cache.cuda(), bt.cuda(), sl.cuda(), 512, None, causal=causal, attn_sink=sink.cuda()
    )
    assert gpu[0].dtype == dtype
    assert_spec_close("out", gpu[0], cpu[0], (1e-3, 2.01 / 128, 5e-6))
    assert_spec_close("lse", gpu[1], cpu[1], (1e-6, 8.01 / 65536, None))


def test_decode_dense_cuda_graph_replay_with_changed_seqlens():
    """A captured decode step replayed after cache_seqlens and block_table changed in place (same shapes) computes
    the new problem: the schedule is made on the device from the values, not at capture time."""
    q, cache, bt, sl = _dense_decode_inputs(4, b=6, s_q=1, h_q=128, max_len=3000)
    q, cache, bt, sl = q.cuda(), cache.cuda(), bt.cuda(), sl.cuda()
    flashmla.decode_dense(q, cache, bt, sl)  # warm-up outside the capture (module load, allocator)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashmla.decode_dense(q, cache, bt, sl)
    for seed in (11, 12):
        q2, cache2, bt2, sl2 = _dense_decode_inputs(seed, b=6, s_q=1, h_q=128, max_len=3000)
        q.copy_(q2.cuda())
        cache.copy_(cache2.cuda())
        bt.copy_(bt2.cuda())
        sl.copy_(sl2.cuda())
        graph.replay()
        want = flashmla.decode_dense(q2, cache2, bt2, sl2)
        assert_spec_close("out", out, want[0], (1e-3, 2.01 / 128, 5e-6))
        assert_spec_close("lse", lse, want[1], (1e-6, 8.01 / 65536, None))


def test_decode_dense_batch_invariant_gpu():
    q, cache, bt, sl = _dense_decode_inputs(6, b=4, s_q=1, h_q=128, max_len=4000)
    q, cache, bt, sl = q.cuda(), cache.cuda(), bt.cuda(), sl.cuda()
    full = flashmla.decode_dense(q, cache, bt, sl, batch_invariant=True)
    alone = flashmla.decode_dense(q[1:2], cache, bt[1:2], sl[1:2], batch_invariant=True)
    assert torch.equal(full[0][1:2], alone[0]) and torch.equal(full[1][1:2], alone[1])


def test_decode_dense_compile_fullgraph():
    q, cache, bt, sl = (t.cuda() for t in _dense_decode_inputs(7, b=3, s_q=2, h_q=64))
    step = torch.compile(lambda q: flashmla.decode_dense(q, cache, bt, sl, causal=True), fullgraph=True)
    got = step(q)
    want = flashmla.decode_dense(q, cache, bt, sl, causal=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_decode_workspace_kept_per_stream_grows_and_releases():
    """Decodes of growing and shrinking size share the stream's kept workspace; each result is right."""
    flashmla.release_workspaces()
    cases = [
        _sparse_decode_inputs(16, b=1, s_q=1, h_q=16, topk=64),
        _sparse_decode_inputs(17, b=8, s_q=2, h_q=128, topk=512),
        _sparse_decode_inputs(18, b=2, s_q=1, h_q=64, topk=128),
    ]
    for q, cache, idx, lengths in cases:
        got = flashmla.decode_sparse(q.cuda(), cache.cuda(), idx.cuda(), lengths.cuda())
        want = flashmla.decode_sparse(q, cache, idx, lengths)
        assert_spec_close("out", got[0], want[0], (1e-3, 2.01 / 128, 5e-6))
        assert_spec_close("lse", got[1], want[1], (1e-6, 8.01 / 65536, None))
    assert flashmla.release_workspaces() > 0
    assert flashmla.release_workspaces() == 0


def test_decodes_from_threads_on_one_stream_share_its_workspace_safely():
    """Threads decoding on the same stream (sharing its kept workspace) get the results of serial calls."""
    import threading

    cases = []
    for i in range(4):
        q, cache, idx, lengths = _sparse_decode_inputs(30 + i, b=1 + i, s_q=1, h_q=64, topk=64 * (1 + i))
        cases.append((q.cuda(), cache.cuda(), idx.cuda(), lengths.cuda()))
    want = [flashmla.decode_sparse(*c) for c in cases]
    torch.cuda.synchronize()
    got = [[] for _ in cases]

    def work(i):
        for _ in range(50):
            got[i].append(flashmla.decode_sparse(*cases[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for i, results in enumerate(got):
        assert len(results) == 50
        for out, lse in results:
            assert torch.equal(out, want[i][0]) and torch.equal(lse, want[i][1])
