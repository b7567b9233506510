"""Hostile inputs on the CPU (issue 27): mixed devices, foreign dtypes, broadcast views, out-of-range lengths, Ctrl-C."""

import os
import signal
import threading
import time

import pytest
import torch

import flashmla
import flashmla.compat as flash_mla
from mla_cases import make_sparse_case

META = torch.device("meta")


def _case(**kw):
    return make_sparse_case(2027, s_q=3, s_kv=20, h_q=2, d_qk=576, topk=8, sink="random", topk_length=True, **kw)


def _dense_decode_args():
    g = torch.Generator().manual_seed(7)
    return dict(
        q=(torch.randn(2, 1, 4, 576, generator=g) / 10).bfloat16(),
        k_cache=(torch.randn(3, 16, 1, 576, generator=g) / 10).bfloat16(),
        block_table=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
        cache_seqlens=torch.tensor([20, 9], dtype=torch.int32),
        attn_sink=torch.zeros(4),
    )


def _sparse_decode_args():
    g = torch.Generator().manual_seed(8)
    cache = flashmla.kv_quantize((torch.randn(3, 16, 1, 576, generator=g) / 10).bfloat16())
    return dict(
        q=(torch.randn(2, 1, 4, 576, generator=g) / 10).bfloat16(),
        k_cache=cache,
        indices=torch.randint(-2, 48, (2, 1, 8), generator=g, dtype=torch.int32),
        topk_length=torch.tensor([5, 8], dtype=torch.int32),
        attn_sink=torch.zeros(4),
        extra_k_cache=cache[:1],
        extra_indices=torch.randint(0, 16, (2, 1, 3), generator=g, dtype=torch.int32),
    )


def _sparse_fwd_args():
    c = _case()
    return dict(q=c.q, kv=c.kv, indices=c.indices, sm_scale=c.sm_scale, attn_sink=c.attn_sink, topk_length=c.topk_length)


def _sparse_bwd_args():
    a = _sparse_fwd_args()
    out, _, lse = flashmla.sparse_fwd(**a)
    return dict(a, out=out, d_out=out.clone(), lse=lse)


OPS = {
    "sparse_fwd": (flashmla.sparse_fwd, _sparse_fwd_args),
    "sparse_bwd": (flashmla.sparse_bwd, _sparse_bwd_args),
    "decode_dense": (flashmla.decode_dense, _dense_decode_args),
    "decode_sparse": (flashmla.decode_sparse, _sparse_decode_args),
}


def _tensor_args(make):
    return [k for k, v in make().items() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize(
    "op,moved",
    [(op, name) for op, (_, make) in OPS.items() for name in _tensor_args(make)],
)
def test_one_meta_tensor_among_cpu_tensors_is_refused_naming_it(op, moved):
    fn, make = OPS[op]
    args = make()
    args[moved] = args[moved].to(META)
    names = _tensor_args(make)
    # Devices are compared with the first tensor's: moving that one makes the second the odd one out.
    named = names[1] if moved == names[0] else moved
    with pytest.raises(ValueError, match=f"invalid argument `{named}.device`"):
        fn(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", list(OPS))
def test_cpu_or_meta_tensors_among_cuda_tensors_are_refused_naming_them(op):
    fn, make = OPS[op]
    args = make()
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    for name in _tensor_args(make)[1:]:
        for elsewhere in (args[name], args[name].to(META)):
            with pytest.raises(ValueError, match=f"invalid argument `{name}.device`"):
                fn(**dict(on_gpu, **{name: elsewhere}))


@pytest.mark.parametrize("op", list(OPS))
def test_meta_only_calls_are_shape_inference(op):
    fn, make = OPS[op]
    args = make()
    real = fn(**args)
    fake = fn(**{k: v.to(META) if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    for r, f in zip(real, fake):
        assert f.device == META and f.shape == r.shape and f.dtype == r.dtype


def test_autograd_and_compat_refuse_meta_mixed_with_cpu():
    a = _sparse_fwd_args()
    q = a["q"].clone().requires_grad_()
    with pytest.raises(ValueError, match="`kv.device`: expected cpu"):
        flashmla.sparse_mla(q, a["kv"].to(META), a["indices"])
    with pytest.raises(ValueError, match="`indices.device`"):
        flash_mla.flash_mla_sparse_fwd(a["q"], a["kv"], a["indices"].to(META), a["sm_scale"])


@pytest.mark.parametrize(
    "op,arg,dtype,accepted",
    [
        ("sparse_fwd", "indices", torch.int64, "[i32]"),
        ("sparse_fwd", "topk_length", torch.int64, "[i32]"),
        ("sparse_fwd", "q", torch.float64, "[bf16]"),
        ("sparse_fwd", "attn_sink", torch.float64, "[f32]"),
        ("sparse_bwd", "lse", torch.float64, "[f32]"),
        ("decode_dense", "block_table", torch.int64, "[i32]"),
        ("decode_dense", "q", torch.float64, "[bf16, f16]"),
        ("decode_sparse", "indices", torch.int64, "[i32]"),
        ("decode_sparse", "k_cache", torch.int8, "[u8, f8e4m3]"),
    ],
)
def test_a_foreign_dtype_is_named_with_what_the_argument_accepts(op, arg, dtype, accepted):
    fn, make = OPS[op]
    args = make()
    args[arg] = args[arg].to(dtype)
    got = str(dtype).replace("torch.", "")
    with pytest.raises(TypeError) as info:
        fn(**args)
    assert f"invalid argument `{arg}.dtype`: expected one of {accepted}, got {got}" in str(info.value)


def test_broadcast_kv_with_large_indices_reads_only_the_used_rows():
    """The issue's case: kv[:1].expand(2**31, 1, 576) used to copy 4.9 TB and abort the interpreter."""
    a = _sparse_fwd_args()
    s_q, _, topk = a["indices"].shape
    big = torch.tensor([2**31 - 1, 1_000_000_007, -1, 0, 77], dtype=torch.int32)
    indices = big[torch.arange(s_q * topk) % len(big)].reshape(s_q, 1, topk)
    kv = a["kv"][:1].expand(2**31, 1, 576)
    got = flashmla.sparse_fwd(**dict(a, kv=kv, indices=indices))
    # Every valid row holds kv[0]: the same as a one-row kv whose valid indices are all 0.
    want = flashmla.sparse_fwd(**dict(a, kv=a["kv"][:1], indices=indices.clamp(max=0)))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_topk_length_outside_zero_to_topk_is_clamped():
    c = make_sparse_case(2028, s_q=6, s_kv=30, h_q=2, d_qk=512, topk=5, invalid_frac=0.0)
    lengths = torch.tensor([9, 2**31 - 1, -1, -(2**31), 0, 3], dtype=torch.int32)
    keep = torch.arange(5)[None, None, :] < lengths.clamp(0, 5)[:, None, None]
    masked = torch.where(keep, c.indices, torch.full_like(c.indices, -1))
    out, max_logits, lse = flashmla.sparse_fwd(c.q, c.kv, c.indices, c.sm_scale, topk_length=lengths)
    w_out, w_max, w_lse = flashmla.sparse_fwd(c.q, c.kv, masked, c.sm_scale)
    assert torch.equal(out, w_out) and torch.equal(lse, w_lse) and torch.equal(max_logits, w_max)
    assert torch.isposinf(lse[2:5]).all() and (out[2:5] == 0).all()


def _long_sparse_fwd(tokens):
    """A CPU forward of ``tokens`` query tokens, each with 4096 entries of one KV row over 16 heads."""
    q = (torch.randn(tokens, 16, 576) / 10).bfloat16()
    kv = (torch.randn(1, 1, 576) / 10).bfloat16()
    indices = torch.zeros(1, 1, 4096, dtype=torch.int32).expand(tokens, 1, 4096)
    return lambda: flashmla.sparse_fwd(q, kv, indices, 0.04)


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_ctrl_c_interrupts_a_long_cpu_call():
    assert threading.current_thread() is threading.main_thread()
    # One token per core is one wave of the CPU path's parallel loop; the long call is 100 waves. The wave time is
    # measured warm over 4 waves: a single cold wave also times the thread pool's start, and a delay derived from it
    # could outlast the whole long call on a machine with few cores. The fastest of three measurements, so that load
    # which ends before the long call cannot make the call outlast the delay.
    wave = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    calibration = _long_sparse_fwd(4 * wave)
    calibration()
    t_wave = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        calibration()
        t_wave = min(t_wave, (time.perf_counter() - t0) / 4)
    call = _long_sparse_fwd(100 * wave)
    delay = max(0.05, 2 * t_wave)
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    # A process started as a background job of a non-interactive shell inherits SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: install it for the test (what is tested is the call's response to it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    elapsed = time.perf_counter() - t0
    # Uninterrupted, the call takes about 100 waves; interrupted, it stops within a wave of the signal.
    assert elapsed < delay + 20 * t_wave, f"stopped after {elapsed:.2f} s; a wave takes {t_wave:.3f} s"
