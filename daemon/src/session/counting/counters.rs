//! Counting mode's perf-counter source: the requested events, opened on the target.

use perf_event::Counter as PerfCounter;
use tracer_proto::{counter, Counter};

use crate::error::Error;
use tracer_bpf::perf::{self, EventSpec, Scope};

enum Slot {
    Open {
        spec: &'static EventSpec,
        counters: Vec<PerfCounter>,
        last: perf::Reading,
    },
    Unavailable {
        spec: &'static EventSpec,
        reason: String,
    },
}

pub struct Counting {
    slots: Vec<Slot>,
    /// The counters start at the target's exec (a launched command).
    on_exec: bool,
}

/// Why a launched target's counters read nothing: they were never enabled. A gRPC client
/// can set `launched` on a child that never execs, and its zeros must not pass for counts.
const NOT_EXECD: &str =
    "not enabled: counting starts at the launched target's exec, and it has not exec'd";

/// Resolves event names, rejecting unknown ones; empty means the default set.
pub fn resolve(events: &[String]) -> Result<Vec<&'static EventSpec>, Error> {
    let names: Vec<&str> = if events.is_empty() {
        perf::DEFAULT_EVENTS.to_vec()
    } else {
        events
            .iter()
            .flat_map(|e| e.split(','))
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect()
    };
    let mut specs: Vec<&'static EventSpec> = Vec::new();
    for name in names {
        let spec = perf::lookup(name).ok_or_else(|| {
            let known: Vec<&str> = perf::EVENTS.iter().map(|e| e.name).collect();
            Error::InvalidArgument(format!(
                "unknown event '{name}' (known: {})",
                known.join(", ")
            ))
        })?;
        if !specs.iter().any(|s| s.name == spec.name) {
            specs.push(spec);
        }
    }
    Ok(specs)
}

impl Counting {
    /// Opens every event on `scope`. An event this machine lacks becomes "unavailable" with its
    /// reason; only a vanished target fails the whole session.
    pub fn open(
        specs: &[&'static EventSpec],
        scope: &Scope,
        pid: Option<u32>,
    ) -> Result<Self, Error> {
        let mut slots = Vec::new();
        for &spec in specs {
            match spec.open(scope) {
                Ok(counters) => slots.push(Slot::Open {
                    spec,
                    counters,
                    last: perf::Reading::default(),
                }),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                    return Err(Error::NoSuchProcess {
                        pid: pid.unwrap_or_default(),
                    });
                }
                Err(e) => slots.push(Slot::Unavailable {
                    spec,
                    reason: perf::unavailable_reason(spec, &e),
                }),
            }
        }
        Ok(Self {
            slots,
            on_exec: matches!(scope, Scope::Threads { on_exec: true, .. }),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Current totals. A counter that cannot be read keeps its last value.
    pub fn read(&mut self) -> Vec<Counter> {
        self.slots
            .iter_mut()
            .map(|slot| match slot {
                Slot::Open {
                    spec,
                    counters,
                    last,
                } => {
                    if let Ok(r) = perf::read(counters) {
                        *last = r;
                    }
                    if self.on_exec && last.time_enabled_ns == 0 {
                        return unavailable(spec, NOT_EXECD.into());
                    }
                    Counter {
                        event: spec.name.into(),
                        result: Some(counter::Result::Value(last.value)),
                        unit: spec.unit.into(),
                        time_enabled_ns: last.time_enabled_ns,
                        time_running_ns: last.time_running_ns,
                    }
                }
                Slot::Unavailable { spec, reason } => unavailable(spec, reason.clone()),
            })
            .collect()
    }
}

/// A counter that reads nothing, and why.
fn unavailable(spec: &EventSpec, why: String) -> Counter {
    Counter {
        event: spec.name.into(),
        result: Some(counter::Result::Unavailable(why)),
        unit: spec.unit.into(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_lists_resolve() {
        let names = |v: &[&str]| resolve(&v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        let specs = names(&["task-clock,page-faults", "cs", "page-faults"]).unwrap();
        let got: Vec<&str> = specs.iter().map(|s| s.name).collect();
        assert_eq!(got, ["task-clock", "page-faults", "context-switches"]);
        let err = names(&["task-clock,bogus"]).unwrap_err();
        assert!(
            err.to_string().starts_with("unknown event 'bogus'"),
            "{err}"
        );
        assert_eq!(names(&[]).unwrap().len(), perf::DEFAULT_EVENTS.len());
    }
}
