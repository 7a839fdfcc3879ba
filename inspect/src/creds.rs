//! Acting as another user for file access: Linux keeps file-system ids per thread.

/// (uid, gid).
pub type Ids = (u32, u32);

/// Runs `f` with this thread's file-system ids set to `owner`'s, and its supplementary
/// groups to the owner's gid alone: what it makes is the owner's, and the kernel lets it do
/// only what the owner may (a root thread's file capabilities are off while its fsuid is
/// not 0; tracerd's own groups, root's among them, would still open group-readable files of
/// root's). Linux keeps these ids per thread.
pub fn as_user<T>(owner: Ids, f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    if owner == (0, 0) {
        return f();
    }
    let _groups = Groups::only(owner.1)?;
    struct Back(u32, u32);
    impl Drop for Back {
        fn drop(&mut self) {
            // SAFETY: plain syscalls on this thread's own credentials.
            unsafe {
                libc::setfsuid(self.0);
                libc::setfsgid(self.1);
            }
        }
    }
    // SAFETY: as above; each returns the id before the call. An invalid id (u32::MAX)
    // changes nothing and returns the current one: how the change is checked.
    let back = unsafe {
        let gid = libc::setfsgid(owner.1) as u32;
        let uid = libc::setfsuid(owner.0) as u32;
        Back(uid, gid)
    };
    // SAFETY: as above.
    let now = unsafe {
        (
            libc::setfsuid(u32::MAX) as u32,
            libc::setfsgid(u32::MAX) as u32,
        )
    };
    if now != owner {
        drop(back);
        return Err(std::io::Error::other(format!(
            "could not act as uid {} gid {}",
            owner.0, owner.1
        )));
    }
    let out = f();
    drop(back);
    out
}

/// This thread's supplementary groups, set to one gid until dropped. The raw system call
/// changes the calling thread alone (glibc's `setgroups` would change every thread).
struct Groups(Vec<libc::gid_t>);

impl Groups {
    fn only(gid: u32) -> std::io::Result<Self> {
        // SAFETY: getgroups with size 0 returns the count and writes nothing.
        let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut saved = vec![0; n as usize];
        // SAFETY: a buffer of `n` gids.
        let n = unsafe { libc::getgroups(n, saved.as_mut_ptr()) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        saved.truncate(n as usize);
        set(&[gid])?;
        Ok(Self(saved))
    }
}

impl Drop for Groups {
    fn drop(&mut self) {
        if let Err(e) = set(&self.0) {
            tracing::error!(%e, "restoring a thread's supplementary groups");
        }
    }
}

fn set(groups: &[libc::gid_t]) -> std::io::Result<()> {
    // SAFETY: a valid array of `len` gids; affects this thread only.
    let r = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn groups() -> Vec<libc::gid_t> {
        let mut g = vec![0; 256];
        // SAFETY: a buffer of 256 gids.
        let n = unsafe { libc::getgroups(256, g.as_mut_ptr()) };
        g.truncate(n.max(0) as usize);
        g
    }

    /// A file of root's that root's group may read is not the user's to read: acting as the
    /// user drops tracerd's own supplementary groups too (root's group here, as a root
    /// login's groups hold), and gives them back after.
    #[test]
    fn a_user_reads_no_file_of_roots_group() {
        // SAFETY: reads this process's ids.
        if unsafe { libc::geteuid() } != 0 {
            tracer_testkit::skip("needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let file = dir.path().join("roots");
        std::fs::write(&file, "secret").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        // A thread of its own: its groups are its own.
        std::thread::spawn(move || {
            set(&[0, 4]).unwrap();
            let read = as_user((65534, 65534), || std::fs::read_to_string(&file));
            assert_eq!(
                read.map_err(|e| e.kind()),
                Err(std::io::ErrorKind::PermissionDenied)
            );
            assert_eq!(groups(), [0, 4]);
            // The user's own files stay the user's to read.
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o604)).unwrap();
            assert_eq!(
                as_user((65534, 65534), || std::fs::read_to_string(&file)).unwrap(),
                "secret"
            );
        })
        .join()
        .unwrap();
    }
}
