//! Sparse MLA prefill (DeepSeek V3.2 widths): the forward and the backward on the CPU reference, then the same
//! calls on the GPU kernels when an sm_90 device is present, checked against the CPU results.
//!
//! ```sh
//! cargo run --release -p flashmla --example sparse_attention
//! ```

use flashmla::cuda::{DeviceTensor, Gpu};
use flashmla::ops::sparse_bwd::{sparse_bwd_cpu, sparse_bwd_cuda, SparseBwdArgs, SparseBwdOutput};
use flashmla::ops::sparse_fwd::{
    sparse_fwd_cpu, sparse_fwd_cuda, SparseFwdArgs, SparseFwdOutput, D_V,
};
use flashmla::reference::compare::{compare, Tolerance, BWD_GRAD, PREFILL_LSE, PREFILL_OUT};
use flashmla::{DType, HostTensor, TensorMeta};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};
use std::error::Error;
use std::time::Instant;

/// Query tokens, KV rows, query heads, query/key width (512 NoPE + 64 RoPE) and entries per token: small
/// enough for the CPU reference to finish in about a second.
const S_Q: usize = 16;
const S_KV: usize = 2048;
const H_Q: usize = 64;
const D_QK: usize = 576;
const TOPK: usize = 256;
/// Trailing entries of every index row left unused (`-1`: any value outside `[0, s_kv)` is ignored).
const UNUSED_ENTRIES: usize = 16;

type Res<T> = Result<T, Box<dyn Error>>;

/// Values like activations in bf16 training: normal with standard deviation 0.1.
fn normal(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let dist = Normal::new(0.0f32, 0.1).expect("a positive standard deviation");
    (0..n).map(|_| dist.sample(rng)).collect()
}

/// `[S_Q, 1, TOPK]` indices: distinct random rows per token, the last [`UNUSED_ENTRIES`] set to -1.
fn random_indices(rng: &mut StdRng) -> Vec<i32> {
    let mut all = Vec::with_capacity(S_Q * TOPK);
    for _ in 0..S_Q {
        let mut rows: Vec<i32> = (0..S_KV as i32).collect();
        // Partial Fisher-Yates: the first TOPK positions become a random selection.
        for i in 0..TOPK {
            let j = rng.random_range(i..S_KV);
            rows.swap(i, j);
        }
        rows.truncate(TOPK);
        rows[TOPK - UNUSED_ENTRIES..].fill(-1);
        all.extend(rows);
    }
    all
}

fn main() -> Res<()> {
    let mut rng = StdRng::seed_from_u64(2026);
    let q = HostTensor::bf16_from_f32(&normal(&mut rng, S_Q * H_Q * D_QK), &[S_Q, H_Q, D_QK])?;
    let kv = HostTensor::bf16_from_f32(&normal(&mut rng, S_KV * D_QK), &[S_KV, 1, D_QK])?;
    let indices = HostTensor::from_i32(random_indices(&mut rng), &[S_Q, 1, TOPK])?;
    let attn_sink = HostTensor::from_f32(vec![0.25; H_Q], &[H_Q])?;
    let d_out = HostTensor::bf16_from_f32(&normal(&mut rng, S_Q * H_Q * D_V), &[S_Q, H_Q, D_V])?;
    let fwd_args = SparseFwdArgs {
        q: &q,
        kv: &kv,
        indices: &indices,
        sm_scale: (D_QK as f32).powf(-0.5),
        attn_sink: Some(&attn_sink),
        topk_length: None,
    };
    println!("sparse MLA: s_q={S_Q} s_kv={S_KV} h_q={H_Q} d_qk={D_QK} topk={TOPK}, with a sink");

    let t0 = Instant::now();
    let fwd = sparse_fwd_cpu(&fwd_args)?;
    let bwd_args = SparseBwdArgs {
        q: &q,
        kv: &kv,
        out: &fwd.out,
        d_out: &d_out,
        indices: &indices,
        lse: &fwd.lse,
        sm_scale: fwd_args.sm_scale,
        attn_sink: fwd_args.attn_sink,
        topk_length: None,
        d_kv_dtype: DType::Bf16,
    };
    let grads = sparse_bwd_cpu(&bwd_args)?;
    println!(
        "CPU reference: forward + backward in {:.2} s; out {:?}, d_q {:?}, d_kv {:?}",
        t0.elapsed().as_secs_f64(),
        fwd.out.shape(),
        grads.d_q.shape(),
        grads.d_kv.shape()
    );
    let lse = fwd.lse.to_f32_vec()?;
    println!("  lse of token 0, heads 0..4: {:?}", &lse[..4]);

    match open_gpu() {
        Some(gpu) => run_on_gpu(&gpu, &fwd_args, &d_out, &fwd, &grads),
        None => Ok(()),
    }
}

/// Device 0 when it is an sm_90 GPU and this build embeds the sparse kernels; otherwise says why not.
fn open_gpu() -> Option<Gpu> {
    let built = flashmla::cuda::kernels_built();
    if !built.iter().any(|&(f, ok)| f == "sparse_fwd" && ok) {
        println!(
            "GPU: skipped (this build has no kernels: nvcc was not found when it was compiled)"
        );
        return None;
    }
    match Gpu::new(0) {
        Ok(gpu) if gpu.info().is_sm90() => Some(gpu),
        Ok(gpu) => {
            println!("GPU: skipped ({} is not an sm_90 GPU)", gpu.info().name);
            None
        }
        Err(e) => {
            println!("GPU: skipped ({e})");
            None
        }
    }
}

/// Compares a GPU result with the CPU's under the specification's tolerance; an error when it is out of it.
fn check(name: &str, gpu: &HostTensor, cpu: &HostTensor, tol: &Tolerance) -> Res<()> {
    let c = compare(&gpu.to_f32_vec()?, &cpu.to_f32_vec()?);
    c.check(tol)
        .map_err(|e| format!("{name}: GPU and CPU differ: {e}"))?;
    println!(
        "  {name}: max abs difference to the CPU {:.2e}",
        c.max_abs_err
    );
    Ok(())
}

/// The same forward and backward on the GPU: upload, allocate outputs, launch on the `Gpu`'s stream, wait,
/// download and compare.
fn run_on_gpu(
    gpu: &Gpu,
    host: &SparseFwdArgs<'_, HostTensor>,
    d_out: &HostTensor,
    fwd_cpu: &SparseFwdOutput<HostTensor>,
    grads_cpu: &SparseBwdOutput<HostTensor>,
) -> Res<()> {
    println!("GPU: {}", gpu.info().name);
    let upload = |t: &HostTensor| gpu.upload(t);
    let (q, kv, indices) = (upload(host.q)?, upload(host.kv)?, upload(host.indices)?);
    let sink = host.attn_sink.map(upload).transpose()?;
    let d_out = upload(d_out)?;
    let (qv, kvv, iv, dov) = (q.view(), kv.view(), indices.view(), d_out.view());
    let sinkv = sink.as_ref().map(DeviceTensor::view);
    let args = SparseFwdArgs {
        q: &qv,
        kv: &kvv,
        indices: &iv,
        sm_scale: host.sm_scale,
        attn_sink: sinkv.as_ref(),
        topk_length: None,
    };
    let out = gpu.alloc(DType::Bf16, &[S_Q, H_Q, D_V])?;
    let max_logits = gpu.alloc(DType::F32, &[S_Q, H_Q])?;
    let lse = gpu.alloc(DType::F32, &[S_Q, H_Q])?;
    let fwd_out = SparseFwdOutput {
        out: out.view(),
        max_logits: max_logits.view(),
        lse: lse.view(),
    };
    sparse_fwd_cuda(gpu, &args, &fwd_out)?;

    let d_q = gpu.alloc(DType::Bf16, &[S_Q, H_Q, D_QK])?;
    let d_kv = gpu.alloc(DType::Bf16, &[S_KV, 1, D_QK])?;
    let delta = gpu.alloc(DType::F32, &[S_Q, H_Q])?;
    let d_sink = gpu.alloc(DType::F32, &[H_Q])?;
    let bwd_args = SparseBwdArgs {
        q: &qv,
        kv: &kvv,
        out: &fwd_out.out,
        d_out: &dov,
        indices: &iv,
        lse: &fwd_out.lse,
        sm_scale: host.sm_scale,
        attn_sink: sinkv.as_ref(),
        topk_length: None,
        d_kv_dtype: DType::Bf16,
    };
    let bwd_out = SparseBwdOutput {
        d_q: d_q.view(),
        d_kv: d_kv.view(),
        delta: delta.view(),
        d_attn_sink: Some(d_sink.view()),
    };
    // Launches are asynchronous; the downloads below read after the stream has finished.
    sparse_bwd_cuda(gpu, &bwd_args, &bwd_out)?;
    gpu.synchronize()?;

    check("out", &gpu.download(&out)?, &fwd_cpu.out, &PREFILL_OUT)?;
    check("lse", &gpu.download(&lse)?, &fwd_cpu.lse, &PREFILL_LSE)?;
    check("d_q", &gpu.download(&d_q)?, &grads_cpu.d_q, &BWD_GRAD)?;
    check("d_kv", &gpu.download(&d_kv)?, &grads_cpu.d_kv, &BWD_GRAD)?;
    if let Some(cpu) = &grads_cpu.d_attn_sink {
        check("d_attn_sink", &gpu.download(&d_sink)?, cpu, &BWD_GRAD)?;
    }
    println!("GPU results match the CPU reference");
    Ok(())
}
