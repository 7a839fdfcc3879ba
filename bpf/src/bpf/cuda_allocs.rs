//! `CUDA_ALLOCS`: each session's record of the allocations it saw, for the bytes of their
//! frees. A session's records go with it: allocations it saw but whose frees it did not
//! would otherwise fill the map for later sessions.

use super::{maps, Bpf};

impl Bpf {
    /// Forgets session `slot`'s records of allocations (its session ended), in batches.
    pub fn clear_cuda_allocs(&mut self, slot: u8) {
        // The key's first word: pid | driver << 32 | slot << 33 (`alloc_owner` in the probes).
        let mine = |k: &[u64; 2]| k[0] >> 33 == u64::from(slot);
        maps::slot_entries(&mut self.cuda_allocs, mine, true);
    }
}
