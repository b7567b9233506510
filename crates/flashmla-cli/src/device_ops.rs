//! Device-side runs shared by `check`, `bench` and `demo`: upload host inputs, allocate (optionally poisoned)
//! outputs, launch, download.

use flashmla::cuda::{DeviceTensor, Gpu};
use flashmla::ops::sparse_bwd::{
    sparse_bwd_cuda_with, SparseBwdArgs, SparseBwdOptions, SparseBwdOutput,
};
use flashmla::ops::sparse_fwd::{
    sparse_fwd_cuda_with, SparseFwdArgs, SparseFwdOutput, SparseFwdTuning, D_V,
};
use flashmla::testing::SparseInputs;
#[cfg(feature = "experiments")]
use flashmla::Layout;
use flashmla::{DType, DeviceView, Result, TensorMeta};

/// Poison byte for outputs: 0xFF.. is NaN in bf16 and f32, so an element a kernel leaves unwritten fails a check.
pub const POISON: u8 = 0xFF;

/// A new output tensor, filled with [`POISON`] when `poison` is set (so that an element a kernel leaves unwritten
/// fails a check).
fn alloc_output(gpu: &Gpu, poison: bool, dtype: DType, shape: &[usize]) -> Result<DeviceTensor> {
    if poison {
        gpu.alloc_filled(dtype, shape, POISON)
    } else {
        gpu.alloc(dtype, shape)
    }
}

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
        let alloc = |dtype: DType, shape: &[usize]| alloc_output(gpu, poison, dtype, shape);
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

    /// Launches the forward kernel (asynchronously) with `tuning`.
    pub fn run(&self, gpu: &Gpu, tuning: &SparseFwdTuning) -> Result<()> {
        self.launch(gpu, tuning, &self.indices.view(), |v| Ok(v.clone()))
    }

    /// One launch of the op with `indices` in place of the uploaded ones, on the part of every
    /// per-token view that `part` cuts out (the whole views go to the op as they are, so its own
    /// checks see exactly what was uploaded).
    fn launch(
        &self,
        gpu: &Gpu,
        tuning: &SparseFwdTuning,
        indices: &DeviceView,
        part: impl Fn(&DeviceView) -> Result<DeviceView>,
    ) -> Result<()> {
        let (kv, sink) = (self.kv.view(), self.attn_sink.as_ref().map(|t| t.view()));
        let len = self
            .topk_length
            .as_ref()
            .map(|t| part(&t.view()))
            .transpose()?;
        let (q, indices) = (part(&self.q.view())?, part(indices)?);
        let args = SparseFwdArgs {
            q: &q,
            kv: &kv,
            indices: &indices,
            sm_scale: self.sm_scale,
            attn_sink: sink.as_ref(),
            topk_length: len.as_ref(),
        };
        let out = SparseFwdOutput {
            out: part(&self.out.view())?,
            max_logits: part(&self.max_logits.view())?,
            lse: part(&self.lse.view())?,
        };
        sparse_fwd_cuda_with(gpu, &args, &out, tuning)
    }

    /// [`Self::run`] with other `indices` (`[s_q, 1, topk]` i32, e.g. each row reordered) and, with `wave` set, as
    /// one launch per `wave` consecutive tokens, one after another (benchmark experiments on the entry order);
    /// without `wave`, one launch on the whole views.
    #[cfg(feature = "experiments")]
    pub fn run_ordered(
        &self,
        gpu: &Gpu,
        tuning: &SparseFwdTuning,
        indices: Option<&DeviceTensor>,
        wave: Option<usize>,
    ) -> Result<()> {
        let indices = indices.unwrap_or(&self.indices).view();
        let Some(wave) = wave.map(|w| w.max(1)) else {
            return self.launch(gpu, tuning, &indices, |v| Ok(v.clone()));
        };
        let s_q = self.q.view().shape()[0];
        for t0 in (0..s_q).step_by(wave) {
            let n = wave.min(s_q - t0);
            self.launch(gpu, tuning, &indices, |v| token_slice(v, t0, n))?;
        }
        Ok(())
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

/// A sparse backward problem resident on the GPU: the forward's inputs and outputs, `d_out`, and the gradients.
pub struct SparseBwdOnGpu {
    /// The forward (its outputs `out` and `lse` feed the backward).
    pub fwd: SparseFwdOnGpu,
    d_out: DeviceTensor,
    /// `[s_q, h_q, d_qk]` bf16.
    pub d_q: DeviceTensor,
    /// `[s_kv, 1, d_qk]` bf16 or f32.
    pub d_kv: DeviceTensor,
    /// `[s_q, h_q]` f32.
    pub delta: DeviceTensor,
    /// `[h_q]` f32, with a sink.
    pub d_attn_sink: Option<DeviceTensor>,
    d_kv_dtype: DType,
    /// A strided copy of the forward's `out` that the backward reads instead ([`Self::misalign_out`]).
    out_strided: Option<DeviceTensor>,
}

/// Downloaded backward outputs, row-major f32.
pub struct SparseBwdResults {
    /// `[s_q, h_q, d_qk]`.
    pub d_q: Vec<f32>,
    /// `[s_kv, d_qk]`.
    pub d_kv: Vec<f32>,
    /// `[s_q, h_q]`.
    pub delta: Vec<f32>,
    /// `[h_q]`.
    pub d_attn_sink: Option<Vec<f32>>,
}

impl SparseBwdOnGpu {
    /// Uploads the inputs and `d_out`, runs the forward kernel once to produce `out` and `lse`, and allocates
    /// the gradients (poisoned when `poison` is set).
    pub fn new(
        gpu: &Gpu,
        inp: &SparseInputs,
        d_out: &flashmla::HostTensor,
        d_kv_dtype: DType,
        poison: bool,
    ) -> Result<Self> {
        let fwd = SparseFwdOnGpu::new(gpu, inp, poison)?;
        // The forward's outputs are inputs here: made with the measured launch choices.
        fwd.run(gpu, &SparseFwdTuning::default())?;
        let (s_q, h_q, d_qk) = (inp.q.shape()[0], inp.q.shape()[1], inp.q.shape()[2]);
        let s_kv = inp.kv.shape()[0];
        let alloc = |dtype: DType, shape: &[usize]| alloc_output(gpu, poison, dtype, shape);
        Ok(SparseBwdOnGpu {
            d_out: gpu.upload(d_out)?,
            d_q: alloc(DType::Bf16, &[s_q, h_q, d_qk])?,
            d_kv: alloc(d_kv_dtype, &[s_kv, 1, d_qk])?,
            delta: alloc(DType::F32, &[s_q, h_q])?,
            d_attn_sink: match inp.attn_sink {
                Some(_) => Some(alloc(DType::F32, &[h_q])?),
                None => None,
            },
            d_kv_dtype,
            fwd,
            out_strided: None,
        })
    }

    /// Makes the backward read a copy of `out` whose last dimension is padded by one element, so that
    /// its rows start at odd element offsets (2-byte alignment): the kernels' unaligned `out` path.
    pub fn misalign_out(&mut self, gpu: &Gpu) -> Result<()> {
        let host = gpu.download(&self.fwd.out)?;
        self.out_strided = Some(gpu.upload(&host.to_padded(&[1, 1, 1])?)?);
        Ok(())
    }

    /// Launches the backward (asynchronously) with `options`.
    pub fn run(&self, gpu: &Gpu, options: &SparseBwdOptions) -> Result<()> {
        let f = &self.fwd;
        self.launch(gpu, options, &f.indices, f.topk_length.as_ref())
    }

    /// [`Self::run`] with other `indices` (`[s_q, 1, topk]` i32) and `topk_length` (`[s_q]` i32) than the
    /// forward's, e.g. a subset of each row's entries (benchmark experiments).
    #[cfg(feature = "experiments")]
    pub fn run_indices(
        &self,
        gpu: &Gpu,
        options: &SparseBwdOptions,
        indices: &DeviceTensor,
        topk_length: Option<&DeviceTensor>,
    ) -> Result<()> {
        self.launch(gpu, options, indices, topk_length)
    }

    fn launch(
        &self,
        gpu: &Gpu,
        options: &SparseBwdOptions,
        indices: &DeviceTensor,
        topk_length: Option<&DeviceTensor>,
    ) -> Result<()> {
        let f = &self.fwd;
        let (q, kv) = (f.q.view(), f.kv.view());
        let (indices, len) = (indices.view(), topk_length.map(|t| t.view()));
        let out = self.out_strided.as_ref().unwrap_or(&f.out).view();
        let (lse, d_out) = (f.lse.view(), self.d_out.view());
        let sink = f.attn_sink.as_ref().map(|t| t.view());
        let args = SparseBwdArgs {
            q: &q,
            kv: &kv,
            out: &out,
            d_out: &d_out,
            indices: &indices,
            lse: &lse,
            sm_scale: f.sm_scale,
            attn_sink: sink.as_ref(),
            topk_length: len.as_ref(),
            d_kv_dtype: self.d_kv_dtype,
        };
        let grads = SparseBwdOutput {
            d_q: self.d_q.view(),
            d_kv: self.d_kv.view(),
            delta: self.delta.view(),
            d_attn_sink: self.d_attn_sink.as_ref().map(|t| t.view()),
        };
        sparse_bwd_cuda_with(gpu, &args, &grads, options, None)
    }

    /// Copies the gradients back.
    pub fn download(&self, gpu: &Gpu) -> Result<SparseBwdResults> {
        Ok(SparseBwdResults {
            d_q: gpu.download(&self.d_q)?.to_f32_vec()?,
            d_kv: gpu.download(&self.d_kv)?.to_f32_vec()?,
            delta: gpu.download(&self.delta)?.to_f32_vec()?,
            d_attn_sink: self
                .d_attn_sink
                .as_ref()
                .map(|t| gpu.download(t).and_then(|h| h.to_f32_vec()))
                .transpose()?,
        })
    }
}

/// Tokens `[t0, t0 + n)` of a view whose first dimension is the token; an error past that dimension.
#[cfg(feature = "experiments")]
fn token_slice(v: &DeviceView, t0: usize, n: usize) -> Result<DeviceView> {
    let mut shape = v.shape().to_vec();
    let tokens = shape.first().copied().unwrap_or(0);
    if t0 + n > tokens {
        return Err(flashmla::Error::invalid(
            "tokens",
            format!("a range inside the {tokens} tokens of the view"),
            format!("[{t0}, {})", t0 + n),
        ));
    }
    shape[0] = n;
    let layout = Layout::strided(&shape, v.strides())?;
    let ptr = v.ptr() + (t0 * v.strides()[0] * v.dtype().size_bytes()) as u64;
    // SAFETY: the slice covers a subset of the elements `v` covers, in the same allocation.
    Ok(unsafe { DeviceView::from_raw(ptr, v.dtype(), layout, v.device()) })
}

#[cfg(all(test, feature = "experiments"))]
mod tests {
    use super::SparseFwdOnGpu;
    use crate::bench::experiments::sorted_rows;
    use flashmla::cuda::Gpu;
    use flashmla::ops::sparse_fwd::SparseFwdTuning;
    use flashmla::testing::SparseCase;
    use flashmla::HostTensor;

    /// The bench's entry-order experiment computes what the op computes: sorted index rows, launched in waves of
    /// 66 tokens (the last one partial), on freshly poisoned outputs, against one plain launch.
    #[test]
    #[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
    fn ordered_runs_match_the_op() {
        let gpu = Gpu::new(0).unwrap();
        let (s_q, topk) = (300, 512);
        let inp = SparseCase::plain(s_q, 4096, 128, 576, topk)
            .generate(7)
            .unwrap();
        let tuning = SparseFwdTuning::default();
        let plain = SparseFwdOnGpu::new(&gpu, &inp, true).unwrap();
        plain.run(&gpu, &tuning).unwrap();
        let want = plain.download(&gpu).unwrap();
        let rows = sorted_rows(&inp.indices.to_i32_vec().unwrap(), topk);
        let sorted = gpu
            .upload(&HostTensor::from_i32(rows, &[s_q, 1, topk]).unwrap())
            .unwrap();
        let ordered = SparseFwdOnGpu::new(&gpu, &inp, true).unwrap();
        ordered
            .run_ordered(&gpu, &tuning, Some(&sorted), Some(66))
            .unwrap();
        let got = ordered.download(&gpu).unwrap();
        for (name, a, b, rel) in [
            ("out", &want.out, &got.out, 1e-2f32),
            ("lse", &want.lse, &got.lse, 1e-5),
            ("max_logits", &want.max_logits, &got.max_logits, 1e-5),
        ] {
            assert_eq!(a.len(), b.len());
            for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
                let tol = rel * x.abs().max(y.abs()) + 1e-4;
                assert!((x - y).abs() <= tol, "{name}[{i}]: {x} against {y}");
            }
        }
    }
}

/// A dense varlen prefill forward resident on the GPU, with its outputs.
pub struct DensePrefillOnGpu {
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    cu_q: DeviceTensor,
    cu_k: DeviceTensor,
    /// `[total_q, h_q, 128]`, q's dtype.
    pub out: DeviceTensor,
    /// `[h_q, total_q]` f32.
    pub lse: DeviceTensor,
}

impl DensePrefillOnGpu {
    /// Uploads `case` (keeping its strides) and allocates outputs, filled with [`POISON`] when `poison` is set.
    pub fn new(gpu: &Gpu, case: &flashmla::testing::PrefillCase, poison: bool) -> Result<Self> {
        let (total_q, h_q) = (case.q.shape()[0], case.q.shape()[1]);
        let alloc = |dtype: DType, shape: &[usize]| alloc_output(gpu, poison, dtype, shape);
        Ok(DensePrefillOnGpu {
            q: gpu.upload(&case.q)?,
            k: gpu.upload(&case.k)?,
            v: gpu.upload(&case.v)?,
            cu_q: gpu.upload(&case.cu_q)?,
            cu_k: gpu.upload(&case.cu_k)?,
            out: alloc(case.q.dtype(), &[total_q, h_q, 128])?,
            lse: alloc(DType::F32, &[h_q, total_q])?,
        })
    }

    /// Calls `f` with the forward's arguments (views of the uploaded inputs).
    fn with_args<T>(
        &self,
        causal: bool,
        softmax_scale: Option<f32>,
        f: impl FnOnce(flashmla::ops::dense_prefill::DensePrefillArgs<'_, DeviceView>) -> Result<T>,
    ) -> Result<T> {
        let (q, k, v) = (self.q.view(), self.k.view(), self.v.view());
        let (cu_q, cu_k) = (self.cu_q.view(), self.cu_k.view());
        f(flashmla::ops::dense_prefill::DensePrefillArgs {
            q: &q,
            k: &k,
            v: &v,
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
            softmax_scale,
            causal,
        })
    }

    /// Launches the forward (asynchronously).
    pub fn run(&self, gpu: &Gpu, causal: bool, softmax_scale: Option<f32>) -> Result<()> {
        use flashmla::ops::dense_prefill::{dense_prefill_fwd_cuda, DensePrefillOutput};
        let out = DensePrefillOutput {
            out: self.out.view(),
            lse: self.lse.view(),
        };
        self.with_args(causal, softmax_scale, |args| {
            dense_prefill_fwd_cuda(gpu, &args, &out)
        })
    }

    /// Downloads `(out, lse)` as row-major f32.
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((
            gpu.download(&self.out)?.to_f32_vec()?,
            gpu.download(&self.lse)?.to_f32_vec()?,
        ))
    }
}

/// A dense varlen prefill backward resident on the GPU: the forward (whose `out` and `lse` it reads), `d_out`, the
/// gradients and the workspace of its schedule (default or deterministic).
pub struct DensePrefillBwdOnGpu {
    /// The forward.
    pub fwd: DensePrefillOnGpu,
    d_out: DeviceTensor,
    /// `[total_q, h_q, d]`.
    pub d_q: DeviceTensor,
    /// `[total_k, h_k, d]`.
    pub d_k: DeviceTensor,
    /// `[total_k, h_k, 128]`.
    pub d_v: DeviceTensor,
    workspace: DeviceTensor,
    options: flashmla::ops::dense_prefill::DensePrefillBwdOptions,
}

impl DensePrefillBwdOnGpu {
    /// Uploads `case` and `d_out` (`[total_q, h_q, 128]`, q's dtype) and allocates the forward's outputs, the
    /// gradients and the workspace of the schedule `options` picks, the gradients and the workspace filled with
    /// [`POISON`] when `poison` is set.
    pub fn new(
        gpu: &Gpu,
        case: &flashmla::testing::PrefillCase,
        d_out: &flashmla::HostTensor,
        poison: bool,
        options: flashmla::ops::dense_prefill::DensePrefillBwdOptions,
    ) -> Result<Self> {
        let dtype = case.q.dtype();
        let (total_q, h_q, d) = (case.q.shape()[0], case.q.shape()[1], case.q.shape()[2]);
        let (total_k, h_k) = (case.k.shape()[0], case.k.shape()[1]);
        let alloc = |shape: &[usize]| alloc_output(gpu, poison, dtype, shape);
        let batch = case.cu_q.shape()[0].saturating_sub(1);
        let workspace_shape = flashmla::ops::dense_prefill::bwd_workspace_shape_for(
            h_q, total_q, batch, d, &options,
        )?;
        Ok(DensePrefillBwdOnGpu {
            fwd: DensePrefillOnGpu::new(gpu, case, poison)?,
            d_out: gpu.upload(d_out)?,
            d_q: alloc(&[total_q, h_q, d])?,
            d_k: alloc(&[total_k, h_k, d])?,
            d_v: alloc(&[total_k, h_k, 128])?,
            workspace: alloc_output(gpu, poison, DType::F32, &workspace_shape)?,
            options,
        })
    }

    /// Launches the backward (asynchronously) from the forward's current `out` and `lse`.
    pub fn run(&self, gpu: &Gpu, causal: bool, softmax_scale: Option<f32>) -> Result<()> {
        use flashmla::ops::dense_prefill::{
            dense_prefill_bwd_cuda_with, DensePrefillBwdArgs, DensePrefillGrads,
        };
        let f = &self.fwd;
        let (out, lse, d_out) = (f.out.view(), f.lse.view(), self.d_out.view());
        let grads = DensePrefillGrads {
            d_q: self.d_q.view(),
            d_k: self.d_k.view(),
            d_v: self.d_v.view(),
        };
        f.with_args(causal, softmax_scale, |fwd| {
            let args = DensePrefillBwdArgs {
                fwd,
                out: &out,
                d_out: &d_out,
                lse: &lse,
            };
            dense_prefill_bwd_cuda_with(gpu, &args, &grads, &self.workspace.view(), &self.options)
        })
    }

    /// Downloads `(d_q, d_k, d_v)` as row-major f32.
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        Ok((
            gpu.download(&self.d_q)?.to_f32_vec()?,
            gpu.download(&self.d_k)?.to_f32_vec()?,
            gpu.download(&self.d_v)?.to_f32_vec()?,
        ))
    }
}
