//! Real unwinds: of this test process, its threads, signal frames and a Python process.

use std::{
    arch::asm,
    fs,
    hint::black_box,
    ops::Range,
    sync::{
        atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering},
        OnceLock,
    },
};

use super::*;

/// The instruction pointer, stack pointer and frame pointer where the macro stands.
macro_rules! regs_here {
    () => {{
        let (ip, sp, bp): (u64, u64, u64);
        // SAFETY: only reads registers.
        #[allow(unused_unsafe)]
        unsafe {
            asm!(
                "lea {ip}, [rip]",
                "mov {sp}, rsp",
                "mov {bp}, rbp",
                ip = out(reg) ip,
                sp = out(reg) sp,
                bp = out(reg) bp,
                options(nomem, nostack, preserves_flags),
            );
        }
        Regs { ip, sp, bp }
    }};
}

/// Registers and stack bytes captured inside a function, as the BPF program would.
struct Capture {
    regs: Regs,
    stack: Vec<u8>,
}

/// End of the mapping holding `addr` (the thread's stack), from /proc/self/maps directly.
fn mapping_end(addr: u64) -> u64 {
    let maps = fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| {
            let (s, e) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                u64::from_str_radix(s, 16).ok()?,
                u64::from_str_radix(e, 16).ok()?,
            ))
        })
        .find(|&(s, e)| s <= addr && addr < e)
        .map(|(_, e)| e)
        .expect("stack mapping")
}

#[inline(never)]
fn unwind_test_chain_c(max_copy: usize) -> Capture {
    let here = 0u8;
    let top = mapping_end(&here as *const u8 as u64);
    let Regs { ip, sp, bp } = regs_here!();
    let len = max_copy.min((top - sp) as usize);
    let mut stack = vec![0u8; len];
    // SAFETY: [sp, top) is this thread's mapped stack; the frames above sp are live and
    // do not change while we copy (our own calls use memory below sp).
    unsafe { std::ptr::copy_nonoverlapping(sp as *const u8, stack.as_mut_ptr(), len) };
    Capture {
        regs: Regs { ip, sp, bp },
        stack,
    }
}

// Each caller does work after the call, so the call is not a tail call and its return
// address lies inside the caller.
#[inline(never)]
fn unwind_test_chain_b(max_copy: usize) -> Capture {
    let c = unwind_test_chain_c(black_box(max_copy));
    black_box(&c);
    c
}

#[inline(never)]
fn unwind_test_chain_a(max_copy: usize) -> Capture {
    let c = unwind_test_chain_b(black_box(max_copy));
    black_box(&c);
    c
}

/// The range of process addresses of the function starting at `f`, from the executable's
/// symbol table (independent of the CFI under test).
fn function_range(f: usize) -> Range<u64> {
    static SYMBOLS: OnceLock<(u64, Vec<(u64, u64)>)> = OnceLock::new();
    let (bias, symbols) = SYMBOLS.get_or_init(|| {
        let data = fs::read("/proc/self/exe").unwrap();
        let file = object::File::parse(&*data).unwrap();
        use object::ObjectSymbol;
        let symbols = file
            .symbols()
            .filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 0)
            .map(|s| (s.address(), s.size()))
            .collect();
        (executable_load_bias(), symbols)
    });
    let svma = f as u64 - bias;
    let &(start, size) = symbols
        .iter()
        .find(|(a, _)| *a == svma)
        .expect("symbol of function");
    start + bias..start + bias + size
}

fn executable_load_bias() -> u64 {
    unsafe extern "C" fn first(
        info: *mut libc::dl_phdr_info,
        _: usize,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader passes a valid info; data is our &mut u64.
        unsafe { *(data as *mut u64) = (*info).dlpi_addr };
        1 // the executable comes first: stop
    }
    let mut bias = 0u64;
    // SAFETY: the callback only writes through the pointer we pass.
    unsafe { libc::dl_iterate_phdr(Some(first), &mut bias as *mut u64 as *mut libc::c_void) };
    bias
}

fn unwind_capture(c: &Capture) -> Unwound {
    let maps = ProcMaps::read(std::process::id()).unwrap();
    Unwinder::new().unwind(std::process::id(), &maps, c.regs, &c.stack, 128)
}

fn describe(frames: &[u64]) -> String {
    let maps = ProcMaps::read(std::process::id()).unwrap();
    frames
        .iter()
        .map(|&a| match maps.find(a.saturating_sub(1)) {
            Some(e) => format!("{a:#x} {}+{:#x}", e.path, a - e.start + e.offset),
            None => format!("{a:#x} ?"),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
#[inline(never)]
fn unwinds_own_call_chain() {
    let capture = unwind_test_chain_a(black_box(256 * 1024));
    black_box(&capture);
    let u = unwind_capture(&capture);
    let f = &u.frames;
    let trace = describe(f);
    assert!(f.len() > 4, "{u:?}\n{trace}");
    assert!(
        function_range(unwind_test_chain_c as *const () as usize).contains(&f[0]),
        "{trace}"
    );
    assert!(
        function_range(unwind_test_chain_b as *const () as usize).contains(&(f[1] - 1)),
        "{trace}"
    );
    assert!(
        function_range(unwind_test_chain_a as *const () as usize).contains(&(f[2] - 1)),
        "{trace}"
    );
    let test_fn = function_range(unwinds_own_call_chain as *const () as usize);
    assert!(test_fn.contains(&(f[3] - 1)), "{trace}");
    // libtest runs tests on threads of its own: with the whole stack, the walk reaches
    // the thread's start.
    assert_eq!(u.end, End::Root, "{trace}");
}

#[test]
fn thread_unwinds_to_root() {
    let capture = std::thread::spawn(|| unwind_test_chain_a(256 * 1024))
        .join()
        .unwrap();
    let u = unwind_capture(&capture);
    let trace = describe(&u.frames);
    assert_eq!(u.end, End::Root, "{trace}");
    assert!(u.frames.len() > 4, "{trace}");
    assert!(function_range(unwind_test_chain_b as *const () as usize).contains(&(u.frames[1] - 1)));
    // The outermost frame is glibc's thread start (clone3's CFI ends the stack).
    let maps = ProcMaps::read(std::process::id()).unwrap();
    let last = maps.find(u.frames.last().unwrap() - 1).unwrap();
    assert!(last.path.contains("libc"), "{trace}");
}

/// Binaries unused over a few trims go; one used between trims stays, and unwinds the same.
#[test]
fn trim_drops_binaries_no_longer_used() {
    let capture = unwind_test_chain_a(black_box(256 * 1024));
    let maps = ProcMaps::read(std::process::id()).unwrap();
    let pid = std::process::id();
    let mut unwinder = Unwinder::new();
    let full = unwinder.unwind(pid, &maps, capture.regs, &capture.stack, 128);
    let cached = unwinder.cached_binaries();
    assert!(cached >= 2, "the test binary and libc: {cached}");
    for _ in 0..10 {
        unwinder.trim();
        assert_eq!(
            unwinder.unwind(pid, &maps, capture.regs, &capture.stack, 128),
            full
        );
    }
    assert_eq!(unwinder.cached_binaries(), cached);
    for _ in 0..KEEP_GENERATIONS {
        assert_eq!(unwinder.cached_binaries(), cached);
        unwinder.trim();
    }
    assert_eq!(unwinder.cached_binaries(), 0);
    assert_eq!(unwinder.bytes, 0);
    assert_eq!(
        unwinder.unwind(pid, &maps, capture.regs, &capture.stack, 128),
        full
    );
}

#[test]
fn short_copy_and_frame_limit() {
    let capture = unwind_test_chain_a(black_box(256 * 1024));
    let maps = ProcMaps::read(std::process::id()).unwrap();
    let mut unwinder = Unwinder::new();
    let pid = std::process::id();
    let full = unwinder.unwind(pid, &maps, capture.regs, &capture.stack, 128);
    assert_eq!(full.end, End::Root);

    let short = unwinder.unwind(pid, &maps, capture.regs, &capture.stack[..64], 128);
    assert_eq!(short.end, End::StackCopyExhausted);
    assert_eq!(short.frames[..], full.frames[..short.frames.len()]);

    let limited = unwinder.unwind(pid, &maps, capture.regs, &capture.stack, 3);
    assert_eq!(limited.end, End::MaxFrames);
    assert_eq!(limited.frames[..], full.frames[..3]);
    // Exactly as many frames as the stack has: complete, not cut.
    let exact = unwinder.unwind(pid, &maps, capture.regs, &capture.stack, full.frames.len());
    assert_eq!(exact, full);

    let unmapped = Regs {
        ip: 0x10,
        ..capture.regs
    };
    let u = unwinder.unwind(pid, &maps, unmapped, &capture.stack, 128);
    assert_eq!(u.end, End::UnmappedAddress(0x10));
    assert_eq!(u.frames, vec![0x10]);
}

#[test]
fn fde_index_matches_eh_frame_hdr() {
    let data = fs::read("/proc/self/exe").unwrap();
    let with_hdr = Binary::parse_with(&*data, true).ok().unwrap();
    let indexed = Binary::parse_with(&*data, false).ok().unwrap();
    assert!(!with_hdr.eh_frame_hdr.is_empty() && with_hdr.index.is_empty());
    assert!(indexed.eh_frame_hdr.is_empty() && indexed.index.len() > 100);
    let bias = executable_load_bias();
    let probes = [
        unwind_test_chain_a as *const () as u64,
        unwind_test_chain_c as *const () as u64 + 5,
        fde_index_matches_eh_frame_hdr as *const () as u64 + 1,
    ];
    for addr in probes.into_iter().map(|a| a - bias).chain([0, u64::MAX]) {
        let a = with_hdr
            .fde(&with_hdr.eh_frame(), addr)
            .map(|f| f.initial_address());
        let b = indexed
            .fde(&indexed.eh_frame(), addr)
            .map(|f| f.initial_address());
        assert_eq!(a, b, "{addr:#x}");
    }
    for span in indexed.index.iter().step_by(97) {
        let fde = with_hdr.fde(&with_hdr.eh_frame(), span.start).unwrap();
        assert_eq!(fde.initial_address(), span.start);
    }
}

#[test]
fn unwinder_is_send() {
    fn send<T: Send>() {}
    send::<Unwinder>();
}

#[test]
fn parses_proc_maps() {
    let text = "\
55d0c0a00000-55d0c0a2a000 r--p 00000000 fd:01 1837264                    /usr/bin/python3.11
55d0c0a2a000-55d0c0d1f000 r-xp 0002a000 fd:01 1837264                    /usr/bin/python3.11
55d0c1f4e000-55d0c2000000 rw-p 00000000 00:00 0                          [heap]
7f1e2c000000-7f1e2c021000 rw-p 00000000 00:00 0 
7f1e30000000-7f1e30010000 rwxp 00000000 00:00 0 
7f1e31028000-7f1e311bd000 r-xp 00028000 103:02 262457                    /lib/x86_64-linux-gnu/libc.so.6
7f1e31200000-7f1e31201000 r-xp 00000000 00:2a 77                         /tmp/my lib.so (deleted)
7ffd5a1c3000-7ffd5a1e4000 rw-p 00000000 00:00 0                          [stack]
7ffd5a1f8000-7ffd5a1fa000 r-xp 00000000 00:00 0                          [vdso]
garbage line
";
    let maps = ProcMaps::parse(42, text);
    assert_eq!(maps.pid(), 42);
    // The anonymous data mapping is dropped; the anonymous executable one is kept.
    assert_eq!(maps.entries().len(), 8);
    let exe = maps.find(0x55d0c0a2a000 + 0x100).unwrap();
    assert_eq!(
        exe,
        &MapEntry {
            start: 0x55d0c0a2a000,
            end: 0x55d0c0d1f000,
            offset: 0x2a000,
            path: "/usr/bin/python3.11".into(),
            executable: true,
            dev: (0xfd, 1),
            inode: 1837264,
        }
    );
    assert!(!maps.find(0x55d0c0a00000).unwrap().executable);
    let libc = maps.find(0x7f1e31028000).unwrap();
    assert_eq!((libc.dev, libc.inode), ((0x103, 2), 262457));
    let deleted = maps.find(0x7f1e31200fff).unwrap();
    assert_eq!(deleted.path, "/tmp/my lib.so (deleted)");
    assert!(deleted.deleted());
    let jit = maps.find(0x7f1e30000000).unwrap();
    assert!(jit.executable && jit.path.is_empty());
    assert_eq!(maps.find(0x7ffd5a1f8000).unwrap().path, "[vdso]");
    assert!(maps.find(0x7f1e2c000000).is_none());
    assert!(maps.find(0x7f1e31201000).is_none());
    assert!(maps.find(0).is_none());
    assert!(maps.find(u64::MAX).is_none());
}

#[test]
fn anonymous_code_and_non_code() {
    let maps = ProcMaps::parse(
        1,
        "1000-2000 r-xp 00000000 00:00 0 \n3000-4000 rw-p 00000000 00:00 0   [heap]\n",
    );
    let mut unwinder = Unwinder::new();
    let regs = |ip| Regs {
        ip,
        sp: 0x8000,
        bp: 0,
    };
    let u = unwinder.unwind(1, &maps, regs(0x1800), &[0; 64], 16);
    assert_eq!(u.end, End::NoUnwindInfo(String::new()));
    let u = unwinder.unwind(1, &maps, regs(0x3800), &[0; 64], 16);
    assert_eq!(u.end, End::UnmappedAddress(0x3800));
}

#[test]
fn evaluates_plt_cfa_expression() {
    // What linkers emit for .plt: CFA = rsp + 8 + ((rip & 15) >= 11 ? 8 : 0), since the
    // stub pushes one word before jumping to the resolver.
    let expr = [
        0x77, 8, // DW_OP_breg7 (rsp) +8
        0x80, 0,    // DW_OP_breg16 (rip) +0
        0x3f, // DW_OP_lit15
        0x1a, // DW_OP_and
        0x3b, // DW_OP_lit11
        0x2a, // DW_OP_ge
        0x33, // DW_OP_lit3
        0x24, // DW_OP_shl
        0x22, // DW_OP_plus
    ];
    let eh_frame = EhFrame::new(&expr, LittleEndian);
    let stack = StackCopy {
        base: 0x7000,
        bytes: &[],
    };
    let encoding = gimli::Encoding {
        address_size: 8,
        format: gimli::Format::Dwarf32,
        version: 1,
    };
    let cfa = |ip| {
        let frame = Frame {
            ip,
            sp: 0x7000,
            bp: None,
            exact_ip: true,
        };
        let env = Env {
            frame: &frame,
            stack: &stack,
            eh_frame: &eh_frame,
            encoding,
        };
        let e = UnwindExpression {
            offset: 0,
            length: expr.len(),
        };
        env.eval(&e, None)
    };
    assert_eq!(cfa(0x1026), Ok(0x7008));
    assert_eq!(cfa(0x102b), Ok(0x7010));
}

#[test]
fn vdso_has_unwind_info() {
    let pid = std::process::id();
    let maps = ProcMaps::read(pid).unwrap();
    let Some(vdso) = maps.entries().iter().find(|e| e.path == "[vdso]") else {
        return; // vdso=0 on the kernel command line
    };
    let binary = load_vdso(pid, vdso).ok().expect("vDSO parses");
    let image = {
        let mut v = vec![0u8; (vdso.end - vdso.start) as usize];
        // SAFETY: the vDSO mapping is readable in our own process.
        unsafe { std::ptr::copy_nonoverlapping(vdso.start as *const u8, v.as_mut_ptr(), v.len()) };
        v
    };
    let file = object::File::parse(&image[..]).unwrap();
    use object::ObjectSymbol;
    let sym = file
        .dynamic_symbols()
        .find(|s| s.name() == Ok("__vdso_clock_gettime"))
        .expect("__vdso_clock_gettime");
    let svma = binary
        .svma(vdso, vdso.start + sym.address() - binary.loads[0].vaddr)
        .unwrap();
    assert!(binary.fde(&binary.eh_frame(), svma + 1).is_some());
}

// --- Asynchronous samples: SIGPROF interrupts a busy thread anywhere (prologues,
// epilogues, libc, the vDSO), and the handler copies registers and stack like BPF does.

const SAMPLE_STACK: usize = 16 * 1024;

struct Slot {
    regs: Regs,
    len: usize,
    stack: [u8; SAMPLE_STACK],
}

static SLOT: AtomicPtr<Slot> = AtomicPtr::new(std::ptr::null_mut());
static SAMPLED: AtomicBool = AtomicBool::new(false);
static SAMPLED_STACK_TOP: AtomicU64 = AtomicU64::new(0);
/// Sample the handler itself rather than the interrupted code.
static IN_HANDLER: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigprof(_: libc::c_int, _: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let slot = SLOT.load(Ordering::Acquire);
    if slot.is_null() || SAMPLED.load(Ordering::Acquire) {
        return;
    }
    // SAFETY: the kernel passes the interrupted context; the slot is only written here
    // while SAMPLED is false; the interrupted thread's stack is mapped up to its top and
    // the signal frame lies below the interrupted sp.
    unsafe {
        let regs = if IN_HANDLER.load(Ordering::Relaxed) {
            // Sampled here instead: the walk must cross the kernel's signal frame.
            regs_here!()
        } else {
            let gregs = &(*(ctx as *const libc::ucontext_t)).uc_mcontext.gregs;
            Regs {
                ip: gregs[libc::REG_RIP as usize] as u64,
                sp: gregs[libc::REG_RSP as usize] as u64,
                bp: gregs[libc::REG_RBP as usize] as u64,
            }
        };
        let top = SAMPLED_STACK_TOP.load(Ordering::Relaxed);
        let len = SAMPLE_STACK.min(top.saturating_sub(regs.sp) as usize);
        (*slot).regs = regs;
        (*slot).len = len;
        std::ptr::copy_nonoverlapping(regs.sp as *const u8, (*slot).stack.as_mut_ptr(), len);
    }
    SAMPLED.store(true, Ordering::Release);
}

#[inline(never)]
fn unwind_test_spin_inner(n: u64) -> u64 {
    let t = std::time::Instant::now(); // clock_gettime: libc, then the vDSO
    let mut x = n;
    for i in 0..black_box(50) {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
    }
    black_box(t);
    x
}

#[inline(never)]
fn unwind_test_spin(stop: &AtomicBool, spinning: &AtomicBool) {
    let mut acc = 0u64;
    while !stop.load(Ordering::Relaxed) {
        // Samples start once the loop runs (not while the thread is still starting).
        spinning.store(true, Ordering::Relaxed);
        acc = acc.wrapping_add(unwind_test_spin_inner(black_box(acc)));
    }
    black_box(acc);
}

#[test]
fn unwinds_asynchronous_samples() {
    use std::os::unix::thread::JoinHandleExt;
    let mut slot = Box::new(Slot {
        regs: Regs::default(),
        len: 0,
        stack: [0; SAMPLE_STACK],
    });
    SLOT.store(&mut *slot, Ordering::Release);
    // SAFETY: plain sigaction installation of an async-signal-safe handler.
    let old = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigprof as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(libc::SIGPROF, &action, &mut old), 0);
        old
    };
    static STOP: AtomicBool = AtomicBool::new(false);
    static SPINNING: AtomicBool = AtomicBool::new(false);
    let spinner = std::thread::spawn(move || {
        let here = 0u8;
        SAMPLED_STACK_TOP.store(mapping_end(&here as *const u8 as u64), Ordering::Relaxed);
        unwind_test_spin(&STOP, &SPINNING);
    });
    while !SPINNING.load(Ordering::Relaxed) {
        std::thread::yield_now();
    }
    let spin_fn = function_range(unwind_test_spin as *const () as usize);

    let pid = std::process::id();
    let maps = ProcMaps::read(pid).unwrap();
    let mut unwinder = Unwinder::new();
    let (mut samples, mut in_vdso, mut elapsed) = (0, 0, Duration::ZERO);
    let mut failures = Vec::new();
    for i in 0..400 {
        IN_HANDLER.store(i >= 300, Ordering::Relaxed);
        SAMPLED.store(false, Ordering::Release);
        // SAFETY: the thread is alive until STOP is set.
        unsafe { libc::pthread_kill(spinner.as_pthread_t(), libc::SIGPROF) };
        let deadline = Instant::now() + Duration::from_secs(2);
        while !SAMPLED.load(Ordering::Acquire) {
            assert!(Instant::now() < deadline, "no sample");
            std::thread::yield_now();
        }
        let s = &*slot;
        let t = Instant::now();
        let u = unwinder.unwind(pid, &maps, s.regs, &s.stack[..s.len], 128);
        elapsed += t.elapsed();
        samples += 1;
        in_vdso += usize::from(maps.find(s.regs.ip).is_some_and(|e| e.path == "[vdso]"));
        let has_spin = u
            .frames
            .iter()
            .any(|&a| spin_fn.contains(&a) || spin_fn.contains(&(a - 1)));
        if u.end != End::Root || !has_spin {
            failures.push(format!("{:?}\n{}", u.end, describe(&u.frames)));
        }
    }
    STOP.store(true, Ordering::Relaxed);
    spinner.join().unwrap();
    SLOT.store(std::ptr::null_mut(), Ordering::Release);
    // SAFETY: restores the previous disposition.
    unsafe { libc::sigaction(libc::SIGPROF, &old, std::ptr::null_mut()) };
    eprintln!(
        "{samples} samples, {in_vdso} in the vDSO, {:?} per unwind (first includes loading)",
        elapsed / samples
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// Cost of unwinding one sample with a warm cache (run with --ignored --nocapture).
#[test]
#[ignore]
fn bench_unwind() {
    let capture = unwind_test_chain_a(black_box(SAMPLE_STACK));
    let pid = std::process::id();
    let maps = ProcMaps::read(pid).unwrap();
    let mut unwinder = Unwinder::new();
    let u = unwinder.unwind(pid, &maps, capture.regs, &capture.stack, 128);
    let n = 20_000;
    let t = Instant::now();
    for _ in 0..n {
        black_box(unwinder.unwind(pid, &maps, capture.regs, &capture.stack, 128));
    }
    let per = t.elapsed() / n;
    eprintln!(
        "{} frames ({:?}): {per:?} per unwind, {:?} per frame",
        u.frames.len(),
        u.end,
        per / u.frames.len() as u32
    );
}

/// A real interpreter, stopped at random points with ptrace (as a sample would find it).
#[test]
fn unwinds_python_process() {
    let Some(python) = ["/usr/bin/python3", "/usr/local/bin/python3"]
        .into_iter()
        .find(|p| fs::metadata(p).is_ok())
    else {
        tracer_testkit::skip("no python3");
        return;
    };
    let mut child = std::process::Command::new(python)
        .args([
            "-c",
            "import sys\ndef f(n):\n  return n if n < 1 else f(n - 1) + 1\n\
             print('ready', flush=True)\nwhile True: f(30)",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    io::BufRead::read_line(
        &mut io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    let pid = child.id();
    let result = sample_with_ptrace(pid, 50);
    child.kill().unwrap();
    child.wait().unwrap();
    let Some(samples) = result else {
        tracer_testkit::skip("ptrace not permitted");
        return;
    };
    let mut failures = Vec::new();
    for (maps, u, trace) in &samples {
        let in_python = u.frames.iter().filter(|&&a| {
            maps.find(a.saturating_sub(1))
                .is_some_and(|e| e.path.contains("python") || e.path.contains("libpython"))
        });
        if u.end != End::Root || in_python.count() < 2 {
            failures.push(format!("{:?}\n{trace}", u.end));
        }
    }
    eprintln!(
        "python: {} samples, depths {:?}",
        samples.len(),
        samples
            .iter()
            .map(|(_, u, _)| u.frames.len())
            .collect::<Vec<_>>()
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// Stops `pid` `n` times, copies its registers and 16 KiB of stack, and unwinds each.
fn sample_with_ptrace(pid: u32, n: usize) -> Option<Vec<(ProcMaps, Unwound, String)>> {
    let p = pid as libc::pid_t;
    // SAFETY: ptrace requests on our own child, with valid pointers.
    unsafe {
        if libc::ptrace(libc::PTRACE_SEIZE, p, 0usize, 0usize) != 0 {
            return None;
        }
    }
    let maps = ProcMaps::read(pid).unwrap();
    let stack_top = maps
        .entries()
        .iter()
        .find(|e| e.path == "[stack]")
        .unwrap()
        .end;
    let mut unwinder = Unwinder::new();
    let mut out = Vec::new();
    for _ in 0..n {
        std::thread::sleep(Duration::from_millis(3));
        // SAFETY: as above.
        let regs = unsafe {
            assert_eq!(libc::ptrace(libc::PTRACE_INTERRUPT, p, 0usize, 0usize), 0);
            let mut status = 0;
            assert_eq!(libc::waitpid(p, &mut status, libc::__WALL), p);
            let mut r: libc::user_regs_struct = std::mem::zeroed();
            assert_eq!(
                libc::ptrace(libc::PTRACE_GETREGS, p, 0usize, &mut r as *mut _),
                0
            );
            Regs {
                ip: r.rip,
                sp: r.rsp,
                bp: r.rbp,
            }
        };
        let mut stack = vec![0u8; SAMPLE_STACK.min((stack_top - regs.sp) as usize)];
        let remote = [RemoteIoVec {
            base: regs.sp as usize,
            len: stack.len(),
        }];
        process_vm_readv(
            Pid::from_raw(p),
            &mut [io::IoSliceMut::new(&mut stack)],
            &remote,
        )
        .unwrap();
        // SAFETY: as above.
        unsafe { assert_eq!(libc::ptrace(libc::PTRACE_CONT, p, 0usize, 0usize), 0) };
        let u = unwinder.unwind(pid, &maps, regs, &stack, 128);
        let trace = u
            .frames
            .iter()
            .map(|&a| match maps.find(a.saturating_sub(1)) {
                Some(e) => format!("{a:#x} {}+{:#x}", e.path, a - e.start + e.offset),
                None => format!("{a:#x} ?"),
            })
            .collect::<Vec<_>>()
            .join("\n");
        out.push((maps.clone(), u, trace));
    }
    // The caller kills the child, which also ends the tracing.
    Some(out)
}
