//! The CUDA part of a report as a table: launches per kernel, configuration and Python call
//! site (PyProf's kernel table), then copies and allocations.

use std::fmt::Write as _;

use super::us;
use crate::{escape_controls as esc, group, rows_shown, CudaReport};

fn dims(d: [u32; 3]) -> String {
    format!("{}x{}x{}", d[0], d[1], d[2])
}

/// The CUDA section of the table: launches per kernel (PyProf's kernel table), each with its
/// Python call site and native caller under it, then copies and allocations.
pub fn table(out: &mut String, c: &CudaReport, limit: usize) {
    // Runtime launches reach the driver's entry points too: say each layer's count.
    let at = |driver: bool| -> u64 {
        c.launches
            .iter()
            .filter(|l| !l.api.contains("Graph") && l.api.starts_with("cuda") != driver)
            .map(|l| l.launches)
            .sum()
    };
    let graphs: u64 = c
        .launches
        .iter()
        .filter(|l| l.api.contains("Graph"))
        .map(|l| l.launches)
        .sum();
    let _ = writeln!(
        out,
        "\n CUDA launches: {} at the driver's entry points (cuLaunchKernel*), {} at the runtime's (cudaLaunchKernel*, which call the driver's), {} of graphs",
        group(at(true)),
        group(at(false)),
        group(graphs)
    );
    // GPU time per execution, where CUPTI measured the kernel with this configuration.
    let timed = c.launches.iter().any(|l| l.gpu_avg_ns.is_some());
    let gpu_col = |l: Option<&crate::CudaLaunch>| match (timed, l) {
        (false, _) => String::new(),
        (true, None) => format!(" {:>11}", "gpu µs avg"),
        (true, Some(l)) => format!(" {:>11}", l.gpu_avg_ns.map(us).unwrap_or_default()),
    };
    if !c.launches.is_empty() {
        let _ = writeln!(
            out,
            "\n{:>10}  {:<20} {:>12} {:>12} {:>7} {:>14} {:>8}{}  kernel  [← Python call site] [← native caller]",
            "launches", "api", "grid", "block", "smem", "stream", "pid", gpu_col(None)
        );
    }
    let shown = rows_shown(limit, c.launches.len());
    for l in &c.launches[..shown] {
        let _ = writeln!(
            out,
            "{:>10}  {:<20} {:>12} {:>12} {:>7} {:>14} {:>8}{}  {}",
            group(l.launches),
            esc(&l.api),
            dims(l.grid),
            dims(l.block),
            l.shared_mem,
            format!("{:#x}", l.stream),
            l.pid,
            gpu_col(Some(l)),
            esc(&l.kernel)
        );
        if l.named_from == "CUPTI" {
            let _ = writeln!(out, "{:>10}  (named by CUPTI)", "");
        } else if !l.named_from.is_empty() {
            let _ = writeln!(out, "{:>10}  (named from its {})", "", esc(&l.named_from));
        }
        if !l.call_site.is_empty() {
            let from = match l.call_site_from.as_str() {
                "" => String::new(),
                f => format!(" (launched by a thread running no Python: {})", esc(f)),
            };
            let _ = writeln!(out, "{:>10}  ← {}{from}", "", esc(&l.call_site));
        }
        if !l.caller.is_empty() {
            let _ = writeln!(out, "{:>10}  ← native: {}", "", esc(&l.caller));
        }
    }
    if shown < c.launches.len() {
        let _ = writeln!(
            out,
            "{:>10}  more rows (--limit 0 shows all)",
            c.launches.len() - shown
        );
    }
    if !c.memory.is_empty() {
        let _ = writeln!(
            out,
            "\n{:>10} {:>16}  {:<22} {:<22} {:>8}",
            "calls", "bytes", "api", "direction", "pid"
        );
        for m in &c.memory {
            let _ = writeln!(
                out,
                "{:>10} {:>16}  {:<22} {:<22} {:>8}",
                group(m.calls),
                group(m.bytes),
                esc(&m.api),
                esc(&m.direction),
                m.pid
            );
        }
    }
    for l in &c.libraries {
        let how = match l.found_by.as_str() {
            "mmap" => ", as it was mapped",
            "look" => ", by a periodic look (its mapping was not announced)",
            _ => "",
        };
        let _ = writeln!(
            out,
            " probed {} ({} entry points) in pid {}, {} ms after the start{how}",
            esc(&l.path),
            l.probes,
            l.pid,
            l.found_after_ms
        );
    }
    if c.unnamed > 0 {
        let _ = writeln!(
            out,
            " {} rows launch handles with no name: no naming call was seen (made before tracer probed the library) and no symbol names them, or not kernels",
            c.unnamed
        );
    }
    for l in &c.launch_counting {
        let way = match l.way.as_str() {
            "in-process" => "counted in-process",
            _ => "counted with probes",
        };
        let _ = writeln!(out, " launches in pid {}: {way}: {}", l.pid, esc(&l.why));
    }
    gpu_times(out, c, limit);
    match &c.gpu.unavailable {
        Some(why) => {
            let _ = writeln!(out, " GPU metrics: unavailable: {}", esc(why));
        }
        None => {
            for d in &c.gpu.devices {
                let _ = writeln!(
                    out,
                    "\n GPU {} ({}): {} readings every {} ms   min / mean / max",
                    d.index,
                    esc(&d.name),
                    d.samples,
                    c.gpu.period_ms
                );
                for m in &d.metrics {
                    let _ = writeln!(
                        out,
                        "{:>22}  {:>9.1} {:>9.1} {:>9.1} {}",
                        esc(&m.name),
                        m.min,
                        m.mean,
                        m.max,
                        esc(&m.unit)
                    );
                }
            }
        }
    }
    for w in &c.warnings {
        let _ = writeln!(out, " warning: {}", esc(w));
    }
}

/// Time in ms with µs decimals.
fn ms(ns: u64) -> String {
    format!("{}.{:03}", ns / 1_000_000, ns / 1000 % 1000)
}

/// GPU time per kernel (CUPTI), as Nsight Systems' kernel summary has it; or why there is none.
fn gpu_times(out: &mut String, c: &CudaReport, limit: usize) {
    if c.gpu_times.is_empty() {
        // Said plainly: launches are seen where the CPU makes them, not where the GPU runs them.
        let _ = writeln!(
            out,
            " GPU execution times: not measured: no followed process loaded tracer's CUPTI injection library (CUDA loads it when a program started with `tracerctl start --cuda --gpu-times -- CMD` initializes CUDA)"
        );
        return;
    }
    for g in &c.gpu_times {
        let _ = writeln!(
            out,
            " GPU kernel times in pid {}: {}",
            g.pid,
            esc(&g.status)
        );
    }
    let total: u64 = c.gpu_kernels.iter().map(|k| k.total_ns).sum();
    let executions: u64 = c.gpu_kernels.iter().map(|k| k.executions).sum();
    let _ = writeln!(
        out,
        "\n GPU kernel times (CUPTI): {} executions, {} ms of GPU time",
        group(executions),
        ms(total)
    );
    if c.gpu_kernels.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "{:>7} {:>12} {:>10} {:>11} {:>11} {:>11} {:>12} {:>12} {:>4} {:>8}  kernel",
        "time %", "total ms", "runs", "avg µs", "min µs", "max µs", "grid", "block", "gpu", "pid"
    );
    let shown = rows_shown(limit, c.gpu_kernels.len());
    for k in &c.gpu_kernels[..shown] {
        let _ = writeln!(
            out,
            "{:>7.1} {:>12} {:>10} {:>11} {:>11} {:>11} {:>12} {:>12} {:>4} {:>8}  {}",
            100.0 * k.total_ns as f64 / total.max(1) as f64,
            ms(k.total_ns),
            group(k.executions),
            us(k.total_ns / k.executions.max(1)),
            us(k.min_ns),
            us(k.max_ns),
            dims(k.grid),
            dims(k.block),
            k.device,
            k.pid,
            esc(&k.kernel)
        );
    }
    if shown < c.gpu_kernels.len() {
        let _ = writeln!(
            out,
            "{:>7}  {} more kernels (--limit 0 shows all)",
            "",
            c.gpu_kernels.len() - shown
        );
    }
}
