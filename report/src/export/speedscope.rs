//! speedscope's JSON format (<https://www.speedscope.app/file-format-schema.json>): frames
//! shared by all profiles, one "sampled" profile per process, stacks as frame indices.

use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Value};

use crate::profile::{Frame, FrameKind, Profile, Stack};

/// speedscope's key for a frame: name, file, line.
type Key = (String, Option<String>, Option<u32>);

/// The profile as a speedscope file named `name`. The busiest process comes first, as the
/// one speedscope opens. Weights are CPU nanoseconds, or bare sample counts when the
/// profile has no period.
pub fn speedscope(p: &Profile, name: &str) -> String {
    let (unit, weight) = if p.period_ns > 0 {
        ("nanoseconds", p.period_ns)
    } else {
        ("none", 1)
    };
    let mut frames: Vec<Value> = Vec::new();
    let mut index: HashMap<Key, usize> = HashMap::new();
    let mut processes: BTreeMap<u32, Vec<&Stack>> = BTreeMap::new();
    for s in p.stacks.iter().filter(|s| p.weight(s) > 0) {
        processes.entry(s.pid).or_default().push(s);
    }
    let mut processes: Vec<_> = processes.into_iter().collect();
    let stack_weight = |s: &Stack| match p.off_cpu {
        // Wall-clock: nanoseconds on the CPU and off it.
        Some(_) => p.weight(s),
        None => s.count.saturating_mul(weight),
    };
    let total = |stacks: &[&Stack]| stacks.iter().map(|s| stack_weight(s)).sum::<u64>();
    processes.sort_by_key(|(pid, stacks)| (std::cmp::Reverse(total(stacks)), *pid));

    let profiles: Vec<Value> = processes
        .into_iter()
        .map(|(pid, stacks)| {
            let samples: Vec<Vec<usize>> = stacks
                .iter()
                .map(|s| {
                    let keys = s.frames.iter().map(|f| key(p, f));
                    keys.map(|k| {
                        *index.entry(k).or_insert_with_key(|k| {
                            frames.push(frame(k));
                            frames.len() - 1
                        })
                    })
                    .collect()
                })
                .collect();
            let weights: Vec<u64> = stacks.iter().map(|s| stack_weight(s)).collect();
            let process = stacks[0]
                .frames
                .first()
                .filter(|f| f.kind == FrameKind::Process);
            json!({
                "type": "sampled",
                "name": process.map_or_else(|| format!("pid {pid}"), |f| f.name.clone()),
                "unit": unit,
                "startValue": 0,
                "endValue": weights.iter().fold(0u64, |a, w| a.saturating_add(*w)),
                "samples": samples,
                "weights": weights,
            })
        })
        .collect();
    json!({
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": { "frames": frames },
        "profiles": profiles,
        "name": name,
        "activeProfileIndex": 0,
        "exporter": "tracer",
    })
    .to_string()
}

/// Python frames keep their file and line apart, as py-spy writes them; native frames name
/// their binary when the source file is unknown; kernel frames are marked as in folded stacks.
fn key(p: &Profile, f: &Frame) -> Key {
    match f.kind {
        FrameKind::Process => (f.name.clone(), None, None),
        FrameKind::Python => (f.name.clone(), f.file.clone(), f.line),
        FrameKind::Native => {
            let binary = f.mapping.and_then(|m| p.mappings.get(m)).map(|m| &m.path);
            (f.name.clone(), f.file.clone().or(binary.cloned()), f.line)
        }
        FrameKind::Kernel => (f.label(), Some("[kernel]".into()), None),
        FrameKind::OffCpu | FrameKind::Task => (f.label(), None, None),
    }
}

fn frame((name, file, line): &Key) -> Value {
    let mut v = json!({ "name": name });
    if let Some(file) = file {
        v["file"] = json!(file);
    }
    if let Some(line) = line {
        v["line"] = json!(line);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::folded::tests::example;

    /// A profile's stacks as `name` lists, root first, each with its weight.
    fn stacks(doc: &Value, profile: usize) -> Vec<(Vec<String>, u64)> {
        let frames = doc["shared"]["frames"].as_array().unwrap();
        let prof = &doc["profiles"][profile];
        let samples = prof["samples"].as_array().unwrap();
        let weights = prof["weights"].as_array().unwrap();
        assert_eq!(samples.len(), weights.len());
        samples
            .iter()
            .zip(weights)
            .map(|(s, w)| {
                let names = s.as_array().unwrap().iter().map(|i| {
                    let f = &frames[usize::try_from(i.as_u64().unwrap()).unwrap()];
                    f["name"].as_str().unwrap().to_owned()
                });
                (names.collect(), w.as_u64().unwrap())
            })
            .collect()
    }

    #[test]
    fn indices_are_consistent() {
        let doc: Value = serde_json::from_str(&speedscope(&example(), "app")).unwrap();
        assert_eq!(
            doc["$schema"],
            "https://www.speedscope.app/file-format-schema.json"
        );
        assert_eq!(doc["name"], "app");
        assert_eq!(doc["exporter"], "tracer");
        assert_eq!(doc["activeProfileIndex"], 0);

        // Every frame is used, once in the table.
        let frames = doc["shared"]["frames"].as_array().unwrap();
        assert_eq!(frames.len(), 11);
        let module = frames.iter().find(|f| f["name"] == "<module>").unwrap();
        assert_eq!(module["file"], "/srv/app.py");
        assert_eq!(module["line"], 10);
        let kernel = frames.iter().find(|f| f["name"] == "do_syscall_64_[k]");
        assert_eq!(kernel.unwrap()["file"], "[kernel]");
        let start = frames.iter().find(|f| f["name"] == "_start").unwrap();
        assert_eq!(start["file"], "/opt/worker");
        assert!(start.get("line").is_none());

        let profiles = doc["profiles"].as_array().unwrap();
        assert_eq!(profiles.len(), 2);
        let first = &profiles[0];
        assert_eq!(first["type"], "sampled");
        assert_eq!(first["name"], "python3 (pid 100)");
        assert_eq!(first["unit"], "nanoseconds");
        assert_eq!(first["startValue"], 0);
        assert_eq!(first["endValue"], 90_000_000);
        assert_eq!(
            stacks(&doc, 0),
            [
                (
                    vec![
                        "python3 (pid 100)".to_owned(),
                        "<module>".into(),
                        "main".into(),
                        "PyObject_Call".into(),
                        "do_syscall_64_[k]".into()
                    ],
                    50_000_000
                ),
                (
                    vec!["python3 (pid 100)".into(), "<module>".into(), "work".into()],
                    30_000_000
                ),
                (
                    vec!["python3 (pid 100)".into(), "<module>".into(), "work".into()],
                    10_000_000
                ),
            ]
        );
        assert_eq!(profiles[1]["name"], "worker (pid 200)");
        assert_eq!(profiles[1]["endValue"], 30_000_000);
        let worker = stacks(&doc, 1);
        assert_eq!(worker[1].0[1], "odd;name\n\"x\"");
    }

    #[test]
    fn no_period_counts_samples() {
        let mut p = example();
        p.period_ns = 0;
        let doc: Value = serde_json::from_str(&speedscope(&p, "app")).unwrap();
        assert_eq!(doc["profiles"][0]["unit"], "none");
        assert_eq!(doc["profiles"][0]["endValue"], 9);
    }

    #[test]
    fn wall_clock_weights_are_nanoseconds_on_and_off_the_cpu() {
        let p = crate::export::folded::tests::wall_example();
        let doc: Value = serde_json::from_str(&speedscope(&p, "app")).unwrap();
        let weights = doc["profiles"][0]["weights"].as_array().unwrap();
        assert!(weights.iter().any(|w| w == 250_000_000), "{weights:?}");
        // 5 samples at 10 ms.
        assert!(weights.iter().any(|w| w == 50_000_000), "{weights:?}");
    }
}
