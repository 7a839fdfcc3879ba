//! The counter's directory and files, as tracerd touches them. The directory lies in the
//! counted process's `/tmp` and belongs to the process's user, who may change anything in
//! it (the code the process runs lies beside it, root's: [`super::code_dir`]): tracerd
//! makes it, and makes, opens and deletes files in it, as that user (its file-system ids,
//! [`as_user`]), so that it can do there nothing the user could not; only
//! in a `/tmp` (and a root) that no other user could swap; relative to held descriptors,
//! following no symbolic link; files it reads must be regular files, and what it reads is
//! bounds-checked. A mapping whose file the user shrinks reads as zeros ([`super::sigbus`])
//! instead of killing tracerd.

use std::{
    fs::File,
    io::{Read, Write},
    os::{
        fd::AsRawFd,
        unix::fs::{MetadataExt, OpenOptionsExt},
    },
    path::Path,
    sync::atomic::AtomicU32,
};

use tracer_common::inproc::{self, Header, StrRef};

use super::{
    at::{
        c_name, check, found_at, mount_id, names, open_dir_at, open_file_at, unlink_at,
        unsafe_parent,
    },
    code_dir::{self, CodeDir},
};

pub(super) use crate::creds::{as_user, Ids};

/// `/tmp` of `pid`'s root (through `/proc/PID/root`: its chroot, container and mounts),
/// checked: neither it nor the root may be replaceable by another user than root or `uid`.
/// The root too, for [`code_dir::may_make`].
fn process_tmp(pid: u32, uid: u32) -> Result<(File, File), String> {
    tmp_under(Path::new(&format!("/proc/{pid}/root")), uid)
}

/// The root and its `/tmp` under `root`, checked as for [`process_tmp`].
fn tmp_under(root: &Path, uid: u32) -> Result<(File, File), String> {
    let root = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(root)
        .map_err(|e| format!("opening the process's root: {e}"))?;
    let m = root.metadata().map_err(|e| e.to_string())?;
    if let Some(why) = unsafe_parent(&m, uid, "the process's root directory") {
        return Err(why);
    }
    let tmp = open_dir_at(&root, "tmp").map_err(|e| format!("opening the process's /tmp: {e}"))?;
    let m = tmp.metadata().map_err(|e| e.to_string())?;
    if let Some(why) = unsafe_parent(&m, uid, "the process's /tmp") {
        return Err(why);
    }
    Ok((root, tmp))
}

/// The counter's open directory (the user's: the counts files), the one holding it, the
/// user tracerd acts as in it, and the code directory beside it ([`CodeDir`]).
pub(super) struct Dir {
    this: File,
    parent: File,
    /// Its name in `parent`.
    name: String,
    pub(super) owner: Ids,
    /// (device, inode): what a process must find at the directory's path.
    id: (u64, u64),
    /// None: made by a tracerd of before code directories, which put the code here.
    code: Option<CodeDir>,
}

impl Dir {
    /// Makes `name` in `/tmp` of `pid`'s root, mode 0700, as `owner` (the process's user), in
    /// a `/tmp` checked by [`process_tmp`]: a `/tmp` the user may not write is refused by the
    /// kernel itself, whatever is mounted there. Then the code directory beside it, root's.
    pub(super) fn make(pid: u32, name: &str, owner: Ids) -> Result<Self, String> {
        let (root, tmp) = process_tmp(pid, owner.0)?;
        code_dir::may_make(&root, &tmp, owner.0)?;
        let c = c_name(name).map_err(|e| e.to_string())?;
        let this = as_user(owner, || {
            // SAFETY: plain syscall on a descriptor we hold and a NUL-terminated name.
            check(unsafe { libc::mkdirat(tmp.as_raw_fd(), c.as_ptr(), 0o700) })?;
            open_dir_at(&tmp, name)
        })
        .map_err(|e| format!("creating it as uid {}: {e}", owner.0))?;
        let mut dir = Self {
            id: (0, 0),
            this,
            parent: tmp,
            name: name.to_owned(),
            owner,
            code: None,
        };
        let m = dir.this.metadata().map_err(|e| e.to_string())?;
        let p = dir.parent.metadata().map_err(|e| e.to_string())?;
        // Nothing mounted over it between the two calls.
        if m.uid() != owner.0 || m.dev() != p.dev() || mount_id(&dir.this) != mount_id(&dir.parent)
        {
            dir.remove();
            return Err(
                "the directory made is not the one found (a mount or a swap in between)".into(),
            );
        }
        dir.id = (m.dev(), m.ino());
        match CodeDir::make(&dir.parent, code_dir::name_of(name)) {
            Ok(code) => dir.code = Some(code),
            Err(why) => {
                dir.remove();
                return Err(why);
            }
        }
        Ok(dir)
    }

    /// A directory made before (by a tracerd since killed): `name` in `/tmp` under `root`, if
    /// it is still the one made, `id`, and still `owner`'s; with its code directory, `code`
    /// (None: a tracerd of before code directories made it), if that is still the one made.
    pub(super) fn existing(
        root: &Path,
        name: &str,
        owner: Ids,
        id: (u64, u64),
        code: Option<(u64, u64)>,
    ) -> Result<Self, String> {
        let (_, tmp) = tmp_under(root, owner.0)?;
        let code = code
            .map(|code| CodeDir::existing(&tmp, code_dir::name_of(name), code))
            .transpose()?;
        let this = match open_dir_at(&tmp, name) {
            Ok(this) => this,
            Err(e) => {
                // Its start script ran and deleted it (a session ended before that), or its
                // user did: nothing runs the code any more.
                if let Some(code) = code {
                    code.remove();
                }
                return Err(format!("/tmp/{name}: {e}"));
            }
        };
        let m = this.metadata().map_err(|e| e.to_string())?;
        if (m.dev(), m.ino()) != id || m.uid() != owner.0 {
            return Err(format!("/tmp/{name} is not the directory tracer made"));
        }
        Ok(Self {
            this,
            parent: tmp,
            name: name.to_owned(),
            owner,
            id,
            code,
        })
    }

    /// (device, inode).
    pub(super) fn id(&self) -> (u64, u64) {
        self.id
    }

    /// The code directory's (device, inode), where it has one.
    pub(super) fn code_id(&self) -> Option<(u64, u64)> {
        self.code.as_ref().map(CodeDir::id)
    }

    /// Whether `pid` finds this very directory at `/tmp/NAME` (its root, its mounts), and its
    /// code directory beside it, in a `/tmp` only root or the owner could swap: checked
    /// before it is asked to run a file from there.
    pub(super) fn seen_by(&self, pid: u32) -> Result<(), String> {
        let (_, tmp) = process_tmp(pid, self.owner.0)?;
        found_at(&tmp, &self.name, self.id)?;
        match &self.code {
            Some(code) => code.seen_in(&tmp),
            None => Ok(()),
        }
    }

    /// The path of a file of the user's directory, as the process sees it.
    pub(super) fn path(&self, file: &str) -> String {
        format!("/tmp/{}/{file}", self.name)
    }

    /// The path of a code file, as the process sees it.
    pub(super) fn code_path(&self, file: &str) -> String {
        match &self.code {
            Some(code) => code.path(file),
            None => self.path(file),
        }
    }

    /// Creates the code file `file` (not there before), which the process may read and not
    /// change: in the code directory, root's. None in a directory made by a tracerd of before
    /// code directories: its user could change what is put there.
    pub(super) fn create_code(&self, file: &str, bytes: &[u8]) -> Result<File, String> {
        match &self.code {
            Some(code) => code.create(file, bytes),
            None => Err(format!(
                "/tmp/{} was made by an older tracerd, with no directory for code the process's user cannot change",
                self.name
            )),
        }
    }

    pub(super) fn unlink_code(&self, file: &str) {
        match &self.code {
            Some(code) => code.unlink(file),
            None => self.unlink(file),
        }
    }

    /// Creates `name` (not there before) as the owner, mode `mode`, and writes `bytes`.
    pub(super) fn create(&self, name: &str, mode: u32, bytes: &[u8]) -> Result<File, String> {
        as_user(self.owner, || {
            let mut f = open_file_at(
                &self.this,
                name,
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
                mode,
            )?;
            f.write_all(bytes)?;
            Ok(f)
        })
        .map_err(|e| format!("creating {name}: {e}"))
    }

    /// Opens `name`, as the owner, if it is a regular file (no link, FIFO or device).
    pub(super) fn open(&self, name: &str, write: bool) -> std::io::Result<File> {
        let access = if write { libc::O_RDWR } else { libc::O_RDONLY };
        as_user(self.owner, || {
            let f = open_file_at(&self.this, name, access | libc::O_NONBLOCK, 0)?;
            if !f.metadata()?.is_file() {
                return Err(std::io::Error::other("not a regular file"));
            }
            Ok(f)
        })
    }

    pub(super) fn exists(&self, name: &str) -> bool {
        let Ok(c) = c_name(name) else { return false };
        // SAFETY: `st` is written by the call; plain syscall.
        let mut st = unsafe { std::mem::zeroed::<libc::stat>() };
        // SAFETY: as above.
        unsafe {
            libc::fstatat(
                self.this.as_raw_fd(),
                c.as_ptr(),
                &raw mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            ) == 0
        }
    }

    /// The first KiB of a small text file the process wrote.
    pub(super) fn read_text(&self, name: &str) -> Option<String> {
        let mut text = String::new();
        self.open(name, false)
            .ok()?
            .take(1024)
            .read_to_string(&mut text)
            .ok()?;
        Some(text)
    }

    /// When it last changed (a file made or deleted in it).
    pub(super) fn mtime(&self) -> Option<(i64, i64)> {
        let m = self.this.metadata().ok()?;
        Some((m.mtime(), m.mtime_nsec()))
    }

    pub(super) fn unlink(&self, name: &str) {
        let _ = as_user(self.owner, || unlink_at(&self.this, name, 0));
    }

    fn names(&self) -> Vec<String> {
        names(&self.this)
    }

    /// Deletes its files (a bounded number: the owner may fill it), then itself; and the code
    /// directory.
    pub(super) fn remove(&self) {
        for f in self.names().into_iter().take(MAX_NAMES) {
            self.unlink(&f);
        }
        self.remove_if_empty();
        if let Some(code) = &self.code {
            code.remove();
        }
    }

    /// Removes the directory if it is empty (or gone: its start script deleted it), and then
    /// the code directory, whose files nothing runs any more; whether it did.
    pub(super) fn remove_if_empty(&self) -> bool {
        let removed = as_user(self.owner, || {
            unlink_at(&self.parent, &self.name, libc::AT_REMOVEDIR)
        });
        let gone = match removed {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        if gone {
            if let Some(code) = &self.code {
                code.remove();
            }
        }
        gone
    }

    /// (pid, file name) of the counts files in it, at most `most` (the owner may make any
    /// number), and how many more there were.
    pub(super) fn counts_files(&self, most: usize) -> (Vec<(u32, String)>, usize) {
        self.by_pid(inproc::FILE_PREFIX, most)
    }

    /// The same for the files named `prefix<pid>`.
    pub(super) fn by_pid(&self, prefix: &str, most: usize) -> (Vec<(u32, String)>, usize) {
        let mut all: Vec<(u32, String)> = self
            .names()
            .into_iter()
            .filter_map(|name| {
                let pid = name.strip_prefix(prefix)?.parse().ok()?;
                Some((pid, name))
            })
            .collect();
        all.sort_unstable();
        let more = all.len().saturating_sub(most);
        all.truncate(most);
        (all, more)
    }
}

/// How many names tracerd deletes from a directory the user could fill.
pub(super) const MAX_NAMES: usize = 65_536;

/// A whole counts file, mapped shared.
pub(super) struct Mapping {
    pub(super) ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory, read and written only through atomics and
// volatile copies; nothing in it is tied to a thread.
unsafe impl Send for Mapping {}
// SAFETY: as above: shared reads go through volatile copies and atomics only.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(super) fn new(file: &File) -> std::io::Result<Self> {
        Self::with(file, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// For looking only: states and counts are not written through it.
    pub(super) fn new_read_only(file: &File) -> std::io::Result<Self> {
        Self::with(file, libc::PROT_READ)
    }

    fn with(file: &File, prot: libc::c_int) -> std::io::Result<Self> {
        let len = usize::try_from(file.metadata()?.len()).unwrap_or(0);
        // tracerd makes every file this size, and a counter's children take their parent's.
        if len != inproc::file_size(inproc::ENTRIES, inproc::EDGES, inproc::STRINGS) {
            return Err(std::io::Error::other("a counts file of the wrong size"));
        }
        // SAFETY: a fresh shared mapping of a file we hold open; checked for failure.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        crate::sigbus::guard(ptr as usize, len);
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    pub(super) fn header(&self) -> Header {
        // SAFETY: the header lies at the start of a mapping at least HEADER_SIZE long; the
        // process may write it meanwhile, hence a volatile copy.
        unsafe { std::ptr::read_volatile(self.ptr.cast::<Header>()) }
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: `offset` is a 4-byte-aligned field of the header, inside the mapping;
        // AtomicU32 has u32's layout.
        unsafe { &*self.ptr.add(offset).cast::<AtomicU32>() }
    }

    pub(super) fn state(&self) -> &AtomicU32 {
        self.word(std::mem::offset_of!(Header, state))
    }

    /// PENDING → CANCELLED: exactly one of tracerd and the start script decides a pending
    /// counter's fate.
    pub(super) fn cancel(&self) -> Result<u32, u32> {
        use std::sync::atomic::Ordering;
        self.state().compare_exchange(
            tracer_common::inproc::state::PENDING,
            tracer_common::inproc::state::CANCELLED,
            Ordering::SeqCst,
            Ordering::SeqCst,
        )
    }

    /// Answers a counter's HANDOVER (HANDED), with why the probes do not count it where they
    /// do not: the reason goes in first, as the counter's own refusals do.
    pub(super) fn hand(&self, why: Option<&str>) {
        use std::sync::atomic::Ordering;
        if self.state().load(Ordering::SeqCst) != tracer_common::inproc::state::HANDOVER {
            return;
        }
        if let Some(why) = why {
            let buf = inproc::why_bytes(why);
            // SAFETY: `why` is a field of the header, inside the mapping; the counter does
            // not write it while it waits.
            unsafe {
                std::ptr::write_volatile(
                    self.ptr
                        .add(std::mem::offset_of!(Header, why))
                        .cast::<[u8; 256]>(),
                    buf,
                )
            };
        }
        let _ = self.state().compare_exchange(
            tracer_common::inproc::state::HANDOVER,
            tracer_common::inproc::state::HANDED,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    pub(super) fn busy(&self) -> &AtomicU32 {
        self.word(std::mem::offset_of!(Header, busy))
    }

    /// The records of type `T` among `count` from `offset` that `keep` keeps, if they lie
    /// inside the mapping: copied one by one, so a table mostly empty costs no copy of it.
    pub(super) fn records<T: Copy>(
        &self,
        offset: usize,
        count: usize,
        keep: impl Fn(&T) -> bool,
    ) -> Vec<T> {
        let size = std::mem::size_of::<T>();
        let end = count.checked_mul(size).and_then(|n| n.checked_add(offset));
        if end.is_none_or(|end| end > self.len) {
            return Vec::new();
        }
        (0..count)
            // SAFETY: inside the mapping (checked above); records are plain `repr(C)` data.
            .map(|i| unsafe {
                std::ptr::read_volatile(self.ptr.add(offset + i * size).cast::<T>())
            })
            .filter(|r| keep(r))
            .collect()
    }

    /// A name's bytes, if they lie inside the strings area as tracerd laid it out (its own
    /// capacities, not the header's, which the process may rewrite).
    pub(super) fn name_bytes(&self, s: StrRef) -> Option<&[u8]> {
        let (off, len) = (s.offset as usize, s.len as usize);
        if off.checked_add(len)? > inproc::STRINGS {
            return None;
        }
        let start = inproc::strings_offset(inproc::ENTRIES, inproc::EDGES) + off;
        if start + len > self.len {
            return None;
        }
        // SAFETY: inside the mapping (checked above).
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(start), len) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        crate::sigbus::unguard(self.ptr as usize);
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

pub(super) use crate::process::beside_tracerd;

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory a tracerd of before code directories made (its journal line names no code
    /// directory) gets no code written into it: its user could change it.
    #[test]
    fn an_older_tracerds_directory_gets_no_code() {
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            tracer_testkit::skip("the directory's checks want root's /tmp");
            return;
        }
        let base = std::env::temp_dir().join(format!("older-dir-test-{}", std::process::id()));
        let dir = base.join("tmp/tracer-old-1");
        std::fs::create_dir_all(&dir).unwrap();
        for (p, mode) in [(&base, 0o755), (&base.join("tmp"), 0o1777)] {
            std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode))
                .unwrap();
        }
        let m = std::fs::metadata(&dir).unwrap();
        let old = Dir::existing(&base, "tracer-old-1", (0, 0), (m.dev(), m.ino()), None).unwrap();
        let refused = old.create_code("remove.1.py", b"print()").unwrap_err();
        assert!(refused.contains("made by an older tracerd"), "{refused}");
        assert!(!dir.join("remove.1.py").exists());
        assert_eq!(old.code_path("start.py"), "/tmp/tracer-old-1/start.py");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
