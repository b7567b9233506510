//! FP8 building blocks shared by the KV-cache formats: float8 e4m3fn and e8m0 codecs, and the two
//! cache layouts of docs/spec.md section 3 as named, derived constants.
//!
//! The codecs are written with exact integer/power-of-two arithmetic so that the CUDA kernels, which use
//! the same steps (`cvt.rn.satfinite.e4m3x2.f32`, exponent-bit scale rounding), match them bit for bit.

use crate::error::{Error, Result};

/// Largest finite e4m3fn magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// The smallest scale the reference quantiser picks (`max(amax / 448, 1e-4)`).
pub const SCALE_FLOOR: f32 = 1e-4;

/// Encodes an f32 as e4m3fn, rounding to nearest even and saturating to ±448 (NaN stays NaN, 0x7F).
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return 0x7F | sign;
    }
    let a = x.abs();
    if a >= E4M3_MAX {
        return 0x7E | sign;
    }
    // Below the smallest normal (2^-6) the quantum is 2^-9; a code of 8 there is the smallest normal,
    // which the encoding handles without a special case.
    const MIN_NORMAL: f32 = 1.0 / 64.0;
    if a < MIN_NORMAL {
        let q = (a * 512.0).round_ties_even() as u8;
        return sign | q;
    }
    let e = ((a.to_bits() >> 23) & 0xFF) as i32 - 127; // -6..=8
    let quantum = f32::from_bits(((e - 3 + 127) as u32) << 23);
    let mut q = (a / quantum).round_ties_even() as i32; // 8..=16
    let mut e = e;
    if q == 16 {
        q = 8;
        e += 1;
    }
    sign | (((e + 7) as u8) << 3) | ((q - 8) as u8)
}

/// Decodes an e4m3fn byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0F) as i32;
    let man = (b & 0x07) as i32;
    if exp == 0x0F && man == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        man as f32 * (1.0 / 512.0)
    } else {
        (8 + man) as f32 * f32::from_bits(((exp - 7 - 3 + 127) as u32) << 23)
    };
    sign * mag
}

/// Decodes an e8m0 scale byte: `2^(b - 127)`; 255 is NaN.
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        255 => f32::NAN,
        0 => f32::from_bits(0x0040_0000), // 2^-127, a subnormal
        _ => f32::from_bits((b as u32) << 23),
    }
}

/// The reference quantiser's scale for a tile with absolute maximum `amax`:
/// `2^ceil(log2(max(amax / 448, 1e-4)))`, computed on the exponent bits (no `log2`).
/// Returns the scale and its unbiased exponent. A NaN `amax` is treated as infinite, +inf saturates to 2^127.
pub fn pow2_scale(amax: f32) -> (f32, i32) {
    let v = if amax.is_nan() {
        f32::INFINITY
    } else {
        amax / E4M3_MAX
    };
    let v = v.max(SCALE_FLOOR);
    let bits = v.to_bits();
    let mut e = ((bits >> 23) & 0xFF) as i32 - 127;
    if bits & 0x007F_FFFF != 0 {
        e += 1;
    }
    let e = e.min(127);
    (f32::from_bits(((e + 127) as u32) << 23), e)
}

/// The two FP8 KV-cache layouts of docs/spec.md section 3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// DeepSeek V3.2: 656 bytes per token, `d_qk = 576`, four f32 scales per 128 NoPE values.
    V32,
    /// DeepSeek V4 "MODEL1": 584 bytes per token, `d_qk = 512`, seven e8m0 scales per 64 NoPE values,
    /// values and scales in separate regions of each page.
    Model1,
}

impl KvFormat {
    /// Both formats.
    pub const ALL: [KvFormat; 2] = [KvFormat::V32, KvFormat::Model1];
    /// RoPE values per token (bf16, not quantised).
    pub const D_ROPE: usize = 64;

    /// Quantised ("NoPE") values per token.
    pub const fn d_nope(self) -> usize {
        match self {
            KvFormat::V32 => 512,
            KvFormat::Model1 => 448,
        }
    }
    /// Values per token: NoPE + RoPE (576 or 512).
    pub const fn d_qk(self) -> usize {
        self.d_nope() + Self::D_ROPE
    }
    /// NoPE values covered by one scale.
    pub const fn tile(self) -> usize {
        match self {
            KvFormat::V32 => 128,
            KvFormat::Model1 => 64,
        }
    }
    /// Scales per token.
    pub const fn num_scales(self) -> usize {
        self.d_nope() / self.tile()
    }
    /// Bytes of one stored scale (f32 or e8m0).
    pub const fn scale_bytes(self) -> usize {
        match self {
            KvFormat::V32 => 4,
            KvFormat::Model1 => 1,
        }
    }
    /// Bytes of the per-token scale record (MODEL1 pads seven e8m0 bytes to eight).
    pub const fn scale_record_bytes(self) -> usize {
        match self {
            KvFormat::V32 => 4 * 4,
            KvFormat::Model1 => 8,
        }
    }
    /// Bytes of one token's values: e4m3 NoPE + bf16 RoPE (MODEL1 stores these in the page's first region).
    pub const fn value_bytes(self) -> usize {
        self.d_nope() + 2 * Self::D_ROPE
    }
    /// Bytes per token: 656 (= 512 + 4*4 + 64*2) or 584 (= 448 + 64*2 + 8).
    pub const fn bytes_per_token(self) -> usize {
        self.value_bytes() + self.scale_record_bytes()
    }
    /// Byte offset, within a block whose first token is at byte 0, of token `t`'s NoPE values.
    pub const fn nope_offset(self, t: usize) -> usize {
        match self {
            KvFormat::V32 => t * self.bytes_per_token(),
            KvFormat::Model1 => t * self.value_bytes(),
        }
    }
    /// Byte offset of token `t`'s scale record within a block of `page_size` tokens.
    pub const fn scale_offset(self, t: usize, page_size: usize) -> usize {
        match self {
            KvFormat::V32 => t * self.bytes_per_token() + self.d_nope(),
            KvFormat::Model1 => page_size * self.value_bytes() + t * self.scale_record_bytes(),
        }
    }
    /// Byte offset of token `t`'s bf16 RoPE values within a block.
    pub const fn rope_offset(self, t: usize) -> usize {
        match self {
            KvFormat::V32 => t * self.bytes_per_token() + self.d_nope() + self.scale_record_bytes(),
            KvFormat::Model1 => t * self.value_bytes() + self.d_nope(),
        }
    }
    /// The format whose token width is `d_qk`.
    pub fn for_d_qk(d_qk: usize) -> Result<Self> {
        match d_qk {
            576 => Ok(KvFormat::V32),
            512 => Ok(KvFormat::Model1),
            other => Err(Error::invalid(
                "d_qk",
                "576 (V3.2 format) or 512 (MODEL1 format)",
                other,
            )),
        }
    }
    /// Short name (`v32`, `model1`).
    pub const fn name(self) -> &'static str {
        match self {
            KvFormat::V32 => "v32",
            KvFormat::Model1 => "model1",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_decode_encode_roundtrips_every_code() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert_eq!(e4m3_from_f32(v) & 0x7F, 0x7F);
                continue;
            }
            let back = e4m3_from_f32(v);
            // +0 and -0 both round-trip to their own code.
            assert_eq!(back, b, "code {b:#04x} value {v}");
        }
    }

    #[test]
    fn e4m3_known_values_and_saturation() {
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x08), 1.0 / 64.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_from_f32(1e9), 0x7E);
        assert_eq!(e4m3_from_f32(-1e9), 0xFE);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_from_f32(460.0), 0x7E);
        // 1.0625 is halfway between 1.0 (even mantissa 000) and 1.125: ties go to even.
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.1875), 0x3A);
        // Halfway between 0 and the smallest subnormal goes to 0.
        assert_eq!(e4m3_from_f32(1.0 / 1024.0), 0x00);
    }

    #[test]
    fn e4m3_rounding_is_nearest_against_brute_force() {
        let codes: Vec<f32> = (0u8..=0x7E).map(e4m3_to_f32).collect();
        let mut x = 1e-5f32;
        while x < 448.0 {
            let got = e4m3_to_f32(e4m3_from_f32(x));
            let best = codes
                .iter()
                .map(|&c| (c - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert!(
                ((got - x).abs() - best).abs() <= best * 1e-6,
                "x={x} got={got}"
            );
            x *= 1.0137;
        }
    }

    #[test]
    fn pow2_scale_matches_definition() {
        for &amax in &[
            0.0f32, 1e-9, 0.0448, 0.0449, 1.0, 448.0, 449.0, 896.0, 3.7e4,
        ] {
            let (s, e) = pow2_scale(amax);
            let want = (amax / 448.0).max(1e-4).log2().ceil();
            assert_eq!(e as f32, want, "amax {amax}");
            assert_eq!(s, 2f32.powi(e));
        }
    }

    #[test]
    fn format_sizes_are_the_spec_numbers() {
        assert_eq!(KvFormat::V32.bytes_per_token(), 656);
        assert_eq!(KvFormat::Model1.bytes_per_token(), 584);
        assert_eq!(KvFormat::V32.num_scales(), 4);
        assert_eq!(KvFormat::Model1.num_scales(), 7);
        assert_eq!(KvFormat::Model1.scale_offset(3, 64), 64 * 576 + 24);
        assert_eq!(KvFormat::V32.rope_offset(1), 656 + 528);
    }
}
