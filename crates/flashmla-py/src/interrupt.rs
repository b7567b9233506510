//! Running an op's CPU path so that Ctrl-C reaches it.
//!
//! Python runs signal handlers in the main thread only, between bytecodes or when native code calls
//! `PyErr_CheckSignals`; a CPU op can take minutes, during which a Ctrl-C would otherwise wait for it. So
//! [`run_cpu`] hands the work to a helper thread and, with the GIL released, waits for it in slices of
//! [`POLL_INTERVAL`]: after each slice it re-attaches and lets Python run pending signal handlers. When a handler
//! raises (`KeyboardInterrupt` for Ctrl-C), the work is cancelled through its [`CancelToken`] (it stops at the
//! next query token or KV row), its result is discarded, and the handler's exception is raised.
//!
//! Called from a thread other than the main one, polling does nothing (Python runs no handler there) and the call
//! simply runs to its end, as it did before.

use crate::errors::guard;
use flashmla::CancelToken;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::time::Duration;

/// How long the caller waits between two checks for signals: the worst-case delay a Ctrl-C sees on top of the
/// time the work takes to reach its next cancellation point.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// Runs `work` (an op's CPU path) on a helper thread, polling for Python signals meanwhile (see the module
/// documentation). Errors become Python exceptions through [`guard`]; a signal handler's exception wins over
/// the work's result.
pub fn run_cpu<T: Send>(
    py: Python<'_>,
    op: &str,
    work: impl FnOnce(&CancelToken) -> flashmla::Result<T> + Send,
) -> PyResult<T> {
    let cancel = CancelToken::new();
    let token = &cancel;
    let (result, raised) = py.detach(|| {
        std::thread::scope(|s| {
            let (done, finished) = channel::<()>();
            let worker = s.spawn(move || {
                let r = guard(op, || work(token));
                // The receiver outlives the worker (joined below): sending cannot fail.
                let _ = done.send(());
                r
            });
            let mut raised = None;
            // Until the worker reports (or drops its sender), check for signals after every slice.
            while let Err(RecvTimeoutError::Timeout) = finished.recv_timeout(POLL_INTERVAL) {
                if raised.is_none() {
                    if let Err(e) = Python::attach(|py| py.check_signals()) {
                        cancel.cancel();
                        raised = Some(e);
                    }
                }
            }
            (worker.join(), raised)
        })
    });
    if let Some(e) = raised {
        return Err(e);
    }
    // `guard` catches the work's panics, so the helper thread itself cannot have panicked.
    result.unwrap_or_else(|_| {
        Err(PyRuntimeError::new_err(format!(
            "internal error in flashmla `{op}`: its CPU worker thread panicked"
        )))
    })
}
