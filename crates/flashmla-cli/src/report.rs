//! Terminal output helpers: progress bars and aligned tables.

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
