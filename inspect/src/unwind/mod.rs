//! Unwinding copied user stacks with the binaries' `.eh_frame` CFI (x86-64 only).
//!
//! Distribution Pythons and most system libraries are built without frame pointers, so the
//! kernel's frame-pointer walk stops after a frame or two. Like `perf record --call-graph dwarf`,
//! the BPF program instead copies the sampled thread's user registers (ip, sp, bp) and the top
//! of its user stack starting at sp; this module replays the call frame information (CFI) of
//! each binary on that copy to recover the return addresses.
//!
//! Each binary's `.eh_frame` (and `.eh_frame_hdr` search table) is read once and cached by
//! (device, inode), so unwinding a sample costs a few lookups per frame and no system call.

use std::{
    collections::HashMap,
    fs::File,
    io,
    sync::Arc,
    time::{Duration, Instant},
};

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, EhFrameOffset, EndianSlice, Evaluation,
    EvaluationResult, Expression, FrameDescriptionEntry, LittleEndian, Location, Register,
    RegisterRule, UnwindContext, UnwindExpression, UnwindSection, UnwindTableRow, Value, X86_64,
};
use nix::{
    sys::uio::{process_vm_readv, RemoteIoVec},
    unistd::Pid,
};
use object::{Object, ObjectSection, ObjectSegment};

#[cfg(test)]
mod tests;

/// The user registers a sample needs for unwinding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

pub use crate::process::{MapEntry, ProcMaps};

/// Why an unwind stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The outermost frame (`_start`, a thread's start in `clone3`): the stack is complete.
    Root,
    /// The next frame's data lies beyond the copied bytes.
    StackCopyExhausted,
    /// This binary (path as in the maps) has no CFI for the address, or could not be read.
    NoUnwindInfo(String),
    /// No executable mapping holds this code address (a stale maps snapshot, or garbage).
    UnmappedAddress(u64),
    /// The CFI could not be applied (unsupported rule, sp not increasing).
    BadFrame,
    /// `max_frames` frames were produced and more remained.
    MaxFrames,
}

/// One unwound sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unwound {
    /// Absolute code addresses, leaf first. `frames[0]` is the sampled ip; later entries are
    /// return addresses, which point just past the `call`: subtract 1 before symbolizing them
    /// (that may even be another function when the call was the caller's last instruction).
    /// The one exception, an ip interrupted by a signal and found through the signal frame, is
    /// harmless with the same subtraction unless it is a function's first instruction.
    pub frames: Vec<u64>,
    pub end: End,
}

/// Unwinds samples with cached per-binary CFI. Keep one per consumer thread: it is `Send`,
/// and its cache is what makes unwinding cheap.
pub struct Unwinder {
    /// Each with the [`Unwinder::trim`] generation that last used it.
    binaries: HashMap<Key, (Cached, u64)>,
    generation: u64,
    /// Bytes of unwind info held by `binaries`.
    bytes: usize,
    /// Rows already computed, by (binary, address): samples hit the same call sites again
    /// and again, and replaying CFI instructions is most of a frame's cost.
    rows: HashMap<(usize, u64), SimpleRow>,
    ctx: Box<UnwindContext<usize>>,
}

/// How a binary is identified across processes: the same libpython mapped by a hundred
/// workers is parsed once.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Key {
    File {
        dev: (u32, u32),
        inode: u64,
    },
    /// The kernel's vDSO image, the same in every process of this (x86-64) kernel.
    Vdso,
}

enum Cached {
    Loaded(Arc<Binary>),
    /// Parsing failed (no `.eh_frame`, not x86-64): final. Opening failed (a process gone, no
    /// access): retried after `retry_at`, but not on every sample — at once for another
    /// process, since the one that failed may just have exited.
    Failed {
        retry_at: Option<Instant>,
        pid: u32,
    },
}

/// Retry delay for binaries that could not be opened.
const OPEN_RETRY: Duration = Duration::from_secs(30);
/// Cached rows are about 64 bytes each: a few MiB at most.
const MAX_ROWS: usize = 1 << 16;
/// A bound on the cache for long sessions over many short-lived programs; past it the cache
/// starts afresh rather than tracking recency on every sample.
const MAX_BINARIES: usize = 4096;
/// The same, in bytes of unwind info (libpython's is about 1 MiB).
const MAX_BYTES: usize = 256 << 20;
/// Binaries no sample used in this many [`Unwinder::trim`]s (sessions ending) are dropped.
const KEEP_GENERATIONS: u64 = 4;

impl Default for Unwinder {
    fn default() -> Self {
        Self::new()
    }
}

impl Unwinder {
    pub fn new() -> Self {
        Unwinder {
            binaries: HashMap::new(),
            generation: 0,
            bytes: 0,
            rows: HashMap::new(),
            ctx: Box::new(UnwindContext::new()),
        }
    }

    /// Number of binaries whose unwind info is cached (successfully or not).
    pub fn cached_binaries(&self) -> usize {
        self.binaries.len()
    }

    pub fn clear_cache(&mut self) {
        self.binaries.clear();
        self.bytes = 0;
        self.rows.clear();
    }

    /// Drops the binaries no sample used in the last few calls: called as sessions end, so
    /// the programs of sessions long gone do not stay in memory.
    pub fn trim(&mut self) {
        self.generation += 1;
        let now = self.generation;
        let before = self.binaries.len();
        self.binaries
            .retain(|_, (_, used)| *used + KEEP_GENERATIONS > now);
        if self.binaries.len() != before {
            self.bytes = self.binaries.values().map(|(c, _)| c.bytes()).sum();
            // Rows are keyed by their binary's address, which a new binary may reuse.
            self.rows.clear();
        }
    }

    /// Unwinds one sample. `stack` holds the bytes of the user stack starting at `regs.sp`.
    /// `maps` must be a snapshot of `pid`'s mappings taken while the sampled code was mapped.
    pub fn unwind(
        &mut self,
        pid: u32,
        maps: &ProcMaps,
        regs: Regs,
        stack: &[u8],
        max_frames: usize,
    ) -> Unwound {
        let mut frames = Vec::with_capacity(max_frames.min(64));
        if max_frames == 0 {
            return Unwound {
                frames,
                end: End::MaxFrames,
            };
        }
        frames.push(regs.ip);
        let stack = StackCopy {
            base: regs.sp,
            bytes: stack,
        };
        let mut frame = Frame {
            ip: regs.ip,
            sp: regs.sp,
            bp: Some(regs.bp),
            exact_ip: true,
        };
        loop {
            match self.step(pid, maps, &stack, &frame) {
                Err(end) => return Unwound { frames, end },
                Ok(_) if frames.len() == max_frames => {
                    return Unwound {
                        frames,
                        end: End::MaxFrames,
                    }
                }
                Ok(caller) => {
                    frames.push(caller.ip);
                    frame = caller;
                }
            }
        }
    }

    /// The caller's registers, from `f`'s CFI row.
    fn step(
        &mut self,
        pid: u32,
        maps: &ProcMaps,
        stack: &StackCopy,
        f: &Frame,
    ) -> Result<Frame, End> {
        // A return address may be just past a `call` that ends its function: look up the call.
        let lookup = if f.exact_ip {
            f.ip
        } else {
            f.ip.wrapping_sub(1)
        };
        let entry = maps.find(lookup).ok_or(End::UnmappedAddress(f.ip))?;
        if !entry.executable {
            // Also what a snapshot taken while ld.so mapped a library shows: its whole span
            // mapped read-only first, its code mapped over it a moment later.
            return Err(End::UnmappedAddress(f.ip));
        }
        let no_info = || End::NoUnwindInfo(entry.path.clone());
        let binary = self.binary(pid, entry).ok_or_else(no_info)?;
        let svma = binary.svma(entry, lookup).ok_or_else(no_info)?;
        // The binary stays cached (so its address unique) as long as rows refer to it.
        let row_key = (Arc::as_ptr(&binary) as usize, svma);
        if let Some(row) = self.rows.get(&row_key) {
            return row.apply(f, stack);
        }
        let eh_frame = binary.eh_frame();
        let fde = binary.fde(&eh_frame, svma).ok_or_else(no_info)?;
        let row = fde
            .unwind_info_for_address(&eh_frame, &binary.bases, &mut self.ctx, svma)
            .map_err(|_| End::BadFrame)?;
        if let Some(simple) = SimpleRow::new(row, fde.is_signal_trampoline()) {
            if self.rows.len() >= MAX_ROWS {
                self.rows.clear();
            }
            self.rows.insert(row_key, simple);
            return simple.apply(f, stack);
        }
        let env = Env {
            frame: f,
            stack,
            eh_frame: &eh_frame,
            encoding: fde.cie().encoding(),
        };

        let cfa = match row.cfa() {
            CfaRule::RegisterAndOffset { register, offset } => env
                .register(*register)
                .ok_or(End::BadFrame)?
                .wrapping_add_signed(*offset),
            CfaRule::Expression(e) => env.eval(e, None)?,
        };
        let ip = match row.register(X86_64::RA) {
            RegisterRule::Undefined => return Err(End::Root),
            rule => env.recover(X86_64::RA, &rule, cfa)?.ok_or(End::BadFrame)?,
        };
        // On x86-64 the CFA is by definition the caller's sp; only signal frames say otherwise.
        let sp = match row.register(X86_64::RSP) {
            RegisterRule::Undefined | RegisterRule::SameValue => cfa,
            rule => env.recover(X86_64::RSP, &rule, cfa)?.ok_or(End::BadFrame)?,
        };
        // Compilers only describe the callee-saved registers a function saves: no rule means
        // rbp is unchanged. An unknown rbp only matters if a caller's CFA is based on it.
        let bp = match row.register(X86_64::RBP) {
            RegisterRule::Undefined => f.bp,
            rule => env.recover(X86_64::RBP, &rule, cfa)?,
        };
        if ip == 0 {
            return Err(End::Root);
        }
        // Each caller's frame lies above its callee's: this also stops loops on bad data.
        if sp <= f.sp {
            return Err(End::BadFrame);
        }
        Ok(Frame {
            ip,
            sp,
            bp,
            // Through a signal frame the saved ip is where the thread was interrupted, not a
            // return address.
            exact_ip: fde.is_signal_trampoline(),
        })
    }

    /// The cached unwind info of the binary behind `entry`, loading it on first use.
    fn binary(&mut self, pid: u32, entry: &MapEntry) -> Option<Arc<Binary>> {
        let key = if entry.path == "[vdso]" {
            Key::Vdso
        } else if entry.is_file() {
            Key::File {
                dev: entry.dev,
                inode: entry.inode,
            }
        } else {
            return None;
        };
        if let Some((cached, used)) = self.binaries.get_mut(&key) {
            *used = self.generation;
            match cached {
                Cached::Loaded(b) => return Some(b.clone()),
                Cached::Failed { retry_at: None, .. } => return None,
                Cached::Failed {
                    retry_at: Some(at),
                    pid: failed,
                } if Instant::now() < *at && *failed == pid => return None,
                _ => {}
            }
        }
        if self.binaries.len() >= MAX_BINARIES || self.bytes >= MAX_BYTES {
            self.clear_cache();
        }
        let loaded = match key {
            Key::Vdso => load_vdso(pid, entry),
            Key::File { .. } => load_file(pid, entry),
        };
        let (cached, result) = match loaded {
            Ok(b) => {
                let b = Arc::new(b);
                (Cached::Loaded(b.clone()), Some(b))
            }
            Err(LoadError::Io(e)) => {
                tracing::debug!(
                    path = %entry.path, pid, error = %e, "cannot read binary for unwinding"
                );
                let retry_at = Some(Instant::now() + OPEN_RETRY);
                (Cached::Failed { retry_at, pid }, None)
            }
            Err(LoadError::Format(e)) => {
                tracing::debug!(path = %entry.path, error = %e, "no usable unwind info");
                (
                    Cached::Failed {
                        retry_at: None,
                        pid,
                    },
                    None,
                )
            }
        };
        self.bytes += cached.bytes();
        if let Some((old, _)) = self.binaries.insert(key, (cached, self.generation)) {
            self.bytes -= old.bytes();
        }
        result
    }
}

impl Cached {
    fn bytes(&self) -> usize {
        match self {
            Cached::Loaded(b) => b.bytes(),
            Cached::Failed { .. } => 0,
        }
    }
}

/// A CFI row of the shape nearly all compiled code has: CFA = rsp or rbp + offset, return
/// address and maybe rbp saved at CFA + offset.
#[derive(Clone, Copy, Debug)]
struct SimpleRow {
    cfa_on_rbp: bool,
    cfa_offset: i64,
    ra_offset: i64,
    rbp_offset: Option<i64>,
}

impl SimpleRow {
    fn new(row: &UnwindTableRow<usize>, signal_frame: bool) -> Option<Self> {
        let (cfa_on_rbp, cfa_offset) = match *row.cfa() {
            CfaRule::RegisterAndOffset {
                register: X86_64::RSP,
                offset,
            } => (false, offset),
            CfaRule::RegisterAndOffset {
                register: X86_64::RBP,
                offset,
            } => (true, offset),
            _ => return None,
        };
        let RegisterRule::Offset(ra_offset) = row.register(X86_64::RA) else {
            return None;
        };
        let rbp_offset = match row.register(X86_64::RBP) {
            RegisterRule::Undefined => None,
            RegisterRule::Offset(n) => Some(n),
            _ => return None,
        };
        let sp_default = matches!(
            row.register(X86_64::RSP),
            RegisterRule::Undefined | RegisterRule::SameValue
        );
        (sp_default && !signal_frame).then_some(SimpleRow {
            cfa_on_rbp,
            cfa_offset,
            ra_offset,
            rbp_offset,
        })
    }

    /// The same as the general path in `Unwinder::step` for these rules.
    fn apply(&self, f: &Frame, stack: &StackCopy) -> Result<Frame, End> {
        let base = if self.cfa_on_rbp {
            f.bp.ok_or(End::BadFrame)?
        } else {
            f.sp
        };
        let cfa = base.wrapping_add_signed(self.cfa_offset);
        let ip = stack.read(cfa.wrapping_add_signed(self.ra_offset), 8)?;
        let bp = match self.rbp_offset {
            None => f.bp,
            Some(n) => saved(stack, f, cfa.wrapping_add_signed(n), f.bp)?,
        };
        if ip == 0 {
            return Err(End::Root);
        }
        if cfa <= f.sp {
            return Err(End::BadFrame);
        }
        Ok(Frame {
            ip,
            sp: cfa,
            bp,
            exact_ip: false,
        })
    }
}

/// A register saved at `at` by the frame's prologue. GCC's CFI keeps saying so through the
/// epilogue, after the register was popped: a save slot below the stack pointer is gone,
/// and the register holds its caller's value again (`now`).
fn saved(stack: &StackCopy, f: &Frame, at: u64, now: Option<u64>) -> Result<Option<u64>, End> {
    if at < f.sp {
        return Ok(now);
    }
    Ok(Some(stack.read(at, 8)?))
}

/// The registers the CFI of x86-64 code needs to find the caller.
struct Frame {
    ip: u64,
    sp: u64,
    /// None once a frame's rbp could not be recovered (saved somewhere we do not track).
    bp: Option<u64>,
    /// `ip` is the instruction to look up rather than a return address.
    exact_ip: bool,
}

/// The copied stack bytes; its first byte was at `base` (the sampled sp) in the process.
struct StackCopy<'a> {
    base: u64,
    bytes: &'a [u8],
}

impl StackCopy<'_> {
    fn read(&self, addr: u64, size: u8) -> Result<u64, End> {
        let size = usize::from(size.min(8));
        let start = addr
            .checked_sub(self.base)
            .and_then(|o| usize::try_from(o).ok())
            .ok_or(End::StackCopyExhausted)?;
        let bytes = start
            .checked_add(size)
            .and_then(|end| self.bytes.get(start..end))
            .ok_or(End::StackCopyExhausted)?;
        let mut word = [0u8; 8];
        word[..size].copy_from_slice(bytes);
        Ok(u64::from_le_bytes(word))
    }
}

type Slice<'a> = EndianSlice<'a, LittleEndian>;

/// What evaluating one row's rules needs.
struct Env<'a> {
    frame: &'a Frame,
    stack: &'a StackCopy<'a>,
    eh_frame: &'a EhFrame<Slice<'a>>,
    encoding: gimli::Encoding,
}

impl Env<'_> {
    /// The callee's value of a register we track.
    fn register(&self, r: Register) -> Option<u64> {
        match r {
            X86_64::RSP => Some(self.frame.sp),
            X86_64::RBP => self.frame.bp,
            X86_64::RA => Some(self.frame.ip),
            _ => None,
        }
    }

    /// The caller's value of register `r` under `rule`; None where it cannot be known.
    fn recover(
        &self,
        r: Register,
        rule: &RegisterRule<usize>,
        cfa: u64,
    ) -> Result<Option<u64>, End> {
        Ok(match rule {
            RegisterRule::Undefined => None,
            RegisterRule::SameValue => self.register(r),
            RegisterRule::Offset(n) => saved(
                self.stack,
                self.frame,
                cfa.wrapping_add_signed(*n),
                self.register(r),
            )?,
            RegisterRule::ValOffset(n) => Some(cfa.wrapping_add_signed(*n)),
            RegisterRule::Register(other) => self.register(*other),
            RegisterRule::Expression(e) => Some(self.stack.read(self.eval(e, Some(cfa))?, 8)?),
            RegisterRule::ValExpression(e) => Some(self.eval(e, Some(cfa))?),
            RegisterRule::Constant(v) => Some(*v),
            _ => None,
        })
    }

    /// Evaluates a DWARF expression: PLT entries' CFA (rsp-based arithmetic on rip), glibc's
    /// signal trampoline (loads from the signal frame), realigned stacks (rbp-based loads).
    fn eval(&self, expr: &UnwindExpression<usize>, initial: Option<u64>) -> Result<u64, End> {
        let Expression(bytecode) = expr.get(self.eh_frame).map_err(|_| End::BadFrame)?;
        let mut eval = Evaluation::new(bytecode, self.encoding);
        // CFI expressions are tiny; this bounds backward branches in corrupt data.
        eval.set_max_iterations(256);
        if let Some(v) = initial {
            eval.set_initial_value(v);
        }
        let mut state = eval.evaluate();
        loop {
            state = match state.map_err(|_| End::BadFrame)? {
                EvaluationResult::Complete => break,
                EvaluationResult::RequiresRegister { register, .. } => {
                    let v = self.register(register).ok_or(End::BadFrame)?;
                    eval.resume_with_register(Value::Generic(v))
                }
                EvaluationResult::RequiresMemory { address, size, .. } => {
                    let v = self.stack.read(address, size)?;
                    eval.resume_with_memory(Value::Generic(v))
                }
                _ => return Err(End::BadFrame),
            };
        }
        match eval.as_result() {
            [piece] => match piece.location {
                Location::Address { address } => Ok(address),
                Location::Value { value } => value.to_u64(!0).map_err(|_| End::BadFrame),
                _ => Err(End::BadFrame),
            },
            _ => Err(End::BadFrame),
        }
    }
}

/// The unwind info of one ELF binary, copied out of it (a few hundred KiB for libpython).
struct Binary {
    eh_frame: Vec<u8>,
    /// `.eh_frame_hdr` when its binary search table is usable, else empty.
    eh_frame_hdr: Vec<u8>,
    /// Sorted FDE ranges, built when there is no usable `.eh_frame_hdr` table.
    index: Vec<FdeSpan>,
    bases: BaseAddresses,
    /// PT_LOAD segments, to turn file offsets into the addresses the CFI uses.
    loads: Vec<Load>,
}

struct FdeSpan {
    start: u64,
    end: u64,
    offset: usize,
}

struct Load {
    offset: u64,
    size: u64,
    vaddr: u64,
}

enum LoadError {
    Io(io::Error),
    Format(String),
}

impl From<io::Error> for LoadError {
    fn from(e: io::Error) -> Self {
        LoadError::Io(e)
    }
}

fn format_err(e: impl ToString) -> LoadError {
    LoadError::Format(e.to_string())
}

impl Binary {
    fn parse<'data, R: object::ReadRef<'data>>(data: R) -> Result<Self, LoadError> {
        Self::parse_with(data, true)
    }

    /// `use_hdr: false` forces the sorted FDE index (for tests).
    fn parse_with<'data, R: object::ReadRef<'data>>(
        data: R,
        use_hdr: bool,
    ) -> Result<Self, LoadError> {
        let file = object::File::parse(data).map_err(format_err)?;
        if file.architecture() != object::Architecture::X86_64 {
            return Err(format_err("not an x86-64 binary"));
        }
        let section = |name: &str| {
            let s = file.section_by_name(name)?;
            let data = s.data().ok().filter(|d| !d.is_empty())?;
            Some((s.address(), data.to_vec()))
        };
        let (eh_frame_addr, eh_frame) =
            section(".eh_frame").ok_or_else(|| format_err("no .eh_frame"))?;
        let mut bases = BaseAddresses::default().set_eh_frame(eh_frame_addr);
        if let Some(s) = file.section_by_name(".text") {
            bases = bases.set_text(s.address());
        }
        if let Some(s) = file.section_by_name(".got") {
            bases = bases.set_got(s.address());
        }
        let mut eh_frame_hdr = Vec::new();
        if let Some((addr, data)) = section(".eh_frame_hdr").filter(|_| use_hdr) {
            bases = bases.set_eh_frame_hdr(addr);
            if hdr_table_usable(&data, &bases, eh_frame_addr) {
                eh_frame_hdr = data;
            }
        }
        let loads = file
            .segments()
            .map(|s| {
                let (offset, size) = s.file_range();
                Load {
                    offset,
                    size,
                    vaddr: s.address(),
                }
            })
            .collect();
        let mut binary = Binary {
            eh_frame,
            eh_frame_hdr,
            index: Vec::new(),
            bases,
            loads,
        };
        if binary.eh_frame_hdr.is_empty() {
            binary.index = binary.build_index();
        }
        Ok(binary)
    }

    /// Memory held, roughly.
    fn bytes(&self) -> usize {
        self.eh_frame.len()
            + self.eh_frame_hdr.len()
            + self.index.len() * std::mem::size_of::<FdeSpan>()
    }

    fn eh_frame(&self) -> EhFrame<Slice<'_>> {
        let mut eh_frame = EhFrame::new(&self.eh_frame, LittleEndian);
        eh_frame.set_address_size(8);
        eh_frame
    }

    /// Every FDE's range, sorted, for binaries without a search table. Entries after a parse
    /// error are lost; the ones before still serve.
    fn build_index(&self) -> Vec<FdeSpan> {
        let eh_frame = self.eh_frame();
        let mut entries = eh_frame.entries(&self.bases);
        let mut index = Vec::new();
        while let Ok(Some(entry)) = entries.next() {
            if let gimli::CieOrFde::Fde(partial) = entry {
                if let Ok(fde) = partial.parse(EhFrame::cie_from_offset) {
                    if fde.len() > 0 {
                        index.push(FdeSpan {
                            start: fde.initial_address(),
                            end: fde.end_address(),
                            offset: fde.offset(),
                        });
                    }
                }
            }
        }
        index.sort_by_key(|f| f.start);
        index
    }

    /// The address in the ELF's address space (what the CFI describes) of a process address
    /// inside `entry`, through the file offset and the PT_LOAD segment holding it.
    fn svma(&self, entry: &MapEntry, addr: u64) -> Option<u64> {
        let file_offset = addr.checked_sub(entry.start)?.checked_add(entry.offset)?;
        let load = self
            .loads
            .iter()
            .find(|l| file_offset >= l.offset && file_offset - l.offset < l.size)?;
        Some(load.vaddr.wrapping_add(file_offset - load.offset))
    }

    /// The FDE covering `svma`.
    fn fde<'a>(
        &'a self,
        eh_frame: &EhFrame<Slice<'a>>,
        svma: u64,
    ) -> Option<FrameDescriptionEntry<Slice<'a>>> {
        if !self.eh_frame_hdr.is_empty() {
            let hdr = EhFrameHdr::new(&self.eh_frame_hdr, LittleEndian)
                .parse(&self.bases, 8)
                .ok()?;
            return hdr
                .table()?
                .fde_for_address(eh_frame, &self.bases, svma, EhFrame::cie_from_offset)
                .ok();
        }
        let i = self
            .index
            .partition_point(|f| f.start <= svma)
            .checked_sub(1)?;
        let span = &self.index[i];
        if svma >= span.end {
            return None;
        }
        eh_frame
            .fde_from_offset(
                &self.bases,
                EhFrameOffset(span.offset),
                EhFrame::cie_from_offset,
            )
            .ok()
    }
}

/// The range (ELF addresses) of the function, or part of one, whose unwind entry covers `svma`
/// in this ELF image. Where a compiler split a function (hot and cold parts; GCC 16's eval
/// loop, whose body leaves the exported symbol), each part has an entry of its own.
pub fn function_range(data: &[u8], svma: u64) -> Option<(u64, u64)> {
    let binary = Binary::parse(data).ok()?;
    let eh_frame = binary.eh_frame();
    let fde = binary.fde(&eh_frame, svma)?;
    Some((fde.initial_address(), fde.end_address()))
}

/// Whether `.eh_frame_hdr` has a fixed-size search table that points into our `.eh_frame`
/// (gimli turns its entries into `.eh_frame` offsets through the header's own pointer).
fn hdr_table_usable(data: &[u8], bases: &BaseAddresses, eh_frame_addr: u64) -> bool {
    let Ok(hdr) = EhFrameHdr::new(data, LittleEndian).parse(bases, 8) else {
        return false;
    };
    hdr.eh_frame_ptr().direct().ok() == Some(eh_frame_addr)
        && hdr.table().is_some_and(|t| t.lookup(0, bases).is_ok())
}

/// Opens the mapped file where the daemon reaches it (see `process::mapped_path`: chroots,
/// containers, unlinked or replaced files).
fn open_mapped(pid: u32, entry: &MapEntry) -> io::Result<File> {
    let path = crate::process::mapped_path(pid, entry)
        .map_err(|e| io::Error::new(io::ErrorKind::NotFound, e))?;
    File::open(path)
}

fn load_file(pid: u32, entry: &MapEntry) -> Result<Binary, LoadError> {
    // Reads only the headers and the sections used, not the whole (maybe 100 MB) file.
    let cache = object::ReadCache::new(open_mapped(pid, entry)?);
    Binary::parse(&cache)
}

/// The vDSO is only in memory: its ELF image is the mapping itself.
fn load_vdso(pid: u32, entry: &MapEntry) -> Result<Binary, LoadError> {
    let len = usize::try_from(entry.end - entry.start).map_err(format_err)?;
    if len > 1 << 20 {
        return Err(format_err("implausible vDSO size"));
    }
    let mut image = vec![0u8; len];
    let remote = [RemoteIoVec {
        base: usize::try_from(entry.start).map_err(format_err)?,
        len,
    }];
    let pid = i32::try_from(pid).map_err(format_err)?;
    let n = process_vm_readv(
        Pid::from_raw(pid),
        &mut [io::IoSliceMut::new(&mut image)],
        &remote,
    )
    .map_err(io::Error::from)?;
    if n != len {
        return Err(LoadError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    Binary::parse(&image[..])
}
