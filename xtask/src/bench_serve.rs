//! `cargo xtask bench serve`: the serving benchmark (`scripts/bench_serve.py`, in the style of SGLang's
//! `bench_serving`) against a running server, or against an `eyrie serve` this command starts and stops.
//!
//! ```text
//! cargo xtask bench serve [--url URL | --bin PATH] [--server-arg ARG]... [script args...]
//! ```
//!
//! Without `--url` it builds the release `eyrie` (unless `--bin` names one), starts `eyrie serve --port 0
//! --device auto` (the embedded tiny model unless a `--server-arg` says otherwise), reads the URL from the line it
//! prints once it accepts requests, runs the script (JSON to `bench/serve.json` unless the script args name
//! `--json`), then sends SIGTERM and fails unless the server exits 0 within its shutdown deadline.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{cargo, run};

/// How long the server may take from start to "serving" (a CUDA start compiles kernels during its warm-up).
const START_TIMEOUT: Duration = Duration::from_secs(900);
/// How long the server may take to exit after SIGTERM (its default `--shutdown-timeout` is 30 s).
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

struct Options {
    url: Option<String>,
    bin: Option<PathBuf>,
    server_args: Vec<String>,
    script_args: Vec<String>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options { url: None, bin: None, server_args: Vec::new(), script_args: Vec::new() };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "--url" => o.url = Some(value("--url")?),
            "--bin" => o.bin = Some(PathBuf::from(value("--bin")?)),
            "--server-arg" => o.server_args.push(value("--server-arg")?),
            _ => o.script_args.push(a.clone()),
        }
    }
    if o.url.is_some() && (o.bin.is_some() || !o.server_args.is_empty()) {
        bail!("--url benchmarks a running server: --bin and --server-arg start one");
    }
    Ok(o)
}

/// `cargo xtask bench serve ...`.
pub fn run_serve(root: &Path, args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let mut script = Command::new("python3");
    script.arg(root.join("scripts/bench_serve.py"));
    if !o.script_args.iter().any(|a| a == "--json") {
        script.arg("--json").arg(root.join("bench/serve.json"));
    }
    if let Some(url) = &o.url {
        script.arg("--url").arg(url).args(&o.script_args);
        return run(&mut script);
    }

    let bin = match &o.bin {
        Some(b) => b.clone(),
        None => {
            run(cargo().args(["build", "--release", "--locked", "--package", "eyrie-server", "--bin", "eyrie"]))?;
            let target = std::env::var("CARGO_TARGET_DIR").map_or_else(|_| root.join("target"), PathBuf::from);
            target.join("release/eyrie")
        }
    };
    let mut server = Command::new(&bin);
    server.args(["serve", "--port", "0", "--device", "auto"]).args(&o.server_args);
    let built = if o.bin.is_some() { "a prebuilt binary".to_string() } else { format!("built from {}", commit(root)) };
    let label = format!("{} ({built})", crate::render(&server));
    eprintln!("$ {}", crate::render(&server));
    let mut child = server
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let url = match wait_for_url(&mut child) {
        Ok(url) => url,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    eprintln!("bench serve: server ready at {url}");
    if !o.script_args.iter().any(|a| a == "--label") {
        script.arg("--label").arg(&label);
    }
    script.arg("--url").arg(&url).args(&o.script_args);
    let bench = run(&mut script);
    let stopped = stop(&mut child);
    bench?;
    let status = stopped?;
    if !status.success() {
        bail!("eyrie serve exited with {status} after SIGTERM (expected 0)");
    }
    eprintln!("bench serve: the server exited 0 after SIGTERM");
    Ok(())
}

/// Reads the server's stdout until it prints `... serving `NAME` at http://HOST:PORT ...`; a thread keeps
/// forwarding its later stdout to our stderr so the pipe never fills.
fn wait_for_url(child: &mut Child) -> Result<String> {
    let stdout = child.stdout.take().context("the server's stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stdout).lines().map_while(std::io::Result::ok) {
            eprintln!("{line}");
            if !sent && let Some(url) = serving_url(&line) {
                sent = tx.send(url).is_ok();
            }
        }
    });
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(url) => return Ok(url),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = child.wait().context("waiting for the server")?;
                bail!("eyrie serve exited ({status}) before printing its URL");
            }
        }
        if let Some(status) = child.try_wait().context("polling the server")? {
            bail!("eyrie serve exited ({status}) before printing its URL");
        }
        if Instant::now() > deadline {
            bail!("eyrie serve printed no URL within {} s", START_TIMEOUT.as_secs());
        }
    }
}

/// The base URL in eyrie's ready line: the first `http://` word after "serving".
fn serving_url(line: &str) -> Option<String> {
    let rest = &line[line.find("serving")?..];
    let url = &rest[rest.find("http://")?..];
    let end = url.find(|c: char| c.is_whitespace() || c == ')').unwrap_or(url.len());
    Some(url[..end].trim_end_matches('/').to_string())
}

/// SIGTERM (through `kill`, std has no signals), then waits up to [`STOP_TIMEOUT`]; kills it if it hangs.
fn stop(child: &mut Child) -> Result<ExitStatus> {
    let pid = child.id().to_string();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().context("running kill -TERM")?;
    if !sent.success() {
        let _ = child.kill();
        bail!("kill -TERM {pid} failed");
    }
    let deadline = Instant::now() + STOP_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().context("waiting for the server to exit")? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("eyrie serve still running {} s after SIGTERM: killed", STOP_TIMEOUT.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The short commit of the tree, with `-dirty` when it has uncommitted changes; `unknown` without git.
fn commit(root: &Path) -> String {
    let git = |args: &[&str]| Command::new("git").current_dir(root).args(args).output().ok();
    let Some(head) = git(&["rev-parse", "--short", "HEAD"]).filter(|o| o.status.success()) else {
        return "unknown".into();
    };
    let mut s = String::from_utf8_lossy(&head.stdout).trim().to_string();
    if git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|o| !o.stdout.is_empty()) {
        s.push_str("-dirty");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_url_in_the_ready_line() {
        let line = "eyrie: serving `eyrie-tiny` at http://127.0.0.1:41234 (OpenAI API under http://127.0.0.1:41234/v1)";
        assert_eq!(serving_url(line).as_deref(), Some("http://127.0.0.1:41234"));
        assert_eq!(serving_url("eyrie: loading /tmp/x on cpu ..."), None);
    }

    #[test]
    fn splits_own_flags_from_the_script_args() {
        let args: Vec<String> =
            ["--bin", "b", "--num-prompts", "8", "--server-arg", "--max-running-requests", "--server-arg", "4"]
                .map(String::from)
                .to_vec();
        let o = parse(&args).unwrap();
        assert_eq!(o.bin, Some(PathBuf::from("b")));
        assert_eq!(o.server_args, ["--max-running-requests", "4"]);
        assert_eq!(o.script_args, ["--num-prompts", "8"]);
        assert!(parse(&["--url".into(), "http://x".into(), "--bin".into(), "b".into()]).is_err());
    }
}
