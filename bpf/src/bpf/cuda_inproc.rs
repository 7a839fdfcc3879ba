//! `CUDA_INPROC`: the processes whose kernel launches sessions count in-process, through
//! tracer's injection library, so that their launch probes skip them and the library's
//! launches from threads without Python are counted for those sessions alone.

use tracer_common::SessionMask;

use super::{map_err, Bpf, BpfError};

impl Bpf {
    /// Marks `pid`'s launches as counted in-process by session `slot`.
    pub fn set_cuda_inproc(&mut self, pid: u32, slot: u8) -> Result<(), BpfError> {
        let mask = self.cuda_inproc.get(&pid, 0).unwrap_or(0);
        self.cuda_inproc
            .insert(pid, mask | 1 << slot, 0)
            .map_err(map_err("CUDA_INPROC"))
    }

    /// Forgets `slot` everywhere in `CUDA_INPROC` (its session ended).
    pub fn clear_cuda_inproc(&mut self, slot: u8) {
        let pids: Vec<(u32, SessionMask)> = self
            .cuda_inproc
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, m)| m & (1 << slot) != 0)
            .collect();
        for (pid, mask) in pids {
            let rest = mask & !(1 << slot);
            let _ = if rest == 0 {
                self.cuda_inproc.remove(&pid)
            } else {
                self.cuda_inproc.insert(pid, rest, 0)
            };
        }
    }
}
