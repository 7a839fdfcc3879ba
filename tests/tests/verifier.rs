//! A kernel whose verifier refuses a program: the mode goes on with a smaller variant and
//! the report says what is missing. The refusal is made by `TRACER_REFUSE_PROGRAMS`, the
//! switch tracerd reads for tests; the budgets themselves are `cargo xtask verifier`'s.

use std::process::Command;

use tracer_tests::{
    bin, interpreters, parse_folded, root_or_skip, script, ChildGuard, Daemon, DaemonOptions,
};

/// `tracer_sample` refused: sampling with `--asyncio` loads the variant without the task
/// walk, its samples keep their Python frames, no task is shown, and the report says why.
#[test]
fn a_refused_sampling_program_samples_without_task_stacks_and_says_so() {
    if !root_or_skip() {
        return;
    }
    let python = interpreters()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with("3.12"))
        .expect("a CPython 3.12 (pyenv)");
    let d = Daemon::start_with(DaemonOptions {
        env: vec![("TRACER_REFUSE_PROGRAMS".into(), "tracer_sample".into())],
        ..DaemonOptions::default()
    });
    let child = ChildGuard::spawn_ready(
        Command::new(&python)
            .arg(script("asyncio_tree.py"))
            .arg("4"),
    );
    let pid = child.pid().to_string();
    let table = d.ok(&[
        "start",
        "--mode=sampling",
        "--asyncio",
        "--pid",
        &pid,
        "--frequency",
        "250",
        "--duration",
        "2s",
        "--wait",
    ]);
    assert!(
        table.contains(
            "note: no asyncio task stacks: this kernel refused the program that walks them"
        ) && table.contains("TRACER_REFUSE_PROGRAMS"),
        "{table}"
    );
    let id = table
        .lines()
        .find_map(|l| l.strip_prefix("session "))
        .and_then(|l| l.split_whitespace().next())
        .expect("a session id")
        .to_owned();
    let folded = d.ok(&["report", &id, "--format", "folded"]);
    let stacks = parse_folded(&folded);
    let in_spin: u64 = stacks
        .iter()
        .filter(|(frames, _)| frames.iter().any(|f| f.starts_with("spin (")))
        .map(|(_, n)| n)
        .sum();
    assert!(in_spin >= 100, "{in_spin} samples in spin:\n{folded}");
    assert!(
        !stacks
            .iter()
            .any(|(frames, _)| frames.iter().any(|f| f.starts_with("[task: "))),
        "task frames from a program that does not walk tasks:\n{folded}"
    );
}

/// `tracerd --check-programs` loads every program and prints the verifier's figures for
/// each; a refused one makes it fail and is named with the reason.
#[test]
fn check_programs_names_a_refused_program_and_fails() {
    if !root_or_skip() {
        return;
    }
    let out = Command::new(bin("tracerd"))
        .arg("--check-programs")
        .env("TRACER_REFUSE_PROGRAMS", "tracer_native_call")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("refused tracer_native_call: ")),
        "{text}"
    );
    // Every other program loaded, with figures from this kernel.
    let loaded: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("tracer_") && !l.starts_with("tracer_native_call "))
        .collect();
    assert!(loaded.len() >= 15, "{text}");
    for line in loaded {
        let processed: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no figures: {line}"));
        assert!(processed > 0, "{line}");
    }
}

/// `tracer_process_exit` refused: tracerd starts with its variant that does not unwind an
/// exiting thread's Python frames, and processes are still followed to their exits (a
/// tracing session's calls in a forked child and its parent, each process seen exiting).
#[test]
fn a_refused_exit_program_leaves_processes_followed() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start_with(DaemonOptions {
        env: vec![(
            "TRACER_REFUSE_PROGRAMS".into(),
            "tracer_process_exit".into(),
        )],
        ..DaemonOptions::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let program = dir.path().join("forks.py");
    std::fs::write(
        &program,
        "import os\ndef f(n): return n\nfor i in range(1000): f(i)\n\
         if os.fork() == 0:\n    [f(i) for i in range(10)]\nelse:\n    os.wait()\n",
    )
    .unwrap();
    let python = interpreters()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with("3.12"))
        .expect("a CPython 3.12 (pyenv)");
    let report = d.ok(&[
        "start",
        "--mode=tracing",
        "--limit",
        "0",
        "--",
        python.to_str().unwrap(),
        program.to_str().unwrap(),
    ]);
    let calls: Vec<u64> = report
        .lines()
        .filter(|l| l.ends_with("forks.py:2(f)"))
        .filter_map(|l| l.split_whitespace().next()?.replace(',', "").parse().ok())
        .collect();
    let mut sorted = calls.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, [10, 1000], "{report}");
    let followed = report
        .lines()
        .find_map(|l| l.trim().strip_prefix("processes: "))
        .unwrap_or_else(|| panic!("no processes line: {report}"));
    let n: Vec<&str> = followed.split_whitespace().collect();
    assert!(
        n.len() >= 4 && n[0] == n[2] && n[1] == "followed," && n[3].starts_with("exited"),
        "every followed process seen exiting: {followed}"
    );
}
