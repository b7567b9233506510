"""The installed package: where it comes from, what the wheel embeds, thread use."""

import os
import threading

import pytest
import torch

import flashmla
from mla_cases import make_sparse_case


def test_imports_the_installed_wheel():
    if os.environ.get("FLASHMLA_TEST_INSTALLED") != "1":
        pytest.skip("set by scripts/python-test.sh, which installs the wheel")
    assert "site-packages" in flashmla.__file__, flashmla.__file__


def test_version_and_build_info():
    assert flashmla.__version__.count(".") == 2
    built = flashmla.kernels_built()
    assert "sparse_fwd" in built and "kv_quant" in built
    if os.environ.get("FLASHMLA_EXPECT_KERNELS") == "1":
        assert all(built.values()), f"the wheel must embed every cubin: {built}"
        assert flashmla._native.NVCC_VERSION


def test_outputs_come_from_torchs_c_shim():
    """With the torch the project pins, outputs are made through torch's C shim (one Python call per op, not one per
    output): a silent fallback would cost several microseconds per output. The shim's tensors are ordinary ones."""
    if os.environ.get("FLASHMLA_TORCH_SHIM") == "0":
        pytest.skip("turned off by FLASHMLA_TORCH_SHIM=0")
    if torch.__version__.split("+")[0] != "2.11.0":
        pytest.skip(f"the shim is checked with the pinned torch 2.11.0, not {torch.__version__}")
    assert flashmla._native.torch_shim()
    case = make_sparse_case(5, s_q=3, s_kv=32, h_q=4, d_qk=576, topk=16)
    with torch.inference_mode():
        out, max_logits, lse = flashmla.sparse_fwd(*case.args())
        assert out.is_inference()
    for t, shape, dtype in [(out, (3, 4, 512), torch.bfloat16), (max_logits, (3, 4), torch.float32), (lse, (3, 4), torch.float32)]:
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device == case.q.device
        assert not t.requires_grad and t.grad_fn is None
    out2, _, _ = flashmla.sparse_fwd(*case.args())
    assert torch.equal(out, out2) and not out2.is_inference()


def test_release_workspaces_without_cuda_decodes_is_zero():
    """CPU decodes keep no workspace: there is nothing to release."""
    q = torch.zeros(1, 1, 4, 576, dtype=torch.bfloat16)
    cache = torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16)
    flashmla.decode_dense(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.full((1,), 5, dtype=torch.int32))
    if not torch.cuda.is_available():
        assert flashmla.release_workspaces() == 0


def test_concurrent_calls_from_threads():
    """The GIL is released during a call; concurrent calls on separate inputs give the serial results."""
    cases = [make_sparse_case(70 + i, s_q=4, s_kv=32, h_q=4, d_qk=576, topk=16) for i in range(4)]
    serial = [flashmla.sparse_fwd(*c.args())[0] for c in cases]
    results = [None] * len(cases)

    def work(i):
        results[i] = flashmla.sparse_fwd(*cases[i].args())[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(results, serial):
        assert torch.equal(a, b)

