//! The counter's directory and files, as tracerd touches them. The directory lies in the
//! counted process's `/tmp` and belongs to the process's user, who may change anything in
//! it (the code the process runs lies beside it, root's: [`super::code_dir`]): tracerd
//! makes it, and makes, opens and deletes files in it, as that user (its file-system ids,
//! [`as_user`]), so that it can do there nothing the user could not; only
//! in a `/tmp` (and a root) that no other user could swap; relative to held descriptors,
//! following no symbolic link; files it opens there must be regular files of the user's,
//! with no other name, on the directory's own mount, looked at before they are opened
//! ([`Dir::open`]), and what it reads is bounds-checked. A mapping whose file the user
//! shrinks reads as zeros ([`super::sigbus`]) instead of killing tracerd.

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
    at::{c_name, check, found_at, mount_id, open_dir_at, open_file_at, unlink_at, unsafe_parent},
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

    /// Opens `name`, as the owner, if it is a plain file of the owner's, named once, in the
    /// directory's own mount ([`Self::refused`]). It is looked at through an `O_PATH`
    /// descriptor, which opens nothing (a FIFO's writer is not woken, no device driver is
    /// called), and opened only once it passed, through that descriptor: the very file looked
    /// at, whatever is renamed meanwhile.
    pub(super) fn open(&self, name: &str, write: bool) -> std::io::Result<File> {
        as_user(self.owner, || {
            let at = open_file_at(&self.this, name, libc::O_PATH, 0)?;
            let m = at.metadata()?;
            if let Some(why) = self.refused(&m, mount_id(&at)) {
                return Err(std::io::Error::other(format!("tracer refused it: {why}")));
            }
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
                .open(format!("/proc/self/fd/{}", at.as_raw_fd()))?;
            let opened = f.metadata()?;
            if (opened.dev(), opened.ino()) != (m.dev(), m.ino()) {
                return Err(std::io::Error::other("not the file looked at"));
            }
            Ok(f)
        })
    }

    /// Why a file found in the directory (`m`, on mount `mount`) is not one tracerd opens;
    /// None: it is. Anything but a regular file (a symbolic link, a FIFO that would block, a
    /// device); a file of another user (a hard link to it, or a file bound over the name in
    /// the process's mount namespace, which the directory was reached through: tracerd's
    /// supplementary groups could let it open a file its owner may not); a file with other
    /// names (a hard link); a file of another mount.
    fn refused(&self, m: &std::fs::Metadata, mount: u64) -> Option<String> {
        use std::os::unix::fs::FileTypeExt;
        let t = m.file_type();
        let kind = [
            (t.is_symlink(), "a symbolic link"),
            (t.is_fifo(), "a FIFO"),
            (t.is_socket(), "a socket"),
            (t.is_char_device(), "a character device"),
            (t.is_block_device(), "a block device"),
            (t.is_dir(), "a directory"),
            (!t.is_file(), "of an unknown type"),
        ]
        .into_iter()
        .find_map(|(is, kind)| is.then_some(kind));
        if let Some(kind) = kind {
            return Some(format!("it is {kind}, not a regular file"));
        }
        if m.uid() != self.owner.0 {
            return Some(format!(
                "it belongs to uid {}, not to the directory's owner (uid {})",
                m.uid(),
                self.owner.0
            ));
        }
        match m.nlink() {
            1 => {}
            0 => return Some("it was deleted as it was opened".into()),
            n => {
                return Some(format!(
                    "it has {n} hard links: a name for a file that lies elsewhere too"
                ))
            }
        }
        if m.dev() != self.id.0 || mount != mount_id(&self.this) {
            return Some(
                "it lies on another mount than its directory (bound over its name)".into(),
            );
        }
        None
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

    /// The first KiB of a small text file the process wrote; where tracerd refused to open
    /// it, why (in brackets). None: there is none.
    pub(super) fn read_text(&self, name: &str) -> Option<String> {
        let f = match self.open(name, false) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => return Some(format!("[{name} not read: {e}]")),
        };
        let mut text = Vec::new();
        f.take(1024).read_to_end(&mut text).ok()?;
        Some(String::from_utf8_lossy(&text).into_owned())
    }

    /// When it last changed (a file made or deleted in it).
    pub(super) fn mtime(&self) -> Option<(i64, i64)> {
        let m = self.this.metadata().ok()?;
        Some((m.mtime(), m.mtime_nsec()))
    }

    pub(super) fn unlink(&self, name: &str) {
        let _ = as_user(self.owner, || unlink_at(&self.this, name, 0));
    }

    /// The names in it, read as they are asked for: the owner may make millions, which
    /// tracerd does not hold all at once.
    fn listing(&self) -> impl Iterator<Item = String> {
        let listing = format!("/proc/self/fd/{}", self.this.as_raw_fd());
        std::fs::read_dir(listing)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().into_string().ok())
    }

    /// Deletes its files (a bounded number: the owner may fill it), then itself; and the code
    /// directory.
    pub(super) fn remove(&self) {
        let names: Vec<String> = self.listing().take(MAX_NAMES).collect();
        for f in names {
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

    /// The same for the files named `prefix<pid>`, the pid written as the counter writes it
    /// (`counts.+5` and `counts.05` are not a second file of pid 5): the `most` of lowest
    /// pid, holding no more than about twice that many names at a time.
    pub(super) fn by_pid(&self, prefix: &str, most: usize) -> (Vec<(u32, String)>, usize) {
        let mut kept: Vec<(u32, String)> = Vec::new();
        let mut all = 0usize;
        for name in self.listing() {
            let Some(pid) = pid_in(&name, prefix) else {
                continue;
            };
            all += 1;
            kept.push((pid, name));
            if kept.len() > most.max(512) * 2 {
                kept.sort_unstable();
                kept.truncate(most);
            }
        }
        kept.sort_unstable();
        kept.truncate(most);
        let more = all - kept.len();
        (kept, more)
    }
}

/// The pid `name` gives after `prefix`, written in decimal as `u32`'s `Display` writes it.
fn pid_in(name: &str, prefix: &str) -> Option<u32> {
    let digits = name.strip_prefix(prefix)?;
    let pid: u32 = digits.parse().ok()?;
    (pid.to_string() == digits).then_some(pid)
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
        if !crate::sigbus::guard(ptr as usize, len) {
            // Unguarded, a file its owner shrinks would kill tracerd at its first write.
            // SAFETY: the mapping just made, unmapped once.
            unsafe { libc::munmap(ptr, len) };
            return Err(std::io::Error::other(
                "too many counts files mapped at once: tracerd maps none it cannot guard against its owner's shrinking it",
            ));
        }
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
mod tests;
