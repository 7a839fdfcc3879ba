//! What a start asks, checked before anything is opened: each mode's own options, the push
//! endpoint, `launched`, and whether the target can be counted in-process.

use std::time::Duration;

use tracer_proto::{target, Mode, StartSessionRequest};

use crate::{access::Caller, error::Error, process};

/// Samples per second on each CPU unless asked otherwise: perf's and py-spy's habit of an odd
/// rate, so that sampling does not beat in step with periodic work.
const DEFAULT_FREQUENCY: u64 = 99;

/// Continuous profiling's endpoint and period, for sampling sessions that ask for it.
pub(super) fn continuous_options(
    req: &StartSessionRequest,
) -> Result<Option<(crate::continuous::Endpoint, Duration)>, Error> {
    let Some(o) = req.sampling.as_ref().filter(|o| !o.push_url.is_empty()) else {
        if req.sampling.as_ref().is_some_and(|o| o.push_period_ms != 0) {
            return Err(Error::InvalidArgument(
                "a push period needs a push endpoint (--push URL)".into(),
            ));
        }
        return Ok(None);
    };
    if req.mode != Mode::Sampling as i32 {
        return Err(Error::InvalidArgument(
            "pushing profiles (--push) is for sampling sessions".into(),
        ));
    }
    let endpoint =
        crate::continuous::Endpoint::parse(&o.push_url).map_err(Error::InvalidArgument)?;
    let period = match o.push_period_ms {
        0 => Duration::from_secs(15),
        ms if !(1000..=3_600_000).contains(&ms) => {
            return Err(Error::InvalidArgument(
                "the push period must be from 1s to 1h".into(),
            ))
        }
        ms => Duration::from_millis(u64::from(ms)),
    };
    Ok(Some((endpoint, period)))
}

/// The sampling frequency of a sampling session (None for other modes), checking that each
/// mode gets only its own options.
pub(super) fn sampling_frequency(
    sampling: bool,
    req: &StartSessionRequest,
) -> Result<Option<u64>, Error> {
    let asked = req.sampling.as_ref().map_or(0, |s| s.frequency_hz);
    if !sampling {
        if asked != 0 {
            return Err(Error::InvalidArgument(
                "a sampling frequency is for sampling sessions (--mode=sampling)".into(),
            ));
        }
        return Ok(None);
    }
    if let Some(c) = &req.counting {
        if c.python || !c.uprobes.is_empty() || !c.events.is_empty() {
            return Err(Error::InvalidArgument(
                "--python, --uprobe and --events are counting-mode options; sampling mode records stacks of every thread, Python frames included".into(),
            ));
        }
    }
    match asked {
        0 => Ok(Some(DEFAULT_FREQUENCY)),
        hz if hz > crate::sampler::MAX_FREQUENCY => Err(Error::InvalidArgument(format!(
            "frequency {hz} Hz is above the {} Hz tracer allows",
            crate::sampler::MAX_FREQUENCY
        ))),
        hz => Ok(Some(hz)),
    }
}

/// `launched` counts from the target's exec: it must be a child the caller forked and holds
/// before its exec, or it would count nothing. Checked as far as /proc tells: the caller is
/// its parent, and it still runs the caller's executable.
pub(super) fn check_launched(pid: u32, caller: &Caller) -> Result<(), Error> {
    let not = |why: String| {
        Err(Error::InvalidArgument(format!(
            "launched: pid {pid} is not a command held before its exec by the caller ({why}); give the pid without launched"
        )))
    };
    let Some(parent) = caller.pid else {
        return not("only a local client's own child can be".into());
    };
    let ppid = process::parent(pid).ok_or(Error::NoSuchProcess { pid })?;
    if ppid != parent {
        return not(format!("its parent is pid {ppid}"));
    }
    let exe = |p: u32| std::fs::read_link(format!("/proc/{p}/exe")).ok();
    match (exe(pid), exe(parent)) {
        (Some(a), Some(b)) if a == b => Ok(()),
        _ => not("it has exec'd already".into()),
    }
}

/// The pid of a start that may count its target in-process: a counting session with
/// `--python` (not `--python-uprobes-only`) of a running process the caller may trace.
pub(super) fn inproc_candidate(req: &StartSessionRequest, caller: &Caller) -> Option<u32> {
    let options = req.counting.as_ref()?;
    let target = req.target.as_ref()?;
    let pid = match target.kind {
        Some(target::Kind::Pid(pid)) if pid != 0 && !target.launched => pid,
        _ => return None,
    };
    (req.mode == Mode::Counting as i32
        && options.python
        && !options.python_uprobes_only
        && caller.may_trace_pid(pid).is_ok()
        && process::alive(pid))
    .then_some(pid)
}
