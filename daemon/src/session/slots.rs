//! Session slots: the bits of the BPF masks that say which sessions follow a process (64),
//! of which the lowest `MAX_PY_SESSIONS` can also count Python. A user other than root holds
//! at most a share of each kind, and the last few of each stay free for root, so that no
//! user can lock root or the others out.

use tokio::sync::mpsc::UnboundedSender;
use tracer_common::{MAX_PY_SESSIONS, MAX_TRACKED_SESSIONS};

use crate::error::Error;

/// Sessions counting Python that one user other than root may run at once.
pub const USER_PYTHON: u32 = 4;
/// Sessions that follow processes that one user other than root may run at once.
pub const USER_FOLLOWING: u32 = 16;
/// Python slots only root may take.
pub const ROOT_PYTHON: u32 = 2;
/// Slots of any kind only root may take.
pub const ROOT_ANY: u32 = 8;

/// A slot kept taken ([`Slots::hold`]) until this is dropped, when it is sent to be let go.
pub struct Hold {
    slot: u8,
    let_go: UnboundedSender<u8>,
}

impl Hold {
    /// `slot` must be held already; `let_go` leads to [`Slots::unhold`].
    pub fn new(slot: u8, let_go: UnboundedSender<u8>) -> Self {
        Self { slot, let_go }
    }

    pub fn slot(&self) -> u8 {
        self.slot
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let _ = self.let_go.send(self.slot);
    }
}

/// An ended session's last counts of one kind: read on the manager's task, or read where
/// waiting is fine from the maps opened again, its slot held until then.
pub enum LastCounts<M, T> {
    Read(T),
    Later(M, Hold),
}

/// Maps opened again that give a slot's counts.
pub trait SlotMaps {
    type Counts;
    fn take(&mut self, slot: u8) -> Self::Counts;
}

impl SlotMaps for tracer_bpf::NativeMaps {
    type Counts = Vec<(u32, u32, u64)>;
    fn take(&mut self, slot: u8) -> Self::Counts {
        tracer_bpf::NativeMaps::take(self, slot)
    }
}

impl SlotMaps for tracer_bpf::CudaMaps {
    type Counts = (tracer_bpf::CudaCounts, tracer_bpf::GpuKernelTimes);
    fn take(&mut self, slot: u8) -> Self::Counts {
        tracer_bpf::CudaMaps::take(self, slot)
    }
}

impl<M: SlotMaps> LastCounts<M, M::Counts> {
    /// The counts, taken out of the maps if not read yet; the slot is let go after.
    pub fn get(self) -> M::Counts {
        match self {
            Self::Read(counts) => counts,
            Self::Later(mut maps, hold) => maps.take(hold.slot()),
        }
    }
}

pub struct Slots {
    used: u64,
    /// Slots taken by sessions counting Python.
    python: u64,
    owner: [u32; MAX_TRACKED_SESSIONS],
    /// Per slot, how often it is held: its ended session's last counts are still being read
    /// out of the kernel maps, or probes attached for it are still to come off. A held slot
    /// stays taken past `free` until each `hold` is matched by an `unhold`.
    held: [u16; MAX_TRACKED_SESSIONS],
    /// Held slots that `free` was asked to free.
    freed: u64,
}

impl Default for Slots {
    fn default() -> Self {
        Self {
            used: 0,
            python: 0,
            owner: [0; MAX_TRACKED_SESSIONS],
            held: [0; MAX_TRACKED_SESSIONS],
            freed: 0,
        }
    }
}

impl Slots {
    /// A free slot for a session of `uid`: one of the lowest for sessions counting Python;
    /// the highest free one for the others, to leave those alone.
    pub fn take(&mut self, uid: u32, python: bool) -> Result<u8, Error> {
        if uid != 0 {
            self.within_quota(uid, python)?;
        }
        let free = |i: &u8| self.used & (1 << i) == 0;
        let slot = if python {
            (0..MAX_PY_SESSIONS as u8).find(free).ok_or_else(|| {
                Error::ResourceExhausted(format!(
                    "at most {MAX_PY_SESSIONS} sessions may count Python calls at once"
                ))
            })?
        } else {
            (0..MAX_TRACKED_SESSIONS as u8)
                .rev()
                .find(free)
                .ok_or_else(|| {
                    Error::ResourceExhausted(format!(
                        "at most {MAX_TRACKED_SESSIONS} sessions may follow processes at once"
                    ))
                })?
        };
        self.used |= 1 << slot;
        if python {
            self.python |= 1 << slot;
        }
        self.owner[usize::from(slot)] = uid;
        Ok(slot)
    }

    /// Whether the slot is free now (else once it is let go).
    pub fn free(&mut self, slot: u8) -> bool {
        if self.held[usize::from(slot)] != 0 {
            self.freed |= 1 << slot;
            return false;
        }
        self.used &= !(1 << slot);
        self.python &= !(1 << slot);
        true
    }

    /// Keeps `slot` taken, past `free`, until `unhold`: another session in it would have
    /// its counts mixed with the last ones of the slot's ended session, still being read.
    pub fn hold(&mut self, slot: u8) {
        self.held[usize::from(slot)] += 1;
    }

    /// Lets `slot` go once every hold is, if it was freed meanwhile: whether it is free now.
    pub fn unhold(&mut self, slot: u8) -> bool {
        let held = &mut self.held[usize::from(slot)];
        *held = held.saturating_sub(1);
        if *held == 0 && self.freed & (1 << slot) != 0 {
            self.freed &= !(1 << slot);
            return self.free(slot);
        }
        false
    }

    fn within_quota(&self, uid: u32, python: bool) -> Result<(), Error> {
        let of_uid = (0..MAX_TRACKED_SESSIONS)
            .filter(|&i| self.used & (1 << i) != 0 && self.owner[i] == uid)
            .fold(0u64, |m, i| m | 1 << i);
        let exhausted = |what: String| Err(Error::ResourceExhausted(what));
        if of_uid.count_ones() >= USER_FOLLOWING {
            return exhausted(format!(
                "uid {uid} runs {USER_FOLLOWING} sessions already, the most a user other than root may (stop one first)"
            ));
        }
        if python && (of_uid & self.python).count_ones() >= USER_PYTHON {
            return exhausted(format!(
                "uid {uid} runs {USER_PYTHON} sessions counting Python already, the most a user other than root may (stop one first)"
            ));
        }
        let py_mask = (1u64 << MAX_PY_SESSIONS) - 1;
        let free_python = (!self.used & py_mask).count_ones();
        if python && free_python <= ROOT_PYTHON {
            return exhausted(format!(
                "{free_python} of {MAX_PY_SESSIONS} slots for sessions counting Python are free, and are kept for root"
            ));
        }
        let free_any = MAX_TRACKED_SESSIONS as u32 - self.used.count_ones();
        if free_any <= ROOT_ANY {
            return exhausted(format!(
                "{free_any} of {MAX_TRACKED_SESSIONS} session slots are free, and are kept for root"
            ));
        }
        Ok(())
    }

    /// The quotas, as `tracerctl capabilities` shows them.
    pub fn describe() -> String {
        format!(
            "a user other than root runs at most {USER_FOLLOWING} sessions that follow processes and {USER_PYTHON} that count Python at once; the last {ROOT_ANY} session slots ({ROOT_PYTHON} of the {MAX_PY_SESSIONS} for Python) are kept for root"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A held slot is not taken again until it is both freed and let go, in either order,
    /// as often as it was held.
    #[test]
    fn held_slots_stay_taken_until_let_go() {
        let mut s = Slots::default();
        let a = s.take(0, true).unwrap();
        s.hold(a);
        assert!(!s.free(a), "free while held");
        assert_ne!(s.take(0, true).unwrap(), a, "taken again while held");
        assert!(s.unhold(a), "not free once let go");
        assert_eq!(s.take(0, true).unwrap(), a, "freed once let go");
        s.hold(a);
        assert!(!s.unhold(a), "free before it was freed");
        assert!(s.free(a));
        let b = s.take(0, true).unwrap();
        assert_eq!(b, a, "let go first, then freed");
        // Held twice (Python counts being read, CUDA probes still to come off): taken
        // again only once both let go.
        s.hold(a);
        s.hold(a);
        assert!(!s.free(a));
        assert!(!s.unhold(a), "free while held once more");
        let other = s.take(0, true).unwrap();
        assert_ne!(other, a, "taken again while held once more");
        assert!(s.unhold(a));
        assert_eq!(s.take(0, true).unwrap(), a, "freed once both let go");
    }

    #[test]
    fn users_have_quotas_and_root_keeps_room() {
        let mut s = Slots::default();
        for _ in 0..USER_PYTHON {
            s.take(1000, true).unwrap();
        }
        let e = s.take(1000, true).unwrap_err().to_string();
        assert!(e.contains("4 sessions counting Python"), "{e}");
        // Another user gets what is left above root's share.
        s.take(1001, true).unwrap();
        s.take(1001, true).unwrap();
        let e = s.take(1001, true).unwrap_err().to_string();
        assert!(e.contains("kept for root"), "{e}");
        s.take(0, true).unwrap();
        s.take(0, true).unwrap();
        assert!(s.take(0, true).is_err());
        // Following slots: users up to their quota, root beyond everyone.
        let mut s = Slots::default();
        let mut users = 0;
        for uid in 1000.. {
            match s.take(uid, false) {
                Ok(_) => users += 1,
                Err(e) => {
                    assert!(e.to_string().contains("kept for root"), "{e}");
                    break;
                }
            }
        }
        assert_eq!(users, MAX_TRACKED_SESSIONS as u32 - ROOT_ANY);
        for _ in 0..ROOT_ANY {
            s.take(0, false).unwrap();
        }
        assert!(s.take(0, false).is_err());
        let mut s = Slots::default();
        let held: Vec<u8> = (0..USER_FOLLOWING)
            .map(|_| s.take(7, false).unwrap())
            .collect();
        let e = s.take(7, false).unwrap_err().to_string();
        assert!(e.contains("uid 7 runs 16 sessions"), "{e}");
        // Freed, a slot is the user's to take again, once.
        s.free(held[0]);
        s.take(7, false).unwrap();
        assert!(s.take(7, false).is_err());
    }
}
