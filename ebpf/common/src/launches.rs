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

use crate::CudaLaunchKey;

/// `b"trlaunch"`, little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"trlaunch");
/// Bumped whenever anything below changes shape.
pub const VERSION: u32 = 2;
/// Entries in the table (a power of two).
pub const SLOTS: usize = 8192;
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
    pub _reserved: [u64; 4],
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

/// The file's size in bytes.
pub const BYTES: usize = core::mem::size_of::<Header>() + SLOTS * core::mem::size_of::<Entry>();

/// The slot a key's search starts at.
pub fn first_slot(key: &CudaLaunchKey) -> usize {
    key.row_id() as usize & (SLOTS - 1)
}

const _: () = assert!(SLOTS.is_power_of_two());
const _: () = assert!(core::mem::size_of::<Header>() == 64);
const _: () = assert!(core::mem::size_of::<Entry>() == 128);
