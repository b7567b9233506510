//! CPU tests of the FP8 KV-cache ops: error bound of the round trip (derived below), nearest-value rounding
//! against a brute-force search, exact byte layouts of hand-made tokens, untouched block padding, strided
//! inputs, validation errors.

mod kv_quant_data;

use flashmla::fp8::KvFormat;
use flashmla::ops::kv_quant::{
    dequantize_cpu, quantize_cpu, quantize_cpu_into, validate_dequantize,
    validate_dequantize_output, DequantizeArgs, DequantizeOutput, QuantizeArgs,
};
use flashmla::{HostData, HostTensor, Layout, TensorMeta};
use half::bf16;
use kv_quant_data::*;

const SEED: u64 = 0x5eed_4b56;

fn quantize(kv: &HostTensor) -> HostTensor {
    quantize_cpu(&QuantizeArgs { kv }).expect("quantize").cache
}

fn dequantize(cache: &HostTensor) -> HostTensor {
    dequantize_cpu(&DequantizeArgs { cache })
        .expect("dequantize")
        .kv
}

/// The reference scale by its definition, in f64: 2^ceil(log2(max(amax / 448, 1e-4))).
fn scale_by_definition(tile: &[f32]) -> f64 {
    let amax = tile
        .iter()
        .filter(|v| !v.is_nan())
        .fold(0f64, |m, &v| m.max((v as f64).abs()));
    let floor = 1e-4f32 as f64;
    2f64.powf((amax / 448.0).max(floor).log2().ceil())
}

/// Round-trip bound. With scale s >= amax / 448, every y = x / s satisfies |y| <= 448 (no saturation). e4m3
/// rounding to nearest: for |y| >= 2^-6 (normal) the spacing at y's binade 2^E is 2^(E-3), so the error is at
/// most 2^(E-4) <= |y| / 16; below 2^-6 the spacing is 2^-9, error <= 2^-10. Dequantising multiplies by the
/// power of two s exactly, and the product (4 significant bits) is exact in bf16. Hence
/// |x - dq(q(x))| <= max(|x| / 16, s / 1024), with equality only at ties.
#[test]
fn round_trip_error_is_within_the_e4m3_bound() {
    for format in KvFormat::ALL {
        let (nb, ps) = (5, 7);
        let seed = SEED + format.d_qk() as u64;
        let (values, flavours) = cache_values(format, nb * ps, seed);
        let back = dequantize(&quantize(&kv_tensor(&values, format, nb, ps)))
            .to_f32_vec()
            .unwrap();
        let (d, tile) = (format.d_qk(), format.tile());
        for tok in 0..nb * ps {
            if matches!(
                flavours[tok],
                Flavour::Specials | Flavour::AllNan | Flavour::Huge
            ) {
                // Tiles holding inf get the scale 2^127 (checked exactly below); values near the bf16 maximum can
                // round up to e4m3 * scale = 2^128, which dequantises to inf: outside this bound's premises.
                continue;
            }
            let x = &values[tok * d..(tok + 1) * d];
            let y = &back[tok * d..(tok + 1) * d];
            for s in 0..format.num_scales() {
                let scale = scale_by_definition(&x[s * tile..(s + 1) * tile]);
                for i in s * tile..(s + 1) * tile {
                    let err = (x[i] as f64 - y[i] as f64).abs();
                    let bound = ((x[i] as f64).abs() / 16.0).max(scale / 1024.0);
                    assert!(
                        err <= bound,
                        "seed {seed} {format:?} token {tok} ({:?}) elem {i}: x {} dq {} err {err:e} > bound {bound:e}",
                        flavours[tok],
                        x[i],
                        y[i]
                    );
                }
            }
            assert_eq!(
                &x[format.d_nope()..],
                &y[format.d_nope()..],
                "seed {seed} token {tok}: RoPE is copied"
            );
        }
    }
}

/// Every dequantised NoPE value is the e4m3 grid point nearest to x / scale (ties to the even code), found by
/// brute force over the grid, independently of the codec.
#[test]
fn quantised_values_are_the_nearest_e4m3_values() {
    let grid = e4m3_grid();
    for format in KvFormat::ALL {
        let (nb, ps) = (2, 16);
        let seed = SEED ^ 0xabc ^ format.d_qk() as u64;
        let (values, flavours) = cache_values(format, nb * ps, seed);
        let back = dequantize(&quantize(&kv_tensor(&values, format, nb, ps)))
            .to_f32_vec()
            .unwrap();
        let (d, tile) = (format.d_qk(), format.tile());
        for tok in 0..nb * ps {
            if matches!(
                flavours[tok],
                Flavour::Specials | Flavour::AllNan | Flavour::Huge
            ) {
                continue;
            }
            for s in 0..format.num_scales() {
                let x = &values[tok * d + s * tile..tok * d + (s + 1) * tile];
                let scale = scale_by_definition(x);
                for (i, &xi) in x.iter().enumerate() {
                    let y = xi as f64 / scale;
                    let (best, code) = grid
                        .iter()
                        .enumerate()
                        .map(|(c, &g)| ((y.abs() - g).abs(), c))
                        .fold((f64::INFINITY, 0), |a, b| {
                            if b.0 < a.0 || (b.0 == a.0 && b.1 % 2 == 0) {
                                b
                            } else {
                                a
                            }
                        });
                    let want = grid[code].copysign(y) * scale;
                    let got = back[tok * d + s * tile + i] as f64;
                    assert!(
                        got == want || (got == 0.0 && want == 0.0),
                        "seed {seed} {format:?} token {tok} tile {s} elem {i}: x {xi} -> {got}, nearest {want} (dist {best})"
                    );
                }
            }
        }
    }
}

fn f32_le(x: f32) -> [u8; 4] {
    x.to_le_bytes()
}

fn bf16_le(x: f32) -> [u8; 2] {
    bf16::from_f32(x).to_le_bytes()
}

/// Tiles of a hand-made token and the codes / scale exponents worked out by hand.
/// Returns (values of d_nope, expected codes per element, expected exponent per tile).
fn hand_made_nope(format: KvFormat) -> (Vec<f32>, Vec<u8>, Vec<i32>) {
    let tile = format.tile();
    let mut x = Vec::new();
    let mut codes = Vec::new();
    let mut exps = Vec::new();
    for s in 0..format.num_scales() {
        let mut t = vec![0f32; tile];
        let mut c = vec![0u8; tile];
        let e = match s {
            // all 1.0: amax/448 = 2^-8.8 -> scale 2^-8; 1 * 2^8 = 256 = 2^8 * 1.0 -> exponent field 15, code 0x78
            0 => {
                t.fill(1.0);
                c.fill(0x78);
                -8
            }
            // 448: scale 1, 448 -> 0x7E (largest finite)
            1 => {
                t.fill(448.0);
                c.fill(0x7E);
                0
            }
            // mixed: amax 2.5 -> 2.5/448 = 2^-7.5 -> scale 2^-7; -2.5 * 128 = -320 = -2^8 * 1.25 -> 0xFA;
            // 0.5 * 128 = 64 = 2^6 -> 0x68; -0.0 -> 0x80; the rest 0
            2 => {
                t[0] = -2.5;
                c[0] = 0xFA;
                t[1] = 0.5;
                c[1] = 0x68;
                t[2] = -0.0;
                c[2] = 0x80;
                -7
            }
            // specials: amax = inf (NaN skipped) -> scale 2^127; NaN -> 0x7F, -NaN -> 0xFF, inf -> 0x7E,
            // -inf -> 0xFE, -1.0 * 2^-127 rounds to -0 -> 0x80, 3 * 2^126 -> 1.5 -> 0x3C
            3 => {
                t[0] = f32::NAN;
                c[0] = 0x7F;
                t[1] = -f32::NAN;
                c[1] = 0xFF;
                t[2] = f32::INFINITY;
                c[2] = 0x7E;
                t[3] = f32::NEG_INFINITY;
                c[3] = 0xFE;
                t[4] = -1.0;
                c[4] = 0x80;
                t[5] = 3.0 * 2f32.powi(126);
                c[5] = 0x3C;
                127
            }
            // one value 3 * 2^90: amax/448 = (3/7) 2^84 -> scale 2^83; 3 * 2^7 = 384 = 2^8 * 1.5 -> 0x7C
            4 => {
                t[7] = 3.0 * 2f32.powi(90);
                c[7] = 0x7C;
                83
            }
            // below the floor: amax 2^-10 -> 2^-10/448 < 1e-4 -> scale 2^-13; 2^-10 * 2^13 = 8 -> 0x50;
            // a bf16 subnormal 2^-130 * 2^13 = 2^-117 -> 0
            5 => {
                t[3] = 2f32.powi(-10);
                c[3] = 0x50;
                t[4] = f32::from_bits(0x0008_0000);
                c[4] = 0x00;
                -13
            }
            // all zero: floor scale 2^-13
            _ => -13,
        };
        x.extend(t);
        codes.extend(c);
        exps.push(e);
    }
    (x, codes, exps)
}

#[test]
fn v32_byte_layout_of_a_hand_made_token() {
    let f = KvFormat::V32;
    let (mut x, codes, exps) = hand_made_nope(f);
    let rope: Vec<f32> = (0..64)
        .map(|i| {
            if i == 5 {
                f32::NAN
            } else {
                i as f32 * -0.25 + 1.5
            }
        })
        .collect();
    x.extend(&rope);
    // Two tokens; the hand-made one second, so its offset is 656.
    let mut values = vec![0.5f32; f.d_qk()];
    values.extend(&x);
    let cache = quantize(&kv_tensor(&values, f, 1, 2));
    let bytes = cache.to_u8_vec().unwrap();
    assert_eq!(bytes.len(), 2 * 656);
    let tok = &bytes[656..];
    assert_eq!(&tok[..512], &codes[..], "NoPE codes");
    for (s, &e) in exps.iter().enumerate() {
        assert_eq!(
            &tok[512 + 4 * s..516 + 4 * s],
            &f32_le(2f32.powi(e)),
            "scale {s} = 2^{e}"
        );
    }
    for (i, &r) in rope.iter().enumerate() {
        let want = if r.is_nan() { [0xC0, 0x7F] } else { bf16_le(r) };
        assert_eq!(&tok[528 + 2 * i..530 + 2 * i], &want, "RoPE {i}");
    }
    // The first token: 0.5 everywhere -> scale 2^-9 (0.5/448 = 2^-9.8), 0.5 * 2^9 = 256 -> 0x78.
    assert!(bytes[..512].iter().all(|&b| b == 0x78));
    assert_eq!(&bytes[512..516], &f32_le(2f32.powi(-9)));
}

#[test]
fn model1_byte_layout_of_a_hand_made_token() {
    let f = KvFormat::Model1;
    let ps = 3;
    let (mut x, codes, exps) = hand_made_nope(f);
    let rope: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) * 0.125).collect();
    x.extend(&rope);
    // Token 1 of a page of 3; the others plain.
    let mut values = vec![0.5f32; f.d_qk()];
    values.extend(&x);
    values.extend(vec![-1.0f32; f.d_qk()]);
    let bytes = quantize(&kv_tensor(&values, f, 1, ps)).to_u8_vec().unwrap();
    assert_eq!(bytes.len(), ps * 584);
    // Values region: token t at 576 t (448 codes, then 64 bf16); scales region at 3 * 576 + 8 t.
    assert_eq!(&bytes[576..576 + 448], &codes[..], "NoPE codes of token 1");
    for (i, &r) in rope.iter().enumerate() {
        assert_eq!(
            &bytes[576 + 448 + 2 * i..576 + 450 + 2 * i],
            &bf16_le(r),
            "RoPE {i}"
        );
    }
    let scales = &bytes[ps * 576 + 8..ps * 576 + 16];
    for (s, &e) in exps.iter().enumerate() {
        assert_eq!(scales[s] as i32, e + 127, "e8m0 scale {s}");
    }
    assert_eq!(scales[7], 0, "pad byte");
    // Token 0 (0.5: scale 2^-9 -> byte 118) and token 2 (-1.0: scale 2^-8 -> byte 119, codes 0xF8).
    assert!(bytes[..448].iter().all(|&b| b == 0x78));
    assert!(bytes[2 * 576..2 * 576 + 448].iter().all(|&b| b == 0xF8));
    assert_eq!(
        &bytes[ps * 576..ps * 576 + 8],
        &[118, 118, 118, 118, 118, 118, 118, 0]
    );
    assert_eq!(
        &bytes[ps * 576 + 16..ps * 576 + 24],
        &[119, 119, 119, 119, 119, 119, 119, 0]
    );
}

#[test]
fn quantize_into_a_padded_cache_leaves_padding_untouched() {
    const POISON: u8 = 0xA5;
    for (format, ps, pad) in [
        (KvFormat::V32, 4, 40),
        (KvFormat::Model1, 61, 3),
        (KvFormat::Model1, 1, 1),
    ] {
        let nb = 3;
        let seed = SEED + ps as u64 + pad as u64;
        let (values, _) = cache_values(format, nb * ps, seed);
        let kv = kv_tensor(&values, format, nb, ps);
        let packed = quantize(&kv).to_u8_vec().unwrap();
        let cache = quantize_cpu_into(
            &QuantizeArgs { kv: &kv },
            cache_tensor(format, nb, ps, pad, POISON),
        )
        .unwrap();
        let storage = storage_u8(&cache);
        let block_bytes = ps * format.bytes_per_token();
        let stride = block_bytes + pad;
        for b in 0..nb {
            assert_eq!(
                &storage[b * stride..b * stride + block_bytes],
                &packed[b * block_bytes..(b + 1) * block_bytes],
                "seed {seed} {format:?} block {b}"
            );
            let pad_end = ((b + 1) * stride).min(storage.len());
            assert!(
                storage[b * stride + block_bytes..pad_end]
                    .iter()
                    .all(|&x| x == POISON),
                "padding of block {b}"
            );
        }
        // Dequantising the padded cache gives the packed cache's values.
        let from_packed =
            HostTensor::from_u8(packed, &[nb, ps, 1, format.bytes_per_token()]).unwrap();
        assert_bf16_bits_eq(
            "dequantised padded cache",
            &storage_bf16_bits(&dequantize(&cache)),
            &storage_bf16_bits(&dequantize(&from_packed)),
        );
    }
}

#[test]
fn strided_inputs_give_the_same_cache() {
    for format in KvFormat::ALL {
        let (nb, ps) = (2, 5);
        let (values, _) = cache_values(format, nb * ps, SEED + 7);
        let kv = kv_tensor(&values, format, nb, ps);
        let want = quantize(&kv);
        for pad in [[1, 2, 1, 128], [0, 1, 0, 1], [3, 0, 2, 8]] {
            let strided = kv.to_padded(&pad).unwrap();
            assert_eq!(
                quantize(&strided).to_u8_vec().unwrap(),
                want.to_u8_vec().unwrap(),
                "{format:?} pad {pad:?}"
            );
        }
    }
}

#[test]
fn dequantize_decodes_arbitrary_bytes_by_definition() {
    // Every e4m3 code under a few scales; the expected value is code * scale rounded to bf16, computed from the
    // format's definition (f64 product, exact for these scales, then bf16 rounding).
    let f = KvFormat::V32;
    let scales = [1.0f32, 2f32.powi(-13), 2f32.powi(100), 0.3];
    let mut bytes = vec![0u8; 2 * f.bytes_per_token()];
    for tok in 0..2 {
        let base = tok * f.bytes_per_token();
        for i in 0..512 {
            bytes[base + i] = ((i + 256 * tok) % 256) as u8;
        }
        for (s, sc) in scales.iter().enumerate() {
            bytes[base + 512 + 4 * s..base + 516 + 4 * s].copy_from_slice(&sc.to_le_bytes());
        }
    }
    let out = dequantize(&HostTensor::from_u8(bytes.clone(), &[1, 2, 1, 656]).unwrap());
    let got = storage_bf16_bits(&out);
    for tok in 0..2 {
        for i in 0..512 {
            let code = bytes[tok * 656 + i];
            let want = e4m3_by_definition(code) * scales[i / 128] as f64;
            let g = bf16::from_bits(got[tok * 576 + i]).to_f32();
            if want.is_nan() {
                assert!(g.is_nan(), "code {code:#04x}");
            } else {
                assert_eq!(
                    g,
                    bf16::from_f64(want).to_f32(),
                    "code {code:#04x} scale {}",
                    scales[i / 128]
                );
            }
        }
    }
}

#[test]
fn empty_caches_are_fine() {
    for format in KvFormat::ALL {
        for (nb, ps) in [(0, 64), (3, 0)] {
            let kv = kv_tensor(&[], format, nb, ps);
            let cache = quantize(&kv);
            assert_eq!(cache.shape(), &[nb, ps, 1, format.bytes_per_token()]);
            assert_eq!(dequantize(&cache).shape(), &[nb, ps, 1, format.d_qk()]);
        }
    }
}

fn bf16_tensor(shape: &[usize]) -> HostTensor {
    HostTensor::bf16_from_f32(&vec![0.0; shape.iter().product()], shape).unwrap()
}

fn u8_tensor(shape: &[usize]) -> HostTensor {
    HostTensor::from_u8(vec![0; shape.iter().product()], shape).unwrap()
}

fn strided_u8(shape: &[usize], strides: &[usize]) -> HostTensor {
    let layout = Layout::strided(shape, strides).unwrap();
    HostTensor::with_layout(HostData::U8(vec![0; layout.span().unwrap()]), layout).unwrap()
}

fn strided_bf16(shape: &[usize], strides: &[usize]) -> HostTensor {
    let layout = Layout::strided(shape, strides).unwrap();
    HostTensor::with_layout(
        HostData::Bf16(vec![bf16::ZERO; layout.span().unwrap()]),
        layout,
    )
    .unwrap()
}

#[test]
fn validation_names_the_bad_argument() {
    let kv = bf16_tensor(&[2, 4, 1, 576]);
    let quant_err = |kv: &HostTensor| quantize_cpu(&QuantizeArgs { kv }).unwrap_err();
    let into_err =
        |cache: HostTensor| quantize_cpu_into(&QuantizeArgs { kv: &kv }, cache).unwrap_err();
    let deq_err = |cache: &HostTensor| dequantize_cpu(&DequantizeArgs { cache }).unwrap_err();
    let deq_out_err = |out: HostTensor| {
        let cache = u8_tensor(&[2, 4, 1, 656]);
        let dims = validate_dequantize(&DequantizeArgs { cache: &cache }).unwrap();
        validate_dequantize_output(&dims, &DequantizeOutput { kv: out }).unwrap_err()
    };
    let cases = vec![
        (
            quant_err(&HostTensor::from_f32(vec![0.0; 2 * 576], &[2, 1, 1, 576]).unwrap()),
            "kv.dtype",
        ),
        (quant_err(&bf16_tensor(&[8, 1, 576])), "kv.shape"),
        (quant_err(&bf16_tensor(&[2, 4, 2, 576])), "kv.shape[2]"),
        (quant_err(&bf16_tensor(&[2, 4, 1, 500])), "kv.shape[3]"),
        (
            quant_err(&strided_bf16(&[2, 4, 1, 576], &[4 * 1152, 1152, 1152, 2])),
            "kv.strides",
        ),
        (into_err(bf16_tensor(&[2, 4, 1, 656])), "cache.dtype"),
        (into_err(u8_tensor(&[2, 4, 1, 584])), "cache.shape[3]"),
        (into_err(u8_tensor(&[3, 4, 1, 656])), "cache.shape[0]"),
        (into_err(u8_tensor(&[2, 5, 1, 656])), "cache.shape[1]"),
        (into_err(u8_tensor(&[2, 4, 2, 656])), "cache.shape[2]"),
        (
            into_err(strided_u8(&[2, 4, 1, 656], &[4 * 700, 700, 700, 1])),
            "cache.strides[1]",
        ),
        (
            into_err(strided_u8(&[2, 4, 1, 656], &[4 * 656 - 1, 656, 656, 1])),
            "cache.strides[0]",
        ),
        (
            into_err(strided_u8(&[2, 4, 1, 656], &[8 * 656, 2 * 656, 656, 2])),
            "cache.strides[1]",
        ),
        (deq_err(&u8_tensor(&[2, 4, 1, 600])), "cache.shape[3]"),
        (deq_err(&u8_tensor(&[2, 4, 656])), "cache.shape"),
        (deq_err(&bf16_tensor(&[2, 4, 1, 656])), "cache.dtype"),
        (deq_out_err(bf16_tensor(&[2, 4, 1, 512])), "kv.shape[3]"),
        (deq_out_err(bf16_tensor(&[2, 3, 1, 576])), "kv.shape[1]"),
        (
            deq_out_err(strided_bf16(&[2, 4, 1, 576], &[4 * 576, 500, 500, 1])),
            "kv.strides[1]",
        ),
        (
            deq_out_err(strided_bf16(&[2, 4, 1, 576], &[1000, 576, 576, 1])),
            "kv.strides[0]",
        ),
    ];
    assert!(cases.len() >= 10);
    for (err, arg) in cases {
        assert_eq!(err.arg(), Some(arg), "{err}");
    }
    // Disjoint but interleaved output rows (token stride > block stride) are fine.
    let cache = u8_tensor(&[2, 4, 1, 656]);
    let dims = validate_dequantize(&DequantizeArgs { cache: &cache }).unwrap();
    let out = strided_bf16(&[2, 4, 1, 576], &[576, 2 * 576, 576, 1]);
    assert!(validate_dequantize_output(&dims, &DequantizeOutput { kv: out }).is_ok());
}
