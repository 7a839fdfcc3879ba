//! Prometheus metrics (`tracerd --metrics tcp://HOST:PORT`, GET /metrics): the daemon's
//! health (sessions, events, losses) and, for counting sessions started with
//! `--export prometheus`, their counts: perf counters, Python calls per function, native
//! calls, CUDA launches per kernel. Text exposition format 0.0.4.

use std::{collections::BTreeMap, fmt::Write as _, net::SocketAddr};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use tracer_proto::{counter, Counter};
use tracer_report::{CudaReport, NativeCalls, PyFunction};

/// One series' value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: &'static str,
    pub labels: Vec<(&'static str, String)>,
    pub value: f64,
}

/// Families in output order: name, type, help.
const FAMILIES: &[(&str, &str, &str)] = &[
    ("tracer_build_info", "gauge", "tracerd's version"),
    ("tracer_sessions", "gauge", "Sessions by state and mode"),
    (
        "tracer_lost_events_total",
        "counter",
        "Events the kernel side could not record, by cause, since tracerd started",
    ),
    (
        "tracer_zeroed_file_pages_total",
        "counter",
        "Pages of files tracerd maps (binaries, counts files) that shrank under it and read as zeros since tracerd started",
    ),
    (
        "tracer_process_loads_total",
        "counter",
        "Loads of tracer's code into running processes since tracerd started, by outcome (loaded, refused on the stopped process, deadline, cancelled, failed, busy: refused for want of a place)",
    ),
    (
        "tracer_refused_total",
        "counter",
        "Connections and requests refused at tracerd's sockets since it started, by kind",
    ),
    (
        "tracer_session_info",
        "gauge",
        "Running sessions and recently finished exported ones",
    ),
    (
        "tracer_session_process_events_total",
        "counter",
        "Forks, execs and exits of followed processes seen by a session",
    ),
    (
        "tracer_session_lost_events_total",
        "counter",
        "Events a session lost, by cause",
    ),
    (
        "tracer_perf_event_total",
        "counter",
        "perf counter totals of exported sessions",
    ),
    (
        "tracer_python_calls_total",
        "counter",
        "Python calls per function (cProfile's ncalls) of exported sessions",
    ),
    (
        "tracer_python_primitive_calls_total",
        "counter",
        "Non-recursive Python calls per function",
    ),
    (
        "tracer_python_tottime_seconds_total",
        "counter",
        "Time in each Python function itself",
    ),
    (
        "tracer_python_cumtime_seconds_total",
        "counter",
        "Time in each Python function and its callees",
    ),
    (
        "tracer_native_calls_total",
        "counter",
        "Native function calls (--uprobe) of exported sessions",
    ),
    (
        "tracer_cuda_launches_total",
        "counter",
        "CUDA kernel launches per entry point and kernel (at session end)",
    ),
    (
        "tracer_gpu_kernel_executions_total",
        "counter",
        "Kernel executions on the GPU per kernel, from CUPTI (--gpu-times)",
    ),
    (
        "tracer_gpu_kernel_seconds_total",
        "counter",
        "GPU execution time per kernel, from CUPTI (--gpu-times)",
    ),
];

impl Sample {
    fn new(name: &'static str, labels: Vec<(&'static str, String)>, value: f64) -> Self {
        debug_assert!(FAMILIES.iter().any(|f| f.0 == name), "{name} has no family");
        Sample {
            name,
            labels,
            value,
        }
    }
}

pub fn build_info() -> Sample {
    Sample::new(
        "tracer_build_info",
        vec![("version", env!("CARGO_PKG_VERSION").into())],
        1.0,
    )
}

pub fn gauge(name: &'static str, labels: Vec<(&'static str, String)>, value: f64) -> Sample {
    Sample::new(name, labels, value)
}

/// An exported session's counts. Python functions and native calls are summed over
/// processes: a series per function, not per pid, keeps `--all` sessions' cardinality bounded.
pub fn session_counts(
    session: &str,
    counters: &[Counter],
    python: &[PyFunction],
    native: &[NativeCalls],
    cuda: Option<&CudaReport>,
) -> Vec<Sample> {
    let s = || ("session", session.to_owned());
    let mut out = Vec::new();
    for c in counters {
        if let Some(counter::Result::Value(v)) = c.result {
            out.push(Sample::new(
                "tracer_perf_event_total",
                vec![s(), ("event", c.event.clone()), ("unit", c.unit.clone())],
                v as f64,
            ));
        }
    }
    let mut py: BTreeMap<(&str, &str, i32), [u64; 4]> = BTreeMap::new();
    for f in python {
        let e = py
            .entry((&f.qualname, &f.filename, f.firstlineno))
            .or_default();
        e[0] += f.ncalls;
        e[1] += f.primitive_calls;
        e[2] += f.tottime_ns;
        e[3] += f.cumtime_ns;
    }
    for ((function, file, line), v) in py {
        let labels = || {
            vec![
                s(),
                ("function", function.to_owned()),
                ("file", file.to_owned()),
                ("line", line.to_string()),
            ]
        };
        out.push(Sample::new(
            "tracer_python_calls_total",
            labels(),
            v[0] as f64,
        ));
        out.push(Sample::new(
            "tracer_python_primitive_calls_total",
            labels(),
            v[1] as f64,
        ));
        out.push(Sample::new(
            "tracer_python_tottime_seconds_total",
            labels(),
            v[2] as f64 / 1e9,
        ));
        out.push(Sample::new(
            "tracer_python_cumtime_seconds_total",
            labels(),
            v[3] as f64 / 1e9,
        ));
    }
    let mut nat: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for n in native {
        *nat.entry((&n.binary, &n.symbol)).or_default() += n.calls;
    }
    for ((binary, symbol), calls) in nat {
        out.push(Sample::new(
            "tracer_native_calls_total",
            vec![
                s(),
                ("binary", binary.to_owned()),
                ("symbol", symbol.to_owned()),
            ],
            calls as f64,
        ));
    }
    if let Some(c) = cuda {
        let mut k: BTreeMap<(&str, &str), u64> = BTreeMap::new();
        for l in &c.launches {
            *k.entry((&l.api, &l.kernel)).or_default() += l.launches;
        }
        for ((api, kernel), n) in k {
            out.push(Sample::new(
                "tracer_cuda_launches_total",
                vec![s(), ("api", api.to_owned()), ("kernel", kernel.to_owned())],
                n as f64,
            ));
        }
        let mut gpu: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for g in &c.gpu_kernels {
            let e = gpu.entry(&g.kernel).or_default();
            e.0 += g.executions;
            e.1 += g.total_ns;
        }
        for (kernel, (n, ns)) in gpu {
            let labels = || vec![s(), ("kernel", kernel.to_owned())];
            out.push(Sample::new(
                "tracer_gpu_kernel_executions_total",
                labels(),
                n as f64,
            ));
            out.push(Sample::new(
                "tracer_gpu_kernel_seconds_total",
                labels(),
                ns as f64 / 1e9,
            ));
        }
    }
    out
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The exposition text: each family's HELP and TYPE, then its series.
pub fn render(samples: &[Sample]) -> String {
    let mut out = String::new();
    for (name, kind, help) in FAMILIES {
        let mine: Vec<&Sample> = samples.iter().filter(|s| s.name == *name).collect();
        if mine.is_empty() {
            continue;
        }
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for s in mine {
            out.push_str(name);
            if !s.labels.is_empty() {
                out.push('{');
                for (i, (k, v)) in s.labels.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let _ = write!(out, "{k}=\"{}\"", escape(v));
                }
                out.push('}');
            }
            let _ = writeln!(out, " {}", s.value);
        }
    }
    out
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("--metrics wants tcp://HOST:PORT, got '{0}'")]
    BadAddress(String),
    #[error("cannot serve metrics on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

pub async fn bind(spec: &str) -> Result<tokio::net::TcpListener, MetricsError> {
    let addr: SocketAddr = spec
        .strip_prefix("tcp://")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| MetricsError::BadAddress(spec.to_owned()))?;
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind {
            addr: addr.to_string(),
            source,
        })
}

/// Serves GET /metrics (HTTP/1.1, one request per connection) until `stop` resolves.
pub async fn serve<F, Fut>(
    listener: tokio::net::TcpListener,
    scrape: F,
    stop: impl std::future::Future<Output = ()>,
) where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = String> + Send,
{
    tokio::pin!(stop);
    loop {
        let (mut conn, _) = tokio::select! {
            _ = &mut stop => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(%e, "accepting a metrics connection");
                    continue;
                }
            },
        };
        let scrape = scrape.clone();
        tokio::spawn(async move {
            // The request head; a scraper sends a few hundred bytes.
            let mut head = Vec::with_capacity(1024);
            let mut buf = [0u8; 1024];
            let read = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                true
            })
            .await;
            if !matches!(read, Ok(true)) {
                return;
            }
            let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
            let line = String::from_utf8_lossy(line);
            let mut parts = line.split_whitespace();
            let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let (status, kind, body) = match (method, path.split('?').next().unwrap_or("")) {
                ("GET", "/metrics") => (
                    "200 OK",
                    "text/plain; version=0.0.4; charset=utf-8",
                    scrape().await,
                ),
                ("GET", _) => ("404 Not Found", "text/plain", "try /metrics\n".into()),
                _ => ("405 Method Not Allowed", "text/plain", "GET only\n".into()),
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(response.as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_groups_families_and_escapes_labels() {
        let f = |pid, n| PyFunction {
            pid,
            qualname: "f".into(),
            filename: "a \"b\".py".into(),
            firstlineno: 3,
            ncalls: n,
            primitive_calls: n,
            tottime_ns: 1_500_000_000,
            cumtime_ns: 2_000_000_000,
            callers: vec![],
        };
        let mut samples = vec![build_info()];
        samples.extend(session_counts("s1", &[], &[f(1, 2), f(2, 3)], &[], None));
        let text = render(&samples);
        assert!(
            text.contains("# TYPE tracer_python_calls_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "tracer_python_calls_total{session=\"s1\",function=\"f\",file=\"a \\\"b\\\".py\",line=\"3\"} 5\n"
            ),
            "{text}"
        );
        assert!(text.contains("tracer_python_tottime_seconds_total{session=\"s1\",function=\"f\",file=\"a \\\"b\\\".py\",line=\"3\"} 3\n"), "{text}");
        assert!(text.starts_with("# HELP tracer_build_info"), "{text}");
    }
}
