//! `flashmla`: run, check and measure the flashmla kernels.
//!
//! * `demo`  — sparse MLA forward + backward on a built-in problem (GPU when there is one, else CPU), verified.
//! * `info`  — the GPU, the driver, and which kernels this binary carries.
//! * `check` — the GPU correctness suite against the CPU reference; exits non-zero on any failure.
//! * `bench` — times ops on the standard shapes (docs/benchmarking.md) and writes JSON records.

mod bench;
mod check;
mod clocks;
mod demo;
mod device_ops;
mod info;
mod meta;
mod report;
mod signals;
mod tuning;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "flashmla",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("FLASHMLA_GIT_COMMIT"), ")"),
    about = "Multi-head Latent Attention kernels for Hopper GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Sparse MLA forward + backward on a built-in problem, verified against the f64 reference.
    Demo(demo::DemoArgs),
    /// Show the GPU, the driver and the kernels built into this binary.
    Info {
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// Run the GPU correctness suite against the CPU reference.
    Check(check::CheckArgs),
    /// Time ops and write JSON benchmark records.
    Bench(bench::BenchArgs),
}

/// Exit codes: 0 success, 1 a check failed, 2 the command could not run (bad arguments, no GPU...), 130 stopped
/// by Ctrl-C ([`signals::EXIT_INTERRUPTED`]).
pub const EXIT_FAILED: u8 = 1;
/// See [`EXIT_FAILED`].
pub const EXIT_ERROR: u8 = 2;

fn main() -> ExitCode {
    signals::install();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(a) => demo::run(&a),
        Command::Info { device } => info::run(device),
        Command::Check(a) => check::run(&a),
        Command::Bench(a) => bench::run(&a),
    };
    // Whatever the command made of it (an `Interrupted` error, a partial result), Ctrl-C ends it as such.
    if signals::interrupted() {
        eprintln!("flashmla: interrupted");
        return ExitCode::from(signals::EXIT_INTERRUPTED);
    }
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("flashmla: error: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json(path: &PathBuf, value: &impl serde::Serialize) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))
}
