//! The perf events that drive sampling: one per online CPU for each sampling session, at the
//! session's frequency, each running `tracer_sample` with the session's slot in the attach
//! cookie (aya's perf-event attach takes no cookie, so the link is created by `bpf`).
//!
//! A timer (`cpu-clock`) fires at an exact period: a program whose loop lasts about one
//! period would be seen at the same point of its loop each time, and its shares skewed by
//! many points. The timers are restarted now and then with a period drawn around the asked
//! one ([`Jitter`]), which spreads the samples over every phase of such a loop.

use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    sync::{Arc, Condvar, Mutex},
    thread::JoinHandle,
    time::Duration,
};

use perf_event_open_sys as sys;
use tracer_common::sample_cookie;

/// Highest frequency a session may ask for; the kernel's own limit
/// (kernel.perf_event_max_sample_rate) may be lower.
pub const MAX_FREQUENCY: u64 = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum SamplerError {
    #[error("opening the {event} sampling event on CPU {cpu}: {source}")]
    Open {
        event: &'static str,
        cpu: usize,
        #[source]
        source: io::Error,
    },
    #[error("attaching the sampling program on CPU {cpu}: {source}")]
    Attach {
        cpu: usize,
        #[source]
        source: io::Error,
    },
    #[error("reading the online CPUs: {0}")]
    Cpus(#[source] io::Error),
    #[error("starting the sampling timers' jitter: {0}")]
    Jitter(#[source] io::Error),
}

/// A session's sampling events; dropping it stops sampling.
pub struct Sampler {
    /// What is sampled: `cycles` where the machine has a PMU, else `cpu-clock`.
    pub event: &'static str,
    /// Timers only: a `cycles` event's period varies already (the kernel adjusts it to
    /// keep the frequency).
    jitter: Option<Jitter>,
    // Links before events: closing a link detaches the program.
    _links: Vec<OwnedFd>,
    _events: Vec<OwnedFd>,
}

impl Drop for Sampler {
    fn drop(&mut self) {
        // Joined first: its copies of the events' descriptors close with it, so that the
        // events are gone once the sampler is.
        drop(self.jitter.take());
    }
}

impl Sampler {
    pub fn start(
        program: BorrowedFd<'_>,
        slot: u8,
        all: bool,
        frequency: u64,
    ) -> Result<Self, SamplerError> {
        let cpus = crate::perf::online_cpus().map_err(SamplerError::Cpus)?;
        let Some(&first_cpu) = cpus.first() else {
            return Err(SamplerError::Cpus(io::Error::new(
                io::ErrorKind::InvalidData,
                "no online CPU",
            )));
        };
        // cycles where a PMU exists; cpu-clock (a timer) everywhere. The first CPU's event
        // tells, and is kept.
        let hardware = sys::bindings::PERF_TYPE_HARDWARE;
        let mut first = open(hardware, 0, first_cpu, frequency).ok();
        let (event, type_, config) = if first.is_some() {
            ("cycles", hardware, 0)
        } else {
            (
                "cpu-clock",
                sys::bindings::PERF_TYPE_SOFTWARE,
                u64::from(sys::bindings::PERF_COUNT_SW_CPU_CLOCK),
            )
        };
        let cookie = sample_cookie::make(slot, all);
        let (mut links, mut events) = (Vec::new(), Vec::new());
        for cpu in cpus {
            let fd = match first.take() {
                Some(fd) => fd,
                None => open(type_, config, cpu, frequency)
                    .map_err(|source| SamplerError::Open { event, cpu, source })?,
            };
            let link = crate::perf_link(program, fd.as_fd(), cookie)
                .map_err(|source| SamplerError::Attach { cpu, source })?;
            // SAFETY: ioctl on a perf event fd we own.
            if unsafe { sys::ioctls::ENABLE(fd.as_raw_fd(), 0) } != 0 {
                return Err(SamplerError::Attach {
                    cpu,
                    source: io::Error::last_os_error(),
                });
            }
            links.push(link);
            events.push(fd);
        }
        let jitter = match event {
            "cpu-clock" => Some(Jitter::start(&events, 1_000_000_000 / frequency.max(1))?),
            _ => None,
        };
        Ok(Self {
            event,
            jitter,
            _links: links,
            _events: events,
        })
    }
}

/// Restarts the timers every `n` to `3n` periods (`n` ≥ 4, and ≥ 10 ms so that a high
/// frequency on many CPUs does not make this thread busy), each time with a period whose
/// rate is drawn uniformly within ±50% of the asked frequency: samples fall at every phase
/// of a loop.
///
/// Reports give each sample the asked period, so the mean rate must stay the asked one:
/// rates (not periods) are drawn uniformly, and a restart starts a whole new period (the
/// kernel drops what had run of the current one), which loses half a sample on average, one
/// in `4n` over the `2n` periods between restarts, made up by rates `4n / (4n - 1)` of the
/// asked one on average.
struct Jitter {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Jitter {
    fn start(events: &[OwnedFd], period_ns: u64) -> Result<Self, SamplerError> {
        let fds = events
            .iter()
            .map(OwnedFd::try_clone)
            .collect::<io::Result<Vec<_>>>()
            .map_err(SamplerError::Jitter)?;
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("sampling-jitter".into())
            .spawn(move || {
                let mut rng = fastrand::Rng::new();
                let n = 10_000_000u64.div_ceil(period_ns.max(1)).max(4);
                let (lock, cvar) = &*stopped;
                let mut done = lock.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    let wait = Duration::from_nanos(period_ns * rng.u64(n..=3 * n));
                    done = cvar
                        .wait_timeout_while(done, wait, |d| !*d)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                    if *done {
                        return;
                    }
                    for fd in &fds {
                        // In 1/1024ths of the asked rate.
                        let rate = rng.u64(512..=1536) * 4 * n / (4 * n - 1);
                        let period = period_ns * 1024 / rate;
                        // SAFETY: ioctl on a perf event fd we own; the kernel reads a u64
                        // through the pointer passed as the argument.
                        let rc = unsafe {
                            sys::ioctls::PERIOD(fd.as_raw_fd(), &period as *const u64 as u64)
                        };
                        if rc != 0 {
                            // The period stays as it was: samples as without jitter.
                            let error = io::Error::last_os_error();
                            tracing::debug!(%error, "no new sampling period");
                        }
                    }
                }
            })
            .map_err(SamplerError::Jitter)?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Jitter {
    fn drop(&mut self) {
        let (lock, cvar) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cvar.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A disabled, frequency-driven sampling event for every task on one CPU.
fn open(type_: u32, config: u64, cpu: usize, frequency: u64) -> io::Result<OwnedFd> {
    let mut attr = sys::bindings::perf_event_attr::default();
    attr.type_ = type_;
    attr.config = config;
    attr.__bindgen_anon_1.sample_freq = frequency;
    attr.set_freq(1);
    attr.set_disabled(1);
    // pid -1 with a cpu: every task on that CPU.
    crate::perf::open_raw(&mut attr, -1, cpu as i32)
}
