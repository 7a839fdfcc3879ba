//! A start request left pending: the process was in native code on every thread when the
//! session started. A thread of tracer's own waits for the counter to start, asks the
//! threads the process starts meanwhile (a request is written per thread state), and says
//! what became of it. The session's end settles it otherwise ([`super::Counter::finish`]).

use std::{
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant},
};

use tracer_common::inproc::state;

use super::{remote_exec, Counter, Files, Late, MayTrace, LOAD_ERROR};
use crate::pinned::Pinned;

/// How often the process's thread states are read for new ones.
pub const ASK_EVERY: Duration = Duration::from_millis(20);
/// How often the counter's state is looked at.
const LOOK_EVERY: Duration = Duration::from_millis(5);

pub(super) struct Watch {
    pub(super) pin: Pinned,
    /// The start script, as the process sees it, where it was requested through PEP 768
    /// (None: a launch, whose loader runs it).
    pub(super) script: Option<String>,
    pub(super) files: Arc<Files>,
    pub(super) may_trace: MayTrace,
    /// Thread states asked already.
    pub(super) asked: Vec<u64>,
    /// The process's executable when first asked: one that exec'd since is another program.
    pub(super) exe: Option<(u64, u64)>,
}

/// The (device, inode) of `pid`'s executable.
pub(super) fn exe_of(pid: u32) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/exe"))
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

impl Counter {
    /// Waits, on a thread of its own, for the start script that tracer's loader runs in the
    /// process (a launch, a ptrace load): there is no request to ask new threads with.
    pub(super) fn watch_loader_start(&self, pin: Pinned, late: Late) -> Result<(), String> {
        let watch = Watch {
            pin,
            script: None,
            files: self.files.clone(),
            may_trace: self.may_trace.clone(),
            asked: Vec::new(),
            exe: None,
        };
        watch.spawn(late)
    }
}

impl Watch {
    pub(super) fn spawn(self, late: Late) -> Result<(), String> {
        std::thread::Builder::new()
            .name("pycount-pending".into())
            .spawn(move || self.run(late))
            .map(drop)
            .map_err(|e| format!("starting the thread that waits for a safe point: {e}"))
    }

    fn run(mut self, late: Late) {
        let files = self.files.clone();
        let map = &files.map;
        let mut asked_at = Instant::now();
        loop {
            std::thread::sleep(LOOK_EVERY);
            let outcome = match map.state().load(Ordering::SeqCst) {
                state::RUNNING => Ok(map.header().tool_id),
                state::REFUSED => {
                    Err(String::from_utf8_lossy(map.header().why_text()).into_owned())
                }
                state::PENDING if self.files.dir.exists(LOAD_ERROR) => {
                    // The script ran and will not again: one of tracerd and a later run
                    // of it decides, as at the start.
                    if map.cancel().is_err() {
                        continue;
                    }
                    Err(self.files.dir.read_text(LOAD_ERROR).unwrap_or_default())
                }
                state::PENDING => {
                    if !self.pin.alive() {
                        return;
                    }
                    if asked_at.elapsed() >= ASK_EVERY {
                        asked_at = Instant::now();
                        self.ask_new_threads();
                    }
                    continue;
                }
                // The session ended first (CANCELLED), or never mind: its end settles it.
                _ => return,
            };
            // The threads not asked yet need not be; those that take it find it started.
            if let Some(script) = &self.script {
                let _ = remote_exec::withdraw(&self.pin, script);
            }
            late(outcome);
            return;
        }
    }

    /// Asks the thread states made since the last ask, under the checks of the first:
    /// the session's owner may still trace the process, it runs the same program, as the
    /// directory's owner and nobody else (a process that gained credentials must not run a
    /// file its old user could write), and it still finds the directory at the path it will
    /// open.
    fn ask_new_threads(&mut self) {
        let Some(script) = self.script.clone() else {
            return;
        };
        let pid = self.pin.pid();
        let owner = self.files.dir.owner.0;
        let same_user = super::process::uids(pid).is_ok_and(|ids| ids.iter().all(|&u| u == owner));
        if !same_user
            || self.exe.is_none()
            || exe_of(pid) != self.exe
            || (self.may_trace)(pid).is_err()
            || self.files.dir.seen_by(pid).is_err()
        {
            return;
        }
        if let Err(e) = remote_exec::request_more(&self.pin, &script, &mut self.asked) {
            tracing::debug!(pid, %e, "asking new threads to start the counter");
        }
    }
}
