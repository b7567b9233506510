//! The sparse prefill ops' CPU path at its limits (issue 27): a broadcast (stride-0) `kv` costs only the rows
//! that are used, a result too large for memory is an error and not an abort, a cancelled call stops early, and
//! `topk_length` outside `[0, topk]` is clamped as documented.

mod common;

use common::{Case, IndexOpts, Shape, Sink};
use flashmla::ops::sparse_bwd::{sparse_bwd_cpu, sparse_bwd_cpu_with};
use flashmla::ops::sparse_fwd::{sparse_fwd_cpu, sparse_fwd_cpu_with, SparseFwdArgs, D_V};
use flashmla::{CancelToken, DType, Error, HostData, HostTensor, Layout, TensorMeta};
use half::bf16;
use std::time::{Duration, Instant};

/// `rows` copies of the row `values` as a stride-0 view `[rows, 1, values.len()]` (what torch's
/// `kv[:1].expand(rows, 1, d)` describes): one row of storage.
fn broadcast_rows(values: &[f32], rows: usize) -> HostTensor {
    let d = values.len();
    let data = HostData::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect());
    HostTensor::with_layout(data, Layout::strided(&[rows, 1, d], &[0, d, 1]).unwrap()).unwrap()
}

/// A stride-0 i32 view `[rows, 1, values.len()]` of one index row.
fn broadcast_indices(values: &[i32], rows: usize) -> HostTensor {
    let k = values.len();
    let layout = Layout::strided(&[rows, 1, k], &[0, k, 1]).unwrap();
    HostTensor::with_layout(HostData::I32(values.to_vec()), layout).unwrap()
}

fn shape(s_q: usize, s_kv: usize, h_q: usize, topk: usize) -> Shape {
    Shape {
        s_q,
        s_kv,
        h_q,
        d_qk: 576,
        d_v: D_V,
        topk,
    }
}

/// The case: `kv[:1].expand(2**31, 1, 576)` with indices up to `2^31 - 1`. The result must equal the
/// same problem over a one-row `kv` in which every valid index is 0 (the rows hold the same values).
#[test]
fn broadcast_kv_with_large_indices_reads_only_the_referenced_rows() {
    let c = Case::random(
        2701,
        shape(4, 1, 2, 8),
        IndexOpts::CLEAN,
        Sink::Random,
        true,
    );
    let huge = 1usize << 31;
    let row = &c.kv[..576];
    let indices: Vec<i32> = (0..4 * 8)
        .map(|i| match i % 5 {
            0 => i32::MAX,
            1 => 1_000_000_007,
            2 => -1,
            3 => 0,
            _ => 12_345 + i,
        })
        .collect();
    let small_indices: Vec<i32> = indices.iter().map(|&v| v.min(0)).collect();
    let t = c.tensors();
    let big_kv = broadcast_rows(row, huge);
    let big_idx = HostTensor::from_i32(indices, &[4, 1, 8]).unwrap();
    let small_kv = HostTensor::bf16_from_f32(row, &[1, 1, 576]).unwrap();
    let small_idx = HostTensor::from_i32(small_indices, &[4, 1, 8]).unwrap();
    let args = |kv, indices| SparseFwdArgs {
        kv,
        indices,
        ..t.fwd_args()
    };
    let got = sparse_fwd_cpu(&args(&big_kv, &big_idx)).unwrap();
    let want = sparse_fwd_cpu(&args(&small_kv, &small_idx)).unwrap();
    assert_eq!(got, want);
    assert!(
        got.lse.to_f32_vec().unwrap().iter().any(|l| l.is_finite()),
        "some token must attend to something"
    );
}

/// The backward of a broadcast `kv` too large for any address space: its `d_kv` output cannot exist, which is
/// an [`Error::OutOfHostMemory`] naming it (never an abort), while the forward of the same call works.
#[test]
fn a_gradient_too_large_for_memory_is_an_error_not_an_abort() {
    let c = Case::random(2702, shape(3, 1, 2, 4), IndexOpts::CLEAN, Sink::None, false);
    // 2^40 rows x 576 bf16 = 2^50 bytes: beyond the 2^47-byte user address space of x86-64 / arm64 Linux, so
    // the allocation fails whatever the overcommit policy.
    let kv = broadcast_rows(&c.kv[..576], 1 << 40);
    let indices = HostTensor::from_i32(
        vec![0, 7, 1 << 30, i32::MAX, -1, 3, 2, 1, 0, 0, 5, 9],
        &[3, 1, 4],
    )
    .unwrap();
    let t = c.tensors();
    let fwd_args = SparseFwdArgs {
        kv: &kv,
        indices: &indices,
        ..t.fwd_args()
    };
    let fwd = sparse_fwd_cpu(&fwd_args).unwrap();
    let d_out = fwd.out.clone();
    let mut bwd_args = t.bwd_args(&fwd.out, &d_out, &fwd.lse, DType::Bf16);
    bwd_args.kv = &kv;
    bwd_args.indices = &indices;
    match sparse_bwd_cpu(&bwd_args) {
        Err(Error::OutOfHostMemory { what, bytes }) => {
            assert!(what.contains("d_kv"), "{what}");
            assert_eq!(bytes, (1usize << 40) * 576 * 2);
        }
        other => panic!("expected OutOfHostMemory for d_kv, got {other:?}"),
    }
}

/// A forward whose broadcast query and index rows stand for 2^46 tokens: its outputs cannot be allocated.
#[test]
fn a_result_too_large_for_memory_is_an_error_not_an_abort() {
    let c = Case::random(2703, shape(1, 4, 1, 2), IndexOpts::CLEAN, Sink::None, false);
    let tokens = 1usize << 46;
    let q = broadcast_rows(&c.q, tokens);
    let indices = broadcast_indices(&[0, 3], tokens);
    let t = c.tensors();
    let args = SparseFwdArgs {
        q: &q,
        indices: &indices,
        ..t.fwd_args()
    };
    match sparse_fwd_cpu(&args) {
        Err(e @ Error::OutOfHostMemory { .. }) => {
            assert!(e.to_string().starts_with("out of host memory"), "{e}")
        }
        other => panic!("expected OutOfHostMemory, got {other:?}"),
    }
}

/// A forward and backward of about 10^12 flops (minutes on a CPU) over little memory: 64 tokens of 64 heads,
/// each with 65536 entries of one broadcast KV row.
struct LongProblem {
    q: HostTensor,
    kv: HostTensor,
    indices: HostTensor,
}

impl LongProblem {
    fn new() -> Self {
        let c = Case::random(
            2704,
            shape(64, 1, 64, 1),
            IndexOpts::CLEAN,
            Sink::None,
            false,
        );
        LongProblem {
            q: c.tensors().q,
            kv: broadcast_rows(&c.kv[..576], 1),
            indices: broadcast_indices(&vec![0; 1 << 16], 64),
        }
    }

    fn args(&self) -> SparseFwdArgs<'_, HostTensor> {
        SparseFwdArgs {
            q: &self.q,
            kv: &self.kv,
            indices: &self.indices,
            sm_scale: 0.04,
            attn_sink: None,
            topk_length: None,
        }
    }
}

/// A cancelled token stops the computation before its tokens are computed: the call returns
/// [`Error::Interrupted`] in a moment instead of running for minutes.
#[test]
fn a_cancelled_call_stops_at_once_with_interrupted() {
    let p = LongProblem::new();
    let cancelled = CancelToken::new();
    cancelled.cancel();
    let t0 = Instant::now();
    assert_eq!(
        sparse_fwd_cpu_with(&p.args(), &cancelled).unwrap_err(),
        Error::Interrupted
    );
    let [s_q, h_q] = [64, 64];
    let out = HostTensor::bf16_from_f32(&vec![0.01; s_q * h_q * D_V], &[s_q, h_q, D_V]).unwrap();
    let lse = HostTensor::from_f32(vec![1.0; s_q * h_q], &[s_q, h_q]).unwrap();
    let bwd = flashmla::ops::sparse_bwd::SparseBwdArgs {
        q: &p.q,
        kv: &p.kv,
        out: &out,
        d_out: &out,
        indices: &p.indices,
        lse: &lse,
        sm_scale: 0.04,
        attn_sink: None,
        topk_length: None,
        d_kv_dtype: DType::F32,
    };
    assert_eq!(
        sparse_bwd_cpu_with(&bwd, &cancelled).unwrap_err(),
        Error::Interrupted
    );
    // Uncancelled, either call takes minutes; cancelled, only the input copies remain.
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t0.elapsed()
    );
}

/// A token cancelled from another thread while the forward runs stops it early.
#[test]
fn cancelling_from_another_thread_stops_a_running_call() {
    let p = LongProblem::new();
    let token = CancelToken::new();
    let t0 = Instant::now();
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            token.cancel();
        });
        sparse_fwd_cpu_with(&p.args(), &token)
    });
    assert_eq!(result.unwrap_err(), Error::Interrupted);
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
}

/// `topk_length[t]` outside `[0, topk]` is clamped: a length above `topk` (up to `i32::MAX`) uses every entry,
/// a negative one (down to `i32::MIN`) none, exactly as if the ignored entries were -1 and no lengths were given.
#[test]
fn topk_length_outside_zero_to_topk_is_clamped() {
    let topk = 6;
    let lengths = [7, i32::MAX, -1, i32::MIN, 0, 6, 3, 100];
    let s_q = lengths.len();
    let c = Case::random(
        2705,
        shape(s_q, 40, 3, topk),
        IndexOpts::CLEAN,
        Sink::Random,
        false,
    );
    let masked: Vec<i32> = c
        .indices
        .chunks(topk)
        .zip(lengths)
        .flat_map(|(row, len)| {
            let keep = len.clamp(0, topk as i32) as usize;
            row.iter()
                .enumerate()
                .map(move |(j, &v)| if j < keep { v } else { -1 })
        })
        .collect();
    let t = c.tensors();
    let len_t = HostTensor::from_i32(lengths.to_vec(), &[s_q]).unwrap();
    let masked_t = HostTensor::from_i32(masked, &[s_q, 1, topk]).unwrap();
    let with_len = SparseFwdArgs {
        topk_length: Some(&len_t),
        ..t.fwd_args()
    };
    let with_mask = SparseFwdArgs {
        indices: &masked_t,
        topk_length: None,
        ..t.fwd_args()
    };
    let a = sparse_fwd_cpu(&with_len).unwrap();
    let b = sparse_fwd_cpu(&with_mask).unwrap();
    assert_eq!(a, b);
    // Tokens 2, 3 and 4 (lengths -1, i32::MIN, 0) attend to nothing: out 0, lse +inf, max_logits -inf.
    let (lse, max) = (
        a.lse.to_f32_vec().unwrap(),
        a.max_logits.to_f32_vec().unwrap(),
    );
    let out = a.out.to_f32_vec().unwrap();
    for tok in 2..5 {
        assert!(lse[tok * 3..][..3].iter().all(|&l| l == f32::INFINITY));
        assert!(max[tok * 3..][..3].iter().all(|&m| m == f32::NEG_INFINITY));
        assert!(out[tok * 3 * D_V..][..3 * D_V].iter().all(|&o| o == 0.0));
    }
    // Tokens 0 and 1 (lengths above topk) use all entries: the same as no length at all.
    let plain = sparse_fwd_cpu(&t.fwd_args()).unwrap();
    assert_eq!(lse[..6], plain.lse.to_f32_vec().unwrap()[..6]);

    // The backward clamps the same way.
    let d_out = a.out.clone();
    let mut bwd_len = t.bwd_args(&a.out, &d_out, &a.lse, DType::F32);
    bwd_len.topk_length = Some(&len_t);
    let mut bwd_mask = t.bwd_args(&a.out, &d_out, &a.lse, DType::F32);
    bwd_mask.indices = &masked_t;
    bwd_mask.topk_length = None;
    let (ga, gb) = (
        sparse_bwd_cpu(&bwd_len).unwrap(),
        sparse_bwd_cpu(&bwd_mask).unwrap(),
    );
    assert_eq!(ga, gb);
    assert_eq!(ga.d_kv.shape(), &[40, 1, 576]);
}
