//! flashmla: Multi-head Latent Attention (MLA) kernels for NVIDIA Hopper GPUs, with a CPU reference for
//! every operation.
//!
//! Layers, from the bottom:
//! * [`tensor`] and [`validate`]: tensor descriptions and the checks every op runs before touching memory;
//! * [`reference`](mod@crate::reference): the CPU truth for every op (f32 accumulation, or f64 for tests),
//!   rayon-parallel;
//! * [`cuda`]: the GPU plumbing (device, stream, embedded cubins, launches, events);
//! * [`ops`]: the public operations, which validate once and then run on the CPU or the GPU.
#![warn(missing_docs)]

pub mod alloc;
pub mod cancel;
pub mod cuda;
pub mod error;
pub mod fp8;
pub mod ops;
pub mod reference;
pub mod tensor;
pub mod testing;
pub mod validate;

pub use cancel::CancelToken;
pub use error::{Error, Result};
pub use fp8::KvFormat;
pub use tensor::{DType, DeviceView, HostData, HostTensor, Layout, Location, TensorMeta};

/// The README's examples, compiled as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
