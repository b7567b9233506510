//! The dense varlen prefill op on the CPU: typed errors for bad arguments, and results against the f64 reference.

use flashmla::cancel::CancelToken;
use flashmla::ops::dense_prefill::{
    dense_prefill_bwd_cpu, dense_prefill_fwd_cpu, DensePrefillArgs, DensePrefillBwdArgs,
};
use flashmla::reference::compare::{compare, BWD_GRAD, PREFILL_LSE, PREFILL_OUT};
use flashmla::reference::dense_prefill::{
    dense_prefill_bwd, dense_prefill_fwd, DensePrefillProblem,
};
use flashmla::{HostTensor, TensorMeta};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Case {
    q: HostTensor,
    k: HostTensor,
    v: HostTensor,
    cu_q: HostTensor,
    cu_k: HostTensor,
}

/// Sequences of `lens` (queries, keys), bf16 values of a random normal-ish draw.
fn case(lens: &[(usize, usize)], h_q: usize, h_k: usize, d: usize, d_v: usize, seed: u64) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut cu_q, mut cu_k) = (vec![0i32], vec![0i32]);
    for &(a, b) in lens {
        cu_q.push(cu_q.last().unwrap() + a as i32);
        cu_k.push(cu_k.last().unwrap() + b as i32);
    }
    let (tq, tk) = (
        *cu_q.last().unwrap() as usize,
        *cu_k.last().unwrap() as usize,
    );
    let mut vals = |n: usize| {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect::<Vec<_>>()
    };
    let (qv, kv, vv) = (vals(tq * h_q * d), vals(tk * h_k * d), vals(tk * h_k * d_v));
    Case {
        q: HostTensor::bf16_from_f32(&qv, &[tq, h_q, d]).unwrap(),
        k: HostTensor::bf16_from_f32(&kv, &[tk, h_k, d]).unwrap(),
        v: HostTensor::bf16_from_f32(&vv, &[tk, h_k, d_v]).unwrap(),
        cu_q: HostTensor::from_i32(cu_q.clone(), &[cu_q.len()]).unwrap(),
        cu_k: HostTensor::from_i32(cu_k.clone(), &[cu_k.len()]).unwrap(),
    }
}

impl Case {
    fn args(&self, causal: bool) -> DensePrefillArgs<'_, HostTensor> {
        DensePrefillArgs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
            softmax_scale: None,
            causal,
        }
    }
}

fn f32s(t: &HostTensor) -> Vec<f32> {
    t.to_f32_vec().unwrap()
}

#[test]
fn forward_and_backward_match_the_f64_reference() {
    // Mixed lengths, an empty key sequence and more queries than keys (causal rows that see nothing).
    let c = case(&[(37, 70), (5, 0), (20, 9), (64, 64)], 4, 2, 192, 128, 11);
    for causal in [false, true] {
        let args = c.args(causal);
        let fwd = dense_prefill_fwd_cpu(&args).unwrap();
        let (q, k, v) = (f32s(&c.q), f32s(&c.k), f32s(&c.v));
        let (cu_q, cu_k) = (c.cu_q.to_i32_vec().unwrap(), c.cu_k.to_i32_vec().unwrap());
        let p = DensePrefillProblem {
            h_q: 4,
            h_k: 2,
            d: 192,
            d_v: 128,
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
            q: &q,
            k: &k,
            v: &v,
            scale: 192f32.powf(-0.5),
            causal,
        };
        let truth = dense_prefill_fwd::<f64>(&p, CancelToken::never()).unwrap();
        let out = f32s(&fwd.out);
        compare(&out, &truth.out).check(&PREFILL_OUT).expect("out");
        compare(&f32s(&fwd.lse), &truth.lse)
            .check(&PREFILL_LSE)
            .expect("lse");
        assert_eq!(fwd.lse.shape(), &[4, 126]);

        let mut rng = StdRng::seed_from_u64(5);
        let g: Vec<f32> = (0..out.len())
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let d_out = HostTensor::bf16_from_f32(&g, fwd.out.shape()).unwrap();
        let grads = dense_prefill_bwd_cpu(&DensePrefillBwdArgs {
            fwd: c.args(causal),
            out: &fwd.out,
            d_out: &d_out,
            lse: &fwd.lse,
        })
        .unwrap();
        let want = dense_prefill_bwd::<f64>(
            &p,
            &out,
            &f32s(&fwd.lse),
            &f32s(&d_out),
            CancelToken::never(),
        )
        .unwrap();
        compare(&f32s(&grads.d_q), &want.d_q)
            .check(&BWD_GRAD)
            .expect("d_q");
        compare(&f32s(&grads.d_k), &want.d_k)
            .check(&BWD_GRAD)
            .expect("d_k");
        compare(&f32s(&grads.d_v), &want.d_v)
            .check(&BWD_GRAD)
            .expect("d_v");
    }
}

#[test]
fn bad_arguments_are_typed_errors_naming_them() {
    let c = case(&[(3, 4)], 4, 2, 192, 128, 1);
    let err = |args: &DensePrefillArgs<'_, HostTensor>| {
        dense_prefill_fwd_cpu(args).unwrap_err().to_string()
    };
    let wide = case(&[(3, 4)], 4, 2, 192, 192, 1);
    assert!(err(&DensePrefillArgs {
        v: &wide.v,
        ..c.args(false)
    })
    .contains("q.shape[2]"));
    let f32_q = HostTensor::from_f32(f32s(&c.q), &[3, 4, 192]).unwrap();
    assert!(err(&DensePrefillArgs {
        q: &f32_q,
        ..c.args(false)
    })
    .contains("q.dtype"));
    let three_heads = case(&[(3, 4)], 4, 3, 192, 128, 1);
    let e = err(&DensePrefillArgs {
        k: &three_heads.k,
        v: &three_heads.v,
        ..c.args(false)
    });
    assert!(e.contains("q.shape[1]"), "{e}");
    let bad_cu = HostTensor::from_i32(vec![0, 2], &[2]).unwrap();
    let e = err(&DensePrefillArgs {
        cu_seqlens_q: &bad_cu,
        ..c.args(false)
    });
    assert!(e.contains("cu_seqlens_q[1]"), "{e}");
    let short_k = HostTensor::from_i32(vec![0, 2, 4], &[3]).unwrap();
    let e = err(&DensePrefillArgs {
        cu_seqlens_k: &short_k,
        ..c.args(false)
    });
    assert!(e.contains("cu_seqlens_k.shape[0]"), "{e}");
    let e = err(&DensePrefillArgs {
        softmax_scale: Some(f32::NAN),
        ..c.args(false)
    });
    assert!(e.contains("softmax_scale"), "{e}");
}
