//! The process-following tracepoints: tracefs mounted where missing, and field offsets read
//! from its `format` files so that one object fits kernels whose layouts differ.

use std::{fs, path::Path};

use aya::{programs::TracePoint, Ebpf};

use super::{BpfError, TRACEFS};

pub(super) fn attach(
    ebpf: &mut Ebpf,
    prog: &'static str,
    category: &str,
    name: &str,
) -> Result<(), BpfError> {
    let err = |e| BpfError::Program {
        name: prog,
        source: Box::new(e),
    };
    let tp: &mut TracePoint = ebpf
        .program_mut(prog)
        .expect("program in object")
        .try_into()
        .map_err(err)?;
    tp.load().map_err(err)?;
    tp.attach(category, name).map_err(err)?;
    Ok(())
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
