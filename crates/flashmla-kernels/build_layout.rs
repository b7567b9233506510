//! The host/device contract, read from the kernel headers: `build.rs` finds every struct defined in a family's
//! `csrc/sm90/<family>/params.h` ([`parse_structs`]), has the host compiler lay it out ([`probe_source`]: a
//! program printing `sizeof` / `offsetof` of every field, compiled by nvcc's host compiler and run), and embeds
//! the result ([`layouts_rust`]) as `flashmla_kernels::PARAMS_LAYOUTS`, against which the library checks its
//! `#[repr(C)]` mirrors at compile time. Also compiled into the crate's unit tests (`lib.rs`), which test the
//! parser.
//!
//! The parser reads the subset of C++ that parameter headers use: structs defined at namespace scope (not
//! templates), whose data members are declared as `type name;`, `type a, b;`, `type name[N];`, optionally with a
//! default initializer. Member functions, static members, `using` / `typedef`, `static_assert`s and nested type
//! definitions are skipped; a member the parser misses shows up as a field the Rust mirror has and the header
//! lacks, so it cannot pass unnoticed.

use std::fmt::Write as _;

/// A struct defined in a header: its name, its namespace-qualified name and its data members in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StructDecl {
    /// Unqualified name.
    pub name: String,
    /// Name with its namespaces (`flashmla::sparse_fwd::SparseFwdParams`).
    pub qualified: String,
    /// Data members, in declaration order.
    pub fields: Vec<String>,
}

/// One struct as the compiler laid it out (parsed from the probe's output).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StructLayout {
    /// Kernel family (the directory under `csrc/sm90/`).
    pub family: String,
    /// Unqualified struct name.
    pub name: String,
    /// `sizeof`.
    pub size: usize,
    /// `alignof`.
    pub align: usize,
    /// `(name, offsetof, sizeof)` of every field, in declaration order.
    pub fields: Vec<(String, usize, usize)>,
}

/// Source without comments and preprocessor lines (a line break stays where each was).
fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut chars = src.chars().peekable();
    let mut line_start = true;
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
                line_start = true;
                continue;
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                    }
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
                out.push(' ');
                continue;
            }
            '#' if line_start => {
                // A preprocessor line, with its continuations.
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if c == '\n' && prev != '\\' {
                        break;
                    }
                    prev = c;
                }
                out.push('\n');
                line_start = true;
                continue;
            }
            '\n' => line_start = true,
            c if !c.is_whitespace() => line_start = false,
            _ => {}
        }
        out.push(c);
    }
    out
}

/// Identifiers and numbers as one token each, `::` as one token, every other non-blank character alone.
fn tokenize(src: &str) -> Vec<String> {
    let mut toks = Vec::new();
    let chars: Vec<char> = src.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            toks.push(chars[start..i].iter().collect());
            continue;
        }
        if c == ':' && chars.get(i + 1) == Some(&':') {
            toks.push("::".into());
            i += 2;
            continue;
        }
        if !c.is_whitespace() {
            toks.push(c.to_string());
        }
        i += 1;
    }
    toks
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// Index of the token closing the bracket opened at `open` (`{`, `(` or `[`).
fn matching(toks: &[String], open: usize) -> Result<usize, String> {
    let (o, c) = match toks[open].as_str() {
        "{" => ("{", "}"),
        "(" => ("(", ")"),
        "[" => ("[", "]"),
        t => return Err(format!("internal: {t:?} opens nothing")),
    };
    let mut depth = 0usize;
    for (j, t) in toks.iter().enumerate().skip(open) {
        if t == o {
            depth += 1;
        } else if t == c {
            depth -= 1;
            if depth == 0 {
                return Ok(j);
            }
        }
    }
    Err(format!("unbalanced {o}"))
}

/// Every struct defined at namespace scope in a header, with its data members.
pub fn parse_structs(src: &str) -> Result<Vec<StructDecl>, String> {
    let toks = tokenize(&strip_comments(src));
    let mut out = Vec::new();
    parse_scope(&toks, &[], &mut out)?;
    Ok(out)
}

/// Parses the declarations of one namespace scope (`toks` without its braces).
fn parse_scope(toks: &[String], ns: &[String], out: &mut Vec<StructDecl>) -> Result<(), String> {
    let mut i = 0;
    // Where the current declaration started (after the last `;`, `{...}` or `}`).
    let mut decl_start = 0;
    while i < toks.len() {
        match toks[i].as_str() {
            ";" => {
                i += 1;
                decl_start = i;
            }
            "namespace" => {
                // namespace a::b { ... }  (an anonymous namespace is walked without a name)
                let mut j = i + 1;
                let mut names = ns.to_vec();
                while j < toks.len() && toks[j] != "{" {
                    if is_ident(&toks[j]) {
                        names.push(toks[j].clone());
                    }
                    j += 1;
                }
                if j == toks.len() {
                    return Err("namespace without a body".into());
                }
                let end = matching(toks, j)?;
                parse_scope(&toks[j + 1..end], &names, out)?;
                i = end + 1;
                decl_start = i;
            }
            "struct" | "class" if i == 0 || toks[i - 1] != "enum" => {
                let templated = toks[decl_start..i].iter().any(|t| t == "template");
                let name = toks.get(i + 1).filter(|t| is_ident(t)).cloned();
                // The body, if this is a definition: the first `{` before any `;`.
                let body = toks[i..]
                    .iter()
                    .position(|t| t == "{" || t == ";")
                    .map(|k| i + k)
                    .filter(|&k| toks[k] == "{");
                match (name, body) {
                    (Some(name), Some(open)) => {
                        let end = matching(toks, open)?;
                        if !templated {
                            let mut qualified = ns.join("::");
                            if !qualified.is_empty() {
                                qualified.push_str("::");
                            }
                            qualified.push_str(&name);
                            out.push(StructDecl {
                                name,
                                qualified,
                                fields: parse_members(&toks[open + 1..end])?,
                            });
                        }
                        i = end + 1;
                    }
                    (_, Some(open)) => i = matching(toks, open)? + 1,
                    (_, None) => i += 1,
                }
            }
            "{" => {
                // A function body or an initializer at namespace scope.
                i = matching(toks, i)? + 1;
                decl_start = i;
            }
            _ => i += 1,
        }
    }
    Ok(())
}

/// The data members of a struct body.
fn parse_members(toks: &[String]) -> Result<Vec<String>, String> {
    let mut fields = Vec::new();
    let mut decl: Vec<String> = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let t = &toks[i];
        if t == "{" {
            let end = matching(toks, i)?;
            if decl.iter().any(|t| t == "(") {
                // A member function's body ends its declaration.
                decl.clear();
            } else {
                // A brace initializer or a nested type's body: kept as one marker token.
                decl.push("{}".into());
            }
            i = end + 1;
            continue;
        }
        if t == ";" {
            fields.extend(data_members(&decl)?);
            decl.clear();
        } else if (t == "public" || t == "private" || t == "protected")
            && decl.is_empty()
            && toks.get(i + 1).is_some_and(|n| n == ":")
        {
            i += 2;
            continue;
        } else {
            decl.push(t.clone());
        }
        i += 1;
    }
    if !decl.is_empty() {
        return Err(format!(
            "unterminated member declaration {:?}",
            decl.join(" ")
        ));
    }
    Ok(fields)
}

/// The names one member declaration (without its `;`) declares; none for what is not a data member.
fn data_members(decl: &[String]) -> Result<Vec<String>, String> {
    const SKIP: [&str; 7] = [
        "static",
        "using",
        "typedef",
        "friend",
        "template",
        "static_assert",
        "constexpr",
    ];
    let Some(first) = decl.first() else {
        return Ok(Vec::new());
    };
    if SKIP.contains(&first.as_str()) {
        return Ok(Vec::new());
    }
    if ["struct", "union", "class", "enum"].contains(&first.as_str())
        && decl.iter().any(|t| t == "{}")
    {
        // A nested type definition (its members are not this struct's at known offsets).
        return Ok(Vec::new());
    }
    // Alignment specifiers take parentheses; drop them before looking for a function's.
    let mut toks: Vec<String> = Vec::new();
    let mut i = 0;
    while i < decl.len() {
        if (decl[i] == "alignas" || decl[i] == "__align__")
            && decl.get(i + 1).is_some_and(|t| t == "(")
        {
            i = i + 1 + matching(&decl[i + 1..], 0)? + 1;
            continue;
        }
        toks.push(decl[i].clone());
        i += 1;
    }
    if toks.iter().any(|t| t == "(") {
        return Ok(Vec::new());
    }
    let mut names = Vec::new();
    for declarator in toks.split(|t| t == ",") {
        // Up to the initializer, then up to an array bound.
        let end = declarator
            .iter()
            .position(|t| t == "=" || t == "{}" || t == "[")
            .unwrap_or(declarator.len());
        let part = &declarator[..end];
        if part.iter().any(|t| t == ":") {
            return Err(format!(
                "bit-field {:?}: a parameter struct needs addressable fields",
                toks.join(" ")
            ));
        }
        match part.iter().rev().find(|t| is_ident(t)) {
            Some(name) => names.push(name.clone()),
            None => return Err(format!("no member name in {:?}", toks.join(" "))),
        }
    }
    Ok(names)
}

/// A host C++ program that prints the layout of every struct of every `(family, header include path,
/// structs)`: a line `struct FAMILY NAME SIZE ALIGN`, then `field NAME OFFSET SIZE` per member.
pub fn probe_source(families: &[(String, String, Vec<StructDecl>)]) -> String {
    let mut s = String::from(
        "// Generated by flashmla-kernels/build.rs: prints the layout of every parameter struct.\n\
         #include <cstddef>\n#include <cstdio>\n",
    );
    for (_, include, _) in families {
        let _ = writeln!(s, "#include \"{include}\"");
    }
    s.push_str("int main() {\n");
    for (family, _, structs) in families {
        for st in structs {
            let q = &st.qualified;
            let _ = writeln!(
                s,
                "    std::printf(\"struct %s %s %zu %zu\\n\", \"{family}\", \"{}\", sizeof({q}), alignof({q}));",
                st.name
            );
            for f in &st.fields {
                let _ = writeln!(
                    s,
                    "    std::printf(\"field %s %zu %zu\\n\", \"{f}\", offsetof({q}, {f}), sizeof(static_cast<{q}*>(nullptr)->{f}));"
                );
            }
        }
    }
    s.push_str("    return 0;\n}\n");
    s
}

/// Reads the probe's output.
pub fn parse_probe_output(text: &str) -> Result<Vec<StructLayout>, String> {
    let mut out: Vec<StructLayout> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| format!("probe output {line:?}: {s:?} is not a number"))
        };
        match w.as_slice() {
            ["struct", family, name, size, align] => out.push(StructLayout {
                family: family.to_string(),
                name: name.to_string(),
                size: num(size)?,
                align: num(align)?,
                fields: Vec::new(),
            }),
            ["field", name, offset, size] => {
                let st = out
                    .last_mut()
                    .ok_or_else(|| format!("probe output {line:?} before any struct"))?;
                st.fields.push((name.to_string(), num(offset)?, num(size)?));
            }
            _ => return Err(format!("probe output {line:?} not understood")),
        }
    }
    Ok(out)
}

/// The Rust items `build.rs` writes for the layouts (`PARAMS_LAYOUTS`).
pub fn layouts_rust(layouts: &[StructLayout]) -> String {
    let mut s = String::from(
        "/// Every struct of every family's `params.h` as the host compiler laid it out (empty when the kernels were\n\
         /// not built).\npub const PARAMS_LAYOUTS: &[CxxStruct] = &[\n",
    );
    for l in layouts {
        let _ = writeln!(
            s,
            "    CxxStruct {{ family: {:?}, name: {:?}, size: {}, align: {}, fields: &[",
            l.family, l.name, l.size, l.align
        );
        for (name, offset, size) in &l.fields {
            let _ = writeln!(
                s,
                "        CxxField {{ name: {name:?}, offset: {offset}, size: {size} }},"
            );
        }
        s.push_str("    ] },\n");
    }
    s.push_str("];\n");
    s
}
