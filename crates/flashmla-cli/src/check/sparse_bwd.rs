//! Sparse prefill backward: the kernels against the CPU reference (f64 where cheap, f32 otherwise) with the
//! spec section 6 backward tolerances. The forward kernel (checked by its own cases) produces `out` and `lse`, which the
//! GPU backward and the reference both consume. Every case also checks that `d_kv` rows no valid index
//! references are exactly zero, and gradients are poisoned before the run.

use super::{check, check_net, Case, Outcome, GRID_PAIRS};
use crate::device_ops::SparseBwdOnGpu;
use crate::tuning::Tuning;
use flashmla::cuda::Gpu;
use flashmla::ops::sparse_bwd::SparseBwdOptions;
use flashmla::ops::sparse_fwd::D_V;
use flashmla::reference::compare::BWD_GRAD;
use flashmla::reference::sparse_bwd::{
    sparse_bwd_operand_rounding, sparse_bwd_with, SparseBwdProblem, SparseBwdResult,
};
use flashmla::testing::{peer_bf16, rng, IndexPattern, SinkKind, SparseCase, SparseValues};
use flashmla::{DType, HostTensor};

/// Above this many (token, head, entry) triples the reference runs in f32 (still far inside the tolerances).
const F64_LIMIT: usize = 4 << 20;

#[derive(Clone)]
struct Spec {
    case: SparseCase,
    /// Non-contiguous inputs (docs/spec.md section 6), and an `out` whose rows are only 2-byte aligned.
    padded: bool,
    d_kv_dtype: DType,
    deterministic: bool,
}

impl Spec {
    fn new(case: SparseCase) -> Self {
        Spec {
            case,
            padded: false,
            d_kv_dtype: DType::Bf16,
            deterministic: false,
        }
    }
}

/// Rows of `kv` that some valid entry (inside `topk_length`) references.
fn referenced(v: &SparseValues) -> Vec<bool> {
    let mut used = vec![false; v.s_kv];
    for t in 0..v.s_q {
        let len = v
            .topk_length
            .as_ref()
            .map_or(v.topk, |l| (l[t].max(0) as usize).min(v.topk));
        for &i in &v.indices[t * v.topk..t * v.topk + len] {
            if i >= 0 && (i as usize) < v.s_kv {
                used[i as usize] = true;
            }
        }
    }
    used
}

fn widen(r: SparseBwdResult<f32>) -> SparseBwdResult<f64> {
    let w = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<f64>>();
    SparseBwdResult {
        d_q: w(r.d_q),
        d_kv: w(r.d_kv),
        delta: w(r.delta),
        d_attn_sink: r.d_attn_sink.map(w),
    }
}

fn run_case(gpu: &Gpu, tuning: &Tuning, spec: &Spec, seed: u64) -> flashmla::Result<Outcome> {
    let c = &spec.case;
    let inp = c.generate(seed)?;
    let d_out_values = peer_bf16(&mut rng(seed ^ 0xd0d0), c.s_q * c.h_q * D_V);
    let d_out = HostTensor::bf16_from_f32(&d_out_values, &[c.s_q, c.h_q, D_V])?;
    let dev_inp = if spec.padded {
        inp.padded()?
    } else {
        inp.clone()
    };
    let mut dev = SparseBwdOnGpu::new(gpu, &dev_inp, &d_out, spec.d_kv_dtype, true)?;
    if spec.padded {
        // `out` with rows at odd element offsets: the kernels' element-wise `out` loads.
        dev.misalign_out(gpu)?;
    }
    let options = SparseBwdOptions {
        deterministic: spec.deterministic,
        tuning: tuning.bwd,
        ..SparseBwdOptions::default()
    };
    dev.run(gpu, &options)?;
    let got = dev.download(gpu)?;
    let fwd = dev.fwd.download(gpu)?;

    let values = inp.values()?;
    let problem = SparseBwdProblem {
        fwd: values.problem(),
        out: &fwd.out,
        d_out: &d_out_values,
        lse: &fwd.lse,
    };
    let small = c.s_q * c.h_q * c.topk <= F64_LIMIT;
    let stop = crate::signals::token();
    let want = if small {
        sparse_bwd_with::<f64>(&problem, stop)?
    } else {
        widen(sparse_bwd_with::<f32>(&problem, stop)?)
    };
    // Where the f64 reference runs, d_q and d_kv are judged net of the bf16 rounding of the P / dS'
    // MMA operands (a per-element bound; it only matters for tokens with few valid entries, i.e. large
    // probabilities). The larger cases use the plain spec rule.
    // With two head groups and a bf16 d_kv the pair kernel also passes each 64-head partial of d_kv to
    // the peer CTA as bf16 (launch.rs: the `_xb` kernels), one more rounding bounded the same way.
    let bf16_exchange = spec.d_kv_dtype == DType::Bf16 && c.h_q > 64 && !spec.deterministic;
    let rounding = if small {
        let mut r = sparse_bwd_operand_rounding(&problem)?;
        if bf16_exchange {
            r.d_kv.iter_mut().for_each(|x| *x *= 2.0);
        }
        Some(r)
    } else {
        None
    };
    let mut checks = vec![
        check_net(
            "d_q",
            &got.d_q,
            &want.d_q,
            &BWD_GRAD,
            rounding.as_ref().map(|r| &r.d_q[..]),
        ),
        check_net(
            "d_kv",
            &got.d_kv,
            &want.d_kv,
            &BWD_GRAD,
            rounding.as_ref().map(|r| &r.d_kv[..]),
        ),
        check("delta", &got.delta, &want.delta, &BWD_GRAD),
    ];
    if let (Some(g), Some(w)) = (&got.d_attn_sink, &want.d_attn_sink) {
        checks.push(check("d_attn_sink", g, w, &BWD_GRAD));
    }
    let used = referenced(&values);
    let d = c.d_qk;
    let nonzero = (0..c.s_kv).find(|&r| {
        !used[r]
            && got.d_kv[r * d..(r + 1) * d]
                .iter()
                .any(|&x| x.to_bits() != 0)
    });
    checks.push((
        "unreferenced d_kv rows".into(),
        match nonzero {
            None => Ok(format!(
                "{} rows exactly +0",
                used.iter().filter(|u| !**u).count()
            )),
            Some(r) => Err(format!("row {r} is not exactly zero")),
        },
    ));
    if spec.deterministic {
        dev.run(gpu, &options)?;
        let again = dev.download(gpu)?;
        let same = again
            .d_kv
            .iter()
            .zip(&got.d_kv)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        checks.push((
            "deterministic d_kv".into(),
            if same {
                Ok("bitwise identical on a second run".into())
            } else {
                Err("differs between runs".into())
            },
        ));
    }
    Ok(Outcome::from_checks(checks))
}

fn push(v: &mut Vec<Case>, name: String, quick: bool, spec: Spec) {
    v.push(Case {
        name,
        quick,
        run: Box::new(move |gpu, tuning, seed| run_case(gpu, tuning, &spec, seed)),
    });
}

/// Feature variants, rotated over the grid like the forward's.
fn variant(spec: &mut Spec, k: usize) -> &'static str {
    let c = &mut spec.case;
    match k % 7 {
        0 => "plain",
        1 => {
            c.sink = SinkKind::Random;
            c.topk_length = true;
            "sink+topk_length"
        }
        2 => {
            c.sink = SinkKind::Infinite;
            "sink_inf"
        }
        3 => {
            c.invalid_frac = 0.1;
            c.empty_every = 7;
            "invalid+empty_rows"
        }
        4 => {
            c.nan_unreferenced = true;
            c.invalid_frac = 0.05;
            "nan_unreferenced"
        }
        5 => {
            spec.d_kv_dtype = DType::F32;
            c.pattern = IndexPattern::Duplicates;
            "f32_dkv+duplicates"
        }
        _ => {
            c.sink = SinkKind::Random;
            c.topk_length = true;
            spec.padded = true;
            "noncontiguous"
        }
    }
}

/// The backward grid (the forward's) plus the backward issue's extra cases.
pub fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let mut k = 0usize;
    for h_q in [64usize, 128] {
        for d_qk in [512usize, 576] {
            for (s_kv, topk) in GRID_PAIRS {
                for s_q in [1usize, 62, 213] {
                    let mut spec = Spec::new(SparseCase::plain(s_q, s_kv, h_q, d_qk, topk));
                    let what = variant(&mut spec, k);
                    let quick = k % 9 == 0;
                    k += 1;
                    push(
                        &mut v,
                        format!("sparse_bwd/h{h_q}/d{d_qk}/skv{s_kv}/topk{topk}/sq{s_q}/{what}"),
                        quick,
                        spec,
                    );
                }
            }
        }
    }
    for h_q in [64usize, 128] {
        for d_qk in [512usize, 576] {
            for j in 0..7 {
                let mut spec = Spec::new(SparseCase::plain(37, 1521, h_q, d_qk, 512));
                let what = variant(&mut spec, j);
                push(
                    &mut v,
                    format!("sparse_bwd/feature/{what}/h{h_q}/d{d_qk}"),
                    true,
                    spec,
                );
            }
        }
    }
    for (s_kv, topk) in [(32usize, 2048usize), (64, 8192)] {
        let spec = Spec::new(SparseCase::plain(62, s_kv, 128, 576, topk));
        push(
            &mut v,
            format!("sparse_bwd/topk_gt_skv/skv{s_kv}/topk{topk}"),
            false,
            spec,
        );
    }
    let mut all_invalid = SparseCase::plain(20, 500, 128, 576, 256);
    all_invalid.empty_every = 1;
    all_invalid.sink = SinkKind::Random;
    push(
        &mut v,
        "sparse_bwd/all_rows_invalid".into(),
        true,
        Spec::new(all_invalid),
    );
    for h_q in [1usize, 3, 100] {
        let mut c = SparseCase::plain(40, 700, h_q, 576, 200);
        c.sink = SinkKind::Random;
        c.invalid_frac = 0.1;
        push(
            &mut v,
            format!("sparse_bwd/heads/h{h_q}"),
            true,
            Spec::new(c),
        );
    }
    // Heavy reuse: every token selects among the same 96 rows (with repeats once topk > 96).
    for (topk, d_qk) in [(96usize, 576usize), (200, 512)] {
        let mut c = SparseCase::plain(213, 4096, 128, d_qk, topk);
        c.pattern = IndexPattern::Hot;
        push(
            &mut v,
            format!("sparse_bwd/heavy_reuse/topk{topk}/d{d_qk}"),
            true,
            Spec::new(c),
        );
    }
    let mut dup = SparseCase::plain(62, 1000, 128, 576, 256);
    dup.pattern = IndexPattern::Duplicates;
    push(&mut v, "sparse_bwd/duplicates".into(), true, Spec::new(dup));
    // Deterministic mode in both kernel kinds (pair h_q 128, solo h_q 64), with an f32 d_kv, and at a shape it runs
    // in KV-row buckets and several waves (140 tokens: more than one wave of resident tokens at either h_q).
    for (h_q, d_qk, name) in [
        (128usize, 576usize, "d576"),
        (128, 512, "d512"),
        (64, 576, "solo/d576"),
        (64, 512, "solo/d512"),
    ] {
        let mut c = SparseCase::plain(62, 1521, h_q, d_qk, 512);
        c.sink = SinkKind::Random;
        c.invalid_frac = 0.05;
        let mut spec = Spec::new(c);
        spec.deterministic = true;
        push(
            &mut v,
            format!("sparse_bwd/deterministic/{name}"),
            true,
            spec,
        );
    }
    let mut f32_det = Spec::new(SparseCase::plain(62, 1521, 128, 576, 512));
    f32_det.d_kv_dtype = DType::F32;
    f32_det.deterministic = true;
    push(
        &mut v,
        "sparse_bwd/deterministic/f32_dkv".into(),
        false,
        f32_det,
    );
    for h_q in [128usize, 64] {
        let mut c = SparseCase::plain(140, 16384, h_q, 576, 2048);
        c.sink = SinkKind::Random;
        let mut spec = Spec::new(c);
        spec.deterministic = true;
        push(
            &mut v,
            format!("sparse_bwd/deterministic/waves/h{h_q}"),
            false,
            spec,
        );
    }
    // Small topk makes each probability large (~1/128), so a contribution wrongly kept or dropped shows above the
    // absolute tolerance; these combine a sink, topk_length, empty rows and duplicate entries, then each alone.
    for (what, sink, len, dup, empty) in [
        ("all", true, true, true, 2usize),
        ("sink", true, false, false, 0),
        ("topk_length", false, true, false, 0),
        ("duplicates", false, false, true, 0),
        ("sink+topk_length", true, true, false, 0),
    ] {
        for (h_q, d_qk) in [(64usize, 512usize), (128, 576)] {
            let mut c = SparseCase::plain(64, 4096, h_q, d_qk, 128);
            if sink {
                c.sink = SinkKind::Random;
            }
            c.topk_length = len;
            if dup {
                c.pattern = IndexPattern::Duplicates;
            }
            c.empty_every = if empty > 0 { 32 } else { 0 };
            push(
                &mut v,
                format!("sparse_bwd/small_topk/{what}/h{h_q}/d{d_qk}"),
                true,
                Spec::new(c),
            );
        }
    }
    // A long context: the accumulator exceeds L2, so the kernel takes its drain-first order (FLAG_DRAIN_FIRST).
    for h_q in [128usize, 64] {
        let mut long = SparseCase::plain(16, 32768, h_q, 576, 2048);
        long.sink = SinkKind::Random;
        long.invalid_frac = 0.05;
        push(
            &mut v,
            format!("sparse_bwd/long_context/h{h_q}/skv32768"),
            true,
            Spec::new(long),
        );
    }
    // The named shapes.
    push(
        &mut v,
        "sparse_bwd/shape/sq1024_skv2048_topk512".into(),
        false,
        Spec::new(SparseCase::plain(1024, 2048, 128, 576, 512)),
    );
    push(
        &mut v,
        "sparse_bwd/shape/sq128_skv4096_topk2048".into(),
        false,
        Spec::new(SparseCase::plain(128, 4096, 128, 576, 2048)),
    );
    v
}
