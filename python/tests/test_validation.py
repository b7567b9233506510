"""Bad input raises ValueError / TypeError carrying the library's message (argument, expected, actual)."""

import pytest
import torch

import flashmla
from flashmla import _native
from mla_cases import make_sparse_case


def _args(**changes):
    c = make_sparse_case(51, s_q=3, s_kv=16, h_q=2, d_qk=576, topk=8, sink="random", topk_length=True)
    args = dict(q=c.q, kv=c.kv, indices=c.indices, sm_scale=c.sm_scale, attn_sink=c.attn_sink,
                topk_length=c.topk_length)
    for k, f in changes.items():
        args[k] = f(args[k]) if callable(f) else f
    return args


@pytest.mark.parametrize(
    "change,exc,needle",
    [
        (dict(q=lambda t: t.float()), TypeError, "`q.dtype`: expected one of [bf16], got f32"),
        (dict(q=lambda t: t.double()), TypeError, "`q.dtype`"),
        (dict(kv=lambda t: t.half()), TypeError, "`kv.dtype`"),
        (dict(indices=lambda t: t.long()), TypeError, "`indices.dtype`"),
        (dict(attn_sink=lambda t: t.bfloat16()), TypeError, "`attn_sink.dtype`"),
        (dict(topk_length=lambda t: t.long()), TypeError, "`topk_length.dtype`"),
        (dict(q=lambda t: t[0]), ValueError, "`q.shape`"),
        (dict(q=lambda t: t[..., :100]), ValueError, "`q.shape[2]`: expected one of [512, 576], got 100"),
        (dict(kv=lambda t: t.expand(-1, 2, -1)), ValueError, "`kv"),
        (dict(kv=lambda t: t[..., :512]), ValueError, "`kv"),
        (dict(indices=lambda t: t[:2]), ValueError, "`indices"),
        (dict(indices=lambda t: t[..., :0]), ValueError, "`indices.shape[2]`"),
        (dict(sm_scale=0.0), ValueError, "`sm_scale`"),
        (dict(sm_scale=float("nan")), ValueError, "`sm_scale`"),
        (dict(sm_scale=float("inf")), ValueError, "`sm_scale`"),
        (dict(attn_sink=lambda t: t[:1]), ValueError, "`attn_sink"),
        (dict(topk_length=lambda t: t[:2]), ValueError, "`topk_length"),
        (dict(q=lambda t: torch.cat([t, t], -1)[..., ::2]), ValueError, "`q"),
    ],
)
def test_sparse_fwd_rejects(change, exc, needle):
    with pytest.raises(exc) as info:
        flashmla.sparse_fwd(**_args(**change))
    assert needle in str(info.value), str(info.value)
    assert "invalid argument" in str(info.value)


def test_not_a_tensor_is_a_type_error():
    a = _args()
    with pytest.raises(TypeError):
        flashmla.sparse_fwd(a["q"].tolist(), a["kv"], a["indices"], 0.1)


def test_sparse_bwd_rejects_bad_lse():
    a = _args()
    out, _, lse = flashmla.sparse_fwd(**a)
    with pytest.raises(ValueError, match="`lse"):
        flashmla.sparse_bwd(a["q"], a["kv"], out, out, a["indices"], lse[:, :1], a["sm_scale"])
    with pytest.raises(TypeError, match="`d_out.dtype`"):
        flashmla.sparse_bwd(a["q"], a["kv"], out, out.float(), a["indices"], lse, a["sm_scale"])


def test_native_rejects_unknown_dtype_and_non_tensors():
    a = _args()
    q64 = a["q"].to(torch.complex64)
    with pytest.raises(TypeError, match="`q.dtype`"):
        _native.sparse_fwd_check(q64, a["kv"], a["indices"], 0.1)
    with pytest.raises(TypeError, match="`q.dtype`"):
        _native.sparse_fwd(q64, a["kv"], a["indices"], 0.1)
    with pytest.raises(TypeError, match="`kv`: expected a torch.Tensor, got list"):
        _native.sparse_fwd(a["q"], a["kv"].tolist(), a["indices"], 0.1)
    with pytest.raises(TypeError, match="`attn_sink`: expected a torch.Tensor, got int"):
        _native.decode_sparse(a["q"], a["kv"], a["indices"], None, None, 3)


def test_unsupported_device_is_a_value_error():
    a = _args()
    with pytest.raises(ValueError, match="`q.device`: expected a cpu or cuda tensor, got meta"):
        _native.sparse_fwd(a["q"].to("meta"), a["kv"], a["indices"], 0.1)


def test_kv_quant_rejects():
    with pytest.raises(ValueError, match="kv"):
        flashmla.kv_quantize(torch.zeros(2, 4, 1, 100, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="kv.dtype"):
        flashmla.kv_quantize(torch.zeros(2, 4, 1, 576))
    with pytest.raises(ValueError, match="cache"):
        flashmla.kv_dequantize(torch.zeros(2, 4, 1, 600, dtype=torch.uint8))
