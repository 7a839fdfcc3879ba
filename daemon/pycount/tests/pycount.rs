//! Loads libtracer_pycount.so into real interpreters (pyenv's 3.10 to 3.13, and Debian's
//! 3.14 and 3.15 through `target/cpython-bin`'s wrappers where `cargo xtask setup` made
//! them), drives it as tracerd's script would (tests/pycount_workload.py) and checks what it
//! wrote into the shared files against sys.setprofile's and cProfile's counts of the same
//! run.
//!
//! `cargo test` does not build a cdylib-only library for the tests (they could not link to
//! it): the tests run `cargo build -p tracer-pycount` themselves, with their own profile and
//! target directory, and load the library from there.

use std::{
    collections::BTreeMap,
    ffi::OsStr,
    fs,
    io::{BufRead, BufReader, Read, Write},
    os::unix::io::AsRawFd,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        OnceLock,
    },
};

use tracer_common::inproc::{self, state, Edge, Entry, Header};

const WORKLOAD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/pycount_workload.py");

/// The library as it stands now: built here, since `cargo test` does not build a
/// cdylib-only library for its tests (they cannot link to it), and an earlier build's copy
/// may be stale. A no-op when it is up to date.
fn library() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("test executable");
            // <target>/<profile dir>/deps/<test>
            let profile_dir = exe.parent().and_then(Path::parent).expect("profile dir");
            let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
                Some("debug") => "dev",
                Some(other) => other,
                None => panic!("no profile in {}", exe.display()),
            };
            let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .parent()
                .expect("target dir");
            let status = Command::new(env!("CARGO"))
                .args(["build", "-p", "tracer-pycount", "--profile", profile])
                .arg("--target-dir")
                .arg(target_dir)
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("cargo build");
            assert!(status.success(), "cargo build -p tracer-pycount: {status}");
            let so = profile_dir.join("libtracer_pycount.so");
            assert!(so.exists(), "{} not built", so.display());
            so
        })
        .clone()
}

/// The interpreters to run, by name; missing ones are reported and skipped.
fn interpreters() -> Vec<(String, PathBuf)> {
    let mut found = pyenv(&["3.12", "3.13"]);
    let wrappers = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/cpython-bin/static");
    for minor in ["3.14", "3.15"] {
        let python = wrappers.join(format!("python{minor}"));
        if python.exists() {
            found.push((minor.to_string(), python));
        } else {
            tracer_testkit::skip(format_args!(
                "no {} (made by `cargo xtask setup`)",
                python.display()
            ));
        }
    }
    found
}

/// pyenv's newest build of each of `minors`; missing ones are reported and skipped.
fn pyenv(minors: &[&str]) -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    let pyenv = std::env::var_os("HOME").map(|h| Path::new(&h).join(".pyenv/versions"));
    for &minor in minors {
        let best = pyenv
            .as_ref()
            .and_then(|d| fs::read_dir(d).ok())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let patch: u32 = name.strip_prefix(minor)?.strip_prefix('.')?.parse().ok()?;
                let python = e.path().join("bin/python3");
                python.exists().then_some((patch, python))
            })
            .max();
        match best {
            Some((_, python)) => found.push((minor.to_string(), python)),
            None => tracer_testkit::skip(format_args!(
                "no pyenv CPython {minor} (~/.pyenv/versions/{minor}.*)"
            )),
        }
    }
    found
}

/// A fresh directory under the temp dir (which the chrooted interpreters see too).
fn workdir(what: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tracer-pycount-{}-{}-{}",
        std::process::id(),
        what,
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// The counts files in `dir` (a forked child's, named by its pid).
fn counts_files(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(inproc::FILE_PREFIX))
        })
        .collect()
}

/// A session's file as tracerd creates it.
fn session_file(path: &Path, st: u32) -> fs::File {
    let h = Header::new(0, st, inproc::CAPS);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap();
    f.set_len(inproc::file_size(inproc::ENTRIES, inproc::EDGES, inproc::STRINGS) as u64)
        .unwrap();
    // SAFETY: Header is plain old data.
    let bytes =
        unsafe { std::slice::from_raw_parts((&raw const h).cast::<u8>(), size_of::<Header>()) };
    std::os::unix::fs::FileExt::write_all_at(&f, bytes, 0).unwrap();
    f
}

/// tracerd's lock, held while it lives.
fn lock(f: &fs::File) {
    // SAFETY: an open descriptor.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
}

fn python(py: &Path, args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let out = Command::new(py)
        .arg(WORKLOAD)
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .unwrap();
    if !out.status.success() {
        panic!(
            "{} {:?} failed ({}):\n{}\n{}",
            py.display(),
            args.iter().map(|a| a.as_ref()).collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// A function: file, first line, qualified name.
type Func = (String, String, String);
type Pair = (Func, Func);

/// What a counts file holds, keyed by names.
struct Counts {
    header: Header,
    calls: BTreeMap<Func, [u64; 4]>,
    /// ncalls, primitive, tottime, cumtime.
    edges: BTreeMap<Pair, [u64; 4]>,
}

fn read<T: Copy>(data: &[u8], offset: usize) -> T {
    assert!(offset + size_of::<T>() <= data.len());
    // SAFETY: in bounds (checked); the types are plain old data.
    unsafe { std::ptr::read_unaligned(data.as_ptr().add(offset).cast()) }
}

fn read_counts(path: &Path) -> Counts {
    let data = fs::read(path).unwrap();
    let header: Header = read(&data, 0);
    assert_eq!(header.magic, inproc::MAGIC, "{}", path.display());
    assert_eq!(header.version, inproc::VERSION);
    let (ne, nd) = (header.entries_cap as usize, header.edges_cap as usize);
    assert_eq!(
        data.len(),
        inproc::file_size(ne, nd, header.strings_cap as usize)
    );
    let strings = &data[inproc::strings_offset(ne, nd)..];
    let text = |s: inproc::StrRef| {
        let r = s.offset as usize..(s.offset + s.len) as usize;
        assert!(r.end <= header.strings_used as usize);
        String::from_utf8(strings[r].to_vec()).expect("names are UTF-8")
    };
    let mut names = BTreeMap::new();
    let mut calls = BTreeMap::new();
    for i in 0..ne {
        let e: Entry = read(&data, inproc::entries_offset() + i * size_of::<Entry>());
        if e.code == 0 {
            continue;
        }
        let f = (
            text(e.filename),
            e.firstlineno.to_string(),
            text(e.qualname),
        );
        assert!(e.tottime_ns <= e.cumtime_ns, "{f:?}: {e:?}");
        let c: &mut [u64; 4] = calls.entry(f.clone()).or_default();
        c[0] += e.ncalls;
        c[1] += e.primitive;
        c[2] += e.tottime_ns;
        c[3] += e.cumtime_ns;
        names.insert(e.code, f);
    }
    assert_eq!(names.len(), header.entries_used as usize);
    let mut edges = BTreeMap::new();
    let mut used = 0;
    for i in 0..nd {
        let e: Edge = read(&data, inproc::edges_offset(ne) + i * size_of::<Edge>());
        if e.callee == 0 {
            continue;
        }
        used += 1;
        let key = (names[&e.caller].clone(), names[&e.callee].clone());
        let c: &mut [u64; 4] = edges.entry(key).or_default();
        c[0] += e.ncalls;
        c[1] += e.primitive;
        c[2] += e.tottime_ns;
        c[3] += e.cumtime_ns;
    }
    assert_eq!(used, header.edges_used as usize);
    assert_eq!(
        (header.lost_calls, header.lost_edges, header.lost_names),
        (0, 0, 0)
    );
    assert_eq!(header.busy, 0);
    Counts {
        header,
        calls,
        edges,
    }
}

fn is_workload(f: &Func) -> bool {
    f.0 == WORKLOAD && f.2.rsplit('.').next().unwrap().starts_with("wl_")
}

/// Ground truth written by the script: calls and pairs, (ncalls, primitive).
fn read_truth(path: &Path) -> (BTreeMap<Func, [u64; 2]>, BTreeMap<Pair, [u64; 2]>) {
    let text = fs::read_to_string(path).unwrap();
    let (mut calls, mut edges) = (BTreeMap::new(), BTreeMap::new());
    for line in text.lines() {
        let f: Vec<&str> = line.split('\t').collect();
        let func = |i: usize| (f[i].to_string(), f[i + 1].to_string(), f[i + 2].to_string());
        let n = |i: usize| -> u64 { f[i].parse().unwrap() };
        match f[0] {
            "call" => {
                calls.insert(func(1), [n(4), n(5)]);
            }
            "edge" => {
                edges.insert((func(1), func(4)), [n(7), n(8)]);
            }
            other => panic!("bad line {other}"),
        }
    }
    (calls, edges)
}

/// The counter's calls and pairs of workload functions against the ground truth's.
fn compare(what: &str, counts: &Counts, truth: &Path, at_least: usize) {
    let (gt_calls, gt_edges) = read_truth(truth);
    let ours: BTreeMap<_, _> = counts
        .calls
        .iter()
        .filter(|(f, _)| is_workload(f))
        .map(|(f, c)| (f.clone(), [c[0], c[1]]))
        .collect();
    let theirs: BTreeMap<_, _> = gt_calls
        .into_iter()
        .filter(|(f, _)| is_workload(f))
        .collect();
    assert!(
        theirs.len() >= at_least,
        "{what}: too few functions ran: {theirs:?}"
    );
    assert_eq!(ours, theirs, "{what}: calls (ncalls, primitive) differ");
    let ours: BTreeMap<_, _> = counts
        .edges
        .iter()
        .filter(|((_, callee), _)| is_workload(callee))
        .map(|(k, v)| (k.clone(), [v[0], v[1]]))
        .collect();
    let theirs: BTreeMap<_, _> = gt_edges
        .into_iter()
        .filter(|((_, callee), _)| is_workload(callee))
        .collect();
    assert_eq!(
        ours, theirs,
        "{what}: caller pairs (ncalls, primitive) differ"
    );
    check_times(what, counts);
}

/// A function never active twice on a thread spends its cumulative time in itself and in
/// the calls it makes, to the nanosecond: cumtime = tottime + the pairs' cumtimes.
fn check_times(what: &str, counts: &Counts) {
    let mut checked = 0;
    for (f, c) in counts
        .calls
        .iter()
        .filter(|(f, c)| is_workload(f) && c[0] == c[1])
    {
        let callees: u64 = counts
            .edges
            .iter()
            .filter(|((caller, _), _)| caller == f)
            .map(|(_, e)| e[3])
            .sum();
        assert_eq!(c[3], c[2] + callees, "{what}: times of {f:?}");
        checked += 1;
    }
    assert!(checked >= 5, "{what}: {checked} functions' times checked");
    // Each call's own time goes to its caller pair too; a function only ever calling itself
    // (no other path back to it) has its outermost calls' times in its other callers' pairs.
    for (f, c) in counts.calls.iter().filter(|(f, _)| is_workload(f)) {
        let into: Vec<_> = counts
            .edges
            .iter()
            .filter(|((_, callee), _)| callee == f)
            .collect();
        if into.iter().map(|(_, e)| e[0]).sum::<u64>() != c[0] {
            // Some calls had no caller: the bottom of a thread's stack.
            continue;
        }
        let tt: u64 = into.iter().map(|(_, e)| e[2]).sum();
        assert_eq!(c[2], tt, "{what}: tottime of {f:?} and its callers'");
        if ["wl_fib", "wl_raise"].contains(&f.2.as_str()) {
            let ct: u64 = into
                .iter()
                .filter(|((caller, _), _)| caller != f)
                .map(|(_, e)| e[3])
                .sum();
            assert_eq!(c[3], ct, "{what}: cumtime of {f:?} and its callers'");
        }
    }
}

#[test]
fn counts_match_setprofile_across_threads_and_fork() {
    let so = library();
    for (version, py) in interpreters() {
        let dir = workdir(&format!("count{version}"));
        let plain = python(&py, &[&"plain", &dir]);
        let file = dir.join("session");
        let f = session_file(&file, state::PENDING);
        lock(&f);
        let counted = python(&py, &[&"count", &so, &file, &dir]);
        assert_eq!(
            String::from_utf8_lossy(&counted.stdout),
            String::from_utf8_lossy(&plain.stdout),
            "{version}: counting changed the program's output"
        );
        assert!(
            counted.stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&counted.stderr)
        );

        let parent = read_counts(&file);
        let h = parent.header;
        // The script set STOPPED as tracerd would, before its stop().
        assert_eq!(h.state, state::STOPPED);
        assert!((3..=5).contains(&h.tool_id));
        let parent_pid = h.pid;
        compare(
            &format!("{version} parent"),
            &parent,
            &dir.join(format!("gt.{parent_pid}")),
            20,
        );
        // The recursion, generators and exceptions are all there.
        let fib = parent
            .calls
            .iter()
            .find(|(f, _)| f.2 == "wl_fib")
            .map(|(_, c)| c)
            .unwrap();
        assert!(fib[0] > 28_000 && fib[1] < fib[0] && fib[3] > 0, "{fib:?}");

        let children = counts_files(&dir);
        assert_eq!(
            children.len(),
            1,
            "{version}: one forked child: {children:?}"
        );
        let child = read_counts(&children[0]);
        let ch = child.header;
        assert_ne!(ch.pid, parent_pid);
        assert_eq!(
            children[0].file_name().unwrap().to_str().unwrap(),
            format!("{}{}", inproc::FILE_PREFIX, ch.pid)
        );
        assert_eq!(ch.state, state::STOPPED, "the child's stop()");
        assert_eq!(ch.tool_id, h.tool_id);
        assert_eq!(
            (ch.entries_cap, ch.edges_cap, ch.strings_cap),
            (h.entries_cap, h.edges_cap, h.strings_cap)
        );
        compare(
            &format!("{version} child"),
            &child,
            &dir.join(format!("gt.{}", ch.pid)),
            9,
        );
        println!(
            "{version}: parent {} functions, {} pairs; child {} functions, {} pairs: as setprofile counted",
            parent.calls.len(),
            parent.edges.len(),
            child.calls.len(),
            child.edges.len()
        );
        drop(f);
        let _ = fs::remove_dir_all(&dir);
    }
}

/// CPython 3.10 and 3.11 (no sys.monitoring): the profile function counts what
/// sys.setprofile sees, on every thread and in a forked child. It takes sys.setprofile's
/// place, so the ground truth comes from a second run of the same (deterministic) workload.
#[test]
fn profile_function_counts_match_setprofile() {
    let so = library();
    let mut pythons = pyenv(&["3.10", "3.11"]);
    // Debian's: stripped, libpython linked in statically.
    let debian = Path::new("/usr/bin/python3.11");
    if debian.exists() {
        pythons.push(("debian-3.11".into(), debian.into()));
    }
    for (version, py) in pythons {
        let dir = workdir(&format!("profile{version}"));
        let truth = python(&py, &[&"truth", &dir]);
        let file = dir.join("session");
        let f = session_file(&file, state::PENDING);
        lock(&f);
        let counted = python(&py, &[&"profile", &so, &file]);
        assert_eq!(
            String::from_utf8_lossy(&counted.stdout),
            String::from_utf8_lossy(&truth.stdout),
            "{version}: counting changed the program's output"
        );
        assert!(
            counted.stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&counted.stderr)
        );
        let parent = read_counts(&file);
        assert_eq!(parent.header.state, state::STOPPED);
        assert_eq!(parent.header.tool_id, inproc::PROFILE_FUNCTION);
        compare(
            &format!("{version} parent"),
            &parent,
            &dir.join("gt.parent"),
            20,
        );
        let children = counts_files(&dir);
        assert_eq!(
            children.len(),
            1,
            "{version}: one forked child: {children:?}"
        );
        let child = read_counts(&children[0]);
        assert_eq!(child.header.state, state::STOPPED, "the child's stop()");
        assert_eq!(child.header.tool_id, inproc::PROFILE_FUNCTION);
        compare(
            &format!("{version} child"),
            &child,
            &dir.join("gt.child"),
            9,
        );
        println!(
            "{version}: parent {} functions, child {}: as setprofile counted",
            parent.calls.len(),
            child.calls.len()
        );
        drop(f);
        let _ = fs::remove_dir_all(&dir);
    }
}

/// A program that sets a profile function of its own takes the counter's place: the counter
/// stops, asks for the probes (HANDOVER and its file) and holds the program until tracerd
/// answers (HANDED).
#[test]
fn a_program_setting_its_own_profile_function_is_handed_over() {
    let so = library();
    for (version, py) in pyenv(&["3.10", "3.11"]) {
        let dir = workdir(&format!("handover{version}"));
        let file = dir.join("session");
        let f = session_file(&file, state::PENDING);
        lock(&f);
        let child = Command::new(&py)
            .arg(WORKLOAD)
            .args([OsStr::new("handover"), so.as_os_str(), file.as_os_str()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let asked = dir.join(format!("{}{}", inproc::HANDOVER_PREFIX, child.id()));
        let t0 = std::time::Instant::now();
        while !asked.exists() {
            assert!(
                t0.elapsed().as_secs() < 20,
                "{version}: no {}",
                asked.display()
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let st = |f: &fs::File| {
            let mut b = [0u8; 4];
            std::os::unix::fs::FileExt::read_exact_at(f, &mut b, 12).unwrap();
            u32::from_le_bytes(b)
        };
        assert_eq!(st(&f), state::HANDOVER);
        // The program waits for the answer.
        std::thread::sleep(std::time::Duration::from_millis(300));
        std::os::unix::fs::FileExt::write_all_at(&f, &state::HANDED.to_le_bytes(), 12).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let held: f64 = String::from_utf8_lossy(&out.stdout)
            .trim()
            .strip_prefix("held ")
            .and_then(|s| s.parse().ok())
            .expect("held SECONDS");
        assert!(held >= 0.3, "{version}: held {held} s");
        let counts = read_counts(&file);
        assert_eq!(counts.header.state, state::HANDED);
        let fib: u64 = counts
            .calls
            .iter()
            .filter(|(f, _)| f.2 == "wl_fib")
            .map(|(_, c)| c[0])
            .sum();
        // wl_fib(10) alone: wl_fib(8) ran after the handover.
        assert_eq!(fib, 177, "{version}");
        drop(f);
        let _ = fs::remove_dir_all(&dir);
    }
}

#[test]
fn caller_pairs_match_cprofile() {
    let so = library();
    for (version, py) in interpreters() {
        let dir = workdir(&format!("cprofile{version}"));
        let file = dir.join("session");
        let f = session_file(&file, state::PENDING);
        lock(&f);
        python(&py, &[&"cprofile", &so, &file, &dir]);
        let counts = read_counts(&file);
        assert_eq!(counts.header.state, state::STOPPED);
        // cProfile names functions by co_name.
        let short = |f: &Func| {
            (
                f.0.clone(),
                f.1.clone(),
                f.2.rsplit('.').next().unwrap().to_string(),
            )
        };
        let (cp_calls, cp_edges) = read_truth(&dir.join("cprofile"));
        let mut compared = 0;
        for (func, c) in counts.calls.iter().filter(|(f, _)| is_workload(f)) {
            assert_eq!(
                cp_calls.get(&short(func)),
                Some(&[c[0], c[1]]),
                "{version}: {func:?} (ncalls, primitive)"
            );
            let theirs: BTreeMap<_, _> = cp_edges
                .iter()
                .filter(|((_, callee), _)| *callee == short(func))
                .map(|((caller, _), v)| (caller.clone(), *v))
                .collect();
            // Called through a C function (sorted's key, next(), generator.throw()):
            // cProfile's caller is that function, ours the Python frame below it.
            if theirs.keys().any(|caller| caller.0 == "~") {
                continue;
            }
            let ours: BTreeMap<_, _> = counts
                .edges
                .iter()
                .filter(|((_, callee), _)| callee == func)
                .map(|((caller, _), v)| (short(caller), [v[0], v[1]]))
                .collect();
            assert_eq!(ours, theirs, "{version}: callers of {func:?}");
            compared += 1;
        }
        assert!(
            compared >= 12,
            "{version}: only {compared} functions compared"
        );
        println!("{version}: callers of {compared} functions as cProfile counted them");
        drop(f);
        let _ = fs::remove_dir_all(&dir);
    }
}

#[test]
fn cancelled_file_is_not_taken() {
    let so = library();
    for (version, py) in interpreters() {
        let dir = workdir(&format!("cancelled{version}"));
        let file = dir.join("session");
        drop(session_file(&file, state::CANCELLED));
        let before = fs::read(&file).unwrap();
        let out = python(&py, &[&"cancelled", &so, &file]);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "start False\ncallbacks None None None\nstop -1\n",
            "{version}"
        );
        assert!(
            fs::read(&file).unwrap() == before,
            "{version}: the file changed"
        );
        let _ = fs::remove_dir_all(&dir);
    }
}

#[test]
fn refuse_writes_why() {
    let so = library();
    for (version, py) in interpreters() {
        let dir = workdir(&format!("refuse{version}"));
        let file = dir.join("session");
        drop(session_file(&file, state::PENDING));
        // Longer than the field: cut within 255 bytes, at a character boundary (254 here).
        let why = format!("free-threaded build:{}", "é".repeat(200));
        let out = python(&py, &[&"refuse", &so, &file, &why]);
        assert_eq!(out.stdout, b"refused\n");
        let h: Header = read(&fs::read(&file).unwrap(), 0);
        assert_eq!(h.state, state::REFUSED, "{version}");
        let len = h.why.iter().position(|&b| b == 0).unwrap();
        assert_eq!(len, 254, "{version}");
        assert!(h.why[len..].iter().all(|&b| b == 0));
        assert_eq!(std::str::from_utf8(&h.why[..len]).unwrap(), &why[..254]);
        // A second refusal finds it no longer PENDING and leaves it.
        python(&py, &[&"refuse", &so, &file, &"again"]);
        let h2: Header = read(&fs::read(&file).unwrap(), 0);
        assert_eq!(h2.why, h.why);
        let _ = fs::remove_dir_all(&dir);
    }
}

#[test]
fn orphaned_when_tracerd_is_gone() {
    let so = library();
    for (version, py) in interpreters() {
        let dir = workdir(&format!("orphan{version}"));
        let calls = 100_000u64;
        // Nobody holds the lock at the start (tracerd died with a request pending): nothing
        // starts.
        let file = dir.join("unlocked");
        drop(session_file(&file, state::PENDING));
        let out = python(&py, &[&"orphan", &so, &file, &calls.to_string()]);
        assert!(
            out.stdout.starts_with(b"started False\nstop -1"),
            "{version}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert_eq!(read_counts(&file).header.state, state::PENDING, "{version}");
        // tracerd dies while the counter runs.
        let file = dir.join("session");
        let held = session_file(&file, state::PENDING);
        lock(&held);
        let mut child = Command::new(&py)
            .arg(WORKLOAD)
            .args([OsStr::new("orphan"), so.as_ref(), file.as_ref()])
            .arg(calls.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "started True\n", "{version}");
        drop(held);
        child.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        assert!(child.wait().unwrap().success(), "{version}");
        assert!(rest.starts_with("stop "), "{version}: {rest}");
        let counts = read_counts(&file);
        assert_eq!(counts.header.state, state::ORPHANED, "{version}");
        let leaf = counts
            .calls
            .iter()
            .find(|(f, _)| f.2 == "wl_leaf")
            .map(|(_, c)| c[0])
            .unwrap();
        // Checked every 65,536 callbacks, two per call: counting ends at the first check.
        assert!((30_000..=32_768).contains(&leaf), "{version}: {leaf}");
        let _ = fs::remove_dir_all(&dir);
    }
}

#[test]
fn bad_files_raise() {
    let so = library();
    for (version, py) in interpreters() {
        let dir = workdir(&format!("bad{version}"));
        let missing = dir.join("missing");
        let magic = dir.join("magic");
        drop(session_file(&magic, state::PENDING));
        std::os::unix::fs::FileExt::write_all_at(
            &fs::File::options().write(true).open(&magic).unwrap(),
            b"nottracr",
            0,
        )
        .unwrap();
        let short = dir.join("short");
        drop(session_file(&short, state::PENDING));
        fs::File::options()
            .write(true)
            .open(&short)
            .unwrap()
            .set_len(inproc::HEADER_SIZE as u64 * 2)
            .unwrap();
        let out = python(&py, &[&"bad", &so, &missing, &magic, &short]);
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{version}: {text}");
        assert!(
            lines[0].starts_with("RuntimeError start: open"),
            "{version}: {text}"
        );
        assert!(lines[1].contains("bad magic"), "{version}: {text}");
        assert!(lines[2].contains("its header says"), "{version}: {text}");
        assert_eq!(lines[3], "stop -1");
        // Untouched: still PENDING.
        let h: Header = read(&fs::read(&short).unwrap(), 0);
        assert_eq!(h.state, state::PENDING);
        let _ = fs::remove_dir_all(&dir);
    }
}

#[test]
fn second_session_counts_afresh() {
    let so = library();
    for (version, py) in interpreters() {
        let dir = workdir(&format!("twice{version}"));
        let (first, second) = (dir.join("first"), dir.join("second"));
        let f1 = session_file(&first, state::PENDING);
        let f2 = session_file(&second, state::PENDING);
        lock(&f1);
        lock(&f2);
        let out = python(&py, &[&"twice", &so, &first, &second]);
        assert_eq!(out.stdout, b"stop True\n", "{version}");
        for (path, st, n, calls) in [
            (&first, state::STOPPED, 10, 177),
            (&second, state::STOPPED, 12, 465),
        ] {
            let counts = read_counts(path);
            assert_eq!(counts.header.state, st);
            let fib: Vec<_> = counts
                .calls
                .iter()
                .filter(|(f, _)| f.2 == "wl_fib")
                .map(|(_, c)| [c[0], c[1]])
                .collect();
            assert_eq!(fib, [[calls, 1]], "{version}: fib({n})");
            let pairs: Vec<_> = counts.edges.values().map(|e| [e[0], e[1]]).collect();
            assert_eq!(
                pairs,
                [[calls - 1, 2]],
                "{version}: fib({n})'s calls of itself"
            );
        }
        drop((f1, f2));
        let _ = fs::remove_dir_all(&dir);
    }
}
