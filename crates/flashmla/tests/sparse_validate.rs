//! Argument validation of the sparse prefill ops: every bad input is an `InvalidArgument` naming the
//! right argument, before any data is touched.

mod common;

use flashmla::ops::sparse_bwd::{self, SparseBwdArgs, SparseBwdOutput};
use flashmla::ops::sparse_fwd::{self, SparseFwdArgs, SparseFwdDims, SparseFwdOutput};
use flashmla::{DType, Error, HostData, HostTensor, Layout, Location, TensorMeta};

/// Tensor metadata without data, so validation can be fed any dtype, layout and location.
#[derive(Debug, Clone)]
struct Meta {
    dtype: DType,
    layout: Layout,
    location: Location,
}

impl TensorMeta for Meta {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn location(&self) -> Location {
        self.location
    }
}

fn meta(dtype: DType, shape: &[usize]) -> Meta {
    Meta {
        dtype,
        layout: Layout::contiguous(shape),
        location: Location::Cuda(0),
    }
}

/// `t` with every stride doubled, so the last dimension has stride 2.
fn last_dim_strided(t: &Meta) -> Meta {
    let strides: Vec<usize> = t.layout.strides().iter().map(|&s| 2 * s).collect();
    Meta {
        layout: Layout::strided(t.layout.shape(), &strides).unwrap(),
        ..t.clone()
    }
}

/// `t` with its last dimension padded by 7 in storage: non-contiguous, last-dimension stride 1.
fn rows_padded(t: &Meta) -> Meta {
    let mut storage = t.layout.shape().to_vec();
    *storage.last_mut().unwrap() += 7;
    Meta {
        layout: Layout::strided(t.layout.shape(), Layout::contiguous(&storage).strides()).unwrap(),
        ..t.clone()
    }
}

const S_Q: usize = 3;
const S_KV: usize = 10;
const H_Q: usize = 4;
const D_QK: usize = 576;
const D_V: usize = sparse_fwd::D_V;
const TOPK: usize = 6;

/// A valid set of inputs for both ops.
struct Good {
    q: Meta,
    kv: Meta,
    indices: Meta,
    sink: Meta,
    len: Meta,
    out: Meta,
    d_out: Meta,
    lse: Meta,
}

fn good() -> Good {
    Good {
        q: meta(DType::Bf16, &[S_Q, H_Q, D_QK]),
        kv: meta(DType::Bf16, &[S_KV, 1, D_QK]),
        indices: meta(DType::I32, &[S_Q, 1, TOPK]),
        sink: meta(DType::F32, &[H_Q]),
        len: meta(DType::I32, &[S_Q]),
        out: meta(DType::Bf16, &[S_Q, H_Q, D_V]),
        d_out: meta(DType::Bf16, &[S_Q, H_Q, D_V]),
        lse: meta(DType::F32, &[S_Q, H_Q]),
    }
}

impl Good {
    fn fwd(&self) -> SparseFwdArgs<'_, Meta> {
        SparseFwdArgs {
            q: &self.q,
            kv: &self.kv,
            indices: &self.indices,
            sm_scale: 0.04,
            attn_sink: Some(&self.sink),
            topk_length: Some(&self.len),
        }
    }

    fn bwd(&self) -> SparseBwdArgs<'_, Meta> {
        SparseBwdArgs {
            q: &self.q,
            kv: &self.kv,
            out: &self.out,
            d_out: &self.d_out,
            indices: &self.indices,
            lse: &self.lse,
            sm_scale: 0.04,
            attn_sink: Some(&self.sink),
            topk_length: Some(&self.len),
            d_kv_dtype: DType::Bf16,
        }
    }
}

#[track_caller]
fn assert_invalid<T: std::fmt::Debug>(case: &str, r: Result<T, Error>, arg: &str) {
    match r {
        Err(e @ Error::InvalidArgument { .. }) => {
            assert_eq!(e.arg(), Some(arg), "{case}: wrong argument named in `{e}`")
        }
        other => panic!("{case}: expected InvalidArgument for `{arg}`, got {other:?}"),
    }
}

#[test]
fn valid_arguments_give_their_dimensions() {
    let g = good();
    let dims = sparse_fwd::validate(&g.fwd()).unwrap();
    let want = SparseFwdDims {
        s_q: S_Q,
        s_kv: S_KV,
        h_q: H_Q,
        d_qk: D_QK,
        d_v: D_V,
        topk: TOPK,
        has_attn_sink: true,
        has_topk_length: true,
    };
    assert_eq!(dims, want);
    let bdims = sparse_bwd::validate(&g.bwd()).unwrap();
    assert_eq!((bdims.fwd, bdims.d_kv_dtype), (want, DType::Bf16));
    // Padded (non-last) dimensions, d_qk 512, h_q 128, topk 3000 and no optional inputs are fine.
    let q512 = rows_padded(&meta(DType::Bf16, &[2, 128, 512]));
    let kv512 = rows_padded(&meta(DType::Bf16, &[5, 1, 512]));
    let idx = rows_padded(&meta(DType::I32, &[2, 1, 3000]));
    let args = SparseFwdArgs {
        q: &q512,
        kv: &kv512,
        indices: &idx,
        sm_scale: 1.0,
        attn_sink: None,
        topk_length: None,
    };
    let dims = sparse_fwd::validate(&args).unwrap();
    assert_eq!(
        (dims.d_qk, dims.h_q, dims.topk, dims.has_attn_sink),
        (512, 128, 3000, false)
    );
    // s_q = 0 and s_kv = 0 are valid (empty outputs; every index invalid).
    let (q0, kv0, idx0) = (
        meta(DType::Bf16, &[0, 4, 576]),
        meta(DType::Bf16, &[0, 1, 576]),
        meta(DType::I32, &[0, 1, 8]),
    );
    let dims = sparse_fwd::validate(&SparseFwdArgs {
        q: &q0,
        kv: &kv0,
        indices: &idx0,
        ..args
    })
    .unwrap();
    assert_eq!((dims.s_q, dims.s_kv), (0, 0));
}

#[test]
fn forward_rejects_bad_inputs_naming_the_argument() {
    let g = good();
    let m = |dtype, shape: &[usize]| meta(dtype, shape);
    let f32_q = m(DType::F32, &[S_Q, H_Q, D_QK]);
    let q_rank2 = m(DType::Bf16, &[S_Q, H_Q * D_QK]);
    let q_d300 = m(DType::Bf16, &[S_Q, H_Q, 300]);
    let q_h0 = m(DType::Bf16, &[S_Q, 0, D_QK]);
    let q_last_strided = last_dim_strided(&g.q);
    let kv_f16 = m(DType::F16, &[S_KV, 1, D_QK]);
    let kv_rank2 = m(DType::Bf16, &[S_KV, D_QK]);
    let kv_two_heads = m(DType::Bf16, &[S_KV, 2, D_QK]);
    let kv_512 = m(DType::Bf16, &[S_KV, 1, 512]);
    let kv_last_strided = last_dim_strided(&g.kv);
    let kv_on_cpu = Meta {
        location: Location::Host,
        ..g.kv.clone()
    };
    let idx_f32 = m(DType::F32, &[S_Q, 1, TOPK]);
    let idx_s_q = m(DType::I32, &[S_Q + 1, 1, TOPK]);
    let idx_heads = m(DType::I32, &[S_Q, 2, TOPK]);
    let idx_topk0 = m(DType::I32, &[S_Q, 1, 0]);
    let idx_rank2 = m(DType::I32, &[S_Q, TOPK]);
    let idx_last_strided = last_dim_strided(&g.indices);
    let sink_len = m(DType::F32, &[H_Q + 1]);
    let sink_bf16 = m(DType::Bf16, &[H_Q]);
    let sink_rank2 = m(DType::F32, &[1, H_Q]);
    let sink_strided = last_dim_strided(&g.sink);
    let len_shape = m(DType::I32, &[S_Q + 2]);
    let len_f32 = m(DType::F32, &[S_Q]);
    let len_on_other_gpu = Meta {
        location: Location::Cuda(1),
        ..g.len.clone()
    };
    let a = g.fwd();
    let cases: Vec<(&str, SparseFwdArgs<'_, Meta>, &str)> = vec![
        ("q f32", SparseFwdArgs { q: &f32_q, ..a }, "q.dtype"),
        ("q rank 2", SparseFwdArgs { q: &q_rank2, ..a }, "q.shape"),
        ("d_qk 300", SparseFwdArgs { q: &q_d300, ..a }, "q.shape[2]"),
        ("h_q 0", SparseFwdArgs { q: &q_h0, ..a }, "q.shape[1]"),
        (
            "q last dim strided",
            SparseFwdArgs {
                q: &q_last_strided,
                ..a
            },
            "q.strides",
        ),
        ("kv f16", SparseFwdArgs { kv: &kv_f16, ..a }, "kv.dtype"),
        (
            "kv rank 2",
            SparseFwdArgs { kv: &kv_rank2, ..a },
            "kv.shape",
        ),
        (
            "kv.shape[1] = 2",
            SparseFwdArgs {
                kv: &kv_two_heads,
                ..a
            },
            "kv.shape[1]",
        ),
        (
            "kv d_qk 512 vs q 576",
            SparseFwdArgs { kv: &kv_512, ..a },
            "kv.shape[2]",
        ),
        (
            "kv last dim strided",
            SparseFwdArgs {
                kv: &kv_last_strided,
                ..a
            },
            "kv.strides",
        ),
        (
            "kv on another device",
            SparseFwdArgs {
                kv: &kv_on_cpu,
                ..a
            },
            "kv.device",
        ),
        (
            "indices f32",
            SparseFwdArgs {
                indices: &idx_f32,
                ..a
            },
            "indices.dtype",
        ),
        (
            "indices s_q mismatch",
            SparseFwdArgs {
                indices: &idx_s_q,
                ..a
            },
            "indices.shape[0]",
        ),
        (
            "indices.shape[1] = 2",
            SparseFwdArgs {
                indices: &idx_heads,
                ..a
            },
            "indices.shape[1]",
        ),
        (
            "topk 0",
            SparseFwdArgs {
                indices: &idx_topk0,
                ..a
            },
            "indices.shape[2]",
        ),
        (
            "indices rank 2",
            SparseFwdArgs {
                indices: &idx_rank2,
                ..a
            },
            "indices.shape",
        ),
        (
            "indices last dim strided",
            SparseFwdArgs {
                indices: &idx_last_strided,
                ..a
            },
            "indices.strides",
        ),
        (
            "sm_scale NaN",
            SparseFwdArgs {
                sm_scale: f32::NAN,
                ..a
            },
            "sm_scale",
        ),
        (
            "sm_scale 0",
            SparseFwdArgs { sm_scale: 0.0, ..a },
            "sm_scale",
        ),
        (
            "sm_scale -1",
            SparseFwdArgs {
                sm_scale: -1.0,
                ..a
            },
            "sm_scale",
        ),
        (
            "sm_scale inf",
            SparseFwdArgs {
                sm_scale: f32::INFINITY,
                ..a
            },
            "sm_scale",
        ),
        (
            "attn_sink h_q + 1",
            SparseFwdArgs {
                attn_sink: Some(&sink_len),
                ..a
            },
            "attn_sink.shape[0]",
        ),
        (
            "attn_sink bf16",
            SparseFwdArgs {
                attn_sink: Some(&sink_bf16),
                ..a
            },
            "attn_sink.dtype",
        ),
        (
            "attn_sink rank 2",
            SparseFwdArgs {
                attn_sink: Some(&sink_rank2),
                ..a
            },
            "attn_sink.shape",
        ),
        (
            "attn_sink strided",
            SparseFwdArgs {
                attn_sink: Some(&sink_strided),
                ..a
            },
            "attn_sink.strides",
        ),
        (
            "topk_length s_q + 2",
            SparseFwdArgs {
                topk_length: Some(&len_shape),
                ..a
            },
            "topk_length.shape[0]",
        ),
        (
            "topk_length f32",
            SparseFwdArgs {
                topk_length: Some(&len_f32),
                ..a
            },
            "topk_length.dtype",
        ),
        (
            "topk_length on cuda:1",
            SparseFwdArgs {
                topk_length: Some(&len_on_other_gpu),
                ..a
            },
            "topk_length.device",
        ),
    ];
    assert!(cases.len() >= 25);
    for (name, args, arg) in cases {
        assert_invalid(name, sparse_fwd::validate(&args), arg);
        // The backward validates the forward's arguments the same way.
        let b = SparseBwdArgs {
            q: args.q,
            kv: args.kv,
            indices: args.indices,
            sm_scale: args.sm_scale,
            attn_sink: args.attn_sink,
            topk_length: args.topk_length,
            ..g.bwd()
        };
        assert_invalid(name, sparse_bwd::validate(&b), arg);
    }
}

#[test]
fn backward_rejects_bad_inputs_naming_the_argument() {
    let g = good();
    let m = |dtype, shape: &[usize]| meta(dtype, shape);
    let out_d256 = m(DType::Bf16, &[S_Q, H_Q, 256]);
    let out_f32 = m(DType::F32, &[S_Q, H_Q, D_V]);
    let out_rank2 = m(DType::Bf16, &[S_Q, H_Q * D_V]);
    let d_out_h = m(DType::Bf16, &[S_Q, H_Q + 1, D_V]);
    let d_out_strided = last_dim_strided(&g.d_out);
    let d_out_f16 = m(DType::F16, &[S_Q, H_Q, D_V]);
    let d_out_host = Meta {
        location: Location::Host,
        ..g.d_out.clone()
    };
    let lse_t = m(DType::F32, &[H_Q, S_Q]);
    let lse_bf16 = m(DType::Bf16, &[S_Q, H_Q]);
    let lse_rank3 = m(DType::F32, &[S_Q, H_Q, 1]);
    let lse_strided = last_dim_strided(&g.lse);
    let a = g.bwd();
    let cases: Vec<(&str, SparseBwdArgs<'_, Meta>, &str)> = vec![
        (
            "out d_v 256",
            SparseBwdArgs {
                out: &out_d256,
                ..a
            },
            "out.shape",
        ),
        ("out f32", SparseBwdArgs { out: &out_f32, ..a }, "out.dtype"),
        (
            "out rank 2",
            SparseBwdArgs {
                out: &out_rank2,
                ..a
            },
            "out.shape",
        ),
        (
            "d_out h_q + 1",
            SparseBwdArgs {
                d_out: &d_out_h,
                ..a
            },
            "d_out.shape",
        ),
        (
            "d_out last dim strided",
            SparseBwdArgs {
                d_out: &d_out_strided,
                ..a
            },
            "d_out.strides",
        ),
        (
            "d_out f16",
            SparseBwdArgs {
                d_out: &d_out_f16,
                ..a
            },
            "d_out.dtype",
        ),
        (
            "d_out on the host",
            SparseBwdArgs {
                d_out: &d_out_host,
                ..a
            },
            "d_out.device",
        ),
        (
            "lse transposed",
            SparseBwdArgs { lse: &lse_t, ..a },
            "lse.shape",
        ),
        (
            "lse bf16",
            SparseBwdArgs {
                lse: &lse_bf16,
                ..a
            },
            "lse.dtype",
        ),
        (
            "lse rank 3",
            SparseBwdArgs {
                lse: &lse_rank3,
                ..a
            },
            "lse.shape",
        ),
        (
            "lse last dim strided",
            SparseBwdArgs {
                lse: &lse_strided,
                ..a
            },
            "lse.strides",
        ),
        (
            "d_kv f16",
            SparseBwdArgs {
                d_kv_dtype: DType::F16,
                ..a
            },
            "d_kv_dtype",
        ),
        (
            "d_kv i32",
            SparseBwdArgs {
                d_kv_dtype: DType::I32,
                ..a
            },
            "d_kv_dtype",
        ),
    ];
    for (name, args, arg) in cases {
        assert_invalid(name, sparse_bwd::validate(&args), arg);
    }
    // Non-last strides are fine; f32 d_kv is fine.
    let lse_ok = Meta {
        layout: Layout::strided(&[S_Q, H_Q], &[H_Q + 5, 1]).unwrap(),
        ..g.lse.clone()
    };
    let ok = SparseBwdArgs {
        lse: &lse_ok,
        d_kv_dtype: DType::F32,
        ..a
    };
    assert_eq!(sparse_bwd::validate(&ok).unwrap().d_kv_dtype, DType::F32);
}

#[test]
fn output_tensors_are_validated_for_the_gpu_path() {
    let g = good();
    let loc = Location::Cuda(0);
    let dims = sparse_fwd::validate(&g.fwd()).unwrap();
    let stat = meta(DType::F32, &[S_Q, H_Q]);
    let out = SparseFwdOutput {
        out: g.out.clone(),
        max_logits: stat.clone(),
        lse: stat.clone(),
    };
    sparse_fwd::validate_output(&dims, loc, &out).unwrap();
    let bad_out = SparseFwdOutput {
        out: meta(DType::Bf16, &[S_Q, H_Q, D_QK]),
        ..out.clone()
    };
    assert_invalid(
        "out d_qk wide",
        sparse_fwd::validate_output(&dims, loc, &bad_out),
        "out.shape",
    );
    let bad_lse = SparseFwdOutput {
        lse: meta(DType::Bf16, &[S_Q, H_Q]),
        ..out.clone()
    };
    assert_invalid(
        "lse bf16",
        sparse_fwd::validate_output(&dims, loc, &bad_lse),
        "lse.dtype",
    );
    let bad_max = SparseFwdOutput {
        max_logits: meta(DType::F32, &[S_Q]),
        ..out.clone()
    };
    assert_invalid(
        "max_logits rank 1",
        sparse_fwd::validate_output(&dims, loc, &bad_max),
        "max_logits.shape",
    );
    assert_invalid(
        "outputs on the host",
        sparse_fwd::validate_output(&dims, Location::Host, &out),
        "out.device",
    );

    let bdims = sparse_bwd::validate(&g.bwd()).unwrap();
    let grads = SparseBwdOutput {
        d_q: meta(DType::Bf16, &[S_Q, H_Q, D_QK]),
        d_kv: meta(DType::Bf16, &[S_KV, 1, D_QK]),
        delta: stat.clone(),
        d_attn_sink: Some(meta(DType::F32, &[H_Q])),
    };
    sparse_bwd::validate_output(&bdims, loc, &grads).unwrap();
    let f32_d_kv = SparseBwdOutput {
        d_kv: meta(DType::F32, &[S_KV, 1, D_QK]),
        ..grads.clone()
    };
    assert_invalid(
        "d_kv f32, bf16 asked",
        sparse_bwd::validate_output(&bdims, loc, &f32_d_kv),
        "d_kv.dtype",
    );
    let no_sink = SparseBwdOutput {
        d_attn_sink: None,
        ..grads.clone()
    };
    assert_invalid(
        "d_attn_sink missing",
        sparse_bwd::validate_output(&bdims, loc, &no_sink),
        "d_attn_sink",
    );
    let bad_dq = SparseBwdOutput {
        d_q: meta(DType::Bf16, &[S_Q, H_Q, D_V]),
        ..grads.clone()
    };
    assert_invalid(
        "d_q d_v wide",
        sparse_bwd::validate_output(&bdims, loc, &bad_dq),
        "d_q.shape",
    );
    let bad_delta = SparseBwdOutput {
        delta: last_dim_strided(&stat),
        ..grads
    };
    assert_invalid(
        "delta strided",
        sparse_bwd::validate_output(&bdims, loc, &bad_delta),
        "delta.strides",
    );
}

#[test]
fn cpu_ops_validate_before_computing() {
    let c = common::Case::random(
        5,
        common::Shape {
            s_q: 2,
            s_kv: 4,
            h_q: 2,
            d_qk: 576,
            d_v: D_V,
            topk: 3,
        },
        common::IndexOpts::CLEAN,
        common::Sink::Random,
        true,
    );
    let inputs = c.tensors();
    let args = inputs.fwd_args();
    assert_invalid(
        "sm_scale NaN",
        sparse_fwd::sparse_fwd_cpu(&SparseFwdArgs {
            sm_scale: f32::NAN,
            ..args
        }),
        "sm_scale",
    );
    // A q whose last dimension has stride 2: same values, bad layout.
    let data = HostData::Bf16(vec![half::bf16::ZERO; 2 * 2 * 576 * 2]);
    let q_bad = HostTensor::with_layout(
        data,
        Layout::strided(&[2, 2, 576], &[2304, 1152, 2]).unwrap(),
    )
    .unwrap();
    assert_invalid(
        "q last dim strided",
        sparse_fwd::sparse_fwd_cpu(&SparseFwdArgs { q: &q_bad, ..args }),
        "q.strides",
    );
    let f = sparse_fwd::sparse_fwd_cpu(&args).unwrap();
    let wrong_lse = HostTensor::from_f32(vec![0.0; 2], &[2]).unwrap();
    let b = inputs.bwd_args(&f.out, &f.out, &wrong_lse, DType::Bf16);
    assert_invalid("lse rank 1", sparse_bwd::sparse_bwd_cpu(&b), "lse.shape");
    let b = inputs.bwd_args(&f.out, &f.lse, &f.lse, DType::Bf16);
    assert_invalid("d_out = lse", sparse_bwd::sparse_bwd_cpu(&b), "d_out.dtype");
}
