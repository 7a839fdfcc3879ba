//! `CUDA_INPROC`: the processes whose kernel launches sessions count in-process, through
//! tracer's injection library, so that their launch probes skip them and the library's
//! launches from threads without Python are counted for those sessions alone.

use super::{map_err, maps, Bpf, BpfError};

impl Bpf {
    /// Marks `pid`'s launches as counted in-process by session `slot`.
    pub fn set_cuda_inproc(&mut self, pid: u32, slot: u8) -> Result<(), BpfError> {
        maps::add_slot(&mut self.cuda_inproc, pid, slot).map_err(map_err("CUDA_INPROC"))
    }

    /// Forgets `slot` everywhere in `CUDA_INPROC` (its session ended).
    pub fn clear_cuda_inproc(&mut self, slot: u8) {
        maps::clear_slot(&mut self.cuda_inproc, slot);
    }
}
