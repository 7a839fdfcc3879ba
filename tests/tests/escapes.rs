//! Names a traced program chooses reach the terminal escaped: a Python function renamed to
//! hold a screen-clearing escape, a newline and a C1 control shows as visible escapes in the
//! tables `tracerctl start` and `tracerctl report` print, and as itself in JSON.

use serde_json::Value;
use tracer_tests::{python, root_or_skip, script, Daemon};

/// The name `escape_names.py` gives its function.
const EVIL: &str = "evil\x1b[2J\n\u{9b}name";
/// How the tables show it.
const ESCAPED: &str = "evil\\x1b[2J\\n\\u{9b}name";

/// Text for a terminal: no control character but its own line ends, and the name escaped.
fn assert_escaped(what: &str, out: &[u8]) -> String {
    assert!(
        !out.contains(&0x1b),
        "{what} prints a raw ESC: {:?}",
        String::from_utf8_lossy(out)
    );
    let text = String::from_utf8(out.to_vec()).unwrap();
    let raw: Vec<char> = text
        .chars()
        .filter(|&c| c.is_control() && c != '\n')
        .collect();
    assert!(raw.is_empty(), "{what} prints raw {raw:?}: {text:?}");
    assert!(
        text.contains(&format!("({ESCAPED})")),
        "{what} does not show {ESCAPED}:\n{text}"
    );
    text
}

#[test]
fn names_with_terminal_escapes_are_printed_escaped() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let out = d
        .ctl()
        .args(["start", "--mode=counting", "--python", "--"])
        .arg(python())
        .arg(script("escape_names.py"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tracerctl start: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let started = assert_escaped("tracerctl start", &out.stdout);
    // "session ID · counting · pid N (launched)"
    let id = started
        .lines()
        .find_map(|l| l.strip_prefix("session "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("no session line in:\n{started}"))
        .to_owned();
    let report = d.run(&["report", &id]);
    assert!(report.status.success());
    assert_escaped("tracerctl report", &report.stdout);
    // The machine format keeps the name as the program spelled it.
    let json: Value = d.report_json(&id);
    let f = json["python"]["functions"]
        .as_array()
        .expect("python functions")
        .iter()
        .find(|f| f["qualname"] == EVIL)
        .unwrap_or_else(|| panic!("no function named {EVIL:?} in {}", json["python"]));
    assert_eq!(f["ncalls"], 1000, "{f}");
}
