//! Where in an opcode handler to put a uprobe.
//!
//! The kernel emulates a few x86 instructions at a uprobe (relative jumps, calls and
//! conditional jumps, `push reg`, nops) and single-steps every other one out of line, which
//! costs several times more. A handler's first instruction is often a `lea` or `mov`; the
//! straight-line run that starts it usually ends in a `jcc` or `jmp rel`, which every path
//! through the handler passes exactly once. That is the point chosen, unless some other code
//! can jump into the run (then the run is cut there).

use std::collections::HashSet;

use iced_x86::{Decoder, DecoderOptions, FlowControl, Instruction, Mnemonic, OpKind};

/// Executable code: (address, bytes).
pub struct Code<'a> {
    pub regions: Vec<(u64, &'a [u8])>,
}

impl Code<'_> {
    fn bytes_at(&self, addr: u64) -> Option<&[u8]> {
        self.regions.iter().find_map(|&(start, b)| {
            let off = usize::try_from(addr.checked_sub(start)?).ok()?;
            b.get(off..)
        })
    }

    /// Every direct branch or call target in the code: places other paths enter.
    pub fn branch_targets(&self) -> HashSet<u64> {
        let mut out = HashSet::new();
        for &(start, bytes) in &self.regions {
            let mut d = Decoder::with_ip(64, bytes, start, DecoderOptions::NONE);
            let mut ins = Instruction::default();
            while d.can_decode() {
                d.decode_out(&mut ins);
                if matches!(
                    ins.flow_control(),
                    FlowControl::UnconditionalBranch
                        | FlowControl::ConditionalBranch
                        | FlowControl::Call
                ) && matches!(ins.op0_kind(), OpKind::NearBranch64)
                {
                    out.insert(ins.near_branch_target());
                }
            }
        }
        out
    }
}

/// Whether this kernel's uprobe code emulates the instruction (no single-step).
fn emulated(ins: &Instruction, bytes: &[u8]) -> bool {
    // Prefixes (0x66 above all) make the kernel fall back to single-stepping.
    let first = bytes.first().copied().unwrap_or(0);
    let prefixed = matches!(
        first,
        0x66 | 0x67 | 0xf2 | 0xf3 | 0x2e | 0x3e | 0x26 | 0x36 | 0x64 | 0x65
    );
    if prefixed {
        return false;
    }
    match ins.flow_control() {
        FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch | FlowControl::Call => {
            matches!(ins.op0_kind(), OpKind::NearBranch64)
        }
        _ => {
            ins.mnemonic() == Mnemonic::Nop
                || (ins.mnemonic() == Mnemonic::Push && ins.op0_kind() == OpKind::Register)
        }
    }
}

/// The probe address for the handler at `start`, and how it was chosen.
pub fn choose(code: &Code, start: u64, joins: &HashSet<u64>) -> (u64, &'static str) {
    let Some(bytes) = code.bytes_at(start) else {
        return (start, "handler start");
    };
    let mut d = Decoder::with_ip(64, bytes, start, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    // A handler's straight-line prefix is short; stop looking after a few instructions.
    for _ in 0..32 {
        if !d.can_decode() {
            break;
        }
        d.decode_out(&mut ins);
        let at = ins.ip();
        if at != start && joins.contains(&at) {
            break;
        }
        let off = usize::try_from(at - start).unwrap_or(usize::MAX);
        if emulated(&ins, bytes.get(off..).unwrap_or_default()) {
            return (
                at,
                if at == start {
                    "handler start (emulated)"
                } else {
                    "first emulated instruction on every path"
                },
            );
        }
        if ins.flow_control() != FlowControl::Next {
            break;
        }
    }
    (start, "handler start (single-stepped)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(bytes: &[u8]) -> Code<'_> {
        Code {
            regions: vec![(0x1000, bytes)],
        }
    }

    #[test]
    fn skips_to_the_branch_that_ends_the_prefix() {
        // lea 0x2(%r14),%rax ; mov %r14,0x38(%rbp) ; jmp rel32
        let b = [
            0x49, 0x8d, 0x46, 0x02, 0x4c, 0x89, 0x75, 0x38, 0xe9, 0x00, 0x01, 0x00, 0x00,
        ];
        let c = code(&b);
        assert_eq!(choose(&c, 0x1000, &HashSet::new()).0, 0x1008);
    }

    #[test]
    fn a_join_point_inside_the_prefix_keeps_the_start() {
        let b = [
            0x49, 0x8d, 0x46, 0x02, 0x4c, 0x89, 0x75, 0x38, 0xe9, 0x00, 0x01, 0x00, 0x00,
        ];
        let c = code(&b);
        let joins: HashSet<u64> = [0x1004].into_iter().collect();
        assert_eq!(
            choose(&c, 0x1000, &joins),
            (0x1000, "handler start (single-stepped)")
        );
    }

    #[test]
    fn an_indirect_jump_ends_the_search() {
        // mov (%rax),%rax ; jmp *%rax ; jmp rel8
        let b = [0x48, 0x8b, 0x00, 0xff, 0xe0, 0xeb, 0x00];
        assert_eq!(choose(&code(&b), 0x1000, &HashSet::new()).0, 0x1000);
    }

    #[test]
    fn operand_size_prefixed_branches_are_not_emulated() {
        // 66 jmp rel16 is not emulated by the kernel.
        let b = [0x66, 0xe9, 0x00, 0x00];
        assert_eq!(
            choose(&code(&b), 0x1000, &HashSet::new()).1,
            "handler start (single-stepped)"
        );
    }
}
