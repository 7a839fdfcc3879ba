//! A Python code object as the sampler names its frames: its names and line table, read
//! from the process once, the line of an instruction, and asyncio task names.

use tracer_inspect::python::{layout::Version, linetable, memory};

/// A Python code object's names, read from the process once.
pub(super) struct Code {
    /// `py_names_id` of its qualname and file name objects: a freed code object's address
    /// is reused by other functions, which the probe's reading of the same tells apart.
    pub(super) names: u64,
    pub(super) qualname: String,
    pub(super) filename: String,
    pub(super) firstlineno: u32,
    pub(super) linetable: Vec<u8>,
}

/// A Python frame's function and line, read now from its process: (qualname, file, line).
/// None if the code object no longer has the names it had (`names`).
pub fn python_location(
    pid: u32,
    code: u64,
    instr: u64,
    names: u64,
    v: &Version,
) -> Option<(String, String, u32)> {
    let c = read_code(pid, code, v).filter(|c| c.names == names)?;
    let line = instruction_offset(v, code, instr)
        .and_then(|off| linetable::line_for(v.minor, &c.linetable, c.firstlineno, off))
        .unwrap_or(c.firstlineno);
    Some((c.qualname, c.filename, line))
}

/// Byte offset of the frame's instruction in its code, or None before the first one (a
/// frame being set up), which is then shown at the function's first line.
pub(super) fn instruction_offset(v: &Version, code: u64, instr: u64) -> Option<u32> {
    if v.minor == 10 {
        // f_lasti: an instruction index; -1 before the first.
        let lasti = instr as i64;
        return (lasti >= 0).then(|| (lasti as u32).saturating_mul(2));
    }
    let first = code + v.code_adaptive;
    let off = instr.checked_sub(first)?;
    u32::try_from(off).ok()
}

pub(super) fn read_code(pid: u32, code: u64, v: &Version) -> Option<Code> {
    let qualname_obj = memory::read_u64(pid, code + u64::from(v.probe.code_qualname)).ok()?;
    let filename_obj = memory::read_u64(pid, code + u64::from(v.probe.code_filename)).ok()?;
    let (qualname, filename) = memory::code_names(pid, code, v).ok()?;
    let mut first = [0u8; 4];
    memory::read(pid, code + u64::from(v.probe.code_firstlineno), &mut first).ok()?;
    let firstlineno = u32::try_from(i32::from_le_bytes(first)).unwrap_or(0);
    let table = memory::read_u64(pid, code + v.code_linetable).ok()?;
    // A bytes object: ob_size at 16, data at 32.
    let size = memory::read_u64(pid, table + 16).ok()?;
    let mut linetable = vec![0u8; usize::try_from(size.min(1 << 20)).ok()?];
    memory::read(pid, table + 32, &mut linetable).ok()?;
    Some(Code {
        names: tracer_common::py_names_id(qualname_obj, filename_obj),
        qualname,
        filename,
        firstlineno,
        linetable,
    })
}

/// A task's name: a `str`, or an `int` n shown as asyncio shows it, "Task-n".
pub(super) fn task_name(pid: u32, obj: u64, v: &Version) -> String {
    // `tp_flags` of a type object (x86-64; unchanged since 3.0), and its subclass bits.
    const TP_FLAGS: u64 = 168;
    const LONG_SUBCLASS: u64 = 1 << 24;
    const UNICODE_SUBCLASS: u64 = 1 << 28;
    let flags = memory::read_u64(pid, obj + 8)
        .and_then(|t| memory::read_u64(pid, t + TP_FLAGS))
        .unwrap_or(0);
    if flags & UNICODE_SUBCLASS != 0 {
        if let Ok(s) = memory::read_str(pid, obj, v) {
            return s
                .chars()
                .map(|c| if c.is_control() { '?' } else { c })
                .collect();
        }
    } else if flags & LONG_SUBCLASS != 0 {
        // 3.12+ compact ints: `lv_tag` (digit count << 3 | sign), then 30-bit digits.
        let tag = memory::read_u64(pid, obj + 16).unwrap_or(u64::MAX);
        let mut digits = [0u8; 8];
        if tag >> 3 <= 2 && tag & 3 == 0 && memory::read(pid, obj + 24, &mut digits).is_ok() {
            let d0 = u64::from(u32::from_le_bytes(digits[..4].try_into().expect("4")));
            let d1 = u64::from(u32::from_le_bytes(digits[4..].try_into().expect("4")));
            let n = match tag >> 3 {
                0 => 0,
                1 => d0,
                _ => d0 | d1 << 30,
            };
            return format!("Task-{n}");
        }
    }
    "[unknown task]".into()
}
