//! Which container and Kubernetes pod a process runs in: from its cgroup path, as container
//! runtimes and the kubelet name their cgroups (systemd and cgroupfs drivers), and its
//! hostname (in Kubernetes, the pod's name unless the pod sets another).
//!
//! A process may also name the service it is, as OpenTelemetry's SDKs read it from their
//! environment (`OTEL_SERVICE_NAME`, or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`): its
//! initial environment tells.
//!
//! Processes are noted while they live (first event, first sample, fork); reports attribute
//! every pid they name from these notes, so processes that exited are attributed too.

use std::{
    collections::HashMap,
    sync::{Mutex, OnceLock},
};

/// Which container and Kubernetes pod a process runs in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Origin {
    /// The cgroup path that names the container (or the unified hierarchy's).
    pub cgroup: String,
    /// containerd, cri-o, docker or podman; "cri" for a kubelet cgroupfs path.
    pub runtime: Option<String>,
    pub container_id: Option<String>,
    pub pod_uid: Option<String>,
    /// The pod's QoS class: guaranteed, burstable or besteffort.
    pub qos: Option<String>,
    /// The container's /etc/hostname (a pod's name by default).
    pub hostname: Option<String>,
    /// The OpenTelemetry service name the process's environment gives.
    pub service_name: Option<String>,
}

impl Origin {
    pub fn in_container(&self) -> bool {
        self.container_id.is_some() || self.pod_uid.is_some()
    }

    /// Whether reports attribute the process: in a container, or naming its service.
    pub fn attributed(&self) -> bool {
        self.in_container() || self.service_name.is_some()
    }
}

/// The environment read at most: `ARG_MAX`'s usual share for it, far more than any
/// service's; a process choosing a larger one is only read so far.
const MAX_ENVIRON: u64 = 1 << 20;
/// A service name's longest: the process chooses it, the report carries it.
const MAX_SERVICE_NAME: usize = 256;

/// The service name a process's initial environment (`/proc/PID/environ`) declares.
pub fn service_name(pid: u32) -> Option<String> {
    use std::io::Read;
    let mut env = Vec::new();
    std::fs::File::open(format!("/proc/{pid}/environ"))
        .ok()?
        .take(MAX_ENVIRON)
        .read_to_end(&mut env)
        .ok()?;
    service_in(&env)
}

/// `OTEL_SERVICE_NAME`, else `service.name` in `OTEL_RESOURCE_ATTRIBUTES` (comma-separated
/// `key=value`, values percent-encoded), as OpenTelemetry's SDKs choose; control characters
/// dropped, at most [`MAX_SERVICE_NAME`] characters.
pub fn service_in(environ: &[u8]) -> Option<String> {
    let var = |name: &str| {
        environ
            .split(|&b| b == 0)
            .filter_map(|kv| kv.strip_prefix(name.as_bytes())?.strip_prefix(b"="))
            .next_back()
            .map(String::from_utf8_lossy)
    };
    let clean = |v: &str| {
        let v: String = v
            .trim()
            .chars()
            .filter(|c| !c.is_control())
            .take(MAX_SERVICE_NAME)
            .collect();
        (!v.is_empty()).then_some(v)
    };
    if let Some(name) = var("OTEL_SERVICE_NAME").and_then(|v| clean(&v)) {
        return Some(name);
    }
    let attrs = var("OTEL_RESOURCE_ATTRIBUTES")?;
    attrs
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| k.trim() == "service.name")
        .filter_map(|(_, v)| clean(&percent_decoded(v.trim())))
        .next_back()
}

fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |j: usize| b.get(j).and_then(|&c| (c as char).to_digit(16));
        match (b[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, ..) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// What a cgroup path says: its pod, QoS class, container and runtime.
pub fn parse(cgroup: &str) -> Origin {
    let mut o = Origin {
        cgroup: cgroup.to_owned(),
        ..Origin::default()
    };
    let parts: Vec<&str> = cgroup.split('/').filter(|p| !p.is_empty()).collect();
    let kube = parts.iter().position(|p| p.starts_with("kubepods"));
    for (i, p) in parts.iter().enumerate() {
        let stem = p
            .strip_suffix(".slice")
            .or(p.strip_suffix(".scope"))
            .unwrap_or(p);
        if kube.is_some_and(|k| i >= k) {
            for qos in ["burstable", "besteffort"] {
                if *p == qos || stem.ends_with(&format!("-{qos}")) {
                    o.qos = Some(qos.into());
                }
            }
            // systemd: kubepods-burstable-pod<uid with _>.slice; cgroupfs: pod<uid>.
            if let Some(uid) = stem
                .rsplit_once("-pod")
                .map(|(_, u)| u)
                .or(stem.strip_prefix("pod"))
            {
                if uid.len() >= 32 {
                    o.pod_uid = Some(uid.replace('_', "-"));
                }
            }
        }
        let container = [
            ("cri-containerd-", "containerd"),
            ("crio-", "cri-o"),
            ("docker-", "docker"),
            ("libpod-", "podman"),
        ]
        .iter()
        .find_map(|(prefix, rt)| {
            stem.strip_prefix(prefix)
                .filter(|id| is_id(id))
                .map(|id| (id, *rt))
        });
        if let Some((id, rt)) = container {
            o.container_id = Some(id.into());
            o.runtime = Some(rt.into());
        } else if is_id(stem) {
            // cgroupfs layouts: /docker/<id>, /kubepods/<qos>/pod<uid>/<id>.
            o.container_id = Some(stem.into());
            o.runtime = Some(match i.checked_sub(1).map(|j| parts[j]) {
                Some("docker") => "docker".into(),
                _ if o.pod_uid.is_some() => "cri".into(),
                _ => "unknown".into(),
            });
        }
    }
    if kube.is_some() && o.pod_uid.is_some() && o.qos.is_none() {
        o.qos = Some("guaranteed".into());
    }
    o
}

/// The origin of a live process: the first of its cgroup paths (one per hierarchy) that
/// names a container, else its unified (v2) path, else the longest.
pub fn of(pid: u32) -> Option<Origin> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let paths: Vec<&str> = text
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .collect();
    let mut origin = paths
        .iter()
        .map(|p| parse(p))
        .find(Origin::in_container)
        .or_else(|| {
            let unified = text.lines().find_map(|l| l.strip_prefix("0::"));
            let best = unified
                .filter(|u| *u != "/")
                .or_else(|| paths.iter().copied().max_by_key(|p| p.len()))?;
            Some(parse(best))
        })?;
    if origin.in_container() {
        origin.hostname = std::fs::read_to_string(format!("/proc/{pid}/root/etc/hostname"))
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty());
    }
    origin.service_name = service_name(pid);
    Some(origin)
}

/// Bounds the notes; past it, new processes are looked up only at report time.
const MAX_NOTED: usize = 1 << 16;

fn notes() -> &'static Mutex<HashMap<u32, Origin>> {
    static NOTES: OnceLock<Mutex<HashMap<u32, Origin>>> = OnceLock::new();
    NOTES.get_or_init(Default::default)
}

/// Notes where a live process runs, once per pid (`refresh`: again, after a fork or exec).
pub fn note(pid: u32, refresh: bool) {
    let mut n = notes().lock().unwrap_or_else(|e| e.into_inner());
    if (!refresh && n.contains_key(&pid)) || n.len() >= MAX_NOTED {
        return;
    }
    if let Some(o) = of(pid) {
        n.insert(pid, o);
    }
}

/// Origins of these pids (read now for live ones: a process may have moved since it was
/// noted; noted for those gone), those in containers or naming their service only.
pub fn attribute(pids: impl IntoIterator<Item = u32>) -> Vec<(u32, Origin)> {
    let n = notes().lock().unwrap_or_else(|e| e.into_inner());
    // In pid order, each once.
    pids.into_iter()
        .collect::<std::collections::BTreeSet<u32>>()
        .into_iter()
        .filter_map(|pid| Some((pid, of(pid).or_else(|| n.get(&pid).cloned())?)))
        .filter(|(_, o)| o.attributed())
        .collect()
}

/// Drops the notes of processes that are gone (when no session needs them any more).
pub fn forget_exited() {
    let mut n = notes().lock().unwrap_or_else(|e| e.into_inner());
    n.retain(|pid, _| std::path::Path::new(&format!("/proc/{pid}")).exists());
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f1c2a9e8b7d6c5f4e3d2c1b0a9f8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7";

    #[test]
    fn kubelet_systemd_paths() {
        let o = parse(&format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f1e2d3c_4b5a_6978_8a9b_0c1d2e3f4a5b.slice/cri-containerd-{ID}.scope"));
        assert_eq!(
            o.pod_uid.as_deref(),
            Some("0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b")
        );
        assert_eq!(o.qos.as_deref(), Some("burstable"));
        assert_eq!(o.container_id.as_deref(), Some(ID));
        assert_eq!(o.runtime.as_deref(), Some("containerd"));
        let g = parse(&format!(
            "/kubepods.slice/kubepods-pod0f1e2d3c_4b5a_6978_8a9b_0c1d2e3f4a5b.slice/crio-{ID}.scope"
        ));
        assert_eq!(g.qos.as_deref(), Some("guaranteed"));
        assert_eq!(g.runtime.as_deref(), Some("cri-o"));
    }

    #[test]
    fn kubelet_cgroupfs_and_plain_container_paths() {
        let o = parse(&format!(
            "/kubepods/besteffort/pod0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b/{ID}"
        ));
        assert_eq!(
            o.pod_uid.as_deref(),
            Some("0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b")
        );
        assert_eq!(o.qos.as_deref(), Some("besteffort"));
        assert_eq!(
            (o.runtime.as_deref(), o.container_id.as_deref()),
            (Some("cri"), Some(ID))
        );
        let d = parse(&format!("/system.slice/docker-{ID}.scope"));
        assert_eq!((d.runtime.as_deref(), d.pod_uid), (Some("docker"), None));
        let d = parse(&format!("/docker/{ID}"));
        assert_eq!(d.runtime.as_deref(), Some("docker"));
        let p = parse(&format!(
            "/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope"
        ));
        assert_eq!(p.runtime.as_deref(), Some("podman"));
        assert!(!parse("/user.slice/user-1000.slice/session-3.scope").in_container());
        assert!(!parse("/").in_container());
    }

    #[test]
    fn service_names_as_opentelemetry_sdks_read_them() {
        let env = |vars: &[&str]| vars.join("\0").into_bytes();
        assert_eq!(service_in(&env(&["PATH=/bin", "HOME=/"])), None);
        assert_eq!(
            service_in(&env(&["OTEL_SERVICE_NAME=checkout", "X=1"])).as_deref(),
            Some("checkout")
        );
        // The dedicated variable wins over the attribute; an empty one does not count.
        let both = [
            "OTEL_RESOURCE_ATTRIBUTES=service.name=cart",
            "OTEL_SERVICE_NAME=checkout",
        ];
        assert_eq!(service_in(&env(&both)).as_deref(), Some("checkout"));
        let attrs = [
            "OTEL_SERVICE_NAME=",
            "OTEL_RESOURCE_ATTRIBUTES=deployment.environment=prod, service.name = cart%2Cv2 ,x=y",
        ];
        assert_eq!(service_in(&env(&attrs)).as_deref(), Some("cart,v2"));
        // Names that are not names: control characters go, length is bounded.
        let hostile = format!("OTEL_SERVICE_NAME=a\x1b[2Jb\n{}", "x".repeat(10_000));
        let got = service_in(&env(&[&hostile])).unwrap();
        assert!(got.starts_with("a[2Jb") && got.chars().count() == MAX_SERVICE_NAME);
        assert_eq!(
            service_in(&env(&["OTEL_RESOURCE_ATTRIBUTES=service.name=%"])).as_deref(),
            Some("%")
        );
        assert_eq!(service_in(&env(&["OTEL_SERVICE_NAME=\x01\x02"])), None);
        // A process's own environment is read.
        assert_eq!(service_name(u32::MAX), None);
    }
}
