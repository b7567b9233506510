//! Sparse FP8 decode: the kernels (schedule, dequantising split, combine) against the f64 reference (spec section 6
//! decode tolerances) on both cache formats (V3.2 656-byte and MODEL1 584-byte tokens) with padded block strides, dead
//! tokens whose every byte is 0xFF (NaN values and scales) that no valid index names, invalid indices drawn from the
//! spec's adversarial values (i32 extremes included) and rows where every index is invalid; any `h_q` in 1..=128, `s_q`
//! up to 16, `topk` not a multiple of 64 (down to 1), `topk_length` (0, negative, beyond topk), an extra cache with its
//! own page size and lengths, sinks (finite, ±inf), strided q and outputs, out rows not 16-byte aligned, schedules
//! forced to split every request, the batch-invariant schedule, and batches with lengths on both sides of the split
//! kernels' inline-schedule limit (128 requests), for the narrow and the 64-row kernels. Outputs are poisoned (NaN)
//! beforehand, so an unwritten element fails. Two more checks: batch invariance (a query's output is bitwise the same
//! alone and inside a larger batch) and workspace reuse (a second call with other indices and lengths on the same
//! workspace).

use super::{decode_outputs as outputs, Case, Outcome};
use flashmla::cuda::Gpu;
use flashmla::fp8::KvFormat;
use flashmla::ops::decode::{
    decode_sparse_cuda, launch::sparse_workspace_words, validate_sparse, DecodeOptions,
    DecodeOutput, ExtraKvArgs, SparseDecodeArgs,
};
use flashmla::reference::decode::decode_sparse;
use flashmla::testing::{
    rng, sparse_decode_case, SparseCacheCase, SparseCacheSpec, SparseDecodeCase,
};
use flashmla::{DType, DeviceView, HostData, HostTensor, Layout};

/// Poison byte of the workspace: 0xFF.. is a NaN in f32.
const POISON: u8 = 0xFF;

/// One sparse case of the grid.
#[derive(Clone, Debug)]
pub struct SparseCheck {
    /// `(b, s_q, h_q)`.
    pub shape: (usize, usize, usize),
    /// The main cache.
    pub main: SparseCacheSpec,
    /// The extra cache, optional.
    pub extra: Option<SparseCacheSpec>,
    /// Draw an `attn_sink`; `sink_value` overrides every head's value (±inf cases).
    pub sink: bool,
    /// See `sink`.
    pub sink_value: Option<f32>,
    /// Schedule options.
    pub options: DecodeOptions,
    /// Non-contiguous q and indices.
    pub strided: bool,
    /// Elements of padding after every dimension of out and lse (0: contiguous; 1: odd strides; 2: out rows 4-byte
    /// aligned but not 16-byte aligned, so the final rows cannot leave as bulk stores).
    pub out_pad: usize,
}

/// Host tensors of one cache: the bytes keep their padded block stride.
struct HostCache {
    cache: HostTensor,
    indices: HostTensor,
    lengths: Option<HostTensor>,
}

fn host_cache(
    k: &SparseCacheCase,
    batch: usize,
    s_q: usize,
    strided: bool,
) -> flashmla::Result<HostCache> {
    let l = k.layout;
    let bpt = l.format.bytes_per_token();
    let layout = Layout::strided(
        &[l.num_blocks, l.page_size, 1, bpt],
        &[l.block_stride, bpt, bpt, 1],
    )?;
    let cache = HostTensor::with_layout(HostData::U8(k.bytes.clone()), layout)?;
    let indices = HostTensor::from_i32(k.indices.clone(), &[batch, s_q, k.topk])?;
    let indices = if strided {
        indices.to_padded(&[1, 1, 3])?
    } else {
        indices
    };
    let lengths = k
        .topk_length
        .as_ref()
        .map(|t| HostTensor::from_i32(t.clone(), &[batch]))
        .transpose()?;
    Ok(HostCache {
        cache,
        indices,
        lengths,
    })
}

struct HostCase {
    case: SparseDecodeCase,
    q: HostTensor,
    main: HostCache,
    extra: Option<HostCache>,
    sink: Option<HostTensor>,
}

fn host_case(c: &SparseCheck, seed: u64) -> flashmla::Result<HostCase> {
    let (b, s_q, h_q) = c.shape;
    let mut case = sparse_decode_case(&mut rng(seed), c.shape, &c.main, c.extra.as_ref(), c.sink);
    if let (Some(v), Some(s)) = (c.sink_value, case.sink.as_mut()) {
        s.iter_mut().for_each(|x| *x = v);
    }
    let d_qk = c.main.format.d_qk();
    let q = HostTensor::bf16_from_f32(&case.q, &[b, s_q, h_q, d_qk])?;
    let q = if c.strided {
        q.to_padded(&[1, 1, 1, 8])?
    } else {
        q
    };
    let main = host_cache(&case.kv, b, s_q, c.strided)?;
    let extra = case
        .extra
        .as_ref()
        .map(|e| host_cache(e, b, s_q, false))
        .transpose()?;
    let sink = case
        .sink
        .as_ref()
        .map(|s| HostTensor::from_f32(s.clone(), &[h_q]))
        .transpose()?;
    Ok(HostCase {
        case,
        q,
        main,
        extra,
        sink,
    })
}

fn args<'a>(
    h: &'a HostCase,
    q: &'a DeviceView,
    main: &'a [DeviceView; 2],
    main_len: Option<&'a DeviceView>,
    extra: Option<(&'a [DeviceView; 2], Option<&'a DeviceView>)>,
    sink: Option<&'a DeviceView>,
) -> SparseDecodeArgs<'a, DeviceView> {
    SparseDecodeArgs {
        q,
        k_cache: &main[0],
        indices: &main[1],
        topk_length: main_len,
        softmax_scale: Some(h.case.p.softmax_scale),
        attn_sink: sink,
        extra: extra.map(|(e, len)| ExtraKvArgs {
            k_cache: &e[0],
            indices: &e[1],
            topk_length: len,
        }),
    }
}

/// Runs the kernels on a case; returns `(out, lse)` as f32 host vectors (row-major logical order).
fn run_gpu(
    gpu: &Gpu,
    h: &HostCase,
    c: &SparseCheck,
    workspace: Option<&DeviceView>,
) -> flashmla::Result<(Vec<f32>, Vec<f32>)> {
    let p = &h.case.p;
    let q = gpu.upload(&h.q)?;
    let up = |k: &HostCache| -> flashmla::Result<_> {
        Ok((
            gpu.upload(&k.cache)?,
            gpu.upload(&k.indices)?,
            k.lengths.as_ref().map(|t| gpu.upload(t)).transpose()?,
        ))
    };
    let main = up(&h.main)?;
    let extra = h.extra.as_ref().map(up).transpose()?;
    let sink = h.sink.as_ref().map(|s| gpu.upload(s)).transpose()?;
    let (out, lse) =
        outputs::poisoned(gpu, DType::Bf16, [p.batch, p.s_q, p.h_q, p.d_v], c.out_pad)?;
    let main_views = [main.0.view(), main.1.view()];
    let main_len = main.2.as_ref().map(|t| t.view());
    let extra_views = extra
        .as_ref()
        .map(|e| ([e.0.view(), e.1.view()], e.2.as_ref().map(|t| t.view())));
    let sink_view = sink.as_ref().map(|s| s.view());
    let q_view = q.view();
    let a = args(
        h,
        &q_view,
        &main_views,
        main_len.as_ref(),
        extra_views.as_ref().map(|(v, l)| (v, l.as_ref())),
        sink_view.as_ref(),
    );
    let outputs = DecodeOutput {
        out: out.view(),
        lse: lse.view(),
    };
    decode_sparse_cuda(gpu, &a, &outputs, &c.options, workspace)?;
    outputs::read(gpu, &out, &lse)
}

fn run_case(gpu: &Gpu, c: &SparseCheck, seed: u64) -> flashmla::Result<Outcome> {
    let h = host_case(c, seed)?;
    let want = decode_sparse::<f64>(&h.case.p, &h.case.inputs())?;
    Ok(Outcome::from_checks(outputs::judge(
        "",
        &run_gpu(gpu, &h, c, None)?,
        &want,
    )))
}

/// Words of workspace a host case needs.
fn workspace_words(gpu: &Gpu, h: &HostCase, c: &SparseCheck) -> flashmla::Result<usize> {
    let dims = validate_sparse(&SparseDecodeArgs {
        q: &h.q,
        k_cache: &h.main.cache,
        indices: &h.main.indices,
        topk_length: h.main.lengths.as_ref(),
        softmax_scale: None,
        attn_sink: h.sink.as_ref(),
        extra: h.extra.as_ref().map(|e| ExtraKvArgs {
            k_cache: &e.cache,
            indices: &e.indices,
            topk_length: e.lengths.as_ref(),
        }),
    })?;
    sparse_workspace_words(&dims, &c.options, gpu.info().sm_count as usize)
}

/// Workspace reuse: two calls on one caller-owned workspace with different indices and lengths, as a replayed CUDA
/// graph makes them; each must match its own reference.
fn run_reuse(gpu: &Gpu, c: &SparseCheck, seed: u64) -> flashmla::Result<Outcome> {
    let first = host_case(c, seed)?;
    let mut other = c.clone();
    other.main.topk_length = c
        .main
        .topk_length
        .as_ref()
        .map(|t| t.iter().rev().map(|&n| n / 2 + 3).collect());
    let second = host_case(&other, seed ^ 0x5eed)?;
    let words = workspace_words(gpu, &first, c)?.max(workspace_words(gpu, &second, &other)?);
    let ws = gpu.alloc_filled(DType::F32, &[words], POISON)?;
    let mut checks = Vec::new();
    for (name, h, cc) in [("first", &first, c), ("second", &second, &other)] {
        let want = decode_sparse::<f64>(&h.case.p, &h.case.inputs())?;
        let got = run_gpu(gpu, h, cc, Some(&ws.view()))?;
        checks.extend(outputs::judge(&format!("{name} "), &got, &want));
    }
    Ok(Outcome::from_checks(checks))
}

/// Batch invariance: the first request of a batch of 1, then of batches of 2, 8 and 41 over the same caches (the
/// first request keeps its q, indices and length), must give bitwise the same out and lse in batch-invariant mode.
fn run_invariance(gpu: &Gpu, c: &SparseCheck, seed: u64) -> flashmla::Result<Outcome> {
    let (_, s_q, h_q) = c.shape;
    let big_b = 41;
    let mut big = c.clone();
    big.shape.0 = big_b;
    big.main.topk_length = Some(
        (0..big_b as i32)
            .map(|i| (i * 397 + 1500) % (c.main.topk as i32 + 50))
            .collect(),
    );
    let full = host_case(&big, seed)?;
    let d_qk = c.main.format.d_qk();
    let mut checks = Vec::new();
    let mut alone: Option<(Vec<f32>, Vec<f32>)> = None;
    for b in [1usize, 2, 8, big_b] {
        // The first b requests of the big case: q, indices and lengths are prefixes (b is the outer dimension).
        let mut case = full.case.clone();
        case.p.batch = b;
        case.q.truncate(b * s_q * h_q * d_qk);
        case.kv.indices.truncate(b * s_q * c.main.topk);
        if let Some(t) = case.kv.topk_length.as_mut() {
            t.truncate(b);
        }
        let h = HostCase {
            q: HostTensor::bf16_from_f32(&case.q, &[b, s_q, h_q, d_qk])?,
            main: host_cache(&case.kv, b, s_q, false)?,
            extra: None,
            sink: full.sink.clone(),
            case,
        };
        let got = run_gpu(gpu, &h, &big, None)?;
        match &alone {
            None => {
                alone = Some((
                    got.0[..s_q * h_q * 512].to_vec(),
                    got.1[..h_q * s_q].to_vec(),
                ))
            }
            Some((o0, l0)) => checks.push(outputs::bitwise(format!("batch {b}"), &got, (o0, l0))),
        }
    }
    Ok(Outcome::from_checks(checks))
}

fn cache(format: KvFormat, num_blocks: usize, page_size: usize, topk: usize) -> SparseCacheSpec {
    SparseCacheSpec {
        format,
        num_blocks,
        page_size,
        block_pad: 48,
        topk,
        p_invalid: 0.15,
        topk_length: None,
    }
}

/// Lengths of a batch: 0, negative, beyond topk, around tile boundaries.
fn lengths(batch: usize, topk: usize, salt: usize) -> Vec<i32> {
    let t = topk as i32;
    let l = [t, 0, -5, 1, t + 100, 63, 64, 65, t / 2, t - 1, 17, i32::MAX];
    (0..batch).map(|i| l[(i * 5 + salt) % l.len()]).collect()
}

/// The sparse decode cases.
pub fn cases() -> Vec<Case> {
    let mut v: Vec<(String, bool, SparseCheck)> = Vec::new();
    let forced = DecodeOptions {
        num_parts: Some(7),
        ..DecodeOptions::default()
    };
    let invariant = DecodeOptions {
        batch_invariant: true,
        chunk_tiles: Some(7),
        ..DecodeOptions::default()
    };
    let base = |shape, main: SparseCacheSpec| SparseCheck {
        shape,
        main,
        extra: None,
        sink: false,
        sink_value: None,
        options: DecodeOptions::default(),
        strided: false,
        out_pad: 0,
    };
    for (fname, format) in [("v32", KvFormat::V32), ("model1", KvFormat::Model1)] {
        // Head counts (no padding by the caller), query lengths, topk not a multiple of 64.
        for h_q in [128usize, 64, 32, 16, 1, 37] {
            for (s_q, topk) in [(1usize, 256usize), (2, 100), (5, 64)] {
                for (oname, options) in [("default", DecodeOptions::default()), ("split7", forced)]
                {
                    let mut c = base((4, s_q, h_q), cache(format, 24, 64, topk));
                    c.options = options;
                    let quick = s_q <= 2 && (h_q == 128 || h_q == 16);
                    v.push((
                        format!("decode_sparse/{fname}/h{h_q}/s_q{s_q}/topk{topk}/{oname}"),
                        quick,
                        c,
                    ));
                }
            }
        }
        // topk 1, topk 2048 (the V3.2 shape), s_q 16.
        v.push((
            format!("decode_sparse/{fname}/topk1"),
            false,
            base((5, 2, 64), cache(format, 8, 64, 1)),
        ));
        v.push((
            format!("decode_sparse/{fname}/topk2048"),
            true,
            base((2, 2, 128), cache(format, 48, 64, 2048)),
        ));
        v.push((
            format!("decode_sparse/{fname}/s_q16"),
            false,
            base((2, 16, 64), cache(format, 16, 64, 192)),
        ));
        // Schedule requests (b * s_q) at the split kernel's own limit (128: it derives the schedule) and past it (the
        // schedule kernel runs first), with lengths that differ (split and whole requests).
        for (b, name) in [(64usize, "requests128"), (70, "requests140")] {
            let mut c = base((b, 2, 16), cache(format, 24, 64, 96));
            c.main.topk_length = Some(lengths(b, 96, 3));
            v.push((format!("decode_sparse/{fname}/{name}"), true, c));
        }
        // The same past the limit for 64-row tiles (one, or the pair).
        for (b, h_q) in [(70usize, 64usize), (257, 64), (256, 128)] {
            let mut c = base((b, 2, h_q), cache(format, 24, 64, 96));
            c.main.topk_length = Some(lengths(b, 96, 5));
            v.push((
                format!("decode_sparse/{fname}/h{h_q}/requests{}", 2 * b),
                true,
                c,
            ));
        }
        // topk_length (0, negative, beyond topk) with and without forced splits.
        for (oname, options) in [("default", DecodeOptions::default()), ("split7", forced)] {
            let mut c = base((12, 2, 64), cache(format, 24, 64, 300));
            c.main.topk_length = Some(lengths(12, 300, 1));
            c.options = options;
            v.push((
                format!("decode_sparse/{fname}/topk_length/{oname}"),
                oname == "default",
                c,
            ));
        }
        // Every index invalid; half invalid.
        for (name, p) in [("all_invalid", 1.0f64), ("half_invalid", 0.5)] {
            let mut c = base((3, 2, 64), cache(format, 8, 64, 128));
            c.main.p_invalid = p;
            v.push((format!("decode_sparse/{fname}/{name}"), true, c));
        }
        // Page sizes: 1 (MODEL1: 584-byte blocks, copied in 8-byte pieces), 16 and 256 (MODEL1's main cache) tokens
        // per block; a block stride padded by 8 bytes (8-byte pieces too).
        for page in [1usize, 16, 256] {
            let c = base((3, 2, 64), cache(format, 2048 / page, page, 192));
            v.push((
                format!("decode_sparse/{fname}/page{page}"),
                page == 256 || page == 1,
                c,
            ));
        }
        let mut pad8 = base((3, 2, 64), cache(format, 16, 64, 192));
        pad8.main.block_pad = 8;
        v.push((format!("decode_sparse/{fname}/block_pad8"), true, pad8));
        // Extra cache with its own page size and lengths, attended in the same softmax.
        for (ename, extra_page, with_len) in
            [("extra_p64", 64usize, false), ("extra_p2_len", 2, true)]
        {
            for (oname, options) in [("default", DecodeOptions::default()), ("split7", forced)] {
                let mut c = base((6, 2, 64), cache(format, 16, 256, 128));
                let mut e = cache(format, 1024 / extra_page, extra_page, 256);
                if with_len {
                    e.topk_length = Some(lengths(6, 256, 4));
                    c.main.topk_length = Some(lengths(6, 128, 7));
                }
                c.extra = Some(e);
                c.options = options;
                v.push((
                    format!("decode_sparse/{fname}/{ename}/{oname}"),
                    oname == "default",
                    c,
                ));
            }
        }
        // Sinks.
        for (name, sv) in [
            ("sink", None),
            ("sink+inf", Some(f32::INFINITY)),
            ("sink-inf", Some(f32::NEG_INFINITY)),
        ] {
            let mut c = base((4, 2, 128), cache(format, 16, 64, 200));
            c.sink = true;
            c.sink_value = sv;
            c.options = forced;
            v.push((format!("decode_sparse/{fname}/{name}"), name == "sink", c));
        }
        // Strided q, indices and outputs.
        let mut s = base((4, 2, 64), cache(format, 16, 64, 160));
        s.strided = true;
        s.out_pad = 1;
        s.sink = true;
        v.push((format!("decode_sparse/{fname}/strided"), true, s));
        // out rows 4-byte but not 16-byte aligned (final rows as 4-byte stores): one row tile, two (the pair
        // kernels), and a narrow request.
        for h_q in [64usize, 128, 24] {
            let mut w = base((4, 2, h_q), cache(format, 16, 64, 160));
            w.out_pad = 2;
            w.sink = true;
            v.push((format!("decode_sparse/{fname}/out_words/h{h_q}"), false, w));
        }
        // The narrow kernels (at most 16 / 32 query rows per request): every index invalid, half invalid, an
        // extra cache with lengths and forced splits, sinks of +-inf, strided tensors, topk 2048.
        for h_q in [16usize, 24] {
            let mut c = base((3, 2, h_q), cache(format, 8, 64, 128));
            c.main.p_invalid = 1.0;
            v.push((
                format!("decode_sparse/{fname}/narrow{h_q}/all_invalid"),
                true,
                c,
            ));
            let mut c = base((3, 2, h_q), cache(format, 8, 64, 128));
            c.main.p_invalid = 0.5;
            v.push((
                format!("decode_sparse/{fname}/narrow{h_q}/half_invalid"),
                false,
                c,
            ));
            let mut c = base((6, 2, h_q), cache(format, 16, 256, 128));
            let mut e = cache(format, 512, 2, 256);
            e.topk_length = Some(lengths(6, 256, 4));
            c.main.topk_length = Some(lengths(6, 128, 7));
            c.extra = Some(e);
            c.options = forced;
            v.push((
                format!("decode_sparse/{fname}/narrow{h_q}/extra_p2_len/split7"),
                true,
                c,
            ));
            for (name, sv) in [
                ("sink+inf", Some(f32::INFINITY)),
                ("sink-inf", Some(f32::NEG_INFINITY)),
            ] {
                let mut c = base((4, 2, h_q), cache(format, 16, 64, 200));
                c.sink = true;
                c.sink_value = sv;
                c.options = forced;
                v.push((
                    format!("decode_sparse/{fname}/narrow{h_q}/{name}"),
                    false,
                    c,
                ));
            }
            let mut c = base((4, 2, h_q), cache(format, 16, 64, 160));
            c.strided = true;
            c.out_pad = 1;
            c.sink = true;
            v.push((
                format!("decode_sparse/{fname}/narrow{h_q}/strided"),
                true,
                c,
            ));
            v.push((
                format!("decode_sparse/{fname}/narrow{h_q}/topk2048"),
                false,
                base((2, 2, h_q), cache(format, 48, 64, 2048)),
            ));
        }
        // Batch-invariant schedule.
        let mut inv = base((5, 2, 128), cache(format, 24, 64, 700));
        inv.options = invariant;
        inv.main.topk_length = Some(lengths(5, 700, 2));
        v.push((format!("decode_sparse/{fname}/invariant"), false, inv));
    }
    let mut cases: Vec<Case> = v
        .into_iter()
        .map(|(name, quick, c)| Case {
            name,
            quick,
            run: Box::new(move |gpu, _tuning, seed| run_case(gpu, &c, seed)),
        })
        .collect();
    let mut reuse = base((6, 2, 64), cache(KvFormat::V32, 24, 64, 512));
    reuse.main.topk_length = Some(lengths(6, 512, 3));
    reuse.options = forced;
    cases.push(Case {
        name: "decode_sparse/v32/workspace_reuse".into(),
        quick: true,
        run: Box::new(move |gpu, _tuning, seed| run_reuse(gpu, &reuse, seed)),
    });
    let mut inv = base((1, 2, 128), cache(KvFormat::V32, 64, 64, 2048));
    inv.options = DecodeOptions {
        batch_invariant: true,
        ..DecodeOptions::default()
    };
    cases.push(Case {
        name: "decode_sparse/v32/batch_invariance".into(),
        quick: true,
        run: Box::new(move |gpu, _tuning, seed| run_invariance(gpu, &inv, seed)),
    });
    // Chunks of 6 line units: request 0 attends to 1500 keys (24 tiles and 4 units of overhead), split over five
    // parts, so the combine runs at every batch size, over more parts than a row has warps. (Chunks of 8 gave four
    // parts, which four warps add in the one warp's order: that case passed with the batch-dependent rule too.)
    // The same through the narrow kernels (16 query rows per request), in the full suite.
    for (h_q, name, quick) in [(128usize, "split", true), (16, "split_narrow", false)] {
        let mut inv_split = base((1, 2, h_q), cache(KvFormat::V32, 64, 64, 2048));
        inv_split.options = DecodeOptions {
            batch_invariant: true,
            chunk_tiles: Some(6),
            ..DecodeOptions::default()
        };
        cases.push(Case {
            name: format!("decode_sparse/v32/batch_invariance_{name}"),
            quick,
            run: Box::new(move |gpu, _tuning, seed| run_invariance(gpu, &inv_split, seed)),
        });
    }
    cases
}
