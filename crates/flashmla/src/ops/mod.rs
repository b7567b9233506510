//! Public operations. Each family validates its arguments once (shared by both backends), then runs on the
//! CPU reference (host tensors) or a CUDA kernel (device views).

pub mod contract;
pub mod decode;
pub mod dense_prefill;
pub mod kv_quant;
mod layout;
pub mod sparse_bwd;
pub mod sparse_fwd;
