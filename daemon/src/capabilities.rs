//! What this machine and daemon can do, measured once at start.

use std::path::Path;

use tracer_proto::{Capabilities, Interpreter, Mode, PerfEventSupport};

use tracer_bpf::perf;
use tracer_inspect::python;

pub fn measure(
    bpf_loaded: bool,
    probe_limits: &tracer_inspect::native::ProbeLimits,
) -> Capabilities {
    let perf_events: Vec<PerfEventSupport> = perf::EVENTS
        .iter()
        .map(|e| {
            let res = e.probe();
            PerfEventSupport {
                name: e.name.into(),
                kind: e.kind.as_str().into(),
                available: res.is_ok(),
                reason: res.err().unwrap_or_default(),
            }
        })
        .collect();
    let hardware_counters = perf_events
        .iter()
        .any(|e| e.kind == "hardware" && e.available);
    let interpreters = python::discover::interpreters()
        .into_iter()
        .map(|i| Interpreter {
            path: i.path.display().to_string(),
            version: i.version,
            runtime_path: i.runtime.display().to_string(),
            symbols: if i.full_symbols { "full" } else { "dynamic" }.into(),
            support: match python::runtime::Runtime::inspect(&i.runtime) {
                Ok(rt) if rt.resume.is_empty() => "calls counted exactly (eval-loop entry)".into(),
                Ok(rt) => format!(
                    "calls counted exactly (probes on {}; opcode table by {}; layout from {}){}",
                    rt.resume
                        .iter()
                        .map(|p| short_probe(&p.what))
                        .collect::<Vec<_>>()
                        .join(", "),
                    rt.table_found_by,
                    rt.version.source,
                    if rt.jit_built_in {
                        "; experimental JIT built in: counts are not exact in processes that turn it on (PYTHON_JIT=1)"
                    } else {
                        ""
                    }
                ),
                Err(e) => match python::runtime::Runtime::inspect_layout(&i.runtime) {
                    Ok(_) => format!("sampled only: {e}"),
                    Err(_) => format!("not supported: {e}"),
                },
            },
        })
        .collect();
    let (gpus, gpus_unavailable) = match crate::gpu::devices() {
        Ok(gpus) => (gpus, String::new()),
        Err(why) => (Vec::new(), why),
    };
    Capabilities {
        daemon_version: env!("CARGO_PKG_VERSION").into(),
        kernel_release: kernel_release(),
        btf: Path::new("/sys/kernel/btf/vmlinux").exists(),
        bpf: bpf_loaded,
        tracefs: Path::new(tracer_bpf::TRACEFS).join("events").exists(),
        hardware_counters,
        perf_events,
        interpreters,
        modes: vec![
            Mode::Counting.into(),
            Mode::Sampling.into(),
            Mode::Tracing.into(),
        ],
        perf_event_paranoid: std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(-100),
        // Set per answer.
        now_unix_ns: 0,
        gpus,
        gpus_unavailable,
        probe_limits: probe_limits.describe(),
        session_limits: crate::session::slots::Slots::describe(),
        // Known to the loaded BPF object: set by the caller.
        uprobe_links: String::new(),
        python_in_process: tracer_inspect::python::inproc::describe(),
    }
}

/// `RESUME handler +0x18: first emulated …` → `RESUME+0x18`, marking the
/// probes the kernel must single-step since those cost ≈5× more per call.
fn short_probe(what: &str) -> String {
    let (place, how) = what.split_once(": ").unwrap_or((what, ""));
    let place = place.replace(" handler +", "+");
    if how.contains("single-stepped") {
        format!("{place} (single-stepped)")
    } else {
        place
    }
}

/// `uname -r`, or empty where it cannot be had.
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}
