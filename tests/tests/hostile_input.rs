//! Hostile input on tracerd's outer surfaces. Over TCP: messages too large, requests whose
//! fields go on for megabytes, callers who are nobody, connections that never finish a
//! handshake or never authenticate, bytes that are not HTTP/2. Each is answered with the right
//! status, at once, or closed, while tracerd goes on serving everyone else. And a settings
//! file that is not what it should be: tracerd stops at its start with one line, at once.

use std::{
    io::{Read, Write},
    net::TcpStream,
    os::unix::fs::PermissionsExt,
    path::Path,
    process::{Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde_json::Value;
use tracer_tests::{fleet::Pki, root_or_skip, Daemon, DaemonOptions};

/// A trace client as uid 0, by the token "secret".
const POLICY: &str = "[[client]]\nname = 'robot'\n\
    token_sha256 = '2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b'\n\
    role = 'trace'\nuid = 0\n";

/// A tracerd serving TCP on loopback with bearer tokens (plaintext unless `tls` args).
struct Tcp {
    d: Daemon,
    addr: String,
    files: tempfile::TempDir,
    tls_ca: Option<std::path::PathBuf>,
}

impl Tcp {
    fn start(extra: &[&str], tls: bool) -> Self {
        let files = tempfile::tempdir().unwrap();
        let policy = files.path().join("access.toml");
        std::fs::write(&policy, POLICY).unwrap();
        std::fs::write(files.path().join("token"), "secret\n").unwrap();
        let addr = tracer_tests::free_loopback_addr();
        let mut args: Vec<String> = [
            "--listen",
            &format!("tcp://{addr}"),
            "--auth",
            "token",
            "--access",
            policy.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec();
        let mut tls_ca = None;
        if tls {
            let pki = Pki::new(&files.path().join("pki"), "hostile-test-ca");
            let (cert, key) = pki.issue("127.0.0.1");
            for (flag, file) in [("--tls-cert", &cert), ("--tls-key", &key)] {
                args.extend([flag.to_owned(), file.to_str().unwrap().to_owned()]);
            }
            tls_ca = Some(pki.ca.clone());
        } else {
            args.push("--insecure-plaintext".into());
        }
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let d = Daemon::start_with(DaemonOptions {
            args,
            ..DaemonOptions::default()
        });
        tracer_tests::wait_until(20, "tracerd's TCP listener", || {
            TcpStream::connect(&addr).is_ok()
        });
        Tcp {
            d,
            addr,
            files,
            tls_ca,
        }
    }

    /// tracerctl over TCP with the token.
    fn ctl(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(tracer_tests::bin("tracerctl"));
        cmd.args(["--socket", &format!("tcp://{}", self.addr)]);
        match &self.tls_ca {
            Some(ca) => cmd.arg("--tls-ca").arg(ca),
            None => cmd.arg("--insecure-plaintext"),
        };
        cmd.arg("--token-file")
            .arg(self.files.path().join("token"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// `tracerctl list` answers on the Unix socket and over TCP.
    fn serving(&self) {
        let out = self.d.run(&["list"]);
        assert!(
            out.status.success(),
            "Unix socket: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = self.ctl(&["list"]);
        assert!(
            out.status.success(),
            "TCP: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Sends hand-made protobuf (no generated code: the bytes are what a hostile client chooses)
/// with grpcio, and prints each case's [status code, message, seconds].
const CLIENT: &str = r#"
import grpc, json, sys, threading, time

addr = sys.argv[1]
def varint(n):
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if not n:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)
def ld(num, b):
    return varint(num << 3 | 2) + varint(len(b)) + b
def vi(num, n):
    return varint(num << 3) + varint(n)

channel = grpc.insecure_channel(addr)
token = [("authorization", "Bearer secret")]
def call(method, req, md=token, service="tracer.v1.Tracer", stream=None):
    t0 = time.monotonic()
    try:
        if stream is None:
            rpc = channel.unary_unary(f"/{service}/{method}", request_serializer=None, response_deserializer=None)
            rpc(req, metadata=md, timeout=15)
        else:
            rpc = channel.stream_unary(f"/{service}/{method}", request_serializer=None, response_deserializer=None)
            rpc(stream, metadata=md, timeout=15)
        code, msg = "OK", ""
    except grpc.RpcError as e:
        code, msg = e.code().name, e.details() or ""
    return [code, msg[:300], round(time.monotonic() - t0, 3)]

counting_pid_1 = vi(1, 1) + ld(2, vi(1, 1))
out = {}
out["list"] = call("ListSessions", b"")
out["health"] = call("Check", b"", service="grpc.health.v1.Health")
out["oversized"] = call("StartSession", counting_pid_1 + ld(4, ld(3, b"x" * (5 << 20))))
out["million_uprobes"] = call("StartSession", counting_pid_1 + ld(4, ld(3, b"a") * 1_000_000))
out["giant_push_url"] = call("StartSession", vi(1, 2) + ld(2, vi(1, 1)) + ld(5, ld(2, b"http://" + b"h" * (3 << 20))))
out["million_pids"] = call("GetReport", ld(1, b"x") + ld(5, b"".join(varint(i) for i in range(1, 1_000_001))))
out["anonymous_start"] = call("StartSession", counting_pid_1 + ld(4, ld(3, b"a") * 1_000_000), md=None)
out["anonymous_health"] = call("Check", b"", md=None, service="grpc.health.v1.Health")
out["wrong_token"] = call("ListSessions", b"", md=[("authorization", "Bearer not the secret")])
# Headers, then a body that never comes: nothing to wait for from a caller who is nobody.
never = threading.Event()
def unfinished():
    never.wait(30)
    return
    yield
out["anonymous_unfinished_body"] = call("ListSessions", None, md=None, stream=unfinished())
never.set()
print(json.dumps(out))
"#;

/// Requests too large, with fields past their bounds, or from nobody: each answered with its
/// code at once, before anything is looked up or started; tracerd serves on.
#[test]
fn oversized_and_anonymous_requests_are_refused_with_their_codes() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = tracer_tests::grpc_python() else {
        tracer_testkit::skip(format_args!(
            "no Python with grpcio (run via `cargo xtask test`)"
        ));
        return;
    };
    let t = Tcp::start(&[], false);
    let out = Command::new(py)
        .args(["-c", CLIENT, &t.addr])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let case = |name: &str, code: &str, says: &str| {
        let c = &v[name];
        assert_eq!(c[0], code, "{name}: {c}");
        assert!(
            c[1].as_str().unwrap().contains(says),
            "{name}: {c} should say '{says}'"
        );
        // At once: none of them waits for anything (a body that never comes included).
        assert!(c[2].as_f64().unwrap() < 5.0, "{name}: {c}");
    };
    case("list", "OK", "");
    case("health", "OK", "");
    case(
        "oversized",
        "RESOURCE_EXHAUSTED",
        "message length too large",
    );
    case(
        "million_uprobes",
        "INVALID_ARGUMENT",
        "1000000 --uprobe specs; at most 16384 a request",
    );
    case(
        "giant_push_url",
        "INVALID_ARGUMENT",
        "the push URL is 3145735 bytes; at most 4096",
    );
    case(
        "million_pids",
        "INVALID_ARGUMENT",
        "1000000 pids; at most 4096 a request",
    );
    case("anonymous_start", "UNAUTHENTICATED", "wants a bearer token");
    case(
        "anonymous_health",
        "UNAUTHENTICATED",
        "wants a bearer token",
    );
    case("wrong_token", "UNAUTHENTICATED", "unknown token");
    case(
        "anonymous_unfinished_body",
        "UNAUTHENTICATED",
        "wants a bearer token",
    );
    t.serving();
    let sessions = t.d.ok(&["list"]);
    assert!(!sessions.contains("running"), "nothing started: {sessions}");
}

/// An HTTP/2 frame.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads one frame: (type, flags, payload); None at the end of the connection.
fn read_frame(s: &mut TcpStream) -> Option<(u8, u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head).ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).ok()?;
    Some((head[3], head[4], payload))
}

/// An HPACK header block for a gRPC call of `path`, every field a literal (no Huffman, no
/// table): what a client that writes its own frames sends.
fn grpc_headers(path: &str, token: Option<&str>) -> Vec<u8> {
    fn int(b: &mut Vec<u8>, prefix: u8, first: u8, mut n: usize) {
        let max = (1usize << prefix) - 1;
        if n < max {
            b.push(first | n as u8);
            return;
        }
        b.push(first | max as u8);
        n -= max;
        while n >= 128 {
            b.push((n % 128) as u8 | 0x80);
            n /= 128;
        }
        b.push(n as u8);
    }
    fn string(b: &mut Vec<u8>, s: &str) {
        int(b, 7, 0, s.len());
        b.extend(s.as_bytes());
    }
    // Literal without indexing, its name from the static table.
    let indexed_name = |b: &mut Vec<u8>, index: usize, value: &str| {
        int(b, 4, 0, index);
        string(b, value);
    };
    let mut b = vec![0x83, 0x86]; // :method POST, :scheme http
    indexed_name(&mut b, 4, path);
    indexed_name(&mut b, 1, "localhost");
    indexed_name(&mut b, 31, "application/grpc");
    b.push(0);
    string(&mut b, "te");
    string(&mut b, "trailers");
    if let Some(t) = token {
        indexed_name(&mut b, 23, &format!("Bearer {t}"));
    }
    b
}

/// A raw HTTP/2 connection that sends a health check every 300 ms (with the token or
/// without) and notes when the daemon closes it.
struct Pinger {
    closed: Arc<Mutex<Option<Instant>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Pinger {
    fn start(addr: &str, token: Option<&'static str>) -> Self {
        let s = TcpStream::connect(addr).unwrap();
        let writer = Arc::new(Mutex::new(s.try_clone().unwrap()));
        writer
            .lock()
            .unwrap()
            .write_all(&[PREFACE, &frame(4, 0, 0, &[])].concat())
            .unwrap();
        let closed = Arc::new(Mutex::new(None));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (mut reader, w, c) = (s, writer.clone(), closed.clone());
        std::thread::spawn(move || {
            while let Some((kind, flags, _)) = read_frame(&mut reader) {
                // The server's SETTINGS, acknowledged.
                if kind == 4 && flags & 1 == 0 {
                    let _ = w.lock().unwrap().write_all(&frame(4, 1, 0, &[]));
                }
            }
            *c.lock().unwrap() = Some(Instant::now());
        });
        let (w, st) = (writer, stop.clone());
        std::thread::spawn(move || {
            let mut id = 1u32;
            while !st.load(std::sync::atomic::Ordering::SeqCst) {
                let headers = grpc_headers("/grpc.health.v1.Health/Check", token);
                let call = [frame(1, 4, id, &headers), frame(0, 1, id, &[0; 5])].concat();
                if w.lock().unwrap().write_all(&call).is_err() {
                    return;
                }
                id += 2;
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        Pinger { closed, stop }
    }

    fn closed(&self) -> Option<Instant> {
        *self.closed.lock().unwrap()
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether the daemon has closed `s` (an end or a reset); false if it is still open.
fn closed_by_daemon(s: &mut TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    let closed = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
            Err(_) => break true,
        }
    };
    s.set_nonblocking(false).unwrap();
    closed
}

/// HTTP/2 as tracerd speaks it on TCP: a cap on each connection's streams (tonic sets
/// none, hyper's own included) and on request headers, said in its first SETTINGS.
#[test]
fn http2_settings_bound_each_connection() {
    if !root_or_skip() {
        return;
    }
    let t = Tcp::start(&[], false);
    let mut s = TcpStream::connect(&t.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&[PREFACE, &frame(4, 0, 0, &[])].concat())
        .unwrap();
    let settings = std::iter::from_fn(|| read_frame(&mut s))
        .find(|(kind, flags, _)| *kind == 4 && flags & 1 == 0)
        .expect("the server's SETTINGS")
        .2;
    let value = |id: u16| {
        settings
            .chunks(6)
            .find(|p| u16::from_be_bytes([p[0], p[1]]) == id)
            .map(|p| u32::from_be_bytes([p[2], p[3], p[4], p[5]]))
    };
    assert_eq!(value(3), Some(100), "SETTINGS_MAX_CONCURRENT_STREAMS");
    assert_eq!(value(6), Some(16 << 10), "SETTINGS_MAX_HEADER_LIST_SIZE");
    t.serving();
}

/// Connections that never become a caller: silent ones, ones that send what is not
/// HTTP/2, and one that keeps sending requests nobody authenticated (each refused at once,
/// but each a request in flight for the idle timer). All are closed by the authentication
/// deadline (here the idle limit, 3 s), while an authenticated client's connection stays
/// and tracerctl is served meanwhile.
#[test]
fn connections_that_never_authenticate_are_closed() {
    if !root_or_skip() {
        return;
    }
    let metrics = tracer_tests::free_loopback_addr();
    let t = Tcp::start(
        &[
            "--idle-timeout",
            "3",
            "--metrics",
            &format!("tcp://{metrics}"),
        ],
        false,
    );
    let started = Instant::now();
    let mut silent: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(&t.addr).unwrap())
        .collect();
    let mut garbage: Vec<TcpStream> = [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &[0xffu8; 64][..],
        &[PREFACE, &[0xff; 32][..]].concat()[..],
    ]
    .iter()
    .map(|bytes| {
        let mut s = TcpStream::connect(&t.addr).unwrap();
        s.write_all(bytes).unwrap();
        s
    })
    .collect();
    let anonymous = Pinger::start(&t.addr, None);
    let known = Pinger::start(&t.addr, Some("secret"));
    // Served meanwhile, on both sockets.
    t.serving();
    tracer_tests::wait_until(3, "garbage closed", || {
        garbage.iter_mut().all(closed_by_daemon)
    });
    tracer_tests::wait_until(8, "the anonymous requester closed", || {
        anonymous.closed().is_some()
    });
    let after = anonymous.closed().unwrap() - started;
    assert!(
        after >= Duration::from_millis(2500),
        "closed before its deadline: {after:?}"
    );
    tracer_tests::wait_until(3, "silent connections closed", || {
        silent.iter_mut().all(closed_by_daemon)
    });
    // Well past the deadline: the authenticated connection is still open.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        known.closed(),
        None,
        "an authenticated connection was closed"
    );
    t.serving();
    // Counted where an operator looks: the silent connections and the anonymous requests.
    let text = tracer_tests::fleet::http_get(&metrics, "/metrics").unwrap();
    let total = |what: &str| -> u64 {
        let series = format!("tracer_refused_total{{what=\"{what}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
    };
    assert!(total("tcp_unauthenticated_connection") >= 20, "{text}");
    assert!(total("tcp_request") >= 1, "{text}");
}

/// A TLS handshake that never ends (a ClientHello trickled a byte at a time) holds its
/// connection 10 s at most, not the 300 s of the idle limit; others are served meanwhile.
#[test]
fn tls_handshakes_that_never_end_are_closed() {
    if !root_or_skip() {
        return;
    }
    let t = Tcp::start(&[], true);
    let mut trickle = TcpStream::connect(&t.addr).unwrap();
    let started = Instant::now();
    // A handshake record announcing 512 bytes, then one byte every 200 ms.
    trickle.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).unwrap();
    t.serving();
    let closed = loop {
        if trickle.write_all(&[0x01]).is_err() || closed_by_daemon(&mut trickle) {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(14),
            "a handshake that never ends was kept"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        closed >= Duration::from_secs(9),
        "closed before the deadline: {closed:?}"
    );
    t.serving();
}

/// Runs tracerd with the settings file `file`; it must stop within 5 s, with status 1 and
/// one line saying why, having made neither its socket nor its state directory.
fn refused_settings(file: &Path, says: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (socket, state) = (dir.path().join("s.sock"), dir.path().join("state"));
    let mut child = Command::new(tracer_tests::bin("tracerd"))
        .arg("--config")
        .arg(file)
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(&state)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "tracerd with {} ({says}) did not stop within 5 s",
                file.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{says}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{says}: {err}");
    assert!(err.starts_with("tracerd: ") && err.contains(says), "{err}");
    assert!(err.len() < 1024, "{says}: {} bytes", err.len());
    assert!(
        !socket.exists() && !state.exists(),
        "{says}: tracerd went on"
    );
}

/// Settings files that are not root's plain settings: tracerd stops at once with one line
/// naming the file, the key and the bound; it never waits on a FIFO, reads /dev/zero or a
/// huge file, nor takes orders from a file another user may change.
#[test]
fn a_hostile_settings_file_stops_tracerd_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &[u8]| {
        let f = dir.path().join(name);
        std::fs::write(&f, text).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        f
    };
    let fifo = dir.path().join("fifo.toml");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    refused_settings(&fifo, "not a regular file (a FIFO)");
    refused_settings(
        Path::new("/dev/zero"),
        "/dev/zero: not a regular file (a character device)",
    );
    let huge = file("huge.toml", &vec![b'#'; 4 << 20]);
    refused_settings(&huge, "larger than 1024 KiB");
    let open = file("open.toml", b"trace_ring_mb = 32\n");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
    refused_settings(
        &open,
        "writable by its group or others, mode 666 (chmod go-w)",
    );
    if nix::unistd::geteuid().is_root() {
        let theirs = file("theirs.toml", b"trace_ring_mb = 32\n");
        nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
        refused_settings(&theirs, "owned by uid 65534 (chown root)");
    }
    let man = dir.path().join("man");
    std::fs::create_dir(&man).unwrap();
    let long = "x".repeat(5000);
    for (text, says) in [
        (
            "trace_ring_mb = -4\n".to_owned(),
            "trace_ring_mb: wants a power of two from 1 to 1024, got -4",
        ),
        (
            "max_connections = 9223372036854775807\n".to_owned(),
            "max_connections: wants 2 to 1000000, got 9223372036854775807",
        ),
        (
            "idle_timeout = 0\n".to_owned(),
            "idle_timeout: wants 1 to 86400 seconds, got 0",
        ),
        (
            format!("socket = \"{long}\"\n"),
            "socket: 5000 bytes; at most 4096",
        ),
        (
            "group = \"a\\u0000b\"\n".to_owned(),
            "group: holds a NUL character",
        ),
        (
            "trace_ring_mb = [1]\n".to_owned(),
            "trace_ring_mb must be a string or a number",
        ),
        (
            "no_such_key = 1\n".to_owned(),
            "unknown setting no_such_key",
        ),
        ("group = \"a\"\ngroup = \"b\"\n".to_owned(), "duplicate key"),
        (
            format!("generate_man = \"{}\"\n", man.display()),
            "unknown setting generate_man",
        ),
        (
            format!("socket = {}{}\n", "[".repeat(200_000), "]".repeat(200_000)),
            "recursion",
        ),
    ] {
        refused_settings(&file("bad.toml", text.as_bytes()), says);
    }
    assert!(
        std::fs::read_dir(&man).unwrap().next().is_none(),
        "a man page was written"
    );
}
