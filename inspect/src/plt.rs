//! Names of PLT stubs (`malloc@plt`). The stubs have no symbols of their own, so symbol
//! lookups name them after whatever precedes them (`_init`); like perf, tracer names each
//! stub after the function it jumps to, from the jump-slot relocations.

use object::{Object, ObjectSection, ObjectSymbolTable, RelocationFlags};

/// Stubs of one binary: (file offset start, end, name), sorted.
#[derive(Default)]
pub struct Plt {
    stubs: Vec<(u64, u64, String)>,
}

const R_X86_64_JUMP_SLOT: u32 = 7;

impl Plt {
    pub fn read(data: &[u8]) -> Self {
        let Ok(file) = object::File::parse(data) else {
            return Self::default();
        };
        // Jump-slot relocations, in .rela.plt order: stub k of .plt.sec, or k+1 of .plt.
        let mut slots = Vec::new();
        if let (Some(relocs), Some(symbols)) =
            (file.dynamic_relocations(), file.dynamic_symbol_table())
        {
            for (_, r) in relocs {
                if !matches!(r.flags(), RelocationFlags::Elf { r_type } if r_type == R_X86_64_JUMP_SLOT)
                {
                    continue;
                }
                let name = match r.target() {
                    // Dynamic relocations index the dynamic symbol table.
                    object::RelocationTarget::Symbol(i) => symbols
                        .symbol_by_index(i)
                        .ok()
                        .and_then(|s| object::ObjectSymbol::name(&s).ok())
                        .unwrap_or("")
                        .to_owned(),
                    _ => String::new(),
                };
                slots.push(name);
            }
        }
        let mut stubs = Vec::new();
        let has_sec = file.section_by_name(".plt.sec").is_some();
        for s in file.sections() {
            let (Ok(name), Some((off, size))) = (s.name(), s.file_range()) else {
                continue;
            };
            let (entry, first) = match name {
                ".plt.sec" => (16, 0),
                ".plt" if has_sec => {
                    stubs.push((off, off + size, "[plt]".to_owned()));
                    continue;
                }
                ".plt" => (16, 1),
                ".plt.got" => {
                    stubs.push((off, off + size, "[plt.got]".to_owned()));
                    continue;
                }
                _ => continue,
            };
            let mut at = off;
            let mut k = 0usize;
            while at < off + size {
                let label = if k < first {
                    "[plt]".to_owned()
                } else {
                    match slots.get(k - first) {
                        Some(n) if !n.is_empty() => format!("{n}@plt"),
                        _ => "[plt]".to_owned(),
                    }
                };
                stubs.push((at, at + entry, label));
                at += entry;
                k += 1;
            }
        }
        stubs.sort();
        Self { stubs }
    }

    /// The stub holding this file offset, if any.
    pub fn name(&self, file_offset: u64) -> Option<&str> {
        let i = self.stubs.partition_point(|s| s.0 <= file_offset);
        let (start, end, name) = self.stubs.get(i.checked_sub(1)?)?;
        (file_offset >= *start && file_offset < *end).then_some(name.as_str())
    }
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
}
