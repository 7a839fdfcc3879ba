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
use tracer_inspect::python::layout::Version;
use tracer_report::LaunchCounting;

use super::{
    gpu_times::{Ask, Enabled, InProcess, Launches, State},
    CudaJob, CudaSession,
};

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
            Self::NoKernelLaunches => !api::is_kernel_launch(which),
            Self::KernelLaunchesOnly => api::is_kernel_launch(which),
        }
    }
}

/// The target's table, once the library counts.
pub(super) struct Counted {
    pub pid: u32,
    pub inproc: InProcess,
    /// A tracing session's: the thread moving its launch events into the trace.
    pub drainer: Option<super::events::Drainer>,
}

impl CudaSession {
    /// The launch table came with the GPU times the job turned on: the process to mark in
    /// `CUDA_INPROC` for this session's slot.
    pub(super) fn counting_in_process(&mut self, pid: u32, mut inproc: InProcess) -> (u32, u8) {
        let drainer = match (&self.timeline, inproc.events.take()) {
            (Some(timeline), Some(from)) => {
                let table = inproc.table.clone();
                match super::events::Drainer::start(pid, table, from, timeline.clone()) {
                    Ok(d) => Some(d),
                    Err(e) => {
                        self.warnings.push(format!("launches in pid {pid} are counted but not traced: starting the thread that reads their events: {e}"));
                        None
                    }
                }
            }
            _ => None,
        };
        self.in_process.push(Counted {
            pid,
            inproc,
            drainer,
        });
        self.launch_counting.push(LaunchCounting {
            pid,
            way: "in-process".into(),
            why: "tracer's injection library counts them from CUPTI's launch callbacks: no trap a launch".into(),
        });
        (pid, self.slot)
    }

    /// The session's in-process launches so far (slot and pid filled in), and how many
    /// launches the tables had no room for.
    pub(super) fn in_process_counts(&self) -> (Vec<(CudaLaunchKey, u64)>, u64) {
        let mut all = (Vec::new(), 0);
        for (c, counts) in self.in_process_read() {
            all.0.extend(self.keys(c.pid, &counts));
            all.1 += counts.full;
        }
        all
    }

    /// Each process counted in-process, with its table's counts since the session's start.
    fn in_process_read(&self) -> Vec<(&Counted, cuda::LaunchCounts)> {
        self.in_process
            .iter()
            .map(|c| (c, c.inproc.table.read().since(&c.inproc.base)))
            .collect()
    }

    /// `counts`' rows as the session's launch counts in `pid` (slot and pid filled in).
    fn keys(&self, pid: u32, counts: &cuda::LaunchCounts) -> Vec<(CudaLaunchKey, u64)> {
        counts
            .rows
            .iter()
            .map(|r| {
                let mut key = r.key;
                (key.slot, key.pid) = (u32::from(self.slot), pid);
                (key, r.count)
            })
            .collect()
    }

    /// [`Self::in_process_counts`], with what the rows' announcements (`CUPTI_ROW`) left
    /// unnamed looked up now, where the processes may still be read: at the end. Also the
    /// launches under way when counting started whose rows could not be made.
    pub(super) fn in_process_rows(&mut self) -> (Vec<(CudaLaunchKey, u64)>, u64, u64) {
        let read: Vec<(u32, Option<&'static Version>, cuda::LaunchCounts)> = self
            .in_process_read()
            .into_iter()
            .map(|(c, counts)| (c.pid, c.inproc.python, counts))
            .collect();
        let mut all = (Vec::new(), 0, 0);
        for (pid, version, counts) in read {
            let rows = self.named_rows(pid, version, &counts);
            all.0.extend(rows);
            all.1 += counts.full;
            all.2 += counts.unseen;
        }
        all
    }

    /// `pid`'s rows, their kernels, callers and call sites named where the announcements
    /// left them unnamed.
    fn named_rows(
        &mut self,
        pid: u32,
        version: Option<&'static Version>,
        counts: &cuda::LaunchCounts,
    ) -> Vec<(CudaLaunchKey, u64)> {
        for r in &counts.rows {
            if r.name != 0 && !self.cupti_names.contains_key(&(pid, r.key.func)) {
                if let Some(name) = cuda::name_in_process(pid, r.name) {
                    self.cupti_names.insert((pid, r.key.func), name);
                }
            }
        }
        let rows = self.keys(pid, counts);
        let callers: Vec<u64> = rows.iter().map(|(k, _)| k.caller).collect();
        self.callers.locate(pid, &callers);
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
        rows
    }

    /// Stops the threads moving launch events into the trace, after their last reads: the
    /// events lost.
    pub(super) fn drain_launch_events(&mut self) -> u64 {
        self.in_process
            .iter_mut()
            .filter_map(|c| c.drainer.take())
            .map(super::events::Drainer::finish)
            .sum()
    }

    /// Whether launches counted in-process also go to a trace.
    pub fn traces_launches(&self) -> bool {
        self.timeline.is_some()
    }

    /// CUPTI's name for an in-process row's handle.
    pub(super) fn cupti_name(&self, pid: u32, func: u64) -> Option<&str> {
        self.cupti_names.get(&(pid, func)).map(String::as_str)
    }
}

/// A library of the target probed without kernel launches: what a job for them needs.
pub(super) struct Skipped {
    pub lib: cuda::Library,
    pub path: std::path::PathBuf,
    pub mapped: String,
}

/// What the manager does once a job is adopted.
#[derive(Default)]
pub struct Adopted {
    /// The (process, slot) to mark in `CUDA_INPROC`: the library counts its launches from
    /// now on.
    pub mark: Option<(u32, u8)>,
    /// The target's launch probes, attached after all where its library cannot count them.
    pub jobs: Vec<CudaJob>,
}

impl CudaSession {
    /// What turning GPU times or in-process launches on came to: an error refuses the
    /// session where GPU times were asked; launches that cannot be counted in-process are
    /// counted with the probes.
    pub(super) fn enabled(
        &mut self,
        ask: Ask,
        enabled: Result<Enabled, String>,
    ) -> Result<Adopted, String> {
        let pid = ask.pid;
        let enabled = match enabled {
            Err(why) if ask.in_process && !ask.records => {
                let prefix = format!("GPU times in pid {pid}: ");
                Enabled::Probes(why.strip_prefix(&prefix).unwrap_or(&why).to_owned())
            }
            other => other?,
        };
        let (status, launches) = match enabled {
            Enabled::On(status, launches) => {
                self.gpu_times = State::On(ask);
                (status, launches)
            }
            Enabled::Injected(status) if ask.in_process => {
                let why = format!("pid {pid} runs tracer's injection library from its start (CUDA_INJECTION64_PATH), which does not count launches");
                (status, Launches::Probes(why))
            }
            Enabled::Injected(status) => (status, Launches::NotAsked),
            Enabled::Probes(why) => return Ok(self.fall_back(pid, why)),
        };
        self.injected.insert(pid, status);
        Ok(match launches {
            Launches::NotAsked => Adopted::default(),
            Launches::Counted(inproc) => Adopted {
                mark: Some(self.counting_in_process(pid, inproc)),
                jobs: Vec::new(),
            },
            Launches::Probes(why) => self.fall_back(pid, why),
        })
    }

    /// `pid`'s launches, asked to be counted in-process, are counted with the probes (why):
    /// the report says so from the start.
    pub(super) fn counted_with_probes(&mut self, pid: u32, why: String) {
        self.launch_counting.push(LaunchCounting {
            pid,
            way: "probes".into(),
            why,
        });
    }

    /// The target's library cannot count its launches after all (why): the launch probes
    /// its libraries went without are attached now, before the start is answered.
    pub(super) fn fall_back(&mut self, pid: u32, why: String) -> Adopted {
        tracing::info!(pid, %why, "launches counted with probes");
        self.counted_with_probes(pid, why);
        self.in_process_target = None;
        let points = Points::KernelLaunchesOnly;
        let jobs: Vec<CudaJob> = std::mem::take(&mut self.launches_skipped)
            .into_iter()
            .map(|(id, s)| {
                let mut job = self.job(s.lib, id, s.path, &s.mapped, pid, "start", points);
                job.launches_after_all = true;
                job
            })
            .collect();
        self.launch_jobs += jobs.len();
        Adopted { mark: None, jobs }
    }
}
