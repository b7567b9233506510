//! `flashmla check`: the GPU correctness suite. Every case runs a kernel on fresh seeded inputs, with outputs
//! poisoned beforehand, and compares against the CPU reference (bit-exact or spec section 6 tolerances).

mod decode_dense;
mod decode_outputs;
mod decode_sparse;
mod dense_prefill;
mod kv_quant;
mod sparse_bwd;
mod sparse_fwd;

use crate::report::{progress, table, LogProgress};
use crate::tuning::Tuning;
use crate::{meta, signals, write_json, EXIT_FAILED};
use flashmla::cuda::Gpu;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// Which cases to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    /// A fast subset (a minute or less).
    Quick,
    /// Every case.
    Full,
}

/// Arguments of `flashmla check`.
#[derive(clap::Args)]
pub struct CheckArgs {
    /// Which cases to run.
    #[arg(long, value_enum, default_value_t = Suite::Full)]
    suite: Suite,
    /// Only the cases of these op families (comma-separated, e.g. `sparse_fwd,kv_quant`); all when absent.
    #[arg(long, value_delimiter = ',')]
    op: Vec<String>,
    /// Only cases whose name contains this text.
    #[arg(long)]
    filter: Option<String>,
    /// Write per-case results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Base seed; each case derives its own from it and prints it on failure.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// List the cases and exit.
    #[arg(long)]
    list: bool,
}

/// The (s_kv, topk) pairs of the sparse grid (the forward issue's list): tails of every size, topk above and
/// below s_kv, topk 1.
pub const GRID_PAIRS: [(usize, usize); 12] = [
    (128, 128),
    (256, 256),
    (512, 512),
    (592, 128),
    (1840, 256),
    (1592, 384),
    (1521, 512),
    (95, 128),
    (153, 256),
    (114, 384),
    (300, 100),
    (1000, 1),
];

/// Compares `got` with the reference under `tol` (docs/spec.md section 6) as one named check of an [`Outcome`].
pub fn check(
    name: &str,
    got: &[f32],
    want: &[f64],
    tol: &flashmla::reference::compare::Tolerance,
) -> (String, Result<String, String>) {
    check_net(name, got, want, tol, None)
}

/// [`check`], judging each element's error net of `allowance` when one is given (a per-element bound on an
/// error the kernel makes by design; see `reference::compare::compare_with_allowance`).
pub fn check_net(
    name: &str,
    got: &[f32],
    want: &[f64],
    tol: &flashmla::reference::compare::Tolerance,
    allowance: Option<&[f64]>,
) -> (String, Result<String, String>) {
    use flashmla::reference::compare::{compare, compare_with_allowance};
    let c = match allowance {
        Some(a) => compare_with_allowance(got, want, a),
        None => compare(got, want),
    };
    let r = c.check(tol).map(|()| {
        let net = match allowance {
            Some(_) => format!(" (net of the allowance {:.2e})", c.max_net_abs_err),
            None => String::new(),
        };
        format!(
            "max_abs {:.2e}{net} max_rel {:.2e} cos {:.1e}",
            c.max_abs_err, c.max_rel_err, c.cos_diff
        )
    });
    (name.to_string(), r)
}

/// The verdict of one case.
pub struct Outcome {
    /// Whether every comparison passed.
    pub passed: bool,
    /// What was compared and the worst error seen.
    pub detail: String,
}

impl Outcome {
    /// Passes with `detail`, or fails with the first error.
    pub fn from_checks(checks: Vec<(String, Result<String, String>)>) -> Outcome {
        let mut passed = true;
        let mut parts = Vec::new();
        for (what, r) in checks {
            match r {
                Ok(d) => parts.push(format!("{what}: {d}")),
                Err(e) => {
                    passed = false;
                    parts.push(format!("{what}: FAIL {e}"));
                }
            }
        }
        Outcome {
            passed,
            detail: parts.join("; "),
        }
    }
}

/// Runs a case on a GPU with the launch choices and a seed.
type CaseFn = Box<dyn Fn(&Gpu, &Tuning, u64) -> flashmla::Result<Outcome>>;

/// One correctness case.
pub struct Case {
    /// Unique name: `<family>/<parameters>`.
    pub name: String,
    /// Part of the quick suite.
    pub quick: bool,
    /// Runs the case with launch choices and a seed.
    pub run: CaseFn,
}

#[derive(Serialize)]
struct CaseRecord<'a> {
    name: &'a str,
    passed: bool,
    seed: u64,
    seconds: f64,
    detail: String,
    /// Provenance every kept record carries (docs/benchmarking.md, section 7).
    gpu: &'a str,
    commit: &'static str,
    date: &'a str,
}

fn all_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    cases.extend(kv_quant::cases());
    cases.extend(sparse_fwd::cases());
    cases.extend(sparse_bwd::cases());
    cases.extend(decode_dense::cases());
    cases.extend(decode_sparse::cases());
    cases.extend(dense_prefill::cases());
    cases
}

/// Stable per-case seed: the base seed mixed with the case name.
fn case_seed(base: u64, name: &str) -> u64 {
    name.bytes().fold(base ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The op family of a case: its name up to the first `/`.
fn family(name: &str) -> &str {
    name.split('/').next().unwrap_or(name)
}

/// The cases `args` select: `--suite`, `--op` (every name must be a family of the suite), `--filter`. Selecting
/// nothing is an error naming what exists, never an empty run.
fn select(args: &CheckArgs, all: Vec<Case>) -> Result<Vec<Case>, String> {
    let mut families: Vec<String> = Vec::new();
    for c in &all {
        if !families.iter().any(|f| f == family(&c.name)) {
            families.push(family(&c.name).to_string());
        }
    }
    if let Some(bad) = args.op.iter().find(|o| !families.contains(o)) {
        return Err(format!(
            "unknown --op {bad:?}; the ops (case families) are: {}",
            families.join(", ")
        ));
    }
    let cases: Vec<Case> = all
        .into_iter()
        .filter(|c| args.suite == Suite::Full || c.quick)
        .filter(|c| args.op.is_empty() || args.op.iter().any(|o| o == family(&c.name)))
        .filter(|c| {
            args.filter
                .as_ref()
                .is_none_or(|f| c.name.contains(f.as_str()))
        })
        .collect();
    if cases.is_empty() {
        return Err(format!(
            "no case of the {:?} suite matches --op {:?} --filter {:?}; the ops (case families) are: {} \
             (`flashmla check --list` lists the cases)",
            args.suite,
            args.op,
            args.filter.as_deref().unwrap_or(""),
            families.join(", ")
        ));
    }
    Ok(cases)
}

/// Runs the suite; returns the process exit code.
pub fn run(args: &CheckArgs) -> Result<u8, String> {
    let cases = select(args, all_cases())?;
    if args.list {
        for c in &cases {
            println!("{}", c.name);
        }
        return Ok(0);
    }
    let tuning = Tuning::from_env()?;
    let gpu = Gpu::new(args.device).map_err(|e| e.to_string())?;
    let info = gpu.info();
    let date = meta::today();
    println!(
        "flashmla check: {} cases on {} (sm_{}{}, driver {}), commit {}",
        cases.len(),
        info.name,
        info.cc.0,
        info.cc.1,
        info.driver_version,
        meta::COMMIT
    );
    if let Some(label) = tuning.label() {
        println!("launch choices from the environment: {label}");
    }
    let bar = progress(cases.len() as u64, "check");
    // A line every 10 s where the bar is hidden; the JSON is rewritten after each case, so a run that
    // is stopped keeps the verdicts it reached.
    let mut log = LogProgress::new("check", cases.len(), std::time::Duration::from_secs(10));
    let mut records = Vec::new();
    for case in &cases {
        if signals::interrupted() {
            break;
        }
        bar.set_message(case.name.clone());
        let seed = case_seed(args.seed, &case.name);
        let t0 = Instant::now();
        let outcome = (case.run)(&gpu, &tuning, seed).unwrap_or_else(|e| Outcome {
            passed: false,
            detail: format!("error: {e}"),
        });
        if signals::interrupted() {
            // Stopped mid-case by Ctrl-C: no verdict (the JSON keeps the cases before it).
            break;
        }
        let seconds = t0.elapsed().as_secs_f64();
        if !outcome.passed {
            // `suspend`, not `println`: a hidden bar (output not a terminal) would swallow the line.
            bar.suspend(|| println!("FAIL {} (seed {seed}): {}", case.name, outcome.detail));
        }
        records.push(CaseRecord {
            name: &case.name,
            passed: outcome.passed,
            seed,
            seconds,
            detail: outcome.detail,
            gpu: &info.name,
            commit: meta::COMMIT,
            date: &date,
        });
        bar.inc(1);
        let failed = records.iter().filter(|r| !r.passed).count();
        log.step(
            &bar,
            records.len(),
            &format!("{} ({failed} failed so far)", case.name),
        );
        if let Some(path) = &args.json {
            write_json(path, &records)?;
        }
    }
    bar.finish_and_clear();

    // Summary per family.
    let mut families: Vec<(String, usize, usize)> = Vec::new();
    for r in &records {
        let fam = r.name.split('/').next().unwrap_or("").to_string();
        match families.iter_mut().find(|f| f.0 == fam) {
            Some(f) => {
                f.1 += r.passed as usize;
                f.2 += (!r.passed) as usize;
            }
            None => families.push((fam, r.passed as usize, (!r.passed) as usize)),
        }
    }
    let rows: Vec<Vec<String>> = families
        .iter()
        .map(|(f, p, x)| vec![f.clone(), p.to_string(), x.to_string()])
        .collect();
    print!("{}", table(&["family", "passed", "failed"], &rows));
    let failed = records.iter().filter(|r| !r.passed).count();
    if let Some(path) = &args.json {
        write_json(path, &records)?;
    }
    if failed > 0 {
        println!("{failed} of {} cases FAILED", records.len());
        return Ok(EXIT_FAILED);
    }
    println!("all {} cases passed", records.len());
    Ok(0)
}
