//! Kernels a binary registers with the CUDA runtime, read from its code. nvcc's host code
//! registers each kernel of a translation unit when the binary is loaded,
//! `__cudaRegisterFunction(handle, hostFun, deviceFun, deviceName, -1, 0, …)` with constant
//! arguments, and a launch hands the runtime that `hostFun`. A process tracer attaches to
//! after its CUDA start-up made those calls before any probe could see them, but the calls,
//! and their constants, are still in its binaries' code: each call site is found (a call to
//! the function's PLT stub, or through its GOT slot) and the instructions before it are
//! followed to the values of `hostFun` and `deviceName`. What a call site does not show
//! plainly (a value computed or loaded from memory) is left unread, never guessed.
//!
//! CUDA 13's host stubs launch a runtime handle instead of `hostFun`: each stub keeps it in a
//! static of its own, filled at its first launch by `__cudaGetKernel(&handle, hostFun)`; code
//! that launches at the driver may keep `cudaGetFuncBySymbol(&f, hostFun)`'s function the same
//! way. Those calls are read the same way, and the statics' values in a running process
//! ([`Registrations::handles`]) tell which kernel each handle is.

use std::collections::HashMap;

use iced_x86::{Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};
use object::{Object, ObjectSection, ObjectSegment, SectionFlags};

const REGISTER: &str = "__cudaRegisterFunction";
/// Calls that write a handle for a host function through their first argument: CUDA 13's
/// stubs' own, the public one, and the driver function's for a host function.
const GET_HANDLE: [&str; 3] = ["__cudaGetKernel", "cudaGetKernel", "cudaGetFuncBySymbol"];

/// How far before a call its arguments are looked for: nvcc's calls set six registers and
/// push four words just before each call.
const WINDOW: u64 = 128;

/// The longest device name read.
const MAX_NAME: usize = 4096;

/// What a binary's code registers with the CUDA runtime.
#[derive(Default)]
pub struct Registrations {
    /// Host function (its file offset) → the device name registered for it.
    pub kernels: HashMap<u64, String>,
    /// Handle statics: (the static's virtual address, its host function's file
    /// offset), for host functions registered above.
    handle_slots: Vec<(u64, u64)>,
    /// (file offset, size in the file, virtual address) of each loaded segment.
    segments: Vec<(u64, u64, u64)>,
}

impl Registrations {
    /// Every call of `__cudaRegisterFunction` and `__cudaGetKernel` in `data` (an ELF binary)
    /// whose arguments are plain.
    pub fn read(data: &[u8]) -> Self {
        let mut out = Self::default();
        let Ok(file) = object::File::parse(data) else {
            return out;
        };
        if file.architecture() != object::Architecture::X86_64 {
            return out;
        }
        out.segments = file
            .segments()
            .map(|s| {
                let (start, size) = s.file_range();
                (start, size, s.address())
            })
            .collect();
        let callees = Callees::of(&file, data, |off| out.vaddr(off));
        if callees.is_empty() {
            return out;
        }
        let mut slots = Vec::new();
        for section in file.sections() {
            let executable = matches!(section.flags(), SectionFlags::Elf { sh_flags }
                if sh_flags & u64::from(object::elf::SHF_EXECINSTR) != 0);
            let name = section.name().unwrap_or("");
            if !executable || name.starts_with(".plt") {
                continue;
            }
            let (Ok(code), base) = (section.data(), section.address()) else {
                continue;
            };
            for i in 0..code.len() {
                if code[i] != 0xe8 && code[i] != 0xff {
                    continue;
                }
                let at = base + i as u64;
                let Some(callee) = callees.called(at, &code[i..]) else {
                    continue;
                };
                let Some(regs) = arguments(code, base, at, callee) else {
                    continue;
                };
                let Some(host) = regs.get(&Register::RSI).and_then(|&h| out.offset(h)) else {
                    continue;
                };
                if callee == REGISTER {
                    let name = regs.get(&Register::RCX).or(regs.get(&Register::RDX));
                    if let Some(name) = name.and_then(|&n| string(&file, n)) {
                        out.kernels.insert(host, name);
                    }
                } else if let Some(&slot) = regs.get(&Register::RDI) {
                    slots.push((slot, host));
                }
            }
        }
        slots.retain(|(_, host)| out.kernels.contains_key(host));
        out.handle_slots = slots;
        out
    }

    /// The virtual address of a file offset, through the segment that maps it.
    pub fn vaddr(&self, off: u64) -> Option<u64> {
        self.segments.iter().find_map(|&(start, size, addr)| {
            (start..start + size)
                .contains(&off)
                .then(|| addr + (off - start))
        })
    }

    /// The file offset of a virtual address, through the segment that maps it.
    fn offset(&self, addr: u64) -> Option<u64> {
        self.segments.iter().find_map(|&(start, size, at)| {
            (at..at + size).contains(&addr).then(|| start + (addr - at))
        })
    }

    /// Handle → device name, from the handle statics of a process that maps this
    /// binary `bias` bytes above its virtual addresses (a static still 0 was never filled).
    /// The statics are read as they are; a handle is only ever looked up, never followed.
    pub fn handles(&self, pid: u32, bias: u64) -> std::io::Result<HashMap<u64, String>> {
        let addrs: Vec<u64> = self
            .handle_slots
            .iter()
            .map(|&(slot, _)| slot.wrapping_add(bias))
            .collect();
        let words = crate::process::memory::words(pid, &addrs)?;
        Ok(self
            .handle_slots
            .iter()
            .zip(words)
            .filter_map(|(&(_, host), word)| {
                let handle = word.filter(|&w| w != 0)?;
                Some((handle, self.kernels.get(&host)?.clone()))
            })
            .collect())
    }

    /// Whether the binary keeps handles of registered kernels in statics.
    pub fn has_handles(&self) -> bool {
        !self.handle_slots.is_empty()
    }
}

/// The PLT stubs and GOT slots through which a binary calls the runtime's registration
/// functions.
struct Callees {
    /// (start, end, name) of each PLT stub, as virtual addresses.
    stubs: Vec<(u64, u64, &'static str)>,
    /// (GOT slot, name).
    slots: Vec<(u64, &'static str)>,
}

impl Callees {
    fn of(file: &object::File, data: &[u8], vaddr: impl Fn(u64) -> Option<u64>) -> Self {
        let plt = crate::plt::Plt::read(data);
        let got = crate::plt::slots(file);
        let mut out = Self {
            stubs: Vec::new(),
            slots: Vec::new(),
        };
        for name in std::iter::once(REGISTER).chain(GET_HANDLE) {
            out.stubs.extend(
                plt.stubs_of(name)
                    .filter_map(|(start, end)| Some((vaddr(start)?, vaddr(end - 1)? + 1, name))),
            );
            out.slots.extend(
                got.iter()
                    .filter(|(_, n)| n.as_str() == name)
                    .map(|(slot, _)| (*slot, name)),
            );
        }
        out
    }

    fn is_empty(&self) -> bool {
        self.stubs.is_empty() && self.slots.is_empty()
    }

    /// The function the instruction at `at` (`code` from there) calls, if one of ours.
    fn called(&self, at: u64, code: &[u8]) -> Option<&'static str> {
        match code {
            // call rel32
            [0xe8, rel @ ..] if rel.len() >= 4 => {
                let rel = i32::from_le_bytes(rel[..4].try_into().ok()?);
                let target = (at + 5).wrapping_add_signed(rel.into());
                self.stubs
                    .iter()
                    .find(|&&(s, e, _)| (s..e).contains(&target))
                    .map(|&(_, _, n)| n)
            }
            // call *disp32(%rip)
            [0xff, 0x15, disp @ ..] if disp.len() >= 4 => {
                let disp = i32::from_le_bytes(disp[..4].try_into().ok()?);
                let slot = (at + 6).wrapping_add_signed(disp.into());
                self.slots
                    .iter()
                    .find(|&&(s, _)| s == slot)
                    .map(|&(_, n)| n)
            }
            _ => None,
        }
    }
}

/// The argument registers known at the call at `call` to `callee`: the instructions from a start that
/// decodes onto the call exactly, followed through `lea reg, [rip+X]` and register moves;
/// anything else that writes a register forgets it.
fn arguments(code: &[u8], base: u64, call: u64, callee: &str) -> Option<HashMap<Register, u64>> {
    let complete = |regs: &HashMap<Register, u64>| {
        regs.contains_key(&Register::RSI)
            && if callee == REGISTER {
                regs.contains_key(&Register::RCX) || regs.contains_key(&Register::RDX)
            } else {
                regs.contains_key(&Register::RDI)
            }
    };
    let first = call.saturating_sub(WINDOW).max(base);
    (first..call).find_map(|start| {
        let mut decoder = Decoder::with_ip(
            64,
            &code[(start - base) as usize..(call - base) as usize],
            start,
            DecoderOptions::NONE,
        );
        let mut regs: HashMap<Register, u64> = HashMap::new();
        let mut ins = Instruction::default();
        while decoder.can_decode() {
            decoder.decode_out(&mut ins);
            if ins.is_invalid() {
                return None;
            }
            follow(&ins, &mut regs);
        }
        // Only a start whose last instruction ends at the call lines up with the code.
        (ins.next_ip() == call && complete(&regs)).then_some(regs)
    })
}

/// What `ins` does to the registers followed.
fn follow(ins: &Instruction, regs: &mut HashMap<Register, u64>) {
    let dest = (ins.op_count() > 0 && ins.op0_kind() == OpKind::Register)
        .then(|| ins.op0_register().full_register());
    match ins.mnemonic() {
        Mnemonic::Lea if ins.is_ip_rel_memory_operand() => {
            if let Some(d) = dest.filter(|_| ins.op0_register().size() == 8) {
                regs.insert(d, ins.ip_rel_memory_address());
            }
        }
        Mnemonic::Mov if ins.op1_kind() == OpKind::Register && ins.op0_register().size() == 8 => {
            let from = regs.get(&ins.op1_register().full_register()).copied();
            if let Some(d) = dest {
                match from {
                    Some(v) => regs.insert(d, v),
                    None => regs.remove(&d),
                };
            }
        }
        // A call leaves nothing known in the argument registers.
        Mnemonic::Call => regs.clear(),
        Mnemonic::Cmp | Mnemonic::Test | Mnemonic::Push => {}
        _ => {
            if let Some(d) = dest {
                regs.remove(&d);
            }
            if ins.mnemonic() == Mnemonic::Xchg && ins.op1_kind() == OpKind::Register {
                regs.remove(&ins.op1_register().full_register());
            }
        }
    }
}

/// The NUL-terminated name at `addr`: printable ASCII, as device names are.
fn string(file: &object::File, addr: u64) -> Option<String> {
    let section = file
        .sections()
        .find(|s| (s.address()..s.address() + s.size()).contains(&addr))?;
    let data = section.data().ok()?;
    let from = usize::try_from(addr - section.address()).ok()?;
    let bytes = data.get(from..)?;
    let len = bytes.iter().take(MAX_NAME).position(|&b| b == 0)?;
    let name = &bytes[..len];
    (len > 0 && name.iter().all(u8::is_ascii_graphic))
        .then(|| String::from_utf8_lossy(name).into_owned())
}
