//! Off-CPU time's programs (`ebpf/probes/src/offcpu.rs`), on `sched:sched_switch` and
//! `raw_syscalls:sys_exit`: attached while a session records off-CPU time (the second runs
//! at every syscall's exit on the machine), each on one tracepoint perf event: a program on
//! a tracepoint runs wherever the tracepoint fires, whatever CPU its event was opened on.

use std::{
    io,
    os::fd::{AsFd, OwnedFd},
};

use aya::maps::IterableMap;
use tracer_common::{OffCpuConfig, OffCpuThread};

use super::{map_err, programs::perf_link, tracepoints::tracepoint, Bpf, BpfError};

const SWITCH: &str = "tracer_offcpu_switch";
const SYS_EXIT: &str = "tracer_offcpu_sys_exit";
/// Loaded ahead by starts that ask for off-CPU time.
pub(super) const PROGRAMS: [&str; 2] = [SWITCH, SYS_EXIT];

/// The two programs' links and their events; dropping them detaches both.
pub(super) struct Attached {
    // Links before events: closing a link detaches the program.
    links: Vec<OwnedFd>,
    events: Vec<OwnedFd>,
}

/// One session's off-CPU time: of every process or of those it follows; its minimum
/// record (sampling) or event (tracing) in ns; whether it traces (each time away an event
/// on its timeline) rather than samples (records of the time, with stacks).
#[derive(Clone, Copy, Debug)]
pub struct OffCpuSession {
    pub all: bool,
    pub min_ns: u64,
    pub tracing: bool,
}

/// The sessions recording off-CPU time, and the programs while any does.
#[derive(Default)]
pub(super) struct OffCpu {
    /// Slot → how it records off-CPU time.
    sessions: std::collections::BTreeMap<u8, OffCpuSession>,
    attached: Option<Attached>,
}

impl Bpf {
    /// Session `slot` records off-CPU time from now, as `how` says. The programs are
    /// attached at the first.
    pub fn off_cpu_add(&mut self, slot: u8, how: OffCpuSession) -> Result<(), BpfError> {
        if self.off_cpu.attached.is_none() {
            let attached = self.attach_off_cpu()?;
            self.off_cpu.attached = Some(attached);
        }
        self.off_cpu.sessions.insert(slot, how);
        self.write_off_cpu()
    }

    /// Session `slot` records no more off-CPU time; the programs go with the last.
    pub fn off_cpu_remove(&mut self, slot: u8) {
        if self.off_cpu.sessions.remove(&slot).is_none() {
            return;
        }
        if let Err(e) = self.write_off_cpu() {
            tracing::warn!(%e, "off-CPU sessions not updated");
        }
        if self.off_cpu.sessions.is_empty() {
            self.off_cpu.attached = None;
            // What threads carried goes with the last session, not into the next one.
            super::maps::slot_entries(&mut self.offcpu_threads, |_| true, true);
        }
    }

    fn write_off_cpu(&mut self) -> Result<(), BpfError> {
        let mut cfg = OffCpuConfig {
            min_ns: u64::MAX,
            trace_min_ns: u64::MAX,
            ..OffCpuConfig::default()
        };
        for (&slot, s) in &self.off_cpu.sessions {
            // One minimum for all of a kind: a session gets records at least as fine as it
            // asked (a tracing session's events come from the kernel: finer ones are more).
            let (all, slots, min) = match s.tracing {
                true => (
                    &mut cfg.trace_all,
                    &mut cfg.trace_slots,
                    &mut cfg.trace_min_ns,
                ),
                false => (&mut cfg.all, &mut cfg.slots, &mut cfg.min_ns),
            };
            match s.all {
                true => *all |= 1 << slot,
                false => *slots |= 1 << slot,
            }
            *min = (*min).min(s.min_ns);
        }
        self.offcpu_sessions
            .set(0, cfg, 0)
            .map_err(map_err("OFFCPU_SESSIONS"))
    }

    /// Attaches both programs, loaded at once where a start loaded them ahead
    /// ([`Bpf::to_load`]): the verifier's time is not the caller's.
    fn attach_off_cpu(&mut self) -> Result<Attached, BpfError> {
        self.load_programs(&PROGRAMS)?;
        let mut attached = Attached {
            links: Vec::new(),
            events: Vec::new(),
        };
        for (name, category, event) in [
            (SWITCH, "sched", "sched_switch"),
            (SYS_EXIT, "raw_syscalls", "sys_exit"),
        ] {
            let err = |e: io::Error| BpfError::Program {
                name,
                source: Box::new(e),
            };
            let prog = self.programs.fd(name).map_err(err)?;
            let fd = tracepoint(category, event).map_err(err)?;
            attached
                .links
                .push(perf_link(prog.as_fd(), fd.as_fd(), 0).map_err(err)?);
            attached.events.push(fd);
        }
        Ok(attached)
    }

    /// Threads of a session's target start their off-CPU clock now, afresh: a thread
    /// blocked since before the session counts from its start, and nothing an earlier
    /// session left (time carried, a record due) comes in.
    pub fn off_cpu_begin(&mut self, pid: u32, tids: &[u32]) {
        use tracer_common::{off_cpu_fd, OFF_CPU_FD_CALLS};
        use tracer_inspect::process::blocked::{self, FdKind};
        let now = monotonic_ns();
        for &tid in tids {
            // What it waits in, as the switch that took it off would have read it.
            let (syscall, fd_kind) = match blocked::blocked_in(pid, tid) {
                Some((nr, arg0)) if OFF_CPU_FD_CALLS.contains(&(nr as u64)) => {
                    let kind = match blocked::fd_kind(pid, arg0) {
                        FdKind::Pipe => off_cpu_fd::PIPE,
                        FdKind::Socket => off_cpu_fd::SOCKET,
                        FdKind::File => off_cpu_fd::FILE,
                        FdKind::Device => off_cpu_fd::DEVICE,
                        FdKind::Unknown => off_cpu_fd::UNKNOWN,
                    };
                    (nr, kind)
                }
                Some((nr, _)) => (nr, off_cpu_fd::UNKNOWN),
                None => (-1, off_cpu_fd::UNKNOWN),
            };
            let t = OffCpuThread {
                since_ns: now,
                kernel_stack: -1,
                pid,
                syscall,
                fd_kind,
                ..OffCpuThread::default()
            };
            let _ = self.offcpu_threads.insert(tid, t, 0);
        }
    }

    /// Every thread off the CPU now, with its bookkeeping (its process, since when, why):
    /// what a trace's timeline still owes at its end.
    pub fn off_cpu_away(&self) -> Vec<(u32, OffCpuThread)> {
        self.off_cpu_threads()
            .into_iter()
            .filter(|(_, t)| t.since_ns != 0)
            .collect()
    }

    /// Every thread's entry: in batches (a few syscalls for the map's 65,536 entries, where
    /// one at a time took two each), else one at a time.
    fn off_cpu_threads(&self) -> Vec<(u32, OffCpuThread)> {
        match crate::batch::entries(self.offcpu_threads.map().fd().as_fd()) {
            Ok(all) => all,
            Err(e) => {
                tracing::debug!(%e, "batch map reads: reading one entry at a time");
                let tids: Vec<u32> = self.offcpu_threads.keys().filter_map(Result::ok).collect();
                tids.into_iter()
                    .filter_map(|tid| Some((tid, self.offcpu_threads.get(&tid, 0).ok()?)))
                    .collect()
            }
        }
    }

    /// Of `tids`, those off the CPU now and since how long, with the time each carried: what
    /// no record stands for at a session's end.
    pub fn off_cpu_unfinished(&self, tids: &[u32]) -> Vec<(u32, u64)> {
        let now = monotonic_ns();
        tids.iter()
            .filter_map(|&tid| {
                let t = self.offcpu_threads.get(&tid, 0).ok()?;
                let away = match t.since_ns {
                    0 => 0,
                    since => now.saturating_sub(since),
                };
                let ns = away + t.carry_ns + t.due_ns;
                (ns > 0).then_some((tid, ns))
            })
            .collect()
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: `bpf_ktime_get_ns`'s clock.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
