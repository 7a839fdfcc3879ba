//! The live view of a counter (Prometheus' scrapes): its files read about once a second on a
//! thread of its own while scrapes keep asking, so that a scrape, answered on the daemon's
//! task, only takes the last reading. The files are the process's user's: reading them,
//! bounded as it is, is no work for the task that answers everyone.

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

use super::{Counts, Files};

/// How often the view reads, and how long it goes on after the last scrape.
const EVERY: Duration = Duration::from_secs(1);
const IDLE: Duration = Duration::from_secs(30);

pub(super) struct View {
    files: Arc<Files>,
    snapshot: Mutex<Arc<Vec<Counts>>>,
    /// The processes the session follows, as the last scrape said.
    followed: Mutex<HashSet<u32>>,
    last_asked: Mutex<Instant>,
    /// A reading thread runs.
    running: AtomicBool,
    /// The counter's session ended: no more readings.
    pub(super) stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl View {
    pub(super) fn new(files: Arc<Files>) -> Self {
        Self {
            files,
            snapshot: Mutex::new(Arc::new(Vec::new())),
            followed: Mutex::new(HashSet::new()),
            last_asked: Mutex::new(Instant::now()),
            running: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        }
    }

    /// A scrape asks: the reading thread runs (started again if it had gone idle).
    pub(super) fn asked(self: &Arc<Self>, followed: HashSet<u32>) {
        *lock(&self.followed) = followed;
        *lock(&self.last_asked) = Instant::now();
        if self.running.swap(true, Ordering::SeqCst) {
            return;
        }
        let view = self.clone();
        let spawned = std::thread::Builder::new()
            .name("pycount-view".into())
            .spawn(move || view.read_while_asked());
        if let Err(e) = spawned {
            self.running.store(false, Ordering::SeqCst);
            tracing::warn!(%e, "starting the in-process counter's live view");
        }
    }

    pub(super) fn snapshot(&self) -> Arc<Vec<Counts>> {
        lock(&self.snapshot).clone()
    }

    fn read_while_asked(&self) {
        let targets = [self.files.pid];
        loop {
            if self.stop.load(Ordering::SeqCst) || lock(&self.last_asked).elapsed() > IDLE {
                self.running.store(false, Ordering::SeqCst);
                return;
            }
            let followed = lock(&self.followed).clone();
            let follows = |p| followed.contains(&p) || crate::process::descends_from(p, &targets);
            let reading = Arc::new(self.files.peek(&follows));
            *lock(&self.snapshot) = reading;
            std::thread::sleep(EVERY);
        }
    }
}
