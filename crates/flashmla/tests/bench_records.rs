//! Every file in `bench/results/` follows the record schema of docs/benchmarking.md (section 7): a JSON array of
//! benchmark records (`op`, its shape fields, `time_us`, the clock and regime of the run) or of check records
//! (`name`, `passed`, `seed`, `seconds`, `detail`), each with the `gpu`, `commit` and `date` it was measured on.
//! The rates a record states must follow from its shape and time by the counting rules of section 1.

use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

type Record = Map<String, Value>;

fn results_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results")
}

/// The files of `bench/results/`, sorted by name.
fn result_files() -> Vec<PathBuf> {
    let dir = results_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .collect();
    files.sort();
    files
}

fn string<'a>(r: &'a Record, key: &str) -> Result<&'a str, String> {
    match r.get(key) {
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(s),
        Some(other) => Err(format!("`{key}` must be a non-empty string, got {other}")),
        None => Err(format!("`{key}` is missing")),
    }
}

fn positive(r: &Record, key: &str) -> Result<f64, String> {
    match r.get(key).and_then(Value::as_f64) {
        Some(v) if v.is_finite() && v > 0.0 => Ok(v),
        Some(v) => Err(format!("`{key}` must be a finite number > 0, got {v}")),
        None => Err(format!("`{key}` must be a number, got {:?}", r.get(key))),
    }
}

fn count(r: &Record, key: &str) -> Result<u64, String> {
    match r.get(key).and_then(Value::as_u64) {
        Some(v) if v > 0 => Ok(v),
        _ => Err(format!(
            "`{key}` must be an integer > 0, got {:?}",
            r.get(key)
        )),
    }
}

/// `gpu`, `commit` (a git hash, `-dirty` allowed) and `date` (`YYYY-MM-DD`), which every record carries.
fn check_provenance(r: &Record) -> Result<(), String> {
    string(r, "gpu")?;
    let commit = string(r, "commit")?;
    let hash = commit.strip_suffix("-dirty").unwrap_or(commit);
    if !(7..=40).contains(&hash.len()) || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "`commit` must be a git hash of 7 to 40 hex digits (optionally `-dirty`), got {commit:?}"
        ));
    }
    let date = string(r, "date")?;
    let parts: Vec<&str> = date.split('-').collect();
    let numbers: Option<Vec<u32>> = parts.iter().map(|p| p.parse().ok()).collect();
    let valid = match (parts.as_slice(), numbers.as_deref()) {
        ([y, m, d], Some([_, month, day])) => {
            y.len() == 4
                && m.len() == 2
                && d.len() == 2
                && (1..=12).contains(month)
                && (1..=31).contains(day)
        }
        _ => false,
    };
    if !valid {
        return Err(format!("`date` must be YYYY-MM-DD, got {date:?}"));
    }
    Ok(())
}

/// A check record: one case of `flashmla check`.
fn check_case(r: &Record) -> Result<(), String> {
    let name = string(r, "name")?;
    if !name.contains('/') {
        return Err(format!("`name` must be `<family>/<case>`, got {name:?}"));
    }
    if !r.get("passed").is_some_and(Value::is_boolean) {
        return Err(format!(
            "`passed` must be a boolean, got {:?}",
            r.get("passed")
        ));
    }
    if !r.get("seed").is_some_and(Value::is_u64) {
        return Err(format!(
            "`seed` must be an unsigned integer, got {:?}",
            r.get("seed")
        ));
    }
    match r.get("seconds").and_then(Value::as_f64) {
        Some(s) if s.is_finite() && s >= 0.0 => {}
        other => return Err(format!("`seconds` must be a number >= 0, got {other:?}")),
    }
    if !r.get("detail").is_some_and(Value::is_string) {
        return Err(format!(
            "`detail` must be a string, got {:?}",
            r.get("detail")
        ));
    }
    check_provenance(r)
}

/// `stated` agrees with `expected` within the rounding of the stored figures.
fn agrees(key: &str, stated: f64, expected: f64) -> Result<(), String> {
    if ((stated - expected) / expected).abs() <= 5e-3 {
        Ok(())
    } else {
        Err(format!(
            "`{key}` is {stated}, but the shape and `time_us` give {expected:.1} (docs/benchmarking.md, section 1)"
        ))
    }
}

/// The sparse prefill shape fields; returns FLOP per call for `(d_qk, d_v)` weights of the op.
fn sparse_flop(r: &Record, qk_weight: f64, v_weight: f64) -> Result<f64, String> {
    let [s_q, topk, h_q, d_qk, d_v] =
        ["s_q", "topk", "h_q", "d_qk", "d_v"].map(|k| count(r, k).map(|v| v as f64));
    count(r, "s_kv")?;
    let indices = string(r, "indices")?;
    if !["random", "local", "window"].contains(&indices) {
        return Err(format!(
            "`indices` must be random, local or window, got {indices:?}"
        ));
    }
    Ok(2.0 * s_q? * topk? * h_q? * (qk_weight * d_qk? + v_weight * d_v?))
}

/// The dense prefill shape fields (`lens`, a list of sequence lengths, or `seqlens`, the same comma-separated; `h_q`,
/// `d_qk`, `d_v`, `causal`); returns FLOP per call: `2 * sum(s^2) * h_q * (d_qk + d_v)`, halved under the mask.
fn dense_prefill_flop(r: &Record) -> Result<f64, String> {
    let lens: Vec<f64> = match (r.get("lens"), r.get("seqlens")) {
        (Some(Value::Array(a)), _) => a.iter().filter_map(Value::as_f64).collect(),
        (_, Some(Value::String(s))) => s.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
        _ => return Err("`lens` (array) or `seqlens` (comma-separated) is missing".into()),
    };
    if lens.is_empty() || lens.iter().any(|&l| l <= 0.0) {
        return Err(format!("sequence lengths must be positive, got {lens:?}"));
    }
    let [h_q, d_qk, d_v] = ["h_q", "d_qk", "d_v"].map(|k| count(r, k).map(|v| v as f64));
    let causal = r
        .get("causal")
        .and_then(Value::as_bool)
        .ok_or("`causal` must be a boolean")?;
    let pairs: f64 = lens.iter().map(|l| l * l).sum();
    let full = 2.0 * pairs * h_q? * (d_qk? + d_v?);
    Ok(if causal { full / 2.0 } else { full })
}

/// A record of `bench/side_by_side.py` against the peer: `regime` short or sustained (then the record is also
/// a benchmark record of its op, and `vs_peer` = `peer_time_us / time_us`), or `host` (op `host_cost`: CPU time
/// per call of tiny calls, no clock).
fn side_by_side(r: &Record) -> Result<bool, String> {
    let Some(regime) = r.get("regime") else {
        return Ok(false);
    };
    let regime = regime.as_str().unwrap_or("");
    let time_us = positive(r, "time_us")?;
    let given = |key: &str| r.get(key).is_some_and(|v| !v.is_null());
    if given("peer_time_us") || regime == "host" {
        let peer_us = positive(r, "peer_time_us")?;
        agrees("vs_peer", positive(r, "vs_peer")?, peer_us / time_us)?;
    } else if given("vs_peer") {
        return Err("`vs_peer` without `peer_time_us`".into());
    }
    match regime {
        "host" => {
            if string(r, "op")? != "host_cost" {
                return Err("a `host` regime record must have op `host_cost`".into());
            }
            count(r, "calls")?;
            check_provenance(r)?;
            Ok(true)
        }
        "short" | "sustained" => Ok(false),
        other => Err(format!(
            "`regime` must be short, sustained or host, got {other:?}"
        )),
    }
}

/// A benchmark record of `flashmla bench`, `bench/gemm_ceiling.py` or `bench/side_by_side.py`.
fn bench_record(r: &Record) -> Result<(), String> {
    if side_by_side(r)? {
        return Ok(());
    }
    let op = string(r, "op")?;
    let time_us = positive(r, "time_us")?;
    if op != "gemm_bf16" {
        count(r, "reps")?;
    }
    check_provenance(r)?;
    match r.get("timing") {
        None => {}
        Some(Value::String(t)) if t == "full-clock" || t == "sustained" => {}
        Some(other) => {
            return Err(format!(
                "`timing` must be full-clock or sustained (absent: back to back), got {other}"
            ))
        }
    }
    // The clock the run had (the device's maximum, `sm_clock_mhz`, says nothing about the run).
    let clock = if op == "gemm_bf16" {
        "sm_clock_mhz_mean"
    } else {
        "run_sm_clock_mhz"
    };
    positive(r, clock)?;
    let secs = time_us * 1e-6;
    let tflops = |flop: f64| agrees("tflops", positive(r, "tflops")?, flop / secs / 1e12);
    match op {
        "sparse_fwd" => tflops(sparse_flop(r, 1.0, 1.0)?),
        "sparse_bwd" | "sparse_bwd_deterministic" => tflops(sparse_flop(r, 3.0, 2.0)?),
        "gemm_bf16" => {
            let [m, n, k] = ["m", "n", "k"].map(|key| count(r, key).map(|v| v as f64));
            tflops(2.0 * m? * n? * k?)
        }
        "kv_quantize" | "kv_dequantize" => {
            let format = string(r, "format")?;
            let bytes_per_token = match format {
                "v32" => 656.0,
                "model1" => 584.0,
                _ => return Err(format!("`format` must be v32 or model1, got {format:?}")),
            };
            let bytes =
                count(r, "tokens")? as f64 * (2.0 * count(r, "d_qk")? as f64 + bytes_per_token);
            agrees("gb_per_s", positive(r, "gb_per_s")?, bytes / secs / 1e9)
        }
        "decode_dense" | "decode_sparse" | "decode_sparse_fp8" => {
            for key in ["b", "s_q", "h_q", "d_qk", "d_v"] {
                count(r, key)?;
            }
            positive(r, "tflops")
                .or_else(|_| positive(r, "gb_per_s"))
                .map(|_| ())
        }
        "dense_prefill" => tflops(dense_prefill_flop(r)?),
        "dense_prefill_bwd" | "dense_prefill_bwd_deterministic" | "dense_prefill_bwd_fused" => {
            tflops(2.5 * dense_prefill_flop(r)?)
        }
        _ => Err(format!(
            "op {op:?} has no schema: add its shape fields to this test and to docs/benchmarking.md"
        )),
    }
}

/// Checks one file; returns its record count.
fn check_file(path: &Path) -> Result<usize, String> {
    if path.extension().and_then(|e| e.to_str()) != Some("json") || !path.is_file() {
        return Err("bench/results/ holds JSON record files only (logs and other outputs stay in git history)".into());
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?;
    let records = value
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or("must be a non-empty JSON array of records")?;
    for (i, record) in records.iter().enumerate() {
        let r = record
            .as_object()
            .ok_or_else(|| format!("record {i} is not an object"))?;
        let outcome = if r.contains_key("op") {
            bench_record(r)
        } else if r.contains_key("name") {
            check_case(r)
        } else {
            Err("neither a bench record (`op`) nor a check record (`name`)".into())
        };
        outcome.map_err(|e| format!("record {i}: {e}"))?;
    }
    Ok(records.len())
}

#[test]
fn every_kept_record_follows_the_schema() {
    let files = result_files();
    assert!(!files.is_empty(), "bench/results/ is empty");
    let mut errors = Vec::new();
    let mut records = 0;
    for path in &files {
        match check_file(path) {
            Ok(n) => records += n,
            Err(e) => errors.push(format!("{}: {e}", path.display())),
        }
    }
    assert!(
        errors.is_empty(),
        "schema violations:\n{}",
        errors.join("\n")
    );
    assert!(records > 0);
}

fn record(json: &str) -> Record {
    serde_json::from_str::<Value>(json)
        .expect("test JSON")
        .as_object()
        .expect("an object")
        .clone()
}

const FWD: &str = r#"{"op": "sparse_fwd", "s_q": 4096, "s_kv": 32768, "topk": 2048, "h_q": 128, "d_qk": 576,
    "d_v": 512, "indices": "random", "time_us": 3640.0, "tflops": 642.1, "reps": 9, "timing": "full-clock",
    "run_sm_clock_mhz": 1980.0, "gpu": "NVIDIA H100 80GB HBM3", "commit": "f04db3130a18", "date": "2026-11-26"}"#;

#[test]
fn the_schema_accepts_a_complete_record() {
    // 2 * 4096 * 2048 * 128 * 1088 FLOP in 3640 us: 642.1 TFLOPS.
    assert_eq!(bench_record(&record(FWD)), Ok(()));
}

#[test]
fn the_schema_rejects_what_a_record_must_not_lack() {
    for (change, why) in [
        (r#""commit": "f04db3130a18""#, r#""commit": "v3.2""#),
        (r#""gpu": "NVIDIA H100 80GB HBM3""#, r#""gpu": """#),
        (r#""date": "2026-11-26""#, r#""date": "26.11.2026""#),
        (r#""run_sm_clock_mhz": 1980.0"#, r#""sm_clock_mhz": 1980"#),
        (r#""timing": "full-clock""#, r#""timing": "fast""#),
        (r#""tflops": 642.1"#, r#""tflops": 700.0"#),
        (r#""indices": "random""#, r#""indices": "zeros""#),
        (r#""op": "sparse_fwd""#, r#""op": "something_new""#),
    ] {
        let json = FWD.replace(change, why);
        assert_ne!(json, FWD, "{change} not found in the template");
        assert!(bench_record(&record(&json)).is_err(), "accepted: {why}");
    }
    let check = r#"{"name": "sparse_fwd/h64/plain", "passed": true, "seed": 7, "seconds": 0.1, "detail": "ok",
        "gpu": "NVIDIA H200", "commit": "0c60dff77bb0", "date": "2026-11-26"}"#;
    assert_eq!(check_case(&record(check)), Ok(()));
    assert!(check_case(&record(&check.replace(r#", "commit": "0c60dff77bb0""#, ""))).is_err());
}
