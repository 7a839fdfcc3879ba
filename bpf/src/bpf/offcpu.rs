//! Off-CPU time's programs (`ebpf/probes/src/offcpu.rs`), on `sched:sched_switch` and
//! `raw_syscalls:sys_exit`: loaded at first use, attached while a session records off-CPU
//! time (the second runs at every syscall's exit on the machine).

use aya::programs::{trace_point::TracePointLink, ProgramError, TracePoint};
use tracer_common::{OffCpuConfig, OffCpuThread};

use super::{map_err, Bpf, BpfError};

const SWITCH: &str = "tracer_offcpu_switch";
const SYS_EXIT: &str = "tracer_offcpu_sys_exit";

/// The two programs' links; dropping them detaches both.
pub(super) struct Attached {
    _links: Vec<TracePointLink>,
}

/// The sessions recording off-CPU time, and the programs while any does.
#[derive(Default)]
pub(super) struct OffCpu {
    /// Slot → (of every process, its minimum record in ns).
    sessions: std::collections::BTreeMap<u8, (bool, u64)>,
    attached: Option<Attached>,
}

impl Bpf {
    /// Session `slot` records off-CPU time from now: of every process (`all`) or of those
    /// it follows; `min_ns`, its shortest record. The programs are attached at the first.
    pub fn off_cpu_add(&mut self, slot: u8, all: bool, min_ns: u64) -> Result<(), BpfError> {
        if self.off_cpu.attached.is_none() {
            let attached = self.attach_off_cpu()?;
            self.off_cpu.attached = Some(attached);
        }
        self.off_cpu.sessions.insert(slot, (all, min_ns));
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
        }
    }

    fn write_off_cpu(&mut self) -> Result<(), BpfError> {
        let mut cfg = OffCpuConfig {
            min_ns: u64::MAX,
            ..OffCpuConfig::default()
        };
        for (&slot, &(all, min_ns)) in &self.off_cpu.sessions {
            if all {
                cfg.all |= 1 << slot;
            } else {
                cfg.slots |= 1 << slot;
            }
            // One minimum for all: a session gets records at least as fine as it asked.
            cfg.min_ns = cfg.min_ns.min(min_ns);
        }
        self.offcpu_sessions
            .set(0, cfg, 0)
            .map_err(map_err("OFFCPU_SESSIONS"))
    }

    /// Loads both programs at their first use and attaches them.
    fn attach_off_cpu(&mut self) -> Result<Attached, BpfError> {
        let mut links = Vec::new();
        for (name, category, event) in [
            (SWITCH, "sched", "sched_switch"),
            (SYS_EXIT, "raw_syscalls", "sys_exit"),
        ] {
            let err = |e: ProgramError| BpfError::Program {
                name,
                source: Box::new(e),
            };
            let tp: &mut TracePoint = self
                .ebpf
                .program_mut(name)
                .expect("program in object")
                .try_into()
                .map_err(err)?;
            if tp.fd().is_err() {
                tp.load().map_err(err)?;
            }
            let link = tp.attach(category, event).map_err(err)?;
            links.push(tp.take_link(link).map_err(err)?);
        }
        Ok(Attached { _links: links })
    }

    /// Threads of a session's target start their off-CPU clock now where they have none
    /// running: a thread blocked since before the session is counted from its start.
    pub fn off_cpu_begin(&mut self, tids: &[u32]) {
        let now = monotonic_ns();
        for &tid in tids {
            let running = self.offcpu_threads.get(&tid, 0).ok();
            if running.is_some_and(|t| t.since_ns != 0) {
                continue;
            }
            let t = OffCpuThread {
                since_ns: now,
                ..running.unwrap_or_default()
            };
            let _ = self.offcpu_threads.insert(tid, t, 0);
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
