//! Deleting a session's files in the counted processes' `/tmp` once nothing can still run
//! them, off the thread that names the report.

use std::{
    path::Path,
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tracer_common::inproc;

use super::{files::Dir, journal, process::alive, remote_exec, Counter, CLEANUP_WAIT};
use crate::pinned::Pinned;

/// Cleanups still waiting for removal scripts.
static CLEANUPS: AtomicU32 = AtomicU32::new(0);

/// Waits up to `limit` for the cleanups of ended sessions (tracerd is exiting).
pub fn wait_cleanups(limit: Duration) {
    let started = Instant::now();
    while CLEANUPS.load(Ordering::SeqCst) > 0 && started.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Counter {
    /// Gives up a counter whose files nothing will open again: its watches stop, and its
    /// directory and journal entry go now.
    pub(super) fn discard(self) {
        self.ended.store(true, Ordering::SeqCst);
        self.files.dir.remove();
        journal::forget(&self.name);
    }
}

/// Deletes the session's files once nothing can still run them: a removal script once the
/// counts file it deletes is gone (it ran) or its process is; everything once the processes
/// are. After [`CLEANUP_WAIT`] the requests not taken are withdrawn, and what is left stays
/// for the next sweep ([`journal`]).
/// `pids`: the processes (pids here) that could still run something in the directory.
pub(super) fn cleanup_later(
    dir: Arc<Dir>,
    name: String,
    scripts: Vec<(Pinned, u32, String)>,
    pids: Vec<u32>,
) {
    CLEANUPS.fetch_add(1, Ordering::SeqCst);
    let spawned = std::thread::Builder::new()
        .name("pycount-cleanup".into())
        .spawn(move || {
            struct Done;
            impl Drop for Done {
                fn drop(&mut self) {
                    CLEANUPS.fetch_sub(1, Ordering::SeqCst);
                }
            }
            let _done = Done;
            let started = Instant::now();
            let mut pending = scripts;
            loop {
                pending.retain(|(pin, own, path)| {
                    let counts = format!("{}{own}", inproc::FILE_PREFIX);
                    if pin.alive() && dir.exists(&counts) {
                        return true;
                    }
                    if pin.alive() {
                        // Ran in one thread: the others' requests go, then the file.
                        let _ = remote_exec::withdraw(pin, path);
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    let file = Path::new(path).file_name().and_then(|n| n.to_str());
                    dir.unlink_code(file.unwrap_or(""));
                    // Its loader, where one ran it (before 3.14): mapped, it needs no name.
                    if let Some(stem) = file.and_then(|f| f.strip_suffix(".py")) {
                        dir.unlink_code(&format!("{stem}.so"));
                    }
                    false
                });
                // Once every process that could run something here is gone, nothing is
                // needed; while one lives, only an empty directory goes.
                if !pids.iter().any(|&p| alive(p)) {
                    dir.remove();
                    journal::forget(&name);
                    break;
                }
                if pending.is_empty() && dir.remove_if_empty() {
                    journal::forget(&name);
                    break;
                }
                if started.elapsed() > CLEANUP_WAIT {
                    // A request nobody took must not be taken later, from files left here.
                    for (pin, _, path) in &pending {
                        if remote_exec::withdraw(pin, path).is_ok() {
                            let file = Path::new(path).file_name().and_then(|n| n.to_str());
                            dir.unlink_code(file.unwrap_or(""));
                        }
                    }
                    tracing::warn!(dir = %name, "in-process counter files left after {} s; the next start of tracerd sweeps them", CLEANUP_WAIT.as_secs());
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
    if let Err(e) = spawned {
        CLEANUPS.fetch_sub(1, Ordering::SeqCst);
        tracing::warn!(%e, "starting the in-process counter's cleanup");
    }
}
