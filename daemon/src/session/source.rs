//! What a session does with the probes any mode may count with (Python calls, `--uprobe`
//! functions, CUDA launches), whatever their kind. Each kind is a folder of its own
//! (`python/`, `native/`, `cuda/`) whose session-side type is a [`Source`]: the session
//! tells it of the processes it follows, asks it for its part of a report so far, and ends
//! it, the same way for every kind. What only one kind does (handing a process counted
//! in-process to the probes, probing a CUDA library a process maps) stays that type's own.

use std::{any::Any, collections::BTreeSet};

use tracer_bpf::{Bpf, ProbeSet};

use super::{Ends, ReportPart};

/// One kind of probe a session counts with, from the session's start to its report.
pub trait Source: Any + Send {
    /// Whether it ends after the others: its counts are read once their probes are off.
    fn ends_last(&self) -> bool {
        false
    }

    /// Whether probes of its are still being attached: a start is answered once they are
    /// on, since what the caller does meanwhile would not be counted.
    fn probing(&self) -> bool {
        false
    }

    /// The native probes it holds for the session's user (capped per user).
    fn user_probes(&self) -> usize {
        0
    }

    /// Whether it counts Python calls, which may still be running in the followed
    /// processes' threads when the session ends.
    fn counts_python_calls(&self) -> bool {
        false
    }

    /// A followed process exec'd: stopped at its exec (EXEC_HOLD), its new program not run.
    fn exec(&mut self, _pid: u32) {}

    /// A followed process is gone.
    fn exited(&mut self, _pid: u32) {}

    /// Whether the processes the session follows stop at each exec for it (EXEC_HOLD), so
    /// that it looks at the new program before that runs an instruction.
    fn holds_at_exec(&self) -> bool {
        false
    }

    /// Whether it names what it counts with what the sampler read of the processes (which
    /// must then hear of their exits).
    fn uses_sampler(&self) -> bool {
        false
    }

    /// Its part of a running session's report so far, read without taking anything out of
    /// the kernel's maps.
    fn interim(&self, _at: &mut Reading<'_>) -> Option<Box<dyn ReportPart>> {
        None
    }

    /// The session ended: its last readings (or the maps to read them from off the
    /// manager's task, the slot held until then), and its probes to detach.
    fn end(self: Box<Self>, at: &mut Ending<'_, '_>) -> Ended;
}

/// The sources a session counts with, in the order they end: each kind found by its type for
/// what only that kind does, all of them as [`Source`]s for what every kind does. A new kind
/// is a folder with a [`Source`] and a line where sessions open their sources.
#[derive(Default)]
pub struct Sources(Vec<Box<dyn Source>>);

impl Sources {
    /// The sources opened for a session, those that end last put last.
    pub fn new(opened: impl IntoIterator<Item = Option<Box<dyn Source>>>) -> Self {
        let mut all: Vec<Box<dyn Source>> = opened.into_iter().flatten().collect();
        all.sort_by_key(|s| s.ends_last());
        Self(all)
    }

    /// Its source of kind `T`, if it counts with one.
    pub fn get<T: Source>(&self) -> Option<&T> {
        self.0.iter().find_map(|s| {
            let any: &dyn Any = &**s;
            any.downcast_ref()
        })
    }

    /// `get`, to change.
    pub fn get_mut<T: Source>(&mut self) -> Option<&mut T> {
        self.0.iter_mut().find_map(|s| {
            let any: &mut dyn Any = &mut **s;
            any.downcast_mut()
        })
    }

    /// Whether it counts with a source of kind `T`.
    pub fn has<T: Source>(&self) -> bool {
        self.get::<T>().is_some()
    }

    /// Every source, in the order they end.
    pub fn each(&mut self) -> impl Iterator<Item = &mut dyn Source> {
        self.0.iter_mut().map(|s| &mut **s as &mut dyn Source)
    }

    /// Every source, to ask.
    pub fn all(&self) -> impl Iterator<Item = &dyn Source> {
        self.0.iter().map(|s| &**s as &dyn Source)
    }

    /// Every source, taken out of the session to end (in the order they end).
    pub fn take(&mut self) -> Vec<Box<dyn Source>> {
        std::mem::take(&mut self.0)
    }
}

/// What a running session's source reads its interim part with.
pub struct Reading<'a> {
    pub bpf: &'a mut Bpf,
    pub slot: u8,
    /// The processes the session follows now.
    pub live: &'a BTreeSet<u32>,
}

/// What an ended session's source ends with.
pub struct Ending<'a, 'b> {
    pub ends: &'a mut Ends<'b>,
    pub slot: u8,
    /// The processes the session followed until its end.
    pub live: &'a BTreeSet<u32>,
    /// Calls whose return the probes inferred rather than saw while the session ran.
    pub inferred_exits: u64,
}

/// A part named already (a report so far), set into the report as it is.
pub struct Named<F>(pub F);

impl<F: FnOnce(&mut tracer_report::Report) + Send> ReportPart for Named<F> {
    fn fill(self: Box<Self>, report: &mut tracer_report::Report) {
        (self.0)(report);
    }
}

/// What an ended source leaves.
#[derive(Default)]
pub struct Ended {
    /// Its probes, detached off the manager's task.
    pub probes: Option<ProbeSet>,
    /// What it counted, named off the manager's task.
    pub part: Option<Box<dyn ReportPart>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Early(u32);
    struct Last;
    struct Absent;

    impl Source for Early {
        fn end(self: Box<Self>, _: &mut Ending<'_, '_>) -> Ended {
            Ended::default()
        }
    }

    impl Source for Last {
        fn ends_last(&self) -> bool {
            true
        }
        fn end(self: Box<Self>, _: &mut Ending<'_, '_>) -> Ended {
            Ended::default()
        }
    }

    impl Source for Absent {
        fn end(self: Box<Self>, _: &mut Ending<'_, '_>) -> Ended {
            Ended::default()
        }
    }

    #[test]
    fn sources_are_found_by_kind_and_end_in_order() {
        let mut s = Sources::new([
            Some(Box::new(Last) as Box<dyn Source>),
            None,
            Some(Box::new(Early(7)) as Box<dyn Source>),
        ]);
        assert_eq!(s.get::<Early>().map(|e| e.0), Some(7));
        s.get_mut::<Early>().unwrap().0 = 8;
        assert_eq!(s.get::<Early>().map(|e| e.0), Some(8));
        assert!(s.has::<Last>());
        assert!(!s.has::<Absent>());
        assert_eq!(s.all().count(), 2);
        let order: Vec<bool> = s.take().iter().map(|s| s.ends_last()).collect();
        assert_eq!(order, [false, true]);
        assert_eq!(s.all().count(), 0);
    }
}
