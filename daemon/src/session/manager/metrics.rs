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
        samples.extend(counts(info, report));
        Ended {
            at: Instant::now(),
            samples,
        }
    }
}

/// A session's counts in its report (interim or final).
fn counts(info: &SessionInfo, report: &Report) -> Vec<Sample> {
    metrics::session_counts(
        &info.id,
        &info.counters,
        report.python.as_ref().map_or(&[], |p| &p.functions),
        report.native.as_ref().map_or(&[], |n| &n.calls),
        report.cuda.as_ref(),
    )
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
        samples.push(gauge(
            "tracer_zeroed_file_pages_total",
            vec![],
            tracer_inspect::sigbus::zeroed_pages() as f64,
        ));
        for (what, n) in crate::conn::refused_totals() {
            samples.push(gauge(
                "tracer_refused_total",
                vec![("what", what.into())],
                n as f64,
            ));
        }
        let loads = tracer_inspect::process::inject::outcomes()
            .chain([("busy", crate::session::loads::refused())]);
        for (outcome, n) in loads {
            samples.push(gauge(
                "tracer_process_loads_total",
                vec![("outcome", outcome.into())],
                n as f64,
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
            // What each source reads for an interim report, as the ended session's report
            // gives it (`Ended`): the same series, running or ended.
            let mut report = Report::default();
            for part in s.sources_so_far(&mut self.bpf) {
                part.fill(&mut report);
            }
            samples.extend(counts(&info, &report));
        }
        for e in self.exported.values() {
            samples.extend(e.samples.iter().cloned());
        }
        metrics::render(&samples)
    }
}
