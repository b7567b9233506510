//! Device-side runs shared by `check`, `bench` and `demo`: upload host inputs, allocate (optionally poisoned)
//! outputs, launch, download.

use flashmla::cuda::{DeviceTensor, Gpu};
use flashmla::ops::sparse_fwd::{sparse_fwd_cuda, SparseFwdArgs, SparseFwdOutput, D_V};
use flashmla::testing::SparseInputs;
use flashmla::{DType, Result, TensorMeta};

/// Poison byte for outputs: 0xFF.. is NaN in bf16 and f32, so an element a kernel leaves unwritten fails a check.
pub const POISON: u8 = 0xFF;

/// A sparse forward problem resident on the GPU, with its outputs.
pub struct SparseFwdOnGpu {
    q: DeviceTensor,
    kv: DeviceTensor,
    indices: DeviceTensor,
    attn_sink: Option<DeviceTensor>,
    topk_length: Option<DeviceTensor>,
    sm_scale: f32,
    /// `[s_q, h_q, 512]` bf16.
    pub out: DeviceTensor,
    /// `[s_q, h_q]` f32.
    pub max_logits: DeviceTensor,
    /// `[s_q, h_q]` f32.
    pub lse: DeviceTensor,
}

/// Downloaded forward outputs, row-major f32.
pub struct SparseFwdResults {
    /// `[s_q, h_q, 512]`.
    pub out: Vec<f32>,
    /// `[s_q, h_q]`.
    pub max_logits: Vec<f32>,
    /// `[s_q, h_q]`.
    pub lse: Vec<f32>,
}

impl SparseFwdOnGpu {
    /// Uploads `inp` (keeping its strides) and allocates outputs, filled with [`POISON`] when `poison` is set.
    pub fn new(gpu: &Gpu, inp: &SparseInputs, poison: bool) -> Result<Self> {
        let (s_q, h_q) = (inp.q.shape()[0], inp.q.shape()[1]);
        let alloc = |dtype: DType, shape: &[usize]| {
            if poison {
                gpu.alloc_filled(dtype, shape, POISON)
            } else {
                gpu.alloc(dtype, shape)
            }
        };
        Ok(SparseFwdOnGpu {
            q: gpu.upload(&inp.q)?,
            kv: gpu.upload(&inp.kv)?,
            indices: gpu.upload(&inp.indices)?,
            attn_sink: inp.attn_sink.as_ref().map(|t| gpu.upload(t)).transpose()?,
            topk_length: inp
                .topk_length
                .as_ref()
                .map(|t| gpu.upload(t))
                .transpose()?,
            sm_scale: inp.sm_scale,
            out: alloc(DType::Bf16, &[s_q, h_q, D_V])?,
            max_logits: alloc(DType::F32, &[s_q, h_q])?,
            lse: alloc(DType::F32, &[s_q, h_q])?,
        })
    }

    /// Launches the forward kernel (asynchronously).
    pub fn run(&self, gpu: &Gpu) -> Result<()> {
        let (q, kv, indices) = (self.q.view(), self.kv.view(), self.indices.view());
        let sink = self.attn_sink.as_ref().map(|t| t.view());
        let len = self.topk_length.as_ref().map(|t| t.view());
        let args = SparseFwdArgs {
            q: &q,
            kv: &kv,
            indices: &indices,
            sm_scale: self.sm_scale,
            attn_sink: sink.as_ref(),
            topk_length: len.as_ref(),
        };
        let out = SparseFwdOutput {
            out: self.out.view(),
            max_logits: self.max_logits.view(),
            lse: self.lse.view(),
        };
        sparse_fwd_cuda(gpu, &args, &out)
    }

    /// Copies the outputs back.
    pub fn download(&self, gpu: &Gpu) -> Result<SparseFwdResults> {
        Ok(SparseFwdResults {
            out: gpu.download(&self.out)?.to_f32_vec()?,
            max_logits: gpu.download(&self.max_logits)?.to_f32_vec()?,
            lse: gpu.download(&self.lse)?.to_f32_vec()?,
        })
    }
}
