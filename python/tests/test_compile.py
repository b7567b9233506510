"""torch.library registration: opcheck, fake (meta) implementations, torch.compile without graph breaks."""

import os

import pytest
import torch

import flashmla
from mla_cases import SparseBwdSpy, make_sparse_case


def _case(**kw):
    base = dict(s_q=4, s_kv=24, h_q=2, d_qk=576, topk=8, sink="random", topk_length=True)
    base.update(kw)
    return make_sparse_case(41, **base)


def test_ops_are_registered():
    for name in ("sparse_fwd", "sparse_bwd", "decode_dense", "decode_sparse", "kv_quantize", "kv_dequantize"):
        assert hasattr(torch.ops.flashmla, name), name


@pytest.mark.parametrize("sink", [None, "random"])
def test_opcheck_sparse_fwd(sink):
    c = _case(sink=sink)
    q = c.q.clone().requires_grad_()
    kv = c.kv.clone().requires_grad_()
    s = None if c.attn_sink is None else c.attn_sink.clone().requires_grad_()
    torch.library.opcheck(torch.ops.flashmla.sparse_fwd.default, (q, kv, c.indices, c.sm_scale, s, c.topk_length))


def test_opcheck_sparse_bwd():
    c = _case()
    out, _, lse = flashmla.sparse_fwd(*c.args())
    d_out = torch.randn(out.shape).to(torch.bfloat16)
    args = (c.q, c.kv, out, d_out, c.indices, lse, c.sm_scale, c.attn_sink, c.topk_length, True)
    torch.library.opcheck(torch.ops.flashmla.sparse_bwd.default, args)
    torch.library.opcheck(torch.ops.flashmla.sparse_bwd.default, args[:-1] + (False, True))


def test_opcheck_kv_ops():
    kv = (torch.randn(2, 4, 1, 512) / 10).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.flashmla.kv_quantize.default, (kv,))
    cache = flashmla.kv_quantize(kv)
    torch.library.opcheck(torch.ops.flashmla.kv_dequantize.default, (cache,))


def test_meta_tensors_give_shapes():
    c = _case()
    m = [t.to("meta") if t is not None else None for t in (c.q, c.kv, c.indices, c.attn_sink, c.topk_length)]
    out, max_logits, lse = flashmla.sparse_fwd(m[0], m[1], m[2], c.sm_scale, m[3], m[4])
    assert out.device.type == "meta" and out.shape == (4, 2, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (4, 2) and max_logits.dtype == torch.float32


def test_meta_tensors_are_validated():
    c = _case()
    with pytest.raises(ValueError, match="q.shape"):
        flashmla.sparse_fwd(c.q[..., :100].to("meta"), c.kv.to("meta"), c.indices.to("meta"), c.sm_scale)


class TinyAttention(torch.nn.Module):
    """q projection + sparse MLA + a readout: what a training step compiles."""

    def __init__(self, d_model, h_q, d_qk):
        super().__init__()
        self.h_q, self.d_qk = h_q, d_qk
        self.proj = torch.nn.Linear(d_model, h_q * d_qk, dtype=torch.bfloat16)
        self.sink = torch.nn.Parameter(torch.zeros(h_q))

    def forward(self, x, kv, indices, topk_length):
        q = self.proj(x).view(x.shape[0], self.h_q, self.d_qk)
        out = flashmla.sparse_mla(q, kv, indices, attn_sink=self.sink, topk_length=topk_length)
        return out.float().square().mean()


def _compile_and_compare(backend):
    torch.manual_seed(0)
    torch._dynamo.reset()
    c = _case()
    m = TinyAttention(16, 2, 576)
    x = torch.randn(4, 16).to(torch.bfloat16)
    kv = c.kv.clone().requires_grad_()

    loss_eager = m(x, kv, c.indices, c.topk_length)
    loss_eager.backward()
    eager_grads = [p.grad.clone() for p in m.parameters()] + [kv.grad.clone()]
    m.zero_grad()
    kv.grad = None

    compiled = torch.compile(m, backend=backend, fullgraph=True)  # fullgraph: any graph break is an error
    loss = compiled(x, kv, c.indices, c.topk_length)
    loss.backward()
    grads = [p.grad for p in m.parameters()] + [kv.grad]
    torch.testing.assert_close(loss, loss_eager)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)


def test_compile_aot_eager_fullgraph_with_backward():
    _compile_and_compare("aot_eager")


@pytest.mark.skipif(os.environ.get("FLASHMLA_SKIP_INDUCTOR") == "1", reason="FLASHMLA_SKIP_INDUCTOR=1")
def test_compile_inductor_fullgraph_with_backward():
    _compile_and_compare("inductor")


def test_compile_counts_one_graph():
    torch._dynamo.reset()
    c = _case(sink=None, topk_length=False)

    def f(q, kv, idx):
        return flashmla.sparse_mla(q, kv, idx, c.sm_scale) * 2

    explanation = torch._dynamo.explain(f)(c.q, c.kv, c.indices)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_backward_follows_torch_deterministic_setting(monkeypatch):
    """Under `torch.use_deterministic_algorithms(True)` the compiled training step's backward asks the native op for
    the deterministic reduction, as the eager one does (the setting is part of what a compiled graph is guarded on)."""
    from flashmla import _ops

    spy = SparseBwdSpy(_ops._native)
    monkeypatch.setattr(_ops, "_native", spy)
    torch.manual_seed(0)
    torch._dynamo.reset()
    c = _case()
    m = TinyAttention(16, 2, 576)
    x = torch.randn(4, 16).to(torch.bfloat16)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (False, True):
            torch.use_deterministic_algorithms(flag)
            kv = c.kv.clone().requires_grad_()
            compiled(x, kv, c.indices, c.topk_length).backward()
    finally:
        torch.use_deterministic_algorithms(before)
        torch._dynamo.reset()
    assert spy.deterministic == [False, True]
