//! What the kernel's verifier says of a program it loaded or refused: its own figures
//! (`BPF_LOG_STATS`: a few lines, so asked of every load) and, for a refusal, its last lines.

use std::fmt;

/// The verifier's limit on instructions processed per program (since Linux 5.2).
pub const INSN_LIMIT: u64 = 1_000_000;

/// `log_level` bits of `BPF_PROG_LOAD`.
pub(super) const LOG_LEVEL1: u32 = 1;
pub(super) const LOG_STATS: u32 = 4;

/// A stats log is three short lines, but the kernel (6.18 here) answers ENOSPC to a load
/// whose log buffer is a few KiB, as if more had been written: the size of the full log's
/// buffer, taken only while a program loads.
pub(super) const STATS_LOG_BYTES: usize = 1 << 20;

/// The verifier's figures for one program, from its stats lines.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    /// Instructions processed: the work, against [`INSN_LIMIT`].
    pub processed: u64,
    pub max_states_per_insn: u64,
    pub total_states: u64,
    pub peak_states: u64,
    /// Verification time, as the kernel measured it.
    pub time_us: u64,
    /// Each function's stack bytes as the verifier counted them, "64+160+32" (the program's,
    /// then its subprograms'; a call chain adds up those on it, as `cargo xtask frames` does).
    pub stack: String,
    /// Instructions loaded.
    pub insns: u64,
}

impl Figures {
    /// Reads the stats lines out of a verifier log (kernels print them at `BPF_LOG_STATS`
    /// on success and failure alike); `None` without a "processed" line.
    pub fn parse(log: &str, insns: usize) -> Option<Self> {
        let mut f = Figures {
            insns: insns as u64,
            ..Figures::default()
        };
        let mut seen = false;
        for line in log.trim_end_matches('\0').lines() {
            if let Some(rest) = line.strip_prefix("verification time ") {
                f.time_us = first_number(rest).unwrap_or(0);
            } else if let Some(rest) = line.strip_prefix("stack depth ") {
                f.stack = rest.trim().to_owned();
            } else if let Some(rest) = line.strip_prefix("processed ") {
                seen = true;
                f.processed = first_number(rest).unwrap_or(0);
                let mut words = rest.split_whitespace();
                while let Some(w) = words.next() {
                    let value = || words.clone().next().and_then(|v| v.parse().ok());
                    match w {
                        "max_states_per_insn" => f.max_states_per_insn = value().unwrap_or(0),
                        "total_states" => f.total_states = value().unwrap_or(0),
                        "peak_states" => f.peak_states = value().unwrap_or(0),
                        _ => {}
                    }
                }
            }
        }
        seen.then_some(f)
    }

    /// The share of the verifier's instruction limit used, in percent.
    pub fn share(&self) -> f64 {
        self.processed as f64 * 100.0 / INSN_LIMIT as f64
    }

    /// Whether the verifier gave up for the limit (rather than for what the code does).
    pub fn at_limit(&self) -> bool {
        self.processed > INSN_LIMIT
    }
}

impl fmt::Display for Figures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} processed ({:.1}% of the limit), {} states, {} at peak, {} µs, stack {}",
            self.processed,
            self.share(),
            self.total_states,
            self.peak_states,
            self.time_us,
            self.stack
        )
    }
}

fn first_number(s: &str) -> Option<u64> {
    s.split_whitespace().next()?.parse().ok()
}

/// What a verifier's log says of its refusal, for the error: the lines up to its
/// "processed N insns" summary (lines may follow it), else the log's last lines.
pub(super) fn refusal(log: &str) -> String {
    let lines: Vec<&str> = log
        .trim_end_matches('\0')
        .trim()
        .lines()
        .filter(|l| !l.starts_with("verification time ") && !l.starts_with("stack depth "))
        .collect();
    let end = lines
        .iter()
        .position(|l| l.starts_with("processed "))
        .map_or(lines.len(), |i| i + 1);
    let tail = &lines[end.saturating_sub(3)..end];
    if tail.is_empty() {
        String::new()
    } else {
        format!(" (verifier: {})", tail.join(" / "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_the_line_before_the_summary_even_with_lines_after_it() {
        let log = "0: (7b) r1 = 0\n1572: (61) r1 = *(u32 *)(r9 +60)\nR9 invalid mem access 'scalar'\nprocessed 10737 insns (limit 1000000)\n633: call bpf_map_lookup_elem#1\nfrom 633 to 634: safe\n\0\0";
        assert_eq!(
            refusal(log),
            " (verifier: 1572: (61) r1 = *(u32 *)(r9 +60) / R9 invalid mem access 'scalar' / processed 10737 insns (limit 1000000))"
        );
        assert_eq!(refusal("a\nb\nc\nd"), " (verifier: b / c / d)");
        assert_eq!(refusal("\0\0"), "");
    }

    #[test]
    fn stats_lines_are_read_and_left_out_of_a_refusal() {
        // As Linux 6.18 prints them at BPF_LOG_STATS.
        let log = "verification time 152340 usec\nstack depth 64+160+32+48\nprocessed 41251 insns (limit 1000000) max_states_per_insn 78 total_states 4125 peak_states 5057 mark_read 12\n\0";
        let f = Figures::parse(log, 1234).expect("a processed line");
        assert_eq!(
            f,
            Figures {
                processed: 41251,
                max_states_per_insn: 78,
                total_states: 4125,
                peak_states: 5057,
                time_us: 152340,
                stack: "64+160+32+48".into(),
                insns: 1234,
            }
        );
        assert!(!f.at_limit());
        assert!((f.share() - 4.1251).abs() < 1e-9);
        assert_eq!(
            refusal(log),
            " (verifier: processed 41251 insns (limit 1000000) max_states_per_insn 78 total_states 4125 peak_states 5057 mark_read 12)"
        );
        assert_eq!(Figures::parse("R1 invalid mem access\n", 1), None);
        let over = Figures::parse("processed 1000001 insns (limit 1000000)\n", 1).unwrap();
        assert!(over.at_limit());
    }
}
