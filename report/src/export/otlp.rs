//! OpenTelemetry's profiles signal: an `ExportProfilesServiceRequest`
//! (`opentelemetry.proto.collector.profiles.v1development`), with the OpenTelemetry project's
//! own generated types, as an OTLP collector, Pyroscope, Elastic or Polar Signals take it.
//!
//! One resource per process (its pid, the host, its container and pod), one profile per value pprof's export carries (samples, CPU time, and for
//! wall-clock sessions off-CPU and wall time), every sample with its thread's id and name.
//! Strings, functions, locations, stacks and attributes are shared in one dictionary, whose
//! entry 0 is the empty one in every table, as the format asks.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use opentelemetry_proto::tonic::{
    collector::profiles::v1development::ExportProfilesServiceRequest,
    common::v1::{any_value::Value, AnyValue, InstrumentationScope, KeyValue},
    profiles::v1development as pb,
    resource::v1::Resource,
};
use prost::Message;

use super::table::Table;
use crate::{
    profile::{Frame, FrameKind, Profile, Stack},
    Origin, ProcessOrigin,
};

/// The request, encoded: what `tracerctl report --format otlp` writes.
pub fn otlp(p: &Profile, processes: &[ProcessOrigin], host: &str) -> Vec<u8> {
    request(p, processes, host).encode_to_vec()
}

/// The profile as one request; `host` is this machine's name.
pub fn request(
    p: &Profile,
    processes: &[ProcessOrigin],
    host: &str,
) -> ExportProfilesServiceRequest {
    let origins: HashMap<u32, &Origin> = processes.iter().map(|c| (c.pid, &c.origin)).collect();
    let mut d = Dictionary::new(p.mappings.len());
    let timed = p.period_ns > 0;
    let wall = p.off_cpu.is_some();
    // (type, unit, the value of a stack): pprof's sample types, one profile each.
    type Value = fn(&Profile, &Stack) -> u64;
    let mut kinds: Vec<(String, &str, Value)> = if timed {
        vec![
            ("samples".into(), "count", |_, s| s.count),
            ("cpu".into(), "nanoseconds", |p, s| {
                s.count.saturating_mul(p.period_ns)
            }),
        ]
    } else {
        vec![(p.event.clone(), "count", |_, s| s.count)]
    };
    if timed && wall {
        kinds.push(("off_cpu".into(), "nanoseconds", |_, s| s.off_cpu_ns));
        kinds.push(("wall".into(), "nanoseconds", |p, s| {
            s.count
                .saturating_mul(p.period_ns)
                .saturating_add(s.off_cpu_ns)
        }));
    }
    let period_type = if timed {
        d.value_type("cpu", "nanoseconds")
    } else {
        d.value_type(&p.event, "count")
    };
    let mut pids: Vec<u32> = p.stacks.iter().map(|s| s.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    let resource_profiles = pids
        .into_iter()
        .map(|pid| {
            let stacks: Vec<&Stack> = p
                .stacks
                .iter()
                .filter(|s| s.pid == pid && p.weight(s) > 0)
                .collect();
            let samples: Vec<(i32, Vec<i32>)> =
                stacks.iter().map(|s| (d.stack(s), d.thread(s))).collect();
            let profiles = kinds
                .iter()
                .map(|(ty, unit, value)| pb::Profile {
                    sample_type: Some(d.value_type(ty, unit)),
                    samples: stacks
                        .iter()
                        .zip(&samples)
                        .map(|(s, (stack, attrs))| pb::Sample {
                            stack_index: *stack,
                            attribute_indices: attrs.clone(),
                            values: vec![int(value(p, s))],
                            ..Default::default()
                        })
                        .collect(),
                    time_unix_nano: p.start_unix_ns,
                    duration_nano: p.duration_ns,
                    period_type: Some(period_type),
                    period: if timed { int(p.period_ns) } else { 1 },
                    profile_id: profile_id(host, p.start_unix_ns, pid, ty),
                    ..Default::default()
                })
                .collect();
            pb::ResourceProfiles {
                resource: Some(Resource {
                    attributes: resource(pid, host, origins.get(&pid).copied()),
                    ..Default::default()
                }),
                scope_profiles: vec![pb::ScopeProfiles {
                    scope: Some(InstrumentationScope {
                        name: "tracer".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                        ..Default::default()
                    }),
                    profiles,
                    ..Default::default()
                }],
                ..Default::default()
            }
        })
        .collect();
    ExportProfilesServiceRequest {
        resource_profiles,
        dictionary: Some(d.finish(p)),
    }
}

/// A process's resource, by OpenTelemetry's semantic conventions.
fn resource(pid: u32, host: &str, origin: Option<&Origin>) -> Vec<KeyValue> {
    let mut out = vec![
        kv("host.name", Value::StringValue(host.into())),
        kv("process.pid", Value::IntValue(pid.into())),
    ];
    if let Some(o) = origin {
        for (key, v) in [
            ("container.id", &o.container_id),
            ("k8s.pod.uid", &o.pod_uid),
            ("container.runtime.name", &o.runtime),
        ] {
            if let Some(v) = v {
                out.push(kv(key, Value::StringValue(v.clone())));
            }
        }
        // A pod's hostname is its name unless the pod sets another.
        if let (Some(_), Some(h)) = (&o.pod_uid, &o.hostname) {
            out.push(kv("k8s.pod.name", Value::StringValue(h.clone())));
        }
        if let Some(name) = &o.service_name {
            out.push(kv("service.name", Value::StringValue(name.clone())));
        }
    }
    out
}

fn kv(key: &str, v: Value) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(v) }),
        ..Default::default()
    }
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// 16 bytes naming one profile: the host, the window's start, the process and the value.
fn profile_id(host: &str, start: u64, pid: u32, ty: &str) -> Vec<u8> {
    let half = |salt: u8| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (salt, host, start, pid, ty).hash(&mut h);
        h.finish().to_le_bytes()
    };
    [half(0), half(1)].concat()
}

/// The dictionary's tables, built as samples are added: each distinct string, function,
/// location, stack and attribute once, after the empty entry at index 0 each must have.
struct Dictionary<'a> {
    strings: Table<String, String>,
    mappings: usize,
    functions: Table<(i32, i32), pb::Function>,
    locations: Table<&'a Frame, pb::Location>,
    stacks: Table<Vec<i32>, pb::Stack>,
    attributes: Table<(i32, AttributeValue), pb::KeyValueAndUnit>,
}

/// An attribute's value as a key: the two kinds tracer gives.
#[derive(Clone, PartialEq, Eq, Hash)]
enum AttributeValue {
    Str(String),
    Int(i64),
}

impl<'a> Dictionary<'a> {
    fn new(mappings: usize) -> Self {
        let mut strings = Table::new(Vec::new());
        strings.string("");
        Dictionary {
            strings,
            mappings,
            functions: Table::new(vec![pb::Function::default()]),
            locations: Table::new(vec![pb::Location::default()]),
            stacks: Table::new(vec![pb::Stack::default()]),
            attributes: Table::new(vec![pb::KeyValueAndUnit::default()]),
        }
    }

    fn string(&mut self, s: &str) -> i32 {
        self.strings.string(s) as i32
    }

    fn value_type(&mut self, ty: &str, unit: &str) -> pb::ValueType {
        pb::ValueType {
            type_strindex: self.string(ty),
            unit_strindex: self.string(unit),
        }
    }

    /// An attribute of a string or an integer value, once per key and value.
    fn attribute(&mut self, key: &str, v: AttributeValue) -> i32 {
        let key = self.string(key);
        self.attributes
            .id(&(key, v), |(key, v)| pb::KeyValueAndUnit {
                key_strindex: *key,
                value: Some(AnyValue {
                    value: Some(match v {
                        AttributeValue::Str(s) => Value::StringValue(s.clone()),
                        AttributeValue::Int(n) => Value::IntValue(*n),
                    }),
                }),
                unit_strindex: 0,
            }) as i32
    }

    /// A sample's thread: the pprof export's `tid` and `comm`, and its `gil` label as
    /// `cpython.gil` (no semantic convention names the GIL).
    fn thread(&mut self, s: &Stack) -> Vec<i32> {
        let mut attrs = vec![
            self.attribute("thread.id", AttributeValue::Int(s.tid.into())),
            self.attribute("thread.name", AttributeValue::Str(s.comm.clone())),
        ];
        if let Some(held) = s.gil_held {
            let v = if held { "held" } else { "released" };
            attrs.push(self.attribute("cpython.gil", AttributeValue::Str(v.into())));
        }
        attrs
    }

    /// A stack, leaf first as the format (and pprof) orders it.
    fn stack(&mut self, s: &'a Stack) -> i32 {
        let locations: Vec<i32> = s.frames.iter().rev().map(|f| self.location(f)).collect();
        self.stacks.id(&locations, |l| pb::Stack {
            location_indices: l.clone(),
        }) as i32
    }

    fn location(&mut self, f: &'a Frame) -> i32 {
        if let Some(id) = self.locations.get(&f) {
            return id as i32;
        }
        let (name, file) = super::pprof::function_of(f);
        let function_index = self.function(&name, file, f.kind == FrameKind::Native);
        // Only native frames lie in a binary; mapping 0 is "none".
        let mapping_index = match (f.kind, f.mapping) {
            (FrameKind::Native, Some(m)) if m < self.mappings => m as i32 + 1,
            _ => 0,
        };
        // The frame's kind, as the OpenTelemetry eBPF profiler names it.
        let kind = match f.kind {
            FrameKind::Python => Some("cpython"),
            FrameKind::Native => Some("native"),
            FrameKind::Kernel => Some("kernel"),
            FrameKind::Process | FrameKind::OffCpu | FrameKind::Task => None,
        };
        let attribute_indices = kind
            .map(|k| vec![self.attribute("profile.frame.type", AttributeValue::Str(k.into()))])
            .unwrap_or_default();
        self.locations.push(
            f,
            pb::Location {
                mapping_index,
                address: f.address,
                lines: vec![pb::Line {
                    function_index,
                    line: f.line.map_or(0, i64::from),
                    column: 0,
                }],
                attribute_indices,
            },
        ) as i32
    }

    /// Only native functions get a system name, as in the pprof export.
    fn function(&mut self, name: &str, file: &str, native: bool) -> i32 {
        let key = (self.string(name), self.string(file));
        self.functions.id(&key, |&(name, filename)| pb::Function {
            name_strindex: name,
            system_name_strindex: if native { name } else { 0 },
            filename_strindex: filename,
            start_line: 0,
        }) as i32
    }

    fn finish(mut self, p: &Profile) -> pb::ProfilesDictionary {
        let mut mapping_table = vec![pb::Mapping::default()];
        for m in &p.mappings {
            let attribute_indices = if m.build_id.is_empty() {
                Vec::new()
            } else {
                vec![self.attribute(
                    "process.executable.build_id.gnu",
                    AttributeValue::Str(m.build_id.clone()),
                )]
            };
            mapping_table.push(pb::Mapping {
                filename_strindex: self.string(&m.path),
                attribute_indices,
                ..Default::default()
            });
        }
        pb::ProfilesDictionary {
            mapping_table,
            location_table: self.locations.into_items(),
            function_table: self.functions.into_items(),
            link_table: vec![pb::Link::default()],
            string_table: self.strings.into_items(),
            attribute_table: self.attributes.into_items(),
            stack_table: self.stacks.into_items(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;
    use crate::export::folded::tests::example;
    use tracer_proto::pprof as pp;

    /// (pid, tid, stack leaf first as `name:line`, the values in order): a sample as pprof has it.
    type Row = (i64, i64, Vec<String>, Vec<i64>);

    fn from_pprof(bytes: &[u8]) -> (Vec<(String, String)>, Vec<Row>) {
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut raw)
            .unwrap();
        let d = pp::Profile::decode(raw.as_slice()).unwrap();
        let s = |i: i64| d.string_table[i as usize].clone();
        let types = d
            .sample_type
            .iter()
            .map(|t| (s(t.r#type), s(t.unit)))
            .collect();
        let rows = d
            .sample
            .iter()
            .map(|x| {
                let num = |k: &str| x.label.iter().find(|l| s(l.key) == k).unwrap().num;
                let names = x
                    .location_id
                    .iter()
                    .map(|&id| {
                        let loc = &d.location[id as usize - 1];
                        let f = &d.function[loc.line[0].function_id as usize - 1];
                        format!("{}:{}", s(f.name), loc.line[0].line)
                    })
                    .collect();
                (num("pid"), num("tid"), names, x.value.clone())
            })
            .collect();
        (types, rows)
    }

    fn from_otlp(r: &ExportProfilesServiceRequest) -> (Vec<(String, String)>, Vec<Row>) {
        let d = r.dictionary.as_ref().unwrap();
        let s = |i: i32| d.string_table[i as usize].clone();
        let int = |v: &Option<AnyValue>| match v.as_ref().and_then(|v| v.value.as_ref()) {
            Some(Value::IntValue(i)) => *i,
            other => panic!("{other:?}"),
        };
        let mut types = Vec::new();
        let mut rows: Vec<Row> = Vec::new();
        for rp in &r.resource_profiles {
            let attrs = &rp.resource.as_ref().unwrap().attributes;
            let pid = int(&attrs.iter().find(|a| a.key == "process.pid").unwrap().value);
            let first = rows.len();
            for (k, prof) in rp.scope_profiles[0].profiles.iter().enumerate() {
                let t = prof.sample_type.unwrap();
                if types.len() == k {
                    types.push((s(t.type_strindex), s(t.unit_strindex)));
                }
                for (i, x) in prof.samples.iter().enumerate() {
                    if k > 0 {
                        rows[first + i].3.push(x.values[0]);
                        continue;
                    }
                    let tid = x
                        .attribute_indices
                        .iter()
                        .map(|&a| &d.attribute_table[a as usize])
                        .find(|a| s(a.key_strindex) == "thread.id")
                        .map(|a| int(&a.value))
                        .unwrap();
                    let names = d.stack_table[x.stack_index as usize]
                        .location_indices
                        .iter()
                        .map(|&l| {
                            let loc = &d.location_table[l as usize];
                            let f = &d.function_table[loc.lines[0].function_index as usize];
                            format!("{}:{}", s(f.name_strindex), loc.lines[0].line)
                        })
                        .collect();
                    rows.push((pid, tid, names, x.values.clone()));
                }
            }
        }
        (types, rows)
    }

    #[test]
    fn every_sample_equals_the_pprof_exports() {
        let p = example();
        let (pp_types, mut pp_rows) = from_pprof(&crate::export::pprof::pprof(&p, &[]));
        let r = ExportProfilesServiceRequest::decode(otlp(&p, &[], "h").as_slice()).unwrap();
        let (types, mut rows) = from_otlp(&r);
        assert_eq!(types, pp_types);
        pp_rows.sort();
        rows.sort();
        assert!(!rows.is_empty());
        assert_eq!(rows, pp_rows);
        let d = r.dictionary.unwrap();
        assert_eq!(d.string_table[0], "");
        assert_eq!(d.location_table[0], pb::Location::default());
        assert_eq!(d.stack_table[0], pb::Stack::default());
        assert_eq!(d.mapping_table[0], pb::Mapping::default());
    }

    #[test]
    fn a_containers_process_names_its_container_and_pod() {
        let p = example();
        let pid = p.stacks[0].pid;
        let o = ProcessOrigin {
            pid,
            origin: Origin {
                container_id: Some("abc".into()),
                pod_uid: Some("u-1".into()),
                hostname: Some("web-0".into()),
                ..Default::default()
            },
        };
        let r = request(&p, &[o], "node-1");
        let attrs: Vec<(String, String)> = r
            .resource_profiles
            .iter()
            .flat_map(|rp| &rp.resource.as_ref().unwrap().attributes)
            .map(|a| {
                (
                    a.key.clone(),
                    format!("{:?}", a.value.as_ref().unwrap().value),
                )
            })
            .collect();
        for (k, v) in [
            ("host.name", "node-1"),
            ("container.id", "abc"),
            ("k8s.pod.uid", "u-1"),
            ("k8s.pod.name", "web-0"),
        ] {
            assert!(
                attrs.iter().any(|(a, b)| a == k && b.contains(v)),
                "{k}={v} missing from {attrs:?}"
            );
        }
    }
}
