//! CPU reference implementations: the truth every kernel is tested against, and what the library runs
//! where there is no GPU.
//!
//! Inputs are f32 slices holding the values of the op's (bf16/f16) inputs, contiguous, in the shapes the
//! spec names; the accumulation type `R` is f32 (the reference) or f64 (the truth for tests).

pub mod compare;
pub mod kv_quant;

/// The accumulation type of a reference computation: `f32` or `f64`.
pub trait Real:
    num_traits::Float
    + num_traits::FromPrimitive
    + std::iter::Sum
    + Send
    + Sync
    + std::fmt::Debug
    + 'static
{
    /// Widens (or keeps) an f32 input.
    fn of(x: f32) -> Self;
    /// Narrows to f32 for output.
    fn to_f32(self) -> f32;
}

impl Real for f32 {
    fn of(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Real for f64 {
    fn of(x: f32) -> Self {
        x as f64
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
}

pub mod decode;
pub mod dense_prefill;
pub mod sparse_bwd;
pub mod sparse_fwd;
