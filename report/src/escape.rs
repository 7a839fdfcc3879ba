//! Names made safe for a terminal. A traced process chooses its Python qualnames and file
//! names, its `comm`, its symbols and CUDA kernel names, its container's hostname: printed
//! raw, a name holding `ESC [2J` would clear the screen of whoever reads the table, or
//! forge lines of it. Text renderers pass every such string through [`escape_controls`] where
//! they format it; machine formats (JSON, pprof, folded, speedscope, Chrome, Perfetto, SVG)
//! keep names as data.

use std::{borrow::Cow, fmt::Write as _};

/// `name` with each control character written as a visible escape: `\n`, `\r`, `\t`;
/// `\xNN` for the rest of C0 (0x00-0x1f) and DEL; `\u{NN}` for C1 (U+0080-U+009F), which
/// UTF-8 spells in two bytes, so `\x9b` would misname it as one; and `\u{NNNN}` for the
/// formatting characters that reorder or break what a terminal shows ([`reorders`]): a
/// name holding U+202E would print its tail, and the columns after it, right to left.
///
/// A backslash is doubled only where what follows it would otherwise read as one of these
/// escapes (`\\`, `x`, `u`, `n`, `r`, `t`, or an escaped control), so that a name spelling
/// `\x1b` itself cannot pass for one holding ESC, while a path like `a\b` reads as it is.
/// Borrows `name` when nothing needs escaping.
pub fn escape_controls(name: &str) -> Cow<'_, str> {
    if !name
        .chars()
        .any(|c| c.is_control() || reorders(c) || c == '\\')
    {
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
                let ambiguous = next.is_some_and(|n| {
                    n.is_control() || reorders(n) || matches!(n, '\\' | 'x' | 'u' | 'n' | 'r' | 't')
                });
                out.push_str(if ambiguous { "\\\\" } else { "\\" });
            }
            // `char::is_control` is exactly C0, DEL and C1 (general category Cc).
            c if c.is_control() && c.is_ascii() => {
                let _ = write!(out, "\\x{:02x}", u32::from(c));
            }
            c if c.is_control() || reorders(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Bidirectional formatting characters (embeddings, overrides, isolates, marks) and the
/// line and paragraph separators: invisible, they move or split the text around them.
pub fn reorders(c: char) -> bool {
    matches!(
        c,
        '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
            | '\u{2028}' | '\u{2029}'
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
            escape_controls("\u{2010}\u{2030}\u{2065}"),
            "\u{2010}\u{2030}\u{2065}"
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
}
