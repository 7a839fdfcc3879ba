//! `tracerctl top ID`: a running session's report so far, redrawn every interval (like
//! `py-spy top`), until the session ends; then its final report. On a terminal each
//! refresh replaces the last; otherwise each is printed after the last, with a header.

use std::{io::IsTerminal, process::ExitCode, time::Duration};

use anyhow::Result;
use tracer_proto::{GetReportRequest, ReportFormat, SessionRef, SessionState};

use crate::client::Client;

/// What `top` shows, as asked.
pub struct Top {
    pub id: String,
    pub interval: Duration,
    pub limit: u32,
    pub sort: String,
}

pub async fn run(client: &mut Client, top: Top) -> Result<ExitCode> {
    let tty = std::io::stdout().is_terminal();
    let request = |interim| GetReportRequest {
        id: top.id.clone(),
        format: ReportFormat::Table.into(),
        sort: top.sort.clone(),
        limit: top.limit,
        interim,
        ..GetReportRequest::default()
    };
    let mut refreshes = 0u64;
    loop {
        let info = client
            .get_session(SessionRef { id: top.id.clone() })
            .await
            .map_err(crate::status_err)?
            .into_inner();
        let running = info.state == i32::from(SessionState::Running);
        let table = match crate::fetch_report(client, request(running)).await {
            Ok(t) => t,
            // It ended between the two calls and its report is being named: next round.
            Err(_) if running => {
                tokio::time::sleep(top.interval).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        refreshes += 1;
        let header = match running {
            true => format!(
                "tracerctl top {} · refresh {refreshes} every {} ms · the report so far (Ctrl-C leaves it running)\n",
                top.id,
                top.interval.as_millis()
            ),
            false => format!("tracerctl top {} · the session ended: its report\n", top.id),
        };
        let mut screen = Vec::with_capacity(table.len() + 256);
        // Home and clear: the next refresh replaces this one.
        if tty {
            screen.extend_from_slice(b"\x1b[H\x1b[2J");
        } else if refreshes > 1 {
            screen.push(b'\n');
        }
        screen.extend_from_slice(header.as_bytes());
        screen.extend_from_slice(&table);
        crate::stdout_bytes(&screen);
        if !running {
            return Ok(ExitCode::SUCCESS);
        }
        tokio::time::sleep(top.interval).await;
    }
}
