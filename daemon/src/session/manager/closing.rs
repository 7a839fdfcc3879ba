//! Sessions whose end waits for naming. Reading the symbol tables and DWARF of large
//! binaries (tracerd's own, libtorch, libcuda) takes seconds: a blocking thread names the
//! sampled stacks and CUDA callers while the manager answers everything else, and the
//! session ends when they are in. Until then `list` and `get` show it running, `report`
//! says it still is, and a `stop` is answered at its end.

use tokio::sync::watch;
use tracer_proto::SessionInfo;

use super::{Command, Manager, Reply};
use crate::{
    profile::Profile,
    report::{trace, CudaReport, Report},
    session::{cuda::CudaEnd, sampling::Ending},
};

pub(super) struct Closing {
    /// What `list` and `get` show meanwhile.
    pub shown: SessionInfo,
    /// The final state.
    pub info: SessionInfo,
    pub report: Report,
    pub continuous: Option<crate::continuous::Running>,
    pub export_prometheus: bool,
    pub ended: watch::Sender<bool>,
    /// `stop` requests, answered at the end.
    pub stops: Vec<Reply<SessionInfo>>,
}

/// What is left to name.
pub(super) struct Pending {
    pub profile: Option<Ending>,
    pub cuda: Option<CudaEnd>,
}

/// What was named.
pub(super) struct Done {
    profile: Option<Profile>,
    cuda: Option<CudaReport>,
}

impl Pending {
    fn name(self) -> Done {
        Done {
            profile: self.profile.map(Ending::name),
            cuda: self.cuda.map(CudaEnd::finish),
        }
    }
}

impl Manager {
    /// Ends `id` now if nothing is left to name, else once a blocking thread named it
    /// (during shutdown, here: nobody waits for other answers then).
    pub(super) fn close(&mut self, id: &str, closing: Closing, pending: Pending) {
        if self.shutting_down || (pending.profile.is_none() && pending.cuda.is_none()) {
            self.complete(id, closing, pending.name());
            return;
        }
        let (tx, id) = (self.tx.clone(), id.to_owned());
        self.closing.insert(id.clone(), closing);
        tokio::task::spawn_blocking(move || {
            let done = Box::new(pending.name());
            let _ = tx.blocking_send(Command::Named { id, done });
        });
    }

    /// A closing session is named: it ends, and its report is stored.
    pub(super) fn named(&mut self, id: &str, done: Done) {
        if let Some(c) = self.closing.remove(id) {
            self.complete(id, c, done);
            self.store_report(id);
            self.release_free_memory();
        }
    }

    fn complete(&mut self, id: &str, mut c: Closing, done: Done) {
        c.report.profile = done.profile;
        c.report.cuda = done.cuda;
        if let Some(t) = c.report.trace.as_mut() {
            trace_cuda(t, c.report.cuda.as_ref());
        }
        if let Some(cont) = c.continuous.take() {
            cont.finish(c.report.profile.as_ref(), id);
        }
        if c.export_prometheus {
            self.exported.insert(
                id.to_owned(),
                super::metrics::Ended::new(&c.info, &c.report),
            );
        }
        self.unsaved.insert(id.to_owned(), c.report);
        tracing::info!(
            id,
            reason = crate::session::end_reason_name(c.info.end_reason),
            "session ended"
        );
        self.finished.insert(id.to_owned(), c.info.clone());
        let _ = c.ended.send(true);
        for stop in c.stops {
            let _ = stop.send(Ok(c.info.clone()));
        }
    }
}

/// Launch events carry their row: the trace keeps the rows to name and describe them, and
/// CUPTI's kernel names.
fn trace_cuda(t: &mut trace::Trace, cuda: Option<&CudaReport>) {
    let mut launches: Vec<trace::TraceLaunch> = cuda
        .iter()
        .flat_map(|c| &c.launches)
        .map(|l| trace::TraceLaunch {
            row: l.row_id,
            launch: l.clone(),
        })
        .collect();
    launches.sort_unstable_by_key(|l| (l.launch.pid, l.row));
    let mut gpu_kernel_names: Vec<trace::TraceGpuKernel> = cuda
        .iter()
        .flat_map(|c| &c.gpu_kernels)
        .map(|k| trace::TraceGpuKernel {
            pid: k.pid,
            name: k.name_ptr,
            kernel: k.kernel.clone(),
        })
        .collect();
    gpu_kernel_names.sort_unstable_by_key(|k| (k.pid, k.name));
    gpu_kernel_names.dedup_by_key(|k| (k.pid, k.name));
    t.launches = launches;
    t.gpu_kernel_names = gpu_kernel_names;
}
