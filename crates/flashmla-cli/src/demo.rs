//! `flashmla demo`: sparse MLA forward + backward on a built-in problem (DeepSeek V3.2 widths), verified against
//! the f64 reference. On an sm_90 GPU both kernels run at the V3.2 standard benchmark shape of
//! docs/benchmarking.md (sampled tokens verified) and the backward also on a small problem (every element
//! verified); on a machine without one, the CPU reference runs a problem small enough to finish in seconds.
//!
//! Where it runs: `--device cpu` (or `--cpu`) the CPU; `--device N` GPU `N`, and an error when that GPU cannot be
//! used (absent, not sm_90), never a silent fallback; no `--device`: GPU 0 when it is an sm_90 GPU, else the CPU
//! (saying why).

use crate::device_ops::{SparseBwdOnGpu, SparseFwdOnGpu};
use crate::report::spinner;
use crate::signals;
use flashmla::cuda::Gpu;
use flashmla::ops::sparse_bwd::{sparse_bwd_cpu_with, SparseBwdArgs, SparseBwdOptions};
use flashmla::ops::sparse_fwd::{sparse_fwd_cpu_with, SparseFwdArgs, SparseFwdTuning, D_V};
use flashmla::reference::compare::{compare, Tolerance, BWD_GRAD, PREFILL_LSE, PREFILL_OUT};
use flashmla::reference::sparse_bwd::{sparse_bwd_with, SparseBwdProblem};
use flashmla::reference::sparse_fwd::{sparse_fwd_rows_with, sparse_fwd_with};
use flashmla::testing::{peer_bf16, rng, SinkKind, SparseCase, SparseValues};
use flashmla::{DType, HostTensor};
use std::time::Instant;

/// Where `flashmla demo` runs (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU reference.
    Cpu,
    /// The CUDA device of this ordinal.
    Cuda(usize),
}

/// Parses `cpu`, `N` or `cuda:N`.
fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    if s.eq_ignore_ascii_case("cpu") {
        return Ok(DeviceChoice::Cpu);
    }
    s.strip_prefix("cuda:")
        .unwrap_or(s)
        .parse()
        .map(DeviceChoice::Cuda)
        .map_err(|_| format!("expected `cpu`, a CUDA device ordinal or `cuda:N`, got {s:?}"))
}

/// Arguments of `flashmla demo`.
#[derive(clap::Args)]
pub struct DemoArgs {
    /// Run on the CPU even when a GPU is present (the same as `--device cpu`).
    #[arg(long, conflicts_with = "device")]
    cpu: bool,
    /// `cpu`, or the CUDA device ordinal (`N` or `cuda:N`) to run on: an error when that GPU cannot be used.
    /// Default: GPU 0 when it is an sm_90 GPU, else the CPU.
    #[arg(long, value_parser = parse_device)]
    device: Option<DeviceChoice>,
    /// Seed of the generated inputs.
    #[arg(long, default_value_t = 2026)]
    seed: u64,
}

/// The GPU problem: the V3.2 standard benchmark shape at s_kv 32K (docs/benchmarking.md).
const GPU_SHAPE: (usize, usize, usize, usize, usize) = (4096, 32768, 128, 576, 2048);
/// The CPU problem: same widths, few tokens.
const CPU_SHAPE: (usize, usize, usize, usize, usize) = (32, 4096, 128, 576, 512);
/// Query rows of the GPU problem verified against the f64 reference.
const SAMPLED_ROWS: usize = 16;

fn fwd_flop(s_q: usize, topk: usize, h_q: usize, d_qk: usize) -> f64 {
    2.0 * (s_q * topk * h_q) as f64 * (d_qk + D_V) as f64
}

fn bwd_flop(s_q: usize, topk: usize, h_q: usize, d_qk: usize) -> f64 {
    2.0 * (s_q * topk * h_q) as f64 * (3 * d_qk + 2 * D_V) as f64
}

fn verdict(name: &str, got: &[f32], want: &[f64], tol: &Tolerance) -> (bool, String) {
    let c = compare(got, want);
    match c.check(tol) {
        Ok(()) => (
            true,
            format!("{name} ok (max abs err {:.1e})", c.max_abs_err),
        ),
        Err(e) => (false, format!("{name} FAILED: {e}")),
    }
}

fn report(what: &str, checks: Vec<(bool, String)>) -> bool {
    let ok = checks.iter().all(|c| c.0);
    let text: Vec<String> = checks.into_iter().map(|c| c.1).collect();
    println!("  {what} vs f64 reference: {}", text.join(", "));
    ok
}

fn case(shape: (usize, usize, usize, usize, usize)) -> SparseCase {
    let (s_q, s_kv, h_q, d_qk, topk) = shape;
    let mut c = SparseCase::plain(s_q, s_kv, h_q, d_qk, topk);
    c.sink = SinkKind::Random;
    c.invalid_frac = 0.02;
    c
}

/// Forward on the GPU at the benchmark shape; returns whether the sampled rows verified.
fn gpu_forward(gpu: &Gpu, seed: u64) -> flashmla::Result<bool> {
    let (s_q, s_kv, h_q, d_qk, topk) = GPU_SHAPE;
    println!(
        "sparse forward on {}: s_q={s_q} s_kv={s_kv} h_q={h_q} d_qk={d_qk} topk={topk}, with sink",
        gpu.info().name
    );
    let sp = spinner("generating inputs");
    let inp = case(GPU_SHAPE).generate(seed)?;
    sp.set_message("uploading");
    let dev = SparseFwdOnGpu::new(gpu, &inp, true)?;
    sp.set_message("running");
    let mut ms = gpu.time_ms(3, 10, || dev.run(gpu, &SparseFwdTuning::default()))?;
    ms.sort_by(|a, b| a.total_cmp(b));
    let med = ms[ms.len() / 2] as f64;
    let got = dev.download(gpu)?;
    sp.set_message("verifying sampled rows on the CPU");
    let values = inp.values()?;
    let rows: Vec<usize> = (0..SAMPLED_ROWS)
        .map(|i| i * (s_q - 1) / (SAMPLED_ROWS - 1))
        .collect();
    let want = sparse_fwd_rows_with::<f64>(&values.problem(), &rows, signals::token())?;
    sp.finish_and_clear();
    let pick = |v: &[f32], w: usize| -> Vec<f32> {
        rows.iter()
            .flat_map(|&r| v[r * w..(r + 1) * w].iter().copied())
            .collect()
    };
    println!(
        "  {:.3} ms (median of {}), {:.0} TFLOPS",
        med,
        ms.len(),
        fwd_flop(s_q, topk, h_q, d_qk) / (med * 1e-3) / 1e12
    );
    Ok(report(
        &format!("{SAMPLED_ROWS} sampled rows"),
        vec![
            verdict("out", &pick(&got.out, h_q * D_V), &want.out, &PREFILL_OUT),
            verdict("lse", &pick(&got.lse, h_q), &want.lse, &PREFILL_LSE),
        ],
    ))
}

/// The same tokens' slice of a problem: `d_q` of a token depends only on that token's inputs, so the reference
/// can verify sampled tokens of a problem too large for a full CPU backward.
fn select_tokens(v: &SparseValues, rows: &[usize]) -> SparseValues {
    let pick = |x: &[f32], w: usize| -> Vec<f32> {
        rows.iter()
            .flat_map(|&r| x[r * w..(r + 1) * w].iter().copied())
            .collect()
    };
    SparseValues {
        s_q: rows.len(),
        q: pick(&v.q, v.h_q * v.d_qk),
        indices: rows
            .iter()
            .flat_map(|&r| v.indices[r * v.topk..(r + 1) * v.topk].iter().copied())
            .collect(),
        topk_length: v
            .topk_length
            .as_ref()
            .map(|l| rows.iter().map(|&r| l[r]).collect()),
        ..v.clone()
    }
}

/// Backward on the GPU: timed at the benchmark shape with sampled tokens' `d_q` verified, then every output
/// verified on the small problem.
fn gpu_backward(gpu: &Gpu, seed: u64) -> flashmla::Result<bool> {
    let (s_q, s_kv, h_q, d_qk, topk) = GPU_SHAPE;
    println!(
        "sparse backward on {}: same shape, random d_out",
        gpu.info().name
    );
    let sp = spinner("generating inputs");
    let inp = case(GPU_SHAPE).generate(seed)?;
    let d_out_values = peer_bf16(&mut rng(seed ^ 0xd0), s_q * h_q * D_V);
    let d_out = HostTensor::bf16_from_f32(&d_out_values, &[s_q, h_q, D_V])?;
    sp.set_message("uploading, forward");
    let dev = SparseBwdOnGpu::new(gpu, &inp, &d_out, DType::Bf16, true)?;
    sp.set_message("running");
    let opts = SparseBwdOptions::default();
    let mut ms = gpu.time_ms(2, 8, || dev.run(gpu, &opts))?;
    ms.sort_by(|a, b| a.total_cmp(b));
    let med = ms[ms.len() / 2] as f64;
    let got = dev.download(gpu)?;
    let fwd = dev.fwd.download(gpu)?;
    sp.set_message("verifying sampled tokens on the CPU");
    let rows: Vec<usize> = (0..SAMPLED_ROWS)
        .map(|i| i * (s_q - 1) / (SAMPLED_ROWS - 1))
        .collect();
    let sub = select_tokens(&inp.values()?, &rows);
    let pick = |v: &[f32], w: usize| -> Vec<f32> {
        rows.iter()
            .flat_map(|&r| v[r * w..(r + 1) * w].iter().copied())
            .collect()
    };
    let (sub_out, sub_lse, sub_dout) = (
        pick(&fwd.out, h_q * D_V),
        pick(&fwd.lse, h_q),
        pick(&d_out_values, h_q * D_V),
    );
    let want = sparse_bwd_with::<f64>(
        &SparseBwdProblem {
            fwd: sub.problem(),
            out: &sub_out,
            d_out: &sub_dout,
            lse: &sub_lse,
        },
        signals::token(),
    )?;
    sp.finish_and_clear();
    println!(
        "  {:.3} ms (median of {}), {:.0} TFLOPS, f32 d_kv workspace {} MB",
        med,
        ms.len(),
        bwd_flop(s_q, topk, h_q, d_qk) / (med * 1e-3) / 1e12,
        s_kv * d_qk * 4 / 1_000_000
    );
    let mut ok = report(
        &format!("{SAMPLED_ROWS} sampled tokens"),
        vec![
            verdict("d_q", &pick(&got.d_q, h_q * d_qk), &want.d_q, &BWD_GRAD),
            verdict("delta", &pick(&got.delta, h_q), &want.delta, &BWD_GRAD),
        ],
    );

    let (s_q, _, h_q, _, _) = CPU_SHAPE;
    let inp = case(CPU_SHAPE).generate(seed)?;
    let d_out_values = peer_bf16(&mut rng(seed ^ 0xd0), s_q * h_q * D_V);
    let d_out = HostTensor::bf16_from_f32(&d_out_values, &[s_q, h_q, D_V])?;
    let dev = SparseBwdOnGpu::new(gpu, &inp, &d_out, DType::Bf16, true)?;
    dev.run(gpu, &opts)?;
    let got = dev.download(gpu)?;
    let fwd = dev.fwd.download(gpu)?;
    let values = inp.values()?;
    let want = sparse_bwd_with::<f64>(
        &SparseBwdProblem {
            fwd: values.problem(),
            out: &fwd.out,
            d_out: &d_out_values,
            lse: &fwd.lse,
        },
        signals::token(),
    )?;
    let mut checks = vec![
        verdict("d_q", &got.d_q, &want.d_q, &BWD_GRAD),
        verdict("d_kv", &got.d_kv, &want.d_kv, &BWD_GRAD),
        verdict("delta", &got.delta, &want.delta, &BWD_GRAD),
    ];
    if let (Some(g), Some(w)) = (&got.d_attn_sink, &want.d_attn_sink) {
        checks.push(verdict("d_attn_sink", g, w, &BWD_GRAD));
    }
    ok &= report(
        &format!("every element of a small problem (s_q={s_q}) on the GPU"),
        checks,
    );
    Ok(ok)
}

/// Forward + backward on the CPU at the small shape; returns whether everything verified.
fn cpu_forward_backward(seed: u64) -> flashmla::Result<bool> {
    let (s_q, s_kv, h_q, d_qk, topk) = CPU_SHAPE;
    let inp = case(CPU_SHAPE).generate(seed)?;
    let values = inp.values()?;
    let problem = values.problem();
    let mut ok = true;
    let args = SparseFwdArgs {
        q: &inp.q,
        kv: &inp.kv,
        indices: &inp.indices,
        sm_scale: inp.sm_scale,
        attn_sink: inp.attn_sink.as_ref(),
        topk_length: None,
    };
    let t0 = Instant::now();
    let fwd = sparse_fwd_cpu_with(&args, signals::token())?;
    let t_fwd = t0.elapsed().as_secs_f64();
    {
        println!("sparse forward on the CPU reference: s_q={s_q} s_kv={s_kv} h_q={h_q} d_qk={d_qk} topk={topk}, with sink");
        println!(
            "  {:.2} s, {:.1} GFLOP/s",
            t_fwd,
            fwd_flop(s_q, topk, h_q, d_qk) / t_fwd / 1e9
        );
        let sp = spinner("f64 reference");
        let want = sparse_fwd_with::<f64>(&problem, signals::token())?;
        sp.finish_and_clear();
        ok &= report(
            "all rows",
            vec![
                verdict("out", &fwd.out.to_f32_vec()?, &want.out, &PREFILL_OUT),
                verdict("lse", &fwd.lse.to_f32_vec()?, &want.lse, &PREFILL_LSE),
            ],
        );
    }

    println!("sparse backward on the CPU reference: same problem, random d_out");
    let d_out_values = peer_bf16(&mut rng(seed ^ 0xd0), s_q * h_q * D_V);
    let d_out = HostTensor::bf16_from_f32(&d_out_values, &[s_q, h_q, D_V])?;
    let bargs = SparseBwdArgs {
        q: &inp.q,
        kv: &inp.kv,
        out: &fwd.out,
        d_out: &d_out,
        indices: &inp.indices,
        lse: &fwd.lse,
        sm_scale: inp.sm_scale,
        attn_sink: inp.attn_sink.as_ref(),
        topk_length: None,
        d_kv_dtype: DType::Bf16,
    };
    let t0 = Instant::now();
    let bwd = sparse_bwd_cpu_with(&bargs, signals::token())?;
    let t_bwd = t0.elapsed().as_secs_f64();
    println!(
        "  {:.2} s, {:.1} GFLOP/s",
        t_bwd,
        bwd_flop(s_q, topk, h_q, d_qk) / t_bwd / 1e9
    );
    let sp = spinner("f64 reference");
    let (out_v, lse_v) = (fwd.out.to_f32_vec()?, fwd.lse.to_f32_vec()?);
    let want = sparse_bwd_with::<f64>(
        &SparseBwdProblem {
            fwd: problem,
            out: &out_v,
            d_out: &d_out_values,
            lse: &lse_v,
        },
        signals::token(),
    )?;
    sp.finish_and_clear();
    let mut checks = vec![
        verdict("d_q", &bwd.d_q.to_f32_vec()?, &want.d_q, &BWD_GRAD),
        verdict("d_kv", &bwd.d_kv.to_f32_vec()?, &want.d_kv, &BWD_GRAD),
        verdict("delta", &bwd.delta.to_f32_vec()?, &want.delta, &BWD_GRAD),
    ];
    if let (Some(g), Some(w)) = (&bwd.d_attn_sink, &want.d_attn_sink) {
        checks.push(verdict("d_attn_sink", &g.to_f32_vec()?, w, &BWD_GRAD));
    }
    ok &= report("every element", checks);
    Ok(ok)
}

/// Runs the demo; returns the process exit code.
pub fn run(args: &DemoArgs) -> Result<u8, String> {
    println!("flashmla demo: sparse MLA (DeepSeek V3.2 widths: d_qk 576, d_v 512)");
    let device = if args.cpu {
        Some(DeviceChoice::Cpu)
    } else {
        args.device
    };
    let gpu = match device {
        Some(DeviceChoice::Cpu) => {
            println!("device: CPU (requested)");
            None
        }
        Some(DeviceChoice::Cuda(n)) => {
            let g = Gpu::new(n).map_err(|e| format!("--device {n}: {e}"))?;
            if !g.info().is_sm90() {
                return Err(format!(
                    "--device {n}: {} is not an sm_90 GPU (the kernels are built for sm_90a);                      `--device cpu` runs the CPU reference",
                    g.info().name
                ));
            }
            Some(g)
        }
        None => match Gpu::new(0) {
            Ok(g) if g.info().is_sm90() => Some(g),
            Ok(g) => {
                println!("device: CPU ({} is not an sm_90 GPU)", g.info().name);
                None
            }
            Err(e) => {
                println!("device: CPU ({e})");
                None
            }
        },
    };
    let run = || -> flashmla::Result<bool> {
        match &gpu {
            Some(g) => {
                let fwd_ok = gpu_forward(g, args.seed)?;
                Ok(gpu_backward(g, args.seed)? && fwd_ok)
            }
            None => cpu_forward_backward(args.seed),
        }
    };
    match run() {
        Ok(true) => {
            println!("demo passed");
            Ok(0)
        }
        Ok(false) => {
            println!("demo FAILED verification");
            Ok(crate::EXIT_FAILED)
        }
        Err(e) => Err(e.to_string()),
    }
}
