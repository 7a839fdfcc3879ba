//! asyncio task stacks in sampling profiles (`--asyncio`, CPython 3.11+), end to end: a
//! program with a known tree of tasks (`asyncio_tree.py`), its stacks against the tree that
//! CPython's own `python -m asyncio pstree` shows (3.14+) or the program prints from
//! asyncio's own objects (3.11–3.13), its shares against the program's own timing and
//! against CPython 3.15's sampler (`profiling.sampling --async-aware`); 3.10 says it has
//! none.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read},
    path::Path,
    process::{Command, Stdio},
};

use tracer_tests::{
    chroot_interpreters, cpython_3_15, cpython_sampler, interpreters, one_line_error, parse_folded,
    root_or_skip, script, ChildGuard, Daemon,
};

/// The workload, running for `seconds` (`args`: and how its leaves work), once its tasks
/// stand; and what it prints after.
fn start_tree(python: &Path, args: &[&str]) -> (ChildGuard, BufReader<std::process::ChildStdout>) {
    let mut child = ChildGuard::spawn(
        Command::new(python)
            .arg(script("asyncio_tree.py"))
            .args(args)
            .stdout(Stdio::piped()),
    );
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n", "{}", python.display());
    (child, out)
}

/// leaf-a's share of the leaves' computing, as the program timed it.
fn own_share(mut child: ChildGuard, mut out: BufReader<std::process::ChildStdout>) -> f64 {
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(child.0.wait().unwrap().success(), "{rest}");
    rest.trim()
        .strip_prefix("leaf-a ")
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no share printed: {rest}"))
}

/// Each leaf task's chain in `python -m asyncio pstree`'s tree, root first, in tracer's
/// labels: `[task: NAME]` for a task, `func (file:line)` for a coroutine where it awaits.
fn pstree_chains(python: &Path, pid: u32) -> BTreeMap<String, Vec<String>> {
    let mut last = String::new();
    // A snapshot read while the loop switches tasks can fail; CPython's tool says so.
    for _ in 0..5 {
        let out = Command::new(python)
            .env("LC_ALL", "C")
            .args(["-m", "asyncio", "pstree", &pid.to_string()])
            .output()
            .unwrap();
        last = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            continue;
        }
        let mut path: Vec<String> = Vec::new();
        let mut chains = BTreeMap::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let content = line.trim_start_matches(['│', '├', '└', '─', ' ']);
            let depth = line.chars().count() - content.chars().count();
            let level = depth / 4;
            if level == 0 || content.is_empty() {
                continue;
            }
            path.truncate(level - 1);
            let label = match content.strip_prefix("(T) ") {
                Some(name) => format!("[task: {name}]"),
                None => match content.rsplit_once(' ') {
                    Some((func, at)) => format!("{} ({at})", func.trim()),
                    None => content.to_owned(),
                },
            };
            path.push(label.clone());
            if let Some(name) = label.strip_prefix("[task: leaf-") {
                chains.insert(format!("leaf-{}", name.trim_end_matches(']')), path.clone());
            }
        }
        if chains.len() == 2 {
            return chains;
        }
    }
    panic!("pstree of {pid}: {last}");
}

/// Samples under `spin` (in a leaf) by the chain before it, from the process frame's child
/// up to its leaf task.
fn chains(folded: &str) -> BTreeMap<Vec<String>, u64> {
    chains_under(folded, "spin (")
}

/// Samples (or time) under the leaves' `work` function, by the chain before it.
fn chains_under(folded: &str, work: &str) -> BTreeMap<Vec<String>, u64> {
    let mut by = BTreeMap::new();
    for (frames, n) in parse_folded(folded) {
        if !frames.iter().any(|f| f.starts_with(work)) {
            continue;
        }
        let end = frames
            .iter()
            .position(|f| f.starts_with("[task: leaf-"))
            .map_or(frames.len(), |i| i + 1);
        *by.entry(frames[1..end].to_vec()).or_default() += n;
    }
    by
}

fn sample(d: &Daemon, pid: u32, out: &Path, extra: &[&str]) {
    let pid = pid.to_string();
    let mut args = vec![
        "start",
        "--mode=sampling",
        "--asyncio",
        "--pid",
        &pid,
        "--frequency",
        "250",
        "--duration",
        "4s",
        "--wait",
        "--format",
        "folded",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    d.ok(&args);
}

/// Each leaf task's chain as the program itself prints it (`tree`: from `all_tasks()`,
/// each task's `_fut_waiter` and its coroutines' `cr_await`), for interpreters that have no
/// `python -m asyncio pstree`.
fn printed_chains(out: &mut BufReader<std::process::ChildStdout>) -> BTreeMap<String, Vec<String>> {
    let mut chains = BTreeMap::new();
    while chains.len() < 2 {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let (leaf, chain) = line
            .trim()
            .strip_prefix("chain ")
            .and_then(|l| l.split_once(": "))
            .unwrap_or_else(|| panic!("no chain printed: {line:?}"));
        chains.insert(
            leaf.to_owned(),
            chain.split(';').map(str::to_owned).collect(),
        );
    }
    chains
}

/// Runs the tree on `python` (`args`: how long, how its leaves work), samples it (`extra`
/// options besides `--asyncio`) and checks what is under the leaves' `work` function: at
/// least `min_total`, and at least `chain_pct`% of it under the chain pstree shows for its
/// leaf (or, with `tree` in `args`, the program prints); leaf-a's share within 5 points of
/// the program's own timing.
fn check_tree(
    d: &Daemon,
    python: &Path,
    args: &[&str],
    extra: &[&str],
    work: &str,
    min_total: u64,
    chain_pct: u64,
) {
    let dir = tempfile::tempdir().unwrap();
    let (child, mut out) = start_tree(python, args);
    let truth = match args.contains(&"tree") {
        true => printed_chains(&mut out),
        false => pstree_chains(python, child.pid()),
    };
    let file = dir.path().join("ours.folded");
    sample(d, child.pid(), &file, extra);
    let own = own_share(child, out);
    let ours = chains_under(&std::fs::read_to_string(&file).unwrap(), work);
    let total: u64 = ours.values().sum();
    let leaf = |name: &str| ours.get(&truth[name]).copied().unwrap_or(0);
    let python = python.display();
    println!("{python} {args:?}: pstree {truth:?}\n  ours {ours:?}");
    assert!(total >= min_total, "{python}: {total} under {work}");
    assert!(
        (leaf("leaf-a") + leaf("leaf-b")) * 100 >= total * chain_pct,
        "{python}: task chains differ from pstree's {truth:?}: {ours:?}"
    );
    let share = leaf("leaf-a") as f64 / total as f64;
    println!("  leaf-a: tracer {share:.3}, the program's own timing {own:.3}");
    assert!(
        (share - own).abs() <= 0.05,
        "{python}: leaf-a's share {share:.3}, timed {own:.3}"
    );
}

#[test]
fn task_stacks_are_the_tree_asyncio_pstree_shows_on_3_14_and_3_15() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    for python in chroot_interpreters() {
        // Every sample in a leaf starts with the chain pstree shows for that leaf.
        check_tree(&d, &python, &["6"], &[], "spin (", 500, 97);
    }
}

/// 3.11–3.13 publish no offsets for their tasks: tracer's own table of their structs, the
/// running task found from its `Handle._run`, and who awaits a task from its done-callbacks
/// (through `gather`'s here) give the chains the program itself sees, on every such
/// interpreter here (pyenv's, and Debian's stripped 3.11).
#[test]
fn task_stacks_on_3_11_to_3_13_are_the_tree_the_program_sees() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    for python in older() {
        check_tree(&d, &python, &["6", "tree"], &[], "spin (", 500, 97);
    }
}

/// CPython 3.11–3.13 here: pyenv's, and Debian's stripped 3.11.
fn older() -> Vec<std::path::PathBuf> {
    let older: Vec<_> = interpreters()
        .into_iter()
        .filter(|p| {
            ["3.11", "3.12", "3.13"]
                .iter()
                .any(|v| p.to_string_lossy().ends_with(v))
        })
        .collect();
    assert!(older.len() >= 3, "CPython 3.11–3.13 expected: {older:?}");
    older
}

/// Leaves that block the loop (`time.sleep` in a coroutine): with `--off-cpu`, the time
/// each blocks is under its own task chain, as pstree shows it, in the program's own
/// proportions, on 3.14+ and on 3.11–3.13. These records go out at the sleep's system call
/// exit.
#[test]
fn time_a_task_blocks_the_loop_is_under_its_task_chain() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    for python in chroot_interpreters() {
        // Every sleep (1-2 ms) a record of its own.
        let extra = ["--off-cpu", "--off-cpu-min", "100us"];
        check_tree(&d, &python, &["6", "block"], &extra, "block (", 1, 95);
    }
    for python in older() {
        let extra = ["--off-cpu", "--off-cpu-min", "100us"];
        check_tree(
            &d,
            &python,
            &["6", "block", "tree"],
            &extra,
            "block (",
            1,
            95,
        );
    }
}

#[test]
fn task_shares_match_cpython_3_15s_async_aware_sampler() {
    if !root_or_skip() {
        return;
    }
    let Some(python) = cpython_3_15() else {
        return;
    };
    let d = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ours.folded");
    let (child, out) = start_tree(&python, &["6"]);
    sample(&d, child.pid(), &file, &[]);
    own_share(child, out);
    let ours = chains(&std::fs::read_to_string(&file).unwrap());
    // CPython's sampler on the same workload, run again.
    let collapsed = cpython_sampler(
        &python,
        &["--async-aware"],
        250,
        &script("asyncio_tree.py"),
        &["5"],
    );
    // Their frames: `<task>:NAME:0` and `file:func:line`; as ours: tasks and functions.
    let mut theirs: BTreeMap<Vec<String>, u64> = BTreeMap::new();
    for (frames, n) in parse_folded(&collapsed) {
        if !frames.iter().any(|f| f.contains(":spin:")) {
            continue;
        }
        let names: Vec<String> = frames
            .iter()
            .skip(1)
            .map(|f| match f.strip_prefix("<task>:") {
                Some(t) => format!("[task: {}]", t.rsplit_once(':').map_or(t, |x| x.0)),
                None => f.split(':').nth(1).unwrap_or(f).to_owned(),
            })
            .collect();
        let end = names
            .iter()
            .position(|f| f.starts_with("[task: leaf-"))
            .map_or(names.len(), |i| i + 1);
        *theirs.entry(names[..end].to_vec()).or_default() += n;
    }
    // Ours by function names alone (their lines are where each awaits, as ours).
    let mut ours_named: BTreeMap<Vec<String>, u64> = BTreeMap::new();
    for (chain, n) in ours {
        let names = chain
            .iter()
            .map(|f| f.split(" (").next().unwrap_or(f).to_owned())
            .collect();
        *ours_named.entry(names).or_default() += n;
    }
    println!("tracer {ours_named:?}\nCPython 3.15 {theirs:?}");
    let share = |by: &BTreeMap<Vec<String>, u64>| {
        let total: u64 = by.values().sum();
        let a: u64 = by
            .iter()
            .filter(|(k, _)| k.last().is_some_and(|t| t == "[task: leaf-a]"))
            .map(|(_, n)| n)
            .sum();
        (a as f64 / total.max(1) as f64, total)
    };
    let (ours_a, ours_n) = share(&ours_named);
    let (theirs_a, theirs_n) = share(&theirs);
    assert!(ours_n >= 500 && theirs_n >= 500, "too few samples");
    // The chain both see most is the same.
    let top = |by: &BTreeMap<Vec<String>, u64>| {
        by.iter().max_by_key(|(_, n)| **n).map(|(k, _)| k.clone())
    };
    assert_eq!(
        top(&ours_named),
        top(&theirs),
        "the commonest task chain differs"
    );
    // Two samplings of two runs, ~1,000 samples each: 6 points is ~3 standard errors.
    assert!(
        (ours_a - theirs_a).abs() <= 0.06,
        "leaf-a's share: tracer {ours_a:.3}, CPython 3.15's sampler {theirs_a:.3}"
    );
}

#[test]
fn older_interpreters_and_other_modes_say_they_have_no_task_stacks() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let refused = d.run(&["start", "--mode=counting", "--asyncio", "--", "true"]);
    assert!(
        one_line_error(&refused).contains("for sampling sessions"),
        "{}",
        one_line_error(&refused)
    );
    let Some(old) = interpreters()
        .into_iter()
        .find(|p| p.to_string_lossy().contains("python3.10"))
    else {
        tracer_testkit::skip("no CPython 3.10 (pyenv)");
        return;
    };
    let (child, out) = start_tree(&old, &["3"]);
    let printed = d.ok(&[
        "start",
        "--mode=sampling",
        "--asyncio",
        "--pid",
        &child.pid().to_string(),
        "--duration",
        "1s",
        "--wait",
        "--format",
        "json",
    ]);
    own_share(child, out);
    let report: serde_json::Value = serde_json::from_str(&printed[printed.find('{').unwrap()..])
        .unwrap_or_else(|e| panic!("{e}: {printed}"));
    let text = report.to_string();
    assert!(
        text.contains("asyncio task stacks need CPython 3.11"),
        "no note: {text}"
    );
    // The event loop's frames stay.
    assert!(text.contains("run_forever"), "{text}");
    assert!(!text.contains("\"task\""), "{text}");
}
