//! Counting a CPython 3.14+ process's calls in the process itself: a uprobe trap costs
//! ~1 µs a call, a `sys.monitoring` C callback tens of nanoseconds.
//!
//! tracerd makes a directory in the process's `/tmp` (reached through `/proc/PID/root`, so
//! chroots and containers see it at the same path) as the process's user ([`files`]), with a
//! counts file (`tracer_common::inproc`), and beside it a directory of root's ([`code_dir`])
//! with the counter library (`libtracer_pycount.so`, built from `daemon/pycount`), and asks
//! the interpreter to run a start script (PEP 768, [`super::remote_exec`]). The script loads the library as an extension module, takes a
//! free `sys.monitoring` tool id and registers the library's callbacks; the library takes
//! the file over (PENDING → RUNNING). At the end tracerd stops the counter (RUNNING →
//! STOPPED), reads the file, and asks the interpreter to run a removal script, which frees
//! the tool id and deletes the process's counts file; the scripts and the directory are
//! deleted once they have run. A process that cannot do this is counted with uprobes, and
//! [`start`]'s error says why.
//!
//! Everything in the user's directory is that user's to change, so nothing read there is
//! trusted: a process is asked to run a file only after [`Counter::may_run`]'s checks, and
//! reading is bounded ([`Budget`]). docs/SECURITY.md has the threat model.

mod at;
mod attach;
mod cleanup;
mod code_dir;
mod files;
mod handover;
mod journal;
mod launch;
mod make;
mod pending;
mod process;
mod read;
mod scripts;
mod view;

pub use cleanup::wait_cleanups;
pub use handover::Handover;
pub use journal::{set_journal, sweep};
pub use launch::{launch, PRELOAD};
pub use pending::ASK_EVERY;

use std::{
    fs,
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, PoisonError},
};

use cleanup::cleanup_later;
use view::View;

use tracer_common::inproc::{self, state, Edge};

use super::remote_exec;
use crate::pinned::Pinned;
use files::{Dir, Mapping};
use make::make;
use pending::Watch;
use process::{alive, fs_ids, maps_file, own_pid, uids, Pids};
use read::{
    drop_script_frames, read_counts, well_formed, Budget, MAX_FILES, NAME_BYTES, PEEK_FILES,
    PEEK_NAME_BYTES, READ_TIME,
};
use scripts::{remove_script, start_script, LOAD_ERROR};

/// The counter library's file name, beside tracerd's executable.
pub const LIBRARY: &str = "libtracer_pycount.so";

/// The library beside tracerd, if it is there.
pub fn library() -> Result<PathBuf, String> {
    files::beside_tracerd(LIBRARY)
}

/// One function's counts in one process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Function {
    pub code: u64,
    pub qualname: String,
    pub filename: String,
    pub firstlineno: i32,
    pub ncalls: u64,
    pub primitive: u64,
    pub tottime_ns: u64,
    pub cumtime_ns: u64,
}

/// What one process's counter counted.
#[derive(Clone, Debug, Default)]
pub struct Counts {
    pub pid: u32,
    pub functions: Vec<Function>,
    /// (caller code, callee code, the pair's numbers as a [`Function`] without names).
    pub edges: Vec<Edge>,
    pub lost_calls: u64,
    pub lost_edges: u64,
    pub lost_names: u64,
    /// The counter's state when read (`tracer_common::inproc::state`).
    pub state: u32,
    /// `pid` is the process's pid in its own pid namespace: it exited, in another namespace
    /// than tracerd's, before it could be told by its pid here.
    pub namespace_pid: bool,
    /// Handed over to the probes (HANDED) without them: why.
    pub handover_failed: Option<String>,
}

/// Whether the session that counts may trace a pid now (the ptrace rule for its owner, and
/// its grant's cgroups): asked again before each request to run code there.
pub type MayTrace = Arc<dyn Fn(u32) -> Result<(), String> + Send + Sync>;

/// A process counted in-process, and the directory its counter works in.
pub struct Counter {
    pub pid: u32,
    /// Its directory and counts file, shared with the live view's thread.
    files: Arc<Files>,
    /// The directory's name.
    name: String,
    /// The process's counts file, locked (`LOCK_EX`) while tracerd holds it: a counter that
    /// can lock it knows tracerd died and stops.
    _file: fs::File,
    /// The counter library's (device, inode): a process asked to run a removal script must
    /// have loaded it (the counted process or a child it forked).
    library: (u64, u64),
    may_trace: MayTrace,
    /// The live view (Prometheus), once asked for.
    view: Mutex<Option<Arc<View>>>,
    /// Set as the session's end reads the counters (a handover watch stops).
    ended: Arc<AtomicBool>,
    /// How the counter got into the process.
    loaded: Loaded,
    /// A launch's watches, started once its command execs into the interpreter
    /// ([`Counter::launched`]): its directory may have to be made again in the root it
    /// execs in first.
    deferred: Option<launch::Deferred>,
}

/// How a counter got into its process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loaded {
    /// PEP 768 remote execution (3.14+).
    RemoteExec,
    /// Tracer's loader, loaded with ptrace (3.10–3.13).
    Ptrace,
    /// Tracer's loader, preloaded into a launched command.
    Launch,
}

/// What reading a counter needs: the process, its directory and its own counts file.
struct Files {
    pid: u32,
    /// Its pid in its own pid namespace.
    own: u32,
    /// The directory and the process's `/tmp`, held open: a chrooted process's root, through
    /// which tracerd reached them, goes when the process does.
    dir: Arc<Dir>,
    map: Mapping,
}

/// What an end read, and what it refused to do, in words for the report.
#[derive(Debug, Default)]
pub struct Finished {
    pub counts: Vec<Counts>,
    pub refused: Vec<String>,
}

/// How long the counters of an ended session may take to leave the last callback, all of
/// them together.
const BUSY_WAIT: Duration = Duration::from_millis(200);
/// How long the removal scripts may take to run before their requests are withdrawn and
/// their files left to the next sweep.
const CLEANUP_WAIT: Duration = Duration::from_secs(30);

/// The library's name in the directory (what the start script loads).
const LIBRARY_AS: &str = "_tracer_pycount.so";
/// The loader's name there (a launch's `LD_PRELOAD`, a ptrace load's `dlopen`).
const PRELOAD_AS: &str = "_tracer_pystart.so";

/// What becomes of a request left pending ([`start`]): the counter's tool id once it runs,
/// or why it never will (the process is then to be counted with uprobes from then on).
/// Called on a thread of tracer's own, at most once; not called when the session ends first.
pub type Late = Box<dyn FnOnce(Result<u32, String>) + Send>;

/// Has `pid` load the counter and start counting; waits up to `wait` for it. `tag` makes the
/// directory's name unique (the session id); `may_trace` is the session owner's right to
/// trace a process, asked again before any request to run code. On error the process is to
/// be counted with uprobes; the error says why, in words for the report. `cancelled` says
/// whether the start is still wanted (its client went): a ptrace load under way then ends.
///
/// The process is pinned before anything is checked, and what is written or loaded reaches
/// that pin alone: a program exec'd after the checks (a setuid one) is not written to.
///
/// A process that has not started counting by then (every thread in native code: a server
/// in `accept`, a worker on a queue) is not given up on: the counter is returned
/// [`Counter::pending`], its request stays, the threads the process starts meanwhile are
/// asked too, and `late` says what became of it. Until then no thread has run Python since
/// the request reached it, so nothing is missed but what a thread started meanwhile runs
/// before it is asked (within [`ASK_EVERY`]).
///
/// CPython 3.10–3.13 have no remote execution: tracer's loader is loaded with ptrace there
/// ([`attach`]), and on 3.10 and 3.11 `handover` takes over a program that sets a profile
/// function of its own.
pub fn start(
    pid: u32,
    tag: &str,
    wait: Duration,
    may_trace: MayTrace,
    late: Late,
    handover: Handover,
    cancelled: &(dyn Fn() -> bool + Sync),
) -> Result<Counter, String> {
    let pin = pin(pid)?;
    match remote_exec::remote_debugging(pid) {
        Ok(()) => {}
        // "3.12", or "3.13.0" from 3.13's debug offsets.
        Err(remote_exec::RemoteExecError::Unsupported { version, .. })
            if version.strip_prefix("3.").is_some_and(|v| {
                v.split('.')
                    .next()
                    .and_then(|m| m.parse().ok())
                    .is_some_and(|m: u32| (10..=13).contains(&m))
            }) =>
        {
            return attach::start_loaded(pin, tag, wait, may_trace, late, handover, cancelled);
        }
        Err(e) => return Err(e.to_string()),
    }
    let (counter, start_path) = make(pid, tag, may_trace, None, false)?;
    // The checks were made on the program pinned (an exec since would be refused here; one
    // after leaves the pinned memory, where the request goes, unused).
    if crate::pinned::Image::of(pid).ok() != Some(pin.image()) {
        counter.discard();
        return Err("it executed another program as it was being checked".into());
    }
    let exe = pending::exe_of(pid);
    let mut asked = Vec::new();
    if let Err(e) = remote_exec::request_more(&pin, &start_path, &mut asked) {
        counter.discard();
        return Err(e.to_string());
    }
    let outcome = match settle(&counter, wait) {
        Settled::Running => Ok(()),
        Settled::Failed(why) => Err(why),
        Settled::Waiting => {
            // Left pending: the session starts now, the process counts from its first
            // safe point, however late.
            let watch = Watch {
                pin,
                script: Some(start_path),
                files: counter.files.clone(),
                may_trace: counter.may_trace.clone(),
                asked,
                exe,
            };
            watch.spawn(late)?;
            return Ok(counter);
        }
    };
    // Threads that have not taken the request yet need not.
    let _ = remote_exec::withdraw(&pin, &start_path);
    match outcome {
        Ok(()) => Ok(counter),
        Err(why) => {
            if counter.files.map.header().state == state::CANCELLED
                && !counter.files.dir.exists(LOAD_ERROR)
            {
                // The files stay while a thread may still run the start script, which then
                // deletes them (or the cleanup does, once the process is gone).
                counter.leave_behind();
            } else {
                // The script ran: nothing will open these files again.
                std::thread::sleep(Duration::from_millis(50));
                counter.discard();
            }
            Err(why)
        }
    }
}

/// Pins `pid`, the process a start is for.
fn pin(pid: u32) -> Result<Pinned, String> {
    Pinned::open(pid).map_err(|e| format!("pinning the process: {e}"))
}

/// How a start request stood once [`settle`] stopped waiting.
enum Settled {
    Running,
    /// Refused, or the library did not load: why.
    Failed(String),
    /// Not started within the wait.
    Waiting,
}

/// Waits up to `wait` for the counter to start or to fail to.
fn settle(counter: &Counter, wait: Duration) -> Settled {
    let started = Instant::now();
    loop {
        match counter.files.map.state().load(Ordering::SeqCst) {
            state::RUNNING => return Settled::Running,
            state::REFUSED => {
                return Settled::Failed(
                    String::from_utf8_lossy(counter.files.map.header().why_text()).into_owned(),
                );
            }
            _ if counter.files.dir.exists(LOAD_ERROR) => {
                let why = counter.files.dir.read_text(LOAD_ERROR).unwrap_or_default();
                let _ = counter.files.map.cancel();
                return Settled::Failed(why);
            }
            _ if started.elapsed() >= wait => return Settled::Waiting,
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// A counts file found in a counter's directory, mapped and checked.
struct Found {
    own: u32,
    /// Its pid here; None: a child of another pid namespace that is gone.
    host: Option<u32>,
    /// Its name; None: the process's own file, mapped for the session.
    name: Option<String>,
}

/// A found file, mapped: the process's own (`own`), or a child's, mapped now and unmapped
/// when dropped. One child's at a time: each mapping is guarded against SIGBUS
/// ([`crate::sigbus`]), and the guard's slots are few.
enum Mapped<'a> {
    Own(&'a Mapping),
    Child(Mapping),
}

impl std::ops::Deref for Mapped<'_> {
    type Target = Mapping;
    fn deref(&self) -> &Mapping {
        match self {
            Self::Own(m) => m,
            Self::Child(m) => m,
        }
    }
}

impl Files {
    /// The counts files of the process and of the children it forked, at most `most`, mapped
    /// and well formed: of live processes, only those `followed` says the session follows;
    /// what was refused goes to `refused`.
    fn found(
        &self,
        followed: &dyn Fn(u32) -> bool,
        most: usize,
        refused: &mut Vec<String>,
    ) -> Vec<Found> {
        let (files, more) = self.dir.counts_files(files::MAX_NAMES);
        // Files are named by the pid the process knows itself by (its pid namespace's).
        let hosts = Pids::of(self.pid);
        let mut out = Vec::new();
        let (mut strangers, mut skipped) = (Vec::new(), more);
        for (own, name) in files {
            if own == self.own {
                out.push(Found {
                    own,
                    host: Some(self.pid),
                    name: None,
                });
                continue;
            }
            let host = hosts.host(own);
            // A live process must be one the session follows; one that exited is asked
            // nothing, and its counts are only read.
            if let Some(h) = host.filter(|&h| alive(h) && !followed(h)) {
                strangers.push(format!("{name} names pid {h}"));
                continue;
            }
            if out.len() >= most {
                skipped += 1;
                continue;
            }
            out.push(Found {
                own,
                host,
                name: Some(name),
            });
        }
        if !strangers.is_empty() {
            let n = strangers.len();
            strangers.truncate(8);
            let more = if n > 8 {
                format!(", and {} more", n - 8)
            } else {
                String::new()
            };
            refused.push(format!(
                "pid {}'s counter directory holds counts files naming processes this session does not follow ({}{more}): not read, and nothing asked of those processes",
                self.pid,
                strangers.join(", ")
            ));
        }
        if skipped > 0 {
            refused.push(format!(
                "pid {}: {skipped} counts files past the first {most} in tracer's directory were not read",
                self.pid
            ));
        }
        out
    }

    /// Maps a found file (`write`: to stop its counter too), if it is a counts file as this
    /// tracerd makes them; else says why not in `refused`.
    fn map(&self, f: &Found, write: bool, refused: &mut Vec<String>) -> Option<Mapped<'_>> {
        let Some(name) = &f.name else {
            return Some(Mapped::Own(&self.map));
        };
        let map = self.dir.open(name, write).and_then(|file| {
            if write {
                Mapping::new(&file)
            } else {
                Mapping::new_read_only(&file)
            }
        });
        let why = match map {
            Ok(m) if well_formed(&m.header()) => return Some(Mapped::Child(m)),
            Ok(_) => "is not a counts file of this tracer".to_owned(),
            Err(e) => format!("could not be read: {e}"),
        };
        refused.push(format!(
            "{name} in pid {}'s counter directory {why}: not read",
            self.pid
        ));
        None
    }

    /// The functions counted so far in the process and its forked children, without
    /// stopping anything; children by the pid their namespace knows.
    fn peek(&self, followed: &dyn Fn(u32) -> bool) -> Vec<Counts> {
        let mut budget = Budget::new(PEEK_NAME_BYTES, READ_TIME);
        let mut refused = Vec::new();
        let mut out = Vec::new();
        for f in self.found(followed, PEEK_FILES, &mut refused) {
            let Some(map) = self.map(&f, false, &mut refused) else {
                continue;
            };
            let mut c = read_counts(&map, false, &mut budget);
            drop_script_frames(&mut c);
            c.pid = f.host.unwrap_or(f.own);
            out.push(c);
        }
        out
    }
}

impl Counter {
    /// The tool id the counter took.
    pub fn tool_id(&self) -> u32 {
        self.files.map.header().tool_id
    }

    /// How it counts and how it got into the process, in words for the report (once
    /// started).
    pub fn how(&self) -> String {
        let tool = self.tool_id();
        let counts = if tool == inproc::PROFILE_FUNCTION {
            "a C profile function on every thread (cProfile's hook)".to_owned()
        } else {
            format!("sys.monitoring callbacks (tool id {tool})")
        };
        match self.loaded {
            Loaded::RemoteExec => format!("{counts}, loaded through remote execution"),
            Loaded::Ptrace => format!(
                "{counts}, loaded with ptrace (one of its threads made to dlopen tracer's loader, which started the counter from a thread of its own)"
            ),
            Loaded::Launch => format!("{counts}, started with the program"),
        }
    }

    /// The start script's path, as the process sees it.
    pub fn start_path(&self) -> String {
        self.files.dir.code_path("start.py")
    }

    /// Whether its start request is still pending: no thread of the process has reached a
    /// safe point since it was made.
    pub fn pending(&self) -> bool {
        self.files.map.state().load(Ordering::SeqCst) == state::PENDING
    }

    /// Lets the directory outlive this handle: a pending request may still name a script.
    fn leave_behind(self) {
        let pid = self.pid;
        cleanup_later(self.files.dir.clone(), self.name, Vec::new(), vec![pid]);
    }

    /// The functions counted so far in the process and its forked children (Prometheus'
    /// live view), without stopping anything; children by the pid their namespace knows.
    /// Read on a thread of its own, about once a second while asked: this returns the last
    /// reading (empty at first), and `followed` is what the next one reads by.
    pub fn peek(&self, followed: HashSet<u32>) -> Arc<Vec<Counts>> {
        let mut slot = self.view.lock().unwrap_or_else(PoisonError::into_inner);
        let view = slot.get_or_insert_with(|| Arc::new(View::new(self.files.clone())));
        view.asked(followed);
        view.snapshot()
    }

    /// Whether tracerd may ask `pid` (one of the session's processes) to run a file from the
    /// counter's directory, checked now (pids are reused): the session's owner may trace it,
    /// it runs as the directory's owner and nobody else (who alone besides root can write
    /// there), it has loaded the counter from this session's code directory (the counted
    /// process or a child it forked), and it finds both directories at the paths it will
    /// open. The process pinned,
    /// for the request; or why not.
    fn may_run(&self, pid: u32) -> Result<Pinned, String> {
        let pin = Pinned::open(pid).map_err(|e| format!("pinning it: {e}"))?;
        (self.may_trace)(pid)?;
        let ids = uids(pid)?;
        if ids.iter().any(|&u| u != self.files.dir.owner.0) {
            return Err(format!(
                "it runs as uid {} while tracer's directory is uid {}'s",
                ids[1], self.files.dir.owner.0
            ));
        }
        if !maps_file(pid, self.library) {
            return Err("it has not loaded tracer's counter from this session's directory".into());
        }
        self.files.dir.seen_by(pid)?;
        if !pin.alive() {
            return Err("it exited".into());
        }
        Ok(pin)
    }

    /// Stops the counters of the process and of the children it forked that the session
    /// follows (`followed`: now or before, by pid here), reads them, and has each live one
    /// removed. Bounded in files, names and time whatever the directory holds; cleaning up
    /// the files waits for the removal scripts on a thread of its own. Not for the manager's
    /// task: it may take up to [`READ_TIME`] and [`BUSY_WAIT`].
    pub fn finish(self, followed: &dyn Fn(u32) -> bool) -> Finished {
        self.ended.store(true, Ordering::SeqCst);
        let mut refused = Vec::new();
        if let Some(view) = self
            .view
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            view.stop.store(true, Ordering::SeqCst);
        }
        // Exactly one of tracerd and the start script decides; a script run later finds the
        // session gone and deletes the files itself.
        if self.files.map.cancel().is_ok() {
            if let Ok(pin) = Pinned::open(self.pid) {
                let _ = remote_exec::withdraw(&pin, &self.start_path());
            }
            let counts = Counts {
                pid: self.pid,
                state: state::CANCELLED,
                ..Counts::default()
            };
            self.leave_behind();
            return Finished {
                counts: vec![counts],
                refused,
            };
        }
        let files = &self.files;
        let found = files.found(followed, MAX_FILES, &mut refused);
        for f in &found {
            if let Some(map) = files.map(f, true, &mut Vec::new()) {
                let _ = map.state().compare_exchange(
                    state::RUNNING,
                    state::STOPPED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
                // A program held for a handover goes on.
                map.hand(Some(handover::ENDED));
            }
        }
        // One wait for all: the last callbacks leave within microseconds of the stop.
        let busy_until = Instant::now() + BUSY_WAIT;
        let mut budget = Budget::new(NAME_BYTES, READ_TIME);
        let mut out = Vec::new();
        let mut removals = Vec::new();
        let mut pids = vec![self.pid];
        for (i, f) in found.iter().enumerate() {
            if budget.late() {
                refused.push(format!(
                    "pid {}: {} counts files not read: reading took over {} s",
                    self.pid,
                    found.len() - i,
                    READ_TIME.as_secs()
                ));
                break;
            }
            let Some(map) = files.map(f, true, &mut refused) else {
                continue;
            };
            while map.busy().load(Ordering::SeqCst) != 0 && Instant::now() < busy_until {
                std::thread::yield_now();
            }
            let mut counts = read_counts(&map, true, &mut budget);
            drop_script_frames(&mut counts);
            // A child of another pid namespace that is gone: known by that namespace's pid.
            counts.pid = f.host.unwrap_or(f.own);
            counts.namespace_pid = f.host.is_none();
            if let Some(host) = f.host {
                if host != self.pid {
                    pids.push(host);
                }
                let tool = map.header().tool_id;
                // A profile function takes itself off at its thread's next event.
                if (counts.state == state::RUNNING || counts.state == state::STOPPED)
                    && tool != inproc::PROFILE_FUNCTION
                {
                    removals.push((host, f.own, tool));
                }
            }
            out.push(counts);
        }
        if budget.over > 0 {
            refused.push(format!(
                "pid {}: {} functions and caller pairs of its counts files not read: over tracer's budget for one session's end",
                self.pid, budget.over
            ));
        }
        let mut scripts = Vec::new();
        for (pid, own, tool) in removals {
            if !alive(pid) {
                continue;
            }
            let pin = match self.may_run(pid) {
                Ok(pin) => pin,
                // It began to exit since: nothing stays to remove.
                Err(_) if !alive(pid) => continue,
                Err(why) => {
                    let why = format!("it was not asked to run tracer's removal script, as {why}");
                    refused.push(not_removed(pid, tool, false, &why));
                    continue;
                }
            };
            let counts = files.dir.path(&format!("{}{own}", inproc::FILE_PREFIX));
            let name = format!("remove.{own}.py");
            let script = remove_script(tool, &counts, &files.dir.code_path(LIBRARY_AS));
            if files.dir.create_code(&name, script.as_bytes()).is_ok() {
                let path = files.dir.code_path(&name);
                let asked = match remote_exec::request(&pin, &path) {
                    Err(remote_exec::RemoteExecError::Unsupported { .. })
                        if self.loaded != Loaded::RemoteExec =>
                    {
                        // Before 3.14: tracer's loader runs it, loaded as the start's was.
                        let stem = format!("remove.{own}");
                        let owner = files.dir.owner.0;
                        // may_run's checks that a stopped process could fail, asked again.
                        let check = |p: u32| -> Result<(), String> {
                            (self.may_trace)(p)?;
                            match uids(p)?.iter().any(|&u| u != owner) {
                                true => Err(format!("it no longer runs as uid {owner} alone")),
                                false => Ok(()),
                            }
                        };
                        attach::run_with_loader(&files.dir, &pin, &stem, &check, &|| false)
                    }
                    Ok(_) => Ok(()),
                    Err(e) => Err(e.to_string()),
                };
                match asked {
                    Ok(()) => scripts.push((pin, own, path)),
                    Err(why) => refused.push(not_removed(pid, tool, true, &why)),
                }
            }
        }
        // The library is loaded where it will be; the start script has run or been withdrawn.
        files.dir.unlink_code(LIBRARY_AS);
        files.dir.unlink_code(PRELOAD_AS);
        files.dir.unlink_code("start.so");
        files.dir.unlink_code("start.py");
        cleanup_later(files.dir.clone(), self.name.clone(), scripts, pids);
        Finished {
            counts: out,
            refused,
        }
    }
}

/// Why pid `pid`'s counter was stopped but not removed, its tool id `tool` left taken (for
/// the rest of the process's life, `until_exit` says), in words for the report.
fn not_removed(pid: u32, tool: u32, until_exit: bool, why: &str) -> String {
    let until = if until_exit { " until it exits" } else { "" };
    format!("pid {pid}'s counter was stopped, not removed (its sys.monitoring tool id {tool} stays taken{until}): {why}")
}

/// What `capabilities` says about in-process counting.
pub fn describe() -> String {
    match library() {
        Ok(lib) => format!(
            "running CPython 3.14+ processes named by pid are counted in-process (sys.monitoring, {} loaded through PEP 768 remote execution, removed at the session's end), 3.10-3.13 ones too (tracer's loader loaded with ptrace; sys.monitoring on 3.12+, removed the same way at the end; a C profile function before); --python-uprobes-only counts them with uprobes",
            lib.file_name().unwrap_or_default().to_string_lossy()
        ),
        Err(why) => format!("unavailable: {why}; every process is counted with uprobes"),
    }
}
