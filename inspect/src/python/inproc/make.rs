//! Making a counter's directory and files: for a start, and again where a launched command
//! execs into another root (a chroot, a mount namespace of its own) before Python runs.

use std::{
    fs,
    os::fd::AsRawFd,
    sync::{atomic::AtomicBool, Arc, Mutex},
};

use tracer_common::inproc::{self, state, Header};

use super::{
    files::{Dir, Ids, Mapping},
    fs_ids, journal, library, own_pid, start_script, Counter, Files, Loaded, MayTrace, LIBRARY_AS,
    PRELOAD_AS,
};

/// What [`made`] makes: the files a counter reads, its locked counts file, and the
/// library's (device, inode).
pub(super) struct Made {
    pub(super) files: Files,
    pub(super) file: fs::File,
    pub(super) library: (u64, u64),
}

/// Makes the directory in `pid`'s `/tmp` with the counter library, the locked counts file
/// (PENDING), the start script and, for a launch or a ptrace load, the `preload` loader: the
/// counter, and the start script's path as the process sees it. On error nothing is left.
/// `at_exit`: the counter stops as the interpreter starts to exit (a launch).
pub(super) fn make(
    pid: u32,
    tag: &str,
    may_trace: MayTrace,
    preload: Option<&[u8]>,
    at_exit: bool,
) -> Result<(Counter, String), String> {
    may_trace(pid)?;
    let owner = fs_ids(pid)?;
    let name = format!("tracer-{tag}-{pid}");
    // Named as the counter names its children's: by the pid its own namespace knows.
    let own = own_pid(pid).unwrap_or(pid);
    let made = made(pid, &name, owner, (pid, own), preload, at_exit)?;
    let start_path = made.files.dir.code_path("start.py");
    let counter = Counter {
        pid,
        files: Arc::new(made.files),
        name,
        _file: made.file,
        library: made.library,
        may_trace,
        view: Mutex::new(None),
        ended: Arc::new(AtomicBool::new(false)),
        loaded: if at_exit {
            Loaded::Launch
        } else {
            Loaded::RemoteExec
        },
        deferred: None,
    };
    Ok((counter, start_path))
}

/// The files of a counter named `name`, made in `/tmp` of `root_of`'s root as `owner`, for
/// the process `counted` (its pid here, and in its own namespace): the counts file is
/// named by the latter, and its header by the former. On error nothing is left.
pub(super) fn made(
    root_of: u32,
    name: &str,
    owner: Ids,
    counted: (u32, u32),
    preload: Option<&[u8]>,
    at_exit: bool,
) -> Result<Made, String> {
    let (pid, own) = counted;
    let library = library()?;
    let target_dir = format!("/tmp/{name}");
    let dir = Dir::make(root_of, name, owner)
        .map_err(|e| format!("making {target_dir} in the process's root: {e}"))?;
    journal::record(root_of, name, &dir, (0, 0));
    let fail = |why: String| {
        dir.remove();
        journal::forget(name);
        why
    };
    let lib =
        fs::read(&library).map_err(|e| fail(format!("reading {}: {e}", library.display())))?;
    let lib = dir.create_code(LIBRARY_AS, &lib).map_err(fail)?;
    let lib_id = lib
        .metadata()
        .map(|m| {
            use std::os::unix::fs::MetadataExt;
            (m.dev(), m.ino())
        })
        .map_err(|e| fail(e.to_string()))?;
    journal::record(root_of, name, &dir, lib_id);
    if let Some(preload) = preload {
        dir.create_code(PRELOAD_AS, preload).map_err(fail)?;
    }
    let file_name = format!("{}{own}", inproc::FILE_PREFIX);
    let size = inproc::file_size(inproc::ENTRIES, inproc::EDGES, inproc::STRINGS);
    let file = dir.create(&file_name, 0o600, &[]).map_err(fail)?;
    file.set_len(size as u64)
        .map_err(|e| fail(format!("sizing the counts file: {e}")))?;
    // SAFETY: plain syscall on our own descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(fail(format!(
            "locking the counts file: {}",
            std::io::Error::last_os_error()
        )));
    }
    let map = Mapping::new(&file).map_err(|e| fail(format!("mapping the counts file: {e}")))?;
    let header = Header::new(pid, state::PENDING, inproc::CAPS);
    // SAFETY: the mapping starts with room for a header; nobody else writes it yet.
    unsafe { std::ptr::write_volatile(map.ptr.cast::<Header>(), header) };
    let script = start_script(
        &target_dir,
        &dir.path(&file_name),
        &dir.code_path(LIBRARY_AS),
        at_exit,
    );
    dir.create_code("start.py", script.as_bytes())
        .map_err(fail)?;
    dir.seen_by(root_of).map_err(fail)?;
    Ok(Made {
        files: Files {
            pid,
            own,
            dir: Arc::new(dir),
            map,
        },
        file,
        library: lib_id,
    })
}
