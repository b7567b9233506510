"""Context-parallel sparse-MLA training over N processes with torch.distributed (NCCL on GPUs, gloo on the CPU).

The sequence is split into contiguous token slices, one per rank: rank ``r`` holds tokens ``[r*n, (r+1)*n)``,
their hidden states, and so their queries and their latent KV rows. A token's sparse attention may read any
earlier row of the whole sequence, so each rank all-gathers the KV rows before attending with its own queries.
In the backward, each rank holds the gradient of every KV row coming from its own queries only: a reduce-scatter
sums these partial gradients and leaves each rank the slice of its own rows (the custom autograd Function
``GatherTokens``). Replicated parameters' gradients are summed across ranks, as DistributedDataParallel would.

The model is deliberately small: ``q = x W_q``, ``kv = x W_kv`` (bf16), ``out = flashmla.sparse_mla(q, kv,
indices, attn_sink)``, ``y = out W_o``, loss = mean squared error against a fixed target; causal top-k indices.

Run (GPUs: one process per GPU, NCCL; the CPU: flashmla's CPU reference over gloo, seconds)::

    torchrun --nproc-per-node 2 examples/python/context_parallel.py
    python examples/python/context_parallel.py --nproc 2 --device cpu

``--check`` compares the first step's loss and gradients with a single-process run of the whole sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashmla

Tensor = torch.Tensor
Params = Dict[str, Tensor]


@dataclasses.dataclass
class Config:
    """Shapes of the toy model; the sequence has ``tokens_per_rank * world_size`` tokens."""

    tokens_per_rank: int = 64
    hidden: int = 64
    heads: int = 64
    d_qk: int = 576
    topk: int = 64
    steps: int = 3
    lr: float = 1e-4
    seed: int = 0


#: Shapes that finish in seconds on the CPU reference, and a step that keeps an H100 busy for milliseconds.
CPU_CONFIG = Config()
GPU_CONFIG = Config(tokens_per_rank=2048, hidden=256, heads=128, topk=2048, steps=10)


class GatherTokens(torch.autograd.Function):
    """All-gathers every rank's rows along dim 0 in rank order; the backward reduce-scatters the gradient.

    Each rank's gradient of the gathered tensor is a partial sum (from its own queries); the reduce-scatter adds
    the partials of every rank and returns to each rank the rows it contributed. The sum runs in float32 so that
    N bf16 partials are not rounded N times.
    """

    @staticmethod
    def forward(ctx, local: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        full = local.new_empty((world * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(full, local.contiguous(), group=group)
        return full

    @staticmethod
    def backward(ctx, grad_full: Tensor) -> Tuple[Tensor, None]:
        world = dist.get_world_size(ctx.group)
        partial = grad_full.float().contiguous()
        mine = partial.new_empty((partial.shape[0] // world, *partial.shape[1:]))
        dist.reduce_scatter_tensor(mine, partial, op=dist.ReduceOp.SUM, group=ctx.group)
        return mine.to(grad_full.dtype), None


def causal_topk_indices(seq_len: int, topk: int, generator: torch.Generator, rows_per_chunk: int = 1024) -> Tensor:
    """``[seq_len, 1, topk]`` int32: token ``t`` picks ``min(topk, t + 1)`` distinct random rows of ``[0, t]``;
    the other entries are -1 (ignored by the op). Stands in for a learned indexer's choice."""
    out = torch.empty((seq_len, topk), dtype=torch.int32)
    cols = torch.arange(seq_len)
    for t0 in range(0, seq_len, rows_per_chunk):
        t1 = min(t0 + rows_per_chunk, seq_len)
        scores = torch.rand((t1 - t0, seq_len), generator=generator)
        future = cols[None, :] > torch.arange(t0, t1)[:, None]
        scores[future] = -1.0
        k = min(topk, seq_len)
        vals, idx = scores.topk(k, dim=1)
        idx[vals < 0] = -1
        out[t0:t1, :k] = idx.to(torch.int32)
        out[t0:t1, k:] = -1
    return out.view(seq_len, 1, topk)


def make_problem(cfg: Config, world: int) -> Tuple[Params, Dict[str, Tensor]]:
    """Initial parameters and the whole sequence's batch, identical on every rank (seeded, made on the CPU)."""
    g = torch.Generator().manual_seed(cfg.seed)
    s = cfg.tokens_per_rank * world

    def randn(*shape, std):
        return torch.randn(shape, generator=g) * std

    # Scales that keep q . k * d_qk**-0.5 near unit variance, so that attention is neither uniform nor one-hot.
    params = {
        "w_q": randn(cfg.hidden, cfg.heads * cfg.d_qk, std=cfg.hidden**-0.5),
        "w_kv": randn(cfg.hidden, cfg.d_qk, std=cfg.hidden**-0.5),
        "w_o": randn(cfg.heads * flashmla.D_V, cfg.hidden, std=(cfg.heads * flashmla.D_V) ** -0.5),
        "attn_sink": torch.zeros(cfg.heads),
    }
    batch = {
        "x": randn(s, cfg.hidden, std=1.0),
        "target": randn(s, cfg.hidden, std=1.0),
        "indices": causal_topk_indices(s, cfg.topk, g),
    }
    return params, batch


def loss_on_tokens(
    params: Params, x: Tensor, target: Tensor, indices: Tensor, total_tokens: int, gather: Callable[[Tensor], Tensor]
) -> Tensor:
    """This rank's share of the loss: its tokens' squared errors over the whole sequence's element count, so that
    the ranks' shares add up to the mean. ``gather`` turns the local KV rows into the whole sequence's."""
    s, hidden = x.shape
    d_qk = params["w_kv"].shape[1]
    heads = params["w_q"].shape[1] // d_qk
    q = (x @ params["w_q"]).view(s, heads, d_qk).to(torch.bfloat16)
    kv = gather((x @ params["w_kv"]).view(s, 1, d_qk).to(torch.bfloat16))
    out = flashmla.sparse_mla(q, kv, indices, attn_sink=params["attn_sink"])
    y = out.flatten(1).float() @ params["w_o"]
    return ((y - target) ** 2).sum() / (total_tokens * hidden)


def single_process_step(params: Params, batch: Dict[str, Tensor], device: torch.device) -> Tuple[Tensor, Params]:
    """Loss and gradients of the whole sequence in one process (the reference for the sharded step)."""
    p = {k: v.detach().to(device).requires_grad_() for k, v in params.items()}
    b = {k: v.to(device) for k, v in batch.items()}
    loss = loss_on_tokens(p, b["x"], b["target"], b["indices"], b["x"].shape[0], lambda kv: kv)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in p.items()}


def sharded_step(params: Params, batch: Dict[str, Tensor], group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Forward and backward of this rank's token slice; leaves the summed gradients in ``params[...].grad`` and
    returns the whole sequence's loss (on every rank)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    total = batch["x"].shape[0]
    n = total // world
    mine = slice(rank * n, (rank + 1) * n)
    loss = loss_on_tokens(
        params,
        batch["x"][mine],
        batch["target"][mine],
        batch["indices"][mine],
        total,
        lambda kv: GatherTokens.apply(kv, group),
    )
    loss.backward()
    for p in params.values():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)
    return loss


def device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_rank(rank: int, world: int, init_method: str, backend: str, cfg: Config, out_dir: str) -> None:
    """One rank of one training step (for tests): saves the loss and the summed gradients to ``out_dir``."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        device = device_for(backend, rank)
        params, batch = make_problem(cfg, world)
        params = {k: v.to(device).requires_grad_() for k, v in params.items()}
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = sharded_step(params, batch)
        result = {"loss": loss.cpu(), "grads": {k: v.grad.cpu() for k, v in params.items()}}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # Every rank's collectives are done before any tears its process group down (gloo's transport threads
        # could otherwise still be talking to a rank that is exiting).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def compare(got: Tensor, want: Tensor) -> Tuple[float, float]:
    """Largest absolute difference and ``1 - cosine similarity`` of two tensors."""
    a, b = got.double().flatten().cpu(), want.double().flatten().cpu()
    cos = float((a @ b) / (a.norm() * b.norm())) if a.norm() > 0 and b.norm() > 0 else float(torch.equal(a, b))
    return float((a - b).abs().max()), 1.0 - cos


def train(cfg: Config, backend: str, check: bool) -> int:
    """The training loop on an initialised process group; returns an exit status."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for(backend, int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    params0, batch = make_problem(cfg, world)
    params = {k: v.to(device).requires_grad_() for k, v in params0.items()}
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.Adam(params.values(), lr=cfg.lr)
    if rank == 0:
        s = cfg.tokens_per_rank * world
        print(
            f"context parallel over {world} ranks ({backend}, {device.type}): {s} tokens, {cfg.tokens_per_rank} per rank;"
            f" h_q {cfg.heads}, d_qk {cfg.d_qk}, topk {cfg.topk}"
        )
    status = 0
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        loss = sharded_step(params, batch)
        if step == 0 and check:
            status = check_first_step(loss, params, params0, batch, device)
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}")
    return status


def check_first_step(loss: Tensor, params: Params, params0: Params, batch: Dict[str, Tensor], device) -> int:
    """Rank 0 runs the whole sequence in one process and compares; every rank returns the verdict."""
    ok = torch.ones((), device=device)
    if dist.get_rank() == 0:
        ref_loss, ref_grads = single_process_step(params0, batch, device)
        rel = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
        print(f"check: loss {loss.item():.7f}, single process {ref_loss.item():.7f} (relative difference {rel:.1e})")
        good = rel < 1e-4
        for k, g in ref_grads.items():
            err, cos_diff = compare(params[k].grad, g)
            print(f"check: {k}.grad max abs difference {err:.2e}, 1 - cos {cos_diff:.1e}")
            good &= cos_diff < 1e-5
        print("check: " + ("the sharded step matches the single-process step" if good else "MISMATCH"))
        ok.fill_(float(good))
    dist.broadcast(ok, src=0)
    return 0 if bool(ok.item()) else 1


def spawned_main(rank: int, world: int, init_method: str, backend: str, cfg: Config, check: bool) -> None:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        status = train(cfg, backend, check)
    finally:
        dist.destroy_process_group()
    if status:
        sys.exit(status)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    ap.add_argument("--nproc", type=int, default=2, help="processes to start without torchrun (default 2)")
    ap.add_argument("--check", action="store_true", help="compare step 0 with a single-process run")
    for field in dataclasses.fields(Config):
        ap.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), help=f"default {field.default} on the CPU")
    args = ap.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    backend = "nccl" if use_cuda else "gloo"
    base = GPU_CONFIG if use_cuda else CPU_CONFIG
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if getattr(args, f.name) is not None}
    cfg = dataclasses.replace(base, **overrides)

    if "WORLD_SIZE" in os.environ:  # started by torchrun: one process per rank, rendezvous from the environment
        dist.init_process_group(backend)
        try:
            return train(cfg, backend, args.check)
        finally:
            dist.destroy_process_group()
    if use_cuda and torch.cuda.device_count() < args.nproc:
        print(f"--nproc {args.nproc} needs as many CUDA devices; found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        try:
            mp.spawn(spawned_main, args=(args.nproc, init, backend, cfg, args.check), nprocs=args.nproc, join=True)
        except mp.ProcessExitedException as e:
            print(f"context_parallel: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
