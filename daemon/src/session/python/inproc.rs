//! What a session shows of the processes counted in-process (`tracer_inspect::python::inproc`):
//! how they were counted, and their functions as the report's.

use std::collections::HashMap;

use tracer_report::{PyCaller, PyFunction};

/// Why a process whose in-process start was left pending is counted so: with the counter's
/// tool id once it started (a profile function's id on 3.10 and 3.11).
pub fn late_start_why(tool: Option<u32>) -> String {
    let how = match tool {
        Some(tracer_common::inproc::PROFILE_FUNCTION) => {
            "a C profile function on every thread (cProfile's hook)".to_owned()
        }
        Some(t) => format!("sys.monitoring callbacks (tool id {t})"),
        None => "tracer's counter".to_owned(),
    };
    format!(
        "{how}, started at the process's first chance after the session's start (until then every thread was in native code, or one held the GIL there; no Python ran before)"
    )
}

/// Bytes of caller names the report's in-process part may hold, all processes together:
/// each pair names its caller, and a counter's user could make every name long.
const CALLER_NAME_BYTES: usize = 64 << 20;

/// The report's functions from in-process counters: callers are named from the same
/// process's table (a caller is always counted before its callee ends). And how many
/// callers are shown by code object instead, their names being over
/// [`CALLER_NAME_BYTES`].
pub fn inproc_functions(all: &[tracer_inspect::python::inproc::Counts]) -> (Vec<PyFunction>, u64) {
    let mut out = Vec::new();
    let mut left = CALLER_NAME_BYTES;
    let mut unnamed = 0;
    for c in all {
        let names: HashMap<u64, &tracer_inspect::python::inproc::Function> =
            c.functions.iter().map(|f| (f.code, f)).collect();
        let mut callers: HashMap<u64, Vec<PyCaller>> = HashMap::new();
        for e in &c.edges {
            let by_code = || format!("[unknown: code object {:#x}]", e.caller);
            let (qualname, filename, firstlineno) = match names.get(&e.caller) {
                Some(f) if f.qualname.len() + f.filename.len() <= left => {
                    left -= f.qualname.len() + f.filename.len();
                    (f.qualname.clone(), f.filename.clone(), f.firstlineno)
                }
                Some(f) => {
                    unnamed += 1;
                    (by_code(), String::new(), f.firstlineno)
                }
                None => (by_code(), String::new(), 0),
            };
            callers.entry(e.callee).or_default().push(PyCaller {
                qualname,
                filename,
                firstlineno,
                ncalls: e.ncalls,
                primitive_calls: e.primitive,
                tottime_ns: e.tottime_ns,
                cumtime_ns: e.cumtime_ns,
            });
        }
        for f in &c.functions {
            let mut callers = callers.remove(&f.code).unwrap_or_default();
            callers.sort_by(|a, b| {
                b.ncalls
                    .cmp(&a.ncalls)
                    .then_with(|| a.qualname.cmp(&b.qualname))
            });
            out.push(PyFunction {
                callers,
                pid: c.pid,
                qualname: f.qualname.clone(),
                filename: f.filename.clone(),
                firstlineno: f.firstlineno,
                ncalls: f.ncalls,
                primitive_calls: f.primitive,
                tottime_ns: f.tottime_ns,
                cumtime_ns: f.cumtime_ns,
            });
        }
    }
    (out, unnamed)
}

/// Joins the two halves of each function of a process handed over from its in-process
/// counter to the probes (`handed`): counted by one, then by the other, once each.
pub fn merge_handed(functions: &mut Vec<PyFunction>, handed: &std::collections::HashSet<u32>) {
    if handed.is_empty() {
        return;
    }
    let mut at: HashMap<(u32, String, String, i32), usize> = HashMap::new();
    let mut out: Vec<PyFunction> = Vec::with_capacity(functions.len());
    for f in functions.drain(..) {
        let key = (f.pid, f.qualname.clone(), f.filename.clone(), f.firstlineno);
        let Some(&i) = handed.contains(&f.pid).then(|| at.get(&key)).flatten() else {
            at.insert(key, out.len());
            out.push(f);
            continue;
        };
        let into = &mut out[i];
        into.ncalls += f.ncalls;
        into.primitive_calls += f.primitive_calls;
        into.tottime_ns += f.tottime_ns;
        into.cumtime_ns += f.cumtime_ns;
        for c in f.callers {
            match into.callers.iter_mut().find(|d| {
                (&d.qualname, &d.filename, d.firstlineno)
                    == (&c.qualname, &c.filename, c.firstlineno)
            }) {
                Some(d) => {
                    d.ncalls += c.ncalls;
                    d.primitive_calls += c.primitive_calls;
                    d.tottime_ns += c.tottime_ns;
                    d.cumtime_ns += c.cumtime_ns;
                }
                None => into.callers.push(c),
            }
        }
    }
    *functions = out;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(pid: u32, name: &str, ncalls: u64, callers: &[(&str, u64)]) -> PyFunction {
        PyFunction {
            pid,
            qualname: name.into(),
            filename: "a.py".into(),
            firstlineno: 1,
            ncalls,
            primitive_calls: ncalls,
            tottime_ns: ncalls,
            cumtime_ns: ncalls,
            callers: callers
                .iter()
                .map(|&(q, n)| PyCaller {
                    qualname: q.into(),
                    ncalls: n,
                    ..PyCaller::default()
                })
                .collect(),
        }
    }

    #[test]
    fn halves_of_a_handed_process_are_joined_and_others_left_alone() {
        let mut all = vec![
            f(1, "g", 3, &[("main", 3)]),
            f(2, "g", 5, &[]),
            f(1, "g", 4, &[("main", 1), ("h", 3)]),
            f(2, "g", 6, &[]),
        ];
        merge_handed(&mut all, &[1].into_iter().collect());
        assert_eq!(all.len(), 3);
        assert_eq!((all[0].pid, all[0].ncalls, all[0].tottime_ns), (1, 7, 7));
        let callers: Vec<_> = all[0]
            .callers
            .iter()
            .map(|c| (c.qualname.as_str(), c.ncalls))
            .collect();
        assert_eq!(callers, [("main", 4), ("h", 3)]);
        // Two code objects of the same name in a process not handed over stay apart.
        assert_eq!((all[1].ncalls, all[2].ncalls), (5, 6));
    }
}
