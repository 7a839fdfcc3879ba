//! CPython's experimental JIT (3.13+, built in but off unless `PYTHON_JIT=1` where a
//! distribution enables it): hot code runs from compiled traces that pass none of the opcode
//! handlers tracer probes, so counting cannot stay exact in a process that turns it on.

use std::fs;

/// Whether an interpreter binary's bytes show a JIT build: only builds with the JIT (or the
/// tier-2 optimizer) read `PYTHON_JIT`.
pub fn built_in_bytes(data: &[u8]) -> bool {
    const NAME: &[u8] = b"PYTHON_JIT\0";
    data.windows(NAME.len()).any(|w| w == NAME)
}

/// Whether `pid`'s environment turns the JIT on (the interpreter takes any non-zero integer),
/// and the value it found.
pub fn enabled(pid: u32) -> Option<String> {
    let env = fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|kv| {
        let v = kv.strip_prefix(b"PYTHON_JIT=")?;
        let v = String::from_utf8_lossy(v).into_owned();
        let n: i64 = v
            .trim()
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '-')
            .collect::<String>()
            .parse()
            .unwrap_or(0);
        (n != 0).then_some(v)
    })
}

/// The report's line for a process whose counts the JIT makes inexact, if it is one.
pub fn warning(pid: u32, jit_built_in: bool) -> Option<String> {
    if !jit_built_in {
        return None;
    }
    let value = enabled(pid)?;
    Some(format!(
        "pid {pid}: counts are not exact: CPython's JIT is on (PYTHON_JIT={value}), and calls inside JIT-compiled code pass none of the probed opcode handlers; run it without PYTHON_JIT for exact counts"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_name_marks_a_jit_build() {
        assert!(built_in_bytes(b"abc\0PYTHON_JIT\0def"));
        assert!(!built_in_bytes(b"abc\0PYTHON_JITTER\0"));
    }

    #[test]
    fn this_process_does_not_turn_it_on() {
        if std::env::var_os("PYTHON_JIT").is_none() {
            assert_eq!(enabled(std::process::id()), None);
            assert_eq!(warning(std::process::id(), true), None);
        }
    }
}
