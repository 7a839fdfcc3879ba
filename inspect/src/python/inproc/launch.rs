//! In-process counting of a command tracerctl launches: the counter's directory made before
//! the command's exec, with the loader (`daemon/pystart`) it is started with.

use std::fs;

use super::{files, journal, make, pending::Watch, Counter, Late, MayTrace};
use crate::pinned::Pinned;

/// The loader a launched command is started with (`LD_PRELOAD`), beside tracerd.
pub const PRELOAD: &str = "libtracer_pystart.so";
/// Its name in the directory.
pub(super) const PRELOAD_AS: &str = "_tracer_pystart.so";

/// Prepares in-process counting for a command tracerctl holds before its exec (`pid`, the
/// caller's child): the directory, counter and start script as for [`start`], and the
/// loader, which the command is to be started with: the variables to set for its exec (in
/// words for the report on error). Nothing runs until a CPython 3.12+ program exec'd as
/// `pid` reaches its first line (see `daemon/pystart`); `late` says what became of it, as
/// for a request left pending. Until then the counter is [`Counter::pending`].
pub fn launch(
    pid: u32,
    tag: &str,
    may_trace: MayTrace,
    late: Late,
) -> Result<(Counter, Vec<(String, String)>), String> {
    let pin = Pinned::open(pid).map_err(|e| format!("pinning the process: {e}"))?;
    let preload = files::beside_tracerd(PRELOAD)?;
    let preload = fs::read(&preload).map_err(|e| format!("reading {}: {e}", preload.display()))?;
    let (counter, start_path) = make(pid, tag, may_trace, Some(&preload))?;
    let env = vec![
        (
            "LD_PRELOAD".to_owned(),
            format!("/tmp/{}/{PRELOAD_AS}", counter.name),
        ),
        ("TRACER_PYSTART".to_owned(), start_path),
    ];
    let watch = Watch {
        pin,
        script: None,
        files: counter.files.clone(),
        name: counter.name.clone(),
        may_trace: counter.may_trace.clone(),
        asked: Vec::new(),
        exe: None,
    };
    if let Err(e) = watch.spawn(late) {
        counter.files.dir.remove(&counter.name);
        journal::forget(&counter.name);
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
        let script = format!("TRACER_PYSTART={}", self.start_path());
        let preload = format!("/tmp/{}/{PRELOAD_AS}", self.name);
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
