//! The native caller of a CUDA launch, told from inside CUPTI's API-ENTER callback: the return
//! address a uprobe at the API function's entry reads at the top of the stack.
//!
//! The callback runs a few frames below the API function (API function → CUDA/CUPTI internals
//! → callback) and is not told who called. The exact answer is an unwind from the callback
//! (`slow`); it costs microseconds, so it runs once per internal call path. It records the path
//! as the return addresses in each internal frame's slot, at their distances from the
//! callback's fixed point `sp`, and the distance to the API function's own return-address slot.
//! Every later launch (`launch_caller`'s loop) checks that those slots hold those return
//! addresses (the same internal frames, laid out as before), reads the API function's slot, and
//! accepts the word only if it is a known call site of that function (`VERIFIED`) or decodes as
//! one (`Segments::site`: the instruction before it is a call whose target, through a PLT stub
//! or GOT slot, is one of `entries`). Anything else goes back to the unwind, which relearns.
//!
//! A call through a register (`call *%rax`) cannot be decoded to its target: such a call site
//! is accepted only once the unwind has found it as the API function's caller on this path;
//! from then on its address is in `VERIFIED` like a decoded one.
//!
//! Only x86-64 is implemented (its CFA − 8 is the return-address slot); elsewhere the answer
//! is 0.

/// Which CUPTI callback domain `cbid` belongs to: the API function is in libcudart (runtime)
/// or libcuda (driver), which says which libraries lie between it and the callback.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Domain {
    Runtime,
    Driver,
}

/// The return address of the call that entered the CUDA API function whose CUPTI callback
/// runs now on this thread: what a probe at that function's entry reads at the top of the
/// stack. `cbid` names the function within `domain`; `entries` are the exported symbols a call
/// to it may target (a PLT stub or GOT slot is followed to them; a stub that jumps on, such as
/// the runtime's `__cudaLaunchKernel`, must be listed itself); `sp` is a fixed point of the
/// callback's frame (the address of one of its locals). 0 when it cannot be told.
#[cfg(target_arch = "x86_64")]
pub(crate) fn launch_caller(domain: Domain, cbid: u32, entries: &[&str], sp: usize) -> u64 {
    imp::launch_caller(domain, cbid, entries, sp)
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn launch_caller(_domain: Domain, _cbid: u32, _entries: &[&str], _sp: usize) -> u64 {
    0
}

/// What the bytes before a return address say about the call that pushed it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
struct CallForms {
    /// `call rel32`: its target.
    direct: Option<usize>,
    /// `call *disp32(%rip)`: the slot it read its target from.
    slot: Option<usize>,
    /// Some other `call` through a register or memory (its target is not in the bytes).
    indirect: bool,
}

/// Bytes before a return address that `call_forms` reads: the longest `call` it knows
/// (`notrack` + REX + FF /2 with SIB and disp32).
const BEFORE: usize = 9;

/// Decodes `before` (the `BEFORE` bytes that end at `ret`) as the call instructions that could end
/// there. Decoding backwards is ambiguous, so every form that fits is reported; the direct
/// forms still have to resolve to an API function's symbol to count.
fn call_forms(before: &[u8; BEFORE], ret: usize) -> CallForms {
    let rel = |at: usize| {
        let d = i32::from_le_bytes([before[at], before[at + 1], before[at + 2], before[at + 3]]);
        ret.wrapping_add_signed(d as isize)
    };
    let mut forms = CallForms::default();
    if before[BEFORE - 5] == 0xe8 {
        forms.direct = Some(rel(BEFORE - 4));
    }
    if before[BEFORE - 6] == 0xff && before[BEFORE - 5] == 0x15 {
        forms.slot = Some(rel(BEFORE - 4));
    }
    forms.indirect =
        (2..=BEFORE).any(|len| indirect_call_len(&before[BEFORE - len..]) == Some(len));
    forms
}

/// The length of `code` taken as one `call r/m64` (FF /2) other than `call *disp32(%rip)`,
/// with optional `notrack`/`bnd` and REX prefixes, if its operand fits the bytes given.
fn indirect_call_len(code: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < 2 && matches!(code.get(i), Some(0x3e | 0xf2)) {
        i += 1;
    }
    if matches!(code.get(i), Some(0x40..=0x4f)) {
        i += 1;
    }
    if *code.get(i)? != 0xff {
        return None;
    }
    let modrm = *code.get(i + 1)?;
    let (md, reg, rm) = (modrm >> 6, (modrm >> 3) & 7, modrm & 7);
    if reg != 2 || (md == 0 && rm == 5) {
        return None;
    }
    let mut len = i + 2;
    if md != 3 && rm == 4 {
        let sib = *code.get(len)?;
        len += 1;
        if md == 0 && sib & 7 == 5 {
            len += 4;
        }
    }
    len += [0, 1, 4, 0][usize::from(md)]; // disp8 or disp32 by mod
    Some(len)
}

/// The tag that keys a call site or a path to one API function: `cbid` and its domain.
fn tag(domain: Domain, cbid: u32) -> u64 {
    u64::from(cbid & 0x7fff) | u64::from(domain == Domain::Driver) << 15
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::{
        cell::Cell,
        ffi::{c_int, c_void, CStr},
        sync::{
            atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering},
            Mutex, PoisonError,
        },
    };

    use super::{call_forms, tag, Domain, BEFORE};
    use crate::unwind::{_Unwind_Backtrace, _Unwind_GetCFA, _Unwind_GetIP};

    /// Learned paths: enough for every launch function's few internal routes.
    const PATHS: usize = 64;
    /// Internal return-address slots a path may check (deeper ones are not learned).
    const CHAIN: usize = 24;
    /// Frames the unwind collects from the callback outward.
    const MAX_FRAMES: usize = 64;
    /// Verified call sites (power of two), and the slots a lookup tries.
    const SITES: usize = 1024;
    const PROBES: usize = 16;
    const READY: u32 = 2;

    /// One learned internal path from an API function down to the callback.
    struct Path {
        state: AtomicU32,
        tag: AtomicU64,
        len: AtomicUsize,
        /// `offs[..len]`: each internal frame's return-address slot, bytes above `sp`;
        /// `offs[len]`: the API function's.
        offs: [AtomicUsize; CHAIN + 1],
        words: [AtomicU64; CHAIN],
    }

    impl Path {
        const fn empty() -> Path {
            Path {
                state: AtomicU32::new(0),
                tag: AtomicU64::new(0),
                len: AtomicUsize::new(0),
                offs: [const { AtomicUsize::new(0) }; CHAIN + 1],
                words: [const { AtomicU64::new(0) }; CHAIN],
            }
        }

        /// The word in the API function's slot, if this thread's stack holds this path's
        /// return addresses where it learned them.
        fn candidate(&self, sp: usize, hi: usize) -> Option<u64> {
            let len = self.len.load(Ordering::Relaxed);
            for k in 0..len {
                let want = self.words[k].load(Ordering::Relaxed);
                if stack_word(sp, self.offs[k].load(Ordering::Relaxed), hi)? != want {
                    return None;
                }
            }
            stack_word(sp, self.offs[len].load(Ordering::Relaxed), hi)
        }

        fn same(&self, tag: u64, chain: &[(usize, u64)], last: usize) -> bool {
            let len = self.len.load(Ordering::Relaxed);
            self.tag.load(Ordering::Relaxed) == tag
                && len == chain.len()
                && self.offs[len].load(Ordering::Relaxed) == last
                && chain.iter().enumerate().all(|(k, &(off, word))| {
                    self.offs[k].load(Ordering::Relaxed) == off
                        && self.words[k].load(Ordering::Relaxed) == word
                })
        }
    }

    static TABLE: [Path; PATHS] = [const { Path::empty() }; PATHS];
    /// Slots of `TABLE` handed out (may run past `PATHS` once it is full).
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    /// Call sites known to call an API function: address | tag << 48 (0: free).
    static VERIFIED: [AtomicU64; SITES] = [const { AtomicU64::new(0) }; SITES];
    /// Failed unwinds in a row, per tag bucket: past 8, one launch in 256 tries again.
    static FAILS: [AtomicU32; 64] = [const { AtomicU32::new(0) }; 64];
    static SEGMENTS: Mutex<Segments> = Mutex::new(Segments::EMPTY);

    thread_local! {
        /// This thread's stack, [low, high): bounds every read relative to `sp`, since a path
        /// learned on one thread is tried on another's stack. (1, 1): not known.
        static STACK: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    }

    pub(super) fn launch_caller(domain: Domain, cbid: u32, entries: &[&str], sp: usize) -> u64 {
        let tag = tag(domain, cbid);
        let (lo, hi) = stack_bounds();
        if sp < lo || sp >= hi {
            return 0;
        }
        let n = NEXT.load(Ordering::Acquire).min(PATHS);
        for path in &TABLE[..n] {
            if path.state.load(Ordering::Acquire) != READY
                || path.tag.load(Ordering::Relaxed) != tag
            {
                continue;
            }
            let Some(word) = path.candidate(sp, hi) else {
                continue;
            };
            if verified(word, tag) {
                return word;
            }
            // A call site not seen yet: decoded once, then known.
            let site = lock_segments().site(word as usize, entries);
            if site == Site::Entry {
                remember(word, tag);
                return word;
            }
            break;
        }
        slow(domain, tag, entries, sp, hi)
    }

    /// Reads the stack word `off` bytes above `sp`, within this thread's stack.
    fn stack_word(sp: usize, off: usize, hi: usize) -> Option<u64> {
        let at = sp.checked_add(off)?;
        if at.checked_add(8)? > hi || at % 8 != 0 {
            return None;
        }
        // SAFETY: [at, at + 8) lies in this thread's own mapped stack, above `sp`.
        Some(unsafe { std::ptr::read_volatile(at as *const u64) })
    }

    fn stack_bounds() -> (usize, usize) {
        STACK.with(|s| {
            if s.get().0 == 0 {
                s.set(thread_stack().unwrap_or((1, 1)));
            }
            s.get()
        })
    }

    /// This thread's stack from pthread (for the main thread glibc reads /proc/self/maps:
    /// once per thread, on its first launch).
    fn thread_stack() -> Option<(usize, usize)> {
        // SAFETY: `attr` is initialized by pthread_getattr_np before use and destroyed after.
        unsafe {
            let mut attr: libc::pthread_attr_t = std::mem::zeroed();
            if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
                return None;
            }
            let (mut addr, mut size) = (std::ptr::null_mut(), 0usize);
            let ok = libc::pthread_attr_getstack(&attr, &mut addr, &mut size) == 0;
            libc::pthread_attr_destroy(&mut attr);
            ok.then(|| (addr as usize, addr as usize + size))
        }
    }

    fn packed(word: u64, tag: u64) -> Option<u64> {
        (word != 0 && word < 1 << 48).then_some(word | tag << 48)
    }

    fn bucket(v: u64) -> usize {
        (v.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54) as usize
    }

    fn verified(word: u64, tag: u64) -> bool {
        let Some(v) = packed(word, tag) else {
            return false;
        };
        let h = bucket(v);
        for k in 0..PROBES {
            match VERIFIED[(h + k) % SITES].load(Ordering::Relaxed) {
                0 => return false,
                e if e == v => return true,
                _ => {}
            }
        }
        false
    }

    fn remember(word: u64, tag: u64) {
        let Some(v) = packed(word, tag) else {
            return;
        };
        let h = bucket(v);
        for k in 0..PROBES {
            match VERIFIED[(h + k) % SITES].compare_exchange(
                0,
                v,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(e) if e == v => return,
                Err(_) => {}
            }
        }
    }

    /// The exact answer, by unwinding; learns the path on the way. Backs off where it fails.
    #[cold]
    fn slow(domain: Domain, tag: u64, entries: &[&str], sp: usize, hi: usize) -> u64 {
        let fails = &FAILS[bucket(tag) % FAILS.len()];
        let before = fails.load(Ordering::Relaxed);
        if before >= 8 && !before.is_multiple_of(256) {
            fails.fetch_add(1, Ordering::Relaxed);
            return 0;
        }
        let word = unwind(domain, tag, entries, sp, hi);
        if word == 0 {
            fails.fetch_add(1, Ordering::Relaxed);
        } else {
            fails.store(0, Ordering::Relaxed);
        }
        word
    }

    /// (IP, the CFA the unwinder reports with it) per frame, from the innermost.
    struct Walk {
        frames: [(usize, usize); MAX_FRAMES],
        n: usize,
    }

    extern "C" fn trace(ctx: *mut c_void, arg: *mut c_void) -> c_int {
        // SAFETY: `arg` is the `Walk` that `unwind` passed; `ctx` is the unwinder's.
        let walk = unsafe { &mut *arg.cast::<Walk>() };
        if walk.n == MAX_FRAMES {
            return 4; // _URC_NORMAL_STOP
        }
        // SAFETY: as above.
        walk.frames[walk.n] = unsafe { (_Unwind_GetIP(ctx), _Unwind_GetCFA(ctx)) };
        walk.n += 1;
        0
    }

    #[inline(never)]
    fn unwind(domain: Domain, tag: u64, entries: &[&str], sp: usize, hi: usize) -> u64 {
        let mut walk = Walk {
            frames: [(0, 0); MAX_FRAMES],
            n: 0,
        };
        // SAFETY: `trace` only writes into `walk`, which outlives the call.
        unsafe { _Unwind_Backtrace(trace, (&raw mut walk).cast()) };
        let frames = &walk.frames[..walk.n];
        let segments = lock_segments();
        // A frame's return address (all but the first) may end its function: look one back.
        let kind = |j: usize| segments.kind(frames[j].0.saturating_sub(usize::from(j > 0)));
        let inner = |k: Kind| match domain {
            Domain::Runtime => k != Kind::Other,
            Domain::Driver => matches!(k, Kind::Driver | Kind::Cupti | Kind::Ours),
        };
        if frames.is_empty() || kind(0) != Kind::Ours {
            return 0;
        }
        let mut api = 0;
        while api + 1 < frames.len() && inner(kind(api + 1)) {
            api += 1;
        }
        let want = match domain {
            Domain::Runtime => Kind::Runtime,
            Domain::Driver => Kind::Driver,
        };
        if api + 1 >= frames.len() || kind(api) != want {
            return 0;
        }
        let word = frames[api + 1].0 as u64;
        // The unwinder reports, with each frame, the CFA of the one it came from (the frame's
        // own stack pointer at its call): the return address into frame j lies just below j's.
        let last = frames[api + 1].1.wrapping_sub(8);
        if last < sp || stack_word(sp, last - sp, hi) != Some(word) {
            return 0;
        }
        if segments.site(word as usize, entries) == Site::Other {
            return 0;
        }
        drop(segments);
        remember(word, tag);
        learn(tag, frames, api, sp, hi);
        word
    }

    /// Records the path the unwind took: every internal return-address slot above `sp`.
    fn learn(tag: u64, frames: &[(usize, usize)], api: usize, sp: usize, hi: usize) {
        let mut chain = [(0usize, 0u64); CHAIN];
        let mut len = 0;
        for j in 0..api {
            let slot = frames[j + 1].1.wrapping_sub(8);
            if slot < sp {
                continue;
            }
            let (off, word) = (slot - sp, frames[j + 1].0 as u64);
            if len == CHAIN || stack_word(sp, off, hi) != Some(word) {
                return;
            }
            chain[len] = (off, word);
            len += 1;
        }
        let chain = &chain[..len];
        let last = frames[api + 1].1 - 8 - sp;
        let n = NEXT.load(Ordering::Acquire).min(PATHS);
        if TABLE[..n].iter().any(|p| p.same(tag, chain, last)) {
            return;
        }
        let i = NEXT.fetch_add(1, Ordering::AcqRel);
        let Some(path) = TABLE.get(i) else {
            return;
        };
        path.tag.store(tag, Ordering::Relaxed);
        path.len.store(len, Ordering::Relaxed);
        for (k, &(off, word)) in chain.iter().enumerate() {
            path.offs[k].store(off, Ordering::Relaxed);
            path.words[k].store(word, Ordering::Relaxed);
        }
        path.offs[len].store(last, Ordering::Relaxed);
        path.state.store(READY, Ordering::Release);
    }

    fn lock_segments() -> std::sync::MutexGuard<'static, Segments> {
        let mut s = SEGMENTS.lock().unwrap_or_else(PoisonError::into_inner);
        s.refresh();
        s
    }

    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub(super) enum Kind {
        Other,
        Runtime,
        Driver,
        Cupti,
        /// This library (the callback and this code).
        Ours,
    }

    /// What a return address is, for the API function it should return from.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub(super) enum Site {
        /// A call whose target is one of the entries.
        Entry,
        /// A call whose target cannot be read from the code.
        Indirect,
        /// Not a call to one of the entries.
        Other,
    }

    #[derive(Clone, Copy)]
    pub(super) struct Segment {
        start: usize,
        end: usize,
        flags: u32,
        kind: Kind,
    }

    /// The loaded objects' PT_LOAD segments, sorted, as of the loader's adds/subs counters:
    /// the bounds every read of code or GOT is checked against.
    pub(super) struct Segments {
        counters: (u64, u64),
        list: Vec<Segment>,
    }

    impl Segments {
        const EMPTY: Segments = Segments {
            counters: (0, 0),
            list: Vec::new(),
        };

        fn refresh(&mut self) {
            let counters = loader_counters();
            if counters == self.counters && !self.list.is_empty() {
                return;
            }
            if counters.1 != self.counters.1 {
                // An object went away: its call sites may be another's code now.
                for v in &VERIFIED {
                    v.store(0, Ordering::Relaxed);
                }
            }
            self.counters = counters;
            self.list.clear();
            // SAFETY: `collect` only pushes into the Vec passed.
            unsafe { libc::dl_iterate_phdr(Some(collect), (&raw mut self.list).cast()) };
            let ours = launch_caller as *const () as usize;
            let mut object = 0;
            while object < self.list.len() {
                // `collect` tags each object's first segment's `flags` high bit; group by it.
                let mut end = object + 1;
                while end < self.list.len() && self.list[end].flags & NEW_OBJECT == 0 {
                    end += 1;
                }
                if self.list[object..end]
                    .iter()
                    .any(|s| (s.start..s.end).contains(&ours))
                {
                    self.list[object..end]
                        .iter_mut()
                        .for_each(|s| s.kind = Kind::Ours);
                }
                object = end;
            }
            self.list.sort_by_key(|s| s.start);
        }

        fn find(&self, addr: usize, len: usize, flag: u32) -> Option<&Segment> {
            let i = self
                .list
                .partition_point(|s| s.start <= addr)
                .checked_sub(1)?;
            let s = &self.list[i];
            (addr.checked_add(len)? <= s.end && s.flags & flag != 0).then_some(s)
        }

        pub(super) fn kind(&self, addr: usize) -> Kind {
            self.find(addr, 1, libc::PF_X)
                .map_or(Kind::Other, |s| s.kind)
        }

        /// `N` bytes at `addr`, only if they lie in one segment with `flag`.
        pub(super) fn read<const N: usize>(&self, addr: usize, flag: u32) -> Option<[u8; N]> {
            self.find(addr, N, flag)?;
            // SAFETY: [addr, addr + N) lies in a mapped segment of a loaded object.
            Some(unsafe { std::ptr::read_unaligned(addr as *const [u8; N]) })
        }

        fn pointer(&self, slot: usize) -> Option<usize> {
            self.read::<8>(slot, libc::PF_R).map(usize::from_le_bytes)
        }

        /// Whether `ret` returns from a call to one of `entries`.
        pub(super) fn site(&self, ret: usize, entries: &[&str]) -> Site {
            let Some(before) = ret
                .checked_sub(BEFORE)
                .and_then(|a| self.read(a, libc::PF_X))
            else {
                return Site::Other;
            };
            let forms = call_forms(&before, ret);
            let named = |target: Option<usize>| target.is_some_and(|t| names_entry(t, entries));
            if named(forms.direct.map(|t| self.through_plt(t))) {
                return Site::Entry;
            }
            if named(forms.slot.and_then(|s| self.pointer(s))) {
                return Site::Entry;
            }
            if forms.indirect || forms.slot.is_some() {
                return Site::Indirect;
            }
            Site::Other
        }

        /// Where a PLT stub at `target` jumps (its GOT slot's value); `target` if it is none.
        fn through_plt(&self, target: usize) -> usize {
            let Some(code) = self.read::<11>(target, libc::PF_X) else {
                return target;
            };
            let mut i = if code[..4] == [0xf3, 0x0f, 0x1e, 0xfa] {
                4
            } else {
                0
            };
            if code[i] == 0xf2 {
                i += 1;
            }
            if code[i] != 0xff || code[i + 1] != 0x25 {
                return target;
            }
            let d = i32::from_le_bytes([code[i + 2], code[i + 3], code[i + 4], code[i + 5]]);
            let slot = (target + i + 6).wrapping_add_signed(d as isize);
            self.pointer(slot).unwrap_or(target)
        }
    }

    /// Whether `target` is the start of an exported symbol named in `entries`.
    fn names_entry(target: usize, entries: &[&str]) -> bool {
        // SAFETY: dladdr only reads the loader's tables; the name it returns lives as long as
        // the object, which is loaded (the call went there).
        unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            if libc::dladdr(target as *const c_void, &mut info) == 0
                || info.dli_sname.is_null()
                || info.dli_saddr as usize != target
            {
                return false;
            }
            let name = CStr::from_ptr(info.dli_sname).to_bytes();
            entries.iter().any(|e| e.as_bytes() == name)
        }
    }

    const NEW_OBJECT: u32 = 1 << 31;

    /// The loader's counts of objects added and removed so far.
    fn loader_counters() -> (u64, u64) {
        unsafe extern "C" fn first(
            info: *mut libc::dl_phdr_info,
            size: usize,
            data: *mut c_void,
        ) -> c_int {
            if size >= std::mem::offset_of!(libc::dl_phdr_info, dlpi_subs) + 8 {
                // SAFETY: glibc's info is at least this large (checked), `data` is ours.
                unsafe { *data.cast::<(u64, u64)>() = ((*info).dlpi_adds, (*info).dlpi_subs) };
            }
            1
        }
        let mut counters = (u64::MAX, u64::MAX);
        // SAFETY: `first` writes only `counters`.
        unsafe { libc::dl_iterate_phdr(Some(first), (&raw mut counters).cast()) };
        counters
    }

    unsafe extern "C" fn collect(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader's info for one object; `data` is `refresh`'s Vec.
        let (info, list) = unsafe { (&*info, &mut *data.cast::<Vec<Segment>>()) };
        let name = if info.dlpi_name.is_null() {
            &b""[..]
        } else {
            // SAFETY: a NUL-terminated name the loader owns.
            unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes()
        };
        let kind = object_kind(name);
        let mut first = NEW_OBJECT;
        for k in 0..usize::from(info.dlpi_phnum) {
            // SAFETY: dlpi_phdr has dlpi_phnum entries.
            let ph = unsafe { &*info.dlpi_phdr.add(k) };
            if ph.p_type != libc::PT_LOAD || ph.p_memsz == 0 {
                continue;
            }
            let start = info.dlpi_addr as usize + ph.p_vaddr as usize;
            list.push(Segment {
                start,
                end: start + ph.p_memsz as usize,
                flags: ph.p_flags | first,
                kind,
            });
            first = 0;
        }
        0
    }

    /// The CUDA library a loaded object's path names, by its file name.
    pub(super) fn object_kind(path: &[u8]) -> Kind {
        let file = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
        if file.starts_with(b"libcudart") {
            Kind::Runtime
        } else if file.starts_with(b"libcuda.so") {
            Kind::Driver
        } else if file.starts_with(b"libcupti") {
            Kind::Cupti
        } else {
            Kind::Other
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn object_kinds_by_file_name() {
            assert_eq!(
                object_kind(b"/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
                Kind::Driver
            );
            assert_eq!(object_kind(b"/opt/x/libcudart.so.13"), Kind::Runtime);
            assert_eq!(object_kind(b"libcupti.so.13"), Kind::Cupti);
            assert_eq!(object_kind(b"/usr/lib/libcudnn.so.9"), Kind::Other);
        }

        #[test]
        fn reads_stay_inside_loaded_segments() {
            let s = lock_segments();
            let code = launch_caller as *const () as usize;
            assert_eq!(s.kind(code), Kind::Ours);
            assert!(s.read::<16>(code, libc::PF_X).is_some());
            // The stack and the heap are no object's segment; page 0 is nothing.
            let local = 0u64;
            assert!(s.read::<8>(&raw const local as usize, libc::PF_R).is_none());
            assert!(s.read::<8>(16, libc::PF_R).is_none());
            // A read that runs past its segment's end is refused.
            let seg = *s.list.iter().find(|g| g.flags & libc::PF_X != 0).unwrap();
            assert!(s.read::<8>(seg.end - 4, libc::PF_X).is_none());
            assert!(s.read::<4>(seg.end - 4, libc::PF_X).is_some());
        }

        #[inline(never)]
        extern "C" fn target() -> u64 {
            std::hint::black_box(7)
        }

        #[test]
        fn names_exported_symbols_only_at_their_start() {
            let open = libc::dlopen as *const () as usize;
            assert!(names_entry(open, &["dlopen", "x"]));
            assert!(!names_entry(open, &["dlclose"]));
            assert!(!names_entry(open + 1, &["dlopen"]));
            assert!(!names_entry(target as *const () as usize, &["target"]));
        }

        #[test]
        fn verified_sites_are_per_function() {
            remember(0x5555_0000_1234, 211);
            assert!(verified(0x5555_0000_1234, 211));
            assert!(!verified(0x5555_0000_1234, 307));
            assert!(!verified(0x5555_0000_1235, 211));
            assert!(!verified(0, 211));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(tail: &[u8]) -> [u8; BEFORE] {
        let mut b = [0x90; BEFORE];
        b[BEFORE - tail.len()..].copy_from_slice(tail);
        b
    }

    #[test]
    fn decodes_direct_and_rip_relative_calls() {
        let ret = 0x40_1000;
        // call rel32 -0x100
        let f = call_forms(&bytes(&[0xe8, 0x00, 0xff, 0xff, 0xff]), ret);
        assert_eq!(f.direct, Some(ret - 0x100));
        assert_eq!((f.slot, f.indirect), (None, false));
        // call *0x2000(%rip)
        let f = call_forms(&bytes(&[0xff, 0x15, 0x00, 0x20, 0x00, 0x00]), ret);
        assert_eq!(f.slot, Some(ret + 0x2000));
        assert_eq!(f.direct, None);
    }

    #[test]
    fn register_and_memory_calls_are_indirect() {
        for tail in [
            &[0xff, 0xd0][..],                           // call *%rax
            &[0x41, 0xff, 0xd3],                         // call *%r11
            &[0x3e, 0xff, 0xd1],                         // notrack call *%rcx
            &[0xff, 0x10],                               // call *(%rax)
            &[0xff, 0x50, 0x18],                         // call *0x18(%rax)
            &[0xff, 0x54, 0x24, 0x08],                   // call *0x8(%rsp)
            &[0xff, 0x90, 0x00, 0x01, 0x00, 0x00],       // call *0x100(%rax)
            &[0x41, 0xff, 0x94, 0x24, 0, 1, 0, 0],       // call *0x100(%r12) via SIB
            &[0x3e, 0x41, 0xff, 0x94, 0x24, 0, 1, 0, 0], // notrack, the same
            &[0xff, 0x14, 0xc5, 0x00, 0x10, 0, 0],       // call *0x1000(,%rax,8)
        ] {
            let f = call_forms(&bytes(tail), 0x1000);
            assert!(f.indirect, "{tail:x?}");
        }
    }

    #[test]
    fn other_instructions_are_no_call() {
        for tail in [
            &[0x48, 0x89, 0xc7][..], // mov %rax,%rdi
            &[0xff, 0xe0],           // jmp *%rax (FF /4)
            &[0xff, 0xc0],           // inc %eax (FF /0)
            &[0x90],
        ] {
            assert_eq!(
                call_forms(&bytes(tail), 0x1000),
                CallForms::default(),
                "{tail:x?}"
            );
        }
    }

    #[test]
    fn tags_keep_domains_apart() {
        assert_ne!(tag(Domain::Runtime, 307), tag(Domain::Driver, 307));
    }
}
