//! GPU tests of the FP8 KV-cache kernels: bit-exact against the CPU reference on adversarial data (zeros, tiny,
//! huge, NaN, inf, rounding ties), both formats, page sizes 1 / 64 / 61, padded block strides, strided and
//! misaligned rows (vector and scalar kernel variants), arbitrary cache bytes. Run on an sm_90 machine with
//! `cargo test -p flashmla --test gpu_kv_quant -- --ignored`.

mod kv_quant_data;

use flashmla::cuda::Gpu;
use flashmla::fp8::KvFormat;
use flashmla::ops::kv_quant::{
    dequantize_cpu, dequantize_cuda, quantize_cpu_into, quantize_cuda, DequantizeArgs,
    DequantizeOutput, QuantizeArgs, QuantizeOutput,
};
use flashmla::{DType, DeviceView, Error, HostData, HostTensor, Layout, TensorMeta};
use half::bf16;
use kv_quant_data::*;
use rand::Rng;

const POISON_U8: u8 = 0xA5;
/// bf16 NaN that no kernel writes (the kernels write 0x7FC0 for NaN results), to spot untouched elements.
const POISON_BF16: u16 = 0x7FFF;
const SEED: u64 = 0x6b76_7175;

fn gpu() -> Gpu {
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    assert!(
        gpu.info().is_sm90(),
        "these tests need sm_90: {}",
        gpu.info()
    );
    gpu
}

/// Every storage offset the layout reaches.
fn reached_offsets(layout: &Layout) -> Vec<bool> {
    let mut hit = vec![false; layout.span().unwrap()];
    let (shape, strides) = (layout.shape(), layout.strides());
    assert_eq!(shape.len(), 4);
    for a in 0..shape[0] {
        for b in 0..shape[1] {
            for c in 0..shape[2] {
                for d in 0..shape[3] {
                    hit[a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]] = true;
                }
            }
        }
    }
    hit
}

/// A bf16 tensor of `shape` laid out like `kv.to_padded(pad)`, every storage element POISON_BF16.
fn poisoned_bf16(shape: &[usize], pad: &[usize; 4]) -> HostTensor {
    let zeros = HostTensor::bf16_from_f32(&vec![0.0; shape.iter().product()], shape).unwrap();
    let layout = zeros.to_padded(pad).unwrap().layout().clone();
    let n = layout.span().unwrap();
    HostTensor::with_layout(
        HostData::Bf16(vec![bf16::from_bits(POISON_BF16); n]),
        layout,
    )
    .unwrap()
}

/// Bit patterns of a bf16 tensor's values in row-major order, via f32 (exact for bf16; NaNs stay NaN).
fn logical_bits(t: &HostTensor) -> Vec<u16> {
    t.to_f32_vec()
        .unwrap()
        .iter()
        .map(|v| (v.to_bits() >> 16) as u16)
        .collect()
}

/// Describes where byte `i` of a cache storage lies, for failure messages.
fn where_in_cache(format: KvFormat, page_size: usize, block_stride: usize, i: usize) -> String {
    let (b, off) = (i / block_stride, i % block_stride);
    let bpt = format.bytes_per_token();
    if off >= page_size * bpt {
        return format!("block {b} padding byte {}", off - page_size * bpt);
    }
    match format {
        KvFormat::V32 => format!("block {b} token {} byte {}", off / bpt, off % bpt),
        KvFormat::Model1 if off < page_size * format.value_bytes() => {
            format!(
                "block {b} token {} value byte {}",
                off / format.value_bytes(),
                off % format.value_bytes()
            )
        }
        KvFormat::Model1 => {
            let s = off - page_size * format.value_bytes();
            format!("block {b} token {} scale byte {}", s / 8, s % 8)
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Case {
    format: KvFormat,
    num_blocks: usize,
    page_size: usize,
    cache_pad: usize,
    kv_pad: [usize; 4],
    seed: u64,
}

/// Quantise on both backends into poisoned (possibly padded) caches and compare every storage byte; then
/// dequantise on both and compare every value (and the output's untouched padding).
fn check_case(gpu: &Gpu, c: Case) {
    let (values, _) = cache_values(c.format, c.num_blocks * c.page_size, c.seed);
    let kv = kv_tensor(&values, c.format, c.num_blocks, c.page_size)
        .to_padded(&c.kv_pad)
        .unwrap();
    let cache_host = cache_tensor(c.format, c.num_blocks, c.page_size, c.cache_pad, POISON_U8);
    let want = quantize_cpu_into(&QuantizeArgs { kv: &kv }, cache_host.clone()).unwrap();

    let kv_dev = gpu.upload(&kv).unwrap();
    let cache_dev = gpu.upload(&cache_host).unwrap();
    quantize_cuda(
        gpu,
        &QuantizeArgs { kv: &kv_dev.view() },
        &QuantizeOutput {
            cache: cache_dev.view(),
        },
    )
    .unwrap_or_else(|e| panic!("{c:?}: quantize_cuda: {e}"));
    let got = gpu.download(&cache_dev).unwrap();
    let (g, w) = (storage_u8(&got), storage_u8(&want));
    assert_eq!(g.len(), w.len());
    let block_stride = c.page_size * c.format.bytes_per_token() + c.cache_pad;
    if let Some(i) = (0..g.len()).find(|&i| g[i] != w[i]) {
        panic!(
            "{c:?}: cache byte {i} ({}): gpu {:#04x}, cpu {:#04x}",
            where_in_cache(c.format, c.page_size, block_stride, i),
            g[i],
            w[i]
        );
    }

    let shape = [c.num_blocks, c.page_size, 1, c.format.d_qk()];
    let out_host = poisoned_bf16(&shape, &c.kv_pad);
    let out_dev = gpu.upload(&out_host).unwrap();
    dequantize_cuda(
        gpu,
        &DequantizeArgs {
            cache: &cache_dev.view(),
        },
        &DequantizeOutput { kv: out_dev.view() },
    )
    .unwrap_or_else(|e| panic!("{c:?}: dequantize_cuda: {e}"));
    let out = gpu.download(&out_dev).unwrap();
    let want_kv = dequantize_cpu(&DequantizeArgs { cache: &want }).unwrap().kv;
    assert_bf16_bits_eq(
        &format!("{c:?}: dequantised values"),
        &logical_bits(&out),
        &logical_bits(&want_kv),
    );
    let reached = reached_offsets(out.layout());
    let storage = storage_bf16_bits(&out);
    for (i, &hit) in reached.iter().enumerate() {
        if !hit {
            assert_eq!(
                storage[i], POISON_BF16,
                "{c:?}: output padding element {i} was written"
            );
        }
    }
}

#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn kernels_match_the_reference_bit_for_bit() {
    let gpu = gpu();
    let mut n = 0;
    for format in KvFormat::ALL {
        for (num_blocks, page_size) in [(37, 1), (5, 64), (4, 61)] {
            // 0: packed; 40: padded, 8-byte aligned (vector path); 3: padded, unaligned (scalar path).
            for cache_pad in [0, 40, 3] {
                // Contiguous; padded rows of 16-byte multiples (vector path); odd row stride (scalar path).
                for kv_pad in [[0, 0, 0, 0], [1, 2, 1, 128], [0, 1, 0, 1]] {
                    let seed = SEED + n;
                    n += 1;
                    check_case(
                        &gpu,
                        Case {
                            format,
                            num_blocks,
                            page_size,
                            cache_pad,
                            kv_pad,
                            seed,
                        },
                    );
                }
            }
        }
    }
}

/// Views that start off the vector alignment (cache at +1 byte, kv at +2 bytes) take the scalar kernels.
#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn misaligned_views_use_the_scalar_path_and_match() {
    let gpu = gpu();
    for format in KvFormat::ALL {
        let (nb, ps) = (3, 16);
        let seed = SEED ^ format.d_qk() as u64;
        let (values, _) = cache_values(format, nb * ps, seed);
        let kv = kv_tensor(&values, format, nb, ps);
        let want = quantize_cpu_into(
            &QuantizeArgs { kv: &kv },
            cache_tensor(format, nb, ps, 0, 0),
        )
        .unwrap();

        let bpt = format.bytes_per_token();
        let cache_bytes = nb * ps * bpt;
        let kv_elems = nb * ps * format.d_qk();
        let cache_buf = gpu.alloc_filled(DType::U8, &[cache_bytes + 16], 0).unwrap();
        // Place kv at +1 element (2 bytes) by uploading a shifted copy.
        let mut shifted = vec![0f32; 1];
        shifted.extend(&values);
        shifted.resize(kv_elems + 8, 0.0);
        let kv_src = gpu
            .upload(&HostTensor::bf16_from_f32(&shifted, &[kv_elems + 8]).unwrap())
            .unwrap();
        let (kv_view, cache_view) = unsafe {
            (
                DeviceView::from_raw(
                    kv_src.ptr() + 2,
                    DType::Bf16,
                    Layout::contiguous(&[nb, ps, 1, format.d_qk()]),
                    0,
                ),
                DeviceView::from_raw(
                    cache_buf.ptr() + 1,
                    DType::U8,
                    Layout::contiguous(&[nb, ps, 1, bpt]),
                    0,
                ),
            )
        };
        quantize_cuda(
            &gpu,
            &QuantizeArgs { kv: &kv_view },
            &QuantizeOutput {
                cache: cache_view.clone(),
            },
        )
        .unwrap();
        let got = gpu.download_view(&cache_view).unwrap();
        assert_eq!(
            got.to_u8_vec().unwrap(),
            want.to_u8_vec().unwrap(),
            "seed {seed} {format:?}: misaligned quantise"
        );

        let out_buf = gpu
            .alloc_filled(DType::Bf16, &[kv_elems + 8], 0xFF)
            .unwrap();
        let out_view = unsafe {
            DeviceView::from_raw(
                out_buf.ptr() + 2,
                DType::Bf16,
                Layout::contiguous(&[nb, ps, 1, format.d_qk()]),
                0,
            )
        };
        dequantize_cuda(
            &gpu,
            &DequantizeArgs { cache: &cache_view },
            &DequantizeOutput {
                kv: out_view.clone(),
            },
        )
        .unwrap();
        let got = gpu.download_view(&out_view).unwrap();
        let want_kv = dequantize_cpu(&DequantizeArgs { cache: &want }).unwrap().kv;
        assert_bf16_bits_eq(
            &format!("seed {seed} {format:?}: misaligned dequantise"),
            &logical_bits(&got),
            &logical_bits(&want_kv),
        );
    }
}

/// Dequantising arbitrary bytes (every e4m3 code including NaN; V3.2 scales with any f32 bit pattern including
/// subnormals, inf and NaN; MODEL1 scale bytes 0..=255) matches the CPU path (NaNs compared as a class).
#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn dequantize_of_random_bytes_matches() {
    let gpu = gpu();
    for format in KvFormat::ALL {
        let seed = SEED + 99 + format.d_qk() as u64;
        let mut r = rng(seed);
        let (nb, ps) = (6, 61);
        let bpt = format.bytes_per_token();
        let mut bytes: Vec<u8> = (0..nb * ps * bpt).map(|_| r.random()).collect();
        if format == KvFormat::V32 {
            // Make most scales ordinary magnitudes so the products are not all inf/0.
            for tok in 0..nb * ps {
                for s in 0..4 {
                    if r.random_bool(0.7) {
                        let at = tok * bpt + 512 + 4 * s;
                        let v: f32 = r.random_range(-1e3..1e3);
                        bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
        let cache = HostTensor::from_u8(bytes, &[nb, ps, 1, bpt]).unwrap();
        let want = dequantize_cpu(&DequantizeArgs { cache: &cache })
            .unwrap()
            .kv;
        let cache_dev = gpu.upload(&cache).unwrap();
        let out = gpu
            .alloc_filled(DType::Bf16, &[nb, ps, 1, format.d_qk()], 0xFF)
            .unwrap();
        dequantize_cuda(
            &gpu,
            &DequantizeArgs {
                cache: &cache_dev.view(),
            },
            &DequantizeOutput { kv: out.view() },
        )
        .unwrap();
        let got = gpu.download(&out).unwrap();
        assert_bf16_bits_eq(
            &format!("seed {seed} {format:?}"),
            &logical_bits(&got),
            &logical_bits(&want),
        );
    }
}

/// An f8e4m3-typed cache (as PyTorch callers hold it) is accepted and written identically.
#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn f8_typed_cache_is_accepted() {
    let gpu = gpu();
    let format = KvFormat::Model1;
    let (nb, ps) = (2, 64);
    let (values, _) = cache_values(format, nb * ps, SEED + 5);
    let kv = kv_tensor(&values, format, nb, ps);
    let want = quantize_cpu_into(
        &QuantizeArgs { kv: &kv },
        cache_tensor(format, nb, ps, 0, 0),
    )
    .unwrap();
    let kv_dev = gpu.upload(&kv).unwrap();
    let cache = gpu
        .alloc_filled(DType::F8E4M3, &[nb, ps, 1, format.bytes_per_token()], 0)
        .unwrap();
    quantize_cuda(
        &gpu,
        &QuantizeArgs { kv: &kv_dev.view() },
        &QuantizeOutput {
            cache: cache.view(),
        },
    )
    .unwrap();
    let got = gpu.download(&cache).unwrap();
    assert_eq!(got.to_u8_vec().unwrap(), want.to_u8_vec().unwrap());
}

#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn device_side_validation() {
    let gpu = gpu();
    let kv = gpu.alloc_filled(DType::Bf16, &[2, 4, 1, 576], 0).unwrap();
    let cache = gpu.alloc_filled(DType::U8, &[2, 4, 1, 656], 0).unwrap();
    // A view that claims another device.
    let other = unsafe { DeviceView::from_raw(kv.ptr(), DType::Bf16, kv.layout().clone(), 1) };
    let e = quantize_cuda(
        &gpu,
        &QuantizeArgs { kv: &other },
        &QuantizeOutput {
            cache: cache.view(),
        },
    )
    .unwrap_err();
    assert_eq!(e.arg(), Some("cache.device"), "{e}");
    let other_cache =
        unsafe { DeviceView::from_raw(cache.ptr(), DType::U8, cache.layout().clone(), 1) };
    let e = quantize_cuda(
        &gpu,
        &QuantizeArgs { kv: &kv.view() },
        &QuantizeOutput { cache: other_cache },
    )
    .unwrap_err();
    assert_eq!(e.arg(), Some("cache.device"), "{e}");
    // An odd bf16 address.
    let odd = unsafe { DeviceView::from_raw(kv.ptr() + 1, DType::Bf16, kv.layout().clone(), 0) };
    let e = quantize_cuda(
        &gpu,
        &QuantizeArgs { kv: &odd },
        &QuantizeOutput {
            cache: cache.view(),
        },
    )
    .unwrap_err();
    assert_eq!(e.arg(), Some("kv.data_ptr"), "{e}");
    // Host-side rules apply unchanged (wrong bytes per token for the format).
    let wrong = gpu
        .alloc(DType::U8, &[2, 4, 1, KvFormat::Model1.bytes_per_token()])
        .unwrap();
    let e = quantize_cuda(
        &gpu,
        &QuantizeArgs { kv: &kv.view() },
        &QuantizeOutput {
            cache: wrong.view(),
        },
    )
    .unwrap_err();
    assert_eq!(e.arg(), Some("cache.shape[3]"), "{e}");
    assert!(matches!(e, Error::InvalidArgument { .. }));
}

/// Large caches: bit-exact, and the achieved bandwidth (printed, not asserted).
#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn large_cache_throughput() {
    let gpu = gpu();
    gpu.set_sync_launches(false);
    for format in KvFormat::ALL {
        let (nb, ps) = (2048, 64);
        let tokens = nb * ps;
        let seed = SEED + 1234 + format.d_qk() as u64;
        let mut r = rng(seed);
        let values: Vec<f32> = (0..tokens * format.d_qk())
            .map(|_| to_bf16(r.random_range(-4.0f32..4.0)))
            .collect();
        let kv = kv_tensor(&values, format, nb, ps);
        let want = quantize_cpu_into(
            &QuantizeArgs { kv: &kv },
            cache_tensor(format, nb, ps, 0, 0),
        )
        .unwrap();
        let kv_dev = gpu.upload(&kv).unwrap();
        let cache = gpu
            .alloc_filled(DType::U8, &[nb, ps, 1, format.bytes_per_token()], 0)
            .unwrap();
        let out = gpu.alloc(DType::Bf16, &[nb, ps, 1, format.d_qk()]).unwrap();
        let q = || {
            quantize_cuda(
                &gpu,
                &QuantizeArgs { kv: &kv_dev.view() },
                &QuantizeOutput {
                    cache: cache.view(),
                },
            )
        };
        let dq = || {
            dequantize_cuda(
                &gpu,
                &DequantizeArgs {
                    cache: &cache.view(),
                },
                &DequantizeOutput { kv: out.view() },
            )
        };
        let tq = gpu.time_ms(3, 20, q).unwrap();
        let tdq = gpu.time_ms(3, 20, dq).unwrap();
        assert_eq!(
            gpu.download(&cache).unwrap().to_u8_vec().unwrap(),
            want.to_u8_vec().unwrap(),
            "seed {seed}"
        );
        let bytes = tokens * (2 * format.d_qk() + format.bytes_per_token());
        let median = |mut t: Vec<f32>| {
            t.sort_by(f32::total_cmp);
            t[t.len() / 2]
        };
        let (mq, mdq) = (median(tq), median(tdq));
        println!(
            "{format:?} {tokens} tokens: quantize {mq:.3} ms ({:.0} GB/s), dequantize {mdq:.3} ms ({:.0} GB/s)",
            bytes as f64 / mq as f64 / 1e6,
            bytes as f64 / mdq as f64 / 1e6
        );
    }
}
