//! The test run's last line: cargo's own results added up, and the skips the tests logged
//! (`tracer_testkit::skip`, through `TRACER_SKIP_LOG`: libtest keeps a passing test's output
//! to itself), so that a run says at a glance how much of it ran.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

/// (passed, failed) from one of libtest's `test result:` lines.
fn counts(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("test result: ")?;
    let number = |word: &str| {
        rest.split(';').find_map(|part| {
            part.trim()
                .strip_suffix(word)?
                .split_whitespace()
                .last()?
                .parse()
                .ok()
        })
    };
    Some((number(" passed")?, number(" failed")?))
}

/// Runs `cmd` (a `cargo test`), its output passed through, then prints the skips the tests
/// logged in `skip_log` and one line: `tests: N passed, N failed, N skipped` (a skipped
/// test, or part of one, is among the passed).
pub fn run(cmd: &mut Command, skip_log: &Path) -> Result<()> {
    let _ = std::fs::remove_file(skip_log);
    cmd.env("TRACER_SKIP_LOG", skip_log).stdout(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("running {cmd:?}"))?;
    let (mut passed, mut failed) = (0, 0);
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        println!("{line}");
        if let Some((p, f)) = counts(&line) {
            passed += p;
            failed += f;
        }
    }
    let status = child.wait()?;
    let skips: Vec<String> = std::fs::read_to_string(skip_log)
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_default();
    for s in &skips {
        println!("skipped: {s}");
    }
    println!(
        "tests: {passed} passed, {failed} failed, {} skipped",
        skips.len()
    );
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_are_added_up() {
        assert_eq!(
            counts("test result: ok. 74 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 8.09s"),
            Some((74, 0))
        );
        assert_eq!(
            counts("test result: FAILED. 9 passed; 1 failed; 0 ignored; 0 measured"),
            Some((9, 1))
        );
        assert_eq!(counts("running 4 tests"), None);
    }
}
