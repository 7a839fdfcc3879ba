//! Merging sampling reports from many hosts: pprof profiles into one whose samples carry a
//! `host` label, and folded stacks under a root frame per host.

use std::{collections::HashMap, io::Read as _};

use anyhow::{bail, Context, Result};
use flate2::{read::GzDecoder, write::GzEncoder, Compression};
use prost::Message;
use tracer_proto::pprof as pb;

/// Re-interns strings into the merged profile's table.
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        let mut s = Strings {
            table: Vec::new(),
            index: HashMap::new(),
        };
        s.intern("");
        s
    }

    fn intern(&mut self, v: &str) -> i64 {
        if let Some(&i) = self.index.get(v) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(v.to_owned());
        self.index.insert(v.to_owned(), i);
        i
    }
}

pub fn decode(gz: &[u8]) -> Result<pb::Profile> {
    let mut raw = Vec::new();
    GzDecoder::new(gz)
        .read_to_end(&mut raw)
        .context("the profile is not gzip data")?;
    pb::Profile::decode(raw.as_slice()).context("the profile is not a pprof protobuf")
}

/// One profile holding every host's samples, each labelled `host`; ids are renumbered so
/// mappings, locations and functions of different hosts never collide.
pub fn merge(profiles: &[(String, pb::Profile)]) -> Result<Vec<u8>> {
    let mut out = pb::Profile::default();
    let mut strings = Strings::new();
    let host_key = strings.intern("host");
    let (mut next_mapping, mut next_location, mut next_function) = (1u64, 1u64, 1u64);
    let mut types: Option<Vec<(String, String)>> = None;
    for (host, p) in profiles {
        let s = |i: i64| p.string_table.get(i as usize).map_or("", String::as_str);
        let these: Vec<(String, String)> = p
            .sample_type
            .iter()
            .map(|t| (s(t.r#type).to_owned(), s(t.unit).to_owned()))
            .collect();
        match &types {
            None => {
                out.sample_type = these
                    .iter()
                    .map(|(t, u)| pb::ValueType {
                        r#type: strings.intern(t),
                        unit: strings.intern(u),
                    })
                    .collect();
                out.period_type = p.period_type.as_ref().map(|t| pb::ValueType {
                    r#type: strings.intern(s(t.r#type)),
                    unit: strings.intern(s(t.unit)),
                });
                out.period = p.period;
                out.time_nanos = p.time_nanos;
                types = Some(these);
            }
            Some(t) if *t != these => {
                bail!("{host}'s profile measures {these:?}, the others {t:?}: not mergeable")
            }
            Some(_) => out.time_nanos = out.time_nanos.min(p.time_nanos),
        }
        out.duration_nanos = out.duration_nanos.max(p.duration_nanos);
        let mut mappings = HashMap::new();
        for m in &p.mapping {
            let id = next_mapping;
            next_mapping += 1;
            mappings.insert(m.id, id);
            out.mapping.push(pb::Mapping {
                id,
                filename: strings.intern(s(m.filename)),
                build_id: strings.intern(s(m.build_id)),
                ..m.clone()
            });
        }
        let mut functions = HashMap::new();
        for f in &p.function {
            let id = next_function;
            next_function += 1;
            functions.insert(f.id, id);
            out.function.push(pb::Function {
                id,
                name: strings.intern(s(f.name)),
                system_name: strings.intern(s(f.system_name)),
                filename: strings.intern(s(f.filename)),
            });
        }
        let mut locations = HashMap::new();
        for l in &p.location {
            let id = next_location;
            next_location += 1;
            locations.insert(l.id, id);
            out.location.push(pb::Location {
                id,
                mapping_id: mappings.get(&l.mapping_id).copied().unwrap_or(0),
                address: l.address,
                line: l
                    .line
                    .iter()
                    .map(|line| pb::Line {
                        function_id: functions.get(&line.function_id).copied().unwrap_or(0),
                        line: line.line,
                    })
                    .collect(),
            });
        }
        let host_value = strings.intern(host);
        for sample in &p.sample {
            let mut label: Vec<pb::Label> = sample
                .label
                .iter()
                .map(|l| pb::Label {
                    key: strings.intern(s(l.key)),
                    str: if l.str == 0 {
                        0
                    } else {
                        strings.intern(s(l.str))
                    },
                    num: l.num,
                })
                .collect();
            label.push(pb::Label {
                key: host_key,
                str: host_value,
                num: 0,
            });
            out.sample.push(pb::Sample {
                location_id: sample
                    .location_id
                    .iter()
                    .map(|id| locations.get(id).copied().unwrap_or(0))
                    .collect(),
                value: sample.value.clone(),
                label,
            });
        }
    }
    out.string_table = strings.table;
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    std::io::Write::write_all(&mut gz, &out.encode_to_vec())?;
    Ok(gz.finish()?)
}

/// Folded stacks of every host, each under a root frame naming the host.
pub fn folded(hosts: &[(String, String)]) -> String {
    let mut out = String::new();
    for (host, text) in hosts {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            out.push_str(&host.replace(';', "_"));
            out.push(';');
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(func: &str, samples: i64) -> Vec<u8> {
        let p = pb::Profile {
            sample_type: vec![pb::ValueType { r#type: 1, unit: 2 }],
            sample: vec![pb::Sample {
                location_id: vec![7],
                value: vec![samples],
                label: vec![],
            }],
            location: vec![pb::Location {
                id: 7,
                mapping_id: 0,
                address: 0,
                line: vec![pb::Line {
                    function_id: 3,
                    line: 10,
                }],
            }],
            function: vec![pb::Function {
                id: 3,
                name: 3,
                system_name: 3,
                filename: 0,
            }],
            string_table: vec!["".into(), "samples".into(), "count".into(), func.into()],
            ..Default::default()
        };
        let mut gz = GzEncoder::new(Vec::new(), Compression::default());
        std::io::Write::write_all(&mut gz, &p.encode_to_vec()).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn samples_keep_their_functions_and_gain_a_host_label() {
        let a = decode(&profile("f", 3)).unwrap();
        let b = decode(&profile("g", 5)).unwrap();
        let m = decode(&merge(&[("a".into(), a), ("b".into(), b)]).unwrap()).unwrap();
        assert_eq!(m.sample.len(), 2);
        let s = |i: i64| m.string_table[i as usize].as_str();
        for (sample, (host, func, n)) in m.sample.iter().zip([("a", "f", 3), ("b", "g", 5)]) {
            assert_eq!(sample.value, [n]);
            let label = &sample.label[0];
            assert_eq!((s(label.key), s(label.str)), ("host", host));
            let loc = m
                .location
                .iter()
                .find(|l| l.id == sample.location_id[0])
                .unwrap();
            let f = m
                .function
                .iter()
                .find(|f| f.id == loc.line[0].function_id)
                .unwrap();
            assert_eq!(s(f.name), func);
        }
        assert_eq!(s(m.sample_type[0].r#type), "samples");
    }
}
