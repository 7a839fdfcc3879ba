//! The counters' directories a tracerd made, written down in its state directory (root's
//! alone) until they are gone, so that the next tracerd sweeps what a killed one left: the
//! directory, and a counter still registered in a live process, whose tool id would
//! otherwise stay taken for the life of the process. Only what is written here is swept,
//! under the checks a session's end makes: nothing is found by name in a directory a user
//! controls.

use std::{
    fs,
    io::Write,
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::{atomic::Ordering, OnceLock},
};

use tracer_common::inproc::{self, state};

use super::{
    cleanup_later,
    files::{Dir, Mapping},
    process::{maps_file, own_pid, start_time, uids},
    remote_exec, remove_script, LIBRARY_AS,
};
use crate::pinned::Pinned;

static JOURNAL: OnceLock<PathBuf> = OnceLock::new();

/// Keeps the journal in `dir` (made 0700 if missing). Without it nothing is written down and
/// a killed tracerd's files stay.
pub fn set_journal(dir: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let _ = JOURNAL.set(dir.to_owned());
    Ok(())
}

/// One directory made: its process (pid and start time), owner, (device, inode), the
/// library's (device, inode) once made, whether the process's root was tracerd's (so that
/// the directory can be reached after the process is gone), and its code directory's
/// (device, inode) (None: written by a tracerd of before code directories).
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    pid: u32,
    start: u64,
    owner: (u32, u32),
    dir: (u64, u64),
    library: (u64, u64),
    host_root: bool,
    code: Option<(u64, u64)>,
}

impl Entry {
    fn line(&self) -> String {
        let code = self
            .code
            .map(|(d, i)| format!(" {d} {i}"))
            .unwrap_or_default();
        format!(
            "{} {} {} {} {} {} {} {} {}{code}\n",
            self.pid,
            self.start,
            self.owner.0,
            self.owner.1,
            self.dir.0,
            self.dir.1,
            self.library.0,
            self.library.1,
            u8::from(self.host_root)
        )
    }

    fn parse(line: &str) -> Option<Self> {
        let n: Vec<u64> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        let (&[pid, start, uid, gid, dd, di, ld, li, host], code) = (match n.as_slice() {
            [fields @ .., cd, ci] if n.len() == 11 => (fields, Some((*cd, *ci))),
            fields => (fields, None),
        }) else {
            return None;
        };
        Some(Self {
            pid: pid.try_into().ok()?,
            start,
            owner: (uid.try_into().ok()?, gid.try_into().ok()?),
            dir: (dd, di),
            library: (ld, li),
            host_root: host == 1,
            code,
        })
    }
}

/// Only names this tracerd makes: `tracer-<session id>-<pid>`.
fn plain(name: &str) -> bool {
    name.strip_prefix("tracer-").is_some_and(|rest| {
        !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    })
}

/// Writes down `dir` (`name`, in `pid`'s `/tmp`), and its library once made.
pub(super) fn record(pid: u32, name: &str, dir: &Dir, library: (u64, u64)) {
    let Some(journal) = JOURNAL.get() else { return };
    let entry = Entry {
        pid,
        start: start_time(pid).unwrap_or(0),
        owner: dir.owner,
        dir: dir.id(),
        library,
        host_root: crate::process::same_root(pid),
        code: dir.code_id(),
    };
    let written = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(journal.join(name))
        .and_then(|mut f| f.write_all(entry.line().as_bytes()));
    if let Err(e) = written {
        tracing::warn!(%e, name, "writing down an in-process counter's directory");
    }
}

/// Crosses `name` out: its directory is gone.
pub(super) fn forget(name: &str) {
    if let Some(journal) = JOURNAL.get() {
        let _ = fs::remove_file(journal.join(name));
    }
}

/// Sweeps what earlier tracerds left: in a live process that still runs its counter, the
/// counter is stopped and removed (as at a session's end, under the same checks); the
/// directory goes once that is done, or at once where the process is gone and its `/tmp`
/// was the machine's. Returns what it did, a line each, for the log.
pub fn sweep() -> Vec<String> {
    let Some(journal) = JOURNAL.get() else {
        return Vec::new();
    };
    let mut done = Vec::new();
    for e in fs::read_dir(journal).into_iter().flatten().flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let entry = fs::read_to_string(e.path())
            .ok()
            .and_then(|t| Entry::parse(&t));
        match entry {
            Some(entry) if plain(&name) => done.push(sweep_one(&name, &entry)),
            _ => {}
        }
        forget(&name);
    }
    done
}

fn sweep_one(name: &str, e: &Entry) -> String {
    let live = start_time(e.pid) == Some(e.start) && e.start != 0;
    if !live {
        if !e.host_root {
            return format!("{name}: its process is gone, and its /tmp with it");
        }
        return match Dir::existing(Path::new("/"), name, e.owner, e.dir, e.code) {
            Ok(dir) => {
                dir.remove();
                format!("{name}: removed (its process is gone)")
            }
            Err(why) => format!("{name}: left alone: {why}"),
        };
    }
    let root = PathBuf::from(format!("/proc/{}/root", e.pid));
    let dir = match Dir::existing(&root, name, e.owner, e.dir, e.code) {
        Ok(d) => d,
        Err(why) => return format!("{name}: left alone: {why}"),
    };
    let removal = remove_counter(e, &dir);
    let said = format!("{name}: {removal}");
    dir.unlink_code(LIBRARY_AS);
    dir.unlink_code("start.py");
    let scripts = match removal {
        Removal::Asked(pin, own, path) => vec![(pin, own, path)],
        Removal::Not(_) => Vec::new(),
    };
    cleanup_later(
        std::sync::Arc::new(dir),
        name.to_owned(),
        scripts,
        vec![e.pid],
    );
    said
}

enum Removal {
    Asked(Pinned, u32, String),
    Not(String),
}

impl std::fmt::Display for Removal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Asked(pin, ..) => write!(f, "pid {} asked to remove its counter", pin.pid()),
            Self::Not(why) => write!(f, "counter not removed: {why}"),
        }
    }
}

/// Stops the process's counter and asks it to remove it, if it runs as the directory's owner,
/// may be traced by that owner, and loaded the counter from this directory.
fn remove_counter(e: &Entry, dir: &Dir) -> Removal {
    let own = own_pid(e.pid).unwrap_or(e.pid);
    let file = format!("{}{own}", inproc::FILE_PREFIX);
    let Some(map) = dir
        .open(&file, true)
        .ok()
        .and_then(|f| Mapping::new(&f).ok())
    else {
        return Removal::Not("no counts file".into());
    };
    let h = map.header();
    if !super::well_formed(&h) {
        return Removal::Not("not a counts file of this tracer".into());
    }
    for from in [state::RUNNING, state::ORPHANED] {
        let _ =
            map.state()
                .compare_exchange(from, state::STOPPED, Ordering::SeqCst, Ordering::SeqCst);
    }
    if map.state().load(Ordering::SeqCst) != state::STOPPED {
        return Removal::Not("its counter never started".into());
    }
    let checked = (|| -> Result<Pinned, String> {
        let pin = Pinned::open(e.pid).map_err(|e| e.to_string())?;
        if uids(e.pid)?.iter().any(|&u| u != e.owner.0) {
            return Err("it no longer runs as the directory's owner alone".into());
        }
        if e.owner.0 != 0 {
            if let Ok(Some(why)) = crate::process::ptrace_boundary(e.pid, e.owner.0) {
                return Err(why);
            }
        }
        if !maps_file(e.pid, e.library) {
            return Err("it has not loaded tracer's counter from this directory".into());
        }
        dir.seen_by(e.pid)?;
        if !pin.alive() {
            return Err("it exited".into());
        }
        Ok(pin)
    })();
    let pin = match checked {
        Ok(p) => p,
        Err(why) => return Removal::Not(why),
    };
    let script_name = format!("remove.{own}.py");
    let counts = dir.path(&file);
    let script = remove_script(h.tool_id, &counts, &dir.code_path(LIBRARY_AS));
    if let Err(why) = dir.create_code(&script_name, script.as_bytes()) {
        return Removal::Not(why);
    }
    let path = dir.code_path(&script_name);
    match remote_exec::request(&pin, &path) {
        Ok(_) => Removal::Asked(pin, own, path),
        Err(e) => Removal::Not(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_read_back_and_names_are_checked() {
        let e = Entry {
            pid: 7,
            start: 123,
            owner: (1000, 1000),
            dir: (64, 99),
            library: (64, 100),
            host_root: true,
            code: Some((64, 101)),
        };
        assert_eq!(Entry::parse(&e.line()), Some(e));
        // Written by a tracerd of before code directories.
        let old = Entry::parse("7 123 1000 1000 64 99 64 100 1").unwrap();
        assert_eq!(old.code, None);
        assert_eq!(Entry::parse("7 123 1000 1000 64 99 64 100 1 5"), None);
        assert_eq!(Entry::parse("1 2 3"), None);
        assert!(plain("tracer-0a1b2c-42"));
        assert!(!plain("tracer-../etc"));
        assert!(!plain("other"));
        assert!(!plain("tracer-"));
    }
}
