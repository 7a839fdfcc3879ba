//! Where the code a process runs for tracer lies: the counter library, tracer's loader and
//! the start and removal scripts, in `/tmp/NAME-code` beside the counter's directory. That
//! directory and its files are root's (0755, 0644), so the process's user may read them but
//! not replace them between their writing and their loading: a user whom Yama forbids to
//! trace its own processes gets no code of its own run in one because root counts it. The
//! counts files stay in the user's directory, which the counter writes.
//!
//! The guarantee holds only where neither the process's root nor its `/tmp` is the user's
//! (else it could rename the directory away); there, with Yama on, in-process counting is
//! refused ([`may_make`]).

use std::{
    fs::{File, Metadata},
    io::Write,
    os::{
        fd::AsRawFd,
        unix::fs::{MetadataExt, PermissionsExt},
    },
};

use super::at::{
    c_name, check, found_at, mount_id, names, open_dir_at, open_file_at, unlink_at, unsafe_parent,
};

/// The code directory's name beside the counter's directory `name`.
pub(super) fn name_of(name: &str) -> String {
    format!("{name}-code")
}

/// Whether code may be put in `tmp` (the process's `/tmp`, under `root`) for a process of
/// `uid`: where only root could swap it; else why not, where that user could and Yama
/// forbids it to have code run in its own processes (where Yama allows it, the user could
/// do so anyway, with ptrace).
pub(super) fn may_make(root: &File, tmp: &File, uid: u32) -> Result<(), String> {
    let root = root.metadata().map_err(|e| e.to_string())?;
    let tmp = tmp.metadata().map_err(|e| e.to_string())?;
    allowed(crate::process::yama_ptrace_scope(), &root, &tmp, uid)
}

/// [`may_make`] under Yama's `scope`.
fn allowed(scope: u8, root: &Metadata, tmp: &Metadata, uid: u32) -> Result<(), String> {
    if uid == 0 || scope == 0 {
        return Ok(());
    }
    for (m, what) in [
        (root, "the process's root directory"),
        (tmp, "the process's /tmp"),
    ] {
        if let Some(why) = unsafe_parent(m, 0, what) {
            return Err(format!(
                "{why}: uid {uid} could replace tracer's code there before the process loads it, which kernel.yama.ptrace_scope {scope} forbids that user to do"
            ));
        }
    }
    Ok(())
}

/// The open code directory and the `/tmp` holding it.
pub(super) struct CodeDir {
    this: File,
    parent: File,
    /// Its name in `parent`.
    name: String,
    /// (device, inode): what a process must find at its path before it is asked to run a
    /// file in it.
    id: (u64, u64),
}

impl CodeDir {
    /// Makes `name` in `tmp`, root's, mode 0755. The user's own directory beside it was made
    /// first as that user: the kernel checked that the user may write this `/tmp`.
    pub(super) fn make(tmp: &File, name: String) -> Result<Self, String> {
        let parent = tmp.try_clone().map_err(|e| e.to_string())?;
        let c = c_name(&name).map_err(|e| e.to_string())?;
        // SAFETY: plain syscall on a descriptor we hold and a NUL-terminated name.
        check(unsafe { libc::mkdirat(parent.as_raw_fd(), c.as_ptr(), 0o755) })
            .map_err(|e| format!("creating /tmp/{name}: {e}"))?;
        let this = open_dir_at(&parent, &name).map_err(|e| format!("/tmp/{name}: {e}"))?;
        // Whatever tracerd's umask is.
        // SAFETY: plain syscall on a descriptor we hold.
        unsafe { libc::fchmod(this.as_raw_fd(), 0o755) };
        let dir = Self {
            this,
            parent,
            name,
            id: (0, 0),
        };
        let m = dir.this.metadata().map_err(|e| e.to_string())?;
        let p = dir.parent.metadata().map_err(|e| e.to_string())?;
        // Made now by root, so empty unless something was mounted or swapped in between.
        if m.uid() != 0
            || m.mode() & 0o7777 != 0o755
            || m.dev() != p.dev()
            || mount_id(&dir.this) != mount_id(&dir.parent)
        {
            dir.remove();
            return Err(format!(
                "/tmp/{} is not the directory tracer made (a mount or a swap in between)",
                dir.name
            ));
        }
        Ok(Self {
            id: (m.dev(), m.ino()),
            ..dir
        })
    }

    /// A code directory made before (by a tracerd since killed), if it is still the one
    /// made, `id`, and root's.
    pub(super) fn existing(tmp: &File, name: String, id: (u64, u64)) -> Result<Self, String> {
        let this = open_dir_at(tmp, &name).map_err(|e| format!("/tmp/{name}: {e}"))?;
        let m = this.metadata().map_err(|e| e.to_string())?;
        if (m.dev(), m.ino()) != id || m.uid() != 0 {
            return Err(format!("/tmp/{name} is not the directory tracer made"));
        }
        Ok(Self {
            this,
            parent: tmp.try_clone().map_err(|e| e.to_string())?,
            name,
            id,
        })
    }

    pub(super) fn id(&self) -> (u64, u64) {
        self.id
    }

    /// `file`'s path as the process sees it.
    pub(super) fn path(&self, file: &str) -> String {
        format!("/tmp/{}/{file}", self.name)
    }

    /// Whether `tmp` (a process's `/tmp`) holds this very directory.
    pub(super) fn seen_in(&self, tmp: &File) -> Result<(), String> {
        found_at(tmp, &self.name, self.id)
    }

    /// Creates `file` (not there before), root's, mode 0644, with `bytes`.
    pub(super) fn create(&self, file: &str, bytes: &[u8]) -> Result<File, String> {
        let made = (|| {
            let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL;
            let mut f = open_file_at(&self.this, file, flags, 0o644)?;
            // Whatever tracerd's umask is: the process's user reads it.
            f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
            f.write_all(bytes)?;
            Ok::<_, std::io::Error>(f)
        })();
        made.map_err(|e| format!("creating {file}: {e}"))
    }

    pub(super) fn unlink(&self, file: &str) {
        let _ = unlink_at(&self.this, file, 0);
    }

    /// Deletes its files (only tracerd writes there), then itself.
    pub(super) fn remove(&self) {
        for f in names(&self.this) {
            self.unlink(&f);
        }
        let _ = unlink_at(&self.parent, &self.name, libc::AT_REMOVEDIR);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A `/tmp` of the process's user lets it rename tracer's directory away: refused under
    /// Yama, where that user may not have code run in its own processes otherwise.
    #[test]
    fn a_tmp_the_user_owns_is_refused_under_yama_only() {
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            tracer_testkit::skip("chown needs root");
            return;
        }
        let base = std::env::temp_dir().join(format!("code-dir-test-{}", std::process::id()));
        let (root, tmp) = (base.join("root"), base.join("root/tmp"));
        std::fs::create_dir_all(&tmp).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let meta = |p: &std::path::Path| std::fs::metadata(p).unwrap();
        assert_eq!(allowed(1, &meta(&root), &meta(&tmp), 1000), Ok(()));
        std::os::unix::fs::chown(&tmp, Some(1000), None).unwrap();
        let refused = allowed(1, &meta(&root), &meta(&tmp), 1000).unwrap_err();
        assert!(refused.contains("belongs to uid 1000"), "{refused}");
        assert!(refused.contains("ptrace_scope 1"), "{refused}");
        assert_eq!(allowed(0, &meta(&root), &meta(&tmp), 1000), Ok(()));
        assert_eq!(allowed(2, &meta(&root), &meta(&tmp), 0), Ok(()));
        std::os::unix::fs::chown(&tmp, Some(0), None).unwrap();
        std::os::unix::fs::chown(&root, Some(1000), None).unwrap();
        assert!(allowed(1, &meta(&root), &meta(&tmp), 1000).is_err());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
