//! The table in which tracer's CUPTI injection library (`libtracer_cupti.so`) counts CUDA
//! kernel launches in its own process, from CUPTI's launch callbacks, where a session asks it
//! to instead of the launch probes: no trap a launch.
//!
//! The table lives in a sealed memfd the library makes and maps; tracerd takes the file
//! itself (`pidfd_getfd`) and maps it too, so it reads the counts while the process runs and
//! after it has died. Counts only grow, for the process's life: a session reads the table
//! when it starts and when it ends, and reports the difference.
//!
//! An entry is claimed with one compare-and-swap on `state` (EMPTY → FILLING), its key
//! written, then published (READY); only READY entries are read. A key's slot is found by
//! open addressing from its hash ([`CudaLaunchKey::row_id`]), at most [`PROBES`] slots on;
//! a launch that finds no room is counted in [`Header::full`], a loss the report shows.
//!
//! For a tracing session the library also writes each launch it counts as an [`Event`] in
//! a ring after the entries (its time, thread, CPU and entry), which tracerd drains into the
//! trace: writers claim a place with one add on [`Header::events`] and publish it by writing
//! its `seq` last; a place written over before tracerd read it is a counted loss.

use crate::CudaLaunchKey;

/// `b"trlaunch"`, little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"trlaunch");
/// Bumped whenever anything below changes shape.
pub const VERSION: u32 = 3;
/// Entries in the table (a power of two).
pub const SLOTS: usize = 8192;
/// Places in the event ring (a power of two): 8 MiB, untouched pages costing nothing.
pub const EVENTS: usize = 262_144;
/// How many slots an insertion looks at before counting the launch as lost.
pub const PROBES: usize = 64;
/// The memfd's name, as `/proc/PID/fd/N` shows it (`memfd:` + this).
pub const MEMFD_NAME: &str = "tracer-cuda-launches";

/// A launched command's library, waiting in `cuInit` for tracerd's answer, says this in its
/// status line; and this before why, where it cannot count launches there.
pub const WAITING: &str = "launches: waiting for tracerd";
pub const CANNOT: &str = "cannot count them here: ";
/// The variable a session's launcher sets for the library to count launches in the command
/// (and its children), beside `CUDA_INJECTION64_PATH`.
pub const LAUNCHES_VAR: &str = "TRACER_CUPTI_LAUNCHES";

/// `tracer_cupti_want_launches`: tracerd's ask, in bits.
pub mod want {
    /// Count launches, with kernel records (GPU times) if the library turns on now.
    pub const RECORDS: u64 = 1;
    /// Count launches without kernel records.
    pub const ONLY: u64 = 2;
    /// Also write each launch counted as an [`super::Event`] (a tracing session).
    pub const EVENTS: u64 = 4;
}

/// `Entry::state`.
pub mod state {
    pub const EMPTY: u32 = 0;
    /// Claimed, key being written: readers skip it.
    pub const FILLING: u32 = 1;
    pub const READY: u32 = 2;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Header {
    pub magic: u64,
    pub version: u32,
    pub slots: u32,
    /// Launches not counted: no free slot within [`PROBES`] of their key's.
    pub full: u64,
    /// A runtime launch under way when counting started inside the `cuInit` it ran (its
    /// entry callback came before counting did), until its row is made from a later
    /// callback of the call: a loss while it stands.
    pub unseen: u64,
    /// Event places claimed so far: the next event's number (places are numbers modulo
    /// [`EVENTS`]).
    pub events: u64,
    pub _reserved: [u64; 3],
}

/// One row: a launch key (its `slot` and `pid` unused: 0) and how many launches had it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Entry {
    pub state: u32,
    pub _pad: u32,
    pub key: CudaLaunchKey,
    /// CUPTI's `symbolName` for the launch (the kernel's mangled name, a string CUPTI keeps
    /// for the process's life), read by tracerd from the process's memory.
    pub name: u64,
    pub _reserved: u64,
    pub count: u64,
}

/// One launch counted, for a tracing session: published when `seq` is its number + 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// Its number + 1 once written; [`WRITING`] while a writer fills the place.
    pub seq: u64,
    /// CLOCK_MONOTONIC, as the probes' `bpf_ktime_get_ns`.
    pub start_ns: u64,
    pub tid: u32,
    pub cpu: u32,
    /// The entry counted (its index in the table).
    pub entry: u32,
    pub _pad: u32,
}

/// `Event::seq` while its place is being written.
pub const WRITING: u64 = u64::MAX;

/// Where the event ring starts in the file.
pub const RING_AT: usize = core::mem::size_of::<Header>() + SLOTS * core::mem::size_of::<Entry>();
/// The file's size in bytes.
pub const BYTES: usize = RING_AT + EVENTS * core::mem::size_of::<Event>();

/// The slot a key's search starts at.
pub fn first_slot(key: &CudaLaunchKey) -> usize {
    key.row_id() as usize & (SLOTS - 1)
}

const _: () = assert!(SLOTS.is_power_of_two() && EVENTS.is_power_of_two());
const _: () = assert!(core::mem::size_of::<Event>() == 32);
const _: () = assert!(core::mem::size_of::<Header>() == 64);
const _: () = assert!(core::mem::size_of::<Entry>() == 128);
