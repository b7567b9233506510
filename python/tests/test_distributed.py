"""The context-parallel training step of examples/python/context_parallel.py against the single-process run.

Query tokens sharded across ranks, KV rows all-gathered, their gradient reduce-scattered: the loss and every
parameter gradient must match one process running the whole sequence, within the backward's tolerance of
docs/spec.md section 6. On the CPU: two gloo processes on flashmla's CPU reference (CI). On a machine with two
CUDA devices: two NCCL processes against one GPU (skipped otherwise).

The kernel returns a bf16 ``d_kv``: each rank rounds its partial sum of a row's gradient before the
reduce-scatter adds them, where one process rounds the whole sum once. That difference (about one bf16 ulp of
the partials) is what separates ``w_kv.grad`` from the single-process value; the other gradients agree to float32
rounding.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mla_cases import TOL_BWD, TOL_PREFILL_STATS, assert_spec_close

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python"
# On sys.path before the import so that the spawned ranks (which receive this process's sys.path) find it too.
sys.path.insert(0, str(EXAMPLES))
import context_parallel as cp  # noqa: E402

#: Small enough for the CPU reference in two processes (seconds); causal top-k over 2 x 32 tokens.
CPU_CONFIG = cp.Config(tokens_per_rank=32, hidden=32, heads=16, d_qk=576, topk=32, seed=11)
#: A shape the GPU kernels serve in both pipelines' range, with every rank's queries reading the other's rows.
GPU_CONFIG = cp.Config(tokens_per_rank=512, hidden=64, heads=64, d_qk=576, topk=256, seed=12)


def _exit_after(rank: int, fn, *args) -> None:
    """Runs a rank's work, then ends the process without the interpreter's teardown: gloo's transport threads can
    abort a finished process there (``terminate called without an active exception``, seen once in CI),
    which ``mp.spawn`` would report as a failed rank. An exception from ``fn`` still fails the rank."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(tmp_path: Path, world: int, backend: str, cfg: cp.Config):
    """Runs one sharded step in ``world`` spawned processes; returns each rank's loss and gradients."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_exit_after, args=(cp.run_rank, world, init, backend, cfg, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def check_against_single_process(results, cfg: cp.Config, world: int, device: torch.device):
    params, batch = cp.make_problem(cfg, world)
    ref_loss, ref_grads = cp.single_process_step(params, batch, device)
    assert set(results[0]["grads"]) == set(ref_grads)
    for rank, res in enumerate(results):
        ctx = f"(rank {rank} of {world})"
        assert_spec_close("loss", res["loss"].reshape(1), ref_loss.reshape(1), TOL_PREFILL_STATS, ctx)
        for name, ref in ref_grads.items():
            got = res["grads"][name]
            assert got.abs().max() > 0, f"{name}.grad is zero {ctx}"
            assert_spec_close(f"{name}.grad", got, ref, TOL_BWD, ctx)
            # The gradients are all-reduced: every rank holds the same values.
            assert torch.equal(got, results[0]["grads"][name]), f"{name}.grad differs between ranks {ctx}"


def test_gather_tokens_gradient_is_the_sum_of_every_rank_s_partial(tmp_path):
    """Without flashmla: the Function's backward hands each rank the sum over ranks of its rows' gradients."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_exit_after, args=(_gather_worker, 2, init, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"gather{rank}.pt")
        # Rank r's rows are rows [2r, 2r + 2) of the gathered [4, 3] tensor; rank s weighs the gathered rows by
        # (s + 1) * (row + 1), so the gradient of row j is (1 + 2) * (j + 1).
        rows = torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32)
        want = (3 * (rows + 1))[:, None].expand(2, 3)
        assert torch.equal(got["grad"], want), got
        assert torch.equal(got["full"], torch.arange(4, dtype=torch.float32)[:, None].expand(4, 3) + 10)


def _gather_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        local = (torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32)[:, None] + 10).expand(2, 3).clone()
        local.requires_grad_()
        full = cp.GatherTokens.apply(local, None)
        weights = (rank + 1) * (torch.arange(4, dtype=torch.float32)[:, None] + 1)
        (full * weights).sum().backward()
        torch.save({"grad": local.grad, "full": full.detach()}, f"{out_dir}/gather{rank}.pt")
        dist.barrier()  # as in context_parallel.run_rank: no rank tears down while another still talks to it
    finally:
        dist.destroy_process_group()


def test_two_cpu_processes_match_one(tmp_path):
    results = run_ranks(tmp_path, 2, "gloo", CPU_CONFIG)
    check_against_single_process(results, CPU_CONFIG, 2, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_match_one_gpu(tmp_path):
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    results = run_ranks(tmp_path, 2, "nccl", GPU_CONFIG)
    check_against_single_process(results, GPU_CONFIG, 2, torch.device("cuda", 0))
