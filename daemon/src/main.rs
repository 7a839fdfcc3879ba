//! tracerd: the tracer daemon. One per machine; clients (tracerctl, any gRPC client) start
//! sessions over its Unix socket.

mod settings;

use std::{ffi::OsString, path::PathBuf};

use clap::{parser::ValueSource, CommandFactory, FromArgMatches, Parser};
use tracer_daemon::{
    conn::Limits,
    daemon::{self, Config},
    remote::{Auth, ListenOptions},
};
use tracer_inspect::native::ProbeLimits;

/// The tracer daemon: serves profiling sessions over gRPC.
#[derive(Parser)]
#[command(version, args_override_self = true)]
struct Args {
    /// Settings file (TOML): every flag below as `name = value`, in snake case; flags given
    /// here win over it. Default: /etc/tracer/tracerd.toml, if it exists.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Check the settings (file and flags), print them as in effect, and exit.
    #[arg(long)]
    check_config: bool,
    /// Write tracerd's man page (tracerd.8) into DIR and exit.
    #[arg(long, value_name = "DIR", hide = true)]
    generate_man: Option<PathBuf>,
    /// Unix socket to serve on (mode 0660: root and --group may connect).
    #[arg(long, default_value = daemon::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Where finished sessions' reports are kept across restarts.
    #[arg(long, default_value = daemon::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Also serve on TCP, e.g. tcp://0.0.0.0:7070: TLS only, clients authenticated and
    /// allowed what --access grants them.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    listen: Option<String>,
    /// With --listen: this host's certificate chain (PEM).
    #[arg(long, value_name = "PEM", requires = "listen")]
    tls_cert: Option<PathBuf>,
    /// With --listen: the certificate's private key (PEM).
    #[arg(long, value_name = "PEM", requires = "listen")]
    tls_key: Option<PathBuf>,
    /// With --auth mtls: the CA certificate(s) client certificates must chain to (PEM).
    #[arg(long, value_name = "PEM", requires = "listen")]
    client_ca: Option<PathBuf>,
    /// How TCP clients authenticate: mtls (client certificates) or token (bearer tokens).
    #[arg(long, value_enum, default_value_t = Auth::Mtls, requires = "listen")]
    auth: Auth,
    /// With --listen: the access policy (TOML) naming each client, by certificate name or
    /// token hash, and what it may do (see docs/FLEET.md).
    #[arg(long, value_name = "FILE", requires = "listen")]
    access: Option<PathBuf>,
    /// Serve TCP without TLS (tokens in the clear): refused unless the address is loopback.
    #[arg(long, requires = "listen")]
    insecure_plaintext: bool,
    /// Serve Prometheus metrics (GET /metrics, plain HTTP) on this address, e.g.
    /// tcp://0.0.0.0:9464: sessions, events, losses, and the counts of counting sessions
    /// started with --export prometheus.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    metrics: Option<String>,
    /// Group whose members may use the socket besides root.
    #[arg(long)]
    group: Option<String>,
    /// Size of the kernel ring buffer that tracing events pass through, in MiB (a power of
    /// two): it absorbs bursts while tracerd catches up; past it, events are counted lost.
    #[arg(long, default_value_t = daemon::DEFAULT_TRACE_RING_MB)]
    trace_ring_mb: u32,
    /// Native functions (`--uprobe`) one session may probe, duplicates merged. Each probe on
    /// a shared library traps in every process that maps it, traced or not.
    #[arg(long, default_value_t = ProbeLimits::default().per_session as u32)]
    max_probes_per_session: u32,
    /// Native probes one user's running sessions may hold together (root's included).
    #[arg(long, default_value_t = ProbeLimits::default().per_user as u32)]
    max_probes_per_user: u32,
    /// Connections the Unix socket serves at once, all users together; the last few
    /// (1/16, at most 64) are kept for root.
    #[arg(long, default_value_t = Limits::default().total)]
    max_connections: usize,
    /// Connections one user other than root may have open at once.
    #[arg(long, default_value_t = Limits::default().per_user)]
    max_connections_per_user: usize,
    /// Seconds a connection may stay open with no request in flight before it is closed.
    #[arg(long, value_name = "SECS", default_value_t = Limits::default().idle.as_secs())]
    idle_timeout: u64,
    /// Attach every uprobe as a perf event of its own, as kernels before 6.6 must, instead of
    /// one multi-uprobe link per program and binary (to compare the two; each such probe
    /// costs ~150 ms of the kernel's grace periods to remove).
    #[arg(long)]
    per_probe_uprobes: bool,
    /// Print where Python call counting would probe this interpreter binary (libpython or
    /// python3.X), one `FILE_OFFSET WHAT` line per probe, and exit.
    #[arg(long, value_name = "PATH")]
    show_python_probes: Option<PathBuf>,
    /// Load every BPF program on this kernel, as sessions would, print the verifier's
    /// figures for each (one line a program), and exit: 1 if any is refused.
    #[arg(long)]
    check_programs: bool,
}

fn main() {
    // The guardian is this executable too (see `guardian`), started by tracerd alone.
    let argv: Vec<String> = std::env::args().collect();
    if let [_, flag, fds] = argv.as_slice() {
        if flag == tracer_daemon::guardian::ARG {
            if let Err(e) = tracer_daemon::guardian::run(fds) {
                eprintln!("tracerd guardian: {e}");
                std::process::exit(1);
            }
            return;
        }
    }
    fixed_malloc_thresholds();
    // Before any file is mapped: a traced user may shrink one under tracerd (see sigbus).
    tracer_inspect::sigbus::install();
    let args = args();
    if let Some(dir) = &args.generate_man {
        let man = clap_mangen::Man::new(Args::command()).section("8");
        let mut page = Vec::new();
        if let Err(e) = man
            .render(&mut page)
            .and_then(|()| std::fs::write(dir.join("tracerd.8"), page))
        {
            eprintln!("tracerd: writing {}: {e}", dir.join("tracerd.8").display());
            std::process::exit(1);
        }
        return;
    }
    if args.check_programs {
        std::process::exit(check_programs());
    }
    if let Some(path) = &args.show_python_probes {
        match tracer_inspect::python::runtime::Runtime::inspect(path) {
            Ok(rt) => {
                println!(
                    "# CPython 3.{}: layout from {}; opcode table by {}",
                    rt.version.minor, rt.version.source, rt.table_found_by
                );
                for p in std::iter::once(&rt.eval_entry)
                    .chain(&rt.resume)
                    .chain(&rt.exit)
                {
                    println!("{:#x} {}", p.file_offset, p.what);
                }
                return;
            }
            Err(e) => {
                eprintln!("tracerd: {e}");
                std::process::exit(1);
            }
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = Config {
        socket: args.socket,
        state_dir: args.state_dir,
        listen: args.listen.map(|listen| ListenOptions {
            listen,
            tls_cert: args.tls_cert,
            tls_key: args.tls_key,
            client_ca: args.client_ca,
            auth: args.auth,
            access: args.access,
            insecure_plaintext: args.insecure_plaintext,
        }),
        metrics: args.metrics,
        group: args.group,
        trace_ring_mb: args.trace_ring_mb,
        per_probe_uprobes: args.per_probe_uprobes,
        probe_limits: ProbeLimits {
            per_session: args.max_probes_per_session as usize,
            per_user: args.max_probes_per_user as usize,
        },
        connections: Limits {
            total: args.max_connections,
            per_user: args.max_connections_per_user,
            idle: std::time::Duration::from_secs(args.idle_timeout),
        },
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    if let Err(e) = rt.block_on(daemon::run(config, shutdown_signal())) {
        eprintln!("tracerd: {e}");
        std::process::exit(1);
    }
}

/// `--check-programs`: one line a program, `NAME PROCESSED SHARE% STATES PEAK TIME_US STACK`,
/// then its refusal if refused; the exit status.
fn check_programs() -> i32 {
    let verified = match tracer_bpf::verify_all() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("tracerd: {e}");
            return 1;
        }
    };
    println!(
        "# {} processed instructions at most; kernel {}",
        tracer_bpf::INSN_LIMIT,
        tracer_daemon::capabilities::kernel_release()
    );
    println!("# program processed share states peak_states time_us stack");
    let mut refused = 0;
    for v in &verified {
        match &v.figures {
            Some(f) => println!(
                "{} {} {:.2}% {} {} {} {}",
                v.name,
                f.processed,
                f.share(),
                f.total_states,
                f.peak_states,
                f.time_us,
                if f.stack.is_empty() { "-" } else { &f.stack }
            ),
            None => println!("{} - - - - - -", v.name),
        }
        if let Some(why) = &v.refused {
            refused += 1;
            println!("refused {}: {why}", v.name);
        }
    }
    i32::from(refused > 0)
}

/// The flags, with the settings file's before them; `--check-config` ends here.
fn args() -> Args {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let first = Args::parse_from(&argv);
    let merged = match settings::merged::<Args>(argv, first.config.as_deref()) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("tracerd: {e}");
            std::process::exit(1);
        }
    };
    let matches = Args::command()
        .try_get_matches_from(&merged.argv)
        .unwrap_or_else(|e| match merged.explain(&e) {
            Some(line) => {
                eprintln!("tracerd: {line}");
                std::process::exit(1);
            }
            None => e.exit(),
        });
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if args.check_config {
        let from = merged.file.map_or_else(
            || "no settings file".to_owned(),
            |f| f.display().to_string(),
        );
        println!("# tracerd settings in effect ({from}; flags win)");
        for arg in Args::command().get_arguments() {
            let id = arg.get_id().as_str();
            if [
                "config",
                "check_config",
                "show_python_probes",
                "check_programs",
                "generate_man",
            ]
            .contains(&id)
            {
                continue;
            }
            let Some(raw) = matches.get_raw(id) else {
                continue;
            };
            let v: Vec<_> = raw.map(|v| v.to_string_lossy().into_owned()).collect();
            let shown = match (arg.get_action().takes_values(), v.last()) {
                (false, _) => {
                    (matches.value_source(id) == Some(ValueSource::CommandLine)).to_string()
                }
                (true, Some(v)) if v.parse::<i64>().is_ok() => v.clone(),
                (true, Some(v)) => toml::Value::String(v.clone()).to_string(),
                (true, None) => continue,
            };
            println!("{id} = {shown}");
        }
        std::process::exit(0);
    }
    args
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// glibc raises its mmap threshold to the largest block freed (up to 32 MiB), and its trim
/// threshold to twice that; from then on, large blocks come from the arena of the thread that
/// asks, and the space they leave at its top is kept (`malloc_trim` does not return the top of
/// a thread's arena). With many threads handling multi-MB buffers, tracerd grew by tens of MB
/// a thread that way. Fixed thresholds turn the adjustment off: blocks over 256 KiB are
/// mapped and unmapped on their own.
///
/// No fastbins either: a large report freed on a naming thread left hundreds of thousands of
/// small blocks in the fastbins of the arena the manager's task allocates from, and that
/// task's next allocation of another size merged them all (`malloc_consolidate`), 17–50 ms
/// in one session end of three or four with 150,000 functions. Without fastbins, blocks are
/// merged when freed, by the thread that frees them.
fn fixed_malloc_thresholds() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1024 * 1024);
        libc::mallopt(libc::M_MXFAST, 0);
    }
}
