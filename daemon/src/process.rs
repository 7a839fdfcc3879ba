//! What /proc says about a process: whether it lives, who owns it, its threads.

use std::{fs, io};

/// Whether `pid` is a live process (not a zombie waiting to be reaped).
pub fn alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name, which may itself hold ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

/// Real, effective, saved and filesystem uids of `pid`.
pub fn uids(pid: u32) -> io::Result<[u32; 4]> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no Uid line"))?;
    let mut out = [0; 4];
    for (slot, field) in out.iter_mut().zip(line.split_whitespace()) {
        *slot = field
            .parse()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad uid"))?;
    }
    Ok(out)
}

/// Thread ids of `pid`.
pub fn threads(pid: u32) -> io::Result<Vec<u32>> {
    let mut tids: Vec<u32> = fs::read_dir(format!("/proc/{pid}/task"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    Ok(tids)
}

/// The process a thread belongs to.
pub fn tgid(tid: u32) -> Option<u32> {
    fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))?
        .trim()
        .parse()
        .ok()
}

/// The command name of `pid`, for reports.
pub fn comm(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_ours() {
        let me = std::process::id();
        assert!(alive(me));
        assert_eq!(uids(me).unwrap()[0], nix::unistd::getuid().as_raw());
        assert!(threads(me).unwrap().contains(&me));
        assert!(!alive(u32::MAX - 1));
    }

    #[test]
    fn zombies_are_not_alive() {
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not reaped yet: a zombie once it exits.
        for _ in 0..200 {
            if !alive(pid) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!alive(pid));
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
        drop(child);
    }
}
