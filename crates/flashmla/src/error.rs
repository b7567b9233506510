//! The one error type of the library.

use std::fmt;

/// Everything that can go wrong in a flashmla call.
///
/// Library code never panics on user input: every bad argument becomes
/// [`Error::InvalidArgument`] naming the argument, what was expected and what came.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// An argument failed validation.
    #[error("invalid argument `{arg}`: expected {expected}, got {actual}")]
    InvalidArgument {
        /// The argument's name, as in the public API (e.g. `indices`, `q.shape[2]`).
        arg: String,
        /// What was expected.
        expected: String,
        /// What came.
        actual: String,
    },
    /// A valid request that this build or backend does not implement.
    #[error("unsupported: {what} ({why})")]
    Unsupported {
        /// What was asked for.
        what: String,
        /// Why it cannot be done, and what would be needed.
        why: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA call `{call}` failed: {code}")]
    Cuda {
        /// The driver call (or kernel launch) that failed.
        call: String,
        /// The driver's error name and description.
        code: String,
    },
    /// No CUDA driver or no CUDA device is present.
    #[error("no CUDA GPU available: {0}")]
    NoGpu(String),
    /// The library was built without nvcc, so no GPU kernels are embedded.
    #[error("GPU kernels were not built into this binary (nvcc was not found at build time); {0}")]
    KernelsNotBuilt(String),
    /// A GPU kernel exists but not for this device's architecture.
    #[error("device `{device}` (sm_{major}{minor}) is not supported: kernels are built for sm_90a (Hopper)")]
    UnsupportedDevice {
        /// Device name.
        device: String,
        /// Compute capability major.
        major: i32,
        /// Compute capability minor.
        minor: i32,
    },
    /// A host allocation of the CPU path failed (the request needs more memory than the machine can give).
    #[error("out of host memory: {what} needs {bytes} bytes")]
    OutOfHostMemory {
        /// What the memory was for (e.g. `sparse_fwd out`).
        what: String,
        /// The size of the failed allocation, in bytes (saturated at `usize::MAX`).
        bytes: usize,
    },
    /// The caller cancelled a CPU computation through its [`crate::cancel::CancelToken`] (e.g. on Ctrl-C).
    #[error("interrupted")]
    Interrupted,
}

/// Shorthand for `std::result::Result<T, flashmla::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Builds an [`Error::InvalidArgument`].
    pub fn invalid(
        arg: impl Into<String>,
        expected: impl fmt::Display,
        actual: impl fmt::Display,
    ) -> Self {
        Error::InvalidArgument {
            arg: arg.into(),
            expected: expected.to_string(),
            actual: actual.to_string(),
        }
    }

    /// Builds an [`Error::Unsupported`].
    pub fn unsupported(what: impl Into<String>, why: impl Into<String>) -> Self {
        Error::Unsupported {
            what: what.into(),
            why: why.into(),
        }
    }

    /// The argument name, when this is an [`Error::InvalidArgument`].
    pub fn arg(&self) -> Option<&str> {
        match self {
            Error::InvalidArgument { arg, .. } => Some(arg),
            _ => None,
        }
    }
}
