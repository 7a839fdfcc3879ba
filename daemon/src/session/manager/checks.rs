//! What a start asks, checked before anything is opened: each mode's own options, the push
//! endpoint, `launched`, and whether the target can be counted in-process.

use std::time::Duration;

use tracer_proto::{target, CountingOptions, Mode, StartSessionRequest, Target};

use super::{counts_python, MAX_DURATION_MS};
use crate::{
    access::Caller,
    error::Error,
    session::{
        counting,
        tracing::{self, Limits},
    },
};
use tracer_bpf::perf::{self, EventSpec};
use tracer_inspect::process;

/// Samples per second on each CPU unless asked otherwise: perf's and py-spy's habit of an odd
/// rate, so that sampling does not beat in step with periodic work.
const DEFAULT_FREQUENCY: u64 = 99;

/// A wall-clock session's shortest off-CPU record unless asked otherwise.
const DEFAULT_OFF_CPU_MIN_US: u32 = 5_000;

/// Off-CPU time's shortest record in ns (sampling) or event (tracing: a thread state on
/// the timeline), for sessions that ask for it (`--off-cpu`).
fn off_cpu_min(mode: Mode, req: &StartSessionRequest) -> Result<Option<u64>, Error> {
    let Some(o) = req.sampling.as_ref() else {
        return Ok(None);
    };
    if !o.off_cpu {
        if o.off_cpu_min_us != 0 {
            return Err(Error::InvalidArgument(
                "an off-CPU minimum is for off-CPU time: it needs --off-cpu".into(),
            ));
        }
        return Ok(None);
    }
    if mode == Mode::Counting {
        return Err(Error::InvalidArgument(
            "off-CPU time (--off-cpu) is for sampling and tracing sessions".into(),
        ));
    }
    match o.off_cpu_min_us {
        0 => Ok(Some(u64::from(DEFAULT_OFF_CPU_MIN_US) * 1000)),
        us if !(100..=1_000_000).contains(&us) => Err(Error::InvalidArgument(
            "the off-CPU minimum must be from 100us to 1s".into(),
        )),
        us => Ok(Some(u64::from(us) * 1000)),
    }
}

/// Continuous profiling's endpoint and period, for sampling sessions that ask for it.
fn continuous_options(
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
    let endpoint = crate::continuous::Endpoint::parse(
        &o.push_url,
        o.push_tls.as_ref().map_or([&[][..]; 3], |t| {
            [&t.ca_pem[..], &t.cert_pem[..], &t.key_pem[..]]
        }),
    )
    .map_err(Error::InvalidArgument)?;
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
fn sampling_frequency(sampling: bool, req: &StartSessionRequest) -> Result<Option<u64>, Error> {
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
        hz if hz > tracer_bpf::sampler::MAX_FREQUENCY => Err(Error::InvalidArgument(format!(
            "frequency {hz} Hz is above the {} Hz tracer allows",
            tracer_bpf::sampler::MAX_FREQUENCY
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

/// The pid of a start that may count its target in-process, and whether it is launched: a
/// counting session with `--python` (not `--python-uprobes-only`) of a process the caller
/// may trace, running or held before its exec by the caller.
pub(super) fn inproc_candidate(req: &StartSessionRequest, caller: &Caller) -> Option<(u32, bool)> {
    let options = req.counting.as_ref()?;
    let target = req.target.as_ref()?;
    let pid = match target.kind {
        Some(target::Kind::Pid(pid)) if pid != 0 => pid,
        _ => return None,
    };
    (req.mode == Mode::Counting as i32
        && options.python
        && !options.python_uprobes_only
        && caller.may_trace_pid(pid).is_ok()
        && process::alive(pid)
        && (!target.launched || check_launched(pid, caller).is_ok()))
    .then_some((pid, target.launched))
}

/// What a start asks, each option checked against its mode and the others.
pub(super) struct Asked {
    pub(super) mode: Mode,
    /// Sampling: samples per second on each CPU.
    pub(super) frequency: Option<u64>,
    /// Wall-clock sampling: the shortest off-CPU record, in ns.
    pub(super) off_cpu: Option<u64>,
    /// Sampling: samples in asyncio tasks start with the tasks awaiting them.
    pub(super) tasks: bool,
    /// Continuous profiling's endpoint and period.
    pub(super) push: Option<(crate::continuous::Endpoint, Duration)>,
    /// Tracing: the trace's limits and its counters' period.
    pub(super) trace_limits: Option<(Limits, Duration)>,
    /// 0: until stopped or the target exits.
    pub(super) duration_ms: u64,
    pub(super) target: Target,
    pub(super) options: CountingOptions,
    /// Whether Python calls are counted.
    pub(super) python: bool,
    /// perf counters to open: none for sampling, nor when other sources were asked for and
    /// no event was named.
    pub(super) specs: Vec<&'static EventSpec>,
}

/// Checks what `req` asks before anything is opened.
pub(super) fn asked(req: StartSessionRequest) -> Result<Asked, Error> {
    let mode = Mode::try_from(req.mode)
        .map_err(|_| Error::InvalidArgument(format!("unknown mode {}", req.mode)))?;
    match mode {
        Mode::Unspecified => {
            return Err(Error::InvalidArgument(
                "a mode is required: counting, sampling or tracing".into(),
            ))
        }
        Mode::Counting | Mode::Sampling | Mode::Tracing => {}
    }
    let sampling = mode == Mode::Sampling;
    let trace_mode = mode == Mode::Tracing;
    let frequency = sampling_frequency(sampling, &req)?;
    let off_cpu = off_cpu_min(mode, &req)?;
    let push = continuous_options(&req)?;
    let tasks = req.sampling.as_ref().is_some_and(|o| o.asyncio_tasks);
    if tasks && !sampling {
        return Err(Error::InvalidArgument(
            "asyncio task stacks (--asyncio) are for sampling sessions".into(),
        ));
    }
    let trace_limits = match (&req.tracing, trace_mode) {
            (Some(o), false) if *o != Default::default() => {
                return Err(Error::InvalidArgument(
                    "trace buffer, file and counter period options are for tracing sessions (--mode=tracing)".into(),
                ))
            }
            (o, true) => Some(tracing::limits(&o.unwrap_or_default())?),
            _ => None,
        };
    let duration_ms = match req.duration_ms {
        None => 0,
        Some(0) => {
            return Err(Error::InvalidArgument(
                "duration must be greater than 0".into(),
            ))
        }
        Some(d) if d > MAX_DURATION_MS => {
            return Err(Error::InvalidArgument(
                "duration must be at most 24h".into(),
            ))
        }
        Some(d) => d,
    };
    let target = req
        .target
        .ok_or_else(|| Error::InvalidArgument("a target is required: a pid, or all".into()))?;
    let mut options = req.counting.unwrap_or_default();
    if options.export_prometheus && mode != Mode::Counting {
        return Err(Error::InvalidArgument(
            "--export prometheus is for counting sessions".into(),
        ));
    }
    if (options.cuda_stacks || options.cuda_driver_only) && !options.cuda {
        return Err(Error::InvalidArgument(
                "--cuda-stacks and --cuda-driver-only shape how CUDA launches are probed: they need --cuda".into(),
            ));
    }
    if options.gpu_times
        && (!options.cuda || target.launched || !matches!(target.kind, Some(target::Kind::Pid(_))))
    {
        return Err(Error::InvalidArgument(
            "--gpu-times turns CUPTI on in a running process: it needs --cuda and --pid (a command started under tracer gets it from its launcher)".into(),
        ));
    }
    if options.cuda_in_process
        && (!options.cuda
            || !matches!(target.kind, Some(target::Kind::Pid(_)))
            || !matches!(mode, Mode::Counting | Mode::Tracing)
            || options.cuda_stacks
            || options.cuda_driver_only)
    {
        return Err(Error::InvalidArgument(
            "--cuda-in-process counts a process's launches through tracer's injection library: it needs --cuda, --pid or -- CMD, counting or tracing mode, and neither --cuda-stacks nor --cuda-driver-only (which shape the launch probes)".into(),
        ));
    }
    if options.cuda_uprobes_only && (!options.cuda || options.cuda_in_process) {
        return Err(Error::InvalidArgument(
            "--cuda-uprobes-only says how CUDA launches are counted: it needs --cuda, and not --cuda-in-process".into(),
        ));
    }
    // By default a process's launches (a running one's, a launched command's) are counted
    // in-process where its launch probes are not asked to do more (stacks, the driver only)
    // and nothing says otherwise: where that cannot be had, the probes count them and the
    // report says why.
    options.cuda_in_process |= options.cuda
        && !options.cuda_uprobes_only
        && matches!(mode, Mode::Counting | Mode::Tracing)
        && matches!(target.kind, Some(target::Kind::Pid(_)))
        && !options.cuda_stacks
        && !options.cuda_driver_only;
    if options.python_uprobes_only && !options.python {
        return Err(Error::InvalidArgument(
            "--python-uprobes-only says how Python calls are counted: it needs --python".into(),
        ));
    }
    if options.cuda_stacks && mode == Mode::Sampling {
        return Err(Error::InvalidArgument(
                "--cuda-stacks is for counting and tracing sessions: a sampling session's profile is CPU time, not launches".into(),
            ));
    }
    let python = counts_python(mode, &options);
    // With --python or --uprobe, perf counters are only what was asked for.
    let specs = if sampling
        || (python || trace_mode || options.cuda || !options.uprobes.is_empty())
            && options.events.is_empty()
    {
        Vec::new()
    } else {
        counting::resolve(&options.events)?
    };
    Ok(Asked {
        mode,
        frequency,
        off_cpu,
        tasks,
        push,
        trace_limits,
        duration_ms,
        target,
        options,
        python,
        specs,
    })
}

/// What a start's target covers: its threads (a pid the caller may trace, alive now) or every
/// CPU (all, for a caller who may trace everything); and the pid, if one.
pub(super) fn scope(target: &Target, caller: &Caller) -> Result<(perf::Scope, Option<u32>), Error> {
    match target.kind {
        Some(target::Kind::Pid(0)) | None => Err(Error::InvalidArgument(
            "a target is required: a pid, or all".into(),
        )),
        Some(target::Kind::All(false)) => Err(Error::InvalidArgument(
            "a target is required: a pid, or all = true (all = false names nothing)".into(),
        )),
        Some(target::Kind::Pid(pid)) => {
            caller.may_trace_pid(pid)?;
            if !process::alive(pid) {
                return Err(Error::NoSuchProcess { pid });
            }
            if target.launched {
                check_launched(pid, caller)?;
            }
            let tids = process::threads(pid).map_err(|_| Error::NoSuchProcess { pid })?;
            crate::container::note(pid, true);
            let scope = perf::Scope::Threads {
                tids,
                on_exec: target.launched,
            };
            Ok((scope, Some(pid)))
        }
        Some(target::Kind::All(true)) => {
            if target.launched {
                return Err(Error::InvalidArgument(
                    "launched is for a pid tracerctl started, not a system-wide session".into(),
                ));
            }
            caller.may_trace_all()?;
            let cpus = perf::online_cpus().map_err(|e| Error::io("listing online CPUs", e))?;
            Ok((perf::Scope::Cpus(cpus), None))
        }
    }
}
