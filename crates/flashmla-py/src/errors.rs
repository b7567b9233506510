//! How library errors and Rust panics become Python exceptions.
//!
//! | `flashmla::Error` | Python |
//! | --- | --- |
//! | `InvalidArgument` whose argument ends in `.dtype` | `TypeError` |
//! | other `InvalidArgument` | `ValueError` |
//! | `Unsupported` | `NotImplementedError` |
//! | `OutOfHostMemory` | `MemoryError` |
//! | `Interrupted` | `KeyboardInterrupt` |
//! | `Cuda`, `NoGpu`, `KernelsNotBuilt`, `UnsupportedDevice`, anything newer | `RuntimeError` |
//!
//! The message is always the error's `Display` text. A panic (a bug: library code returns errors) is caught at
//! the entry point by [`guard`] and raised as `RuntimeError`, so no `PanicException` reaches Python.

use flashmla::Error;
use pyo3::exceptions::{
    PyKeyboardInterrupt, PyMemoryError, PyNotImplementedError, PyRuntimeError, PyTypeError,
    PyValueError,
};
use pyo3::PyErr;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Suffix of the argument name of a dtype error (`q.dtype`): those are `TypeError`s.
const DTYPE_ARG_SUFFIX: &str = ".dtype";

/// The Python exception for a library error.
pub fn to_py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match &e {
        Error::InvalidArgument { arg, .. } if arg.ends_with(DTYPE_ARG_SUFFIX) => {
            PyTypeError::new_err(msg)
        }
        Error::InvalidArgument { .. } => PyValueError::new_err(msg),
        Error::Unsupported { .. } => PyNotImplementedError::new_err(msg),
        Error::OutOfHostMemory { .. } => PyMemoryError::new_err(msg),
        Error::Interrupted => PyKeyboardInterrupt::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

/// Runs `f`, turning its error into the matching Python exception and a panic into `RuntimeError`.
///
/// `AssertUnwindSafe` is sound here: after a panic nothing `f` touched is used again (every call builds its own
/// views; the only shared state, the `Gpu` cache, recovers from a poisoned lock).
pub fn guard<T>(op: &str, f: impl FnOnce() -> flashmla::Result<T>) -> Result<T, PyErr> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py_err(e)),
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".to_string());
            Err(PyRuntimeError::new_err(format!(
                "internal error in flashmla `{op}` (a bug, please report it): {what}"
            )))
        }
    }
}
