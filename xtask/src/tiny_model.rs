//! `cargo xtask tiny-model [--check]`: regenerates the embedded default model of `eyrie serve`
//! (`crates/server/assets/tiny-model/`) with eyrie-model's `tiny_model` example, or with `--check` generates it
//! into a temporary directory and fails unless every file equals the committed one byte for byte.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Where the committed model lives, relative to the workspace root.
const ASSET_DIR: &str = "crates/server/assets/tiny-model";

pub fn run(root: &Path, args: &[String]) -> Result<()> {
    match args {
        [] => generate(&root.join(ASSET_DIR)),
        [flag] if flag == "--check" => check(root),
        other => bail!("usage: cargo xtask tiny-model [--check] (got {other:?})"),
    }
}

fn generate(out: &Path) -> Result<()> {
    let out = out.to_str().with_context(|| format!("{} is not UTF-8", out.display()))?;
    crate::run(crate::cargo().args([
        "run",
        "--locked",
        "-p",
        "eyrie-model",
        "--example",
        "tiny_model",
        "--",
        "--out",
        out,
    ]))
}

fn check(root: &Path) -> Result<()> {
    let tmp = std::env::temp_dir().join(format!("eyrie-tiny-model-check-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| tmp.display().to_string())?;
    }
    let result = generate(&tmp).and_then(|()| compare(&root.join(ASSET_DIR), &tmp));
    std::fs::remove_dir_all(&tmp).ok();
    result
}

/// Fails listing every file that is missing on one side or differs.
fn compare(committed: &Path, fresh: &Path) -> Result<()> {
    let (a, b) = (files(committed)?, files(fresh)?);
    let mut problems = Vec::new();
    for name in a.union(&b) {
        let (x, y) = (committed.join(name), fresh.join(name));
        match (a.contains(name), b.contains(name)) {
            (true, false) => problems.push(format!("{name}: committed but not generated")),
            (false, true) => problems.push(format!("{name}: generated but not committed")),
            _ => {
                let same = std::fs::read(&x).with_context(|| x.display().to_string())?
                    == std::fs::read(&y).with_context(|| y.display().to_string())?;
                if !same {
                    problems.push(format!("{name}: differs from a fresh generation"));
                }
            }
        }
    }
    if problems.is_empty() {
        eprintln!("{}: {} files identical to a fresh generation", committed.display(), a.len());
        Ok(())
    } else {
        bail!("{} is not what `cargo xtask tiny-model` writes:\n  {}", committed.display(), problems.join("\n  "))
    }
}

fn files(dir: &Path) -> Result<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(dir).with_context(|| dir.display().to_string())? {
        let path: PathBuf = entry?.path();
        if path.is_dir() {
            bail!("{}: unexpected directory", path.display());
        }
        names.insert(path.file_name().unwrap_or_default().to_string_lossy().into_owned());
    }
    Ok(names)
}
