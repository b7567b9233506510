//! FP8 KV-cache quantise/dequantise bandwidth: compulsory bytes are the bf16 values plus the cache bytes.

use super::{Bench, BenchSuite, Record};
use flashmla::fp8::KvFormat;
use flashmla::ops::kv_quant::{
    dequantize_cuda, quantize_cuda, DequantizeArgs, DequantizeOutput, QuantizeArgs, QuantizeOutput,
};
use flashmla::testing::{peer_bf16, rng};
use flashmla::{DType, HostTensor};

const PAGE: usize = 64;

/// Quantise and dequantise for both formats; the standard size moves >= 4x the L2 per call.
pub fn benches(suite: BenchSuite) -> Vec<Bench> {
    let blocks = match suite {
        BenchSuite::Standard | BenchSuite::Sweep => 2048, // 131072 tokens: 237 MB moved per V3.2 call
        BenchSuite::Small => 64,
    };
    let mut v = Vec::new();
    for format in KvFormat::ALL {
        let tokens = blocks * PAGE;
        let bytes = (tokens * (2 * format.d_qk() + format.bytes_per_token())) as f64;
        for op in ["kv_quantize", "kv_dequantize"] {
            let record = Record {
                op: op.to_string(),
                format: Some(format.name().to_string()),
                tokens: Some(tokens),
                d_qk: Some(format.d_qk()),
                ..Record::default()
            };
            v.push(Bench {
                record,
                flop: 0.0,
                bytes,
                setup: Box::new(move |gpu, _variants| {
                    let shape = [blocks, PAGE, 1, format.d_qk()];
                    let cache_shape = [blocks, PAGE, 1, format.bytes_per_token()];
                    let values = peer_bf16(&mut rng(7), tokens * format.d_qk());
                    let kv = gpu.upload(&HostTensor::bf16_from_f32(&values, &shape)?)?;
                    let cache = gpu.alloc(DType::U8, &cache_shape)?;
                    quantize_cuda(
                        gpu,
                        &QuantizeArgs { kv: &kv.view() },
                        &QuantizeOutput {
                            cache: cache.view(),
                        },
                    )?;
                    let gpu = gpu.clone();
                    let quantize = op == "kv_quantize";
                    Ok(Box::new(move |_tuning| {
                        if quantize {
                            quantize_cuda(
                                &gpu,
                                &QuantizeArgs { kv: &kv.view() },
                                &QuantizeOutput {
                                    cache: cache.view(),
                                },
                            )
                        } else {
                            dequantize_cuda(
                                &gpu,
                                &DequantizeArgs {
                                    cache: &cache.view(),
                                },
                                &DequantizeOutput { kv: kv.view() },
                            )
                        }
                    }))
                }),
            });
        }
    }
    v
}
