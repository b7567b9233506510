//! A naive f64 formulation of sparse attention, written independently of the library's reference:
//! each token's index row becomes a dense multiplicity vector over all `s_kv` rows, and the softmax is
//! taken over the materialised logits of the rows with nonzero multiplicity, without max subtraction
//! (test inputs keep logits small).

use super::Case;

/// Rows token `t` references, one item per valid occurrence.
pub fn valid_entries(c: &Case, t: usize) -> Vec<usize> {
    let s = c.shape;
    let len = c
        .topk_length
        .as_ref()
        .map_or(s.topk as i64, |l| i64::from(l[t]).clamp(0, s.topk as i64)) as usize;
    c.indices[t * s.topk..t * s.topk + len]
        .iter()
        .filter(|&&i| i >= 0 && (i as i64) < s.s_kv as i64)
        .map(|&i| i as usize)
        .collect()
}

/// Multiplicity of every KV row in token `t`'s index row, `[s_kv]`.
pub fn multiplicity(c: &Case, t: usize) -> Vec<f64> {
    let mut m = vec![0.0; c.shape.s_kv];
    for r in valid_entries(c, t) {
        m[r] += 1.0;
    }
    m
}

/// `sm_scale * q[t,h,:] . kv[r,:]` in f64.
pub fn logit(c: &Case, t: usize, h: usize, r: usize) -> f64 {
    let s = c.shape;
    let q = &c.q[(t * s.h_q + h) * s.d_qk..][..s.d_qk];
    let k = &c.kv[r * s.d_qk..][..s.d_qk];
    c.sm_scale as f64
        * q.iter()
            .zip(k)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum::<f64>()
}

/// Forward outputs `[s_q, h_q, d_v]`, `[s_q, h_q]`, `[s_q, h_q]`.
#[derive(Debug, Clone)]
pub struct Fwd {
    /// Output.
    pub out: Vec<f64>,
    /// Max logit.
    pub max_logits: Vec<f64>,
    /// Natural-log sum of exponentials (no sink).
    pub lse: Vec<f64>,
}

/// The naive forward.
pub fn fwd(c: &Case) -> Fwd {
    let s = c.shape;
    let mut f = Fwd {
        out: vec![0.0; s.s_q * s.h_q * s.d_v],
        max_logits: vec![f64::NEG_INFINITY; s.s_q * s.h_q],
        lse: vec![f64::INFINITY; s.s_q * s.h_q],
    };
    for t in 0..s.s_q {
        let m = multiplicity(c, t);
        for h in 0..s.h_q {
            let th = t * s.h_q + h;
            let mut z = 0.0;
            let mut num = vec![0.0; s.d_v];
            for r in (0..s.s_kv).filter(|&r| m[r] > 0.0) {
                let l = logit(c, t, h, r);
                f.max_logits[th] = f.max_logits[th].max(l);
                let w = m[r] * l.exp();
                z += w;
                for (n, &v) in num.iter_mut().zip(&c.kv[r * s.d_qk..r * s.d_qk + s.d_v]) {
                    *n += w * v as f64;
                }
            }
            if z == 0.0 {
                continue;
            }
            f.lse[th] = z.ln();
            let sink = c.attn_sink.as_ref().map_or(0.0, |v| (v[h] as f64).exp());
            for (o, n) in f.out[th * s.d_v..(th + 1) * s.d_v].iter_mut().zip(&num) {
                *o = n / (z + sink);
            }
        }
    }
    f
}

/// Backward outputs.
#[derive(Debug, Clone)]
pub struct Bwd {
    /// `[s_q, h_q, d_qk]`.
    pub d_q: Vec<f64>,
    /// `[s_kv, d_qk]`.
    pub d_kv: Vec<f64>,
    /// `[s_q, h_q]`.
    pub delta: Vec<f64>,
    /// `[h_q]` when the case has a sink.
    pub d_attn_sink: Option<Vec<f64>>,
}

/// The naive backward from the given `out`, `d_out` and `lse` (dense probabilities with the
/// multiplicity folded in).
pub fn bwd(c: &Case, out: &[f32], d_out: &[f32], lse: &[f32]) -> Bwd {
    let s = c.shape;
    let scale = c.sm_scale as f64;
    let mut b = Bwd {
        d_q: vec![0.0; s.s_q * s.h_q * s.d_qk],
        d_kv: vec![0.0; s.s_kv * s.d_qk],
        delta: vec![0.0; s.s_q * s.h_q],
        d_attn_sink: c.attn_sink.as_ref().map(|_| vec![0.0; s.h_q]),
    };
    for t in 0..s.s_q {
        let m = multiplicity(c, t);
        for h in 0..s.h_q {
            let th = t * s.h_q + h;
            let g = &d_out[th * s.d_v..(th + 1) * s.d_v];
            let o = &out[th * s.d_v..(th + 1) * s.d_v];
            let delta: f64 = g.iter().zip(o).map(|(&a, &b)| a as f64 * b as f64).sum();
            b.delta[th] = delta;
            let lse = lse[th] as f64;
            if lse == f64::INFINITY {
                continue;
            }
            let sink = c.attn_sink.as_ref().map(|v| v[h] as f64);
            let lse_sink = sink.map_or(lse, |sk| (lse.exp() + sk.exp()).ln());
            if let (Some(d), Some(sk)) = (b.d_attn_sink.as_mut(), sink) {
                d[h] -= (sk - lse_sink).exp() * delta;
            }
            let q = &c.q[th * s.d_qk..(th + 1) * s.d_qk];
            for r in (0..s.s_kv).filter(|&r| m[r] > 0.0) {
                let k = &c.kv[r * s.d_qk..(r + 1) * s.d_qk];
                let p = m[r] * (logit(c, t, h, r) - lse_sink).exp();
                let dp: f64 = g.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum();
                let ds = p * (dp - delta);
                for (dq, &kk) in b.d_q[th * s.d_qk..(th + 1) * s.d_qk].iter_mut().zip(k) {
                    *dq += scale * ds * kk as f64;
                }
                let dk = &mut b.d_kv[r * s.d_qk..(r + 1) * s.d_qk];
                for (c, (d, &qq)) in dk.iter_mut().zip(q).enumerate() {
                    *d += scale * ds * qq as f64;
                    if c < s.d_v {
                        *d += p * g[c] as f64;
                    }
                }
            }
        }
    }
    b
}
