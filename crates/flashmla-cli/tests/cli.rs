//! The `flashmla` command as a user meets it on a machine without a GPU (issue 27): wrong devices and op names are
//! errors that say what exists, a closed pipe ends the output quietly, Ctrl-C stops a CPU run cleanly.
#![cfg(unix)]

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Exit code of a command that could not run.
const EXIT_ERROR: i32 = 2;
/// Exit code of a command stopped by Ctrl-C.
const EXIT_INTERRUPTED: i32 = 130;

fn flashmla(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashmla"))
        .args(args)
        .output()
        .expect("the flashmla binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_gpu_that_cannot_be_used_is_an_error_not_a_silent_cpu_run() {
    let o = flashmla(&["demo", "--device", "99"]);
    assert_eq!(o.status.code(), Some(EXIT_ERROR), "{}", stderr(&o));
    assert!(stderr(&o).contains("--device 99"), "{}", stderr(&o));
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("demo passed"),
        "nothing ran"
    );
    let o = flashmla(&["demo", "--device", "gpu7"]);
    assert_eq!(o.status.code(), Some(EXIT_ERROR));
    assert!(stderr(&o).contains("expected `cpu`"), "{}", stderr(&o));
}

#[test]
fn an_unknown_op_is_an_error_naming_the_ops() {
    let o = flashmla(&["bench", "--op", "sparse_fw"]);
    assert_eq!(o.status.code(), Some(EXIT_ERROR), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("unknown --op \"sparse_fw\""), "{e}");
    for op in ["sparse_fwd", "sparse_bwd", "kv_quantize"] {
        assert!(e.contains(op), "bench ops should list {op}: {e}");
    }

    let o = flashmla(&["check", "--op", "decode_fp9", "--list"]);
    assert_eq!(o.status.code(), Some(EXIT_ERROR), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("unknown --op \"decode_fp9\""), "{e}");
    for op in ["kv_quant", "sparse_fwd", "sparse_bwd"] {
        assert!(e.contains(op), "check ops should list {op}: {e}");
    }

    let o = flashmla(&["check", "--filter", "no-such-case", "--list"]);
    assert_eq!(o.status.code(), Some(EXIT_ERROR), "{}", stderr(&o));
    assert!(stderr(&o).contains("no case"), "{}", stderr(&o));
}

#[test]
fn check_lists_the_cases_of_one_op() {
    let o = flashmla(&["check", "--op", "sparse_fwd", "--list"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.lines().count() > 1);
    assert!(out.lines().all(|l| l.starts_with("sparse_fwd/")), "{out}");
}

/// `flashmla check --list | head -1`, deterministically: stdout is a pipe whose reader is already gone.
#[test]
fn printing_into_a_closed_pipe_ends_quietly() {
    let mut fds = [0; 2];
    // SAFETY: `pipe` fills two new descriptors, each then owned by exactly one OwnedFd.
    let (reader, writer) = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    drop(reader);
    let o = Command::new(env!("CARGO_BIN_EXE_flashmla"))
        .args(["check", "--list"])
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let e = stderr(&o);
    assert!(!e.contains("panicked"), "{e}");
    assert!(e.is_empty(), "nothing to say about a closed pipe: {e}");
    assert!(
        o.status.signal() == Some(libc::SIGPIPE) || o.status.success(),
        "{:?}",
        o.status
    );
}

/// Ctrl-C during the CPU demo: the run stops at the next query token, says so, and exits with 130.
#[test]
fn ctrl_c_stops_a_cpu_run_cleanly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flashmla"))
        .args(["demo", "--device", "cpu"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    if child.try_wait().unwrap().is_some() {
        // A machine fast enough to finish the demo in 0.3 s cannot show the interruption.
        eprintln!("the CPU demo finished before Ctrl-C could be sent");
        return;
    }
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    let sent = Instant::now();
    // SAFETY: signals a child process of this test that has not been reaped yet.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let o = child.wait_with_output().unwrap();
    let (out, e) = (String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert!(out.contains("device: CPU (requested)"), "{out}");
    assert_eq!(o.status.code(), Some(EXIT_INTERRUPTED), "{out}\n{e}");
    assert!(e.contains("flashmla: interrupted"), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    assert!(!out.contains("demo passed"), "{out}");
    // The demo's CPU problem takes seconds per phase: stopping must not wait for the phase to end.
    assert!(
        sent.elapsed() < Duration::from_secs(60),
        "{:?}",
        sent.elapsed()
    );
}
