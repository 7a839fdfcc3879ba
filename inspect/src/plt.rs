//! Names of PLT stubs (`malloc@plt`). The stubs have no symbols of their own, so symbol
//! lookups name them after whatever precedes them (`_init`); like perf, tracer names each
//! stub after the function it jumps to. Each stub is an indirect `jmp *slot(%rip)`; the
//! dynamic relocation of that GOT slot names the function.

use std::collections::HashMap;

use object::{Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, RelocationFlags};

/// Stubs of one binary: (file offset start, end, name), sorted.
#[derive(Default)]
pub struct Plt {
    stubs: Vec<(u64, u64, String)>,
}

const R_X86_64_GLOB_DAT: u32 = 6;
const R_X86_64_JUMP_SLOT: u32 = 7;
const R_X86_64_IRELATIVE: u32 = 37;
/// What the PLT header and the lazy-binding stubs lead to: the first call of a function
/// goes through them into ld.so's resolver.
const RESOLVER: &str = "_dl_runtime_resolve@plt";

impl Plt {
    pub fn read(data: &[u8]) -> Self {
        let Ok(file) = object::File::parse(data) else {
            return Self::default();
        };
        let slots = slots(&file);
        // With IBT, .plt.sec holds the stubs and .plt only the header and the lazy-binding
        // entries, which jump to the header: all of .plt leads to the resolver.
        let ibt = file.section_by_name(".plt.sec").is_some();
        let mut stubs = Vec::new();
        for s in file.sections() {
            let (Ok(name), Some((off, size)), Ok(code)) = (s.name(), s.file_range(), s.data())
            else {
                continue;
            };
            let (entry, unknown) = match name {
                ".plt" => (16, RESOLVER),
                ".plt.sec" => (16, "[plt]"),
                ".plt.got" if ibt => (16, "[plt.got]"),
                ".plt.got" => (8, "[plt.got]"),
                _ => continue,
            };
            for (k, e) in code.chunks(entry).enumerate() {
                let at = (k * entry) as u64;
                let slot = jump_slot(e, s.address() + at);
                let label = match slot.and_then(|t| slots.get(&t)) {
                    Some(n) if !(name == ".plt" && ibt) => format!("{n}@plt"),
                    _ => unknown.to_owned(),
                };
                stubs.push((off + at, (off + at + entry as u64).min(off + size), label));
            }
        }
        stubs.sort();
        Self { stubs }
    }

    /// The file offsets of the stubs that jump to `function`: (start, end).
    pub fn stubs_of<'a>(&'a self, function: &'a str) -> impl Iterator<Item = (u64, u64)> + 'a {
        self.stubs
            .iter()
            .filter(move |s| s.2.strip_suffix("@plt") == Some(function))
            .map(|s| (s.0, s.1))
    }

    /// The stub holding this file offset, if any.
    pub fn name(&self, file_offset: u64) -> Option<&str> {
        let i = self.stubs.partition_point(|s| s.0 <= file_offset);
        let (start, end, name) = self.stubs.get(i.checked_sub(1)?)?;
        (file_offset >= *start && file_offset < *end).then_some(name.as_str())
    }
}

/// GOT slot address → the function a stub jumping through it reaches: the symbol of a
/// jump-slot or GOT-entry relocation, or for an ifunc inside the binary (IRELATIVE), the
/// ifunc symbol at the resolver's address.
pub(crate) fn slots(file: &object::File) -> HashMap<u64, String> {
    let mut out = HashMap::new();
    let Some(relocs) = file.dynamic_relocations() else {
        return out;
    };
    let symbols = file.dynamic_symbol_table();
    let by_address: HashMap<u64, &str> = file
        .dynamic_symbols()
        .chain(file.symbols())
        .filter(|s| s.address() != 0)
        .filter_map(|s| Some((s.address(), s.name().ok()?)))
        .collect();
    for (at, r) in relocs {
        let RelocationFlags::Elf { r_type } = r.flags() else {
            continue;
        };
        let name = match (r_type, r.target()) {
            (R_X86_64_JUMP_SLOT | R_X86_64_GLOB_DAT, object::RelocationTarget::Symbol(i)) => {
                // Dynamic relocations index the dynamic symbol table.
                symbols
                    .as_ref()
                    .and_then(|t| t.symbol_by_index(i).ok())
                    .and_then(|s| s.name().ok())
            }
            (R_X86_64_IRELATIVE, _) => u64::try_from(r.addend())
                .ok()
                .and_then(|a| by_address.get(&a).copied()),
            _ => None,
        };
        if let Some(n) = name.filter(|n| !n.is_empty()) {
            out.insert(at, n.to_owned());
        }
    }
    out
}

/// The GOT slot an entry jumps through: `jmp *disp(%rip)` (`ff 25`, after `endbr64` and
/// `bnd` with IBT), relative to the end of the instruction.
fn jump_slot(entry: &[u8], address: u64) -> Option<u64> {
    let i = entry.windows(6).position(|w| w[..2] == [0xff, 0x25])?;
    let disp = i32::from_le_bytes(entry[i + 2..i + 6].try_into().ok()?);
    Some((address + i as u64 + 6).wrapping_add_signed(disp.into()))
}

#[cfg(test)]
mod tests {
    use super::Plt;

    #[test]
    fn own_libc_stubs_are_named() {
        // The test binary calls into libc through its PLT; every stub found must be named
        // after a dynamic symbol or be the PLT header.
        let data = std::fs::read("/proc/self/exe").unwrap();
        let plt = Plt::read(&data);
        if plt.stubs.is_empty() {
            tracer_testkit::skip(format_args!("this binary has no PLT"));
            return;
        }
        assert!(
            plt.stubs.iter().any(|s| s.2.ends_with("@plt")),
            "{:?}",
            &plt.stubs[..plt.stubs.len().min(5)]
        );
        let (start, _, name) = &plt.stubs[plt.stubs.len() / 2];
        assert_eq!(plt.name(*start), Some(name.as_str()));
        assert_eq!(plt.name(0), None);
    }

    #[test]
    fn libc_stubs_and_header_all_have_names() {
        // The libc this test runs with: its .plt header leads to the resolver and its
        // .plt.got stubs jump through GLOB_DAT slots, so no stub is left as a bare section.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let Some(libc) = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("/libc.so"))
        else {
            tracer_testkit::skip(format_args!("no libc.so mapped"));
            return;
        };
        let plt = Plt::read(&std::fs::read(libc).unwrap());
        assert!(!plt.stubs.is_empty(), "{libc}: no stubs");
        let bare: Vec<_> = plt.stubs.iter().filter(|s| s.2.starts_with('[')).collect();
        assert!(bare.is_empty(), "{libc}: {bare:?}");
        assert_eq!(plt.stubs[0].2, super::RESOLVER);
    }
}
