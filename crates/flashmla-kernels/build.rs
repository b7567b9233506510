//! Compiles every kernel family under `csrc/sm90/<family>/<family>.cu` to an sm_90a cubin and embeds it, with
//! the layout of every struct in the families' `params.h` (`build_layout.rs`: parsed from the header, laid out by
//! nvcc's host compiler in a small probe program that this script runs).
//!
//! nvcc is looked up in `NVCC`, `$CUDA_HOME/bin/nvcc`, the repository's `.toolchain/` (see
//! `scripts/toolchain.sh`), then `PATH`. Without nvcc the crate still builds, with no cubins; the library then
//! reports `Error::KernelsNotBuilt` at run time. `FLASHMLA_REQUIRE_KERNELS=1` turns a missing nvcc, a failed
//! compile or a failed layout probe into a build error (CI sets it); without it, a failed probe leaves the
//! build without cubins (no kernel is launched through an unchecked contract).
//!
//! ptxas's report: the full text of every family goes to `$OUT_DIR/ptxas-report.txt`; the build shows only what is
//! news ([`ptxas::review`]: serialised wgmma, spills in a kernel that had none, a known spill that grew, unknown
//! lines), and with `FLASHMLA_REQUIRE_KERNELS=1` serialised wgmma and unexpected spills are build errors.
//! `FLASHMLA_PTXAS_VERBOSE=1` adds one line naming the report file.
//!
//! A family is recompiled only when its inputs change (every source under `csrc/`, nvcc and its flags): the
//! cubin and report of the last compile are kept in `$OUT_DIR` with a key of those inputs, so that changing an
//! environment variable that does not affect the code (`FLASHMLA_PTXAS_VERBOSE`, say) costs no nvcc run.

#[path = "build_support/ptxas.rs"]
mod ptxas;

#[path = "build_layout.rs"]
mod layout;

use std::env;
use std::fs;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

const GENCODE: &str = "-gencode=arch=compute_90a,code=sm_90a";
/// nvcc's flags besides the gencode, the include path and `FLASHMLA_NVCC_FLAGS`.
const NVCC_FLAGS: &[&str] = &[
    "-cubin",
    "-O3",
    "-std=c++17",
    "--use_fast_math",
    "-Xptxas=-warn-spills",
    "-lineinfo",
];

/// A key of everything a compile depends on: nvcc (path and version), the flags, and every source's path and
/// contents (any change recompiles every family, as a header may be shared).
fn compile_key(nvcc: &Path, nvcc_version: &str, extra: &[String], sources: &[PathBuf]) -> String {
    let mut h = DefaultHasher::new();
    (nvcc, nvcc_version, GENCODE, NVCC_FLAGS, extra).hash(&mut h);
    for s in sources {
        s.hash(&mut h);
        fs::read(s).unwrap_or_default().hash(&mut h);
    }
    format!("{:016x}", h.finish())
}

/// The ptxas report of the last compile of `cubin` when `key` matches that compile's, so it need not be redone.
fn cached_report(cubin: &Path, key: &str) -> Option<String> {
    let stored = fs::read_to_string(cubin.with_extension("key")).ok()?;
    if stored != key || !cubin.exists() {
        return None;
    }
    fs::read_to_string(cubin.with_extension("ptxas.txt")).ok()
}

fn find_nvcc(manifest: &Path) -> Option<PathBuf> {
    if let Ok(p) = env::var("NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Ok(home) = env::var("CUDA_HOME") {
        let p = Path::new(&home).join("bin/nvcc");
        if p.exists() {
            return Some(p);
        }
    }
    let local = manifest.join("../../.toolchain/cuda/nvidia/cu13/bin/nvcc");
    if local.exists() {
        return Some(local);
    }
    env::var_os("PATH").and_then(|paths| {
        env::split_paths(&paths)
            .map(|d| d.join("nvcc"))
            .find(|p| p.exists())
    })
}

fn collect_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            collect_sources(&p, out);
        } else if matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("cu" | "cuh" | "h")
        ) {
            out.push(p);
        }
    }
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let csrc = manifest.join("csrc");
    let require = env::var("FLASHMLA_REQUIRE_KERNELS").is_ok_and(|v| v == "1");
    for var in [
        "NVCC",
        "CUDA_HOME",
        "FLASHMLA_REQUIRE_KERNELS",
        "FLASHMLA_NVCC_FLAGS",
        "FLASHMLA_PTXAS_VERBOSE",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed={}", csrc.display());
    println!("cargo:rerun-if-changed=build_layout.rs");
    let mut sources = Vec::new();
    collect_sources(&csrc, &mut sources);
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }

    // Entry translation units: csrc/sm90/<family>/<family>.cu
    let mut families: Vec<(String, PathBuf)> = Vec::new();
    if let Ok(dirs) = fs::read_dir(csrc.join("sm90")) {
        for d in dirs.flatten() {
            let name = d.file_name().to_string_lossy().into_owned();
            let tu = d.path().join(format!("{name}.cu"));
            if tu.exists() {
                families.push((name, tu));
            }
        }
    }
    families.sort();

    let nvcc = find_nvcc(&manifest);
    let mut entries = Vec::new();
    let mut nvcc_version = String::new();
    match &nvcc {
        None => {
            let msg = "nvcc not found (set NVCC or CUDA_HOME, or run scripts/toolchain.sh): \
                       building without GPU kernels";
            if require {
                panic!("{msg}");
            }
            println!("cargo:warning={msg}");
        }
        Some(nvcc) => {
            nvcc_version = Command::new(nvcc)
                .arg("--version")
                .output()
                .ok()
                .and_then(|o| String::from_utf8(o.stdout).ok())
                .and_then(|s| s.lines().last().map(str::to_owned))
                .unwrap_or_default();
            let extra: Vec<String> = env::var("FLASHMLA_NVCC_FLAGS")
                .map(|s| s.split_whitespace().map(str::to_owned).collect())
                .unwrap_or_default();
            let key = compile_key(nvcc, &nvcc_version, &extra, &sources);
            // At most two nvcc processes at once: a heavy TU takes ~2 GB.
            let results: Vec<(String, PathBuf, Result<String, String>)> = families
                .chunks(2)
                .flat_map(|pair| {
                    let handles: Vec<_> = pair
                        .iter()
                        .map(|(name, tu)| {
                            let cubin = out_dir.join(format!("{name}.cubin"));
                            let cached = cached_report(&cubin, &key);
                            if cached.is_none() {
                                // No key vouches for the cubin until this compile succeeds.
                                let _ = fs::remove_file(cubin.with_extension("key"));
                            }
                            let run = match cached {
                                Some(report) => Ok(Ok(report)),
                                None => Command::new(nvcc)
                                    .arg(GENCODE)
                                    .args(NVCC_FLAGS)
                                    .arg(format!("-I{}", csrc.display()))
                                    .args(&extra)
                                    .arg("-o")
                                    .arg(&cubin)
                                    .arg(tu)
                                    .output()
                                    .map(|o| {
                                        let log = String::from_utf8_lossy(&o.stderr).into_owned();
                                        if o.status.success() {
                                            Ok(log)
                                        } else {
                                            Err(log)
                                        }
                                    }),
                            };
                            (name.clone(), cubin, run)
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|(name, cubin, run)| {
                            let r = match run {
                                Ok(Ok(report)) => {
                                    // Written only after a successful compile, so a stale key never
                                    // vouches for a failed one.
                                    fs::write(cubin.with_extension("ptxas.txt"), &report).unwrap();
                                    fs::write(cubin.with_extension("key"), &key).unwrap();
                                    Ok(report)
                                }
                                Ok(Err(log)) => Err(log),
                                Err(e) => Err(e.to_string()),
                            };
                            (name, cubin, r)
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            let mut report = String::new();
            for (name, cubin, r) in results {
                match r {
                    Ok(log) => {
                        report.push_str(&format!("== {name}\n{log}\n"));
                        let findings = ptxas::review(&log, ptxas::KNOWN_SPILLS);
                        for f in &findings {
                            println!("cargo:warning={name}: {}", f.describe());
                        }
                        match findings.iter().find(|f| f.is_error()) {
                            Some(f) if require => {
                                panic!("ptxas report of kernel family `{name}`: {}", f.describe())
                            }
                            _ => entries.push((name, cubin)),
                        }
                    }
                    Err(e) => {
                        if require {
                            panic!("nvcc failed on kernel family `{name}`:\n{e}");
                        }
                        for line in e.lines().take(20) {
                            println!("cargo:warning={name}: {line}");
                        }
                    }
                }
            }
            let report_path = out_dir.join("ptxas-report.txt");
            fs::write(&report_path, report).unwrap();
            if env::var("FLASHMLA_PTXAS_VERBOSE").is_ok_and(|v| v == "1") {
                println!(
                    "cargo:warning=ptxas report (every family, full text): {}",
                    report_path.display()
                );
            }
        }
    }

    let mut layouts = Vec::new();
    if let Some(nvcc) = &nvcc {
        match probe_layouts(nvcc, &csrc, &out_dir, &families) {
            Ok(l) => layouts = l,
            Err(e) if require => panic!("parameter layout probe failed:\n{e}"),
            Err(e) => {
                for line in e.lines().take(20) {
                    println!("cargo:warning=params layout: {line}");
                }
                println!("cargo:warning=params layout unknown: building without GPU kernels");
                entries.clear();
            }
        }
    }

    let mut gen = String::new();
    gen.push_str("/// Embedded cubins: (kernel family, sm_90a cubin bytes).\n");
    gen.push_str("pub static CUBINS: &[(&str, &[u8])] = &[\n");
    for (name, cubin) in &entries {
        gen.push_str(&format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            cubin.display().to_string()
        ));
    }
    gen.push_str("];\n");
    gen.push_str(&format!(
        "/// The nvcc that built the cubins (empty when none was found).\npub const NVCC_VERSION: &str = {nvcc_version:?};\n"
    ));
    let all: Vec<&str> = families.iter().map(|(n, _)| n.as_str()).collect();
    gen.push_str(&format!(
        "/// Every kernel family in the sources, built or not.\npub const FAMILIES: &[&str] = &{all:?};\n"
    ));
    gen.push_str(&layout::layouts_rust(&layouts));
    fs::write(out_dir.join("cubins.rs"), gen).unwrap();
}

/// Lays out every struct of every family's `params.h` with nvcc's host compiler: parses the headers, compiles
/// and runs a program printing `sizeof` / `offsetof` of each field, and checks that it printed every struct.
fn probe_layouts(
    nvcc: &Path,
    csrc: &Path,
    out_dir: &Path,
    families: &[(String, PathBuf)],
) -> Result<Vec<layout::StructLayout>, String> {
    let mut headers = Vec::new();
    for (family, _) in families {
        let include = format!("sm90/{family}/params.h");
        let path = csrc.join(&include);
        if !path.exists() {
            continue;
        }
        let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let structs =
            layout::parse_structs(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        headers.push((family.clone(), include, structs));
    }
    let src = out_dir.join("params_layout_probe.cpp");
    let exe = out_dir.join("params_layout_probe");
    fs::write(&src, layout::probe_source(&headers)).map_err(|e| e.to_string())?;
    let out = Command::new(nvcc)
        .args(["-x", "c++", "-std=c++17", "-cudart", "none"])
        .arg(format!("-I{}", csrc.display()))
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .map_err(|e| format!("{}: {e}", nvcc.display()))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let run = Command::new(&exe)
        .output()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    if !run.status.success() {
        return Err(format!("{} exited with {}", exe.display(), run.status));
    }
    let layouts = layout::parse_probe_output(&String::from_utf8_lossy(&run.stdout))?;
    let expected: usize = headers.iter().map(|(_, _, s)| s.len()).sum();
    if layouts.len() != expected {
        return Err(format!(
            "the probe printed {} structs, the headers define {expected}",
            layouts.len()
        ));
    }
    Ok(layouts)
}
