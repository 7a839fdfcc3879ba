//! CUDA: uprobes on the runtime (libcudart) and driver (libcuda) entry points. Launches are
//! counted per (session, process, entry point, kernel handle, grid, block, shared memory,
//! stream); copies and allocations per kind; the calls that give kernel handles their names
//! send (handle, name) to user space once each, since launches carry only the handle.
//!
//! The attach cookie says which entry point a probe sits on (`cuda_api`), its session slot
//! and whether the session follows every process.

mod inproc;

use aya_ebpf::{
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        bpf_probe_read_kernel_str_bytes, bpf_probe_read_user, bpf_probe_read_user_str_bytes,
    },
    macros::{map, tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::{ProbeContext, RetProbeContext, TracePointContext},
    EbpfContext,
};
use tracer_common::{
    cuda_api as api, cuda_cookie, loss, py_from, py_kind, py_names_id, trace_kind, CudaLaunchKey,
    CudaMemKey, CudaMemStats, CudaNameEvent, CuptiKernel, GpuKernelKey, GpuKernelStats, PyLayout,
    SessionMask, TraceEvent, PY_FRAME_OWNER_NOT_PYTHON,
};

use crate::{
    sample::{python_thread, PyThread},
    shared::{count_loss, count_losses, TRACKED},
    trace,
};

#[map]
static CUDA_LAUNCHES: HashMap<CudaLaunchKey, u64> = HashMap::with_max_entries(65_536, 0);

#[map]
static CUDA_MEMORY: HashMap<CudaMemKey, CudaMemStats> = HashMap::with_max_entries(4_096, 0);

/// (pid | layer << 32 | session slot << 33, device pointer) → bytes, for the frees of
/// allocations seen. Per layer: `cudaMalloc` runs `cuMemAlloc` inside it, for the same
/// pointer; per session: each session's free probe finds its own record.
#[map]
static CUDA_ALLOCS: HashMap<[u64; 2], u64> = HashMap::with_max_entries(262_144, 0);

/// (thread, entry point | session slot << 16) → the arguments of a call whose result the
/// return probe reads. Keyed by entry point too: the runtime's calls run the driver's inside
/// them; and by session: each session's return probe takes its own (two sessions on one
/// process each see every allocation).
#[map]
static CUDA_PENDING: HashMap<[u32; 2], [u64; 2]> = HashMap::with_max_entries(16_384, 0);

/// GPU time per kernel, from CUPTI's records (tracer's injection library).
#[map]
static GPU_KERNELS: HashMap<GpuKernelKey, GpuKernelStats> = HashMap::with_max_entries(16_384, 0);

#[map]
static CUDA_NAMES: RingBuf = RingBuf::with_byte_size(1024 * 1024, 0);

/// [CUDA sessions' slots, those of them that follow every process]: whose executable file
/// mappings are announced, so that libraries mapped later are probed at once.
#[map]
static CUDA_WATCH: Array<[SessionMask; 2]> = Array::with_max_entries(1, 0);

/// Thread → [length, whether the file is a CUDA library] of the executable file mapping it
/// is making (between the mmap tracepoints). LRU: a thread killed inside mmap leaves its
/// entry behind.
#[map]
static CUDA_MMAPS: LruHashMap<u32, [u64; 2]> = LruHashMap::with_max_entries(4_096, 0);

/// `file.f_path.dentry` and `dentry.d_name.name`, patched in by the loader from the kernel's
/// BTF (`u32::MAX`: not known; then no process is held at a mapping).
#[no_mangle]
static FILE_NAME_OFFSETS: [u32; 2] = [u32::MAX; 2];

/// Thread → [runtime handle, return address, time, stack pointer] of a runtime launch that
/// just made a new row, for the driver launch it makes underneath (`ROW_LINK`). Written on
/// new rows only, so repeated launches pay nothing for it. LRU: entries of threads that
/// never reached the driver make room.
#[map]
static CUDA_NEW_ROWS: LruHashMap<u32, [u64; 4]> = LruHashMap::with_max_entries(4_096, 0);

/// The Python call site a runtime launch just read, for the driver launch it makes underneath
/// on the same thread, which then reads no Python memory of its own (the call site is the
/// same: no Python runs in between; reading it is ten or more reads of user memory a probe):
/// [thread, stack pointer, return address, time, code object, instruction, names id, whose].
/// Per CPU: a thread that moved between the two finds another's entry and reads its own.
#[map]
static CUDA_SITE_ABOVE: PerCpuArray<[u64; 8]> = PerCpuArray::with_max_entries(1, 0);

/// A driver launch belongs to the runtime launch that made a new row on its thread this
/// recently (the runtime's own work in between takes microseconds).
const LINK_WINDOW_NS: u64 = 1_000_000;

/// BPF_NOEXIST.
const NOEXIST: u64 = 1;
/// cudaMemcpyKind values are multiplied into `CudaMemKey::kind` above the entry point.
const MEMCPY_KIND_STEP: u32 = 100;

/// The probe's entry point, slot and cookie, if the current process is one its session
/// follows.
fn accepted<C: EbpfContext>(ctx: &C) -> Option<(u32, u32, u32, u64)> {
    // SAFETY: plain helper call on this program's context.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let pid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let slot = (cookie >> cuda_cookie::SLOT_SHIFT) as u32 & 63;
    if cookie & cuda_cookie::ALL == 0 {
        // SAFETY: map values are valid for the duration of the program.
        let followed = unsafe { TRACKED.get(&pid) }.copied().unwrap_or(0);
        if followed & (1 << slot) == 0 {
            return None;
        }
    }
    Some(((cookie & api::MASK) as u32, slot, pid, cookie))
}

fn user<T>(addr: u64) -> Option<T> {
    // SAFETY: bpf_probe_read_user copes with any address.
    unsafe { bpf_probe_read_user(addr as *const T) }.ok()
}

/// The six register arguments, read at once: the verifier rejects a context read at an
/// offset chosen at run time, which indexing into the registers would become.
fn args(ctx: &ProbeContext) -> [u64; 6] {
    // SAFETY: `regs` is this program's context; each field is read at a constant offset.
    unsafe {
        let r = ctx.regs;
        [(*r).rdi, (*r).rsi, (*r).rdx, (*r).rcx, (*r).r8, (*r).r9]
    }
}

#[uprobe]
pub fn tracer_cuda_call(ctx: ProbeContext) -> u32 {
    let _ = try_call(&ctx);
    0
}

fn try_call(ctx: &ProbeContext) -> Option<()> {
    let (which, slot, pid, cookie) = accepted(ctx)?;
    if api::is_kernel_launch(which) && inproc::in_process(pid, slot) {
        return None;
    }
    let a = args(ctx);
    let arg = |n: usize| a.get(n).copied();
    // SAFETY: `regs` is this program's context.
    let sp = unsafe { (*ctx.regs).rsp };
    let mut key = CudaLaunchKey {
        slot,
        pid,
        api: which,
        ..CudaLaunchKey::default()
    };
    match which {
        api::CU_LAUNCH => {
            // cuLaunchKernel(f, gridX, gridY, gridZ, blockX, blockY, blockZ, shmem, stream, …):
            // the return address and the three stack arguments above it in one read (one
            // helper call instead of four: this runs at every launch).
            let [caller, block_z, shmem, stream] = user::<[u64; 4]>(sp)?;
            key.func = arg(0)?;
            key.grid = [arg(1)? as u32, arg(2)? as u32, arg(3)? as u32];
            key.block = [arg(4)? as u32, arg(5)? as u32, block_z as u32];
            key.shared_mem = shmem as u32;
            key.stream = stream;
            key.caller = caller;
        }
        api::CU_LAUNCH_EX => {
            // cuLaunchKernelEx(const CUlaunchConfig *, f, …): 7 × u32, then hStream at 32.
            let config: u64 = arg(0)?;
            // The 7 dimensions, a hole, and hStream at 32, in one read.
            let c: [u32; 10] = user(config)?;
            key.func = arg(1)?;
            key.grid = [c[0], c[1], c[2]];
            key.block = [c[3], c[4], c[5]];
            key.shared_mem = c[6];
            key.stream = u64::from(c[8]) | u64::from(c[9]) << 32;
            key.caller = user::<u64>(sp).unwrap_or(0);
        }
        api::CUDA_LAUNCH => {
            // cudaLaunchKernel(func, dim3 grid, dim3 block, args, size_t shmem, stream): each
            // dim3 by value in two registers (x | y << 32, then z).
            // The return address and the two stack arguments above it, in one read.
            let [caller, shmem, stream] = user::<[u64; 3]>(sp)?;
            key.func = arg(0)?;
            let (gxy, gz, bxy, bz): (u64, u64, u64, u64) = (arg(1)?, arg(2)?, arg(3)?, arg(4)?);
            key.grid = [gxy as u32, (gxy >> 32) as u32, gz as u32];
            key.block = [bxy as u32, (bxy >> 32) as u32, bz as u32];
            key.shared_mem = shmem as u32;
            key.stream = stream;
            key.caller = caller;
        }
        api::CUDA_LAUNCH_EX => {
            // cudaLaunchKernelExC(const cudaLaunchConfig_t *, func, args): dim3 grid at 0,
            // dim3 block at 12, size_t shmem at 24, stream at 32.
            let config: u64 = arg(0)?;
            // Both dim3s, the shared memory and the stream, in one read.
            let c: [u32; 10] = user(config)?;
            key.func = arg(1)?;
            key.grid = [c[0], c[1], c[2]];
            key.block = [c[3], c[4], c[5]];
            key.shared_mem = c[6];
            key.stream = u64::from(c[8]) | u64::from(c[9]) << 32;
            key.caller = user::<u64>(sp).unwrap_or(0);
        }
        api::CU_GRAPH | api::CUDA_GRAPH => {
            key.func = arg(0)?;
            key.stream = arg(1)?;
            key.caller = user::<u64>(sp).unwrap_or(0);
        }
        _ => return memory_or_name(&a, which, slot, pid),
    }
    let tid = bpf_get_current_pid_tgid() as u32;
    // A driver launch inside a runtime launch takes the call site the runtime's probe read.
    let above =
        matches!(which, api::CU_LAUNCH | api::CU_LAUNCH_EX) && site_above(&mut key, tid, sp);
    if !above {
        if let Some((code, instr, names, from)) = call_site::<0>(pid) {
            (key.py_code, key.py_instr, key.py_names) = (code, instr, names);
            key.py_elsewhere = from;
            if matches!(which, api::CUDA_LAUNCH | api::CUDA_LAUNCH_EX) {
                note_site(&key, tid, sp);
            }
        }
    }
    if count_launch::<0>(&key) {
        link_rows(&key, tid, sp);
    }
    if cookie & cuda_cookie::STACKS != 0 {
        crate::sample::launch_stack(slot, pid, tid);
    }
    if trace::tracing(1 << slot) != 0 {
        trace(
            slot,
            pid,
            trace_kind::CUDA_LAUNCH,
            which,
            key.func,
            key.row_id(),
        );
    }
    Some(())
}

/// The probe points of tracer's CUPTI injection library: a program of their own, so that a
/// kernel record's stack space is not added to every launch's (the verifier sums the frames
/// of a call chain, at most 512 bytes).
#[uprobe]
pub fn tracer_cupti_call(ctx: ProbeContext) -> u32 {
    let _ = try_cupti(&ctx);
    0
}

fn try_cupti(ctx: &ProbeContext) -> Option<()> {
    let (which, slot, pid, _) = accepted(ctx)?;
    // SAFETY: `regs` is this program's context.
    let arg = unsafe { (*ctx.regs).rdi };
    match which {
        api::CUPTI_KERNEL => gpu_kernel(slot, pid, arg)?,
        api::CUPTI_DROPPED => count_losses(loss::CUPTI_RECORDS_DROPPED, arg),
        api::CUPTI_STATUS => send(pid, which, 0, 0, 0, arg),
        api::CUPTI_LAUNCH => inproc::launch_elsewhere(ctx, slot, pid, arg)?,
        api::CUPTI_ROW => inproc::new_row(ctx, slot, pid, arg)?,
        _ => {}
    }
    Some(())
}

/// A kernel's execution on the GPU, from CUPTI (on CUPTI's thread, at a buffer's completion):
/// its time added to the kernel's; its name sent once; a trace event for tracing sessions.
fn gpu_kernel(slot: u32, pid: u32, record: u64) -> Option<()> {
    let k: CuptiKernel = user(record)?;
    let ns = k.end_ns.saturating_sub(k.start_ns);
    let key = GpuKernelKey {
        slot,
        pid,
        name: k.name,
        device: k.device,
        grid: k.grid,
        block: k.block,
        _pad: 0,
    };
    let first = GpuKernelStats {
        executions: 1,
        total_ns: ns,
        min_ns: ns,
        max_ns: ns,
    };
    let added = add_or_insert(&GPU_KERNELS, &key, &first, |s| {
        // SAFETY: a live map value. Buffers may complete on several threads at once (CUDA 13
        // gives each thread its own): atomic sums; a racing min or max may keep the other value.
        unsafe {
            crate::python::add(&raw mut (*s).executions, 1);
            crate::python::add(&raw mut (*s).total_ns, ns);
            if ns < (*s).min_ns {
                (*s).min_ns = ns;
            }
            if ns > (*s).max_ns {
                (*s).max_ns = ns;
            }
        }
    });
    if added == Some(true) {
        send(pid, api::CUPTI_KERNEL, k.name, 0, 0, k.name);
    }
    trace_with(slot, || TraceEvent {
        kind: trace_kind::GPU_KERNEL,
        pid,
        start_ns: k.start_ns,
        end_ns: k.end_ns,
        a: k.name,
        b: u64::from(k.device) << 32 | u64::from(k.stream),
        ..TraceEvent::default()
    });
    Some(())
}

/// Adds to `key`'s value with `update`, or inserts `first` when it has none: whether that made
/// a new entry (None: the map is full, counted as a loss).
#[inline(always)]
fn add_or_insert<K, V>(
    map: &HashMap<K, V>,
    key: &K,
    first: &V,
    update: impl Fn(*mut V),
) -> Option<bool> {
    // Twice: another CPU may insert the key between the lookup and the insert.
    for _ in 0..2 {
        if let Some(v) = map.get_ptr_mut(key) {
            update(v);
            return Some(false);
        }
        if map.insert(key, first, NOEXIST).is_ok() {
            return Some(true);
        }
    }
    count_loss(loss::CUDA_MAP_FULL);
    None
}

/// A tracing session's event for this call, at this instant.
pub(super) fn trace(slot: u32, pid: u32, kind: u16, flags: u32, a: u64, b: u64) {
    trace_with(slot, || {
        // SAFETY: plain helper call.
        let now = unsafe { bpf_ktime_get_ns() };
        TraceEvent {
            kind,
            flags: flags as u16,
            pid,
            start_ns: now,
            end_ns: now,
            a,
            b,
            ..TraceEvent::default()
        }
    });
}

/// The event `event` makes, with this thread's id, for the slot's session if it is tracing
/// (made only then).
#[inline(always)]
fn trace_with(slot: u32, event: impl FnOnce() -> TraceEvent) {
    let traced = trace::tracing(1 << slot);
    if traced == 0 {
        return;
    }
    trace::emit(&TraceEvent {
        tid: bpf_get_current_pid_tgid() as u32,
        sessions: traced,
        ..event()
    });
}

/// The launching thread's innermost Python frame (code object, instruction, names id), and
/// whose it is (`py_from`): a thread running no Python (no thread state, or one with no
/// frame) is given the frame of the thread it most likely works for
/// ([`crate::sample::works_for`]). `C`: one copy per calling program, each with one caller,
/// so the compiler lays the launch program out as if it alone called it (shared, it would
/// become a function whose frame adds to the launch program's, over the stack budget).
fn call_site<const C: u8>(pid: u32) -> Option<(u64, u64, u64, u32)> {
    let (me, own) = match python_thread(pid) {
        PyThread::Found(tstate, l, _) => (tstate, innermost(tstate, l).map(|f| (f, l))),
        PyThread::NoThread => (0, None),
        _ => return None,
    };
    let (frame, l, from) = match own {
        Some((frame, l)) => {
            crate::sample::launched_from_python(pid, me, l);
            (frame, l, py_from::OWN)
        }
        None => {
            let (_, frame, l, from) = crate::sample::works_for(pid, me)?;
            (past_shim(frame, l)?, l, from)
        }
    };
    let (code, instr, names) = frame_site(frame, l)?;
    Some((code, instr, names, from))
}

/// A runtime launch's call site, for the driver launch it makes underneath
/// (`CUDA_SITE_ABOVE`). Field by field: the launch program's stack is near the verifier's
/// limit.
#[inline(always)]
fn note_site(key: &CudaLaunchKey, tid: u32, sp: u64) {
    let Some(e) = CUDA_SITE_ABOVE.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's entry, valid for the program's duration; a probe is not preempted
    // by another on its CPU.
    unsafe {
        (*e)[0] = u64::from(tid);
        (*e)[1] = sp;
        (*e)[2] = key.caller;
        (*e)[3] = bpf_ktime_get_ns();
        (*e)[4] = key.py_code;
        (*e)[5] = key.py_instr;
        (*e)[6] = key.py_names;
        (*e)[7] = u64::from(key.py_elsewhere);
    }
}

/// Gives `key` the call site that the runtime launch this driver launch is made in read
/// (`note_site`): the same thread, deeper on the stack, moments later, the runtime call's
/// return address still in place (not a driver call made after a runtime launch that
/// returned). Taken once. Whether it did.
#[inline(always)]
fn site_above(key: &mut CudaLaunchKey, tid: u32, sp: u64) -> bool {
    let Some(e) = CUDA_SITE_ABOVE.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's entry, valid for the program's duration.
    unsafe {
        if (*e)[0] != u64::from(tid) || sp >= (*e)[1] {
            return false;
        }
        // Taken, so that a later driver call on this thread reads its own.
        (*e)[0] = 0;
        if bpf_ktime_get_ns().wrapping_sub((*e)[3]) >= LINK_WINDOW_NS
            || user::<u64>((*e)[1]) != Some((*e)[2])
        {
            return false;
        }
        key.py_code = (*e)[4];
        key.py_instr = (*e)[5];
        key.py_names = (*e)[6];
        key.py_elsewhere = (*e)[7] as u32;
    }
    true
}

/// The innermost Python frame of the thread whose state is `tstate`; None when it runs none.
fn innermost(tstate: u64, l: &PyLayout) -> Option<u64> {
    past_shim(crate::python::current_frame_quiet(tstate, l).ok()?, l)
}

/// `frame`, or on 3.12+ where it is a C-stack shim on top (C code called back into Python),
/// its caller; None for no frame.
fn past_shim(mut frame: u64, l: &PyLayout) -> Option<u64> {
    if frame != 0
        && l.frame_owner != 0
        && user::<u8>(frame + u64::from(l.frame_owner))
            .is_some_and(|o| o >= PY_FRAME_OWNER_NOT_PYTHON)
    {
        frame = user(frame + u64::from(l.frame_previous))?;
    }
    (frame != 0).then_some(frame)
}

/// A frame's code object, current instruction and names id.
fn frame_site(frame: u64, l: &PyLayout) -> Option<(u64, u64, u64)> {
    let code = l.code_of(user(frame + u64::from(l.frame_code))?);
    let instr = if l.kind == py_kind::EVAL_ARG_FRAME {
        user::<i32>(frame + u64::from(l.frame_instr)).unwrap_or(-1) as i64 as u64
    } else {
        user::<u64>(frame + u64::from(l.frame_instr)).unwrap_or(0)
    };
    let qualname: u64 = user(code + u64::from(l.code_qualname))?;
    let filename: u64 = user(code + u64::from(l.code_filename))?;
    Some((code, instr, py_names_id(qualname, filename)))
}

/// Counts a launch; whether it made a new row. `C`: as for [`call_site`].
fn count_launch<const C: u8>(key: &CudaLaunchKey) -> bool {
    let new = add_or_insert(&CUDA_LAUNCHES, key, &1, |n| crate::python::add(n, 1)) == Some(true);
    if new {
        announce_row(key);
    }
    new
}

/// A new row's call site and caller, named while its process lives.
#[inline(always)]
fn announce_row(key: &CudaLaunchKey) {
    {
        if key.py_code != 0 {
            let origin = crate::sample::origin(key.pid);
            send_from(
                key.pid,
                api::CALL_SITE,
                key.py_code,
                key.py_instr,
                key.py_names,
                0,
                origin,
            );
        }
        send(
            key.pid,
            api::LAUNCH_ROW,
            key.func,
            key.caller,
            u64::from(key.api),
            0,
        );
    }
}

/// A new runtime row is noted for its thread; a new driver row made inside it (deeper on the
/// same stack, moments later, the runtime's return address intact: not a call the program
/// made after the runtime's returned) is linked to it.
fn link_rows(key: &CudaLaunchKey, tid: u32, sp: u64) {
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    match key.api {
        api::CUDA_LAUNCH | api::CUDA_LAUNCH_EX => {
            let _ = CUDA_NEW_ROWS.insert(&tid, &[key.func, key.caller, now, sp], 0);
        }
        api::CU_LAUNCH | api::CU_LAUNCH_EX => {
            // SAFETY: map values are valid for the duration of the program.
            let Some([func, caller, at, outer_sp]) = (unsafe { CUDA_NEW_ROWS.get(&tid) }).copied()
            else {
                return;
            };
            let _ = CUDA_NEW_ROWS.remove(&tid);
            // Inside the runtime's call its return address is still where its entry found
            // it; a driver call the program makes after a refused runtime launch (one that
            // passes more arguments on the stack, so deeper) has written its own there.
            if sp < outer_sp
                && now.wrapping_sub(at) < LINK_WINDOW_NS
                && user::<u64>(outer_sp) == Some(caller)
            {
                send(key.pid, api::ROW_LINK, key.func, func, caller, 0);
            }
        }
        _ => {}
    }
}

/// A record for user space on `CUDA_NAMES`: `which` says what the three words are; `name`
/// is a user string to copy in (0: none). A mapped library wakes the reader at once, to be
/// probed before the process gets far.
#[inline(always)]
fn send(pid: u32, which: u32, handle: u64, other: u64, extra: u64, name: u64) {
    send_from(pid, which, handle, other, extra, name, 0);
}

/// `send`, with the process `origin` the event's addresses may be read in too. False when
/// the ring was full (counted as a loss).
fn send_from(
    pid: u32,
    which: u32,
    handle: u64,
    other: u64,
    extra: u64,
    name: u64,
    origin: u32,
) -> bool {
    const BPF_RB_FORCE_WAKEUP: u64 = 2;
    let Some(mut entry) = CUDA_NAMES.reserve::<CudaNameEvent>(0) else {
        count_loss(loss::CUDA_NAMES_RINGBUF_FULL);
        return false;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points to the reserved record, filled before it is submitted.
    unsafe {
        (*ev).pid = pid;
        (*ev).api = which;
        (*ev).handle = handle;
        (*ev).other = other;
        (*ev).extra = extra;
        (*ev).origin = origin;
        (*ev)._pad = 0;
        (*ev).name[0] = 0;
        if name != 0 {
            let _ = bpf_probe_read_user_str_bytes(name as *const u8, &mut (*ev).name);
        }
    }
    entry.submit(if which == api::LIBRARY_MAPPED {
        BPF_RB_FORCE_WAKEUP
    } else {
        0
    });
    true
}

/// `syscalls:sys_enter_mmap` (`unsigned long` arguments from offset 16: addr, len, prot,
/// flags, fd, off): notes an executable file mapping by a process a CUDA session watches.
#[tracepoint]
pub fn tracer_cuda_mmap_enter(ctx: TracePointContext) -> u32 {
    let _ = try_mmap_enter(&ctx);
    0
}

fn try_mmap_enter(ctx: &TracePointContext) -> Option<()> {
    const PROT_EXEC: u64 = 4;
    let [slots, all] = *CUDA_WATCH.get(0)?;
    if slots == 0 {
        return None;
    }
    // SAFETY (each): fixed offsets of the syscall tracepoint's record.
    let len = unsafe { ctx.read_at::<u64>(24) }.ok()?;
    let prot = unsafe { ctx.read_at::<u64>(32) }.ok()?;
    let fd = unsafe { ctx.read_at::<u64>(48) }.ok()?;
    if prot & PROT_EXEC == 0 || (fd as i32) < 0 {
        return None;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    if all == 0 {
        // SAFETY: map values are valid for the duration of the program.
        let followed = unsafe { TRACKED.get(&((pid_tgid >> 32) as u32)) }
            .copied()
            .unwrap_or(0);
        if followed & slots == 0 {
            return None;
        }
    }
    let cuda = u64::from(cuda_library(fd));
    CUDA_MMAPS.insert(&(pid_tgid as u32), &[len, cuda], 0).ok()
}

/// Whether the current thread's `fd` is a CUDA library whose launches the probes count:
/// `libcudart.so*` or `libcuda.so*` (the names `tracer_inspect::cuda::library` probes).
fn cuda_library(fd: u64) -> bool {
    // SAFETY: reading a plain static the loader patched.
    let off = |i: usize| unsafe { core::ptr::read_volatile(FILE_NAME_OFFSETS.as_ptr().add(i)) };
    let (dentry_off, name_off) = (off(0), off(1));
    if dentry_off == u32::MAX || name_off == u32::MAX {
        return false;
    }
    let name = (|| {
        let file = crate::offcpu::fd_file(fd)?;
        let dentry = crate::offcpu::kernel_word(file + u64::from(dentry_off))?;
        crate::offcpu::kernel_word(dentry + u64::from(name_off))
    })();
    let Some(name) = name else {
        return false;
    };
    let mut buf = [0u8; 16];
    // SAFETY: a probe read into a stack buffer, which fails cleanly on a bad address.
    if unsafe { bpf_probe_read_kernel_str_bytes(name as *const u8, &mut buf) }.is_err() {
        return false;
    }
    buf.starts_with(b"libcudart.so") || buf.starts_with(b"libcuda.so")
}

/// `syscalls:sys_exit_mmap` (`long ret` at 16): the mapping noted at the entry exists now;
/// user space is woken at once to look at it.
#[tracepoint]
pub fn tracer_cuda_mmap_exit(ctx: TracePointContext) -> u32 {
    let _ = try_mmap_exit(&ctx);
    0
}

fn try_mmap_exit(ctx: &TracePointContext) -> Option<()> {
    if CUDA_WATCH.get(0)?[0] == 0 {
        return None;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    // SAFETY: map values are valid for the duration of the program.
    let [len, cuda] = unsafe { CUDA_MMAPS.get(&tid) }.copied()?;
    let _ = CUDA_MMAPS.remove(&tid);
    // SAFETY: fixed offset of the syscall tracepoint's record.
    let ret = unsafe { ctx.read_at::<i64>(16) }.ok()?;
    if (-4095..0).contains(&ret) {
        return None;
    }
    let tgid = (pid_tgid >> 32) as u32;
    // A CUDA library is probed before the process goes on, or its first launches would
    // be neither counted nor known to be missed: it stops on its way back from mmap until
    // the daemon has attached the library's probes and continues it.
    // SAFETY: plain BPF helper call.
    let held = cuda != 0 && crate::proc::hold(tgid, unsafe { bpf_ktime_get_ns() });
    let sent = send_from(
        tgid,
        api::LIBRARY_MAPPED,
        ret as u64,
        len,
        u64::from(held),
        0,
        0,
    );
    if held && !sent {
        crate::proc::unhold(tgid);
    }
    Some(())
}

/// Inlined: out of line, its frame came on top of the launch program's whole frame (the
/// verifier sums a chain's frames: 480 of 512 bytes, over `cargo xtask verifier`'s 448);
/// inlined, its locals share the stack slots of the launch's, which are dead on this path.
#[inline(always)]
fn add_memory(slot: u32, pid: u32, kind: u32, bytes: u64) {
    trace(slot, pid, trace_kind::CUDA_MEMORY, kind, bytes, 0);
    let key = CudaMemKey {
        slot,
        pid,
        kind,
        _pad: 0,
    };
    add_or_insert(&CUDA_MEMORY, &key, &CudaMemStats { calls: 1, bytes }, |s| {
        // SAFETY: a live map value.
        unsafe {
            crate::python::add(&raw mut (*s).calls, 1);
            crate::python::add(&raw mut (*s).bytes, bytes);
        }
    });
}

fn memory_or_name(a: &[u64; 6], which: u32, slot: u32, pid: u32) -> Option<()> {
    let arg = |n: usize| a.get(n).copied();
    let tid = bpf_get_current_pid_tgid() as u32;
    match which {
        // cudaMemcpy(dst, src, count, kind), cudaMemcpyAsync(…, kind, stream).
        api::CUDA_MEMCPY | api::CUDA_MEMCPY_ASYNC => {
            let kind = (arg(3)? as u32).min(9);
            add_memory(slot, pid, which + MEMCPY_KIND_STEP * kind, arg(2)?);
        }
        // cuMemcpyHtoD(dst, src, bytes), cuMemcpyDtoH(dst, src, bytes).
        api::CU_MEMCPY_HTOD | api::CU_MEMCPY_DTOH => add_memory(slot, pid, which, arg(2)?),
        api::CUDA_DEVICE_SYNCHRONIZE | api::CUDA_STREAM_SYNCHRONIZE => {
            add_memory(slot, pid, which, 0)
        }
        api::CUDA_FREE | api::CU_MEM_FREE => {
            let ptr: u64 = arg(0)?;
            let key = [alloc_owner(slot, pid, which), ptr];
            // SAFETY: map values are valid for the duration of the program.
            let bytes = unsafe { CUDA_ALLOCS.get(&key) }.copied().unwrap_or(0);
            let _ = CUDA_ALLOCS.remove(&key);
            if ptr != 0 {
                add_memory(slot, pid, which, bytes);
            }
        }
        // Read at the return: the handle or pointer the call writes through its first argument.
        api::CUDA_MALLOC
        | api::CU_MEM_ALLOC
        | api::CU_MODULE_GET_FUNCTION
        | api::CU_LIBRARY_GET_KERNEL
        | api::CU_KERNEL_GET_FUNCTION
        | api::CUDA_GET_KERNEL
        | api::CUDA_GET_FUNC_BY_SYMBOL => {
            // The size; the kernel or host stub; or the name (still the caller's at return).
            let third = match which {
                api::CU_MODULE_GET_FUNCTION | api::CU_LIBRARY_GET_KERNEL => arg(2)?,
                _ => arg(1)?,
            };
            let _ = CUDA_PENDING.insert(&[tid, which | slot << 16], &[arg(0)?, third], 0);
        }
        // __cudaRegisterFunction(module, host_stub, device_fun, device_name, …).
        api::CUDA_REGISTER_FUNCTION => send(pid, which, arg(1)?, 0, 0, arg(3)?),
        _ => {}
    }
    Some(())
}

/// The return of a call recorded in `CUDA_PENDING`: on success, what it wrote.
#[uretprobe]
pub fn tracer_cuda_return(ctx: RetProbeContext) -> u32 {
    let _ = try_return(&ctx);
    0
}

fn try_return(ctx: &RetProbeContext) -> Option<()> {
    let (which, slot, pid, _) = accepted(ctx)?;
    let key = [bpf_get_current_pid_tgid() as u32, which | slot << 16];
    // SAFETY: map values are valid for the duration of the program.
    let [out, extra] = unsafe { CUDA_PENDING.get(&key) }.copied()?;
    let _ = CUDA_PENDING.remove(&key);
    let result: u64 = ctx.ret();
    if result as u32 != 0 {
        return Some(());
    }
    let handle: u64 = user(out)?;
    match which {
        api::CUDA_MALLOC | api::CU_MEM_ALLOC => {
            let _ = CUDA_ALLOCS.insert(&[alloc_owner(slot, pid, which), handle], &extra, 0);
            add_memory(slot, pid, which, extra);
        }
        api::CU_MODULE_GET_FUNCTION | api::CU_LIBRARY_GET_KERNEL => {
            send(pid, which, handle, 0, 0, extra)
        }
        _ => send(pid, which, handle, extra, 0, 0),
    }
    Some(())
}

/// The first half of a `CUDA_ALLOCS` key: the process, whether the driver's calls made it, and
/// the session (each session's free finds its own record of the allocation).
fn alloc_owner(slot: u32, pid: u32, which: u32) -> u64 {
    let driver = matches!(which, api::CU_MEM_ALLOC | api::CU_MEM_FREE);
    u64::from(pid) | u64::from(driver) << 32 | u64::from(slot) << 33
}
