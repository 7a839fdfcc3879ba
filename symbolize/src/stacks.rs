//! From a raw sample to a named stack: unwind the user stack copy, name native and kernel
//! frames, read Python frames' names and lines from the process, and put the Python frames
//! in place of the interpreter's eval-loop frames that run them.
//!
//! Frames are interned: a sample becomes a list of small ids, and each distinct frame is
//! named once (per binary and offset, per code object and instruction).

use std::{
    collections::{BTreeSet, HashMap},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tracer_common::{
    sample_flag, PySampleFrame, SampleEvent, PY_FRAME_ENTRY, PY_FRAME_SHIM, PY_FRAME_TASK,
    SAMPLE_PY_DEPTH,
};

use tracer_inspect::{
    python::{layout::Version, linetable},
    unwind::{End, MapEntry, ProcMaps, Regs, Unwinder},
};
use tracer_report::profile::{Frame, FrameKind, Mapping};

mod code;
mod merge;

pub use code::python_location;
use code::{instruction_offset, read_code, task_name, Code};
use merge::{first_at, merge};

use crate::symbolize::Symbolizer;

/// Native frames unwound per sample at most: a 64 KiB stack copy holds ~1,000 frames of
/// 64 bytes (a libpython without symbols nests 6 or more frames per Python call from C).
const MAX_NATIVE_FRAMES: usize = 1024;
/// How long a process's memory map is trusted before it is read again on a miss.
const MAPS_TTL: Duration = Duration::from_millis(200);

/// A sample's stack as captured, before native and kernel frames are named: what must be
/// read while the process lives (its maps, stack, code objects) is in it; naming, the slow
/// part, waits for the report.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RawStack {
    /// (binary, file offset), leaf first; binary `UNMAPPED` keeps the address.
    pub native: Vec<(u32, u64)>,
    /// Python frame ids, leaf first, with whether each starts a run of the eval loop.
    pub python: Vec<(u32, bool)>,
    /// Kernel addresses, leaf first.
    pub kernel: Vec<u64>,
    /// In an asyncio task (3.14+): the tasks awaiting the running one and their coroutines,
    /// root first, ending with the running task; and the index in `python` of the running
    /// task's coroutine frame, where the thread's own frames (the event loop's) end.
    pub tasks: Vec<u32>,
    pub task_frame: Option<u32>,
}

/// Between the Python frames of the thread a thread running no Python works for (the last
/// to launch from Python, or to hold the GIL) and that thread's own native frames, in a
/// CUDA launch's stack (`PY_ELSEWHERE`).
const ELSEWHERE_MARK: &str = "[a thread without Python, for the frames above]";

/// `RawStack::native` binary of an address outside every mapping.
const UNMAPPED: u32 = u32::MAX;

/// A captured sample, and how it was unwound (for the unwinding statistics).
pub struct Captured {
    pub raw: RawStack,
    pub end: End,
    pub python: bool,
    /// The Python chain was read whole (not cut, no failed read).
    pub python_complete: bool,
}

/// A binary seen in a sampled process, kept open so that it can be named after the
/// process is gone (also in a container, whose root dies with it).
struct Binary {
    key: BinaryKey,
    mapping: Mapping,
    file: Option<std::fs::File>,
}

/// A mapped binary's identity: device, inode, path in the maps.
type BinaryKey = (u64, u64, String);

/// Old id → new id of what a [`Resolver::compact`] kept.
#[derive(Default)]
pub struct Renumbered {
    frames: HashMap<u32, u32>,
    binaries: HashMap<u32, u32>,
}

impl Renumbered {
    pub fn frame(&self, id: u32) -> u32 {
        self.frames[&id]
    }

    pub fn stack(&self, mut raw: RawStack) -> RawStack {
        for (b, _) in &mut raw.native {
            if *b != UNMAPPED {
                *b = self.binaries[b];
            }
        }
        for (f, _) in &mut raw.python {
            *f = self.frames[f];
        }
        for f in &mut raw.tasks {
            *f = self.frames[f];
        }
        raw
    }
}

#[derive(Default)]
pub struct Resolver {
    unwinder: Unwinder,
    /// Build ids of the binaries as they are first seen.
    symbolizer: Symbolizer,
    /// Names addresses ([`Naming::run`]) without the lock its caller keeps the resolver
    /// under. Knows the binaries by their `/proc/self/fd/N` paths, so its parsed files stay
    /// open until [`Self::compact`] closes ours.
    namer: Arc<Mutex<Symbolizer>>,
    maps: HashMap<u32, (ProcMaps, Instant)>,
    binaries: Vec<Binary>,
    binary_ids: HashMap<BinaryKey, u32>,
    native: HashMap<(u32, u64), u32>,
    kernel: HashMap<u64, u32>,
    frames: Vec<Frame>,
    frame_ids: HashMap<Frame, u32>,
    /// Frames that are the interpreter's eval loop, where Python frames go.
    eval_frames: BTreeSet<u32>,
    /// Per binary, the eval loop's file-offset ranges where its symbols do not name them
    /// (read once, for binaries named like an interpreter).
    eval_ranges: HashMap<u32, Vec<(u64, u64)>>,
    codes: HashMap<(u32, u64), Code>,
    python_frames: HashMap<(u32, u64, u64, u64), u32>,
    /// What limited the last sample's stack, for its session's report (taken after each).
    pub notes: BTreeSet<String>,
}

impl Resolver {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn frame(&self, id: u32) -> &Frame {
        &self.frames[id as usize]
    }

    pub fn mapping(&self, index: usize) -> &Mapping {
        &self.binaries[index].mapping
    }

    /// Forgets what was read of processes that are gone (an `--all` session sees many).
    pub fn forget_exited(&mut self) {
        let pids: BTreeSet<u32> = self
            .maps
            .keys()
            .copied()
            .chain(self.codes.keys().map(|k| k.0))
            .collect();
        for pid in pids {
            if !tracer_inspect::process::alive(pid) {
                self.forget(pid);
            }
        }
    }

    /// Forgets every binary, frame and name that the stacks in `live` (a process frame and
    /// a captured stack each) do not refer to, and renumbers what stays: the files of binaries
    /// no session needs are closed, and the caches start again from what is in use.
    pub fn compact<'a>(&mut self, live: impl Iterator<Item = (u32, &'a RawStack)>) -> Renumbered {
        let (mut frames, mut binaries) = (BTreeSet::new(), BTreeSet::new());
        for (root, raw) in live {
            frames.insert(root);
            frames.extend(raw.python.iter().map(|&(f, _)| f));
            frames.extend(raw.tasks.iter().copied());
            binaries.extend(
                raw.native
                    .iter()
                    .map(|&(b, _)| b)
                    .filter(|&b| b != UNMAPPED),
            );
        }
        let mut map = Renumbered::default();
        let mut dropped = Vec::new();
        self.binary_ids.clear();
        for (old, b) in std::mem::take(&mut self.binaries).into_iter().enumerate() {
            let old = old as u32;
            if binaries.contains(&old) {
                let new = self.binaries.len() as u32;
                self.binary_ids.insert(b.key.clone(), new);
                map.binaries.insert(old, new);
                self.binaries.push(b);
            } else {
                dropped.push(b);
            }
        }
        // The namer knows them by their `/proc/self/fd/N` paths, which the next binaries
        // opened may reuse: forget them, and close its files, before ours.
        self.namer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .evict(dropped.iter().map(read_path).collect());
        drop(dropped);
        self.frame_ids.clear();
        for (old, mut f) in std::mem::take(&mut self.frames).into_iter().enumerate() {
            let old = old as u32;
            if frames.contains(&old) {
                let new = self.frames.len() as u32;
                f.mapping = f
                    .mapping
                    .and_then(|m| map.binaries.get(&(m as u32)).map(|&n| n as usize));
                self.frame_ids.insert(f.clone(), new);
                map.frames.insert(old, new);
                self.frames.push(f);
            }
        }
        // Named again when needed: the symbolizer keeps names per binary identity.
        self.native.clear();
        self.kernel.clear();
        self.eval_frames.clear();
        self.eval_ranges.clear();
        self.python_frames.clear();
        self.unwinder.trim();
        map
    }

    /// Forgets what is per process (its maps and code objects) once it is gone.
    pub fn forget(&mut self, pid: u32) {
        self.maps.remove(&pid);
        self.codes.retain(|(p, _), _| *p != pid);
        self.python_frames.retain(|(p, ..), _| *p != pid);
    }

    fn intern(&mut self, frame: Frame) -> u32 {
        if let Some(&id) = self.frame_ids.get(&frame) {
            return id;
        }
        let id = self.frames.len() as u32;
        self.frames.push(frame.clone());
        self.frame_ids.insert(frame, id);
        id
    }

    /// The process's root frame: `comm (pid N)`.
    pub fn process_frame(&mut self, comm: &str, pid: u32) -> u32 {
        self.intern(Frame {
            kind: FrameKind::Process,
            name: format!("{comm} (pid {pid})"),
            ..Frame::default()
        })
    }

    /// Captures a sample: unwinds its user stack and names its Python frames, while the
    /// process lives. `kernel` holds the kernel stack's addresses, leaf first.
    pub fn capture(
        &mut self,
        ev: &SampleEvent,
        kernel: Vec<u64>,
        version: Option<&'static Version>,
    ) -> Captured {
        let (native, end) = self.native(ev);
        let (mut python, mut tasks, mut task_frame) = (Vec::new(), Vec::new(), None);
        let is_python = ev.flags & sample_flag::PYTHON != 0;
        if let Some(v) = version.filter(|_| is_python) {
            let depth = (ev.py_depth as usize).min(SAMPLE_PY_DEPTH);
            let raw = &ev.py[..depth];
            let own = raw
                .iter()
                .position(|f| f.code & PY_FRAME_TASK != 0)
                .unwrap_or(depth);
            let at = (ev.py_task as usize).checked_sub(1).filter(|&i| i < own);
            (python, task_frame) = self.python(ev.pid, &raw[..own], v, at);
            tasks = self.tasks(ev.pid, &raw[own..], v);
            if ev.flags & sample_flag::PY_ELSEWHERE != 0 && !python.is_empty() {
                // Not this thread's frames: the thread's own (native) ones follow a mark.
                let mark = self.intern(Frame {
                    kind: FrameKind::Python,
                    name: ELSEWHERE_MARK.into(),
                    ..Frame::default()
                });
                python.insert(0, (mark, false));
            }
        }
        Captured {
            raw: RawStack {
                native,
                python,
                kernel,
                tasks,
                task_frame,
            },
            end,
            python: is_python,
            python_complete: is_python
                && ev.flags & (sample_flag::PY_TRUNCATED | sample_flag::PY_READ_FAILED) == 0,
        }
    }

    /// A captured stack's frames, root first, without the process frame: Python frames in
    /// place of the eval-loop frames. Its native and kernel frames must have been named
    /// ([`Self::to_name`], [`Naming::run`], [`Self::apply`]). `tasks`: a sample in an
    /// asyncio task starts with the tasks awaiting it, then the task's own frames, without
    /// the event loop's frames below them.
    pub fn frames(&mut self, raw: &RawStack, tasks: bool) -> Vec<u32> {
        let native: Vec<(u32, bool)> = raw
            .native
            .iter()
            .map(|&(b, off)| {
                let id = match self.native.get(&(b, off)) {
                    Some(&id) => id,
                    None => self.intern(Frame {
                        kind: FrameKind::Native,
                        name: format!("[unknown] 0x{off:x}"),
                        address: off,
                        ..Frame::default()
                    }),
                };
                (id, self.eval_frames.contains(&id))
            })
            .collect();
        let mut frames = match (tasks, raw.tasks.is_empty()) {
            (true, false) => {
                let mut f = raw.tasks.clone();
                let own = merge(&native, &raw.python);
                let cut = raw
                    .task_frame
                    .and_then(|i| first_at(&native, &raw.python, i as usize))
                    .unwrap_or(0);
                f.extend_from_slice(&own[cut..]);
                f
            }
            _ => merge(&native, &raw.python),
        };
        for &addr in raw.kernel.iter().rev() {
            let id = self.kernel.get(&addr).copied().unwrap_or_else(|| {
                self.intern(Frame {
                    kind: FrameKind::Kernel,
                    name: format!("0x{addr:x}"),
                    address: addr,
                    ..Frame::default()
                })
            });
            frames.push(id);
        }
        frames
    }

    /// What naming these stacks' native and kernel addresses not named yet needs: quick, so
    /// that the slow part ([`Naming::run`], one symbolizer call per binary) can run without
    /// the caller's lock. Until [`Self::apply`], binary ids must hold (no [`Self::compact`]).
    pub fn to_name<'a>(&self, raws: impl Iterator<Item = &'a RawStack>) -> Naming {
        let mut natives: HashMap<u32, BTreeSet<u64>> = HashMap::new();
        let mut kernel = BTreeSet::new();
        for raw in raws {
            for &(b, off) in &raw.native {
                if b != UNMAPPED && !self.native.contains_key(&(b, off)) {
                    natives.entry(b).or_default().insert(off);
                }
            }
            kernel.extend(raw.kernel.iter().filter(|a| !self.kernel.contains_key(a)));
        }
        let binaries = natives
            .into_iter()
            .map(|(b, offsets)| ToName {
                id: b,
                path: self.read_path(b),
                offsets: offsets.into_iter().collect(),
            })
            .collect();
        Naming {
            binaries,
            kernel: kernel.into_iter().collect(),
        }
    }

    /// What names addresses: [`Naming::run`]'s symbolizer.
    pub fn namer(&self) -> Arc<Mutex<Symbolizer>> {
        self.namer.clone()
    }

    /// Takes in what [`Naming::run`] found.
    pub fn apply(&mut self, named: Named) {
        for (b, names) in named.binaries {
            let display = self.binaries[b as usize].mapping.path.clone();
            let base = display.rsplit('/').next().unwrap_or(&display).to_owned();
            for (off, sym) in names {
                if self.native.contains_key(&(b, off)) {
                    // Named meanwhile, for another profile.
                    continue;
                }
                let frame = match sym {
                    Some(s) => Frame {
                        kind: FrameKind::Native,
                        name: s.name,
                        file: s.file,
                        line: s.line,
                        mapping: Some(b as usize),
                        address: off,
                    },
                    None => Frame {
                        kind: FrameKind::Native,
                        // perf's habit: an unnamed address is shown as its binary, so that the
                        // stripped functions of one library add up in one place.
                        name: format!("[{base}]"),
                        mapping: Some(b as usize),
                        address: off,
                        ..Frame::default()
                    },
                };
                let eval = frame.name.starts_with("_PyEval_EvalFrameDefault")
                    || (frame.name.starts_with('[') && self.in_eval_loop(b, off));
                let id = self.intern(frame);
                if eval {
                    self.eval_frames.insert(id);
                }
                self.native.insert((b, off), id);
            }
        }
        for (addr, sym) in named.kernel {
            if self.kernel.contains_key(&addr) {
                continue;
            }
            let id = self.intern(Frame {
                kind: FrameKind::Kernel,
                name: sym.map_or_else(|| format!("0x{addr:x}"), |s| s.name),
                address: addr,
                ..Frame::default()
            });
            self.kernel.insert(addr, id);
        }
    }

    /// Whether `off` in binary `b` is eval-loop code its symbols leave unnamed (see
    /// `python::runtime::eval_ranges`). Only binaries named like CPython's are read.
    fn in_eval_loop(&mut self, b: u32, off: u64) -> bool {
        if !self.eval_ranges.contains_key(&b) {
            let path = &self.binaries[b as usize].mapping.path;
            let name = path.rsplit('/').next().unwrap_or(path);
            let ranges = if name.starts_with("python") || name.starts_with("libpython") {
                tracer_inspect::binary::map(self.read_path(b))
                    .map(|d| tracer_inspect::python::runtime::eval_ranges(&d))
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            self.eval_ranges.insert(b, ranges);
        }
        self.eval_ranges[&b]
            .iter()
            .any(|&(a, e)| off >= a && off < e)
    }

    /// [`read_path`] of binary `b`.
    fn read_path(&self, b: u32) -> PathBuf {
        read_path(&self.binaries[b as usize])
    }

    /// The user stack, leaf first, as (binary, file offset).
    fn native(&mut self, ev: &SampleEvent) -> (Vec<(u32, u64)>, End) {
        let pid = ev.pid;
        if ev.ip == 0 || ev.sp < ev.stack_base {
            // A kernel thread: no user stack.
            return (Vec::new(), End::Root);
        }
        let len = (ev.stack_len as usize).min(ev.stack.len());
        let skip = ((ev.sp - ev.stack_base) as usize).min(len);
        let regs = Regs {
            ip: ev.ip,
            sp: ev.sp,
            bp: ev.bp,
        };
        let stack = &ev.stack[skip..len];
        let mut unwound = match self.unwind(pid, regs, stack) {
            Some(u) => u,
            None => return (Vec::new(), End::UnmappedAddress(ev.ip)),
        };
        if let End::UnmappedAddress(_) = unwound.end {
            // The map may be stale (a library loaded, or being loaded, since): read it again
            // once.
            self.maps.remove(&pid);
            if let Some(u) = self.unwind(pid, regs, stack) {
                unwound = u;
            }
        }
        if let End::NoUnwindInfo(path) = &unwound.end {
            self.notes.insert(format!(
                "{path}: code without unwind entries (stubs, JIT code or a stripped table) ends some stacks"
            ));
        }
        let mut out = Vec::with_capacity(unwound.frames.len());
        for (i, &addr) in unwound.frames.iter().enumerate() {
            // Return addresses point after the call: name the call itself.
            let lookup = if i == 0 { addr } else { addr.saturating_sub(1) };
            out.push(self.native_ref(pid, lookup));
        }
        (out, unwound.end)
    }

    fn unwind(
        &mut self,
        pid: u32,
        regs: Regs,
        stack: &[u8],
    ) -> Option<tracer_inspect::unwind::Unwound> {
        self.maps_of(pid, regs.ip)?;
        // Out and back in: the unwinder and the maps both live in self.
        let (maps, at) = self.maps.remove(&pid)?;
        let unwound = self
            .unwinder
            .unwind(pid, &maps, regs, stack, MAX_NATIVE_FRAMES);
        self.maps.insert(pid, (maps, at));
        Some(unwound)
    }

    fn maps_of(&mut self, pid: u32, addr: u64) -> Option<&ProcMaps> {
        let fresh = self.maps.get(&pid).is_some_and(|(m, at)| {
            // Not code in the snapshot: it may predate the mapping (a library being
            // loaded shows as one read-only span first), read again.
            m.find(addr).is_some_and(|e| e.executable) || at.elapsed() < MAPS_TTL
        });
        if !fresh {
            let maps = ProcMaps::read(pid).ok()?;
            self.maps.insert(pid, (maps, Instant::now()));
        }
        self.maps.get(&pid).map(|(m, _)| m)
    }

    fn native_ref(&mut self, pid: u32, addr: u64) -> (u32, u64) {
        let entry = self.maps.get(&pid).and_then(|(m, _)| m.find(addr)).cloned();
        let Some(entry) = entry else {
            return (UNMAPPED, addr);
        };
        (self.binary(pid, &entry), addr - entry.start + entry.offset)
    }

    /// A binary's index, by its identity in the process's maps (device, inode, path). It is
    /// opened now (see `process::mapped_path`: chroots, containers), so that it can be read
    /// once the process is gone. Reports show it by its path in the maps.
    fn binary(&mut self, pid: u32, m: &MapEntry) -> u32 {
        let key = (
            (u64::from(m.dev.0) << 32) | u64::from(m.dev.1),
            m.inode,
            m.path.clone(),
        );
        if let Some(&i) = self.binary_ids.get(&key) {
            return i;
        }
        let i = self.binaries.len() as u32;
        self.binary_ids.insert(key.clone(), i);
        let file = match tracer_inspect::process::mapped_path(pid, m) {
            Ok(p) => std::fs::File::open(p).ok(),
            Err(e) => {
                tracing::debug!(%e, "mapped binary not reachable");
                None
            }
        };
        self.binaries.push(Binary {
            key,
            mapping: Mapping {
                path: m.path.clone(),
                build_id: String::new(),
            },
            file,
        });
        let read = self.read_path(i);
        self.binaries[i as usize].mapping.build_id =
            self.symbolizer.build_id(&read).unwrap_or_default();
        i
    }

    /// The Python frames, leaf first, each with whether it starts a run of the eval loop;
    /// and where in them the frame `raw[at]` went.
    fn python(
        &mut self,
        pid: u32,
        raw: &[PySampleFrame],
        v: &'static Version,
        at: Option<usize>,
    ) -> (Vec<(u32, bool)>, Option<u32>) {
        let mut out: Vec<(u32, bool)> = Vec::with_capacity(raw.len());
        let mut found = None;
        for (i, f) in raw.iter().enumerate() {
            if at == Some(i) {
                found = Some(out.len() as u32);
            }
            if f.code & PY_FRAME_SHIM != 0 {
                // 3.12+: the shim below a run: the frame above it started the run.
                if let Some(last) = out.last_mut() {
                    last.1 = true;
                }
                continue;
            }
            let entry = f.code & PY_FRAME_ENTRY != 0;
            let code = f.code & !(PY_FRAME_ENTRY | PY_FRAME_SHIM);
            let id = self.python_frame(pid, code, f.instr, f.names, v);
            out.push((id, entry));
        }
        (out, found)
    }

    /// The tasks part of a sample (after the thread's frames): groups of a task and its
    /// coroutines, outermost first, from the running task out. Root first: the outermost
    /// awaiting task first, each task's frames after its name.
    fn tasks(&mut self, pid: u32, raw: &[PySampleFrame], v: &'static Version) -> Vec<u32> {
        let mut groups: Vec<Vec<u32>> = Vec::new();
        for f in raw {
            if f.code & PY_FRAME_TASK != 0 {
                let name = task_name(pid, f.instr, v);
                groups.push(vec![self.intern(Frame {
                    kind: FrameKind::Task,
                    name,
                    ..Frame::default()
                })]);
            } else if let Some(g) = groups.last_mut() {
                g.push(self.python_frame(pid, f.code, f.instr, f.names, v));
            }
        }
        groups.into_iter().rev().flatten().collect()
    }

    fn python_frame(
        &mut self,
        pid: u32,
        code: u64,
        instr: u64,
        names: u64,
        v: &'static Version,
    ) -> u32 {
        if let Some(&id) = self.python_frames.get(&(pid, code, names, instr)) {
            return id;
        }
        let known = self
            .codes
            .get(&(pid, code))
            .is_some_and(|c| c.names == names);
        if !known {
            match read_code(pid, code, v).filter(|c| c.names == names) {
                Some(c) => {
                    self.codes.insert((pid, code), c);
                }
                None => {
                    self.notes.insert(
                        "some Python frames could not be named: their code objects were freed, or their process exited, before tracer read them"
                            .into(),
                    );
                    return self.intern(Frame {
                        kind: FrameKind::Python,
                        name: "[unknown]".into(),
                        ..Frame::default()
                    });
                }
            }
        }
        let c = &self.codes[&(pid, code)];
        let line = instruction_offset(v, code, instr)
            .and_then(|off| linetable::line_for(v.minor, &c.linetable, c.firstlineno, off))
            .unwrap_or(c.firstlineno);
        let frame = Frame {
            kind: FrameKind::Python,
            name: c.qualname.clone(),
            file: Some(c.filename.clone()),
            line: Some(line),
            ..Frame::default()
        };
        let id = self.intern(frame);
        self.python_frames.insert((pid, code, names, instr), id);
        id
    }
}

/// Addresses to name, taken from a [`Resolver`] ([`Resolver::to_name`]).
pub struct Naming {
    binaries: Vec<ToName>,
    kernel: Vec<u64>,
}

struct ToName {
    id: u32,
    /// [`read_path`]: open until the resolver compacts, which waits for the names.
    path: PathBuf,
    offsets: Vec<u64>,
}

/// Names found by [`Naming::run`], for [`Resolver::apply`]: per binary id, and for kernel
/// addresses, each address with its symbol.
pub struct Named {
    binaries: Vec<(u32, Names)>,
    kernel: Names,
}

type Names = Vec<(u64, Option<crate::symbolize::Sym>)>;

impl Naming {
    /// Names the addresses: the slow part (symbol tables and DWARF), one symbolizer call per
    /// binary; PLT stubs as `name@plt`.
    pub fn run(self, symbolizer: &mut Symbolizer) -> Named {
        let mut binaries = Vec::with_capacity(self.binaries.len());
        for b in self.binaries {
            let plt = tracer_inspect::binary::map(&b.path)
                .map(|d| tracer_inspect::plt::Plt::read(&d))
                .unwrap_or_default();
            let syms = symbolizer.user(&b.path, &b.offsets);
            let names = b
                .offsets
                .into_iter()
                .zip(syms)
                .map(|(off, sym)| {
                    let stub = plt.name(off).map(|n| crate::symbolize::Sym {
                        name: n.to_owned(),
                        file: None,
                        line: None,
                        offset: 0,
                    });
                    (off, stub.or(sym))
                })
                .collect();
            binaries.push((b.id, names));
        }
        let kernel = symbolizer.kernel(&self.kernel);
        Named {
            binaries,
            kernel: self.kernel.into_iter().zip(kernel).collect(),
        }
    }
}

/// Where the daemon reads a binary: the file it opened while a process mapped it, or (if
/// that failed) its own view of the path.
fn read_path(bin: &Binary) -> PathBuf {
    use std::os::fd::AsRawFd;
    match &bin.file {
        Some(f) => PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd())),
        None => PathBuf::from(&bin.mapping.path),
    }
}
