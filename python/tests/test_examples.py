"""Every Python example under examples/python runs to completion (on a Hopper GPU where there is one, else on
the CPU) and passes its own checks; a new example is picked up without editing this file."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python"

#: Extra arguments per example: the context-parallel one starts two processes itself here (torchrun elsewhere),
#: on two GPUs where there are, else on the CPU, and checks its first step against a single process.
ARGS = {
    "context_parallel.py": ["--nproc", "2", "--check", "--steps", "2"]
    + ([] if torch.cuda.device_count() >= 2 else ["--device", "cpu"])
}
#: Seconds an example may take on a loaded CI machine.
TIMEOUT_S = 600


def example_scripts():
    return sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_examples_exist():
    assert {"sparse_attention.py", "kv_cache_decode.py", "context_parallel.py"} <= set(example_scripts())


@pytest.mark.parametrize("name", example_scripts())
def test_example_runs(name):
    cmd = [sys.executable, str(EXAMPLES / name), *ARGS.get(name, [])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert res.stdout.strip(), f"{name} printed nothing"
