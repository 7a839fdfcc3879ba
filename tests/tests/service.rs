//! tracerd as a host service: `deploy/systemd/tracerd.service` is a unit systemd accepts,
//! and tracerd with exactly the unit's capabilities (and root's uid, as the unit runs it)
//! counts, samples and traces; its settings file is read and checked.

use std::{path::Path, process::Command};

use serde_json::Value;
use tracer_tests::{bin, interpreters, root_or_skip, Daemon, DaemonOptions};

const UNIT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/systemd/tracerd.service"
);

const DAEMONSET: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/kubernetes/daemonset.yaml"
);

/// The capabilities the DaemonSet's container adds (after dropping all), as setpriv names
/// them: the `- NAME` items of `capabilities.add`, comments between them skipped.
fn daemonset_caps() -> Vec<String> {
    let yaml = std::fs::read_to_string(DAEMONSET).unwrap();
    let mut lines = yaml.lines().map(str::trim);
    lines
        .by_ref()
        .find(|l| *l == "add:")
        .expect("capabilities.add");
    lines
        .filter(|l| !l.starts_with('#'))
        .map_while(|l| l.strip_prefix("- "))
        .map(str::to_lowercase)
        .collect()
}

/// The capabilities the unit keeps, as setpriv names them (`bpf`, `sys_ptrace`, …).
fn unit_caps() -> Vec<String> {
    let unit = std::fs::read_to_string(UNIT).unwrap();
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("CapabilityBoundingSet");
    line.split_whitespace()
        .map(|c| c.strip_prefix("CAP_").expect("CAP_ name").to_lowercase())
        .collect()
}

#[test]
fn systemd_accepts_the_unit() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        tracer_testkit::skip(format_args!("no systemd-analyze"));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Verified against the binary built here (verify checks that ExecStart's is there).
    let unit = std::fs::read_to_string(UNIT)
        .unwrap()
        .replace("/usr/bin/tracerd", bin("tracerd").to_str().unwrap());
    let path = dir.path().join("tracerd.service");
    std::fs::write(&path, unit).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `CapEff` of a process, as a set of capability numbers.
fn effective(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim();
    u64::from_str_radix(hex, 16).unwrap()
}

#[test]
fn tracerd_works_with_exactly_the_units_capabilities() {
    if !root_or_skip() {
        return;
    }
    works_with_exactly(&unit_caps());
}

/// The Kubernetes DaemonSet's container, as far as capabilities go (root's uid, all
/// dropped, these added).
#[test]
fn tracerd_works_with_exactly_the_daemonsets_capabilities() {
    if !root_or_skip() {
        return;
    }
    let caps = daemonset_caps();
    assert!(caps.len() >= 5 && caps.contains(&"bpf".into()), "{caps:?}");
    works_with_exactly(&caps);
}

/// tracerd run with exactly `caps` counts in-process, samples and traces.
fn works_with_exactly(caps: &[String]) {
    let set: Vec<String> = caps.iter().map(|c| format!("+{c}")).collect();
    let d = Daemon::start_with(DaemonOptions {
        wrapper: vec![
            "setpriv".into(),
            format!("--bounding-set=-all,{}", set.join(",")),
            "--inh-caps=-all".into(),
            "--no-new-privs".into(),
            "--".into(),
        ],
        ..DaemonOptions::default()
    });
    // Exactly those: the numbers capsh gives the names.
    let mut want = 0u64;
    for c in caps {
        let out = Command::new("capsh")
            .arg(format!("--explain=cap_{c}"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let n: u32 = text
            .split(|ch: char| !ch.is_ascii_digit())
            .find(|s| !s.is_empty())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("capsh --explain=cap_{c}: {text}"));
        want |= 1 << n;
    }
    assert_eq!(effective(d.pid()), want, "tracerd's effective capabilities");

    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("app.py");
    std::fs::write(
        &script,
        "import sys, time\ndef f(n):\n    return n\nfor i in range(1000):\n    f(i)\nt = time.time()\nwhile time.time() - t < float(sys.argv[1]):\n    f(0)\n",
    )
    .unwrap();
    let pythons = interpreters();
    // In-process counting of a launched command: a profile function (3.10) and
    // sys.monitoring (3.12).
    for minor in ["3.10", "3.12"] {
        let Some(py) = pythons
            .iter()
            .find(|p| p.file_name().and_then(|n| n.to_str()) == Some(&format!("python{minor}")))
        else {
            tracer_testkit::skip(format_args!("no pyenv CPython {minor}"));
            continue;
        };
        let out = dir.path().join(format!("count{minor}.json"));
        d.ok(&[
            "start",
            "--mode=counting",
            "--python",
            "--format",
            "json",
            "-o",
            out.to_str().unwrap(),
            "--",
            py.to_str().unwrap(),
            script.to_str().unwrap(),
            "0",
        ]);
        let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(
            report["python"]["counted"][0]["way"], "in-process",
            "{report}"
        );
        let f = report["python"]["functions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["qualname"] == "f" && Path::new(f["filename"].as_str().unwrap()) == script)
            .expect("f counted");
        assert_eq!(f["ncalls"], 1000, "{minor}");
    }
    // In-process counting of another user's running process: its files are made in its
    // /tmp as that user (setfsuid, setfsgid), else they would be counted with uprobes.
    if let (Some((uid, gid)), true) = (
        tracer_tests::users::member(),
        Path::new("/usr/bin/python3.11").exists(),
    ) {
        let shared = tempfile::tempdir().unwrap();
        let theirs = shared.path().join("app.py");
        std::fs::copy(&script, &theirs).unwrap();
        let mode = |p: &Path, m: u32| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        mode(shared.path(), 0o755);
        mode(&theirs, 0o644);
        let mut cmd = Command::new("/usr/bin/python3.11");
        cmd.arg(&theirs).arg("3");
        let mut other = tracer_tests::users::as_user(&mut cmd, uid, gid)
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let report: Value = serde_json::from_str(&d.ok(&[
            "start",
            "--mode=counting",
            "--python",
            "--pid",
            &other.id().to_string(),
            "--duration",
            "1s",
            "--wait",
            "--format",
            "json",
        ]))
        .unwrap();
        let counted = &report["python"]["counted"][0];
        assert_eq!(counted["way"], "in-process", "another user's: {counted}");
        let _ = other.kill();
        let _ = other.wait();
    } else {
        tracer_testkit::skip(format_args!("no test user or no /usr/bin/python3.11"));
    }
    // Sampling and tracing (Python calls with the probes) of a running process.
    let py = pythons.first().expect("a CPython");
    let mut busy = Command::new(py).arg(&script).arg("4").spawn().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let pid = busy.id().to_string();
    let folded = d.ok(&[
        "start",
        "--mode=sampling",
        "--pid",
        &pid,
        "--duration",
        "1s",
        "--wait",
        "--format",
        "folded",
    ]);
    assert!(
        folded.lines().any(|l| l.contains("app.py")),
        "no Python frames sampled: {folded}"
    );
    let id = d.ok(&[
        "start",
        "--mode=tracing",
        "--python",
        "--pid",
        &pid,
        "--duration",
        "1s",
    ]);
    let traced = id.trim().to_owned();
    let t0 = std::time::Instant::now();
    while !d
        .run(&["report", &traced, "--format", "json"])
        .status
        .success()
    {
        assert!(
            t0.elapsed().as_secs() < 20,
            "the tracing session did not end"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let report: Value = d.report_json(&traced);
    assert!(
        report["trace"]["python_calls"].as_u64().unwrap_or(0) > 0,
        "{}",
        report["trace"]
    );
    let _ = busy.kill();
    let _ = busy.wait();
}

#[test]
fn settings_come_from_the_file_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tracerd.toml");
    std::fs::write(
        &file,
        "state_dir = \"/var/lib/elsewhere\"\ntrace_ring_mb = 32\nper_probe_uprobes = true\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        Command::new(bin("tracerd"))
            .arg("--config")
            .arg(&file)
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["--check-config", "--trace-ring-mb", "64"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    for line in [
        "state_dir = \"/var/lib/elsewhere\"",
        "trace_ring_mb = 64",
        "per_probe_uprobes = true",
        "socket = \"/run/tracer/tracerd.sock\"",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
    }
    // Bad settings: one line naming the file and the key, exit status 1.
    for (bad, says) in [
        (
            "trace_ring_mb = \"lots\"\n",
            "trace_ring_mb: invalid value 'lots'",
        ),
        ("trace-ring-mb = 4\n", "unknown setting trace-ring-mb"),
        ("group = 7\ngroup = 8\n", ""),
        ("tls_cert = \"/x.pem\"\n", "--listen"),
    ] {
        std::fs::write(&file, bad).unwrap();
        let out = run(&["--check-config"]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{bad}: {err}");
        assert_eq!(err.lines().count(), 1, "{bad}: {err}");
        assert!(err.starts_with("tracerd: "), "{err}");
        assert!(err.contains(says), "{bad}: {err}");
        assert!(err.contains(file.to_str().unwrap()), "{err}");
    }
}

/// The package (`cargo xtask package`; `cargo xtask test` makes it and names it in
/// TRACER_TEST_DEB) installs into an empty root with dpkg, owns every file it puts there,
/// keeps only the settings file after removal, and leaves nothing after a purge, the state
/// directory tracerd filled included.
#[test]
fn the_package_installs_and_leaves_nothing_behind() {
    if !root_or_skip() {
        return;
    }
    let Some(deb) = std::env::var_os("TRACER_TEST_DEB") else {
        tracer_testkit::skip(format_args!(
            "TRACER_TEST_DEB is not set (cargo xtask test makes the package)"
        ));
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let admin = r.join("var/lib/dpkg");
    for d in ["info", "updates"] {
        std::fs::create_dir_all(admin.join(d)).unwrap();
    }
    std::fs::write(admin.join("status"), "").unwrap();
    std::fs::write(admin.join("available"), "").unwrap();
    let dpkg = |args: &[&str]| {
        let out = Command::new("dpkg")
            .arg(format!("--root={}", r.display()))
            // Maintainer scripts run here with DPKG_ROOT set: they leave the host alone.
            .arg("--force-script-chrootless")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "dpkg {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    // adduser is the host's (the chrootless postinst does not run it).
    dpkg(&["--force-depends", "-i", deb.to_str().unwrap()]);
    let files = |r: &Path| {
        let mut all = Vec::new();
        let mut stack = vec![r.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.starts_with(r.join("var/lib/dpkg")) {
                    continue;
                }
                if e.file_type().unwrap().is_dir() {
                    stack.push(p.clone());
                }
                all.push(format!("/{}", p.strip_prefix(r).unwrap().display()));
            }
        }
        all.sort();
        all
    };
    let owned: Vec<String> = dpkg(&["-L", "tracer"]).lines().map(str::to_owned).collect();
    let unowned: Vec<_> = files(r)
        .into_iter()
        .filter(|f| !owned.contains(f) && f != "/var" && f != "/var/lib")
        .collect();
    assert!(unowned.is_empty(), "not the package's: {unowned:?}");
    for f in [
        "/usr/bin/tracerd",
        "/usr/bin/tracerctl",
        "/usr/lib/tracer/libtracer_pycount.so",
        "/usr/lib/tracer/libtracer_pystart.so",
        "/usr/lib/tracer/libtracer_cupti.so",
        "/usr/lib/systemd/system/tracerd.service",
        "/etc/tracer/tracerd.toml",
        "/usr/share/man/man8/tracerd.8.gz",
        "/usr/share/man/man1/tracerctl-start.1.gz",
        "/usr/share/bash-completion/completions/tracerctl",
    ] {
        assert!(owned.iter().any(|o| o == f), "{f} not in the package");
    }
    // The installed tracerd reads the installed settings file.
    let out = Command::new(r.join("usr/bin/tracerd"))
        .arg("--config")
        .arg(r.join("etc/tracer/tracerd.toml"))
        .arg("--check-config")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What tracerd kept, then a removal: the settings file and the state stay.
    std::fs::create_dir_all(r.join("var/lib/tracer")).unwrap();
    std::fs::write(r.join("var/lib/tracer/sessions.redb"), "x").unwrap();
    dpkg(&["-r", "tracer"]);
    assert_eq!(
        files(r),
        [
            "/etc",
            "/etc/tracer",
            "/etc/tracer/tracerd.toml",
            "/var",
            "/var/lib",
            "/var/lib/tracer",
            "/var/lib/tracer/sessions.redb"
        ]
    );
    dpkg(&["-P", "tracer"]);
    assert_eq!(files(r), ["/var", "/var/lib"]);
}
