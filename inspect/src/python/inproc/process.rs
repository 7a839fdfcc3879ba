//! What the in-process counter needs to know of a process from `/proc`: whether it lives,
//! its start, its ids, its pid namespace's pids, and what it maps.

use std::fs;

use super::LIBRARY_AS;

/// Whether `pid` can still run a script: not gone, not a zombie.
pub(super) fn alive(pid: u32) -> bool {
    crate::process::alive(pid)
}

/// How a process's start is known across restarts (`/proc/PID/stat`'s start time).
pub(super) fn start_time(pid: u32) -> Option<u64> {
    crate::process::start_time(pid)
}

/// The pid a process knows itself by (in its own pid namespace).
pub(super) fn own_pid(pid: u32) -> Option<u32> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// Pids as a counted process's pid namespace knows them → pids here.
pub(super) enum Pids {
    /// The daemon's own namespace.
    Same,
    /// Another: the live processes of that namespace.
    Map(std::collections::HashMap<u32, u32>),
}

impl Pids {
    pub(super) fn of(pid: u32) -> Self {
        let Some(own) = own_pid(pid) else {
            return Self::Same;
        };
        if own == pid {
            return Self::Same;
        }
        let ns = |p: u32| fs::read_link(format!("/proc/{p}/ns/pid")).ok();
        let mine = ns(pid);
        let mut out = std::collections::HashMap::from([(own, pid)]);
        for e in fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
        {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if ns(p) == mine {
                if let Some(o) = own_pid(p) {
                    out.insert(o, p);
                }
            }
        }
        Self::Map(out)
    }

    /// The pid here; unknown for a process of another namespace that is gone.
    pub(super) fn host(&self, own: u32) -> Option<u32> {
        match self {
            Self::Same => Some(own),
            Self::Map(m) => m.get(&own).copied(),
        }
    }
}

/// The file-system uid and gid `pid` creates and opens files as.
pub(super) fn fs_ids(pid: u32) -> Result<(u32, u32), String> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("reading pid {pid}'s status: {e}"))?;
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().nth(3))
            .and_then(|v| v.parse().ok())
    };
    field("Uid:")
        .zip(field("Gid:"))
        .ok_or_else(|| format!("pid {pid}'s status has no Uid/Gid lines"))
}

/// The ids on `pid`'s `Uid:` line: real, effective, saved, file-system.
pub(super) fn uids(pid: u32) -> Result<Vec<u32>, String> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    let ids: Vec<u32> = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .map(|v| {
            v.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    if ids.len() == 4 {
        Ok(ids)
    } else {
        Err("its status has no Uid line".into())
    }
}

/// Whether `pid` maps the file `(dev, ino)`.
pub(super) fn maps_file(pid: u32, (dev, ino): (u64, u64)) -> bool {
    let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return false;
    };
    maps.lines().any(|l| {
        let mut f = l.split_whitespace().skip(3);
        let (Some(d), Some(i)) = (f.next(), f.next()) else {
            return false;
        };
        let same_dev = d.split_once(':').is_some_and(|(ma, mi)| {
            let (ma, mi) = (
                u32::from_str_radix(ma, 16).unwrap_or(u32::MAX),
                u32::from_str_radix(mi, 16).unwrap_or(u32::MAX),
            );
            libc::makedev(ma, mi) == dev
        });
        i.parse::<u64>() == Ok(ino) && (same_dev || l.contains(&format!("/{LIBRARY_AS}")))
    })
}
