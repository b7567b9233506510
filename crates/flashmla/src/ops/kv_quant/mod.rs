//! kv_quant (work in progress).
