//! In-process counting of a command tracerctl launches: the counter's directory made before
//! the command's exec, with the loader (`daemon/pystart`) it is started with; made again in
//! the root the command runs Python in, where that is another (a chroot, a mount namespace
//! of its own), before Python runs.

use std::fs;

use super::{files, make, make::made, Counter, Handover, Late, MayTrace, PRELOAD_AS};

/// The loader a launched command is started with (`LD_PRELOAD`), beside tracerd.
pub const PRELOAD: &str = "libtracer_pystart.so";

/// What a launch waits with until its command execs into the interpreter.
pub(super) struct Deferred {
    late: Late,
    handover: Handover,
}

/// Prepares in-process counting for a command tracerctl holds before its exec (`pid`, the
/// caller's child): the directory, counter and start script as for [`super::start`], and
/// the loader, which the command is to be started with: the variables to set for its exec
/// (in words for the report on error). Nothing runs until a CPython 3.10+ program exec'd as
/// `pid` reaches its first line (see `daemon/pystart`), and nothing is watched until tracerd
/// has seen that exec ([`Counter::launched`]); `late` says what became of it, as for a
/// request left pending. Until then the counter is [`Counter::pending`]. On 3.10 and 3.11,
/// `handover` has the probes take a process over whose program set a profile function of
/// its own (see `handover.rs`).
pub fn launch(
    pid: u32,
    tag: &str,
    may_trace: MayTrace,
    late: Late,
    handover: Handover,
) -> Result<(Counter, Vec<(String, String)>), String> {
    let preload = preload()?;
    let (mut counter, start_path) = make(pid, tag, may_trace, Some(&preload), true)?;
    let env = vec![
        (
            "LD_PRELOAD".to_owned(),
            counter.files.dir.code_path(PRELOAD_AS),
        ),
        (SCRIPT_VAR.to_owned(), start_path),
    ];
    counter.deferred = Some(Deferred { late, handover });
    Ok((counter, env))
}

/// The loader's bytes.
fn preload() -> Result<Vec<u8>, String> {
    let path = files::beside_tracerd(PRELOAD)?;
    fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))
}

impl Counter {
    /// `pid`, a process of the launch held at its exec into CPython (EXEC_HOLD, before its
    /// first instruction) with the loader in its environment, is counted in-process: the
    /// counter's directory is made there first if its root does not hold it
    /// ([`Counter::reach`]), and its start is watched from now on. Else why not, in words
    /// for the report (it is then to be counted with the probes, its loader taken out).
    pub fn launched(&mut self, pid: u32) -> Result<(), String> {
        self.reach(pid)?;
        let Some(deferred) = self.deferred.take() else {
            return Ok(());
        };
        let pin = super::pin(pid)?;
        self.watch_loader_start(pin, deferred.late)?;
        self.watch_handovers(deferred.handover)
    }

    /// Has `pid`, a process of the launch held at an exec (a wrapper on the way to Python:
    /// `sh`, `env`), find the counter's directory where its loader looks, in the root it
    /// runs in: made there again if that root does not hold it ([`Counter::relocate`]);
    /// or why it cannot. Only until the launch's watches start.
    pub fn reach(&mut self, pid: u32) -> Result<(), String> {
        if self.deferred.is_none() || self.seen_by(pid) {
            return Ok(());
        }
        self.relocate(pid)
    }

    /// Makes the counter's directory and files again, at the same names, in `/tmp` of the
    /// root `pid` runs in (through `/proc/PID/root`, under the rules of a first start: the
    /// owner's right to trace it, a `/tmp` only root or its user could swap, the code
    /// directory root's), so that its loader's and start script's paths lead there, in place
    /// of the first. Only before the watches start: they read the files in use.
    fn relocate(&mut self, pid: u32) -> Result<(), String> {
        let owner = self.files.dir.owner;
        let runs_as = super::fs_ids(pid)?;
        if runs_as != owner {
            return Err(format!(
                "it runs as uid {} where uid {} launched it",
                runs_as.0, owner.0
            ));
        }
        (self.may_trace)(pid)?;
        let preload = preload()?;
        let t0 = std::time::Instant::now();
        // The first directory goes first: the process does not see it, and a tracerd killed
        // in between leaves nothing behind (the journal keeps one entry a name). If no second
        // can be made, the process is counted with the probes and nothing reads these files.
        self.files.dir.remove();
        let made = made(
            pid,
            &self.name,
            owner,
            (self.pid, self.files.own),
            Some(&preload),
            true,
        )?;
        self.files = std::sync::Arc::new(made.files);
        self._file = made.file;
        self.library = made.library;
        *self
            .view
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        tracing::debug!(pid, ms = t0.elapsed().as_millis() as u64, dir = %self.name, "counter's directory made again in the process's root");
        Ok(())
    }
}

impl Counter {
    /// Whether `pid` (exec'd, held before its first instruction) has the loader of this
    /// counter's launch in its environment: a launcher that did not set
    /// `SessionInfo.launch_env` leaves its command to the probes.
    pub fn launched_with_loader(&self, pid: u32) -> bool {
        let Ok(env) = fs::read(format!("/proc/{pid}/environ")) else {
            return false;
        };
        let script = format!("{SCRIPT_VAR}={}", self.start_path());
        let preload = self.files.dir.code_path(PRELOAD_AS);
        let mut vars = env.split(|&b| b == 0);
        let (mut has_script, mut has_preload) = (false, false);
        for v in &mut vars {
            has_script |= v == script.as_bytes();
            if let Some(list) = v.strip_prefix(b"LD_PRELOAD=") {
                has_preload |= list
                    .split(|&b| b == b':' || b == b' ')
                    .any(|e| e == preload.as_bytes());
            }
        }
        has_script && has_preload
    }
}

impl Counter {
    /// Whether `pid` finds this counter's directory at the path its loader names (a process
    /// that chroot'ed or entered another mount namespace on the way does not).
    pub fn seen_by(&self, pid: u32) -> bool {
        self.files.dir.seen_by(pid).is_ok()
    }

    /// Takes the loader out of the environment of `pid`, held at its exec before the dynamic
    /// loader ran (EXEC_HOLD), where it could not load it: the dynamic loader would print an
    /// error on the program's stderr. Our `LD_PRELOAD` entry becomes separators (the user's
    /// own entries stay), and the `TRACER_PYSTART` entry an empty string, which getenv and
    /// Python's `os.environ` skip. The strings keep their length and place.
    pub fn unload(&self, pid: u32) -> Result<(), String> {
        use std::os::unix::fs::FileExt;
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| e.to_string())?;
        let rest = stat.rsplit_once(')').ok_or("unreadable stat")?.1;
        // Fields 50 and 51 (env_start, env_end); the fields after the name start at 3.
        let mut f = rest.split_whitespace().skip(47);
        let (start, end): (u64, u64) = match (f.next(), f.next()) {
            (Some(a), Some(b)) => (
                a.parse().map_err(|_| "env_start")?,
                b.parse().map_err(|_| "env_end")?,
            ),
            _ => return Err("stat has no environment bounds".into()),
        };
        if end <= start || end - start > 1 << 20 {
            return Err("the environment's bounds are not plausible".into());
        }
        let mem = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))
            .map_err(|e| e.to_string())?;
        let mut env = vec![0u8; (end - start) as usize];
        mem.read_exact_at(&mut env, start)
            .map_err(|e| format!("reading its environment: {e}"))?;
        let script = format!("{SCRIPT_VAR}={}", self.start_path());
        let preload = self.files.dir.code_path(PRELOAD_AS);
        let mut at = 0usize;
        for entry in env.split(|&b| b == 0) {
            let here = start + at as u64;
            if entry == script.as_bytes() {
                mem.write_all_at(&[0], here).map_err(|e| e.to_string())?;
            } else if let Some(list) = entry.strip_prefix(b"LD_PRELOAD=") {
                let base = here + "LD_PRELOAD=".len() as u64;
                let mut off = 0usize;
                for e in list.split(|&b| b == b':' || b == b' ') {
                    if e == preload.as_bytes() {
                        mem.write_all_at(&vec![b':'; e.len()], base + off as u64)
                            .map_err(|e| e.to_string())?;
                    }
                    off += e.len() + 1;
                }
            }
            at += entry.len() + 1;
        }
        Ok(())
    }
}

/// The variable naming the start script (`daemon/pystart`).
const SCRIPT_VAR: &str = "TRACER_PYSTART";
