//! Attaching one CUDA library's probes for one session, off the manager's task; for tracer's
//! injection library, loading it and turning GPU times on once they are in.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use tracer_bpf::{CudaAttacher, ProbeSet};
use tracer_inspect::cuda;
use tracer_inspect::unwind::ProcMaps;

use super::{gpu_times, LibraryId};

pub(super) use cuda::INJECTION_LIBRARY as INJECTION;

/// Attaching one CUDA library's probes for one session, on a thread other than the
/// manager's: its symbol table is read (libcuda's is large) and its probes attached.
pub struct CudaJob {
    /// The session's slot, which its probes count into.
    pub slot: u8,
    pub(super) id: LibraryId,
    /// Where the file is reachable from here.
    pub(super) path: std::path::PathBuf,
    /// Its path in the process.
    pub(super) mapped: String,
    pub(super) pid: u32,
    pub(super) found_by: String,
    /// (symbol, cookie, read at return) of each entry point to probe.
    pub(super) points: Vec<(&'static str, u64, bool)>,
    /// tracer's injection library: GPU times turned on once its probes are in.
    pub(super) enable: Option<gpu_times::Enable>,
    /// The launch probes of a library probed without them, for a process whose launches
    /// could not be counted in-process after all.
    pub(super) launches_after_all: bool,
}

/// What [`CudaJob::run`] attached.
pub struct CudaProbed {
    pub job: CudaJob,
    pub links: ProbeSet,
    pub(super) warning: Option<String>,
    /// How long resolving and attaching took.
    pub(super) took: Duration,
    /// What turning GPU times on came to, where the job did.
    pub(super) enabled: Option<Result<gpu_times::Enabled, String>>,
}

impl CudaProbed {
    /// The process whose GPU times the job turned on, if it did.
    pub fn turned_on(&self) -> Option<u32> {
        matches!(self.enabled, Some(Ok(gpu_times::Enabled::On(..)))).then_some(self.job.pid)
    }
}

impl CudaJob {
    /// Resolves the entry points and attaches them: all of a library's probes or none (a
    /// library that does not load fails on every entry point, and says it once).
    pub fn run(self, attacher: &CudaAttacher) -> CudaProbed {
        let began = Instant::now();
        let symbols: Vec<&str> = self.points.iter().map(|p| p.0).collect();
        let mut warning = None;
        let offsets =
            tracer_inspect::native::resolve_exact(&self.path, &symbols).unwrap_or_else(|e| {
                warning = Some(format!("{}: {e}", self.mapped));
                HashMap::new()
            });
        // Not every version exports every variant.
        let probes: Vec<(u64, u64, bool)> = self
            .points
            .iter()
            .filter_map(|&(symbol, cookie, at_return)| {
                Some((*offsets.get(symbol)?, cookie, at_return))
            })
            .collect();
        let links = match attacher.attach(&self.path, &probes) {
            Ok(set) => set,
            Err(e) => {
                warning.get_or_insert_with(|| format!("{}: {e}", self.mapped));
                ProbeSet::default()
            }
        };
        let enabled = self
            .enable
            .as_ref()
            .map(|e| match (&warning, links.is_empty()) {
                (None, false) => e.run(),
                (w, _) => Err(format!(
                "{INJECTION}'s probes could not be attached, so its records would go unseen: {}",
                w.as_deref().unwrap_or("no entry point found")
            )),
            });
        CudaProbed {
            job: self,
            links,
            warning,
            took: began.elapsed(),
            enabled,
        }
    }
}

/// The CUPTI injection library's status line in `pid`, mapping the library `id` at `path`
/// (`maps`: the process's mappings, read here if not given).
pub(super) fn injection_status(
    pid: u32,
    path: &std::path::Path,
    id: LibraryId,
    maps: Option<&ProcMaps>,
) -> String {
    let read;
    let maps = match maps {
        Some(m) => Ok(m),
        None => {
            read = ProcMaps::read(pid);
            read.as_ref().map_err(ToString::to_string)
        }
    };
    let status = maps.and_then(|maps| {
        let mine: Vec<_> = maps
            .entries()
            .iter()
            .filter(|e| (e.dev.0, e.dev.1, e.inode) == id)
            .collect();
        cuda::injection_status(pid, path, &mine)
    });
    status.unwrap_or_else(|e| format!("error: its status could not be read: {e}"))
}
