//! In-process counting of a command tracerctl launches: the counter's directory made before
//! the command's exec, with the loader (`daemon/pystart`) it is started with.

use std::fs;

use super::{files, make, pin, Counter, Handover, Late, MayTrace};

/// The loader a launched command is started with (`LD_PRELOAD`), beside tracerd.
pub const PRELOAD: &str = "libtracer_pystart.so";
/// Its name in the directory.
pub(super) const PRELOAD_AS: &str = "_tracer_pystart.so";

/// Prepares in-process counting for a command tracerctl holds before its exec (`pid`, the
/// caller's child): the directory, counter and start script as for [`start`], and the
/// loader, which the command is to be started with: the variables to set for its exec (in
/// words for the report on error). Nothing runs until a CPython 3.10+ program exec'd as
/// `pid` reaches its first line (see `daemon/pystart`); `late` says what became of it, as
/// for a request left pending. Until then the counter is [`Counter::pending`]. On 3.10 and
/// 3.11, `handover` has the probes take a process over whose program set a profile function
/// of its own (see `handover.rs`).
pub fn launch(
    pid: u32,
    tag: &str,
    may_trace: MayTrace,
    late: Late,
    handover: Handover,
) -> Result<(Counter, Vec<(String, String)>), String> {
    let pin = pin(pid)?;
    let preload = files::beside_tracerd(PRELOAD)?;
    let preload = fs::read(&preload).map_err(|e| format!("reading {}: {e}", preload.display()))?;
    let (counter, start_path) = make(pid, tag, may_trace, Some(&preload), true)?;
    let env = vec![
        (
            "LD_PRELOAD".to_owned(),
            counter.files.dir.code_path(PRELOAD_AS),
        ),
        (SCRIPT_VAR.to_owned(), start_path),
    ];
    let watched = counter
        .watch_loader_start(pin, late)
        .and_then(|()| counter.watch_handovers(handover));
    if let Err(e) = watched {
        counter.discard();
        return Err(e);
    }
    Ok((counter, env))
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
