//! The fleet tests' hosts: several tracerds on this machine, each in its own network
//! namespace behind a veth pair, with its own certificate from a test CA.

use std::{
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// A test certificate authority writing PEM files into a directory.
pub struct Pki {
    pub dir: PathBuf,
    /// The CA's certificate file.
    pub ca: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    pub fn new(dir: &Path, name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        std::fs::create_dir_all(dir).unwrap();
        let path = dir.join(format!("{name}.pem"));
        std::fs::write(&path, ca.pem()).unwrap();
        Pki {
            dir: dir.to_owned(),
            ca: path,
            issuer: ca,
        }
    }

    /// A certificate for `name` (its CN; also a DNS or IP SAN), signed by this CA:
    /// (certificate, key) files.
    pub fn issue(&self, name: &str) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (c, k) = (
            self.dir.join(format!("{name}.cert.pem")),
            self.dir.join(format!("{name}.key.pem")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }
}

static NEXT_SUBNET: AtomicU32 = AtomicU32::new(0);

/// A network namespace reached from here through a veth pair: `addr` is its side.
pub struct Netns {
    pub name: String,
    veth: String,
    pub addr: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Netns {
    pub fn create() -> Self {
        let n = NEXT_SUBNET.fetch_add(1, Ordering::Relaxed);
        let tag = std::process::id() % 10_000;
        let name = format!("tracer-test-{tag}-{n}");
        let veth = format!("trv{tag}x{n}");
        let peer = format!("trp{tag}x{n}");
        // A leftover of a killed run would hold the names.
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        let _ = Command::new("ip").args(["link", "del", &veth]).output();
        let (a, b) = (n / 64, (n % 64) * 4);
        let here = format!("10.213.{a}.{}", b + 1);
        let there = format!("10.213.{a}.{}", b + 2);
        ip(&["netns", "add", &name]);
        ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer]);
        ip(&["link", "set", &peer, "netns", &name]);
        ip(&["addr", "add", &format!("{here}/30"), "dev", &veth]);
        ip(&["link", "set", &veth, "up"]);
        ip(&[
            "-n",
            &name,
            "addr",
            "add",
            &format!("{there}/30"),
            "dev",
            &peer,
        ]);
        ip(&["-n", &name, "link", "set", &peer, "up"]);
        ip(&["-n", &name, "link", "set", "lo", "up"]);
        Netns {
            name,
            veth,
            addr: there,
        }
    }

    /// Makes `cmd` run in this namespace (its network only: files and processes are shared).
    pub fn enter(&self, cmd: &mut Command) {
        let path = format!("/run/netns/{}", self.name);
        // SAFETY: only setns between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let f = std::fs::File::open(&path)?;
                nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
            });
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth])
            .output();
    }
}

/// A tracerd serving TLS on port 7070 inside its own network namespace.
pub struct Host {
    pub net: Netns,
    pub addr: String,
    pub dir: PathBuf,
    child: Option<Child>,
}

impl Host {
    /// `args(ip)` gives the arguments after the socket, state and listen ones.
    pub fn start(dir: &Path, args: impl FnOnce(&str) -> Vec<String>) -> Self {
        let net = Netns::create();
        let args = args(&net.addr);
        let addr = format!("{}:7070", net.addr);
        let dir = dir.join(&net.name);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("tracerd.sock");
        let mut cmd = Command::new(crate::bin("tracerd"));
        cmd.arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--listen", &format!("tcp://{addr}")])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null());
        net.enter(&mut cmd);
        let mut child = cmd.spawn().expect("starting tracerd");
        crate::wait_until(20, "tracerd's socket", || {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("tracerd exited before listening: {status}");
            }
            socket.exists()
        });
        // The TCP listener is bound after the socket: a test that connects at once was
        // refused now and then.
        crate::wait_until(20, "tracerd's TCP listener", || {
            std::net::TcpStream::connect(&addr).is_ok()
        });
        Host {
            net,
            addr,
            dir,
            child: Some(child),
        }
    }

    /// SIGKILL: the host goes away without a word.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

/// A GET over plain HTTP/1.1 (Prometheus' API, tracerd's /metrics): the body.
pub fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Ok(dechunk(body));
    }
    Ok(body.to_owned())
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// `s` as a URL query value.
pub fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
