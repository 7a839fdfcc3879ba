//! Kernels a binary registers with the CUDA runtime, read from its code. nvcc's host code
//! registers each kernel of a translation unit when the binary is loaded,
//! `__cudaRegisterFunction(handle, hostFun, deviceFun, deviceName, -1, 0, …)` with constant
//! arguments, and a launch hands the runtime that `hostFun`. A process tracer attaches to
//! after its CUDA start-up made those calls before any probe could see them, but the calls,
//! and their constants, are still in its binaries' code: each call site is found (a call to
//! the function's PLT stub, or through its GOT slot) and the instructions before it are
//! followed to the values of `hostFun` and `deviceName`. What a call site does not show
//! plainly (a value computed or loaded from memory) is left unread, never guessed.

use std::collections::HashMap;

use iced_x86::{Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};
use object::{Object, ObjectSection, ObjectSegment, SectionFlags};

const REGISTER: &str = "__cudaRegisterFunction";

/// How far before a call its arguments are looked for: nvcc's calls set six registers and
/// push four words just before each call.
const WINDOW: u64 = 128;

/// The longest device name read.
const MAX_NAME: usize = 4096;

/// Host function (its file offset) → the device name registered for it, for every call of
/// `__cudaRegisterFunction` in `data` (an ELF binary) whose arguments are plain.
pub fn registered_kernels(data: &[u8]) -> HashMap<u64, String> {
    let mut out = HashMap::new();
    let Ok(file) = object::File::parse(data) else {
        return out;
    };
    if file.architecture() != object::Architecture::X86_64 {
        return out;
    }
    let plt = crate::plt::Plt::read(data);
    let stubs: Vec<(u64, u64)> = plt
        .stubs_of(REGISTER)
        .filter_map(|(start, end)| Some((vaddr(&file, start)?, vaddr(&file, end - 1)? + 1)))
        .collect();
    let slots: Vec<u64> = crate::plt::slots(&file)
        .into_iter()
        .filter(|(_, name)| name == REGISTER)
        .map(|(slot, _)| slot)
        .collect();
    if stubs.is_empty() && slots.is_empty() {
        return out;
    }
    let calls_register = |at: u64, code: &[u8]| -> Option<usize> {
        match code {
            // call rel32
            [0xe8, rel @ ..] if rel.len() >= 4 => {
                let rel = i32::from_le_bytes(rel[..4].try_into().ok()?);
                let target = (at + 5).wrapping_add_signed(rel.into());
                stubs
                    .iter()
                    .any(|&(s, e)| (s..e).contains(&target))
                    .then_some(5)
            }
            // call *disp32(%rip)
            [0xff, 0x15, disp @ ..] if disp.len() >= 4 => {
                let disp = i32::from_le_bytes(disp[..4].try_into().ok()?);
                let slot = (at + 6).wrapping_add_signed(disp.into());
                slots.contains(&slot).then_some(6)
            }
            _ => None,
        }
    };
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
            if calls_register(at, &code[i..]).is_none() {
                continue;
            }
            let Some((host, name)) = arguments(code, base, at) else {
                continue;
            };
            let (Some(host), Some(name)) = (offset(&file, host), string(&file, name)) else {
                continue;
            };
            out.insert(host, name);
        }
    }
    out
}

/// `hostFun` and `deviceName` (else `deviceFun`) as set up before the call at `call`: the
/// instructions from a start that decodes onto the call exactly, followed through
/// `lea reg, [rip+X]` and register moves; anything else that writes a register forgets it.
fn arguments(code: &[u8], base: u64, call: u64) -> Option<(u64, u64)> {
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
        if ins.next_ip() != call {
            return None;
        }
        let host = *regs.get(&Register::RSI)?;
        let name = regs.get(&Register::RCX).or(regs.get(&Register::RDX))?;
        Some((host, *name))
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

/// The virtual address of a file offset, through the segment that maps it.
fn vaddr(file: &object::File, off: u64) -> Option<u64> {
    file.segments().find_map(|s| {
        let (start, size) = s.file_range();
        (start..start + size)
            .contains(&off)
            .then(|| s.address() + (off - start))
    })
}

/// The file offset of a virtual address, through the segment that maps it.
fn offset(file: &object::File, addr: u64) -> Option<u64> {
    file.segments().find_map(|s| {
        let (start, size) = s.file_range();
        (s.address()..s.address() + size)
            .contains(&addr)
            .then(|| start + (addr - s.address()))
    })
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
