//! Reading counts files, which belong to the counted process's user: tables at tracerd's own
//! capacities, names within a budget, the start script's own frames taken out.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use tracer_common::inproc::{self, Edge, Entry, Header, StrRef};

use super::{files::Mapping, Counts, Function};

/// Takes out the start script's own frames: a thread that runs it after the counter started
/// (every thread was asked) is counted entering its function and module code, which are
/// nobody's calls. They are the `_tracer_pycount` functions of `<string>` and the module code
/// objects that called them.
pub(super) fn drop_script_frames(c: &mut Counts) {
    let script: Vec<u64> = c
        .functions
        .iter()
        .filter(|f| f.filename == "<string>" && f.qualname == "_tracer_pycount")
        .map(|f| f.code)
        .collect();
    if script.is_empty() {
        return;
    }
    let modules: Vec<u64> = c
        .edges
        .iter()
        .filter(|e| script.contains(&e.callee))
        .map(|e| e.caller)
        .collect();
    let own = |code: &u64| script.contains(code) || modules.contains(code);
    c.functions.retain(|f| !own(&f.code));
    c.edges.retain(|e| !own(&e.caller) && !own(&e.callee));
}

/// Bounds on what one reading of counters may cost tracerd, whatever the files say: the
/// files belong to the counted process's user.
pub(super) struct Budget {
    /// Bytes of names still to be read (names read once per file, however often named).
    names: usize,
    /// Functions and caller pairs still to be kept, all files together.
    records: usize,
    /// Those left unread for want of it.
    pub(super) over: u64,
    /// Past it, no more files are read.
    deadline: Instant,
}

/// The longest name kept whole; longer ones are cut (and counted as not named).
const MAX_NAME: usize = 4096;
/// Name bytes one session's end may read, all files together.
pub(super) const NAME_BYTES: usize = 32 << 20;
/// Functions and caller pairs one end keeps, all files together (~50 bytes each).
const MAX_RECORDS: usize = 2 << 20;
/// Counts files one end reads: the process and its forked children.
pub(super) const MAX_FILES: usize = 1024;
/// How long one end may spend reading.
pub(super) const READ_TIME: Duration = Duration::from_secs(10);
/// Files a live view (Prometheus) reads, and its name bytes.
pub(super) const PEEK_FILES: usize = 8;
pub(super) const PEEK_NAME_BYTES: usize = 8 << 20;

impl Budget {
    pub(super) fn new(names: usize, time: Duration) -> Self {
        Self {
            names,
            records: MAX_RECORDS,
            over: 0,
            deadline: Instant::now() + time,
        }
    }

    /// Takes one record out of the budget; false (counted) when none is left.
    fn keep(&mut self) -> bool {
        if self.records == 0 {
            self.over += 1;
            return false;
        }
        self.records -= 1;
        true
    }

    pub(super) fn late(&self) -> bool {
        Instant::now() >= self.deadline
    }
}

/// One file's names, each read once and charged to the budget.
struct Names<'a> {
    map: &'a Mapping,
    seen: HashMap<(u32, u32), String>,
    lost: u64,
}

impl Names<'_> {
    fn get(&mut self, r: StrRef, budget: &mut Budget) -> String {
        if let Some(s) = self.seen.get(&(r.offset, r.len)) {
            return s.clone();
        }
        let name = match self.map.name_bytes(r) {
            Some(b) if b.len().min(MAX_NAME) <= budget.names => {
                let cut = &b[..b.len().min(MAX_NAME)];
                budget.names -= cut.len();
                if cut.len() < b.len() {
                    self.lost += 1;
                }
                String::from_utf8_lossy(cut).into_owned()
            }
            Some(_) => {
                self.lost += 1;
                "[name not read: over tracer's budget for names]".to_owned()
            }
            None => String::new(),
        };
        self.seen.insert((r.offset, r.len), name.clone());
        name
    }
}

/// Whether a mapped file is a counts file as this tracerd makes them.
pub(super) fn well_formed(h: &Header) -> bool {
    h.magic == inproc::MAGIC
        && h.version == inproc::VERSION
        && (h.entries_cap, h.edges_cap, h.strings_cap) == inproc::CAPS
}

/// The counts in a file; `edges`: the caller pairs too. Tables are read at tracerd's own
/// capacities, names within `budget`.
pub(super) fn read_counts(map: &Mapping, edges: bool, budget: &mut Budget) -> Counts {
    let h = map.header();
    let mut names = Names {
        map,
        seen: HashMap::new(),
        lost: 0,
    };
    let mut entries =
        map.records::<Entry>(inproc::entries_offset(), inproc::ENTRIES, |e| e.code != 0);
    entries.retain(|_| budget.keep());
    let functions = entries
        .into_iter()
        .map(|e| Function {
            code: e.code,
            qualname: names.get(e.qualname, budget),
            filename: names.get(e.filename, budget),
            firstlineno: e.firstlineno,
            ncalls: e.ncalls,
            primitive: e.primitive,
            tottime_ns: e.tottime_ns,
            cumtime_ns: e.cumtime_ns,
        })
        .collect();
    let edges = if edges {
        let mut edges =
            map.records::<Edge>(inproc::edges_offset(inproc::ENTRIES), inproc::EDGES, |e| {
                e.callee != 0
            });
        edges.retain(|_| budget.keep());
        edges
    } else {
        Vec::new()
    };
    Counts {
        pid: h.pid,
        functions,
        edges,
        lost_calls: h.lost_calls,
        lost_edges: h.lost_edges,
        lost_names: h.lost_names.saturating_add(names.lost),
        state: h.state,
        namespace_pid: false,
        handover_failed: (h.state == tracer_common::inproc::state::HANDED)
            .then(|| String::from_utf8_lossy(h.why_text()).into_owned())
            // The session ending first is no loss: nothing ran uncounted within it.
            .filter(|why| !why.is_empty() && why != super::handover::ENDED),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_run_of_the_start_script_is_not_counted() {
        let f = |code, qualname: &str, filename: &str| Function {
            code,
            qualname: qualname.into(),
            filename: filename.into(),
            ncalls: 1,
            ..Function::default()
        };
        let edge = |caller, callee| Edge {
            caller,
            callee,
            ncalls: 1,
            ..Edge::default()
        };
        let mut c = Counts {
            functions: vec![
                f(1, "<module>", "<string>"),
                f(2, "_tracer_pycount", "<string>"),
                f(3, "<module>", "<string>"),
                f(4, "work", "app.py"),
            ],
            edges: vec![edge(1, 2), edge(3, 4)],
            ..Counts::default()
        };
        drop_script_frames(&mut c);
        let left: Vec<u64> = c.functions.iter().map(|f| f.code).collect();
        assert_eq!(left, [3, 4], "a program's own exec'd code stays");
        assert_eq!(c.edges.len(), 1);
    }
}
