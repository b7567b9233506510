"""Sparse MLA prefill with autograd: forward and backward through ``flashmla.sparse_mla``, checked against the
pure-torch reference (``flashmla.reference``, float32), then one optimiser step.

Runs on a Hopper GPU when there is one (the sm_90a kernels), otherwise on the CPU (flashmla's CPU reference; a
shape that takes seconds)::

    python examples/python/sparse_attention.py            # --device cpu to force the CPU
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import flashmla
from flashmla.reference import sparse_mla_reference

#: (s_q, s_kv, h_q, d_qk, topk) per device: DeepSeek V3.2 widths (d_qk = 512 NoPE + 64 RoPE, d_v = 512).
SHAPES = {"cpu": (32, 1024, 64, 576, 256), "cuda": (1024, 8192, 128, 576, 512)}


def default_device() -> str:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return "cuda"
    return "cpu"


def random_indices(s_q: int, s_kv: int, topk: int, device) -> torch.Tensor:
    """``[s_q, 1, topk]`` int32: distinct random rows per token; the last 8 entries of each row are -1 (unused)."""
    idx = torch.rand(s_q, s_kv, device=device).topk(topk, dim=1).indices.to(torch.int32)
    idx[:, -8:] = -1
    return idx.view(s_q, 1, topk)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` over the whole tensor (Frobenius norms)."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    s_q, s_kv, h_q, d_qk, topk = SHAPES[args.device]
    torch.manual_seed(0)

    q = torch.randn(s_q, h_q, d_qk, device=dev).bfloat16().requires_grad_()
    kv = torch.randn(s_kv, 1, d_qk, device=dev).bfloat16().requires_grad_()
    sink = torch.zeros(h_q, device=dev, requires_grad=True)  # per-head sink logit, learnable
    indices = random_indices(s_q, s_kv, topk, dev)
    d_out = torch.randn(s_q, h_q, flashmla.D_V, device=dev).bfloat16()
    print(f"sparse_mla on {dev}: s_q={s_q} s_kv={s_kv} h_q={h_q} d_qk={d_qk} topk={topk}")

    t0 = time.perf_counter()
    out, lse = flashmla.sparse_mla(q, kv, indices, attn_sink=sink, return_lse=True)
    out.backward(d_out)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"  forward + backward: {time.perf_counter() - t0:.3f} s (the first call: on a GPU it also loads the kernels)")

    # The same function in float32 pure torch (gather, softmax, einsum), differentiated by autograd.
    q32, kv32, sink32 = (t.detach().float().requires_grad_() for t in (q, kv, sink))
    ref_out, _, ref_lse = sparse_mla_reference(q32, kv32, indices, d_qk**-0.5, sink32)
    ref_out.backward(d_out.float())
    errors = {
        "out": relative_error(out, ref_out),
        "lse": relative_error(lse, ref_lse),
        "q.grad": relative_error(q.grad, q32.grad),
        "kv.grad": relative_error(kv.grad, kv32.grad),
        "sink.grad": relative_error(sink.grad, sink32.grad),
    }
    for name, err in errors.items():
        print(f"  {name}: relative error to the float32 reference {err:.1e}")
    # bf16 outputs and gradients: about 2^-9 relative rounding each.
    bad = [name for name, err in errors.items() if not err < 1e-2]
    if bad:
        print(f"FAILED: {bad} differ from the reference", file=sys.stderr)
        return 1

    # The op is an ordinary differentiable function: any optimiser can step on its inputs' gradients.
    opt = torch.optim.SGD([q, kv, sink], lr=0.1)
    opt.step()
    print(f"  after one SGD step: sink[:4] = {[round(v, 4) for v in sink[:4].tolist()]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
