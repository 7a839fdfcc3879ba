//! The file an in-process counter (`libtracer_pycount.so`, loaded into a CPython 3.14+
//! process through PEP 768's remote execution) shares with tracerd: a header, a table of
//! functions, a table of caller → callee pairs and the functions' names, all fixed-size, so
//! that both sides map the same file and tracerd reads it while the process runs or after
//! it has died.
//!
//! tracerd creates the file (header filled, `state` = [`state::PENDING`]) and holds an
//! exclusive `flock` on it while it lives. The counter takes it over with one
//! compare-and-swap, PENDING → RUNNING; tracerd gives up on a process that did not do so in
//! time with PENDING → CANCELLED, so exactly one of them counts the process. A forked child
//! writes a file of its own (`counts.<pid>` beside its parent's), RUNNING from the start.
//!
//! Semantics are those of the BPF counter (`ebpf/probes/src/python/`): a call (start,
//! resume or throw into a frame) counts at its start, primitive when its code is not active
//! further down the same thread; times are added when it ends; caller pairs count when the
//! callee ends, primitive when the pair is not active further down.

/// `b"tracerpc"`, little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"tracerpc");
/// Bumped whenever anything below changes shape.
pub const VERSION: u32 = 1;

/// Header `state` values.
pub mod state {
    /// Written by tracerd; nobody counts yet.
    pub const PENDING: u32 = 0;
    /// The counter counts.
    pub const RUNNING: u32 = 1;
    /// tracerd gave up waiting (the process counts the uprobe way): the counter must not start.
    pub const CANCELLED: u32 = 2;
    /// The session ended: callbacks count nothing more and ask the interpreter to stop
    /// calling them where it can (`sys.monitoring.DISABLE`).
    pub const STOPPED: u32 = 3;
    /// The counter could not start; `why` says why.
    pub const REFUSED: u32 = 4;
    /// tracerd died while the counter ran (its lock was free): as STOPPED.
    pub const ORPHANED: u32 = 5;
    /// A profile-function counter ([`super::PROFILE_FUNCTION`]) whose program set a profile
    /// function of its own (cProfile, `sys.setprofile`), which takes the counter's place:
    /// it stopped counting, asked tracerd to count the process with the probes from here
    /// (a [`super::HANDOVER_PREFIX`] file), and holds the program until tracerd answers.
    pub const HANDOVER: u32 = 6;
    /// tracerd answered a HANDOVER: the probes count the process now, or `why` says why not.
    pub const HANDED: u32 = 7;
    /// A HANDOVER nobody answered while the counter held the program (30 s): the program
    /// went on, counted by nobody from then on. Set by the counter, so that an answer
    /// made later (as the session ends) does not hide the loss.
    pub const GAVE_UP: u32 = 8;
}

/// `<dir>/handover.<pid>`: a counter in [`state::HANDOVER`] creates it, for tracerd to look
/// at its counts file (a file's creation is seen in the directory's mtime).
pub const HANDOVER_PREFIX: &str = "handover.";

/// Where each part of the file starts, and the sizes tracerd creates it with.
pub const HEADER_SIZE: usize = 4096;
pub const ENTRIES: usize = 1 << 16;
pub const EDGES: usize = 1 << 18;
pub const STRINGS: usize = 8 << 20;

pub const fn entries_offset() -> usize {
    HEADER_SIZE
}
pub const fn edges_offset(entries: usize) -> usize {
    HEADER_SIZE + entries * core::mem::size_of::<Entry>()
}
pub const fn strings_offset(entries: usize, edges: usize) -> usize {
    edges_offset(entries) + edges * core::mem::size_of::<Edge>()
}
pub const fn file_size(entries: usize, edges: usize, strings: usize) -> usize {
    strings_offset(entries, edges) + strings
}

/// `Header::tool_id` of a counter that is a C profile function on every thread
/// (`PyEval_SetProfile`, cProfile's events: CPython 3.10 and 3.11, which have no
/// `sys.monitoring`) rather than a `sys.monitoring` tool.
pub const PROFILE_FUNCTION: u32 = 0x100;

/// The first bytes of the file. Counters are written by the process only; `state` by both
/// (compare-and-swap); `busy` is 1 while a callback runs, so that tracerd, having stopped the
/// counter, reads the tables only once the last callback is out.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Header {
    pub magic: u64,
    pub version: u32,
    pub state: u32,
    pub busy: u32,
    /// The `sys.monitoring` tool id the counter uses (set when it starts), or
    /// [`PROFILE_FUNCTION`].
    pub tool_id: u32,
    /// The process that writes this file (the child's own, after a fork).
    pub pid: u32,
    /// Capacities (entries and edges: powers of two) and what is used of them.
    pub entries_cap: u32,
    pub edges_cap: u32,
    pub strings_cap: u32,
    pub entries_used: u32,
    pub edges_used: u32,
    pub strings_used: u32,
    pub _pad: u32,
    /// Calls not counted because the function table was full.
    pub lost_calls: u64,
    /// Caller pairs not counted because the pair table was full.
    pub lost_edges: u64,
    /// Functions whose names did not fit or could not be read.
    pub lost_names: u64,
    /// Why the counter refused to start ([`state::REFUSED`]), NUL-padded UTF-8.
    pub why: [u8; 256],
}

/// `why` as [`Header::why`] holds it: UTF-8 cut at a character boundary, NUL-padded.
pub fn why_bytes(why: &str) -> [u8; 256] {
    let mut buf = [0u8; 256];
    let mut n = if why.len() < buf.len() {
        why.len()
    } else {
        buf.len() - 1
    };
    while !why.is_char_boundary(n) {
        n -= 1;
    }
    buf[..n].copy_from_slice(&why.as_bytes()[..n]);
    buf
}

impl Header {
    /// The bytes of `why` before its NUL padding.
    pub fn why_text(&self) -> &[u8] {
        let len = self
            .why
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.why.len());
        &self.why[..len]
    }

    /// A header with nothing counted yet: `(entries, edges, strings)` capacities.
    pub const fn new(pid: u32, state: u32, caps: (u32, u32, u32)) -> Self {
        Self {
            magic: MAGIC,
            version: VERSION,
            state,
            busy: 0,
            tool_id: 0,
            pid,
            entries_cap: caps.0,
            edges_cap: caps.1,
            strings_cap: caps.2,
            entries_used: 0,
            edges_used: 0,
            strings_used: 0,
            _pad: 0,
            lost_calls: 0,
            lost_edges: 0,
            lost_names: 0,
            why: [0; 256],
        }
    }
}

/// The capacities tracerd creates files with.
pub const CAPS: (u32, u32, u32) = (ENTRIES as u32, EDGES as u32, STRINGS as u32);

/// A name in the strings area.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StrRef {
    pub offset: u32,
    pub len: u32,
}

/// One function (code object). `code` 0: an empty slot. Open addressing, linear probing from
/// `hash(code) & (cap - 1)`; the counter keeps a reference to each code object it lists, so
/// that no other code object takes its address while the file counts.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Entry {
    pub code: u64,
    pub ncalls: u64,
    pub primitive: u64,
    pub tottime_ns: u64,
    pub cumtime_ns: u64,
    pub qualname: StrRef,
    pub filename: StrRef,
    pub firstlineno: i32,
    pub _pad: u32,
}

/// One caller → callee pair, keyed by both code objects (`callee` 0: an empty slot).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Edge {
    pub caller: u64,
    pub callee: u64,
    pub ncalls: u64,
    pub primitive: u64,
    pub tottime_ns: u64,
    pub cumtime_ns: u64,
}

/// The slot a key starts probing at (both sides must agree only for lookups; tracerd scans).
pub const fn slot(key: u64, cap: usize) -> usize {
    // Fibonacci hashing: code objects are 16-byte aligned, low bits carry nothing.
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & (cap - 1)
}

/// The file of the process itself, and of a child it forked, in the directory tracerd made.
pub const FILE_PREFIX: &str = "counts.";
