//! `--uprobe` native-call counting: its map key, capacity and attach cookie.

/// Key of `NATIVE_CALLS`: calls of one probed native function in one process, for one
/// session. The value is the count (u64).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NativeCallKey {
    pub slot: u32,
    pub pid: u32,
    /// The daemon's number for the probed function.
    pub probe: u32,
    pub _pad: u32,
}

/// Capacity of `NATIVE_CALLS`.
pub const NATIVE_CALLS_MAX: u32 = 65_536;

/// The attach cookie of a native-call probe: session slot, whether the session counts every
/// process, and the probe's number.
pub mod native_cookie {
    pub const SLOT_SHIFT: u64 = 32;
    pub const ALL: u64 = 1 << 31;
    pub const PROBE_MASK: u64 = (1 << 31) - 1;

    pub const fn make(slot: u8, all: bool, probe: u32) -> u64 {
        ((slot as u64) << SLOT_SHIFT) | if all { ALL } else { 0 } | (probe as u64 & PROBE_MASK)
    }
}
