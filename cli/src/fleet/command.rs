//! `tracerctl --hosts …`: which commands run on many daemons, and how their arguments
//! become one request for all.

use std::process::ExitCode;

use anyhow::{bail, Result};
use tracer_proto::{target, ListSessionsRequest, ReportFormat};

use crate::{
    client, render, report_request, start_request, status_err, Cli, Command, FormatArg, ModeArg,
};

/// `--hosts`: the commands that run on many daemons.
pub async fn run(cli: Cli) -> Result<ExitCode> {
    let hosts = super::hosts(&cli.hosts, cli.hosts_file.as_deref())?;
    match cli.command {
        Command::Start(args) => {
            if !args.command.is_empty() {
                bail!("with --hosts, give --all or --pid: a command cannot be launched on other hosts");
            }
            if args.duration.is_none() {
                bail!("with --hosts, give --duration: the sessions end together and their reports are merged");
            }
            let format = match (args.mode, args.out.format) {
                (ModeArg::Counting, FormatArg::Table) => ReportFormat::Table,
                (ModeArg::Counting, FormatArg::Json) => ReportFormat::Json,
                (ModeArg::Sampling, FormatArg::Pprof) => ReportFormat::Pprof,
                (ModeArg::Sampling, FormatArg::Folded) => ReportFormat::Folded,
                (ModeArg::Counting, _) => bail!("with --hosts, counting reports are merged as table or json"),
                (ModeArg::Sampling, _) => bail!("with --hosts, sampling reports are merged as pprof (a host label on each sample) or folded"),
                (ModeArg::Tracing, FormatArg::Chrome) => ReportFormat::Chrome,
                (ModeArg::Tracing, _) => bail!("with --hosts, tracing reports are merged as chrome (one timeline, a process group per host process)"),
            };
            let kind = match (args.pid, args.all) {
                (Some(pid), _) => target::Kind::Pid(pid),
                (None, true) => target::Kind::All(true),
                (None, false) => bail!("a target is required: --pid PID or --all"),
            };
            let fetch = super::Fetch {
                // Counting tables are merged from each host's JSON.
                template: report_request(String::new(), &args.out, match format {
                    ReportFormat::Table => ReportFormat::Json,
                    f => f,
                }),
                format,
                limit: args.out.limit as usize,
                output: args.out.output.clone(),
            };
            let req = start_request(&args, kind, false)?;
            super::start(&hosts, &cli.remote, req, fetch).await
        }
        Command::Capabilities => super::capabilities(&hosts, &cli.remote).await,
        Command::List => {
            let mut code = ExitCode::SUCCESS;
            for h in &hosts {
                let r = async {
                    let mut c = client::connect(&format!("tcp://{h}"), &cli.remote).await?;
                    Ok::<_, anyhow::Error>(
                        c.list_sessions(ListSessionsRequest {})
                            .await
                            .map_err(status_err)?
                            .into_inner(),
                    )
                }
                .await;
                match r {
                    Ok(r) => out!("== {h}\n{}", render::list(&r.sessions)),
                    Err(e) => {
                        out!("== {h}\nFAILED: {e:#}\n");
                        code = ExitCode::from(super::PARTIAL);
                    }
                }
            }
            Ok(code)
        }
        _ => bail!("with --hosts: start, list and capabilities run on every host; other commands take one daemon (--socket tcp://HOST:PORT)"),
    }
}
