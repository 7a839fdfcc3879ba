//! The signal frame a loading thread returns through: `dlopen` returns to the C library's
//! signal restorer (`mov $15, %rax; syscall`: `rt_sigreturn`), which puts the thread back from
//! this frame — every general register, the FPU/SSE/AVX state, the signal mask — whether
//! tracerd is still there to watch or was killed mid-call. The thread never depends on
//! tracerd to be made whole.
//!
//! Layout (x86-64 kernel ABI): `struct rt_sigframe { pretcode; struct ucontext uc; siginfo }`,
//! `pretcode` being the return address `dlopen` pops; the XSAVE area it names follows,
//! 64-byte aligned, then the library's path.

use libc::user_regs_struct;

/// `struct ucontext`: flags, link, `stack_t` (24 bytes), `struct sigcontext` (256), mask (8).
const UCONTEXT: usize = 8 + 8 + 24 + 256 + 8;
/// pretcode + ucontext + siginfo (128).
const FRAME: usize = 8 + UCONTEXT + 128;
/// `UC_FP_XSTATE | UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS`: the stack segment is taken as is.
const UC_FLAGS: u64 = 0x1 | 0x2 | 0x4;
/// An `ss_flags` the kernel rejects, so that `rt_sigreturn` leaves the alternate signal
/// stack as the thread set it (its error is ignored there).
const ALTSTACK_UNCHANGED: u32 = 0x10;
const FP_XSTATE_MAGIC1: u32 = 0x4650_5853;
const FP_XSTATE_MAGIC2: u32 = 0x4650_5845;
/// Where the legacy area's software-reserved bytes are, and the XSAVE header.
const SW_RESERVED: usize = 464;
const XSAVE_HEADER: usize = 512;
/// The legacy area plus the header: the least an XSAVE area may be.
const MIN_XSTATE: usize = 576;
/// `-ERESTARTSYS` … `-ERESTART_RESTARTBLOCK`.
pub(super) const RESTART_CODES: [i64; 4] = [-512, -513, -514, -516];

/// The bytes to write at `base` on the thread's stack.
pub(super) struct Frame {
    pub base: u64,
    pub bytes: Vec<u8>,
    /// Where the path is, and where `dlopen`'s return address is (its stack pointer at entry).
    pub path_at: u64,
    pub ret_at: u64,
}

/// The frame that resumes `resume` (with signal mask `mask` and XSAVE state `xstate`, as
/// `PTRACE_GETREGSET NT_X86_XSTATE` gives it), laid out below `top`, with `path`
/// (NUL-terminated here) for `dlopen` and `restorer` as the return address.
pub(super) fn build(
    resume: &user_regs_struct,
    mask: u64,
    xstate: &[u8],
    top: u64,
    path: &str,
    restorer: u64,
) -> Result<Frame, String> {
    if xstate.len() < MIN_XSTATE {
        return Err(format!("an XSAVE area of {} bytes", xstate.len()));
    }
    let mut p = path.as_bytes().to_vec();
    p.push(0);
    let path_at = (top & !15) - ((p.len() as u64 + 15) & !15);
    let xs = signal_xstate(xstate);
    let xs_at = (path_at - xs.len() as u64) & !63;
    let ret_at = ((xs_at - FRAME as u64) & !15) - 8;
    let mut bytes = vec![0u8; (top - ret_at) as usize];
    let at = |addr: u64| (addr - ret_at) as usize;
    bytes[at(path_at)..at(path_at) + p.len()].copy_from_slice(&p);
    bytes[at(xs_at)..at(xs_at) + xs.len()].copy_from_slice(&xs);
    let mut w = Writer(&mut bytes, 0);
    w.u64(restorer);
    // ucontext: flags, link, stack_t {ss_sp, ss_flags, ss_size}.
    w.u64(UC_FLAGS);
    w.u64(0);
    w.u64(0);
    w.u64(u64::from(ALTSTACK_UNCHANGED));
    w.u64(0);
    let r = restarted(resume);
    for v in [
        r.r8, r.r9, r.r10, r.r11, r.r12, r.r13, r.r14, r.r15, r.rdi, r.rsi, r.rbp, r.rbx, r.rdx,
        r.rax, r.rcx, r.rsp, r.rip, r.eflags,
    ] {
        w.u64(v);
    }
    // cs, gs, fs, ss (16 bits each): fs and gs are not restored on x86-64.
    w.u64((r.cs & 0xffff) | ((r.ss & 0xffff) << 48));
    // err, trapno, oldmask, cr2, then the XSAVE area's address.
    for v in [0, 0, 0, 0, xs_at] {
        w.u64(v);
    }
    w.1 = 8 + UCONTEXT - 8;
    w.u64(mask);
    Ok(Frame {
        base: ret_at,
        bytes,
        path_at,
        ret_at,
    })
}

/// What a thread stopped in a system call resumes with when no kernel restarts the call: the
/// kernel's own restart, done by hand (back to the `syscall` instruction, its number in rax).
/// `-ERESTART_RESTARTBLOCK`'s call (a relative sleep) is made again from the start, as
/// `rt_sigreturn` cancels the kernel's record of the time left.
fn restarted(r: &user_regs_struct) -> user_regs_struct {
    let mut out = *r;
    if r.orig_rax as i64 >= 0 && RESTART_CODES.contains(&(r.rax as i64)) {
        out.rax = r.orig_rax;
        out.rip -= 2;
    }
    out
}

/// `xstate` as a signal frame's: the software-reserved bytes say how big it is and which
/// components it holds, and the second magic number ends it.
fn signal_xstate(xstate: &[u8]) -> Vec<u8> {
    let in_use =
        u64::from_le_bytes(xstate[XSAVE_HEADER..XSAVE_HEADER + 8].try_into().unwrap()) | 0b11;
    let size = used_size(in_use).clamp(MIN_XSTATE, xstate.len());
    let mut out = xstate[..size].to_vec();
    out.extend_from_slice(&FP_XSTATE_MAGIC2.to_le_bytes());
    let mut w = Writer(&mut out, SW_RESERVED);
    // struct _fpx_sw_bytes: magic1, extended_size, xfeatures, xstate_size, padding.
    w.u32(FP_XSTATE_MAGIC1);
    w.u32(size as u32 + 4);
    w.u64(in_use);
    w.u32(size as u32);
    for _ in 0..7 {
        w.u32(0);
    }
    out
}

/// The standard-format XSAVE area's size up to the last component in `features`: CPUID leaf
/// 0xD names each component's offset and size.
fn used_size(features: u64) -> usize {
    let mut end = MIN_XSTATE;
    for i in 2..63 {
        if features & (1u64 << i) != 0 {
            #[cfg(target_arch = "x86_64")]
            {
                // SAFETY: CPUID leaf 0xD exists wherever XSAVE does, which NT_X86_XSTATE needs.
                #[allow(unused_unsafe)]
                let c = unsafe { std::arch::x86_64::__cpuid_count(0xd, i) };
                end = end.max(c.ebx as usize + c.eax as usize);
            }
        }
    }
    end
}

/// Little-endian fields written from an offset on.
struct Writer<'a>(&'a mut Vec<u8>, usize);

impl Writer<'_> {
    fn u64(&mut self, v: u64) {
        self.0[self.1..self.1 + 8].copy_from_slice(&v.to_le_bytes());
        self.1 += 8;
    }

    fn u32(&mut self, v: u32) {
        self.0[self.1..self.1 + 4].copy_from_slice(&v.to_le_bytes());
        self.1 += 4;
    }
}
