//! `cargo xtask tidy`: mechanical checks of the design's invariants.
//!
//! - The crate graph (STYLE rule 1), read from `cargo metadata`: a workspace crate may depend only on the
//!   workspace crates its arrows allow, and `eyrie-quant` never pulls in tokio, axum or hyper, even transitively
//!   (checked with `cargo tree` over its non-optional dependencies).
//! - Every Rust source file starts with a `//!` line.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// May-depend-on arrows between workspace crates (direct edges; transitive use is allowed).
const ARROWS: &[(&str, &[&str])] = &[
    ("eyrie-quant", &[]),
    ("eyrie-model", &["eyrie-quant"]),
    ("eyrie-spec-decode", &["eyrie-model"]),
    ("eyrie-train", &["eyrie-model", "eyrie-spec-decode"]),
    ("eyrie-server", &["eyrie-model", "eyrie-spec-decode"]),
    ("xtask", &[]),
];

/// Crates `eyrie-quant` must never reach through its required dependencies.
const QUANT_FORBIDDEN: &[&str] = &["tokio", "axum", "hyper", "tower", "burn", "cubecl"];

pub fn run(root: &Path) -> Result<()> {
    let mut problems = Vec::new();
    check_graph(&mut problems)?;
    check_quant_closure(&mut problems)?;
    check_file_headers(root, &mut problems)?;
    check_exact_pins(root, &mut problems)?;
    if problems.is_empty() {
        eprintln!("tidy: ok");
        Ok(())
    } else {
        for p in &problems {
            eprintln!("tidy: {p}");
        }
        bail!("tidy found {} problem(s)", problems.len())
    }
}

/// The transitive closure of [`ARROWS`] from `krate`.
fn allowed(krate: &str) -> BTreeSet<&'static str> {
    let map: BTreeMap<&str, &[&str]> = ARROWS.iter().copied().collect();
    let mut out = BTreeSet::new();
    let mut stack: Vec<&str> = map.get(krate).map(|v| v.to_vec()).unwrap_or_default();
    while let Some(k) = stack.pop() {
        if let Some((name, _)) = ARROWS.iter().find(|(n, _)| *n == k)
            && out.insert(*name)
        {
            stack.extend(map.get(k).copied().unwrap_or_default());
        }
    }
    out
}

fn check_graph(problems: &mut Vec<String>) -> Result<()> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let meta: Value = serde_json::from_slice(&out.stdout).context("parsing cargo metadata")?;
    let packages = meta["packages"].as_array().context("cargo metadata: no packages")?;
    let members: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    for p in packages {
        let name = p["name"].as_str().unwrap_or_default();
        let Some(deps) = p["dependencies"].as_array() else { continue };
        for d in deps {
            let dep = d["name"].as_str().unwrap_or_default();
            let kind = d["kind"].as_str(); // null = normal, "dev", "build"
            if !members.contains(dep) || kind == Some("dev") {
                continue;
            }
            if name == "eyrie-e2e" {
                continue; // end-to-end tests may use everything
            }
            if !ARROWS.iter().any(|(n, _)| *n == name) {
                problems.push(format!("{name} is not in the crate graph of STYLE rule 1 (add it to xtask tidy)"));
                continue;
            }
            if !allowed(name).contains(dep) {
                problems.push(format!("{name} depends on {dep}, which the crate graph does not allow"));
            }
        }
    }
    Ok(())
}

fn check_quant_closure(problems: &mut Vec<String>) -> Result<()> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "tree",
            "-p",
            "eyrie-quant",
            "-e",
            "normal",
            "--no-default-features",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .output()
        .context("running cargo tree")?;
    if !out.status.success() {
        bail!("cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut seen = BTreeSet::new();
    for line in text.lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        if name.starts_with("eyrie-") && name != "eyrie-quant" {
            seen.insert(name.to_string());
        }
        if QUANT_FORBIDDEN.iter().any(|f| name == *f || name.starts_with(&format!("{f}-"))) {
            seen.insert(name.to_string());
        }
    }
    for s in seen {
        problems.push(format!("eyrie-quant (no features) pulls in {s}: quant must stay reusable alone"));
    }
    Ok(())
}

/// Every registry dependency in `[workspace.dependencies]` is pinned exactly (`=x.y.z`): builds here are offline-ish
/// and slow, and a silent minor bump of burn/CubeCL has broken builds before.
fn check_exact_pins(root: &Path, problems: &mut Vec<String>) -> Result<()> {
    let text = std::fs::read_to_string(root.join("Cargo.toml")).context("reading Cargo.toml")?;
    let mut in_table = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_table = line == "[workspace.dependencies]";
            continue;
        }
        if !in_table || line.is_empty() || line.starts_with('#') || line.contains("path =") {
            continue;
        }
        let Some((name, spec)) = line.split_once('=') else { continue };
        let version = match spec.trim().strip_prefix('"') {
            Some(v) => v.split('"').next().unwrap_or_default().to_string(),
            None => spec.split("version").nth(1).and_then(|v| v.split('"').nth(1)).unwrap_or_default().to_string(),
        };
        if !version.starts_with('=') {
            problems
                .push(format!("Cargo.toml: workspace dependency {} is not pinned exactly ({version:?})", name.trim()));
        }
    }
    Ok(())
}

fn check_file_headers(root: &Path, problems: &mut Vec<String>) -> Result<()> {
    let mut stack = vec![root.join("crates"), root.join("xtask"), root.join("tests")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries {
            let e = e?;
            let path = e.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "target") {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
                if !text.trim_start().starts_with("//!") {
                    problems.push(format!("{} does not start with a `//!` line", path.display()));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrows_are_transitive() {
        let a = allowed("eyrie-train");
        assert!(a.contains("eyrie-quant") && a.contains("eyrie-model") && a.contains("eyrie-spec-decode"));
        assert!(allowed("eyrie-quant").is_empty());
        assert!(!allowed("eyrie-model").contains("eyrie-server"));
    }
}
