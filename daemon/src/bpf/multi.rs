//! Multi-uprobe links (Linux 6.6+): one BPF link puts one program on many offsets of one
//! binary in a single syscall, and releasing it waits for the kernel's grace periods once
//! for the whole set instead of once per probe (~150 ms each). That is what lets a session
//! with hundreds of probes stop at once, and a SIGKILLed daemon leave no breakpoint behind
//! for long.
//!
//! The kernel takes such a link only for a program loaded with the `BPF_TRACE_UPROBE_MULTI`
//! attach type, which aya does not set for uprobes. So this module loads its own copies of
//! the uprobe programs from the same object, relocated against the maps aya created: both
//! copies read and write the very same maps.

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

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_BTF_LOAD: libc::c_long = 18;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_KPROBE: u32 = 2;
const BPF_PROG_TYPE_PERF_EVENT: u32 = 7;
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
    /// A perf-event program (sampling) rather than a uprobe for multi-uprobe links.
    perf_event: bool,
    insns: &'a [bpf_insn],
    license: &'a CString,
    btf: Option<(BorrowedFd<'a>, &'a Function)>,
}

fn load(code: &Code<'_>, log: &mut [u8]) -> io::Result<OwnedFd> {
    let mut prog_name = [0u8; 16];
    for (d, s) in prog_name.iter_mut().zip(code.name.bytes().take(15)) {
        *d = s;
    }
    let mut attr = ProgLoadAttr {
        prog_type: if code.perf_event {
            BPF_PROG_TYPE_PERF_EVENT
        } else {
            BPF_PROG_TYPE_KPROBE
        },
        insn_cnt: u32::try_from(code.insns.len()).unwrap_or(u32::MAX),
        insns: code.insns.as_ptr() as u64,
        license: code.license.as_ptr() as u64,
        log_level: u32::from(!log.is_empty()),
        log_size: u32::try_from(log.len()).unwrap_or(u32::MAX),
        log_buf: if log.is_empty() {
            0
        } else {
            log.as_mut_ptr() as u64
        },
        prog_name,
        expected_attach_type: if code.perf_event {
            0
        } else {
            BPF_TRACE_UPROBE_MULTI
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
fn load_btf(object: &mut Object) -> Result<Option<OwnedFd>, MultiError> {
    let Some(features) = aya::features().btf() else {
        return Ok(None);
    };
    let btf = object
        .fixup_and_sanitize_btf(features)
        .map_err(|e| MultiError::Relocate(format!("BTF: {e}")))?;
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
        .map_err(|e| MultiError::Relocate(format!("loading BTF: {e}")))
}

/// Creates one link of `prog` on `offsets` of `binary`, for every process (`pid` 0) or one;
/// `cookies[i]` is what `bpf_get_attach_cookie` gives the program at `offsets[i]`.
fn link(
    prog: BorrowedFd<'_>,
    binary: &Path,
    offsets: &[u64],
    cookies: &[u64],
    at_return: bool,
) -> io::Result<OwnedFd> {
    let path = CString::new(binary.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
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
        perf_event: false,
        insns: &insns,
        license: &license,
        btf: None,
    };
    let Ok(prog) = load(&code, &mut []) else {
        return false;
    };
    match link(prog.as_fd(), Path::new("/"), &[0], &[0], false) {
        Ok(_) => true,
        Err(e) => e.raw_os_error() == Some(libc::EBADF),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MultiError {
    #[error("parsing the BPF object again: {0}")]
    Parse(String),
    #[error("relocating {0}")]
    Relocate(String),
    #[error("no program {0} in the object")]
    NoProgram(String),
    #[error("loading {name} for multi-uprobe links: {source}{log}")]
    Load {
        name: String,
        source: io::Error,
        /// The verifier's last lines, when it refused.
        log: String,
    },
}

/// The uprobe programs, loaded for multi-uprobe links, and the sampling program, by name.
/// Cloned handles share them: verifying a program takes up to seconds, so it may be loaded
/// on another thread than the one that attaches it.
#[derive(Clone)]
pub struct MultiPrograms(Arc<Shared>);

struct Shared {
    object: Object,
    btf: Option<OwnedFd>,
    /// Duplicates of the fds of aya's maps, kept open for programs loaded later: relocated
    /// instructions name the maps by these fd numbers.
    _maps: HashMap<String, OwnedFd>,
    /// Each program of the object, once loaded. Its lock is held while it is verified, so a
    /// second loader waits for the first instead of verifying it again.
    loaded: HashMap<String, Mutex<Option<OwnedFd>>>,
}

impl MultiPrograms {
    /// Takes copies of `ebpf`'s map fds; call before any map is taken out of it.
    pub fn new(ebpf: &Ebpf, object_bytes: &[u8]) -> Result<Self, MultiError> {
        let mut object =
            Object::parse(object_bytes).map_err(|e| MultiError::Parse(e.to_string()))?;
        let btf = load_btf(&mut object)?;
        let mut maps = HashMap::new();
        for (name, map) in ebpf.maps() {
            let fd = map_fd(map)
                .try_clone_to_owned()
                .map_err(|e| MultiError::Relocate(format!("map {name}: {e}")))?;
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
            .map_err(|e| MultiError::Relocate(e.to_string()))?;
        object
            .relocate_calls(&text)
            .map_err(|e| MultiError::Relocate(e.to_string()))?;
        let loaded = object
            .programs
            .keys()
            .map(|name| (name.clone(), Mutex::new(None)))
            .collect();
        Ok(Self(Arc::new(Shared {
            object,
            btf,
            _maps: maps,
            loaded,
        })))
    }

    fn slot(&self, name: &str) -> Result<&Mutex<Option<OwnedFd>>, MultiError> {
        self.0
            .loaded
            .get(name)
            .ok_or_else(|| MultiError::NoProgram(name.into()))
    }

    /// Whether `name` is loaded; one being verified on another thread is not yet.
    pub fn is_loaded(&self, name: &str) -> bool {
        self.slot(name)
            .ok()
            .and_then(|s| s.try_lock().ok())
            .is_some_and(|fd| fd.is_some())
    }

    /// Loads `name` (once); the verifier's refusal comes back with its last lines.
    pub fn load(&self, name: &str) -> Result<(), MultiError> {
        let mut slot = self
            .slot(name)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return Ok(());
        }
        let object = &self.0.object;
        let program = object
            .programs
            .get(name)
            .ok_or_else(|| MultiError::NoProgram(name.into()))?;
        let function = object
            .functions
            .get(&program.function_key())
            .ok_or_else(|| MultiError::NoProgram(name.into()))?;
        let code = Code {
            name,
            perf_event: matches!(program.section, aya_obj::ProgramSection::PerfEvent),
            insns: &function.instructions,
            license: &program.license,
            btf: self.0.btf.as_ref().map(|fd| (fd.as_fd(), function)),
        };
        let fd = match load(&code, &mut []) {
            Ok(fd) => fd,
            Err(source) => {
                let mut log = vec![0u8; 1 << 20];
                let _ = load(&code, &mut log);
                let text = String::from_utf8_lossy(&log);
                let text = text.trim_end_matches('\0').trim();
                let tail: Vec<&str> = text.lines().rev().take(3).collect();
                let log = if tail.is_empty() {
                    String::new()
                } else {
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    format!(" (verifier: {})", tail.join(" / "))
                };
                return Err(MultiError::Load {
                    name: name.into(),
                    source,
                    log,
                });
            }
        };
        *slot = Some(fd);
        Ok(())
    }

    /// A duplicate of the loaded program `name`'s fd (the perf-event program, which
    /// `sampler` attaches itself).
    pub fn fd(&self, name: &str) -> io::Result<OwnedFd> {
        let slot = self.slot(name).map_err(io::Error::other)?;
        let prog = slot.lock().unwrap_or_else(PoisonError::into_inner);
        prog.as_ref()
            .ok_or_else(|| io::Error::other(format!("{name} is not loaded")))?
            .try_clone()
    }

    /// One link of the loaded program `name` on `offsets` (with their `cookies`) of `binary`.
    pub fn attach(
        &self,
        name: &'static str,
        binary: &Path,
        offsets: &[u64],
        cookies: &[u64],
        at_return: bool,
    ) -> io::Result<OwnedFd> {
        let slot = self.slot(name).map_err(io::Error::other)?;
        let prog = slot.lock().unwrap_or_else(PoisonError::into_inner);
        let prog = prog
            .as_ref()
            .ok_or_else(|| io::Error::other(format!("{name} is not loaded")))?;
        link(prog.as_fd(), binary, offsets, cookies, at_return)
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
