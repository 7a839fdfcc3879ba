//! OpenTelemetry profiles (OTLP), end to end: a sampling session's report as an
//! `ExportProfilesServiceRequest`, read back with the OpenTelemetry project's own Python
//! classes and checked sample by sample against the pprof export of the same session.

use std::{io::Read, process::Command};

use prost::Message;
use serde_json::Value;
use tracer_proto::pprof as pb;
use tracer_tests::{grpc_python, root_or_skip, script, ChildGuard, Daemon};

/// (pid, tid, stack leaf first as `name:line`, one value per sample type).
type Row = (i64, i64, Vec<String>, Vec<i64>);

/// The samples of a gzipped pprof, and its sample types.
fn pprof_rows(gz: &[u8]) -> (Vec<(String, String)>, Vec<Row>) {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut raw)
        .unwrap();
    let d = pb::Profile::decode(raw.as_slice()).unwrap();
    let s = |i: i64| d.string_table[i as usize].clone();
    let types = d
        .sample_type
        .iter()
        .map(|t| (s(t.r#type), s(t.unit)))
        .collect();
    let rows = d
        .sample
        .iter()
        .map(|x| {
            let num = |k: &str| x.label.iter().find(|l| s(l.key) == k).unwrap().num;
            let names = x
                .location_id
                .iter()
                .map(|&id| {
                    let loc = &d.location[id as usize - 1];
                    let f = &d.function[loc.line[0].function_id as usize - 1];
                    format!("{}:{}", s(f.name), loc.line[0].line)
                })
                .collect();
            (num("pid"), num("tid"), names, x.value.clone())
        })
        .collect();
    (types, rows)
}

/// What otlp_receiver.py read from an OTLP request.
struct Decoded {
    types: Vec<(String, String)>,
    rows: Vec<Row>,
    resources: Vec<serde_json::Map<String, Value>>,
}

fn decoded(v: &Value) -> Decoded {
    assert_eq!(
        v["zero_entries"], true,
        "entry 0 of a dictionary table is not empty"
    );
    let pair = |t: &Value| {
        (
            t[0].as_str().unwrap().to_owned(),
            t[1].as_str().unwrap().to_owned(),
        )
    };
    let ints = |t: &Value| {
        t.as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_i64().unwrap())
            .collect()
    };
    Decoded {
        types: v["types"].as_array().unwrap().iter().map(pair).collect(),
        rows: v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let names = r[2].as_array().unwrap().iter();
                (
                    r[0].as_i64().unwrap(),
                    r[1].as_i64().unwrap(),
                    names.map(|n| n.as_str().unwrap().to_owned()).collect(),
                    ints(&r[3]),
                )
            })
            .collect(),
        resources: v["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_object().unwrap().clone())
            .collect(),
    }
}

/// The OpenTelemetry classes' reading of an OTLP request in `file`.
fn read_otlp(python: &std::path::Path, file: &std::path::Path) -> Decoded {
    let out = Command::new(python)
        .arg(script("otlp_receiver.py"))
        .arg("decode")
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    decoded(&serde_json::from_slice(&out.stdout).unwrap())
}

#[test]
fn a_report_as_otlp_equals_its_pprof_sample_by_sample() {
    if !root_or_skip() {
        return;
    }
    let Some(python) = grpc_python().filter(|p| {
        Command::new(p)
            .args(["-c", "import opentelemetry.proto"])
            .status()
            .is_ok_and(|s| s.success())
    }) else {
        tracer_testkit::skip(format_args!(
            "no opentelemetry-proto (cargo xtask test installs it)"
        ));
        return;
    };
    let d = Daemon::start();
    let target = ChildGuard::spawn(
        Command::new(tracer_tests::python())
            .arg(script("sample_workload.py"))
            .arg("30")
            // As an OpenTelemetry SDK would read it; the attribute loses to the variable.
            .env("OTEL_RESOURCE_ATTRIBUTES", "service.name=cart,team=x")
            .env("OTEL_SERVICE_NAME", "checkout\u{1b}[2J"),
    );
    let pid = target.pid().to_string();
    d.ok(&[
        "start",
        "--mode=sampling",
        "--pid",
        &pid,
        "--duration",
        "2s",
        "--wait",
        "--format",
        "json",
        "-o",
        "/dev/null",
    ]);
    let id = d.newest_session("");
    let file = |format: &str| {
        let f = d.dir.path().join(format!("report.{format}"));
        d.ok(&["report", &id, "--format", format, "-o", f.to_str().unwrap()]);
        f
    };
    let (pp_types, mut pp_rows) = pprof_rows(&std::fs::read(file("pprof")).unwrap());
    let mut o = read_otlp(&python, &file("otlp"));
    assert_eq!(o.types, pp_types);
    o.rows.sort();
    pp_rows.sort();
    assert!(pp_rows.len() >= 3, "{pp_rows:?}");
    assert_eq!(o.rows, pp_rows);
    assert!(
        o.rows
            .iter()
            .any(|r| r.2.iter().any(|n| n.starts_with("heavy:"))),
        "no Python frame"
    );
    // One resource: the process, on this host.
    assert_eq!(o.resources.len(), 1, "{:?}", o.resources);
    let r = &o.resources[0];
    assert_eq!(r["process.pid"].as_i64().unwrap().to_string(), pid);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(r["host.name"], host.trim());
    assert_eq!(r["service.name"], "checkout[2J", "{r:?}");
    // Counting sessions have no stacks to give.
    d.ok(&[
        "start",
        "--mode=counting",
        "--pid",
        &pid,
        "--duration",
        "200ms",
        "--wait",
        "--format",
        "json",
        "-o",
        "/dev/null",
    ]);
    let id = d.newest_session("");
    let out = d.run(&["report", &id, "--format", "otlp"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("sampling"), "{e}");
}

/// An OTLP receiver made of the OpenTelemetry classes (`mode`: serve or reject), and where
/// it writes what it is sent.
fn receiver(
    d: &Daemon,
    python: &std::path::Path,
    mode: &str,
) -> (ChildGuard, String, std::path::PathBuf) {
    use std::io::BufRead;
    let out = d.dir.path().join(format!("otlp-{mode}.bin"));
    let mut r = ChildGuard::spawn(
        Command::new(python)
            .arg(script("otlp_receiver.py"))
            .arg(mode)
            .arg(&out)
            .stdout(std::process::Stdio::piped()),
    );
    let mut port = String::new();
    std::io::BufReader::new(r.0.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    (r, format!("otlp://127.0.0.1:{}", port.trim()), out)
}

fn otlp_python() -> Option<std::path::PathBuf> {
    let p = grpc_python().filter(|p| {
        Command::new(p)
            .args(["-c", "import opentelemetry.proto"])
            .status()
            .is_ok_and(|s| s.success())
    });
    if p.is_none() {
        tracer_testkit::skip(format_args!(
            "no opentelemetry-proto (cargo xtask test installs it)"
        ));
    }
    p
}

#[test]
fn windows_reach_an_otlp_receiver() {
    if !root_or_skip() {
        return;
    }
    let Some(python) = otlp_python() else {
        return;
    };
    let d = Daemon::start();
    let (_receiver, url, out) = receiver(&d, &python, "serve");
    let busy = ChildGuard::spawn(Command::new(tracer_tests::python()).args([
        "-c",
        "def busy_otlp_loop():\n    while True:\n        sum(range(1000))\nbusy_otlp_loop()\n",
    ]));
    let id = d.start_pushing(&url, &[]);
    tracer_tests::wait_until(30, "two windows at the OTLP receiver", || {
        tracer_tests::length_prefixed(&out).len() >= 2
    });
    let status = d.ok(&["status", &id]);
    d.ok(&["stop", &id]);
    assert!(status.contains("pushed:"), "{status}");
    let mut seen = false;
    for (n, body) in tracer_tests::length_prefixed(&out).iter().enumerate() {
        let f = d.dir.path().join(format!("request-{n}.bin"));
        std::fs::write(&f, body).unwrap();
        let o = read_otlp(&python, &f);
        assert_eq!(
            o.types,
            [
                ("samples".into(), "count".into()),
                ("cpu".into(), "nanoseconds".into())
            ]
        );
        // CPU time is samples × one period (49 Hz).
        let period = 1_000_000_000 / 49;
        assert!(
            o.rows.iter().all(|r| r.3.len() == 2
                && r.3[0] > 0
                && r.3[1] % r.3[0] == 0
                && (r.3[1] / r.3[0] - period).abs() < 1_000),
            "{:?}",
            o.rows.first()
        );
        let pid = i64::from(busy.pid());
        assert!(o.resources.iter().all(|r| r.contains_key("host.name")));
        seen |= o.resources.iter().any(|r| r["process.pid"] == pid)
            && o.rows
                .iter()
                .any(|r| r.0 == pid && r.2.iter().any(|f| f.starts_with("busy_otlp_loop:")));
    }
    assert!(seen, "the busy process never came with its Python frame");
}

#[test]
fn a_receiver_that_rejects_profiles_is_a_failed_push() {
    if !root_or_skip() {
        return;
    }
    let Some(python) = otlp_python() else {
        return;
    };
    let d = Daemon::start();
    let (_receiver, url, out) = receiver(&d, &python, "reject");
    let _busy = ChildGuard::spawn(
        Command::new(tracer_tests::python()).args(["-c", "while True: sum(range(1000))"]),
    );
    let id = d.start_pushing(&url, &[]);
    tracer_tests::wait_until(30, "a window at the rejecting receiver", || {
        !tracer_tests::length_prefixed(&out).is_empty()
    });
    let mut status = String::new();
    tracer_tests::wait_until(15, "the rejection in the status", || {
        status = d.ok(&["status", &id]);
        status.contains("rejected")
    });
    d.ok(&["stop", &id]);
    assert!(status.contains("this receiver takes none"), "{status}");
}
