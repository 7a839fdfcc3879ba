//! perf counters (perf-event2): which events exist here, and opening them on a session's target.

use std::io;

use perf_event::{
    events::{Hardware, Software},
    Builder, Counter,
};

/// Opens a perf event BPF programs are linked to (`pid` -1: every task; on `cpu`), close
/// on exec: the raw call, for what perf-event2 does not build (uprobes, tracepoints, the
/// sampling clock).
pub fn open_raw(
    attr: &mut perf_event_open_sys::bindings::perf_event_attr,
    pid: i32,
    cpu: i32,
) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    attr.size = std::mem::size_of::<perf_event_open_sys::bindings::perf_event_attr>() as u32;
    // SAFETY: a valid attr (whatever it points to outlives the call, the caller's); no group.
    let fd = unsafe {
        perf_event_open_sys::perf_event_open(
            attr,
            pid,
            cpu,
            -1,
            perf_event_open_sys::bindings::PERF_FLAG_FD_CLOEXEC as u64,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Where a counter set counts.
#[derive(Clone, Debug)]
pub enum Scope {
    /// These threads, with `inherit` so threads and processes they create later are counted too.
    /// `on_exec`: the target is held before its exec; count from the exec on, as `perf stat -- CMD`.
    Threads { tids: Vec<u32>, on_exec: bool },
    /// Every CPU (system-wide).
    Cpus(Vec<usize>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Hardware,
    Software,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Hardware => "hardware",
            Kind::Software => "software",
        }
    }
}

/// An event tracer knows by its `perf stat -e` name.
#[derive(Clone, Copy, Debug)]
pub struct EventSpec {
    pub name: &'static str,
    pub kind: Kind,
    /// "ns" for clocks, "count" otherwise.
    pub unit: &'static str,
    which: Which,
}

#[derive(Clone, Copy, Debug)]
enum Which {
    Hw(Hardware),
    Sw(Software),
}

const fn hw(name: &'static str, e: Hardware) -> EventSpec {
    EventSpec {
        name,
        kind: Kind::Hardware,
        unit: "count",
        which: Which::Hw(e),
    }
}
const fn sw(name: &'static str, unit: &'static str, e: Software) -> EventSpec {
    EventSpec {
        name,
        kind: Kind::Software,
        unit,
        which: Which::Sw(e),
    }
}

/// Every event, in the order reports list them. Aliases map onto these names.
pub const EVENTS: &[EventSpec] = &[
    sw("task-clock", "ns", Software::TASK_CLOCK),
    sw("cpu-clock", "ns", Software::CPU_CLOCK),
    sw("context-switches", "count", Software::CONTEXT_SWITCHES),
    sw("cpu-migrations", "count", Software::CPU_MIGRATIONS),
    sw("page-faults", "count", Software::PAGE_FAULTS),
    sw("minor-faults", "count", Software::PAGE_FAULTS_MIN),
    sw("major-faults", "count", Software::PAGE_FAULTS_MAJ),
    hw("cycles", Hardware::CPU_CYCLES),
    hw("instructions", Hardware::INSTRUCTIONS),
    hw("cache-references", Hardware::CACHE_REFERENCES),
    hw("cache-misses", Hardware::CACHE_MISSES),
    hw("branches", Hardware::BRANCH_INSTRUCTIONS),
    hw("branch-misses", Hardware::BRANCH_MISSES),
];

/// What `--events` means when empty: perf stat's default software set plus the common hardware ones.
pub const DEFAULT_EVENTS: &[&str] = &[
    "task-clock",
    "context-switches",
    "cpu-migrations",
    "page-faults",
    "cycles",
    "instructions",
    "branch-misses",
];

/// Looks an event up by name or perf's aliases (`cs`, `faults`, `migrations`, `branch-instructions`...).
pub fn lookup(name: &str) -> Option<&'static EventSpec> {
    let canonical = match name {
        "cs" => "context-switches",
        "faults" => "page-faults",
        "migrations" => "cpu-migrations",
        "cpu-cycles" => "cycles",
        "branch-instructions" => "branches",
        other => other,
    };
    EVENTS.iter().find(|e| e.name == canonical)
}

impl EventSpec {
    fn builder(&self) -> Builder<'static> {
        let mut b = match self.which {
            Which::Hw(e) => Builder::new(e),
            Which::Sw(e) => Builder::new(e),
        };
        // The daemon runs as root: count kernel time too, as `perf stat` does for root.
        b.exclude_kernel(false).exclude_hv(false);
        b
    }

    /// Opens this event on `scope`: one counter per thread or CPU. Counting starts at once,
    /// or at the target's exec for `Threads { on_exec: true }`.
    pub fn open(&self, scope: &Scope) -> io::Result<Vec<Counter>> {
        let mut counters = Vec::new();
        match scope {
            Scope::Threads { tids, on_exec } => {
                for &tid in tids {
                    let mut b = self.builder();
                    let pid = i32::try_from(tid)
                        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
                    b.observe_pid(pid)
                        .any_cpu()
                        .inherit(true)
                        .enable_on_exec(*on_exec);
                    match b.build() {
                        Ok(c) => counters.push(c),
                        // A thread that ended between listing and opening is not an error.
                        Err(e) if e.raw_os_error() == Some(libc::ESRCH) && !counters.is_empty() => {
                            continue
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            Scope::Cpus(cpus) => {
                for &cpu in cpus {
                    let mut b = self.builder();
                    b.any_pid().one_cpu(cpu);
                    counters.push(b.build()?);
                }
            }
        }
        if !matches!(scope, Scope::Threads { on_exec: true, .. }) {
            for c in &mut counters {
                c.enable()?;
            }
        }
        Ok(counters)
    }

    /// Whether the event can be opened here, and why not: measured by opening it on ourselves.
    pub fn probe(&self) -> Result<(), String> {
        let mut b = self.builder();
        b.observe_self().any_cpu();
        b.build()
            .map(drop)
            .map_err(|e| unavailable_reason(self, &e))
    }
}

/// A one-line reason for an event that cannot be opened.
pub fn unavailable_reason(spec: &EventSpec, e: &io::Error) -> String {
    match (spec.kind, e.raw_os_error()) {
        (Kind::Hardware, Some(libc::ENOENT | libc::EOPNOTSUPP | libc::ENODEV)) => {
            format!("not supported: this machine exposes no hardware PMU counters (perf_event_open: {e})")
        }
        (_, Some(libc::EACCES | libc::EPERM)) => format!("not permitted (perf_event_open: {e})"),
        _ => format!("perf_event_open failed: {e}"),
    }
}

/// A counter's total over all its threads/CPUs, scaled for multiplexing as perf stat does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reading {
    pub value: u64,
    pub time_enabled_ns: u64,
    pub time_running_ns: u64,
}

pub fn read(counters: &mut [Counter]) -> io::Result<Reading> {
    let mut total = Reading::default();
    for c in counters {
        let r = c.read_count_and_time()?;
        total.value += scale(r.count, r.time_enabled, r.time_running);
        total.time_enabled_ns += r.time_enabled;
        total.time_running_ns += r.time_running;
    }
    Ok(total)
}

/// perf stat's scaling: a counter that ran part of the time it was enabled is extrapolated.
fn scale(count: u64, enabled: u64, running: u64) -> u64 {
    if running == 0 || running >= enabled {
        return count;
    }
    u64::try_from(u128::from(count) * u128::from(enabled) / u128::from(running)).unwrap_or(u64::MAX)
}

/// Online CPUs, from sysfs ("0-3,6").
pub fn online_cpus() -> io::Result<Vec<usize>> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online")?;
    parse_cpu_list(text.trim())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad cpu list"))
}

fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,6"), Some(vec![0, 1, 2, 3, 6]));
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn multiplexed_counts_scale_like_perf_stat() {
        assert_eq!(scale(100, 200, 100), 200);
        assert_eq!(scale(100, 100, 100), 100);
        assert_eq!(scale(100, 100, 0), 100);
    }

    #[test]
    fn aliases_resolve() {
        assert_eq!(lookup("cs").map(|e| e.name), Some("context-switches"));
        assert_eq!(lookup("faults").map(|e| e.name), Some("page-faults"));
        assert!(lookup("no-such-event").is_none());
        for name in DEFAULT_EVENTS {
            assert!(lookup(name).is_some(), "{name}");
        }
    }

    #[test]
    fn software_events_count_this_process() {
        let spec = lookup("task-clock").unwrap();
        let mut counters = spec
            .open(&Scope::Threads {
                tids: vec![nix::unistd::gettid().as_raw() as u32],
                on_exec: false,
            })
            .unwrap();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(read(&mut counters).unwrap().value > 0);
    }
}
