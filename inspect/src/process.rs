//! What /proc says about a process: whether it lives, who owns it, its threads, and where
//! the daemon can open the files it maps.

pub mod blocked;
pub mod inject;
mod maps;
pub mod memory;

pub use maps::{MapEntry, ProcMaps};

use std::{fs, io, os::unix::fs::MetadataExt, path::PathBuf};

/// Whether `pid` is a live process: not a zombie waiting to be reaped, nor on its way to
/// one (PF_EXITING: its memory and executable may already be gone, so nothing about the
/// program it ran can be read or asked of it any more).
pub fn alive(pid: u32) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The fields follow the parenthesised command name, which may itself hold ')': the
    // state (field 3) first, the flags (field 9) seventh.
    let mut fields = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace());
    let Some(fields) = fields.as_mut() else {
        return false;
    };
    let state = fields.next();
    let flags = fields.nth(5).and_then(|f| f.parse::<u64>().ok());
    state.is_some_and(|s| s != "Z" && s != "X") && flags.is_some_and(|f| f & PF_EXITING == 0)
}

/// The four ids on a `/proc/PID/status` line (`Uid:` or `Gid:`).
fn ids(status: &str, key: &str) -> io::Result<[u32; 4]> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("no {key} line"));
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .ok_or_else(bad)?;
    let mut out = [0; 4];
    let mut fields = line.split_whitespace();
    for slot in &mut out {
        *slot = fields.next().and_then(|f| f.parse().ok()).ok_or_else(bad)?;
    }
    Ok(out)
}

/// Whether `uid` may see kernel addresses, as the kernel decides for /proc/kallsyms: root;
/// others only with kptr_restrict 0 and perf_event_paranoid at most 1.
pub fn kernel_addresses_for(uid: u32) -> bool {
    let sysctl = |name: &str| {
        fs::read_to_string(format!("/proc/sys/kernel/{name}"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
    };
    uid == 0
        || (sysctl("kptr_restrict") == Some(0)
            && sysctl("perf_event_paranoid").is_some_and(|p| p <= 1))
}

/// Whether `uid` may read `path` by its mode bits and those of the directories above it,
/// with the groups its passwd and group entries give it (ACLs aside: they are not granted).
pub fn readable_by(uid: u32, path: &std::path::Path) -> bool {
    let groups: Vec<u32> = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .and_then(|u| {
            let name = std::ffi::CString::new(u.name).ok()?;
            nix::unistd::getgrouplist(&name, u.gid).ok()
        })
        .map(|g| g.into_iter().map(|g| g.as_raw()).collect())
        .unwrap_or_default();
    // `bit`: 4 read, 1 search.
    let allows = |m: &fs::Metadata, bit: u32| {
        let mode = m.mode();
        let shift = if m.uid() == uid {
            6
        } else if groups.contains(&m.gid()) {
            3
        } else {
            0
        };
        mode >> shift & bit != 0
    };
    let Ok(real) = fs::canonicalize(path) else {
        return false;
    };
    real.ancestors()
        .skip(1)
        .all(|dir| fs::metadata(dir).is_ok_and(|m| allows(&m, 1)))
        && fs::metadata(&real).is_ok_and(|m| allows(&m, 4))
}

/// Why `uid` (not root) may not trace `pid`, by the rule the kernel applies to ptrace: every
/// uid of the process is `uid`, its gids are all one (no setgid program), and it is dumpable
/// (no credentials gained at exec: setuid, setgid or file capabilities; no PR_SET_DUMPABLE 0).
/// None: it may. Err: the process is gone.
pub fn ptrace_boundary(pid: u32, uid: u32) -> io::Result<Option<String>> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let (uids, gids) = (ids(&status, "Uid:")?, ids(&status, "Gid:")?);
    if uids.iter().any(|&u| u != uid) {
        return Ok(Some(format!("it runs as uid {}", uids[1])));
    }
    if gids.iter().any(|&g| g != gids[0]) {
        return Ok(Some(format!(
            "it runs with gid {} from a setgid program",
            gids[1]
        )));
    }
    // /proc/PID's files belong to root while the process is not dumpable (the kernel's
    // task_dump_owner), whoever runs it; the directory itself keeps the process's owner.
    if fs::metadata(format!("/proc/{pid}/status"))?.uid() != uid {
        return Ok(Some(
            "it is not dumpable (it gained credentials at exec, or asked not to be traced)".into(),
        ));
    }
    Ok(None)
}

/// Every process's pid (empty if /proc cannot be read).
pub fn pids() -> Vec<u32> {
    fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Thread ids of `pid`.
pub fn threads(pid: u32) -> io::Result<Vec<u32>> {
    let mut tids: Vec<u32> = fs::read_dir(format!("/proc/{pid}/task"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    Ok(tids)
}

/// `pid`'s threads by the tid the process itself knows (`gettid()` in its own, innermost pid
/// namespace: what CPython stores as `native_thread_id`) → their tid here. The same where the
/// process shares the daemon's pid namespace.
pub fn tids_by_own_tid(pid: u32) -> io::Result<std::collections::HashMap<u32, u32>> {
    let mut out = std::collections::HashMap::new();
    for tid in threads(pid)? {
        // Gone since listed: not a thread to find any more.
        let Ok(status) = fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")) else {
            continue;
        };
        // `NSpid:` lists the tid in each pid namespace from /proc's down to the thread's own.
        let own = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|ids| ids.split_whitespace().last()?.parse().ok())
            .unwrap_or(tid);
        out.insert(own, tid);
    }
    Ok(out)
}

/// The process a thread belongs to.
pub fn tgid(tid: u32) -> Option<u32> {
    fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))?
        .trim()
        .parse()
        .ok()
}

/// Processes forked on the machine since boot (`processes` in /proc/stat).
pub fn forks_since_boot() -> Option<u64> {
    fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("processes "))?
        .trim()
        .parse()
        .ok()
}

/// `kernel.yama.ptrace_scope`: 0 where Yama is not in the kernel; 3 (no ptrace at all) when
/// the file cannot be read as a number.
pub fn yama_ptrace_scope() -> u8 {
    match fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
        Err(_) => 3,
        Ok(s) => s.trim().parse().unwrap_or(3),
    }
}

/// The parent of a process.
pub fn parent(pid: u32) -> Option<u32> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))?
        .trim()
        .parse()
        .ok()
}

/// Whether `pid` is a live descendant of one of `ancestors` now, by its chain of parents (at
/// most 64 steps; a process whose parent exited was given to another and is no one's here).
pub fn descends_from(pid: u32, ancestors: &[u32]) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        match parent(p) {
            Some(up) if ancestors.contains(&up) => return true,
            Some(up) if up > 1 => p = up,
            _ => return false,
        }
    }
    false
}

/// The command name of `pid`, for reports.
pub fn comm(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_owned())
}

/// Why a file a process maps cannot be opened.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MappedFileError {
    #[error("pid {pid}: {path:?} is not a mapped file")]
    NotAFile { pid: u32, path: String },
    #[error(
        "pid {pid}: no path reaches {path} (inode {inode} on device {major:x}:{minor:x}): {tried}"
    )]
    Unreachable {
        pid: u32,
        path: String,
        major: u32,
        minor: u32,
        inode: u64,
        /// Each candidate path and why it was not taken.
        tried: String,
    },
}

/// A library of tracer's that tracerd has processes load, beside tracerd's executable, if it
/// is there.
pub fn beside_tracerd(name: &str) -> Result<std::path::PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding tracerd's executable: {e}"))?;
    // As `cargo build` leaves it, then the installed layout (/usr/bin, /usr/lib/tracer).
    let beside = exe.with_file_name(name);
    let installed = exe.with_file_name("../lib/tracer").join(name);
    [beside, installed]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| format!("{name} is neither beside tracerd nor in ../lib/tracer"))
}

/// A path the daemon can open the file of mapping `m` of `pid` through.
///
/// /proc/PID/maps prints a path as the reader (the daemon) sees it when the file is reachable
/// from the reader's root, so a chrooted process's paths already hold the chroot and
/// /proc/PID/root + path would hold it twice; otherwise (another mount namespace: pivot_root,
/// containers) it prints the path inside the process's namespace, which only /proc/PID/root
/// reaches. So the first candidate that is the mapped file (same device and inode) is taken:
/// /proc/PID/root + path, then the path itself, then /proc/PID/map_files/START-END, which is
/// the mapped file whatever the namespaces but lives only as long as the mapping (and needs
/// CAP_SYS_ADMIN). The stable paths come first: a binary is read, and uprobes attached to it,
/// after the process may have exited.
pub fn mapped_path(pid: u32, m: &MapEntry) -> Result<PathBuf, MappedFileError> {
    if !m.path.starts_with('/') || m.inode == 0 {
        return Err(MappedFileError::NotAFile {
            pid,
            path: m.path.clone(),
        });
    }
    let mut tried = Vec::new();
    // The same inode on another device: the file itself where stat and maps may disagree on
    // the device (see `device_may_differ`), else taken only when nothing better is found.
    let mut same_inode = None;
    // A deleted file's path names another file, or none.
    if !m.deleted() {
        for candidate in [
            PathBuf::from(format!("/proc/{pid}/root{}", m.path)),
            PathBuf::from(&m.path),
        ] {
            match fs::metadata(&candidate) {
                Ok(meta)
                    if meta.ino() == m.inode
                        && (device(&meta) == m.dev || device_may_differ(&candidate)) =>
                {
                    return Ok(candidate)
                }
                Ok(meta) => {
                    tried.push(format!(
                        "{}: another file (inode {} on device {:x}:{:x})",
                        candidate.display(),
                        meta.ino(),
                        device(&meta).0,
                        device(&meta).1
                    ));
                    if meta.ino() == m.inode && same_inode.is_none() {
                        same_inode = Some(candidate);
                    }
                }
                Err(e) => tried.push(format!("{}: {e}", candidate.display())),
            }
        }
    }
    let map_files = map_files_path(pid, m);
    match fs::metadata(&map_files) {
        Ok(_) => return Ok(map_files),
        Err(e) => tried.push(format!("{}: {e}", map_files.display())),
    }
    same_inode.ok_or_else(|| MappedFileError::Unreachable {
        pid,
        path: m.path.clone(),
        major: m.dev.0,
        minor: m.dev.1,
        inode: m.inode,
        tried: tried.join("; "),
    })
}

/// The magic link to the file of mapping `m` of `pid`.
fn map_files_path(pid: u32, m: &MapEntry) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end))
}

/// Whether stat may give a file another device than /proc/PID/maps does: btrfs gives each
/// subvolume a device of its own, and overlayfs may give the overlay's or a layer's.
fn device_may_differ(path: &std::path::Path) -> bool {
    use nix::sys::statfs::{statfs, BTRFS_SUPER_MAGIC, OVERLAYFS_SUPER_MAGIC};
    statfs(path).is_ok_and(|s| {
        let fs = s.filesystem_type();
        fs == BTRFS_SUPER_MAGIC || fs == OVERLAYFS_SUPER_MAGIC
    })
}

/// Whether `pid` has tracerd's root directory: paths mean the same file to both.
pub fn same_root(pid: u32) -> bool {
    let id = |p: &str| fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    id(&format!("/proc/{pid}/root")).is_some_and(|r| Some(r) == id("/"))
}

/// `/proc/PID/stat`'s start time (field 22): how a process is told from a later one under
/// the same pid (an exec keeps it).
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the parenthesised name start at 3.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// (major, minor) of the device holding a file, as /proc/PID/maps prints it.
pub fn device(meta: &fs::Metadata) -> (u32, u32) {
    let dev = meta.dev();
    (libc::major(dev), libc::minor(dev))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_ours() {
        let me = std::process::id();
        assert!(alive(me));
        let uid = nix::unistd::getuid().as_raw();
        assert_eq!(ptrace_boundary(me, uid).unwrap(), None);
        assert!(ptrace_boundary(me, uid + 1).unwrap().is_some());
        assert!(threads(me).unwrap().contains(&me));
        assert!(!alive(u32::MAX - 1));
    }

    #[test]
    fn own_tids_are_tids_in_our_namespace() {
        let me = std::process::id();
        let tids = tids_by_own_tid(me).unwrap();
        assert_eq!(tids.get(&me), Some(&me));
        assert!(tids.iter().all(|(own, here)| own == here), "{tids:?}");
    }

    #[test]
    fn zombies_are_not_alive() {
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not reaped yet: a zombie once it exits.
        for _ in 0..200 {
            if !alive(pid) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!alive(pid));
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
        drop(child);
    }

    /// The mapping of this test binary's code.
    fn own_code() -> MapEntry {
        let exe = fs::read_link("/proc/self/exe").unwrap();
        ProcMaps::read(std::process::id())
            .unwrap()
            .entries()
            .iter()
            .find(|e| e.executable && std::path::Path::new(&e.path) == exe)
            .cloned()
            .unwrap()
    }

    #[test]
    fn mapped_files_resolve_to_the_mapped_inode() {
        let me = std::process::id();
        let code = own_code();
        let path = mapped_path(me, &code).unwrap();
        // Not chrooted: /proc/PID/root + path is the file.
        assert_eq!(path, PathBuf::from(format!("/proc/{me}/root{}", code.path)));
        assert_eq!(fs::metadata(&path).unwrap().ino(), code.inode);

        // Another file at the path, and no such mapping: nothing is the mapped file.
        let other = MapEntry {
            inode: code.inode + 1,
            start: 0x1000,
            end: 0x2000,
            ..code.clone()
        };
        let err = mapped_path(me, &other).unwrap_err();
        assert!(
            matches!(&err, MappedFileError::Unreachable { tried, .. } if tried.contains("another file")),
            "{err}"
        );

        // Same inode, another device: the path still (overlayfs, btrfs; elsewhere as a last
        // resort, map_files having no such mapping).
        let overlay = MapEntry {
            dev: (code.dev.0 + 1, code.dev.1),
            start: 0x1000,
            end: 0x2000,
            ..code.clone()
        };
        assert_eq!(mapped_path(me, &overlay).unwrap(), path);

        let stack = MapEntry {
            path: "[stack]".into(),
            inode: 0,
            ..code
        };
        assert!(matches!(
            mapped_path(me, &stack),
            Err(MappedFileError::NotAFile { .. })
        ));
    }

    #[test]
    fn a_chrooted_processs_files_resolve_to_the_host_path() {
        if !nix::unistd::geteuid().is_root() {
            tracer_testkit::skip(format_args!("chroot needs root"));
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let c_dir = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: the child makes only async-signal-safe calls (chroot, pause, _exit).
        let child = unsafe { libc::fork() };
        if child == 0 {
            unsafe {
                if libc::chroot(c_dir.as_ptr()) != 0 {
                    libc::_exit(1);
                }
                loop {
                    libc::pause();
                }
            }
        }
        assert!(child > 0);
        struct Reap(i32);
        impl Drop for Reap {
            fn drop(&mut self) {
                // SAFETY: our own child, killed and reaped once.
                unsafe {
                    libc::kill(self.0, libc::SIGKILL);
                    libc::waitpid(self.0, std::ptr::null_mut(), 0);
                }
            }
        }
        let _reap = Reap(child);
        let pid = child as u32;
        let root = format!("/proc/{pid}/root");
        for _ in 0..500 {
            if fs::read_link(&root).is_ok_and(|r| r == dir.path()) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(fs::read_link(&root).unwrap(), dir.path());
        // The maps name the (forked) test binary from the host's root; through the chroot
        // that path names nothing.
        let exe = fs::read_link("/proc/self/exe").unwrap();
        let code = ProcMaps::read(pid)
            .unwrap()
            .entries()
            .iter()
            .find(|e| e.executable && std::path::Path::new(&e.path) == exe)
            .cloned()
            .unwrap();
        assert!(!std::path::Path::new(&format!("{root}{}", code.path)).exists());
        assert_eq!(mapped_path(pid, &code).unwrap(), PathBuf::from(&code.path));
    }

    #[test]
    fn deleted_files_resolve_through_map_files() {
        if !nix::unistd::geteuid().is_root() {
            tracer_testkit::skip(format_args!("/proc/PID/map_files needs CAP_SYS_ADMIN"));
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mapped");
        fs::write(&file, b"mapped bytes").unwrap();
        let f = fs::File::open(&file).unwrap();
        // SAFETY: a fresh private read-only mapping of an open file, unmapped below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        fs::remove_file(&file).unwrap();
        // Another file where the mapped one was: its path must not be taken.
        fs::write(&file, b"other bytes").unwrap();
        let me = std::process::id();
        let entry = ProcMaps::read(me)
            .unwrap()
            .find(addr as u64)
            .cloned()
            .unwrap();
        assert!(entry.deleted(), "{entry:?}");
        let path = mapped_path(me, &entry).unwrap();
        let read = fs::read(&path);
        // SAFETY: the mapping made above, not used after.
        unsafe { libc::munmap(addr, 4096) };
        assert!(
            path.to_string_lossy().contains("/map_files/"),
            "{}",
            path.display()
        );
        assert_eq!(read.unwrap(), b"mapped bytes");
    }
}
