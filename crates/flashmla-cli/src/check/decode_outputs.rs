//! What the dense and sparse decode checks share: NaN-poisoned outputs (contiguous, or padded in every dimension:
//! by 1, so that their strides are odd, or by 2, so that out rows are 4-byte but not 16-byte aligned), reading them
//! back, judging them against the f64 reference, and the bitwise comparison of the batch-invariance checks.

use super::check;
use flashmla::cuda::{DeviceTensor, Gpu};
use flashmla::reference::compare::{DECODE_LSE, DECODE_OUT};
use flashmla::reference::decode::DecodeResult;
use flashmla::{DType, HostData, HostTensor};

/// Poison byte of the contiguous outputs: 0xFF.. is a NaN in bf16, f16 and f32.
const POISON: u8 = 0xFF;

/// `out [b, s_q, h_q, d_v]` of `dtype` and `lse [b, h_q, s_q]` f32, every element NaN; `pad` elements of padding
/// after every dimension (0: contiguous).
pub fn poisoned(
    gpu: &Gpu,
    dtype: DType,
    [b, s_q, h_q, d_v]: [usize; 4],
    pad: usize,
) -> flashmla::Result<(DeviceTensor, DeviceTensor)> {
    let (out_shape, lse_shape) = ([b, s_q, h_q, d_v], [b, h_q, s_q]);
    if pad == 0 {
        return Ok((
            gpu.alloc_filled(dtype, &out_shape, POISON)?,
            gpu.alloc_filled(DType::F32, &lse_shape, POISON)?,
        ));
    }
    let n = out_shape.iter().product();
    let data = match dtype {
        DType::F16 => HostData::F16(vec![half::f16::NAN; n]),
        _ => HostData::Bf16(vec![half::bf16::NAN; n]),
    };
    let o = HostTensor::new(data, &out_shape)?.to_padded(&[pad; 4])?;
    let l = HostTensor::from_f32(vec![f32::NAN; lse_shape.iter().product()], &lse_shape)?
        .to_padded(&[pad; 3])?;
    Ok((gpu.upload(&o)?, gpu.upload(&l)?))
}

/// `(out, lse)` as f32 host vectors in logical order.
pub fn read(
    gpu: &Gpu,
    out: &DeviceTensor,
    lse: &DeviceTensor,
) -> flashmla::Result<(Vec<f32>, Vec<f32>)> {
    Ok((
        gpu.download(out)?.to_f32_vec()?,
        gpu.download(lse)?.to_f32_vec()?,
    ))
}

/// `out` and `lse` against the reference, with the decode tolerances; `prefix` names the call ("" or "first ").
pub fn judge(
    prefix: &str,
    (out, lse): &(Vec<f32>, Vec<f32>),
    want: &DecodeResult<f64>,
) -> Vec<(String, Result<String, String>)> {
    vec![
        check(&format!("{prefix}out"), out, &want.out, &DECODE_OUT),
        check(&format!("{prefix}lse"), lse, &want.lse, &DECODE_LSE),
    ]
}

/// One batch-invariance check: the first `per_out` / `per_lse` values of a batch's results against those of the
/// request alone, bit for bit.
pub fn bitwise(
    name: String,
    (out, lse): &(Vec<f32>, Vec<f32>),
    (out0, lse0): (&[f32], &[f32]),
) -> (String, Result<String, String>) {
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let same_out = same(&out[..out0.len()], out0);
    let same_lse = same(&lse[..lse0.len()], lse0);
    let verdict = if same_out && same_lse {
        Ok("bitwise equal".to_string())
    } else {
        Err(format!(
            "request 0 differs (out equal: {same_out}, lse equal: {same_lse})"
        ))
    };
    (name, verdict)
}
