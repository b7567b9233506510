//! Decode over a paged KV cache: bf16 latent rows are quantised into the V3.2 FP8 cache (656 bytes per
//! token), read back, and attended by a sparse FP8 decode; a dense decode over the dequantised rows, through a
//! block table, gives the same result. The FP8 quantiser and both decodes also run on the GPU when an sm_90 device is
//! present (the cache bit-exact with the CPU's, the decodes within the spec's tolerances).
//!
//! ```sh
//! cargo run --release -p flashmla --example paged_decode
//! ```

use flashmla::cuda::Gpu;
use flashmla::ops::decode::{
    decode_dense_cpu, decode_dense_cuda, decode_sparse_cpu, decode_sparse_cuda, DecodeOptions,
    DecodeOutput, DenseDecodeArgs, SparseDecodeArgs,
};
use flashmla::ops::kv_quant::{
    dequantize_cpu, quantize_cpu, quantize_cuda, DequantizeArgs, QuantizeArgs, QuantizeOutput,
};
use flashmla::reference::compare::{compare, DECODE_LSE, DECODE_OUT};
use flashmla::{DType, HostTensor, KvFormat, TensorMeta};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use std::error::Error;

/// Cache geometry: blocks of `PAGE_SIZE` tokens (the FlashMLA page size).
const NUM_BLOCKS: usize = 8;
const PAGE_SIZE: usize = 64;
/// Requests in the batch, query tokens per request (2: one extra token of speculative decoding), heads.
const BATCH: usize = 2;
const S_Q: usize = 2;
const H_Q: usize = 64;
/// Tokens each request has in the cache.
const SEQ_LENS: [usize; BATCH] = [200, 131];
/// Blocks of each request, in order (a request's blocks need not be contiguous or sorted).
const BLOCK_TABLE: [[i32; 4]; BATCH] = [[5, 0, 7, 2], [3, 6, 1, 4]];

type Res<T> = Result<T, Box<dyn Error>>;

fn normal(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let dist = Normal::new(0.0f32, 0.5).expect("a positive standard deviation");
    (0..n).map(|_| dist.sample(rng)).collect()
}

fn main() -> Res<()> {
    let format = KvFormat::V32;
    let d_qk = format.d_qk();
    let mut rng = StdRng::seed_from_u64(7);

    // 1. Quantise the latent rows of every cached token into the FP8 cache and read them back.
    let kv = HostTensor::bf16_from_f32(
        &normal(&mut rng, NUM_BLOCKS * PAGE_SIZE * d_qk),
        &[NUM_BLOCKS, PAGE_SIZE, 1, d_qk],
    )?;
    let cache = quantize_cpu(&QuantizeArgs { kv: &kv })?.cache;
    let restored = dequantize_cpu(&DequantizeArgs { cache: &cache })?.kv;
    let (a, b) = (kv.to_f32_vec()?, restored.to_f32_vec()?);
    let worst = a
        .chunks(d_qk)
        .zip(b.chunks(d_qk))
        .map(|(x, y)| {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            err / amax
        })
        .fold(0f32, f32::max);
    println!(
        "FP8 cache {:?} ({} bytes per token): worst error of a token {:.3} of its largest value",
        cache.shape(),
        format.bytes_per_token(),
        worst
    );

    if let Some(gpu) = open_gpu() {
        let dev_kv = gpu.upload(&kv)?;
        let dev_cache = gpu.alloc(DType::U8, cache.shape())?;
        let out = QuantizeOutput {
            cache: dev_cache.view(),
        };
        quantize_cuda(&gpu, &QuantizeArgs { kv: &dev_kv.view() }, &out)?;
        gpu.synchronize()?;
        if gpu.download(&dev_cache)?.to_u8_vec()? != cache.to_u8_vec()? {
            return Err("the GPU's FP8 cache differs from the CPU's".into());
        }
        println!("GPU ({}): the same cache, byte for byte", gpu.info().name);
    }

    // 2. Sparse FP8 decode: each query attends to the cache tokens its index row names, here every token of
    //    its request (token `block * PAGE_SIZE + offset`; -1 pads the shorter request's row).
    let q = HostTensor::bf16_from_f32(
        &normal(&mut rng, BATCH * S_Q * H_Q * d_qk),
        &[BATCH, S_Q, H_Q, d_qk],
    )?;
    let topk = SEQ_LENS
        .iter()
        .max()
        .copied()
        .unwrap_or(0)
        .next_multiple_of(64);
    let mut indices = vec![-1i32; BATCH * S_Q * topk];
    for (r, &len) in SEQ_LENS.iter().enumerate() {
        for s in 0..S_Q {
            let row = &mut indices[(r * S_Q + s) * topk..][..topk];
            for (p, slot) in row.iter_mut().take(len).enumerate() {
                *slot = BLOCK_TABLE[r][p / PAGE_SIZE] * PAGE_SIZE as i32 + (p % PAGE_SIZE) as i32;
            }
        }
    }
    let indices = HostTensor::from_i32(indices, &[BATCH, S_Q, topk])?;
    let sparse = decode_sparse_cpu(&SparseDecodeArgs {
        q: &q,
        k_cache: &cache,
        indices: &indices,
        topk_length: None,
        softmax_scale: None,
        attn_sink: None,
        extra: None,
    })?;
    println!(
        "sparse FP8 decode: out {:?}, lse {:?}",
        sparse.out.shape(),
        sparse.lse.shape()
    );

    // 3. Dense decode over the dequantised rows through the block table: the same attention.
    let block_table = HostTensor::from_i32(BLOCK_TABLE.concat(), &[BATCH, BLOCK_TABLE[0].len()])?;
    let seqlens: Vec<i32> = SEQ_LENS.iter().map(|&l| l as i32).collect();
    let cache_seqlens = HostTensor::from_i32(seqlens, &[BATCH])?;
    let dense = decode_dense_cpu(&DenseDecodeArgs {
        q: &q,
        k_cache: &restored,
        block_table: &block_table,
        cache_seqlens: &cache_seqlens,
        softmax_scale: None,
        causal: false,
        attn_sink: None,
    })?;
    agree("sparse FP8 and dense decode", &sparse, &dense)?;

    // 4. The same two decodes on the GPU: the split-KV schedule is computed on the device, nothing is synchronised
    //    until the results are read back.
    if let Some(gpu) = open_gpu() {
        let up = |t: &HostTensor| gpu.upload(t);
        let (d_q, d_cache, d_idx) = (up(&q)?, up(&cache)?, up(&indices)?);
        let (d_restored, d_bt, d_sl) = (up(&restored)?, up(&block_table)?, up(&cache_seqlens)?);
        let outputs = || -> flashmla::Result<_> {
            let out = gpu.alloc(DType::Bf16, sparse.out.shape())?;
            let lse = gpu.alloc(DType::F32, sparse.lse.shape())?;
            Ok((out, lse))
        };
        let (s_out, s_lse) = outputs()?;
        decode_sparse_cuda(
            &gpu,
            &SparseDecodeArgs {
                q: &d_q.view(),
                k_cache: &d_cache.view(),
                indices: &d_idx.view(),
                topk_length: None,
                softmax_scale: None,
                attn_sink: None,
                extra: None,
            },
            &DecodeOutput {
                out: s_out.view(),
                lse: s_lse.view(),
            },
            &DecodeOptions::default(),
            None,
        )?;
        let (d_out, d_lse) = outputs()?;
        decode_dense_cuda(
            &gpu,
            &DenseDecodeArgs {
                q: &d_q.view(),
                k_cache: &d_restored.view(),
                block_table: &d_bt.view(),
                cache_seqlens: &d_sl.view(),
                softmax_scale: None,
                causal: false,
                attn_sink: None,
            },
            &DecodeOutput {
                out: d_out.view(),
                lse: d_lse.view(),
            },
            &DecodeOptions::default(),
            None,
        )?;
        let read = |o: &flashmla::cuda::DeviceTensor,
                    l: &flashmla::cuda::DeviceTensor|
         -> flashmla::Result<_> {
            Ok(DecodeOutput {
                out: gpu.download(o)?,
                lse: gpu.download(l)?,
            })
        };
        agree(
            "GPU sparse FP8 decode and the CPU's",
            &read(&s_out, &s_lse)?,
            &sparse,
        )?;
        agree(
            "GPU dense decode and the CPU's",
            &read(&d_out, &d_lse)?,
            &dense,
        )?;
    }
    Ok(())
}

/// Checks two decode results against each other with the spec's decode tolerances.
fn agree(
    what: &str,
    got: &DecodeOutput<HostTensor>,
    want: &DecodeOutput<HostTensor>,
) -> Result<(), Box<dyn Error>> {
    for (name, a, b, tol) in [
        ("out", &got.out, &want.out, &DECODE_OUT),
        ("lse", &got.lse, &want.lse, &DECODE_LSE),
    ] {
        let c = compare(&a.to_f32_vec()?, &b.to_f32_vec()?);
        c.check(tol)
            .map_err(|e| format!("{what} differ in {name}: {e}"))?;
        println!(
            "  {name}: {what} agree (max abs difference {:.2e})",
            c.max_abs_err
        );
    }
    Ok(())
}

/// Device 0 when it is an sm_90 GPU and this build embeds the FP8 cache kernels; otherwise says why not.
fn open_gpu() -> Option<Gpu> {
    let built = flashmla::cuda::kernels_built();
    if !built.iter().any(|&(f, ok)| f == "kv_quant" && ok) {
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
