//! Python across the running sessions: the names of code objects the probes send, which
//! slots count Python, and the processes that run an interpreter, as the manager meets
//! them.

use std::collections::HashMap;

use aya::maps::{MapData, RingBuf};
use tracer_common::PyCodeEvent;
use tracer_inspect::python::memory;
use tracer_proto::target;

use super::{Probes, PySession};
use crate::session::Session;

/// When a session met a process whose interpreter it probes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Met {
    /// At the session's start: probed in place (the start's interpreters were attached
    /// ahead).
    AtStart,
    /// Held at its exec: nothing of the new program has run.
    AtExec,
    /// Found running by the sweep or a scan: it ran unprobed for a while if its interpreter
    /// was not probed then.
    Late,
    /// As `Late`, checked again once its interpreter's probes were attached off the
    /// manager's task: it ran unprobed.
    Unprobed,
}

/// A process that maps an interpreter, as a scan off the manager's task found it: what
/// checking it there would read again (~0.1 ms a process, more for large ones).
#[derive(Clone, Debug)]
pub struct FoundPython {
    pub pid: u32,
    /// Its executable ([`exe_id`]), read before its mappings: if it execs in between, the
    /// next check sees a new executable and looks again.
    pub exe: (u64, u64),
    pub mapped: memory::Mapped,
}

/// The processes that map a Python interpreter now.
pub fn processes() -> Vec<FoundPython> {
    tracer_inspect::process::pids()
        .into_iter()
        .filter_map(|pid| {
            let exe = exe_id(pid);
            let mapped = memory::runtime_of(pid)?;
            Some(FoundPython { pid, exe, mapped })
        })
        .collect()
}

/// Names of code objects the probes met first, into the session of the slot that met them
/// (and its mode: a trace's events).
pub(in crate::session) fn drain_codes(
    ring: &mut RingBuf<MapData>,
    running: &mut HashMap<String, Session>,
    probes: &Probes,
) {
    while let Some(item) = ring.next() {
        if item.len() < std::mem::size_of::<PyCodeEvent>() {
            continue;
        }
        // SAFETY: written as a PyCodeEvent by the BPF side; read unaligned.
        let ev = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<PyCodeEvent>()) };
        let slot = ev.slot;
        let Some(s) = running
            .values_mut()
            .find(|s| s.slot.is_some_and(|x| u32::from(x) == slot))
        else {
            continue;
        };
        if let Some(py) = s.sources.get_mut::<PySession>() {
            py.on_code(&ev, probes);
            if let Some(name) = py.name(ev.pid, ev.code, ev.names) {
                s.measure.named((ev.pid, ev.code, ev.names), name);
            }
        }
    }
}

/// The slots that count Python, and of those the ones on every process.
pub(in crate::session) fn masks(running: &HashMap<String, Session>) -> (u64, u64) {
    let (mut python, mut all) = (0u64, 0u64);
    for s in running.values().filter(|s| s.sources.has::<PySession>()) {
        if let Some(slot) = s.slot {
            python |= 1 << slot;
            if matches!(s.target.kind, Some(target::Kind::All(_))) {
                all |= 1 << slot;
            }
        }
    }
    (python, all)
}

/// Identity of the executable a process runs now (changes on exec).
pub fn exe_id(pid: u32) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/exe")).map_or((0, 0), |m| (m.dev(), m.ino()))
}
