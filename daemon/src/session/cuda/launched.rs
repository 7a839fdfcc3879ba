//! Launches counted in-process in a launched command (`tracerctl start --mode=counting --cuda
//! -- CMD`, by default): the launcher sets `CUDA_INJECTION64_PATH` (tracer's injection
//! library) and `TRACER_CUPTI_LAUNCHES=1` for the command; every process of it that starts
//! with both in its environment has its CUDA libraries probed without kernel launches, and
//! its library waits in `cuInit`, before any launch, for the session's answer
//! (`daemon/cupti/src/launched.rs`). The answer comes after the table is taken and the
//! process marked for the probes to skip (count there), or after the launch probes it went
//! without are attached (the probes count): no launch goes uncounted, none twice. A process
//! of the command started without them (a child given an environment of its own) keeps the
//! launch probes.
//!
//! [`handshake`] waits on the process: blocking threads only.

use std::{collections::HashMap, path::Path};

use tracer_common::launches::{CANNOT, LAUNCHES_VAR, WAITING};
use tracer_inspect::{
    cuda::{Injection, INJECTION_LIBRARY},
    process,
};

use super::{
    gpu_times::{self, InProcess, Named},
    in_process::Adopted,
    CudaSession,
};

/// The variables a launched command counted in-process starts with (names and values).
pub fn launch_env() -> Result<Vec<(String, String)>, String> {
    let library = process::beside_tracerd(INJECTION_LIBRARY)?;
    Ok(vec![
        (
            "CUDA_INJECTION64_PATH".into(),
            library.to_string_lossy().into_owned(),
        ),
        (LAUNCHES_VAR.into(), "1".into()),
    ])
}

/// Whether `pid` started with the launcher's variables (its environment at its exec, which
/// CUDA's driver reads at `cuInit`), or why its launches are the probes'.
fn started_with_them(pid: u32) -> Result<(), String> {
    match gpu_times::injection_env(pid) {
        Some(Named::Ours(p)) => {
            // Where the driver will look for it: the process's root (a chroot may lack it).
            let inside = Path::new(&format!("/proc/{pid}/root")).join(p.trim_start_matches('/'));
            if !inside.is_file() {
                return Err(format!(
                    "pid {pid} runs under a root directory without {p}, which CUDA would load from its CUDA_INJECTION64_PATH"
                ));
            }
        }
        Some(Named::Other(p)) => {
            return Err(format!(
                "pid {pid} started with CUDA_INJECTION64_PATH={p}: another tool's injection library holds CUPTI there"
            ))
        }
        None => {
            return Err(format!(
                "pid {pid} started without CUDA_INJECTION64_PATH naming tracer's injection library (a program of the command gave it an environment of its own)"
            ))
        }
    }
    if gpu_times::env_value(pid, LAUNCHES_VAR).as_deref() != Some("1") {
        return Err(format!("pid {pid} started without {LAUNCHES_VAR}=1"));
    }
    Ok(())
}

/// The session's side of a launched process's library waiting in `cuInit`: the library (to
/// answer), and its launch table, or why launches cannot be counted there.
pub fn handshake(pid: u32, events: bool) -> (Option<Injection>, Result<InProcess, String>) {
    let injection = match gpu_times::find(pid) {
        Ok(i) => i,
        Err(e) => return (None, Err(e)),
    };
    let counted = (|| {
        let status = injection.status()?;
        if !status.contains(WAITING) {
            return Err(format!("its library no longer waits: {status}"));
        }
        if let Some(why) = status.split(CANNOT).nth(1) {
            return Err(format!("tracer's injection library could not: {why}"));
        }
        // Written before the answer: the library reads it when it starts counting.
        let python = gpu_times::python_at(pid)?;
        injection
            .ask_launches(python.map(|p| p.0), false, events)
            .map_err(|e| format!("launches in pid {pid}: {e}"))?;
        Ok(InProcess::from_now(
            injection.launch_table()?,
            python.map(|p| p.1),
        ))
    })();
    (Some(injection), counted)
}

/// What the manager does once a handshake is back.
#[derive(Default)]
pub struct Handshaken {
    pub adopted: Adopted,
    /// To be told to count: once the process is marked (`adopted.mark`).
    pub count: Option<Injection>,
}

/// Launched processes' libraries: which started with the launcher's variables, and which
/// asked or were answered.
#[derive(Default)]
pub(super) struct Launched {
    /// pid → whether it started with them (or why not).
    started: HashMap<u32, Result<(), String>>,
    /// Waiting in `cuInit`, their handshake not started yet.
    pending: Vec<u32>,
    /// Asked already (once each).
    asked: std::collections::HashSet<u32>,
    /// Processes that started with them and mapped CUDA's driver.
    driver: std::collections::HashSet<u32>,
    /// Told "the probes count" once the launch probes being attached are in.
    answers: Vec<Injection>,
}

impl CudaSession {
    /// Whether `pid`'s launches are to be counted in-process (a launched command's process
    /// that started with the launcher's variables); the first time one is not, the report
    /// says why.
    pub(super) fn launched_in_process(&mut self, pid: u32, driver: bool) -> bool {
        let Some(l) = self.launched.as_mut() else {
            return false;
        };
        let first = !l.started.contains_key(&pid);
        let started = l
            .started
            .entry(pid)
            .or_insert_with(|| started_with_them(pid))
            .clone();
        match started {
            Ok(()) => {
                if driver {
                    l.driver.insert(pid);
                }
                true
            }
            Err(why) => {
                if first {
                    self.counted_with_probes(pid, why);
                }
                false
            }
        }
    }

    /// `pid`'s library said `status`: one waiting in `cuInit` is asked (once).
    pub(super) fn launched_status(&mut self, pid: u32, status: &str) {
        if let Some(l) = self.launched.as_mut() {
            if status.contains(WAITING) && l.asked.insert(pid) {
                l.pending.push(pid);
            }
        }
    }

    /// The processes whose handshakes are to start now.
    pub fn take_handshakes(&mut self) -> Vec<u32> {
        self.launched
            .as_mut()
            .map(|l| std::mem::take(&mut l.pending))
            .unwrap_or_default()
    }

    /// A handshake is back: `pid` counts its launches in-process from the answer on, or the
    /// probes count them (answered once they are in: [`Self::answers_due`]).
    pub fn handshaken(
        &mut self,
        pid: u32,
        injection: Option<Injection>,
        counted: Result<InProcess, String>,
    ) -> Handshaken {
        let started = self
            .launched
            .as_ref()
            .and_then(|l| l.started.get(&pid))
            .is_some_and(Result::is_ok);
        match counted {
            Ok(inproc) if started => Handshaken {
                adopted: Adopted {
                    mark: Some(self.counting_in_process(pid, inproc)),
                    jobs: Vec::new(),
                },
                count: injection,
            },
            // Probed with its launches from the start: the probes count it.
            Ok(_) => {
                self.answer_later(injection);
                Handshaken::default()
            }
            Err(why) => {
                let adopted = self.fall_back(pid, why);
                self.answer_later(injection);
                Handshaken {
                    adopted,
                    count: None,
                }
            }
        }
    }

    /// `pid`, about to count in-process, cannot after all (why): the probes count it, and its
    /// library is told so once they are in.
    pub fn not_in_process(
        &mut self,
        pid: u32,
        why: String,
        injection: Option<Injection>,
    ) -> Adopted {
        self.in_process.retain(|c| c.pid != pid);
        self.launch_counting.retain(|l| l.pid != pid);
        let adopted = self.fall_back(pid, why);
        self.answer_later(injection);
        adopted
    }

    fn answer_later(&mut self, injection: Option<Injection>) {
        if let (Some(l), Some(i)) = (self.launched.as_mut(), injection) {
            l.answers.push(i);
        }
    }

    /// The libraries to tell "the probes count", now that no launch probe is on its way.
    pub fn answers_due(&mut self) -> Vec<Injection> {
        match self.launched.as_mut() {
            Some(l) if self.launch_jobs == 0 => std::mem::take(&mut l.answers),
            _ => Vec::new(),
        }
    }

    /// Processes that started with the launcher's variables and loaded CUDA's driver, whose
    /// library never asked: a warning for each (their launches, if any, went uncounted).
    pub(super) fn launched_silent(&self) -> Vec<String> {
        let Some(l) = self.launched.as_ref() else {
            return Vec::new();
        };
        let mut silent: Vec<u32> = l.driver.difference(&l.asked).copied().collect();
        silent.sort_unstable();
        silent
            .into_iter()
            .map(|pid| format!("pid {pid} loaded CUDA's driver, but tracer's injection library never asked from its cuInit: launches it made, if any, were not counted (CUDA not initialized, or CUDA_INJECTION64_PATH changed in the program)"))
            .collect()
    }
}
