//! Terminal output helpers: progress bars and aligned tables.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar over `len` steps, drawn on stderr (hidden when stderr is not a terminal).
pub fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(what.to_string());
    bar
}

/// Progress for logs: where the bar is hidden (stderr not a terminal, e.g. a CI log or a remote
/// run), a line on stderr after a step when `every` has passed since the last one, and after the
/// last step, so that a long run shows where it is and what a killed run had reached.
pub struct LogProgress {
    what: &'static str,
    len: usize,
    every: Duration,
    last: Instant,
}

impl LogProgress {
    /// For `len` steps of `what` (e.g. "bench"), a line at most every `every`.
    pub fn new(what: &'static str, len: usize, every: Duration) -> Self {
        Self {
            what,
            len,
            every,
            last: Instant::now(),
        }
    }

    /// Step `done` (1-based) finished with `msg`; prints only while `bar` is hidden. Returns whether
    /// it printed.
    pub fn step(&mut self, bar: &ProgressBar, done: usize, msg: &str) -> bool {
        if !bar.is_hidden() {
            return false;
        }
        if done >= self.len || self.last.elapsed() >= self.every {
            eprintln!("{} {done}/{}: {msg}", self.what, self.len);
            self.last = Instant::now();
            return true;
        }
        false
    }
}

/// A spinner for one long step.
pub fn spinner(msg: &str) -> ProgressBar {
    let s = ProgressBar::new_spinner();
    s.set_message(msg.to_string());
    s.enable_steady_tick(std::time::Duration::from_millis(120));
    s
}

/// Renders rows as an aligned table with a header rule. Every row has one cell per header column.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    debug_assert!(
        rows.iter().all(|r| r.len() == header.len()),
        "a table row's cells do not match the header's columns"
    );
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| -> String {
        cells
            .iter()
            .zip(&width)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let rule: Vec<String> = width.iter().map(|w| "-".repeat(*w)).collect();
    let mut out = format!(
        "{}\n{}\n",
        line(header.to_vec()),
        line(rule.iter().map(String::as_str).collect())
    );
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_progress_prints_on_its_period_and_always_after_the_last_step() {
        let hidden = ProgressBar::hidden();
        let mut every_step = LogProgress::new("bench", 3, Duration::ZERO);
        assert!((1..=3).all(|i| every_step.step(&hidden, i, "x")));
        let mut hourly = LogProgress::new("check", 3, Duration::from_secs(3600));
        assert!(!hourly.step(&hidden, 1, "x"));
        assert!(!hourly.step(&hidden, 2, "x"));
        assert!(
            hourly.step(&hidden, 3, "x"),
            "the last step is always logged"
        );
    }

    #[test]
    fn tables_align_their_columns() {
        let t = table(&["a", "bb"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "a    bb\n---  --\nxyz  1\n");
    }
}
