//! The store's writes, one after another in the order they were asked for, on a thread of
//! their own. Whoever asks never waits for a commit (a report of 150,000 Python functions
//! takes hundreds of ms to write), and a session's running record, asked for at its start,
//! is written before its final one.

use std::sync::{mpsc, Arc, Mutex, PoisonError};

use super::Store;

/// The store, shared by its writer and by the readers of stored reports.
pub type Shared = Arc<Mutex<Store>>;

type Job = Box<dyn FnOnce(&mut Store) + Send>;

#[derive(Clone)]
pub struct Writer(mpsc::Sender<Job>);

impl Writer {
    pub fn spawn(store: Shared) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || {
                for job in rx {
                    let mut s = store.lock().unwrap_or_else(PoisonError::into_inner);
                    // A job that panics loses its own answer, not the writes after it.
                    let run = std::panic::AssertUnwindSafe(|| job(&mut s));
                    if std::panic::catch_unwind(run).is_err() {
                        tracing::error!("a write to the state database panicked");
                    }
                }
            })?;
        Ok(Self(tx))
    }

    /// Runs `job` after every write asked for before it.
    pub fn then(&self, job: impl FnOnce(&mut Store) + Send + 'static) {
        // The thread ends only with the last sender: this one is alive.
        let _ = self.0.send(Box::new(job));
    }

    /// Runs `job` in its turn and waits for what it returns: for blocking threads only.
    /// None if the job panicked.
    pub fn wait<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Store) -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.then(move |s| {
            let _ = tx.send(job(s));
        });
        rx.recv().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracer_proto::{SessionInfo, SessionState};

    fn info(id: &str, state: SessionState) -> SessionInfo {
        SessionInfo {
            id: id.into(),
            state: state as i32,
            ..Default::default()
        }
    }

    /// A running record asked for first is never written over a final one asked for after
    /// it, however the two are waited for.
    #[test]
    fn writes_land_in_the_order_they_were_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let shared: Shared = Arc::new(Mutex::new(Store::open(dir.path()).unwrap()));
        let writer = Writer::spawn(shared.clone()).unwrap();
        let big = "x".repeat(8 << 20);
        for i in 0..20 {
            let id = format!("s{i}");
            let (running, big) = (info(&id, SessionState::Running), big.clone());
            writer.then(move |s| s.put(&running, &big).unwrap());
            let finished = info(&id, SessionState::Finished);
            let w = writer.clone();
            std::thread::spawn(move || w.wait(move |s| s.put(&finished, "{}")))
                .join()
                .unwrap()
                .unwrap()
                .unwrap();
        }
        let mut store = shared.lock().unwrap();
        let sessions = store.sessions().unwrap();
        assert_eq!(sessions.len(), 20);
        for info in sessions {
            assert_eq!(info.state, SessionState::Finished as i32, "{}", info.id);
            assert_eq!(store.report(&info.id).unwrap().as_deref(), Some("{}"));
        }
        drop(store);
        // A panicking job loses its own answer only.
        assert!(writer.wait(|_| -> u32 { panic!("on purpose") }).is_none());
        assert_eq!(writer.wait(|_| 7), Some(7));
    }
}
