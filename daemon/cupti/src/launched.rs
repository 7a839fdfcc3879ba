//! Launches counted in-process in a command tracerctl launched (`TRACER_CUPTI_LAUNCHES=1`
//! in its environment, beside `CUDA_INJECTION64_PATH`): CUDA's driver calls
//! `InitializeInjection` inside `cuInit`, before the process can launch anything, and the
//! library turns CUPTI's launch callbacks on there, then waits for tracerd's answer before it
//! lets `cuInit` go on. tracerd first writes what Python call sites need
//! (`tracer_cupti_python`), takes the table and marks the process for its probes to skip;
//! its answer is then 1 (count here); 2 (its probes count: the library lets its subscriber
//! go) comes once the launch probes the process went without are attached. So every launch
//! is counted, here or by the probes, and none twice.
//!
//! The wait is bounded: without a probe on the library (no session watches the process) it
//! ends after [`UNWATCHED_WAIT`], else after [`ANSWER_WAIT`]; then the library lets its
//! subscriber go and says why in its status line.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use tracer_common::launches::{CANNOT, LAUNCHES_VAR, WAITING};

use crate::{announce, api::Cupti, attach::Probe, launches, set_status};

/// tracerd's answer: 1 (count here) or 2 (the probes count); 0 until it answers.
#[no_mangle]
pub static tracer_cupti_go: AtomicU64 = AtomicU64::new(0);

/// How long `cuInit` waits for tracerd's answer where the library is probed.
const ANSWER_WAIT: Duration = Duration::from_secs(5);
/// How long it waits for a probe to appear on the library: a session watching the process
/// attaches it as the library is mapped.
const UNWATCHED_WAIT: Duration = Duration::from_millis(500);

/// Whether the launcher asked for launches counted here: `TRACER_CUPTI_LAUNCHES=1`. (Read
/// only outside the loader's secure mode, where the environment is the program's own.)
pub fn asked() -> bool {
    std::env::var_os(LAUNCHES_VAR).is_some_and(|v| v == "1")
}

/// Turns the launch callbacks on (where `cupti` was set up) and waits for tracerd's answer,
/// also where they could not be: its probes must be in before `cuInit` lets the process
/// launch. What became of it, for the status line after `line` (the library's line so far).
pub fn count_here(cupti: Option<&Cupti>, line: &str) -> String {
    let not = |why: String| format!("{line}; launches not counted in-process: {why}");
    let ready = match cupti {
        None => Err("CUPTI could not be set up".to_owned()),
        Some(c) => c.subscribe().and_then(|sub| {
            match launches::table().and_then(|fd| c.count_launches(&sub).map(|()| fd)) {
                Ok(fd) => Ok((c, sub, fd)),
                Err(e) => {
                    let _ = c.let_go(sub);
                    Err(e)
                }
            }
        }),
    };
    let waiting = match &ready {
        Ok((_, _, fd)) => format!("{line}; {WAITING} (table: fd {fd})"),
        Err(why) => format!("{line}; {WAITING}; {CANNOT}{why}"),
    };
    set_status(&waiting);
    announce(&waiting);
    let answer = wait();
    match (ready, answer) {
        (Ok((_, subscriber, fd)), Ok(())) => {
            launches::catch_launch_under_way();
            launches::start();
            // Held for the process's life (never unsubscribed): its callbacks count every
            // launch from now on.
            let _ = subscriber;
            format!("{line}; launches counted in-process (table: fd {fd})")
        }
        (Ok((c, subscriber, _)), Err(why)) => match c.let_go(subscriber) {
            Ok(()) => not(why),
            Err(e) => not(format!("{why}; letting CUPTI's subscriber go: {e}")),
        },
        (Err(why), _) => not(why),
    }
}

/// tracerd's answer: Ok to count here, else why not.
fn wait() -> Result<(), String> {
    let probe = Probe::find();
    let began = Instant::now();
    loop {
        match tracer_cupti_go.load(Ordering::Acquire) {
            1 => return Ok(()),
            2 => return Err("tracerd counts them with its probes".to_owned()),
            _ => {}
        }
        let waited = began.elapsed();
        let watched = probe.as_ref().is_none_or(Probe::probed);
        if !watched && waited >= UNWATCHED_WAIT {
            return Err("no tracer session watches this process".to_owned());
        }
        if waited >= ANSWER_WAIT {
            return Err(format!(
                "tracerd did not answer within {} s",
                ANSWER_WAIT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
