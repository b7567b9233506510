//! Seeded, adversarial inputs for the FP8 KV-cache tests (CPU and GPU), and an independent e4m3 decoder.
//!
//! Every value generated is exactly representable in bf16 (the ops' input dtype), so the tests compare the
//! kernels and the reference on the same inputs.
#![allow(dead_code)]

use flashmla::fp8::KvFormat;
use flashmla::{HostData, HostTensor, Layout};
use half::bf16;

/// Rounds to the nearest bf16 value.
pub fn to_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

#[allow(unused_imports)]
pub use flashmla::testing::{
    kv_cache_values as cache_values, kv_token_values as token_values, rng, KvFlavour as Flavour,
    KV_FLAVOURS as FLAVOURS,
};

/// Contiguous bf16 `[num_blocks, page_size, 1, d_qk]`.
pub fn kv_tensor(
    values: &[f32],
    format: KvFormat,
    num_blocks: usize,
    page_size: usize,
) -> HostTensor {
    HostTensor::bf16_from_f32(values, &[num_blocks, page_size, 1, format.d_qk()])
        .expect("kv tensor")
}

/// A u8 cache `[num_blocks, page_size, 1, bpt]` with block stride `page_size * bpt + pad` bytes, every byte
/// `fill` (so untouched padding is visible).
pub fn cache_tensor(
    format: KvFormat,
    num_blocks: usize,
    page_size: usize,
    pad: usize,
    fill: u8,
) -> HostTensor {
    let bpt = format.bytes_per_token();
    let block_stride = page_size * bpt + pad;
    let layout = Layout::strided(
        &[num_blocks, page_size, 1, bpt],
        &[block_stride, bpt, bpt, 1],
    )
    .expect("layout");
    let len = layout.span().expect("span");
    HostTensor::with_layout(HostData::U8(vec![fill; len]), layout).expect("cache tensor")
}

/// The raw storage of a u8 host tensor.
pub fn storage_u8(t: &HostTensor) -> &[u8] {
    match t.data() {
        HostData::U8(v) => v,
        other => panic!("expected u8 storage, got {:?}", other.dtype()),
    }
}

/// The raw storage of a bf16 host tensor, as bits.
pub fn storage_bf16_bits(t: &HostTensor) -> Vec<u16> {
    match t.data() {
        HostData::Bf16(v) => v.iter().map(|x| x.to_bits()).collect(),
        other => panic!("expected bf16 storage, got {:?}", other.dtype()),
    }
}

/// e4m3fn decoded straight from its definition (sign, 4-bit exponent with bias 7, 3-bit mantissa; S.1111.111 is
/// NaN; no infinities), in f64. Independent of `flashmla::fp8`.
pub fn e4m3_by_definition(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f64;
    if e == 15 && m == 7.0 {
        return f64::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    sign * mag
}

/// Non-negative finite e4m3 values, ascending (codes 0x00..=0x7E).
pub fn e4m3_grid() -> Vec<f64> {
    (0u8..=0x7E).map(e4m3_by_definition).collect()
}

/// Compares bf16 outputs bit for bit, treating any two NaNs as equal (payloads are not part of the contract).
#[track_caller]
pub fn assert_bf16_bits_eq(what: &str, got: &[u16], want: &[u16]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let is_nan = |b: u16| (b & 0x7FFF) > 0x7F80;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if is_nan(g) && is_nan(w) {
            continue;
        }
        assert_eq!(g, w, "{what}: element {i}: got {g:#06x}, want {w:#06x}");
    }
}
