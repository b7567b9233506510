//! GPU tests of the sparse backward beyond `flashmla check`: `topk_length` gives the same gradients as
//! masking the tail of each index row with `-1`, and both match the f64 reference (judged net of the bf16
//! rounding of the MMA operands, which these few-entry tokens make visible). Run on an sm_90 machine with
//! `cargo test -p flashmla --test gpu_sparse_bwd -- --ignored`.

use flashmla::cuda::Gpu;
use flashmla::ops::sparse_bwd::{
    sparse_bwd_cuda_with, SparseBwdArgs, SparseBwdOptions, SparseBwdOutput,
};
use flashmla::ops::sparse_fwd::D_V;
use flashmla::reference::compare::{compare_with_allowance, BWD_GRAD};
use flashmla::reference::sparse_bwd::{sparse_bwd, sparse_bwd_operand_rounding, SparseBwdProblem};
use flashmla::testing::{peer_bf16, rng, SparseCase, SparseValues};
use flashmla::{DType, HostTensor};

fn gpu() -> Gpu {
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    assert!(
        gpu.info().is_sm90(),
        "these tests need sm_90: {}",
        gpu.info()
    );
    gpu
}

/// `(d_q, d_kv)` of the GPU backward (f32 `d_kv`, outputs poisoned first) for `v` with the given
/// forward outputs.
fn run_gpu(
    gpu: &Gpu,
    v: &SparseValues,
    out: &[f32],
    lse: &[f32],
    d_out: &[f32],
    deterministic: bool,
) -> (Vec<f32>, Vec<f32>) {
    let (s_q, h_q, d_qk, topk, s_kv) = (v.s_q, v.h_q, v.d_qk, v.topk, v.s_kv);
    let up = |t: HostTensor| gpu.upload(&t).unwrap();
    let q = up(HostTensor::bf16_from_f32(&v.q, &[s_q, h_q, d_qk]).unwrap());
    let kv = up(HostTensor::bf16_from_f32(&v.kv, &[s_kv, 1, d_qk]).unwrap());
    let idx = up(HostTensor::from_i32(v.indices.clone(), &[s_q, 1, topk]).unwrap());
    let o = up(HostTensor::bf16_from_f32(out, &[s_q, h_q, D_V]).unwrap());
    let l = up(HostTensor::from_f32(lse.to_vec(), &[s_q, h_q]).unwrap());
    let g = up(HostTensor::bf16_from_f32(d_out, &[s_q, h_q, D_V]).unwrap());
    let len = v
        .topk_length
        .as_ref()
        .map(|x| up(HostTensor::from_i32(x.clone(), &[s_q]).unwrap()));
    let d_q = gpu
        .alloc_filled(DType::Bf16, &[s_q, h_q, d_qk], 0xFF)
        .unwrap();
    let d_kv = gpu
        .alloc_filled(DType::F32, &[s_kv, 1, d_qk], 0xFF)
        .unwrap();
    let delta = gpu.alloc_filled(DType::F32, &[s_q, h_q], 0xFF).unwrap();
    let (qv, kvv, iv, ov, lv, gv) = (
        q.view(),
        kv.view(),
        idx.view(),
        o.view(),
        l.view(),
        g.view(),
    );
    let lenv = len.as_ref().map(|t| t.view());
    let args = SparseBwdArgs {
        q: &qv,
        kv: &kvv,
        out: &ov,
        d_out: &gv,
        indices: &iv,
        lse: &lv,
        sm_scale: v.sm_scale,
        attn_sink: None,
        topk_length: lenv.as_ref(),
        d_kv_dtype: DType::F32,
    };
    let grads = SparseBwdOutput {
        d_q: d_q.view(),
        d_kv: d_kv.view(),
        delta: delta.view(),
        d_attn_sink: None,
    };
    let options = SparseBwdOptions {
        deterministic,
        ..Default::default()
    };
    sparse_bwd_cuda_with(gpu, &args, &grads, &options, None).unwrap();
    (
        gpu.download(&d_q).unwrap().to_f32_vec().unwrap(),
        gpu.download(&d_kv).unwrap().to_f32_vec().unwrap(),
    )
}

#[test]
#[ignore = "needs an sm_90 GPU"]
fn topk_length_equals_masking_the_tail_and_matches_the_reference() {
    let gpu = gpu();
    for h_q in [128usize, 64] {
        for lengths in ["generated", "topk", "64", "100", "alternating 0 / topk"] {
            let mut c = SparseCase::plain(64, 4096, h_q, 576, 128);
            c.topk_length = true;
            let mut v = c.generate(7).unwrap().values().unwrap();
            for (t, l) in v.topk_length.as_mut().unwrap().iter_mut().enumerate() {
                *l = match lengths {
                    "topk" => 128,
                    "64" => 64,
                    "100" => 100,
                    "alternating 0 / topk" => 128 * (t % 2) as i32,
                    _ => *l,
                };
            }
            let mut masked = v.clone();
            let len = v.topk_length.clone().unwrap();
            for (t, &len_t) in len.iter().enumerate() {
                for j in (len_t.max(0) as usize).min(v.topk)..v.topk {
                    masked.indices[t * v.topk + j] = -1;
                }
            }
            masked.topk_length = None;

            let d_out = peer_bf16(&mut rng(5), v.s_q * h_q * D_V);
            let (out, lse) = v.reference_fwd_outputs().unwrap();
            let problem = SparseBwdProblem {
                fwd: v.problem(),
                out: &out,
                d_out: &d_out,
                lse: &lse,
            };
            let want = sparse_bwd::<f64>(&problem).unwrap();
            let bound = sparse_bwd_operand_rounding(&problem).unwrap();
            for deterministic in [false, true] {
                let what = format!("h_q {h_q}, lengths {lengths}, deterministic {deterministic}");
                let (dq, dkv) = run_gpu(&gpu, &v, &out, &lse, &d_out, deterministic);
                let (dq_m, dkv_m) = run_gpu(&gpu, &masked, &out, &lse, &d_out, deterministic);
                // Same contributions either way; only the order of the f32 reductions may differ.
                let worst = dkv
                    .iter()
                    .zip(&dkv_m)
                    .map(|(a, b)| (a - b).abs() / (b.abs() + 1e-3))
                    .fold(0.0f32, f32::max);
                assert!(
                    worst < 1e-4,
                    "{what}: topk_length vs -1 masking differ by {worst:e}"
                );
                assert_eq!(
                    dq, dq_m,
                    "{what}: d_q differs between topk_length and masking"
                );
                compare_with_allowance(&dq, &want.d_q, &bound.d_q)
                    .check(&BWD_GRAD)
                    .unwrap_or_else(|e| panic!("{what}: d_q {e}"));
                compare_with_allowance(&dkv, &want.d_kv, &bound.d_kv)
                    .check(&BWD_GRAD)
                    .unwrap_or_else(|e| panic!("{what}: d_kv {e}"));
            }
        }
    }
}
