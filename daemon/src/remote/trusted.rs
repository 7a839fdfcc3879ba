//! Files tracerd reads at its start and takes orders from: its settings, the access policy,
//! and the TLS material that decides who connects. tracerd runs as root, so whoever may
//! change such a file controls tracerd (which group may use its socket, who may trace as
//! root over TCP). Like sshd with its users' files (StrictModes), tracerd refuses a file that
//! someone other than root (or the user tracerd runs as) owns or may write, or that sits in
//! a directory such a user may change. It also reads only regular files, at most `MAX_SIZE`
//! bytes: a FIFO would block the start forever, and `/dev/zero` would be read until memory
//! runs out.

use std::{
    fs::{File, Metadata},
    io::Read,
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

/// The most a settings, policy or PEM file may hold; real ones are a few KiB.
pub const MAX_SIZE: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TrustedFileError {
    #[error("{}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a regular file ({kind})", path.display())]
    NotAFile { path: PathBuf, kind: &'static str },
    #[error("{}: larger than {} KiB, the most tracerd reads", path.display(), MAX_SIZE >> 10)]
    TooLarge { path: PathBuf },
    #[error("{}: {why}: whoever may change it controls tracerd, which runs as root", path.display())]
    Unsafe { path: PathBuf, why: String },
    #[error("{}: not UTF-8 text", path.display())]
    NotText { path: PathBuf },
}

/// The file at `path`, as text, once it has passed the checks above.
pub fn read_text(path: &Path) -> Result<String, TrustedFileError> {
    String::from_utf8(read(path)?).map_err(|_| TrustedFileError::NotText {
        path: path.to_owned(),
    })
}

/// The file at `path`, once it has passed the checks above.
pub fn read(path: &Path) -> Result<Vec<u8>, TrustedFileError> {
    let open = |source| TrustedFileError::Open {
        path: path.to_owned(),
        source,
    };
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(open)?;
    let meta = file.metadata().map_err(open)?;
    if !meta.is_file() {
        return Err(TrustedFileError::NotAFile {
            path: path.to_owned(),
            kind: kind(&meta),
        });
    }
    if meta.len() > MAX_SIZE {
        return Err(TrustedFileError::TooLarge {
            path: path.to_owned(),
        });
    }
    // SAFETY: geteuid cannot fail and touches no memory.
    let euid = unsafe { libc::geteuid() };
    let unsafe_file = |why: String| TrustedFileError::Unsafe {
        path: path.to_owned(),
        why,
    };
    if let Some(why) = unsafe_to_trust(&meta, euid, false) {
        return Err(unsafe_file(why));
    }
    // The directories of the file opened, symbolic links resolved: the descriptor's own path
    // names the file read, whatever the path given went through.
    let real = std::fs::read_link(format!("/proc/self/fd/{}", raw_fd(&file)))
        .or_else(|_| path.canonicalize())
        .map_err(open)?;
    for dir in real.ancestors().skip(1) {
        let meta = std::fs::metadata(dir).map_err(open)?;
        if let Some(why) = unsafe_to_trust(&meta, euid, true) {
            return Err(unsafe_file(format!(
                "its directory {}: {why}",
                dir.display()
            )));
        }
    }
    // The size again, as read: the file may have grown since it was looked at.
    let mut data = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_SIZE + 1)
        .read_to_end(&mut data)
        .map_err(open)?;
    if data.len() as u64 > MAX_SIZE {
        return Err(TrustedFileError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(data)
}

fn raw_fd(file: &File) -> i32 {
    use std::os::fd::AsRawFd;
    file.as_raw_fd()
}

/// Why a file (or directory) that tracerd running as `euid` takes orders from may be
/// changed by someone else: its owner, or write permission for its group or others. A
/// directory writable by others is fine when sticky (as /tmp): they may not rename or
/// remove what they do not own.
fn unsafe_to_trust(meta: &Metadata, euid: u32, dir: bool) -> Option<String> {
    let (uid, mode) = (meta.uid(), meta.mode());
    if uid != 0 && uid != euid {
        return Some(format!("owned by uid {uid} (chown root)"));
    }
    let sticky = dir && mode & 0o1000 != 0;
    if mode & 0o022 != 0 && !sticky {
        return Some(format!(
            "writable by its group or others, mode {:o} (chmod go-w)",
            mode & 0o7777
        ));
    }
    None
}

fn kind(meta: &Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn euid() -> u32 {
        // SAFETY: as above.
        unsafe { libc::geteuid() }
    }

    #[test]
    fn what_is_not_a_small_regular_file_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let started = std::time::Instant::now();
        let e = read(&fifo).unwrap_err().to_string();
        assert!(e.ends_with("not a regular file (a FIFO)"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        let e = read(Path::new("/dev/zero")).unwrap_err().to_string();
        assert_eq!(e, "/dev/zero: not a regular file (a character device)");
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.ends_with("not a regular file (a directory)"), "{e}");
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'#'; MAX_SIZE as usize + 1]).unwrap();
        let e = read(&big).unwrap_err().to_string();
        assert!(
            e.ends_with("larger than 1024 KiB, the most tracerd reads"),
            "{e}"
        );
        let exact = dir.path().join("exact");
        std::fs::write(&exact, vec![b'#'; MAX_SIZE as usize]).unwrap();
        assert_eq!(read(&exact).unwrap().len(), MAX_SIZE as usize);
        let binary = dir.path().join("binary");
        std::fs::write(&binary, [0xff, 0xfe]).unwrap();
        assert!(read_text(&binary)
            .unwrap_err()
            .to_string()
            .ends_with("not UTF-8 text"));
    }

    #[test]
    fn files_others_may_change_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tracerd.toml");
        std::fs::write(&file, "x = 1\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(read_text(&file).unwrap(), "x = 1\n");
        for mode in [0o666, 0o646, 0o664] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = read(&file).unwrap_err().to_string();
            assert!(
                e.contains(&format!("writable by its group or others, mode {mode:o}"))
                    && e.contains("controls tracerd"),
                "{e}"
            );
        }
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        // Through a symbolic link: the directory of the file itself counts.
        let open_dir = dir.path().join("open");
        std::fs::create_dir(&open_dir).unwrap();
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let inner = open_dir.join("real.toml");
        std::fs::write(&inner, "").unwrap();
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o644)).unwrap();
        let link = dir.path().join("link.toml");
        std::os::unix::fs::symlink(&inner, &link).unwrap();
        let e = read(&link).unwrap_err().to_string();
        assert!(
            e.contains(&format!("its directory {}", open_dir.display())) && e.contains("mode 777"),
            "{e}"
        );
        // Sticky, as /tmp: others may not replace what is not theirs.
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(read(&link).is_ok());
    }

    #[test]
    fn owners_other_than_root_and_tracerd_are_refused() {
        let meta = |path: &Path| std::fs::metadata(path).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let m = meta(&file);
        assert_eq!(unsafe_to_trust(&m, euid(), false), None);
        // As seen by a tracerd running as another user than the owner (unless root's).
        let other = if m.uid() == 0 {
            None
        } else {
            Some(m.uid() + 1)
        };
        if let Some(euid) = other {
            assert_eq!(
                unsafe_to_trust(&m, euid, false).unwrap(),
                format!("owned by uid {} (chown root)", m.uid())
            );
        }
        if euid() == 0 {
            nix::unistd::chown(&file, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
            let e = read(&file).unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534 (chown root)"), "{e}");
        }
    }
}
