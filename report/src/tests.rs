//! The report's own table and model.

use super::*;

#[test]
fn numbers_are_grouped() {
    assert_eq!(group(0), "0");
    assert_eq!(group(999), "999");
    assert_eq!(group(1000), "1,000");
    assert_eq!(group(1_234_567), "1,234,567");
    assert_eq!(group_f(1234.5), "1,234.50");
}

#[test]
fn unavailable_counters_are_never_zero() {
    let r = Report {
        counters: vec![
            CounterResult::from(&Counter {
                event: "cycles".into(),
                result: Some(counter::Result::Unavailable("no PMU".into())),
                unit: "count".into(),
                ..Default::default()
            }),
            CounterResult::from(&Counter {
                event: "page-faults".into(),
                result: Some(counter::Result::Value(1234)),
                unit: "count".into(),
                time_enabled_ns: 10,
                time_running_ns: 10,
            }),
        ],
        ..Default::default()
    };
    let json: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(json["counters"][0]["unavailable"], "no PMU");
    assert!(json["counters"][0].get("value").is_none());
    assert_eq!(json["counters"][1]["value"], 1234);
    let table = r.to_table();
    assert!(table.contains("<not supported>       cycles"), "{table}");
    assert!(table.contains("1,234       page-faults"), "{table}");
    assert_eq!(Report::from_json(&r.to_json()).unwrap(), r);
}

#[test]
fn names_of_traced_processes_cannot_drive_the_terminal() {
    use crate::profile::{Frame, FrameKind, Profile, Stack};
    // Clears the screen; forges a line of the table; a C1 CSI.
    let evil = "evil\x1b[2Jname\n   999 forged\u{9b}31m";
    let escaped = "evil\\x1b[2Jname\\n   999 forged\\u{9b}31m";
    let r = Report {
        session: Summary {
            id: "s1".into(),
            ..Default::default()
        },
        processes: Processes {
            command: Some(evil.into()),
            containers: vec![ProcessOrigin {
                pid: 7,
                origin: Origin {
                    container_id: Some(evil.into()),
                    hostname: Some(evil.into()),
                    ..Default::default()
                },
            }],
            ..Default::default()
        },
        python: Some(PythonReport {
            functions: vec![PyFunction {
                pid: 7,
                qualname: evil.into(),
                filename: evil.into(),
                ncalls: 1,
                primitive_calls: 1,
                ..Default::default()
            }],
            ..Default::default()
        }),
        native: Some(NativeReport {
            calls: vec![NativeCalls {
                pid: 7,
                binary: evil.into(),
                symbol: evil.into(),
                calls: 1,
            }],
            ..Default::default()
        }),
        cuda: Some(CudaReport {
            launches: vec![CudaLaunch {
                kernel: evil.into(),
                call_site: evil.into(),
                caller: evil.into(),
                launches: 1,
                ..Default::default()
            }],
            ..Default::default()
        }),
        profile: Some(Profile {
            stacks: vec![Stack {
                comm: evil.into(),
                frames: vec![Frame {
                    kind: FrameKind::Python,
                    name: evil.into(),
                    file: Some(evil.into()),
                    line: Some(3),
                    ..Default::default()
                }],
                count: 1,
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let table = r.to_table();
    let raw: Vec<char> = table
        .chars()
        .filter(|&c| c.is_control() && c != '\n')
        .collect();
    assert!(raw.is_empty(), "raw controls {raw:?} in:\n{table}");
    // Each name stays on its row: no line starts with the forged text.
    assert!(!table
        .lines()
        .any(|l| l.trim_start().starts_with("999 forged")));
    for row in [
        format!("({escaped})"),
        format!("{escaped} ({escaped})"),
        format!("← native: {escaped}"),
        format!("[{escaped}]"),
    ] {
        assert!(table.contains(&row), "no {row:?} in:\n{table}");
    }
    // The machine formats keep the name as data.
    let json = r.to_json();
    assert_eq!(Report::from_json(&json).unwrap(), r);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&json).unwrap()["python"]["functions"][0]
            ["qualname"],
        evil
    );
}
