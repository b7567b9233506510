"""Dense varlen prefill (docs/spec.md section 5) on the CPU: forward, autograd, errors, fake shapes, compile."""

import math

import pytest
import torch

import flashmla


def _case(lens, h_q=4, h_k=2, d=192, d_v=128, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + [sum(a for a, _ in lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(b for _, b in lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = (torch.randn(tq, h_q, d, generator=g) / 2).to(dtype)
    k = (torch.randn(tk, h_k, d, generator=g) / 2).to(dtype)
    v = torch.randn(tk, h_k, d_v, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k


def _reference(q, k, v, cu_q, cu_k, causal, scale=None):
    """Per sequence and head in float64: softmax over the keys each row sees; empty rows give 0 / +inf."""
    h_q, h_k, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], h_q, v.shape[2], dtype=torch.float64)
    lse = torch.full((h_q, q.shape[0]), math.inf, dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        s_q, s_k = q1 - q0, k1 - k0
        for h in range(h_q):
            j = h // (h_q // h_k)
            s = scale * q[q0:q1, h].double() @ k[k0:k1, j].double().T
            if causal:
                r = torch.arange(s_q)[:, None]
                c = torch.arange(s_k)[None, :]
                s = s.masked_fill(c > r + s_k - s_q, -math.inf)
            for r in range(s_q):
                if torch.isinf(s[r]).all() or s_k == 0:
                    continue
                l = torch.logsumexp(s[r], 0)
                lse[h, q0 + r] = l
                out[q0 + r, h] = torch.exp(s[r] - l) @ v[k0:k1, j].double()
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", [(192, 128), (128, 128)])
def test_forward_matches_reference(causal, dims):
    q, k, v, cu_q, cu_k = _case([(9, 14), (6, 3), (0, 4), (3, 0)], d=dims[0], d_v=dims[1], seed=1)
    out, lse = flashmla.dense_prefill(q, k, v, cu_q, cu_k, causal=causal)
    want_out, want_lse = _reference(q, k, v, cu_q, cu_k, causal)
    assert out.dtype == torch.bfloat16 and lse.shape == (4, 18)
    torch.testing.assert_close(out.double(), want_out, atol=8e-4, rtol=3.01 / 128)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_autograd_matches_the_reference_gradients():
    q, k, v, cu_q, cu_k = _case([(5, 7), (4, 2)], h_q=2, h_k=1, d=128, seed=2, dtype=torch.float16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = flashmla.dense_prefill(*leaves, cu_q, cu_k, causal=True)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out.float() * w).sum().backward()
    ref_leaves = [t.double().clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = _reference(*ref_leaves, cu_q, cu_k, True)
    (ref_out * w.double()).sum().backward()
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-3, rtol=8.01 / 128)


def test_errors_name_the_argument():
    q, k, v, cu_q, cu_k = _case([(3, 4)])
    with pytest.raises(ValueError, match="q.shape\\[2\\]"):
        flashmla.dense_prefill(q[..., :100], k[..., :100], v, cu_q, cu_k)
    with pytest.raises(TypeError, match="cu_seqlens_q.dtype"):
        flashmla.dense_prefill(q, k, v, cu_q.long(), cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_k\\[1\\]"):
        flashmla.dense_prefill(q, k, v, cu_q, torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="`v`"):
        flashmla.dense_prefill(q, k, None, cu_q, cu_k)


def test_meta_shapes_and_compile_without_graph_breaks():
    q, k, v, cu_q, cu_k = _case([(3, 4), (2, 2)])
    m = [t.to("meta") for t in (q, k, v, cu_q, cu_k)]
    out, lse = flashmla.dense_prefill(*m)
    assert out.shape == (5, 4, 128) and lse.shape == (4, 5) and out.device.type == "meta"
    step = torch.compile(lambda q: flashmla.dense_prefill(q, k, v, cu_q, cu_k, causal=True)[0], backend="aot_eager",
                         fullgraph=True)
    torch.testing.assert_close(step(q), flashmla.dense_prefill(q, k, v, cu_q, cu_k, causal=True)[0])


def test_opcheck():
    q, k, v, cu_q, cu_k = _case([(3, 4), (2, 2)], d=128)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu_q, cu_k, None, True)
    torch.library.opcheck(torch.ops.flashmla.dense_prefill_fwd.default, args)
