//! Dense varlen prefill forward: the kernel against the f64 reference (spec section 6 prefill tolerances), with
//! outputs poisoned before every run. Every (d, dtype, mask) meets single sequences with tails of every kind, packed
//! batches with empty query and key sequences, more queries than keys (causal rows that see nothing), GQA / MQA,
//! non-contiguous inputs and peaky logits.

use super::{check, check_net, Case, Outcome};
use crate::device_ops::{DensePrefillBwdOnGpu, DensePrefillOnGpu};
use flashmla::cuda::Gpu;
use flashmla::ops::dense_prefill::DensePrefillBwdOptions;
use flashmla::reference::compare::{BWD_GRAD, PREFILL_LSE, PREFILL_OUT};
use flashmla::reference::dense_prefill::{
    dense_prefill_bwd, dense_prefill_bwd_rounding, dense_prefill_fwd, dense_prefill_p_rounding,
};
use flashmla::reference::sparse_bwd::BF16_UNIT_ROUNDOFF;
use flashmla::testing::{prefill_case, randn_half, rng, PrefillSpec};
use flashmla::{DType, TensorMeta};

/// How a case is run.
#[derive(Clone)]
struct Spec {
    data: PrefillSpec,
    causal: bool,
    /// Pass q, k and v non-contiguous.
    padded: bool,
    softmax_scale: Option<f32>,
}

fn run_case(gpu: &Gpu, spec: &Spec, seed: u64) -> flashmla::Result<Outcome> {
    let case = prefill_case(&mut rng(seed), &spec.data)?;
    let dev = DensePrefillOnGpu::new(
        gpu,
        &if spec.padded {
            case.padded()?
        } else {
            case.clone()
        },
        true,
    )?;
    dev.run(gpu, spec.causal, spec.softmax_scale)?;
    let (out, lse) = dev.download(gpu)?;
    let scale = spec
        .softmax_scale
        .unwrap_or((spec.data.d as f32).powf(-0.5));
    let problem = case.problem(&spec.data, spec.causal, scale);
    let cancel = crate::signals::token();
    let want = dense_prefill_fwd::<f64>(&problem, cancel)?;
    // The kernel rounds P to the element type for the P V MMA (as every 16-bit tensor-core attention does): out is
    // judged net of that rounding's bound (docs/spec.md section 6).
    let unit_roundoff = match spec.data.dtype {
        DType::F16 => 1.0 / 2048.0,
        _ => BF16_UNIT_ROUNDOFF,
    };
    let allowance = dense_prefill_p_rounding(&problem, unit_roundoff, cancel)?;
    Ok(Outcome::from_checks(vec![
        check_net("out", &out, &want.out, &PREFILL_OUT, Some(&allowance)),
        check("lse", &lse, &want.lse, &PREFILL_LSE),
    ]))
}

/// The backward: the GPU forward, then the GPU backward from its `out` and `lse`; the reference backward reads the
/// same `out` and `lse` (downloaded), so only the backward is judged, net of the bound of its operand rounding.
/// `options` picks the schedule; with `deterministic` a second run must give bitwise the same gradients.
fn run_bwd_case(
    gpu: &Gpu,
    spec: &Spec,
    seed: u64,
    options: DensePrefillBwdOptions,
) -> flashmla::Result<Outcome> {
    let deterministic = options.deterministic;
    let case = prefill_case(&mut rng(seed), &spec.data)?;
    let (total_q, h_q) = (case.q.shape()[0], spec.data.h_q);
    let d_out = randn_half(
        &mut rng(seed ^ 0x9e37),
        &[total_q, h_q, 128],
        1.0,
        spec.data.dtype,
    )?;
    let input = if spec.padded {
        case.padded()?
    } else {
        case.clone()
    };
    let dev = DensePrefillBwdOnGpu::new(gpu, &input, &d_out, true, options)?;
    dev.fwd.run(gpu, spec.causal, spec.softmax_scale)?;
    dev.run(gpu, spec.causal, spec.softmax_scale)?;
    let (d_q, d_k, d_v) = dev.download(gpu)?;
    let (out, lse) = dev.fwd.download(gpu)?;
    let scale = spec
        .softmax_scale
        .unwrap_or((spec.data.d as f32).powf(-0.5));
    let problem = case.problem(&spec.data, spec.causal, scale);
    let cancel = crate::signals::token();
    let g_out = d_out.to_f32_vec()?;
    let want = dense_prefill_bwd::<f64>(&problem, &out, &lse, &g_out, cancel)?;
    let unit_roundoff = match spec.data.dtype {
        DType::F16 => 1.0 / 2048.0,
        _ => BF16_UNIT_ROUNDOFF,
    };
    let allow = dense_prefill_bwd_rounding(&problem, &out, &lse, &g_out, unit_roundoff, cancel)?;
    let mut checks = vec![
        check_net("d_q", &d_q, &want.d_q, &BWD_GRAD, Some(&allow.d_q)),
        check_net("d_k", &d_k, &want.d_k, &BWD_GRAD, Some(&allow.d_k)),
        check_net("d_v", &d_v, &want.d_v, &BWD_GRAD, Some(&allow.d_v)),
    ];
    if deterministic {
        dev.run(gpu, spec.causal, spec.softmax_scale)?;
        let (q2, k2, v2) = dev.download(gpu)?;
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        checks.push((
            "deterministic gradients".into(),
            if same(&q2, &d_q) && same(&k2, &d_k) && same(&v2, &d_v) {
                Ok("bitwise identical on a second run".into())
            } else {
                Err("differ between runs".into())
            },
        ));
    }
    Ok(Outcome::from_checks(checks))
}

/// Offsets that break the contract (decreasing, past the row counts, negative): the values are unspecified, but the
/// launch must complete without a fault and the next launch must still be right.
fn run_hostile_offsets(gpu: &Gpu, seed: u64) -> flashmla::Result<Outcome> {
    let data = PrefillSpec {
        lens: vec![(100, 100), (100, 100), (100, 100), (100, 100)],
        h_q: 2,
        h_k: 1,
        d: 192,
        dtype: DType::Bf16,
        q_std: 1.0,
    };
    let mut case = prefill_case(&mut rng(seed), &data)?;
    let bad = vec![0, 350, 100, i32::MAX, -5];
    case.cu_q = flashmla::HostTensor::from_i32(bad.clone(), &[5])?;
    case.cu_k = flashmla::HostTensor::from_i32(vec![i32::MIN, 500, -1, 399, 1 << 30], &[5])?;
    let dev = DensePrefillOnGpu::new(gpu, &case, true)?;
    for causal in [false, true] {
        dev.run(gpu, causal, None)?;
        gpu.synchronize()?;
    }
    // The backward on the same offsets, every schedule at both head dimensions (the fused one numbers its
    // accumulator tiles from the query offsets).
    for d in [192, 128] {
        let data = PrefillSpec { d, ..data.clone() };
        let mut case = prefill_case(&mut rng(seed), &data)?;
        case.cu_q = flashmla::HostTensor::from_i32(bad.clone(), &[5])?;
        case.cu_k = flashmla::HostTensor::from_i32(vec![i32::MIN, 500, -1, 399, 1 << 30], &[5])?;
        let d_out = randn_half(&mut rng(seed ^ 7), &[400, 2, 128], 1.0, DType::Bf16)?;
        for (deterministic, fused) in [(false, Some(true)), (true, None), (false, Some(false))] {
            let options = DensePrefillBwdOptions {
                deterministic,
                fused,
            };
            let dev = DensePrefillBwdOnGpu::new(gpu, &case, &d_out, true, options)?;
            for causal in [false, true] {
                dev.fwd.run(gpu, causal, None)?;
                dev.run(gpu, causal, None)?;
                gpu.synchronize()?;
            }
        }
    }
    let ok = Spec {
        data,
        causal: true,
        padded: false,
        softmax_scale: None,
    };
    run_case(gpu, &ok, seed ^ 1)
}

fn push(v: &mut Vec<Case>, name: String, quick: bool, spec: Spec) {
    v.push(Case {
        name,
        quick,
        run: Box::new(move |gpu, _tuning, seed| run_case(gpu, &spec, seed)),
    });
}

/// The forward grid: (d, dtype) x mask x sequence sets, with GQA, padding, peaky logits and a custom scale in
/// rotation, two cases with more work items than SMs, and the hostile-offsets case.
pub fn cases() -> Vec<Case> {
    let sets: [(&str, Vec<(usize, usize)>); 8] = [
        ("one_tile", vec![(128, 128)]),
        ("one_row", vec![(1, 1)]),
        ("tails", vec![(300, 300)]),
        ("more_keys", vec![(257, 513)]),
        ("more_queries", vec![(513, 257)]),
        ("long", vec![(1100, 1100)]),
        (
            "varlen_empty",
            vec![
                (37, 70),
                (5, 0),
                (20, 9),
                (64, 64),
                (0, 12),
                (200, 130),
                (129, 129),
            ],
        ),
        (
            "many_short",
            (0..40)
                .map(|i| ((i * 7) % 41, (i * 13) % 37 + (i % 3)))
                .collect(),
        ),
    ];
    let heads = [(4usize, 4usize), (8, 2), (3, 1)];
    let mut v = Vec::new();
    let mut k = 0usize;
    for (d, dtype, tname) in [
        (192usize, DType::Bf16, "bf16"),
        (192, DType::F16, "f16"),
        (128, DType::Bf16, "bf16"),
        (128, DType::F16, "f16"),
    ] {
        for causal in [false, true] {
            for (set, lens) in &sets {
                let (h_q, h_k) = heads[k % heads.len()];
                let (what, padded, q_std, scale) = match k % 4 {
                    0 => ("plain", false, 1.0, None),
                    1 => ("noncontiguous", true, 1.0, None),
                    2 => ("peaky", false, 4.0, None),
                    _ => ("scale0.3", false, 1.0, Some(0.3)),
                };
                let quick = k % 5 == 0;
                k += 1;
                let mask = if causal { "causal" } else { "full" };
                let spec = Spec {
                    data: PrefillSpec {
                        lens: lens.clone(),
                        h_q,
                        h_k,
                        d,
                        dtype,
                        q_std,
                    },
                    causal,
                    padded,
                    softmax_scale: scale,
                };
                let name = format!("d{d}/{tname}/{mask}/{set}/h{h_q}k{h_k}/{what}");
                if *set != "long" {
                    // The f64 reference backward of the 1100-row case takes minutes on a CPU. Besides the
                    // measured schedule, every other case runs the deterministic one and, where the measured
                    // choice is the separate schedule (d 192), the others the fused one.
                    let mut runs = vec![("dense_prefill_bwd", DensePrefillBwdOptions::default())];
                    if k % 2 == 0 {
                        runs.push((
                            "dense_prefill_bwd_deterministic",
                            DensePrefillBwdOptions {
                                deterministic: true,
                                fused: None,
                            },
                        ));
                    } else if d == 192 {
                        runs.push((
                            "dense_prefill_bwd_fused",
                            DensePrefillBwdOptions {
                                deterministic: false,
                                fused: Some(true),
                            },
                        ));
                    }
                    for (op, options) in runs {
                        let bwd = spec.clone();
                        v.push(Case {
                            name: format!("{op}/{name}"),
                            quick,
                            run: Box::new(move |gpu, _tuning, seed| {
                                run_bwd_case(gpu, &bwd, seed, options)
                            }),
                        });
                    }
                }
                push(&mut v, format!("dense_prefill/{name}"), quick, spec);
            }
        }
    }
    // More work items (128-row tiles x heads) than a GPU has SMs, so that each persistent CTA serves several, with
    // a causal shift and unequal lengths (forward only: the f64 reference backward of this size takes minutes).
    for (d, dtype, tname, causal, quick) in [
        (192usize, DType::Bf16, "bf16", true, true),
        (128, DType::F16, "f16", false, false),
    ] {
        let spec = Spec {
            data: PrefillSpec {
                lens: vec![(520, 700), (300, 300), (390, 390), (0, 40)],
                h_q: 32,
                h_k: 4,
                d,
                dtype,
                q_std: 1.0,
            },
            causal,
            padded: false,
            softmax_scale: None,
        };
        let mask = if causal { "causal" } else { "full" };
        push(
            &mut v,
            format!("dense_prefill/d{d}/{tname}/{mask}/many_items/h32k4/plain"),
            quick,
            spec,
        );
    }
    v.push(Case {
        name: "dense_prefill/hostile_offsets".to_string(),
        quick: true,
        run: Box::new(|gpu, _tuning, seed| run_hostile_offsets(gpu, seed)),
    });
    v
}
