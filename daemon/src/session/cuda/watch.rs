//! CUDA across the running sessions: names of kernel handles from the probes' ring, for
//! every CUDA session; the CUDA libraries of the sessions' processes, found as they are
//! mapped or looked for, each a [`CudaJob`] for the manager to run off its task; and which
//! slots the kernel announces executable mappings for.

use std::{collections::HashMap, time::Instant};

use aya::maps::{MapData, RingBuf};
use tracer_common::{cuda_api, CudaNameEvent};

use super::{CudaJob, CudaSession, LOOK_ALL_EVERY, LOOK_EVERY};
use crate::session::{sampling::Sampling, Session};

/// The running sessions, by id.
type Running = HashMap<String, Session>;

/// Libraries to probe, each for a session (by id).
pub type Jobs = Vec<(String, CudaJob)>;

/// An executable file mapping the kernel announced.
pub struct Mapped {
    pub pid: u32,
    pub start: u64,
    pub len: u64,
    /// The file is a CUDA library, and the process is stopped until it is continued.
    pub held: bool,
}

/// Drains the ring of kernel names into every CUDA session (names are per process, any of
/// them may need one). Returns the executable mappings it announced.
pub(in crate::session) fn drain_names(
    ring: &mut RingBuf<MapData>,
    running: &mut Running,
    sampling: &Sampling,
) -> Vec<Mapped> {
    let mut mapped = Vec::new();
    while let Some(item) = ring.next() {
        if item.len() < std::mem::size_of::<CudaNameEvent>() {
            continue;
        }
        // SAFETY: written as a CudaNameEvent by the BPF side; read unaligned.
        let ev = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<CudaNameEvent>()) };
        if ev.api == cuda_api::LIBRARY_MAPPED {
            mapped.push(Mapped {
                pid: ev.pid,
                start: ev.handle,
                len: ev.other,
                held: ev.extra == 1,
            });
            continue;
        }
        for c in running
            .values_mut()
            .filter_map(|s| s.sources.get_mut::<CudaSession>())
        {
            c.on_name(&ev, sampling);
        }
    }
    mapped
}

/// Looks at one process's mappings for the CUDA sessions that watch it (`followers`: the
/// slots the kernel follows it for).
pub(in crate::session) fn look_at(
    pid: u32,
    followers: u64,
    found_by: &str,
    running: &mut Running,
    sampling: &Sampling,
) -> Jobs {
    let mut jobs = Vec::new();
    for s in running.values_mut() {
        let follows = s.follows_pid();
        let followed = s.slot.is_some_and(|slot| followers & (1 << slot) != 0);
        if follows && !followed && !s.live.contains(&pid) {
            continue;
        }
        let Some(c) = s.sources.get_mut::<CudaSession>() else {
            continue;
        };
        let (maps_cuda, found) = c.look(pid, found_by);
        if maps_cuda || follows {
            sampling.watch(pid);
        }
        jobs.extend(found.into_iter().map(|j| (s.id.clone(), j)));
    }
    jobs
}

/// Looks for the CUDA libraries the sessions' processes map: all of them when a session
/// starts (`force`), then as a fallback to the kernel's announcements of new mappings. For
/// sessions following processes, each of theirs (once a `LOOK_EVERY`); for sessions on
/// every process, those in `scanned`. Also says whether a scan of every process is due
/// (once a `LOOK_ALL_EVERY`, with nothing `scanned`).
pub(in crate::session) fn look(
    force: bool,
    scanned: Option<&[u32]>,
    running: &mut Running,
    sampling: &Sampling,
) -> (Jobs, bool) {
    let now = Instant::now();
    let mut scan = false;
    let mut jobs = Vec::new();
    let found_by = if force { "start" } else { "look" };
    for s in running.values_mut() {
        let follows = s.follows_pid();
        let Some(c) = s.sources.get_mut::<CudaSession>() else {
            continue;
        };
        let pids: Vec<u32> = match (follows, scanned) {
            (true, _) => {
                if !force && now < c.next_look {
                    continue;
                }
                c.next_look = now + LOOK_EVERY;
                s.live.iter().copied().collect()
            }
            (false, Some(pids)) => pids.to_vec(),
            (false, None) => {
                if force || now >= c.next_look {
                    c.next_look = now + LOOK_ALL_EVERY;
                    scan = true;
                }
                continue;
            }
        };
        for pid in pids {
            // Launches read their Python call site through the sampling's process table:
            // the followed processes, or (--all) those that map CUDA.
            let (maps_cuda, found) = c.look(pid, found_by);
            if maps_cuda || follows {
                sampling.watch(pid);
            }
            jobs.extend(found.into_iter().map(|j| (s.id.clone(), j)));
        }
    }
    (jobs, scan)
}

/// The slots of CUDA sessions, and of those the ones on every process: their processes'
/// executable mappings are announced.
pub(in crate::session) fn masks(running: &Running) -> (u64, u64) {
    let (mut cuda, mut all) = (0u64, 0u64);
    for s in running.values().filter(|s| s.sources.has::<CudaSession>()) {
        if let Some(slot) = s.slot {
            cuda |= 1 << slot;
            if !s.follows_pid() {
                all |= 1 << slot;
            }
        }
    }
    (cuda, all)
}

/// The processes that map a CUDA library now.
pub fn processes() -> Vec<u32> {
    tracer_inspect::process::pids()
        .into_iter()
        .filter(|&pid| {
            tracer_inspect::unwind::ProcMaps::read(pid).is_ok_and(|maps| {
                maps.entries()
                    .iter()
                    .any(|m| tracer_inspect::cuda::library(std::path::Path::new(&m.path)).is_some())
            })
        })
        .collect()
}
