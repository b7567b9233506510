//! The decode reference (dense and sparse FP8), its split-KV schedule and combine, against a naive f64
//! formulation and hand-worked examples.

mod decode_support;

use decode_support::*;
use flashmla::fp8::KvFormat;
use flashmla::reference::decode::{
    combine, decode_dense, decode_dense_partial, decode_dense_split, decode_schedule,
    decode_sparse, decode_sparse_partial, decode_sparse_split, DecodePartial, DecodeResult,
    DecodeSchedule, DenseDecodeInputs, DenseDecodeProblem, RowShape, ScheduleConfig, ScheduleShape,
};
use rand::rngs::StdRng;
use rand::Rng;
use std::ops::Range;

fn f32_result(r: &DecodeResult<f32>) -> (Vec<f64>, Vec<f64>) {
    (widen(&r.out), widen(&r.lse))
}

/// Small widths keep the dense reference tests fast; the ops tests use the real 576/512.
const D_QK: usize = 40;
const D_V: usize = 32;

fn spec(
    seqlens: &[i32],
    (s_q, h_q, h_kv): (usize, usize, usize),
    page_size: usize,
    causal: bool,
) -> DenseSpec {
    DenseSpec {
        batch: seqlens.len(),
        s_q,
        h_q,
        h_kv,
        d_qk: D_QK,
        d_v: D_V,
        page_size,
        seqlens: seqlens.to_vec(),
        causal,
        sink: false,
    }
}

/// Checks the f64 reference against the naive f64 formulation tightly and the f32 reference with the spec
/// decode tolerances.
fn check_dense(case: &DenseCase, seed: u64) {
    let x = case.inputs();
    let (want_out, want_lse) = naive_dense(&case.p, &x);
    let r64 = decode_dense::<f64>(&case.p, &x).unwrap();
    assert_close("out f64", &r64.out, &want_out, F64_EXACT, seed);
    assert_close("lse f64", &r64.lse, &want_lse, F64_EXACT, seed);
    let (out, lse) = f32_result(&decode_dense::<f32>(&case.p, &x).unwrap());
    assert_close("out f32", &out, &want_out, DECODE_OUT, seed);
    assert_close("lse f32", &lse, &want_lse, DECODE_LSE, seed);
}

#[test]
fn dense_matches_naive_f64_paged_causal_and_sink() {
    for seed in 0..4u64 {
        let mut rng = rng(seed);
        let causal = seed % 2 == 1;
        let s_q = 1 + (seed as usize % 3);
        let mut sp = spec(
            &[37, 5, 64, 1],
            (s_q, 8, 1),
            [16, 7, 1, 64][seed as usize],
            causal,
        );
        sp.sink = seed >= 2;
        check_dense(&dense_case(&mut rng, &sp), seed);
    }
}

/// s_q = 2, s_k = 5, causal: query 0 sees keys 0..4, query 1 sees keys 0..5. With q = 0 every visible key has
/// weight 1/n, and column 0 of key p holds p, so out[.., 0] is the mean visible position.
#[test]
fn dense_causal_alignment_worked_by_hand() {
    let (page, d) = (2usize, 8usize);
    let p = DenseDecodeProblem {
        batch: 2,
        s_q: 2,
        h_q: 1,
        h_kv: 1,
        d_qk: d,
        d_v: 4,
        num_blocks: 4,
        page_size: page,
        max_blocks: 3,
        softmax_scale: 1.0,
        causal: true,
    };
    // Request 0 (s_k = 5) uses blocks [2, 0, 3]; request 1 (s_k = 1) uses block [1].
    let block_table = [2, 0, 3, 1, -1, -1];
    let mut k_cache = vec![f32::NAN; 4 * page * d];
    for (pos, &blk) in [2usize, 2, 0, 0, 3].iter().enumerate() {
        let at = (blk * page + pos % page) * d;
        k_cache[at..at + d].fill(0.0);
        k_cache[at] = pos as f32;
    }
    k_cache[page * d..page * d + d].fill(0.0);
    k_cache[page * d] = 7.0; // request 1's only key
    let q = vec![0.0f32; 2 * 2 * d];
    let x = DenseDecodeInputs {
        q: &q,
        k_cache: &k_cache,
        block_table: &block_table,
        cache_seqlens: &[5, 1],
        attn_sink: None,
    };
    let near = |a: f64, b: f64| (a - b).abs() < 1e-12;
    let r = decode_dense::<f64>(&p, &x).unwrap();
    // Request 0: query 0 sees keys < 5 - 2 + 0 + 1 = 4 -> mean(0,1,2,3) = 1.5, lse ln 4; query 1 sees all 5.
    assert!(
        near(r.out[0], 1.5) && near(r.out[4], 2.0),
        "{:?}",
        (r.out[0], r.out[4])
    );
    assert!(near(r.lse[0], 4f64.ln()) && near(r.lse[1], 5f64.ln()));
    // Request 1 (s_k = 1 < s_q = 2): query 0 sees keys < 0 (none); query 1 sees key 0.
    assert_eq!(&r.out[8..12], &[0.0; 4]);
    assert_eq!(r.lse[2], f64::INFINITY);
    assert!(near(r.out[12], 7.0) && near(r.lse[3], 0.0));
    // Without the mask both queries see every key.
    let r = decode_dense::<f64>(&DenseDecodeProblem { causal: false, ..p }, &x).unwrap();
    assert!(
        near(r.out[0], 2.0) && near(r.out[4], 2.0) && near(r.out[8], 7.0) && near(r.out[12], 7.0)
    );
    assert!(near(r.lse[0], 5f64.ln()) && near(r.lse[2], 0.0));
    // s_q == 1: causal has no effect.
    let p1 = DenseDecodeProblem {
        s_q: 1,
        batch: 1,
        ..p
    };
    let x1 = DenseDecodeInputs {
        q: &q[..d],
        cache_seqlens: &[5],
        block_table: &block_table[..3],
        ..x
    };
    assert!(near(decode_dense::<f64>(&p1, &x1).unwrap().out[0], 2.0));
}

#[test]
fn dense_head_ratios_1_2_16_128() {
    for (seed, (h_q, h_kv)) in [(2usize, 2usize), (4, 2), (16, 1), (128, 1), (32, 2)]
        .into_iter()
        .enumerate()
    {
        let seed = 100 + seed as u64;
        let mut rng = rng(seed);
        let case = dense_case(&mut rng, &spec(&[13, 29], (2, h_q, h_kv), 8, seed % 2 == 0));
        check_dense(&case, seed);
    }
}

#[test]
fn dense_empty_rows_give_zero_out_and_inf_lse() {
    let seed = 7;
    let mut rng = rng(seed);
    // Request 0 has no key; request 1 has one key with s_q = 3 causal, so queries 0 and 1 see nothing.
    let mut sp = spec(&[0, 1, 9], (3, 4, 2), 4, true);
    sp.sink = true;
    let case = dense_case(&mut rng, &sp);
    let r = decode_dense::<f32>(&case.p, &case.inputs()).unwrap();
    let (h_q, s_q, d_v) = (4, 3, D_V);
    for b in 0..3 {
        for i in 0..s_q {
            let empty = b == 0 || (b == 1 && i < 2);
            for h in 0..h_q {
                let lse = r.lse[(b * h_q + h) * s_q + i];
                let o = &r.out[((b * s_q + i) * h_q + h) * d_v..][..d_v];
                if empty {
                    assert_eq!(lse, f32::INFINITY, "b {b} i {i} h {h}");
                    assert!(o.iter().all(|&v| v == 0.0));
                } else {
                    assert!(lse.is_finite() && o.iter().all(|v| v.is_finite()));
                }
            }
        }
    }
    check_dense(&case, seed);
}

#[test]
fn dense_nan_beyond_seqlen_and_in_spare_blocks_never_leaks() {
    // dense_case leaves every slot no request owns as NaN and fills unused block-table entries with garbage.
    for seed in 20..23u64 {
        let mut rng = rng(seed);
        let case = dense_case(&mut rng, &spec(&[3, 17, 30], (2, 4, 1), 16, seed == 21));
        assert!(case.k_cache.iter().any(|v| v.is_nan()));
        let r = decode_dense::<f32>(&case.p, &case.inputs()).unwrap();
        assert!(r.out.iter().all(|v| v.is_finite()), "seed {seed}");
        assert!(r.lse.iter().all(|v| !v.is_nan()), "seed {seed}");
    }
}

#[test]
fn dense_out_of_range_block_id_means_missing_keys() {
    let seed = 31;
    let mut rng = rng(seed);
    let mut case = dense_case(&mut rng, &spec(&[20, 12], (2, 4, 1), 4, false));
    let mb = case.p.max_blocks;
    case.block_table[1] = -7; // keys 4..8 of request 0
    case.block_table[mb + 2] = case.p.num_blocks as i32; // keys 8..12 of request 1
    case.block_table[mb] = i32::MAX; // keys 0..4 of request 1
    check_dense(&case, seed); // the naive formulation skips those keys too
    let r = decode_dense::<f32>(&case.p, &case.inputs()).unwrap();
    assert!(r.out.iter().all(|v| v.is_finite()));
}

/// Random chunk boundaries for `n` keys: sorted cut points (repeats give empty chunks, none gives a single
/// chunk), sometimes a range past the end.
fn random_chunks(rng: &mut StdRng, n: usize) -> Vec<Range<usize>> {
    let cuts = rng.random_range(0..5);
    let mut points: Vec<usize> = (0..cuts).map(|_| rng.random_range(0..=n)).collect();
    points.sort();
    let mut bounds = vec![0];
    bounds.extend(points);
    bounds.push(if rng.random_bool(0.3) { n + 10 } else { n });
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

fn check_split_equals_unsplit(
    whole: &DecodeResult<f64>,
    shape: RowShape,
    batch: usize,
    sink: Option<&[f32]>,
    partial_of: impl Fn(usize, Range<usize>) -> DecodePartial<f64>,
    chunks_of: impl Fn(usize) -> Vec<Range<usize>>,
    seed: u64,
) {
    let RowShape { s_q, h_q, d_v } = shape;
    for b in 0..batch {
        let partials: Vec<_> = chunks_of(b).into_iter().map(|r| partial_of(b, r)).collect();
        let (out, lse) = combine(&partials, shape, sink).unwrap();
        let o_want = &whole.out[b * s_q * h_q * d_v..][..s_q * h_q * d_v];
        let l_want = &whole.lse[b * h_q * s_q..][..h_q * s_q];
        assert_close(&format!("split out b{b}"), &out, o_want, F64_EXACT, seed);
        assert_close(&format!("split lse b{b}"), &lse, l_want, F64_EXACT, seed);
    }
}

#[test]
fn dense_split_plus_combine_equals_unsplit_for_random_splits() {
    for seed in 40..46u64 {
        let mut rng = rng(seed);
        let mut sp = spec(&[0, 1, 23, 50], (2, 4, 2), 8, seed % 2 == 0);
        sp.sink = seed % 3 != 0;
        let case = dense_case(&mut rng, &sp);
        let x = case.inputs();
        let whole = decode_dense::<f64>(&case.p, &x).unwrap();
        let shape = RowShape {
            s_q: 2,
            h_q: 4,
            d_v: D_V,
        };
        let chunks: Vec<Vec<Range<usize>>> = case
            .cache_seqlens
            .iter()
            .map(|&n| random_chunks(&mut rng, n as usize))
            .collect();
        let partial_of = |b, r| decode_dense_partial::<f64>(&case.p, &x, b, r).unwrap();
        check_split_equals_unsplit(
            &whole,
            shape,
            4,
            x.attn_sink,
            partial_of,
            |b| chunks[b].clone(),
            seed,
        );
    }
}

#[test]
fn combine_weights_empty_chunks_zero_and_applies_the_sink_once() {
    let shape = RowShape {
        s_q: 1,
        h_q: 2,
        d_v: 2,
    };
    let a = DecodePartial {
        out: vec![1.0, 2.0, 3.0, 4.0],
        lse: vec![0.0f64, f64::NEG_INFINITY],
    };
    let empty = DecodePartial {
        out: vec![0.0; 4],
        lse: vec![f64::NEG_INFINITY; 2],
    };
    let b = DecodePartial {
        out: vec![5.0, 6.0, 0.0, 0.0],
        lse: vec![2f64.ln(), f64::NEG_INFINITY],
    };
    // Head 0: weights 1 and 2 -> out (1 + 2*5)/3, lse ln 3. Head 1: every chunk empty -> 0, +inf.
    let (out, lse) = combine(&[a.clone(), empty.clone(), b.clone()], shape, None).unwrap();
    assert!((out[0] - 11.0 / 3.0).abs() < 1e-15 && (out[1] - 14.0 / 3.0).abs() < 1e-15);
    assert!((lse[0] - 3f64.ln()).abs() < 1e-15);
    assert_eq!((&out[2..], lse[1]), (&[0.0, 0.0][..], f64::INFINITY));
    // An empty chunk changes nothing, bit for bit.
    let (out2, lse2) = combine(&[a.clone(), b.clone()], shape, None).unwrap();
    assert_eq!((out2, lse2), (out.clone(), lse.clone()));
    // Sink ln 3 on head 0: denominator 3 + 3, out halves, lse unchanged; sink +inf: out 0; -inf: no effect.
    let (o, l) = combine(&[a.clone(), b.clone()], shape, Some(&[3f32.ln(), 0.0])).unwrap();
    assert!((o[0] - 11.0 / 6.0).abs() < 1e-6 && (l[0] - 3f64.ln()).abs() < 1e-15);
    let (o, l) = combine(
        &[a.clone(), b.clone()],
        shape,
        Some(&[f32::INFINITY, f32::INFINITY]),
    )
    .unwrap();
    assert_eq!(
        (&o[..2], l[0], l[1]),
        (&[0.0, 0.0][..], lse[0], f64::INFINITY)
    );
    let (o, _) = combine(&[a.clone(), b], shape, Some(&[f32::NEG_INFINITY; 2])).unwrap();
    assert_eq!(o, out);
    // No chunk at all: every row empty.
    let (o, l) = combine::<f64>(&[], shape, None).unwrap();
    assert_eq!((o, l), (vec![0.0; 4], vec![f64::INFINITY; 2]));
    // Mismatched partial sizes are an error, not a panic.
    let bad = DecodePartial {
        out: vec![0.0; 3],
        lse: vec![0.0; 2],
    };
    assert_eq!(
        combine(&[a, bad], shape, None).unwrap_err().arg(),
        Some("partials[1].out")
    );
}

fn mla_shape(num_sms: usize) -> ScheduleShape {
    ScheduleShape {
        s_q: 1,
        h_q: 128,
        h_kv: 1,
        num_sms,
    }
}

#[test]
fn a_lone_long_request_is_split_over_at_most_max_request_parts() {
    // b 1, s_k 4096 on 132 SMs with h_q 64: 132 parts would give each a single tile; the cap keeps 32 or fewer.
    let shape = ScheduleShape {
        h_q: 64,
        ..mla_shape(132)
    };
    let parts_of = |cfg: &ScheduleConfig| {
        let s = decode_schedule(&shape, cfg, &[4096]);
        (s.chunks.len(), s.tile_budget)
    };
    assert_eq!(parts_of(&ScheduleConfig::default()), (22, 3));
    let uncapped = ScheduleConfig {
        max_request_parts: 0,
        ..ScheduleConfig::default()
    };
    assert_eq!(parts_of(&uncapped), (64, 1));
}

#[test]
fn the_parts_floor_gives_way_once_parts_are_long() {
    // One request of 131072 keys among 127 of 1024, h_q 16 on 132 SMs: the line (2052 + 127 * 20 = 4592 units)
    // fills the parts at a budget of 35. The floor of ceil(2052 / 32) = 65 units would leave 61 parts idle; capped
    // at MAX_BUDGET_FLOOR it does not bind, and the long request spreads over 59 parts.
    let shape = ScheduleShape {
        h_q: 16,
        ..mla_shape(132)
    };
    let mut keys = vec![1024usize; 128];
    keys[0] = 131072;
    let s = decode_schedule(&shape, &ScheduleConfig::default(), &keys);
    assert_eq!(s.tile_budget, 35);
    let used = |s: &DecodeSchedule| s.chunks.iter().map(|c| c.part).max().unwrap() + 1;
    assert_eq!(used(&s), 132);
    assert_eq!(s.request_chunks[1] - s.request_chunks[0], 59);
    let uncapped_floor = ScheduleConfig {
        max_budget_floor: 0,
        ..ScheduleConfig::default()
    };
    let s = decode_schedule(&shape, &uncapped_floor, &keys);
    assert_eq!((s.tile_budget, used(&s)), (65, 71));
    // A lone request of 131072 keys: parts of 16 units (128 parts) rather than 32 parts of 65.
    let s = decode_schedule(&shape, &ScheduleConfig::default(), &[131072]);
    assert_eq!((s.tile_budget, used(&s)), (16, 129));
}

#[test]
fn schedule_worked_example() {
    let s = decode_schedule(
        &mla_shape(16),
        &ScheduleConfig::default(),
        &[4096, 100, 0, 1000],
    );
    assert_eq!((s.head_tiles, s.num_parts, s.tile_budget), (2, 8, 13));
    let got: Vec<(usize, usize, usize, usize)> = s
        .chunks
        .iter()
        .map(|c| (c.request, c.part, c.start, c.end))
        .collect();
    let want = vec![
        (0, 0, 0, 576),
        (0, 1, 576, 1408),
        (0, 2, 1408, 2240),
        (0, 3, 2240, 3072),
        (0, 4, 3072, 3904),
        (0, 5, 3904, 4096),
        (1, 5, 0, 100),
        (2, 5, 0, 0),
        (3, 6, 0, 576),
        (3, 7, 576, 1000),
    ];
    assert_eq!(got, want);
    assert_eq!(s.request_chunks, vec![0, 6, 7, 8, 10]);
    assert_eq!(s.part_chunks, vec![0, 1, 2, 3, 4, 5, 8, 9, 10]);
    let costs: Vec<usize> = (0..8)
        .map(|p| s.part_cost(p, &ScheduleConfig::default()))
        .collect();
    assert_eq!(costs, vec![13, 17, 17, 17, 17, 17, 13, 11]);
}

/// Every property the schedule documents, for one input.
fn check_schedule_properties(s: &DecodeSchedule, cfg: &ScheduleConfig, keys: &[usize], ctx: &str) {
    assert_eq!(s.request_chunks.len(), keys.len() + 1, "{ctx}");
    assert_eq!(s.part_chunks.len(), s.num_parts + 1, "{ctx}");
    assert!(
        s.chunks.len() <= DecodeSchedule::max_chunks(keys.len(), s.num_parts),
        "{ctx}"
    );
    for (b, &n) in keys.iter().enumerate() {
        let mine = &s.chunks[s.request_chunks[b]..s.request_chunks[b + 1]];
        assert!(!mine.is_empty(), "{ctx}: request {b} has no chunk");
        // Contiguous, disjoint, covering 0..n; only a keyless request has an empty chunk.
        let mut at = 0;
        for c in mine {
            assert_eq!((c.request, c.start), (b, at), "{ctx}");
            assert!(
                c.end > c.start || (n == 0 && mine.len() == 1),
                "{ctx}: empty chunk in request {b}"
            );
            assert!(
                c.start % cfg.keys_per_tile == 0,
                "{ctx}: chunk start off the tile grid"
            );
            at = c.end;
        }
        assert_eq!(at, n, "{ctx}: request {b} covered up to {at} of {n}");
    }
    for p in 0..s.num_parts {
        for c in &s.chunks[s.part_chunks[p]..s.part_chunks[p + 1]] {
            assert_eq!(c.part, p, "{ctx}");
        }
        assert!(
            s.part_cost(p, cfg) <= s.tile_budget + cfg.chunk_overhead_tiles,
            "{ctx}: part {p} overloaded"
        );
    }
    assert!(
        s.chunks
            .windows(2)
            .all(|w| w[0].part <= w[1].part && w[0].request <= w[1].request),
        "{ctx}"
    );
}

#[test]
fn schedule_covers_every_key_once_with_bounded_chunks_and_load() {
    let mut rng = rng(50);
    for case in 0..300 {
        let batch = rng.random_range(0..40);
        let keys: Vec<usize> = (0..batch)
            .map(|_| match rng.random_range(0..4) {
                0 => 0,
                1 => rng.random_range(1..64),
                _ => rng.random_range(1..40_000),
            })
            .collect();
        let shape = ScheduleShape {
            s_q: rng.random_range(1..4),
            h_q: [1, 16, 64, 128][rng.random_range(0..4)],
            h_kv: 1,
            num_sms: rng.random_range(0..200),
        };
        let cfg = ScheduleConfig {
            rows_per_cta: 64,
            keys_per_tile: [1, 16, 64][rng.random_range(0..3)],
            chunk_overhead_tiles: rng.random_range(1..6),
            max_request_parts: [0, 1, 3, 32][rng.random_range(0..4)],
            max_budget_floor: [0, 1, 16][rng.random_range(0..3)],
        };
        let s = decode_schedule(&shape, &cfg, &keys);
        check_schedule_properties(
            &s,
            &cfg,
            &keys,
            &format!("case {case} {shape:?} {cfg:?} keys {keys:?}"),
        );
        // A pure function: the same inputs give the same schedule.
        assert_eq!(s, decode_schedule(&shape, &cfg, &keys));
    }
}

#[test]
fn schedule_fills_the_sms_at_batch_128() {
    let cfg = ScheduleConfig::default();
    let mut rng = rng(51);
    for (s_q, h_q) in [(1usize, 128usize), (2, 128), (1, 64), (2, 64)] {
        let keys: Vec<usize> = (0..128).map(|_| rng.random_range(1000..20_000)).collect();
        let shape = ScheduleShape {
            s_q,
            h_q,
            h_kv: 1,
            num_sms: 132,
        };
        let s = decode_schedule(&shape, &cfg, &keys);
        // Parts times the CTAs per chunk use all but fewer than head_tiles of the 132 SMs...
        assert!(s.num_parts * s.head_tiles > 132 - s.head_tiles, "{shape:?}");
        // ...every part gets work (at most the last can be idle after rounding)...
        let busy = (0..s.num_parts)
            .filter(|&p| s.part_chunks[p + 1] > s.part_chunks[p])
            .count();
        assert!(
            busy + 1 >= s.num_parts,
            "{shape:?}: {busy} of {} parts busy",
            s.num_parts
        );
        // ...and the heaviest part is within one chunk overhead of the mean.
        let total: usize = (0..s.num_parts).map(|p| s.part_cost(p, &cfg)).sum();
        let max = (0..s.num_parts)
            .map(|p| s.part_cost(p, &cfg))
            .max()
            .unwrap();
        assert!(
            max <= total.div_ceil(s.num_parts) + 2 * cfg.chunk_overhead_tiles,
            "{shape:?}"
        );
        check_schedule_properties(&s, &cfg, &keys, &format!("{shape:?}"));
    }
}

#[test]
fn schedule_driven_split_equals_unsplit_dense_and_sparse() {
    let seed = 60;
    let mut rng = rng(seed);
    let cfg = ScheduleConfig {
        rows_per_cta: 64,
        keys_per_tile: 4,
        chunk_overhead_tiles: 1,
        max_request_parts: 0,
        max_budget_floor: 0,
    };
    let mut sp = spec(&[0, 45, 3, 70], (2, 4, 1), 8, true);
    sp.sink = true;
    let case = dense_case(&mut rng, &sp);
    let x = case.inputs();
    let sched = decode_schedule(
        &ScheduleShape {
            s_q: 2,
            h_q: 4,
            h_kv: 1,
            num_sms: 24,
        },
        &cfg,
        &case.p.key_counts(&x),
    );
    assert!(
        sched.chunks.len() > 8,
        "the schedule should split: {sched:?}"
    );
    let split = decode_dense_split::<f64>(&case.p, &x, &sched).unwrap();
    let whole = decode_dense::<f64>(&case.p, &x).unwrap();
    assert_close("dense out", &split.out, &whole.out, F64_EXACT, seed);
    assert_close("dense lse", &split.lse, &whole.lse, F64_EXACT, seed);

    let main = SparseCacheSpec {
        format: KvFormat::Model1,
        num_blocks: 3,
        page_size: 16,
        block_pad: 0,
        topk: 24,
        p_invalid: 0.2,
        topk_length: Some(vec![24, 0, 10]),
    };
    let extra = SparseCacheSpec {
        topk: 9,
        topk_length: None,
        ..main.clone()
    };
    let sc = sparse_case(&mut rng, (3, 2, 4), &main, Some(&extra), true);
    let sx = sc.inputs();
    let sched = decode_schedule(
        &ScheduleShape {
            s_q: 2,
            h_q: 4,
            h_kv: 1,
            num_sms: 16,
        },
        &cfg,
        &sc.p.key_counts(&sx),
    );
    let split = decode_sparse_split::<f64>(&sc.p, &sx, &sched).unwrap();
    let whole = decode_sparse::<f64>(&sc.p, &sx).unwrap();
    assert_close("sparse out", &split.out, &whole.out, F64_EXACT, seed);
    assert_close("sparse lse", &split.lse, &whole.lse, F64_EXACT, seed);
}

fn check_sparse(case: &SparseCase, seed: u64) {
    let x = case.inputs();
    let (want_out, want_lse) = naive_sparse(case);
    let r64 = decode_sparse::<f64>(&case.p, &x).unwrap();
    assert_close("sparse out f64", &r64.out, &want_out, F64_EXACT, seed);
    assert_close("sparse lse f64", &r64.lse, &want_lse, F64_EXACT, seed);
    let (out, lse) = f32_result(&decode_sparse::<f32>(&case.p, &x).unwrap());
    assert_close("sparse out f32", &out, &want_out, DECODE_OUT, seed);
    assert_close("sparse lse f32", &lse, &want_lse, DECODE_LSE, seed);
    assert!(
        r64.out.iter().all(|v| v.is_finite()),
        "NaN from a dead token leaked (seed {seed})"
    );
}

fn cache_spec(format: KvFormat, topk: usize) -> SparseCacheSpec {
    SparseCacheSpec {
        format,
        num_blocks: 4,
        page_size: 16,
        block_pad: 0,
        topk,
        p_invalid: 0.25,
        topk_length: None,
    }
}

#[test]
fn sparse_fp8_both_formats_match_naive_over_dequantize_cache() {
    for (seed, format) in [(70u64, KvFormat::V32), (71, KvFormat::Model1)] {
        let mut rng = rng(seed);
        // topk 80 > 64 tokens: duplicates and invalid entries both occur; a padded block stride too.
        let main = SparseCacheSpec {
            block_pad: 48,
            ..cache_spec(format, 80)
        };
        check_sparse(&sparse_case(&mut rng, (2, 2, 8), &main, None, false), seed);
    }
}

#[test]
fn sparse_extra_cache_topk_length_and_extra_topk_length() {
    for (seed, format) in [(72u64, KvFormat::V32), (73, KvFormat::Model1)] {
        let mut rng = rng(seed);
        // Lengths 0, partial, > topk and negative; the extra cache has its own page size and lengths.
        let main = SparseCacheSpec {
            topk_length: Some(vec![0, 7, 999, -5]),
            ..cache_spec(format, 20)
        };
        let extra = SparseCacheSpec {
            num_blocks: 2,
            page_size: 8,
            block_pad: 16,
            topk: 12,
            p_invalid: 0.1,
            topk_length: Some(vec![12, 0, 5, 3]),
            format,
        };
        let case = sparse_case(&mut rng, (4, 2, 4), &main, Some(&extra), seed == 73);
        check_sparse(&case, seed);
        // Request 0 (main length 0, extra 12) and 1 (main 7, extra 0) still have keys from one cache.
        let lse = decode_sparse::<f64>(&case.p, &case.inputs()).unwrap().lse;
        assert!(lse[..8].iter().any(|v| v.is_finite()), "seed {seed}");
    }
}

#[test]
fn sparse_sinks_plus_and_minus_infinity() {
    let seed = 74;
    let mut rng = rng(seed);
    let mut case = sparse_case(
        &mut rng,
        (2, 1, 4),
        &cache_spec(KvFormat::V32, 32),
        None,
        false,
    );
    let plain = decode_sparse::<f64>(&case.p, &case.inputs()).unwrap();
    case.sink = Some(vec![f32::NEG_INFINITY; 4]);
    let minus = decode_sparse::<f64>(&case.p, &case.inputs()).unwrap();
    assert_eq!(minus, plain, "a -inf sink has no effect");
    case.sink = Some(vec![f32::INFINITY, f32::INFINITY, f32::NEG_INFINITY, 0.5]);
    let mixed = decode_sparse::<f64>(&case.p, &case.inputs()).unwrap();
    assert_eq!(mixed.lse, plain.lse, "the sink never changes lse");
    for row in 0..2 {
        for h in 0..4 {
            let o = &mixed.out[(row * 4 + h) * 512..][..512];
            match h {
                0 | 1 => assert!(o.iter().all(|&v| v == 0.0), "+inf sink gives out = 0"),
                2 => assert_eq!(o, &plain.out[(row * 4 + h) * 512..][..512]),
                _ => {}
            }
        }
    }
    check_sparse(&case, seed);
}

#[test]
fn sparse_invalid_indices_and_all_invalid_rows() {
    let seed = 75;
    let mut rng = rng(seed);
    let mut case = sparse_case(
        &mut rng,
        (2, 2, 4),
        &cache_spec(KvFormat::Model1, 16),
        None,
        true,
    );
    let n_tok = case.kv.layout.num_tokens() as i32;
    // Row 0: every spec invalid value (and s_kv); row 3: all -1.
    let bad: Vec<i32> = INVALID_INDICES
        .iter()
        .copied()
        .chain([n_tok, n_tok + 1, -2])
        .cycle()
        .take(16)
        .collect();
    case.kv.indices[..16].copy_from_slice(&bad);
    case.kv.indices[48..64].fill(-1);
    let r = decode_sparse::<f32>(&case.p, &case.inputs()).unwrap();
    for h in 0..4 {
        // lse [b, h_q, s_q]: row 0 is (b 0, i 0), row 3 is (b 1, i 1).
        assert_eq!(r.lse[h * 2], f32::INFINITY);
        assert_eq!(r.lse[(4 + h) * 2 + 1], f32::INFINITY);
    }
    assert!(r.out[..4 * 512].iter().all(|&v| v == 0.0));
    assert!(r.out[3 * 4 * 512..].iter().all(|&v| v == 0.0));
    check_sparse(&case, seed);
}

#[test]
fn sparse_split_plus_combine_equals_unsplit_for_random_splits() {
    for (seed, format) in [(80u64, KvFormat::V32), (81, KvFormat::Model1)] {
        let mut rng = rng(seed);
        let main = SparseCacheSpec {
            topk_length: Some(vec![0, 20, 13]),
            ..cache_spec(format, 20)
        };
        let extra = SparseCacheSpec {
            topk: 6,
            ..cache_spec(format, 6)
        };
        let case = sparse_case(&mut rng, (3, 2, 4), &main, Some(&extra), true);
        let x = case.inputs();
        let whole = decode_sparse::<f64>(&case.p, &x).unwrap();
        let chunks: Vec<Vec<Range<usize>>> = case
            .p
            .key_counts(&x)
            .into_iter()
            .map(|n| random_chunks(&mut rng, n))
            .collect();
        let partial_of = |b, r| decode_sparse_partial::<f64>(&case.p, &x, b, r).unwrap();
        let shape = RowShape {
            s_q: 2,
            h_q: 4,
            d_v: 512,
        };
        check_split_equals_unsplit(
            &whole,
            shape,
            3,
            x.attn_sink,
            partial_of,
            |b| chunks[b].clone(),
            seed,
        );
    }
}

#[test]
fn reference_rejects_inconsistent_inputs_without_panicking() {
    let mut rng = rng(90);
    let case = dense_case(&mut rng, &spec(&[5], (1, 4, 2), 4, false));
    let x = case.inputs();
    let short = &case.q[1..];
    let err = decode_dense::<f32>(&case.p, &DenseDecodeInputs { q: short, ..x }).unwrap_err();
    assert_eq!(err.arg(), Some("q"));
    let err = decode_dense::<f32>(&DenseDecodeProblem { h_kv: 3, ..case.p }, &x).unwrap_err();
    assert_eq!(err.arg(), Some("h_q"));
    let err = decode_dense_partial::<f32>(&case.p, &x, 1, 0..5).unwrap_err();
    assert_eq!(err.arg(), Some("request"));
}
