//! `cargo xtask frames`: the BPF programs' stack use along their deepest call chains, which
//! the verifier caps at 512 bytes (each function's frame rounded up to 16, summed over
//! BPF-to-BPF calls and `bpf_loop` callbacks). A nightly whose code generation grows a frame
//! on the deepest chain makes the program fail to load; this shows how close each one is.
//!
//! Read from `llvm-objdump -dr` of the built object: a frame is the deepest `r10 - N` a
//! function touches; a call is a pseudo call (`call` with source register 1, relative to the
//! next instruction), a relocated `call -1`, or a callback handed to a helper (`rX = N ll`
//! relocated against `.text`: N is the callback's byte offset).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::PathBuf,
    process::Command,
};

use anyhow::{bail, Context, Result};

/// The verifier's limit per call chain.
const LIMIT: u64 = 512;

/// A function's frame and what it calls.
#[derive(Default)]
struct Function {
    frame: u64,
    calls: BTreeSet<String>,
}

/// One program's deepest stack: its bytes and the chain of functions (with their frames).
pub struct Chain {
    pub program: String,
    pub bytes: u64,
    pub chain: String,
}

/// Each program's deepest chain, least first, from the newest build's object.
pub fn chains() -> Result<Vec<Chain>> {
    let object = newest_object()?;
    let out = Command::new("llvm-objdump")
        .arg("-dr")
        .arg(&object)
        .output()
        .context("llvm-objdump (LLVM's binutils) is needed")?;
    if !out.status.success() {
        bail!("llvm-objdump -dr {} failed", object.display());
    }
    let functions = parse(&String::from_utf8_lossy(&out.stdout));
    let mut depths = HashMap::new();
    let mut programs: Vec<(u64, String)> = functions
        .keys()
        .filter(|f| f.starts_with("tracer_"))
        .map(|f| (depth(&functions, f, &mut depths), f.clone()))
        .collect();
    programs.sort();
    Ok(programs
        .into_iter()
        .map(|(bytes, program)| {
            let chain: Vec<String> = path(&functions, &program, &mut depths)
                .iter()
                .map(|f| format!("{} {}", short(f), round(functions[f].frame)))
                .collect();
            Chain {
                program,
                bytes,
                chain: chain.join(" > "),
            }
        })
        .collect())
}

/// Prints each program's deepest chain; warns when one is within a frame of the limit.
pub fn print() -> Result<()> {
    let object = newest_object()?;
    let programs = chains()?;
    let shown = object.strip_prefix(crate::root()).unwrap_or(&object);
    println!(
        "{}: deepest stack per program (limit {LIMIT} bytes)",
        shown.display()
    );
    for c in &programs {
        println!("{:>4}  {}", c.bytes, c.chain);
    }
    if let Some(c) = programs.last().filter(|c| c.bytes + 16 > LIMIT) {
        println!(
            "warning: {} is at {} of {LIMIT} bytes: any frame on its chain that grows stops it loading",
            c.program, c.bytes
        );
    }
    Ok(())
}

/// The BPF object the last build made.
fn newest_object() -> Result<PathBuf> {
    let build = crate::root().join("target/release/build");
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&build)
        .with_context(|| format!("{}: build first (cargo xtask build)", build.display()))?
        .flatten()
        .map(|d| d.path().join("out/tracer.bpf.o"))
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, p)| p)
        .context("no tracer.bpf.o: build first (cargo xtask build)")
}

/// Functions by name, from `llvm-objdump -dr` output.
fn parse(text: &str) -> BTreeMap<String, Function> {
    let mut functions: BTreeMap<String, Function> = BTreeMap::new();
    // (section, instruction index) → the function starting there.
    let mut starts: HashMap<(String, u64), String> = HashMap::new();
    // Calls by target position, resolved once every function is known.
    let mut by_position: Vec<(String, (String, u64))> = Vec::new();
    let (mut section, mut current) = (String::new(), None::<String>);
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if let Some(s) = line.strip_prefix("Disassembly of section ") {
            section = s.trim_end_matches(':').to_owned();
            continue;
        }
        if let Some((offset, name)) = function_start(line) {
            starts.insert((section.clone(), offset / 8), name.clone());
            functions.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        let (Some(f), Some((pc, bytes, asm))) = (current.as_ref(), instruction(line)) else {
            continue;
        };
        let function = functions.get_mut(f).expect("entered above");
        for n in stack_offsets(asm) {
            function.frame = function.frame.max(n);
        }
        let relocated = lines
            .get(i + 1)
            .filter(|l| l.contains("R_BPF_64"))
            .and_then(|l| l.split_whitespace().last());
        let imm = i64::from(i32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]));
        match (bytes[0], relocated) {
            // A callback's address: its byte offset in .text.
            (0x18, Some(".text")) => {
                by_position.push((f.clone(), (".text".into(), imm as u64 / 8)))
            }
            (0x85, Some(".text")) => {
                by_position.push((f.clone(), (".text".into(), (imm + 1) as u64)))
            }
            (0x85, Some(target)) => {
                function.calls.insert(target.to_owned());
            }
            // A pseudo call within the section.
            (0x85, None) if bytes[1] & 0xf0 == 0x10 => {
                by_position.push((f.clone(), (section.clone(), (pc as i64 + imm + 1) as u64)))
            }
            _ => {}
        }
    }
    for (f, at) in by_position {
        if let Some(target) = starts.get(&at) {
            functions
                .get_mut(&f)
                .expect("seen")
                .calls
                .insert(target.clone());
        }
    }
    functions
}

/// `0000000000000000 <name>:`
fn function_start(line: &str) -> Option<(u64, String)> {
    let (offset, rest) = line.split_once(" <")?;
    let name = rest.strip_suffix(">:")?;
    Some((u64::from_str_radix(offset, 16).ok()?, name.to_owned()))
}

/// `     12:\t85 10 00 00 ff ff ff ff\tcall -1`: (index, the first 8 bytes, the assembly).
fn instruction(line: &str) -> Option<(u64, [u8; 8], &str)> {
    let (pc, rest) = line.trim_start().split_once(':')?;
    let pc = pc.parse().ok()?;
    let mut fields = rest.trim_start().splitn(2, '\t');
    let hex: Vec<u8> = fields
        .next()?
        .split_whitespace()
        .take(8)
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .ok()?;
    Some((pc, hex.try_into().ok()?, fields.next().unwrap_or("")))
}

/// The N of each `(r10 - N)` in an instruction.
fn stack_offsets(asm: &str) -> impl Iterator<Item = u64> + '_ {
    asm.split("(r10 - ").skip(1).filter_map(|s| {
        let n = s.split(')').next()?;
        match n.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => n.parse().ok(),
        }
    })
}

fn round(frame: u64) -> u64 {
    frame.div_ceil(16) * 16
}

/// The stack `f` and its deepest callees use.
fn depth(fs: &BTreeMap<String, Function>, f: &str, memo: &mut HashMap<String, u64>) -> u64 {
    if let Some(&d) = memo.get(f) {
        return d;
    }
    // A cycle (none is loadable) counts once.
    memo.insert(f.to_owned(), 0);
    let Some(function) = fs.get(f) else { return 0 };
    let below = function
        .calls
        .iter()
        .map(|c| depth(fs, c, memo))
        .max()
        .unwrap_or(0);
    let d = round(function.frame) + below;
    memo.insert(f.to_owned(), d);
    d
}

/// `f` and its deepest callees, outermost first.
fn path(
    fs: &BTreeMap<String, Function>,
    f: &str,
    depths: &mut HashMap<String, u64>,
) -> Vec<String> {
    let mut out = vec![f.to_owned()];
    let mut at = f.to_owned();
    while let Some(next) = fs[&at]
        .calls
        .iter()
        .filter(|c| fs.contains_key(*c) && !out.contains(c))
        .max_by_key(|c| depth(fs, c, depths))
    {
        out.push(next.clone());
        at = next.clone();
    }
    out
}

/// A Rust v0 symbol's last path segment (`…5stack3pop` → `pop`); other names as they are.
fn short(name: &str) -> String {
    if !name.starts_with("_R") {
        return name.to_owned();
    }
    // The last `<decimal length><identifier>` of the name.
    let b = name.as_bytes();
    let mut best = name;
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_digit()) {
            let end = (i..b.len())
                .find(|&j| !b[j].is_ascii_digit())
                .unwrap_or(b.len());
            if let Ok(n) = name[i..end].parse::<usize>() {
                if n > 0 && end + n <= b.len() {
                    best = &name[end..end + n];
                    i = end + n;
                    continue;
                }
            }
        }
        i += 1;
    }
    best.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_follow_calls_and_callbacks() {
        let text = "\
Disassembly of section .text:

0000000000000000 <leaf>:
       0:\t7b 1a e0 ff 00 00 00 00\t*(u64 *)(r10 - 32) = r1
       1:\t95 00 00 00 00 00 00 00\texit

0000000000000010 <callback>:
       2:\t7b 1a f8 ff 00 00 00 00\t*(u64 *)(r10 - 0x8) = r1
       3:\t85 10 00 00 fc ff ff ff\tcall -4
       4:\t95 00 00 00 00 00 00 00\texit

Disassembly of section uprobe:

0000000000000000 <tracer_prog>:
       0:\t7b 1a d8 ff 00 00 00 00\t*(u64 *)(r10 - 40) = r1
       1:\t18 02 00 00 10 00 00 00 00 00 00 00 00 00 00 00\tr2 = 16 ll
\t\t0000000000000008:  R_BPF_64_64\t.text
       3:\t85 00 00 00 b5 00 00 00\tcall 181
       4:\t95 00 00 00 00 00 00 00\texit
";
        let fs = parse(text);
        assert_eq!(fs["tracer_prog"].frame, 40);
        assert!(fs["tracer_prog"].calls.contains("callback"));
        assert!(fs["callback"].calls.contains("leaf"));
        // 48 + 16 + 32.
        assert_eq!(depth(&fs, "tracer_prog", &mut HashMap::new()), 96);
        assert_eq!(
            path(&fs, "tracer_prog", &mut HashMap::new()),
            ["tracer_prog", "callback", "leaf"]
        );
    }

    #[test]
    fn rust_names_are_shortened_to_their_function() {
        assert_eq!(
            short("_RNvNtNtCslBJnx8TALSO_6tracer6python5stack3pop"),
            "pop"
        );
        assert_eq!(short("memset"), "memset");
    }
}
