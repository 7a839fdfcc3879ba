//! tracer's kernel side, loaded and driven from user space: the BPF object (built from
//! `ebpf/probes` and embedded), its programs attached as tracepoints, uprobes (multi-uprobe
//! links or one perf event per probe) and perf events, its maps and rings read; BTF and
//! tracefs formats for the kernel's layouts; perf counters; the CPU sampler. It knows which
//! binaries and interpreters it probes (`tracer-inspect`), and no session.

mod batch;
mod bpf;
pub mod btf;
pub mod perf;
pub mod sampler;

pub use bpf::{
    ensure_tracefs, loss_cause_name, perf_link, publish_layout, release, slot_entries, verify_all,
    Bpf, BpfError, CudaAttacher, CudaCounts, CudaMaps, Figures, GpuKernelTimes, Loading,
    NativeAttacher, NativeMaps, OffCpuSession, ProbeSet, PythonAttacher, PythonMaps, SamplingMaps,
    TracingMaps, Verified, INSN_LIMIT, TRACEFS,
};
