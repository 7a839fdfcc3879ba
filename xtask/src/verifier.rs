//! `cargo xtask verifier`: every BPF program loaded on the running kernel, with the
//! verifier's own figures (from `tracerd --check-programs`) and its deepest stack (from
//! `frames`), against budgets well inside the kernel's limits. A program whose verification
//! goes from accepted to refused between two machines of one kind had no margin: the
//! verifier's work differs from kernel to kernel and toolchain to toolchain.

use std::process::Command;

use anyhow::{bail, Context, Result};

/// A quarter of the verifier's 1,000,000 processed instructions.
pub const INSN_BUDGET: u64 = 250_000;
/// Of the verifier's 512 stack bytes a call chain.
pub const STACK_BUDGET: u64 = 448;

/// One program as `tracerd --check-programs` printed it.
#[derive(Debug, PartialEq)]
pub struct Row {
    pub program: String,
    /// None: the kernel printed no figures.
    pub processed: Option<u64>,
    pub states: Option<u64>,
    pub peak_states: Option<u64>,
    pub time_us: Option<u64>,
    pub refused: Option<String>,
}

/// Parses `tracerd --check-programs`' output.
pub fn parse(out: &str) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    for line in out.lines().filter(|l| !l.starts_with('#')) {
        if let Some(rest) = line.strip_prefix("refused ") {
            if let Some((name, why)) = rest.split_once(": ") {
                if let Some(row) = rows.iter_mut().find(|r| r.program == name) {
                    row.refused = Some(why.to_owned());
                }
            }
            continue;
        }
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() < 7 {
            continue;
        }
        let n = |i: usize| w[i].parse::<u64>().ok();
        rows.push(Row {
            program: w[0].to_owned(),
            processed: n(1),
            states: n(3),
            peak_states: n(4),
            time_us: n(5),
            refused: None,
        });
    }
    rows
}

/// Runs the check on this kernel, prints the table and fails over a budget.
pub fn check() -> Result<()> {
    let tracerd = crate::bin_dir().join("tracerd");
    let out = Command::new(&tracerd)
        .arg("--check-programs")
        .output()
        .with_context(|| format!("running {} --check-programs", tracerd.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rows = parse(&text);
    if rows.is_empty() {
        bail!(
            "tracerd --check-programs printed no program: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let chains = crate::frames::chains()?;
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!(
        "BPF programs on Linux {}: budgets {INSN_BUDGET} processed instructions (25% of the verifier's limit), {STACK_BUDGET} stack bytes a chain",
        release.trim()
    );
    println!(
        "{:<26} {:>10} {:>7} {:>8} {:>8} {:>9} {:>6}",
        "program", "processed", "share", "states", "peak", "time ms", "stack"
    );
    let mut over = Vec::new();
    for r in &rows {
        let stack = chains
            .iter()
            .find(|c| c.program == r.program)
            .map(|c| c.bytes);
        let opt = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
        println!(
            "{:<26} {:>10} {:>6.1}% {:>8} {:>8} {:>9} {:>6}",
            r.program,
            opt(r.processed),
            r.processed.unwrap_or(0) as f64 / 10_000.0,
            opt(r.states),
            opt(r.peak_states),
            r.time_us
                .map_or_else(|| "-".to_owned(), |t| format!("{:.1}", t as f64 / 1000.0)),
            opt(stack),
        );
        if let Some(why) = &r.refused {
            over.push(format!("{} is refused: {why}", r.program));
        } else if r.processed.is_some_and(|p| p > INSN_BUDGET) {
            over.push(format!(
                "{} takes {} processed instructions (budget {INSN_BUDGET})",
                r.program,
                r.processed.unwrap_or(0)
            ));
        }
        if let Some(bytes) = stack.filter(|&b| b > STACK_BUDGET) {
            over.push(format!(
                "{}'s deepest chain is {bytes} stack bytes (budget {STACK_BUDGET})",
                r.program
            ));
        }
    }
    if !out.status.success() && over.is_empty() {
        over.push(format!(
            "tracerd --check-programs failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    if !over.is_empty() {
        bail!("over the verifier budget: {}", over.join("; "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_programs_output_is_read_with_its_refusals() {
        let out = "# 1000000 processed instructions at most; kernel 6.18.0\n\
                   # program processed share states peak_states time_us stack\n\
                   tracer_sample 1000001 100.00% 41251 50574 15000000 64+32\n\
                   refused tracer_sample: loading tracer_sample: Argument list too long (os error 7)\n\
                   tracer_task_newtask 31 0.00% 2 2 20 0\n\
                   tracer_old - - - - - -\n";
        let rows = parse(out);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].program, "tracer_sample");
        assert_eq!(rows[0].processed, Some(1_000_001));
        assert_eq!(rows[0].peak_states, Some(50_574));
        assert!(rows[0].refused.as_deref().unwrap().contains("too long"));
        assert_eq!(rows[1].time_us, Some(20));
        assert_eq!(rows[1].refused, None);
        assert_eq!(rows[2].processed, None);
    }
}
