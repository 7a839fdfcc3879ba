//! Fetching a session's report and writing it where it was asked to go.

use anyhow::{Context, Result};
use tokio_stream::StreamExt;
use tracer_proto::{GetReportRequest, ReportFormat};

use crate::{client, status_err, stdout_bytes, FormatArg, Output};

pub fn report_request(id: String, out: &Output, format: ReportFormat) -> GetReportRequest {
    GetReportRequest {
        id,
        format: format.into(),
        sort: out.sort.clone(),
        limit: out.limit,
        pids: out.filter_pids.clone(),
        tids: out.filter_tids.clone(),
        comm: out.filter_comm.clone().unwrap_or_default(),
        gil_held: out.gil,
        interim: false,
    }
}

pub async fn report(
    client: &mut client::Client,
    id: String,
    out: &Output,
    interim: bool,
) -> Result<()> {
    let format = match out.format {
        FormatArg::Table => ReportFormat::Table,
        FormatArg::Json => ReportFormat::Json,
        FormatArg::Pstats => ReportFormat::Pstats,
        FormatArg::Folded => ReportFormat::Folded,
        FormatArg::Pprof => ReportFormat::Pprof,
        FormatArg::Otlp => ReportFormat::Otlp,
        FormatArg::Speedscope => ReportFormat::Speedscope,
        FormatArg::Svg => ReportFormat::Svg,
        FormatArg::Chrome => ReportFormat::Chrome,
        FormatArg::Perfetto => ReportFormat::Perfetto,
        FormatArg::Kernels => ReportFormat::Kernels,
    };
    let mut req = report_request(id, out, format);
    req.interim = interim;
    let data = fetch_report(client, req).await?;
    write_output(&data, out.output.as_deref())
}

/// A report, whole.
pub async fn fetch_report(client: &mut client::Client, req: GetReportRequest) -> Result<Vec<u8>> {
    let mut stream = client
        .get_report(req)
        .await
        .map_err(status_err)?
        .into_inner();
    let mut data = Vec::new();
    while let Some(chunk) = stream.next().await {
        data.extend(chunk.map_err(status_err)?.data);
    }
    Ok(data)
}

/// Writes to `-o FILE`, or standard output.
pub fn write_output(data: &[u8], output: Option<&std::path::Path>) -> Result<()> {
    match output {
        Some(path) => {
            std::fs::write(path, data).with_context(|| format!("writing {}", path.display()))
        }
        None => {
            stdout_bytes(data);
            Ok(())
        }
    }
}
