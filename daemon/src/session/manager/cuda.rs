//! The manager's CUDA: kernel names from the probes' ring, and the CUDA libraries of the
//! sessions' processes found as they are mapped, and probed off this task (reading
//! libcuda's symbol table and attaching its probes would hold every request meanwhile).

use std::time::Instant;

use aya::maps::{MapData, RingBuf};

use super::{cuda_processes, Done, Manager};
use crate::session::cuda::{CudaJob, CudaProbed};

impl Manager {
    pub(super) fn drain_kernel_names(&mut self, ring: &mut RingBuf<MapData>) {
        let mut mapped: Vec<(u32, u64, u64)> = Vec::new();
        while let Some(item) = ring.next() {
            if item.len() < std::mem::size_of::<tracer_common::CudaNameEvent>() {
                continue;
            }
            // SAFETY: written as a CudaNameEvent by the BPF side; read unaligned.
            let ev = unsafe {
                std::ptr::read_unaligned(item.as_ptr().cast::<tracer_common::CudaNameEvent>())
            };
            if ev.api == tracer_common::cuda_api::LIBRARY_MAPPED {
                mapped.push((ev.pid, ev.handle, ev.other));
                continue;
            }
            // Names are per process: every CUDA session may keep them.
            for s in self.running.values_mut() {
                if let Some(c) = s.cuda.as_mut() {
                    c.on_name(&ev, &self.sampling);
                }
            }
        }
        // Looked at now, before the process gets far (the ring's reader is woken per
        // mapping); the probes go on as soon as a blocking thread has attached them.
        for (pid, addr, len) in mapped {
            if tracer_inspect::cuda::mapped_library(pid, addr, len) {
                self.look_at(pid, "mmap");
            }
        }
    }

    /// Looks at one process's mappings for the CUDA sessions that watch it.
    pub(super) fn look_at(&mut self, pid: u32, found_by: &str) {
        let followers = self.bpf.followers(pid);
        let mut jobs = Vec::new();
        for s in self.running.values_mut() {
            let follows = s.follows_pid();
            let followed = s.slot.is_some_and(|slot| followers & (1 << slot) != 0);
            if follows && !followed && !s.live.contains(&pid) {
                continue;
            }
            let Some(c) = s.cuda.as_mut() else { continue };
            let (maps_cuda, found) = c.look(pid, found_by);
            if maps_cuda || follows {
                self.sampling.watch(pid);
            }
            jobs.extend(found.into_iter().map(|j| (s.id.clone(), j)));
        }
        self.probe_cuda(jobs);
    }

    /// Attaches libraries' probes on blocking threads; each comes back as `CudaProbed`.
    fn probe_cuda(&self, jobs: Vec<(String, CudaJob)>) {
        for (session, job) in jobs {
            let attacher = self.bpf.cuda_attacher();
            let tx = self.done.clone();
            tokio::task::spawn_blocking(move || {
                let probed = job.run(&attacher);
                // A manager gone (shutdown) drops the probes here, off its task.
                let _ = tx.send(Done::CudaProbed { session, probed });
            });
        }
    }

    /// A library's probes are in: the session's, if it still runs (and its start is answered
    /// once its libraries are probed); else they come off, and the slot it held is let go
    /// once they are (`CudaReleased`).
    pub(super) fn cuda_probed(&mut self, session: &str, probed: CudaProbed) {
        if let Some(c) = self.running.get_mut(session).and_then(|s| s.cuda.as_mut()) {
            c.adopt(probed);
            if !c.probing() {
                if let Some(start) = self.starts.cuda_probing.remove(session) {
                    self.record(start.info, start.record, start.reply);
                }
            }
            return;
        }
        let slot = probed.job.slot;
        if probed.links.is_empty() {
            // Nothing to wait for (`release` would call back on this task).
            self.cuda_released(slot);
            return;
        }
        let tx = self.done.clone();
        tracer_bpf::bpf::release(vec![probed.links], move || {
            let _ = tx.send(Done::CudaReleased(slot));
        });
    }

    /// Probes that came back after their session ended are off: what they counted goes
    /// once the slot is free, and the slot is let go.
    pub(super) fn cuda_released(&mut self, slot: u8) {
        self.to_drain |= 1 << slot;
        self.let_go(slot);
    }

    /// Probes the CUDA libraries the sessions' processes map: all of them when a session
    /// starts (`force`), then as a fallback to the kernel's announcements of new mappings.
    /// For sessions following processes, each of theirs (once a `LOOK_EVERY`); for sessions
    /// on every process, those in `scanned`, else a scan of every process off this task is
    /// asked for once a `LOOK_ALL_EVERY` (it comes back as `CudaScanned`).
    pub(super) fn look_for_cuda(&mut self, force: bool, scanned: Option<&[u32]>) {
        let now = Instant::now();
        let mut scan = false;
        let mut jobs = Vec::new();
        for s in self.running.values_mut() {
            let follows = s.follows_pid();
            let Some(c) = s.cuda.as_mut() else { continue };
            let found_by = if force { "start" } else { "look" };
            let pids: Vec<u32> = match (follows, scanned) {
                (true, _) => {
                    if !force && now < c.next_look {
                        continue;
                    }
                    c.next_look = now + crate::session::cuda::LOOK_EVERY;
                    s.live.iter().copied().collect()
                }
                (false, Some(pids)) => pids.to_vec(),
                (false, None) => {
                    if force || now >= c.next_look {
                        c.next_look = now + crate::session::cuda::LOOK_ALL_EVERY;
                        scan = true;
                    }
                    continue;
                }
            };
            for pid in pids {
                // Launches read their Python call site through the sampling's process
                // table: the followed processes, or (--all) those that map CUDA.
                let (maps_cuda, found) = c.look(pid, found_by);
                if maps_cuda || follows {
                    self.sampling.watch(pid);
                }
                jobs.extend(found.into_iter().map(|j| (s.id.clone(), j)));
            }
        }
        self.probe_cuda(jobs);
        if scan && !self.scans.cuda {
            self.scans.cuda = true;
            let tx = self.done.clone();
            tokio::task::spawn_blocking(move || {
                let _ = tx.send(Done::CudaScanned(cuda_processes()));
            });
        }
    }

    /// Which slots' processes have their executable mappings announced (CUDA sessions).
    pub(super) fn update_cuda_masks(&mut self) {
        let (mut cuda, mut all) = (0u64, 0u64);
        for s in self.running.values().filter(|s| s.cuda.is_some()) {
            if let Some(slot) = s.slot {
                cuda |= 1 << slot;
                if !s.follows_pid() {
                    all |= 1 << slot;
                }
            }
        }
        if let Err(e) = self.bpf.set_cuda_sessions(cuda, all) {
            tracing::error!(%e, "updating CUDA session masks");
        }
    }
}
