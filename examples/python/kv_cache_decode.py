"""Decode over a paged FP8 KV cache: latent KV rows are quantised into the DeepSeek V3.2 cache layout (656 bytes
per token: 512 e4m3 values, four float32 scales, 64 bf16 RoPE values), read by a sparse FP8 decode, and checked
against a dense decode over the dequantised rows through a block table.

The cache codec runs on a Hopper GPU when there is one; an op without a GPU kernel in this build raises
NotImplementedError, and this example then runs that op on the CPU::

    python examples/python/kv_cache_decode.py             # --device cpu to force the CPU
"""

from __future__ import annotations

import argparse
import sys

import torch

import flashmla

NUM_BLOCKS, PAGE_SIZE, D_QK = 16, 64, 576
BATCH, S_Q, H_Q = 4, 2, 64  # s_q 2: one speculative token per request


def default_device() -> str:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return "cuda"
    return "cpu"


def on_device_or_cpu(name: str, fn, *tensors, **kwargs):
    """Runs ``fn`` on the given tensors; if this build has no GPU kernel for it, on CPU copies instead."""
    try:
        return fn(*tensors, **kwargs)
    except NotImplementedError as e:
        print(f"  {name}: {e}; running it on the CPU")
        cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in tensors]
        return fn(*cpu, **kwargs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.manual_seed(0)

    # 1. The FP8 cache: quantise every block of latent rows, then read it back.
    kv = (torch.randn(NUM_BLOCKS, PAGE_SIZE, 1, D_QK, device=dev) * 0.5).bfloat16()
    cache = flashmla.kv_quantize(kv)
    restored = flashmla.kv_dequantize(cache)
    err = ((restored.float() - kv.float()).abs().amax(-1) / kv.float().abs().amax(-1)).max().item()
    print(f"FP8 cache on {dev}: {tuple(cache.shape)} {cache.dtype}; worst token error {err:.3f} of its largest value")
    # RoPE columns (the last 64) are stored in bf16 and come back exactly.
    assert torch.equal(restored[..., 512:], kv[..., 512:])

    # 2. Requests own shuffled blocks; request r has seqlens[r] tokens.
    block_table = torch.randperm(NUM_BLOCKS, device=dev).to(torch.int32).view(BATCH, NUM_BLOCKS // BATCH)
    seqlens = torch.tensor([256, 1, 130, 200], dtype=torch.int32, device=dev)
    q = torch.randn(BATCH, S_Q, H_Q, D_QK, device=dev).bfloat16()

    # Sparse decode indices name cache tokens (block * PAGE_SIZE + offset); here every token of the request, in
    # order, padded with -1 (ignored).
    topk = 256
    pos = torch.arange(topk, device=dev)
    token = block_table.long().gather(1, (pos // PAGE_SIZE).expand(BATCH, -1)) * PAGE_SIZE + pos % PAGE_SIZE
    token = torch.where(pos < seqlens[:, None], token, torch.full_like(token, -1))
    indices = token.to(torch.int32)[:, None, :].expand(BATCH, S_Q, topk).contiguous()

    out, lse = on_device_or_cpu("decode_sparse", flashmla.decode_sparse, q, cache, indices)
    ref_out, ref_lse = on_device_or_cpu(
        "decode_dense", flashmla.decode_dense, q, restored, block_table, seqlens
    )
    print(f"sparse FP8 decode: out {tuple(out.shape)}, lse {tuple(lse.shape)}")
    d_out = (out.float() - ref_out.float().to(out.device)).abs().max().item()
    d_lse = (lse - ref_lse.to(lse.device)).abs().max().item()
    print(f"  against the dense decode of the dequantised rows: max |d out| {d_out:.1e}, max |d lse| {d_lse:.1e}")
    if not (d_out < 1e-2 and d_lse < 1e-4):
        print("FAILED: the sparse FP8 and the dense decode differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
