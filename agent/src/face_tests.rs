//! What the embeddable crate must not carry, checked on its own manifest and sources.
//!
//! Engines and the Python package link this crate; whatever it depends on, they build and ship.
//! Command-line flags belong to the CLI and the demo's weights and independent check to the
//! demo, both outside this crate and wrapping it. Each rule below names what it forbids and why;
//! extend the tables when another concern must stay out.

use std::path::{Path, PathBuf};

/// Dependencies the manifest must not name (in any dependency table), and why.
const FORBIDDEN_DEPENDENCIES: &[(&str, &str)] = &[
    (
        "clap",
        "flags are the CLI's: it derives them and converts into WorkerSettings",
    ),
    ("weightsync-demo", "the demo wraps the drivers from outside"),
    (
        "weightsync-cli",
        "the CLI depends on the agent, never the reverse",
    ),
    (
        "weightsync-controller",
        "an engine embeds a worker, not the controller service",
    ),
    (
        "weightsync-benches",
        "benchmarks are not shipped to engines",
    ),
    ("indicatif", "progress bars are the CLI's"),
];

/// Words no source file name or module may contain, and why.
const FORBIDDEN_MODULE_WORDS: &[(&str, &str)] = &[(
    "demo",
    "the demo's weights and check live in weightsync-demo, wrapping the production drivers",
)];

/// Text no source file may contain, and why.
const FORBIDDEN_SOURCE_TEXT: &[(&str, &str)] = &[
    ("clap::", "flags are the CLI's"),
    ("demo_weights", "the demo's weights live in weightsync-demo"),
    (
        "expected_rollout",
        "the demo's independent check lives in weightsync-demo",
    ),
];

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, recursively.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// The names of every dependency in every dependency table of a manifest (including
/// target-specific ones).
fn dependency_names(manifest: &toml::Value) -> Vec<String> {
    let mut names = Vec::new();
    let tables = ["dependencies", "dev-dependencies", "build-dependencies"];
    let mut collect = |t: &toml::Value| {
        for key in tables {
            if let Some(deps) = t.get(key).and_then(|d| d.as_table()) {
                names.extend(deps.keys().cloned());
            }
        }
    };
    collect(manifest);
    if let Some(targets) = manifest.get("target").and_then(|t| t.as_table()) {
        targets.values().for_each(&mut collect);
    }
    names
}

#[test]
fn the_manifest_names_no_forbidden_dependency() {
    let text = std::fs::read_to_string(crate_dir().join("Cargo.toml")).unwrap();
    let manifest: toml::Value = toml::from_str(&text).unwrap();
    let names = dependency_names(&manifest);
    assert!(
        names.iter().any(|n| n == "weightsync-worker"),
        "the dependency reader found no weightsync-worker in {names:?}: it reads nothing"
    );
    for (dep, why) in FORBIDDEN_DEPENDENCIES {
        assert!(
            !names.iter().any(|n| n == dep),
            "agent/Cargo.toml depends on {dep}: {why}"
        );
    }
}

#[test]
fn no_source_file_is_the_demos_or_uses_flags() {
    let files = sources(&crate_dir().join("src"));
    assert!(
        files.iter().any(|f| f.ends_with("rollout.rs")),
        "the source walk found no rollout.rs: it reads nothing"
    );
    for file in &files {
        let rel = file
            .strip_prefix(crate_dir())
            .unwrap()
            .display()
            .to_string();
        for (word, why) in FORBIDDEN_MODULE_WORDS {
            assert!(!rel.contains(word), "{rel}: a module named {word:?}: {why}");
        }
        let text = std::fs::read_to_string(file).unwrap();
        for (needle, why) in FORBIDDEN_SOURCE_TEXT {
            if file.ends_with("face_tests.rs") {
                continue;
            }
            assert!(!text.contains(needle), "{rel} contains {needle:?}: {why}");
        }
        for (word, why) in FORBIDDEN_MODULE_WORDS {
            let declared = format!("mod {word}");
            assert!(
                file.ends_with("face_tests.rs") || !text.contains(&declared),
                "{rel} declares a module starting {declared:?}: {why}"
            );
        }
    }
}
