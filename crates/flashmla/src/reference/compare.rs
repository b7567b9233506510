//! Numerical acceptance of a computed tensor against a reference (docs/spec.md section 6).
//!
//! An element passes when `|a - r| < abs` **or** `|a - r| / (|r| + 1e-6) < rel`; every element must
//! pass; the positions of `+inf`, `-inf` and NaN must be the same in both; and
//! `cos_diff = 1 - 2 * sum(a * r) / sum(a * a + r * r)`, accumulated in f64 over the positions where both
//! are finite, must stay under `cos` where the table gives one. When the reference is exactly zero at every
//! finite position the cosine is undefined and counts as 0 (e.g. `d_q` with `topk = 1`, where `P = 1` and
//! `dS = 0` exactly; the element rule still bounds the kernel's rounding noise there).
//!
//! [`compare`] measures once; [`Comparison::check`] then judges against any [`Tolerance`]. The
//! measurement keeps only the Pareto frontier of `(abs error, rel error)` pairs, which is enough to
//! decide exactly whether some element fails both bounds, and to name the worst one, in memory that does
//! not grow with the tensor.
//!
//! ```text
//! let c = compare(&gpu_out, &reference_out);
//! c.check(&PREFILL_OUT)?;   // Err names the worst element, max abs/rel error and cos_diff
//! ```

use std::fmt;

/// Added to `|r|` in the relative error so that zeros in the reference do not divide by zero.
pub const REL_EPS: f64 = 1e-6;

/// Acceptance bounds for one tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// An element passes when its absolute error is below this...
    pub abs: f64,
    /// ...or its relative error `|a - r| / (|r| + 1e-6)` is below this.
    pub rel: f64,
    /// Bound on `cos_diff` over the whole tensor, when the tensor has one.
    pub cos: Option<f64>,
}

impl Tolerance {
    /// Whether an element with these errors passes.
    pub fn passes(&self, abs_err: f64, rel_err: f64) -> bool {
        abs_err < self.abs || rel_err < self.rel
    }
}

/// Sparse prefill `out` (the peer's bf16 forward output test).
pub const PREFILL_OUT: Tolerance = Tolerance {
    abs: 8e-4,
    rel: 3.01 / 128.0,
    cos: Some(7e-6),
};
/// Sparse prefill `lse` (natural log, f32).
pub const PREFILL_LSE: Tolerance = Tolerance {
    abs: 1e-6,
    rel: 2.01 / 65536.0,
    cos: None,
};
/// Sparse prefill `max_logits` (same bounds as `lse`).
pub const PREFILL_MAX_LOGITS: Tolerance = PREFILL_LSE;
/// Decode `out`.
pub const DECODE_OUT: Tolerance = Tolerance {
    abs: 1e-3,
    rel: 2.01 / 128.0,
    cos: Some(5e-6),
};
/// Decode `lse`.
pub const DECODE_LSE: Tolerance = Tolerance {
    abs: 1e-6,
    rel: 8.01 / 65536.0,
    cos: None,
};
/// Backward gradients `d_q`, `d_kv`.
pub const BWD_GRAD: Tolerance = Tolerance {
    abs: 1e-3,
    rel: 8.01 / 128.0,
    cos: Some(7e-6),
};

/// One element of a comparison.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ElementError {
    /// Position in the flattened tensor.
    pub index: usize,
    /// The computed value.
    pub got: f32,
    /// The reference value.
    pub want: f64,
    /// `|got - want|`.
    pub abs_err: f64,
    /// `|got - want| / (|want| + 1e-6)`.
    pub rel_err: f64,
}

impl fmt::Display for ElementError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "element {}: got {:e}, want {:e} (abs err {:.3e}, rel err {:.3e})",
            self.index, self.got, self.want, self.abs_err, self.rel_err
        )
    }
}

/// What [`compare`] measured; judge it with [`Comparison::check`].
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// Elements in the computed tensor.
    pub got_len: usize,
    /// Elements in the reference.
    pub want_len: usize,
    /// Largest absolute error over the positions where both are finite (0 when there are none).
    pub max_abs_err: f64,
    /// Largest relative error over the positions where both are finite.
    pub max_rel_err: f64,
    /// `1 - 2 sum(a r) / sum(a^2 + r^2)` over the positions where both are finite (0 when the reference is 0 there).
    pub cos_diff: f64,
    /// Largest absolute error net of the allowance ([`compare_with_allowance`]); equal to
    /// `max_abs_err` without one.
    pub max_net_abs_err: f64,
    /// Positions where one side is `+inf`, `-inf` or NaN and the other is not the same.
    pub nonfinite_mismatches: usize,
    /// The first such position.
    pub first_nonfinite_mismatch: Option<ElementError>,
    /// Elements not dominated in both errors by another one, sorted by `abs_err` ascending (so
    /// `rel_err` descending). Some element fails a tolerance iff one of these does.
    frontier: Vec<ElementError>,
    /// Whether errors were judged net of an allowance.
    with_allowance: bool,
}

/// The four classes whose positions must match: finite, `+inf`, `-inf`, NaN.
fn class(x: f64) -> u8 {
    if x.is_nan() {
        3
    } else if x == f64::INFINITY {
        2
    } else if x == f64::NEG_INFINITY {
        1
    } else {
        0
    }
}

/// Measures `got` against the reference `want` (f32 or f64) element by element.
pub fn compare<W: Copy + Into<f64>>(got: &[f32], want: &[W]) -> Comparison {
    compare_inner(got, want, None)
}

/// Like [`compare`], but the error of element `i` is judged net of `allowance[i]` (`>= 0`): an
/// element passes a tolerance when `max(0, |a - r| - allowance[i])` is within `abs` or, divided by
/// `|r| + 1e-6`, within `rel`. For errors a kernel makes by design and that can be bounded per element
/// from the inputs, such as the bf16 rounding of tensor-core operands (see
/// [`crate::reference::sparse_bwd::sparse_bwd_operand_rounding`]). `max_abs_err`, `max_rel_err` and
/// `cos_diff` stay the raw figures; `max_net_abs_err` is the largest net error. An allowance shorter
/// than `want` counts as 0 past its end.
pub fn compare_with_allowance<W: Copy + Into<f64>>(
    got: &[f32],
    want: &[W],
    allowance: &[f64],
) -> Comparison {
    compare_inner(got, want, Some(allowance))
}

fn compare_inner<W: Copy + Into<f64>>(
    got: &[f32],
    want: &[W],
    allowance: Option<&[f64]>,
) -> Comparison {
    let mut c = Comparison {
        got_len: got.len(),
        want_len: want.len(),
        max_abs_err: 0.0,
        max_rel_err: 0.0,
        cos_diff: 0.0,
        max_net_abs_err: 0.0,
        nonfinite_mismatches: 0,
        first_nonfinite_mismatch: None,
        frontier: Vec::new(),
        with_allowance: allowance.is_some(),
    };
    let (mut dot, mut norms, mut ref_norm) = (0.0f64, 0.0f64, 0.0f64);
    for (index, (&a, &r)) in got.iter().zip(want).enumerate() {
        let (a64, r): (f64, f64) = (a.into(), r.into());
        let (ca, cr) = (class(a64), class(r));
        if ca != cr {
            c.nonfinite_mismatches += 1;
            c.first_nonfinite_mismatch.get_or_insert(ElementError {
                index,
                got: a,
                want: r,
                abs_err: f64::INFINITY,
                rel_err: f64::INFINITY,
            });
            continue;
        }
        if ca != 0 {
            continue;
        }
        let abs_err = (a64 - r).abs();
        let rel_err = abs_err / (r.abs() + REL_EPS);
        c.max_abs_err = c.max_abs_err.max(abs_err);
        c.max_rel_err = c.max_rel_err.max(rel_err);
        dot += a64 * r;
        norms += a64 * a64 + r * r;
        ref_norm += r * r;
        let allowed = allowance
            .and_then(|al| al.get(index))
            .copied()
            .unwrap_or(0.0);
        let net = (abs_err - allowed).max(0.0);
        c.max_net_abs_err = c.max_net_abs_err.max(net);
        c.insert(ElementError {
            index,
            got: a,
            want: r,
            abs_err: net,
            rel_err: net / (r.abs() + REL_EPS),
        });
    }
    // Against an identically zero reference the cosine is undefined (any nonzero rounding noise would
    // give 1): the element rule alone judges such a tensor.
    c.cos_diff = if norms > 0.0 && ref_norm > 0.0 {
        1.0 - 2.0 * dot / norms
    } else {
        0.0
    };
    c
}

impl Comparison {
    /// Adds an element to the Pareto frontier unless another element is at least as bad in both errors.
    fn insert(&mut self, e: ElementError) {
        // First frontier element with abs_err >= e.abs_err: the largest rel_err among those.
        let pos = self.frontier.partition_point(|f| f.abs_err < e.abs_err);
        if self
            .frontier
            .get(pos)
            .is_some_and(|f| f.rel_err >= e.rel_err)
        {
            return;
        }
        // Elements before `pos` have smaller abs_err: drop those with rel_err <= e.rel_err. Elements
        // from `pos` with equal abs_err have smaller rel_err: drop them too.
        let start = self.frontier[..pos].partition_point(|f| f.rel_err > e.rel_err);
        let end = pos + self.frontier[pos..].partition_point(|f| f.abs_err <= e.abs_err);
        self.frontier.splice(start..end, [e]);
    }

    /// The element that fails `tol` by the largest factor (the larger of its two error/bound ratios
    /// being the smaller one), or `None` when every element passes.
    pub fn worst_failure(&self, tol: &Tolerance) -> Option<ElementError> {
        let ratio = |err: f64, bound: f64| {
            if bound > 0.0 {
                err / bound
            } else {
                f64::INFINITY
            }
        };
        self.frontier
            .iter()
            .filter(|e| !tol.passes(e.abs_err, e.rel_err))
            .max_by(|a, b| {
                let fa = ratio(a.abs_err, tol.abs).min(ratio(a.rel_err, tol.rel));
                let fb = ratio(b.abs_err, tol.abs).min(ratio(b.rel_err, tol.rel));
                fa.total_cmp(&fb)
            })
            .copied()
    }

    /// Judges the measurement: lengths equal, non-finite positions equal, every element within `abs`
    /// or `rel`, and `cos_diff < cos`. The error names the first failed rule and the summary numbers.
    pub fn check(&self, tol: &Tolerance) -> Result<(), String> {
        if self.got_len != self.want_len {
            return Err(format!(
                "length mismatch: got {} elements, reference has {}",
                self.got_len, self.want_len
            ));
        }
        if let Some(e) = self.first_nonfinite_mismatch {
            return Err(format!(
                "{} positions differ in inf/NaN; first at element {}: got {}, want {}; {self}",
                self.nonfinite_mismatches, e.index, e.got, e.want
            ));
        }
        if let Some(e) = self.worst_failure(tol) {
            return Err(format!(
                "{e} exceeds abs {:e} and rel {:e}; {self}",
                tol.abs, tol.rel
            ));
        }
        if let Some(cos) = tol.cos {
            if self.cos_diff.is_nan() || self.cos_diff >= cos {
                return Err(format!("cos_diff {:.3e} >= {cos:e}; {self}", self.cos_diff));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} elements, max abs err {:.3e}, max rel err {:.3e}, cos_diff {:.3e}",
            self.got_len, self.max_abs_err, self.max_rel_err, self.cos_diff
        )?;
        if self.with_allowance {
            write!(
                f,
                " (errors judged net of the per-element allowance; largest net {:.3e})",
                self.max_net_abs_err
            )?;
        }
        Ok(())
    }
}
