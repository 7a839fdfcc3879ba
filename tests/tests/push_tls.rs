//! Pushes over TLS (`otlps://`, `https://`): the endpoint's certificate checked against the
//! CA given with --push-ca, a client certificate given where the endpoint asks for one (the
//! fleet tests' test CA makes them), and a push to an endpoint of another CA refused with
//! the reason in the session's status.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use tracer_tests::{fleet::Pki, grpc_python, root_or_skip, script, ChildGuard, Daemon};

/// A TLS endpoint (`program args…`, printing its port), with the server certificate of
/// `pki` for 127.0.0.1 and asking for client certificates of `pki`.
fn endpoint(
    d: &Daemon,
    pki: &Pki,
    program: &[&std::ffi::OsStr],
    name: &str,
) -> (ChildGuard, String, PathBuf) {
    let (cert, key) = pki.issue("127.0.0.1");
    let out = d.dir.path().join(format!("{name}.bin"));
    let mut c = Command::new(program[0]);
    c.args(&program[1..])
        .arg(&out)
        .args([&cert, &key, &pki.ca])
        .stdout(Stdio::piped());
    let mut e = ChildGuard::spawn(&mut c);
    let mut port = String::new();
    BufReader::new(e.0.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    assert!(!port.trim().is_empty(), "{name} did not start");
    (e, port.trim().to_owned(), out)
}

/// Starts a continuous session pushing to `url` with the client certificate `client` of
/// `ca`'s PKI.
fn push(d: &Daemon, url: &str, ca: &Path, client: &(PathBuf, PathBuf)) -> String {
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    d.start_pushing(
        url,
        &[
            "--push-ca",
            &s(ca),
            "--push-cert",
            &s(&client.0),
            "--push-key",
            &s(&client.1),
        ],
    )
}

fn busy() -> ChildGuard {
    ChildGuard::spawn(
        Command::new(tracer_tests::python()).args(["-c", "while True: sum(range(1000))"]),
    )
}

#[test]
fn windows_reach_tls_endpoints_with_a_client_certificate() {
    if !root_or_skip() {
        return;
    }
    let Some(python) = grpc_python() else {
        tracer_testkit::skip(format_args!(
            "no Python with grpcio (cargo xtask test makes one)"
        ));
        return;
    };
    let d = Daemon::start();
    let pki = Pki::new(&d.dir.path().join("pki"), "push-ca");
    let client = pki.issue("tracerd-client");
    let _busy = busy();
    let otlp = script("otlp_receiver.py");
    let https = script("https_sink.py");
    for (name, program, scheme) in [
        (
            "otlp",
            vec![python.as_os_str(), otlp.as_os_str(), "serve".as_ref()],
            "otlps",
        ),
        (
            "pyroscope",
            vec![python.as_os_str(), https.as_os_str()],
            "https",
        ),
    ] {
        let (_e, port, out) = endpoint(&d, &pki, &program, name);
        let id = push(
            &d,
            &format!("{scheme}://127.0.0.1:{port}"),
            &pki.ca,
            &client,
        );
        tracer_tests::wait_until(
            30,
            &format!("a window at the {name} endpoint over TLS"),
            || !tracer_tests::length_prefixed(&out).is_empty(),
        );
        let status = d.ok(&["status", &id]);
        d.ok(&["stop", &id]);
        assert!(status.contains("pushed:"), "{status}");
    }
}

#[test]
fn an_endpoint_of_another_ca_is_refused_saying_why() {
    if !root_or_skip() {
        return;
    }
    let Some(python) = grpc_python() else {
        tracer_testkit::skip(format_args!(
            "no Python with grpcio (cargo xtask test makes one)"
        ));
        return;
    };
    let d = Daemon::start();
    let theirs = Pki::new(&d.dir.path().join("theirs"), "their-ca");
    let ours = Pki::new(&d.dir.path().join("ours"), "our-ca");
    let client = ours.issue("tracerd-client");
    let _busy = busy();
    let otlp = script("otlp_receiver.py");
    let program = [python.as_os_str(), otlp.as_os_str(), "serve".as_ref()];
    let (_e, port, out) = endpoint(&d, &theirs, &program, "otlp");
    let id = push(&d, &format!("otlps://127.0.0.1:{port}"), &ours.ca, &client);
    let mut status = String::new();
    tracer_tests::wait_until(30, "a failed push in the status", || {
        status = d.ok(&["status", &id]);
        status.to_lowercase().contains("certificate")
    });
    d.ok(&["stop", &id]);
    assert_eq!(tracer_tests::length_prefixed(&out).len(), 0, "{status}");
    // TLS files with a plaintext endpoint are a mistake, said at once.
    let e = d.run(&[
        "start",
        "--mode=sampling",
        "--all",
        "--continuous",
        "--push",
        "otlp://127.0.0.1:1",
        "--push-ca",
        ours.ca.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&e.stderr);
    assert!(!e.status.success() && said.contains("otlps://"), "{said}");
}
