//! tracerctl: the command-line client of tracerd.

mod client;
mod duration;
mod launch;
mod render;

use std::{io::IsTerminal, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use tokio_stream::StreamExt;
use tracer_proto::{
    target, CountingOptions, GetCapabilitiesRequest, GetReportRequest, ListSessionsRequest, Mode,
    ReportFormat, SamplingOptions, SessionInfo, SessionRef, SessionState, StartSessionRequest,
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
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a session on a pid, the whole machine, or a command run under it.
    Start(StartArgs),
    /// Stop a running session; its report is then available.
    Stop { id: String },
    /// List sessions, running and finished.
    List,
    /// Show one session: state, elapsed time, counts so far, losses.
    Status { id: String },
    /// Print a finished session's report.
    Report {
        id: String,
        #[command(flatten)]
        out: Output,
    },
    /// What this machine and daemon can do.
    Capabilities,
    /// Print a running tracing session's events as they are recorded, until it ends.
    Watch { id: String },
}

#[derive(Args)]
struct StartArgs {
    /// counting, sampling or tracing.
    #[arg(long, value_enum)]
    mode: ModeArg,
    /// perf events to count, comma-separated (as `perf stat -e`).
    #[arg(long, value_delimiter = ',')]
    events: Vec<String>,
    /// Count calls of every Python function (CPython 3.10-3.13), as cProfile counts them.
    #[arg(long)]
    python: bool,
    /// Count CUDA kernel launches, copies and allocations (libcudart and libcuda, probed as
    /// the target maps them).
    #[arg(long)]
    cuda: bool,
    /// With --cuda: period of the GPU metric readings (NVML), e.g. 50ms (default 100ms).
    #[arg(long, value_parser = duration::parse_ms, requires = "cuda")]
    gpu_period: Option<u64>,
    /// Sampling: samples per second on each CPU (default 99).
    #[arg(long, value_name = "HZ", value_parser = clap::value_parser!(u64).range(1..))]
    frequency: Option<u64>,
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
    // Like other Unix tools (and unlike Rust's default), die quietly when the reader of our
    // output goes away; and a command launched below must not inherit an ignored SIGPIPE.
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
    // `-- CMD` is forked before any thread exists (tokio's included).
    let held = match &cli.command {
        Command::Start(a) if !a.command.is_empty() => match launch::hold(&a.command) {
            Ok(h) => Some(h),
            Err(e) => return fail(&e),
        },
        _ => None,
    };
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

/// A gRPC error as one line: the daemon's message already names the problem.
fn status_err(s: tonic::Status) -> anyhow::Error {
    match s.code() {
        tonic::Code::Unavailable => anyhow::anyhow!("tracerd is unavailable: {}", s.message()),
        _ => anyhow::anyhow!("{}", s.message()),
    }
}

async fn run(cli: Cli, held: Option<launch::Held>) -> Result<ExitCode> {
    let mut client = match client::connect(&cli.socket).await {
        Ok(c) => c,
        Err(e) => {
            if let Some(h) = held {
                h.abandon();
            }
            return Err(e);
        }
    };
    match cli.command {
        Command::Start(args) => start(&mut client, args, held).await,
        Command::Stop { id } => {
            let s = client
                .stop_session(SessionRef { id })
                .await
                .map_err(status_err)?
                .into_inner();
            print!("{}", render::status(&s));
            Ok(ExitCode::SUCCESS)
        }
        Command::List => {
            let r = client
                .list_sessions(ListSessionsRequest {})
                .await
                .map_err(status_err)?
                .into_inner();
            print!("{}", render::list(&r.sessions));
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { id } => {
            let s = client
                .get_session(SessionRef { id })
                .await
                .map_err(status_err)?
                .into_inner();
            print!("{}", render::status(&s));
            Ok(ExitCode::SUCCESS)
        }
        Command::Report { id, out } => {
            report(&mut client, id, &out).await?;
            Ok(ExitCode::SUCCESS)
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
        Command::Capabilities => {
            let c = client
                .get_capabilities(GetCapabilitiesRequest {})
                .await
                .map_err(status_err)?
                .into_inner();
            print!("{}", render::capabilities(&c));
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn start(
    client: &mut client::Client,
    args: StartArgs,
    mut held: Option<launch::Held>,
) -> Result<ExitCode> {
    let kind = match (&held, args.pid, args.all) {
        (Some(h), _, _) => {
            target::Kind::Pid(u32::try_from(h.pid.as_raw()).expect("pids are positive"))
        }
        (None, Some(pid), _) => target::Kind::Pid(pid),
        (None, None, true) => target::Kind::All(true),
        (None, None, false) => bail!("a target is required: --pid PID, --all, or -- CMD ARGS…"),
    };
    let mode = match args.mode {
        ModeArg::Counting => Mode::Counting,
        ModeArg::Sampling => Mode::Sampling,
        ModeArg::Tracing => Mode::Tracing,
    };
    let req = StartSessionRequest {
        mode: mode.into(),
        target: Some(Target {
            kind: Some(kind),
            launched: held.is_some(),
        }),
        duration_ms: args.duration,
        counting: Some(CountingOptions {
            python: args.python,
            events: args.events,
            uprobes: args.uprobes.iter().map(|s| absolute_spec(s)).collect(),
            cuda: args.cuda,
            gpu_period_ms: args
                .gpu_period
                .map_or(0, |ms| u32::try_from(ms).unwrap_or(u32::MAX)),
        }),
        sampling: args
            .frequency
            .map(|hz| SamplingOptions { frequency_hz: hz }),
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
    };
    let session = match client.start_session(req).await {
        Ok(s) => s.into_inner(),
        Err(e) => {
            if let Some(h) = held {
                h.abandon();
            }
            return Err(status_err(e));
        }
    };
    let Some(h) = held.as_mut() else {
        if !args.wait {
            println!("{}", session.id);
            return Ok(ExitCode::SUCCESS);
        }
        follow(client, &session.id).await?;
        report(client, session.id, &args.out).await?;
        return Ok(ExitCode::SUCCESS);
    };
    h.release()?;
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
    report(client, session.id, &args.out).await?;
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
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

async fn report(client: &mut client::Client, id: String, out: &Output) -> Result<()> {
    let format = match out.format {
        FormatArg::Table => ReportFormat::Table,
        FormatArg::Json => ReportFormat::Json,
        FormatArg::Pstats => ReportFormat::Pstats,
        FormatArg::Folded => ReportFormat::Folded,
        FormatArg::Pprof => ReportFormat::Pprof,
        FormatArg::Speedscope => ReportFormat::Speedscope,
        FormatArg::Svg => ReportFormat::Svg,
        FormatArg::Chrome => ReportFormat::Chrome,
        FormatArg::Perfetto => ReportFormat::Perfetto,
        FormatArg::Kernels => ReportFormat::Kernels,
    };
    let mut stream = client
        .get_report(GetReportRequest {
            id,
            format: format.into(),
            sort: out.sort.clone(),
            limit: out.limit,
            pids: out.filter_pids.clone(),
            tids: out.filter_tids.clone(),
            comm: out.filter_comm.clone().unwrap_or_default(),
        })
        .await
        .map_err(status_err)?
        .into_inner();
    let mut data = Vec::new();
    while let Some(chunk) = stream.next().await {
        data.extend(chunk.map_err(status_err)?.data);
    }
    match &out.output {
        Some(path) => {
            std::fs::write(path, &data).with_context(|| format!("writing {}", path.display()))?
        }
        None => {
            use std::io::Write;
            std::io::stdout().write_all(&data)?;
        }
    }
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
