//! Words of another process's memory, read with `process_vm_readv` in batches.

use std::io;

use nix::{
    sys::uio::{process_vm_readv, RemoteIoVec},
    unistd::Pid,
};

/// Vectors per `process_vm_readv` (the kernel's `UIO_MAXIOV`).
const BATCH: usize = 1024;

/// The 8-byte little-endian word at each of `addrs` in `pid`; None for one that is not
/// readable (unmapped). Err only when the process cannot be read at all (gone, not allowed).
pub fn words(pid: u32, addrs: &[u64]) -> io::Result<Vec<Option<u64>>> {
    let target = Pid::from_raw(i32::try_from(pid).map_err(|_| io::ErrorKind::InvalidInput)?);
    let mut out = Vec::with_capacity(addrs.len());
    for chunk in addrs.chunks(BATCH) {
        let mut buf = vec![0u8; chunk.len() * 8];
        let remote: Vec<RemoteIoVec> = chunk
            .iter()
            .map(|&a| RemoteIoVec {
                base: a as usize,
                len: 8,
            })
            .collect();
        // The kernel stops at the first vector it cannot read: those before it are good, and
        // the rest are read one by one.
        let n = match process_vm_readv(target, &mut [io::IoSliceMut::new(&mut buf)], &remote) {
            Ok(n) => n / 8,
            Err(nix::Error::EFAULT) => 0,
            Err(e) => return Err(e.into()),
        };
        for (i, &a) in chunk.iter().enumerate() {
            if i < n {
                let w = buf[i * 8..i * 8 + 8].try_into().expect("8 bytes");
                out.push(Some(u64::from_le_bytes(w)));
                continue;
            }
            let mut one = [0u8; 8];
            let read = process_vm_readv(
                target,
                &mut [io::IoSliceMut::new(&mut one)],
                &[RemoteIoVec {
                    base: a as usize,
                    len: 8,
                }],
            );
            out.push(matches!(read, Ok(8)).then(|| u64::from_le_bytes(one)));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_of_this_process_are_read_and_an_unmapped_one_is_none() {
        let values: Vec<u64> = (0..1500u64).map(|i| i * 0x1_0001 + 7).collect();
        let mut addrs: Vec<u64> = values.iter().map(|v| v as *const u64 as u64).collect();
        // Page 0 is never mapped: the batch stops there and the rest are read one by one.
        addrs.insert(700, 8);
        let got = words(std::process::id(), &addrs).unwrap();
        assert_eq!(got.len(), addrs.len());
        assert_eq!(got[700], None);
        let read: Vec<u64> = got
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != 700)
            .map(|(_, w)| w.unwrap())
            .collect();
        assert_eq!(read, values);
    }
}
