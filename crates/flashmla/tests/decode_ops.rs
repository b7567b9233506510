//! The CPU decode ops: bf16 and f16 dense, sparse FP8 with padded block strides and non-contiguous inputs,
//! against the naive f64 formulation with docs/spec.md section 6 tolerances; and argument validation.

mod decode_support;

use decode_support::*;
use flashmla::fp8::KvFormat;
use flashmla::ops::decode::{
    decode_dense_cpu, decode_sparse_cpu, DecodeOutput, DenseDecodeArgs, ExtraKvArgs,
    SparseDecodeArgs,
};
use flashmla::{DType, Error, HostData, HostTensor, Layout, TensorMeta};
use half::f16;

/// spec section 6 non-contiguity: pad the last dimension by 128 and every other dimension by 1, then slice.
fn padded(t: &HostTensor) -> HostTensor {
    let rank = t.shape().len();
    let pad: Vec<usize> = (0..rank)
        .map(|d| if d + 1 == rank { 128 } else { 1 })
        .collect();
    t.to_padded(&pad).unwrap()
}

fn f16_tensor(v: &[f32], shape: &[usize]) -> HostTensor {
    HostTensor::new(
        HostData::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
        shape,
    )
    .unwrap()
}

/// Host tensors of a dense case in `dtype` (values already representable).
struct DenseTensors {
    q: HostTensor,
    k_cache: HostTensor,
    block_table: HostTensor,
    cache_seqlens: HostTensor,
    sink: Option<HostTensor>,
}

fn dense_tensors(c: &DenseCase, dtype: DType) -> DenseTensors {
    let p = &c.p;
    let make = |v: &[f32], shape: &[usize]| match dtype {
        DType::F16 => f16_tensor(v, shape),
        _ => HostTensor::bf16_from_f32(v, shape).unwrap(),
    };
    DenseTensors {
        q: make(&c.q, &[p.batch, p.s_q, p.h_q, p.d_qk]),
        k_cache: make(&c.k_cache, &[p.num_blocks, p.page_size, p.h_kv, p.d_qk]),
        block_table: HostTensor::from_i32(c.block_table.clone(), &[p.batch, p.max_blocks]).unwrap(),
        cache_seqlens: HostTensor::from_i32(c.cache_seqlens.clone(), &[p.batch]).unwrap(),
        sink: c
            .sink
            .as_ref()
            .map(|s| HostTensor::from_f32(s.clone(), &[p.h_q]).unwrap()),
    }
}

impl DenseTensors {
    fn args(&self, c: &DenseCase) -> DenseDecodeArgs<'_, HostTensor> {
        DenseDecodeArgs {
            q: &self.q,
            k_cache: &self.k_cache,
            block_table: &self.block_table,
            cache_seqlens: &self.cache_seqlens,
            softmax_scale: Some(c.p.softmax_scale),
            causal: c.p.causal,
            attn_sink: self.sink.as_ref(),
        }
    }
}

fn check_output(
    o: &DecodeOutput<HostTensor>,
    want: &(Vec<f64>, Vec<f64>),
    dtype: DType,
    seed: u64,
) {
    assert_eq!(o.out.dtype(), dtype);
    assert_eq!(o.lse.dtype(), DType::F32);
    assert_close(
        "out",
        &widen(&o.out.to_f32_vec().unwrap()),
        &want.0,
        DECODE_OUT,
        seed,
    );
    assert_close(
        "lse",
        &widen(&o.lse.to_f32_vec().unwrap()),
        &want.1,
        DECODE_LSE,
        seed,
    );
}

fn mla_dense_spec(causal: bool) -> DenseSpec {
    DenseSpec {
        batch: 3,
        s_q: 2,
        h_q: 16,
        h_kv: 1,
        d_qk: 576,
        d_v: 512,
        page_size: 16,
        seqlens: vec![37, 0, 70],
        causal,
        sink: true,
    }
}

#[test]
fn dense_op_bf16_with_every_input_non_contiguous() {
    let seed = 200;
    let case = dense_case(&mut rng(seed), &mla_dense_spec(true));
    let want = naive_dense(&case.p, &case.inputs());
    let t = dense_tensors(&case, DType::Bf16);
    let contiguous = decode_dense_cpu(&t.args(&case)).unwrap();
    check_output(&contiguous, &want, DType::Bf16, seed);
    assert_eq!(contiguous.out.shape(), &[3, 2, 16, 512]);
    assert_eq!(contiguous.lse.shape(), &[3, 16, 2]);
    let strided = DenseTensors {
        q: padded(&t.q),
        k_cache: padded(&t.k_cache),
        block_table: padded(&t.block_table),
        cache_seqlens: padded(&t.cache_seqlens),
        sink: t.sink.as_ref().map(padded),
    };
    assert!(!strided.q.layout().is_contiguous());
    assert_eq!(decode_dense_cpu(&strided.args(&case)).unwrap(), contiguous);
}

#[test]
fn dense_op_f16_path_and_head_groups() {
    let seed = 201;
    let mut sp = mla_dense_spec(false);
    sp.h_kv = 4;
    sp.sink = false;
    let mut case = dense_case(&mut rng(seed), &sp);
    // The generator rounds to bf16; round to f16 as well so the naive formulation sees what the f16 op sees
    // (tiny bf16 values fall below f16's normal range).
    for v in case.q.iter_mut().chain(case.k_cache.iter_mut()) {
        *v = f16::from_f32(*v).to_f32();
    }
    let want = naive_dense(&case.p, &case.inputs());
    let out = decode_dense_cpu(&dense_tensors(&case, DType::F16).args(&case)).unwrap();
    check_output(&out, &want, DType::F16, seed);
}

#[test]
fn dense_op_default_softmax_scale_is_inverse_sqrt_d_qk() {
    let seed = 202;
    let case = dense_case(&mut rng(seed), &mla_dense_spec(true));
    let t = dense_tensors(&case, DType::Bf16);
    let given = decode_dense_cpu(&DenseDecodeArgs {
        softmax_scale: Some(1.0 / 24.0),
        ..t.args(&case)
    })
    .unwrap();
    let default = decode_dense_cpu(&DenseDecodeArgs {
        softmax_scale: None,
        ..t.args(&case)
    })
    .unwrap();
    assert_eq!(given, default);
}

/// Host tensors of one FP8 cache case: the cache keeps its padded block stride.
fn cache_tensors(
    k: &SparseCacheCase,
    batch: usize,
    s_q: usize,
) -> (HostTensor, HostTensor, Option<HostTensor>) {
    let l = k.layout;
    let bpt = l.format.bytes_per_token();
    let layout = Layout::strided(
        &[l.num_blocks, l.page_size, 1, bpt],
        &[l.block_stride, bpt, bpt, 1],
    )
    .unwrap();
    let cache = HostTensor::with_layout(HostData::U8(k.bytes.clone()), layout).unwrap();
    let indices = HostTensor::from_i32(k.indices.clone(), &[batch, s_q, k.topk]).unwrap();
    let lengths = k
        .topk_length
        .as_ref()
        .map(|t| HostTensor::from_i32(t.clone(), &[batch]).unwrap());
    (cache, indices, lengths)
}

#[test]
fn sparse_op_both_formats_padded_block_stride_extra_cache_non_contiguous_q() {
    for (seed, format) in [(210u64, KvFormat::V32), (211, KvFormat::Model1)] {
        let mut rng = rng(seed);
        let main = SparseCacheSpec {
            format,
            num_blocks: 3,
            page_size: 16,
            block_pad: 40,
            topk: 24,
            p_invalid: 0.3,
            topk_length: Some(vec![24, 3]),
        };
        let extra = SparseCacheSpec {
            num_blocks: 2,
            page_size: 8,
            block_pad: 0,
            topk: 10,
            topk_length: None,
            ..main.clone()
        };
        let case = sparse_case(&mut rng, (2, 2, 8), &main, Some(&extra), true);
        let want = naive_sparse(&case);
        let d_qk = format.d_qk();
        let q = padded(&HostTensor::bf16_from_f32(&case.q, &[2, 2, 8, d_qk]).unwrap());
        let (cache, indices, lengths) = cache_tensors(&case.kv, 2, 2);
        let (e_cache, e_indices, e_lengths) = cache_tensors(case.extra.as_ref().unwrap(), 2, 2);
        let indices = padded(&indices);
        let sink = HostTensor::from_f32(case.sink.clone().unwrap(), &[8]).unwrap();
        let args = SparseDecodeArgs {
            q: &q,
            k_cache: &cache,
            indices: &indices,
            topk_length: lengths.as_ref(),
            softmax_scale: Some(case.p.softmax_scale),
            attn_sink: Some(&sink),
            extra: Some(ExtraKvArgs {
                k_cache: &e_cache,
                indices: &e_indices,
                topk_length: e_lengths.as_ref(),
            }),
        };
        let out = decode_sparse_cpu(&args).unwrap();
        assert_eq!(out.out.shape(), &[2, 2, 8, 512]);
        check_output(&out, &want, DType::Bf16, seed);
    }
}

fn expect_arg<T: std::fmt::Debug>(r: Result<T, Error>, arg: &str, case: &str) {
    match r {
        Err(Error::InvalidArgument { arg: got, .. }) => assert_eq!(got, arg, "{case}"),
        other => panic!("{case}: expected InvalidArgument({arg}), got {other:?}"),
    }
}

#[test]
fn dense_op_rejects_bad_inputs_naming_the_argument() {
    let mut sp = mla_dense_spec(false);
    sp.h_kv = 2;
    sp.h_q = 4;
    let case = dense_case(&mut rng(220), &sp);
    let t = dense_tensors(&case, DType::Bf16);
    let ok = t.args(&case);
    assert!(decode_dense_cpu(&ok).is_ok());
    let p = &case.p;
    let f32_q = HostTensor::from_f32(case.q.clone(), &[3, 2, 4, 576]).unwrap();
    let q3 = HostTensor::bf16_from_f32(&case.q, &[6, 4, 576]).unwrap();
    let q_narrow = HostTensor::bf16_from_f32(&vec![0.0; 3 * 2 * 4 * 128], &[3, 2, 4, 128]).unwrap();
    let q_odd_heads =
        HostTensor::bf16_from_f32(&vec![0.0; 3 * 2 * 3 * 576], &[3, 2, 3, 576]).unwrap();
    let k_512 = HostTensor::bf16_from_f32(
        &vec![0.0; p.num_blocks * p.page_size * 2 * 512],
        &[p.num_blocks, p.page_size, 2, 512],
    )
    .unwrap();
    let k_f16 = f16_tensor(&case.k_cache, &[p.num_blocks, p.page_size, p.h_kv, 576]);
    let q_strided_last = {
        let shape = [3, 2, 4, 576];
        let strides = [2 * 4 * 576 * 2, 4 * 576 * 2, 576 * 2, 2];
        let data = HostData::Bf16(vec![half::bf16::ZERO; 3 * 2 * 4 * 576 * 2]);
        HostTensor::with_layout(data, Layout::strided(&shape, &strides).unwrap()).unwrap()
    };
    let table_rows = HostTensor::from_i32(vec![0; 2 * p.max_blocks], &[2, p.max_blocks]).unwrap();
    let table_f32 = HostTensor::from_f32(vec![0.0; 3 * p.max_blocks], &[3, p.max_blocks]).unwrap();
    let seq = |v: Vec<i32>| HostTensor::from_i32(v, &[3]).unwrap();
    let too_long = seq(vec![37, (p.max_blocks * p.page_size) as i32 + 1, 70]);
    let negative = seq(vec![-1, 0, 70]);
    let mut table = case.block_table.clone();
    table[2 * p.max_blocks + 2] = p.num_blocks as i32; // block 2 of request 2 (keys 32..48 of 70)
    let bad_block = HostTensor::from_i32(table, &[3, p.max_blocks]).unwrap();
    let mut table = case.block_table.clone();
    table[1] = -3;
    let neg_block = HostTensor::from_i32(table, &[3, p.max_blocks]).unwrap();
    let sink_long = HostTensor::from_f32(vec![0.0; 5], &[5]).unwrap();

    let cases: Vec<(&str, DenseDecodeArgs<'_, HostTensor>, &str)> = vec![
        ("q f32", DenseDecodeArgs { q: &f32_q, ..ok }, "q.dtype"),
        ("q rank 3", DenseDecodeArgs { q: &q3, ..ok }, "q.shape"),
        (
            "d_qk 128",
            DenseDecodeArgs { q: &q_narrow, ..ok },
            "q.shape[3]",
        ),
        (
            "h_q % h_kv",
            DenseDecodeArgs {
                q: &q_odd_heads,
                ..ok
            },
            "q.shape[2]",
        ),
        (
            "q last stride 2",
            DenseDecodeArgs {
                q: &q_strided_last,
                ..ok
            },
            "q.strides",
        ),
        (
            "k_cache dtype",
            DenseDecodeArgs {
                k_cache: &k_f16,
                ..ok
            },
            "k_cache.dtype",
        ),
        (
            "k_cache d_qk",
            DenseDecodeArgs {
                k_cache: &k_512,
                ..ok
            },
            "k_cache.shape[3]",
        ),
        (
            "block_table rows",
            DenseDecodeArgs {
                block_table: &table_rows,
                ..ok
            },
            "block_table.shape",
        ),
        (
            "block_table f32",
            DenseDecodeArgs {
                block_table: &table_f32,
                ..ok
            },
            "block_table.dtype",
        ),
        (
            "cache_seqlens too long",
            DenseDecodeArgs {
                cache_seqlens: &too_long,
                ..ok
            },
            "cache_seqlens[1]",
        ),
        (
            "cache_seqlens negative",
            DenseDecodeArgs {
                cache_seqlens: &negative,
                ..ok
            },
            "cache_seqlens[0]",
        ),
        (
            "block id past the cache",
            DenseDecodeArgs {
                block_table: &bad_block,
                ..ok
            },
            "block_table[2][2]",
        ),
        (
            "negative block id",
            DenseDecodeArgs {
                block_table: &neg_block,
                ..ok
            },
            "block_table[0][1]",
        ),
        (
            "sink shape",
            DenseDecodeArgs {
                attn_sink: Some(&sink_long),
                ..ok
            },
            "attn_sink.shape",
        ),
        (
            "sink dtype",
            DenseDecodeArgs {
                attn_sink: Some(&t.cache_seqlens),
                ..ok
            },
            "attn_sink.dtype",
        ),
        (
            "scale NaN",
            DenseDecodeArgs {
                softmax_scale: Some(f32::NAN),
                ..ok
            },
            "softmax_scale",
        ),
        (
            "scale 0",
            DenseDecodeArgs {
                softmax_scale: Some(0.0),
                ..ok
            },
            "softmax_scale",
        ),
    ];
    for (name, args, arg) in cases {
        expect_arg(decode_dense_cpu(&args), arg, name);
    }
}

#[test]
fn sparse_op_rejects_bad_inputs_naming_the_argument() {
    let main = SparseCacheSpec {
        format: KvFormat::V32,
        num_blocks: 2,
        page_size: 8,
        block_pad: 0,
        topk: 8,
        p_invalid: 0.2,
        topk_length: Some(vec![8]),
    };
    let case = sparse_case(&mut rng(230), (1, 1, 4), &main, None, false);
    let q = HostTensor::bf16_from_f32(&case.q, &[1, 1, 4, 576]).unwrap();
    let (cache, indices, lengths) = cache_tensors(&case.kv, 1, 1);
    let ok = SparseDecodeArgs {
        q: &q,
        k_cache: &cache,
        indices: &indices,
        topk_length: lengths.as_ref(),
        softmax_scale: None,
        attn_sink: None,
        extra: None,
    };
    assert!(decode_sparse_cpu(&ok).is_ok());
    let q_f16 = f16_tensor(&case.q, &[1, 1, 4, 576]);
    let q_640 = HostTensor::bf16_from_f32(&vec![0.0; 4 * 640], &[1, 1, 4, 640]).unwrap();
    let q_model1 = HostTensor::bf16_from_f32(&vec![0.0; 4 * 512], &[1, 1, 4, 512]).unwrap();
    let bytes = case.kv.bytes.clone();
    let cache_with = |shape: &[usize], strides: &[usize]| {
        HostTensor::with_layout(
            HostData::U8(bytes.clone()),
            Layout::strided(shape, strides).unwrap(),
        )
        .unwrap()
    };
    let two_heads = cache_with(&[2, 4, 2, 656], &[8 * 656, 2 * 656, 656, 1]);
    let token_gap = cache_with(&[2, 7, 1, 656], &[8 * 656, 657, 656, 1]);
    let overlapping = cache_with(&[2, 8, 1, 656], &[4 * 656, 656, 656, 1]);
    let cache_padded_everywhere = padded(&cache);
    let idx_f32 = HostTensor::from_f32(vec![0.0; 8], &[1, 1, 8]).unwrap();
    let idx_empty = HostTensor::from_i32(vec![], &[1, 1, 0]).unwrap();
    let idx_batch = HostTensor::from_i32(vec![0; 16], &[2, 1, 8]).unwrap();
    let len_shape = HostTensor::from_i32(vec![0; 2], &[2]).unwrap();
    let extra_bad = ExtraKvArgs {
        k_cache: &cache,
        indices: &idx_batch,
        topk_length: None,
    };
    let extra_wrong_format = ExtraKvArgs {
        k_cache: &two_heads,
        indices: &indices,
        topk_length: None,
    };

    let cases: Vec<(&str, SparseDecodeArgs<'_, HostTensor>, &str)> = vec![
        ("q f16", SparseDecodeArgs { q: &q_f16, ..ok }, "q.dtype"),
        (
            "d_qk 640",
            SparseDecodeArgs { q: &q_640, ..ok },
            "q.shape[3]",
        ),
        (
            "V3.2 cache with MODEL1 q",
            SparseDecodeArgs { q: &q_model1, ..ok },
            "k_cache.shape[3]",
        ),
        (
            "h_kv 2",
            SparseDecodeArgs {
                k_cache: &two_heads,
                ..ok
            },
            "k_cache.shape[2]",
        ),
        (
            "tokens not packed",
            SparseDecodeArgs {
                k_cache: &token_gap,
                ..ok
            },
            "k_cache.strides[1]",
        ),
        (
            "blocks overlap",
            SparseDecodeArgs {
                k_cache: &overlapping,
                ..ok
            },
            "k_cache.strides[0]",
        ),
        (
            "cache padded in every dim",
            SparseDecodeArgs {
                k_cache: &cache_padded_everywhere,
                ..ok
            },
            "k_cache.strides[1]",
        ),
        (
            "cache dtype",
            SparseDecodeArgs { k_cache: &q, ..ok },
            "k_cache.dtype",
        ),
        (
            "indices f32",
            SparseDecodeArgs {
                indices: &idx_f32,
                ..ok
            },
            "indices.dtype",
        ),
        (
            "topk 0",
            SparseDecodeArgs {
                indices: &idx_empty,
                ..ok
            },
            "indices.shape[2]",
        ),
        (
            "indices batch",
            SparseDecodeArgs {
                indices: &idx_batch,
                ..ok
            },
            "indices.shape",
        ),
        (
            "topk_length shape",
            SparseDecodeArgs {
                topk_length: Some(&len_shape),
                ..ok
            },
            "topk_length.shape",
        ),
        (
            "extra indices batch",
            SparseDecodeArgs {
                extra: Some(extra_bad),
                ..ok
            },
            "extra_indices.shape",
        ),
        (
            "extra cache shape",
            SparseDecodeArgs {
                extra: Some(extra_wrong_format),
                ..ok
            },
            "extra_k_cache.shape[2]",
        ),
        (
            "scale inf",
            SparseDecodeArgs {
                softmax_scale: Some(f32::INFINITY),
                ..ok
            },
            "softmax_scale",
        ),
    ];
    for (name, args, arg) in cases {
        expect_arg(decode_sparse_cpu(&args), arg, name);
    }
}
