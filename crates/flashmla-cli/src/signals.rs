//! Ctrl-C and closed pipes.
//!
//! * **SIGINT** (Ctrl-C): the first one sets [`token`], which the CPU references poll between query tokens and
//!   the `check` / `bench` loops between cases, so the command stops at the next such point, keeps what it has
//!   written (the JSON files are rewritten after every case) and exits with [`EXIT_INTERRUPTED`]. It also restores
//!   the default action, so a second Ctrl-C ends the process at once (e.g. during a long GPU run, which does not
//!   poll).
//! * **SIGPIPE**: the default action (end the process quietly) instead of Rust's (ignore it, so that the next
//!   `println!` to a closed pipe panics): `flashmla check --list | head -1` stops printing when `head` is done.

use flashmla::CancelToken;

/// Exit code of a command stopped by Ctrl-C (128 + SIGINT, as shells report it).
pub const EXIT_INTERRUPTED: u8 = 130;

/// Set by the first Ctrl-C.
static INTERRUPT: CancelToken = CancelToken::new();

/// The token Ctrl-C cancels: pass it to every long CPU computation.
pub fn token() -> &'static CancelToken {
    &INTERRUPT
}

/// Whether Ctrl-C was pressed.
pub fn interrupted() -> bool {
    INTERRUPT.is_cancelled()
}

#[cfg(unix)]
extern "C" fn on_sigint(_signal: libc::c_int) {
    INTERRUPT.cancel();
    // SAFETY: `signal` is async-signal-safe; restoring the default action needs no other state.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
}

/// Installs the two dispositions above (Unix; elsewhere Ctrl-C keeps its default action). Called once, first thing
/// in `main`.
#[cfg(unix)]
pub fn install() {
    let handler: extern "C" fn(libc::c_int) = on_sigint;
    // SAFETY: the handler only performs an atomic store and an async-signal-safe call; SIG_DFL for SIGPIPE
    // is the disposition every C program starts with.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
    }
}

/// Installs nothing: the dispositions above are Unix signals.
#[cfg(not(unix))]
pub fn install() {}
