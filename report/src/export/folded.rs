//! Brendan Gregg's folded stacks, as `stackcollapse-*.pl` write them and `flamegraph.pl`,
//! inferno and speedscope read them: `root;…;leaf COUNT`, one line per distinct stack. In a
//! wall-clock profile COUNT is microseconds (on the CPU and off it), as `offcputime -f` writes.

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
        .filter(|s| p.flame_value(s) > 0 && !s.frames.is_empty())
    {
        let stack: Vec<String> = s.frames.iter().map(label).collect();
        *lines.entry(stack.join(";")).or_default() += p.flame_value(s);
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
            off_cpu_ns: 0,
            gil_held: None,
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
            off_cpu: None,
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

    /// `example()` as a wall-clock profile: thread 100 also slept 250 ms.
    pub(crate) fn wall_example() -> Profile {
        let mut p = example();
        p.off_cpu = Some(crate::profile::OffCpu {
            min_ns: 5_000_000,
            total_ns: 250_000_000,
            records: 3,
            ..Default::default()
        });
        let mut away = stack(
            100,
            100,
            "python3",
            vec![
                frame(FrameKind::Process, "python3 (pid 100)"),
                py("<module>", 10),
                kernel("do_nanosleep", 0),
                frame(FrameKind::OffCpu, "sleep"),
            ],
            0,
        );
        away.off_cpu_ns = 250_000_000;
        p.stacks.push(away);
        p
    }

    /// Off-CPU time beside the samples: µs in flame graphs, ms in the table with each
    /// thread's time on and off the CPU.
    #[test]
    fn wall_clock_profiles_weigh_stacks_by_time() {
        let p = wall_example();
        let text = folded(&p);
        assert!(
            text.contains("<module> (/srv/app.py:10);do_nanosleep_[k];[off-CPU: sleep] 250000\n"),
            "{text}"
        );
        // 5 samples at 10 ms: 50 ms, in µs.
        assert!(text.contains("do_syscall_64_[k] 50000\n"), "{text}");
        let mut table = String::new();
        p.table(&mut table, 0);
        assert!(table.contains("Wall-clock: 120.0 ms on the CPU"), "{table}");
        assert!(table.contains("250.0 ms off it"), "{table}");
        assert!(table.contains("[off-CPU: sleep]"), "{table}");
        // Thread 100: 50 ms on, 250 ms off.
        assert!(
            table.contains("50.0 ms  16.7%   250.0 ms  83.3%  sleep 83%"),
            "{table}"
        );
    }
}
