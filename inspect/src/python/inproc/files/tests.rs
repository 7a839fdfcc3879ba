//! Unit tests of `files.rs`: real files, FIFOs, sockets, links and mounts.

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
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    }
    let m = std::fs::metadata(&dir).unwrap();
    let old = Dir::existing(&base, "tracer-old-1", (0, 0), (m.dev(), m.ino()), None).unwrap();
    let refused = old.create_code("remove.1.py", b"print()").unwrap_err();
    assert!(refused.contains("made by an older tracerd"), "{refused}");
    assert!(!dir.join("remove.1.py").exists());
    assert_eq!(old.code_path("start.py"), "/tmp/tracer-old-1/start.py");
    std::fs::remove_dir_all(&base).unwrap();
}

/// The directory's owner in these tests (no such user need exist).
const OWNER: Ids = (4242, 4242);

/// A counter directory of [`OWNER`]'s, `/tmp/tracer-t-1` under a root of its own, as
/// tracerd finds it again; the root, to delete. None (said) where not root.
fn owners_dir(tag: &str) -> Option<(std::path::PathBuf, Dir)> {
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tracer_testkit::skip("making files of another user wants root");
        return None;
    }
    use std::os::unix::fs::PermissionsExt;
    let base = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let dir = base.join("tmp/tracer-t-1");
    std::fs::create_dir_all(&dir).unwrap();
    for (p, mode) in [(&base, 0o755), (&base.join("tmp"), 0o1777), (&dir, 0o700)] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    std::os::unix::fs::chown(&dir, Some(OWNER.0), Some(OWNER.1)).unwrap();
    let m = std::fs::metadata(&dir).unwrap();
    let found = Dir::existing(&base, "tracer-t-1", OWNER, (m.dev(), m.ino()), None).unwrap();
    Some((base, found))
}

/// A file of the owner's at `path`, `len` bytes long.
fn owners_file(path: &std::path::Path, len: u64) {
    let f = File::create(path).unwrap();
    f.set_len(len).unwrap();
    std::os::unix::fs::chown(path, Some(OWNER.0), Some(OWNER.1)).unwrap();
}

fn refused(dir: &Dir, name: &str, write: bool) -> String {
    match dir.open(name, write) {
        Ok(_) => panic!("{name} was opened"),
        Err(e) => e.to_string(),
    }
}

/// What the owner may put where tracerd looks for a counts file: only a regular file of
/// its own with one name is opened; a symbolic link, a FIFO (its writer, blocked until a
/// reader opens it, stays blocked: nothing opened it), a socket, a device, a directory,
/// a file of root's (world-writable: the kernel would let the owner open it) and a hard
/// link are refused, and the report's reason names which.
#[test]
fn only_regular_files_of_the_owner_with_one_name_are_opened() {
    let Some((base, dir)) = owners_dir("open-checks-test") else {
        return;
    };
    let at = |name: &str| base.join("tmp/tracer-t-1").join(name);
    owners_file(&at("counts.1"), 100);
    dir.open("counts.1", false).unwrap();
    dir.open("counts.1", true).unwrap();

    std::os::unix::fs::symlink(at("counts.1"), at("counts.2")).unwrap();
    assert!(refused(&dir, "counts.2", false).contains("a symbolic link"));

    let fifo = std::ffi::CString::new(at("counts.3").to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    check(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }).unwrap();
    std::os::unix::fs::chown(at("counts.3"), Some(OWNER.0), Some(OWNER.1)).unwrap();
    let woken = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (path, woken) = (at("counts.3"), woken.clone());
        // Blocks until a reader opens the FIFO.
        std::thread::spawn(move || {
            let f = std::fs::OpenOptions::new().write(true).open(path);
            woken.store(true, std::sync::atomic::Ordering::SeqCst);
            f.map(drop)
        })
    };
    assert!(refused(&dir, "counts.3", false).contains("a FIFO"));
    assert!(refused(&dir, "counts.3", true).contains("a FIFO"));
    std::thread::sleep(std::time::Duration::from_millis(200));
    let was_woken = woken.load(std::sync::atomic::Ordering::SeqCst);
    // Lets the writer go.
    let reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(at("counts.3"))
        .unwrap();
    writer.join().unwrap().unwrap();
    drop(reader);
    assert!(!was_woken, "tracerd opened the FIFO (its writer was woken)");

    let _socket = std::os::unix::net::UnixListener::bind(at("counts.4")).unwrap();
    assert!(refused(&dir, "counts.4", false).contains("a socket"));

    let dev = std::ffi::CString::new(at("counts.5").to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; /dev/null's numbers.
    if unsafe { libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } == 0 {
        assert!(refused(&dir, "counts.5", true).contains("a character device"));
    }

    std::fs::create_dir(at("counts.6")).unwrap();
    assert!(refused(&dir, "counts.6", false).contains("a directory"));

    File::create(at("counts.7")).unwrap();
    std::fs::set_permissions(
        at("counts.7"),
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    let why = refused(&dir, "counts.7", true);
    assert!(why.contains("belongs to uid 0"), "{why}");

    owners_file(&at("kept"), 100);
    std::fs::hard_link(at("kept"), at("counts.8")).unwrap();
    let why = refused(&dir, "counts.8", false);
    assert!(why.contains("2 hard links"), "{why}");

    // The start's error, where the owner put something else than its text.
    assert_eq!(dir.read_text("load-error"), None);
    let said = dir.read_text("counts.7").unwrap();
    assert!(
        said.contains("not read") && said.contains("uid 0"),
        "{said}"
    );
    std::fs::write(at("counts.1"), b"why").unwrap();
    assert_eq!(dir.read_text("counts.1").as_deref(), Some("why"));
    std::fs::remove_dir_all(&base).unwrap();
}

/// A file of the owner's bound over a counts file's name in a mount namespace (as the
/// process's user may do in a namespace of its own, which tracerd reaches the directory
/// through): refused, another mount than the directory's.
#[test]
fn a_file_bound_over_its_name_is_refused() {
    let Some((base, _)) = owners_dir("bound-test") else {
        return;
    };
    let base2 = base.clone();
    // A mount namespace of this thread's own: the bind goes nowhere else.
    let done = std::thread::spawn(move || {
        let base = base2;
        // SAFETY: plain syscalls on this thread's own mount namespace.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0
                || libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        let dir = base.join("tmp/tracer-t-1");
        owners_file(&base.join("elsewhere"), 100);
        owners_file(&dir.join("counts.9"), 100);
        let from = std::ffi::CString::new(base.join("elsewhere").to_str().unwrap()).unwrap();
        let to = std::ffi::CString::new(dir.join("counts.9").to_str().unwrap()).unwrap();
        // SAFETY: NUL-terminated paths.
        check(unsafe {
            libc::mount(
                from.as_ptr(),
                to.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        })?;
        let m = std::fs::metadata(&dir).unwrap();
        let found = Dir::existing(&base, "tracer-t-1", OWNER, (m.dev(), m.ino()), None).unwrap();
        if mount_id(&found.this) == 0 {
            return Ok(None);
        }
        let why = refused(&found, "counts.9", false);
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(to.as_ptr(), libc::MNT_DETACH) };
        Ok(Some(why))
    })
    .join()
    .unwrap();
    match done {
        Ok(Some(why)) => assert!(why.contains("another mount"), "{why}"),
        Ok(None) => tracer_testkit::skip("statx names no mount here"),
        Err(e) => tracer_testkit::skip(format_args!("no mount namespace here: {e}")),
    }
    std::fs::remove_dir_all(&base).unwrap();
}

/// Sizes are tracerd's own: a file of 1 TB (sparse) or one short of a counts file is not
/// mapped; a header whose capacities differ is not a counts file of this tracer; a file
/// grown once mapped is read within the mapping's length; a file that cannot be guarded
/// against its owner's shrinking it is not mapped.
#[test]
fn counts_files_are_mapped_at_tracerds_size_only() {
    let Some((base, dir)) = owners_dir("sizes-test") else {
        return;
    };
    let _slots = crate::sigbus::TEST_SLOTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let at = |name: &str| base.join("tmp/tracer-t-1").join(name);
    let size = inproc::file_size(inproc::ENTRIES, inproc::EDGES, inproc::STRINGS);
    for (name, len) in [("counts.1", 1u64 << 40), ("counts.2", size as u64 - 1)] {
        owners_file(&at(name), len);
        let f = dir.open(name, true).unwrap();
        let why = Mapping::new(&f).err().expect("mapped");
        assert!(why.to_string().contains("wrong size"), "{why}");
    }
    owners_file(&at("counts.3"), size as u64);
    let f = dir.open("counts.3", true).unwrap();
    let map = Mapping::new(&f).unwrap();
    let mut h = Header::new(3, inproc::state::RUNNING, inproc::CAPS);
    h.entries_cap = u32::MAX;
    // SAFETY: the mapping starts with a header's room.
    unsafe { std::ptr::write_volatile(map.ptr.cast::<Header>(), h) };
    assert!(!super::super::read::well_formed(&map.header()));
    f.set_len(2 * size as u64).unwrap();
    assert!(map.records::<u64>(size, 1, |_| true).is_empty());
    assert!(map
        .name_bytes(StrRef {
            offset: 0,
            len: u32::MAX
        })
        .is_none());
    drop(map);
    f.set_len(size as u64).unwrap();
    // Every slot of the SIGBUS guard taken (addresses of the first page: nothing's).
    let taken: Vec<usize> = (1..).take_while(|&a| crate::sigbus::guard(a, 1)).collect();
    let refused = Mapping::new(&f).err();
    for a in taken {
        crate::sigbus::unguard(a);
    }
    let why = refused.expect("mapped unguarded").to_string();
    assert!(why.contains("too many counts files"), "{why}");
    Mapping::new(&f).unwrap();
    std::fs::remove_dir_all(&base).unwrap();
}

/// Counts files are named by the pid as the counter writes it: `counts.+5` and
/// `counts.05` are no second file of pid 5; of many, the lowest pids are taken, and the
/// others counted.
#[test]
fn counts_files_are_named_by_pid_as_written() {
    let Some((base, dir)) = owners_dir("names-test") else {
        return;
    };
    let at = |name: &str| base.join("tmp/tracer-t-1").join(name);
    for name in [
        "counts.5",
        "counts.+5",
        "counts.05",
        "counts.x",
        "counts.",
        "counts.4294967296",
        "counts.7",
        "handover.5",
    ] {
        File::create(at(name)).unwrap();
    }
    let (found, more) = dir.counts_files(10);
    assert_eq!(
        found,
        [(5, "counts.5".to_owned()), (7, "counts.7".to_owned())]
    );
    assert_eq!(more, 0);
    assert_eq!(
        dir.by_pid("handover.", 10).0,
        [(5, "handover.5".to_owned())]
    );
    for pid in 1000..3500 {
        File::create(at(&format!("counts.{pid}"))).unwrap();
    }
    let (found, more) = dir.counts_files(3);
    let pids: Vec<u32> = found.iter().map(|f| f.0).collect();
    assert_eq!((pids, more), (vec![5, 7, 1000], 2499));
    dir.remove();
    assert!(!at("").exists(), "the directory went");
    std::fs::remove_dir_all(&base).unwrap();
}
