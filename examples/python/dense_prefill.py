"""Dense MHA prefill over packed sequences of different lengths (the MHA form of MLA: q/k of 192 = 128 NoPE + 64
RoPE, v of 128; causal; GQA), with autograd: forward and backward against a pure-torch float64 reference per
sequence, then one optimiser step on the projections that produce q, k and v.

Runs on a Hopper GPU when there is one (the sm_90a kernels), else on the CPU (flashmla's reference)::

    python examples/python/dense_prefill.py             # --device cpu to force the CPU
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import flashmla

H_Q, H_K, D, D_V = 8, 2, 192, 128
LENGTHS = [(37, 37), (0, 5), (100, 140), (64, 64)]  # (queries, keys) per sequence: an empty one, a longer context


def default_device() -> str:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return "cuda"
    return "cpu"


def reference(q, k, v, cu_q, cu_k):
    """Per sequence and head in float64, bottom-right causal; rows that see no key give 0."""
    out = torch.zeros(q.shape[0], H_Q, D_V, dtype=torch.float64, device=q.device)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        s_q, s_k = q1 - q0, k1 - k0
        if s_q == 0 or s_k == 0:
            continue
        qs = q[q0:q1].double().transpose(0, 1)  # [h, s_q, d]
        ks = k[k0:k1].double().repeat_interleave(H_Q // H_K, dim=1).transpose(0, 1)
        vs = v[k0:k1].double().repeat_interleave(H_Q // H_K, dim=1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) / math.sqrt(D)
        r = torch.arange(s_q, device=q.device)[:, None]
        c = torch.arange(s_k, device=q.device)[None, :]
        s = s.masked_fill(c > r + s_k - s_q, -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with every key masked -> 0
        out[q0:q1] = (p @ vs).transpose(0, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.manual_seed(0)

    cu_q = torch.tensor([0] + [sum(a for a, _ in LENGTHS[: i + 1]) for i in range(len(LENGTHS))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(b for _, b in LENGTHS[: i + 1]) for i in range(len(LENGTHS))], dtype=torch.int32)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    x_q = torch.randn(total_q, 256, device=dev, dtype=torch.bfloat16)
    x_k = torch.randn(total_k, 256, device=dev, dtype=torch.bfloat16)
    w_q = (torch.randn(256, H_Q * D, device=dev) / 16).bfloat16().requires_grad_(True)
    w_k = (torch.randn(256, H_K * D, device=dev) / 16).bfloat16().requires_grad_(True)
    w_v = (torch.randn(256, H_K * D_V, device=dev) / 16).bfloat16().requires_grad_(True)
    cu_q, cu_k = cu_q.to(dev), cu_k.to(dev)

    def attend(attention):
        q = (x_q @ w_q).view(total_q, H_Q, D)
        k = (x_k @ w_k).view(total_k, H_K, D)
        v = (x_k @ w_v).view(total_k, H_K, D_V)
        return attention(q, k, v)

    out = attend(lambda q, k, v: flashmla.dense_prefill(q, k, v, cu_q, cu_k, causal=True)[0])
    loss = out.float().square().mean()
    loss.backward()
    grads = [w.grad.double() for w in (w_q, w_k, w_v)]

    for w in (w_q, w_k, w_v):
        w.grad = None
    want = attend(lambda q, k, v: reference(q, k, v, cu_q, cu_k))
    want.square().mean().backward()
    ok = True
    out_err = (out.double() - want.detach()).abs().max().item()
    print(f"dense prefill on {dev}: {len(LENGTHS)} sequences, {total_q} query rows, out max |err| {out_err:.2e}")
    ok &= out_err < 3e-2
    for name, got, w in zip(("w_q", "w_k", "w_v"), grads, (w_q, w_k, w_v)):
        ref = w.grad.double()
        rel = ((got - ref).norm() / ref.norm()).item()
        print(f"  grad {name}: relative error {rel:.2e}")
        ok &= rel < 3e-2

    # One optimiser step with flashmla's gradients: the loss goes down.
    with torch.no_grad():
        for w, g in zip((w_q, w_k, w_v), grads):
            w -= (0.5 * g).to(w.dtype)
    after = attend(lambda q, k, v: flashmla.dense_prefill(q, k, v, cu_q, cu_k, causal=True)[0]).float().square().mean()
    print(f"  loss {loss.item():.5f} -> {after.item():.5f} after one step")
    ok &= after.item() < loss.item()
    print("ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
