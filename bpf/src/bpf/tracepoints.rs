//! The process-following tracepoints: tracefs mounted where missing, and field offsets read
//! from its `format` files so that one object fits kernels whose layouts differ.

use std::{
    fs, io,
    os::fd::{AsFd, OwnedFd},
    path::Path,
};

use perf_event_open_sys as sys;

use super::{programs::Programs, BpfError, TRACEFS};

/// Program `prog` on tracepoint `category:name`, loaded and attached by tracer's loader (so
/// that its verifier figures are known, a refusal remembered, and a smaller variant can be
/// put in its place): the link, then its event; dropping both detaches it.
pub(super) fn attach(
    programs: &Programs,
    prog: &'static str,
    category: &str,
    name: &str,
) -> Result<[OwnedFd; 2], BpfError> {
    programs.load(prog).map_err(|e| BpfError::Program {
        name: prog,
        source: Box::new(e),
    })?;
    let err = |e: io::Error| BpfError::Program {
        name: prog,
        source: Box::new(e),
    };
    let fd = programs.fd(prog).map_err(err)?;
    let event = tracepoint(category, name).map_err(err)?;
    let link = super::programs::perf_link(fd.as_fd(), event.as_fd(), 0).map_err(err)?;
    Ok([link, event])
}

/// A perf event on tracepoint `category:name`, for a program to be linked to.
pub(super) fn tracepoint(category: &str, name: &str) -> io::Result<OwnedFd> {
    let id = fs::read_to_string(
        Path::new(TRACEFS)
            .join("events")
            .join(category)
            .join(name)
            .join("id"),
    )?;
    let mut attr = sys::bindings::perf_event_attr::default();
    attr.type_ = sys::bindings::PERF_TYPE_TRACEPOINT;
    attr.config = id.trim().parse().map_err(io::Error::other)?;
    attr.__bindgen_anon_1.sample_period = 1;
    // pid -1 on CPU 0, as libbpf opens a tracepoint's event.
    crate::perf::open_raw(&mut attr, -1, 0)
}

/// Mounts tracefs when it is not (a fresh boot may lack it); tracepoints and uprobes need it.
pub fn ensure_tracefs() -> Result<(), BpfError> {
    if Path::new(TRACEFS).join("events").exists() {
        return Ok(());
    }
    nix::mount::mount(
        Some("nodev"),
        TRACEFS,
        Some("tracefs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| BpfError::Tracefs(e.to_string()))
}

/// Field offsets of a tracepoint, from its tracefs `format` file.
pub(super) struct TracepointFormat(String);

impl TracepointFormat {
    pub(super) fn read(category: &str, name: &str) -> Self {
        Self(
            fs::read_to_string(
                Path::new(TRACEFS)
                    .join("events")
                    .join(category)
                    .join(name)
                    .join("format"),
            )
            .unwrap_or_default(),
        )
    }

    /// The offset of `field`, from a line like `field:pid_t pid; offset:8; size:4; signed:1;`
    /// (tab-separated).
    pub(super) fn offset(&self, field: &str) -> Option<u32> {
        self.0.lines().find_map(|line| {
            let decl = line.trim().strip_prefix("field:")?.split(';').next()?;
            let name = decl.rsplit([' ', '*']).next()?.split('[').next()?;
            if name != field {
                return None;
            }
            let off = line.split("offset:").nth(1)?.split(';').next()?;
            off.trim().parse().ok()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracepoint_offsets_parse() {
        let f = TracepointFormat(
            "format:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
             \tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\
             \tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\
             \tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n"
                .into(),
        );
        assert_eq!(f.offset("pid"), Some(24));
        assert_eq!(f.offset("comm"), Some(8));
        assert_eq!(f.offset("group_dead"), Some(32));
        assert_eq!(f.offset("prio"), None);
    }
}
