//! Kernel handles a warm process got before the session and keeps in statics: CUDA 13's host
//! stubs keep their runtime handle in one (`__cudaGetKernel(&handle, stub)`), cluster
//! launchers their driver function (`cudaGetFuncBySymbol(&f, stub)`). The calls' arguments
//! are read from the binary's code and the statics from the process
//! ([`tracer_inspect::cuda::Registrations`]), while it runs: on a thread of the session's
//! own, since a library's code is scanned (libtorch_cuda's: hundreds of MB), at the first
//! new row whose handle has no name, once per process and binary.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    sync::{mpsc, Arc, Mutex},
    thread::JoinHandle,
};

use tracer_inspect::{cuda::Registrations, unwind::ProcMaps};

use super::callers::ProcAddr;

/// A binary of a process to read handles from.
struct Ask {
    pid: u32,
    /// The binary, kept open by the session's callers.
    file: File,
    /// An address of the process in it, and that address's offset in the file.
    addr: u64,
    file_offset: u64,
}

#[derive(Default)]
pub(super) struct Handles {
    /// (pid, binary) pairs asked for already.
    asked: HashSet<(u32, usize)>,
    reader: Option<(mpsc::Sender<Ask>, JoinHandle<Read>)>,
    found: Arc<Mutex<HashMap<ProcAddr, String>>>,
}

impl Handles {
    /// Reads, once per process and binary (`binary`: its index among the session's), the
    /// handles kept by the code of `file`, where `pid` maps `addr` at `file_offset`.
    pub fn ask(&mut self, pid: u32, binary: usize, file: &File, addr: u64, file_offset: u64) {
        if !self.asked.insert((pid, binary)) {
            return;
        }
        let Ok(file) = file.try_clone() else { return };
        if self.reader.is_none() {
            let (tx, rx) = mpsc::channel::<Ask>();
            let found = self.found.clone();
            let spawned = std::thread::Builder::new()
                .name("cuda-handles".into())
                .spawn(move || read_all(&rx, &found));
            match spawned {
                Ok(thread) => self.reader = Some((tx, thread)),
                Err(e) => {
                    tracing::warn!(%e, "no thread to read kernel handles with");
                    return;
                }
            }
        }
        if let Some((tx, _)) = &self.reader {
            let _ = tx.send(Ask {
                pid,
                file,
                addr,
                file_offset,
            });
        }
    }

    /// What was found so far.
    pub fn so_far(&self) -> HashMap<ProcAddr, String> {
        self.found.lock().map(|f| f.clone()).unwrap_or_default()
    }

    /// Everything found, once what was asked has been read; and the binaries read, for the
    /// names of their host functions.
    pub fn finish(mut self) -> (HashMap<ProcAddr, String>, Read) {
        let read = match self.reader.take() {
            Some((tx, thread)) => {
                drop(tx);
                thread.join().unwrap_or_default()
            }
            None => Read::default(),
        };
        (self.so_far(), read)
    }
}

/// Binaries' registrations by (device, inode): a library is read once for every process
/// that maps it.
pub(super) type Read = HashMap<(u64, u64), Registrations>;

fn read_all(rx: &mpsc::Receiver<Ask>, found: &Mutex<HashMap<ProcAddr, String>>) -> Read {
    let mut read = Read::new();
    while let Ok(ask) = rx.recv() {
        let Ok(meta) = ask.file.metadata() else {
            continue;
        };
        let registered = read.entry((meta.dev(), meta.ino())).or_insert_with(|| {
            let path = format!("/proc/self/fd/{}", ask.file.as_raw_fd());
            tracer_inspect::binary::map(path)
                .map(|data| Registrations::read(&data))
                .unwrap_or_default()
        });
        if !registered.has_handles() {
            continue;
        }
        // The process still maps this file at that address: not a pid reused since.
        let device = tracer_inspect::process::device(&meta);
        let same = ProcMaps::read(ask.pid).is_ok_and(|maps| {
            maps.find(ask.addr)
                .is_some_and(|m| m.is_file() && m.dev == device && m.inode == meta.ino())
        });
        let Some(vaddr) = registered.vaddr(ask.file_offset).filter(|_| same) else {
            continue;
        };
        match registered.handles(ask.pid, ask.addr.wrapping_sub(vaddr)) {
            Ok(handles) => {
                if let Ok(mut f) = found.lock() {
                    f.extend(handles.into_iter().map(|(h, n)| ((ask.pid, h), n)));
                }
            }
            Err(e) => tracing::debug!(pid = ask.pid, %e, "kernel handle statics not readable"),
        }
    }
    read
}
