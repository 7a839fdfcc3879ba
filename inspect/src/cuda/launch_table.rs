//! The launch table of tracer's injection library in a process (`tracer_common::launches`),
//! taken from the process as a file and mapped here read-only, so that its counts can be
//! read while the process runs and after it has died. The process wrote it: the file is
//! checked to be the memfd the library makes, sealed at its size, before it is mapped, and
//! every entry is read as untrusted data.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use tracer_common::{
    launches::{self, state, Entry, Header},
    CudaLaunchKey,
};

/// One row as read: the key, its launches so far and CUPTI's name pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub key: CudaLaunchKey,
    pub count: u64,
    pub name: u64,
}

/// A snapshot: every row's count, and the launches the table had no room for.
#[derive(Clone, Debug, Default)]
pub struct Counts {
    pub rows: Vec<Row>,
    pub full: u64,
    /// A launch under way when counting started whose row could not be made (`Header::unseen`).
    pub unseen: u64,
}

impl Counts {
    /// What was counted since `base` (rows counted then, less their count then).
    pub fn since(&self, base: &Counts) -> Counts {
        let mut before = std::collections::HashMap::new();
        for r in &base.rows {
            *before.entry(r.key).or_insert(0u64) += r.count;
        }
        let mut rows: Vec<Row> = Vec::new();
        let mut at = std::collections::HashMap::new();
        for r in &self.rows {
            // A key may have two entries (one writer gave up waiting for the other): one row.
            match at.get(&r.key) {
                Some(&i) => {
                    let row: &mut Row = &mut rows[i];
                    row.count += r.count;
                }
                None => {
                    at.insert(r.key, rows.len());
                    rows.push(*r);
                }
            }
        }
        for r in &mut rows {
            r.count = r
                .count
                .saturating_sub(before.get(&r.key).copied().unwrap_or(0));
        }
        rows.retain(|r| r.count > 0);
        Counts {
            rows,
            full: self.full.saturating_sub(base.full),
            unseen: self.unseen.saturating_sub(base.unseen),
        }
    }
}

/// The table of one process, mapped read-only.
pub struct LaunchTable {
    map: *const u8,
}

// SAFETY: a read-only shared mapping owned by this value; reads are plain loads of words the
// process updates atomically.
unsafe impl Send for LaunchTable {}
unsafe impl Sync for LaunchTable {}

impl Drop for LaunchTable {
    fn drop(&mut self) {
        // SAFETY: our mapping, `BYTES` long.
        unsafe { libc::munmap(self.map as *mut libc::c_void, launches::BYTES) };
    }
}

impl LaunchTable {
    /// Takes `fd` (a descriptor number in `pid`) from the process and maps it, after checking
    /// that it is the library's sealed memfd of the table's size.
    pub fn take(pid: u32, fd: i32) -> Result<Self, String> {
        let file = take_fd(pid, fd).map_err(|e| format!("taking pid {pid}'s fd {fd}: {e}"))?;
        let raw = file.as_raw_fd();
        let link = std::fs::read_link(format!("/proc/self/fd/{raw}"))
            .map_err(|e| format!("pid {pid}'s fd {fd}: {e}"))?;
        let expected = format!("/memfd:{} (deleted)", launches::MEMFD_NAME);
        if link.as_os_str() != expected.as_str() {
            return Err(format!(
                "pid {pid}'s fd {fd} is {}, not the injection library's launch table",
                link.display()
            ));
        }
        // SAFETY: plain calls on a descriptor we own.
        let (size, seals) = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(raw, &mut st) != 0 {
                return Err(format!("fstat: {}", io::Error::last_os_error()));
            }
            (st.st_size, libc::fcntl(raw, libc::F_GET_SEALS))
        };
        let needed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if size != launches::BYTES as libc::off_t || seals < 0 || seals & needed != needed {
            return Err(format!(
                "pid {pid}'s launch table is {size} bytes, seals {seals:#x}: not the library's (a table that could shrink would fault its reader)"
            ));
        }
        // SAFETY: a shared read-only mapping of a file sealed at this size.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                launches::BYTES,
                libc::PROT_READ,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(format!(
                "mapping pid {pid}'s launch table: {}",
                io::Error::last_os_error()
            ));
        }
        let table = Self { map: map.cast() };
        let h = table.header();
        if h.magic != launches::MAGIC
            || h.version != launches::VERSION
            || h.slots as usize != launches::SLOTS
        {
            return Err(format!(
                "pid {pid}'s launch table has another layout (version {}, {} slots)",
                h.version, h.slots
            ));
        }
        Ok(table)
    }

    /// The rows, `SLOTS` of them, after the header.
    pub(super) fn entries(&self) -> *const Entry {
        // SAFETY: inside the mapping, `BYTES` long.
        unsafe { self.map.add(std::mem::size_of::<Header>()).cast() }
    }

    /// The event ring, `EVENTS` places from `RING_AT`.
    pub(super) fn ring(&self) -> *const tracer_common::launches::Event {
        // SAFETY: inside the mapping, `BYTES` long.
        unsafe { self.map.add(launches::RING_AT).cast() }
    }

    pub(super) fn header(&self) -> Header {
        // SAFETY: the mapping starts with the header.
        unsafe { std::ptr::read_volatile(self.map.cast::<Header>()) }
    }

    /// Every published row and the launches not counted for want of room, now.
    pub fn read(&self) -> Counts {
        let mut rows = Vec::new();
        let entries = self.entries();
        for i in 0..launches::SLOTS {
            // SAFETY: inside the mapping; the state is read before the rest (published last).
            let e = unsafe {
                let p = entries.add(i);
                let st = std::ptr::read_volatile(std::ptr::addr_of!((*p).state));
                if st != state::READY {
                    continue;
                }
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                std::ptr::read_volatile(p)
            };
            rows.push(Row {
                key: e.key,
                count: e.count,
                name: e.name,
            });
        }
        Counts {
            rows,
            full: self.header().full,
            unseen: self.header().unseen,
        }
    }
}

/// `pid`'s descriptor `fd`, duplicated into this process (`pidfd_getfd`: ptrace's right).
fn take_fd(pid: u32, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscalls; each descriptor returned is ours to own.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0);
        if pidfd < 0 {
            return Err(io::Error::last_os_error());
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd as i32);
        let got = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(got as i32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(func: u64, count: u64) -> Row {
        Row {
            key: CudaLaunchKey {
                func,
                ..CudaLaunchKey::default()
            },
            count,
            name: 0,
        }
    }

    #[test]
    fn counts_since_a_base_subtract_and_merge_duplicate_entries() {
        let base = Counts {
            rows: vec![row(1, 10), row(2, 5)],
            full: 1,
            unseen: 0,
        };
        let now = Counts {
            rows: vec![row(1, 12), row(2, 5), row(3, 4), row(3, 1)],
            full: 3,
            unseen: 1,
        };
        let d = now.since(&base);
        assert_eq!(d.rows, vec![row(1, 2), row(3, 5)]);
        assert_eq!((d.full, d.unseen), (2, 1));
    }
}
