//! Attribution of processes to Kubernetes pods and containers from real cgroups: a Python
//! program moved into a cgroup laid out as the kubelet (systemd driver) and containerd lay
//! them out is reported with its pod uid, QoS class, container id and runtime.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use tracer_tests::{root_or_skip, Daemon};

const POD: &str = "0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b";
const ID: &str = "4f1c2a9e8b7d6c5f4e3d2c1b0a9f8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7";

/// A writable cgroup v2 mount.
fn cgroup2() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == "cgroup2")
        .map(|f| PathBuf::from(f[1]))
}

/// The pod's cgroups: the leaf, and those made here, removed (leaf first) on drop (a killed
/// earlier run may have left some).
struct PodCgroup(PathBuf, Vec<PathBuf>);

impl PodCgroup {
    fn create(root: &Path) -> Self {
        let pod = POD.replace('-', "_");
        let mut dirs = Vec::new();
        let mut dir = root.to_owned();
        for part in [
            "kubepods.slice".to_owned(),
            "kubepods-burstable.slice".to_owned(),
            format!("kubepods-burstable-pod{pod}.slice"),
            format!("cri-containerd-{ID}.scope"),
        ] {
            dir = dir.join(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).unwrap();
                dirs.push(dir.clone());
            }
        }
        PodCgroup(dir, dirs)
    }

    fn leaf(&self) -> &Path {
        &self.0
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for d in self.1.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[test]
fn processes_are_attributed_to_their_pod_and_container() {
    if !root_or_skip() {
        return;
    }
    let Some(root) = cgroup2() else {
        tracer_testkit::skip(format_args!("no cgroup2 hierarchy is mounted"));
        return;
    };
    let pod = PodCgroup::create(&root);
    let d = Daemon::start();
    // The program enters the container's cgroup, then waits for the session before working.
    let script = d.dir.path().join("in_pod.py");
    std::fs::write(
        &script,
        "import sys\nsys.stdin.readline()\n\ndef work(n):\n    return sum(range(n))\n\nfor i in range(50):\n    work(1000)\n",
    )
    .unwrap();
    let mut child = tracer_tests::ChildGuard::spawn(
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec {} {}",
                pod.leaf().display(),
                tracer_tests::python().display(),
                script.display()
            ))
            .stdin(Stdio::piped()),
    );
    let pid = child.pid();
    tracer_tests::wait_until(10, "the program in its pod's cgroup", || {
        std::fs::read_to_string(pod.leaf().join("cgroup.procs"))
            .is_ok_and(|p| p.lines().any(|l| l == pid.to_string()))
            && std::fs::read_link(format!("/proc/{pid}/exe"))
                .is_ok_and(|e| e.to_string_lossy().contains("python"))
    });
    let id = d.ok(&[
        "start",
        "--mode=counting",
        "--python",
        "--pid",
        &pid.to_string(),
    ]);
    let id = id.trim();
    child.0.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert!(child.0.wait().unwrap().success());
    tracer_tests::wait_until(10, "the session to end with its target", || {
        d.ok(&["status", id]).contains("finished")
    });
    let report: serde_json::Value = d.report_json(id);
    let containers = report["processes"]["containers"].as_array().unwrap();
    let c = containers
        .iter()
        .find(|c| c["pid"] == pid)
        .unwrap_or_else(|| panic!("pid {pid} not attributed: {containers:?}"));
    assert_eq!(c["pod_uid"], POD, "{c}");
    assert_eq!(c["qos"], "burstable", "{c}");
    assert_eq!(c["container_id"], ID, "{c}");
    assert_eq!(c["runtime"], "containerd", "{c}");
    assert!(
        c["cgroup"]
            .as_str()
            .unwrap()
            .ends_with(&format!("cri-containerd-{ID}.scope")),
        "{c}"
    );
    // The Python rows are the pod's program's.
    let work = report["python"]["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["qualname"] == "work")
        .unwrap();
    assert_eq!(work["pid"], pid);
    assert_eq!(work["ncalls"], 50);
    let table = d.ok(&["report", id]);
    assert!(
        table.contains("Containers:") && table.contains(POD) && table.contains(&ID[..12]),
        "{table}"
    );
}
