//! The house rules that a reviewer should not have to count by hand: no source file grows past
//! 900 lines, and no two files of one crate import each other, directly or around a loop. Both
//! rot quietly (each commit adds a little), so a test walks every crate's `src/` and names the
//! files that break them.
//!
//! # The rules, exactly
//!
//! **Which files.** Each workspace member's `src/lib.rs` and `src/main.rs` is a crate root; the
//! walk follows `mod name;` declarations from there (`name.rs` or `name/mod.rs` beside a root or
//! `mod.rs`, `dir/name.rs` under a plain `dir.rs`). Test code is left out: an item under
//! `#[cfg(test)]` (or `#[cfg(all(test, ..))]`), inline or a `mod` declared so, and every file
//! reached only through such a declaration.
//!
//! **Length.** A file's length is its line count minus the lines of its `#[cfg(test)]` items
//! (from the attribute to the item's closing `;` or `}`). Over [`MAX_LINES`] fails.
//!
//! **Imports.** File A imports file B when A names a module path that resolves to B: a `use`
//! (each leaf of a `use a::{b, c::D}` tree) or a path in code (`crate::a::b::C`, `super::x::Y`,
//! `self::x::Y`, or `x::Y` where `x` is a module declared as a child of A's module). A path
//! resolves to the deepest module that is a file: `crate::a::b::C` is `a/b.rs` (or
//! `a/b/mod.rs`) if that exists, else `a.rs` (or `a/mod.rs`), else the crate root. Paths to other
//! crates and to inline modules of A itself give no edge.
//!
//! **The tree is not an import.** A module naming its own descendants gives no edge: a
//! `mod child;` declaration, a `pub use child::Face` re-export (how Rust gives a module its
//! face), and a parent calling into the children it declared (`tcp/mod.rs` starting
//! `receiver::accept_loop`). Without this, every parent whose children `use super::..` what it
//! defines would be a circle, and the tree is the one loop Rust asks for. A child naming its
//! parent, a sibling, or anything elsewhere in the crate is an import. So a circle always runs
//! across the tree: `trainer/mod.rs` -> `rollout/mod.rs` -> `trainer/mod.rs`, or two siblings.
//!
//! **Circles.** Any strongly connected set of two or more files in that graph fails; the report
//! prints one loop through it, each arrow with the names that tie it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

/// The longest a source file may be, test items not counted.
const MAX_LINES: usize = 900;

/// The workspace root (this crate lives one level below it).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Every crate root of the workspace: `<member>/src/{lib,main}.rs`.
fn crate_roots(root: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    let mut members: Vec<PathBuf> = fs::read_dir(root)
        .expect("read the workspace root")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .collect();
    members.sort();
    for member in members {
        for name in ["lib.rs", "main.rs"] {
            let file = member.join("src").join(name);
            if file.is_file() {
                roots.push(file);
            }
        }
    }
    roots
}

// ---------------------------------------------------------------------------------------------
// Tokens

/// One token of Rust source with its line (1-based). Literals collapse to `"` and lifetimes to
/// `'`; comments vanish; `::` is one token.
#[derive(Clone, Debug)]
struct Tok {
    text: String,
    line: usize,
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Splits Rust source into tokens, enough to find paths: identifiers, punctuation, with strings,
/// chars and comments skipped exactly (raw strings and nested block comments included).
fn tokenize(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let count_lines = |from: usize, to: usize, line: &mut usize| {
        *line += c[from..to].iter().filter(|&&x| x == '\n').count();
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let start = i;
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            count_lines(start, i, &mut line);
        } else if let Some(end) = raw_string_end(&c, i) {
            let at = line;
            count_lines(i, end, &mut line);
            toks.push(Tok {
                text: "\"".into(),
                line: at,
            });
            i = end;
        } else if ch == '"' || (ch == 'b' && c.get(i + 1) == Some(&'"')) {
            let start = i;
            i += if ch == 'b' { 2 } else { 1 };
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            let at = line;
            count_lines(start, i.min(c.len()), &mut line);
            toks.push(Tok {
                text: "\"".into(),
                line: at,
            });
        } else if ch == '\'' || (ch == 'b' && c.get(i + 1) == Some(&'\'')) {
            let q = if ch == 'b' { i + 1 } else { i };
            if c.get(q + 1) == Some(&'\\') {
                // An escaped char literal: '\n', '\'', '\u{..}'.
                i = q + 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
                toks.push(Tok {
                    text: "\"".into(),
                    line,
                });
            } else if c.get(q + 2) == Some(&'\'') {
                i = q + 3;
                toks.push(Tok {
                    text: "\"".into(),
                    line,
                });
            } else {
                // A lifetime or label.
                i = q + 1;
                while i < c.len() && is_ident_char(c[i]) {
                    i += 1;
                }
                toks.push(Tok {
                    text: "'".into(),
                    line,
                });
            }
        } else if is_ident_start(ch)
            || (ch == '$' && c.get(i + 1).is_some_and(|&x| is_ident_start(x)))
        {
            let start = i;
            i += 1;
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let word = if word == "$crate" {
                "crate".to_string()
            } else {
                word
            };
            toks.push(Tok { text: word, line });
        } else if ch.is_ascii_digit() {
            while i < c.len()
                && (is_ident_char(c[i])
                    || c[i] == '.' && c.get(i + 1).is_some_and(|d| d.is_ascii_digit()))
            {
                i += 1;
            }
            toks.push(Tok {
                text: "0".into(),
                line,
            });
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            toks.push(Tok {
                text: "::".into(),
                line,
            });
            i += 2;
        } else {
            toks.push(Tok {
                text: ch.to_string(),
                line,
            });
            i += 1;
        }
    }
    toks
}

/// If a raw string (`r"…"`, `r#"…"#`, `br#"…"#`) starts at `i`, the index just past its end.
fn raw_string_end(c: &[char], i: usize) -> Option<usize> {
    if i > 0 && is_ident_char(c[i - 1]) {
        return None;
    }
    let mut j = i;
    if c.get(j) == Some(&'b') {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && (0..hashes).all(|k| c.get(j + 1 + k) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(c.len())
}

/// If `toks[i..]` is an attribute `#[..]` or `#![..]`, the index just past it and its inner
/// tokens.
fn attribute_at(toks: &[Tok], i: usize) -> Option<(usize, &[Tok])> {
    if toks.get(i)?.text != "#" {
        return None;
    }
    let mut j = i + 1;
    if toks.get(j)?.text == "!" {
        j += 1;
    }
    if toks.get(j)?.text != "[" {
        return None;
    }
    let open = j;
    let mut depth = 0;
    while j < toks.len() {
        match toks[j].text.as_str() {
            "[" | "(" | "{" => depth += 1,
            "]" | ")" | "}" => {
                depth -= 1;
                if depth == 0 {
                    return Some((j + 1, &toks[open + 1..j]));
                }
            }
            _ => {}
        }
        j += 1;
    }
    None
}

/// Whether an attribute's inner tokens gate on `test`: `cfg(test)` or `cfg(all(test, ..))`.
fn is_test_cfg(inner: &[Tok]) -> bool {
    let words: Vec<&str> = inner.iter().map(|t| t.text.as_str()).collect();
    matches!(words.as_slice(), ["cfg", "(", "test", ")"])
        || (words.starts_with(&["cfg", "(", "all", "("])
            && words.contains(&"test")
            && !words.contains(&"not"))
}

/// The index just past the item starting at `i`: its `;` or its first brace block at depth 0.
fn item_end(toks: &[Tok], mut i: usize) -> usize {
    let mut depth = 0i32;
    while i < toks.len() {
        match toks[i].text.as_str() {
            "(" | "[" | "{" => depth += 1,
            ")" | "]" => depth -= 1,
            "}" => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            ";" if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// A file with its `#[cfg(test)]` items removed.
struct Shipped {
    /// The tokens that ship.
    toks: Vec<Tok>,
    /// Lines that belong to test items.
    test_lines: BTreeSet<usize>,
    /// The whole file is test code (`#![cfg(test)]`).
    all_test: bool,
}

fn strip_tests(toks: Vec<Tok>) -> Shipped {
    let mut kept = Vec::with_capacity(toks.len());
    let mut test_lines = BTreeSet::new();
    let mut all_test = false;
    let mut i = 0;
    while i < toks.len() {
        if let Some((after, inner)) = attribute_at(&toks, i) {
            if is_test_cfg(inner) {
                if toks[i + 1].text == "!" {
                    all_test = true;
                    i = after;
                    continue;
                }
                let end = item_end(&toks, after);
                let last = toks
                    .get(end.saturating_sub(1))
                    .map_or(toks[i].line, |t| t.line);
                test_lines.extend(toks[i].line..=last);
                i = end;
                continue;
            }
            kept.extend_from_slice(&toks[i..after]);
            i = after;
            continue;
        }
        kept.push(toks[i].clone());
        i += 1;
    }
    Shipped {
        toks: kept,
        test_lines,
        all_test,
    }
}

// ---------------------------------------------------------------------------------------------
// Modules and paths

/// One file reached from a crate root.
struct ModFile {
    path: PathBuf,
    /// Module path from the crate root (`[]` for the root).
    module: Vec<String>,
    shipped: Shipped,
    lines: usize,
}

/// Where the children of a module file live.
fn child_dir(file: &Path) -> PathBuf {
    let name = file
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let parent = file.parent().expect("a file has a parent");
    if matches!(name, "mod.rs" | "lib.rs" | "main.rs") {
        parent.to_path_buf()
    } else {
        parent.join(file.file_stem().expect("a file has a stem"))
    }
}

/// The `mod name;` declarations at a file's top level (test ones already stripped).
fn declared_children(toks: &[Tok]) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    for (i, t) in toks.iter().enumerate() {
        match t.text.as_str() {
            "{" => depth += 1,
            "}" => depth -= 1,
            "mod" if depth == 0 => {
                if let (Some(name), Some(semi)) = (toks.get(i + 1), toks.get(i + 2))
                    && semi.text == ";"
                {
                    out.push(name.text.clone());
                }
            }
            _ => {}
        }
    }
    out
}

/// Reads every shipped file of the crate whose root is `root`.
fn crate_files(root: &Path) -> Vec<ModFile> {
    let mut files = Vec::new();
    let mut queue = vec![(root.to_path_buf(), Vec::<String>::new())];
    while let Some((path, module)) = queue.pop() {
        let src =
            fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let shipped = strip_tests(tokenize(&src));
        if shipped.all_test {
            continue;
        }
        let dir = child_dir(&path);
        for child in declared_children(&shipped.toks) {
            let flat = dir.join(format!("{child}.rs"));
            let nested = dir.join(&child).join("mod.rs");
            let file = if flat.is_file() { flat } else { nested };
            assert!(
                file.is_file(),
                "{} declares `mod {child};` but neither {} nor its mod.rs exists",
                path.display(),
                file.display()
            );
            let mut m = module.clone();
            m.push(child);
            queue.push((file, m));
        }
        files.push(ModFile {
            lines: src.lines().count(),
            path,
            module,
            shipped,
        });
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    files
}

/// A path named in a file.
struct Named {
    segments: Vec<String>,
    /// Inline modules of the file enclosing the naming.
    inline: Vec<String>,
}

/// Expands a `use` tree starting at `toks[i]` (just after `use`) into its leaf paths; returns the
/// index past the closing `;`.
fn use_tree(toks: &[Tok], mut i: usize, prefix: &[String], out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix.to_vec();
    while i < toks.len() {
        let t = toks[i].text.as_str();
        match t {
            "::" => i += 1,
            "{" => {
                i += 1;
                loop {
                    i = use_tree(toks, i, &path, out);
                    match toks.get(i).map(|t| t.text.as_str()) {
                        Some(",") => {
                            i += 1;
                            if toks.get(i).is_some_and(|t| t.text == "}") {
                                return i + 1;
                            }
                        }
                        Some("}") => return i + 1,
                        _ => return i,
                    }
                }
            }
            "," | "}" | ";" => {
                if path.len() > prefix.len() {
                    out.push(path);
                }
                return i;
            }
            "*" | "self" => i += 1,
            "as" => i += 2,
            _ => {
                path.push(t.to_string());
                i += 1;
            }
        }
    }
    i
}

/// Every path a file names that could lead to another file of its crate.
fn named_paths(toks: &[Tok], children: &BTreeSet<String>) -> Vec<Named> {
    let mut out = Vec::new();
    let mut inline: Vec<(String, i32)> = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    let starts = |w: &str, inline_now: bool| {
        matches!(w, "crate" | "super" | "self") || (!inline_now && children.contains(w))
    };
    while i < toks.len() {
        let t = toks[i].text.as_str();
        let prev = if i > 0 { toks[i - 1].text.as_str() } else { "" };
        match t {
            "{" => {
                depth += 1;
                i += 1;
            }
            "}" => {
                depth -= 1;
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                i += 1;
            }
            "mod" if toks.get(i + 2).is_some_and(|t| t.text == "{") => {
                inline.push((toks[i + 1].text.clone(), depth));
                depth += 1;
                i += 3;
            }
            "use" => {
                let mut leaves = Vec::new();
                let end = use_tree(toks, i + 1, &[], &mut leaves);
                let names: Vec<String> = inline.iter().map(|(n, _)| n.clone()).collect();
                for segments in leaves {
                    if segments
                        .first()
                        .is_some_and(|w| starts(w, !names.is_empty()))
                    {
                        out.push(Named {
                            segments,
                            inline: names.clone(),
                        });
                    }
                }
                i = end.max(i + 1);
            }
            _ if starts(t, !inline.is_empty())
                && prev != "::"
                && prev != "."
                && toks.get(i + 1).is_some_and(|n| n.text == "::") =>
            {
                let mut segments = vec![t.to_string()];
                let mut j = i + 1;
                while toks.get(j).is_some_and(|n| n.text == "::")
                    && toks
                        .get(j + 1)
                        .is_some_and(|n| n.text.chars().next().is_some_and(is_ident_start))
                {
                    segments.push(toks[j + 1].text.clone());
                    j += 2;
                }
                out.push(Named {
                    segments,
                    inline: inline.iter().map(|(n, _)| n.clone()).collect(),
                });
                i = j;
            }
            _ => i += 1,
        }
    }
    out
}

/// The absolute module path a named path points into, from a file at `module`.
fn absolute(module: &[String], named: &Named) -> Option<Vec<String>> {
    let mut here: Vec<String> = module.iter().chain(&named.inline).cloned().collect();
    let mut segs = named.segments.iter().peekable();
    match segs.peek().map(|s| s.as_str()) {
        Some("crate") => {
            here.clear();
            segs.next();
        }
        Some("self") => {
            segs.next();
        }
        Some("super") => {
            while segs.peek().is_some_and(|s| *s == "super") {
                here.pop()?;
                segs.next();
            }
        }
        _ => {}
    }
    here.extend(segs.cloned());
    Some(here)
}

// ---------------------------------------------------------------------------------------------
// The graph and its circles

/// The import graph of one crate: for each file index, the files it imports and the names that
/// tie each arrow.
type Graph = Vec<BTreeMap<usize, BTreeSet<String>>>;

fn import_graph(files: &[ModFile]) -> Graph {
    let by_module: BTreeMap<&[String], usize> = files
        .iter()
        .enumerate()
        .map(|(i, f)| (f.module.as_slice(), i))
        .collect();
    let mut graph: Graph = vec![BTreeMap::new(); files.len()];
    for (from, file) in files.iter().enumerate() {
        let children: BTreeSet<String> =
            declared_children(&file.shipped.toks).into_iter().collect();
        for named in named_paths(&file.shipped.toks, &children) {
            let Some(target) = absolute(&file.module, &named) else {
                continue;
            };
            let Some((to, depth)) = (0..=target.len())
                .rev()
                .find_map(|n| by_module.get(&target[..n]).map(|&to| (to, n)))
            else {
                continue;
            };
            if to == from {
                continue;
            }
            // A module naming its own descendants is the tree itself, not an import.
            if depth > file.module.len() && target.starts_with(&file.module) {
                continue;
            }
            let name = target
                .get(depth..)
                .filter(|r| !r.is_empty())
                .map_or_else(|| target[depth - 1].clone(), |r| r.join("::"));
            graph[from].entry(to).or_default().insert(name);
        }
    }
    graph
}

/// Tarjan's strongly connected components, those of two or more files.
fn circles(graph: &Graph) -> Vec<Vec<usize>> {
    struct State<'g> {
        graph: &'g Graph,
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in s.graph[v].keys() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut scc = Vec::new();
            loop {
                let w = s.stack.pop().expect("v is on the stack");
                s.on_stack[w] = false;
                scc.push(w);
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                s.out.push(scc);
            }
        }
    }
    let n = graph.len();
    let mut s = State {
        graph,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out.sort();
    s.out
}

/// One loop through a circle: the shortest way from its first file back to itself.
fn one_loop(graph: &Graph, scc: &[usize]) -> Vec<usize> {
    let start = scc[0];
    let inside: BTreeSet<usize> = scc.iter().copied().collect();
    let mut came_from: BTreeMap<usize, usize> = BTreeMap::new();
    let mut frontier = vec![start];
    while !frontier.is_empty() {
        let mut next = Vec::new();
        for v in frontier {
            for &w in graph[v].keys().filter(|w| inside.contains(w)) {
                if w == start {
                    let mut path = vec![v];
                    while let Some(&p) = came_from.get(path.last().expect("non-empty")) {
                        path.push(p);
                    }
                    path.reverse();
                    return path;
                }
                if let std::collections::btree_map::Entry::Vacant(e) = came_from.entry(w) {
                    e.insert(v);
                    next.push(w);
                }
            }
        }
        frontier = next;
    }
    scc.to_vec()
}

/// Everything wrong with the crates under `root`, one paragraph per problem.
fn house_faults(root: &Path) -> Vec<String> {
    let mut faults = Vec::new();
    let show = |p: &Path| p.strip_prefix(root).unwrap_or(p).display().to_string();
    for crate_root in crate_roots(root) {
        let files = crate_files(&crate_root);
        for f in &files {
            let body = f.lines - f.shipped.test_lines.len();
            if body > MAX_LINES {
                faults.push(format!(
                    "{} is {body} lines (test items not counted), over {MAX_LINES}",
                    show(&f.path)
                ));
            }
        }
        let graph = import_graph(&files);
        for scc in circles(&graph) {
            let member = crate_root
                .parent()
                .and_then(Path::parent)
                .map_or_else(String::new, &show);
            let mut msg = format!("import circle of {} files in crate `{member}`:", scc.len());
            for &v in &scc {
                let _ = write!(msg, "\n    {}", show(&files[v].path));
            }
            msg.push_str("\n  one loop:");
            let ring = one_loop(&graph, &scc);
            for (k, &v) in ring.iter().enumerate() {
                let w = ring[(k + 1) % ring.len()];
                let names: Vec<&str> = graph[v]
                    .get(&w)
                    .map(|s| s.iter().map(String::as_str).collect())
                    .unwrap_or_default();
                let _ = write!(
                    msg,
                    "\n    {} -> {}  ({})",
                    show(&files[v].path),
                    show(&files[w].path),
                    names.join(", ")
                );
            }
            faults.push(msg);
        }
    }
    faults
}

#[test]
fn no_file_is_too_long_and_no_files_import_each_other() {
    let root = std::env::var_os("HOUSE_ROOT").map_or_else(workspace_root, PathBuf::from);
    let faults = house_faults(&root);
    assert!(
        faults.is_empty(),
        "the house rules are broken ({} faults):\n\n{}\n",
        faults.len(),
        faults.join("\n\n")
    );
}

#[test]
fn a_circle_across_the_tree_is_found_and_the_tree_is_not_one() {
    let dir = std::env::temp_dir().join(format!("house-{}", std::process::id()));
    let src = dir.join("toy").join("src");
    fs::create_dir_all(src.join("a")).expect("make the toy crate");
    fs::write(
        dir.join("toy").join("Cargo.toml"),
        "[package]\nname = \"toy\"\n",
    )
    .expect("write");
    fs::write(
        src.join("lib.rs"),
        "//! toy\nmod a;\nmod b;\npub use a::Face;\n",
    )
    .expect("write");
    // a/mod.rs re-exports and calls its child (the tree, no edge) and calls b (an edge).
    let a = concat!(
        "mod inner;\npub use inner::Face;\npub struct Top;\n",
        "fn f() { crate::b::g(); inner::h(); }\n",
    );
    fs::write(src.join("a").join("mod.rs"), a).expect("write");
    // Paths in comments and strings are no imports.
    let inner = concat!(
        "use super::Top;\npub struct Face(Top);\npub fn h() {}\n",
        "/* crate::b::x */ const S: &str = \"crate::b::y\";\n",
    );
    fs::write(src.join("a").join("inner.rs"), inner).expect("write");
    // Test items are no imports either.
    let b = concat!(
        "use crate::a::{inner::Face};\npub fn g() {}\n",
        "#[cfg(test)]\nmod tests { use crate::a::Top; }\n",
    );
    fs::write(src.join("b.rs"), b).expect("write");
    let faults = house_faults(&dir);
    fs::remove_dir_all(&dir).expect("clean up");
    assert_eq!(faults.len(), 1, "{faults:#?}");
    let f = &faults[0];
    assert!(f.contains("import circle of 3 files"), "{f}");
    assert!(f.contains("toy/src/a/mod.rs -> toy/src/b.rs  (g)"), "{f}");
    assert!(
        f.contains("toy/src/b.rs -> toy/src/a/inner.rs  (Face)"),
        "{f}"
    );
    assert!(
        !f.contains("lib.rs"),
        "a parent naming its children is not an import: {f}"
    );
}
