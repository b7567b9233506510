"""Sparse MLA prefill forward and backward on CPU tensors (the Rust CPU reference) against pure-torch references."""

import zlib

import pytest
import torch

import flashmla
from flashmla.reference import sparse_mla_backward_reference, sparse_mla_reference
from mla_cases import (
    SparseBwdSpy,
    TOL_BWD,
    TOL_PREFILL_OUT,
    TOL_PREFILL_STATS,
    assert_spec_close,
    make_sparse_case,
)

F64 = torch.float64


def check_forward(case):
    out, max_logits, lse = flashmla.sparse_fwd(*case.args())
    s_q, h_q = case.q.shape[0], case.q.shape[1]
    assert out.shape == (s_q, h_q, 512) and out.dtype == torch.bfloat16
    assert max_logits.shape == (s_q, h_q) and max_logits.dtype == torch.float32
    assert lse.shape == (s_q, h_q) and lse.dtype == torch.float32
    sink = None if case.attn_sink is None else case.attn_sink.to(F64)
    ref = sparse_mla_reference(case.q.to(F64), case.kv.to(F64), case.indices, case.sm_scale, sink, case.topk_length)
    ctx = case.describe()
    assert_spec_close("out", out, ref[0], TOL_PREFILL_OUT, ctx)
    assert_spec_close("max_logits", max_logits, ref[1], TOL_PREFILL_STATS, ctx)
    assert_spec_close("lse", lse, ref[2], TOL_PREFILL_STATS, ctx)
    return out, max_logits, lse


@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("h_q", [1, 3, 16])
@pytest.mark.parametrize("sink", [None, "random"])
@pytest.mark.parametrize("topk_length", [False, True])
def test_forward_matches_reference(d_qk, h_q, sink, topk_length):
    seed = 1000 * d_qk + 10 * h_q + (sink is not None) * 2 + topk_length
    case = make_sparse_case(seed, s_q=5, s_kv=40, h_q=h_q, d_qk=d_qk, topk=24, sink=sink, topk_length=topk_length)
    check_forward(case)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("empty rows", dict(empty_rows=3)),
        ("topk > s_kv", dict(s_kv=7, topk=33)),
        ("s_kv = 0", dict(s_kv=0)),
        ("sink +inf", dict(sink="inf")),
        ("sink -inf", dict(sink="-inf")),
        ("sinks mixed", dict(sink="mixed", h_q=6)),
        ("non-contiguous", dict(noncontig=True, sink="random", topk_length=True)),
        ("NaN in unreferenced KV rows", dict(nan_unreferenced=True, topk_length=True, s_kv=64)),
        ("many invalid", dict(invalid_frac=0.7)),
        ("s_q = 0", dict(s_q=0)),
    ],
)
def test_forward_adversarial(name, kw):
    base = dict(s_q=6, s_kv=30, h_q=4, d_qk=576, topk=16)
    base.update(kw)
    case = make_sparse_case(zlib.crc32(name.encode()) % 10_000, **base)
    out, max_logits, lse = check_forward(case)
    if name == "empty rows" or name == "s_kv = 0":
        empty = torch.isposinf(lse)
        assert empty.any()
        assert torch.all(out[empty] == 0)
        assert torch.all(torch.isneginf(max_logits[empty]))
    if name == "sink +inf":
        assert torch.all(out == 0)
    assert not torch.isnan(out).any(), name


def check_backward(case, d_kv_f32=False):
    out, _, lse = flashmla.sparse_fwd(*case.args())
    g = torch.Generator().manual_seed(case.seed + 1)
    d_out = (torch.randn(out.shape, generator=g) / 10).to(torch.bfloat16)
    d_q, d_kv, delta, d_sink = flashmla.sparse_bwd(
        case.q, case.kv, out, d_out, case.indices, lse, case.sm_scale, case.attn_sink, case.topk_length, d_kv_f32
    )
    assert d_q.shape == case.q.shape and d_q.dtype == torch.bfloat16
    assert d_kv.shape == case.kv.shape and d_kv.dtype == (torch.float32 if d_kv_f32 else torch.bfloat16)
    assert delta.shape == lse.shape and delta.dtype == torch.float32
    ref = sparse_mla_backward_reference(
        case.q.to(F64), case.kv.to(F64), out, d_out, case.indices, lse, case.sm_scale,
        None if case.attn_sink is None else case.attn_sink.to(F64), case.topk_length,
    )
    ctx = case.describe()
    assert_spec_close("d_q", d_q, ref[0], TOL_BWD, ctx)
    assert_spec_close("d_kv", d_kv, ref[1], TOL_BWD, ctx)
    assert_spec_close("delta", delta, ref[2], (1e-6, 1e-5, None), ctx)
    if case.attn_sink is None:
        assert d_sink.shape == (0,)
    else:
        assert d_sink.shape == case.attn_sink.shape
        assert_spec_close("d_attn_sink", d_sink, ref[3], (1e-6, 1e-4, None), ctx)
    return d_q, d_kv, d_sink


@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("sink", [None, "random", "mixed"])
@pytest.mark.parametrize("topk_length", [False, True])
def test_backward_matches_reference(d_qk, sink, topk_length):
    case = make_sparse_case(
        zlib.crc32(f"{d_qk} {sink} {topk_length}".encode()) % 10_000, s_q=6, s_kv=48, h_q=6, d_qk=d_qk, topk=20,
        sink=sink, topk_length=topk_length, empty_rows=1,
    )
    check_backward(case)


def test_backward_f32_dkv_noncontiguous_nan_rows():
    case = make_sparse_case(
        99, s_q=5, s_kv=64, h_q=4, d_qk=576, topk=16, sink="random", topk_length=True,
        noncontig=True, nan_unreferenced=True,
    )
    _, d_kv, _ = check_backward(case, d_kv_f32=True)
    from flashmla.reference import valid_mask

    used = torch.zeros(case.kv.shape[0], dtype=torch.bool)
    used[case.indices[:, 0, :].long()[valid_mask(case.indices, case.kv.shape[0], case.topk_length)]] = True
    assert torch.all(d_kv[~used] == 0), "rows no valid index references must get exactly 0"


def test_backward_formula_matches_autograd_f64():
    """The explicit docs/spec.md section 2 formulas (used to check the op) equal autograd of the forward reference."""
    case = make_sparse_case(5, s_q=4, s_kv=12, h_q=3, d_qk=24, topk=10, sink="random", topk_length=True, empty_rows=1)
    q = case.q.to(F64).requires_grad_()
    kv = case.kv.to(F64).requires_grad_()
    sink = case.attn_sink.to(F64).requires_grad_()
    out, _, lse = sparse_mla_reference(q, kv, case.indices, case.sm_scale, sink, case.topk_length, d_v=16)
    d_out = torch.randn(out.shape, dtype=F64)
    out.backward(d_out)
    d_q, d_kv, _, d_sink = sparse_mla_backward_reference(
        q.detach(), kv.detach(), out.detach(), d_out, case.indices, lse.detach(), case.sm_scale,
        sink.detach(), case.topk_length,
    )
    torch.testing.assert_close(d_q, q.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(d_kv, kv.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(d_sink, sink.grad, rtol=1e-10, atol=1e-12)


def test_reference_gradcheck_f64():
    """The pure-torch reference differentiates correctly (finite differences, float64), masks and sink included."""
    case = make_sparse_case(11, s_q=3, s_kv=9, h_q=2, d_qk=8, topk=6, sink="random", topk_length=True, empty_rows=1)
    q = case.q.to(F64).requires_grad_()
    kv = case.kv.to(F64).requires_grad_()
    sink = case.attn_sink.to(F64).requires_grad_()

    def f(q, kv, sink):
        return sparse_mla_reference(q, kv, case.indices, case.sm_scale, sink, case.topk_length, d_v=4)[0]

    assert torch.autograd.gradcheck(f, (q, kv, sink))


@pytest.mark.parametrize("sink", [False, True])
def test_autograd_sparse_mla_matches_reference(sink):
    """`flashmla.sparse_mla` backward (our backward op) against autograd of the float64 reference."""
    case = make_sparse_case(
        21 + sink, s_q=6, s_kv=40, h_q=4, d_qk=512, topk=16, sink="random" if sink else None,
        topk_length=True, empty_rows=1,
    )
    q = case.q.clone().requires_grad_()
    kv = case.kv.clone().requires_grad_()
    attn_sink = case.attn_sink.clone().requires_grad_() if sink else None
    out, lse = flashmla.sparse_mla(q, kv, case.indices, case.sm_scale, attn_sink, case.topk_length, return_lse=True)
    assert not lse.requires_grad
    g = torch.Generator().manual_seed(3)
    d_out = (torch.randn(out.shape, generator=g) / 10).to(torch.bfloat16)
    out.backward(d_out)

    q64 = case.q.to(F64).requires_grad_()
    kv64 = case.kv.to(F64).requires_grad_()
    s64 = case.attn_sink.to(F64).requires_grad_() if sink else None
    ref, _, _ = sparse_mla_reference(q64, kv64, case.indices, case.sm_scale, s64, case.topk_length)
    ref.backward(d_out.to(F64))
    ctx = case.describe()
    assert_spec_close("d_q", q.grad, q64.grad, TOL_BWD, ctx)
    assert_spec_close("d_kv", kv.grad, kv64.grad, TOL_BWD, ctx)
    if sink:
        # Our backward takes delta from the bf16 `out`; the float64 autograd from the exact one.
        assert_spec_close("d_attn_sink", attn_sink.grad, s64.grad, (1e-4, 1e-2, None), ctx)


def test_autograd_sum_loss_expanded_grad():
    """`out.sum().backward()` hands the backward an expanded (stride 0) gradient; it must work."""
    case = make_sparse_case(31, s_q=3, s_kv=20, h_q=2, d_qk=576, topk=8)
    q = case.q.clone().requires_grad_()
    kv = case.kv.clone().requires_grad_()
    flashmla.sparse_mla(q, kv, case.indices, case.sm_scale).float().sum().backward()
    assert q.grad is not None and kv.grad is not None
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()


def test_autograd_backward_follows_torch_deterministic_setting(monkeypatch):
    """`torch.use_deterministic_algorithms(True)` makes the autograd backward (and `sparse_bwd` without an explicit
    `deterministic`) ask for the bitwise-reproducible reduction; an explicit argument wins over the setting."""
    from flashmla import _ops

    spy = SparseBwdSpy(_ops._native)
    monkeypatch.setattr(_ops, "_native", spy)
    case = make_sparse_case(33, s_q=3, s_kv=20, h_q=2, d_qk=576, topk=8)
    before = torch.are_deterministic_algorithms_enabled()
    grads = []
    try:
        for flag in (False, True):
            torch.use_deterministic_algorithms(flag)
            q = case.q.clone().requires_grad_()
            kv = case.kv.clone().requires_grad_()
            flashmla.sparse_mla(q, kv, case.indices, case.sm_scale).float().square().sum().backward()
            grads.append((q.grad, kv.grad))
            out, _, lse = flashmla.sparse_fwd(*case.args())
            flashmla.sparse_bwd(case.q, case.kv, out, out, case.indices, lse, case.sm_scale)
            flashmla.sparse_bwd(case.q, case.kv, out, out, case.indices, lse, case.sm_scale, deterministic=not flag)
    finally:
        torch.use_deterministic_algorithms(before)
    assert spy.deterministic == [False, False, True, True, True, False]
    # On the CPU both modes are the reference: the same gradients.
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_autograd_only_q_requires_grad():
    case = make_sparse_case(32, s_q=3, s_kv=20, h_q=2, d_qk=576, topk=8, sink="random")
    q = case.q.clone().requires_grad_()
    flashmla.sparse_mla(q, case.kv, case.indices, None, case.attn_sink).float().square().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_default_sm_scale():
    case = make_sparse_case(33, s_q=2, s_kv=10, h_q=2, d_qk=512, topk=4)
    a = flashmla.sparse_mla(case.q, case.kv, case.indices)
    b = flashmla.sparse_mla(case.q, case.kv, case.indices, 512**-0.5)
    assert torch.equal(a, b)


def test_training_loop_cpu():
    """A tiny model with sparse MLA learns: the loss falls over a few Adam steps."""
    torch.manual_seed(0)
    s_q, s_kv, h_q, d_qk, topk, d_model = 8, 32, 2, 512, 8, 16
    proj = torch.nn.Linear(d_model, h_q * d_qk).to(torch.bfloat16)
    kv = torch.nn.Parameter((torch.randn(s_kv, 1, d_qk) / 10).to(torch.bfloat16))
    sink = torch.nn.Parameter(torch.zeros(h_q))
    x = torch.randn(s_q, d_model).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32)
    target = torch.randn(s_q, h_q, 512) / 10
    opt = torch.optim.Adam([*proj.parameters(), kv, sink], lr=3e-2)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        q = proj(x).view(s_q, h_q, d_qk)
        out = flashmla.sparse_mla(q, kv, idx, attn_sink=sink)
        loss = (out.float() - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert sink.grad is not None and torch.isfinite(sink.grad).all()
