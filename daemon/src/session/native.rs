//! Counting mode's native source: one session's uprobes on native functions, and its report.

use aya::programs::uprobe::UProbeLinkId;

use crate::{
    bpf::Bpf,
    error::Error,
    native::NativeTarget,
    report::{NativeCalls, NativeProbe, NativeReport},
};

pub struct NativeSession {
    targets: Vec<NativeTarget>,
    links: Vec<UProbeLinkId>,
}

impl NativeSession {
    /// Attaches a counter to every target for session `slot`; all or nothing.
    pub fn attach(
        bpf: &mut Bpf,
        targets: Vec<NativeTarget>,
        slot: u8,
        all: bool,
    ) -> Result<Self, Error> {
        let mut links = Vec::with_capacity(targets.len());
        for (i, t) in targets.iter().enumerate() {
            let probe = u32::try_from(i).unwrap_or(u32::MAX);
            match bpf.attach_native(t, slot, all, probe) {
                Ok(link) => links.push(link),
                Err(e) => {
                    bpf.detach_native(links);
                    return Err(Error::FailedPrecondition(format!(
                        "attaching a uprobe to {} in {}: {e}",
                        t.symbol, t.display
                    )));
                }
            }
        }
        Ok(Self { targets, links })
    }

    /// Functions probed.
    pub fn probes(&self) -> usize {
        self.targets.len()
    }

    /// "BINARY:SYMBOL" of each probe, by probe number.
    pub fn labels(&self) -> Vec<String> {
        self.targets
            .iter()
            .map(|t| format!("{}:{}", t.display, t.symbol))
            .collect()
    }

    /// The counts so far, left in the kernel.
    pub fn live(&self, bpf: &mut Bpf, slot: u8) -> Vec<NativeCalls> {
        self.named(bpf.native_counts(slot, false))
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

    /// Detaches the probes, then takes the session's counts out of the kernel.
    pub fn finish(mut self, bpf: &mut Bpf, slot: u8) -> NativeReport {
        bpf.detach_native(std::mem::take(&mut self.links));
        let counts = bpf.native_counts(slot, true);
        let mut calls = self.named(counts);
        calls.sort_by(|a, b| {
            b.calls
                .cmp(&a.calls)
                .then_with(|| a.symbol.cmp(&b.symbol))
                .then(a.pid.cmp(&b.pid))
        });
        NativeReport {
            probes: self
                .targets
                .iter()
                .map(|t| NativeProbe {
                    spec: t.spec.clone(),
                    binary: t.display.clone(),
                    symbol: t.symbol.clone(),
                })
                .collect(),
            calls,
        }
    }
}
