//! CUDA counting end to end, without a GPU: tests/cuda builds a libcudart.so.13 and a
//! libcuda.so.1 with CUDA's ABI and a program that loads them late (after the session
//! started), names kernels the ways nvcc's code, cuBLAS-like callers and Triton do, launches
//! them through every entry point, copies and allocates — and prints what it did. tracer's
//! report must say the same.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use tracer_tests::{one_line_error, root_or_skip, wait_until, ChildGuard, Daemon};

/// `c++filt`'s reading of a device name (binutils, not tracer's demangler).
fn demangle(name: &str) -> String {
    let out = Command::new("c++filt").arg(name).output().expect("c++filt");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Builds tests/cuda into the daemon's directory; None (and a note) without a C compiler.
fn build(d: &Daemon) -> Option<std::path::PathBuf> {
    build_into(d.dir.path().join("fakecuda"))
}

fn build_into(libs: std::path::PathBuf) -> Option<std::path::PathBuf> {
    let built = Command::new("sh")
        .arg(tracer_tests::test_file("cuda/build.sh"))
        .arg(&libs)
        .output()
        .expect("sh");
    if !built.status.success() {
        let why = String::from_utf8_lossy(&built.stderr);
        if why.contains("cc: not found") {
            tracer_testkit::skip(format_args!("no C compiler to build the test libraries"));
            return None;
        }
        panic!("building tests/cuda: {why}");
    }
    Some(libs)
}

type Row = (String, String, Vec<u64>, Vec<u64>, u64);

/// A report's launches (`cuda.launches[].launches`) and copies, allocations, frees and
/// synchronizations (`cuda.memory[].calls`), summed: what a trace has an event for each of.
fn counted(report: &Value) -> (u64, u64) {
    let sum = |what: &str, field: &str| -> u64 {
        let rows = report["cuda"][what].as_array().unwrap();
        rows.iter().map(|r| r[field].as_u64().unwrap()).sum()
    };
    (sum("launches", "launches"), sum("memory", "calls"))
}

fn dims(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap())
        .collect()
}

#[test]
fn launches_copies_and_allocations_match_what_the_program_did() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    // The runtime hands the driver a function (CUDA 12 style) or the kernel itself.
    for handle in ["function", "kernel"] {
        check_app(&d, &libs, handle);
    }
    // --cuda-driver-only: the driver's rows alone, the same as with both layers probed.
    let (id, truth) = run_app_with(
        &d,
        &libs,
        &["--mode=counting", "--cuda-driver-only"],
        "function",
    );
    let report: Value = d.report_json(&id);
    let got = report_rows(&report);
    assert!(
        got.keys().all(|k| !k.0.starts_with("cuda")),
        "no runtime launch probed: {got:?}"
    );
    let want: BTreeMap<Row, u64> = truth_rows(&truth)
        .into_iter()
        .filter(|(k, _)| !k.0.starts_with("cuda"))
        .collect();
    assert_eq!(got, want);
    // A sampling session counts launches too, beside its CPU profile.
    let (id, truth) = run_app_with(&d, &libs, &["--mode=sampling"], "function");
    let report: Value = d.report_json(&id);
    assert!(report["profile"].is_object(), "a sampling report");
    assert_eq!(report_rows(&report), truth_rows(&truth));
}

/// A program that maps CUDA and launches at once, as a short script does: the kernel stops
/// it at its mapping of each CUDA library (the runtime by the program's dlopen, the driver
/// by the runtime's at its first call) until tracerd has probed the library, so that every
/// launch is counted, and nothing is lost. Without the stop the program makes all its
/// launches while tracerd is still reading the library's symbols.
#[test]
fn launches_right_after_a_library_is_mapped_are_counted() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let app = App::spawn(&libs, &[], &[("FAKE_CUDART_LAUNCH_HANDLE", "function")]);
    let (_, truth, report) = counted_from_its_cue(&d, app, &[]);
    assert_eq!(report["losses"], serde_json::json!([]));
    let libraries = report["cuda"]["libraries"].as_array().unwrap();
    assert_eq!(libraries.len(), 2, "{libraries:?}");
    for lib in libraries {
        assert_eq!(lib["found_by"], "mmap", "{lib}");
    }
    assert_eq!(report_rows(&report), truth_rows(&truth));
}

/// A process whose kernels were registered before the session, by a stripped binary (no
/// symbol names a host function) linked against the runtime, as PyTorch's libraries are: its
/// launches are named from the binary's registration code, as the program registered them,
/// at the runtime's entry points and at the driver's underneath. Also where the handles were
/// made before the session: CUDA 13 stubs' runtime handles and the driver's functions under
/// them (named through the statics the stubs keep them in), and a driver function got by
/// symbol and kept in a static, launched with `cuLaunchKernelEx` as cluster launchers do.
#[test]
fn kernels_registered_before_the_session_are_named_from_registration_code() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let app = App::spawn_program("warm_kernels", &libs, &["4"], &[]);
    // The probes' naming: in-process rows are named by CUPTI.
    let (_, truth, report) = counted_from_its_cue(&d, app, &["--cuda-uprobes-only"]);
    let want = |runtime_only: bool| -> BTreeMap<String, u64> {
        truth["launches"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| !runtime_only || l["runtime"] == true)
            .map(|l| {
                let kernel = demangle(l["kernel"].as_str().unwrap());
                (kernel, l["count"].as_u64().unwrap())
            })
            .collect()
    };
    let (mut runtime, mut driver) = (BTreeMap::new(), BTreeMap::new());
    for l in report["cuda"]["launches"].as_array().unwrap() {
        let into = match l["api"].as_str().unwrap() {
            "cudaLaunchKernel" => {
                assert_eq!(l["named_from"], "registration code", "{l}");
                &mut runtime
            }
            // The fake runtime loads its kernels into the driver at first use: in the
            // session for the CUDA 12 stubs (the driver's rows named by the calls that make
            // them), before it for the others.
            "cuLaunchKernel" | "cuLaunchKernelEx" => {
                assert_ne!(l["named_from"], "launching function", "{l}");
                &mut driver
            }
            other => panic!("a launch through {other}: {l}"),
        };
        *into
            .entry(l["kernel"].as_str().unwrap().to_owned())
            .or_default() += l["launches"].as_u64().unwrap();
    }
    assert_eq!(runtime, want(true), "at the runtime's entry points");
    assert_eq!(driver, want(false), "at the driver's");
    assert!(
        want(false)
            .keys()
            .any(|k| k.contains("std::array<char*, 3ul>")),
        "named as c++filt names them: {:?}",
        want(false)
    );
}

/// A `--cuda` counting session on `app`, started before its cue; the session's id, the
/// program's account and the session's report, once both are done.
fn counted_from_its_cue(d: &Daemon, app: App, extra: &[&str]) -> (String, Value, Value) {
    let pid = app.pid();
    let start = ["start", "--mode=counting", "--cuda", "--pid", &pid];
    let id = d.ok(&[&start[..], extra].concat()).trim().to_owned();
    let truth = app.finish();
    wait_ended(d, &id);
    let report = d.report_json(&id);
    (id, truth, report)
}

/// A report's launch rows as `truth_rows` has them: graphs left out, kernels with no name seen
/// (or named after the function that launched them, a stand-in) as "".
fn report_rows(report: &Value) -> BTreeMap<Row, u64> {
    let mut rows: BTreeMap<Row, u64> = BTreeMap::new();
    for l in report["cuda"]["launches"].as_array().unwrap() {
        let api = l["api"].as_str().unwrap();
        if api.contains("Graph") {
            continue;
        }
        let kernel = l["kernel"].as_str().unwrap();
        let unnamed = kernel.starts_with('[') || l["named_from"] == "launching function";
        let key = (
            api.to_owned(),
            if unnamed { "" } else { kernel }.to_owned(),
            dims(&l["grid"]),
            dims(&l["block"]),
            l["shared_mem"].as_u64().unwrap(),
        );
        *rows.entry(key).or_default() += l["launches"].as_u64().unwrap();
    }
    rows
}

/// A running session's interim report (what `tracerctl top` shows): the launches made so far,
/// as the program made them, while it still runs; the final report has the same rows.
#[test]
fn interim_reports_count_launches_so_far() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let mut app = App::spawn(&libs, &["hold=1"], &[]);
    let pid = app.pid();
    let id = d
        .ok(&["start", "--mode=counting", "--cuda", "--pid", &pid])
        .trim()
        .to_owned();
    assert_eq!(app.cue("go\n"), "loaded\n");
    // Probed as it maps them, off the manager's task (as in `run_app_with`).
    std::thread::sleep(Duration::from_millis(1000));
    // Its launches done and accounted for, it waits for its stdin to close.
    let truth: Value = serde_json::from_str(&app.cue("go\n")).expect("the program's account");
    assert_eq!(truth["ok"], true, "the program's own checks");
    let want = truth_rows(&truth);
    let interim: Value =
        serde_json::from_str(&d.ok(&["report", &id, "--interim", "--format", "json"])).unwrap();
    assert_eq!(report_rows(&interim), want, "interim: {}", interim["cuda"]);
    let warnings = interim["cuda"]["warnings"].to_string();
    assert!(
        warnings.contains("interim"),
        "says what it lacks: {warnings}"
    );
    // The table, as `tracerctl top` shows it.
    let table = d.ok(&["report", &id, "--interim"]);
    assert!(
        table.contains("matmul(float*, float*, float*, int)"),
        "{table}"
    );
    assert!(d.ok(&["status", &id]).contains("running"));
    drop(app.stdin.take());
    let _ = app.guard.0.wait();
    wait_ended(&d, &id);
    let report: Value = d.report_json(&id);
    assert_eq!(report_rows(&report), want, "final");
}

/// A session on every process: a program that maps CUDA's libraries after it started is
/// announced by the kernel and probed at once, and its launches are all counted.
#[test]
fn sessions_on_every_process_probe_libraries_as_they_are_mapped() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let mut app = App::spawn(&libs, &["hold=1"], &[]);
    let pid = u64::from(app.guard.pid());
    let id = d
        .ok(&["start", "--mode=counting", "--cuda", "--all"])
        .trim()
        .to_owned();
    assert_eq!(app.cue("go\n"), "loaded\n");
    std::thread::sleep(Duration::from_millis(300));
    let truth = app.finish();
    d.ok(&["stop", &id]);
    wait_ended(&d, &id);
    let report: Value = d.report_json(&id);
    let libraries: Vec<&Value> = report["cuda"]["libraries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["pid"] == pid)
        .collect();
    assert_eq!(libraries.len(), 2, "{}", report["cuda"]["libraries"]);
    for lib in libraries {
        assert_eq!(lib["found_by"], "mmap", "{lib}");
    }
    let counted: u64 = report["cuda"]["launches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["pid"] == pid && !l["api"].as_str().unwrap().contains("Graph"))
        .map(|l| l["launches"].as_u64().unwrap())
        .sum();
    assert_eq!(counted, truth_rows(&truth).values().sum::<u64>());
}

/// Runs tests/cuda's program under a `--cuda` session of `mode`, the runtime handing the
/// driver a `handle` ("function" or "kernel"): started before its cue, its libraries probed
/// before the second. Returns the session, ended, and the program's account of its calls.
fn run_app(d: &Daemon, libs: &std::path::Path, mode: &str, handle: &str) -> (String, Value) {
    run_app_with(d, libs, &[mode], handle)
}

/// `run_app` with more `tracerctl start` arguments (the mode among them).
fn run_app_with(
    d: &Daemon,
    libs: &std::path::Path,
    start: &[&str],
    handle: &str,
) -> (String, Value) {
    let mut app = App::spawn(libs, &["hold=1"], &[("FAKE_CUDART_LAUNCH_HANDLE", handle)]);
    let pid = app.pid();
    let id = d
        .ok(&[&["start"], start, &["--cuda", "--pid", &pid]].concat())
        .trim()
        .to_owned();
    assert_eq!(
        app.cue("go\n"),
        "loaded\n",
        "the libraries are mapped only now"
    );
    // tracerd probes a library as the process maps it, and keeps its mappings for the
    // callers of launches made after it exits; a margin for a loaded machine (300 ms was
    // not always enough under the whole suite: see the stop notes).
    std::thread::sleep(Duration::from_millis(1000));
    let truth = app.finish();
    assert_eq!(truth["launch_handle_mode"], handle);
    wait_ended(d, &id);
    (id, truth)
}

/// tests/cuda's program, driven by its cues: a line in, a line out.
struct App {
    guard: ChildGuard,
    out: BufReader<std::process::ChildStdout>,
    stdin: Option<std::process::ChildStdin>,
}

impl App {
    /// Starts the program with `args` and `env`; it prints "ready" first.
    fn spawn(libs: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn_program("cuda_app", libs, args, env)
    }

    /// `spawn`, for another program of tests/cuda with the same cues.
    fn spawn_program(
        program: &str,
        libs: &std::path::Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut cmd = Command::new(libs.join(program));
        cmd.args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut guard = ChildGuard::spawn(&mut cmd);
        let out = BufReader::new(guard.0.stdout.take().unwrap());
        let stdin = guard.0.stdin.take();
        let mut app = App { guard, out, stdin };
        assert_eq!(app.cue(""), "ready\n");
        app
    }

    fn pid(&self) -> String {
        self.guard.pid().to_string()
    }

    /// Sends `go` (a line, or nothing when empty) and returns the next line printed.
    fn cue(&mut self, go: &str) -> String {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(go.as_bytes()).unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        line
    }

    /// The last cue: the program's account of its calls, checked by itself; then its stdin
    /// closes and it exits.
    fn finish(self) -> Value {
        self.finish_lingering(Duration::ZERO)
    }

    /// `finish`, with the program kept alive for `linger` after its account.
    fn finish_lingering(mut self, linger: Duration) -> Value {
        let line = self.cue("go\n");
        let truth: Value = serde_json::from_str(&line).expect("the program's account");
        assert_eq!(truth["ok"], true, "the program's own checks");
        std::thread::sleep(linger);
        drop(self.stdin.take());
        let _ = self.guard.0.wait();
        truth
    }
}

fn wait_ended(d: &Daemon, id: &str) {
    wait_until(20, "the session to end", || {
        !d.ok(&["status", id]).contains("running")
    });
}

/// The program's launches as rows (entry point, demangled kernel, grid, block, shared
/// memory): each at the layer it was made and at the driver's underneath. Unnamed: "".
fn truth_rows(truth: &Value) -> BTreeMap<Row, u64> {
    let mut want: BTreeMap<Row, u64> = BTreeMap::new();
    for l in truth["launches"].as_array().unwrap() {
        let kernel = l["kernel"].as_str().map(demangle).unwrap_or_default();
        let shape = |api: &str| {
            (
                api.trim_end_matches("_ptsz").to_owned(),
                kernel.clone(),
                dims(&l["grid"]),
                dims(&l["block"]),
                l["shmem"].as_u64().unwrap(),
            )
        };
        let n = l["count"].as_u64().unwrap();
        if l["layer"] == "runtime" {
            *want.entry(shape(l["api"].as_str().unwrap())).or_default() += n;
        }
        if let Some(driver) = l["driver_api"].as_str() {
            *want.entry(shape(driver)).or_default() += n;
        }
    }
    want
}

fn check_app(d: &Daemon, libs: &std::path::Path, handle: &str) {
    let (id, truth) = run_app(d, libs, "--mode=counting", handle);
    let report: Value = d.report_json(&id);
    let cuda = &report["cuda"];
    assert_eq!(report["losses"], serde_json::json!([]));
    assert_eq!(
        cuda["libraries"].as_array().unwrap().len(),
        2,
        "{}",
        cuda["libraries"]
    );
    // Both mapped after the session started: probed when the kernel saw them mapped, not by
    // the periodic fallback look.
    for lib in cuda["libraries"].as_array().unwrap() {
        assert_eq!(lib["found_by"], "mmap", "{lib}");
    }
    // GPU metrics: said unavailable, with the reason, on a machine without NVIDIA's driver.
    let gpu = &cuda["gpu"];
    match gpu["unavailable"].as_str() {
        Some(why) => assert!(why.starts_with("NVML: "), "{gpu}"),
        None => assert!(gpu["devices"][0]["samples"].as_u64() > Some(0), "{gpu}"),
    }

    // Every launch, at the layer it was made and at the driver's, with its configuration.
    for l in cuda["launches"].as_array().unwrap() {
        let api = l["api"].as_str().unwrap();
        if api.contains("Graph") {
            continue;
        }
        let kernel = l["kernel"].as_str().unwrap();
        let caller = l["caller"]
            .as_str()
            .unwrap_or_else(|| panic!("no caller: {l}"));
        assert!(!caller.is_empty(), "every launch names its caller: {l}");
        if api.starts_with("cuda") {
            assert!(!caller.starts_with("cuda_app+"), "named by a symbol: {l}");
        }
        // Handles no call named (the program's deliberately bad ones) have no name; at the
        // runtime's entry points the function that launched them stands in, and says so.
        match l["named_from"].as_str() {
            Some("launching function") => {
                // The driver's bad launch, made by the program right after the runtime
                // refused its own, is not inside that runtime launch: nothing names it.
                assert!(api.starts_with("cuda"), "{l}");
                assert_eq!(kernel, "run", "{l}");
                assert!(caller.starts_with("run (cuda_app.c:"), "{l}");
            }
            None => {}
            Some(other) => panic!("named from {other} though every naming call was seen: {l}"),
        }
    }
    let (got, want) = (report_rows(&report), truth_rows(&truth));
    assert_eq!(got, want, "runtime handing the driver a {handle}");
    let graphs: u64 = cuda["launches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["api"] == "cudaGraphLaunch" || l["api"] == "cuGraphLaunch")
        .map(|l| l["launches"].as_u64().unwrap())
        .sum();
    let calls = &truth["totals"];
    assert_eq!(
        graphs,
        calls["runtime_calls"]["cudaGraphLaunch"].as_u64().unwrap()
            + calls["driver_calls"]["cuGraphLaunch"].as_u64().unwrap()
    );

    // Copies and allocations, per entry point.
    let memory = |api: &str, direction: &str| {
        cuda["memory"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["api"] == api && m["direction"] == direction)
            .map(|m| (m["calls"].as_u64().unwrap(), m["bytes"].as_u64().unwrap()))
            .unwrap_or_default()
    };
    let copies = |field: &str, api: &str, dir: &str| -> (u64, u64) {
        truth["memcpys"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m[field] == api && m["direction"] == dir)
            .fold((0, 0), |(c, b), m| {
                let n = m["count"].as_u64().unwrap();
                (c + n, b + n * m["bytes"].as_u64().unwrap())
            })
    };
    assert_eq!(
        memory("cudaMemcpy", "host to device"),
        copies("api", "cudaMemcpy", "HtoD")
    );
    assert_eq!(
        memory("cudaMemcpy", "device to host"),
        copies("api", "cudaMemcpy", "DtoH")
    );
    assert_eq!(
        memory("cuMemcpyHtoD", "host to device"),
        copies("driver_api", "cuMemcpyHtoD_v2", "HtoD")
    );
    let runtime_allocs: Vec<&Value> = truth["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["api"] == "cudaMalloc")
        .collect();
    let bytes: u64 = runtime_allocs
        .iter()
        .map(|a| a["bytes"].as_u64().unwrap())
        .sum();
    let n = runtime_allocs.len() as u64;
    assert_eq!(memory("cudaMalloc", ""), (n, bytes));
    assert_eq!(
        memory("cudaFree", ""),
        (n, bytes),
        "frees of the allocations seen"
    );
    // The driver's allocations: the runtime's (made through it) and its own.
    let all = truth["allocations"].as_array().unwrap();
    let driver_bytes: u64 = all.iter().map(|a| a["bytes"].as_u64().unwrap()).sum();
    let driver = (all.len() as u64, driver_bytes);
    assert_eq!(memory("cuMemAlloc", ""), driver);
    assert_eq!(memory("cuMemFree", ""), driver);

    // The kernels table names each kernel once per configuration.
    let table = d.ok(&["report", &id, "--format", "kernels"]);
    assert!(
        table.contains("matmul(float*, float*, float*, int)"),
        "{table}"
    );
    assert!(table.contains("triton_poi_fused_add_0"), "{table}");
    assert!(
        table.contains("GPU execution times: not measured"),
        "said plainly: {table}"
    );
}

/// A process whose kernels were registered, and one handle fetched, before the session: the
/// naming calls are not seen again. The runtime's launches are named from the host stub's
/// symbol (launches given the stub) or the launching function (a handle fetched earlier).
#[test]
fn kernels_named_before_the_session_are_named_from_symbols() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    // Counted in-process (the default): CUPTI names every launch's kernel. (In a process
    // of its own: the probes' session would take CUPTI's names from it.)
    let mut app = App::spawn(&libs, &["warm=1"], &[]);
    assert_eq!(app.cue("go\n"), "registered\n");
    let (_, truth, inproc) = counted_from_its_cue(&d, app, &[]);
    assert_eq!(
        inproc["cuda"]["launch_counting"][0]["way"], "in-process",
        "{}",
        inproc["cuda"]
    );
    assert_eq!(
        report_rows(&inproc),
        truth_rows(&truth),
        "every kernel named"
    );
    for l in inproc["cuda"]["launches"].as_array().unwrap() {
        // The program's bad handles have no name anywhere: named after run(), their launcher.
        let from = l["named_from"].as_str().unwrap_or("");
        assert!(
            from.is_empty() || from == "CUPTI" || l["kernel"] == "run",
            "{l}"
        );
    }
    let mut app = App::spawn(&libs, &["warm=1"], &[]);
    assert_eq!(app.cue("go\n"), "registered\n");
    let (id, truth, report) = counted_from_its_cue(&d, app, &["--cuda-uprobes-only"]);
    let cuda = &report["cuda"];
    for lib in cuda["libraries"].as_array().unwrap() {
        assert_eq!(lib["found_by"], "start", "{lib}");
    }
    let want = truth_rows(&truth);
    let mut got: BTreeMap<Row, u64> = BTreeMap::new();
    let mut named_from: BTreeMap<String, String> = BTreeMap::new();
    for l in cuda["launches"].as_array().unwrap() {
        let api = l["api"].as_str().unwrap();
        if api.contains("Graph") {
            continue;
        }
        let mut kernel = l["kernel"].as_str().unwrap().to_owned();
        let from = l["named_from"].as_str().unwrap_or("").to_owned();
        if kernel == "run" || kernel.starts_with("[kernel handle") {
            // The program's bad handles: launched from run(), no name anywhere.
            assert!(
                l["caller"].as_str().is_some_and(|c| c.starts_with("run (")),
                "{l}; losses: {}",
                report["losses"]
            );
            kernel.clear();
        } else {
            named_from.insert(format!("{api} {kernel}"), from);
        }
        let key = (
            api.to_owned(),
            kernel,
            dims(&l["grid"]),
            dims(&l["block"]),
            l["shared_mem"].as_u64().unwrap(),
        );
        *got.entry(key).or_default() += l["launches"].as_u64().unwrap();
    }
    assert_eq!(got, want);
    let table = d.ok(&["report", &id, "--format", "kernels"]);
    assert!(
        table.contains("(named from its host stub symbol)"),
        "{table}"
    );
    assert!(
        table.contains("← native: matmul(float*, float*, float*, int)"),
        "{table}"
    );
    let matmul = demangle("_Z6matmulPfS_S_i");
    let relu = demangle("_Z4reluPfi");
    let reduce = demangle("_Z9reduceSumILi256EEvPKfPfi");
    let expect = |api: &str, kernel: &str, from: &str| {
        assert_eq!(
            named_from
                .get(&format!("{api} {kernel}"))
                .map(String::as_str),
            Some(from),
            "{named_from:?}"
        );
    };
    // matmul's stub launches the handle it fetched before the session.
    expect("cudaLaunchKernel", &matmul, "launching function");
    // The others hand the runtime their host stub itself.
    expect("cudaLaunchKernelExC", &relu, "host stub symbol");
    expect("cudaLaunchKernel", &reduce, "host stub symbol");
    expect("cudaLaunchKernelExC", &reduce, "host stub symbol");
    // The driver's launch underneath matmul's: its handle was made before the session too;
    // named after the runtime launch it was made in.
    expect("cuLaunchKernel", &matmul, "launching function");
}

/// `--cuda-stacks`: every launch's stack (taken at the driver's entry points, which every
/// kernel launch reaches), Python frames in native ones, as a profile weighted by launches;
/// from two call sites the script made a known number of launches from.
#[test]
fn launch_stacks_show_where_launches_come_from() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    // In a tracing session too, beside its timeline.
    let (traced, _) = run_cuda_calls(
        &d,
        &libs.join("libcuda.so.1"),
        &["7", "3"],
        &["--mode=tracing", "--cuda", "--cuda-stacks"],
        false,
    );
    let (id, _) = run_cuda_calls(
        &d,
        &libs.join("libcuda.so.1"),
        &["7", "3"],
        &["--mode=counting", "--cuda", "--cuda-stacks"],
        false,
    );
    // One stack a launch, each from the Python function that made it down to the entry point.
    for id in [&traced, &id] {
        let mut from: BTreeMap<&str, u64> = BTreeMap::new();
        let folded = d.ok(&["report", id, "--format", "folded"]);
        for l in folded.lines() {
            let (stack, n) = l.rsplit_once(' ').unwrap();
            let frames: Vec<&str> = stack.split(';').collect();
            assert_eq!(frames.last(), Some(&"cuLaunchKernel"), "{l}");
            let caller = ["launch (", "warm_up ("]
                .into_iter()
                .find(|f| frames.iter().any(|x| x.starts_with(f)))
                .unwrap_or_else(|| panic!("no launching Python function: {l}"));
            assert!(frames.iter().any(|x| x.starts_with("main (")), "{l}");
            *from.entry(caller).or_default() += n.parse::<u64>().unwrap();
        }
        assert_eq!(from, BTreeMap::from([("launch (", 7), ("warm_up (", 3)]));
    }
    let report: Value = d.report_json(&id);
    assert_eq!(report["losses"], serde_json::json!([]));
    let (launches, _) = counted(&report);
    assert_eq!(launches, 10, "{}", report["cuda"]);
    // pprof, weighted by launches, as go tool pprof reads it.
    if Command::new("go").arg("version").output().is_err() {
        tracer_testkit::skip(format_args!(
            "the pprof half: go is not installed (cargo xtask test installs it)"
        ));
        return;
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    d.ok(&[
        "report",
        &id,
        "--format",
        "pprof",
        "-o",
        file.path().to_str().unwrap(),
    ]);
    let top = Command::new("go")
        .args(["tool", "pprof", "-top", "-nodecount=100"])
        .arg(file.path())
        .output()
        .unwrap();
    assert!(
        top.status.success(),
        "{}",
        String::from_utf8_lossy(&top.stderr)
    );
    let top = String::from_utf8_lossy(&top.stdout);
    assert!(top.contains("Type: cuda-launch"), "{top}");
    assert!(
        top.lines()
            .any(|l| l.split_whitespace().next() == Some("10") && l.ends_with("cuLaunchKernel")),
        "{top}"
    );
}

#[test]
fn launches_name_their_python_call_site() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    // A session on the process, and one on the whole machine; launches by the process, and
    // by a forked child that continues its frames; on this machine's Python, and on 3.14/3.15
    // in their chroots.
    let pythons =
        std::iter::once(tracer_tests::python()).chain(tracer_tests::chroot_interpreters());
    for python in pythons {
        for all in [false, true] {
            for fork in [false, true] {
                call_site_of(&d, &libs, &python, all, fork);
            }
        }
    }
}

/// Launches through the runtime from Python that reach the driver underneath (tests/cuda's
/// `launch_loop.py`: nvcc-style launches from one line): the driver's probe takes the call
/// site the runtime's read on the same thread rather than reading the interpreter again;
/// both rows must name that line, the kernel and every launch, counting and tracing, in a
/// process attached to and in one launched.
#[test]
fn runtime_launches_from_python_give_the_driver_launches_beneath_them_their_call_site() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let script = tracer_tests::test_file("cuda/launch_loop.py");
    let source = std::fs::read_to_string(&script).unwrap();
    let line = source
        .lines()
        .position(|l| l.contains("# every launch's call site"))
        .unwrap()
        + 1;
    let site = format!("main ({}:{line})", script.display());
    let lib = libs.join("liblaunch_loop.so");
    let loop_args = [script.to_str().unwrap(), lib.to_str().unwrap(), "40", "3"];
    let python = tracer_tests::python();
    for mode in ["--mode=counting", "--mode=tracing"] {
        for launched in [false, true] {
            let (report, printed) = if launched {
                let out = d.dir.path().join("launch_loop.json");
                let run = d
                    .ctl()
                    .args(["start", mode, "--cuda", "--format", "json", "-o"])
                    .arg(&out)
                    .arg("--")
                    .arg(&python)
                    .args(loop_args)
                    .output()
                    .unwrap();
                assert!(run.status.success(), "{run:?}");
                let report: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
                (report, String::from_utf8(run.stdout).unwrap())
            } else {
                let mut py = ChildGuard::spawn(
                    Command::new(&python)
                        .args(loop_args)
                        .stdin(Stdio::piped())
                        .stdout(Stdio::piped()),
                );
                let mut out = BufReader::new(py.0.stdout.take().unwrap());
                let mut ready = String::new();
                out.read_line(&mut ready).unwrap();
                assert_eq!(ready, "ready\n");
                let pid = py.pid().to_string();
                let id = d
                    .ok(&["start", mode, "--cuda", "--pid", &pid])
                    .trim()
                    .to_owned();
                // Both libraries are mapped already: probed at the start; a margin.
                std::thread::sleep(Duration::from_millis(300));
                let mut stdin = py.0.stdin.take().unwrap();
                stdin.write_all(b"go\n").unwrap();
                drop(stdin);
                let mut rest = String::new();
                std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
                assert!(py.0.wait().unwrap().success());
                wait_ended(&d, &id);
                let json = d.ok(&["report", &id, "--format", "json"]);
                (serde_json::from_str(&json).unwrap(), rest)
            };
            let launches: u64 = printed
                .lines()
                .find_map(|l| l.strip_prefix("LAUNCHES "))
                .unwrap_or_else(|| panic!("the loop's count: {printed}"))
                .trim()
                .parse()
                .unwrap();
            assert_eq!(report["losses"], serde_json::json!([]), "{mode} {launched}");
            let rows = report["cuda"]["launches"].as_array().unwrap();
            for api in ["cudaLaunchKernel", "cuLaunchKernel"] {
                let found: Vec<&Value> = rows.iter().filter(|l| l["api"] == api).collect();
                assert_eq!(found.len(), 1, "{mode} launched {launched}: {rows:?}");
                let row = found[0];
                assert_eq!(
                    row["launches"], launches,
                    "{mode} launched {launched}: {row}"
                );
                assert_eq!(row["kernel"], "step(float*, int)", "{row}");
                assert_eq!(
                    (dims(&row["grid"]), dims(&row["block"])),
                    (vec![64, 1, 1], vec![256, 1, 1])
                );
                assert_eq!(row["call_site"], site, "{mode} launched {launched}: {row}");
                assert!(
                    row.get("call_site_from").is_none(),
                    "its own thread's: {row}"
                );
            }
        }
    }
}

/// Runs tests/scripts/cuda_calls.py on `lib` with `args` under a session started with
/// `start` (on its pid, or on every process with `all`), its library mapped before; returns
/// the ended session and the pid of the process that launched (the script's, or its forked
/// child's when `args` ask for one).
/// Launches made by a thread that runs no Python (autograd's threads, a C++ pool's) while
/// the Python thread that handed it the work waits in a C call: their call site is that
/// thread's line, said to be another thread's; on every interpreter (the GIL lives in the
/// runtime up to 3.11, in the interpreter from 3.12).
#[test]
fn launches_from_threads_without_python_name_the_line_that_waits() {
    const MARK: &str = "[a thread without Python, for the frames above]";
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let script = tracer_tests::script("cuda_calls.py");
    let source = std::fs::read_to_string(&script).unwrap();
    let line = source
        .lines()
        .position(|l| l.contains("# the thread's call site"))
        .unwrap()
        + 1;
    // Runtime launches of a handle never registered reach no driver entry point: stacks are
    // checked on the driver's. With a launch from Python first (warm_up's), the thread that
    // made it is named, though another Python thread spins meanwhile; without, the thread
    // that last held the GIL.
    let ways = [
        ("libcudart.so.13", "cudaLaunchKernel", "0", "thread"),
        ("libcuda.so.1", "cuLaunchKernel", "1", "thread-busy"),
    ];
    for python in tracer_tests::interpreters() {
        for (lib, api, warm, mode) in ways {
            let what = format!("{} {api} {mode}", python.display());
            let (id, pid) = run_cuda_calls_on(
                &d,
                &python,
                &libs.join(lib),
                &["5", warm, mode],
                &["--mode=counting", "--cuda", "--cuda-stacks"],
                false,
            );
            let report: Value = d.report_json(&id);
            let rows: Vec<&Value> = report["cuda"]["launches"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|l| l["api"] == api && l["pid"].as_u64() == pid.parse().ok())
                .filter(|l| dims(&l["grid"]) == vec![3, 1, 1])
                .collect();
            assert_eq!(rows.len(), 1, "{what}: {rows:?}");
            let row = rows[0];
            assert_eq!(row["launches"], 5, "{row}");
            assert_eq!(
                row["call_site"],
                format!("on_a_thread ({}:{line})", script.display()),
                "{what}: {row}"
            );
            let from = match warm {
                "0" => "the thread that last held the GIL",
                _ => "the thread that last launched from Python",
            };
            assert_eq!(row["call_site_from"], from, "{what}: {row}");
            if api != "cuLaunchKernel" {
                continue;
            }
            // Their stacks: the waiting thread's Python frames, a mark, the thread's own.
            let folded = d.ok(&["report", &id, "--format", "folded"]);
            let mut marked = 0;
            for l in folded.lines().filter(|l| l.contains(MARK)) {
                let (stack, n) = l.rsplit_once(' ').unwrap();
                let frames: Vec<&str> = stack.split(';').collect();
                let mark = frames.iter().position(|f| *f == MARK).unwrap();
                let waits = frames.iter().position(|f| f.starts_with("on_a_thread ("));
                assert!(waits.is_some_and(|w| w < mark), "{what}: {l}");
                assert_eq!(frames.last(), Some(&"cuLaunchKernel"), "{what}: {l}");
                marked += n.parse::<u64>().unwrap();
            }
            assert_eq!(marked, 5, "{what}: {folded}");
        }
    }
}

fn run_cuda_calls(
    d: &Daemon,
    lib: &std::path::Path,
    args: &[&str],
    start: &[&str],
    all: bool,
) -> (String, String) {
    run_cuda_calls_on(d, &tracer_tests::python(), lib, args, start, all)
}

fn run_cuda_calls_on(
    d: &Daemon,
    python: &std::path::Path,
    lib: &std::path::Path,
    args: &[&str],
    start: &[&str],
    all: bool,
) -> (String, String) {
    let mut py = ChildGuard::spawn(
        Command::new(python)
            .arg(tracer_tests::script("cuda_calls.py"))
            .arg(lib)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    );
    let mut out = BufReader::new(py.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "loaded\n");
    let pid = py.pid().to_string();
    let target: &[&str] = if all { &["--all"] } else { &["--pid", &pid] };
    let id = d
        .ok(&[&["start"], start, target].concat())
        .trim()
        .to_owned();
    // The library is mapped already (probed at the start); a margin for a loaded machine.
    std::thread::sleep(Duration::from_millis(300));
    let mut stdin = py.0.stdin.take().unwrap();
    stdin.write_all(b"go\n").unwrap();
    stdin.flush().unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    // A forked child made the launches: its pid is the one to look for.
    let mut launcher = pid;
    if let Some(kid) = line.strip_prefix("child ") {
        launcher = kid.trim().to_owned();
        line.clear();
        out.read_line(&mut line).unwrap();
    }
    assert_eq!(line, "done\n");
    // Python frames of launch stacks are read while the script lives: a moment for that.
    std::thread::sleep(Duration::from_millis(200));
    drop(stdin);
    let _ = py.0.wait();
    if all {
        d.ok(&["stop", &id]);
    }
    wait_ended(d, &id);
    (id, launcher)
}

fn call_site_of(
    d: &Daemon,
    libs: &std::path::Path,
    python: &std::path::Path,
    all: bool,
    fork: bool,
) {
    let script = tracer_tests::script("cuda_calls.py");
    let args: &[&str] = if fork { &["7", "0", "fork"] } else { &["7"] };
    let (id, pid) = run_cuda_calls_on(
        d,
        python,
        &libs.join("libcudart.so.13"),
        args,
        &["--mode=counting", "--cuda"],
        all,
    );
    let report: Value = d.report_json(&id);
    let rows: Vec<&Value> = report["cuda"]["launches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["api"] == "cudaLaunchKernel" && l["pid"].as_u64() == pid.parse().ok())
        .collect();
    assert_eq!(rows.len(), 1, "{} fork {fork}: {rows:?}", python.display());
    let row = rows[0];
    assert_eq!(row["launches"], 7);
    assert_eq!(
        (dims(&row["grid"]), dims(&row["block"])),
        (vec![2, 3, 4], vec![5, 6, 7])
    );
    assert_eq!(row["shared_mem"], 64);
    // The line, from the script's own text.
    let source = std::fs::read_to_string(&script).unwrap();
    let call_line = source
        .lines()
        .position(|l| l.contains("# the call site"))
        .unwrap()
        + 1;
    assert_eq!(
        row["call_site"],
        format!("launch ({}:{call_line})", script.display()),
        "{} fork {fork}: {row}",
        python.display()
    );
}

#[test]
fn traces_show_each_launch_and_copy() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let (id, truth) = run_app(&d, &libs, "--mode=tracing", "function");
    let report: Value = d.report_json(&id);
    assert_eq!(report["losses"], serde_json::json!([]));
    let path = d.dir.path().join("cuda.json");
    d.ok(&[
        "report",
        &id,
        "--format",
        "chrome",
        "-o",
        path.to_str().unwrap(),
    ]);
    let chrome: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let cuda: Vec<&Value> = chrome["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "cuda")
        .collect();
    // Every counted launch is an instant, named after its kernel where a name was seen.
    let mut want: BTreeMap<String, u64> = BTreeMap::new();
    for l in report["cuda"]["launches"].as_array().unwrap() {
        let kernel = l["kernel"].as_str().unwrap();
        if !kernel.starts_with('[') {
            *want.entry(kernel.to_owned()).or_default() += l["launches"].as_u64().unwrap();
        }
    }
    let mut got: BTreeMap<String, u64> = BTreeMap::new();
    for e in cuda.iter().filter(|e| !e["args"]["api"].is_null()) {
        let name = e["name"].as_str().unwrap();
        if !name.starts_with('[') {
            *got.entry(name.to_owned()).or_default() += 1;
        }
    }
    assert_eq!(got, want);
    // Each launch instant carries its configuration and callers: grouped by them, the
    // instants are the program's own account of its launches.
    let mut shapes: BTreeMap<Row, u64> = BTreeMap::new();
    for e in cuda.iter().filter(|e| !e["args"]["api"].is_null()) {
        let a = &e["args"];
        let api = a["api"].as_str().unwrap();
        if api.contains("Graph") {
            continue;
        }
        assert!(a["caller"].as_str().is_some_and(|c| !c.is_empty()), "{e}");
        let name = e["name"].as_str().unwrap();
        let unnamed = name.starts_with('[') || a["named_from"] == "launching function";
        let key = (
            api.to_owned(),
            if unnamed {
                String::new()
            } else {
                name.to_owned()
            },
            dims(&a["grid"]),
            dims(&a["block"]),
            a["shared_mem"].as_u64().unwrap(),
        );
        *shapes.entry(key).or_default() += 1;
    }
    assert_eq!(shapes, truth_rows(&truth));
    let (launches, memory) = counted(&report);
    let instants = cuda.iter().filter(|e| !e["args"]["api"].is_null()).count() as u64;
    assert_eq!(instants, launches);
    let copies = cuda
        .iter()
        .filter(|e| !e["args"]["bytes"].is_null())
        .count() as u64;
    assert_eq!(copies, memory);
    assert_eq!(report["trace"]["cuda_events"], launches + memory);
    let path = d.dir.path().join("cuda.pftrace");
    d.ok(&[
        "report",
        &id,
        "--format",
        "perfetto",
        "-o",
        path.to_str().unwrap(),
    ]);
    let p = tracer_tests::timeline::perfetto_summary(&std::fs::read(path).unwrap());
    assert_eq!(p.instants, launches + memory);
}

/// GPU metrics read through NVML's ABI from tests/cuda's stand-in libnvidia-ml.so.1 (two
/// devices, values documented in fake_nvml.c): min/mean/max in the counting report, every
/// reading on a counter track of the trace.
#[test]
fn gpu_metrics_reach_reports_and_timelines() {
    if !root_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(libs) = build_into(dir.path().join("fakecuda")) else {
        return;
    };
    let d = Daemon::start_with(tracer_tests::DaemonOptions {
        env: vec![("LD_LIBRARY_PATH".into(), libs.to_str().unwrap().into())],
        ..Default::default()
    });
    let caps = d.ok(&["capabilities"]);
    assert!(
        caps.contains("GPUs (NVML): 0: Fake GPU 0, 1: Fake GPU 1\n"),
        "{caps}"
    );
    let (id, _) = run_app(&d, &libs, "--mode=counting", "function");
    let report: Value = d.report_json(&id);
    let gpu = &report["cuda"]["gpu"];
    assert!(gpu["unavailable"].is_null(), "{gpu}");
    let devices = gpu["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2, "{gpu}");
    for (i, dev) in devices.iter().enumerate() {
        let i = i as f64;
        assert_eq!(dev["name"], format!("Fake GPU {i}"));
        assert!(dev["samples"].as_u64().unwrap() >= 3, "{dev}");
        let metric = |name: &str| {
            let m = dev["metrics"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["name"] == name)
                .unwrap_or_else(|| panic!("no {name}: {dev}"));
            (
                m["min"].as_f64().unwrap(),
                m["mean"].as_f64().unwrap(),
                m["max"].as_f64().unwrap(),
                m["unit"].as_str().unwrap().to_owned(),
            )
        };
        let constant = |name: &str, v: f64, unit: &str| {
            let (min, mean, max, u) = metric(name);
            assert_eq!((min, max, u.as_str()), (v, v, unit), "{name}");
            assert!((mean - v).abs() < 1e-9, "{name}");
        };
        constant("memory utilization", 10.0 + i, "%");
        constant("memory used", 2048.0 + 1024.0 * i, "MiB");
        constant("power", 123.456, "W");
        constant("SM clock", 1410.0, "MHz");
        constant("temperature", 55.0 + i, "°C");
        // Cycles 20, 40, 60 from one read to the next.
        let (min, mean, max, _) = metric("gpu utilization");
        assert_eq!((min, max), (20.0, 60.0));
        assert!((20.0..=60.0).contains(&mean));
    }

    let (id, _) = run_app(&d, &libs, "--mode=tracing", "function");
    let path = d.dir.path().join("gpu.json");
    d.ok(&[
        "report",
        &id,
        "--format",
        "chrome",
        "-o",
        path.to_str().unwrap(),
    ]);
    let chrome: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let track = |name: &str, unit: &str| -> Vec<u64> {
        chrome["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "C" && e["name"] == name)
            .map(|e| e["args"][unit].as_u64().unwrap_or_else(|| panic!("{e}")))
            .collect()
    };
    let power = track("GPU 0 power", "mW");
    assert!(
        power.len() >= 3 && power.iter().all(|&p| p == 123_456),
        "{power:?}"
    );
    let used = track("GPU 1 memory used", "MiB");
    assert!(
        !used.is_empty() && used.iter().all(|&m| m == 3072),
        "{used:?}"
    );
    let util = track("GPU 0 gpu utilization", "%");
    assert!(
        util.contains(&20) && util.contains(&40) && util.contains(&60),
        "{util:?}"
    );
}

/// A daemon serving Prometheus metrics, and the address to scrape.
fn daemon_with_metrics() -> (Daemon, String) {
    let addr = tracer_tests::free_loopback_addr();
    let d = Daemon::start_with(tracer_tests::DaemonOptions {
        args: vec!["--metrics".into(), format!("tcp://{addr}")],
        ..Default::default()
    });
    (d, addr)
}

/// A Prometheus label value as the exposition format escapes it.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Launches per (entry point, kernel) on tracerd's Prometheus endpoint equal the report's.
#[test]
fn launch_counts_reach_prometheus() {
    if !root_or_skip() {
        return;
    }
    let (d, addr) = daemon_with_metrics();
    let Some(libs) = build(&d) else { return };
    let (id, _) = run_app_with(
        &d,
        &libs,
        &["--mode=counting", "--export", "prometheus"],
        "function",
    );
    let report: Value = d.report_json(&id);
    let mut want: BTreeMap<(String, String), u64> = BTreeMap::new();
    for l in report["cuda"]["launches"].as_array().unwrap() {
        *want
            .entry((
                l["api"].as_str().unwrap().into(),
                l["kernel"].as_str().unwrap().into(),
            ))
            .or_default() += l["launches"].as_u64().unwrap();
    }
    assert!(want.len() > 3, "{want:?}");
    let text = tracer_tests::fleet::http_get(&addr, "/metrics").unwrap();
    for ((api, kernel), n) in &want {
        let series = format!(
            "tracer_cuda_launches_total{{session=\"{id}\",api=\"{api}\",kernel=\"{}\"}} {n}\n",
            label(kernel)
        );
        assert!(text.contains(&series), "no {series} in:\n{text}");
    }
}

/// `--gpu-times`: the command runs with tracer's CUPTI injection library, which tests/cuda's
/// fake driver loads at cuInit as CUDA's does, and which finds tests/cuda's fake CUPTI beside
/// the runtime (as in a CUDA 13 wheel). The report's GPU time per kernel must be the fake
/// CUPTI's own tally; each execution is a slice on a GPU track of the trace, in the session's
/// clock (the fake stamps records with CLOCK_REALTIME, as CUPTI does).
#[test]
fn gpu_kernel_times_come_from_cupti() {
    if !root_or_skip() {
        return;
    }
    let (d, addr) = daemon_with_metrics();
    let Some(libs) = build(&d) else { return };
    let app = libs.join("cuda_app");
    let app = app.to_str().unwrap();
    // The program is tracerctl's child and shares its stdin and stdout: driven by its cues.
    // `watch`: a `tracerctl watch` of the session, started while the program holds.
    let run_watched = |mode: &[&str],
                       env: &[(&str, &str)],
                       out: &std::path::Path,
                       watch: bool|
     -> (Value, Value, Option<String>) {
        let mut ctl = d.ctl();
        ctl.arg("start")
            .args(mode)
            .args(["--cuda", "--gpu-times", "--format", "json", "-o"])
            .arg(out)
            .args(["--", app, "hold=1", "init=1"])
            .env_remove("CUDA_INJECTION64_PATH")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in env {
            ctl.env(k, v);
        }
        let mut guard = ChildGuard::spawn(&mut ctl);
        let out_pipe = BufReader::new(guard.0.stdout.take().unwrap());
        let stdin = guard.0.stdin.take();
        let mut app = App {
            guard,
            out: out_pipe,
            stdin,
        };
        assert_eq!(app.cue(""), "ready\n");
        // CUDA initialized, so the injection library loaded and probed as it was mapped: a
        // margin for a loaded machine.
        assert_eq!(app.cue("go\n"), "loaded\n");
        let watcher = watch.then(|| {
            let id = d.newest_session("");
            let mut w = d.ctl();
            w.args(["watch", &id]).stdout(Stdio::piped());
            ChildGuard::spawn(&mut w)
        });
        std::thread::sleep(Duration::from_millis(300));
        // Watched: CUPTI's periodic flush hands the records over while the program lives, so
        // that the live view can read their names from it.
        let truth = app.finish_lingering(Duration::from_millis(if watch { 500 } else { 0 }));
        let report = serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap();
        let watched = watcher.map(|mut w| {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut w.0.stdout.take().unwrap(), &mut text).unwrap();
            text
        });
        (truth, report, watched)
    };
    let run = |mode: &[&str], env: &[(&str, &str)], out: &std::path::Path| {
        let (truth, report, _) = run_watched(mode, env, out, false);
        (truth, report)
    };

    // Counting, with CUPTI reporting dropped records as well.
    let path = d.dir.path().join("gpu-times.json");
    let (truth, report) = run(
        &["--mode=counting", "--export", "prometheus"],
        &[("FAKE_CUPTI_DROPPED", "5")],
        &path,
    );
    let pid = truth["pid"].as_u64().unwrap();
    let status = &report["cuda"]["gpu_times"];
    assert_eq!(status[0]["pid"], pid, "{status}");
    let line = status[0]["status"].as_str().unwrap();
    let beside = libs.join("libcupti.so.13");
    assert!(
        line.starts_with("ok: CUPTI from") && line.contains(beside.to_str().unwrap()),
        "{line}"
    );
    let handed = truth["cupti_observed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["executions"].as_u64().unwrap())
        .sum::<u64>();
    assert!(
        line.ends_with(&format!(
            "at exit: {handed} kernel records handed over, 5 dropped"
        )),
        "{line}"
    );
    let observed = cupti_observed(&truth);
    // One row per kernel and configuration: the fake runs a kernel 1 µs per block, so each
    // row's executions all took that long; and each launch row with that kernel and
    // configuration says so.
    for k in report["cuda"]["gpu_kernels"].as_array().unwrap() {
        assert_eq!(k["pid"], pid);
        let ns = 1000 * dims(&k["grid"]).iter().product::<u64>();
        let n = k["executions"].as_u64().unwrap();
        assert_eq!(
            (k["min_ns"].as_u64(), k["max_ns"].as_u64()),
            (Some(ns), Some(ns)),
            "{k}"
        );
        assert_eq!(k["total_ns"].as_u64(), Some(n * ns), "{k}");
    }
    for l in report["cuda"]["launches"].as_array().unwrap() {
        // The deliberately bad handles ran nothing (and have at most a stand-in name).
        let named = !l["kernel"].as_str().unwrap().starts_with('[')
            && l["named_from"] != "launching function";
        let want = named.then(|| 1000 * dims(&l["grid"]).iter().product::<u64>());
        assert_eq!(l["gpu_avg_ns"].as_u64(), want, "{l}");
    }
    assert_eq!(gpu_per_kernel(&report), observed);
    let launched: u64 = truth["totals"]["kernel_launches"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(observed.values().map(|v| v.0).sum::<u64>(), launched);
    assert!(
        report["losses"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!({"cause": "cupti_records_dropped", "count": 5})),
        "{}",
        report["losses"]
    );
    let id = report["session"]["id"].as_str().unwrap();
    let table = d.ok(&["report", id]);
    assert!(table.contains("GPU kernel times (CUPTI)"), "{table}");
    let text = tracer_tests::fleet::http_get(&addr, "/metrics").unwrap();
    for (kernel, (n, ns)) in &observed {
        let kernel = label(kernel);
        for series in [
            format!(
                "tracer_gpu_kernel_executions_total{{session=\"{id}\",kernel=\"{kernel}\"}} {n}\n"
            ),
            format!(
                "tracer_gpu_kernel_seconds_total{{session=\"{id}\",kernel=\"{kernel}\"}} {}\n",
                *ns as f64 / 1e9
            ),
        ] {
            assert!(text.contains(&series), "no {series} in:\n{text}");
        }
    }

    // Tracing: one slice per execution on its stream's GPU track, inside the session.
    let path = d.dir.path().join("gpu-trace.json");
    let (_, report, watched) = run_watched(&["--mode=tracing"], &[], &path, true);
    let id = report["session"]["id"].as_str().unwrap();
    let chrome_path = d.dir.path().join("gpu-trace.chrome.json");
    d.ok(&[
        "report",
        id,
        "--format",
        "chrome",
        "-o",
        chrome_path.to_str().unwrap(),
    ]);
    let chrome: Value = serde_json::from_slice(&std::fs::read(&chrome_path).unwrap()).unwrap();
    let (start, end) = (
        chrome["otherData"]["start_ns"].as_f64().unwrap() / 1e3,
        chrome["otherData"]["end_ns"].as_f64().unwrap() / 1e3,
    );
    let events = chrome["traceEvents"].as_array().unwrap();
    let mut slices: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for e in events.iter().filter(|e| e["cat"] == "gpu") {
        let ts = e["ts"].as_f64().unwrap();
        assert!(
            ts >= start && ts <= end,
            "a GPU slice outside the session: {e}"
        );
        let track = events
            .iter()
            .find(|m| m["ph"] == "M" && m["tid"] == e["tid"] && m["pid"] == e["pid"])
            .expect("the GPU track's name");
        assert_eq!(
            track["args"]["name"],
            format!("GPU 0 stream {}", e["args"]["stream"])
        );
        let s = slices
            .entry(e["name"].as_str().unwrap().to_owned())
            .or_default();
        s.0 += 1;
        s.1 += (e["dur"].as_f64().unwrap() * 1e3).round() as u64;
    }
    assert_eq!(slices, gpu_per_kernel(&report));
    // Live, each execution as it is recorded, named from the process.
    let watched = watched.unwrap();
    let mut live: BTreeMap<String, u64> = BTreeMap::new();
    for line in watched.lines().filter(|l| l.contains(" gpu ")) {
        let (_, rest) = line.split_once(" gpu ").unwrap();
        let (kernel, _) = rest.trim().split_once(" on GPU 0 stream ").expect(line);
        *live.entry(kernel.to_owned()).or_default() += 1;
    }
    let counts: BTreeMap<String, u64> = slices.iter().map(|(k, v)| (k.clone(), v.0)).collect();
    assert_eq!(live, counts, "{watched}");
    assert_eq!(slices, observed, "every execution, in a session of its own");
    let executions: u64 = slices.values().map(|s| s.0).sum();
    assert_eq!(report["trace"]["gpu_kernels"], executions);
    let pf_path = d.dir.path().join("gpu-trace.pftrace");
    d.ok(&[
        "report",
        id,
        "--format",
        "perfetto",
        "-o",
        pf_path.to_str().unwrap(),
    ]);
    let p = tracer_tests::timeline::perfetto_summary(&std::fs::read(pf_path).unwrap());
    assert_eq!((p.begins, p.ends), (executions, executions));

    // No CUPTI to be found: the program runs as ever, and the report says why.
    let path = d.dir.path().join("no-cupti.json");
    let (_, report) = run(
        &["--mode=counting"],
        &[("TRACER_CUPTI_PATH", "/nonexistent/libcupti.so")],
        &path,
    );
    let line = report["cuda"]["gpu_times"][0]["status"].as_str().unwrap();
    assert!(
        line.starts_with("error: TRACER_CUPTI_PATH=/nonexistent/libcupti.so"),
        "{line}"
    );
    assert!(report["cuda"]["gpu_kernels"].is_null(), "{report}");
    assert!(report["cuda"]["launches"]
        .as_array()
        .is_some_and(|l| !l.is_empty()));
}

/// A process started with the injection library by other means (a service's environment) and
/// already past `cuInit` when a plain `--cuda` session attaches: the session finds the library
/// mapped at its start, and the kernels' GPU times reach it. (The status line read from the
/// process's memory alone is checked by the no-CUPTI case above, which announces nothing at
/// exit.)
#[test]
fn gpu_times_reach_sessions_attached_to_a_process_with_the_library() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let injection = tracer_tests::bin_dir().join("libtracer_cupti.so");
    let mut app = App::spawn(
        &libs,
        &["hold=1", "init=1"],
        &[("CUDA_INJECTION64_PATH", injection.to_str().unwrap())],
    );
    assert_eq!(app.cue("go\n"), "loaded\n", "CUDA initialized");
    // `--gpu-times` asks for what the process has already: nothing is loaded or turned on.
    let id = d
        .ok(&[
            "start",
            "--mode=counting",
            "--cuda",
            "--gpu-times",
            "--pid",
            &app.pid(),
        ])
        .trim()
        .to_owned();
    let status = d.ok(&["status", &id]);
    assert!(status.contains("running"), "{status}");
    let truth = app.finish();
    wait_ended(&d, &id);
    let report: Value = d.report_json(&id);
    let c = &report["cuda"];
    let injected = c["libraries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["path"].as_str().unwrap().ends_with("/libtracer_cupti.so"))
        .expect("the injection library among the libraries probed");
    assert_eq!(injected["found_by"], "start", "{injected}");
    let line = c["gpu_times"][0]["status"].as_str().unwrap();
    assert!(line.starts_with("ok: CUPTI from"), "{line}");
    let observed = cupti_observed(&truth);
    assert_eq!(gpu_per_kernel(&report), observed);
}

/// `--gpu-times --pid`: a process that initialized CUDA long before, without the injection
/// library, gets GPU times without a restart. tracerd loads the library with ptrace and turns
/// CUPTI on before the start is answered; the report's GPU times must be the fake CUPTI's own
/// tally. A session stopped while the process lives turns CUPTI off and detaches it (the fake
/// CUPTI's state says what is left: no subscriber, no kind, no callbacks), with the last
/// records in the report; a later session turns it on again. A process where another tool
/// holds CUPTI's subscriber slot is refused, with the reason, and its slot left alone, as is
/// one that CUDA will load the library into itself. A SIGKILLed tracerd's process turns
/// CUPTI off by itself.
#[test]
fn gpu_times_without_a_restart() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    fn gpu_times(pid: &str) -> [&str; 6] {
        [
            "start",
            "--mode=counting",
            "--cuda",
            "--gpu-times",
            "--pid",
            pid,
        ]
    }
    let start = |pid: &str| d.ok(&gpu_times(pid)).trim().to_owned();
    let status = |r: &Value| {
        r["cuda"]["gpu_times"][0]["status"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let no_cuda_cupti =
        serde_json::json!({"subscribed": 0, "kind": 0, "callbacks": 0, "api_callbacks": 0});

    // Stopped while the process lives: its last records are in the report, CUPTI is left
    // detached.
    let mut app = App::spawn(&libs, &["hold=1", "init=1"], &[]);
    assert_eq!(app.cue("go\n"), "loaded\n", "CUDA initialized");
    let id = start(&app.pid());
    let truth: Value = serde_json::from_str(&app.cue("go\n")).expect("the program's account");
    assert_eq!(truth["ok"], true, "the program's own checks");
    assert_eq!(app.cue(""), "done\n");
    let on: Value = serde_json::from_str(&app.cue("cupti\n")).unwrap();
    assert_eq!(on["subscribed"], 1, "{on}");
    assert_ne!(on["kind"], 0, "{on}");
    d.ok(&["stop", &id]);
    let r = d.report_json(&id);
    let observed = cupti_observed(&truth);
    let launched: u64 = observed.values().map(|v| v.0).sum();
    assert!(launched > 0, "{truth}");
    assert_eq!(
        gpu_per_kernel(&r),
        observed,
        "every execution, the last ones too"
    );
    let line = status(&r);
    assert!(
        line.starts_with(&format!(
            "off: turned off at the session's end; {launched} kernel records handed over, 0 dropped"
        )),
        "{line}"
    );
    let loaded = r["cuda"]["libraries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["path"].as_str().unwrap().ends_with("/libtracer_cupti.so"))
        .expect("the injection library among the libraries probed");
    assert_eq!(loaded["found_by"], "loaded", "{loaded}");
    let off: Value = serde_json::from_str(&app.cue("cupti\n")).unwrap();
    assert_eq!(off, no_cuda_cupti, "CUPTI left as before the session");

    // Again: the library is there already, and turned on once more.
    let again = start(&app.pid());
    let on: Value = serde_json::from_str(&app.cue("cupti\n")).unwrap();
    assert_eq!(on["subscribed"], 1, "{on}");
    d.ok(&["stop", &again]);
    let line = status(&d.report_json(&again));
    assert!(
        line.starts_with("off: turned off at the session's end; 0 kernel records handed over"),
        "{line}"
    );
    let off: Value = serde_json::from_str(&app.cue("cupti\n")).unwrap();
    assert_eq!(off, no_cuda_cupti);
    drop(app);

    // The process exits during the session: its exit hands the rest over.
    let mut app = App::spawn(&libs, &["hold=1", "init=1"], &[]);
    assert_eq!(app.cue("go\n"), "loaded\n");
    let id = start(&app.pid());
    let truth = app.finish();
    wait_ended(&d, &id);
    let r = d.report_json(&id);
    assert_eq!(gpu_per_kernel(&r), cupti_observed(&truth));
    assert!(status(&r).contains("at exit"), "{}", status(&r));

    // Another tool holds CUPTI: refused, and its hold left as it was.
    let mut app = App::spawn(&libs, &["hold=1", "init=1", "subscribe=1"], &[]);
    assert_eq!(app.cue("go\n"), "loaded\n");
    let pid = app.pid();
    let out = d.run(&gpu_times(&pid));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("another CUPTI subscriber holds this process"),
        "{err}"
    );
    let truth: Value = serde_json::from_str(&app.cue("go\n")).expect("the program's account");
    assert_eq!(truth["ok"], true, "the program's own checks");
    assert_eq!(app.cue(""), "done\n");
    let held: Value = serde_json::from_str(&app.cue("cupti\n")).unwrap();
    assert_eq!(
        held,
        serde_json::json!({"subscribed": 1, "kind": 0, "callbacks": 0, "api_callbacks": 0})
    );
    let listed = d.ok(&["list"]);
    assert!(
        !listed.contains("running"),
        "a refused start leaves no session: {listed}"
    );
    drop(app);

    // The injection library named in the environment but not loaded yet (CUDA not
    // initialized): CUDA will load it, so nothing is loaded now.
    let injection = tracer_tests::bin_dir().join("libtracer_cupti.so");
    let mut app = App::spawn(
        &libs,
        &["hold=1"],
        &[("CUDA_INJECTION64_PATH", injection.to_str().unwrap())],
    );
    assert_eq!(
        app.cue("go\n"),
        "loaded\n",
        "the driver mapped, not initialized"
    );
    let pid = app.pid();
    let out = d.run(&gpu_times(&pid));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("which CUDA loads when the process initializes it"),
        "{err}"
    );
    drop(app);

    // Another tool's injection library in the environment (CUDA not initialized, so the
    // fake driver has not tried to load it): refused, nothing loaded.
    let mut app = App::spawn(
        &libs,
        &["hold=1"],
        &[("CUDA_INJECTION64_PATH", "/opt/other-tool/libinjection.so")],
    );
    assert_eq!(app.cue("go\n"), "loaded\n");
    let pid = app.pid();
    let out = d.run(&gpu_times(&pid));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("another tool's injection library holds CUPTI there"),
        "{err}"
    );
    drop(app);

    // tracerd killed while records are on: the kernel takes its probes out, and the library,
    // seeing its probe point unprobed for 5 s, turns CUPTI off itself.
    let mut app = App::spawn(&libs, &["hold=1", "init=1"], &[]);
    assert_eq!(app.cue("go\n"), "loaded\n");
    let pid = app.pid();
    let mut d = d;
    d.ok(&gpu_times(&pid));
    let truth: Value = serde_json::from_str(&app.cue("go\n")).expect("the program's account");
    assert_eq!(truth["ok"], true, "the program's own checks");
    assert_eq!(app.cue(""), "done\n");
    // Stopped (SIGTERM): tracerd turns it off as it ends its sessions.
    d.restart();
    let off: Value = serde_json::from_str(&app.cue("cupti\n")).unwrap();
    assert_eq!(off, no_cuda_cupti, "turned off by a tracerd stopping");
    d.ok(&gpu_times(&pid));
    let on: Value = serde_json::from_str(&app.cue("cupti\n")).unwrap();
    assert_eq!(on["subscribed"], 1, "{on}");
    d.kill();
    wait_until(20, "CUPTI turned off without tracerd", || {
        serde_json::from_str::<Value>(&app.cue("cupti\n")).unwrap() == no_cuda_cupti
    });
}

/// `--gpu-times --pid` loads the CUPTI tracerd finds from what the process maps (CUPTI itself,
/// or a file beside its CUDA runtime), never one its environment names: that environment is
/// its user's, and in a setuid program it would choose what runs with the program's rights.
/// A process started with `TRACER_CUPTI_PATH` naming a working copy of the fake CUPTI gets
/// its GPU times from the one beside its runtime, and never maps the copy. Where no CUPTI is
/// found, the start is refused naming the directories tried, and nothing is loaded.
#[test]
fn gpu_times_for_a_running_process_ignore_its_environment() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let decoy = d.dir.path().join("decoy");
    std::fs::create_dir_all(&decoy).unwrap();
    let decoy = decoy.join("libcupti.so.13");
    std::fs::copy(libs.join("libcupti.so.13"), &decoy).unwrap();
    let beside = libs.join("libcupti.so.13");
    let start = |pid: &str| {
        d.run(&[
            "start",
            "--mode=counting",
            "--cuda",
            "--gpu-times",
            "--pid",
            pid,
        ])
    };
    let maps = |pid: &str| std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();

    let mut app = App::spawn(
        &libs,
        &["hold=1", "init=1"],
        &[("TRACER_CUPTI_PATH", decoy.to_str().unwrap())],
    );
    assert_eq!(app.cue("go\n"), "loaded\n", "CUDA initialized");
    let pid = app.pid();
    let out = start(&pid);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    // On once the start is answered.
    let mapped = maps(&pid);
    assert!(mapped.contains(beside.to_str().unwrap()), "{mapped}");
    assert!(!mapped.contains(decoy.to_str().unwrap()), "{mapped}");
    // The process exits during the session: its status line, the one of "on" with what was
    // handed over at exit, is the report's.
    let truth = app.finish();
    wait_ended(&d, &id);
    let r: Value = d.report_json(&id);
    let line = r["cuda"]["gpu_times"][0]["status"].as_str().unwrap();
    assert!(
        line.starts_with(&format!("on: CUPTI from {}; ", beside.display()))
            && line.contains("at exit"),
        "{line}"
    );
    assert_eq!(gpu_per_kernel(&r), cupti_observed(&truth));

    // No CUPTI beside the runtime: refused before anything is loaded, whatever the
    // environment names.
    let Some(bare) = build_into(d.dir.path().join("no-cupti")) else {
        return;
    };
    std::fs::remove_file(bare.join("libcupti.so.13")).unwrap();
    let mut app = App::spawn(
        &bare,
        &["hold=1", "init=1"],
        &[("TRACER_CUPTI_PATH", decoy.to_str().unwrap())],
    );
    assert_eq!(app.cue("go\n"), "loaded\n", "CUDA initialized");
    let pid = app.pid();
    let out = start(&pid);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let want = format!(
        "no CUPTI for pid {pid}: it maps none, and none of libcupti.so.13, libcupti.so.12, libcupti.so is in {}, ",
        bare.display()
    );
    assert!(err.contains(&want), "{err}");
    let mapped = maps(&pid);
    assert!(!mapped.contains("libtracer_cupti.so"), "{mapped}");
    assert!(!mapped.contains("libcupti"), "{mapped}");
}

/// tracer's injection library in a program started in the loader's secure mode (here setgid,
/// run by root: the effective group changes, as a setuid program's user does) does nothing: its
/// status line says so, `TRACER_CUPTI_PATH` (kept by glibc in secure mode) leads nowhere, and
/// no thread is left to take requests. The same program without the setgid bit reads the
/// variable, as a launched command does, and its serving thread ends once the driver's
/// `InitializeInjection` has been called.
#[test]
fn the_injection_library_does_nothing_in_a_secure_mode_process() {
    if !root_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let library = dir.path().join("libtracer_cupti.so");
    std::fs::copy(tracer_tests::bin_dir().join("libtracer_cupti.so"), &library).unwrap();
    // As CUDA's driver does: load it, then call InitializeInjection.
    let source = dir.path().join("inject.c");
    std::fs::write(
        &source,
        r#"#include <dirent.h>
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
static int threads(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    for (struct dirent *e; d && (e = readdir(d));) n += e->d_name[0] != '.';
    if (d) closedir(d);
    return n;
}
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { printf("dlopen: %s\n", dlerror()); return 1; }
    const char *status = dlsym(h, "tracer_cupti_status");
    int (*init)(void) = (int (*)(void))dlsym(h, "InitializeInjection");
    printf("loaded: %s\n", status);
    printf("initialized: %d\n", init());
    printf("status: %s\n", status);
    for (int i = 0; i < 40 && threads() > 1; i++) usleep(50000);
    printf("threads: %d\n", threads());
    return 0;
}
"#,
    )
    .unwrap();
    let plain = dir.path().join("inject");
    let built = Command::new("cc")
        .arg("-o")
        .arg(&plain)
        .arg(&source)
        .arg("-ldl")
        .output();
    match built {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!("cc: {}", String::from_utf8_lossy(&out.stderr)),
        Err(_) => {
            tracer_testkit::skip(format_args!("no C compiler to build the test program"));
            return;
        }
    }
    let setgid = dir.path().join("inject-setgid");
    std::fs::copy(&plain, &setgid).unwrap();
    std::os::unix::fs::chown(&setgid, Some(0), Some(65534)).unwrap();
    std::fs::set_permissions(
        &setgid,
        std::os::unix::fs::PermissionsExt::from_mode(0o2755),
    )
    .unwrap();
    let run = |program: &std::path::Path| {
        let out = Command::new(program)
            .arg(&library)
            .env("TRACER_CUPTI_PATH", "/nonexistent/libcupti.so")
            .env_remove("CUDA_INJECTION64_PATH")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };

    let refused = "error: refused in a secure-mode (setuid) process";
    assert_eq!(
        run(&setgid),
        format!("loaded: {refused}\ninitialized: 1\nstatus: {refused}\nthreads: 1\n")
    );
    let out = run(&plain);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "loaded: loaded; InitializeInjection not called yet"
    );
    assert!(
        lines[2].starts_with("status: error: TRACER_CUPTI_PATH=/nonexistent/libcupti.so"),
        "{out}"
    );
    assert_eq!(lines[3], "threads: 1", "the serving thread ended: {out}");
}

/// A report's GPU time rows summed per kernel: (executions, total ns).
fn gpu_per_kernel(report: &Value) -> BTreeMap<String, (u64, u64)> {
    let mut per: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for k in report["cuda"]["gpu_kernels"].as_array().unwrap() {
        let e = per
            .entry(k["kernel"].as_str().unwrap().to_owned())
            .or_default();
        e.0 += k["executions"].as_u64().unwrap();
        e.1 += k["total_ns"].as_u64().unwrap();
    }
    per
}

/// The fake CUPTI's own tally (`cupti_observed`), per demangled kernel.
fn cupti_observed(truth: &Value) -> BTreeMap<String, (u64, u64)> {
    truth["cupti_observed"]
        .as_array()
        .expect("the fake CUPTI's tally")
        .iter()
        .map(|k| {
            let n = (
                k["executions"].as_u64().unwrap(),
                k["total_ns"].as_u64().unwrap(),
            );
            (demangle(k["name"].as_str().unwrap()), n)
        })
        .collect()
}

/// The member's process in [`a_setuid_program_execd_during_the_gpu_times_load_gets_nothing`]:
/// it maps the fake runtime and driver and initializes CUDA, leaves a second thread asleep (the
/// one tracerd stops: a sleeping thread before a running one), prints "ready", then spins on its
/// main thread watching for tracerd's load. Its first cue is one of the session's CUDA probes
/// turning an entry point's code into a breakpoint (the probes go in after the start's checks,
/// as the injection library's load begins); `DELAY_US` later, or at once when its sleeping
/// thread is seen traced (`TracerPid`: the load has stopped it), it execs `PROGRAM` (a
/// setuid-root copy of sleep), having printed `exec cue=probes|traced|none after_us=N child=PID`.
/// A negative delay waits for the thread to be traced. `KEEP` 1: a child forked at the probes
/// keeps the session following a process of its user's past the exec (which it stops following,
/// the program having gained root), so that the start answers for the load.
/// usage: race LIBDIR PROGRAM DELAY_US KEEP
const RACE_C: &str = r#"#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
static volatile int sleeper;
static void *sleep_on(void *arg) {
    sleeper = (int)syscall(SYS_gettid);
    for (;;) pause();
    return arg;
}
static long long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000LL + t.tv_nsec / 1000;
}
static int traced(void) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/self/task/%d/status", sleeper);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    const char *p = strstr(buf, "TracerPid:");
    return p && atoi(p + 10) != 0;
}
#define WATCHED 6
#define BYTES 32
int main(int argc, char **argv) {
    if (argc != 5) return 2;
    long long delay = atoll(argv[3]);
    int keep = atoi(argv[4]);
    char path[4096];
    snprintf(path, sizeof path, "%s/libcudart.so.13", argv[1]);
    void *rt = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    snprintf(path, sizeof path, "%s/libcuda.so.1", argv[1]);
    void *drv = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!rt || !drv) { printf("dlopen: %s\n", dlerror()); return 1; }
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(drv, "cuInit");
    if (!init || init(0) != 0) { printf("cuInit failed\n"); return 1; }
    const char *names[WATCHED] = {"cuLaunchKernel", "cuLaunchKernelEx", "cuMemAlloc_v2",
                                  "cuMemcpy", "cudaLaunchKernel", "cudaMemcpy"};
    const unsigned char *code[WATCHED];
    unsigned char was[WATCHED][BYTES];
    for (int i = 0; i < WATCHED; i++) {
        code[i] = dlsym(i < 4 ? drv : rt, names[i]);
        if (code[i]) memcpy(was[i], code[i], BYTES);
    }
    pthread_t t;
    pthread_create(&t, NULL, sleep_on, NULL);
    while (!sleeper) ;
    printf("ready\n");
    fflush(stdout);
    long long start = now_us(), probed = 0;
    int child = 0;
    const char *cue = "none";
    for (;;) {
        for (int i = 0; !probed && i < WATCHED; i++) {
            if (code[i] && memcmp(was[i], (const void *)code[i], BYTES) != 0) {
                probed = now_us();
                if (keep && (child = fork()) == 0)
                    for (;;) pause();
            }
        }
        if (probed && delay >= 0 && now_us() - probed >= delay) { cue = "probes"; break; }
        if (traced()) { cue = "traced"; break; }
        if (now_us() - start > 5000000) break;
    }
    printf("exec cue=%s after_us=%lld child=%d\n", cue, probed ? now_us() - probed : -1LL, child);
    fflush(stdout);
    execl(argv[2], "sleep", "30", (char *)NULL);
    printf("exec failed\n");
    return 1;
}
"#;

/// `--gpu-times --pid` as the test group's member, whose process execs a setuid-root program
/// while tracerd loads the injection library into it (`RACE_C` says when: as the session's
/// probes go in, at delays spread over the time tracerd takes to stop a thread of it, or as its
/// thread is seen traced). Between the start's checks and the ptrace attach, such an exec hands
/// tracerd a root process under the pid it checked. Each time the injection library is never
/// mapped in the process once it runs as root, no thread of it is left traced, and tracerd's
/// answer is one [`refused_outcome`] or [`started_outcome`] knows: a refusal naming the exec
/// (before the process was pinned, on the stopped process, as its thread stopped) or the
/// caller's right; one in ptrace's words where the exec killed the thread stopped for the load;
/// or a session that stopped following the process at the exec (where it followed no other
/// process of the member's). A load carried on past a failed check would say "writing its
/// stack" (the pinned address space gone), which fails. Prints how many tries exec'd within
/// the load, and where each was caught.
#[test]
fn a_setuid_program_execd_during_the_gpu_times_load_gets_nothing() {
    use std::os::unix::fs::PermissionsExt;
    use tracer_tests::users::{as_user, member, public_ctl, GROUP};
    if !root_or_skip() {
        return;
    }
    let Some((uid, gid)) = member() else {
        tracer_testkit::skip(format_args!(
            "could not create test users (useradd/groupadd missing)"
        ));
        return;
    };
    let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").unwrap_or_default();
    if !matches!(yama.trim(), "" | "0") {
        tracer_testkit::skip(format_args!(
            "kernel.yama.ptrace_scope is {}: the member may have code loaded only into processes tracerctl started",
            yama.trim()
        ));
        return;
    }
    let d = Daemon::start_with(tracer_tests::DaemonOptions {
        group: Some(GROUP.into()),
        ..tracer_tests::DaemonOptions::default()
    });
    let Some(built) = build(&d) else { return };
    let ctl = public_ctl(&d);
    let shared = d.dir.path().join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let source = shared.join("race.c");
    std::fs::write(&source, RACE_C).unwrap();
    let race = shared.join("race");
    let compiled = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&race)
        .arg(&source)
        .args(["-ldl", "-lpthread"])
        .output();
    match compiled {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!("cc: {}", String::from_utf8_lossy(&out.stderr)),
        Err(_) => {
            tracer_testkit::skip(format_args!("no C compiler to build the test program"));
            return;
        }
    }
    // The setuid-root program, where the member can run it.
    let setuid = shared.join("sleep-setuid-root");
    std::fs::copy("/bin/sleep", &setuid).unwrap();
    std::os::unix::fs::chown(&setuid, Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&setuid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let status_of = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let euid = |status: &str| -> u32 {
        let uids = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap();
        uids.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    {
        let mut cmd = Command::new(&setuid);
        cmd.arg("30");
        let probe = ChildGuard::spawn(as_user(&mut cmd, uid, gid));
        if euid(&status_of(probe.pid())) != 0 {
            tracer_testkit::skip(format_args!(
                "{} does not run as root when the member runs it (a nosuid filesystem?)",
                setuid.display()
            ));
            return;
        }
    }
    // (delay after the probes in µs, negative: when its thread is seen traced; a child kept).
    let mut tries: Vec<(i64, bool)> = vec![(-1, true), (-1, false)];
    let (mut hits, mut window) = (0, 0i64);
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut n = 0;
    while n < tries.len() {
        let (delay, keep) = tries[n];
        // Files of their own: an earlier session's probes on the same files may still be
        // coming off, which the program would take for its cue.
        let libs = d.dir.path().join(format!("fakecuda-{n}"));
        std::fs::create_dir_all(&libs).unwrap();
        for lib in ["libcuda.so.1", "libcudart.so.13", "libcupti.so.13"] {
            std::fs::copy(built.join(lib), libs.join(lib)).unwrap();
        }
        let mut cmd = Command::new(&race);
        cmd.arg(&libs)
            .arg(&setuid)
            .arg(delay.to_string())
            .arg(if keep { "1" } else { "0" })
            .env_remove("CUDA_INJECTION64_PATH")
            .env_remove("LD_PRELOAD")
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        let mut app = ChildGuard::spawn(as_user(&mut cmd, uid, gid));
        let mut out = BufReader::new(app.0.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n");
        let pid = app.pid();
        let spid = pid.to_string();
        let args = [
            "start",
            "--mode=counting",
            "--cuda",
            "--gpu-times",
            "--pid",
            &spid,
        ];
        let answer = d.run_as(uid, gid, &args, &ctl);
        let mut exec = String::new();
        out.read_line(&mut exec).unwrap();
        let exec = exec.trim().to_owned();
        let field = |k: &str| -> String {
            exec.split_whitespace()
                .find_map(|f| f.strip_prefix(k))
                .unwrap_or_else(|| panic!("try {n}: the program's last words: {exec:?}"))
                .to_owned()
        };
        let after_us: i64 = field("after_us=").parse().unwrap();
        let child: i32 = field("child=").parse().unwrap();
        // Refused: the load has ended, and left no thread traced. Started: the session ended
        // at the exec (see `started_outcome`), and the load may still be under way.
        let loaded = !answer.status.success();
        let root_at_answer = look(&mut app, n, "at the start's answer", loaded);
        std::thread::sleep(Duration::from_millis(500));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !traced(pid).is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            look(&mut app, n, "0.5 s later", true),
            "try {n}: the setuid program runs as root"
        );
        assert_eq!(
            std::fs::read_link(format!("/proc/{pid}/exe")).unwrap(),
            setuid,
            "try {n}: {exec:?}"
        );
        let kill_child = || {
            if child > 0 {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(child),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        };
        let (said, outcome) = if answer.status.success() {
            let id = String::from_utf8_lossy(&answer.stdout).trim().to_owned();
            kill_child();
            wait_ended(&d, &id);
            let r = d.ok(&["report", &id, "--format", "json"]);
            let r: Value = serde_json::from_str(&r).unwrap();
            let said = format!(
                "started; unfollowed {}; GPU times {}",
                r["processes"]["unfollowed"], r["cuda"]["gpu_times"]
            );
            (said, started_outcome(&r, pid))
        } else {
            let err = String::from_utf8_lossy(&answer.stderr).trim().to_owned();
            let outcome = refused_outcome(&err, pid, uid);
            (err, outcome)
        };
        kill_child();
        let outcome =
            outcome.unwrap_or_else(|| panic!("try {n}: {exec:?}, and tracerd said: {said}"));
        eprintln!(
            "try {n}: delay {delay} us, child kept {keep}: {exec}; root at the answer {root_at_answer}; {outcome}: {said}"
        );
        if outcome != AFTER_THE_LOAD {
            hits += 1;
        }
        *outcomes.entry(outcome).or_default() += 1;
        // The first tries measure how long after the probes tracerd stops a thread; the
        // others exec at delays spread over twice that time, where the load pins the process,
        // checks it and stops a thread (the exec itself takes a few hundred µs).
        window = window.max(after_us);
        if n == 1 {
            let step = window.clamp(600, 20_000) / 12;
            for k in 0..24 {
                tries.push((step * k, k % 4 != 3));
            }
        }
        n += 1;
    }
    eprintln!(
        "{hits} of {} tries exec'd the setuid program within tracerd's load, after the start's checks: {outcomes:#?}",
        tries.len()
    );
    assert!(hits > 0, "no try raced the load: {outcomes:?}");
}

/// The threads of `pid` that are traced, with their tracer.
fn traced(pid: u32) -> Vec<(String, String)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|task| {
            let task = task.ok()?.path();
            let status = std::fs::read_to_string(task.join("status")).ok()?;
            let tracer = status
                .lines()
                .find_map(|l| l.strip_prefix("TracerPid:"))?
                .trim()
                .to_owned();
            (tracer != "0").then(|| (task.display().to_string(), tracer))
        })
        .collect()
}

/// Whether `app` runs as root now, which it never does with tracer's library mapped; where
/// `untraced`, no thread of it is traced.
fn look(app: &mut ChildGuard, n: usize, when: &str, untraced: bool) -> bool {
    let pid = app.pid();
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        panic!("try {n}, {when}: pid {pid} is gone: {:?}", app.0.try_wait());
    };
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let uids = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap();
    let root = uids.split_whitespace().nth(1) == Some("0");
    assert!(
        !(root && maps.contains("libtracer_cupti.so")),
        "try {n}, {when}: pid {pid} runs as root with tracer's library mapped:\n{maps}"
    );
    if untraced {
        let traced = traced(pid);
        assert!(
            traced.is_empty(),
            "try {n}, {when}: threads left traced (task, tracer): {traced:?}"
        );
    }
    root
}

/// An exec that came after the load had finished: not a try that hit the window.
const AFTER_THE_LOAD: &str = "exec'd after the load";

/// Where tracerd's refusal (`err`) of a `--gpu-times --pid` start for `pid` of `uid`'s, whose
/// process exec'd a setuid-root program during the load, caught the exec; None for a refusal
/// that names no reason.
fn refused_outcome(err: &str, pid: u32, uid: u32) -> Option<&'static str> {
    let err = err.strip_prefix("tracerctl: ")?;
    if err == format!("pid {pid} executed another program since the session's start checked it") {
        return Some("refused: exec'd before the process was pinned");
    }
    // The library loaded, then asked through the process's memory, replaced meanwhile.
    if err.contains(&format!("pid {pid} does not map libtracer_cupti.so"))
        || err.starts_with(&format!("GPU times in pid {pid}: "))
        || err.starts_with(&format!("reading pid {pid}'s memory: "))
        || err.starts_with(&format!("writing pid {pid}'s memory: "))
    {
        return Some(AFTER_THE_LOAD);
    }
    let load = err.strip_prefix(&format!(
        "loading libtracer_cupti.so into pid {pid} with ptrace: "
    ))?;
    let Some(stopped) = load.strip_prefix("refused once a thread of it was stopped: ") else {
        return match load {
            // Held at its exec by tracerd, which checks what the new program runs as.
            "it is stopped (job control, or held at an exec): a stopped process is not loaded into" => {
                Some("refused: held at its exec")
            }
            // The load failed (its thread killed, its libraries gone) and the exec since is
            // named for it.
            "it executed another program since it was checked" => {
                Some("refused: the exec named once the load failed")
            }
            // The thread stopped (or being stopped) for the load, killed by the exec after the
            // stopped process was checked: ptrace's own words only, the exec not named.
            "it exited" => Some("refused: its stopped thread killed by the exec (unnamed)"),
            _ if load.starts_with("ptrace ")
                && [
                    "No such process (os error 3)",
                    "Operation not permitted (os error 1)",
                    "No child processes (os error 10)",
                ]
                .iter()
                .any(|e| load.ends_with(e)) =>
            {
                Some("refused: its stopped thread killed by the exec (unnamed)")
            }
            // The new program's mappings, read before its loader mapped libc: the exec not
            // named either.
            "it maps no glibc (libc.so.6): a static or musl program" => {
                Some("refused: the new program read before it mapped libc (unnamed)")
            }
            // Anything else, "writing its stack" among them (what a load past a failed check
            // would say, the pinned address space gone), names nothing.
            _ => None,
        };
    };
    if stopped.starts_with(&format!("pid {pid} executed another program"))
        || stopped.starts_with(&format!("pid {pid} replaced its address space"))
    {
        Some("refused on the stopped process: another program")
    } else if stopped == "it executed a program as it was being stopped" {
        Some("refused: exec'd as its thread was being stopped")
    } else if stopped.contains(&format!("uid {uid} may not trace pid {pid}")) {
        Some("refused on the stopped process: the caller's right")
    } else {
        None
    }
}

/// Where a started session's report `r` says the exec of a setuid-root program by its target
/// `pid` was caught (as `refused_outcome`).
fn started_outcome(r: &Value, pid: u32) -> Option<&'static str> {
    let unfollowed = r["processes"]["unfollowed"].as_array()?;
    let gained_root = unfollowed.iter().any(|u| {
        u.as_str().is_some_and(|u| {
            u.starts_with(&format!("pid {pid} exec'd "))
                && u.contains("it runs as uid 0, so it is not traced")
        })
    });
    if !gained_root {
        return None;
    }
    // GPU times turned on before the exec, in the program the start checked: their status
    // line, whatever it came to once the program was replaced.
    let times = r["cuda"]["gpu_times"]
        .as_array()
        .map_or(&[][..], |t| &t[..]);
    Some(if times.iter().any(|t| t["pid"] == pid) {
        AFTER_THE_LOAD
    } else {
        "the session stopped following it at the exec"
    })
}

/// Every launch row of a report with all it says (entry point, kernel, grid, block, shared
/// memory, stream, native caller, Python call site and whose), graphs left out.
fn full_rows(report: &Value, pid: &str) -> BTreeMap<String, u64> {
    let mut rows = BTreeMap::new();
    for l in report["cuda"]["launches"].as_array().unwrap() {
        if l["api"].as_str().unwrap().contains("Graph") || l["pid"].as_u64() != pid.parse().ok() {
            continue;
        }
        let key = format!(
            "{} {} grid {:?} block {:?} shm {} stream {} caller {} site {} from {}",
            l["api"],
            l["kernel"],
            dims(&l["grid"]),
            dims(&l["block"]),
            l["shared_mem"],
            l["stream"],
            l["caller"],
            l["call_site"],
            l["call_site_from"]
        );
        *rows.entry(key).or_default() += l["launches"].as_u64().unwrap();
    }
    rows
}

/// tests/cuda's program with CUDA initialized, under two sessions of `mode` started while it
/// waits — the default (launches counted in-process) and `--cuda-uprobes-only` — then run:
/// the program (still alive), its pid, its account, and the sessions' ids (default, probes).
fn side_by_side(
    d: &Daemon,
    libs: &std::path::Path,
    mode: &str,
) -> (App, String, Value, [String; 2]) {
    let mut app = App::spawn(libs, &["hold=1", "init=1"], &[]);
    assert_eq!(app.cue("go\n"), "loaded\n", "CUDA initialized");
    let pid = app.pid();
    let start = ["start", mode, "--cuda", "--pid", &pid];
    let probes = d
        .ok(&[&start[..], &["--cuda-uprobes-only"]].concat())
        .trim()
        .to_owned();
    let inproc = d.ok(&start).trim().to_owned();
    let truth: Value = serde_json::from_str(&app.cue("go\n")).expect("the program's account");
    assert_eq!(truth["ok"], true, "the program's own checks");
    assert_eq!(app.cue(""), "done\n");
    (app, pid, truth, [inproc, probes])
}

/// `--cuda-in-process`: the launches tracer's injection library counts inside the process,
/// from CUPTI's launch callbacks, make the rows the launch probes make — each launch, kernel
/// name, configuration, stream and native caller — checked against a probes' session on the
/// same process at the same time and against the program's own account; its process gets no
/// kernel-launch probes from the session, and CUPTI is left as it was found.
#[test]
fn launches_counted_in_process_are_the_probes_rows() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let (mut app, pid, truth, [inproc, probes]) = side_by_side(&d, &libs, "--mode=counting");
    let on: Value = serde_json::from_str(&app.cue("cupti\n")).unwrap();
    assert_eq!(on["subscribed"], 1, "CUPTI's subscriber taken: {on}");
    assert_eq!(on["kind"], 0, "no kernel records without --gpu-times: {on}");
    assert_eq!(on["api_callbacks"], 8, "the eight launch callbacks: {on}");
    d.ok(&["stop", &inproc]);
    d.ok(&["stop", &probes]);
    let (inproc, probes) = (d.report_json(&inproc), d.report_json(&probes));
    assert_eq!(
        inproc["cuda"]["launch_counting"][0]["way"], "in-process",
        "{}",
        inproc["cuda"]
    );
    assert_eq!(probes["cuda"]["launch_counting"], Value::Null, "none asked");
    let status = inproc["cuda"]["gpu_times"][0]["status"].as_str().unwrap();
    assert!(
        status.starts_with("off: ") && status.contains("launches counted in-process"),
        "{status}"
    );
    assert_eq!(
        report_rows(&inproc),
        truth_rows(&truth),
        "the program's own account"
    );
    let (mine, theirs) = (full_rows(&inproc, &pid), full_rows(&probes, &pid));
    assert_eq!(mine, theirs, "the probes' rows, field by field");
    let callers = mine.keys().filter(|k| !k.contains("caller \"\"")).count();
    assert_eq!(callers, mine.len(), "every row has its caller: {mine:#?}");
    // The session put no kernel-launch probe on the process's libraries.
    let probed = |r: &Value, lib: &str| {
        r["cuda"]["libraries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["path"].as_str().unwrap().ends_with(lib))
            .map(|l| l["probes"].as_u64().unwrap())
    };
    for lib in ["/libcudart.so.13", "/libcuda.so.1"] {
        let (mine, all) = (probed(&inproc, lib).unwrap(), probed(&probes, lib).unwrap());
        assert!(
            mine < all,
            "{lib}: {mine} probes in-process, {all} with launch probes"
        );
    }
    let off: Value = serde_json::from_str(&app.cue("cupti\n")).unwrap();
    assert_eq!(
        off,
        serde_json::json!({"subscribed": 0, "kind": 0, "callbacks": 0, "api_callbacks": 0}),
        "CUPTI left as before the session"
    );
}

/// `--cuda-in-process` in a Python process: a launch from Python names its line, read by the
/// library in the launching thread's own frames; a launch from a thread without Python is
/// handed to the library's probe point, which names the line of the thread that launched from
/// Python last — as the probes name both, in the same process at the same time.
#[test]
fn launches_counted_in_process_name_their_python_call_site() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let script = tracer_tests::script("cuda_calls.py");
    let runtime = libs.join("libcudart.so.13");
    // The host's interpreters: tracerd's library is not loaded into another root (the 3.14
    // and 3.15 of CPython's chroot), as for --gpu-times.
    let chrooted = tracer_tests::chroot_interpreters();
    let host = tracer_tests::interpreters()
        .into_iter()
        .filter(|p| !chrooted.contains(p));
    for python in host {
        for mode in ["", "thread-busy"] {
            let what = format!("{} {mode}", python.display());
            // CUDA initialized before "loaded": the library is loaded into a process that has.
            let mut py = ChildGuard::spawn(
                Command::new(&python)
                    .arg(&script)
                    .arg(&runtime)
                    .args(["6", "2", mode])
                    .env("CUDA_CALLS_INIT", "1")
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped()),
            );
            let mut out = BufReader::new(py.0.stdout.take().unwrap());
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line, "loaded\n");
            let pid = py.pid().to_string();
            let counting = ["start", "--mode=counting", "--cuda", "--pid", &pid];
            let probes = d
                .ok(&[&counting[..], &["--cuda-uprobes-only"]].concat())
                .trim()
                .to_owned();
            let inproc = d
                .ok(&[&counting[..], &["--cuda-in-process"]].concat())
                .trim()
                .to_owned();
            let mut stdin = py.0.stdin.take().unwrap();
            stdin.write_all(b"go\n").unwrap();
            stdin.flush().unwrap();
            line.clear();
            out.read_line(&mut line).unwrap();
            assert_eq!(line, "done\n", "{what}");
            d.ok(&["stop", &inproc]);
            d.ok(&["stop", &probes]);
            drop(stdin);
            let _ = py.0.wait();
            let (mine, theirs) = (
                full_rows(&d.report_json(&inproc), &pid),
                full_rows(&d.report_json(&probes), &pid),
            );
            assert_eq!(mine, theirs, "{what}: the probes' rows, field by field");
            let source = std::fs::read_to_string(&script).unwrap();
            let marker = match mode {
                "" => "# the call site",
                _ => "# the thread's call site",
            };
            let at = source.lines().position(|l| l.contains(marker)).unwrap() + 1;
            let function = if mode.is_empty() {
                "launch"
            } else {
                "on_a_thread"
            };
            let site = format!("{function} ({}:{at})", script.display());
            let n: u64 = mine
                .iter()
                .filter(|(k, _)| k.contains(&format!("site {site:?}")))
                .map(|(_, n)| n)
                .sum();
            assert_eq!(n, 6, "{what}: six launches from {site}: {mine:#?}");
        }
    }
}

/// `--cuda-in-process` with options it cannot go with (another mode, another target, options
/// that shape the launch probes): refused, each with its reason, nothing started.
#[test]
fn launches_in_process_are_refused_with_options_they_cannot_go_with() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let mut app = App::spawn(&libs, &["hold=1", "init=1"], &[]);
    assert_eq!(app.cue("go\n"), "loaded\n", "CUDA initialized");
    let pid = app.pid();
    let shapes =
        "it needs --cuda, --pid or -- CMD, counting or tracing mode, and neither --cuda-stacks nor --cuda-driver-only";
    for extra in [
        &["--mode=sampling", "--pid", &pid][..],
        &["--mode=counting", "--all"],
        &["--mode=counting", "--cuda-stacks", "--pid", &pid],
        &["--mode=counting", "--cuda-driver-only", "--pid", &pid],
    ] {
        let args = [&["start", "--cuda", "--cuda-in-process"][..], extra].concat();
        let line = one_line_error(&d.run(&args));
        assert!(line.contains(shapes), "{args:?}: {line}");
    }
    assert!(
        !d.ok(&["list"]).contains("running"),
        "no session left running"
    );
    app.finish();
}

/// A running process whose launches cannot be counted in-process is counted with the probes
/// (the default, and --cuda-in-process alike), and the report says why: CUDA not loaded at
/// the start (its libraries probed as it maps them), CUPTI's subscriber slot held by
/// another tool (as torch.profiler holds it), the injection library loaded by CUDA at the
/// process's start. The rows are the program's own account; CUPTI is left as it was.
#[test]
fn launches_that_cannot_be_counted_in_process_are_counted_with_the_probes() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let injection = tracer_tests::bin_dir().join("libtracer_cupti.so");
    let injection = injection.to_str().unwrap();
    // (program arguments, environment, tracerctl flag, the reason the report gives)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: [Case; 3] = [
        (&[], &[], "", "has not loaded CUDA's driver"),
        (
            &["hold=1", "init=1", "subscribe=1"],
            &[],
            "--cuda-in-process",
            "another CUPTI subscriber holds this process",
        ),
        (
            &["hold=1", "init=1"],
            &[("CUDA_INJECTION64_PATH", injection)],
            "",
            "from its start (CUDA_INJECTION64_PATH)",
        ),
    ];
    for (args, env, flag, why) in cases {
        let mut app = App::spawn(&libs, args, env);
        if !args.is_empty() {
            assert_eq!(app.cue("go\n"), "loaded\n");
        }
        let pid = app.pid();
        let mut start = vec!["start", "--mode=counting", "--cuda", "--pid", &pid];
        start.extend((!flag.is_empty()).then_some(flag));
        let id = d.ok(&start).trim().to_owned();
        let truth: Value = serde_json::from_str(&app.cue("go\n")).expect("the program's account");
        assert_eq!(truth["ok"], true, "the program's own checks");
        assert_eq!(app.cue(""), "done\n");
        let cupti = app.cue("cupti\n");
        d.ok(&["stop", &id]);
        let report = d.report_json(&id);
        let counting = &report["cuda"]["launch_counting"];
        assert_eq!(counting[0]["way"], "probes", "{args:?}: {counting}");
        assert_eq!(counting[0]["pid"], pid.parse::<u64>().unwrap());
        let said = counting[0]["why"].as_str().unwrap();
        assert!(said.contains(why), "{args:?}: {said}");
        assert_eq!(
            report_rows(&report),
            truth_rows(&truth),
            "{args:?}: the program's own account"
        );
        let text = d.ok(&["report", &id]);
        assert!(
            text.contains(&format!("launches in pid {pid}: counted with probes: ")),
            "{text}"
        );
        if args.contains(&"subscribe=1") {
            let held: Value = serde_json::from_str(&cupti).unwrap();
            assert_eq!(held["subscribed"], 1, "the other tool's: {held}");
            assert_eq!(held["api_callbacks"], 0, "none turned on: {held}");
        }
        drop(app);
    }
}

/// `tracerctl start --mode=counting --cuda -- CMD` and its launched command, driven by its
/// cues through tracerctl's stdin and stdout: the program's account and the session's JSON
/// report (written when the command exits).
fn launched(
    d: &Daemon,
    extra: &[&str],
    cmd: &[&str],
    env: &[(&str, &str)],
    cues: &[&str],
) -> (Vec<String>, Value) {
    let out = d
        .dir
        .path()
        .join(format!("launched-{}.json", std::process::id()));
    let mut ctl = d.ctl();
    let counting = !extra.iter().any(|a| a.starts_with("--mode="));
    ctl.args(["start", "--cuda"])
        .args(counting.then_some("--mode=counting"))
        .args(extra)
        .args(["--format", "json", "-o"])
        .arg(&out)
        .arg("--")
        .args(cmd)
        .env_remove("CUDA_INJECTION64_PATH")
        .env_remove("TRACER_CUPTI_LAUNCHES")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut guard = ChildGuard::spawn(&mut ctl);
    let mut app = App {
        out: BufReader::new(guard.0.stdout.take().unwrap()),
        stdin: guard.0.stdin.take(),
        guard,
    };
    let said: Vec<String> = cues.iter().map(|c| app.cue(c)).collect();
    drop(app.stdin.take());
    let _ = app.guard.0.wait();
    let report = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    (said, report)
}

/// A launched command's launches are counted in-process by default: the launcher sets
/// tracer's injection library and `TRACER_CUPTI_LAUNCHES=1` for it, the library waits in
/// `cuInit` for the session's answer, and every launch made after is counted there, the rows
/// the program's own account with their callers; the same as `--cuda-uprobes-only` counts.
/// A program of the command started without those variables (another tool's injection
/// library, or an environment of its own) is counted with the probes, and the report says
/// why.
#[test]
fn launched_commands_count_their_launches_in_process() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let app = libs.join("cuda_app");
    let app = app.to_str().unwrap();
    let cues = ["", "go\n"];
    let account = |said: &[String]| -> Value {
        assert_eq!(said[0], "ready\n");
        let truth: Value = serde_json::from_str(&said[1]).expect("the program's account");
        assert_eq!(truth["ok"], true, "the program's own checks");
        truth
    };
    let callers = |r: &Value| -> BTreeMap<String, u64> {
        let mut all = BTreeMap::new();
        for l in r["cuda"]["launches"].as_array().unwrap() {
            // Graph executables' handles differ from run to run.
            if l["api"].as_str().unwrap().contains("Graph") {
                continue;
            }
            let key = format!("{} {} {}", l["api"], l["kernel"], l["caller"]);
            *all.entry(key).or_default() += l["launches"].as_u64().unwrap();
        }
        all
    };

    let (said, inproc) = launched(&d, &[], &[app], &[], &cues);
    let truth = account(&said);
    let counting = &inproc["cuda"]["launch_counting"];
    assert_eq!(counting[0]["way"], "in-process", "{}", inproc["cuda"]);
    assert_eq!(counting[0]["pid"], truth["pid"]);
    assert_eq!(
        report_rows(&inproc),
        truth_rows(&truth),
        "the program's own account"
    );
    let status = inproc["cuda"]["gpu_times"][0]["status"].as_str().unwrap();
    assert!(
        status.contains("no kernel records (launches alone)")
            && status.contains("; launches counted in-process"),
        "{status}"
    );

    // Traced: each launch counted in-process an event too, from the library's ring.
    let (said, traced) = launched(&d, &["--mode=tracing"], &[app], &[], &cues);
    let truth = account(&said);
    assert_eq!(traced["cuda"]["launch_counting"][0]["way"], "in-process");
    assert_eq!(report_rows(&traced), truth_rows(&truth), "traced");
    let (launches, memory) = counted(&traced);
    assert_eq!(
        traced["trace"]["cuda_events"],
        launches + memory,
        "an event each"
    );
    assert_eq!(traced["losses"], serde_json::json!([]));

    let (said, probes) = launched(&d, &["--cuda-uprobes-only"], &[app], &[], &cues);
    let truth = account(&said);
    assert_eq!(probes["cuda"]["launch_counting"], Value::Null, "none asked");
    assert_eq!(
        probes["cuda"]["gpu_times"],
        Value::Null,
        "no library loaded"
    );
    assert_eq!(report_rows(&probes), truth_rows(&truth));
    assert_eq!(callers(&inproc), callers(&probes), "the probes' callers");

    // Started with another tool's library (the launcher leaves it), and a program of the
    // command given an environment without tracer's.
    let other = ("CUDA_INJECTION64_PATH", "/nonexistent/libother_tool.so");
    let stripped = ["env", "-u", "CUDA_INJECTION64_PATH", app];
    for (cmd, env, why) in [
        (&[app][..], &[other][..], "another tool's injection library"),
        (
            &stripped[..],
            &[][..],
            "started without CUDA_INJECTION64_PATH",
        ),
    ] {
        let (said, report) = launched(&d, &[], cmd, env, &cues);
        let truth = account(&said);
        let counting = &report["cuda"]["launch_counting"];
        assert_eq!(counting[0]["way"], "probes", "{cmd:?}: {counting}");
        assert_eq!(counting[0]["pid"], truth["pid"]);
        let said = counting[0]["why"].as_str().unwrap();
        assert!(said.contains(why), "{cmd:?}: {said}");
        assert_eq!(report_rows(&report), truth_rows(&truth), "{cmd:?}");
    }
}

/// A launched Python program's launches counted in-process name their Python call site as
/// the probes do: the line that launched, and a thread without Python given the line of the
/// thread that launched from Python last.
#[test]
fn launched_python_names_its_call_sites_in_process() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let script = tracer_tests::script("cuda_calls.py");
    let runtime = libs.join("libcudart.so.13");
    let python = tracer_tests::python();
    let sites = |r: &Value| -> BTreeMap<String, u64> {
        let mut all = BTreeMap::new();
        for l in r["cuda"]["launches"].as_array().unwrap() {
            let key = format!("{} {} {}", l["api"], l["call_site"], l["call_site_from"]);
            *all.entry(key).or_default() += l["launches"].as_u64().unwrap();
        }
        all
    };
    // The thread-busy run is a tracing session's: its launches from threads without Python
    // are events made by the library's probe point, the others the library's own.
    for (mode, session) in [("", "--mode=counting"), ("thread-busy", "--mode=tracing")] {
        let cmd = [
            python.to_str().unwrap(),
            script.to_str().unwrap(),
            runtime.to_str().unwrap(),
            "6",
            "2",
            mode,
        ];
        let cues = ["", "go\n"];
        let (said, inproc) = launched(&d, &[session], &cmd, &[], &cues);
        assert_eq!(said, ["loaded\n", "done\n"], "{mode}");
        let (said, probes) = launched(&d, &["--cuda-uprobes-only"], &cmd, &[], &cues);
        assert_eq!(said, ["loaded\n", "done\n"], "{mode}");
        assert_eq!(
            inproc["cuda"]["launch_counting"][0]["way"], "in-process",
            "{mode}: {}",
            inproc["cuda"]
        );
        let (mine, theirs) = (sites(&inproc), sites(&probes));
        assert_eq!(mine, theirs, "{mode}: the probes' call sites");
        let named = mine.keys().filter(|k| k.contains(".py:")).count();
        assert!(named > 0, "{mode}: {mine:#?}");
        if session == "--mode=tracing" {
            let (launches, memory) = counted(&inproc);
            assert_eq!(
                inproc["trace"]["cuda_events"],
                launches + memory,
                "{mode}: an event each"
            );
            assert_eq!(inproc["losses"], serde_json::json!([]), "{mode}");
        }
    }
}

/// Session `id`'s launch instants in pid `pid`, in time order: (time in µs, thread, name and
/// arguments as the Chrome export gives them).
fn launch_instants(d: &Daemon, id: &str, pid: &str) -> Vec<(f64, u64, String)> {
    let path = d.dir.path().join(format!("{id}.json"));
    d.ok(&[
        "report",
        id,
        "--format",
        "chrome",
        "-o",
        path.to_str().unwrap(),
    ]);
    let chrome: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let mut all: Vec<(f64, u64, String)> = chrome["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "cuda" && !e["args"]["api"].is_null())
        .filter(|e| e["pid"].as_u64() == pid.parse().ok())
        .map(|e| {
            let what = format!("{} {}", e["name"], e["args"]);
            (e["ts"].as_f64().unwrap(), e["tid"].as_u64().unwrap(), what)
        })
        .collect();
    all.sort_by(|a, b| a.0.total_cmp(&b.0));
    all
}

/// A tracing session counts a running process's launches in-process by default, and each
/// launch is an instant on its timeline as the launch probes make it: checked against a
/// `--cuda-uprobes-only` tracing session on the same process at the same time — the same
/// instants (kernel, configuration, stream, caller), on the same threads, in the same order,
/// each stamped between its probe's and the next launch's — and against the report's counts.
#[test]
fn traced_launches_counted_in_process_are_the_probes_instants() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let Some(libs) = build(&d) else { return };
    let (_app, pid, truth, [inproc, probes]) = side_by_side(&d, &libs, "--mode=tracing");
    d.ok(&["stop", &inproc]);
    d.ok(&["stop", &probes]);
    let (mine, theirs) = (d.report_json(&inproc), d.report_json(&probes));
    let counting = &mine["cuda"]["launch_counting"];
    assert_eq!(counting[0]["way"], "in-process", "{counting}");
    for r in [&mine, &theirs] {
        assert_eq!(r["losses"], serde_json::json!([]));
        assert_eq!(
            report_rows(r),
            truth_rows(&truth),
            "the program's own account"
        );
    }
    assert_eq!(full_rows(&mine, &pid), full_rows(&theirs, &pid));
    let (a, b) = (
        launch_instants(&d, &inproc, &pid),
        launch_instants(&d, &probes, &pid),
    );
    let (launches, _) = counted(&mine);
    assert_eq!(a.len() as u64, launches, "an instant a launch");
    // Per thread (threads launch at once, so only each one's order is the program's).
    let threads = |v: &[(f64, u64, String)]| -> BTreeMap<u64, Vec<(f64, String)>> {
        let mut all: BTreeMap<u64, Vec<(f64, String)>> = BTreeMap::new();
        for (at, tid, what) in v {
            all.entry(*tid).or_default().push((*at, what.clone()));
        }
        all
    };
    let (a, b) = (threads(&a), threads(&b));
    let names = |m: &BTreeMap<u64, Vec<(f64, String)>>| -> BTreeMap<u64, Vec<String>> {
        m.iter()
            .map(|(t, v)| (*t, v.iter().map(|(_, w)| w.clone()).collect()))
            .collect()
    };
    assert_eq!(names(&a), names(&b), "the probes' instants, in their order");
    // The library's clock is the probes': each kernel launch after its probe's instant (the
    // probe fires at the call's first instruction, CUPTI's callback inside it), before the
    // next. (Graph launches are probed in both sessions.)
    for (tid, mine) in &a {
        let theirs = &b[tid];
        for (i, (at, what)) in mine.iter().enumerate() {
            if what.contains("Graph") {
                continue;
            }
            assert!(
                *at >= theirs[i].0,
                "{what}: {at} µs, its probe's {}",
                theirs[i].0
            );
            if let Some(next) = theirs.get(i + 1) {
                assert!(
                    *at <= next.0,
                    "{what}: {at} µs, the next probe's {}",
                    next.0
                );
            }
        }
    }
    // Copies, allocations and frees stay the probes' in both, each session's own: every
    // allocation and the bytes of its free in each.
    let memory = |r: &Value| -> Vec<String> {
        let mut all: Vec<String> = r["cuda"]["memory"]
            .as_array()
            .unwrap()
            .iter()
            .map(Value::to_string)
            .collect();
        all.sort();
        all
    };
    assert_eq!(memory(&mine), memory(&theirs));
    assert_eq!(mine["trace"]["cuda_events"], theirs["trace"]["cuda_events"]);
}
