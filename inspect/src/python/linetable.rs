//! Instruction offset -> source line, from a code object's `co_linetable`.
//!
//! Two formats, as CPython documents them:
//! - 3.10 (`Objects/lnotab_notes.txt`): (start delta: u8, line delta: i8) pairs, each
//!   covering `start delta` bytes; a line delta of -128 marks a range with no line and
//!   leaves the running line unchanged.
//! - 3.11+ (`Objects/locations.md`): entries of a head byte `1 code:4 (length-1):3`, length
//!   in 2-byte code units, then code-specific bytes; the start line is a delta from the
//!   previous entry's (first: `co_firstlineno`). Only the line is decoded; columns are skipped.

/// `table`: the bytes of co_linetable (3.10: the 3.10 "linetable" format of (byte-delta,
/// line-delta) pairs; 3.11+: the location-table format of Objects/locations.md).
/// `byte_offset`: the instruction's offset in bytes in co_code (3.10: 2*f_lasti; 3.11+:
/// 2*code units from the first instruction). Returns None when the instruction has no
/// line (or lies past the table, or the version is not one of these formats).
pub fn line_for(minor: u32, table: &[u8], firstlineno: u32, byte_offset: u32) -> Option<u32> {
    let line = match minor {
        10 => line_310(table, i64::from(firstlineno), u64::from(byte_offset))?,
        11.. => line_311(table, i64::from(firstlineno), u64::from(byte_offset / 2))?,
        _ => return None,
    };
    u32::try_from(line).ok()
}

fn line_310(table: &[u8], mut line: i64, offset: u64) -> Option<i64> {
    let mut end = 0u64;
    for pair in table.chunks_exact(2) {
        let (start_delta, line_delta) = (pair[0], pair[1] as i8);
        // 255 never occurs as a delta (they are split at 254); it marks the end.
        if start_delta == 255 {
            break;
        }
        let start = end;
        end += u64::from(start_delta);
        let has_line = line_delta != -128;
        if has_line {
            line += i64::from(line_delta);
        }
        if (start..end).contains(&offset) {
            return has_line.then_some(line);
        }
    }
    None
}

fn line_311(table: &[u8], mut line: i64, unit: u64) -> Option<i64> {
    let mut bytes = table.iter().copied();
    let mut start = 0u64;
    while let Some(head) = bytes.next() {
        if head & 0x80 == 0 {
            return None; // not at an entry head: malformed (or we misparsed)
        }
        let code = (head >> 3) & 0xf;
        let length = u64::from(head & 7) + 1;
        let has_line = match code {
            // Short forms: same line; one byte of column data.
            0..=9 => skip(&mut bytes, 1),
            // One-line forms: the line delta is in the code; two column bytes.
            10..=12 => {
                line += i64::from(code - 10);
                skip(&mut bytes, 2)
            }
            // No columns: just a signed line delta.
            13 => {
                line += svarint(&mut bytes)?;
                true
            }
            // Long form: line delta, then end-line delta, start and end columns.
            14 => {
                line += svarint(&mut bytes)?;
                (0..3).all(|_| varint(&mut bytes).is_some())
            }
            // No location: the running line is not changed.
            _ => false,
        };
        if (start..start + length).contains(&unit) {
            return has_line.then_some(line);
        }
        start += length;
    }
    None
}

/// Skips `n` bytes; false when the table ends first.
fn skip(bytes: &mut impl Iterator<Item = u8>, n: usize) -> bool {
    bytes.nth(n - 1).is_some()
}

/// Unsigned varint: 6-bit chunks, least significant first, bit 6 set on all but the last.
fn varint(bytes: &mut impl Iterator<Item = u8>) -> Option<u64> {
    let (mut value, mut shift) = (0u64, 0u32);
    loop {
        let b = bytes.next()?;
        value |= u64::from(b & 0x3f).checked_shl(shift)?;
        if b & 0x40 == 0 {
            return Some(value);
        }
        shift += 6;
    }
}

/// Signed varint: the magnitude shifted left by one, the sign in bit 0.
fn svarint(bytes: &mut impl Iterator<Item = u8>) -> Option<i64> {
    let v = varint(bytes)?;
    let magnitude = i64::try_from(v >> 1).ok()?;
    Some(if v & 1 == 1 { -magnitude } else { magnitude })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::process::Command;

    #[test]
    fn varints_from_the_docs() {
        // locations.md: 63 is `0x3f`, 200 is `0x48 0x03`.
        assert_eq!(varint(&mut [0x3f].into_iter()), Some(63));
        assert_eq!(varint(&mut [0x48, 0x03].into_iter()), Some(200));
        assert_eq!(svarint(&mut [(5 << 1) | 1].into_iter()), Some(-5));
        assert_eq!(svarint(&mut [5 << 1].into_iter()), Some(5));
        assert_eq!(varint(&mut [0x48].into_iter()), None);
    }

    #[test]
    fn table_310_from_the_docs() {
        // The worked example of lnotab_notes.txt (3.10), with first line 1 rather than 0:
        // [0,6) +1, [6,50) +1, [50,350) +5, [350,360) none, [360,376) +1, [376,380) +200.
        let table: &[u8] = &[
            6, 1, 44, 1, 254, 5, 46, 0, 10, 0x80, 16, 1, 0, 127, 4, 73, 255, 0,
        ];
        let at = |off| line_for(10, table, 0, off);
        assert_eq!(at(0), Some(1));
        assert_eq!(at(48), Some(2));
        assert_eq!(at(50), Some(7));
        assert_eq!(at(348), Some(7));
        assert_eq!(at(350), None);
        assert_eq!(at(360), Some(8));
        assert_eq!(at(378), Some(208));
        assert_eq!(at(380), None);
    }

    #[test]
    fn table_311_hand_made() {
        let table: &[u8] = &[
            0x80 | (13 << 3) | 1,
            4, // 2 units, no columns, line +2
            0x80 | (11 << 3),
            0,
            4,                    // 1 unit, one-line form, line +1
            0x80 | (15 << 3) | 2, // 3 units, no location
            0x80 | (3 << 3),
            0x12, // 1 unit, short form, same line
            0x80 | (14 << 3),
            0x47,
            0x01,
            2,
            3,
            4, // 1 unit, long form, line -35
        ];
        let at = |unit: u32| line_for(12, table, 40, 2 * unit);
        assert_eq!([at(0), at(1), at(2)], [Some(42), Some(42), Some(43)]);
        assert_eq!([at(3), at(5)], [None, None]);
        assert_eq!(at(6), Some(43));
        assert_eq!(at(7), Some(8));
        assert_eq!(at(8), None);
        assert_eq!(line_for(9, table, 40, 0), None);
    }

    /// Source with the shapes that stress the tables: loops, multi-line expressions,
    /// try/except, comprehensions, decorators, blank lines, long gaps and long lines.
    fn source() -> String {
        let mut src = String::from(SAMPLE);
        // A jump of more than 127 lines forwards and then back (line deltas split or
        // negative), and one line whose bytecode spans more than 254 bytes.
        src += "\n\ndef far(n):\n    a = (n,\n";
        src += &"\n".repeat(300);
        src += "    )\n    return a\n\n\ndef wide(n):\n    return [";
        src += &"n, ".repeat(300);
        src += "]\n";
        src
    }

    const SAMPLE: &str = r#"import functools


def deco(f):
    @functools.wraps(f)
    def inner(*a, **k):
        return f(*a, **k)
    return inner


@deco
def loops(n):
    total = 0
    for i in range(n):

        if i % 3 == 0:
            continue
        while total < i:
            total += 1
    else:
        total -= 1
    return total


def multiline(a, b):
    value = (a +
             b *
             2)
    call = max(
        a,

        b,
    )
    return [x * y
            for x in range(a)
            for y in range(b) if x != y], {k: v for k, v in zip("ab", (value, call))}


def handlers(x):
    try:
        y = 1 / x
    except ZeroDivisionError as e:
        y = None
    except (TypeError,
            ValueError):
        raise
    else:
        y = y + 1
    finally:
        x = 0
    with open("/dev/null") as f:
        f.read()
    return y


class Thing:
    attr = [i for i in range(3)]

    @property
    def prop(self):
        return lambda q: (q,
                          self)

    async def coro(self):
        async for item in self:
            await item
        return f"{self!r:>10} {self.attr}"

    def gen(self):
        yield from (i for i in range(10) if i)
"#;

    /// For each code object (recursively): first line, table, and the line (-1 for none)
    /// of every instruction, from the interpreter itself.
    const DUMP: &str = r#"
import sys, types
todo = [compile(sys.stdin.read(), "<linetable-test>", "exec")]
while todo:
    co = todo.pop()
    print("code", co.co_firstlineno, co.co_linetable.hex() or "-")
    if sys.version_info < (3, 11):
        for start, end, line in co.co_lines():
            for off in range(start, end, 2):
                print("at", off, -1 if line is None else line)
    else:
        for unit, pos in enumerate(co.co_positions()):
            print("at", 2 * unit, -1 if pos[0] is None else pos[0])
    todo.extend(c for c in co.co_consts if isinstance(c, types.CodeType))
"#;

    /// The interpreter for 3.`minor`, from pyenv: `pyenv prefix`, else its versions folder.
    fn python(minor: u32) -> Option<PathBuf> {
        let want = format!("3.{minor}");
        let from_pyenv = Command::new("pyenv")
            .args(["prefix", &want])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
        let roots = [
            std::env::var_os("PYENV_ROOT").map(PathBuf::from),
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")),
        ];
        let from_dirs = roots.into_iter().flatten().find_map(|root| {
            let entries = std::fs::read_dir(root.join("versions")).ok()?;
            entries.flatten().map(|e| e.path()).find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{want}.")))
            })
        });
        from_pyenv
            .into_iter()
            .chain(from_dirs)
            .map(|prefix| prefix.join("bin/python3"))
            .find(|p| p.exists())
    }

    fn run(python: &PathBuf, src: &str) -> String {
        use std::io::Write;
        let mut child = Command::new(python)
            .args(["-c", DUMP])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start python");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(src.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{} failed", python.display());
        String::from_utf8(out.stdout).unwrap()
    }

    fn hex(s: &str) -> Vec<u8> {
        if s == "-" {
            return Vec::new();
        }
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn agrees_with_real_interpreters() {
        let src = source();
        for minor in [10, 11, 12, 13] {
            let Some(python) = python(minor) else {
                tracer_testkit::skip(format_args!("python 3.{minor} not installed under pyenv"));
                continue;
            };
            let (mut codes, mut checked, mut lineless) = (0, 0, 0);
            let (mut table, mut first) = (Vec::new(), 0);
            for line in run(&python, &src).lines() {
                let words: Vec<&str> = line.split_whitespace().collect();
                match words[..] {
                    ["code", firstlineno, hex_table] => {
                        (first, table) = (firstlineno.parse().unwrap(), hex(hex_table));
                        codes += 1;
                    }
                    ["at", offset, expected] => {
                        let offset: u32 = offset.parse().unwrap();
                        let expected = u32::try_from(expected.parse::<i64>().unwrap()).ok();
                        let got = line_for(minor, &table, first, offset);
                        assert_eq!(
                            got, expected,
                            "3.{minor}: offset {offset}, firstlineno {first}"
                        );
                        checked += 1;
                        lineless += usize::from(expected.is_none());
                    }
                    _ => panic!("unexpected output line {line:?}"),
                }
            }
            println!("3.{minor}: {codes} code objects, {checked} instructions ({lineless} without a line) agree");
            assert!(
                codes >= 10 && checked > 500,
                "3.{minor}: too little ground truth"
            );
        }
    }
}
