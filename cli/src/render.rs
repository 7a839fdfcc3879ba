//! Plain-text views of sessions and capabilities. Strings from the daemon go through
//! `esc` where they are formatted: they may carry names a traced process chose.

use std::fmt::Write as _;

use tracer_proto::{counter, target, Capabilities, EndReason, Mode, SessionInfo, SessionState};
use tracer_report::escape_controls as esc;

pub fn mode(m: i32) -> &'static str {
    match Mode::try_from(m) {
        Ok(Mode::Counting) => "counting",
        Ok(Mode::Sampling) => "sampling",
        Ok(Mode::Tracing) => "tracing",
        _ => "?",
    }
}

pub fn state(s: &SessionInfo) -> String {
    let reason = match EndReason::try_from(s.end_reason) {
        Ok(EndReason::Stopped) => " (stopped)",
        Ok(EndReason::Duration) => " (duration reached)",
        Ok(EndReason::TargetExited) => " (target exited)",
        Ok(EndReason::DaemonShutdown) => " (daemon shut down)",
        Ok(EndReason::Error) => " (error)",
        _ => "",
    };
    let name = match SessionState::try_from(s.state) {
        Ok(SessionState::Running) => "running",
        Ok(SessionState::Finished) => "finished",
        Ok(SessionState::Failed) => "failed",
        _ => "?",
    };
    format!("{name}{reason}")
}

pub fn target(s: &SessionInfo) -> String {
    match s.target.and_then(|t| t.kind) {
        Some(target::Kind::Pid(p)) => format!("pid {p}"),
        Some(target::Kind::All(_)) => "all".into(),
        None => "-".into(),
    }
}

fn secs(ms: u64) -> String {
    format!("{:.1}s", ms as f64 / 1000.0)
}

pub fn list(sessions: &[SessionInfo]) -> String {
    let mut out = format!(
        "{:<14} {:<9} {:<12} {:>9}  {}\n",
        "ID", "MODE", "TARGET", "ELAPSED", "STATE"
    );
    for s in sessions {
        let _ = writeln!(
            out,
            "{:<14} {:<9} {:<12} {:>9}  {}",
            esc(&s.id),
            mode(s.mode),
            target(s),
            secs(s.elapsed_ms),
            state(s)
        );
    }
    out
}

pub fn status(s: &SessionInfo) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "session:   {}", esc(&s.id));
    let _ = writeln!(out, "mode:      {}", mode(s.mode));
    let _ = writeln!(out, "target:    {}", target(s));
    let _ = writeln!(out, "state:     {}", state(s));
    if !s.started_by.is_empty() {
        let _ = writeln!(out, "by:        {}", esc(&s.started_by));
    }
    if !s.error.is_empty() {
        let _ = writeln!(out, "error:     {}", esc(&s.error));
    }
    let dur = if s.duration_ms > 0 {
        format!(" of {}", secs(s.duration_ms))
    } else {
        String::new()
    };
    let _ = writeln!(out, "elapsed:   {}{dur}", secs(s.elapsed_ms));
    if matches!(s.target.and_then(|t| t.kind), Some(target::Kind::All(_))) {
        let _ = writeln!(out, "processes: the whole machine (system-wide)");
    } else {
        let _ = writeln!(
            out,
            "processes: {} live, {} exited",
            s.live_processes, s.exited_processes
        );
    }
    let _ = writeln!(out, "events:    {}", s.events);
    if s.mode == tracer_proto::Mode::Tracing as i32 {
        let _ = writeln!(
            out,
            "trace:     {} events, {:.1} MiB",
            s.trace_events,
            s.trace_bytes as f64 / (1u64 << 20) as f64
        );
    }
    if s.profiles_pushed + s.push_failures + s.profiles_dropped > 0 {
        let _ = writeln!(
            out,
            "pushed:    {} profiles, {} failed pushes (retried), {} dropped",
            s.profiles_pushed, s.push_failures, s.profiles_dropped
        );
        if !s.last_push_error.is_empty() {
            let _ = writeln!(out, "push error: {}", esc(&s.last_push_error));
        }
    }
    let losses = if s.losses.is_empty() {
        "none".to_owned()
    } else {
        s.losses
            .iter()
            .map(|l| format!("{} {}", l.count, esc(&l.cause)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(out, "losses:    {losses}");
    for c in &s.counters {
        match &c.result {
            Some(counter::Result::Value(v)) => {
                let _ = writeln!(
                    out,
                    "  {:<18} {v} {}",
                    esc(&c.event),
                    if c.unit == "ns" { "ns" } else { "" }
                );
            }
            Some(counter::Result::Unavailable(why)) => {
                let _ = writeln!(out, "  {:<18} unavailable: {}", esc(&c.event), esc(why));
            }
            None => {}
        }
    }
    out
}

/// One line for a terminal's live progress.
pub fn progress(s: &SessionInfo) -> String {
    let lost: u64 = s.losses.iter().map(|l| l.count).sum();
    let events = if s.mode == tracer_proto::Mode::Tracing as i32 {
        s.trace_events
    } else {
        s.events
    };
    format!(
        "[tracer {}] {} elapsed · {} processes · {} events · {} lost",
        esc(&s.id),
        secs(s.elapsed_ms),
        s.live_processes,
        events,
        lost
    )
}

pub fn capabilities(c: &Capabilities) -> String {
    let yes = |b: bool| if b { "yes" } else { "no" };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "tracerd {}  kernel {}",
        c.daemon_version, c.kernel_release
    );
    let _ = writeln!(
        out,
        "BPF: {}  BTF: {}  tracefs: {}  perf_event_paranoid: {}",
        yes(c.bpf),
        yes(c.btf),
        yes(c.tracefs),
        c.perf_event_paranoid
    );
    let modes: Vec<&str> = c.modes.iter().map(|m| mode(*m)).collect();
    let _ = writeln!(out, "modes: {}", modes.join(", "));
    let _ = writeln!(out, "hardware counters: {}", yes(c.hardware_counters));
    let _ = writeln!(out, "\nperf events:");
    for e in &c.perf_events {
        let state = if e.available {
            "available".to_owned()
        } else {
            format!("unavailable: {}", e.reason)
        };
        let _ = writeln!(out, "  {:<18} {:<9} {state}", e.name, e.kind);
    }
    match (c.gpus.is_empty(), c.gpus_unavailable.as_str()) {
        (false, _) => {
            let _ = writeln!(out, "GPUs (NVML): {}", c.gpus.join(", "));
        }
        (true, "") => {
            let _ = writeln!(out, "GPUs (NVML): none");
        }
        (true, why) => {
            let _ = writeln!(out, "GPUs: unavailable: {why}");
        }
    }
    if !c.probe_limits.is_empty() {
        let _ = writeln!(out, "{}", c.probe_limits);
    }
    if !c.session_limits.is_empty() {
        let _ = writeln!(out, "{}", c.session_limits);
    }
    if !c.python_in_process.is_empty() {
        let _ = writeln!(out, "python in-process: {}", c.python_in_process);
    }
    if !c.uprobe_links.is_empty() {
        let _ = writeln!(out, "uprobes: {}", c.uprobe_links);
    }
    let _ = writeln!(out, "\nPython interpreters:");
    if c.interpreters.is_empty() {
        let _ = writeln!(out, "  none found on PATH");
    }
    for i in &c.interpreters {
        let _ = writeln!(
            out,
            "  {:<5} {}  (eval loop in {}, {} symbols) {}",
            esc(&i.version),
            esc(&i.path),
            esc(&i.runtime_path),
            i.symbols,
            esc(&i.support)
        );
    }
    out
}

/// One line per live event, as `tracerctl watch` prints them.
pub fn event(e: &tracer_proto::TraceEvent) -> String {
    use tracer_proto::trace_event::Kind;
    let at = format!(
        "{}.{:06}",
        e.start_ns / 1_000_000_000,
        e.start_ns / 1000 % 1_000_000
    );
    match e.kind() {
        Kind::PythonCall => format!(
            "{at} {:>7}/{:<7} py     {} ({}:{}) {:.3} ms{}",
            e.pid,
            e.tid,
            esc(&e.name),
            esc(&e.file),
            e.line,
            e.end_ns.saturating_sub(e.start_ns) as f64 / 1e6,
            if e.exit_inferred {
                " [exit inferred]"
            } else {
                ""
            }
        ),
        Kind::NativeCall => format!("{at} {:>7}/{:<7} native {}", e.pid, e.tid, esc(&e.name)),
        Kind::Counter => format!(
            "{at} {:>7}         counter {} = {}",
            e.pid,
            esc(&e.name),
            e.value
        ),
        Kind::CudaLaunch => format!("{at} {:>7}/{:<7} cuda   {}", e.pid, e.tid, esc(&e.name)),
        Kind::CudaMemory => format!(
            "{at} {:>7}/{:<7} cuda   {} {} bytes",
            e.pid,
            e.tid,
            esc(&e.name),
            e.value
        ),
        Kind::GpuKernel => format!(
            "{at} {:>7}         gpu    {} {:.3} ms",
            e.pid,
            esc(&e.name),
            e.end_ns.saturating_sub(e.start_ns) as f64 / 1e6
        ),
        Kind::OffCpu => format!(
            "{at} {:>7}/{:<7} away   {} {:.3} ms",
            e.pid,
            e.tid,
            esc(&e.name),
            e.end_ns.saturating_sub(e.start_ns) as f64 / 1e6
        ),
        Kind::Unspecified => format!("{at} {:>7}/{:<7} ?", e.pid, e.tid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracer_proto::{trace_event::Kind, Loss, TraceEvent};

    #[test]
    fn names_from_the_daemon_are_escaped() {
        let evil = "evil\x1b[2Jname\n\u{9b}31m";
        let escaped = "evil\\x1b[2Jname\\n\\u{9b}31m";
        let call = event(&TraceEvent {
            kind: Kind::PythonCall.into(),
            name: evil.into(),
            file: evil.into(),
            line: 3,
            ..Default::default()
        });
        assert!(call.contains(&format!("{escaped} ({escaped}:3)")), "{call}");
        let s = SessionInfo {
            id: "s1".into(),
            error: evil.into(),
            losses: vec![Loss {
                cause: evil.into(),
                count: 1,
            }],
            ..Default::default()
        };
        let status = status(&s);
        assert!(
            status.contains(&format!("error:     {escaped}\n")),
            "{status}"
        );
        for text in [call, status, list(&[s])] {
            assert!(
                !text.chars().any(|c| c.is_control() && c != '\n'),
                "{text:?}"
            );
        }
    }
}
