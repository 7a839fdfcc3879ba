//! The uprobe programs and the sampling program, loaded and attached by tracer itself (aya
//! loads the object's maps and tracepoint programs). Two reasons:
//!
//! - Multi-uprobe links (Linux 6.6+): one BPF link puts one program on many offsets of one
//!   binary in a single syscall, and releasing it waits for the kernel's grace periods once
//!   for the whole set instead of once per probe (~150 ms each). That is what lets a session
//!   with hundreds of probes stop at once, and a SIGKILLed daemon leave no breakpoint behind
//!   for long. The kernel takes such a link only for a program loaded with the
//!   `BPF_TRACE_UPROBE_MULTI` attach type, which aya does not set.
//! - Loading and attaching from any thread: [`Programs`] is shared by cloned handles, so the
//!   verifier's seconds and the attaching of thousands of probes happen off the task that
//!   answers requests. Kernels without multi-uprobe links get one perf event per probe, the
//!   same way.
//!
//! The programs are relocated against the maps aya created: both read and write the very
//! same maps.

use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
    sync::{Arc, Mutex, PoisonError},
};

use aya::{maps::Map, Ebpf};
use aya_obj::{generated::bpf_insn, Function, Object};
use perf_event_open_sys as sys;

use super::verifier::{self, Figures};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_BTF_LOAD: libc::c_long = 18;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_KPROBE: u32 = 2;
const BPF_PROG_TYPE_TRACEPOINT: u32 = 5;
const BPF_PROG_TYPE_PERF_EVENT: u32 = 7;
const BPF_PERF_EVENT: u32 = 41;
const BPF_TRACE_UPROBE_MULTI: u32 = 48;
const BPF_F_UPROBE_MULTI_RETURN: u32 = 1;

/// `union bpf_attr` as BPF_PROG_LOAD reads it, up to the attach type; the kernel takes a
/// shorter attribute than its own and reads the rest as zero.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    prog_btf_fd: u32,
    func_info_rec_size: u32,
    func_info: u64,
    func_info_cnt: u32,
    line_info_rec_size: u32,
    line_info: u64,
    line_info_cnt: u32,
    _pad: u32,
}

/// `union bpf_attr` as BPF_BTF_LOAD reads it.
#[repr(C)]
#[derive(Default)]
struct BtfLoadAttr {
    btf: u64,
    btf_log_buf: u64,
    btf_size: u32,
    btf_log_size: u32,
    btf_log_level: u32,
    _pad: u32,
}

/// `union bpf_attr` as BPF_LINK_CREATE reads it for `BPF_TRACE_UPROBE_MULTI`.
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    cnt: u32,
    multi_flags: u32,
    pid: u32,
    _pad: u32,
}

/// `union bpf_attr` as BPF_LINK_CREATE reads it for a perf event.
#[repr(C)]
#[derive(Default)]
struct PerfLinkAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    bpf_cookie: u64,
}

fn sys_bpf<T>(cmd: libc::c_long, attr: &T) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a live, initialized bpf_attr prefix of the size passed; every pointer
    // in it points at memory that outlives the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_ref(attr),
            std::mem::size_of::<T>(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as RawFd) })
}

/// A program's instructions, with the BTF records the verifier needs where the program
/// hands it functions (`bpf_loop` callbacks).
struct Code<'a> {
    name: &'a str,
    /// `BPF_PROG_TYPE_*`: a uprobe or kprobe, a perf-event program (sampling), a tracepoint.
    prog_type: u32,
    /// A uprobe for multi-uprobe links, rather than for one perf event each.
    multi: bool,
    insns: &'a [bpf_insn],
    license: &'a CString,
    btf: Option<(BorrowedFd<'a>, &'a Function)>,
}

/// `log_level`: 0 with an empty `log`, else the verifier's `LOG_*` bits.
fn load(code: &Code<'_>, log_level: u32, log: &mut [u8]) -> io::Result<OwnedFd> {
    let mut prog_name = [0u8; 16];
    for (d, s) in prog_name.iter_mut().zip(code.name.bytes().take(15)) {
        *d = s;
    }
    let mut attr = ProgLoadAttr {
        prog_type: code.prog_type,
        insn_cnt: u32::try_from(code.insns.len()).unwrap_or(u32::MAX),
        insns: code.insns.as_ptr() as u64,
        license: code.license.as_ptr() as u64,
        log_level: if log.is_empty() { 0 } else { log_level },
        log_size: u32::try_from(log.len()).unwrap_or(u32::MAX),
        log_buf: if log.is_empty() {
            0
        } else {
            log.as_mut_ptr() as u64
        },
        prog_name,
        expected_attach_type: if code.multi {
            BPF_TRACE_UPROBE_MULTI
        } else {
            0
        },
        ..ProgLoadAttr::default()
    };
    // Kept alive until the call returns: the attribute points into them.
    let (func_info, line_info);
    if let Some((btf_fd, f)) = code.btf {
        func_info = f.func_info.func_info_bytes();
        line_info = f.line_info.line_info_bytes();
        attr.prog_btf_fd = btf_fd.as_raw_fd() as u32;
        if f.func_info_rec_size > 0 {
            attr.func_info = func_info.as_ptr() as u64;
            attr.func_info_cnt = f.func_info.len() as u32;
            attr.func_info_rec_size = f.func_info_rec_size as u32;
        }
        if f.line_info_rec_size > 0 {
            attr.line_info = line_info.as_ptr() as u64;
            attr.line_info_cnt = f.line_info.len() as u32;
            attr.line_info_rec_size = f.line_info_rec_size as u32;
        }
    }
    sys_bpf(BPF_PROG_LOAD, &attr)
}

/// Loads the object's BTF (fixed up for this kernel as aya does it) into the kernel.
fn load_btf(object: &mut Object) -> Result<Option<OwnedFd>, ProgramsError> {
    let Some(features) = aya::features().btf() else {
        return Ok(None);
    };
    let btf = object
        .fixup_and_sanitize_btf(features)
        .map_err(|e| ProgramsError::Relocate(format!("BTF: {e}")))?;
    let Some(btf) = btf else {
        return Ok(None);
    };
    let bytes = btf.to_bytes();
    let attr = BtfLoadAttr {
        btf: bytes.as_ptr() as u64,
        btf_size: u32::try_from(bytes.len()).unwrap_or(u32::MAX),
        ..BtfLoadAttr::default()
    };
    sys_bpf(BPF_BTF_LOAD, &attr)
        .map(Some)
        .map_err(|e| ProgramsError::Relocate(format!("loading BTF: {e}")))
}

/// `binary` as the kernel takes a path.
fn c_path(binary: &Path) -> io::Result<CString> {
    CString::new(binary.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Creates one multi-uprobe link of `prog` on `offsets` of `binary`, for every process;
/// `cookies[i]` is what `bpf_get_attach_cookie` gives the program at `offsets[i]`.
fn link(
    prog: BorrowedFd<'_>,
    binary: &Path,
    offsets: &[u64],
    cookies: &[u64],
    at_return: bool,
) -> io::Result<OwnedFd> {
    let path = c_path(binary)?;
    let attr = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        attach_type: BPF_TRACE_UPROBE_MULTI,
        path: path.as_ptr() as u64,
        offsets: offsets.as_ptr() as u64,
        cookies: cookies.as_ptr() as u64,
        cnt: u32::try_from(offsets.len())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
        multi_flags: if at_return {
            BPF_F_UPROBE_MULTI_RETURN
        } else {
            0
        },
        ..LinkCreateAttr::default()
    };
    sys_bpf(BPF_LINK_CREATE, &attr)
}

/// `BPF_LINK_CREATE` of `prog` on the perf event `event`; `cookie` is what
/// `bpf_get_attach_cookie` gives the program there. The link holds the event: closing it
/// detaches the program and, for a uprobe, removes the probe.
pub fn perf_link(prog: BorrowedFd<'_>, event: BorrowedFd<'_>, cookie: u64) -> io::Result<OwnedFd> {
    let attr = PerfLinkAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: event.as_raw_fd() as u32,
        attach_type: BPF_PERF_EVENT,
        bpf_cookie: cookie,
        ..PerfLinkAttr::default()
    };
    sys_bpf(BPF_LINK_CREATE, &attr)
}

/// The kernel's uprobe PMU: its perf type, and the config bit that makes a probe one at the
/// function's return.
#[derive(Clone, Copy)]
struct UprobePmu {
    type_: u32,
    retprobe_bit: u32,
}

impl UprobePmu {
    fn read() -> io::Result<Self> {
        let dir = Path::new("/sys/bus/event_source/devices/uprobe");
        let bad =
            |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("uprobe PMU {what}"));
        let type_ = std::fs::read_to_string(dir.join("type"))?
            .trim()
            .parse()
            .map_err(|_| bad("type"))?;
        // "config:0"
        let retprobe_bit = std::fs::read_to_string(dir.join("format/retprobe"))?
            .trim()
            .strip_prefix("config:")
            .and_then(|b| b.parse().ok())
            .filter(|&b: &u32| b < 64)
            .ok_or_else(|| bad("retprobe format"))?;
        Ok(Self {
            type_,
            retprobe_bit,
        })
    }

    /// One uprobe perf event at `offset` of `binary`, for every process.
    fn open(&self, binary: &CString, offset: u64, at_return: bool) -> io::Result<OwnedFd> {
        let mut attr = sys::bindings::perf_event_attr::default();
        attr.type_ = self.type_;
        if at_return {
            attr.config = 1 << self.retprobe_bit;
        }
        attr.__bindgen_anon_3.config1 = binary.as_ptr() as u64;
        attr.__bindgen_anon_4.config2 = offset;
        // `binary` outlives the call; pid -1 on CPU 0 is a uprobe in every process.
        crate::perf::open_raw(&mut attr, -1, 0)
    }
}

/// Whether this kernel creates multi-uprobe links: a do-nothing program loads with the
/// attach type, and a link on a path that is no regular file is refused for that reason
/// (EBADF) rather than for an unknown attach type (EINVAL).
pub fn supported() -> bool {
    // r0 = 0; exit
    let insn = |code| {
        // SAFETY: bpf_insn is plain integers; all zeros is a valid value.
        let mut i: bpf_insn = unsafe { std::mem::zeroed() };
        i.code = code;
        i
    };
    let insns = [insn(0xb7), insn(0x95)];
    let license = CString::new("GPL").expect("no NUL");
    let code = Code {
        name: "tracer_probe",
        prog_type: BPF_PROG_TYPE_KPROBE,
        multi: true,
        insns: &insns,
        license: &license,
        btf: None,
    };
    let Ok(prog) = load(&code, 0, &mut []) else {
        return false;
    };
    match link(prog.as_fd(), Path::new("/"), &[0], &[0], false) {
        Ok(_) => true,
        Err(e) => e.raw_os_error() == Some(libc::EBADF),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProgramsError {
    #[error("parsing the BPF object again: {0}")]
    Parse(String),
    #[error("relocating {0}")]
    Relocate(String),
    #[error("no program {0} in the object")]
    NoProgram(String),
    #[error("the kernel's uprobe PMU: {0}")]
    Pmu(#[source] io::Error),
    #[error("loading {name}: {source}{log}")]
    Load {
        name: String,
        source: io::Error,
        /// The verifier's last lines, when it refused.
        log: String,
    },
}

/// The uprobe programs and the sampling program, by name. Cloned handles share them:
/// verifying a program takes up to seconds and attaching thousands of probes can too, so
/// both may happen on other threads than the one that asks.
#[derive(Clone)]
pub struct Programs(Arc<Shared>);

/// How uprobes are attached.
#[derive(Clone, Copy)]
enum Links {
    /// One multi-uprobe link per program and binary.
    Multi,
    /// One perf event per probe (kernels before 6.6, or when asked).
    PerProbe(UprobePmu),
}

struct Shared {
    links: Links,
    object: Object,
    btf: Option<OwnedFd>,
    /// Duplicates of the fds of aya's maps, kept open for programs loaded later: relocated
    /// instructions name the maps by these fd numbers.
    _maps: HashMap<String, OwnedFd>,
    /// Each program of the object, once loaded or refused. Its lock is held while it is
    /// verified, so a second loader waits for the first instead of verifying it again.
    loaded: HashMap<String, Mutex<Slot>>,
}

/// A program of the object, as far as the kernel has seen it.
#[derive(Default)]
enum Slot {
    #[default]
    NotLoaded,
    Loaded {
        fd: OwnedFd,
        figures: Option<Figures>,
    },
    /// Refused by the verifier: remembered, not verified again at every start (one refused
    /// at the instruction limit costs seconds of CPU each time).
    Refused {
        errno: i32,
        log: String,
        figures: Option<Figures>,
    },
}

impl Programs {
    /// Takes copies of `ebpf`'s map fds; call before any map is taken out of it. `multi`:
    /// uprobes go on in multi-uprobe links, else one perf event each.
    pub fn new(ebpf: &Ebpf, object_bytes: &[u8], multi: bool) -> Result<Self, ProgramsError> {
        let links = if multi {
            Links::Multi
        } else {
            Links::PerProbe(UprobePmu::read().map_err(ProgramsError::Pmu)?)
        };
        let mut object =
            Object::parse(object_bytes).map_err(|e| ProgramsError::Parse(e.to_string()))?;
        let btf = load_btf(&mut object)?;
        let mut maps = HashMap::new();
        for (name, map) in ebpf.maps() {
            let fd = map_fd(map)
                .try_clone_to_owned()
                .map_err(|e| ProgramsError::Relocate(format!("map {name}: {e}")))?;
            maps.insert(name.to_owned(), fd);
        }
        let defs = std::mem::take(&mut object.maps);
        let text: HashSet<usize> = object.functions.keys().map(|(s, _)| *s).collect();
        object
            .relocate_maps(
                defs.iter().filter_map(|(name, def)| {
                    Some((name.as_str(), maps.get(name)?.as_raw_fd(), def))
                }),
                &text,
            )
            .map_err(|e| ProgramsError::Relocate(e.to_string()))?;
        object
            .relocate_calls(&text)
            .map_err(|e| ProgramsError::Relocate(e.to_string()))?;
        let loaded = object
            .programs
            .keys()
            .map(|name| (name.clone(), Mutex::new(refused_for_tests(name))))
            .collect();
        Ok(Self(Arc::new(Shared {
            links,
            object,
            btf,
            _maps: maps,
            loaded,
        })))
    }

    fn slot(&self, name: &str) -> Result<&Mutex<Slot>, ProgramsError> {
        self.0
            .loaded
            .get(name)
            .ok_or_else(|| ProgramsError::NoProgram(name.into()))
    }

    /// Whether `name` was loaded or refused: a start need not load it ahead.
    pub fn is_settled(&self, name: &str) -> bool {
        self.slot(name)
            .ok()
            .and_then(|s| s.try_lock().ok())
            .is_some_and(|slot| !matches!(*slot, Slot::NotLoaded))
    }

    /// The programs of the object, by name.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.0.loaded.keys().cloned().collect();
        names.sort();
        names
    }

    /// The verifier's figures for `name`, loaded or refused (none before it is tried, or
    /// from a kernel that prints no stats).
    pub fn figures(&self, name: &str) -> Option<Figures> {
        let slot = self.slot(name).ok()?.lock().ok()?;
        match &*slot {
            Slot::Loaded { figures, .. } | Slot::Refused { figures, .. } => figures.clone(),
            Slot::NotLoaded => None,
        }
    }

    /// Loads `name` (once); the verifier's refusal comes back with its last lines, and
    /// again, without verifying, at every later call.
    pub fn load(&self, name: &str) -> Result<(), ProgramsError> {
        let mut slot = self
            .slot(name)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let refused = |errno: i32, log: &str| ProgramsError::Load {
            name: name.into(),
            source: io::Error::from_raw_os_error(errno),
            log: log.to_owned(),
        };
        match &*slot {
            Slot::Loaded { .. } => return Ok(()),
            Slot::Refused { errno, log, .. } => return Err(refused(*errno, log)),
            Slot::NotLoaded => {}
        }
        let object = &self.0.object;
        let program = object
            .programs
            .get(name)
            .ok_or_else(|| ProgramsError::NoProgram(name.into()))?;
        let function = object
            .functions
            .get(&program.function_key())
            .ok_or_else(|| ProgramsError::NoProgram(name.into()))?;
        use aya_obj::ProgramSection as S;
        let prog_type = match program.section {
            S::PerfEvent => BPF_PROG_TYPE_PERF_EVENT,
            S::TracePoint => BPF_PROG_TYPE_TRACEPOINT,
            _ => BPF_PROG_TYPE_KPROBE,
        };
        let code = Code {
            name,
            prog_type,
            multi: matches!(program.section, S::UProbe { .. } | S::URetProbe { .. })
                && self.multi(),
            insns: &function.instructions,
            license: &program.license,
            btf: self.0.btf.as_ref().map(|fd| (fd.as_fd(), function)),
        };
        let mut stats = vec![0u8; verifier::STATS_LOG_BYTES];
        let loaded = load(&code, verifier::LOG_STATS, &mut stats);
        let stats = String::from_utf8_lossy(&stats).into_owned();
        let figures = Figures::parse(&stats, code.insns.len());
        let source = match loaded {
            Ok(fd) => {
                *slot = Slot::Loaded { fd, figures };
                return Ok(());
            }
            Err(source) => source,
        };
        // Refused at the instruction limit, the figures say why; the full log would cost
        // as much verifying again. Otherwise the verifier stops where the code is wrong,
        // soon, and its last lines say where.
        let log = if figures.as_ref().is_some_and(Figures::at_limit) {
            verifier::refusal(&stats)
        } else {
            let mut log = vec![0u8; 1 << 20];
            let _ = load(&code, verifier::LOG_LEVEL1 | verifier::LOG_STATS, &mut log);
            verifier::refusal(&String::from_utf8_lossy(&log))
        };
        let errno = source.raw_os_error().unwrap_or(libc::EINVAL);
        // Out of memory or interrupted: worth another try later, unlike a refusal.
        if ![libc::ENOMEM, libc::EAGAIN, libc::EINTR].contains(&errno) {
            *slot = Slot::Refused {
                errno,
                log: log.clone(),
                figures,
            };
        }
        Err(refused(errno, &log))
    }

    /// A duplicate of the loaded program `name`'s fd (the perf-event program, which
    /// `sampler` attaches itself).
    pub fn fd(&self, name: &str) -> io::Result<OwnedFd> {
        let slot = self.slot(name).map_err(io::Error::other)?;
        let prog = slot.lock().unwrap_or_else(PoisonError::into_inner);
        match &*prog {
            Slot::Loaded { fd, .. } => fd.try_clone(),
            _ => Err(io::Error::other(format!("{name} is not loaded"))),
        }
    }

    /// Whether uprobes go on in multi-uprobe links.
    pub fn multi(&self) -> bool {
        matches!(self.0.links, Links::Multi)
    }

    /// The loaded uprobe program `name` on `offsets` (with their `cookies`) of `binary`, for
    /// every process: one multi-uprobe link, or one link per offset; all or nothing.
    pub fn attach(
        &self,
        name: &'static str,
        binary: &Path,
        offsets: &[u64],
        cookies: &[u64],
        at_return: bool,
    ) -> io::Result<Vec<OwnedFd>> {
        // A copy: attaching one perf event at a time takes long, and the program's lock
        // would keep others from seeing it loaded meanwhile.
        let prog = self.fd(name)?;
        match self.0.links {
            Links::Multi => {
                link(prog.as_fd(), binary, offsets, cookies, at_return).map(|l| vec![l])
            }
            Links::PerProbe(pmu) => {
                let path = c_path(binary)?;
                offsets
                    .iter()
                    .zip(cookies)
                    .map(|(&offset, &cookie)| {
                        let event = pmu.open(&path, offset, at_return)?;
                        perf_link(prog.as_fd(), event.as_fd(), cookie)
                    })
                    .collect()
            }
        }
    }
}

/// Programs named in `TRACER_REFUSE_PROGRAMS` (comma-separated) are taken as refused
/// without being verified: how the tests see a kernel that refuses one (a smaller variant
/// must serve, and the report say what is missing).
fn refused_for_tests(name: &str) -> Slot {
    let refused = std::env::var("TRACER_REFUSE_PROGRAMS")
        .is_ok_and(|v| v.split(',').any(|n| n.trim() == name));
    match refused {
        true => Slot::Refused {
            errno: libc::E2BIG,
            log: " (TRACER_REFUSE_PROGRAMS names it)".into(),
            figures: None,
        },
        false => Slot::NotLoaded,
    }
}

/// The fd of any map aya created.
fn map_fd(map: &Map) -> BorrowedFd<'_> {
    macro_rules! variants {
        ($($v:ident),*) => {
            match map { $(Map::$v(m) => m.fd().as_fd(),)* }
        };
    }
    variants!(
        Array,
        ArrayOfMaps,
        BloomFilter,
        CgroupArray,
        CgroupStorage,
        CgrpStorage,
        CpuMap,
        DevMap,
        DevMapHash,
        HashMap,
        HashOfMaps,
        InodeStorage,
        LpmTrie,
        LruHashMap,
        PerCpuArray,
        PerCpuCgroupStorage,
        PerCpuHashMap,
        PerCpuLruHashMap,
        PerfEventArray,
        ProgramArray,
        Queue,
        ReusePortSockArray,
        RingBuf,
        SockHash,
        SockMap,
        SkStorage,
        Stack,
        StackTraceMap,
        Unsupported,
        XskMap
    )
}
