//! The thread that drains one BPF ring buffer into shared state: sampling's and tracing's
//! data paths each run one. It wakes on the first record (short-lived processes must be
//! read while they exist) or after a period, whichever comes first, and drains under the
//! state's lock, where the manager's task may also take it briefly.

use std::{
    os::fd::RawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard,
    },
    thread,
    time::Duration,
};

/// A running drain thread; dropping it stops the thread and waits for it.
pub struct RingWorker<S> {
    state: Arc<Mutex<S>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl<S: Send + 'static> RingWorker<S> {
    /// Runs `drain` on `state` each time `fd` (the ring buffer's) is readable, and at least
    /// every `every`. A panic in one drain is logged and the thread goes on: a bug met by
    /// one record must not stop a data path for good.
    pub fn spawn(
        name: &str,
        fd: RawFd,
        every: Duration,
        state: S,
        mut drain: impl FnMut(&mut S) + Send + 'static,
    ) -> Self {
        let state = Arc::new(Mutex::new(state));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (state, stop, label) = (state.clone(), stop.clone(), name.to_owned());
            thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let mut pfd = libc::pollfd {
                            fd,
                            events: libc::POLLIN,
                            revents: 0,
                        };
                        // SAFETY: one valid pollfd; the ring buffer's fd is owned by the
                        // state, which outlives this loop.
                        unsafe { libc::poll(&mut pfd, 1, every.as_millis() as i32) };
                        let drained =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                drain(&mut lock(&state))
                            }));
                        if drained.is_err() {
                            tracing::error!(
                                worker = label,
                                "a ring buffer worker hit a bug; records in flight were dropped"
                            );
                        }
                    }
                })
                .unwrap_or_else(|e| panic!("spawning {name}: {e}"))
        };
        Self {
            state,
            stop,
            thread: Some(thread),
        }
    }

    /// The state the thread drains into.
    pub fn state(&self) -> &Arc<Mutex<S>> {
        &self.state
    }
}

impl<S> Drop for RingWorker<S> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Locks state a drain may have panicked in: it is plain data, so going on with it is
/// better than losing the data path.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
