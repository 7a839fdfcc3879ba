//! What a session shows of the processes counted in-process (`tracer_inspect::python::inproc`):
//! how they were counted, and their functions as the report's.

use std::collections::HashMap;

use tracer_report::{PyCaller, PyFunction};

/// Why a process whose in-process start was left pending is counted so: with the counter's
/// tool id once it started.
pub fn late_start_why(tool: Option<u32>) -> String {
    let tool = tool.map(|t| format!(" (tool id {t})")).unwrap_or_default();
    format!(
        "sys.monitoring callbacks{tool}, loaded through remote execution at the process's first safe point after the start (every thread was in native code then; it ran no Python before)"
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
