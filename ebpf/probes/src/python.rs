//! Counting Python calls. Uprobes on each interpreter's eval loop find the code object being
//! entered and count it per (session, process, code object) in `PY_CALLS`. The first time a
//! session sees a code object, its names go to user space on `PY_CODES`.
//!
//! The attach cookie of every probe is the index of the interpreter's `PyLayout`.

use aya_ebpf::{
    helpers::{bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_probe_read_user, bpf_probe_read_user_str_bytes},
    macros::{map, uprobe},
    maps::{Array, HashMap, LruHashMap, RingBuf},
    programs::ProbeContext,
    EbpfContext,
};
use tracer_common::{
    loss, py_kind, py_names_id, PyCallKey, PyCodeEvent, PyLayout, SessionMask, PY_CODE_FILENAME_UNREAD,
    PY_CODE_QUALNAME_UNREAD, PY_LAYOUTS_MAX,
};

use crate::proc::{count_loss, TRACKED};

#[map]
static PY_LAYOUTS: Array<PyLayout> = Array::with_max_entries(PY_LAYOUTS_MAX, 0);

/// Thread id → its `PyThreadState *`, recorded when the thread enters the eval loop (or seeded
/// by the daemon for threads already inside it).
#[map]
static PY_TSTATE: LruHashMap<u32, u64> = LruHashMap::with_max_entries(65_536, 0);

#[map]
static PY_CALLS: HashMap<PyCallKey, u64> = HashMap::with_max_entries(262_144, 0);

#[map]
static PY_CODES: RingBuf = RingBuf::with_byte_size(4 * 1024 * 1024, 0);

/// One entry: [sessions counting Python calls, those of them that count every process].
#[map]
static PY_SESSIONS: Array<[SessionMask; 2]> = Array::with_max_entries(1, 0);

/// `PyASCIIObject.state` bits: compact (5) and ascii (6), the same from 3.10 to 3.13.
const COMPACT_ASCII: u32 = (1 << 5) | (1 << 6);

/// The sessions that count this process's calls, if any.
fn sessions(pid: u32) -> SessionMask {
    let [python, all] = PY_SESSIONS.get(0).copied().unwrap_or([0, 0]);
    if python == 0 {
        return 0;
    }
    // SAFETY: map values are valid for the duration of the program.
    let followed = unsafe { TRACKED.get(&pid) }.copied().unwrap_or(0);
    (followed | all) & python
}

fn layout(ctx: &ProbeContext) -> Option<&'static PyLayout> {
    // SAFETY: plain helper call on this program's context.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    PY_LAYOUTS.get(cookie as u32)
}

fn read<T>(addr: u64) -> Result<T, ()> {
    // SAFETY: bpf_probe_read_user copes with any address; a bad one is an error, not a fault.
    unsafe { bpf_probe_read_user(addr as *const T) }.map_err(|_| count_loss(loss::PY_READ_FAILED))
}

/// `_PyEval_EvalFrameDefault` entry. 3.10: counts the frame's code. 3.11+: remembers the
/// thread's state for the RESUME probes.
#[uprobe]
pub fn tracer_py_eval_entry(ctx: ProbeContext) -> u32 {
    let _ = try_eval_entry(&ctx);
    0
}

fn try_eval_entry(ctx: &ProbeContext) -> Result<(), ()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let pid = (pid_tgid >> 32) as u32;
    let Some(layout) = layout(ctx) else { return Ok(()) };
    if layout.kind != py_kind::EVAL_ARG_FRAME {
        let tstate: u64 = ctx.arg(0).ok_or(())?;
        // Recorded for every process: cheap, and a session that starts later finds it.
        let _ = PY_TSTATE.insert(&(pid_tgid as u32), &tstate, 0);
        // An exception thrown into a suspended generator or coroutine (throw(), close())
        // resumes its frame without passing RESUME; profilers count that as a call too.
        let throwflag: u64 = ctx.arg(2).ok_or(())?;
        if throwflag as u32 == 0 {
            return Ok(());
        }
    }
    let mask = sessions(pid);
    if mask == 0 {
        return Ok(());
    }
    let frame: u64 = ctx.arg(1).ok_or(())?;
    let code: u64 = read(frame + u64::from(layout.frame_code))?;
    count(mask, pid, code, layout);
    Ok(())
}

/// A RESUME handler of the eval loop (3.11+): a frame starts or resumes, which is what
/// cProfile counts as a call.
#[uprobe]
pub fn tracer_py_resume(ctx: ProbeContext) -> u32 {
    let _ = try_resume(&ctx);
    0
}

fn try_resume(ctx: &ProbeContext) -> Result<(), ()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let pid = (pid_tgid >> 32) as u32;
    let mask = sessions(pid);
    if mask == 0 {
        return Ok(());
    }
    let layout = layout(ctx).ok_or(())?;
    // SAFETY: map values are valid for the duration of the program.
    let Some(&tstate) = (unsafe { PY_TSTATE.get(&(pid_tgid as u32)) }) else {
        count_loss(loss::PY_NO_THREAD_STATE);
        return Ok(());
    };
    let frame: u64 = if layout.kind == py_kind::CFRAME {
        let cframe: u64 = read(tstate + u64::from(layout.tstate_cframe))?;
        read(cframe + u64::from(layout.cframe_current_frame))?
    } else {
        read(tstate + u64::from(layout.tstate_current_frame))?
    };
    let code: u64 = read(frame + u64::from(layout.frame_code))?;
    count(mask, pid, code, layout);
    Ok(())
}

fn count(mut mask: SessionMask, pid: u32, code: u64, layout: &PyLayout) {
    let Ok(qualname) = read::<u64>(code + u64::from(layout.code_qualname)) else { return };
    let Ok(filename) = read::<u64>(code + u64::from(layout.code_filename)) else { return };
    let names = py_names_id(qualname, filename);
    // One iteration per session following this process: almost always one.
    for _ in 0..tracer_common::MAX_TRACKED_SESSIONS {
        if mask == 0 {
            return;
        }
        let slot = mask.trailing_zeros();
        mask &= mask - 1;
        let key = PyCallKey { slot, pid, code, names };
        if let Some(n) = PY_CALLS.get_ptr_mut(&key) {
            add(n);
            continue;
        }
        // BPF_NOEXIST: of two CPUs racing on a first call, one inserts and names it.
        match PY_CALLS.insert(&key, &1, 1) {
            Ok(()) => send_names(&key, qualname, filename, layout),
            Err(_) => match PY_CALLS.get_ptr_mut(&key) {
                Some(n) => add(n),
                None => count_loss(loss::PY_CALLS_FULL),
            },
        }
    }
}

/// Atomic increment (BPF_ATOMIC add): threads of one process call the same function on several CPUs.
fn add(n: *mut u64) {
    // SAFETY: `n` points to a live map value.
    unsafe { core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(n, 1) };
}

fn send_names(key: &PyCallKey, qualname: u64, filename: u64, layout: &PyLayout) {
    let Some(mut entry) = PY_CODES.reserve::<PyCodeEvent>(0) else {
        count_loss(loss::PY_CODES_RINGBUF_FULL);
        return;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points to the reserved record, which we fill completely before submitting.
    unsafe {
        (*ev).slot = key.slot;
        (*ev).pid = key.pid;
        (*ev).code = key.code;
        (*ev).names = key.names;
        (*ev).firstlineno = read::<i32>(key.code + u64::from(layout.code_firstlineno)).unwrap_or(0);
        let mut flags = 0;
        if !read_str(qualname, layout, &mut (*ev).qualname) {
            flags |= PY_CODE_QUALNAME_UNREAD;
        }
        if !read_str(filename, layout, &mut (*ev).filename) {
            flags |= PY_CODE_FILENAME_UNREAD;
        }
        (*ev).flags = flags;
    }
    entry.submit(0);
}

/// Reads the `str` object `obj` into `out`, if it is compact ASCII (nearly every identifier
/// and path is); otherwise user space reads it.
fn read_str(obj: u64, layout: &PyLayout, out: &mut [u8]) -> bool {
    out[0] = 0;
    let Ok(state) = read::<u32>(obj + u64::from(layout.unicode_state)) else { return false };
    if state & COMPACT_ASCII != COMPACT_ASCII {
        return false;
    }
    let data = (obj + u64::from(layout.unicode_ascii_data)) as *const u8;
    // SAFETY: reads at most out.len() bytes of user memory, stopping at the string's NUL.
    unsafe { bpf_probe_read_user_str_bytes(data, out) }.is_ok()
}
