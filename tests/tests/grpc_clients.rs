//! Clients nobody here wrote: Python's grpcio with server reflection and the standard health
//! service, using no proto file.

use std::process::Command;

use serde_json::Value;
use tracer_tests::{root_or_skip, script, Daemon};

#[test]
fn reflection_and_health_serve_generic_clients() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = tracer_tests::grpc_python() else {
        tracer_testkit::skip(format_args!("no Python with grpcio, grpcio-reflection and grpcio-health-checking (run via `cargo xtask test`)"));
        return;
    };
    let d = Daemon::start();
    let out = Command::new(py)
        .arg(script("generic_client.py"))
        .arg(&d.socket)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "generic client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let services = v["services"].to_string();
    for s in [
        "tracer.v1.Tracer",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(services.contains(s), "{services}");
    }
    let methods: Vec<&str> = v["methods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    assert_eq!(
        methods,
        [
            "DeleteSession",
            "GetCapabilities",
            "GetReport",
            "GetSession",
            "ListSessions",
            "StartSession",
            "StopSession",
            "StreamEvents",
            "WatchSession"
        ]
    );
    assert_eq!(v["health"], "SERVING");
    assert!(v["capabilities"]["kernelRelease"]
        .as_str()
        .is_some_and(|k| !k.is_empty()));
    assert_eq!(v["capabilities"]["bpf"], true);
    let codes = &v["errors"];
    assert_eq!(codes["no_mode"][0], "INVALID_ARGUMENT", "{codes}");
    assert_eq!(codes["zero_duration"][0], "INVALID_ARGUMENT", "{codes}");
    assert_eq!(codes["no_such_pid"][0], "NOT_FOUND", "{codes}");
    assert_eq!(codes["bad_event"][0], "INVALID_ARGUMENT", "{codes}");
    assert_eq!(
        codes["tracing_options_elsewhere"][0], "INVALID_ARGUMENT",
        "{codes}"
    );
    assert_eq!(codes["huge_trace_buffer"][0], "INVALID_ARGUMENT", "{codes}");
    assert_eq!(codes["bad_frequency"][0], "INVALID_ARGUMENT", "{codes}");
    assert_eq!(
        codes["stacks_without_cuda"][0], "INVALID_ARGUMENT",
        "{codes}"
    );
    assert_eq!(
        codes["driver_only_without_cuda"][0], "INVALID_ARGUMENT",
        "{codes}"
    );
    for bad in ["stacks_without_cuda", "driver_only_without_cuda"] {
        assert!(
            codes[bad][1]
                .as_str()
                .is_some_and(|m| m.ends_with("they need --cuda")),
            "{codes}"
        );
    }
    assert_eq!(codes["no_session"][0], "NOT_FOUND", "{codes}");
    assert_eq!(
        v["started"]["state"], "SESSION_STATE_RUNNING",
        "{}",
        v["started"]
    );
}

#[test]
fn plaintext_tcp_on_loopback_takes_a_token() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let sock = d.dir.path().join("tcp-daemon.sock");
    let listen = format!("tcp://{}", tracer_tests::free_loopback_addr());
    let policy = d.dir.path().join("access.toml");
    // sha256 of "secret"; a read-only client.
    std::fs::write(
        &policy,
        "[[client]]\nname = 'dash'\ntoken_sha256 = '2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b'\nrole = 'read'\n",
    )
    .unwrap();
    let token = d.dir.path().join("token");
    std::fs::write(&token, "secret").unwrap();
    let mut child = tracer_tests::ChildGuard::spawn(
        Command::new(tracer_tests::bin("tracerd"))
            .arg("--socket")
            .arg(&sock)
            .arg("--state-dir")
            .arg(d.dir.path().join("tcp-state"))
            .args([
                "--listen",
                &listen,
                "--auth",
                "token",
                "--insecure-plaintext",
            ])
            .arg("--access")
            .arg(&policy)
            .env("RUST_LOG", "warn"),
    );
    tracer_tests::wait_until(20, "the TCP daemon", || sock.exists());
    let ctl = |args: &[&str]| {
        Command::new(tracer_tests::bin("tracerctl"))
            .args(["--socket", &listen, "--insecure-plaintext", "--token-file"])
            .arg(&token)
            .args(args)
            .output()
            .unwrap()
    };
    let caps = ctl(&["capabilities"]);
    assert!(
        caps.status.success(),
        "{}",
        String::from_utf8_lossy(&caps.stderr)
    );
    assert!(ctl(&["list"]).status.success());
    let line = tracer_tests::one_line_error(&ctl(&[
        "start",
        "--mode=counting",
        "--all",
        "--duration",
        "1s",
    ]));
    assert!(line.contains("client 'dash' may only read"), "{line}");
    let anonymous = Command::new(tracer_tests::bin("tracerctl"))
        .args(["--socket", &listen, "--insecure-plaintext", "list"])
        .output()
        .unwrap();
    let line = tracer_tests::one_line_error(&anonymous);
    assert!(line.contains("wants a bearer token"), "{line}");
    assert!(child.0.try_wait().unwrap().is_none());
}
