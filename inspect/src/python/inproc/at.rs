//! Plain system calls relative to held directory descriptors, following no symbolic link,
//! and the check of a directory on the way to tracer's files: what the counter's directory
//! (`files.rs`) and the code directory (`code_dir.rs`) are made with.

use std::{
    ffi::CString,
    fs::File,
    os::{
        fd::{AsRawFd, FromRawFd},
        unix::fs::MetadataExt,
    },
    path::PathBuf,
};

/// `name` as a C string, if it is a plain file name (no path, neither `.` nor `..`).
pub(super) fn c_name(name: &str) -> std::io::Result<CString> {
    if name.contains('/') || name == "." || name == ".." || name.is_empty() {
        return Err(std::io::Error::other("not a plain file name"));
    }
    CString::new(name).map_err(std::io::Error::other)
}

/// A system call's result, its error taken from errno.
pub(super) fn check(ret: libc::c_int) -> std::io::Result<libc::c_int> {
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Why a directory on the way to the counter's files could let someone other than root or
/// `uid` replace them; None: it could not. `what` names it for the message.
pub(super) fn unsafe_parent(m: &std::fs::Metadata, uid: u32, what: &str) -> Option<String> {
    const STICKY: u32 = 0o1000;
    if !m.is_dir() {
        return Some(format!("{what} is not a directory"));
    }
    if m.uid() != 0 && m.uid() != uid {
        return Some(format!(
            "{what} belongs to uid {}, neither root nor the process's user",
            m.uid()
        ));
    }
    if m.mode() & 0o022 != 0 && m.mode() & STICKY == 0 {
        return Some(format!(
            "{what} (mode {:o}) is writable by others and not sticky: another user could replace tracer's files",
            m.mode() & 0o7777
        ));
    }
    None
}

/// The mount a descriptor lies on (0 where the kernel cannot say).
pub(super) fn mount_id(f: &File) -> u64 {
    // SAFETY: `st` is written by the call; an empty path with AT_EMPTY_PATH names the fd.
    let mut st = unsafe { std::mem::zeroed::<libc::statx>() };
    // SAFETY: as above.
    let r = unsafe {
        libc::statx(
            f.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_MNT_ID,
            &raw mut st,
        )
    };
    if r == 0 && st.stx_mask & libc::STATX_MNT_ID != 0 {
        st.stx_mnt_id
    } else {
        0
    }
}

/// Opens `name` in `dir` as a directory, following no link at its last component.
pub(super) fn open_dir_at(dir: &File, name: &str) -> std::io::Result<File> {
    let c = c_name(name)?;
    // SAFETY: plain syscall; the descriptor returned is owned by the File.
    let fd = check(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// `openat` of `name` in `dir`, following no link, as the caller's ids.
pub(super) fn open_file_at(
    dir: &File,
    name: &str,
    flags: libc::c_int,
    mode: u32,
) -> std::io::Result<File> {
    let c = c_name(name)?;
    // SAFETY: plain syscall; the descriptor returned is owned by the File.
    let fd = check(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode,
        )
    })?;
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Deletes `name` in `dir` (a directory, with `AT_REMOVEDIR`), following no link.
pub(super) fn unlink_at(dir: &File, name: &str, flags: libc::c_int) -> std::io::Result<()> {
    let c = c_name(name)?;
    // SAFETY: plain syscall; unlinkat never follows a link, and fails on a directory that
    // is not empty.
    check(unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), flags) }).map(drop)
}

/// The names in `dir`.
pub(super) fn names(dir: &File) -> Vec<String> {
    let listing = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    std::fs::read_dir(listing)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `tmp` (a process's `/tmp`) holds the very directory `id` (device, inode) at
/// `name`: checked before the process is asked to run a file from there.
pub(super) fn found_at(tmp: &File, name: &str, id: (u64, u64)) -> Result<(), String> {
    let found = open_dir_at(tmp, name)
        .and_then(|d| d.metadata())
        .map_err(|e| format!("its /tmp/{name}: {e}"))?;
    if (found.dev(), found.ino()) != id {
        return Err(format!("its /tmp/{name} is not the directory tracer made"));
    }
    Ok(())
}
