//! Every relative link in the README and in `docs/` resolves: a newcomer who clicks one lands on
//! a file of this tree, and on a heading of it when the link names one.
//!
//! Why a test: the README is short and points into `docs/` for everything else, so a moved or
//! renamed page (or heading) would silently strand the reader. This reads `README.md` and every
//! `docs/**/*.md`, takes each inline link and image (`[text](target)`, `![alt](target)`) and each
//! reference definition (`[name]: target`) outside code, and checks that a relative target exists
//! (its `#anchor` stripped) and, for an anchor into a Markdown file (or into the page itself),
//! that the file has a heading with that GitHub slug. Absolute URLs are not fetched. It fails
//! naming every broken link with its file and line.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// A link as written: the line it is on (1-based) and its target.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Link {
    line: usize,
    target: String,
}

/// The repository root (this crate lives in `tests/`).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate has a parent directory")
        .to_path_buf()
}

/// `README.md` and every Markdown file under `docs/`, sorted.
fn doc_files(root: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut files = vec![root.join("README.md")];
    walk(&root.join("docs"), &mut files);
    files.sort();
    files
}

/// Each line of `text` with what lies in code blocks and code spans blanked out, so that neither
/// links nor headings are read from code. Fenced blocks (``` or ~~~) and blocks indented by four
/// spaces after a blank line are code.
fn prose_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    let mut previous_blank = true;
    let mut in_indented = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(f) = fence {
            if trimmed.starts_with(f) {
                fence = None;
            }
            out.push(String::new());
            previous_blank = false;
            continue;
        }
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = Some(if trimmed.starts_with("```") {
                "```"
            } else {
                "~~~"
            });
            out.push(String::new());
            previous_blank = false;
            continue;
        }
        let blank = line.trim().is_empty();
        in_indented = (line.starts_with("    ") || line.starts_with('\t'))
            && !blank
            && (previous_blank || in_indented);
        if in_indented {
            out.push(String::new());
        } else {
            out.push(without_code_spans(line));
        }
        previous_blank = blank;
    }
    out
}

/// `line` with every `` `code span` `` replaced by spaces (an unclosed backtick is kept).
fn without_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(open) = rest.find('`') {
        let ticks = rest[open..].chars().take_while(|&c| c == '`').count();
        let fence = "`".repeat(ticks);
        let after = &rest[open + ticks..];
        match after.find(&fence) {
            Some(close) => {
                out.push_str(&rest[..open]);
                out.push_str(&" ".repeat(ticks * 2 + close));
                rest = &after[close + ticks..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    out
}

/// The links of a Markdown text: inline links and images, and reference definitions.
fn links(text: &str) -> Vec<Link> {
    let mut found = Vec::new();
    for (i, line) in prose_lines(text).iter().enumerate() {
        let line_no = i + 1;
        // Reference definitions: `[name]: target`.
        let t = line.trim_start();
        if t.starts_with('[')
            && !t.starts_with("[^")
            && let Some(end) = t.find("]:")
        {
            let target = t[end + 2..].split_whitespace().next().unwrap_or("");
            if !target.is_empty() {
                found.push(Link {
                    line: line_no,
                    target: target.trim_matches(|c| c == '<' || c == '>').to_string(),
                });
            }
        }
        // Inline links and images: `](target)` or `](target "title")`.
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(close) = closing_paren(after) else {
                break;
            };
            let inner = after[..close].trim();
            let target = inner.split_whitespace().next().unwrap_or("");
            found.push(Link {
                line: line_no,
                target: target.trim_matches(|c| c == '<' || c == '>').to_string(),
            });
            rest = &after[close..];
        }
    }
    found
}

/// The index of the `)` that closes a link target starting at `s` (parentheses may nest).
fn closing_paren(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return Some(i),
            ')' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// GitHub's anchor for a heading's text: lower case, punctuation dropped (hyphens and
/// underscores kept), spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown text's headings (outside code), numbered as GitHub numbers repeats
/// (`name`, `name-1`, ...).
fn anchors(text: &str) -> BTreeSet<String> {
    let raw: Vec<&str> = text.lines().collect();
    let mut seen = BTreeSet::new();
    for (i, line) in prose_lines(text).iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let t = line.trim_start();
        let hashes = t.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !t[hashes..].starts_with(' ') {
            continue;
        }
        // The heading's own text, with its code spans (blanked above) read back from the raw line.
        let text_of = raw[i].trim_start()[hashes..]
            .trim()
            .trim_end_matches('#')
            .trim();
        let base = slug(&link_texts(text_of));
        let mut name = base.clone();
        let mut n = 0;
        while seen.contains(&name) {
            n += 1;
            name = format!("{base}-{n}");
        }
        seen.insert(name);
    }
    seen
}

/// A heading's text with `[text](target)` links reduced to their text, as GitHub's anchors read it.
fn link_texts(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(open) = rest.find('[') {
        let after = &rest[open + 1..];
        match (after.find("]("), after.find(']')) {
            (Some(mid), Some(first)) if mid == first => {
                let tail = &after[mid + 2..];
                let Some(close) = closing_paren(tail) else {
                    break;
                };
                out.push_str(&rest[..open]);
                out.push_str(&after[..mid]);
                rest = &tail[close + 1..];
            }
            _ => {
                out.push_str(&rest[..=open]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Whether a target points outside the tree (a URL), so it is not checked here.
fn is_external(target: &str) -> bool {
    let scheme_end = target.find(':');
    let first_slash = target.find('/');
    matches!(scheme_end, Some(c) if c > 0 && first_slash.is_none_or(|s| c < s)
        && target[..c].chars().all(|ch| ch.is_ascii_alphanumeric() || "+.-".contains(ch)))
}

/// What is wrong with one link of `file` (in the tree at `root`), if anything.
fn check(root: &Path, file: &Path, own_anchors: &BTreeSet<String>, target: &str) -> Option<String> {
    if target.is_empty() {
        return Some("empty target".into());
    }
    if is_external(target) {
        return None;
    }
    let (path_part, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    let path_part = path_part.split('?').next().unwrap_or("");
    if path_part.is_empty() {
        let a = anchor.unwrap_or("");
        return (!own_anchors.contains(a)).then(|| format!("no heading #{a} in this page"));
    }
    let base = if path_part.starts_with('/') {
        root.to_path_buf()
    } else {
        file.parent().unwrap_or(root).to_path_buf()
    };
    let resolved = base.join(path_part.trim_start_matches('/'));
    let shown = resolved.strip_prefix(root).unwrap_or(&resolved).display();
    if !resolved.exists() {
        return Some(format!("no file {shown}"));
    }
    if let Some(a) = anchor.filter(|a| !a.is_empty())
        && resolved.extension().is_some_and(|e| e == "md")
    {
        let text = fs::read_to_string(&resolved).unwrap_or_default();
        if !anchors(&text).contains(a) {
            return Some(format!("no heading #{a} in {shown}"));
        }
    }
    None
}

#[test]
fn every_relative_link_in_the_readme_and_docs_resolves() {
    let root = repo_root();
    let files = doc_files(&root);
    assert!(
        files.len() > 1,
        "no docs/*.md found beside README.md under {}",
        root.display()
    );
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        let own = anchors(&text);
        for link in links(&text) {
            checked += 1;
            if let Some(why) = check(&root, file, &own, &link.target) {
                let shown = file.strip_prefix(&root).unwrap_or(file);
                broken.push(format!(
                    "{}:{}: ({}) {why}",
                    shown.display(),
                    link.line,
                    link.target
                ));
            }
        }
    }
    assert!(checked > 0, "no links found in the README and docs/");
    assert!(
        broken.is_empty(),
        "{} broken link(s) of {checked}:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

#[test]
fn the_readme_links_its_picture_and_the_docs() {
    let root = repo_root();
    let text = fs::read_to_string(root.join("README.md")).expect("README.md");
    let targets: Vec<String> = links(&text).into_iter().map(|l| l.target).collect();
    assert!(
        targets.iter().any(|t| t.ends_with(".svg")),
        "the README shows no picture"
    );
    for file in doc_files(&root).iter().skip(1) {
        let rel = file.strip_prefix(&root).expect("under the root");
        let rel = rel.to_string_lossy().replace('\\', "/");
        assert!(
            targets
                .iter()
                .any(|t| t.split('#').next() == Some(rel.as_str())),
            "the README does not link {rel}"
        );
    }
}

#[test]
fn links_are_read_from_prose_only_and_checked() {
    let text = [
        "# Title",
        "See [a](a.md), ![pic](img/p.svg \"title\") and [web](https://x.org/y).",
        "Not `[code](nope.md)`, nor this:",
        "",
        "```text",
        "[fenced](nope.md)",
        "# not a heading",
        "```",
        "",
        "    [indented](nope.md)",
        "",
        "[ref]: b.md#part",
        "## Part (one)",
        "## Part (one)",
        "Back to [top](#title).",
    ]
    .join("\n");
    let text = text.as_str();
    let found: Vec<(usize, String)> = links(text)
        .into_iter()
        .map(|l| (l.line, l.target))
        .collect();
    assert_eq!(
        found,
        vec![
            (2, "a.md".to_string()),
            (2, "img/p.svg".to_string()),
            (2, "https://x.org/y".to_string()),
            (12, "b.md#part".to_string()),
            (15, "#title".to_string()),
        ]
    );
    let heads = anchors(text);
    assert_eq!(
        heads.into_iter().collect::<Vec<_>>(),
        vec!["part-one", "part-one-1", "title"]
    );

    // Against a small tree: what exists passes, what does not is named.
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    fs::create_dir_all(root.join("docs/img")).unwrap();
    fs::write(root.join("docs/a.md"), "# A\n## What `it` does\n").unwrap();
    fs::write(root.join("docs/img/p.svg"), "<svg/>").unwrap();
    let page = root.join("docs/page.md");
    let own = anchors("# Page\n");
    assert_eq!(check(root, &page, &own, "a.md"), None);
    assert_eq!(check(root, &page, &own, "a.md#what-it-does"), None);
    assert_eq!(check(root, &page, &own, "img/p.svg"), None);
    assert_eq!(check(root, &page, &own, "#page"), None);
    assert_eq!(check(root, &page, &own, "https://example.org/x"), None);
    assert!(
        check(root, &page, &own, "b.md")
            .unwrap()
            .starts_with("no file")
    );
    assert!(
        check(root, &page, &own, "a.md#nowhere")
            .unwrap()
            .starts_with("no heading #nowhere")
    );
    assert!(
        check(root, &page, &own, "#nowhere")
            .unwrap()
            .starts_with("no heading")
    );
    assert!(check(root, &page, &own, "../docs/img/q.svg").is_some());
}

#[test]
fn slugs_follow_github() {
    assert_eq!(
        slug("Same host: pulls instead of sockets"),
        "same-host-pulls-instead-of-sockets"
    );
    assert_eq!(
        slug("The log, topic by topic (2026-12-01 to 2026-12-06)"),
        "the-log-topic-by-topic-2026-12-01-to-2026-12-06"
    );
    assert_eq!(
        slug("What `weightsync demo` does"),
        "what-weightsync-demo-does"
    );
    assert_eq!(slug(&link_texts("See [RDMA](rdma.md) now")), "see-rdma-now");
}
