//! Sampling: a perf event interrupts each CPU at a frequency and this program records where
//! the interrupted thread is: its kernel stack (aggregated in a stack map), its user
//! registers and a copy of the top of its user stack (unwound by the daemon with unwind
//! tables: distribution builds have no frame pointers), and, for Python threads, the chain
//! of interpreter frames read from the thread's own state.
//!
//! The attach cookie carries the session slot and whether it samples every process.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::BPF_F_USER_STACK,
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_comm, bpf_get_current_pid_tgid,
        bpf_get_current_task, bpf_get_current_task_btf, bpf_get_smp_processor_id, bpf_ktime_get_ns,
        bpf_loop, bpf_probe_read_kernel, bpf_probe_read_user, bpf_task_pt_regs, generated as gen,
    },
    macros::{map, perf_event},
    maps::{Array, HashMap, LruHashMap, RingBuf, StackTrace},
    programs::{tracing::StackIdContext, PerfEventContext},
    EbpfContext,
};
use tracer_common::{
    loss, py_from, py_kind, py_names_id, sample_cookie, sample_flag, PyAsyncLayout, PyLayout,
    PySampleFrame, PySampleProc, SampleEvent, PY_FRAME_ENTRY, PY_FRAME_OWNER_NOT_PYTHON,
    PY_FRAME_SHIM, PY_SAMPLE_NOT_PYTHON, SAMPLE_PY_DEPTH, SAMPLE_STACK_BYTES, SAMPLE_STACK_OFFSET,
};

use crate::{
    shared::{count_loss, read, TRACKED},
    tasks::{self, PY_ASYNC_PROCS},
};

/// 32 MiB: ≥ 480 samples (a record is ≈ 3 KiB plus the stack bytes copied, at most 64 KiB),
/// a quarter second of 999 Hz on both CPUs of a small machine at the deepest stacks.
#[map]
static SAMPLES: RingBuf = RingBuf::with_byte_size(32 * 1024 * 1024, 0);

/// Each CPU's record under construction: the ring receives only the stack bytes copied, a
/// length a ring reservation cannot have. One entry per possible CPU (set by the loader).
/// Programs of this object never nest on a CPU (the kernel runs one tracing program at a
/// time per CPU), so an entry has one writer.
#[map]
static SAMPLE_SCRATCH: Array<SampleEvent> = Array::with_max_entries(1, 0);

/// Kernel stacks, deduplicated by the kernel itself.
#[map]
pub(crate) static SAMPLE_KSTACKS: StackTrace = StackTrace::with_max_entries(16_384, 0);

/// Process id → how to read its Python stacks (or that it runs no known CPython). Filled
/// by the daemon when a process is first sampled; removed at exec and exit.
#[map]
static PY_SAMPLE_PROCS: HashMap<u32, PySampleProc> = HashMap::with_max_entries(65_536, 0);

/// `task_struct.thread.fsbase`, patched in by the loader from the kernel's BTF.
#[no_mangle]
static TASK_FSBASE_OFFSET: u32 = u32::MAX;

/// Process id → the thread state that made its last CUDA launch from Python, and its thread
/// id: the thread a thread running no Python most likely works for (a backward pass's
/// forward pass).
#[map]
static PY_LAST_LAUNCHER: LruHashMap<u32, [u64; 2]> = LruHashMap::with_max_entries(4_096, 0);

const PAGE: usize = 4096;
/// `pt_regs` on x86-64: where the interrupted ip, cs and sp are, and rbp.
const REGS_BP: usize = 32;
const REGS_IP: usize = 128;
const REGS_CS: usize = 136;
const REGS_SP: usize = 152;

#[perf_event]
pub fn tracer_sample(ctx: PerfEventContext) -> u32 {
    let _ = try_sample::<true>(&ctx);
    0
}

/// `tracer_sample` without the asyncio task walk: what sampling loads where the kernel
/// refuses the whole, so that a sampling session loses its task stacks, not its samples.
#[perf_event]
pub fn tracer_sample_plain(ctx: PerfEventContext) -> u32 {
    let _ = try_sample::<false>(&ctx);
    0
}

fn try_sample<const TASKS: bool>(ctx: &PerfEventContext) -> Result<(), ()> {
    // SAFETY: plain helper call on this program's context.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let slot = (cookie & sample_cookie::SLOT_MASK) as u32;
    let pid_tgid = bpf_get_current_pid_tgid();
    let (pid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    if pid == 0 {
        // The idle task: not a process anyone profiles.
        return Ok(());
    }
    if cookie & sample_cookie::ALL == 0 {
        // SAFETY: map values are valid for the duration of the program.
        let followed = unsafe { TRACKED.get(&pid) }.copied().unwrap_or(0);
        if followed & (1 << slot) == 0 {
            return Ok(());
        }
    }
    let Some(ev) = scratch() else {
        return Ok(());
    };
    // SAFETY: `ev` is this CPU's record, ours until sent; fields are written one by one so
    // that the record never lands on the 512-byte BPF stack.
    unsafe {
        header(ev, slot, pid, tid);
        let interrupted = ctx.as_ptr() as *const u8;
        let cs: u64 = bpf_probe_read_kernel(interrupted.add(REGS_CS) as *const u64).unwrap_or(3);
        (*ev).kernel_stack = if cs & 3 == 0 {
            (*ev).flags |= sample_flag::KERNEL_MODE;
            ctx.get_stackid(&SAMPLE_KSTACKS, 0)
                .map(|id| id as i64)
                .unwrap_or_else(|e| e as i64)
        } else {
            -1
        };
        user_stack(ev);
        python::<TASKS, false>(ev, pid);
    }
    // The user stack id is not used: frame-pointer walks are wrong without frame pointers.
    let _ = BPF_F_USER_STACK;
    // SAFETY: filled above.
    unsafe { send(ev) };
    Ok(())
}

/// This CPU's record to fill (`SAMPLE_SCRATCH`).
pub(crate) fn scratch() -> Option<*mut SampleEvent> {
    // SAFETY: plain helper call.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let ev = SAMPLE_SCRATCH.get_ptr_mut(cpu);
    if ev.is_none() {
        // More CPUs than the loader counted: cannot happen, but never silently.
        count_loss(loss::SAMPLES_RINGBUF_FULL);
    }
    ev
}

/// Puts the record on the ring, up to the stack bytes copied.
pub(crate) unsafe fn send(ev: *mut SampleEvent) {
    // SAFETY: `ev` is this CPU's filled record.
    let copied = unsafe { (*ev).stack_len } as usize;
    // Masked, then capped: a bound the verifier can follow to the scratch entry's size.
    let len = SAMPLE_STACK_OFFSET + (copied & (SAMPLE_STACK_BYTES * 2 - 1)).min(SAMPLE_STACK_BYTES);
    // SAFETY: the record is `SAMPLE_STACK_OFFSET + SAMPLE_STACK_BYTES` bytes long.
    let bytes = unsafe { core::slice::from_raw_parts(ev as *const u8, len) };
    if SAMPLES.output::<[u8]>(bytes, 0).is_err() {
        count_loss(loss::SAMPLES_RINGBUF_FULL);
    }
}

/// A CUDA launch's stack (`--cuda-stacks`), as a sample of the launching thread taken in
/// the launch probe: its user stack and Python frames, no kernel stack.
pub(crate) fn launch_stack(slot: u32, pid: u32, tid: u32) {
    let Some(ev) = scratch() else {
        return;
    };
    // SAFETY: as in `try_sample`.
    unsafe {
        header(ev, slot, pid, tid);
        (*ev).kernel_stack = -1;
        user_stack(ev);
        python::<false, true>(ev, pid);
        send(ev);
    }
}

/// The record's fixed fields.
pub(crate) unsafe fn header(ev: *mut SampleEvent, slot: u32, pid: u32, tid: u32) {
    // SAFETY: `ev` is this CPU's record.
    unsafe {
        (*ev).slot = slot;
        (*ev).cpu = bpf_get_smp_processor_id();
        (*ev).pid = pid;
        (*ev).tid = tid;
        (*ev).ktime_ns = bpf_ktime_get_ns();
        (*ev).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        (*ev).flags = 0;
        (*ev).py_depth = 0;
        (*ev).py_task = 0;
        (*ev).slots = 1u64 << (slot & 63);
        (*ev).weight_ns = 0;
        (*ev).own_ns = 0;
    }
}

/// The thread's user registers (saved at its entry to the kernel, whatever the interrupt
/// hit; at a uprobe, the probed instruction's) and the stack pages from the one holding its
/// stack pointer up.
pub(crate) unsafe fn user_stack(ev: *mut SampleEvent) {
    // SAFETY (whole body): reads go through probe-read helpers, which fail cleanly.
    unsafe {
        let regs = bpf_task_pt_regs(bpf_get_current_task_btf()) as *const u8;
        let reg = |off: usize| bpf_probe_read_kernel(regs.add(off) as *const u64).unwrap_or(0);
        let (ip, sp) = (reg(REGS_IP), reg(REGS_SP));
        (*ev).ip = ip;
        (*ev).sp = sp;
        (*ev).bp = reg(REGS_BP);
        let base = sp & !(PAGE as u64 - 1);
        (*ev).stack_base = base;
        (*ev).stack_len = 0;
        if sp == 0 {
            return;
        }
        // Page by page: the stack ends somewhere above, and a read across its end fails whole.
        let dst = (*ev).stack.as_mut_ptr();
        for page in 0..SAMPLE_STACK_BYTES / PAGE {
            let off = page * PAGE;
            let r = gen::bpf_probe_read_user(
                dst.add(off) as *mut c_void,
                PAGE as u32,
                (base + off as u64) as *const c_void,
            );
            if r != 0 {
                break;
            }
            (*ev).stack_len = (off + PAGE) as u32;
        }
    }
}

/// A known Python process's bookkeeping and layout.
fn py_process(pid: u32) -> Option<(PySampleProc, &'static PyLayout)> {
    // SAFETY: map values are valid for the duration of the program.
    let proc = unsafe { PY_SAMPLE_PROCS.get(&pid) }.copied()?;
    if proc.layout == PY_SAMPLE_NOT_PYTHON {
        return None;
    }
    Some((proc, crate::python::layout(proc.layout)?))
}

/// The thread state that last took the GIL in the process's interpreter (0: none).
fn gil_holder(proc: &PySampleProc, l: &PyLayout) -> Option<u64> {
    if l.gil_locked == 0 {
        return None;
    }
    let base = if l.gil_in_interp != 0 {
        read::<u64>(proc.runtime + u64::from(l.runtime_interpreters_head))?
    } else {
        proc.runtime
    };
    read::<u64>(base + u64::from(l.gil_holder))
}

/// A CUDA launch from Python by thread state `tstate` of `pid`: kept with its thread id, so
/// that a thread state freed and its memory reused is not taken for it.
/// The last launcher as tracer's injection library saw it (launches it counted in-process).
pub(crate) fn set_last_launcher(pid: u32, tstate: u64, thread_id: u64) {
    let _ = PY_LAST_LAUNCHER.insert(&pid, &[tstate, thread_id], 0);
}

pub(crate) fn launched_from_python(pid: u32, tstate: u64, l: &PyLayout) {
    // SAFETY: map values are valid for the duration of the program.
    if unsafe { PY_LAST_LAUNCHER.get(&pid) }.map(|v| v[0]) != Some(tstate) {
        let id = read::<u64>(tstate + u64::from(l.tstate_thread_id)).unwrap_or(0);
        let _ = PY_LAST_LAUNCHER.insert(&pid, &[tstate, id], 0);
    }
}

/// For a thread of `pid` that runs no Python (`me`: its thread state, 0 if none), the thread
/// it most likely works for, and that thread's current frame (never 0): the one that last
/// launched from Python (it handed the work over: a backward pass's forward pass), else the
/// one that last held the GIL, most often waiting in the call that handed it the work
/// (`py_from`).
pub(crate) fn works_for(pid: u32, me: u64) -> Option<(u64, u64, &'static PyLayout, u32)> {
    let (proc, l) = py_process(pid)?;
    let frame = |t: u64| {
        crate::python::current_frame_quiet(t, l)
            .ok()
            .filter(|&f| f != 0)
    };
    // SAFETY: map values are valid for the duration of the program.
    if let Some([t, id]) = unsafe { PY_LAST_LAUNCHER.get(&pid) }.copied() {
        let same = read::<u64>(t + u64::from(l.tstate_thread_id)) == Some(id);
        if let Some(f) = frame(t).filter(|_| t != me && same) {
            return Some((t, f, l, py_from::LAST_LAUNCHER));
        }
    }
    let holder = gil_holder(&proc, l).filter(|&h| h != 0 && h != me)?;
    Some((holder, frame(holder)?, l, py_from::GIL_HOLDER))
}

/// Where the current thread's Python state is, if its process runs a known CPython.
pub(crate) enum PyThread {
    /// Its thread state, the layout, and the interpreter state the thread was found in.
    Found(u64, &'static PyLayout, u64),
    /// The daemon has not told yet whether the process runs Python.
    UnknownProcess,
    NotPython,
    /// A Python process, but no thread state for this thread (a native thread).
    NoThread,
}

pub(crate) fn python_thread(pid: u32) -> PyThread {
    // SAFETY: map values are valid for the duration of the program.
    let Some(proc) = (unsafe { PY_SAMPLE_PROCS.get(&pid) }).copied() else {
        return PyThread::UnknownProcess;
    };
    if proc.layout == PY_SAMPLE_NOT_PYTHON {
        return PyThread::NotPython;
    }
    let Some(layout) = crate::python::layout(proc.layout) else {
        return PyThread::NotPython;
    };
    // Thread states are matched on `thread_id`, which CPython sets to pthread_self(): the
    // thread's fs base. Its `native_thread_id` is the tid in the process's own pid
    // namespace, which is not the kernel's tid here inside a container.
    let off = crate::shared::global(&TASK_FSBASE_OFFSET);
    if off == u32::MAX {
        return PyThread::NotPython;
    }
    // SAFETY: plain helper call.
    let fsbase = unsafe { bpf_get_current_task() } + u64::from(off);
    // SAFETY: a kernel read at an offset from this kernel's BTF.
    let Ok(want) = (unsafe { bpf_probe_read_kernel(fsbase as *const u64) }) else {
        return PyThread::NoThread;
    };
    match thread_state(proc.runtime, layout, want) {
        Some((t, interp)) => PyThread::Found(t, layout, interp),
        None => PyThread::NoThread,
    }
}

/// The Python frames of the sampled thread, if its process runs a known CPython.
///
/// `TASKS`: and, in an asyncio task, the tasks awaiting it (the timer's samples, and
/// off-CPU records sent at a system call's exit: the off-CPU switch and launch programs are
/// too large for the verifier with them). `ELSEWHERE` (a CUDA launch's stack): a thread
/// that runs no Python is given the frames of the thread it works for ([`works_for`]:
/// autograd's threads, a C++ pool's), marked `PY_ELSEWHERE`.
// Inlined into each program: called from two, `python::<true>` became a function of its own
// and the verifier's work for both tripled (`cargo xtask bench first-start`).
#[inline(always)]
pub(crate) unsafe fn python<const TASKS: bool, const ELSEWHERE: bool>(
    ev: *mut SampleEvent,
    pid: u32,
) {
    let (tstate, layout, mut frame) = match python_thread(pid) {
        PyThread::Found(t, l, interp) => {
            // SAFETY: as above.
            unsafe { (*ev).flags |= gil(pid, interp, t, l) };
            let Ok(frame) = crate::python::current_frame_quiet(t, l) else {
                // SAFETY: as above.
                unsafe { (*ev).flags |= sample_flag::PY_READ_FAILED };
                return;
            };
            (t, l, frame)
        }
        PyThread::UnknownProcess => {
            // SAFETY: `ev` is this CPU's record.
            unsafe { (*ev).flags |= sample_flag::PY_UNKNOWN_PROCESS };
            return;
        }
        PyThread::NotPython => return,
        PyThread::NoThread => match works_for(pid, 0).filter(|_| ELSEWHERE) {
            Some((other, frame, l, _)) => {
                // SAFETY: as above.
                unsafe { (*ev).flags |= sample_flag::PY_ELSEWHERE };
                (other, l, frame)
            }
            None => {
                // SAFETY: as above.
                unsafe { (*ev).flags |= sample_flag::PY_NO_THREAD };
                return;
            }
        },
    };
    if ELSEWHERE && frame == 0 {
        // A thread state with no frame: a native thread that ran Python once.
        if let Some((_, f, _, _)) = works_for(pid, tstate) {
            // SAFETY: as above.
            unsafe { (*ev).flags |= sample_flag::PY_ELSEWHERE };
            frame = f;
        }
    }
    // SAFETY: map values are valid for the duration of the program.
    let asyncio = if TASKS {
        unsafe { PY_ASYNC_PROCS.get(&pid) }
    } else {
        None
    };
    // 3.11–3.13: the running task is found by the walk, from its frames.
    let legacy = asyncio.filter(|a| a.legacy != 0);
    let task = match asyncio {
        Some(a) if a.legacy == 0 => tasks::running_task(tstate, a),
        _ => 0,
    };
    let task_frame = match asyncio {
        Some(a) if task != 0 => read::<u64>(task + u64::from(a.task_coro))
            .filter(|&c| c != 0)
            .map_or(0, |c| c + u64::from(a.gen_iframe)),
        _ => 0,
    };
    let mut walk = Walk {
        ev,
        layout,
        frame,
        depth: 0,
        failed: false,
        task_frame,
        task_at: 0,
        legacy_pid: legacy.map_or(0, |_| pid),
        code_flags: legacy.map_or(0, |a| a.code_flags),
        coro_frame: 0,
        task,
    };
    // SAFETY: `walk_step` only touches `walk`, which outlives the call.
    unsafe {
        bpf_loop(
            SAMPLE_PY_DEPTH as u32,
            walk_step::<TASKS> as *mut c_void,
            (&mut walk as *mut Walk).cast(),
            0,
        );
        (*ev).py_depth = walk.depth;
        (*ev).py_task = walk.task_at;
        (*ev).flags |= sample_flag::PYTHON;
        if walk.failed {
            (*ev).flags |= sample_flag::PY_READ_FAILED;
        } else if walk.frame != 0 {
            (*ev).flags |= sample_flag::PY_TRUNCATED;
        }
    }
    if let (Some(a), true) = (asyncio, walk.task != 0 && !walk.failed && walk.frame == 0) {
        // SAFETY: as above.
        unsafe { tasks::tasks(ev, layout, a, walk.task, walk.depth) };
    }
}

struct Find {
    layout: *const PyLayout,
    tstate: u64,
    want: u64,
    found: u64,
}

/// Whether the thread whose state is `tstate` holds the GIL: `GIL_KNOWN`, and `GIL_HELD`
/// when the GIL is locked and this thread took it last (`last_holder` stays set after a
/// release, so the lock word says whether anyone holds it now).
fn gil(pid: u32, interp: u64, tstate: u64, l: &PyLayout) -> u32 {
    if l.gil_locked == 0 {
        return 0;
    }
    let base = if l.gil_in_interp != 0 {
        interp
    } else {
        // SAFETY: map values are valid for the duration of the program.
        match unsafe { PY_SAMPLE_PROCS.get(&pid) } {
            Some(p) => p.runtime,
            None => return 0,
        }
    };
    let locked = read::<i32>(base + u64::from(l.gil_locked));
    let holder = read::<u64>(base + u64::from(l.gil_holder));
    match (locked, holder) {
        (Some(locked), Some(holder)) if locked != 0 && holder == tstate => {
            sample_flag::GIL_KNOWN | sample_flag::GIL_HELD
        }
        (Some(_), Some(_)) => sample_flag::GIL_KNOWN,
        _ => 0,
    }
}

/// The thread state whose thread id is `want`, and the interpreter state whose thread list
/// holds it (the newest interpreter's: the main one unless subinterpreters were made).
fn thread_state(runtime: u64, layout: &PyLayout, want: u64) -> Option<(u64, u64)> {
    let interp: u64 = read(runtime + u64::from(layout.runtime_interpreters_head))?;
    let tstate: u64 = read(interp + u64::from(layout.interp_threads_head))?;
    let mut find = Find {
        layout,
        tstate,
        want,
        found: 0,
    };
    // SAFETY: `find_step` only touches `find`, which outlives the call.
    unsafe {
        bpf_loop(
            1024,
            find_step as *mut c_void,
            (&mut find as *mut Find).cast(),
            0,
        )
    };
    (find.found != 0).then_some((find.found, interp))
}

#[inline(never)]
extern "C" fn find_step(_: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `Find` that `thread_state` passed; the layout is a map value.
    let f = unsafe { &mut *ctx.cast::<Find>() };
    let l = unsafe { &*f.layout };
    if f.tstate == 0 {
        return 1;
    }
    match read::<u64>(f.tstate + u64::from(l.tstate_thread_id)) {
        Some(id) if id == f.want => {
            f.found = f.tstate;
            return 1;
        }
        Some(_) => {}
        None => return 1,
    }
    f.tstate = read(f.tstate + u64::from(l.tstate_next)).unwrap_or(0);
    0
}

struct Walk {
    ev: *mut SampleEvent,
    layout: *const PyLayout,
    frame: u64,
    depth: u32,
    failed: bool,
    /// The running asyncio task's coroutine frame (0: none), and 1 + its index once met.
    task_frame: u64,
    task_at: u32,
    /// 3.11–3.13 with `--asyncio`, the process (else 0): the running task is looked for in
    /// the walk, as the caller of the outermost coroutine frame (`coro_frame`, its index
    /// `task_at`), a coroutine's code told by its `co_flags` (at `code_flags`). Scalars, not
    /// the layout's pointer: a pointer read back from the caller's stack is no map value to
    /// the verifier.
    legacy_pid: u32,
    code_flags: u32,
    coro_frame: u64,
    /// The running task (0: none found).
    task: u64,
}

/// One frame: its code object, current instruction and run-start flags, then its caller.
/// `TASKS`: and, on 3.11–3.13 with `--asyncio`, the running task, compiled only into the
/// programs that walk tasks (the others' verification took up to 3.6 times as long).
#[inline(never)]
extern "C" fn walk_step<const TASKS: bool>(index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `Walk` that `python` passed; the layout is a map value.
    let w = unsafe { &mut *ctx.cast::<Walk>() };
    let l = unsafe { &*w.layout };
    if w.frame == 0 {
        return 1;
    }
    let Some(code) = read::<u64>(w.frame + u64::from(l.frame_code)).map(|e| l.code_of(e)) else {
        w.failed = true;
        return 1;
    };
    let (instr, mut flags) = if l.kind == py_kind::EVAL_ARG_FRAME {
        let lasti = read::<i32>(w.frame + u64::from(l.frame_instr)).unwrap_or(-1);
        (lasti as i64 as u64, PY_FRAME_ENTRY)
    } else {
        (
            read::<u64>(w.frame + u64::from(l.frame_instr)).unwrap_or(0),
            0,
        )
    };
    if l.frame_is_entry != 0 && read::<u8>(w.frame + u64::from(l.frame_is_entry)).unwrap_or(0) != 0
    {
        flags |= PY_FRAME_ENTRY;
    }
    if l.frame_owner != 0
        && read::<u8>(w.frame + u64::from(l.frame_owner))
            .is_some_and(|o| o >= PY_FRAME_OWNER_NOT_PYTHON)
    {
        flags |= PY_FRAME_SHIM;
    }
    let qualname = read::<u64>(code + u64::from(l.code_qualname)).unwrap_or(0);
    let filename = read::<u64>(code + u64::from(l.code_filename)).unwrap_or(0);
    // The depth is the loop's index, which the verifier knows only by its range: a count
    // kept in `w` is a constant on each pass, so it verified this body once per depth
    // (128 times; the sampling program went over the verifier's 1,000,000 instructions).
    let depth = (index as u32) & (SAMPLE_PY_DEPTH as u32 - 1);
    if w.frame == w.task_frame {
        w.task_at = depth + 1;
    }
    if TASKS && w.legacy_pid != 0 && w.task == 0 && flags & PY_FRAME_SHIM == 0 {
        let coroutine = tasks::is_coroutine(code, w.code_flags);
        if !coroutine && w.coro_frame != 0 {
            w.task = tasks::stepped_task(w.legacy_pid, w.frame, w.coro_frame);
        }
        if coroutine {
            (w.coro_frame, w.task_at) = (w.frame, depth + 1);
        } else {
            (w.coro_frame, w.task_at) = (0, if w.task != 0 { w.task_at } else { 0 });
        }
    }
    // SAFETY: `ev` is this CPU's record; `depth` is masked into the array.
    unsafe {
        (*w.ev).py[depth as usize] = PySampleFrame {
            code: code | flags,
            instr,
            names: py_names_id(qualname, filename),
        }
    };
    w.depth = depth + 1;
    w.frame = read(w.frame + u64::from(l.frame_previous)).unwrap_or(0);
    // `bpf_loop` stops after SAMPLE_PY_DEPTH passes.
    0
}

/// A process forked: the child's memory is a copy of the parent's, so its Python stacks are
/// read the same way from its first instruction (a CUDA launch right after the fork finds
/// its call site before the daemon could look at the child).
pub(crate) fn forked(parent: u32, child: u32) {
    // SAFETY: map values are valid for the duration of the program.
    if let Some(&proc) = unsafe { PY_SAMPLE_PROCS.get(&parent) } {
        let origin = if proc.origin != 0 {
            proc.origin
        } else {
            parent
        };
        let _ = PY_SAMPLE_PROCS.insert(&child, &PySampleProc { origin, ..proc }, 0);
    }
    // SAFETY: as above.
    if let Some(&a) = unsafe { PY_ASYNC_PROCS.get(&parent) } {
        let _ = PY_ASYNC_PROCS.insert(&child, &a, 0);
    }
}

/// The process `pid` was forked from whose memory it began as a copy of (0: none known).
pub(crate) fn origin(pid: u32) -> u32 {
    // SAFETY: as above.
    unsafe { PY_SAMPLE_PROCS.get(&pid) }.map_or(0, |p| p.origin)
}

/// A process exec'd or exited: the daemon must look at it afresh.
pub(crate) fn forget_process(pid: u32) {
    let _ = PY_SAMPLE_PROCS.remove(&pid);
    let _ = PY_ASYNC_PROCS.remove(&pid);
}
