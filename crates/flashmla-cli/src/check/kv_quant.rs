//! FP8 KV-cache quantise/dequantise: the kernels must match the CPU path bit for bit, on both formats, with
//! adversarial values (zeros, subnormals, huge, NaN, inf, rounding ties), odd page sizes, padded block strides
//! (the padding must stay untouched) and strided input rows.

use super::{Case, Outcome};
use flashmla::cuda::Gpu;
use flashmla::fp8::KvFormat;
use flashmla::ops::kv_quant::{
    dequantize_cpu, dequantize_cuda, quantize_cpu_into, quantize_cuda, DequantizeArgs,
    DequantizeOutput, QuantizeArgs, QuantizeOutput,
};
use flashmla::testing::kv_cache_values;
use flashmla::{DType, HostData, HostTensor, Layout, TensorMeta};

/// Poison for cache bytes: a value no quantiser writes into padding.
const POISON_U8: u8 = 0xA5;
/// Poison for bf16 outputs: a NaN the kernel never writes (it writes a canonical quiet NaN, 0x7FC0 or 0xFFC0).
const POISON_BF16_BYTE: u8 = 0xFF;

struct Shape {
    format: KvFormat,
    num_blocks: usize,
    page_size: usize,
    block_pad: usize,
    row_pad: usize,
}

fn cache_layout(s: &Shape) -> flashmla::Result<Layout> {
    let bpt = s.format.bytes_per_token();
    Layout::strided(
        &[s.num_blocks, s.page_size, 1, bpt],
        &[s.page_size * bpt + s.block_pad, bpt, bpt, 1],
    )
}

fn u8_storage(t: &HostTensor) -> &[u8] {
    match t.data() {
        HostData::U8(v) => v,
        _ => &[],
    }
}

fn bf16_bits(t: &HostTensor) -> flashmla::Result<Vec<u16>> {
    // Row-major logical values; f32 widening of bf16 is exact and keeps NaN payloads in the high half.
    Ok(t.to_f32_vec()?
        .iter()
        .map(|v| (v.to_bits() >> 16) as u16)
        .collect())
}

fn run_case(gpu: &Gpu, s: &Shape, seed: u64) -> flashmla::Result<Outcome> {
    let d = s.format.d_qk();
    let tokens = s.num_blocks * s.page_size;
    let (values, _) = kv_cache_values(s.format, tokens, seed);
    let kv = HostTensor::bf16_from_f32(&values, &[s.num_blocks, s.page_size, 1, d])?;
    let kv = if s.row_pad > 0 {
        kv.to_padded(&[0, 0, 0, s.row_pad])?
    } else {
        kv
    };
    let layout = cache_layout(s)?;
    let span = layout.span().unwrap_or(0);

    // Quantise: CPU into a poisoned cache, GPU into an identically poisoned one; compare every byte.
    let host_cache = HostTensor::with_layout(HostData::U8(vec![POISON_U8; span]), layout.clone())?;
    let want = quantize_cpu_into(&QuantizeArgs { kv: &kv }, host_cache.clone())?;
    let d_kv = gpu.upload(&kv)?;
    let d_cache = gpu.upload(&host_cache)?;
    quantize_cuda(
        gpu,
        &QuantizeArgs { kv: &d_kv.view() },
        &QuantizeOutput {
            cache: d_cache.view(),
        },
    )?;
    let got = gpu.download(&d_cache)?;
    let (gb, wb) = (u8_storage(&got), u8_storage(&want));
    let quant = match gb.iter().zip(wb).position(|(a, b)| a != b) {
        None if gb.len() == wb.len() => Ok(format!("{} bytes identical", wb.len())),
        None => Err(format!("length {} vs {}", gb.len(), wb.len())),
        Some(i) => Err(format!(
            "byte {i} (block {}, offset {}): gpu {:#04x} cpu {:#04x}; {} bytes differ",
            i / layout.strides()[0],
            i % layout.strides()[0],
            gb[i],
            wb[i],
            gb.iter().zip(wb).filter(|(a, b)| a != b).count()
        )),
    };

    // Dequantise the CPU cache: GPU output poisoned, compare bf16 bit patterns (a NaN must be a canonical quiet
    // NaN of either sign, which the 0xFFFF poison is not).
    let want_kv = dequantize_cpu(&DequantizeArgs { cache: &want })?.kv;
    let d_src = gpu.upload(&want)?;
    let d_out = gpu.alloc_filled(DType::Bf16, want_kv.shape(), POISON_BF16_BYTE)?;
    dequantize_cuda(
        gpu,
        &DequantizeArgs {
            cache: &d_src.view(),
        },
        &DequantizeOutput { kv: d_out.view() },
    )?;
    let got_kv = gpu.download(&d_out)?;
    let (g, w) = (bf16_bits(&got_kv)?, bf16_bits(&want_kv)?);
    let is_nan = |b: u16| b & 0x7F80 == 0x7F80 && b & 0x007F != 0;
    let bad = g.iter().zip(&w).position(|(&a, &b)| {
        if is_nan(b) {
            a & 0x7FFF != 0x7FC0
        } else {
            a != b
        }
    });
    let dequant = match bad {
        None => Ok(format!("{} values identical", w.len())),
        Some(i) => Err(format!(
            "value {i} (token {}, column {}): gpu {:#06x} cpu {:#06x}",
            i / d,
            i % d,
            g[i],
            w[i]
        )),
    };
    Ok(Outcome::from_checks(vec![
        ("quantize".into(), quant),
        ("dequantize".into(), dequant),
    ]))
}

/// The kv_quant cases: both formats x page sizes {1, 61, 64} x packed/padded blocks x contiguous/strided rows.
pub fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for format in KvFormat::ALL {
        for (page_size, num_blocks) in [(64usize, 37usize), (61, 9), (1, 300)] {
            for block_pad in [0usize, 40] {
                for row_pad in [0usize, 128] {
                    let name = format!(
                        "kv_quant/{}/page{page_size}/blocks{num_blocks}/blockpad{block_pad}/rowpad{row_pad}",
                        format.name()
                    );
                    let quick = page_size == 64 && block_pad == 0 && row_pad == 0;
                    let shape = Shape {
                        format,
                        num_blocks,
                        page_size,
                        block_pad,
                        row_pad,
                    };
                    v.push(Case {
                        name,
                        quick,
                        run: Box::new(move |gpu, _tuning, seed| run_case(gpu, &shape, seed)),
                    });
                }
            }
        }
    }
    v
}
