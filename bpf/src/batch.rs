//! Reading and clearing hash maps thousands of entries per syscall (`BPF_MAP_*_BATCH`,
//! Linux 5.6). A session's counts live in maps every session shares; read one entry at a
//! time (next key, lookup, delete: three syscalls each), the 40,000 entries of a Python
//! program with 20,000 functions held the manager ~100 ms at the session's end.

use std::{
    io,
    mem::size_of,
    os::fd::{AsRawFd, BorrowedFd},
};

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
/// Entries per call, to start with.
const CHUNK: usize = 4096;
/// A hash bucket never holds this many; past it the kernel's ENOSPC means something else.
const MAX_CHUNK: usize = 1 << 20;

/// `union bpf_attr`'s member for the batch commands.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid batch member of `bpf_attr`, its size passed with it; the
    // kernel touches only the buffers it names, within `count` entries of the map's sizes.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            size_of::<BatchAttr>(),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn zeroed<T: aya::Pod>() -> T {
    // SAFETY: a `Pod` type is plain bytes: every bit pattern, zeros included, is a value.
    unsafe { std::mem::zeroed() }
}

/// Every entry of the hash map `fd`, whose keys are `K` and values `V`.
pub fn entries<K: aya::Pod, V: aya::Pod>(fd: BorrowedFd<'_>) -> io::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    let mut chunk = CHUNK;
    // Where the next call starts: a bucket index the kernel hands back.
    let (mut at, mut next) = (None::<u64>, 0u64);
    loop {
        let mut keys = vec![zeroed::<K>(); chunk];
        let mut values = vec![zeroed::<V>(); chunk];
        let mut attr = BatchAttr {
            in_batch: at.as_ref().map_or(0, |a| std::ptr::from_ref(a) as u64),
            out_batch: std::ptr::from_mut(&mut next) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        let done = match bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
            Ok(()) => false,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            // One bucket holds more entries than fit: nothing was copied, ask again with room.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && chunk < MAX_CHUNK => {
                chunk *= 4;
                continue;
            }
            Err(e) => return Err(e),
        };
        let n = (attr.count as usize).min(chunk);
        out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        if done {
            return Ok(out);
        }
        at = Some(next);
    }
}

/// Deletes `keys` from the hash map `fd`. On an error (a key already gone, or a kernel
/// without batches) the keys from the failing one on may be left.
pub fn delete<K: aya::Pod>(fd: BorrowedFd<'_>, keys: &[K]) -> io::Result<()> {
    for part in keys.chunks(CHUNK) {
        let mut attr = BatchAttr {
            keys: part.as_ptr() as u64,
            count: part.len() as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        bpf(BPF_MAP_DELETE_BATCH, &mut attr)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    use super::*;

    /// `union bpf_attr`'s members for creating a map and for one element.
    #[repr(C)]
    #[derive(Default)]
    struct CreateAttr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
    }
    #[repr(C)]
    #[derive(Default)]
    struct ElemAttr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }

    fn sys<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<i64> {
        // SAFETY: `attr` is a `bpf_attr` member of the command, its size passed with it.
        let r =
            unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<T>()) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    fn hash_map(max: u32) -> OwnedFd {
        let mut attr = CreateAttr {
            map_type: 1, // BPF_MAP_TYPE_HASH
            key_size: 8,
            value_size: 16,
            max_entries: max,
            map_flags: 0,
        };
        let fd = sys(0, &mut attr).expect("creating a BPF hash map (needs root)");
        // SAFETY: BPF_MAP_CREATE returned a new descriptor that nothing else owns.
        unsafe { OwnedFd::from_raw_fd(fd as i32) }
    }

    fn one(fd: &OwnedFd, cmd: libc::c_long, key: u64, value: &mut [u64; 2]) -> io::Result<i64> {
        let mut attr = ElemAttr {
            map_fd: fd.as_raw_fd() as u32,
            key: std::ptr::from_ref(&key) as u64,
            value: value.as_mut_ptr() as u64,
            ..ElemAttr::default()
        };
        sys(cmd, &mut attr)
    }

    #[test]
    fn reads_every_entry_and_deletes_the_asked_ones() {
        let fd = hash_map(20_000);
        // More entries than one call takes, so that reading resumes where it stopped.
        for k in 0..10_000u64 {
            one(&fd, 2, k, &mut [k * 3, k + 7]).unwrap(); // BPF_MAP_UPDATE_ELEM
        }
        let mut all = entries::<u64, [u64; 2]>(fd.as_fd()).unwrap();
        all.sort_unstable();
        assert_eq!(all.len(), 10_000);
        assert!(all
            .iter()
            .enumerate()
            .all(|(i, &(k, v))| k == i as u64 && v == [k * 3, k + 7]));

        let odd: Vec<u64> = (0..10_000).filter(|k| k % 2 == 1).collect();
        delete(fd.as_fd(), &odd).unwrap();
        for k in [0u64, 1, 4_096, 4_097, 9_999] {
            let found = one(&fd, 1, k, &mut [0; 2]).is_ok(); // BPF_MAP_LOOKUP_ELEM
            assert_eq!(found, k % 2 == 0, "key {k}");
        }
        assert_eq!(entries::<u64, [u64; 2]>(fd.as_fd()).unwrap().len(), 5_000);
        // Deleting a key that is gone is an error, not silence.
        assert!(delete(fd.as_fd(), &[1u64]).is_err());
        assert!(entries::<u64, [u64; 2]>(hash_map(4).as_fd())
            .unwrap()
            .is_empty());
    }
}
