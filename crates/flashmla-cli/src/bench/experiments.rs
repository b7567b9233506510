//! Bench-only experiments (the `experiments` cargo feature): ways of running the sparse ops that the
//! library does not offer, timed to bound what a change inside the op could gain. Their results are not
//! the op's. Each is chosen per run by a variable read in `tuning.rs`, so `bench --ab` compares them.
//!
//! * [`ORDER_VAR`] (`index`, `waves`, `sorted`, `sorted-waves`): the forward on every token's index row
//!   sorted by KV row (`sorted`), and/or launched once per wave of tokens (as many as the GPU holds at
//!   once: `sm_count` CTAs of 64 heads), one after another (`waves`); `index` runs the op as built. The
//!   outputs are the same up to the order of the online softmax's additions. It bounds what a KV-row
//!   order inside the forward would be worth (the backward's buckets): within a wave every CTA then
//!   walks the KV rows from low to high at about the same pace. E.g. `flashmla bench --op sparse_fwd
//!   --ab FLASHMLA_BENCH_SPARSE_FWD_ORDER=index,waves,sorted,sorted-waves`.
//! * [`PASSES_VAR`] (`1`, `2`): at `2`, the backward runs twice, once on each token's entries in KV rows
//!   `[0, s_kv / 2)` and once on those in `[s_kv / 2, s_kv)` (compacted, with `topk_length`), to time a
//!   two-pass order whose live `d_kv` accumulator is half the size. The second pass overwrites `d_q` and
//!   `d_kv` (timing only; a real two-pass op would add them). E.g. `flashmla bench --op sparse_bwd --ab
//!   FLASHMLA_BENCH_SPARSE_BWD_PASSES=1,2`.
//!
//! The extra inputs (sorted rows, half rows) are uploaded only when one of the run's variants asks for
//! them.

use crate::device_ops::{SparseBwdOnGpu, SparseFwdOnGpu};
use crate::tuning::Tuning;
use flashmla::cuda::{DeviceTensor, Gpu};
use flashmla::ops::sparse_bwd::SparseBwdOptions;
use flashmla::testing::SparseInputs;
use flashmla::{HostTensor, Result, TensorMeta};
use std::str::FromStr;

/// Variable choosing the forward's entry-order experiment ([`FwdOrder`]).
pub const ORDER_VAR: &str = "FLASHMLA_BENCH_SPARSE_FWD_ORDER";
/// Variable choosing the backward's two-pass experiment (`2`; `1`: the op as built).
pub const PASSES_VAR: &str = "FLASHMLA_BENCH_SPARSE_BWD_PASSES";

/// The experiments of one run; `None`: the op as built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Experiments {
    /// [`ORDER_VAR`].
    pub fwd_order: Option<FwdOrder>,
    /// [`PASSES_VAR`]: 1 or 2.
    pub bwd_passes: Option<u8>,
}

/// How the forward's entries are ordered and launched ([`ORDER_VAR`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FwdOrder {
    /// The op as built.
    Index,
    /// One launch per wave of resident tokens.
    Waves,
    /// Index rows sorted by KV row.
    Sorted,
    /// Both.
    SortedWaves,
}

impl FromStr for FwdOrder {
    type Err = ();

    fn from_str(s: &str) -> std::result::Result<Self, ()> {
        match s {
            "index" => Ok(FwdOrder::Index),
            "waves" => Ok(FwdOrder::Waves),
            "sorted" => Ok(FwdOrder::Sorted),
            "sorted-waves" => Ok(FwdOrder::SortedWaves),
            _ => Err(()),
        }
    }
}

impl FwdOrder {
    fn sorted(self) -> bool {
        matches!(self, FwdOrder::Sorted | FwdOrder::SortedWaves)
    }

    fn waves(self) -> bool {
        matches!(self, FwdOrder::Waves | FwdOrder::SortedWaves)
    }
}

/// Each `topk`-entry row of `indices` sorted ascending (invalid `-1` entries first).
pub(crate) fn sorted_rows(indices: &[i32], topk: usize) -> Vec<i32> {
    let mut v = indices.to_vec();
    for row in v.chunks_mut(topk.max(1)) {
        row.sort_unstable();
    }
    v
}

/// Per token, the entries of `indices` (`[s_q, topk]` values) whose KV row lies in the lower (`upper` false) or
/// upper half of `[0, s_kv)`, compacted to the front of the row and padded with -1, and their counts.
fn half_rows(
    indices: &[i32],
    s_q: usize,
    topk: usize,
    s_kv: usize,
    upper: bool,
) -> (Vec<i32>, Vec<i32>) {
    let mid = (s_kv / 2) as i64;
    let mut rows = vec![-1i32; s_q * topk];
    let mut lens = vec![0i32; s_q];
    for t in 0..s_q {
        let mut n = 0;
        for &i in &indices[t * topk..(t + 1) * topk] {
            let v = i64::from(i);
            if v >= 0 && (v < s_kv as i64) && ((v >= mid) == upper) {
                rows[t * topk + n] = i;
                n += 1;
            }
        }
        lens[t] = n as i32;
    }
    (rows, lens)
}

/// The forward's entry-order experiment for one bench shape.
pub struct FwdOrderRuns {
    /// The sorted index rows, when a variant runs on them.
    sorted: Option<DeviceTensor>,
    /// Tokens per wave.
    wave: usize,
}

impl FwdOrderRuns {
    /// Uploads what `variants` need for the problem `inp`.
    pub fn prepare(gpu: &Gpu, inp: &SparseInputs, variants: &[Tuning]) -> Result<Self> {
        let (s_q, h_q) = (inp.q.shape()[0], inp.q.shape()[1]);
        let topk = inp.indices.shape()[2];
        let any_sorted = variants
            .iter()
            .any(|t| t.experiments.fwd_order.is_some_and(FwdOrder::sorted));
        let sorted = if any_sorted {
            let rows = sorted_rows(&inp.indices.to_i32_vec()?, topk);
            Some(gpu.upload(&HostTensor::from_i32(rows, &[s_q, 1, topk])?)?)
        } else {
            None
        };
        Ok(FwdOrderRuns {
            sorted,
            wave: (gpu.info().sm_count as usize / h_q.div_ceil(64)).max(1),
        })
    }

    /// Runs the forward as `t` asks.
    pub fn run(&self, dev: &SparseFwdOnGpu, gpu: &Gpu, t: &Tuning) -> Result<()> {
        let order = t.experiments.fwd_order.unwrap_or(FwdOrder::Index);
        let indices = self.sorted.as_ref().filter(|_| order.sorted());
        let waves = order.waves().then_some(self.wave);
        if indices.is_none() && waves.is_none() {
            dev.run(gpu, &t.fwd)
        } else {
            dev.run_ordered(gpu, &t.fwd, indices, waves)
        }
    }
}

/// The backward's two-pass experiment for one bench shape.
pub struct BwdPassRuns {
    /// Per half of the KV rows: the compacted index rows and their counts (empty unless a variant
    /// runs two passes).
    halves: Vec<(DeviceTensor, DeviceTensor)>,
}

impl BwdPassRuns {
    /// Uploads what `variants` need for the problem `inp`.
    pub fn prepare(gpu: &Gpu, inp: &SparseInputs, variants: &[Tuning]) -> Result<Self> {
        let mut halves = Vec::new();
        if variants.iter().any(|t| t.experiments.bwd_passes == Some(2)) {
            let (s_q, s_kv) = (inp.q.shape()[0], inp.kv.shape()[0]);
            let topk = inp.indices.shape()[2];
            let idx = inp.indices.to_i32_vec()?;
            for upper in [false, true] {
                let (rows, lens) = half_rows(&idx, s_q, topk, s_kv, upper);
                halves.push((
                    gpu.upload(&HostTensor::from_i32(rows, &[s_q, 1, topk])?)?,
                    gpu.upload(&HostTensor::from_i32(lens, &[s_q])?)?,
                ));
            }
        }
        Ok(BwdPassRuns { halves })
    }

    /// Runs the backward with `options` as `t` asks.
    pub fn run(
        &self,
        dev: &SparseBwdOnGpu,
        gpu: &Gpu,
        options: &SparseBwdOptions,
        t: &Tuning,
    ) -> Result<()> {
        if t.experiments.bwd_passes == Some(2) && !self.halves.is_empty() {
            for (rows, lens) in &self.halves {
                dev.run_indices(gpu, options, rows, Some(lens))?;
            }
            Ok(())
        } else {
            dev.run(gpu, options)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{half_rows, sorted_rows, FwdOrder};

    #[test]
    fn sorted_rows_sorts_each_row_on_its_own() {
        let idx = [5, -1, 3, 9, 2, 8, 0, 1];
        assert_eq!(sorted_rows(&idx, 4), [-1, 3, 5, 9, 0, 1, 2, 8]);
    }

    #[test]
    fn half_rows_split_every_valid_entry_once_and_drop_invalid_ones() {
        // s_kv 10: rows [0, 5) are the lower half. Token 0 holds both halves, an out-of-range row and -1; token 1
        // only upper rows.
        let idx = [0, 7, 4, 10, 5, -1, 9, 8, 6, 5, 7, 9];
        let (lo, lo_len) = half_rows(&idx, 2, 6, 10, false);
        let (hi, hi_len) = half_rows(&idx, 2, 6, 10, true);
        assert_eq!(lo, [0, 4, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1]);
        assert_eq!(lo_len, [2, 0]);
        assert_eq!(hi, [7, 5, -1, -1, -1, -1, 9, 8, 6, 5, 7, 9]);
        assert_eq!(hi_len, [2, 6]);
    }

    #[test]
    fn orders_parse_and_say_what_they_change() {
        let parsed: Vec<FwdOrder> = ["index", "waves", "sorted", "sorted-waves"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(
            parsed
                .iter()
                .map(|o| (o.sorted(), o.waves()))
                .collect::<Vec<_>>(),
            [(false, false), (false, true), (true, false), (true, true)]
        );
        assert!("sorted_waves".parse::<FwdOrder>().is_err());
    }
}
