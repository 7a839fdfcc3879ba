//! A running session's report so far (`GetReport` with `interim`), what `tracerctl top`
//! shows every second: read here without stopping or taking anything (kernel counts stay in
//! their maps, in-process counters are peeked, the sampling histogram is copied), and named
//! off this task by the caller. Each of the session's sources gives its part
//! (`Source::interim`); CUDA launches come without their native callers, which are named
//! from symbol tables of libraries of hundreds of MB at the end.

use super::*;

impl Manager {
    pub(super) fn interim(&mut self, id: &str) -> Result<Fetched, Error> {
        let losses = self.bpf.losses();
        let s = self
            .running
            .get_mut(id)
            .ok_or_else(|| Error::NoSuchSession { id: id.into() })?;
        let info = s.info(&losses);
        let report = build_report(&info, s.followed, s.command.clone());
        let mut parts: Vec<_> = s.measure.interim(&self.sampling).into_iter().collect();
        parts.extend(s.sources_so_far(&mut self.bpf));
        Ok(Fetched::Interim(Box::new(report), parts))
    }
}
