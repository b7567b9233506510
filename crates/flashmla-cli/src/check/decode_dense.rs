//! Dense decode: the kernels (schedule, split, combine) against the f64 reference (spec section 6 decode tolerances) on
//! paged caches with shuffled blocks, NaN in every slot no request owns, garbage block ids past each request's used
//! blocks, `cache_seqlens` including 0 and values that are not multiples of the page size; bf16 and f16; head ratios
//! 1..=128 per key head; `s_q` up to 16 with and without the causal mask; page sizes 64, 16, 48 and 1; sinks (finite,
//! +inf, -inf); strided inputs and outputs; out rows not 16-byte aligned; schedules forced to split every request and
//! the batch-invariant schedule. Outputs are poisoned (NaN) beforehand, so an unwritten element fails. Two more checks:
//! batch invariance (a request's output is bitwise the same alone and inside a larger batch) and workspace reuse (a
//! second call with other `cache_seqlens` on the same workspace, as a replayed CUDA graph does).

use super::{decode_outputs as outputs, Case, Outcome};
use flashmla::cuda::Gpu;
use flashmla::ops::decode::{
    decode_dense_cuda, launch::dense_workspace_words, validate_dense, DecodeOptions, DecodeOutput,
    DenseDecodeArgs,
};
use flashmla::reference::decode::decode_dense;
use flashmla::testing::{dense_case, rng, DenseCase, DenseSpec};
use flashmla::{DType, HostData, HostTensor};
use half::f16;

/// Poison byte of the workspace: 0xFF.. is a NaN in f32.
const POISON: u8 = 0xFF;

/// One dense case of the grid.
#[derive(Clone, Debug)]
pub struct DenseCheck {
    /// What to generate.
    pub spec: DenseSpec,
    /// Element type of q, the cache and out.
    pub dtype: DType,
    /// Schedule options.
    pub options: DecodeOptions,
    /// `attn_sink` override: `Some(v)` sets every head's sink to `v` (±inf cases).
    pub sink_value: Option<f32>,
    /// Non-contiguous q and k_cache.
    pub strided: bool,
    /// Elements of padding after every dimension of out and lse (0: contiguous; 1: odd strides; 2: out rows 4-byte
    /// aligned but not 16-byte aligned, so the final rows cannot leave as bulk stores).
    pub out_pad: usize,
    /// Every third block-table entry a request uses replaced by an id outside `0..num_blocks` (missing keys: the
    /// kernels must skip them without reading, as the reference does).
    pub missing_blocks: bool,
}

/// Host tensors of a case in the kernel's dtype (values rounded to f16 first for f16 cases, so the reference sees
/// exactly what the kernel reads).
struct HostCase {
    case: DenseCase,
    q: HostTensor,
    k_cache: HostTensor,
    block_table: HostTensor,
    cache_seqlens: HostTensor,
    sink: Option<HostTensor>,
}

fn tensor_of(values: &[f32], shape: &[usize], dtype: DType) -> flashmla::Result<HostTensor> {
    match dtype {
        DType::F16 => HostTensor::new(
            HostData::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            shape,
        ),
        _ => HostTensor::bf16_from_f32(values, shape),
    }
}

fn host_case(c: &DenseCheck, seed: u64) -> flashmla::Result<HostCase> {
    let mut case = dense_case(&mut rng(seed), &c.spec);
    if c.missing_blocks {
        let (page, max_blocks, num_blocks) =
            (case.p.page_size, case.p.max_blocks, case.p.num_blocks);
        for (b, &n) in case.cache_seqlens.iter().enumerate() {
            for j in (1..(n.max(0) as usize).div_ceil(page)).step_by(3) {
                case.block_table[b * max_blocks + j] =
                    if j % 2 == 0 { -1 } else { num_blocks as i32 };
            }
        }
    }
    if c.dtype == DType::F16 {
        for v in case.q.iter_mut().chain(case.k_cache.iter_mut()) {
            *v = f16::from_f32(*v).to_f32();
        }
    }
    if let (Some(v), Some(s)) = (c.sink_value, case.sink.as_mut()) {
        s.iter_mut().for_each(|x| *x = v);
    }
    let p = &case.p;
    let q = tensor_of(&case.q, &[p.batch, p.s_q, p.h_q, p.d_qk], c.dtype)?;
    let k_cache = tensor_of(
        &case.k_cache,
        &[p.num_blocks, p.page_size, p.h_kv, p.d_qk],
        c.dtype,
    )?;
    let block_table = HostTensor::from_i32(case.block_table.clone(), &[p.batch, p.max_blocks])?;
    let cache_seqlens = HostTensor::from_i32(case.cache_seqlens.clone(), &[p.batch])?;
    let sink = case
        .sink
        .as_ref()
        .map(|s| HostTensor::from_f32(s.clone(), &[p.h_q]))
        .transpose()?;
    let (q, k_cache) = if c.strided {
        // Padding keeps rows 16-byte aligned (the gather's requirement); out and lse get odd strides.
        (
            q.to_padded(&[0, 1, 1, 8])?,
            k_cache.to_padded(&[1, 1, 1, 0])?,
        )
    } else {
        (q, k_cache)
    };
    Ok(HostCase {
        case,
        q,
        k_cache,
        block_table,
        cache_seqlens,
        sink,
    })
}

/// Runs the kernels on a case; returns `(out, lse)` as f32 host vectors (row-major logical order).
fn run_gpu(
    gpu: &Gpu,
    h: &HostCase,
    c: &DenseCheck,
    workspace: Option<&flashmla::DeviceView>,
) -> flashmla::Result<(Vec<f32>, Vec<f32>)> {
    let p = &h.case.p;
    let q = gpu.upload(&h.q)?;
    let k = gpu.upload(&h.k_cache)?;
    let bt = gpu.upload(&h.block_table)?;
    let sl = gpu.upload(&h.cache_seqlens)?;
    let sink = h.sink.as_ref().map(|s| gpu.upload(s)).transpose()?;
    let (out, lse) = outputs::poisoned(gpu, c.dtype, [p.batch, p.s_q, p.h_q, p.d_v], c.out_pad)?;
    let sink_view = sink.as_ref().map(|s| s.view());
    let args = DenseDecodeArgs {
        q: &q.view(),
        k_cache: &k.view(),
        block_table: &bt.view(),
        cache_seqlens: &sl.view(),
        softmax_scale: Some(p.softmax_scale),
        causal: p.causal,
        attn_sink: sink_view.as_ref(),
    };
    let outputs = DecodeOutput {
        out: out.view(),
        lse: lse.view(),
    };
    decode_dense_cuda(gpu, &args, &outputs, &c.options, workspace)?;
    outputs::read(gpu, &out, &lse)
}

fn run_case(gpu: &Gpu, c: &DenseCheck, seed: u64) -> flashmla::Result<Outcome> {
    let h = host_case(c, seed)?;
    let want = decode_dense::<f64>(&h.case.p, &h.case.inputs())?;
    Ok(Outcome::from_checks(outputs::judge(
        "",
        &run_gpu(gpu, &h, c, None)?,
        &want,
    )))
}

/// Workspace reuse: two calls on one caller-owned workspace with different `cache_seqlens` (and block tables),
/// as a CUDA graph replays them; each must match its own reference.
fn run_reuse(gpu: &Gpu, c: &DenseCheck, seed: u64) -> flashmla::Result<Outcome> {
    let first = host_case(c, seed)?;
    let mut other = c.clone();
    other.spec.seqlens = c.spec.seqlens.iter().rev().map(|&n| n / 2 + 7).collect();
    let second = host_case(&other, seed ^ 0x5eed)?;
    let dims = validate_dense(&DenseDecodeArgs {
        q: &first.q,
        k_cache: &first.k_cache,
        block_table: &first.block_table,
        cache_seqlens: &first.cache_seqlens,
        softmax_scale: None,
        causal: c.spec.causal,
        attn_sink: first.sink.as_ref(),
    })?;
    let dims2 = validate_dense(&DenseDecodeArgs {
        q: &second.q,
        k_cache: &second.k_cache,
        block_table: &second.block_table,
        cache_seqlens: &second.cache_seqlens,
        softmax_scale: None,
        causal: c.spec.causal,
        attn_sink: second.sink.as_ref(),
    })?;
    let sms = gpu.info().sm_count as usize;
    let words = dense_workspace_words(&dims, &c.options, sms)?
        .max(dense_workspace_words(&dims2, &c.options, sms)?);
    let ws = gpu.alloc_filled(DType::F32, &[words], POISON)?;
    let mut checks = Vec::new();
    for (name, h) in [("first", &first), ("second", &second)] {
        let want = decode_dense::<f64>(&h.case.p, &h.case.inputs())?;
        let got = run_gpu(gpu, h, c, Some(&ws.view()))?;
        checks.extend(outputs::judge(&format!("{name} "), &got, &want));
    }
    Ok(Outcome::from_checks(checks))
}

/// Batch invariance: request 0 of a small batch, run alone and as request 0 of larger batches (other requests of
/// other lengths behind it), must give bitwise the same out and lse in batch-invariant mode.
fn run_invariance(gpu: &Gpu, c: &DenseCheck, seed: u64) -> flashmla::Result<Outcome> {
    let p0 = host_case(c, seed)?;
    let (out0, lse0) = run_gpu(gpu, &p0, c, None)?;
    let mut checks = Vec::new();
    for extra in [1usize, 7, 40] {
        let mut big = c.clone();
        big.spec.batch = 1 + extra;
        big.spec.seqlens = std::iter::once(c.spec.seqlens[0])
            .chain((0..extra).map(|i| (i as i32 * 977 + 13) % 9000))
            .collect();
        let mut h = host_case(&big, seed ^ extra as u64)?;
        // Request 0 must read the same q and keys as in the small batch: copy them over.
        let p = h.case.p;
        let n_q = p.s_q * p.h_q * p.d_qk;
        h.case.q[..n_q].copy_from_slice(&p0.case.q[..n_q]);
        let row = p.h_kv * p.d_qk;
        for pos in 0..c.spec.seqlens[0].max(0) as usize {
            let src_block = p0.case.block_table[pos / p0.case.p.page_size] as usize;
            let dst_block = h.case.block_table[pos / p.page_size] as usize;
            let src = (src_block * p.page_size + pos % p.page_size) * row;
            let dst = (dst_block * p.page_size + pos % p.page_size) * row;
            h.case.k_cache[dst..dst + row].copy_from_slice(&p0.case.k_cache[src..src + row]);
        }
        h.q = tensor_of(&h.case.q, &[p.batch, p.s_q, p.h_q, p.d_qk], big.dtype)?;
        h.k_cache = tensor_of(
            &h.case.k_cache,
            &[p.num_blocks, p.page_size, p.h_kv, p.d_qk],
            big.dtype,
        )?;
        h.sink = p0.sink.clone();
        let got = run_gpu(gpu, &h, &big, None)?;
        checks.push(outputs::bitwise(
            format!("batch {}", 1 + extra),
            &got,
            (&out0, &lse0),
        ));
    }
    Ok(Outcome::from_checks(checks))
}

fn spec(
    batch: usize,
    s_q: usize,
    h_q: usize,
    h_kv: usize,
    page_size: usize,
    seqlens: Vec<i32>,
) -> DenseSpec {
    DenseSpec {
        batch,
        s_q,
        h_q,
        h_kv,
        d_qk: 576,
        d_v: 512,
        page_size,
        seqlens,
        causal: false,
        sink: false,
    }
}

/// Sequence lengths of a batch: 0, lengths around page and tile boundaries, and a few long ones.
fn lengths(batch: usize, salt: usize) -> Vec<i32> {
    const L: [i32; 12] = [0, 1, 63, 64, 65, 200, 1000, 1537, 2048, 3001, 17, 4500];
    (0..batch).map(|i| L[(i * 5 + salt) % L.len()]).collect()
}

/// The dense decode cases.
pub fn cases() -> Vec<Case> {
    let mut v: Vec<(String, bool, DenseCheck)> = Vec::new();
    let forced = DecodeOptions {
        num_parts: Some(7),
        ..DecodeOptions::default()
    };
    let invariant = DecodeOptions {
        batch_invariant: true,
        chunk_tiles: Some(9),
        ..DecodeOptions::default()
    };
    let base = |s: DenseSpec| DenseCheck {
        spec: s,
        dtype: DType::Bf16,
        options: DecodeOptions::default(),
        sink_value: None,
        strided: false,
        out_pad: 0,
        missing_blocks: false,
    };
    // Head ratios and query lengths, default schedule and forced splits.
    for (h_q, h_kv) in [
        (128usize, 1usize),
        (64, 1),
        (16, 1),
        (1, 1),
        (8, 2),
        (128, 2),
        (3, 3),
    ] {
        for s_q in [1usize, 2, 5] {
            for (oname, options) in [("default", DecodeOptions::default()), ("split7", forced)] {
                let mut c = base(spec(6, s_q, h_q, h_kv, 64, lengths(6, h_q + s_q)));
                c.spec.causal = s_q > 1;
                c.options = options;
                let quick = s_q <= 2 && (h_kv == 1 && (h_q == 128 || h_q == 16));
                v.push((
                    format!("decode_dense/bf16/h{h_q}kv{h_kv}/s_q{s_q}/{oname}"),
                    quick,
                    c,
                ));
            }
        }
    }
    // s_q 16 (MTP) with causal and h_q 128: 2048 rows per request.
    for causal in [false, true] {
        let mut c = base(spec(3, 16, 128, 1, 64, vec![10, 700, 2100]));
        c.spec.causal = causal;
        v.push((format!("decode_dense/bf16/s_q16/causal{causal}"), false, c));
    }
    // Page sizes, f16, sinks, d_qk 512, strided, invariant schedule.
    // Pages of several key tiles (tiles start inside a page) and pages smaller than or not a multiple of a tile.
    for page in [128usize, 256, 16, 48, 1] {
        let c = base(spec(5, 1, 64, 1, page, lengths(5, page)));
        v.push((format!("decode_dense/bf16/page{page}"), page == 16, c));
    }
    // Missing blocks inside the requests' ranges, one and two row tiles, unsplit and forced splits.
    for (h_q, page) in [(128usize, 64usize), (16, 128)] {
        for (oname, options) in [("default", DecodeOptions::default()), ("split7", forced)] {
            let mut c = base(spec(6, 1, h_q, 1, page, lengths(6, 5)));
            c.missing_blocks = true;
            c.options = options;
            v.push((
                format!("decode_dense/bf16/missing_blocks/h{h_q}page{page}/{oname}"),
                false,
                c,
            ));
        }
    }
    for (h_q, h_kv) in [(128usize, 1usize), (16, 1), (12, 4)] {
        let mut c = base(spec(6, 2, h_q, h_kv, 64, lengths(6, 3)));
        c.dtype = DType::F16;
        c.spec.causal = true;
        let mut c2 = c.clone();
        c2.options = forced;
        v.push((format!("decode_dense/f16/h{h_q}kv{h_kv}"), h_q == 128, c));
        v.push((format!("decode_dense/f16/h{h_q}kv{h_kv}/split7"), false, c2));
    }
    for (name, sv) in [
        ("sink", None),
        ("sink+inf", Some(f32::INFINITY)),
        ("sink-inf", Some(f32::NEG_INFINITY)),
    ] {
        for (oname, options) in [("default", DecodeOptions::default()), ("split7", forced)] {
            let mut c = base(spec(6, 1, 128, 1, 64, lengths(6, 7)));
            c.spec.sink = true;
            c.sink_value = sv;
            c.options = options;
            v.push((
                format!("decode_dense/bf16/{name}/{oname}"),
                name == "sink",
                c,
            ));
        }
    }
    for (oname, options) in [("default", DecodeOptions::default()), ("split7", forced)] {
        let mut c = base(spec(6, 2, 128, 1, 64, lengths(6, 9)));
        c.spec.d_qk = 512;
        c.options = options;
        v.push((format!("decode_dense/bf16/d512/{oname}"), false, c));
        let mut s = base(spec(6, 2, 64, 1, 64, lengths(6, 11)));
        s.strided = true;
        s.out_pad = 1;
        s.spec.sink = true;
        s.options = options;
        v.push((
            format!("decode_dense/bf16/strided/{oname}"),
            oname == "default",
            s,
        ));
        // out rows 4-byte but not 16-byte aligned: the final rows leave as 4-byte stores.
        let mut w = base(spec(6, 2, 128, 1, 64, lengths(6, 13)));
        w.out_pad = 2;
        w.options = options;
        v.push((format!("decode_dense/bf16/out_words/{oname}"), false, w));
    }
    for (h_q, s_q) in [(128usize, 1usize), (64, 2)] {
        let mut c = base(spec(9, s_q, h_q, 1, 64, lengths(9, 1)));
        c.options = invariant;
        c.spec.causal = s_q > 1;
        v.push((
            format!("decode_dense/bf16/invariant/h{h_q}/s_q{s_q}"),
            true,
            c,
        ));
    }
    // A skewed batch: one long request and many short ones.
    let mut skew = vec![20_000i32];
    skew.extend(std::iter::repeat_n(300, 31));
    v.push((
        "decode_dense/bf16/skewed".into(),
        false,
        base(spec(32, 1, 128, 1, 64, skew)),
    ));
    // Batches around the split kernel's own schedule (at most 128 requests; 33 and 128: one and four requests per
    // lane) and past it (129: the schedule kernel runs first); a uniform batch of 128 (whole requests per part).
    for b in [33usize, 128, 129] {
        v.push((
            format!("decode_dense/bf16/batch{b}"),
            b == 128 || b == 129,
            base(spec(b, 1, 16, 1, 64, lengths(b, b))),
        ));
    }
    v.push((
        "decode_dense/bf16/uniform128".into(),
        true,
        base(spec(128, 1, 16, 1, 64, vec![1024; 128])),
    ));
    // Every request empty.
    v.push((
        "decode_dense/bf16/all_empty".into(),
        true,
        base(spec(4, 2, 64, 1, 64, vec![0; 4])),
    ));

    let mut cases: Vec<Case> = v
        .into_iter()
        .map(|(name, quick, c)| Case {
            name,
            quick,
            run: Box::new(move |gpu, _tuning, seed| run_case(gpu, &c, seed)),
        })
        .collect();
    let mut reuse = base(spec(6, 1, 128, 1, 64, lengths(6, 2)));
    reuse.options = forced;
    cases.push(Case {
        name: "decode_dense/bf16/workspace_reuse".into(),
        quick: true,
        run: Box::new(move |gpu, _tuning, seed| run_reuse(gpu, &reuse, seed)),
    });
    let mut inv = base(spec(1, 2, 128, 1, 64, vec![2500]));
    inv.options = DecodeOptions {
        batch_invariant: true,
        ..DecodeOptions::default()
    };
    cases.push(Case {
        name: "decode_dense/bf16/batch_invariance".into(),
        quick: true,
        run: Box::new(move |gpu, _tuning, seed| run_invariance(gpu, &inv, seed)),
    });
    // The same with chunks of 8 line units: request 0 (40 key tiles) is split over six parts, so its combine runs, in
    // a batch of 1 (a small grid) as in a batch of 41, over more parts than a row has warps.
    let mut inv_split = base(spec(1, 2, 128, 1, 64, vec![2500]));
    inv_split.options = DecodeOptions {
        batch_invariant: true,
        chunk_tiles: Some(8),
        ..DecodeOptions::default()
    };
    cases.push(Case {
        name: "decode_dense/bf16/batch_invariance_split".into(),
        quick: true,
        run: Box::new(move |gpu, _tuning, seed| run_invariance(gpu, &inv_split, seed)),
    });
    cases
}
