//! The library's own host time per call, without Python: validation alone, then the whole call (validation,
//! lowering, launches), for a tiny sparse prefill forward and a single-request dense decode on GPU 0.
//!
//! Each figure is the median over rounds of the wall time per call of bursts of 32 calls, each burst started on an
//! idle stream and synchronised untimed, so that the launch queue never fills and the time is the host's own.
//! `bench/host_breakdown.py` splits the Python side of the same calls.
//!
//! ```sh
//! cargo run --release -p flashmla --example launch_cost
//! ```

use flashmla::cuda::Gpu;
use flashmla::ops::decode::{
    decode_dense_cuda, launch::dense_workspace_words, validate_dense, DecodeOptions, DecodeOutput,
    DenseDecodeArgs,
};
use flashmla::ops::sparse_fwd::launch::lower;
use flashmla::ops::sparse_fwd::{
    sparse_fwd_cuda, validate, SparseFwdArgs, SparseFwdOutput, SparseFwdTuning,
};
use flashmla::{DType, HostTensor};
use std::error::Error;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn Error>>;

const BURST: usize = 32;
const BURSTS: usize = 64;
const ROUNDS: usize = 7;

/// Median over rounds of the host time per call of `f` (microseconds).
fn per_call_us(gpu: &Gpu, mut f: impl FnMut() -> flashmla::Result<()>) -> Res<f64> {
    for _ in 0..BURST {
        f()?;
    }
    let mut rounds = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let mut total = 0.0;
        for _ in 0..BURSTS {
            gpu.synchronize()?;
            let t0 = Instant::now();
            for _ in 0..BURST {
                f()?;
            }
            total += t0.elapsed().as_secs_f64();
        }
        rounds.push(total * 1e6 / (BURSTS * BURST) as f64);
    }
    gpu.synchronize()?;
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[ROUNDS / 2])
}

fn bf16(gpu: &Gpu, shape: &[usize]) -> Res<flashmla::cuda::DeviceTensor> {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) / 480.0).collect();
    Ok(gpu.upload(&HostTensor::bf16_from_f32(&values, shape)?)?)
}

fn main() -> Res<()> {
    let gpu = match Gpu::new(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("no GPU ({e}): nothing to time");
            return Ok(());
        }
    };
    println!("{} (host time per call, us)", gpu.info().name);

    // Sparse prefill forward: s_q 1, h_q 64, topk 128 over 1024 rows.
    let q = bf16(&gpu, &[1, 64, 576])?;
    let kv = bf16(&gpu, &[1024, 1, 576])?;
    let idx: Vec<i32> = (0..128).map(|i| i * 8).collect();
    let idx = gpu.upload(&HostTensor::from_i32(idx, &[1, 1, 128])?)?;
    let out = gpu.alloc(DType::Bf16, &[1, 64, 512])?;
    let max_logits = gpu.alloc(DType::F32, &[1, 64])?;
    let lse = gpu.alloc(DType::F32, &[1, 64])?;
    let (qv, kvv, iv) = (q.view(), kv.view(), idx.view());
    let args = SparseFwdArgs {
        q: &qv,
        kv: &kvv,
        indices: &iv,
        sm_scale: 576f32.powf(-0.5),
        attn_sink: None,
        topk_length: None,
    };
    let outs = SparseFwdOutput {
        out: out.view(),
        max_logits: max_logits.view(),
        lse: lse.view(),
    };
    let check = per_call_us(&gpu, || validate(&args).map(|_| ()))?;
    let full = per_call_us(&gpu, || sparse_fwd_cuda(&gpu, &args, &outs))?;
    println!("sparse_fwd   validate {check:6.2}   whole call {full:6.2}");
    let dims = validate(&args)?;
    let tuning = SparseFwdTuning::default();
    let lowering = per_call_us(&gpu, || lower(&dims, &args, &outs, &tuning).map(|_| ()))?;
    let (name, cfg, params) = lower(&dims, &args, &outs, &tuning)?.ok_or("nothing to launch")?;
    let lookup = per_call_us(&gpu, || gpu.kernel("sparse_fwd", name).map(|_| ()))?;
    let kernel = gpu.kernel("sparse_fwd", name)?;
    // SAFETY: the params lowered for these live tensors, as sparse_fwd_cuda launches them.
    let launch = per_call_us(&gpu, || unsafe { gpu.launch(&kernel, &cfg, &params) })?;
    println!(
        "sparse_fwd   lower {lowering:6.2}   kernel lookup {lookup:6.2}   launch {launch:6.2}"
    );

    // Dense decode: b 1, s_q 1, h_q 128, 4096 tokens in pages of 64.
    let (pages, page) = (64usize, 64usize);
    let q = bf16(&gpu, &[1, 1, 128, 576])?;
    let cache = bf16(&gpu, &[pages, page, 1, 576])?;
    let table = gpu.upload(&HostTensor::from_i32(
        (0..pages as i32).collect(),
        &[1, pages],
    )?)?;
    let seqlens = gpu.upload(&HostTensor::from_i32(vec![(pages * page) as i32], &[1])?)?;
    let (qv, cv, tv, sv) = (q.view(), cache.view(), table.view(), seqlens.view());
    let args = DenseDecodeArgs {
        q: &qv,
        k_cache: &cv,
        block_table: &tv,
        cache_seqlens: &sv,
        softmax_scale: None,
        causal: false,
        attn_sink: None,
    };
    let options = DecodeOptions::default();
    let dims = validate_dense(&args)?;
    let words = dense_workspace_words(&dims, &options, gpu.info().sm_count as usize)?;
    let ws = gpu.alloc(DType::F32, &[words])?;
    let out = gpu.alloc(DType::Bf16, &[1, 1, 128, 512])?;
    let lse = gpu.alloc(DType::F32, &[1, 128, 1])?;
    let outs = DecodeOutput {
        out: out.view(),
        lse: lse.view(),
    };
    let wsv = ws.view();
    let check = per_call_us(&gpu, || validate_dense(&args).map(|_| ()))?;
    let full = per_call_us(&gpu, || {
        decode_dense_cuda(&gpu, &args, &outs, &options, Some(&wsv))
    })?;
    println!("decode_dense validate {check:6.2}   whole call {full:6.2}");
    Ok(())
}
