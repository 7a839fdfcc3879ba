//! The report's container attribution, from what `tracer-inspect` notes of each process.

pub use tracer_inspect::container::{forget_exited, note, of};

use tracer_report::{Origin, ProcessOrigin};

/// The processes among `pids` that ran in a container or pod, and where, or that named
/// their service.
pub fn attribute(pids: impl IntoIterator<Item = u32>) -> Vec<ProcessOrigin> {
    tracer_inspect::container::attribute(pids)
        .into_iter()
        .map(|(pid, o)| ProcessOrigin {
            pid,
            origin: Origin {
                cgroup: o.cgroup,
                runtime: o.runtime,
                container_id: o.container_id,
                pod_uid: o.pod_uid,
                qos: o.qos,
                hostname: o.hostname,
                service_name: o.service_name,
            },
        })
        .collect()
}

/// This machine's name, as tracerd's own UTS namespace has it (a DaemonSet's pod shares the
/// node's with `hostNetwork`): pushed windows' `node` label, OTLP's `host.name`.
pub fn host_name() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.nodename().to_string_lossy().into_owned())
        .unwrap_or_default()
}
