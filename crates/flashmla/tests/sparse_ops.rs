//! The sparse prefill ops on the CPU: outputs in the spec dtypes and shapes, agreement with the f64
//! reference within spec section 6 tolerances, and stride independence.

mod common;

use common::compare::{BWD_GRAD, PREFILL_LSE, PREFILL_MAX_LOGITS, PREFILL_OUT};
use common::{assert_close, values, Case, IndexOpts, Shape, Sink};
use flashmla::ops::sparse_bwd::{sparse_bwd_cpu, SparseBwdOutput};
use flashmla::ops::sparse_fwd::{sparse_fwd_cpu, D_V};
use flashmla::reference::sparse_bwd::{sparse_bwd, SparseBwdProblem};
use flashmla::reference::sparse_fwd::sparse_fwd;
use flashmla::{DType, HostTensor, TensorMeta};

fn shape(s_q: usize, s_kv: usize, h_q: usize, d_qk: usize, topk: usize) -> Shape {
    Shape {
        s_q,
        s_kv,
        h_q,
        d_qk,
        d_v: D_V,
        topk,
    }
}

fn cases(seed: u64) -> Vec<Case> {
    vec![
        Case::random(
            seed,
            shape(6, 90, 3, 576, 45),
            IndexOpts::ADVERSARIAL,
            Sink::Random,
            true,
        ),
        Case::random(
            seed + 1,
            shape(4, 33, 2, 512, 70),
            IndexOpts::ADVERSARIAL,
            Sink::None,
            false,
        ),
    ]
}

fn assert_meta(name: &str, t: &HostTensor, dtype: DType, shape: &[usize]) {
    assert_eq!((t.dtype(), t.shape()), (dtype, shape), "{name}");
    assert!(t.layout().is_contiguous(), "{name} should be contiguous");
}

/// A random bf16 `d_out` for a case.
fn d_out_for(c: &Case) -> HostTensor {
    let s = c.shape;
    let mut rng = common::rng(c.seed ^ 0xBEEF);
    let v = common::randn_bf16(&mut rng, s.s_q * s.h_q * s.d_v, 0.05);
    HostTensor::bf16_from_f32(&v, &[s.s_q, s.h_q, s.d_v]).unwrap()
}

#[test]
fn fwd_cpu_matches_f64_reference_within_spec() {
    for c in cases(10) {
        let s = c.shape;
        let name = format!("seed {} {s:?}", c.seed);
        let inputs = c.tensors();
        let got = sparse_fwd_cpu(&inputs.fwd_args()).unwrap();
        assert_meta("out", &got.out, DType::Bf16, &[s.s_q, s.h_q, D_V]);
        assert_meta("max_logits", &got.max_logits, DType::F32, &[s.s_q, s.h_q]);
        assert_meta("lse", &got.lse, DType::F32, &[s.s_q, s.h_q]);
        let want = sparse_fwd::<f64>(&c.problem()).unwrap();
        assert_close(
            &format!("{name} out"),
            &values(&got.out),
            &want.out,
            PREFILL_OUT,
        );
        assert_close(
            &format!("{name} lse"),
            &values(&got.lse),
            &want.lse,
            PREFILL_LSE,
        );
        assert_close(
            &format!("{name} max"),
            &values(&got.max_logits),
            &want.max_logits,
            PREFILL_MAX_LOGITS,
        );
    }
}

#[test]
fn fwd_cpu_noncontiguous_inputs_give_identical_results() {
    for c in cases(20) {
        let inputs = c.tensors();
        let padded = inputs.padded();
        assert!(!padded.q.layout().is_contiguous() && !padded.indices.layout().is_contiguous());
        let a = sparse_fwd_cpu(&inputs.fwd_args()).unwrap();
        let b = sparse_fwd_cpu(&padded.fwd_args()).unwrap();
        assert_eq!(a, b, "seed {}", c.seed);
    }
}

#[test]
fn fwd_cpu_nan_in_unreferenced_kv_rows_does_not_leak() {
    let clean = Case::random(
        30,
        shape(5, 120, 2, 576, 40),
        IndexOpts::ADVERSARIAL,
        Sink::Random,
        true,
    );
    let mut dirty = clean.clone();
    assert!(dirty.nan_unreferenced() > 0);
    let a = sparse_fwd_cpu(&clean.tensors().fwd_args()).unwrap();
    let b = sparse_fwd_cpu(&dirty.tensors().padded().fwd_args()).unwrap();
    assert_eq!(a, b);
}

#[test]
fn fwd_cpu_empty_token_and_kv_dimensions() {
    // s_q = 0: empty outputs of the right shapes.
    let c = Case::random(
        40,
        shape(0, 10, 4, 512, 8),
        IndexOpts::CLEAN,
        Sink::Random,
        true,
    );
    let got = sparse_fwd_cpu(&c.tensors().fwd_args()).unwrap();
    assert_meta("out", &got.out, DType::Bf16, &[0, 4, D_V]);
    assert_meta("lse", &got.lse, DType::F32, &[0, 4]);
    // s_kv = 0: every index is invalid, every token is empty.
    let c = Case::random(
        41,
        shape(3, 0, 2, 576, 5),
        IndexOpts::CLEAN,
        Sink::Random,
        false,
    );
    let got = sparse_fwd_cpu(&c.tensors().fwd_args()).unwrap();
    assert!(values(&got.out).iter().all(|&x| x == 0.0));
    assert!(values(&got.lse).iter().all(|&x| x == f32::INFINITY));
    assert!(values(&got.max_logits)
        .iter()
        .all(|&x| x == f32::NEG_INFINITY));
}

/// Runs the forward op, then the backward op on its outputs.
fn fwd_then_bwd(c: &Case, d_kv_dtype: DType, padded: bool) -> SparseBwdOutput<HostTensor> {
    let inputs = c.tensors();
    let f = sparse_fwd_cpu(&inputs.fwd_args()).unwrap();
    let d_out = d_out_for(c);
    if padded {
        let (p, out, d_out, lse) = (
            inputs.padded(),
            common::pad(&f.out),
            common::pad(&d_out),
            common::pad(&f.lse),
        );
        sparse_bwd_cpu(&p.bwd_args(&out, &d_out, &lse, d_kv_dtype)).unwrap()
    } else {
        sparse_bwd_cpu(&inputs.bwd_args(&f.out, &d_out, &f.lse, d_kv_dtype)).unwrap()
    }
}

#[test]
fn bwd_cpu_matches_f64_reference_within_spec() {
    for c in cases(50) {
        for d_kv_dtype in [DType::Bf16, DType::F32] {
            let s = c.shape;
            let name = format!("seed {} {s:?} d_kv {d_kv_dtype}", c.seed);
            let got = fwd_then_bwd(&c, d_kv_dtype, false);
            assert_meta("d_q", &got.d_q, DType::Bf16, &[s.s_q, s.h_q, s.d_qk]);
            assert_meta("d_kv", &got.d_kv, d_kv_dtype, &[s.s_kv, 1, s.d_qk]);
            assert_meta("delta", &got.delta, DType::F32, &[s.s_q, s.h_q]);
            assert_eq!(got.d_attn_sink.is_some(), c.attn_sink.is_some(), "{name}");
            if let Some(d) = &got.d_attn_sink {
                assert_meta("d_attn_sink", d, DType::F32, &[s.h_q]);
            }
            // The truth: the f64 backward from the same (bf16 out, f32 lse, bf16 d_out) inputs.
            let inputs = c.tensors();
            let f = sparse_fwd_cpu(&inputs.fwd_args()).unwrap();
            let (out, lse, d_out) = (values(&f.out), values(&f.lse), values(&d_out_for(&c)));
            let want = sparse_bwd::<f64>(&SparseBwdProblem {
                fwd: c.problem(),
                out: &out,
                d_out: &d_out,
                lse: &lse,
            })
            .unwrap();
            assert_close(
                &format!("{name} d_q"),
                &values(&got.d_q),
                &want.d_q,
                BWD_GRAD,
            );
            assert_close(
                &format!("{name} d_kv"),
                &values(&got.d_kv),
                &want.d_kv,
                BWD_GRAD,
            );
            assert_close(
                &format!("{name} delta"),
                &values(&got.delta),
                &want.delta,
                PREFILL_LSE,
            );
            if let (Some(g), Some(w)) = (&got.d_attn_sink, &want.d_attn_sink) {
                assert_close(&format!("{name} d_sink"), &values(g), w, BWD_GRAD);
            }
        }
    }
}

#[test]
fn bwd_cpu_noncontiguous_inputs_give_identical_results() {
    for c in cases(60) {
        let a = fwd_then_bwd(&c, DType::F32, false);
        let b = fwd_then_bwd(&c, DType::F32, true);
        assert_eq!(a, b, "seed {}", c.seed);
    }
}

#[test]
fn bwd_cpu_unreferenced_kv_rows_are_exactly_zero_in_both_dtypes() {
    let mut c = Case::random(
        70,
        shape(4, 150, 2, 512, 30),
        IndexOpts::ADVERSARIAL,
        Sink::Random,
        true,
    );
    c.nan_unreferenced();
    let used = c.referenced();
    for d_kv_dtype in [DType::Bf16, DType::F32] {
        let g = fwd_then_bwd(&c, d_kv_dtype, false);
        let d_kv = values(&g.d_kv);
        assert!(d_kv.iter().all(|x| x.is_finite()));
        for (r, _) in used.iter().enumerate().filter(|(_, &u)| !u) {
            assert!(
                d_kv[r * 512..(r + 1) * 512].iter().all(|&x| x == 0.0),
                "row {r}"
            );
        }
    }
}

#[test]
fn bwd_cpu_with_no_kv_rows() {
    let c = Case::random(
        80,
        shape(3, 0, 2, 576, 4),
        IndexOpts::CLEAN,
        Sink::Random,
        true,
    );
    let g = fwd_then_bwd(&c, DType::Bf16, false);
    assert_meta("d_kv", &g.d_kv, DType::Bf16, &[0, 1, 576]);
    assert!(values(&g.d_q).iter().all(|&x| x == 0.0));
    assert!(values(g.d_attn_sink.as_ref().unwrap())
        .iter()
        .all(|&x| x == 0.0));
}
