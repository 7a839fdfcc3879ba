//! The GIL in sampling profiles, end to end: whether each sample's thread held it, on every
//! interpreter, against a program whose threads hold it (pure Python) and release it (hashlib
//! on large buffers) by construction; the GIL-held flame graph against `py-spy --gil`; the
//! per-thread GIL table.

use std::collections::BTreeMap;

use serde_json::Value;
use tracer_tests::{
    cpython_3_15, cpython_sampler, interpreters, parse_folded, py_spy_record, root_or_skip, script,
    venv_python, Daemon,
};

/// Samples by function (`spin`, `digest`) and GIL state (`Some(held)`, None: not read).
fn by_function(report: &Value) -> BTreeMap<(&'static str, Option<bool>), u64> {
    let mut by = BTreeMap::new();
    let stacks = report["profile"]["stacks"]
        .as_array()
        .unwrap_or_else(|| panic!("no stacks in {report}"));
    for s in stacks {
        let frames = s["frames"].as_array().cloned().unwrap_or_default();
        let Some(f) = ["spin", "digest"].into_iter().find(|name| {
            frames
                .iter()
                .any(|f| f["kind"] == "python" && f["name"] == *name)
        }) else {
            continue;
        };
        let held = s["gil_held"].as_bool();
        *by.entry((f, held)).or_default() += s["count"].as_u64().unwrap_or(0);
    }
    by
}

#[test]
fn samples_say_whether_their_thread_held_the_gil_on_every_interpreter() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let workload = script("gil_split.py");
    for python in interpreters() {
        let printed = d.ok(&[
            "start",
            "--mode=sampling",
            "--frequency",
            "250",
            "--format",
            "json",
            "--",
            python.to_str().unwrap(),
            workload.to_str().unwrap(),
            "2",
        ]);
        let json = &printed[printed
            .find('{')
            .unwrap_or_else(|| panic!("no report: {printed}"))..];
        let report: Value = serde_json::from_str(json).unwrap();
        let by = by_function(&report);
        println!("{}: {by:?}", python.display());
        let n = |f: &'static str, held: Option<bool>| by.get(&(f, held)).copied().unwrap_or(0);
        let spin = n("spin", Some(true)) + n("spin", Some(false)) + n("spin", None);
        let digest = n("digest", Some(true)) + n("digest", Some(false)) + n("digest", None);
        assert!(
            spin >= 100 && digest >= 100,
            "{}: too few samples: {by:?}",
            python.display()
        );
        // Every Python thread's sample read the GIL.
        assert!(
            n("spin", None) + n("digest", None) == 0,
            "{}: GIL not read: {by:?}",
            python.display()
        );
        // Pure Python runs holding it; hashing 4 MiB runs without it, and takes it back
        // only between buffers.
        assert!(
            n("spin", Some(true)) * 10 >= spin * 9,
            "{}: spin held the GIL in {} of {spin} samples",
            python.display(),
            n("spin", Some(true))
        );
        assert!(
            n("digest", Some(false)) * 10 >= digest * 8,
            "{}: digest ran without the GIL in {} of {digest} samples",
            python.display(),
            n("digest", Some(false))
        );
    }
}

/// `digest`'s share (%) of the samples under either function.
fn digest_share(lines: &[(Vec<String>, u64)]) -> (f64, u64) {
    let under = |name: &str| -> u64 {
        let prefix = format!("{name} (");
        lines
            .iter()
            .filter(|(f, _)| f.iter().any(|f| f.starts_with(&prefix)))
            .map(|l| l.1)
            .sum()
    };
    let (spin, digest) = (under("spin"), under("digest"));
    (
        100.0 * digest as f64 / (spin + digest).max(1) as f64,
        spin + digest,
    )
}

#[test]
fn the_gil_held_flame_graph_matches_py_spy_gil() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let python = venv_python();
    let workload = script("gil_split.py");
    let out = tempfile::NamedTempFile::new().unwrap();
    d.ok(&[
        "start",
        "--mode=sampling",
        "--frequency",
        "100",
        "--gil",
        "--format",
        "folded",
        "-o",
        out.path().to_str().unwrap(),
        "--",
        python.to_str().unwrap(),
        workload.to_str().unwrap(),
        "3",
    ]);
    let ours = digest_share(&parse_folded(&std::fs::read_to_string(out.path()).unwrap()));

    let (theirs, _) = py_spy_record(
        "100",
        &["--gil"],
        &[python.as_os_str(), workload.as_os_str(), "3".as_ref()],
    );
    let theirs = digest_share(&theirs);
    println!("GIL-held samples under digest: tracer {ours:.1?}, py-spy --gil {theirs:.1?}");
    assert!(ours.1 >= 50 && theirs.1 >= 50, "too few samples");
    // Holding the GIL is what spin does; digest holds it only between buffers.
    assert!(
        ours.0 <= 10.0,
        "digest held the GIL in {:.1}% of tracer's samples",
        ours.0
    );
    assert!(
        (ours.0 - theirs.0).abs() <= 5.0,
        "digest's share of GIL-held samples: tracer {:.1}%, py-spy --gil {:.1}%",
        ours.0,
        theirs.0
    );

    // The table names each thread's share holding the GIL, running without it and waiting
    // for it.
    let table = d.ok(&[
        "start",
        "--mode=sampling",
        "--frequency",
        "100",
        "--off-cpu",
        "--",
        python.to_str().unwrap(),
        workload.to_str().unwrap(),
        "2",
    ]);
    println!("{table}");
    let gil = table
        .split_once("The GIL:")
        .unwrap_or_else(|| panic!("no GIL table: {table}"))
        .1;
    // Two threads of the workload (pure Python first, holding it most), the main thread.
    let rows: Vec<Vec<f64>> = gil
        .lines()
        .skip(3)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| {
            let v: Vec<f64> = l
                .split_whitespace()
                .skip(2)
                .take(4)
                .filter_map(|c| c.trim_end_matches('%').parse().ok())
                .collect();
            (v.len() == 4).then_some(v)
        })
        .collect();
    assert!(rows.len() >= 2, "GIL rows: {gil}");
    // Shares of wall time depend on the machine's load (preempted time is "other"); what
    // each thread did on the CPU does not.
    // The pure-Python thread holds it most; the hashing one runs without it most (the main
    // thread, waiting to join, may have a row too).
    let most = |i: usize| {
        rows.iter()
            .max_by(|a, b| a[i].total_cmp(&b[i]))
            .expect("rows")
    };
    let (spin, digest) = (most(0), most(1));
    assert!(
        spin[0] >= 20.0 && spin[0] >= 5.0 * spin[1],
        "spin: held {}%, without {}%: {gil}",
        spin[0],
        spin[1]
    );
    assert!(
        digest[1] >= 10.0 && digest[1] >= 5.0 * digest[0],
        "digest: held {}%, without {}%: {gil}",
        digest[0],
        digest[1]
    );
}

/// `digest`'s share (%) of the samples under either function in CPython's own collapsed
/// stacks (`tid:N;file:qualname:line;… count`), and the samples counted.
fn cpython_digest_share(collapsed: &str) -> (f64, u64) {
    let (mut spin, mut digest) = (0u64, 0u64);
    for line in collapsed.lines() {
        let Some((frames, n)) = line.rsplit_once(' ') else {
            continue;
        };
        let n: u64 = n.parse().unwrap_or(0);
        let has = |f: &str| frames.split(';').any(|fr| fr.contains(&format!(":{f}:")));
        if has("digest") {
            digest += n;
        } else if has("spin") {
            spin += n;
        }
    }
    (
        100.0 * digest as f64 / (spin + digest).max(1) as f64,
        spin + digest,
    )
}

#[test]
fn the_gil_held_flame_graph_matches_cpython_3_15s_gil_mode() {
    if !root_or_skip() {
        return;
    }
    let Some(python) = cpython_3_15() else {
        return;
    };
    let d = Daemon::start();
    let workload = script("gil_split.py");
    let dir = tempfile::tempdir().unwrap();
    let ours_file = dir.path().join("ours.folded");
    d.ok(&[
        "start",
        "--mode=sampling",
        "--frequency",
        "200",
        "--gil",
        "--format",
        "folded",
        "-o",
        ours_file.to_str().unwrap(),
        "--",
        python.to_str().unwrap(),
        workload.to_str().unwrap(),
        "3",
    ]);
    let ours = digest_share(&parse_folded(&std::fs::read_to_string(&ours_file).unwrap()));
    // CPython's own sampler, in its GIL mode (samples of threads holding the GIL), every
    // thread, at the same rate.
    let theirs = cpython_digest_share(&cpython_sampler(
        &python,
        &["--mode", "gil", "-a"],
        200,
        &workload,
        &["3"],
    ));
    println!(
        "GIL-held samples under digest on 3.15: tracer {ours:.1?}, CPython's gil mode {theirs:.1?}"
    );
    assert!(ours.1 >= 50 && theirs.1 >= 50, "too few samples");
    assert!(
        (ours.0 - theirs.0).abs() <= 5.0,
        "digest's share of GIL-held samples: tracer {:.1}%, CPython 3.15's gil mode {:.1}%",
        ours.0,
        theirs.0
    );
}
