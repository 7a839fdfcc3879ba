//! pprof's format: a gzip-compressed `perftools.profiles.Profile` (proto/profile.proto in
//! github.com/google/pprof), as `go tool pprof`, Pyroscope and most profile viewers read it.
//! The messages are tracer_proto's `pprof` module.

use std::io::Write;

use flate2::{write::GzEncoder, Compression};
use prost::Message;

use super::table::Table;
use crate::{
    profile::{Frame, FrameKind, Profile},
    ProcessOrigin,
};

use tracer_proto::pprof as pb;

/// The profile as a `.pb.gz` file: two sample values, samples and CPU nanoseconds, each
/// sample labelled with its pid, tid and comm, and for processes in containers their
/// container id, pod uid and hostname (a pod's name by default).
pub fn pprof(p: &Profile, containers: &[ProcessOrigin]) -> Vec<u8> {
    let origins: std::collections::HashMap<u32, &crate::Origin> =
        containers.iter().map(|c| (c.pid, &c.origin)).collect();
    let mut b = Builder::new(p.mappings.len());
    // Launch stacks (`--cuda-stacks`) count launches and stand for no time.
    let timed = p.period_ns > 0;
    let wall = p.off_cpu.is_some();
    let sample_type = if timed && wall {
        vec![
            b.value_type("samples", "count"),
            b.value_type("cpu", "nanoseconds"),
            b.value_type("off_cpu", "nanoseconds"),
            b.value_type("wall", "nanoseconds"),
        ]
    } else if timed {
        vec![
            b.value_type("samples", "count"),
            b.value_type("cpu", "nanoseconds"),
        ]
    } else {
        vec![b.value_type(&p.event, "count")]
    };
    let period_type = Some(if timed {
        b.value_type("cpu", "nanoseconds")
    } else {
        b.value_type(&p.event, "count")
    });
    let mapping = p
        .mappings
        .iter()
        .zip(1..)
        .map(|(m, id)| pb::Mapping {
            id,
            filename: b.strings.id(&m.path),
            build_id: b.strings.id(&m.build_id),
            // Frames arrive named: pprof must not try to symbolize them again.
            has_functions: true,
            ..Default::default()
        })
        .collect();
    let sample = p
        .stacks
        .iter()
        .filter(|s| p.weight(s) > 0)
        .map(|s| pb::Sample {
            location_id: s.frames.iter().rev().map(|f| b.location(f)).collect(),
            value: if timed && wall {
                let cpu = s.count.saturating_mul(p.period_ns);
                vec![
                    int(s.count),
                    int(cpu),
                    int(s.off_cpu_ns),
                    int(cpu.saturating_add(s.off_cpu_ns)),
                ]
            } else if timed {
                vec![int(s.count), int(s.count.saturating_mul(p.period_ns))]
            } else {
                vec![int(s.count)]
            },
            label: {
                let mut l = vec![
                    b.num_label("pid", s.pid.into()),
                    b.num_label("tid", s.tid.into()),
                    b.str_label("comm", &s.comm),
                ];
                if let Some(o) = origins.get(&s.pid) {
                    for (key, v) in [
                        ("container_id", &o.container_id),
                        ("pod_uid", &o.pod_uid),
                        ("hostname", &o.hostname),
                        ("service_name", &o.service_name),
                    ] {
                        if let Some(v) = v {
                            l.push(b.str_label(key, v));
                        }
                    }
                }
                if let Some(held) = s.gil_held {
                    l.push(b.str_label("gil", if held { "held" } else { "released" }));
                }
                l
            },
        })
        .collect();
    let comment = vec![b.strings.id(&if timed {
        format!("tracer: {} at {} Hz", p.event, p.frequency_hz)
    } else {
        format!("tracer: the stack of every {}", p.event)
    })];
    let profile = pb::Profile {
        sample_type,
        sample,
        mapping,
        location: b.locations.into_items(),
        function: b.functions.into_items(),
        string_table: b.strings.0.into_items(),
        time_nanos: int(p.start_unix_ns),
        duration_nanos: int(p.duration_ns),
        period_type,
        period: if timed { int(p.period_ns) } else { 1 },
        comment,
    };
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&profile.encode_to_vec())
        .and_then(|()| gz.finish())
        .expect("writing to a Vec cannot fail")
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Deduplicates strings (pprof refers to each by its index, and index 0 must be ""),
/// locations (one per distinct frame) and functions (one per name and file).
struct Builder<'a> {
    strings: Strings,
    mappings: usize,
    locations: Table<&'a Frame, pb::Location>,
    functions: Table<(i64, i64), pb::Function>,
}

/// pprof's string table.
struct Strings(Table<String, String>);

impl Strings {
    fn id(&mut self, s: &str) -> i64 {
        int(self.0.string(s) as u64)
    }
}

impl<'a> Builder<'a> {
    fn new(mappings: usize) -> Self {
        let mut strings = Strings(Table::new(Vec::new()));
        strings.id("");
        Builder {
            strings,
            mappings,
            locations: Table::new(Vec::new()),
            functions: Table::new(Vec::new()),
        }
    }

    fn value_type(&mut self, ty: &str, unit: &str) -> pb::ValueType {
        pb::ValueType {
            r#type: self.strings.id(ty),
            unit: self.strings.id(unit),
        }
    }

    fn num_label(&mut self, key: &str, num: i64) -> pb::Label {
        pb::Label {
            key: self.strings.id(key),
            num,
            ..Default::default()
        }
    }

    fn str_label(&mut self, key: &str, value: &str) -> pb::Label {
        pb::Label {
            key: self.strings.id(key),
            str: self.strings.id(value),
            ..Default::default()
        }
    }

    fn location(&mut self, f: &'a Frame) -> u64 {
        if let Some(i) = self.locations.get(&f) {
            return i as u64 + 1;
        }
        let (name, file) = function_of(f);
        let function_id = self.function(&name, file, f.kind == FrameKind::Native);
        // Only native frames lie in a binary; an index past the table would make the
        // whole file invalid, so such a frame goes without mapping.
        let mapping_id = match (f.kind, f.mapping) {
            (FrameKind::Native, Some(m)) if m < self.mappings => m as u64 + 1,
            _ => 0,
        };
        let id = self.locations.len() as u64 + 1;
        self.locations.push(
            f,
            pb::Location {
                id,
                mapping_id,
                address: f.address,
                line: vec![pb::Line {
                    function_id,
                    line: f.line.map_or(0, i64::from),
                }],
            },
        );
        id
    }

    /// Only native functions get a system name: pprof simplifies those as C++ names (template
    /// arguments dropped), which would turn Python's `<module>` or `<lambda>` into nothing.
    fn function(&mut self, name: &str, file: &str, native: bool) -> u64 {
        let key = (self.strings.id(name), self.strings.id(file));
        // pprof's ids count from 1.
        let next = self.functions.len() as u64 + 1;
        let i = self.functions.id(&key, |&(name, filename)| pb::Function {
            id: next,
            name,
            system_name: if native { name } else { 0 },
            filename,
        });
        i as u64 + 1
    }
}

/// A frame's function name and file, as the pprof and OTLP exports name them: kernel and
/// off-CPU frames get a pseudo-file, off-CPU ones their reason as the name, asyncio tasks
/// `[task: NAME]`.
pub(super) fn function_of(f: &Frame) -> (std::borrow::Cow<'_, str>, &str) {
    let file = match f.kind {
        FrameKind::Kernel => "[kernel]",
        FrameKind::OffCpu => "[off-CPU]",
        FrameKind::Task => "[asyncio task]",
        _ => f.file.as_deref().unwrap_or(""),
    };
    let name = match f.kind {
        FrameKind::OffCpu | FrameKind::Task => std::borrow::Cow::Owned(f.label()),
        _ => std::borrow::Cow::Borrowed(f.name.as_str()),
    };
    (name, file)
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::process::Command;

    use super::*;
    use crate::export::folded::tests::example;

    fn decode(bytes: &[u8]) -> pb::Profile {
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut raw)
            .expect("gzip");
        pb::Profile::decode(raw.as_slice()).expect("protobuf")
    }

    /// The stack of a sample as `name:line` strings, leaf first as stored.
    fn names(d: &pb::Profile, s: &pb::Sample) -> Vec<String> {
        s.location_id
            .iter()
            .map(|&id| {
                let loc = &d.location[id as usize - 1];
                assert_eq!(loc.id, id);
                let f = &d.function[loc.line[0].function_id as usize - 1];
                format!("{}:{}", d.string_table[f.name as usize], loc.line[0].line)
            })
            .collect()
    }

    #[test]
    fn asyncio_tasks_are_functions_of_their_own() {
        let task = Frame {
            kind: FrameKind::Task,
            name: "leaf-a".into(),
            ..Frame::default()
        };
        let (name, file) = function_of(&task);
        assert_eq!((name.as_ref(), file), ("[task: leaf-a]", "[asyncio task]"));
        let mut p = example();
        p.stacks[0].frames.insert(1, task);
        let d = decode(&pprof(&p, &[]));
        let sample = d
            .sample
            .iter()
            .find(|s| names(&d, s).iter().any(|n| n.starts_with("[task: leaf-a]")));
        assert!(sample.is_some(), "no task frame in the pprof export");
    }

    #[test]
    fn samples_of_containers_carry_their_pod() {
        let p = example();
        let pid = p.stacks[0].pid;
        let o = ProcessOrigin {
            pid,
            origin: crate::Origin {
                container_id: Some("abc".into()),
                pod_uid: Some("u-1".into()),
                hostname: Some("web-0".into()),
                ..Default::default()
            },
        };
        let d = decode(&pprof(&p, &[o]));
        let s = |i: i64| d.string_table[i as usize].as_str();
        let has = |x: &pb::Sample, k: &str, v: &str| {
            x.label.iter().any(|l| s(l.key) == k && s(l.str) == v)
        };
        let labelled = d.sample.iter().filter(|x| has(x, "pod_uid", "u-1")).count();
        let expected = p
            .stacks
            .iter()
            .filter(|x| x.pid == pid && x.count > 0)
            .count();
        assert!(expected > 0 && expected < d.sample.len());
        assert_eq!(labelled, expected);
        assert!(d
            .sample
            .iter()
            .filter(|x| has(x, "pod_uid", "u-1"))
            .all(|x| has(x, "hostname", "web-0") && has(x, "container_id", "abc")));
    }

    #[test]
    fn python_samples_say_whether_they_held_the_gil() {
        let mut p = example();
        p.stacks[0].gil_held = Some(true);
        p.stacks[1].gil_held = Some(false);
        let d = decode(&pprof(&p, &[]));
        let s = |i: i64| d.string_table[i as usize].as_str();
        let gil: Vec<Option<&str>> = d
            .sample
            .iter()
            .map(|x| x.label.iter().find(|l| s(l.key) == "gil").map(|l| s(l.str)))
            .collect();
        assert_eq!(gil[..3], [Some("held"), Some("released"), None]);
    }

    #[test]
    fn decodes_back() {
        let p = example();
        let d = decode(&pprof(&p, &[]));
        let s = |i: i64| d.string_table[i as usize].as_str();
        assert_eq!(d.string_table[0], "");
        let types: Vec<_> = d
            .sample_type
            .iter()
            .map(|t| (s(t.r#type), s(t.unit)))
            .collect();
        assert_eq!(types, [("samples", "count"), ("cpu", "nanoseconds")]);
        let period = d.period_type.as_ref().unwrap();
        assert_eq!((s(period.r#type), s(period.unit)), ("cpu", "nanoseconds"));
        assert_eq!(d.period, 10_000_000);
        assert_eq!(d.time_nanos, 1_700_000_000_000_000_000);
        assert_eq!(d.duration_nanos, 2_000_000_000);

        assert_eq!(d.sample.len(), 5);
        let first = &d.sample[0];
        assert_eq!(first.value, [5, 50_000_000]);
        assert_eq!(
            names(&d, first),
            [
                "do_syscall_64:0",
                "PyObject_Call:0",
                "main:5",
                "<module>:10",
                "python3 (pid 100):0"
            ]
        );
        let labels: Vec<_> = first
            .label
            .iter()
            .map(|l| (s(l.key), s(l.str), l.num))
            .collect();
        assert_eq!(
            labels,
            [("pid", "", 100), ("tid", "", 100), ("comm", "python3", 0)]
        );

        // One location per distinct frame, shared between stacks.
        assert_eq!(d.sample[1].location_id, d.sample[3].location_id);
        assert_eq!(d.location.len(), 11);
        assert_eq!(d.sample[1].location_id.last(), first.location_id.last());

        // Mappings: native frames only, ids from 1.
        assert_eq!(d.mapping.len(), 2);
        assert_eq!(s(d.mapping[0].filename), "/usr/bin/python3.12");
        assert_eq!(s(d.mapping[0].build_id), "0123abcd");
        assert_eq!(d.mapping[1].build_id, 0);
        for loc in &d.location {
            let f = &d.function[loc.line[0].function_id as usize - 1];
            let native = ["PyObject_Call", "_start", "std::vector<int>::push_back&"];
            let expected = match s(f.name) {
                "PyObject_Call" => 1,
                n if native.contains(&n) => 2,
                _ => 0,
            };
            assert_eq!(loc.mapping_id, expected, "{}", s(f.name));
            let system_name = if expected > 0 { f.name } else { 0 };
            assert_eq!(f.system_name, system_name, "{}", s(f.name));
            if s(f.name) == "do_syscall_64" {
                assert_eq!(s(f.filename), "[kernel]");
                assert_eq!(loc.address, 0xffff_ffff_8100_0000);
            }
            if s(f.name) == "PyObject_Call" {
                assert_eq!(loc.address, 0x1234);
            }
        }
    }

    #[test]
    fn one_function_per_name_and_file() {
        // `main` again at another line: a new location, the same function.
        let mut p = example();
        let mut other = p.stacks[0].clone();
        other.frames.truncate(3);
        other.frames[2].line = Some(6);
        p.stacks.push(other);
        let d = decode(&pprof(&p, &[]));
        assert_eq!(d.location.len(), 12);
        assert_eq!(d.function.len(), 11);
        let last = d.sample.last().unwrap();
        assert_eq!(
            names(&d, last),
            ["main:6", "<module>:10", "python3 (pid 100):0"]
        );
        assert_eq!(
            d.location[last.location_id[0] as usize - 1].line[0].function_id,
            d.location[d.sample[0].location_id[2] as usize - 1].line[0].function_id
        );
    }

    /// pprof itself is the judge of the format, where Go is installed.
    #[test]
    fn go_tool_pprof_reads_it() {
        if Command::new("go").arg("version").output().is_err() {
            tracer_testkit::skip(format_args!("go not installed"));
            return;
        }
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), pprof(&example(), &[])).unwrap();
        let run = |flag: &str| {
            let out = Command::new("go")
                .args(["tool", "pprof", flag])
                .arg(file.path())
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                out.status.success(),
                "{text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            text
        };
        let raw = run("-raw");
        assert!(raw.contains("samples/count cpu/nanoseconds"), "{raw}");
        assert!(raw.contains("5   50000000:"), "{raw}");
        assert!(raw.contains("pid:[100]"), "{raw}");
        assert!(raw.contains("comm:[worker]"), "{raw}");
        let top = run("-top");
        // pprof shows C++ names without template arguments.
        for name in [
            "do_syscall_64",
            "PyObject_Call",
            "<module>",
            "work",
            "std::vector::push_back&",
            "asm_exc_page_fault",
            "python3 (pid 100)",
        ] {
            assert!(top.contains(name), "{name} missing from:\n{top}");
        }
    }
}
