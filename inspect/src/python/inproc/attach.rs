//! In-process counting of a running CPython 3.10–3.13 process (`--pid`), which has no PEP 768:
//! tracer's loader (`daemon/pystart`), copied into the counter's code directory, is loaded
//! into the process with ptrace ([`crate::process::inject`]), and runs the start script on a
//! thread of its own as soon as it can take the GIL: at once where every thread waits in
//! native code.

use std::{fs, time::Duration};

use super::{
    files::{self, Dir},
    make, settle, Counter, Handover, Late, Loaded, MayTrace, Settled,
};
use crate::{pinned::Pinned, process::inject};

/// How long a thread may take to stop where loading is safe.
const LOAD_WAIT: Duration = Duration::from_secs(1);

/// [`super::start`] for 3.10–3.13 (`minor`), on the process it pinned; 3.10 and 3.11 count
/// with a profile function, which `handover` takes over from where the program sets one of
/// its own.
pub(super) fn start_loaded(
    pin: Pinned,
    tag: &str,
    wait: Duration,
    may_trace: MayTrace,
    late: Late,
    handover: Handover,
    cancelled: &(dyn Fn() -> bool + Sync),
) -> Result<Counter, String> {
    let pid = pin.pid();
    let (mut counter, _) = make(pid, tag, may_trace, None, false)?;
    counter.loaded = Loaded::Ptrace;
    // Asked again on the stopped process, through the pin taken before `make` checked.
    let check = counter.may_trace.clone();
    let loaded = run_with_loader(&counter.files.dir, &pin, "start", &*check, cancelled)
        .and_then(|()| counter.watch_handovers(handover));
    if let Err(why) = loaded {
        counter.discard();
        return Err(why);
    }
    match settle(&counter, wait) {
        Settled::Running => Ok(counter),
        Settled::Failed(why) => {
            // The loader ran the script, which runs once: nothing opens these files again.
            std::thread::sleep(Duration::from_millis(50));
            counter.discard();
            Err(why)
        }
        Settled::Waiting => {
            // A thread holds the GIL in native code: the loader's thread takes it when let.
            counter
                .watch_loader_start(pin, late)
                .map_err(|e| fail_pending(&counter, e))?;
            Ok(counter)
        }
    }
}

/// A pending start that cannot be watched: cancelled, its files left for the loader's script
/// (which finds it cancelled and deletes them) or the next sweep.
fn fail_pending(counter: &Counter, why: String) -> String {
    let _ = counter.files.map.cancel();
    why
}

/// Has the pinned process run `STEM.py` of the code directory (written already): tracer's
/// loader is copied there as `STEM.so` and loaded with ptrace, once `check` passes again on
/// the stopped process.
pub(super) fn run_with_loader(
    dir: &Dir,
    pin: &Pinned,
    stem: &str,
    check: &(dyn Fn(u32) -> Result<(), String> + Sync),
    cancelled: &(dyn Fn() -> bool + Sync),
) -> Result<(), String> {
    let loader = files::beside_tracerd(super::PRELOAD)?;
    let loader = fs::read(&loader).map_err(|e| format!("reading {}: {e}", loader.display()))?;
    let file = format!("{stem}.so");
    dir.create_code(&file, &loader)?;
    let path = dir.code_path(&file);
    inject::Load {
        pin,
        path: &path,
        wait: LOAD_WAIT,
        check,
        cancelled,
    }
    .run()
    .map_err(|e| format!("loading tracer's loader with ptrace: {e}"))
}
