//! The perf events that drive sampling: one per online CPU for each sampling session, at the
//! session's frequency, each running `tracer_sample` with the session's slot in the attach
//! cookie (aya's perf-event attach takes no cookie, so the link is created by `bpf`).

use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
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
}

/// A session's sampling events; dropping it stops sampling.
pub struct Sampler {
    /// What is sampled: `cycles` where the machine has a PMU, else `cpu-clock`.
    pub event: &'static str,
    // Links before events: closing a link detaches the program.
    _links: Vec<OwnedFd>,
    _events: Vec<OwnedFd>,
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
            let link = crate::bpf::perf_link(program, fd.as_fd(), cookie)
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
        Ok(Self {
            event,
            _links: links,
            _events: events,
        })
    }
}

/// A disabled, frequency-driven sampling event for every task on one CPU.
fn open(type_: u32, config: u64, cpu: usize, frequency: u64) -> io::Result<OwnedFd> {
    let mut attr = sys::bindings::perf_event_attr::default();
    attr.type_ = type_;
    attr.size = std::mem::size_of::<sys::bindings::perf_event_attr>() as u32;
    attr.config = config;
    attr.__bindgen_anon_1.sample_freq = frequency;
    attr.set_freq(1);
    attr.set_disabled(1);
    // SAFETY: a valid attr; pid -1 with a cpu: every task on that CPU.
    let fd = unsafe {
        sys::perf_event_open(
            &mut attr,
            -1,
            cpu as i32,
            -1,
            sys::bindings::PERF_FLAG_FD_CLOEXEC as u64,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
