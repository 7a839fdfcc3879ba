//! Counting mode's native source: one session's uprobes on native functions, and its report.

use super::{
    slots::LastCounts,
    source::{Ended, Ending, Named, Reading, Source},
    ReportPart,
};
use crate::error::Error;
use tracer_bpf::{NativeAttacher, NativeMaps, ProbeSet};
use tracer_inspect::native::NativeTarget;
use tracer_report::{NativeCalls, NativeProbe, NativeReport};

pub struct NativeSession {
    /// By probe number, the skipped ones included.
    targets: Vec<NativeTarget>,
    links: ProbeSet,
    /// Targets that could not be probed (by probe number), and why.
    skipped: Vec<(usize, String)>,
}

impl NativeSession {
    /// Attaches a counter to every target for session `slot`. A function the kernel will not
    /// probe (one of a pattern's many, say) is skipped and named in the report; the session
    /// fails only when none could be probed. Attaching thousands of probes, to a binary many
    /// processes map, takes long: the manager has it done on a blocking thread.
    pub fn attach(
        attacher: &NativeAttacher,
        targets: Vec<NativeTarget>,
        slot: u8,
        all: bool,
    ) -> Result<Self, Error> {
        // One set of probes per binary: attached, and later detached, in one step each.
        let mut binaries: Vec<&std::path::Path> =
            targets.iter().map(|t| t.binary.as_path()).collect();
        binaries.sort_unstable();
        binaries.dedup();
        let mut links = ProbeSet::default();
        let mut skipped = Vec::new();
        for binary in binaries {
            let numbers: Vec<usize> = (0..targets.len())
                .filter(|&i| targets[i].binary == binary)
                .collect();
            let points: Vec<(u64, u32)> = numbers
                .iter()
                .map(|&i| (targets[i].file_offset, u32::try_from(i).unwrap_or(u32::MAX)))
                .collect();
            match attacher.attach(binary, &points, slot, all) {
                Ok((set, refused)) => {
                    links.extend(set);
                    skipped.extend(
                        refused
                            .into_iter()
                            .map(|(j, e)| (numbers[j], error_chain(&e))),
                    );
                }
                Err(e) => {
                    let why = error_chain(&e);
                    skipped.extend(numbers.iter().map(|&i| (i, why.clone())));
                }
            }
        }
        skipped.sort_unstable_by_key(|(i, _)| *i);
        if links.is_empty() {
            let (i, why) = &skipped[0];
            let t = &targets[*i];
            let others = match skipped.len() {
                1 => String::new(),
                n => format!(" (nor any of the {} others)", n - 1),
            };
            return Err(Error::FailedPrecondition(format!(
                "attaching a uprobe to {} in {}: {why}{others}",
                t.symbol, t.display
            )));
        }
        Ok(Self {
            targets,
            links,
            skipped,
        })
    }

    /// "BINARY:SYMBOL" of each probe, by probe number.
    pub fn labels(&self) -> Vec<String> {
        self.targets
            .iter()
            .map(|t| format!("{}:{}", t.display, t.symbol))
            .collect()
    }

    fn named(&self, counts: Vec<(u32, u32, u64)>) -> Vec<NativeCalls> {
        counts
            .into_iter()
            .filter_map(|(pid, probe, calls)| {
                let t = self.targets.get(usize::try_from(probe).ok()?)?;
                Some(NativeCalls {
                    pid,
                    binary: t.display.clone(),
                    symbol: t.symbol.clone(),
                    calls,
                })
            })
            .collect()
    }

    /// The probes, taken out to be detached off the manager's task.
    pub fn take_probes(&mut self) -> ProbeSet {
        std::mem::take(&mut self.links)
    }

    /// The report of the session's last `counts` (pid, probe, calls). Probes not taken out
    /// with [`Self::take_probes`] are detached here first.
    pub fn finish(mut self, counts: Vec<(u32, u32, u64)>) -> NativeReport {
        drop(self.take_probes());
        self.report(counts)
    }

    /// The report of `counts` (pid, probe, calls): at the end, or so far (interim).
    pub fn report(&self, counts: Vec<(u32, u32, u64)>) -> NativeReport {
        let mut calls = self.named(counts);
        calls.sort_by(|a, b| {
            b.calls
                .cmp(&a.calls)
                .then_with(|| a.symbol.cmp(&b.symbol))
                .then(a.pid.cmp(&b.pid))
        });
        let skipped: Vec<usize> = self.skipped.iter().map(|(i, _)| *i).collect();
        NativeReport {
            probes: self
                .targets
                .iter()
                .enumerate()
                .filter(|(i, _)| !skipped.contains(i))
                .map(|(_, t)| NativeProbe {
                    spec: t.spec.clone(),
                    binary: t.display.clone(),
                    symbol: t.symbol.clone(),
                })
                .collect(),
            calls,
            not_probed: self
                .skipped
                .iter()
                .map(|(i, why)| {
                    let t = &self.targets[*i];
                    format!("{}:{}: {why}", t.display, t.symbol)
                })
                .collect(),
        }
    }
}

/// An error and its causes on one line: aya names the failed call (`perf_event_open`) and
/// keeps the errno as its source.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out = format!("{out}: {s_text}");
        }
        source = s.source();
    }
    out
}

impl Source for NativeSession {
    /// One a function probed.
    fn user_probes(&self) -> usize {
        self.links.len()
    }

    fn interim(&self, at: &mut Reading<'_>) -> Option<Box<dyn ReportPart>> {
        // Counted in the kernel, left there; named from the probes' own list.
        let native = self.report(at.bpf.native_counts(at.slot, false));
        Some(Box::new(Named(move |r: &mut tracer_report::Report| {
            r.native = Some(native)
        })))
    }

    fn end(mut self: Box<Self>, at: &mut Ending<'_, '_>) -> Ended {
        let probes = self.take_probes();
        let slot = at.slot;
        let maps = at.ends.bpf.native_maps();
        let counts = at
            .ends
            .last_counts(slot, maps, |bpf| bpf.native_counts(slot, true));
        Ended {
            probes: Some(probes),
            part: Some(Box::new(NativeEnd {
                session: *self,
                counts,
            })),
        }
    }
}

/// An ended session's native calls, counted and reported where waiting is fine.
struct NativeEnd {
    session: NativeSession,
    counts: LastCounts<NativeMaps, Vec<(u32, u32, u64)>>,
}

impl ReportPart for NativeEnd {
    fn fill(self: Box<Self>, report: &mut tracer_report::Report) {
        let counts = self.counts.get();
        report.native = Some(self.session.finish(counts));
    }
}
