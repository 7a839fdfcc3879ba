//! Records and keys shared by the BPF programs (`ebpf/probes`) and the daemon.
//!
//! Every type is `#[repr(C)]`, `Copy`, and spells out its padding so that both compilers
//! agree on the layout byte for byte.
#![no_std]

/// How many sessions may follow processes at once: one bit each in [`SessionMask`].
pub const MAX_TRACKED_SESSIONS: usize = 64;

/// Bit `i` set: session slot `i` follows this process.
pub type SessionMask = u64;

/// `ProcEvent::kind`: a new process was forked by a followed one.
pub const PROC_EVENT_FORK: u32 = 1;
/// `ProcEvent::kind`: the last thread of a followed process exited.
pub const PROC_EVENT_EXIT: u32 = 2;

/// Sent on the `PROC_EVENTS` ring buffer when a followed process forks or exits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcEvent {
    pub kind: u32,
    /// Process id (thread-group id) of the new or exiting process.
    pub pid: u32,
    /// For forks: the parent's process id. For exits: 0.
    pub parent_pid: u32,
    pub _pad: u32,
    /// The sessions that follow this process.
    pub sessions: SessionMask,
    /// `bpf_ktime_get_ns` at the event.
    pub ktime_ns: u64,
    /// The command name (`comm`) of the forking or exiting task, NUL-padded.
    pub comm: [u8; 16],
}

/// Indices into the `LOSSES` per-CPU array: why an event could not be delivered.
pub mod loss {
    /// The ring buffer was full.
    pub const RINGBUF_FULL: u32 = 0;
    /// The `TRACKED` map was full: a forked child could not be followed.
    pub const TRACKED_MAP_FULL: u32 = 1;
    /// Number of loss causes (size of the `LOSSES` array).
    pub const COUNT: u32 = 2;
}

/// Capacity of the `TRACKED` map (followed processes, all sessions together).
pub const TRACKED_MAX_ENTRIES: u32 = 65_536;

/// Tracepoint field offsets read from tracefs at load time, so one object fits every kernel.
/// Set as globals by the loader; `u32::MAX` means "field absent".
pub mod globals {
    pub const NEWTASK_PID_OFFSET: &str = "NEWTASK_PID_OFFSET";
    pub const NEWTASK_CLONE_FLAGS_OFFSET: &str = "NEWTASK_CLONE_FLAGS_OFFSET";
    pub const EXIT_GROUP_DEAD_OFFSET: &str = "EXIT_GROUP_DEAD_OFFSET";
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), Copy, every field an integer and every byte covered (no implicit padding).
    unsafe impl aya::Pod for super::ProcEvent {}
}

#[cfg(test)]
mod tests {
    #[test]
    fn proc_event_has_no_hidden_padding() {
        assert_eq!(core::mem::size_of::<super::ProcEvent>(), 4 * 4 + 8 + 8 + 16);
    }
}
