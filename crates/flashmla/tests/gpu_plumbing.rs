//! GPU tests of `flashmla::cuda`: device info, memory round trips that keep strides, kernel lookup and cache,
//! launch configuration (dynamic shared memory above 48 KiB, clusters), timing, external streams, threads.
//! Run on an sm_90 machine with `cargo test -p flashmla --test gpu_plumbing -- --ignored`.

mod kv_quant_data;

use flashmla::cuda::{kernels_built, Gpu, LaunchConfig, NVCC_VERSION};
use flashmla::fp8::KvFormat;
use flashmla::ops::kv_quant::launch::{KvQuantParams, FAMILY, THREADS_PER_CTA, WARPS_PER_CTA};
use flashmla::ops::kv_quant::{quantize_cpu, quantize_cuda, QuantizeArgs, QuantizeOutput};
use flashmla::{DType, Error, HostData, HostTensor, TensorMeta};
use half::f16;
use kv_quant_data::*;

fn gpu() -> Gpu {
    Gpu::new(0).expect("a CUDA GPU")
}

/// Parameters of a launch with no tokens: every warp returns at once, touching no memory.
fn idle_params() -> KvQuantParams {
    KvQuantParams {
        kv: 0,
        cache: 0,
        kv_block_stride: 0,
        kv_token_stride: 0,
        cache_block_stride: 0,
        num_blocks: 0,
        page_size: 1,
        num_tokens: 0,
        reserved: 0,
    }
}

#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn device_info_is_sane() {
    let gpu = gpu();
    let info = gpu.info();
    println!("{info}");
    println!("nvcc: {NVCC_VERSION}; kernels: {:?}", kernels_built());
    assert_eq!(info.cc, (9, 0));
    assert!(info.sm_count >= 100, "{info:?}");
    assert!(info.l2_bytes >= 32 << 20, "{info:?}");
    assert!(info.max_smem_per_block_optin >= 227 * 1024, "{info:?}");
    assert!(info.driver_version_code >= 13000, "{info:?}");
    assert!(info.total_mem_bytes >= 64 << 30, "{info:?}");
    assert!(info.cluster_launch);
    assert!(Gpu::device_count().unwrap() >= 1);
    let (free, total) = gpu.mem_info().unwrap();
    assert!(free <= total && total == info.total_mem_bytes);
    assert!(matches!(
        Gpu::new(1 << 20),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn upload_download_keep_storage_and_strides() {
    let gpu = gpu();
    let vals: Vec<f32> = (0..2 * 3 * 5).map(|i| i as f32 * 0.5 - 3.0).collect();
    let tensors = [
        HostTensor::bf16_from_f32(&vals, &[2, 3, 5]).unwrap(),
        HostTensor::new(
            HostData::F16(vals.iter().map(|&v| f16::from_f32(v)).collect()),
            &[2, 3, 5],
        )
        .unwrap(),
        HostTensor::from_f32(vals.clone(), &[2, 3, 5]).unwrap(),
        HostTensor::from_i32((0..30).collect(), &[2, 3, 5]).unwrap(),
        HostTensor::from_u8((0..30).collect(), &[2, 3, 5]).unwrap(),
    ];
    for t in tensors {
        for pad in [[0, 0, 0], [1, 2, 3]] {
            let h = t.to_padded(&pad).unwrap();
            let d = gpu.upload(&h).unwrap();
            assert_eq!(d.layout(), h.layout());
            assert_eq!(d.dtype(), h.dtype());
            assert_eq!(
                d.bytes(),
                h.layout().span().unwrap() * h.dtype().size_bytes()
            );
            let back = gpu.download(&d).unwrap();
            // Storage equality by bits (the padding holds NaN for float types).
            let bits = |x: &HostTensor| -> Vec<u64> {
                match x.data() {
                    HostData::Bf16(v) => v.iter().map(|e| e.to_bits() as u64).collect(),
                    HostData::F16(v) => v.iter().map(|e| e.to_bits() as u64).collect(),
                    HostData::F32(v) => v.iter().map(|e| e.to_bits() as u64).collect(),
                    HostData::I32(v) => v.iter().map(|&e| e as u32 as u64).collect(),
                    HostData::U8(v) => v.iter().map(|&e| e as u64).collect(),
                }
            };
            assert_eq!(
                bits(&back)[..],
                bits(&h)[..h.layout().span().unwrap()],
                "{:?} pad {pad:?}",
                t.dtype()
            );
            assert_eq!(back.layout(), h.layout());
        }
    }
    // Filled allocation and an empty one.
    let f = gpu.alloc_filled(DType::Bf16, &[7, 3], 0xFF).unwrap();
    match gpu.download(&f).unwrap().data() {
        HostData::Bf16(v) => assert!(v.iter().all(|x| x.to_bits() == 0xFFFF)),
        _ => unreachable!(),
    }
    let e = gpu.alloc(DType::F32, &[0, 4]).unwrap();
    assert_eq!((e.bytes(), e.ptr()), (0, 0));
    assert_eq!(gpu.download(&e).unwrap().shape(), &[0, 4]);
    // f8 comes back as bytes.
    let f8 = gpu.alloc_filled(DType::F8E4M3, &[4], 0x38).unwrap();
    assert_eq!(
        gpu.download(&f8).unwrap().to_u8_vec().unwrap(),
        vec![0x38; 4]
    );
}

#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn kernel_lookup_cache_and_attributes() {
    let gpu = gpu();
    for (family, built) in kernels_built() {
        assert!(built, "family {family} not built");
    }
    for format in ["v32", "model1"] {
        for dir in ["quantize", "dequantize"] {
            for path in ["vec", "scalar"] {
                let name = format!("kv_quant_{dir}_{format}_{path}");
                let k = gpu.kernel(FAMILY, &name).unwrap();
                let again = gpu.kernel(FAMILY, &name).unwrap();
                assert_eq!(format!("{k:?}"), format!("{again:?}"));
                let a = k.attributes().unwrap();
                println!("{name}: {a:?}");
                assert_eq!(a.local_bytes, 0, "{name} uses local memory");
                assert!(a.num_regs <= 64, "{name}: {} registers", a.num_regs);
                assert!(a.max_threads_per_block >= THREADS_PER_CTA);
            }
        }
    }
    assert!(matches!(
        gpu.kernel("no_such_family", "k"),
        Err(Error::KernelsNotBuilt(_))
    ));
    assert!(matches!(
        gpu.kernel(FAMILY, "no_such_kernel"),
        Err(Error::Cuda { .. })
    ));
    // A kernel looked up through another Gpu handle is refused.
    let other = Gpu::new(0).unwrap();
    let k = other.kernel(FAMILY, "kv_quant_quantize_v32_vec").unwrap();
    let e = unsafe {
        gpu.launch(
            &k,
            &LaunchConfig::linear(1, THREADS_PER_CTA),
            &idle_params(),
        )
    }
    .unwrap_err();
    assert_eq!(e.arg(), Some("kernel"), "{e}");
}

/// Runs the V3.2 quantise kernel by hand with a given launch geometry and checks the cache.
fn quantize_by_hand(gpu: &Gpu, cfg_of: impl Fn(u32) -> LaunchConfig) {
    let format = KvFormat::V32;
    let (nb, ps) = (4, 16); // 64 tokens = 8 CTAs
    let (values, _) = cache_values(format, nb * ps, 77);
    let kv = kv_tensor(&values, format, nb, ps);
    let want = quantize_cpu(&QuantizeArgs { kv: &kv }).unwrap().cache;
    let kv_dev = gpu.upload(&kv).unwrap();
    let cache = gpu.alloc_filled(DType::U8, &[nb, ps, 1, 656], 0).unwrap();
    let p = KvQuantParams {
        kv: kv_dev.ptr(),
        cache: cache.ptr(),
        kv_block_stride: (ps * 576) as i64,
        kv_token_stride: 576,
        cache_block_stride: (ps * 656) as i64,
        num_blocks: nb as i32,
        page_size: ps as i32,
        num_tokens: (nb * ps) as i32,
        reserved: 0,
    };
    let k = gpu.kernel(FAMILY, "kv_quant_quantize_v32_vec").unwrap();
    let ctas = (nb * ps) as u32 / WARPS_PER_CTA;
    unsafe { gpu.launch(&k, &cfg_of(ctas), &p) }.unwrap();
    assert_eq!(
        gpu.download(&cache).unwrap().to_u8_vec().unwrap(),
        want.to_u8_vec().unwrap()
    );
}

#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn launch_with_large_dynamic_smem_and_clusters() {
    let gpu = gpu();
    let max = gpu.info().max_smem_per_block_optin as u32;
    // Dynamic shared memory above 48 KiB (the kernel ignores it; the launch must raise the limit).
    quantize_by_hand(&gpu, |ctas| LaunchConfig {
        shared_mem_bytes: 100 * 1024,
        ..LaunchConfig::linear(ctas, THREADS_PER_CTA)
    });
    quantize_by_hand(&gpu, |ctas| LaunchConfig {
        shared_mem_bytes: max,
        ..LaunchConfig::linear(ctas, THREADS_PER_CTA)
    });
    // Clusters of 2 and 8 (portable), and 16 (non-portable, opt-in).
    for c in [2, 8] {
        quantize_by_hand(&gpu, |ctas| LaunchConfig {
            cluster: Some((c, 1, 1)),
            programmatic: false,
            ..LaunchConfig::linear(ctas, THREADS_PER_CTA)
        });
    }
    // 16-CTA clusters: grid of 16 with the extra CTAs idle (their tokens are past the end).
    quantize_by_hand(&gpu, |_| LaunchConfig {
        cluster: Some((16, 1, 1)),
        programmatic: false,
        ..LaunchConfig::linear(16, THREADS_PER_CTA)
    });
    // Refused before the driver sees them.
    let k = gpu.kernel(FAMILY, "kv_quant_quantize_v32_vec").unwrap();
    // No tokens: even a launch that went through would touch no memory.
    let p = idle_params();
    let bad = LaunchConfig {
        shared_mem_bytes: max + 1,
        ..LaunchConfig::linear(1, 32)
    };
    assert_eq!(
        unsafe { gpu.launch(&k, &bad, &p) }.unwrap_err().arg(),
        Some("cfg.shared_mem_bytes")
    );
    let bad = LaunchConfig {
        cluster: Some((3, 1, 1)),
        programmatic: false,
        ..LaunchConfig::linear(8, 32)
    };
    assert_eq!(
        unsafe { gpu.launch(&k, &bad, &p) }.unwrap_err().arg(),
        Some("cfg.cluster")
    );
    // The driver's own refusal is an Error::Cuda naming the call: more threads than the kernel's launch bounds.
    let too_many = LaunchConfig::linear(1, 1024);
    match unsafe { gpu.launch(&k, &too_many, &p) } {
        Err(Error::Cuda { call, code }) => {
            println!("{call}: {code}");
            assert!(call.contains("kv_quant_quantize_v32_vec"));
        }
        other => panic!("expected Error::Cuda, got {other:?}"),
    }
    gpu.synchronize().unwrap();
}

#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn events_time_each_rep() {
    let gpu = gpu();
    let format = KvFormat::Model1;
    let (values, _) = cache_values(format, 4096, 3);
    let kv = gpu.upload(&kv_tensor(&values, format, 64, 64)).unwrap();
    let cache = gpu.alloc(DType::U8, &[64, 64, 1, 584]).unwrap();
    let mut calls = 0;
    let t = gpu
        .time_ms(2, 5, || {
            calls += 1;
            quantize_cuda(
                &gpu,
                &QuantizeArgs { kv: &kv.view() },
                &QuantizeOutput {
                    cache: cache.view(),
                },
            )
        })
        .unwrap();
    assert_eq!(calls, 7);
    assert_eq!(t.len(), 5);
    assert!(t.iter().all(|&ms| ms > 0.0 && ms < 1000.0), "{t:?}");
    assert!(gpu.time_ms(0, 0, || Ok(())).unwrap().is_empty());
    // An error inside the closure comes back as is.
    let e = gpu
        .time_ms(0, 2, || Err(Error::unsupported("x", "y")))
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }));
}

#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn external_streams_and_threads() {
    let owner = gpu();
    let format = KvFormat::V32;
    let (values, _) = cache_values(format, 128, 11);
    let kv_host = kv_tensor(&values, format, 2, 64);
    let want = quantize_cpu(&QuantizeArgs { kv: &kv_host })
        .unwrap()
        .cache
        .to_u8_vec()
        .unwrap();
    // The owner's stream, then the legacy default stream (0), used as "external" streams.
    for stream in [owner.stream(), 0] {
        let ext = unsafe { Gpu::with_external_stream(0, stream) }.unwrap();
        assert_eq!(ext.stream(), stream);
        let kv = ext.upload(&kv_host).unwrap();
        let cache = ext.alloc_filled(DType::U8, &[2, 64, 1, 656], 0).unwrap();
        quantize_cuda(
            &ext,
            &QuantizeArgs { kv: &kv.view() },
            &QuantizeOutput {
                cache: cache.view(),
            },
        )
        .unwrap();
        assert_eq!(
            ext.download(&cache).unwrap().to_u8_vec().unwrap(),
            want,
            "stream {stream:#x}"
        );
    }
    // A handle sharing the owner's context and kernels, on the legacy default stream: kernels looked up through
    // either handle launch on both.
    let shared = unsafe { owner.with_stream(0) }.unwrap();
    let k = owner.kernel(FAMILY, "kv_quant_quantize_v32_vec").unwrap();
    unsafe {
        shared.launch(
            &k,
            &LaunchConfig::linear(1, THREADS_PER_CTA),
            &idle_params(),
        )
    }
    .unwrap();
    shared.synchronize().unwrap();
    let kv = shared.upload(&kv_host).unwrap();
    let cache = shared.alloc_filled(DType::U8, &[2, 64, 1, 656], 0).unwrap();
    quantize_cuda(
        &shared,
        &QuantizeArgs { kv: &kv.view() },
        &QuantizeOutput {
            cache: cache.view(),
        },
    )
    .unwrap();
    assert_eq!(
        shared.download(&cache).unwrap().to_u8_vec().unwrap(),
        want,
        "with_stream"
    );
    // Clones used from several threads at once.
    std::thread::scope(|s| {
        for _ in 0..4 {
            let g = owner.clone();
            let (kv_host, want) = (&kv_host, &want);
            s.spawn(move || {
                for _ in 0..10 {
                    let kv = g.upload(kv_host).unwrap();
                    let cache = g.alloc_filled(DType::U8, &[2, 64, 1, 656], 0).unwrap();
                    quantize_cuda(
                        &g,
                        &QuantizeArgs { kv: &kv.view() },
                        &QuantizeOutput {
                            cache: cache.view(),
                        },
                    )
                    .unwrap();
                    assert_eq!(&g.download(&cache).unwrap().to_u8_vec().unwrap(), want);
                }
            });
        }
    });
}
