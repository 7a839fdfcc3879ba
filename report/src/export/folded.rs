//! Brendan Gregg's folded stacks, as `stackcollapse-*.pl` write them and `flamegraph.pl`,
//! inferno and speedscope read them: `root;…;leaf COUNT`, one line per distinct stack.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::profile::{Frame, Profile};

/// One line per distinct stack, frames root first, in byte order like `stackcollapse` sorts
/// them. Stacks that read the same (threads of one process share their lines) are merged.
pub fn folded(p: &Profile) -> String {
    let mut lines: BTreeMap<String, u64> = BTreeMap::new();
    for s in p
        .stacks
        .iter()
        .filter(|s| s.count > 0 && !s.frames.is_empty())
    {
        let stack: Vec<String> = s.frames.iter().map(label).collect();
        *lines.entry(stack.join(";")).or_default() += s.count;
    }
    let mut out = String::new();
    for (stack, count) in lines {
        let _ = writeln!(out, "{stack} {count}");
    }
    out
}

/// The frame's label with the separators of the format replaced, so every line parses.
fn label(f: &Frame) -> String {
    f.label()
        .chars()
        .map(|c| match c {
            ';' => ':',
            '\n' | '\r' => ' ',
            c => c,
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::profile::{FrameKind, Mapping, Stack};

    fn frame(kind: FrameKind, name: &str) -> Frame {
        Frame {
            kind,
            name: name.into(),
            ..Frame::default()
        }
    }

    fn py(name: &str, line: u32) -> Frame {
        Frame {
            file: Some("/srv/app.py".into()),
            line: Some(line),
            ..frame(FrameKind::Python, name)
        }
    }

    fn native(name: &str, mapping: usize, address: u64) -> Frame {
        Frame {
            mapping: Some(mapping),
            address,
            ..frame(FrameKind::Native, name)
        }
    }

    fn kernel(name: &str, address: u64) -> Frame {
        Frame {
            address,
            ..frame(FrameKind::Kernel, name)
        }
    }

    fn stack(pid: u32, tid: u32, comm: &str, frames: Vec<Frame>, count: u64) -> Stack {
        Stack {
            pid,
            tid,
            comm: comm.into(),
            frames,
            count,
        }
    }

    /// Two processes: a Python one (three threads, two of them with the same stack) and a
    /// native one whose names need escaping in every format.
    pub(crate) fn example() -> Profile {
        let p100 = || frame(FrameKind::Process, "python3 (pid 100)");
        let p200 = || frame(FrameKind::Process, "worker (pid 200)");
        Profile {
            event: "cpu-clock".into(),
            frequency_hz: 100,
            period_ns: 10_000_000,
            start_unix_ns: 1_700_000_000_000_000_000,
            duration_ns: 2_000_000_000,
            stacks: vec![
                stack(
                    100,
                    100,
                    "python3",
                    vec![
                        p100(),
                        py("<module>", 10),
                        py("main", 5),
                        native("PyObject_Call", 0, 0x1234),
                        kernel("do_syscall_64", 0xffff_ffff_8100_0000),
                    ],
                    5,
                ),
                stack(
                    100,
                    101,
                    "python3",
                    vec![p100(), py("<module>", 10), py("work", 20)],
                    3,
                ),
                stack(
                    200,
                    200,
                    "worker",
                    vec![
                        p200(),
                        native("_start", 1, 0x40),
                        native("std::vector<int>::push_back&", 1, 0x99),
                        kernel("asm_exc_page_fault", 0xffff_ffff_8200_0000),
                    ],
                    2,
                ),
                stack(
                    100,
                    102,
                    "python3",
                    vec![p100(), py("<module>", 10), py("work", 20)],
                    1,
                ),
                stack(
                    200,
                    201,
                    "worker",
                    vec![p200(), py("odd;name\n\"x\"", 7)],
                    1,
                ),
            ],
            mappings: vec![
                Mapping {
                    path: "/usr/bin/python3.12".into(),
                    build_id: "0123abcd".into(),
                },
                Mapping {
                    path: "/opt/worker".into(),
                    build_id: String::new(),
                },
            ],
            unwinding: Default::default(),
        }
    }

    #[test]
    fn lines_are_merged_sanitized_and_sorted() {
        assert_eq!(
            folded(&example()),
            "python3 (pid 100);<module> (/srv/app.py:10);main (/srv/app.py:5);PyObject_Call;do_syscall_64_[k] 5\n\
             python3 (pid 100);<module> (/srv/app.py:10);work (/srv/app.py:20) 4\n\
             worker (pid 200);_start;std::vector<int>::push_back&;asm_exc_page_fault_[k] 2\n\
             worker (pid 200);odd:name \"x\" (/srv/app.py:7) 1\n"
        );
    }

    #[test]
    fn empty_profile_is_empty() {
        assert_eq!(folded(&Profile::default()), "");
    }
}
