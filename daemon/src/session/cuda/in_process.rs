//! `--cuda-in-process`: the target's kernel launches are counted inside it by tracer's
//! injection library (CUPTI's launch callbacks, `daemon/cupti/src/launches.rs`), in a table
//! tracerd maps; the target's libraries get no kernel-launch probes from this session (its
//! graphs, copies, allocations and naming calls keep theirs). Other processes the session
//! follows get launch probes on their first CUDA mapping, which skip the target
//! (`CUDA_INPROC`), so no launch is counted twice. The session's launches are the table's
//! counts since its start; their names come from CUPTI, their callers and call sites are
//! named as the probes' are.

use tracer_common::{cuda_api as api, CudaLaunchKey};
use tracer_inspect::cuda;

use super::{gpu_times::InProcess, CudaSession};

/// A kernel launch (not a graph): the entry points the library counts.
pub(super) fn kernel_launch(which: u32) -> bool {
    matches!(
        which,
        api::CU_LAUNCH | api::CU_LAUNCH_EX | api::CUDA_LAUNCH | api::CUDA_LAUNCH_EX
    )
}

/// Which of a library's entry points a job attaches.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Points {
    All,
    /// The in-process target's: no kernel launches.
    NoKernelLaunches,
    /// Kernel launches alone: for another process mapping a library probed for the target.
    KernelLaunchesOnly,
}

impl Points {
    pub(super) fn keeps(self, which: u32) -> bool {
        match self {
            Self::All => true,
            Self::NoKernelLaunches => !kernel_launch(which),
            Self::KernelLaunchesOnly => kernel_launch(which),
        }
    }
}

/// The target's table, once the library counts.
pub(super) struct Counted {
    pub pid: u32,
    pub inproc: InProcess,
}

impl CudaSession {
    /// The launch table came with the GPU times the job turned on: the process to mark in
    /// `CUDA_INPROC` for this session's slot.
    pub(super) fn counting_in_process(&mut self, pid: u32, inproc: InProcess) -> (u32, u8) {
        self.in_process = Some(Counted { pid, inproc });
        (pid, self.slot)
    }

    /// The session's in-process launches so far (slot and pid filled in), and how many
    /// launches the table had no room for.
    pub(super) fn in_process_counts(&self) -> (Vec<(CudaLaunchKey, u64)>, u64) {
        let Some(c) = self.in_process.as_ref() else {
            return (Vec::new(), 0);
        };
        let counts = c.inproc.table.read().since(&c.inproc.base);
        let rows = counts
            .rows
            .iter()
            .map(|r| {
                let mut key = r.key;
                (key.slot, key.pid) = (u32::from(self.slot), c.pid);
                (key, r.count)
            })
            .collect();
        (rows, counts.full)
    }

    /// [`Self::in_process_counts`], with what the rows' announcements (`CUPTI_ROW`) left
    /// unnamed looked up now, where the process may still be read: at the end.
    pub(super) fn in_process_rows(&mut self) -> (Vec<(CudaLaunchKey, u64)>, u64) {
        let Some(c) = self.in_process.as_ref() else {
            return (Vec::new(), 0);
        };
        let counts = c.inproc.table.read().since(&c.inproc.base);
        let pid = c.pid;
        for r in &counts.rows {
            if r.name != 0 && !self.cupti_names.contains_key(&(pid, r.key.func)) {
                if let Some(name) = cuda::name_in_process(pid, r.name) {
                    self.cupti_names.insert((pid, r.key.func), name);
                }
            }
        }
        let (rows, full) = self.in_process_counts();
        let callers: Vec<u64> = rows.iter().map(|(k, _)| k.caller).collect();
        self.callers.locate(pid, &callers);
        let version = self.in_process.as_ref().and_then(|c| c.inproc.python);
        for (k, _) in &rows {
            let site = (k.pid, k.py_code, k.py_instr, k.py_names);
            if k.py_code == 0 || self.call_sites.contains_key(&site) {
                continue;
            }
            let Some(v) = version else { continue };
            if let Some((q, f, line)) =
                tracer_symbolize::python_location(pid, k.py_code, k.py_instr, k.py_names, v)
            {
                self.call_sites.insert(site, format!("{q} ({f}:{line})"));
            }
        }
        (rows, full)
    }

    /// CUPTI's name for an in-process row's handle.
    pub(super) fn cupti_name(&self, pid: u32, func: u64) -> Option<&str> {
        self.cupti_names.get(&(pid, func)).map(String::as_str)
    }
}
