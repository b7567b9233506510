//! The spec section 6 comparison (`reference::compare`) against a brute-force reading of the rule.

mod common;

use common::compare::{compare, Tolerance, BWD_GRAD, PREFILL_OUT, REL_EPS};
use rand::Rng;

const TOL: Tolerance = Tolerance {
    abs: 1e-3,
    rel: 1e-2,
    cos: None,
};

#[test]
fn an_element_passes_on_abs_or_rel() {
    // Large relative error, small absolute error (reference near 0): passes.
    assert!(compare(&[1e-4], &[0.0f64]).check(&TOL).is_ok());
    // Large absolute error, small relative error (large reference): passes.
    assert!(compare(&[1000.5], &[1000.0f64]).check(&TOL).is_ok());
    // Both exceeded: fails, and the message names the element.
    let err = compare(&[1.0, 2.0, 3.5], &[1.0f64, 2.0, 3.0])
        .check(&TOL)
        .unwrap_err();
    assert!(err.contains("element 2"), "{err}");
    // The bounds are strict.
    let at_abs = Tolerance {
        abs: 0.5,
        rel: 0.0,
        cos: None,
    };
    assert!(compare(&[1.5], &[1.0f64]).check(&at_abs).is_err());
    assert!(compare(&[1.25], &[1.0f64]).check(&at_abs).is_ok());
}

#[test]
fn nonfinite_positions_must_match() {
    let ok = compare(
        &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.0],
        &[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1.0],
    );
    assert!(ok.check(&PREFILL_OUT).is_ok(), "{ok}");
    for (got, want) in [
        (f32::INFINITY, f64::NEG_INFINITY),
        (f32::NAN, 0.0),
        (0.0, f64::NAN),
        (1.0, f64::INFINITY),
        (f32::NEG_INFINITY, -1e300),
    ] {
        let c = compare(&[0.5, got], &[0.5f64, want]);
        assert_eq!(c.nonfinite_mismatches, 1, "{got} vs {want}");
        let err = c.check(&TOL).unwrap_err();
        assert!(err.contains("element 1"), "{err}");
    }
}

#[test]
fn cos_diff_is_computed_in_f64_and_bounded() {
    let want: Vec<f64> = (0..1000).map(|i| ((i as f64) * 0.37).sin()).collect();
    let got: Vec<f32> = want.iter().map(|&r| (r * 1.002) as f32).collect();
    let c = compare(&got, &want);
    let (dot, norms) = got.iter().zip(&want).fold((0.0, 0.0), |(d, n), (&a, &r)| {
        (d + a as f64 * r, n + a as f64 * a as f64 + r * r)
    });
    assert!((c.cos_diff - (1.0 - 2.0 * dot / norms)).abs() < 1e-15);
    // A 0.2% scale error: every element passes its rel bound, cos_diff ~ 1e-6 fails a 1e-7 bound.
    let loose = Tolerance {
        cos: Some(1e-5),
        ..TOL
    };
    let tight = Tolerance {
        cos: Some(1e-7),
        ..TOL
    };
    assert!(c.check(&loose).is_ok(), "{c}");
    assert!(c.check(&tight).unwrap_err().contains("cos_diff"));
    // All zeros: identical, cos_diff 0.
    assert_eq!(compare(&[0.0; 4], &[0.0f32; 4]).cos_diff, 0.0);
    // Rounding noise against an exactly zero reference: the cosine is undefined, the element rule judges.
    let noise = compare(&[1e-9, -2e-9, 0.0, 3e-9], &[0.0f64; 4]);
    assert_eq!(noise.cos_diff, 0.0);
    assert!(noise.check(&BWD_GRAD).is_ok());
    assert!(compare(&[1e-9, -2e-2, 0.0, 3e-9], &[0.0f64; 4])
        .check(&BWD_GRAD)
        .is_err());
    // A zero result against a nonzero reference still fails the cosine.
    assert_eq!(compare(&[0.0; 2], &[1e-4f64, -1e-4]).cos_diff, 1.0);
}

#[test]
fn length_mismatch_fails() {
    let err = compare(&[1.0, 2.0], &[1.0f32])
        .check(&BWD_GRAD)
        .unwrap_err();
    assert!(err.contains("length"), "{err}");
}

#[test]
fn check_agrees_with_brute_force_on_random_errors() {
    let seed = 0xC0FFEE;
    let mut rng = common::rng(seed);
    for round in 0..200 {
        let n = rng.random_range(1..300);
        let want: Vec<f64> = (0..n)
            .map(|_| rng.random_range(-3.0..3.0) * 10f64.powi(rng.random_range(-4..3)))
            .collect();
        let got: Vec<f32> = want
            .iter()
            .map(|&r| {
                (r + rng.random_range(-1.0..1.0) * 10f64.powi(rng.random_range(-7..0))) as f32
            })
            .collect();
        let c = compare(&got, &want);
        for _ in 0..20 {
            let tol = Tolerance {
                abs: 10f64.powf(rng.random_range(-7.0..0.0)),
                rel: 10f64.powf(rng.random_range(-7.0..0.0)),
                cos: None,
            };
            let brute = got.iter().zip(&want).all(|(&a, &r)| {
                let e = (a as f64 - r).abs();
                e < tol.abs || e / (r.abs() + REL_EPS) < tol.rel
            });
            assert_eq!(
                c.check(&tol).is_ok(),
                brute,
                "seed {seed} round {round} {tol:?}"
            );
        }
    }
}
