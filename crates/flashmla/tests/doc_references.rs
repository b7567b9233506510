//! The repository is self-contained: every `docs/*.md` and `bench/results/*.json` path that its documents, sources,
//! scripts and help texts cite exists, and none of them cites a document that is not in the repository.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Text files of the repository that may cite documents (build outputs, toolchains and the records excluded).
fn text_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !(name.starts_with('.')
                    || name == "target"
                    || name == "__pycache__"
                    || name == "results")
                {
                    walk(&path, out);
                }
            } else if [".md", ".rs", ".cu", ".cuh", ".h", ".py", ".sh", ".toml"]
                .iter()
                .any(|ext| name.ends_with(ext))
            {
                out.push(path);
            }
        }
    }
    let root = root();
    let mut files = vec![
        root.join("README.md"),
        root.join("pyproject.toml"),
        root.join(".ci/run"),
    ];
    for dir in ["docs", "crates", "python", "scripts", "bench"] {
        walk(&root.join(dir), &mut files);
    }
    files.sort();
    files
}

/// The paths that start with `prefix` in `text` and end in `suffix` (path characters only).
fn cited<'a>(text: &'a str, prefix: &str, suffix: &str) -> Vec<&'a str> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let tail = &rest[at..];
        let len = tail
            .char_indices()
            .find(|&(i, c)| i >= prefix.len() && !(c.is_ascii_alphanumeric() || "._-/".contains(c)))
            .map_or(tail.len(), |(i, _)| i);
        let path = tail[..len].trim_end_matches('.');
        if path.len() > prefix.len() && path.ends_with(suffix) {
            found.push(path);
        }
        rest = &tail[len.max(1)..];
    }
    found
}

#[test]
fn cited_documents_and_records_exist() {
    let root = root();
    let mut missing = Vec::new();
    for file in text_files() {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for path in
            cited(&text, "docs/", ".md")
                .into_iter()
                .chain(cited(&text, "bench/results/", ".json"))
        {
            if !root.join(path).is_file() {
                missing.push(format!(
                    "{}: {path}",
                    file.strip_prefix(&root).unwrap_or(&file).display()
                ));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "cited but not in the repository:\n{}",
        missing.join("\n")
    );
}

#[test]
fn no_document_outside_the_repository_is_cited() {
    // Spelled in pieces so that this file does not cite them itself.
    let outside = [
        ["PERF", ".md"],
        ["PEER", ".md"],
        ["DESIGN-NOTES", ".md"],
        ["STYLE", ".md"],
        ["DEVICE", ".md"],
        ["../sha", "red"],
    ]
    .map(|p| p.concat());
    let bare_word = ["SP", "EC"].concat();
    let root = root();
    let mut found = Vec::new();
    for file in text_files() {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let shown = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .display()
            .to_string();
        for name in &outside {
            if text.contains(name.as_str()) {
                found.push(format!("{shown}: {name}"));
            }
        }
        let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        for (at, _) in text.match_indices(&bare_word) {
            if !word(text[..at].chars().next_back())
                && !word(text[at + bare_word.len()..].chars().next())
            {
                found.push(format!("{shown}: {bare_word}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "documents outside the repository cited:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_citation_scanner_finds_paths_in_prose() {
    // Assembled at run time, so that the scan of this file does not find these made-up paths.
    let (docs, results) = ("docs/", "bench/results/");
    let text = format!(
        "see {docs}spec.md section 1 and (`{results}2026-x.json`), {docs} itself, {docs}a.md."
    );
    assert_eq!(
        cited(&text, docs, ".md"),
        [format!("{docs}spec.md"), format!("{docs}a.md")]
    );
    assert_eq!(
        cited(&text, results, ".json"),
        [format!("{results}2026-x.json")]
    );
}
