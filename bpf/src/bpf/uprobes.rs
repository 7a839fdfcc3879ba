//! Uprobes attached as sets, one per binary, on any thread: the attachers a blocking thread
//! holds, and the sets' release, which waits for the kernel's grace periods.

use std::{os::fd::OwnedFd, path::Path};

use tracer_common::{cuda_api, native_cookie, py_role};
use tracer_inspect::python::runtime::Runtime;

use super::{
    programs, publish_layout, BpfError, AT_RETURN, CUDA_CALL, CUDA_PROGRAMS, CUDA_RETURN,
    CUPTI_CALL, NATIVE_CALL, NATIVE_PROGRAMS, PY_ENTRY, PY_OPCODE, PY_OPCODE_EXIT, PY_PROGRAMS,
    PY_RETURN,
};

/// Uprobes that come off together; dropping the set detaches them. That waits for the
/// kernel's grace periods (once per multi-uprobe link, once per probe without them): drop
/// sets off the task that answers RPCs, with [`crate::release`].
#[derive(Default)]
pub struct ProbeSet {
    /// Held only to be dropped: multi-uprobe links, or one link per probe's perf event.
    links: Vec<OwnedFd>,
    probes: usize,
}

impl ProbeSet {
    /// Probes in the set.
    pub fn len(&self) -> usize {
        self.probes
    }

    pub fn is_empty(&self) -> bool {
        self.probes == 0
    }

    /// Takes in the probes of `other`.
    pub fn extend(&mut self, other: ProbeSet) {
        self.links.extend(other.links);
        self.probes += other.probes;
    }
}

/// Uprobe programs still to be verified and loaded, from [`Bpf::to_load`]; `run` them on a
/// thread that may wait seconds. What they load, the daemon's later attaches use.
pub struct Loading {
    pub(super) programs: programs::Programs,
    pub(super) names: Vec<&'static str>,
}

impl Loading {
    pub fn run(self) -> Result<(), BpfError> {
        load_all(&self.programs, &self.names)
    }
}

/// Loads `names` (at once where loaded already); after a failed attempt some are loaded
/// already, so the error names the one that fails.
pub(super) fn load_all(
    programs: &programs::Programs,
    names: &[&'static str],
) -> Result<(), BpfError> {
    for &name in names {
        programs.load(name).map_err(|e| BpfError::Program {
            name,
            source: Box::new(e),
        })?;
    }
    Ok(())
}

/// Detaches `sets` on a thread of their own, then calls `done` there: the kernel's grace
/// periods keep nobody else waiting.
pub fn release(sets: Vec<ProbeSet>, done: impl FnOnce() + Send + 'static) {
    if sets.iter().all(ProbeSet::is_empty) {
        drop(sets);
        done();
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("probe-release".into())
        .spawn(move || {
            drop(sets);
            done();
        });
    if let Err(e) = spawned {
        tracing::warn!(%e, "no thread to release probes on");
    }
}

/// Attaches (program, file offset, cookie) points in `binary`, for every process that maps
/// it; all or nothing. With multi-uprobe links, one link per program.
fn attach_all(
    programs: &programs::Programs,
    binary: &Path,
    points: &[(&'static str, u64, u64)],
) -> Result<ProbeSet, BpfError> {
    let mut set = ProbeSet::default();
    let mut names: Vec<&'static str> = points.iter().map(|p| p.0).collect();
    names.sort_unstable();
    names.dedup();
    for name in names {
        let (offsets, cookies): (Vec<u64>, Vec<u64>) = points
            .iter()
            .filter(|p| p.0 == name)
            .map(|p| (p.1, p.2))
            .unzip();
        let links = programs
            .attach(name, binary, &offsets, &cookies, AT_RETURN.contains(&name))
            .map_err(|e| BpfError::Attach {
                name,
                probes: offsets.len(),
                source: e,
            })?;
        set.links.extend(links);
        set.probes += offsets.len();
    }
    Ok(set)
}

/// Attaches the Python probes ([`Bpf::python_attacher`]); `Send`, for a blocking thread.
#[derive(Clone)]
pub struct PythonAttacher {
    pub(super) programs: programs::Programs,
}

impl PythonAttacher {
    /// The Python probes on one interpreter binary, for every process that maps it.
    pub fn attach(&self, rt: &Runtime, path: &Path) -> Result<ProbeSet, BpfError> {
        load_all(&self.programs, &PY_PROGRAMS)?;
        publish_layout(rt.version)?;
        let index = u64::from(rt.version.index);
        let entry = index | (py_role::ENTRY << py_role::SHIFT);
        let exit = index | (py_role::EXIT << py_role::SHIFT);
        let mut points = vec![(PY_ENTRY, &rt.eval_entry, entry)];
        if rt.resume.is_empty() {
            // 3.10: every frame is one call of the eval loop, left when it returns.
            points.push((PY_RETURN, &rt.eval_entry, exit));
        }
        points.extend(rt.resume.iter().map(|p| (PY_OPCODE, p, entry)));
        points.extend(rt.exit.iter().map(|p| (PY_OPCODE_EXIT, p, exit)));
        let points: Vec<_> = points
            .into_iter()
            .map(|(name, p, cookie)| (name, p.file_offset, cookie))
            .collect();
        attach_all(&self.programs, path, &points)
    }
}

/// Attaches native-call counters ([`Bpf::native_attacher`]); `Send`, for a blocking thread.
#[derive(Clone)]
pub struct CudaAttacher {
    pub(super) programs: programs::Programs,
}

impl CudaAttacher {
    /// Probes CUDA entry points of one library for one session: (file offset, cookie, and
    /// whether the call's result is read at its return). `cookie`:
    /// `cuda_cookie::make(slot, all, api)`.
    pub fn attach(&self, binary: &Path, probes: &[(u64, u64, bool)]) -> Result<ProbeSet, BpfError> {
        load_all(&self.programs, &CUDA_PROGRAMS)?;
        let program = |cookie: u64| match (cookie & cuda_api::MASK) as u32 {
            cuda_api::CUPTI_KERNEL
            | cuda_api::CUPTI_DROPPED
            | cuda_api::CUPTI_STATUS
            | cuda_api::CUPTI_LAUNCH
            | cuda_api::CUPTI_ROW => CUPTI_CALL,
            _ => CUDA_CALL,
        };
        let mut points: Vec<_> = probes.iter().map(|&(o, c, _)| (program(c), o, c)).collect();
        points.extend(
            probes
                .iter()
                .filter(|p| p.2)
                .map(|&(o, c, _)| (CUDA_RETURN, o, c)),
        );
        attach_all(&self.programs, binary, &points)
    }
}

pub struct NativeAttacher {
    pub(super) programs: programs::Programs,
}

impl NativeAttacher {
    /// Attaches native-call counters for one session on functions of one binary: each
    /// `(file offset, probe)` numbers the function in the session's report; `all`: count
    /// every process, not only those the session follows. A function the kernel will not
    /// probe is left out and comes back with why, by its index in `points`.
    pub fn attach(
        &self,
        binary: &Path,
        points: &[(u64, u32)],
        slot: u8,
        all: bool,
    ) -> Result<(ProbeSet, Vec<(usize, BpfError)>), BpfError> {
        load_all(&self.programs, &NATIVE_PROGRAMS)?;
        let points: Vec<_> = points
            .iter()
            .map(|&(offset, probe)| (NATIVE_CALL, offset, native_cookie::make(slot, all, probe)))
            .collect();
        // In one link, unless the kernel refuses one of them: then one at a time, to name
        // those it refuses. (One perf event each goes one at a time from the start: those
        // attached before a refusal would each take a grace period to come off.)
        if self.programs.multi() {
            if let Ok(set) = attach_all(&self.programs, binary, &points) {
                return Ok((set, Vec::new()));
            }
        }
        let mut set = ProbeSet::default();
        let mut refused = Vec::new();
        for (i, p) in points.iter().enumerate() {
            match attach_all(&self.programs, binary, std::slice::from_ref(p)) {
                Ok(one) => set.extend(one),
                Err(e) => refused.push((i, e)),
            }
        }
        Ok((set, refused))
    }
}
