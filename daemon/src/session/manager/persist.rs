//! The manager's side of the store: sessions recorded as running when they start, found
//! failed at the next start if the daemon died meanwhile, and reports a failed write left in
//! memory stored once the store takes writes again.

use std::{collections::HashMap, path::Path, sync::Arc};

use tracer_proto::{EndReason, SessionInfo, SessionState};

use super::{super::build_report, super::Measurement, Done, Manager};
use crate::{error::Error, store::Store};
use tracer_report::{trace::RECORD, Report};

/// Why a session the store shows as running is no longer.
const DIED: &str = "daemon died";

/// The report stored with a session as it starts: what a daemon killed before its end leaves.
pub(super) fn running_report(info: &SessionInfo, measure: &dyn Measurement) -> String {
    let mut report = build_report(info, 0, None);
    measure.running_record(&mut report);
    report.to_json()
}

/// What the store holds at start.
pub(super) struct Recovered {
    pub finished: HashMap<String, SessionInfo>,
    /// Reports of sessions found failed that could not be stored (kept in memory, stored later).
    pub unsaved: HashMap<String, Arc<Report>>,
}

/// The stored sessions, those a dead daemon left running now failed.
pub(super) fn recover(store: &mut Store, traces: &Path) -> Result<Recovered, Error> {
    let (mut finished, mut unsaved) = (HashMap::new(), HashMap::new());
    for mut info in store.sessions()? {
        if info.state == SessionState::Running as i32 {
            let stored = store.report(&info.id).ok().flatten();
            let report = died(&mut info, stored.as_deref(), traces);
            tracing::warn!(
                id = info.id,
                "session was running when tracerd died: failed"
            );
            if let Err(e) = store.put(&info, &report.to_json()) {
                tracing::error!(%e, id = info.id, "could not store the failed session; it is kept in memory");
                unsaved.insert(info.id.clone(), Arc::new(report));
            }
        }
        finished.insert(info.id.clone(), info);
    }
    Ok(Recovered { finished, unsaved })
}

/// Ends a session the daemon died in, with its trace as far as it was written.
fn died(info: &mut SessionInfo, stored: Option<&str>, traces: &Path) -> Report {
    let mut report = stored
        .and_then(|json| Report::from_json(json).ok())
        .unwrap_or_else(|| build_report(info, 0, None));
    info.state = SessionState::Failed.into();
    info.end_reason = EndReason::Error.into();
    info.error = DIED.into();
    info.live_processes = 0;
    if let Some(t) = report.trace.as_mut() {
        let path = traces.join(&t.file);
        if let Ok(meta) = std::fs::metadata(&path) {
            // A write cut short by the kill leaves part of a record: whole records only.
            let whole = meta.len() - meta.len() % RECORD as u64;
            if whole != meta.len() {
                if let Err(e) = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .and_then(|f| f.set_len(whole))
                {
                    tracing::warn!(%e, path = %path.display(), "cutting a trace to whole records");
                }
            }
            t.events = whole / RECORD as u64;
            info.trace_events = t.events;
            info.trace_bytes = whole;
            // The last write is as near to the end as can be known.
            let last_ns = meta
                .modified()
                .ok()
                .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(t.start_unix_ns, |d| d.as_nanos() as u64);
            let elapsed_ns = last_ns.saturating_sub(t.start_unix_ns);
            t.end_ns = t.start_ns + elapsed_ns;
            info.elapsed_ms = elapsed_ns / 1_000_000;
        }
    }
    report.session = build_report(info, 0, None).session;
    report
}

impl Manager {
    /// Stores the reports a failed write left in memory, if the store takes writes again:
    /// on the store's writer, one attempt at a time; back as `Saved`.
    pub(super) fn save_unsaved(&mut self) {
        if self.ending.saving || self.ending.unsaved.is_empty() {
            return;
        }
        self.ending.saving = true;
        let (save, tx) = (self.to_save(), self.done.clone());
        self.writer.then(move |store| {
            let _ = tx.send(Done::Saved(save(store)));
        });
    }

    /// As `save_unsaved`, waited for: at shutdown, on the manager's task.
    pub(super) fn save_unsaved_now(&mut self) {
        if self.ending.unsaved.is_empty() {
            return;
        }
        let save = self.to_save();
        // The daemon is ending: nothing else waits for this task.
        let saved = self.writer.wait(save);
        self.saved(saved.unwrap_or_default());
    }

    /// Writes the unsaved reports, in turn, until the store refuses one; returns the ids of
    /// those written.
    fn to_save(&self) -> impl FnOnce(&mut Store) -> Vec<String> + Send + 'static {
        let todo: Vec<(SessionInfo, Arc<Report>)> = self
            .ending
            .unsaved
            .iter()
            .filter_map(|(id, r)| Some((self.finished.get(id)?.clone(), r.clone())))
            .collect();
        move |store| {
            let mut saved = Vec::new();
            for (info, report) in todo {
                if store.put(&info, &report.to_json()).is_err() {
                    // Still failing: the next sweep tries again.
                    break;
                }
                saved.push(info.id);
            }
            saved
        }
    }

    /// Reports the store took again.
    pub(super) fn saved(&mut self, ids: Vec<String>) {
        self.ending.saving = false;
        for id in ids {
            tracing::info!(
                id,
                "report stored, now that the state database takes writes"
            );
            self.ending.unsaved.remove(&id);
        }
    }

    /// Forgets a session that ended as it started: nothing of it is kept.
    pub(super) fn discard(&mut self, id: &str) {
        self.finished.remove(id);
        self.ending.unsaved.remove(id);
        self.exported.remove(id);
        self.remove_trace(id);
        let id = id.to_owned();
        self.writer.then(move |store| {
            let _ = store.delete(&id);
        });
    }

    /// Removes a session's trace file, if it has one.
    pub(super) fn remove_trace(&self, id: &str) {
        remove_trace_file(&self.trace_path(id));
    }

    /// Where a session's trace file is, if it has one.
    pub(super) fn trace_path(&self, id: &str) -> std::path::PathBuf {
        self.tracing
            .dir()
            .join(super::super::tracing::file_name(id))
    }
}

/// Removes a trace file, if there is one.
pub(super) fn remove_trace_file(path: &std::path::Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(%e, path = %path.display(), "removing a deleted session's trace");
        }
    }
}
