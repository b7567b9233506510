"""`flashmla.compat` (the FlashMLA-style API), decode and the FP8 cache ops, on CPU tensors."""

import pytest
import torch

import flashmla
import flashmla.compat as flash_mla
from flashmla.reference import dense_decode_reference, sparse_decode_reference, sparse_mla_reference
from mla_cases import (
    TOL_BWD,
    TOL_DECODE_LSE,
    TOL_DECODE_OUT,
    TOL_PREFILL_OUT,
    TOL_PREFILL_STATS,
    assert_spec_close,
    make_sparse_case,
)


def test_sparse_fwd_tuple_and_natural_log():
    c = make_sparse_case(61, s_q=4, s_kv=30, h_q=4, d_qk=576, topk=16, sink="random", topk_length=True)
    res = flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, c.sm_scale, 512, c.attn_sink, c.topk_length)
    assert isinstance(res, tuple) and len(res) == 3
    out, max_logits, lse = res
    ref = sparse_mla_reference(c.q.double(), c.kv.double(), c.indices, c.sm_scale, c.attn_sink.double(), c.topk_length)
    assert_spec_close("out", out, ref[0], TOL_PREFILL_OUT, c.describe())
    assert_spec_close("max_logits", max_logits, ref[1], TOL_PREFILL_STATS, c.describe())
    assert_spec_close("lse (natural log)", lse, ref[2], TOL_PREFILL_STATS, c.describe())


def test_sparse_fwd_positional_peer_signature():
    c = make_sparse_case(62, s_q=2, s_kv=10, h_q=2, d_qk=512, topk=4)
    out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, c.sm_scale)
    assert out.shape == (2, 2, 512) and lse.shape == (2, 2)


def test_sparse_fwd_refuses_unsupported_options():
    c = make_sparse_case(63, s_q=2, s_kv=10, h_q=2, d_qk=512, topk=4)
    with pytest.raises(NotImplementedError, match="indexer_topk"):
        flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, c.sm_scale, indexer_topk=512)
    with pytest.raises(ValueError, match="d_v"):
        flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, c.sm_scale, d_v=448)


def test_sparse_bwd_returns_dq_dkv_delta():
    c = make_sparse_case(64, s_q=4, s_kv=24, h_q=4, d_qk=576, topk=12, topk_length=True)
    out, _, lse = flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, c.sm_scale, topk_length=c.topk_length)
    do = (torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) / 10).to(torch.bfloat16)
    res = flash_mla.flash_mla_sparse_bwd(c.q, c.kv, out, do, c.indices, lse, c.sm_scale, 512, topk_length=c.topk_length)
    assert isinstance(res, tuple) and len(res) == 3
    dq, dkv, delta = res
    assert dq.shape == c.q.shape and dkv.shape == c.kv.shape and delta.shape == lse.shape
    from flashmla.reference import sparse_mla_backward_reference

    ref = sparse_mla_backward_reference(c.q, c.kv, out, do, c.indices, lse, c.sm_scale, None, c.topk_length)
    assert_spec_close("dq", dq, ref[0], TOL_BWD)
    assert_spec_close("dkv", dkv, ref[1], TOL_BWD)


def test_get_mla_metadata_old_and_new_call_styles():
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    for meta, none in (flash_mla.get_mla_metadata(), flash_mla.get_mla_metadata(seqlens, 4, 1)):
        assert isinstance(meta, flash_mla.FlashMLASchedMeta) and none is None
        assert not meta.have_initialized


def _dense_problem(seed, b=2, s_q=2, h_q=4, h_kv=1, d_qk=576, page=16, max_blocks=4, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    num_blocks = b * max_blocks + 1
    q = (torch.randn(b, s_q, h_q, d_qk, generator=g) / 10).to(dtype)
    k_cache = (torch.randn(num_blocks, page, h_kv, d_qk, generator=g) / 10).to(dtype)
    block_table = torch.randperm(num_blocks, generator=g)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    seqlens = torch.randint(0, max_blocks * page + 1, (b,), generator=g, dtype=torch.int32)
    seqlens[0] = 0 if b > 1 else seqlens[0]
    return q, k_cache, block_table, seqlens


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_with_kvcache_dense(causal, dtype):
    q, k_cache, block_table, seqlens = _dense_problem(70 + causal, b=3, h_q=4, h_kv=2, dtype=dtype)
    seqlens[1] = 1  # with causal and s_q 2: query 0 sees nothing
    meta, none = flash_mla.get_mla_metadata(seqlens, q.shape[1] * q.shape[2] // 2, 2)
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, none, causal=causal)
    assert out.dtype == dtype and out.shape == (3, 2, 4, 512) and lse.shape == (3, 4, 2)
    ref_out, ref_lse = dense_decode_reference(q, k_cache, block_table, seqlens, None, causal)
    assert_spec_close("out", out, ref_out, TOL_DECODE_OUT)
    assert_spec_close("lse", lse, ref_lse, TOL_DECODE_LSE)
    assert torch.all(out[0] == 0) and torch.all(torch.isposinf(lse[0])), "cache_seqlens 0: empty rows"
    # The metadata is reusable for the same configuration and refuses another one.
    flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, None, causal=causal)
    with pytest.raises(ValueError, match="causal"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, None, causal=not causal)


def test_with_kvcache_dense_sink_and_scale():
    q, k_cache, block_table, seqlens = _dense_problem(75, d_qk=512)
    sink = torch.randn(q.shape[2])
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, k_cache, block_table, seqlens, 512, meta, softmax_scale=0.05, attn_sink=sink
    )
    ref_out, ref_lse = dense_decode_reference(q, k_cache, block_table, seqlens, 0.05, False, sink)
    assert_spec_close("out", out, ref_out, TOL_DECODE_OUT)
    assert_spec_close("lse", lse, ref_lse, TOL_DECODE_LSE)


def _fp8_cache(seed, num_blocks, page, d_qk, pad_bytes=0):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(num_blocks, page, 1, d_qk, generator=g) / 10).to(torch.bfloat16)
    if pad_bytes:
        bpt = flashmla._ops.FP8_BYTES_PER_TOKEN[d_qk]
        storage = torch.full((num_blocks, page * bpt + pad_bytes), 0xAB, dtype=torch.uint8)
        cache = storage[:, : page * bpt].view(num_blocks, page, 1, bpt)
        flashmla.kv_quantize(kv, out=cache)
    else:
        cache = flashmla.kv_quantize(kv)
    values = flashmla.kv_dequantize(cache).reshape(num_blocks * page, d_qk)
    return cache, values


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("extra", [False, True])
def test_with_kvcache_sparse_fp8(d_qk, extra):
    g = torch.Generator().manual_seed(80 + d_qk + extra)
    b, s_q, h_q, topk, page = 2, 2, 8, 24, 16
    cache, values = _fp8_cache(81, 5, page, d_qk, pad_bytes=64)
    n_tokens = values.shape[0]
    q = (torch.randn(b, s_q, h_q, d_qk, generator=g) / 10).to(torch.bfloat16)
    indices = torch.randint(0, n_tokens, (b, s_q, topk), generator=g, dtype=torch.int32)
    indices[0, 0, ::3] = -1
    indices[1, 1, :] = -1  # a query without keys (unless the extra cache gives it some)
    topk_length = torch.tensor([topk, topk // 2], dtype=torch.int32)
    sink = torch.randn(h_q, generator=g)
    kw = {}
    ref_kw = {}
    if extra:
        e_cache, e_values = _fp8_cache(82, 3, 32, d_qk)
        e_idx = torch.randint(-1, e_values.shape[0], (b, s_q, 8), generator=g, dtype=torch.int32)
        e_len = torch.tensor([8, 0], dtype=torch.int32)
        kw = dict(extra_k_cache=e_cache, extra_indices_in_kvcache=e_idx, extra_topk_length=e_len)
        ref_kw = dict(extra_values=e_values, extra_indices=e_idx, extra_topk_length=e_len)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, cache, None, None, 512, meta, None, is_fp8_kvcache=True, indices=indices, attn_sink=sink,
        topk_length=topk_length, **kw,
    )
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == torch.bfloat16 and lse.shape == (b, h_q, s_q)
    ref_out, ref_lse = sparse_decode_reference(q, values, indices, topk_length, None, sink, **ref_kw)
    assert_spec_close("out", out, ref_out, TOL_DECODE_OUT)
    assert_spec_close("lse", lse, ref_lse, TOL_DECODE_LSE)


def test_with_kvcache_sparse_float8_cache_dtype():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    cache, values = _fp8_cache(90, 2, 16, 576)
    q = (torch.randn(1, 1, 4, 576) / 10).to(torch.bfloat16)
    idx = torch.arange(8, dtype=torch.int32).view(1, 1, 8)
    a = flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, None, is_fp8_kvcache=True, indices=idx)
    b = flash_mla.flash_mla_with_kvcache(
        q, cache.view(torch.float8_e4m3fn), None, None, 512, None, is_fp8_kvcache=True, indices=idx
    )
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_with_kvcache_misuse():
    q, k_cache, block_table, seqlens = _dense_problem(91)
    idx = torch.zeros(2, 2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="causal"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, None, causal=True, is_fp8_kvcache=True,
                                         indices=idx)
    with pytest.raises(ValueError, match="head_dim_v|d_v"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 576, None)
    with pytest.raises(ValueError, match="topk_length"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, None, topk_length=seqlens)
    with pytest.raises(NotImplementedError, match="FP8"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, None, is_fp8_kvcache=True)
    with pytest.raises(NotImplementedError, match="bf16 cache"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, None, indices=idx)
    with pytest.raises(TypeError, match="tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, torch.zeros(3))


def test_with_kvcache_metadata_fixes_the_configuration():
    """One FlashMLASchedMeta serves calls of one configuration: a grown cache pool (more blocks) or new lengths keep
    it; another head count, page size or causality is refused by name, as FlashMLA refuses it."""
    q, k_cache, block_table, seqlens = _dense_problem(92)
    meta, _ = flash_mla.get_mla_metadata()
    flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta)
    assert meta.have_initialized and meta.config.b == 2 and meta.config.h_q == 4 and meta.config.page_block_size == 16
    bigger_pool = torch.cat([k_cache, k_cache[:3]])
    flash_mla.flash_mla_with_kvcache(q, bigger_pool, block_table, seqlens.flip(0), 512, meta)
    with pytest.raises(ValueError, match="h_q=4 but this call has h_q=2"):
        flash_mla.flash_mla_with_kvcache(q[:, :, :2], k_cache, block_table, seqlens, 512, meta)
    with pytest.raises(ValueError, match="causal=False but this call has causal=True"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, causal=True)
    # The refused calls leave the metadata as it was.
    flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta)


def test_dense_prefill_compat_packed_forms_and_options():
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    qkv = (torch.randn(12, 2, 192 * 2 + 128, generator=g) / 4).to(torch.bfloat16)
    q, k, v = qkv[:, :, :192], qkv[:, :, 192:384], qkv[:, :, 384:]
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
    assert out.shape == (12, 2, 128) and lse.shape == (12, 2)
    packed = flash_mla.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, 192, causal=True)
    kvp = flash_mla.flash_attn_varlen_kvpacked_func(q, qkv[:, :, 192:], cu, cu, 7, 7, 192, causal=True)
    for o, l in (packed, kvp):
        assert torch.equal(o, out) and torch.equal(l, lse)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_mla.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, dropout_p=0.1)
    with pytest.raises(TypeError, match="`q`"):
        flash_mla.flash_attn_varlen_func(None, k, v, cu, cu, 7, 7)


@pytest.mark.parametrize("d_qk", [576, 512])
def test_kv_quant_roundtrip(d_qk):
    g = torch.Generator().manual_seed(d_qk)
    kv = (torch.randn(3, 16, 1, d_qk, generator=g) * 3).to(torch.bfloat16)
    cache = flashmla.kv_quantize(kv)
    assert cache.dtype == torch.uint8 and cache.shape == (3, 16, 1, flashmla._ops.FP8_BYTES_PER_TOKEN[d_qk])
    back = flashmla.kv_dequantize(cache)
    assert back.shape == kv.shape and back.dtype == torch.bfloat16
    rope = slice(d_qk - 64, d_qk)
    assert torch.equal(back[..., rope], kv[..., rope]), "RoPE values are stored unquantised"
    nope_err = (back[..., : d_qk - 64].float() - kv[..., : d_qk - 64].float()).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, plus the power-of-two scale rounding.
    assert (nope_err <= kv[..., : d_qk - 64].float().abs() / 8 + 1e-2).all()
    a, b = back.double().flatten(), kv.double().flatten()
    assert 1 - (a @ b) / (a.norm() * b.norm()) < 1e-3


def test_kv_quantize_into_padded_cache_keeps_gaps():
    kv = (torch.randn(3, 16, 1, 576) / 10).to(torch.bfloat16)
    packed = flashmla.kv_quantize(kv)
    bpt, pad = 656, 100
    storage = torch.full((3, 16 * bpt + pad), 0x5A, dtype=torch.uint8)
    cache = storage[:, : 16 * bpt].view(3, 16, 1, bpt)
    assert not cache.is_contiguous()
    res = flashmla.kv_quantize(kv, out=cache)
    assert res is cache
    assert torch.equal(cache, packed)
    assert torch.all(storage[:, 16 * bpt :] == 0x5A), "bytes between blocks must be left untouched"
    assert torch.equal(flashmla.kv_dequantize(cache), flashmla.kv_dequantize(packed))

