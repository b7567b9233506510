// Entry points of the kv_quant family: {quantize, dequantize} x {v32, model1} x {vec, scalar}.
// `vec` needs kv rows 16-byte aligned and cache blocks 8-byte aligned; `scalar` accepts any alignment
// (the host picks, see ops/kv_quant/launch.rs). Grid: ceil(num_tokens / kWarpsPerCta) CTAs of kThreads.
#include "sm90/kv_quant/kernel.cuh"

using flashmla::kv_quant::FormatModel1;
using flashmla::kv_quant::FormatV32;
using flashmla::kv_quant::kThreads;
using flashmla::kv_quant::Params;

#define FLASHMLA_KV_QUANT_ENTRY(NAME, BODY, FORMAT, VEC)                                    \
    extern "C" __global__ void __launch_bounds__(kThreads) NAME(const __grid_constant__ Params p) { \
        flashmla::kv_quant::BODY<FORMAT, VEC>(p);                                           \
    }

FLASHMLA_KV_QUANT_ENTRY(kv_quant_quantize_v32_vec, quantize_token, FormatV32, true)
FLASHMLA_KV_QUANT_ENTRY(kv_quant_quantize_v32_scalar, quantize_token, FormatV32, false)
FLASHMLA_KV_QUANT_ENTRY(kv_quant_quantize_model1_vec, quantize_token, FormatModel1, true)
FLASHMLA_KV_QUANT_ENTRY(kv_quant_quantize_model1_scalar, quantize_token, FormatModel1, false)
FLASHMLA_KV_QUANT_ENTRY(kv_quant_dequantize_v32_vec, dequantize_token, FormatV32, true)
FLASHMLA_KV_QUANT_ENTRY(kv_quant_dequantize_v32_scalar, dequantize_token, FormatV32, false)
FLASHMLA_KV_QUANT_ENTRY(kv_quant_dequantize_model1_vec, dequantize_token, FormatModel1, true)
FLASHMLA_KV_QUANT_ENTRY(kv_quant_dequantize_model1_scalar, dequantize_token, FormatModel1, false)
