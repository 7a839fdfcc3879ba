//! What a test does where the machine lacks something it needs (a tool, an interpreter, the
//! test users, root): it says so and returns. Under `CI=true`, how `.ci/run` runs the suite
//! on a machine `cargo xtask test` has set up, it fails instead: a green CI must not hide a
//! test that never ran. Only what no CI machine can have (a GPU, hardware counters) may
//! skip there too, and no test needs either.
//!
//! Libtest keeps a passing test's output to itself, so each skip is also appended to the file
//! `TRACER_SKIP_LOG` names, which `cargo xtask test` counts in its last line.

use std::{fmt::Display, io::Write};

/// Skips the rest of a test (or of one part of it), saying why; panics under `CI=true`.
pub fn skip(why: impl Display) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true, where nothing may be missing: {why}");
    }
    println!("skipping: {why}");
    if let Some(log) = std::env::var_os("TRACER_SKIP_LOG") {
        let test = std::thread::current().name().unwrap_or("a test").to_owned();
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = writeln!(f, "{test}: {why}");
        }
    }
}
