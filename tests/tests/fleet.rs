//! Fleet: tracerds in their own network namespaces, reached over mutual TLS or bearer
//! tokens; the same session fanned out to all of them and merged; a host lost mid-session;
//! clients held to what the access policy grants them.

use std::{
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::Duration,
};

use tracer_tests::{
    fleet::{http_get, url_encode, Host, Pki},
    one_line_error, root_or_skip,
};

const POLICY: &str = r#"
[[client]]
name = "ops"
cert = "ops.example"
role = "trace"
uid = 0

[[client]]
name = "viewer"
cert = "viewer.example"
role = "read"

[[client]]
name = "confined"
cert = "confined.example"
role = "trace"
uid = 0
cgroups = ["/no/such.slice"]

[[client]]
name = "robot"
# printf secret | sha256sum
token_sha256 = "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
role = "trace"
uid = 0
"#;

struct Fleet {
    dir: tempfile::TempDir,
    pki: Pki,
    hosts: Vec<Host>,
}

impl Fleet {
    /// `n` hosts with mTLS (`--auth mtls`, the default).
    fn mtls(n: usize) -> Self {
        Self::mtls_with(n, |_| Vec::new())
    }

    /// With more tracerd arguments, given the host's address.
    fn mtls_with(n: usize, more: impl Fn(&str) -> Vec<String>) -> Self {
        Self::start(n, |pki, ip| {
            let (cert, key) = pki.issue(ip);
            let mut args = more(ip);
            args.extend([
                "--tls-cert".into(),
                path(&cert),
                "--tls-key".into(),
                path(&key),
                "--client-ca".into(),
                path(&pki.ca),
            ]);
            args
        })
    }

    fn start(n: usize, tls: impl Fn(&Pki, &str) -> Vec<String>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::new(&dir.path().join("pki"), "fleet-test-ca");
        let policy = dir.path().join("access.toml");
        std::fs::write(&policy, POLICY).unwrap();
        let hosts = (0..n)
            .map(|_| {
                Host::start(dir.path(), |ip| {
                    let mut args = tls(&pki, ip);
                    args.extend(["--access".into(), path(&policy)]);
                    args
                })
            })
            .collect();
        Fleet { dir, pki, hosts }
    }

    /// tracerctl as client `who` (a certificate from the fleet's CA).
    fn ctl(&self, who: &str) -> Command {
        let (cert, key) = self.pki.issue(who);
        let mut cmd = Command::new(tracer_tests::bin("tracerctl"));
        cmd.arg("--tls-ca")
            .arg(&self.pki.ca)
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key)
            .stdin(Stdio::null());
        cmd
    }

    fn on(&self, who: &str, host: usize, args: &[&str]) -> Output {
        self.ctl(who)
            .args(["--socket", &format!("tcp://{}", self.hosts[host].addr)])
            .args(args)
            .output()
            .unwrap()
    }

    /// tracerctl as `ops` with every host of the fleet (`--hosts`) and these arguments.
    fn fan_out_ctl(&self, args: &[&str]) -> Command {
        let mut cmd = self.ctl("ops.example");
        cmd.args(["--hosts", &self.all()]).args(args);
        cmd
    }

    fn all(&self) -> String {
        self.hosts
            .iter()
            .map(|h| h.addr.clone())
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "tracerctl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A Python program calling `fib` a known number of times, which it prints.
fn fib_script(dir: &Path) -> PathBuf {
    let script = dir.join("fleet_fib.py");
    std::fs::write(
        &script,
        "calls = 0\n\ndef fib(n):\n    global calls\n    calls += 1\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nfib(16)\nprint(calls)\n",
    )
    .unwrap();
    script
}

/// Runs a fan-out `start` in the background; returns it once every host's session runs.
fn fan_out(mut cmd: Command) -> (std::process::Child, std::thread::JoinHandle<String>) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("session running on") {
                let _ = tx.send(line.clone());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the fan-out start did not report its sessions within 30 s");
    eprintln!("{line}");
    (child, reader)
}

#[test]
fn counting_fans_out_sums_hosts_and_names_the_lost_ones() {
    if !root_or_skip() {
        return;
    }
    let mut fleet = Fleet::mtls(3);
    let script = fib_script(fleet.dir.path());
    // The fourth host has nothing listening.
    let hosts = format!("{},127.0.0.1:1", fleet.all());
    let mut cmd = fleet.ctl("ops.example");
    cmd.args(["--hosts", &hosts]).args([
        "start",
        "--mode=counting",
        "--python",
        "--all",
        "--duration",
        "6s",
        "--format",
        "json",
    ]);
    let (child, stderr) = fan_out(cmd);
    // The third host dies during the session.
    fleet.hosts[2].kill();
    let out = Command::new(tracer_tests::python())
        .arg(&script)
        .output()
        .unwrap();
    assert!(out.status.success());
    let calls: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = stderr.join().unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "partial result expected: {stderr}"
    );
    let merged: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let hosts = merged["hosts"].as_array().unwrap();
    assert_eq!(hosts.len(), 4, "{merged:#}");
    let (h0, h1, h2) = (
        &fleet.hosts[0].addr,
        &fleet.hosts[1].addr,
        &fleet.hosts[2].addr,
    );
    for h in hosts {
        let name = h["host"].as_str().unwrap();
        if name == h0 || name == h1 {
            assert!(h["error"].is_null(), "{h}");
        } else if name == h2 {
            assert!(h["error"].as_str().is_some(), "{h}");
        } else {
            assert!(
                h["error"]
                    .as_str()
                    .unwrap()
                    .contains("cannot reach tracerd at tcp://127.0.0.1:1"),
                "{h}"
            );
        }
    }
    assert!(stderr.contains(&format!("tracerctl: {h2}: ")), "{stderr}");
    // Every host saw the one program: the merged count is the program's, twice over.
    let fib = merged["python"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["qualname"] == "fib" && f["filename"] == path(&script))
        .unwrap_or_else(|| panic!("no fib row: {merged:#}"));
    assert_eq!(fib["ncalls"], 2 * calls, "{fib}");
    assert_eq!(fib["hosts"][h0]["ncalls"], calls, "{fib}");
    assert_eq!(fib["hosts"][h1]["ncalls"], calls, "{fib}");
    assert!(fib["hosts"].get(h2).is_none(), "{fib}");
}

#[test]
fn sampling_fans_out_into_one_pprof_with_a_host_label() {
    if !root_or_skip() {
        return;
    }
    let fleet = Fleet::mtls(2);
    let busy = tracer_tests::ChildGuard::spawn(
        Command::new(tracer_tests::python()).args(["-c", "while True: sum(range(1000))"]),
    );
    let file = fleet.dir.path().join("merged.pb.gz");
    let cmd = fleet.fan_out_ctl(&[
        "start",
        "--mode=sampling",
        "--all",
        "--duration",
        "2s",
        "--format",
        "pprof",
        "-o",
        &path(&file),
    ]);
    let (child, stderr) = fan_out(cmd);
    let out = child.wait_with_output().unwrap();
    let stderr = stderr.join().unwrap();
    assert!(out.status.success(), "{stderr}");
    drop(busy);
    let Ok(go) = Command::new("go").arg("version").output() else {
        tracer_testkit::skip(format_args!(
            "the pprof check: go is not installed (cargo xtask test installs it)"
        ));
        return;
    };
    assert!(go.status.success());
    let tags = Command::new("go")
        .args(["tool", "pprof", "-tags"])
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&tags.stdout);
    assert!(
        tags.status.success(),
        "{}",
        String::from_utf8_lossy(&tags.stderr)
    );
    for h in &fleet.hosts {
        assert!(
            text.contains(&h.addr),
            "no samples labelled host={}:\n{text}",
            h.addr
        );
    }
    // Both hosts sampled the same busy loop: each holds a share of the samples.
    let focused = Command::new("go")
        .args(["tool", "pprof", "-top", "-tagfocus"])
        .arg(format!("host={}", fleet.hosts[0].addr))
        .arg(&file)
        .output()
        .unwrap();
    assert!(focused.status.success());
}

#[test]
fn tracing_fans_out_onto_one_timeline() {
    if !root_or_skip() {
        return;
    }
    let fleet = Fleet::mtls(2);
    let script = fib_script(fleet.dir.path());
    let file = fleet.dir.path().join("merged.json");
    let cmd = fleet.fan_out_ctl(&[
        "start",
        "--mode=tracing",
        "--python",
        "--all",
        "--duration",
        "4s",
        "--format",
        "chrome",
        "-o",
        &path(&file),
    ]);
    let (child, stderr) = fan_out(cmd);
    let out = Command::new(tracer_tests::python())
        .arg(&script)
        .output()
        .unwrap();
    assert!(out.status.success());
    let calls: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let status = child.wait_with_output().unwrap().status;
    let stderr = stderr.join().unwrap();
    assert!(status.success(), "{stderr}");
    let merged: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let events = merged["traceEvents"].as_array().unwrap();
    // Each host traced the one program: its fib calls, under that host's process group.
    for (i, h) in fleet.hosts.iter().enumerate() {
        let lo = (i as u64 + 1) * 10_000_000;
        let fib = events
            .iter()
            .filter(|e| {
                e["ph"] == "X"
                    && e["name"].as_str().is_some_and(|n| n.starts_with("fib"))
                    && e["args"]["file"] == path(&script)
                    && e["pid"]
                        .as_u64()
                        .is_some_and(|p| p > lo && p < lo + 10_000_000)
            })
            .count() as u64;
        assert_eq!(fib, calls, "host {}", h.addr);
        let pid = events
            .iter()
            .find(|e| {
                e["ph"] == "X"
                    && e["args"]["file"] == path(&script)
                    && e["pid"]
                        .as_u64()
                        .is_some_and(|p| p > lo && p < lo + 10_000_000)
            })
            .unwrap()["pid"]
            .clone();
        let named = events.iter().any(|e| {
            e["name"] == "process_name"
                && e["pid"] == pid
                && e["args"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with(&format!("{}: ", h.addr)))
        });
        assert!(named, "no process group named after {}", h.addr);
    }
    // One clock: both hosts' calls of the same run overlap in time (within 50 ms).
    let first = |i: u64| {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["args"]["file"] == path(&script))
            .filter(|e| e["pid"].as_u64().is_some_and(|p| p / 10_000_000 == i))
            .filter_map(|e| e["ts"].as_f64())
            .fold(f64::MAX, f64::min)
    };
    assert!(
        (first(1) - first(2)).abs() < 50_000.0,
        "{} vs {}",
        first(1),
        first(2)
    );
}

#[test]
fn prometheus_scrapes_every_daemon() {
    if !root_or_skip() {
        return;
    }
    if Command::new("prometheus")
        .arg("--version")
        .output()
        .is_err()
    {
        tracer_testkit::skip(format_args!(
            "prometheus is not installed (cargo xtask test installs it)"
        ));
        return;
    }
    let fleet = Fleet::mtls_with(2, |ip| vec!["--metrics".into(), format!("tcp://{ip}:9464")]);
    let script = fib_script(fleet.dir.path());
    let cmd = fleet.fan_out_ctl(&[
        "start",
        "--mode=counting",
        "--python",
        "--all",
        "--export",
        "prometheus",
        "--duration",
        "60s",
    ]);
    let (child, _stderr) = fan_out(cmd);
    let _fan_out = tracer_tests::ChildGuard(child);
    let out = Command::new(tracer_tests::python())
        .arg(&script)
        .output()
        .unwrap();
    assert!(out.status.success());
    let calls: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();

    let targets: Vec<String> = fleet
        .hosts
        .iter()
        .map(|h| format!("'{}:9464'", h.net.addr))
        .collect();
    let config = fleet.dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tracer\n    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        ),
    )
    .unwrap();
    let web = tracer_tests::free_loopback_addr();
    let _prometheus = tracer_tests::ChildGuard::spawn(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                fleet.dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={web}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let query = |q: &str| -> Option<f64> {
        let body = http_get(&web, &format!("/api/v1/query?query={}", url_encode(q))).ok()?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
    };
    tracer_tests::wait_until(60, "Prometheus to scrape both daemons", || {
        query("count(up{job=\"tracer\"} == 1)") == Some(2.0)
    });
    // Each daemon counted the one program; Prometheus sums them.
    let fib = format!(
        "sum(tracer_python_calls_total{{function=\"fib\",file=\"{}\"}})",
        path(&script)
    );
    let mut last = None;
    tracer_tests::wait_until(30, "the fib series on both daemons", || {
        last = query(&fib);
        last == Some(2.0 * calls as f64)
    });
    let per_host = format!(
        "count(tracer_python_calls_total{{function=\"fib\",file=\"{}\"}} == {calls})",
        path(&script)
    );
    assert_eq!(query(&per_host), Some(2.0), "{last:?}");
    assert_eq!(query("sum(tracer_sessions{state=\"running\"})"), Some(2.0));
    let line = one_line_error(&fleet.on(
        "ops.example",
        0,
        &[
            "start",
            "--mode=sampling",
            "--all",
            "--export",
            "prometheus",
            "--duration",
            "1s",
        ],
    ));
    assert!(
        line.contains("--export prometheus is for counting sessions"),
        "{line}"
    );
}

#[test]
fn interrupting_a_fan_out_stops_every_session_and_still_merges() {
    if !root_or_skip() {
        return;
    }
    let fleet = Fleet::mtls(2);
    let mut cmd = fleet.fan_out_ctl(&[
        "start",
        "--mode=counting",
        "--all",
        "--events",
        "task-clock",
        "--duration",
        "10m",
        "--format",
        "json",
    ]);
    // Interrupted while the sessions wait for their aligned start (≈ 0.5 s ahead).
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(250));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let stderr = std::thread::spawn({
        let mut e = child.stderr.take().unwrap();
        move || {
            let mut s = String::new();
            e.read_to_string(&mut s).unwrap();
            s
        }
    });
    let out = child.wait_with_output().unwrap();
    let stderr = stderr.join().unwrap();
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("interrupted: stopping the sessions"),
        "{stderr}"
    );
    let merged: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for h in merged["hosts"].as_array().unwrap() {
        assert_eq!(h["state"], "finished (stopped)", "{h}");
    }
    assert!(
        merged["counters"][0]["value"].as_u64().unwrap() > 0,
        "{merged:#}"
    );
}

#[test]
fn clients_get_what_their_grant_says_and_nothing_more() {
    if !root_or_skip() {
        return;
    }
    let fleet = Fleet::mtls(1);
    // A certificate the daemon's CA did not sign.
    let rogue = Pki::new(&fleet.dir.path().join("rogue"), "rogue-ca");
    // `list` with this client certificate, or none.
    let list = |cert: Option<(PathBuf, PathBuf)>| {
        let mut cmd = Command::new(tracer_tests::bin("tracerctl"));
        cmd.arg("--tls-ca").arg(&fleet.pki.ca);
        if let Some((cert, key)) = cert {
            cmd.arg("--tls-cert").arg(cert).arg("--tls-key").arg(key);
        }
        cmd.args([
            "--socket",
            &format!("tcp://{}", fleet.hosts[0].addr),
            "list",
        ])
        .output()
        .unwrap()
    };
    // TLS 1.3 sends the refusal after the handshake: the client sees the alert or a closed
    // connection, whichever comes first.
    let line = one_line_error(&list(Some(rogue.issue("ops.example"))));
    assert!(line.starts_with("tracerctl: "), "{line}");
    // No client certificate at all.
    let line = one_line_error(&list(None));
    assert!(line.starts_with("tracerctl: "), "{line}");
    // Signed by the right CA but unknown to the policy.
    let line = one_line_error(&fleet.on("stranger.example", 0, &["list"]));
    assert!(
        line.contains(
            "permission denied: client certificate 'stranger.example' is not in the access policy"
        ),
        "{line}"
    );
    // The reader lists, reads reports, and neither starts nor stops.
    ok(fleet.on("viewer.example", 0, &["list"]));
    let line = one_line_error(&fleet.on(
        "viewer.example",
        0,
        &["start", "--mode=counting", "--all", "--duration", "1s"],
    ));
    assert!(line.contains("client 'viewer' may only read"), "{line}");
    let id = ok(fleet.on(
        "ops.example",
        0,
        &[
            "start",
            "--mode=counting",
            "--all",
            "--events",
            "task-clock",
            "--duration",
            "30s",
        ],
    ));
    let id = id.trim();
    let status = ok(fleet.on("viewer.example", 0, &["status", id]));
    assert!(status.contains("by:        client 'ops'"), "{status}");
    let line = one_line_error(&fleet.on("viewer.example", 0, &["stop", id]));
    assert!(line.contains("may only read"), "{line}");
    ok(fleet.on("ops.example", 0, &["stop", id]));
    let report = ok(fleet.on("viewer.example", 0, &["report", id, "--format", "json"]));
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert!(tracer_tests::counter(&report, "task-clock").unwrap() > 0);
    // Confined to cgroups: not this process's, and never the whole machine.
    let me = std::process::id().to_string();
    let line = one_line_error(&fleet.on(
        "confined.example",
        0,
        &["start", "--mode=counting", "--pid", &me, "--duration", "1s"],
    ));
    assert!(
        line.contains("client 'confined' may not trace pid") && line.contains("/no/such.slice"),
        "{line}"
    );
    let line = one_line_error(&fleet.on(
        "confined.example",
        0,
        &["start", "--mode=counting", "--all", "--duration", "1s"],
    ));
    assert!(line.contains("may not start system-wide"), "{line}");
}

#[test]
fn bearer_tokens_over_server_tls() {
    if !root_or_skip() {
        return;
    }
    let fleet = Fleet::start(1, |pki, ip| {
        let (cert, key) = pki.issue(ip);
        vec![
            "--auth".into(),
            "token".into(),
            "--tls-cert".into(),
            path(&cert),
            "--tls-key".into(),
            path(&key),
        ]
    });
    let token = |text: &str| {
        let f = fleet.dir.path().join(format!("token-{}", text.len()));
        std::fs::write(&f, format!("{text}\n")).unwrap();
        f
    };
    let ctl = |args: &[&str]| {
        Command::new(tracer_tests::bin("tracerctl"))
            .arg("--tls-ca")
            .arg(&fleet.pki.ca)
            .args(["--socket", &format!("tcp://{}", fleet.hosts[0].addr)])
            .args(args)
            .output()
            .unwrap()
    };
    let good = token("secret");
    let out = ok(ctl(&[
        "--token-file",
        &path(&good),
        "start",
        "--mode=counting",
        "--all",
        "--events",
        "task-clock",
        "--duration",
        "500ms",
        "--wait",
    ]));
    assert!(out.contains("task-clock"), "{out}");
    let bad = token("not the secret");
    let line = one_line_error(&ctl(&["--token-file", &path(&bad), "list"]));
    assert!(line.contains("not authenticated: unknown token"), "{line}");
    let line = one_line_error(&ctl(&["list"]));
    assert!(line.contains("wants a bearer token"), "{line}");
}

#[test]
fn unsafe_listeners_are_refused() {
    if !root_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("access.toml");
    std::fs::write(&policy, POLICY).unwrap();
    let tracerd = |args: &[&str]| {
        let out = Command::new(tracer_tests::bin("tracerd"))
            .arg("--socket")
            .arg(dir.path().join("s.sock"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).trim().to_owned()
    };
    let err = tracerd(&["--listen", "tcp://0.0.0.0:7999", "--access", &path(&policy)]);
    assert!(
        err.contains("serves TLS only: give --tls-cert and --tls-key"),
        "{err}"
    );
    let err = tracerd(&[
        "--listen",
        "tcp://0.0.0.0:7999",
        "--access",
        &path(&policy),
        "--auth",
        "token",
        "--insecure-plaintext",
    ]);
    assert!(err.contains("only on a loopback address"), "{err}");
    let err = tracerd(&["--listen", "tcp://127.0.0.1:7999"]);
    assert!(err.contains("--listen needs --access FILE"), "{err}");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[[client]]\nname = 'x'\ncert = 'x'\nrole = 'trace'\n").unwrap();
    let err = tracerd(&[
        "--listen",
        "tcp://127.0.0.1:7999",
        "--access",
        &path(&bad),
        "--auth",
        "token",
        "--insecure-plaintext",
    ]);
    assert!(
        err.contains("client 'x': a trace client needs the uid"),
        "{err}"
    );
    // Which TLS options go together is checked before the files are used.
    let pem = |name: &str| {
        let f = dir.path().join(name);
        std::fs::write(&f, "not checked yet").unwrap();
        path(&f)
    };
    let (cert, key, ca) = (pem("cert.pem"), pem("key.pem"), pem("ca.pem"));
    let tls = |more: &[&str]| {
        let mut args = vec![
            "--listen",
            "tcp://127.0.0.1:7999",
            "--access",
            policy.to_str().unwrap(),
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ];
        args.extend(more);
        tracerd(&args)
    };
    let err = tls(&[]);
    assert!(
        err.contains("--auth mtls (the default) needs --client-ca"),
        "{err}"
    );
    let err = tls(&["--auth", "token", "--client-ca", &ca]);
    assert!(err.contains("--client-ca is for --auth mtls"), "{err}");
    let err = tracerd(&[
        "--listen",
        "tcp://127.0.0.1:7999",
        "--access",
        &path(&policy),
        "--insecure-plaintext",
    ]);
    assert!(err.contains("it goes with --auth token only"), "{err}");
    let certs_only = dir.path().join("certs_only.toml");
    std::fs::write(
        &certs_only,
        "[[client]]\nname = 'x'\ncert = 'x'\nrole = 'read'\n",
    )
    .unwrap();
    let err = tracerd(&[
        "--listen",
        "tcp://127.0.0.1:7999",
        "--access",
        &path(&certs_only),
        "--auth",
        "token",
        "--insecure-plaintext",
    ]);
    assert!(err.contains("names no client by token_sha256"), "{err}");
    let err = tracerd(&["--metrics", "localhost:9464"]);
    assert!(
        err.contains("--metrics wants tcp://HOST:PORT, got 'localhost:9464'"),
        "{err}"
    );
}

#[test]
fn fan_outs_tracerctl_cannot_do_are_refused_before_any_host_is_asked() {
    let ctl = |args: &[&str]| {
        tracer_tests::one_line_error(
            &Command::new(tracer_tests::bin("tracerctl"))
                .args(args)
                .output()
                .unwrap(),
        )
    };
    let start = |more: &[&str]| {
        let mut args = vec!["--hosts", "10.213.255.2:7070", "start", "--all"];
        args.extend(more);
        ctl(&args)
    };
    let line = start(&["--mode=counting"]);
    assert!(line.contains("with --hosts, give --duration"), "{line}");
    let line = start(&["--mode=sampling", "--duration", "1s"]);
    assert!(
        line.contains("sampling reports are merged as pprof"),
        "{line}"
    );
    let line = start(&["--mode=tracing", "--duration", "1s", "--format", "perfetto"]);
    assert!(
        line.contains("tracing reports are merged as chrome"),
        "{line}"
    );
    let line = start(&["--mode=counting", "--duration", "1s", "--format", "pstats"]);
    assert!(
        line.contains("counting reports are merged as table or json"),
        "{line}"
    );
    let line = ctl(&[
        "--hosts",
        "10.213.255.2:7070",
        "start",
        "--mode=counting",
        "--duration",
        "1s",
        "--",
        "true",
    ]);
    assert!(
        line.contains("a command cannot be launched on other hosts"),
        "{line}"
    );
    let line = ctl(&["--hosts", "nohostport", "list"]);
    assert!(line.contains("host 'nohostport' needs a port"), "{line}");
    let line = ctl(&["--hosts", "10.213.255.2:7070", "status", "x"]);
    assert!(
        line.contains("start, list and capabilities run on every host"),
        "{line}"
    );
}

/// `n` TCP connections to `addr` that the daemon holds open. The connection of a request
/// just answered may still count for a moment after its client closed it: one refused
/// meanwhile (closed by the daemon) is opened again.
fn held_connections(addr: &str, n: usize) -> Vec<std::net::TcpStream> {
    let open = |s: &std::net::TcpStream| {
        s.set_nonblocking(true).unwrap();
        let r = std::io::Read::read(&mut &*s, &mut [0u8; 1]);
        s.set_nonblocking(false).unwrap();
        matches!(r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    };
    let mut held = Vec::new();
    for _ in 0..50 {
        while held.len() < n {
            held.push(std::net::TcpStream::connect(addr).unwrap());
        }
        // Margin for a refusal to arrive, not a measure.
        std::thread::sleep(std::time::Duration::from_millis(200));
        held.retain(open);
        if held.len() == n {
            return held;
        }
    }
    panic!("the daemon did not hold {n} connections from one address");
}

/// TCP connections are capped per client address (and overall): one that would pass a cap is
/// closed before its TLS handshake, so a host that opens connections and never speaks cannot
/// take every descriptor; once they close, the address is served again.
#[test]
fn tcp_connections_are_capped_per_address() {
    if !root_or_skip() {
        return;
    }
    let fleet = Fleet::mtls_with(1, |_| vec!["--max-connections-per-user".into(), "3".into()]);
    ok(fleet.on("ops.example", 0, &["list"]));
    let idle = held_connections(&fleet.hosts[0].addr, 3);
    // Past the cap: closed at once, unanswered.
    let mut extra = std::net::TcpStream::connect(&fleet.hosts[0].addr).unwrap();
    extra
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut byte = [0u8; 1];
    match std::io::Read::read(&mut extra, &mut byte) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("a connection past the cap was kept: {other:?}"),
    }
    let refused = fleet.on("ops.example", 0, &["list"]);
    assert!(!refused.status.success());
    drop(idle);
    tracer_tests::wait_until(10, "the address served again", || {
        fleet.on("ops.example", 0, &["list"]).status.success()
    });
}

#[test]
fn idle_tcp_connections_are_closed() {
    if !root_or_skip() {
        return;
    }
    let fleet = Fleet::mtls_with(1, |_| vec!["--idle-timeout".into(), "2".into()]);
    // Connected, and silent: no TLS handshake, no request.
    let mut idle = std::net::TcpStream::connect(&fleet.hosts[0].addr).unwrap();
    idle.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let started = std::time::Instant::now();
    let mut byte = [0u8; 1];
    match std::io::Read::read(&mut idle, &mut byte) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("an idle connection was kept: {other:?}"),
    }
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(1),
        "closed before it was idle for long: {:?}",
        started.elapsed()
    );
    // Requests still go through: a client's connection is busy while it waits for them.
    ok(fleet.on("ops.example", 0, &["list"]));
}
