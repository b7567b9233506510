//! The sparse prefill forward/backward references against an independent naive f64 formulation,
//! finite differences, and the docs/spec.md section 1/2/6 edge cases.

mod common;

use common::compare::{BWD_GRAD, PREFILL_LSE, PREFILL_MAX_LOGITS, PREFILL_OUT};
use common::{assert_close, assert_close_f64, bf16_round, naive, Case, IndexOpts, Shape, Sink};
use flashmla::reference::sparse_bwd::{sparse_bwd, SparseBwdProblem, SparseBwdResult};
use flashmla::reference::sparse_fwd::{
    sparse_fwd, sparse_fwd_rows, SparseFwdProblem, SparseFwdResult,
};
use flashmla::reference::Real;
use flashmla::Error;
use rand::Rng;

/// f64 reference against the naive f64 formulation: both exact up to summation order.
const F64_ABS: f64 = 1e-12;
const F64_REL: f64 = 1e-10;

fn shape(s_q: usize, s_kv: usize, h_q: usize, d_qk: usize, d_v: usize, topk: usize) -> Shape {
    Shape {
        s_q,
        s_kv,
        h_q,
        d_qk,
        d_v,
        topk,
    }
}

/// Random cases covering both op widths, head counts {1, 3, 64, 128}, `topk` not a multiple of
/// anything, `topk > s_kv`, sinks, `topk_length` and tiny reference-only widths.
fn random_cases(seed: u64) -> Vec<Case> {
    vec![
        Case::random(
            seed,
            shape(5, 70, 3, 576, 512, 37),
            IndexOpts::ADVERSARIAL,
            Sink::Random,
            true,
        ),
        Case::random(
            seed + 1,
            shape(3, 200, 64, 512, 512, 131),
            IndexOpts::ADVERSARIAL,
            Sink::None,
            false,
        ),
        Case::random(
            seed + 2,
            shape(2, 50, 128, 576, 512, 19),
            IndexOpts::CLEAN,
            Sink::Random,
            false,
        ),
        Case::random(
            seed + 3,
            shape(7, 9, 1, 576, 512, 33),
            IndexOpts::ADVERSARIAL,
            Sink::Random,
            true,
        ),
        Case::random(
            seed + 4,
            shape(11, 13, 4, 24, 16, 7),
            IndexOpts::ADVERSARIAL,
            Sink::Random,
            true,
        ),
    ]
}

fn fwd<R: Real>(c: &Case) -> SparseFwdResult<R> {
    sparse_fwd::<R>(&c.problem()).unwrap()
}

/// The forward's outputs narrowed to what a caller passes to the backward (`out` in bf16), plus a
/// random bf16 `d_out`.
struct BwdInputs {
    out: Vec<f32>,
    lse: Vec<f32>,
    d_out: Vec<f32>,
}

fn bwd_inputs(c: &Case) -> BwdInputs {
    let f = fwd::<f64>(c);
    let mut rng = common::rng(c.seed ^ 0xD0D0);
    let off = common::offset(&mut rng, 0.2);
    BwdInputs {
        out: f.out.iter().map(|&x| bf16_round(x as f32)).collect(),
        lse: f.lse.iter().map(|&x| x as f32).collect(),
        d_out: common::randn_bf16(&mut rng, f.out.len(), off),
    }
}

fn bwd<R: Real>(c: &Case, b: &BwdInputs) -> SparseBwdResult<R> {
    sparse_bwd::<R>(&SparseBwdProblem {
        fwd: c.problem(),
        out: &b.out,
        d_out: &b.d_out,
        lse: &b.lse,
    })
    .unwrap()
}

#[test]
fn fwd_f64_matches_naive_formulation() {
    for c in random_cases(100) {
        let (got, want) = (fwd::<f64>(&c), naive::fwd(&c));
        let name = format!("seed {} {:?}", c.seed, c.shape);
        assert_close_f64(
            &format!("{name} out"),
            &got.out,
            &want.out,
            F64_ABS,
            F64_REL,
        );
        assert_close_f64(
            &format!("{name} lse"),
            &got.lse,
            &want.lse,
            F64_ABS,
            F64_REL,
        );
        assert_close_f64(
            &format!("{name} max"),
            &got.max_logits,
            &want.max_logits,
            F64_ABS,
            F64_REL,
        );
    }
}

#[test]
fn fwd_f32_and_bf16_out_within_spec_tolerance_of_f64() {
    for c in random_cases(200) {
        let (got, want) = (fwd::<f32>(&c), fwd::<f64>(&c));
        let name = format!("seed {} {:?}", c.seed, c.shape);
        assert_close(&format!("{name} out"), &got.out, &want.out, PREFILL_OUT);
        let bf16_out: Vec<f32> = got.out.iter().map(|&x| bf16_round(x)).collect();
        assert_close(
            &format!("{name} bf16 out"),
            &bf16_out,
            &want.out,
            PREFILL_OUT,
        );
        assert_close(&format!("{name} lse"), &got.lse, &want.lse, PREFILL_LSE);
        assert_close(
            &format!("{name} max"),
            &got.max_logits,
            &want.max_logits,
            PREFILL_MAX_LOGITS,
        );
    }
}

#[test]
fn fwd_hand_computed_example() {
    // q = [1, 0], kv rows [2, 3] and [4, 5], sm_scale 0.5: logits 1 and 2; d_v = 1.
    let (q, kv) = ([1.0f32, 0.0], [2.0f32, 3.0, 4.0, 5.0]);
    let p = |indices: &'static [i32], sink: Option<&'static [f32]>| SparseFwdProblem {
        s_q: 1,
        s_kv: 2,
        h_q: 1,
        d_qk: 2,
        d_v: 1,
        topk: indices.len(),
        q: &q,
        kv: &kv,
        indices,
        sm_scale: 0.5,
        attn_sink: sink,
        topk_length: None,
    };
    let e = std::f64::consts::E;
    let r = sparse_fwd::<f64>(&p(&[0], None)).unwrap();
    assert_eq!((r.out[0], r.lse[0], r.max_logits[0]), (2.0, 1.0, 1.0));
    // A duplicate doubles the weight: lse = 1 + ln 2.
    let r = sparse_fwd::<f64>(&p(&[0, -1, 0], None)).unwrap();
    assert!((r.lse[0] - (1.0 + 2f64.ln())).abs() < 1e-15 && r.out[0] == 2.0);
    // Two rows: out = (2e + 4e^2) / (e + e^2); with a sink of 1: one more e in the denominator.
    let r = sparse_fwd::<f64>(&p(&[1, 0], Some(&[1.0]))).unwrap();
    let want_out = (2.0 * e + 4.0 * e * e) / (e + e * e + e);
    assert!(
        (r.out[0] - want_out).abs() < 1e-14,
        "{} vs {want_out}",
        r.out[0]
    );
    assert!((r.lse[0] - (e + e * e).ln()).abs() < 1e-15 && r.max_logits[0] == 2.0);
}

#[test]
fn fwd_rows_match_the_full_run() {
    let c = Case::random(
        300,
        shape(6, 40, 5, 64, 32, 21),
        IndexOpts::ADVERSARIAL,
        Sink::Random,
        true,
    );
    let full = fwd::<f32>(&c);
    let rows = [4, 0, 4, 5, 1];
    let part = sparse_fwd_rows::<f32>(&c.problem(), &rows).unwrap();
    let (h, d_v) = (c.shape.h_q, c.shape.d_v);
    for (i, &t) in rows.iter().enumerate() {
        assert_eq!(
            part.out[i * h * d_v..(i + 1) * h * d_v],
            full.out[t * h * d_v..(t + 1) * h * d_v]
        );
        assert_eq!(part.lse[i * h..(i + 1) * h], full.lse[t * h..(t + 1) * h]);
        assert_eq!(
            part.max_logits[i * h..(i + 1) * h],
            full.max_logits[t * h..(t + 1) * h]
        );
    }
    let err = sparse_fwd_rows::<f32>(&c.problem(), &[0, 6]).unwrap_err();
    assert_eq!(err.arg(), Some("rows"), "{err}");
}

#[test]
fn problems_with_inconsistent_slices_are_rejected() {
    let c = Case::random(
        310,
        shape(3, 5, 2, 8, 4, 3),
        IndexOpts::CLEAN,
        Sink::Random,
        true,
    );
    let good = c.problem();
    let short = [0.0f32; 3];
    let short_i = [0i32; 2];
    let bad_fwd: [(&str, SparseFwdProblem); 7] = [
        ("q", SparseFwdProblem { q: &short, ..good }),
        ("kv", SparseFwdProblem { kv: &short, ..good }),
        (
            "indices",
            SparseFwdProblem {
                indices: &short_i,
                ..good
            },
        ),
        (
            "attn_sink",
            SparseFwdProblem {
                attn_sink: Some(&short),
                ..good
            },
        ),
        (
            "topk_length",
            SparseFwdProblem {
                topk_length: Some(&short_i),
                ..good
            },
        ),
        ("d_v", SparseFwdProblem { d_v: 9, ..good }),
        ("h_q", SparseFwdProblem { h_q: 0, ..good }),
    ];
    for (arg, p) in bad_fwd {
        let err = sparse_fwd::<f64>(&p).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { .. }) && err.arg() == Some(arg),
            "{arg}: {err}"
        );
    }
    let b = bwd_inputs(&c);
    let good_b = SparseBwdProblem {
        fwd: good,
        out: &b.out,
        d_out: &b.d_out,
        lse: &b.lse,
    };
    for (arg, p) in [
        (
            "out",
            SparseBwdProblem {
                out: &short,
                ..good_b
            },
        ),
        (
            "d_out",
            SparseBwdProblem {
                d_out: &short,
                ..good_b
            },
        ),
        (
            "lse",
            SparseBwdProblem {
                lse: &short,
                ..good_b
            },
        ),
        (
            "q",
            SparseBwdProblem {
                fwd: SparseFwdProblem { q: &short, ..good },
                ..good_b
            },
        ),
    ] {
        assert_eq!(sparse_bwd::<f64>(&p).unwrap_err().arg(), Some(arg));
    }
}

#[test]
fn fwd_rows_without_valid_entries_give_zero_out_inf_lse() {
    // Every 5th token has only invalid indices; topk_length makes every 6th token empty too.
    for sink in [Sink::None, Sink::Random, Sink::All(f32::INFINITY)] {
        let c = Case::random(
            400,
            shape(13, 30, 3, 32, 16, 9),
            IndexOpts::ADVERSARIAL,
            sink,
            true,
        );
        let (f32r, f64r) = (fwd::<f32>(&c), fwd::<f64>(&c));
        let (h, d_v) = (c.shape.h_q, c.shape.d_v);
        let mut empty = 0;
        for t in (0..c.shape.s_q).filter(|&t| naive::valid_entries(&c, t).is_empty()) {
            empty += 1;
            for th in t * h..(t + 1) * h {
                assert!(f32r.out[th * d_v..(th + 1) * d_v].iter().all(|&x| x == 0.0));
                assert!(f64r.out[th * d_v..(th + 1) * d_v].iter().all(|&x| x == 0.0));
                assert_eq!(
                    (f32r.lse[th], f32r.max_logits[th]),
                    (f32::INFINITY, f32::NEG_INFINITY)
                );
                assert_eq!(
                    (f64r.lse[th], f64r.max_logits[th]),
                    (f64::INFINITY, f64::NEG_INFINITY)
                );
            }
        }
        assert!(
            empty >= 3,
            "the generator should make empty rows (seed {})",
            c.seed
        );
        assert!(f32r.out.iter().chain(&f32r.lse).all(|x| !x.is_nan()));
    }
}

/// The case with every repeated occurrence of a KV row redirected to a fresh copy of that row appended
/// to `kv`, plus the original row of each copy.
fn expand_duplicates(c: &Case) -> (Case, Vec<usize>) {
    let mut e = c.clone();
    let s = c.shape;
    let mut origin = (0..s.s_kv).collect::<Vec<_>>();
    for t in 0..s.s_q {
        let mut seen = std::collections::HashSet::new();
        for j in 0..s.topk {
            let i = c.indices[t * s.topk + j];
            let in_len = match &c.topk_length {
                Some(l) => (j as i64) < i64::from(l[t]),
                None => true,
            };
            if i < 0 || i as usize >= s.s_kv {
                // Values like `s_kv` become valid once rows are appended: keep them invalid.
                e.indices[t * s.topk + j] = -1;
                continue;
            }
            if !in_len || seen.insert(i) {
                continue;
            }
            let r = i as usize;
            e.kv.extend_from_slice(&c.kv[r * s.d_qk..(r + 1) * s.d_qk]);
            e.indices[t * s.topk + j] = origin.len() as i32;
            origin.push(r);
        }
    }
    e.shape.s_kv = origin.len();
    (e, origin)
}

#[test]
fn duplicates_count_once_per_occurrence() {
    let c = Case::random(
        500,
        shape(9, 12, 3, 40, 24, 20),
        IndexOpts::ADVERSARIAL,
        Sink::Random,
        true,
    );
    let (e, origin) = expand_duplicates(&c);
    assert!(
        origin.len() > c.shape.s_kv + 5,
        "the case should have duplicates"
    );
    // The expanded case has the same logits in the same order.
    let (a, b) = (fwd::<f64>(&c), fwd::<f64>(&e));
    assert_close_f64("dup out", &a.out, &b.out, F64_ABS, F64_REL);
    assert_close_f64("dup lse", &a.lse, &b.lse, F64_ABS, F64_REL);
    // Backward: d_kv of a row is the sum over the row and its copies.
    let inputs = bwd_inputs(&c);
    let (ga, gb) = (bwd::<f64>(&c, &inputs), bwd::<f64>(&e, &inputs));
    assert_close_f64("dup d_q", &ga.d_q, &gb.d_q, F64_ABS, F64_REL);
    let d_qk = c.shape.d_qk;
    let mut folded = vec![0.0; c.shape.s_kv * d_qk];
    for (r, &o) in origin.iter().enumerate() {
        for k in 0..d_qk {
            folded[o * d_qk + k] += gb.d_kv[r * d_qk + k];
        }
    }
    assert_close_f64("dup d_kv", &ga.d_kv, &folded, F64_ABS, F64_REL);
    assert_close_f64(
        "dup d_sink",
        ga.d_attn_sink.as_ref().unwrap(),
        gb.d_attn_sink.as_ref().unwrap(),
        F64_ABS,
        F64_REL,
    );
}

#[test]
fn sink_changes_neither_lse_nor_max_logits_and_damps_out() {
    let with = Case::random(
        600,
        shape(8, 25, 4, 48, 32, 15),
        IndexOpts::ADVERSARIAL,
        Sink::Random,
        false,
    );
    let without = Case {
        attn_sink: None,
        ..with.clone()
    };
    let (a, b) = (fwd::<f64>(&with), fwd::<f64>(&without));
    assert_eq!(a.lse, b.lse);
    assert_eq!(a.max_logits, b.max_logits);
    let (h, d_v) = (with.shape.h_q, with.shape.d_v);
    let sink = with.attn_sink.as_ref().unwrap();
    let damped: Vec<f64> = (0..b.out.len())
        .map(|i| {
            let th = i / d_v;
            let lse = b.lse[th];
            if lse.is_infinite() {
                return 0.0; // empty row
            }
            b.out[i] * lse.exp() / (lse.exp() + (sink[th % h] as f64).exp())
        })
        .collect();
    assert_close_f64("damped out", &a.out, &damped, F64_ABS, F64_REL);
    assert_ne!(a.out, b.out);
}

#[test]
fn sink_of_plus_infinity_zeroes_out_and_minus_infinity_is_no_sink() {
    let base = Case::random(
        700,
        shape(7, 20, 3, 32, 16, 11),
        IndexOpts::ADVERSARIAL,
        Sink::None,
        true,
    );
    let pos = Case {
        attn_sink: Some(vec![f32::INFINITY; 3]),
        ..base.clone()
    };
    let neg = Case {
        attn_sink: Some(vec![f32::NEG_INFINITY; 3]),
        ..base.clone()
    };
    let (b, p, n) = (fwd::<f32>(&base), fwd::<f32>(&pos), fwd::<f32>(&neg));
    assert!(
        p.out.iter().all(|&x| x == 0.0),
        "sink +inf must give out = 0"
    );
    assert_eq!((&p.lse, &p.max_logits), (&b.lse, &b.max_logits));
    assert_eq!(n, b, "sink -inf must change nothing");

    // Backward: -inf is no sink (and d_sink = 0); +inf gives zero gradients everywhere.
    let ib = bwd_inputs(&base);
    let (gb, gn) = (bwd::<f64>(&base, &ib), bwd::<f64>(&neg, &ib));
    assert_eq!(
        (&gb.d_q, &gb.d_kv, &gb.delta),
        (&gn.d_q, &gn.d_kv, &gn.delta)
    );
    assert!(gn.d_attn_sink.unwrap().iter().all(|&x| x == 0.0));
    let ip = bwd_inputs(&pos);
    assert!(ip.out.iter().all(|&x| x == 0.0));
    let gp = bwd::<f64>(&pos, &ip);
    for (name, v) in [("d_q", &gp.d_q), ("d_kv", &gp.d_kv), ("delta", &gp.delta)] {
        assert!(v.iter().all(|&x| x == 0.0), "sink +inf: {name} must be 0");
    }
    assert!(gp.d_attn_sink.unwrap().iter().all(|&x| x == 0.0));
}

#[test]
fn nan_in_unreferenced_kv_rows_never_leaks() {
    for (seed, sink) in [(800, Sink::None), (801, Sink::Random)] {
        let clean = Case::random(
            seed,
            shape(10, 60, 3, 40, 24, 13),
            IndexOpts::ADVERSARIAL,
            sink,
            true,
        );
        let mut dirty = clean.clone();
        assert!(
            dirty.nan_unreferenced() > 10,
            "seed {seed}: too few unreferenced rows"
        );
        assert_eq!(
            fwd::<f32>(&clean),
            fwd::<f32>(&dirty),
            "seed {seed}: forward f32"
        );
        assert_eq!(
            fwd::<f64>(&clean),
            fwd::<f64>(&dirty),
            "seed {seed}: forward f64"
        );
        let inputs = bwd_inputs(&clean);
        let (a, b) = (bwd::<f32>(&clean, &inputs), bwd::<f32>(&dirty, &inputs));
        assert_eq!(a, b, "seed {seed}: backward");
        assert!(b.d_q.iter().chain(&b.d_kv).all(|x| !x.is_nan()));
    }
}

#[test]
fn topk_larger_than_s_kv() {
    let c = Case::random(
        900,
        shape(6, 4, 5, 64, 48, 50),
        IndexOpts::CLEAN,
        Sink::Random,
        false,
    );
    let (got, want) = (fwd::<f64>(&c), naive::fwd(&c));
    assert_close_f64("topk > s_kv out", &got.out, &want.out, F64_ABS, F64_REL);
    assert_close_f64("topk > s_kv lse", &got.lse, &want.lse, F64_ABS, F64_REL);
    let inputs = bwd_inputs(&c);
    let (g, w) = (
        bwd::<f64>(&c, &inputs),
        naive::bwd(&c, &inputs.out, &inputs.d_out, &inputs.lse),
    );
    assert_close_f64("topk > s_kv d_kv", &g.d_kv, &w.d_kv, F64_ABS, F64_REL);
}

#[test]
fn every_invalid_index_value_is_ignored() {
    let base = Case::random(
        1000,
        shape(5, 30, 2, 32, 16, 9),
        IndexOpts::CLEAN,
        Sink::Random,
        false,
    );
    let want = fwd::<f64>(&base);
    let inputs = bwd_inputs(&base);
    let want_b = bwd::<f64>(&base, &inputs);
    let s = base.shape;
    for v in common::invalid_index_values(s.s_kv) {
        // Insert `v` at a different position of every row (topk 9 -> 10).
        let mut c = base.clone();
        c.shape.topk += 1;
        c.indices = (0..s.s_q)
            .flat_map(|t| {
                let mut row = base.indices[t * s.topk..(t + 1) * s.topk].to_vec();
                row.insert((t * 4) % (s.topk + 1), v);
                row
            })
            .collect();
        let got = fwd::<f64>(&c);
        assert_eq!(got, want, "invalid value {v}");
        assert_eq!(bwd::<f64>(&c, &inputs), want_b, "invalid value {v}");
    }
}

#[test]
fn topk_length_equals_masking_the_tail() {
    let c = Case::random(
        1100,
        shape(12, 40, 3, 32, 16, 17),
        IndexOpts::ADVERSARIAL,
        Sink::Random,
        true,
    );
    let lens = c.topk_length.clone().unwrap();
    assert!(lens.contains(&0) && lens.iter().any(|&l| l < 0) && lens.iter().any(|&l| l > 17));
    let mut masked = Case {
        topk_length: None,
        ..c.clone()
    };
    for (t, &l) in lens.iter().enumerate() {
        for j in (l.clamp(0, 17) as usize)..17 {
            masked.indices[t * 17 + j] = -1;
        }
    }
    assert_eq!(fwd::<f32>(&c), fwd::<f32>(&masked));
    let inputs = bwd_inputs(&c);
    assert_eq!(bwd::<f32>(&c, &inputs), bwd::<f32>(&masked, &inputs));
}

#[test]
fn bwd_f64_matches_naive_formulation() {
    for c in random_cases(1200) {
        let inputs = bwd_inputs(&c);
        let got = bwd::<f64>(&c, &inputs);
        let want = naive::bwd(&c, &inputs.out, &inputs.d_out, &inputs.lse);
        let name = format!("seed {} {:?}", c.seed, c.shape);
        assert_close_f64(
            &format!("{name} d_q"),
            &got.d_q,
            &want.d_q,
            F64_ABS,
            F64_REL,
        );
        assert_close_f64(
            &format!("{name} d_kv"),
            &got.d_kv,
            &want.d_kv,
            F64_ABS,
            F64_REL,
        );
        assert_close_f64(
            &format!("{name} delta"),
            &got.delta,
            &want.delta,
            F64_ABS,
            F64_REL,
        );
        assert_eq!(got.d_attn_sink.is_some(), c.attn_sink.is_some());
        if let (Some(g), Some(w)) = (&got.d_attn_sink, &want.d_attn_sink) {
            assert_close_f64(&format!("{name} d_sink"), g, w, F64_ABS, F64_REL);
        }
    }
}

#[test]
fn bwd_f32_within_spec_tolerance_of_f64() {
    for c in random_cases(1300) {
        let inputs = bwd_inputs(&c);
        let (got, want) = (bwd::<f32>(&c, &inputs), bwd::<f64>(&c, &inputs));
        let name = format!("seed {} {:?}", c.seed, c.shape);
        assert_close(&format!("{name} d_q"), &got.d_q, &want.d_q, BWD_GRAD);
        assert_close(&format!("{name} d_kv"), &got.d_kv, &want.d_kv, BWD_GRAD);
        let bf16_dq: Vec<f32> = got.d_q.iter().map(|&x| bf16_round(x)).collect();
        assert_close(&format!("{name} bf16 d_q"), &bf16_dq, &want.d_q, BWD_GRAD);
        assert_close(
            &format!("{name} delta"),
            &got.delta,
            &want.delta,
            PREFILL_LSE,
        );
        if let (Some(g), Some(w)) = (&got.d_attn_sink, &want.d_attn_sink) {
            assert_close(&format!("{name} d_sink"), g, w, BWD_GRAD);
        }
    }
}

/// `sum(out * g)` through the f64 forward.
fn loss(c: &Case, g: &[f32]) -> f64 {
    fwd::<f64>(c)
        .out
        .iter()
        .zip(g)
        .map(|(&o, &g)| o * g as f64)
        .sum()
}

/// Central difference of `loss` in one f32 input, with the steps actually taken (f32 rounding of
/// `x ± h`) measured.
fn central_difference(
    c: &mut Case,
    g: &[f32],
    which: fn(&mut Case) -> &mut [f32],
    i: usize,
) -> f64 {
    const STEP: f32 = 1e-3;
    let x = which(c)[i];
    let (up, down) = (x + STEP, x - STEP);
    which(c)[i] = up;
    let l_up = loss(c, g);
    which(c)[i] = down;
    let l_down = loss(c, g);
    which(c)[i] = x;
    (l_up - l_down) / (up as f64 - down as f64)
}

#[test]
fn bwd_matches_finite_differences() {
    // Tiny problem with duplicates, invalid entries, an empty row, topk_length and a sink; values
    // kept small so the loss is smooth at the step size.
    let mut c = Case::random(
        1400,
        shape(4, 6, 2, 5, 3, 6),
        IndexOpts::ADVERSARIAL,
        Sink::Random,
        true,
    );
    c.topk_length = Some(vec![6, 0, 4, 5]);
    let mut rng = common::rng(1401);
    let g: Vec<f32> = (0..4 * 2 * 3)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let f = fwd::<f64>(&c);
    let grads = sparse_bwd::<f64>(&SparseBwdProblem {
        fwd: c.problem(),
        // The exact forward outputs narrowed to f32: the backward's inputs.
        out: &f.out.iter().map(|&x| x as f32).collect::<Vec<_>>(),
        d_out: &g,
        lse: &f.lse.iter().map(|&x| x as f32).collect::<Vec<_>>(),
    })
    .unwrap();
    let check = |name: &str, fd: f64, an: f64| {
        assert!(
            (fd - an).abs() <= 2e-6 + 1e-4 * an.abs(),
            "{name}: finite difference {fd:e}, backward {an:e} (seed {})",
            c.seed
        );
    };
    let mut work = c.clone();
    for i in 0..c.q.len() {
        check(
            &format!("d_q[{i}]"),
            central_difference(&mut work, &g, |c| c.q.as_mut_slice(), i),
            grads.d_q[i],
        );
    }
    for i in 0..c.kv.len() {
        check(
            &format!("d_kv[{i}]"),
            central_difference(&mut work, &g, |c| c.kv.as_mut_slice(), i),
            grads.d_kv[i],
        );
    }
    let d_sink = grads.d_attn_sink.unwrap();
    for (h, &an) in d_sink.iter().enumerate() {
        let fd = central_difference(
            &mut work,
            &g,
            |c| c.attn_sink.as_mut().unwrap().as_mut_slice(),
            h,
        );
        check(&format!("d_sink[{h}]"), fd, an);
    }
    assert!(grads.d_kv.iter().any(|&x| x.abs() > 1e-3) && d_sink.iter().any(|&x| x.abs() > 1e-3));
}

#[test]
fn bwd_empty_rows_and_unreferenced_kv_rows_are_exactly_zero() {
    for sink in [Sink::None, Sink::Random] {
        let c = Case::random(
            1500,
            shape(16, 80, 3, 32, 16, 7),
            IndexOpts::ADVERSARIAL,
            sink,
            true,
        );
        let inputs = bwd_inputs(&c);
        assert!(inputs.lse.contains(&f32::INFINITY));
        let g = bwd::<f32>(&c, &inputs);
        let (h, d_qk) = (c.shape.h_q, c.shape.d_qk);
        for t in (0..c.shape.s_q).filter(|&t| naive::valid_entries(&c, t).is_empty()) {
            assert!(
                g.d_q[t * h * d_qk..(t + 1) * h * d_qk]
                    .iter()
                    .all(|&x| x == 0.0),
                "d_q of empty token {t}"
            );
        }
        let used = c.referenced();
        assert!(used.iter().filter(|&&u| !u).count() > 10);
        for (r, _) in used.iter().enumerate().filter(|(_, &u)| !u) {
            assert!(
                g.d_kv[r * d_qk..(r + 1) * d_qk].iter().all(|&x| x == 0.0),
                "d_kv row {r}"
            );
        }
        assert!(g
            .d_q
            .iter()
            .chain(&g.d_kv)
            .chain(&g.delta)
            .all(|x| x.is_finite()));
        assert!(g.d_attn_sink.iter().flatten().all(|x| x.is_finite()));
    }
}

#[test]
fn bwd_is_deterministic_across_thread_counts() {
    let c = Case::random(
        1600,
        shape(24, 20, 4, 64, 32, 29),
        IndexOpts::ADVERSARIAL,
        Sink::Random,
        true,
    );
    let inputs = bwd_inputs(&c);
    let many = bwd::<f32>(&c, &inputs);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| bwd::<f32>(&c, &inputs));
    let three = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap()
        .install(|| bwd::<f32>(&c, &inputs));
    assert_eq!(many, one);
    assert_eq!(many, three);
}

#[test]
fn fwd_rows_sample_a_70000_token_problem() {
    // s_q above 65535; tiny widths keep it cheap. Sampled rows must equal the full run and the naive
    // formulation.
    let c = Case::random(
        1700,
        shape(70_000, 50, 2, 8, 4, 3),
        IndexOpts::ADVERSARIAL,
        Sink::Random,
        true,
    );
    let rows = [0, 1, 34_567, 65_535, 65_536, 69_999];
    let part = sparse_fwd_rows::<f64>(&c.problem(), &rows).unwrap();
    let full = fwd::<f64>(&c);
    let (h, d_v) = (c.shape.h_q, c.shape.d_v);
    for (i, &t) in rows.iter().enumerate() {
        assert_eq!(
            part.out[i * h * d_v..(i + 1) * h * d_v],
            full.out[t * h * d_v..(t + 1) * h * d_v]
        );
        assert_eq!(part.lse[i * h..(i + 1) * h], full.lse[t * h..(t + 1) * h]);
    }
    let want = naive::fwd(&c);
    assert_close_f64("70000 tokens out", &full.out, &want.out, F64_ABS, F64_REL);
    assert_close_f64("70000 tokens lse", &full.lse, &want.lse, F64_ABS, F64_REL);
}

/// `sparse_bwd_operand_rounding` bounds what rounding the MMA operands P and dS' to bf16 does (an
/// emulation of the GPU backward's numerics) on a case where that rounding exceeds the plain spec rule
/// (few valid entries per token, so large probabilities), and judging net of it still catches a single
/// dropped contribution.
#[test]
fn bwd_operand_rounding_bounds_bf16_operands_and_still_catches_a_dropped_entry() {
    use flashmla::reference::compare::{compare, compare_with_allowance};
    use flashmla::reference::sparse_bwd::sparse_bwd_operand_rounding;
    use flashmla::testing::{peer_bf16, rng, SparseCase};
    let bf = |x: f64| half::bf16::from_f64(x).to_f64();

    let mut c = SparseCase::plain(16, 512, 128, 576, 16);
    c.topk_length = true;
    let v = c.generate(11).unwrap().values().unwrap();
    let (h_q, d_qk, topk) = (v.h_q, v.d_qk, v.topk);
    let d_out = peer_bf16(&mut rng(12), v.s_q * h_q * 512);
    let (out, lse) = v.reference_fwd_outputs().unwrap();
    let problem = SparseBwdProblem {
        fwd: v.problem(),
        out: &out,
        d_out: &d_out,
        lse: &lse,
    };
    let exact = sparse_bwd::<f64>(&problem).unwrap();
    let bound = sparse_bwd_operand_rounding(&problem).unwrap();

    // The emulation, written out naively: exact products except for bf16 P and dS'.
    let (mut d_q, mut d_kv) = (vec![0f64; exact.d_q.len()], vec![0f64; exact.d_kv.len()]);
    let scale = v.sm_scale as f64;
    let len = v.topk_length.as_ref().unwrap();
    // The largest probability, its KV row and its contribution to that row of d_kv.
    let mut largest = (0.0f64, 0usize, Vec::new());
    let dot = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| *x as f64 * *y as f64)
            .sum::<f64>()
    };
    for (t, &len_t) in len.iter().enumerate() {
        for j in 0..(len_t.max(0) as usize).min(topk) {
            let Ok(r) = usize::try_from(v.indices[t * topk + j]) else {
                continue;
            };
            if r >= v.s_kv {
                continue;
            }
            let k = &v.kv[r * d_qk..(r + 1) * d_qk];
            for h in 0..h_q {
                let th = t * h_q + h;
                let q = &v.q[th * d_qk..(th + 1) * d_qk];
                let g = &d_out[th * 512..(th + 1) * 512];
                let o = &out[th * 512..(th + 1) * 512];
                let p = (scale * dot(q, k) - lse[th] as f64).exp();
                let ds = scale * p * (dot(g, &k[..512]) - dot(g, o));
                let (pb, dsb) = (bf(p), bf(ds));
                let contrib: Vec<f64> = (0..d_qk)
                    .map(|col| {
                        dsb * q[col] as f64 + if col < 512 { pb * g[col] as f64 } else { 0.0 }
                    })
                    .collect();
                for col in 0..d_qk {
                    d_q[th * d_qk + col] += dsb * k[col] as f64;
                    d_kv[r * d_qk + col] += contrib[col];
                }
                if p > largest.0 {
                    largest = (p, r, contrib);
                }
            }
        }
    }
    let f32s = |x: &[f64]| x.iter().map(|&a| a as f32).collect::<Vec<f32>>();
    let (emu_q, emu_kv) = (f32s(&d_q), f32s(&d_kv));
    // The case is one where the plain rule is not enough...
    assert!(
        compare(&emu_kv, &exact.d_kv).check(&BWD_GRAD).is_err(),
        "this case should exceed the plain spec tolerance"
    );
    // ...the bound holds element by element (f32 storage of the emulation aside)...
    for (name, emu, want, b) in [
        ("d_q", &d_q, &exact.d_q, &bound.d_q),
        ("d_kv", &d_kv, &exact.d_kv, &bound.d_kv),
    ] {
        for i in 0..want.len() {
            assert!(
                (emu[i] - want[i]).abs() <= b[i] * (1.0 + 1e-9) + 1e-12,
                "{name}[{i}]: emulated {} exact {} bound {}",
                emu[i],
                want[i],
                b[i]
            );
        }
    }
    compare_with_allowance(&emu_q, &exact.d_q, &bound.d_q)
        .check(&BWD_GRAD)
        .unwrap();
    compare_with_allowance(&emu_kv, &exact.d_kv, &bound.d_kv)
        .check(&BWD_GRAD)
        .unwrap();
    // ...and dropping the contribution of one (token, head) entry to its row is caught.
    let (_, r, contrib) = largest;
    let mut dropped = d_kv.clone();
    for (x, c) in dropped[r * d_qk..(r + 1) * d_qk].iter_mut().zip(&contrib) {
        *x -= c;
    }
    assert!(
        compare_with_allowance(&f32s(&dropped), &exact.d_kv, &bound.d_kv)
            .check(&BWD_GRAD)
            .is_err()
    );
}
