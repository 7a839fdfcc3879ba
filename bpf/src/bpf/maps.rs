//! Maps opened again by a session's end, so that its counts are read off the manager's task,
//! and the maps the tracing and sampling workers take out of the object.

use aya::maps::{HashMap, MapData, MapError, PerCpuArray, RingBuf, StackTraceMap};
use tracer_common::{
    CudaLaunchKey, CudaMemKey, CudaMemStats, GpuKernelKey, GpuKernelStats, NativeCallKey,
    PyAsyncLayout, PyCallKey, PyCallStats, PyEdgeKey, PySampleProc, SessionMask,
};

use super::BpfError;

/// Sets `slot`'s bit in `pid`'s mask of a pid → sessions map (`PY_INPROC`, `CUDA_INPROC`).
pub fn add_slot(
    map: &mut HashMap<MapData, u32, SessionMask>,
    pid: u32,
    slot: u8,
) -> Result<(), MapError> {
    let mask = map.get(&pid, 0).unwrap_or(0);
    map.insert(pid, mask | 1 << slot, 0)
}

/// Clears `slot`'s bit in every mask of a pid → sessions map, removing masks left empty.
pub fn clear_slot(map: &mut HashMap<MapData, u32, SessionMask>, slot: u8) {
    let pids: Vec<(u32, SessionMask)> = map
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, m)| m & (1 << slot) != 0)
        .collect();
    for (pid, mask) in pids {
        let rest = mask & !(1 << slot);
        let _ = if rest == 0 {
            map.remove(&pid)
        } else {
            map.insert(pid, rest, 0)
        };
    }
}

/// The entries of a map shared by sessions whose key `belongs` to one session, read, and
/// taken out of the map with `take` (at the session's end) or left there (live readings).
/// In batches where the kernel has them, else one entry at a time.
pub fn slot_entries<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    belongs: impl Fn(&K) -> bool,
    take: bool,
) -> Vec<(K, V)> {
    use std::os::fd::AsFd;

    use aya::maps::IterableMap;
    let all = match crate::batch::entries::<K, V>(map.map().fd().as_fd()) {
        Ok(all) => all,
        Err(e) => {
            tracing::debug!(%e, "batch map reads: reading one entry at a time");
            return slot_entries_one_by_one(map, belongs, take);
        }
    };
    let mine: Vec<(K, V)> = all.into_iter().filter(|(k, _)| belongs(k)).collect();
    if take {
        let keys: Vec<K> = mine.iter().map(|(k, _)| *k).collect();
        if crate::batch::delete(map.map().fd().as_fd(), &keys).is_err() {
            for k in &keys {
                let _ = map.remove(k);
            }
        }
    }
    mine
}

fn slot_entries_one_by_one<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    belongs: impl Fn(&K) -> bool,
    take: bool,
) -> Vec<(K, V)> {
    let keys: Vec<K> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| belongs(k))
        .collect();
    let mut out = Vec::with_capacity(keys.len());
    for k in keys {
        if let Ok(v) = map.get(&k, 0) {
            out.push((k, v));
        }
        if take {
            let _ = map.remove(&k);
        }
    }
    out
}

/// A map shared by sessions, opened again (its fd duplicated) for another thread to read.
pub(super) fn reopen<K: aya::Pod, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>, BpfError> {
    use std::os::fd::AsFd;

    use aya::maps::IterableMap;
    let err = |source: MapError| BpfError::Map {
        name,
        source: Box::new(source),
    };
    let fd = map
        .map()
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|io_error| {
            err(MapError::SyscallError(aya::sys::SyscallError {
                call: "dup",
                io_error,
            }))
        })?;
    let data = MapData::from_fd(fd).map_err(err)?;
    HashMap::try_from(aya::maps::Map::HashMap(data)).map_err(err)
}

/// The native-call counts map, opened again for reading a session's last counts off the
/// thread that owns [`Bpf`].
pub struct NativeMaps {
    pub(super) calls: HashMap<MapData, NativeCallKey, u64>,
}

impl NativeMaps {
    /// The counts (pid, probe, calls) of `slot`, taken out of the map.
    pub fn take(&mut self, slot: u8) -> Vec<(u32, u32, u64)> {
        native_counts(&mut self.calls, slot, true)
    }
}

/// The CUDA count maps, opened again for reading a session's last counts off the thread
/// that owns [`Bpf`].
pub struct CudaMaps {
    pub(super) launches: HashMap<MapData, CudaLaunchKey, u64>,
    pub(super) memory: HashMap<MapData, CudaMemKey, CudaMemStats>,
    pub(super) gpu_kernels: HashMap<MapData, GpuKernelKey, GpuKernelStats>,
}

impl CudaMaps {
    /// The launch counts, memory totals and GPU kernel times of `slot`, taken out of the maps.
    pub fn take(&mut self, slot: u8) -> (CudaCounts, GpuKernelTimes) {
        (
            cuda_counts(&mut self.launches, &mut self.memory, slot, true),
            gpu_kernel_times(&mut self.gpu_kernels, slot, true),
        )
    }
}

/// A session's GPU kernel times (CUPTI), as the kernel keeps them.
pub type GpuKernelTimes = Vec<(GpuKernelKey, GpuKernelStats)>;

pub(super) fn cuda_counts(
    launches: &mut HashMap<MapData, CudaLaunchKey, u64>,
    memory: &mut HashMap<MapData, CudaMemKey, CudaMemStats>,
    slot: u8,
    take: bool,
) -> CudaCounts {
    let slot = u32::from(slot);
    (
        slot_entries(launches, |k| k.slot == slot, take),
        slot_entries(memory, |k| k.slot == slot, take),
    )
}

pub(super) fn gpu_kernel_times(
    map: &mut HashMap<MapData, GpuKernelKey, GpuKernelStats>,
    slot: u8,
    take: bool,
) -> GpuKernelTimes {
    let slot = u32::from(slot);
    slot_entries(map, |k| k.slot == slot, take)
}

pub(super) fn native_counts(
    map: &mut HashMap<MapData, NativeCallKey, u64>,
    slot: u8,
    take: bool,
) -> Vec<(u32, u32, u64)> {
    slot_entries(map, |k| k.slot == u32::from(slot), take)
        .into_iter()
        .map(|(k, n)| (k.pid, k.probe, n))
        .collect()
}

/// A session's Python counts and caller pairs, as the kernel keeps them.
pub type PythonCounts = (Vec<(PyCallKey, PyCallStats)>, Vec<(PyEdgeKey, PyCallStats)>);

/// The Python call and caller-pair maps, opened again for reading a session's last counts
/// off the thread that owns [`Bpf`].
pub struct PythonMaps {
    pub(super) calls: HashMap<MapData, PyCallKey, PyCallStats>,
    pub(super) edges: HashMap<MapData, PyEdgeKey, PyCallStats>,
}

impl PythonMaps {
    /// The counts and caller pairs of `slot`, taken out of the maps.
    pub fn take(&mut self, slot: u8) -> PythonCounts {
        let slot = u32::from(slot);
        (
            slot_entries(&mut self.calls, |k| k.slot == slot, true),
            slot_entries(&mut self.edges, |k| k.call.slot == slot, true),
        )
    }
}

/// The maps trace events come through, taken out of the BPF object.
pub struct TracingMaps {
    pub events: RingBuf<MapData>,
    /// Events dropped on a full ring buffer, per session slot.
    pub drops: PerCpuArray<MapData, u64>,
}

/// The maps the sampling program fills, taken out of the BPF object.
pub struct SamplingMaps {
    pub samples: RingBuf<MapData>,
    pub kernel_stacks: StackTraceMap<MapData>,
    pub python_procs: HashMap<MapData, u32, PySampleProc>,
    /// 3.14+ processes whose asyncio tasks the probe reads.
    pub async_procs: HashMap<MapData, u32, PyAsyncLayout>,
}

/// A session's CUDA launch counts and memory totals.
pub type CudaCounts = (Vec<(CudaLaunchKey, u64)>, Vec<(CudaMemKey, CudaMemStats)>);
