//! Cooperative cancellation of long CPU computations.
//!
//! A [`CancelToken`] is a flag that one party sets (another thread, a signal handler: setting it is a single
//! atomic store, async-signal-safe) and a computation polls between units of work (query tokens, KV rows). A
//! cancelled computation stops at the next poll, discards its partial results and returns
//! [`Error::Interrupted`]. The `*_with` CPU entry points of the ops and the references take a token; the plain
//! ones run with [`CancelToken::never`].

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};

/// A cancellation flag shared between a computation and whoever may stop it.
#[derive(Debug, Default)]
pub struct CancelToken {
    cancelled: AtomicBool,
}

/// The token of computations nobody cancels.
static NEVER: CancelToken = CancelToken::new();

impl CancelToken {
    /// A token that is not cancelled (usable in a `static`).
    pub const fn new() -> Self {
        CancelToken {
            cancelled: AtomicBool::new(false),
        }
    }

    /// A shared token that nobody cancels, for calls that cannot be interrupted.
    pub fn never() -> &'static CancelToken {
        &NEVER
    }

    /// Asks every computation polling this token to stop. Async-signal-safe (one atomic store); never undone.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Whether [`CancelToken::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// `Err(Error::Interrupted)` once cancelled.
    pub fn check(&self) -> Result<()> {
        if self.is_cancelled() {
            return Err(Error::Interrupted);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_reports_cancellation_once_cancelled() {
        let t = CancelToken::new();
        assert!(!t.is_cancelled());
        assert_eq!(t.check(), Ok(()));
        t.cancel();
        assert!(t.is_cancelled());
        assert_eq!(t.check(), Err(Error::Interrupted));
        assert!(!CancelToken::never().is_cancelled());
    }
}
