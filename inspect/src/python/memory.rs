//! Reading a live Python process from outside (process_vm_readv): which interpreter it runs,
//! its threads' states, and code objects' names that the probes could not read.

use std::{io, path::PathBuf};

use nix::{
    sys::uio::{process_vm_readv, RemoteIoVec},
    unistd::Pid,
};

use super::{layout::Version, runtime::Runtime};

/// A mapping of an interpreter binary in a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapped {
    pub path: PathBuf,
    pub start: u64,
    pub file_offset: u64,
}

/// The interpreter binary a process runs: its libpython if it maps one, else its `python3.X`
/// executable. `path` is where the daemon opens it (see `process::mapped_path`: chroots and
/// containers).
pub fn runtime_of(pid: u32) -> Option<Mapped> {
    let maps = crate::process::ProcMaps::read(pid).ok()?;
    let mut exe = None;
    for m in maps.entries() {
        let name = m.path.rsplit('/').next().unwrap_or(&m.path);
        let mapped = || Mapped {
            path: crate::process::mapped_path(pid, m).unwrap_or_else(|e| {
                // Left to fail where it is opened, which says so in the report.
                tracing::debug!(%e, "interpreter binary not reachable");
                PathBuf::from(format!("/proc/{pid}/root{}", m.path))
            }),
            start: m.start,
            file_offset: m.offset,
        };
        if name.starts_with("libpython3.") && name.contains(".so") {
            return Some(mapped());
        }
        if exe.is_none()
            && super::runtime::minor_from_name(std::path::Path::new(name)).is_some()
            && !name.contains(".so")
        {
            exe = Some(mapped());
        }
    }
    exe
}

pub fn read(pid: u32, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    let len = buf.len();
    let remote = [RemoteIoVec {
        base: usize::try_from(addr).map_err(|_| io::ErrorKind::InvalidInput)?,
        len,
    }];
    let n = process_vm_readv(
        Pid::from_raw(pid as i32),
        &mut [io::IoSliceMut::new(buf)],
        &remote,
    )?;
    if n == len {
        Ok(())
    } else {
        Err(io::ErrorKind::UnexpectedEof.into())
    }
}

pub fn read_u64(pid: u32, addr: u64) -> io::Result<u64> {
    let mut b = [0u8; 8];
    read(pid, addr, &mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// (tid, `PyThreadState *`) of every live thread of the main interpreter, for 3.11+: tids as
/// the daemon (and the kernel's helpers) see them, also for a process in its own pid
/// namespace.
pub fn thread_states(pid: u32, rt: &Runtime, mapped: &Mapped) -> io::Result<Vec<(u32, u64)>> {
    let v: &Version = rt.version;
    let (Some(native_id), Some(sym)) = (v.tstate_native_thread_id, rt.runtime_symbol) else {
        return Ok(Vec::new());
    };
    let bias = rt
        .load_bias(mapped.start, mapped.file_offset)
        .ok_or(io::ErrorKind::InvalidData)?;
    let runtime = sym.wrapping_add(bias);
    let interp = read_u64(pid, runtime + v.runtime_interpreters_head)?;
    if interp == 0 {
        // Not initialised yet (just exec'd): its threads will enter the eval loop while probed.
        return Ok(Vec::new());
    }
    let mut tstate = read_u64(pid, interp + v.interp_threads_head)?;
    // `native_thread_id` is the tid in the process's own pid namespace.
    let tids = crate::process::tids_by_own_tid(pid)?;
    let mut out = Vec::new();
    // A bound against a corrupt or changing list.
    for _ in 0..4096 {
        if tstate == 0 {
            break;
        }
        let mut id = [0u8; 8];
        read(pid, tstate + native_id, &mut id)?;
        // No such thread: not bound to one yet (0), or exited since.
        if let Some(&tid) = u32::try_from(u64::from_le_bytes(id))
            .ok()
            .and_then(|own| tids.get(&own))
        {
            out.push((tid, tstate));
        }
        tstate = read_u64(pid, tstate + v.tstate_next)?;
    }
    Ok(out)
}

/// Reads a `str` object: compact ASCII, Latin-1, UCS-2 or UCS-4.
pub fn read_str(pid: u32, obj: u64, v: &Version) -> io::Result<String> {
    let length = read_u64(pid, obj + 16)?;
    let mut state = [0u8; 4];
    read(pid, obj + u64::from(v.probe.unicode_state), &mut state)?;
    let state = u32::from_le_bytes(state);
    let (kind, compact, ascii) = (
        (state >> 2) & 7,
        state & (1 << 5) != 0,
        state & (1 << 6) != 0,
    );
    // kind 1, 2 or 4 bytes per character; anything else is not a str (a stale pointer).
    if !compact || length > 4096 || !matches!(kind, 1 | 2 | 4) && !ascii {
        return Err(io::ErrorKind::Unsupported.into());
    }
    // Non-ASCII compact strings are PyCompactUnicodeObject: utf8_length and utf8 pointer
    // follow the header (and wstr_length before 3.12).
    let extra = match (ascii, v.minor) {
        (true, _) => 0,
        (false, ..=11) => 24,
        (false, _) => 16,
    };
    let data = obj + u64::from(v.probe.unicode_ascii_data) + extra;
    let width = u64::from(kind.max(1));
    let mut buf =
        vec![0u8; usize::try_from(length * width).map_err(|_| io::ErrorKind::InvalidData)?];
    read(pid, data, &mut buf)?;
    Ok(match width {
        1 => buf.iter().map(|&b| char::from(b)).collect(),
        2 => buf
            .chunks_exact(2)
            .filter_map(|c| char::from_u32(u32::from(u16::from_le_bytes([c[0], c[1]]))))
            .collect(),
        _ => buf
            .chunks_exact(4)
            .filter_map(|c| char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
    })
}

/// A code object's qualname (name on 3.10) and file name.
pub fn code_names(pid: u32, code: u64, v: &Version) -> io::Result<(String, String)> {
    let q = read_u64(pid, code + u64::from(v.probe.code_qualname))?;
    let f = read_u64(pid, code + u64::from(v.probe.code_filename))?;
    Ok((read_str(pid, q, v)?, read_str(pid, f, v)?))
}

/// A code object's names and first line, if it still has the names it had when `names`
/// (`py_names_id`) was taken: a freed code object's address is soon reused by another.
pub fn checked_code_names(
    pid: u32,
    code: u64,
    names: u64,
    v: &Version,
) -> Option<(String, String, i32)> {
    let q = read_u64(pid, code + u64::from(v.probe.code_qualname)).ok()?;
    let f = read_u64(pid, code + u64::from(v.probe.code_filename)).ok()?;
    if tracer_common::py_names_id(q, f) != names {
        return None;
    }
    let mut line = [0u8; 4];
    read(pid, code + u64::from(v.probe.code_firstlineno), &mut line).ok()?;
    Some((
        read_str(pid, q, v).ok()?,
        read_str(pid, f, v).ok()?,
        i32::from_le_bytes(line),
    ))
}
