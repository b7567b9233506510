//! A kernel that faults leaves a *sticky* error: the launch itself succeeds (it is asynchronous), the fault is
//! reported by the next call that waits on the stream, and every later call on the context fails with the same
//! error. Kept in its own test binary (its own process) because the context stays unusable afterwards.
//! Run on an sm_90 machine with `cargo test -p flashmla --test gpu_sticky_error -- --ignored`.

use flashmla::cuda::{Gpu, LaunchConfig};
use flashmla::ops::kv_quant::launch::{KvQuantParams, FAMILY, THREADS_PER_CTA};
use flashmla::ops::kv_quant::{quantize_cuda, QuantizeArgs, QuantizeOutput};
use flashmla::{DType, Error};

/// Address in the first page, never mapped.
const BAD_ADDRESS: u64 = 0x100;

#[test]
#[ignore = "needs an sm_90 GPU; run with --ignored on the device"]
fn a_fault_is_reported_and_then_sticks() {
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    gpu.set_sync_launches(false);
    let kv = gpu.alloc_filled(DType::Bf16, &[1, 8, 1, 576], 0).unwrap();
    let cache = gpu.alloc_filled(DType::U8, &[1, 8, 1, 656], 0).unwrap();
    gpu.synchronize().unwrap();
    let k = gpu.kernel(FAMILY, "kv_quant_quantize_v32_vec").unwrap();
    let bad = KvQuantParams {
        kv: BAD_ADDRESS,
        cache: BAD_ADDRESS,
        kv_block_stride: 8 * 576,
        kv_token_stride: 576,
        cache_block_stride: 8 * 656,
        num_blocks: 1,
        page_size: 8,
        num_tokens: 8,
        reserved: 0,
    };
    // The launch is accepted: the fault happens later, on the device.
    unsafe { gpu.launch(&k, &LaunchConfig::linear(1, THREADS_PER_CTA), &bad) }
        .expect("launch is asynchronous");
    let e = gpu.synchronize().unwrap_err();
    println!("after the faulting kernel: {e}");
    let Error::Cuda { code, .. } = &e else {
        panic!("expected Error::Cuda, got {e:?}")
    };
    assert!(code.contains("CUDA_ERROR_"), "{code}");
    // A correct launch afterwards fails too: the error is sticky.
    let e2 = quantize_cuda(
        &gpu,
        &QuantizeArgs { kv: &kv.view() },
        &QuantizeOutput {
            cache: cache.view(),
        },
    )
    .and_then(|_| gpu.synchronize())
    .unwrap_err();
    println!("next call: {e2}");
    assert!(matches!(e2, Error::Cuda { .. }));
}
