//! Handovers: on CPython 3.10 and 3.11 the counter is the thread's profile function, and a
//! program that sets one of its own (cProfile, `sys.setprofile`, a profiler's C hook) takes
//! its place. The counter then stops, leaves a `handover.<pid>` file and holds the program
//! (`daemon/pycount`'s profile.rs); a thread of tracer's own, watching the directory, has the
//! probes count that process from there on and answers (HANDED), so that every call is
//! counted once.

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use tracer_common::inproc::{state, HANDOVER_PREFIX};

use super::{files::MAX_NAMES, Counter, Files};

/// Has the probes count a process (by its pid here) from now on; blocks until they do, or
/// says why they do not.
pub type Handover = Arc<dyn Fn(u32) -> Result<(), String> + Send + Sync>;

/// Why a handover asked for as the session ended was not made.
pub(super) const ENDED: &str = "the session ended first";

/// How often the directory is looked at (its mtime: a stat).
const LOOK_EVERY: Duration = Duration::from_millis(5);

/// How long after its mtime last changed the directory is listed at every look all the
/// same: before Linux 6.13 a directory's mtime is a clock tick's (up to 10 ms), so a file made
/// in the tick of a listing leaves the mtime that listing saw.
const RELIST_FOR: Duration = Duration::from_millis(50);

struct Watch {
    files: Arc<Files>,
    /// Set when the session's end reads the counters: nothing is handed over after.
    ended: Arc<AtomicBool>,
}

impl Counter {
    /// Watches the counter's directory for handovers, on a thread of its own, until the
    /// session's end reads the counters.
    pub(super) fn watch_handovers(&self, handover: Handover) -> Result<(), String> {
        let watch = Watch {
            files: self.files.clone(),
            ended: self.ended.clone(),
        };
        watch.spawn(handover)
    }
}

impl Watch {
    fn spawn(self, handover: Handover) -> Result<(), String> {
        std::thread::Builder::new()
            .name("pycount-handover".into())
            .spawn(move || self.run(&handover))
            .map(drop)
            .map_err(|e| format!("starting the thread that watches for handovers: {e}"))
    }

    fn run(self, handover: &Handover) {
        let mut seen_mtime = None;
        let mut changed = std::time::Instant::now();
        // Each request is answered once: the process's owner may make any number of them.
        let mut answered = HashSet::new();
        while !self.ended.load(Ordering::SeqCst) {
            std::thread::sleep(LOOK_EVERY);
            let mtime = self.files.dir.mtime();
            if mtime.is_none() {
                return;
            }
            if mtime != seen_mtime {
                changed = std::time::Instant::now();
            } else if changed.elapsed() > RELIST_FOR {
                continue;
            }
            seen_mtime = mtime;
            let (asked, _) = self.files.dir.by_pid(HANDOVER_PREFIX, MAX_NAMES);
            let asked: Vec<_> = asked
                .into_iter()
                .filter(|(own, _)| answered.insert(*own))
                .collect();
            if asked.is_empty() {
                continue;
            }
            let mut refused = Vec::new();
            for f in self.files.found(&|_| true, MAX_NAMES, &mut refused) {
                if !asked.iter().any(|(own, _)| *own == f.own) {
                    continue;
                }
                let Some(map) = self.files.map(&f, true, &mut refused) else {
                    continue;
                };
                if map.state().load(Ordering::SeqCst) != state::HANDOVER {
                    continue;
                }
                let why = match f.host {
                    _ if self.ended.load(Ordering::SeqCst) => Some(ENDED.into()),
                    Some(pid) => handover(pid).err(),
                    None => Some("tracer cannot tell its pid".into()),
                };
                if let Some(why) = &why {
                    tracing::info!(own = f.own, %why, "a handover to the probes failed");
                }
                map.hand(why.as_deref());
            }
            for (_, name) in asked {
                self.files.dir.unlink(&name);
            }
        }
    }
}
