//! The manager's side of the Prometheus endpoint: daemon-wide series, and the counts of
//! exported sessions (read from the kernel maps without taking them while they run).

use std::time::{Duration, Instant};

use tracer_proto::{SessionInfo, SessionState};

use super::Manager;
use crate::metrics::{self, gauge, Sample};
use tracer_report::Report;

/// How long an exported session's final counts stay on the endpoint after it ends: long
/// enough for any scrape interval to see them.
const KEEP_ENDED: Duration = Duration::from_secs(300);

/// An exported session that ended: its final series.
pub struct Ended {
    at: Instant,
    samples: Vec<Sample>,
}

impl Ended {
    pub fn new(info: &SessionInfo, report: &Report) -> Self {
        let mut samples = vec![info_sample(info)];
        samples.extend(session_samples(info));
        samples.extend(metrics::session_counts(
            &info.id,
            &info.counters,
            report.python.as_ref().map_or(&[], |p| &p.functions),
            report.native.as_ref().map_or(&[], |n| &n.calls),
            report.cuda.as_ref(),
        ));
        Ended {
            at: Instant::now(),
            samples,
        }
    }
}

fn info_sample(info: &SessionInfo) -> Sample {
    gauge(
        "tracer_session_info",
        vec![
            ("session", info.id.clone()),
            ("mode", crate::session::mode_name(info.mode).into()),
            ("target", crate::session::target_label(info.target.as_ref())),
            ("owner_uid", info.owner_uid.to_string()),
            ("started_by", info.started_by.clone()),
        ],
        1.0,
    )
}

fn session_samples(info: &SessionInfo) -> Vec<Sample> {
    let mut out = vec![gauge(
        "tracer_session_process_events_total",
        vec![("session", info.id.clone())],
        info.events as f64,
    )];
    for l in &info.losses {
        out.push(gauge(
            "tracer_session_lost_events_total",
            vec![("session", info.id.clone()), ("cause", l.cause.clone())],
            l.count as f64,
        ));
    }
    out
}

impl Manager {
    pub(super) fn metrics(&mut self) -> String {
        self.exported.retain(|_, e| e.at.elapsed() < KEEP_ENDED);
        let losses = self.bpf.losses();
        let mut samples = vec![metrics::build_info()];
        let mut by_mode = std::collections::BTreeMap::new();
        for s in self.running.values() {
            *by_mode
                .entry(crate::session::mode_name(s.measure.mode().into()))
                .or_insert(0u32) += 1;
        }
        for (mode, n) in by_mode {
            samples.push(gauge(
                "tracer_sessions",
                vec![("state", "running".into()), ("mode", mode.into())],
                f64::from(n),
            ));
        }
        for state in [SessionState::Finished, SessionState::Failed] {
            let n = self
                .finished
                .values()
                .filter(|i| i.state == state as i32)
                .count();
            samples.push(gauge(
                "tracer_sessions",
                vec![(
                    "state",
                    if state == SessionState::Finished {
                        "finished"
                    } else {
                        "failed"
                    }
                    .into(),
                )],
                n as f64,
            ));
        }
        // Exits inferred are not losses: the Python report counts them.
        for (i, n) in losses
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != tracer_common::loss::PY_EXIT_INFERRED as usize)
        {
            let cause = tracer_bpf::loss_cause_name(i as u32);
            samples.push(gauge(
                "tracer_lost_events_total",
                vec![("cause", cause.into())],
                *n as f64,
            ));
        }
        let ids: Vec<String> = self.running.keys().cloned().collect();
        for id in ids {
            let Some(s) = self.running.get_mut(&id) else {
                continue;
            };
            let info = s.info(&losses);
            samples.push(info_sample(&info));
            samples.extend(session_samples(&info));
            if !s.measure.exports_prometheus() {
                continue;
            }
            let slot = s.slot;
            let native = match (&s.sources.native, slot) {
                (Some(n), Some(slot)) => n.live(&mut self.bpf, slot),
                _ => Vec::new(),
            };
            let cuda = s.sources.cuda.as_ref().map(|c| c.live(&mut self.bpf));
            let python = match slot.filter(|_| s.sources.python.is_some()) {
                Some(slot) => {
                    let counts = crate::session::python::counts(&mut self.bpf, slot, false);
                    let s = &self.running[&id];
                    s.sources
                        .python
                        .as_ref()
                        .map(|py| {
                            let mut f = py.functions(counts, Vec::new()).0;
                            // Read off this task; here only the last reading is taken.
                            let followed: std::collections::HashSet<u32> =
                                s.live.iter().chain(&py.gone).copied().collect();
                            for c in &py.inproc {
                                let live = c.peek(followed.clone());
                                f.extend(crate::session::python::inproc_functions(&live).0);
                            }
                            f
                        })
                        .unwrap_or_default()
                }
                None => Vec::new(),
            };
            samples.extend(metrics::session_counts(
                &id,
                &info.counters,
                &python,
                &native,
                cuda.as_ref(),
            ));
        }
        for e in self.exported.values() {
            samples.extend(e.samples.iter().cloned());
        }
        metrics::render(&samples)
    }
}
