//! A process held by its pidfd, with its memory opened: what tracerd writes into a process
//! (a request to run a script) must reach the process that was checked, not one that took
//! its pid since. `/proc/PID/mem`, once open, names the address space it was opened on; a
//! pidfd tells whether the pid still names that process, so checks made through
//! `/proc/PID/...` between [`Pinned::open`] and a true [`Pinned::alive`] were made on it.

use std::{
    fs::File,
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::fs::{FileExt, OpenOptionsExt},
    },
};

/// One process, pinned.
#[derive(Debug)]
pub struct Pinned {
    pid: u32,
    pidfd: OwnedFd,
    mem: File,
    /// The program it ran when pinned, read before its memory was opened.
    image: Image,
}

/// Which program a process runs: an exec keeps the pid and the start time but replaces the
/// executable (and the address space, which [`Pinned::unchanged`] checks apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Image {
    /// `/proc/PID/stat`'s start time: another process under the same pid has another.
    pub start_time: u64,
    /// The executable's (device, inode), through `/proc/PID/exe` (any root, deleted or not).
    pub exe: (u64, u64),
}

impl Image {
    pub fn of(pid: u32) -> io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let start_time = crate::process::start_time(pid)
            .ok_or_else(|| io::Error::other(format!("/proc/{pid}/stat has no start time")))?;
        let exe = std::fs::metadata(format!("/proc/{pid}/exe"))?;
        Ok(Self {
            start_time,
            exe: (exe.dev(), exe.ino()),
        })
    }
}

impl Pinned {
    /// Pins `pid`: its pidfd first, then its memory, so a process that took the pid in between
    /// is caught by the next [`Pinned::alive`] (the pidfd names the first).
    pub fn open(pid: u32) -> io::Result<Self> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // Before the memory: an exec between the two shows as another image later.
        let image = Image::of(pid)?;
        let path = format!("/proc/{pid}/mem");
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
        };
        let mem = match open() {
            // Another user's process whose file mode lets its owner alone write: tracerd
            // without CAP_DAC_OVERRIDE (the service unit, the DaemonSet) opens it as that
            // user (the kernel's ptrace check is then the owner's, with tracerd's
            // CAP_SYS_PTRACE).
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                use std::os::unix::fs::MetadataExt;
                let owner = std::fs::metadata(format!("/proc/{pid}"))?;
                crate::creds::as_user((owner.uid(), owner.gid()), open)?
            }
            r => r?,
        };
        let p = Self {
            pid,
            pidfd,
            mem,
            image,
        };
        if !p.alive() {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(p)
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The program the process ran when pinned.
    pub fn image(&self) -> Image {
        self.image
    }

    /// Whether the process is alive and runs the program it was pinned on (its image; an
    /// exec of the same file shows in [`Pinned::unchanged`] alone).
    fn same_program(&self) -> Result<(), String> {
        let pid = self.pid;
        let now = Image::of(pid).map_err(|e| format!("pid {pid}: {e}"))?;
        if !self.alive() {
            return Err(format!("pid {pid} exited"));
        }
        if now != self.image {
            return Err(format!(
                "pid {pid} executed another program since it was checked"
            ));
        }
        Ok(())
    }

    /// Whether the process still runs the program it was pinned on: not reaped, the same
    /// image, and the address space pinned still its own (an exec drops the old one, whose
    /// memory then reads nothing; `addr` is an address mapped there, a stopped thread's
    /// instruction pointer). Checks made on `/proc/PID` after a true answer, with a thread of
    /// it stopped, are made on that program: another exec would kill the stopped thread.
    pub fn unchanged(&self, addr: u64) -> Result<(), String> {
        let pid = self.pid;
        self.same_program()?;
        let mut b = [0u8; 1];
        self.read(addr, &mut b).map_err(|_| {
            format!("pid {pid} replaced its address space (an exec) since it was checked")
        })
    }

    /// Whether the pinned process has not been reaped: while it has not, its pid is its own,
    /// and what `/proc/PID` showed since [`Pinned::open`] was about it.
    pub fn alive(&self) -> bool {
        // SAFETY: signal 0 checks only; a null info and no flags, on our own descriptor.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                0,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        r == 0
    }

    /// Writes `bytes` at `addr` of the pinned process's memory (nowhere else, whoever has
    /// its pid by now).
    pub fn write(&self, addr: u64, bytes: &[u8]) -> io::Result<()> {
        self.mem.write_all_at(bytes, addr)
    }

    /// Reads `buf.len()` bytes at `addr` of the pinned process's memory.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        self.mem.read_exact_at(buf, addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reaped_process_is_not_alive_and_its_memory_is_not_written() {
        let mut child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        let p = match Pinned::open(child.id()) {
            Ok(p) => p,
            // Not root, or ptrace forbidden here: nothing to check.
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert!(p.alive());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!p.alive());
        assert!(p.write(0x1000, b"x").is_err());
    }
}
