//! `flashmla bench`: times ops with CUDA events (warm-up, many repetitions, median) on the standard shapes of
//! docs/benchmarking.md and writes JSON records carrying the GPU, driver, commit and date.

mod decode_dense;
mod decode_sparse;
mod dense_prefill;
#[cfg(feature = "experiments")]
pub(crate) mod experiments;
mod kv_quant;
mod sparse_bwd;
mod sparse_fwd;

use crate::clocks::{ClockStats, Nvml, Sampler};
use crate::report::{progress, table, LogProgress};
use crate::tuning::Tuning;
use crate::{meta, signals, write_json};
use flashmla::cuda::Gpu;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;

/// Which shapes to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchSuite {
    /// The standard shapes (docs/benchmarking.md, section 5).
    Standard,
    /// One small shape per op (smoke test).
    Small,
    /// The V3.2 sparse shape (`s_q` 4096, `h_q` 128, `d_qk` 576) at `topk` 2048 and `s_kv` from 8K
    /// to 128K in finer steps than the standard suite, then at `s_kv` 8K with `topk` 512 to 8192 (how
    /// the time splits into per-tile and per-CTA work); the sparse decode at `b` 128, `s_q` 2,
    /// `topk` 256 to 8192 (V3.2 at `h_q` 64 and 128, MODEL1 at 64), and V3.2 `h_q` 64 with 64 tiles a
    /// part in 1 to 8 requests (how its time splits into per-tile and per-chunk work); the other ops
    /// time their standard shapes.
    Sweep,
}

/// Which index pattern the sparse ops use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IndexChoice {
    /// Distinct random rows.
    Random,
    /// 31 of 32 indices in the last 20000 rows.
    Local,
    /// Random and local.
    Both,
    /// Random rows of an 8192-row window that slides with the token (the best a KV-row reordering could give).
    Window,
}

/// Arguments of `flashmla bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Which shapes to time.
    #[arg(long, value_enum, default_value_t = BenchSuite::Standard)]
    suite: BenchSuite,
    /// Only these ops (comma-separated, e.g. `sparse_fwd,kv_quantize`); all when absent.
    #[arg(long, value_delimiter = ',')]
    op: Vec<String>,
    /// Index pattern for sparse ops.
    #[arg(long, value_enum, default_value_t = IndexChoice::Both)]
    indices: IndexChoice,
    /// Only the shapes whose fields include all of these `key=value` pairs (separated by spaces or
    /// commas, e.g. `--shape "s_kv=32768 h_q=128"`; keys as printed in the shape column). Repeat the
    /// flag to select several shapes; all shapes of the suite when absent.
    #[arg(long = "shape")]
    shapes: Vec<String>,
    /// Write the records as a JSON array here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Untimed runs before timing.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Timed runs (the median is reported).
    #[arg(long, default_value_t = 30)]
    reps: usize,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// A/B comparison inside one process: `VAR=a,b,...` times every shape once per value of the
    /// launch-choice variable VAR (e.g. `FLASHMLA_SPARSE_FWD_PIPELINE=split,alternating`; the other
    /// variables keep their values from the environment), on the same inputs, the values alternating
    /// over `--rounds` rounds; one record per value. An empty value or `auto` is the measured choice.
    #[arg(long)]
    ab: Option<String>,
    /// Rounds per shape: each round times `--reps` runs per value (after `--cooldown-ms`), the
    /// values alternating inside a round; the reported median is over all rounds' runs and the
    /// JSON keeps each round's median. Default: 3 with `--ab` or `--timing full-clock`, else 1.
    #[arg(long)]
    rounds: Option<usize>,
    /// Idle this many milliseconds before each timed run (warm-up included). A run short enough
    /// (about 100 ms of full load on an H100) then starts and stays below the board's power cap, so
    /// that variants compare at full clock; the `SM MHz` column shows whether they did. Default: 0
    /// (1500 with `--timing full-clock`).
    #[arg(long)]
    cooldown_ms: Option<u64>,
    /// How each shape is timed with respect to the board's power state (an H100 under full tensor
    /// load reaches its power cap after ~100 ms and then lowers its clocks).
    #[arg(long, value_enum, default_value_t = Timing::BackToBack)]
    timing: Timing,
}

/// `--timing`: the power state each shape is timed in.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// `--warmup` then `--reps` runs, shapes back to back: short suites run at full clock, long ones
    /// partly at the power cap.
    BackToBack,
    /// Blocks below the power cap: idle 1500 ms before each (unless `--cooldown-ms`), then as many
    /// warm-up and timed runs as fit in ~30 ms of load (at least 3 timed, at most `--warmup` /
    /// `--reps`, from one probe call); 3 rounds unless `--rounds`. ~30 ms is the regime of the
    /// ~798 TFLOPS bf16 GEMM ceiling; ~80 ms blocks already run partly throttled on some cards.
    FullClock,
    /// At the power cap: before each block, ~2 s of untimed calls (at least `--warmup`), then
    /// `--reps` timed runs: what sustained use such as training gets.
    Sustained,
}

/// Load per timed block of `--timing full-clock`, milliseconds: short enough that neither the GEMM
/// ceiling (8192^3 bf16: -2.6% in 80 ms blocks) nor the sparse forward (-4 to -8%) slows within a block.
const FULL_CLOCK_BLOCK_MS: f32 = 30.0;
/// Idle time before each block of `--timing full-clock` when `--cooldown-ms` is not given.
const FULL_CLOCK_COOLDOWN_MS: u64 = 1500;
/// Untimed load before each block of `--timing sustained`, milliseconds: well past the ~100 ms after
/// which the power cap acts.
const SUSTAINED_WARMUP_MS: f32 = 2000.0;

/// A probe's time per call, or a block's worth when the probe measured nothing usable.
fn usable_call_ms(call_ms: f32) -> f32 {
    if call_ms.is_finite() && call_ms > 0.0 {
        call_ms
    } else {
        FULL_CLOCK_BLOCK_MS
    }
}

/// Warm-up and timed runs of one `--timing full-clock` block for a call of `call_ms`: a quarter of
/// the block (at least one run, at most `max_warmup`) warms up, the rest is timed (at least 3, at
/// most `max_reps`).
fn full_clock_counts(call_ms: f32, max_warmup: usize, max_reps: usize) -> (usize, usize) {
    let call_ms = usable_call_ms(call_ms);
    let fit = |ms: f32| (ms / call_ms) as usize;
    let warmup = fit(FULL_CLOCK_BLOCK_MS / 4.0).clamp(1, max_warmup.max(1));
    let left = FULL_CLOCK_BLOCK_MS - warmup as f32 * call_ms;
    let reps = fit(left.max(0.0)).clamp(3, max_reps.max(3));
    (warmup, reps)
}

/// Untimed runs before each `--timing sustained` block: ~2 s of calls of `call_ms`, at least
/// `min_warmup` and at least one.
fn sustained_warmup(call_ms: f32, min_warmup: usize) -> usize {
    let n = (SUSTAINED_WARMUP_MS / usable_call_ms(call_ms)).ceil() as usize;
    n.max(min_warmup).max(1)
}

/// The `--ab` spec: the variable and its values (`None`: no A/B).
fn ab_spec(spec: Option<&str>) -> Result<Option<(String, Vec<String>)>, String> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    let (var, values) = spec
        .split_once('=')
        .ok_or_else(|| format!("--ab: expected VAR=value,value..., got {spec:?}"))?;
    if var.is_empty() {
        return Err(format!("--ab: expected VAR=value,value..., got {spec:?}"));
    }
    Ok(Some((
        var.to_string(),
        values.split(',').map(str::to_string).collect(),
    )))
}

/// The launch choices to time every shape with: `base` (from the environment), or one per `--ab`
/// value, each `base` with the A/B variable set to that value.
fn variants(base: &Tuning, ab: Option<&str>) -> Result<Vec<Tuning>, String> {
    match ab_spec(ab)? {
        None => Ok(vec![base.clone()]),
        Some((var, values)) => values
            .iter()
            .map(|v| base.with(&var, v).map_err(|e| format!("--ab: {e}")))
            .collect(),
    }
}

/// One benchmark record (docs/benchmarking.md, section 7).
#[derive(Serialize, Clone, Debug, Default)]
pub struct Record {
    /// Op name (`sparse_fwd`, `kv_quantize`, ...).
    pub op: String,
    /// Shape fields that apply.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub s_q: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub s_kv: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topk: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub h_q: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub d_qk: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub d_v: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub causal: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub indices: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<usize>,
    /// Decode: tokens per cache block, and `skewed` for the 1 x 131072 + 127 x 1024 batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seqlens: Option<String>,
    /// Decode: element type of q and the cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Device memory the op allocates beyond its inputs and outputs, bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extra_bytes: Option<usize>,
    /// Input sets the timed calls rotate through (every call takes the next), where more than one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_sets: Option<usize>,
    /// The launch-choice variables set for this record, `VAR=value` separated by spaces (the `--ab`
    /// value last); absent when every choice was the measured one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
    /// Median time per call, microseconds.
    pub time_us: f64,
    /// Fastest and slowest repetition, microseconds.
    pub min_us: f64,
    pub max_us: f64,
    /// `--timing` when not `back-to-back`: `full-clock` or `sustained`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timing: Option<String>,
    /// Idle time before each timed block, milliseconds (`--cooldown-ms`, `--timing full-clock`;
    /// absent when the blocks ran back to back).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cooldown_ms: Option<u64>,
    /// Median of each round, microseconds, in order (only with more than one round).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub round_median_us: Vec<f64>,
    /// Tera-FLOP per second (ops with arithmetic).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tflops: Option<f64>,
    /// Gigabytes per second of compulsory traffic.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gb_per_s: Option<f64>,
    pub reps: usize,
    pub gpu: String,
    pub driver: String,
    /// The toolkit the kernels were built with (`nvcc --version`'s last line); absent when unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub toolkit: Option<String>,
    /// The device's maximum SM clock, MHz (not the clock of the run: see `run_sm_clock_mhz`).
    pub sm_clock_mhz: Option<u32>,
    /// Mean and lowest SM clock sampled (NVML, every 5 ms) while the reps were timed, MHz; absent without NVML.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_sm_clock_mhz: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_sm_clock_mhz_min: Option<u32>,
    /// Highest board power sampled meanwhile, watts. NVML's reading is an average over up to a second, so it lags
    /// short runs; the power cap itself acts on the instantaneous draw (see `run_clock_limits`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_power_w_max: Option<f64>,
    /// Why the clock was below its maximum at some sample (e.g. `sw_power_cap`); empty when it never was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_clock_limits: Option<Vec<String>>,
    /// Board energy per call, joules: NVML's energy counter over the timed calls and their warm-up, divided by
    /// their number (the whole board: memory and idle power included). Coarse for intervals under a few seconds
    /// (two arms of equal speed read 2.9 and 3.4 J over ~0.45 s intervals): compare it over long runs only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_joules_per_call: Option<f64>,
    pub commit: String,
    pub date: String,
}

/// The closure a benchmark times: one call of the op with the given launch choices.
pub type Timed = Box<dyn FnMut(&Tuning) -> flashmla::Result<()>>;

/// Prepares a benchmark's inputs on the GPU and returns what to time; the slice holds every launch
/// choice the closure will be called with.
pub type Setup = Box<dyn Fn(&Gpu, &[Tuning]) -> flashmla::Result<Timed>>;

/// A benchmark: its record template (shape fields), its work counts, and a closure that runs the op once.
pub struct Bench {
    /// Record with the shape fields filled in.
    pub record: Record,
    /// Floating-point operations per call (0 when not meaningful).
    pub flop: f64,
    /// Compulsory bytes per call.
    pub bytes: f64,
    /// Prepares inputs and returns the closure to time.
    pub setup: Setup,
}

/// Ops timed only when `--op` names them (variants of another op's shapes).
const OPT_IN_OPS: &[&str] = &[
    sparse_bwd::DETERMINISTIC_OP,
    dense_prefill::DETERMINISTIC_OP,
    dense_prefill::FUSED_OP,
];

/// Every benchmark of a suite.
fn suite_benches(suite: BenchSuite, indices: IndexChoice) -> Vec<Bench> {
    let mut v = Vec::new();
    v.extend(sparse_fwd::benches(suite, indices));
    v.extend(sparse_bwd::benches(suite, indices, false));
    v.extend(sparse_bwd::benches(suite, indices, true));
    v.extend(kv_quant::benches(suite));
    v.extend(decode_dense::benches(suite));
    v.extend(decode_sparse::benches(suite));
    for pass in [
        dense_prefill::Pass::Forward,
        dense_prefill::Pass::Backward,
        dense_prefill::Pass::BackwardDeterministic,
        dense_prefill::Pass::BackwardFused,
    ] {
        v.extend(dense_prefill::benches(suite, pass));
    }
    v
}

/// Every op name `--op` accepts (the ops of every suite), in suite order.
fn known_ops() -> Vec<String> {
    let mut ops: Vec<String> = Vec::new();
    for suite in [BenchSuite::Standard, BenchSuite::Small, BenchSuite::Sweep] {
        for b in suite_benches(suite, IndexChoice::Both) {
            if !ops.contains(&b.record.op) {
                ops.push(b.record.op);
            }
        }
    }
    ops
}

/// The benchmarks of `args.suite` that `--op` selects; an op name no suite knows is an error listing the ops.
fn all_benches(args: &BenchArgs) -> Result<Vec<Bench>, String> {
    let known = known_ops();
    if let Some(bad) = args.op.iter().find(|o| !known.contains(o)) {
        return Err(format!(
            "unknown --op {bad:?}; the ops are: {}",
            known.join(", ")
        ));
    }
    Ok(suite_benches(args.suite, args.indices)
        .into_iter()
        .filter(|b| op_selected(&args.op, &b.record.op))
        .collect())
}

/// Whether `--op` (empty: every op that is not opt-in) selects `op`.
fn op_selected(ops: &[String], op: &str) -> bool {
    if ops.is_empty() {
        !OPT_IN_OPS.contains(&op)
    } else {
        ops.iter().any(|o| o == op)
    }
}

/// Whether a shape label (`shape_label`) is selected by the `--shape` specs: no spec, or one spec whose
/// every `key=value` token is a field of the label.
fn shape_selected(specs: &[String], label: &str) -> bool {
    let fields: Vec<&str> = label.split(' ').collect();
    specs.is_empty()
        || specs.iter().any(|spec| {
            spec.split(|c: char| c == ',' || c.is_whitespace())
                .filter(|tok| !tok.is_empty())
                .all(|tok| fields.contains(&tok))
        })
}

fn median(v: &mut [f32]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2] as f64
    } else {
        (v[n / 2 - 1] as f64 + v[n / 2] as f64) / 2.0
    }
}

/// Runs the benchmarks; returns the process exit code.
pub fn run(args: &BenchArgs) -> Result<u8, String> {
    let (benches, others): (Vec<Bench>, Vec<Bench>) = all_benches(args)?
        .into_iter()
        .partition(|b| shape_selected(&args.shapes, &shape_label(&b.record)));
    if benches.is_empty() {
        if others.is_empty() {
            return Err(format!(
                "the {:?} suite has no shape for --op {:?} (`--suite` picks another)",
                args.suite, args.op
            ));
        }
        let known: Vec<String> = others
            .iter()
            .map(|b| format!("  {} {}", b.record.op, shape_label(&b.record)))
            .collect();
        return Err(format!(
            "no benchmark matches --op {:?} --shape {:?}; the suite's shapes for these ops:\n{}",
            args.op,
            args.shapes,
            known.join("\n")
        ));
    }
    let base = Tuning::from_env()?;
    let tunings = variants(&base, args.ab.as_deref())?;
    let rounds = args
        .rounds
        .unwrap_or(if args.ab.is_some() || args.timing == Timing::FullClock {
            3
        } else {
            1
        })
        .max(1);
    let cooldown_ms = args
        .cooldown_ms
        .unwrap_or(if args.timing == Timing::FullClock {
            FULL_CLOCK_COOLDOWN_MS
        } else {
            0
        });
    let gpu = Gpu::new(args.device).map_err(|e| e.to_string())?;
    let info = gpu.info().clone();
    println!(
        "flashmla bench: {} on {} ({} SMs, driver {}), commit {}",
        benches.len(),
        info.name,
        info.sm_count,
        info.driver_version,
        meta::COMMIT
    );
    let nvml = Nvml::for_device(&info).map(Arc::new);
    match &nvml {
        Some(n) => println!(
            "SM clock sampled during each run (NVML): now {} MHz, max {} MHz, power limit {} W",
            n.sm_clock_mhz().map_or("?".into(), |v| v.to_string()),
            info.sm_clock_mhz.map_or("?".into(), |v| v.to_string()),
            n.power_limit_w().map_or("?".into(), |v| format!("{v:.0}")),
        ),
        None => println!("SM clock not sampled: NVML (libnvidia-ml.so.1) is not available"),
    }
    if let (None, Some(label)) = (&args.ab, base.label()) {
        println!("launch choices from the environment: {label}");
    }
    let bar = progress(benches.len() as u64, "bench");
    // Every shape is logged (a shape takes seconds); the JSON is rewritten after each one, so a run
    // that is stopped keeps what it measured.
    let mut log = LogProgress::new("bench", benches.len(), std::time::Duration::ZERO);
    let mut records: Vec<Record> = Vec::new();
    let mut outcome = Ok(());
    'benches: for b in &benches {
        // Ctrl-C: stop before the next shape (what was measured is printed and written below).
        if signals::interrupted() {
            break;
        }
        bar.set_message(b.record.op.clone());
        let mut f = match (b.setup)(&gpu, &tunings) {
            Ok(f) => f,
            Err(e) => {
                outcome = Err(format!("{}: {e}", b.record.op));
                break;
            }
        };
        let probe = match args.timing {
            Timing::BackToBack => Ok(f32::NAN),
            Timing::FullClock | Timing::Sustained => {
                std::thread::sleep(std::time::Duration::from_millis(cooldown_ms));
                gpu.time_ms(1, 1, || f(&tunings[0])).map(|t| t[0])
            }
        };
        let call_ms = match probe {
            Ok(t) => t,
            Err(e) => {
                outcome = Err(format!("{}: {e}", b.record.op));
                break;
            }
        };
        let (warmup, reps) = match args.timing {
            Timing::BackToBack => (args.warmup, args.reps.max(1)),
            Timing::FullClock => full_clock_counts(call_ms, args.warmup, args.reps),
            Timing::Sustained => (sustained_warmup(call_ms, args.warmup), args.reps.max(1)),
        };
        let mut samples: Vec<Vec<f32>> = vec![Vec::new(); tunings.len()];
        let mut clocks: Vec<Option<ClockStats>> = vec![None; tunings.len()];
        let mut round_medians: Vec<Vec<f64>> = vec![Vec::new(); tunings.len()];
        for _ in 0..rounds {
            for (((tuning, ms), seen), round_med) in tunings
                .iter()
                .zip(samples.iter_mut())
                .zip(clocks.iter_mut())
                .zip(round_medians.iter_mut())
            {
                if cooldown_ms > 0 {
                    std::thread::sleep(std::time::Duration::from_millis(cooldown_ms));
                }
                let sampler = nvml.as_ref().map(Sampler::start);
                let timed = gpu.time_ms(warmup, reps, || f(tuning));
                let calls = warmup + reps;
                if let Some(stats) = sampler.and_then(|s| s.stop(calls)) {
                    seen.get_or_insert_with(ClockStats::default).merge(&stats);
                }
                match timed {
                    Ok(mut t) => {
                        if rounds > 1 {
                            round_med.push((median(&mut t) * 1e4).round() / 10.0);
                        }
                        ms.extend(t)
                    }
                    Err(e) => {
                        outcome = Err(format!("{}: {e}", b.record.op));
                        break 'benches;
                    }
                }
            }
        }
        for (((tuning, mut ms), seen), round_med) in
            tunings.iter().zip(samples).zip(clocks).zip(round_medians)
        {
            let (lo, hi) = ms
                .iter()
                .fold((f32::MAX, 0f32), |(l, h), &x| (l.min(x), h.max(x)));
            let med = median(&mut ms);
            let secs = med * 1e-3;
            let mut r = b.record.clone();
            r.variant = tuning.label();
            r.time_us = med * 1e3;
            r.min_us = lo as f64 * 1e3;
            r.max_us = hi as f64 * 1e3;
            r.round_median_us = round_med;
            r.cooldown_ms = (cooldown_ms > 0).then_some(cooldown_ms);
            r.timing = match args.timing {
                Timing::BackToBack => None,
                Timing::FullClock => Some("full-clock".into()),
                Timing::Sustained => Some("sustained".into()),
            };
            r.tflops = (b.flop > 0.0).then(|| b.flop / secs / 1e12);
            r.gb_per_s = (b.bytes > 0.0).then(|| b.bytes / secs / 1e9);
            r.reps = ms.len();
            r.gpu = info.name.clone();
            r.driver = info.driver_version.clone();
            r.toolkit = (!flashmla::cuda::NVCC_VERSION.is_empty())
                .then(|| flashmla::cuda::NVCC_VERSION.into());
            r.sm_clock_mhz = info.sm_clock_mhz;
            if let Some(c) = seen {
                r.run_sm_clock_mhz = Some((c.mean_mhz * 10.0).round() / 10.0);
                r.run_sm_clock_mhz_min = Some(c.min_mhz);
                r.run_power_w_max = Some((c.max_power_w * 10.0).round() / 10.0);
                r.run_joules_per_call = c.joules_per_call().map(|j| (j * 1e4).round() / 1e4);
                r.run_clock_limits = Some(c.reasons);
            }
            r.commit = meta::COMMIT.to_string();
            r.date = meta::today();
            records.push(r);
        }
        bar.inc(1);
        let shape_records = &records[records.len() - tunings.len()..];
        let summary: Vec<String> = shape_records
            .iter()
            .map(|r| {
                let row = table_row(r);
                format!("{} {}: {} us, {} TFLOPS", row[0], row[1], row[2], row[3])
            })
            .collect();
        log.step(&bar, bar.position() as usize, &summary.join("; "));
        if let Some(path) = &args.json {
            write_json(path, &records)?;
        }
    }
    bar.finish_and_clear();
    // What was measured is shown (and was written) even when a later shape failed.
    if !records.is_empty() {
        let rows: Vec<Vec<String>> = records.iter().map(table_row).collect();
        print!("{}", table(&TABLE_HEADER, &rows));
        for (shape, ratio) in deterministic_ratios(&records) {
            println!("deterministic / default time, {shape}: {ratio:.2}x");
        }
    }
    if let Some(path) = &args.json {
        write_json(path, &records)?;
        println!("wrote {} records to {}", records.len(), path.display());
    }
    outcome?;
    Ok(0)
}

/// Columns of the printed table (`table_row` fills them in this order).
const TABLE_HEADER: [&str; 7] = [
    "op", "shape", "time_us", "TFLOPS", "GB/s", "SM MHz", "J/call",
];

/// One printed row per record.
fn table_row(r: &Record) -> Vec<String> {
    vec![
        r.op.clone(),
        match &r.variant {
            Some(v) => format!("{} {v}", shape_label(r)),
            None => shape_label(r),
        },
        format!("{:.1}", r.time_us),
        r.tflops.map_or("-".into(), |t| format!("{t:.1}")),
        r.gb_per_s.map_or("-".into(), |g| format!("{g:.0}")),
        clock_cell(r),
        r.run_joules_per_call
            .map_or("-".into(), |j| format!("{j:.3}")),
    ]
}

/// For every deterministic backward record (op `<op>_deterministic`) with a default backward record (`<op>`) of the
/// same shape and variant in the same run: (shape, deterministic time / default time).
fn deterministic_ratios(records: &[Record]) -> Vec<(String, f64)> {
    let label = |r: &Record| match &r.variant {
        Some(v) => format!("{} {v}", shape_label(r)),
        None => shape_label(r),
    };
    records
        .iter()
        .filter_map(|det| {
            let base = det.op.strip_suffix("_deterministic")?;
            let shape = label(det);
            records
                .iter()
                .find(|r| r.op == base && label(r) == shape && r.time_us > 0.0)
                .map(|default| (shape, det.time_us / default.time_us))
        })
        .collect()
}

/// The table's clock column: mean (lowest) sampled SM clock, and the limiting reasons if any.
fn clock_cell(r: &Record) -> String {
    match (r.run_sm_clock_mhz, r.run_sm_clock_mhz_min) {
        (Some(mean), Some(min)) => {
            let limits = r.run_clock_limits.as_deref().unwrap_or_default();
            if limits.is_empty() {
                format!("{mean:.0} ({min})")
            } else {
                format!("{mean:.0} ({min}) {}", limits.join(","))
            }
        }
        _ => "-".into(),
    }
}

fn shape_label(r: &Record) -> String {
    let mut parts = Vec::new();
    let mut add = |k: &str, v: Option<String>| {
        if let Some(v) = v {
            parts.push(format!("{k}={v}"));
        }
    };
    add("b", r.b.map(|x| x.to_string()));
    add("s_q", r.s_q.map(|x| x.to_string()));
    add("s_kv", r.s_kv.map(|x| x.to_string()));
    add("topk", r.topk.map(|x| x.to_string()));
    add("h_q", r.h_q.map(|x| x.to_string()));
    add("d_qk", r.d_qk.map(|x| x.to_string()));
    add("causal", r.causal.map(|x| x.to_string()));
    add("idx", r.indices.clone());
    add("fmt", r.format.clone());
    add("tokens", r.tokens.map(|x| x.to_string()));
    add("page", r.page_size.map(|x| x.to_string()));
    add("seqlens", r.seqlens.clone());
    add("dtype", r.dtype.clone());
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::{
        deterministic_ratios, full_clock_counts, op_selected, shape_selected, sparse_bwd,
        sustained_warmup, table_row, variants, Record, TABLE_HEADER,
    };
    use crate::tuning::Tuning;
    use flashmla::ops::sparse_fwd::SparseFwdPipeline;

    #[test]
    fn opt_in_ops_run_only_when_named() {
        let none: Vec<String> = Vec::new();
        assert!(op_selected(&none, "sparse_bwd"));
        assert!(!op_selected(&none, "sparse_bwd_deterministic"));
        let named = vec!["sparse_bwd_deterministic".to_string()];
        assert!(op_selected(&named, "sparse_bwd_deterministic"));
        assert!(!op_selected(&named, "sparse_bwd"));
    }

    #[test]
    fn sustained_blocks_start_after_two_seconds_of_load() {
        assert_eq!(sustained_warmup(3.4, 5), 589);
        assert_eq!(sustained_warmup(16.0, 5), 125);
        assert_eq!(sustained_warmup(4000.0, 5), 5);
        assert_eq!(sustained_warmup(4000.0, 0), 1);
        assert_eq!(sustained_warmup(f32::NAN, 0), 67);
    }

    #[test]
    fn full_clock_blocks_fit_30_ms_of_load() {
        // V3.2 forward (~3.4 ms): 2 warm-up, 6 timed; backward (~15 ms): 1 + 3 (the minimum).
        assert_eq!(full_clock_counts(3.4, 5, 30), (2, 6));
        assert_eq!(full_clock_counts(15.0, 5, 30), (1, 3));
        // Short calls stop at --warmup / --reps; long ones still time 3 runs after one warm-up.
        assert_eq!(full_clock_counts(0.1, 5, 30), (5, 30));
        assert_eq!(full_clock_counts(200.0, 5, 30), (1, 3));
        assert_eq!(full_clock_counts(0.1, 0, 0), (1, 3));
        // A failed probe (non-finite or zero time) falls back to one block-sized call.
        assert_eq!(full_clock_counts(f32::NAN, 5, 30), (1, 3));
        assert_eq!(full_clock_counts(0.0, 5, 30), (1, 3));
        for ms in [0.05f32, 0.9, 3.7, 15.8, 40.0] {
            let (w, r) = full_clock_counts(ms, 5, 30);
            assert!(r >= 3 && w >= 1);
            assert!((w + r) as f32 * ms <= 30.0 || r == 3, "{ms} ms: {w} + {r}");
        }
    }

    #[test]
    fn ab_specs_build_one_tuning_per_value_or_name_the_expectation() {
        let base = Tuning::default()
            .with("FLASHMLA_SPARSE_BWD_PDL", "off")
            .unwrap();
        assert_eq!(variants(&base, None).unwrap(), std::slice::from_ref(&base));
        let v = variants(
            &base,
            Some("FLASHMLA_SPARSE_FWD_PIPELINE=split,alternating,"),
        )
        .unwrap();
        assert_eq!(
            v.iter().map(|t| t.fwd.pipeline).collect::<Vec<_>>(),
            [
                Some(SparseFwdPipeline::Split),
                Some(SparseFwdPipeline::Alternating),
                None
            ]
        );
        // The environment's other choices stay; the label names every assignment.
        assert!(v.iter().all(|t| t.bwd.pdl == Some(false)));
        assert_eq!(
            v[0].label().as_deref(),
            Some("FLASHMLA_SPARSE_BWD_PDL=off FLASHMLA_SPARSE_FWD_PIPELINE=split")
        );
        for bad in ["novalue", "=a,b"] {
            let e = variants(&base, Some(bad)).unwrap_err();
            assert!(e.contains("VAR=value"), "{e}");
        }
        let e = variants(&base, Some("FLASHMLA_SPARSE_FWD_PIPELINE=split,fast")).unwrap_err();
        assert!(
            e.starts_with("--ab: FLASHMLA_SPARSE_FWD_PIPELINE=\"fast\""),
            "{e}"
        );
        let e = variants(&base, Some("FLASHMLA_X=1,2")).unwrap_err();
        assert!(e.contains("not a launch choice"), "{e}");
    }

    #[test]
    fn deterministic_ratios_pair_records_of_one_shape() {
        let rec = |op: &str, s_kv: usize, time_us: f64| Record {
            op: op.into(),
            s_kv: Some(s_kv),
            time_us,
            ..Record::default()
        };
        let records = [
            rec("sparse_bwd", 8192, 100.0),
            rec("sparse_bwd", 32768, 200.0),
            rec(sparse_bwd::DETERMINISTIC_OP, 32768, 360.0),
            rec(sparse_bwd::DETERMINISTIC_OP, 65536, 500.0),
        ];
        let got = deterministic_ratios(&records);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].0.contains("32768"));
        assert!((got[0].1 - 1.8).abs() < 1e-12);
    }

    #[test]
    fn table_rows_fill_every_column() {
        let mut r = Record {
            op: "sparse_fwd".into(),
            s_kv: Some(8192),
            time_us: 3400.0,
            tflops: Some(687.3),
            ..Record::default()
        };
        let row = table_row(&r);
        assert_eq!(row.len(), TABLE_HEADER.len());
        assert_eq!(row[5], "-");
        r.run_sm_clock_mhz = Some(1541.2);
        r.run_sm_clock_mhz_min = Some(1215);
        r.run_clock_limits = Some(vec!["sw_power_cap".into()]);
        r.run_joules_per_call = Some(2.8377);
        let row = table_row(&r);
        assert_eq!(row[5], "1541 (1215) sw_power_cap");
        assert_eq!(row[6], "2.838");
    }

    #[test]
    fn shape_specs_select_by_every_field_and_any_spec() {
        let label = "s_q=4096 s_kv=32768 topk=2048 h_q=128 d_qk=576 idx=random";
        assert!(shape_selected(&[], label));
        assert!(shape_selected(&["s_kv=32768 h_q=128".into()], label));
        assert!(shape_selected(&["s_kv=32768,idx=random".into()], label));
        assert!(!shape_selected(&["s_kv=32768 h_q=64".into()], label));
        assert!(!shape_selected(&["s_kv=3276".into()], label));
        assert!(shape_selected(
            &["h_q=64".into(), "topk=2048".into()],
            label
        ));
    }
}
