//! Continuous profiling: a sampling session pushing a window of samples every second to a
//! Pyroscope-style endpoint (push.v1.PusherService/Push; here a recorder that refuses its
//! first pushes) or to Parca's gRPC WriteRaw (here grpcio's server); the pushed pprof is
//! read back with `go tool pprof`.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpListener,
    process::Command,
    sync::{Arc, Mutex},
    time::Duration,
};

use prost::Message;
use tracer_tests::{root_or_skip, Daemon};

#[derive(Clone, PartialEq, prost::Message)]
struct PushRequest {
    #[prost(message, repeated, tag = "1")]
    series: Vec<RawProfileSeries>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawProfileSeries {
    #[prost(message, repeated, tag = "1")]
    labels: Vec<LabelPair>,
    #[prost(message, repeated, tag = "2")]
    samples: Vec<RawSample>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawSample {
    #[prost(bytes = "vec", tag = "1")]
    raw_profile: Vec<u8>,
    #[prost(string, tag = "2")]
    id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WriteRawRequest {
    #[prost(message, repeated, tag = "2")]
    series: Vec<ParcaSeries>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ParcaSeries {
    #[prost(message, optional, tag = "1")]
    labels: Option<LabelSet>,
    #[prost(message, repeated, tag = "2")]
    samples: Vec<RawSample>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct LabelSet {
    #[prost(message, repeated, tag = "1")]
    labels: Vec<LabelPair>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct LabelPair {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    value: String,
}

/// A request as received: path, headers (lowercase names), body, and the status sent back.
type Received = (String, String, Vec<u8>, u16);

/// An HTTP endpoint recording every request; it answers 503 to the first `refuse`.
fn recorder(refuse: usize) -> (String, Arc<Mutex<Vec<Received>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let got: Arc<Mutex<Vec<Received>>> = Arc::default();
    let g = got.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            let mut data = Vec::new();
            let mut buf = [0u8; 65536];
            let head_end = loop {
                if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                    break Some(i + 4);
                }
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break None,
                    Ok(n) => data.extend_from_slice(&buf[..n]),
                }
            };
            let Some(head_end) = head_end else { continue };
            let head = String::from_utf8_lossy(&data[..head_end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while data.len() < head_end + len {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => data.extend_from_slice(&buf[..n]),
                }
            }
            let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
            let mut g = g.lock().unwrap();
            let status = if g.len() < refuse { 503 } else { 200 };
            g.push((path, head.clone(), data[head_end..].to_vec(), status));
            let _ = write!(
                c,
                "HTTP/1.1 {status} X\r\nContent-Type: application/proto\r\nContent-Length: 0\r\n\r\n"
            );
        }
    });
    (addr, got)
}

#[test]
fn windows_are_pushed_with_process_labels_and_refusals_retried() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let (addr, got) = recorder(2);
    let _busy = busy();
    let id = d.start_pushing(&format!("http://{addr}"), &[]);
    let id = id.trim();
    tracer_tests::wait_until(30, "four pushes, two of them taken", || {
        got.lock().unwrap().iter().filter(|r| r.3 == 200).count() >= 2
    });
    let status = d.ok(&["status", id]);
    d.ok(&["stop", id]);
    assert!(status.contains("pushed:"), "{status}");
    let failed: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("pushed:"))
        .and_then(|l| l.split(',').nth(1))
        .and_then(|p| p.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(failed >= 2, "{status}");

    let got = got.lock().unwrap().clone();
    // The refused windows were pushed again: the first taken request repeats the first.
    assert_eq!(got[0].2, got[1].2, "a refused window is retried as it was");
    let mut found = None;
    for (path, head, body, _) in &got {
        assert_eq!(path, "/push.v1.pusherservice/push");
        assert!(head.contains("content-type: application/proto"), "{head}");
        let req = PushRequest::decode(body.as_slice()).unwrap();
        for s in &req.series {
            let label = |n: &str| {
                s.labels
                    .iter()
                    .find(|l| l.name == n)
                    .map(|l| l.value.clone())
            };
            assert_eq!(label("__name__").as_deref(), Some("process_cpu"));
            assert!(label("service_name").is_some() && label("node").is_some());
            let names: Vec<&str> = s.labels.iter().map(|l| l.name.as_str()).collect();
            let mut sorted = names.clone();
            sorted.sort();
            assert_eq!(names, sorted, "labels are sorted");
            // The fullest window of the Python process: on a loaded machine a window may
            // hold a sample or two of it, none of them in its loop.
            if label("comm").is_some_and(|c| c.starts_with("python")) {
                let profile = &s.samples[0].raw_profile;
                if found
                    .as_ref()
                    .is_none_or(|f: &Vec<u8>| f.len() < profile.len())
                {
                    found = Some(profile.clone());
                }
            }
        }
    }
    let profile = found.expect("no series of the Python process");
    assert_busy(&d, &profile);
}

/// `go tool pprof` finds the busy loop in a pushed profile.
fn assert_busy(d: &Daemon, profile: &[u8]) {
    let Ok(go) = Command::new("go").arg("version").output() else {
        tracer_testkit::skip(format_args!(
            "the pprof half: go is not installed (cargo xtask test installs it)"
        ));
        return;
    };
    assert!(go.status.success());
    let file = d.dir.path().join("window.pb.gz");
    std::fs::write(&file, profile).unwrap();
    let top = Command::new("go")
        .args(["tool", "pprof", "-top", "-nodecount=500"])
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&top.stdout);
    assert!(
        top.status.success(),
        "{}",
        String::from_utf8_lossy(&top.stderr)
    );
    assert!(text.contains("busy_window_loop"), "{text}");
}

fn busy() -> tracer_tests::ChildGuard {
    tracer_tests::ChildGuard::spawn(Command::new(tracer_tests::python()).args([
        "-c",
        "def busy_window_loop():\n    while True:\n        sum(range(1000))\nbusy_window_loop()\n",
    ]))
}

#[test]
fn windows_reach_parca_over_grpc() {
    if !root_or_skip() {
        return;
    }
    let Some(grpc_python) = tracer_tests::grpc_python() else {
        tracer_testkit::skip(format_args!(
            "no Python with grpcio (cargo xtask test makes one)"
        ));
        return;
    };
    let d = Daemon::start();
    let out = d.dir.path().join("parca.bin");
    let mut sink = tracer_tests::ChildGuard::spawn(
        Command::new(grpc_python)
            .arg(tracer_tests::script("parca_sink.py"))
            .arg(&out)
            .stdout(std::process::Stdio::piped()),
    );
    let mut port = String::new();
    BufReader::new(sink.0.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    let _busy = busy();
    let id = d.start_pushing(&format!("parca://127.0.0.1:{}", port.trim()), &[]);
    let id = id.trim();
    tracer_tests::wait_until(30, "two windows at the Parca sink", || {
        std::fs::metadata(&out).is_ok_and(|m| m.len() > 0)
            && tracer_tests::length_prefixed(&out).len() >= 2
    });
    let status = d.ok(&["status", id]);
    d.ok(&["stop", id]);
    assert!(status.contains("pushed:"), "{status}");
    let mut found = None;
    for body in tracer_tests::length_prefixed(&out) {
        let req = WriteRawRequest::decode(body.as_slice()).unwrap();
        for s in &req.series {
            let labels = &s.labels.as_ref().unwrap().labels;
            let label = |n: &str| labels.iter().find(|l| l.name == n).map(|l| l.value.clone());
            assert_eq!(label("__name__").as_deref(), Some("process_cpu"));
            // The fullest window of the Python process: on a loaded machine a window may
            // hold a sample or two of it, none of them in its loop.
            if label("comm").is_some_and(|c| c.starts_with("python")) {
                let profile = &s.samples[0].raw_profile;
                if found
                    .as_ref()
                    .is_none_or(|f: &Vec<u8>| f.len() < profile.len())
                {
                    found = Some(profile.clone());
                }
            }
        }
    }
    assert_busy(&d, &found.expect("no series of the Python process"));
}

#[test]
fn bad_push_requests_are_refused() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let start =
        |args: &[&str]| tracer_tests::one_line_error(&d.run(&[&["start", "--all"], args].concat()));
    let not_pem = d.dir.path().join("not.pem");
    std::fs::write(&not_pem, "not a certificate\n").unwrap();
    let line = start(&[
        "--mode=sampling",
        "--push",
        "https://pyroscope:4040",
        "--push-ca",
        not_pem.to_str().unwrap(),
    ]);
    assert!(line.contains("push CA"), "{line}");
    let line = start(&["--mode=sampling", "--push", "pyroscope:4040"]);
    assert!(
        line.contains(
            "must be http[s]://HOST:PORT (Pyroscope), parca[s]://HOST:PORT or otlp[s]://HOST:PORT"
        ),
        "{line}"
    );
    let line = start(&["--mode=sampling", "--push", "http://pyroscope"]);
    assert!(line.contains("needs a host and port"), "{line}");
    let line = start(&[
        "--mode=sampling",
        "--push",
        "http://h:1",
        "--push-period",
        "500ms",
    ]);
    assert!(
        line.contains("the push period must be from 1s to 1h"),
        "{line}"
    );
    let line = start(&["--mode=counting", "--push", "http://h:1"]);
    assert!(
        line.contains("pushing profiles (--push) is for sampling sessions"),
        "{line}"
    );
}
