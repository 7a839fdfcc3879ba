//! tracerctl: the command-line client of tracerd.

/// Prints to standard output; a reader that went away (`| head`) ends tracerctl quietly,
/// as SIGPIPE would in other Unix tools (tracerctl ignores SIGPIPE: see `main`).
macro_rules! out {
    ($($arg:tt)*) => { $crate::stdout_write(format_args!($($arg)*)) };
}

mod client;
mod duration;
mod fleet;
mod launch;
mod output;
mod render;
mod top;

use std::{io::IsTerminal, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use output::{fetch_report, report, report_request, write_output};
use tokio_stream::StreamExt;
use tracer_proto::{
    target, CountingOptions, GetCapabilitiesRequest, ListSessionsRequest, Mode, PushTls,
    SamplingOptions, SessionInfo, SessionRef, SessionState, StartSessionRequest,
    StreamEventsRequest, Target, TracingOptions, WatchSessionRequest,
};

/// Control tracerd: start profiling sessions, follow them, fetch their reports.
#[derive(Parser)]
#[command(version, name = "tracerctl")]
struct Cli {
    /// tracerd's Unix socket, or tcp://HOST:PORT.
    #[arg(
        long,
        env = "TRACER_SOCKET",
        default_value = "/run/tracer/tracerd.sock",
        global = true
    )]
    socket: String,
    /// Fan-out: run `start`, `list` or `capabilities` on each of these tracerds
    /// (HOST:PORT, comma-separated) and merge their results.
    #[arg(long, value_delimiter = ',', global = true, value_name = "HOST:PORT,…")]
    hosts: Vec<String>,
    /// Fan-out: the hosts, one HOST:PORT per line (# comments).
    #[arg(long, global = true, value_name = "FILE")]
    hosts_file: Option<PathBuf>,
    #[command(flatten)]
    remote: client::Remote,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a session on a pid, the whole machine, or a command run under it.
    Start(Box<StartArgs>),
    /// Stop a running session; its report is then available.
    Stop { id: String },
    /// Forget a finished session: its state, report and trace file.
    Delete { id: String },
    /// List sessions, running and finished.
    List,
    /// Show one session: state, elapsed time, counts so far, losses.
    Status { id: String },
    /// Print a finished session's report.
    Report {
        id: String,
        /// A running session's report so far; it goes on running.
        #[arg(long)]
        interim: bool,
        #[command(flatten)]
        out: Output,
    },
    /// Show a running session's report so far, refreshed every interval, until it ends
    /// (hottest functions by CPU and off-CPU time, or by calls and time).
    Top {
        id: String,
        /// Time between refreshes, e.g. 500ms.
        #[arg(long, value_parser = duration::parse_ms, default_value = "1s")]
        interval: u64,
        /// Functions shown at most.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Order of Python functions counted (as `python -m cProfile -s`).
        #[arg(long, default_value = "tottime")]
        sort: String,
    },
    /// What this machine and daemon can do.
    Capabilities,
    /// Print a running tracing session's events as they are recorded, until it ends.
    Watch { id: String },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Write tracerctl's man pages (tracerctl.1 and one per command) into DIR.
    #[command(hide = true)]
    Manual { dir: PathBuf },
}

#[derive(Args)]
struct StartArgs {
    /// counting, sampling or tracing.
    #[arg(long, value_enum)]
    mode: ModeArg,
    /// perf events to count, comma-separated (as `perf stat -e`).
    #[arg(long, value_delimiter = ',')]
    events: Vec<String>,
    /// Count calls of every Python function (CPython 3.10-3.15), as cProfile counts them.
    #[arg(long)]
    python: bool,
    /// With --python: count with uprobes only, loading no code into any process (by default a
    /// running CPython 3.10+ named by --pid, and a command run under tracer, count in-process).
    #[arg(long, requires = "python")]
    python_uprobes_only: bool,
    /// Count CUDA kernel launches, copies and allocations (libcudart and libcuda, probed as
    /// the target maps them).
    #[arg(long)]
    cuda: bool,
    /// With --cuda: period of the GPU metric readings (NVML), e.g. 50ms (default 100ms).
    #[arg(long, value_parser = duration::parse_ms, requires = "cuda")]
    gpu_period: Option<u64>,
    /// With --cuda: also record each launch's stack (Python and native), weighted by launches:
    /// `report --format folded|pprof|speedscope|svg` then draws where launches come from.
    #[arg(long, requires = "cuda")]
    cuda_stacks: bool,
    /// With --cuda: probe launches at the driver's entry points only (one probe a launch,
    /// not two; no rows for the runtime's entry points).
    #[arg(long, requires = "cuda")]
    cuda_driver_only: bool,
    /// With --cuda: GPU execution time per kernel, from CUPTI. With -- CMD the command runs with
    /// tracer's injection library (CUDA_INJECTION64_PATH=…/libtracer_cupti.so); with --pid
    /// tracerd loads that library into the running process (ptrace) and turns CUPTI on there
    /// until the session ends.
    #[arg(long, requires = "cuda")]
    gpu_times: bool,
    /// With --cuda (counting, --pid or -- CMD): count the process's launches inside it,
    /// through CUPTI's launch callbacks in tracer's injection library (loaded with ptrace
    /// into a running process, as for --gpu-times; set in a launched command's environment),
    /// instead of the launch probes: no trap a launch. The default for such a session
    /// without --cuda-stacks or --cuda-driver-only; where it cannot be had, the probes count
    /// them and the report says why.
    #[arg(long, requires = "cuda")]
    cuda_in_process: bool,
    /// With --cuda: count launches with the launch uprobes only, loading nothing into any
    /// process.
    #[arg(long, requires = "cuda", conflicts_with = "cuda_in_process")]
    cuda_uprobes_only: bool,
    /// Sampling: samples per second on each CPU (default 99).
    #[arg(long, value_name = "HZ", value_parser = parse_frequency)]
    frequency: Option<u64>,
    /// Sampling, wall-clock: also the time threads spend off the CPU (sleeping, blocked on
    /// I/O, a lock, the GIL, a CUDA synchronization, or preempted), with their stacks where
    /// they left and why, beside the CPU samples, in time units. Tracing: each time away a
    /// slice on the thread's track, named for what it waited on.
    #[arg(long)]
    off_cpu: bool,
    /// With --off-cpu: a thread's time away goes in as a stack once it adds up to this much
    /// (default 5ms; 100us to 1s); shorter periods are carried into its next one (tracing:
    /// not drawn).
    #[arg(long, value_name = "DURATION", value_parser = duration::parse_us, requires = "off_cpu")]
    off_cpu_min: Option<u64>,
    /// Sampling, CPython 3.11+: a sample in an asyncio task starts with the tasks awaiting
    /// it (outermost first, each `[task: NAME]` and the line where it awaits), then the
    /// task's own frames, in place of the event loop's.
    #[arg(long)]
    asyncio: bool,
    /// Always-on low-rate profiling: sampling at 19 Hz (unless --frequency says otherwise)
    /// until stopped, each window pushed to --push.
    #[arg(long, requires = "push")]
    continuous: bool,
    /// Sampling, continuously: push each window of samples to this endpoint:
    /// http://HOST:PORT (pprof to Pyroscope's push.v1 API: Grafana Pyroscope, Alloy),
    /// parca://HOST:PORT (pprof to Parca's gRPC WriteRaw) or otlp://HOST:PORT
    /// (OpenTelemetry profiles to an OTLP gRPC receiver); https://, parcas:// and otlps://
    /// over TLS.
    #[arg(long, value_name = "URL")]
    push: Option<String>,
    /// With an https://, parcas:// or otlps:// --push: the CA the endpoint's certificate must
    /// chain to (PEM; default: the system's roots).
    #[arg(long, value_name = "PEM", requires = "push")]
    push_ca: Option<PathBuf>,
    /// With a TLS --push: a client certificate (PEM) for endpoints that ask for one; with
    /// --push-key.
    #[arg(long, value_name = "PEM", requires = "push_key")]
    push_cert: Option<PathBuf>,
    /// The key of --push-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "push_cert")]
    push_key: Option<PathBuf>,
    /// With --push: the window length, e.g. 10s (default 15s).
    #[arg(long, value_parser = duration::parse_ms, requires = "push")]
    push_period: Option<u64>,
    /// Count calls of native functions, like bcc's funccount: BINARY_OR_LIB:SYMBOL, e.g.
    /// libc:malloc, 'libcuda:cuLaunchKernel*', ./app:parse (repeatable; * and ? glob).
    #[arg(long = "uprobe", value_name = "BINARY_OR_LIB:SYMBOL")]
    uprobes: Vec<String>,
    /// Tracing: MiB of events kept in memory before they go to the trace file (default 64).
    #[arg(long, value_name = "MIB")]
    buffer_mb: Option<u32>,
    /// Tracing: the trace file's size limit in MiB (default 4096); events past it are lost.
    #[arg(long, value_name = "MIB")]
    max_file_mb: Option<u32>,
    /// Tracing: period of the perf counter readings (--events), e.g. 10ms, 1s (default 100ms).
    #[arg(long, value_parser = duration::parse_ms)]
    interval: Option<u64>,
    /// Counting: also expose the counts on tracerd's Prometheus endpoint (tracerd --metrics).
    #[arg(long, value_enum, value_name = "SINK")]
    export: Vec<ExportArg>,
    /// Stop after this long: 500ms, 30s, 5m, 1h (at most 24h).
    #[arg(long, value_parser = duration::parse_ms)]
    duration: Option<u64>,
    /// Wait for the session to end and print its report (implied with `-- CMD`).
    #[arg(long)]
    wait: bool,
    /// Trace this process, its threads, and the children it forks from now on.
    #[arg(long, conflicts_with_all = ["all", "command"])]
    pid: Option<u32>,
    /// Trace every process on the machine (root only).
    #[arg(long, conflicts_with = "command")]
    all: bool,
    #[command(flatten)]
    out: Output,
    /// The command to run under the session: `-- CMD ARGS…`.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Args)]
struct Output {
    /// Report format.
    #[arg(long, value_enum, default_value_t = FormatArg::Table)]
    format: FormatArg,
    /// Write the report to this file instead of standard output.
    #[arg(short = 'o', long = "output")]
    output: Option<PathBuf>,
    /// Order of the Python functions: tottime, cumtime, ncalls, pcalls, filename, name, line, pid.
    #[arg(long, default_value = "tottime")]
    sort: String,
    /// Table only: show at most this many Python functions and native rows (0: all).
    #[arg(long, default_value_t = 0)]
    limit: u32,
    /// Sampling reports: only the stacks of this process (repeatable).
    #[arg(long = "filter-pid", value_name = "PID")]
    filter_pids: Vec<u32>,
    /// Sampling reports: only the stacks of this thread (repeatable).
    #[arg(long = "filter-tid", value_name = "TID")]
    filter_tids: Vec<u32>,
    /// Sampling reports: only the stacks of processes with this name (comm).
    #[arg(long = "filter-comm", value_name = "NAME")]
    filter_comm: Option<String>,
    /// Sampling reports: only the samples taken while their thread held the GIL (what
    /// limits a threaded Python program; py-spy's --gil).
    #[arg(long)]
    gil: bool,
}

/// `--frequency`: clap's own range check would print u64's whole range.
fn parse_frequency(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("the frequency must be at least 1 Hz (samples per second on each CPU)".into()),
        Ok(hz) => Ok(hz),
        Err(_) => Err(format!("'{s}' is not a number of samples per second")),
    }
}

/// `--continuous`'s default rate: low, and prime, so that samples do not beat with
/// periodic work.
const CONTINUOUS_HZ: u64 = 19;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ExportArg {
    /// Live series on tracerd's /metrics, for a Prometheus that scrapes it.
    Prometheus,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Counting,
    Sampling,
    Tracing,
}

#[derive(Clone, Copy, ValueEnum)]
enum FormatArg {
    Table,
    Json,
    /// Python's pstats file (for pstats.Stats, snakeviz); use with -o.
    Pstats,
    /// Sampling: folded stacks (flamegraph.pl, inferno, speedscope).
    Folded,
    /// Sampling: gzipped pprof protobuf (go tool pprof, Pyroscope, Parca); use with -o.
    Pprof,
    /// Sampling: OpenTelemetry profiles (one ExportProfilesServiceRequest, protobuf); use with -o.
    Otlp,
    /// Sampling: speedscope JSON.
    Speedscope,
    /// Sampling: an SVG flame graph.
    Svg,
    /// Tracing: Chrome trace event JSON (Perfetto UI, chrome://tracing).
    Chrome,
    /// Tracing: Perfetto's protobuf trace (Perfetto UI, trace_processor); use with -o.
    Perfetto,
    /// --cuda: the table of kernel launches.
    Kernels,
}

fn main() -> ExitCode {
    // A command launched below must not inherit an ignored SIGPIPE: default until it is
    // forked, ignored after (see `out!`).
    // SAFETY: setting a signal disposition before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            // One line naming the problem, not clap's usage block: its first paragraph, whose
            // continuation lines name the arguments (a missing one, say).
            let text = e.render().to_string();
            let first: Vec<&str> = text
                .lines()
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            let first = match first.join(" ") {
                s if s.is_empty() => "invalid arguments".to_owned(),
                s => s.trim_start_matches("error: ").to_owned(),
            };
            eprintln!("tracerctl: {first} (see tracerctl --help)");
            return ExitCode::from(2);
        }
    };
    // What needs no daemon.
    match &cli.command {
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut cmd, "tracerctl", &mut std::io::stdout());
            return ExitCode::SUCCESS;
        }
        Command::Manual { dir } => {
            let cmd = <Cli as clap::CommandFactory>::command();
            return match clap_mangen::generate_to(cmd, dir) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&anyhow::anyhow!(
                    "writing man pages into {}: {e}",
                    dir.display()
                )),
            };
        }
        _ => {}
    }
    // `-- CMD` is forked before any thread exists (tokio's included).
    if let Command::Start(a) = &cli.command {
        if a.gpu_times && a.pid.is_none() {
            if let Err(e) = launch::inject_cupti(&a.command) {
                return fail(&e);
            }
        }
    }
    let held = match &cli.command {
        Command::Start(a) if !a.command.is_empty() => match launch::hold(&a.command) {
            Ok(h) => Some(h),
            Err(e) => return fail(&e),
        },
        _ => None,
    };
    // A daemon that refuses TLS closes the connection under our writes: that is an error to
    // report, not a signal to die of.
    // SAFETY: still before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(cli, held)) {
        Ok(code) => code,
        Err(e) => fail(&e),
    }
}

fn fail(e: &anyhow::Error) -> ExitCode {
    eprintln!("tracerctl: {e:#}");
    ExitCode::FAILURE
}

/// A gRPC error as one line: the daemon's message already names the problem; a transport
/// failure (TLS refused, connection reset) adds its cause.
fn status_err(s: tonic::Status) -> anyhow::Error {
    let cause = std::error::Error::source(&s).map(client::root_cause);
    let message = match (s.message(), cause) {
        ("", Some(c)) => c,
        (m, Some(c)) if !m.contains(&c) => format!("{m}: {c}"),
        (m, _) => m.to_owned(),
    };
    // The message may quote a name a traced process chose (a path, a `comm`), and it is one
    // line: escaped whole.
    let message = tracer_report::escape_controls(&message).into_owned();
    let prefix = match s.code() {
        tonic::Code::Unavailable => "tracerd is unavailable: ",
        tonic::Code::Unauthenticated => "not authenticated: ",
        tonic::Code::PermissionDenied => "permission denied: ",
        _ => "",
    };
    // The daemon's message may say so itself ("permission denied: …"): once is enough.
    if message
        .get(..prefix.len())
        .is_some_and(|m| m.eq_ignore_ascii_case(prefix))
    {
        anyhow::anyhow!("{message}")
    } else {
        anyhow::anyhow!("{prefix}{message}")
    }
}

async fn run(cli: Cli, held: Option<launch::Held>) -> Result<ExitCode> {
    if !cli.hosts.is_empty() || cli.hosts_file.is_some() {
        return fleet::command::run(cli).await;
    }
    let mut client = match client::connect(&cli.socket, &cli.remote).await {
        Ok(c) => c,
        Err(e) => {
            if let Some(h) = held {
                h.abandon();
            }
            return Err(e);
        }
    };
    match cli.command {
        Command::Start(args) => start(&mut client, *args, held).await,
        Command::Stop { id } => {
            let s = client
                .stop_session(SessionRef { id })
                .await
                .map_err(status_err)?
                .into_inner();
            out!("{}", render::status(&s));
            Ok(ExitCode::SUCCESS)
        }
        Command::Delete { id } => {
            client
                .delete_session(SessionRef { id: id.clone() })
                .await
                .map_err(status_err)?;
            out!("deleted {id}\n");
            Ok(ExitCode::SUCCESS)
        }
        Command::List => {
            let r = client
                .list_sessions(ListSessionsRequest {})
                .await
                .map_err(status_err)?
                .into_inner();
            out!("{}", render::list(&r.sessions));
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { id } => {
            let s = client
                .get_session(SessionRef { id })
                .await
                .map_err(status_err)?
                .into_inner();
            out!("{}", render::status(&s));
            Ok(ExitCode::SUCCESS)
        }
        Command::Report { id, interim, out } => {
            report(&mut client, id, &out, interim).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Top {
            id,
            interval,
            limit,
            sort,
        } => {
            let top = top::Top {
                id,
                interval: Duration::from_millis(interval.max(100)),
                limit,
                sort,
            };
            top::run(&mut client, top).await
        }
        Command::Watch { id } => {
            let mut stream = client
                .stream_events(StreamEventsRequest { id: id.clone() })
                .await
                .map_err(status_err)?
                .into_inner();
            // Events recorded from here on are shown; said on stderr so scripts can wait for it.
            eprintln!("tracerctl: watching session {id}");
            let mut missed = 0;
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            while let Some(batch) = stream.next().await {
                let batch = batch.map_err(status_err)?;
                use std::io::Write;
                for e in &batch.events {
                    // A closed pipe (`| head`) ends the watch quietly.
                    if writeln!(out, "{}", render::event(e)).is_err() {
                        return Ok(ExitCode::SUCCESS);
                    }
                }
                let _ = out.flush();
                missed = batch.missed;
            }
            drop(out);
            if missed > 0 {
                eprintln!("tracerctl: {missed} events went by faster than this terminal could print them (the trace has them all)");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Completions { .. } | Command::Manual { .. } => Ok(ExitCode::SUCCESS),
        Command::Capabilities => {
            let c = client
                .get_capabilities(GetCapabilitiesRequest {})
                .await
                .map_err(status_err)?
                .into_inner();
            out!("{}", render::capabilities(&c));
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn start(
    client: &mut client::Client,
    args: StartArgs,
    held: Option<launch::Held>,
) -> Result<ExitCode> {
    let kind = match (&held, args.pid, args.all) {
        (Some(h), _, _) => {
            target::Kind::Pid(u32::try_from(h.pid.as_raw()).expect("pids are positive"))
        }
        (None, Some(pid), _) => target::Kind::Pid(pid),
        (None, None, true) => target::Kind::All(true),
        (None, None, false) => bail!("a target is required: --pid PID, --all, or -- CMD ARGS…"),
    };
    let req = start_request(&args, kind, held.is_some())?;
    let session = match client.start_session(req).await {
        Ok(s) => s.into_inner(),
        Err(e) => {
            if let Some(h) = held {
                h.abandon();
            }
            return Err(status_err(e));
        }
    };
    start_followed(client, args, held, session).await
}

/// The TLS files of a push, read as the user running tracerctl.
fn push_tls(args: &StartArgs) -> Result<Option<PushTls>> {
    let read = |p: &Option<PathBuf>| -> Result<Vec<u8>> {
        p.as_deref().map_or(Ok(Vec::new()), |p| {
            std::fs::read(p).with_context(|| format!("reading {}", p.display()))
        })
    };
    if args.push_ca.is_none() && args.push_cert.is_none() {
        return Ok(None);
    }
    Ok(Some(PushTls {
        ca_pem: read(&args.push_ca)?,
        cert_pem: read(&args.push_cert)?,
        key_pem: read(&args.push_key)?,
    }))
}

fn start_request(
    args: &StartArgs,
    kind: target::Kind,
    launched: bool,
) -> Result<StartSessionRequest> {
    let push_tls = push_tls(args)?;
    let mode = match args.mode {
        ModeArg::Counting => Mode::Counting,
        ModeArg::Sampling => Mode::Sampling,
        ModeArg::Tracing => Mode::Tracing,
    };
    Ok(StartSessionRequest {
        mode: mode.into(),
        target: Some(Target {
            kind: Some(kind),
            launched,
        }),
        duration_ms: args.duration,
        counting: Some(CountingOptions {
            python: args.python,
            python_uprobes_only: args.python_uprobes_only,
            events: args.events.clone(),
            uprobes: args.uprobes.iter().map(|s| absolute_spec(s)).collect(),
            cuda: args.cuda,
            gpu_period_ms: args
                .gpu_period
                .map_or(0, |ms| u32::try_from(ms).unwrap_or(u32::MAX)),
            export_prometheus: args.export.contains(&ExportArg::Prometheus),
            cuda_stacks: args.cuda_stacks,
            cuda_driver_only: args.cuda_driver_only,
            cuda_in_process: args.cuda_in_process,
            cuda_uprobes_only: args.cuda_uprobes_only,
            // A launched command's is its launcher's (`inject_cupti`).
            gpu_times: args.gpu_times && args.pid.is_some(),
        }),
        sampling: (args.frequency.is_some() || args.push.is_some() || args.off_cpu || args.asyncio)
            .then(|| SamplingOptions {
                frequency_hz: args.frequency.unwrap_or(if args.continuous {
                    CONTINUOUS_HZ
                } else {
                    0
                }),
                push_url: args.push.clone().unwrap_or_default(),
                push_period_ms: args
                    .push_period
                    .map_or(0, |ms| u32::try_from(ms).unwrap_or(u32::MAX)),
                off_cpu: args.off_cpu,
                off_cpu_min_us: args
                    .off_cpu_min
                    .map_or(0, |us| u32::try_from(us.max(1)).unwrap_or(u32::MAX)),
                push_tls,
                asyncio_tasks: args.asyncio,
            }),
        tracing: (args.buffer_mb.is_some()
            || args.max_file_mb.is_some()
            || args.interval.is_some())
        .then(|| TracingOptions {
            buffer_mb: args.buffer_mb.unwrap_or(0),
            max_file_mb: args.max_file_mb.unwrap_or(0),
            counter_interval_ms: args
                .interval
                .map_or(0, |ms| u32::try_from(ms).unwrap_or(u32::MAX)),
        }),
        start_at_unix_ms: 0,
    })
}

async fn start_followed(
    client: &mut client::Client,
    args: StartArgs,
    mut held: Option<launch::Held>,
    session: SessionInfo,
) -> Result<ExitCode> {
    let Some(h) = held.as_mut() else {
        if !args.wait {
            out!("{}\n", session.id);
            return Ok(ExitCode::SUCCESS);
        }
        follow(client, &session.id).await?;
        report(client, session.id, &args.out, false).await?;
        return Ok(ExitCode::SUCCESS);
    };
    if let Err(e) = h.release(&session.launch_env) {
        // Nothing ran: the session is no one's measurement; a shell says 127 for it.
        discard(client, &session.id).await;
        eprintln!("tracerctl: {e:#}");
        return Ok(ExitCode::from(127));
    }
    let pid = h.pid;
    let mut waiter = tokio::task::spawn_blocking(move || launch::wait(pid));
    // The daemon sees the exit too and ends the session; following it shows progress meanwhile.
    let followed = follow(client, &session.id);
    let code = tokio::select! {
        code = &mut waiter => code.context("waiting for the command")?,
        r = followed => {
            // The daemon may see the exit before this process reaps the command: its
            // status is then still to be read.
            if r?.end_reason == tracer_proto::EndReason::TargetExited as i32 {
                waiter.await.context("waiting for the command")?
            } else {
                0
            }
        }
    };
    // Either way the session is over or about to be: wait for the daemon to close it.
    finish_after_exit(client, &session.id).await?;
    report(client, session.id, &args.out, false).await?;
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

/// Stops and deletes a session, as far as the daemon lets it (best effort: the command's
/// failure is what gets reported).
async fn discard(client: &mut client::Client, id: &str) {
    let session = || SessionRef { id: id.to_owned() };
    let _ = client.stop_session(session()).await;
    for _ in 0..20 {
        if client.delete_session(session()).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Follows a session until it ends, with a progress line on a terminal.
async fn follow(client: &mut client::Client, id: &str) -> Result<SessionInfo> {
    let tty = std::io::stderr().is_terminal();
    let mut stream = client
        .watch_session(WatchSessionRequest {
            id: id.to_owned(),
            interval_ms: 500,
        })
        .await
        .map_err(status_err)?
        .into_inner();
    let mut last = None;
    while let Some(info) = stream.next().await {
        let info = info.map_err(status_err)?;
        if tty {
            eprint!("\r\x1b[2K{}", render::progress(&info));
        }
        last = Some(info);
    }
    if tty {
        eprintln!();
    }
    last.context("the daemon closed the session stream without a state")
}

/// After the command exited: the daemon ends the session on the exit event; stop it
/// ourselves if that has not happened within a few seconds.
async fn finish_after_exit(client: &mut client::Client, id: &str) -> Result<()> {
    for _ in 0..50 {
        let s = client
            .get_session(SessionRef { id: id.to_owned() })
            .await
            .map_err(status_err)?
            .into_inner();
        if s.state != SessionState::Running as i32 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    client
        .stop_session(SessionRef { id: id.to_owned() })
        .await
        .map_err(status_err)?;
    Ok(())
}

/// A spec whose binary is a relative path (`./app:main`) names it from tracerctl's directory,
/// not the daemon's.
fn absolute_spec(spec: &str) -> String {
    match spec.rsplit_once(':') {
        Some((bin, sym)) if bin.contains('/') && !bin.starts_with('/') => {
            match std::fs::canonicalize(bin) {
                Ok(p) => format!("{}:{sym}", p.display()),
                Err(_) => spec.to_owned(),
            }
        }
        _ => spec.to_owned(),
    }
}

pub fn stdout_write(args: std::fmt::Arguments) {
    use std::io::Write;
    let r = std::io::stdout().write_fmt(args);
    stdout_result(r);
}

fn stdout_bytes(data: &[u8]) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let r = out.write_all(data).and_then(|()| out.flush());
    stdout_result(r);
}

fn stdout_result(r: std::io::Result<()>) {
    match r {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(141),
        Err(e) => {
            eprintln!("tracerctl: writing to standard output: {e}");
            std::process::exit(1);
        }
    }
}
