//! `flashmla._native`: the PyO3 extension module behind the `flashmla` Python package (`python/flashmla/`).
//!
//! Bindings only: one entry point per op that takes torch tensors, reads their metadata through the tensor
//! protocol (see the `tensor` module), allocates the outputs through torch and runs on torch's current stream; the
//! Python layer owns the rest of what is torch-specific (autograd, `torch.library` registration, `torch.compile`). The
//! module does not link torch: it calls the torch Python API it is handed. Built with the stable ABI (abi3,
//! CPython 3.9+) by maturin from the repository's `pyproject.toml`.
//!
//! Errors: see the `errors` module for how `flashmla::Error` maps to Python exceptions; no panic reaches Python.

mod errors;
mod gpu;
mod interrupt;
mod ops;
mod shim;
mod tensor;

use pyo3::prelude::*;

/// Rust core of flashmla (import `flashmla`, not this module).
#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NVCC_VERSION", flashmla::cuda::NVCC_VERSION)?;
    m.add("KERNEL_ARCH", flashmla::cuda::KERNEL_ARCH)?;
    m.add_function(wrap_pyfunction!(ops::sparse_fwd_check, m)?)?;
    m.add_function(wrap_pyfunction!(ops::sparse_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::sparse_bwd_check, m)?)?;
    m.add_function(wrap_pyfunction!(ops::sparse_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::decode_dense_check, m)?)?;
    m.add_function(wrap_pyfunction!(ops::decode_dense, m)?)?;
    m.add_function(wrap_pyfunction!(ops::decode_sparse_check, m)?)?;
    m.add_function(wrap_pyfunction!(ops::decode_sparse, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dense_prefill_fwd_check, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dense_prefill_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dense_prefill_bwd_check, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dense_prefill_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::kv_quantize_check, m)?)?;
    m.add_function(wrap_pyfunction!(ops::kv_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(ops::kv_dequantize_check, m)?)?;
    m.add_function(wrap_pyfunction!(ops::kv_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(ops::kernels_built, m)?)?;
    m.add_function(wrap_pyfunction!(ops::release_workspaces, m)?)?;
    m.add_function(wrap_pyfunction!(ops::torch_shim, m)?)?;
    Ok(())
}
