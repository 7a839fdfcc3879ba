//! A running session's report so far (`GetReport` with `interim`), what `tracerctl top`
//! shows every second: read here without stopping or taking anything (kernel counts stay in
//! their maps, in-process counters are peeked, the sampling histogram is copied), and named
//! off this task by the caller. CUDA parts are not in it: naming launch callers reads
//! symbol tables of libraries of hundreds of MB, work for the end.

use super::*;
use crate::session::python::inproc_functions;
use tracer_report::PythonReport;

impl Manager {
    pub(super) fn interim(&mut self, id: &str) -> Result<Fetched, Error> {
        let losses = self.bpf.losses();
        let (slot, counts_python) = {
            let s = self
                .running
                .get(id)
                .ok_or_else(|| Error::NoSuchSession { id: id.into() })?;
            (s.slot, s.python.is_some())
        };
        // Read before the session is borrowed: reading takes the manager's maps.
        let counts = slot
            .filter(|_| counts_python)
            .map(|slot| self.python_counts(slot, false));
        let s = self.running.get_mut(id).expect("looked up above");
        let info = s.info(&losses);
        let mut report = build_report(&info, s.followed, s.command.clone());
        if let (Some(n), Some(slot)) = (s.native.as_ref(), slot) {
            // Counted in the kernel, left there; named from the probes' own list.
            report.native = Some(n.report(self.bpf.native_counts(slot, false)));
        }
        if let (Some(py), Some(counts)) = (s.python.as_ref(), counts) {
            let (mut functions, unknown_names) = py.functions(counts, Vec::new());
            let followed: std::collections::HashSet<u32> =
                s.live.iter().chain(&py.gone).copied().collect();
            for c in &py.inproc {
                functions.extend(inproc_functions(&c.peek(followed.clone())).0);
            }
            tracer_report::sort_functions(&mut functions, "tottime");
            report.python = Some(PythonReport {
                functions,
                unknown_names,
                warnings: vec![
                    "interim: calls still running are not in these times until they return; in-process counts are those read last (about once a second, from the first report asked)".into(),
                ],
                counted: py.counted.clone(),
                ..PythonReport::default()
            });
        }
        let parts = s.measure.interim(&self.sampling).into_iter().collect();
        Ok(Fetched::Interim(Box::new(report), parts))
    }
}
