//! Counting mode's Python source: the probes on interpreter binaries (shared by sessions),
//! and each session's view: names of the code objects it saw, and its counts.

use std::{
    collections::HashMap,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use aya::programs::uprobe::UProbeLinkId;
use tracer_common::{PyCodeEvent, PY_CODE_FILENAME_UNREAD, PY_CODE_QUALNAME_UNREAD};

use crate::{
    bpf::Bpf,
    python::{
        memory::{self, Mapped},
        runtime::{Runtime, RuntimeError},
    },
    report::PyFunction,
};

struct Attached {
    runtime: Runtime,
    links: Vec<(&'static str, UProbeLinkId)>,
}

/// Interpreter binaries with probes attached, keyed by (device, inode) so that one file seen
/// through several paths is probed once.
#[derive(Default)]
pub struct Probes {
    attached: HashMap<(u64, u64), Attached>,
    /// Binaries that cannot be probed, and why (not retried).
    failed: HashMap<(u64, u64), Unprobed>,
    /// Interpreter runtimes found on this machine at start.
    known: Vec<PathBuf>,
}

/// Why a binary has no probes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unprobed {
    /// It holds no eval loop (a `python3.X` that links libpython, say).
    NotRuntime,
    Failed(String),
}

impl std::fmt::Display for Unprobed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unprobed::NotRuntime => f.write_str("not a CPython runtime"),
            Unprobed::Failed(why) => f.write_str(why),
        }
    }
}

fn file_id(path: &Path) -> Result<(u64, u64), String> {
    let m = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((m.dev(), m.ino()))
}

impl Probes {
    pub fn new(known: Vec<PathBuf>) -> Self {
        Self {
            known,
            ..Self::default()
        }
    }

    /// Probes `path` (once). Returns the runtime, or why it cannot be probed.
    pub fn ensure(&mut self, bpf: &mut Bpf, path: &Path) -> Result<&Runtime, Unprobed> {
        let id = file_id(path).map_err(Unprobed::Failed)?;
        if let Some(why) = self.failed.get(&id) {
            return Err(why.clone());
        }
        let entry = match self.attached.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => return Ok(&e.into_mut().runtime),
            std::collections::hash_map::Entry::Vacant(e) => e,
        };
        let attached = Runtime::inspect(path)
            .map_err(|e| match e {
                RuntimeError::NoEvalLoop { .. } => Unprobed::NotRuntime,
                e => Unprobed::Failed(e.to_string()),
            })
            .and_then(|rt| match bpf.attach_python(&rt) {
                Ok(links) => Ok(Attached { runtime: rt, links }),
                Err(e) => Err(Unprobed::Failed(format!(
                    "attaching probes to {}: {e}",
                    path.display()
                ))),
            });
        match attached {
            Ok(a) => {
                tracing::info!(path = %path.display(), version = a.runtime.version.minor, table = a.runtime.table_found_by, "Python probes attached");
                Ok(&entry.insert(a).runtime)
            }
            Err(why) => {
                tracing::debug!(?why, "interpreter not probed");
                self.failed.insert(id, why.clone());
                Err(why)
            }
        }
    }

    pub fn is_attached(&self, path: &Path) -> bool {
        file_id(path).is_ok_and(|id| self.attached.contains_key(&id))
    }

    pub fn runtime(&self, path: &Path) -> Option<&Runtime> {
        self.attached.get(&file_id(path).ok()?).map(|a| &a.runtime)
    }

    /// Probes every interpreter found on the machine; returns what could not be probed.
    pub fn ensure_known(&mut self, bpf: &mut Bpf) -> Vec<Unprobed> {
        let known = self.known.clone();
        known
            .iter()
            .filter_map(|p| self.ensure(bpf, p).err())
            .collect()
    }

    /// Removes every probe (no session counts Python any more): processes stop paying for them.
    pub fn detach_all(&mut self, bpf: &mut Bpf) {
        for (_, a) in self.attached.drain() {
            bpf.detach_python(a.links);
        }
        self.failed.clear();
    }

    /// Makes the probes see a running process's threads: those already inside the eval loop
    /// never pass its entry again.
    pub fn seed_threads(&self, bpf: &mut Bpf, pid: u32, mapped: &Mapped) -> Result<usize, String> {
        let rt = self.runtime(&mapped.path).ok_or("interpreter not probed")?;
        let states = memory::thread_states(pid, rt, mapped)
            .map_err(|e| format!("reading pid {pid}'s thread states: {e}"))?;
        for &(tid, tstate) in &states {
            bpf.py_tstate
                .insert(tid, tstate, 0)
                .map_err(|e| e.to_string())?;
        }
        Ok(states.len())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Name {
    qualname: String,
    filename: String,
    firstlineno: i32,
}

/// One session's Python state.
#[derive(Default)]
pub struct PySession {
    names: HashMap<(u32, u64, u64), Name>,
    /// Processes already checked for an interpreter, with the executable they ran then.
    pub checked: HashMap<u32, (u64, u64)>,
    pub warnings: Vec<String>,
}

fn c_str(bytes: &[u8]) -> String {
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..len]).into_owned()
}

impl PySession {
    /// Records the names the kernel sent; reads from the process those it could not.
    pub fn on_code(&mut self, ev: &PyCodeEvent, probes: &Probes) {
        let mut name = Name {
            qualname: c_str(&ev.qualname),
            filename: c_str(&ev.filename),
            firstlineno: ev.firstlineno,
        };
        if ev.flags & (PY_CODE_QUALNAME_UNREAD | PY_CODE_FILENAME_UNREAD) != 0 {
            let read = memory::runtime_of(ev.pid)
                .and_then(|m| probes.runtime(&m.path).map(|rt| rt.version))
                .and_then(|v| memory::code_names(ev.pid, ev.code, v).ok());
            if let Some((q, f)) = read {
                if ev.flags & PY_CODE_QUALNAME_UNREAD != 0 {
                    name.qualname = q;
                }
                if ev.flags & PY_CODE_FILENAME_UNREAD != 0 {
                    name.filename = f;
                }
            }
        }
        self.names.insert((ev.pid, ev.code, ev.names), name);
    }

    /// Names this session's counts. Code objects whose names never arrived are reported as unknown.
    /// `counts`: (pid, code, names id, calls).
    pub fn functions(&self, counts: Vec<(u32, u64, u64, u64)>) -> (Vec<PyFunction>, u64) {
        let mut unknown = 0;
        let mut out: Vec<PyFunction> = counts
            .into_iter()
            .map(
                |(pid, code, names, ncalls)| match self.names.get(&(pid, code, names)) {
                    Some(n) => PyFunction {
                        pid,
                        qualname: if n.qualname.is_empty() {
                            format!("[unreadable name: code object {code:#x}]")
                        } else {
                            n.qualname.clone()
                        },
                        filename: n.filename.clone(),
                        firstlineno: n.firstlineno,
                        ncalls,
                    },
                    None => {
                        unknown += 1;
                        PyFunction {
                            pid,
                            qualname: format!("[unknown: code object {code:#x}]"),
                            filename: String::new(),
                            firstlineno: 0,
                            ncalls,
                        }
                    }
                },
            )
            .collect();
        out.sort_by(|a, b| {
            b.ncalls.cmp(&a.ncalls).then_with(|| {
                (&a.filename, a.firstlineno, &a.qualname).cmp(&(
                    &b.filename,
                    b.firstlineno,
                    &b.qualname,
                ))
            })
        });
        (out, unknown)
    }
}
