//! Names made safe for a terminal. A traced process chooses its Python qualnames and file
//! names, its `comm`, its symbols and CUDA kernel names, its container's hostname: printed
//! raw, a name holding `ESC [2J` would clear the screen of whoever reads the table, or
//! forge lines of it, one holding U+202E would print right to left, and one holding a
//! zero-width space or a soft hyphen would look like another name it is not. Text
//! renderers pass every such string through [`escape_controls`] where they format it;
//! machine formats (JSON, pprof, folded, speedscope, Chrome, Perfetto, SVG) keep names as
//! data.

use std::{borrow::Cow, fmt::Write as _};

use unicode_general_category::{get_general_category, GeneralCategory};

/// `name` with each control or invisible character written as a visible escape: `\n`, `\r`,
/// `\t`; `\xNN` for the rest of C0 (0x00-0x1f) and DEL; `\u{NN}` for C1 (U+0080-U+009F),
/// which UTF-8 spells in two bytes, so `\x9b` would misname it as one; and `\u{NNNN}` for
/// the characters a terminal shows as nothing, or as something else (`invisible`): every
/// format character, so U+202E cannot print a name's tail (and the columns after it) right
/// to left, nor U+200B or U+00AD make two names look alike; every unassigned code point and
/// noncharacter, which a terminal may draw as anything; and the line and paragraph
/// separators.
///
/// A backslash is doubled only where what follows it would otherwise read as one of these
/// escapes (`\\`, `x`, `u`, `n`, `r`, `t`, or an escaped character), so that a name spelling
/// `\x1b` itself cannot pass for one holding ESC, while a path like `a\b` reads as it is.
/// Borrows `name` when nothing needs escaping.
pub fn escape_controls(name: &str) -> Cow<'_, str> {
    if !name.chars().any(|c| escaped(c) || c == '\\') {
        return Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len() + 8);
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' => {
                let next = chars.peek().copied();
                let ambiguous = next
                    .is_some_and(|n| escaped(n) || matches!(n, '\\' | 'x' | 'u' | 'n' | 'r' | 't'));
                out.push_str(if ambiguous { "\\\\" } else { "\\" });
            }
            // C0 and DEL, one byte each; C1 takes `\u` below.
            c if c.is_ascii_control() => {
                let _ = write!(out, "\\x{:02x}", u32::from(c));
            }
            c if escaped(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Whether `c` is written as an escape (a backslash, doubled or not, is the caller's).
fn escaped(c: char) -> bool {
    // Printable ASCII, which most names are made of, needs no table.
    if c.is_ascii() {
        return c.is_ascii_control();
    }
    c.is_control() || invisible(c)
}

/// Characters that are not shown as themselves: the format characters (general category
/// Cf: bidirectional embeddings, overrides, isolates and marks; zero-width spaces and
/// joiners; the soft hyphen; tags), the unassigned code points (Cn, noncharacters such as
/// U+FFFE and U+FDD0 included: a terminal draws them as anything, and a later Unicode may
/// make them invisible too), and the line and paragraph separators (Zl, Zp), which split a
/// line. Categories are those of Unicode 16.0 (`unicode-general-category`'s tables), so a
/// character assigned later is escaped until they catch up. Private-use characters (Co)
/// stay as they are: assigned, they are drawn with a font's glyph or a box. Surrogates
/// cannot occur in a `str`.
pub fn invisible(c: char) -> bool {
    matches!(
        get_general_category(c),
        GeneralCategory::Format
            | GeneralCategory::Unassigned
            | GeneralCategory::LineSeparator
            | GeneralCategory::ParagraphSeparator
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_are_borrowed() {
        for name in [
            "fib",
            "Outer.<locals>.inner",
            "/usr/lib/python3.11/x.py",
            "ünïcødé",
        ] {
            assert!(matches!(escape_controls(name), Cow::Borrowed(n) if n == name));
        }
    }

    #[test]
    fn controls_become_visible_escapes() {
        assert_eq!(escape_controls("evil\x1b[2Jname"), "evil\\x1b[2Jname");
        assert_eq!(escape_controls("a\nb\rc\td"), "a\\nb\\rc\\td");
        assert_eq!(escape_controls("\0\x07\x1f\x7f"), "\\x00\\x07\\x1f\\x7f");
        assert_eq!(escape_controls("csi\u{9b}31m"), "csi\\u{9b}31m");
        assert_eq!(escape_controls("\u{80}\u{9f}"), "\\u{80}\\u{9f}");
        // Printable characters just past either range stay as they are.
        assert_eq!(escape_controls(" ~\u{a0}é"), " ~\u{a0}é");
        let escaped = escape_controls("x\x1b\n\u{9b}\x7fy");
        assert!(!escaped.chars().any(char::is_control), "{escaped:?}");
    }

    #[test]
    fn characters_that_reorder_text_become_visible_escapes() {
        // "Trojan Source": an override that would print `gpj.exe` as `exe.jpg`.
        assert_eq!(
            escape_controls("evil\u{202e}gpj.exe"),
            "evil\\u{202e}gpj.exe"
        );
        assert_eq!(
            escape_controls("\u{2066}a\u{2069}\u{200f}\u{61c}\u{2028}"),
            "\\u{2066}a\\u{2069}\\u{200f}\\u{61c}\\u{2028}"
        );
        assert_eq!(escape_controls("\\u{202e}"), "\\\\u{202e}");
        // Neighbours that only look alike stay as they are.
        assert_eq!(
            escape_controls("\u{2010}\u{2030}\u{2070}"),
            "\u{2010}\u{2030}\u{2070}"
        );
        assert_eq!(unescape(&escape_controls("a\\\u{202e}b")), "a\\\u{202e}b");
    }

    #[test]
    fn backslashes_are_doubled_only_where_they_would_read_as_an_escape() {
        assert_eq!(escape_controls("a\\b"), "a\\b");
        assert_eq!(escape_controls("dir\\"), "dir\\");
        // Spelled out, not ESC: must not read as the escape of one.
        assert_eq!(escape_controls("\\x1b"), "\\\\x1b");
        assert_eq!(escape_controls("\\u{9b}"), "\\\\u{9b}");
        assert_eq!(escape_controls("\\n\\t\\r"), "\\\\n\\\\t\\\\r");
        assert_eq!(escape_controls("\\\\"), "\\\\\\");
        // A backslash before a real control, which is escaped with one of its own.
        assert_eq!(escape_controls("\\\x1b"), "\\\\\\x1b");
        assert_eq!(
            unescape(&escape_controls("\\\x1b\\x1b\\\\n\\")),
            "\\\x1b\\x1b\\\\n\\"
        );
    }

    /// The inverse, to show no two names share an escaped form.
    fn unescape(s: &str) -> String {
        let mut out = String::new();
        let mut chars = s.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            match chars.peek().copied() {
                Some('\\') => {
                    chars.next();
                    out.push('\\');
                }
                Some('n') => {
                    chars.next();
                    out.push('\n');
                }
                Some('r') => {
                    chars.next();
                    out.push('\r');
                }
                Some('t') => {
                    chars.next();
                    out.push('\t');
                }
                Some('x') => {
                    chars.next();
                    let hex: String = chars.by_ref().take(2).collect();
                    out.push(char::from(u8::from_str_radix(&hex, 16).unwrap()));
                }
                Some('u') => {
                    chars.next();
                    let hex: String = chars.by_ref().skip(1).take_while(|&c| c != '}').collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).unwrap()).unwrap());
                }
                _ => out.push('\\'),
            }
        }
        out
    }

    #[test]
    fn escaping_round_trips() {
        for name in [
            "evil\x1b[2Jname",
            "a\\b\\",
            "\\x1b\x1b",
            "\\\\\\n\n",
            "\\u{9b}\u{9b}",
            "\\\t",
            "\\",
            "",
        ] {
            assert_eq!(unescape(&escape_controls(name)), name, "{name:?}");
        }
    }

    #[test]
    fn invisible_characters_become_visible_escapes() {
        // Zero-width space and soft hyphen: `fib` and `f\u{200b}ib` would look alike.
        assert_eq!(escape_controls("f\u{200b}ib"), "f\\u{200b}ib");
        assert_eq!(escape_controls("re\u{ad}ad"), "re\\u{ad}ad");
        assert_eq!(
            escape_controls("\u{200c}\u{200d}\u{2060}\u{feff}\u{e0041}"),
            "\\u{200c}\\u{200d}\\u{2060}\\u{feff}\\u{e0041}"
        );
        // Unassigned code points and noncharacters.
        assert_eq!(
            escape_controls("\u{378}\u{2065}\u{fdd0}\u{fdef}\u{fffe}\u{ffff}"),
            "\\u{378}\\u{2065}\\u{fdd0}\\u{fdef}\\u{fffe}\\u{ffff}"
        );
        assert_eq!(
            escape_controls("\u{1fffe}\u{e01f0}\u{10ffff}"),
            "\\u{1fffe}\\u{e01f0}\\u{10ffff}"
        );
        // A backslash before one is doubled, as before any escaped character.
        assert_eq!(escape_controls("a\\\u{200b}"), "a\\\\\\u{200b}");
        assert_eq!(
            unescape(&escape_controls("a\\\u{200b}\\u{ad}")),
            "a\\\u{200b}\\u{ad}"
        );
    }

    #[test]
    fn visible_text_in_any_script_is_borrowed() {
        for name in [
            "función",
            // Decomposed: combining acute accents (Mn).
            "e\u{301}te\u{301}",
            // Devanagari: a virama (Mn) and vowel signs (Mc).
            "नमस्ते",
            "関数_計算",
            "한글",
            // Arabic letters print right to left, but hold no control.
            "دالة",
            "🦀rust🐍",
            // An emoji with its variation selector (Mn), and with a skin tone (Sk).
            "\u{2764}\u{fe0f}\u{1f44d}\u{1f3fd}",
            // Private use.
            "\u{e000}\u{f8ff}\u{f0000}",
            // Spaces that show as spaces (Zs).
            "a\u{a0}b\u{3000}c",
            // CJK Extension H, Unicode 15.0: newer than some tables.
            "\u{31350}",
        ] {
            assert!(
                matches!(escape_controls(name), Cow::Borrowed(n) if n == name),
                "{name:?}"
            );
        }
    }

    /// Code points whose general category is `category` (two letters) by Python's
    /// `unicodedata`, surrogates left out, with its Unicode version: an independent table to
    /// check ours against. The interpreter is `python3`, or `TRACER_TEST_PYTHON` (one with
    /// Unicode 16.0 or newer checks the unassigned code points in full). None, with the
    /// reason printed, where there is none.
    fn python_category(category: &str) -> Option<((u64, u64, u64), Vec<char>)> {
        let python = std::env::var("TRACER_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let script = "import sys, unicodedata as u\n\
                      print(u.unidata_version)\n\
                      print(' '.join('%x' % c for c in range(0x110000)\n\
                      \x20   if not 0xd800 <= c < 0xe000 and u.category(chr(c)) == sys.argv[1]))";
        let output = match std::process::Command::new(&python)
            .args(["-c", script, category])
            .output()
        {
            Ok(output) if output.status.success() => output,
            Ok(output) => {
                let stderr = String::from_utf8_lossy(&output.stderr);
                println!("skipped: {python} failed ({}): {stderr}", output.status);
                return None;
            }
            Err(e) => {
                println!("skipped: no {python} to list Unicode categories: {e}");
                return None;
            }
        };
        let stdout = String::from_utf8(output.stdout).unwrap();
        let (version, code_points) = stdout.split_once('\n').unwrap();
        let mut parts = version.split('.').map(|p| p.parse::<u64>().unwrap());
        let version = (
            parts.next().unwrap(),
            parts.next().unwrap(),
            parts.next().unwrap(),
        );
        let chars: Vec<char> = code_points
            .split_whitespace()
            .map(|h| char::from_u32(u32::from_str_radix(h, 16).unwrap()).unwrap())
            .collect();
        println!("{python}: Unicode {version:?}, {} {category}", chars.len());
        assert!(!chars.is_empty(), "{python} lists no {category}");
        Some((version, chars))
    }

    /// The `c` of `chars` that `escape_controls` does not write as `\u{hex}`, alone, inside
    /// a name, and after a backslash (doubled, as before any escape).
    fn not_escaped(chars: &[char]) -> Vec<String> {
        chars
            .iter()
            .filter(|&&c| {
                let hex = format!("{:x}", u32::from(c));
                escape_controls(&c.to_string()) != format!("\\u{{{hex}}}")
                    || escape_controls(&format!("fn{c}ame")) != format!("fn\\u{{{hex}}}ame")
                    || escape_controls(&format!("a\\{c}")) != format!("a\\\\\\u{{{hex}}}")
            })
            .map(|&c| format!("U+{:04X}", u32::from(c)))
            .collect()
    }

    #[test]
    fn every_format_character_is_escaped() {
        // Format characters keep their category from one Unicode to the next, and one that
        // is new since ours is still unassigned in ours: any version's list must pass.
        let Some((_, cf)) = python_category("Cf") else {
            return;
        };
        let missed = not_escaped(&cf);
        assert!(
            missed.is_empty(),
            "{} not escaped: {:?}",
            missed.len(),
            &missed[..missed.len().min(20)]
        );
    }

    #[test]
    fn every_unassigned_code_point_is_escaped() {
        let Some((version, cn)) = python_category("Cn") else {
            return;
        };
        let ours = unicode_general_category::UNICODE_VERSION;
        let missed = not_escaped(&cn);
        if version >= ours {
            // Code points, once assigned, stay so: all unassigned in a newer Unicode are
            // unassigned in ours.
            assert!(
                missed.is_empty(),
                "{} not escaped: {:?}",
                missed.len(),
                &missed[..missed.len().min(20)]
            );
        } else {
            // An older Python's list holds the code points assigned since; all it can tell
            // is that those are the only ones ours does not escape.
            let assigned_since = cn.iter().filter(|&&c| !invisible(c)).count();
            assert_eq!(
                missed.len(),
                assigned_since,
                "not escaped: {:?}",
                &missed[..missed.len().min(20)]
            );
            println!(
                "{assigned_since} of them assigned after Unicode {version:?} not checked \
                 (ours is {ours:?}; set TRACER_TEST_PYTHON to a newer interpreter)"
            );
        }
    }
}
