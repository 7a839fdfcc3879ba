//! /proc/PID/maps, as the unwinder, the symbolizer and the probes read it.

use std::{fs, io};

/// One line of /proc/PID/maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapEntry {
    pub start: u64,
    pub end: u64,
    /// Offset in the file of the mapping's first byte.
    pub offset: u64,
    /// The file's path as the process sees it (inside its mount namespace), a pseudo-path such
    /// as `[vdso]` or `[stack]`, or empty for anonymous executable memory (JIT code).
    pub path: String,
    pub executable: bool,
    /// (major, minor) of the device holding the file.
    pub dev: (u32, u32),
    pub inode: u64,
}

impl MapEntry {
    /// Whether the kernel reports the file as unlinked since it was mapped: its path may now
    /// name a different file (a package upgrade), so only /proc/PID/map_files reaches it.
    pub fn deleted(&self) -> bool {
        self.path.ends_with(" (deleted)")
    }

    pub fn is_file(&self) -> bool {
        self.path.starts_with('/') && self.inode != 0
    }
}

/// A process's memory mappings: those backed by a file or named by the kernel (`[vdso]`,
/// `[stack]`, ...) and anonymous executable ones. Anonymous data (heaps, arenas) is left out.
#[derive(Clone, Debug, Default)]
pub struct ProcMaps {
    pid: u32,
    /// Sorted by start; mappings never overlap.
    entries: Vec<MapEntry>,
}

impl ProcMaps {
    pub fn read(pid: u32) -> io::Result<Self> {
        Ok(Self::parse(
            pid,
            &fs::read_to_string(format!("/proc/{pid}/maps"))?,
        ))
    }

    /// Parses the text of /proc/PID/maps; malformed lines are skipped.
    pub fn parse(pid: u32, text: &str) -> Self {
        let mut entries: Vec<MapEntry> = text
            .lines()
            .filter_map(parse_maps_line)
            .filter(|e| !e.path.is_empty() || e.executable)
            .collect();
        entries.sort_by_key(|e| e.start);
        ProcMaps { pid, entries }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The mapping containing `addr`.
    pub fn find(&self, addr: u64) -> Option<&MapEntry> {
        let i = self
            .entries
            .partition_point(|e| e.start <= addr)
            .checked_sub(1)?;
        let e = &self.entries[i];
        (addr < e.end).then_some(e)
    }

    pub fn entries(&self) -> &[MapEntry] {
        &self.entries
    }
}

/// `start-end perms offset major:minor inode   path`; the path may contain spaces.
fn parse_maps_line(line: &str) -> Option<MapEntry> {
    fn field<'a>(rest: &mut &'a str) -> Option<&'a str> {
        let s = rest.trim_start();
        let end = s.find(char::is_whitespace).unwrap_or(s.len());
        let (f, r) = s.split_at(end);
        *rest = r;
        (!f.is_empty()).then_some(f)
    }
    let hex = |s: &str| u64::from_str_radix(s, 16).ok();
    let mut rest = line;
    let (start, end) = field(&mut rest)?.split_once('-')?;
    let perms = field(&mut rest)?;
    let offset = hex(field(&mut rest)?)?;
    let (major, minor) = field(&mut rest)?.split_once(':')?;
    let inode = field(&mut rest)?.parse().ok()?;
    Some(MapEntry {
        start: hex(start)?,
        end: hex(end)?,
        offset,
        path: rest.trim_start().to_string(),
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        dev: (
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        ),
        inode,
    })
}
