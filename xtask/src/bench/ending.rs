//! `cargo xtask bench ending`: what a session's end costs other clients. A Python program
//! with N generated functions (1,000 to 150,000) is counted with uprobes for 3 s; then, while
//! `tracerctl stop` waits for the session to end (its functions named, its report stored),
//! `tracerctl list` is sent over and over. Printed side by side: the slowest list then, and
//! the slowest of as many lists sent while the session simply ran.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};

use super::probes::Daemon;

const SIZES: [usize; 3] = [1_000, 20_000, 150_000];

pub fn run() -> Result<()> {
    println!("counting a Python program's calls with uprobes, then stopping; times in ms");
    println!(
        "{:>10} {:>9} {:>22} {:>26}",
        "functions", "end", "slowest list (ending)", "slowest list (running)"
    );
    for n in SIZES {
        let row = measure(n)?;
        println!(
            "{n:>10} {:>9.0} {:>22.0} {:>26.0}",
            ms(row.end),
            ms(row.ending),
            ms(row.running)
        );
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

struct Row {
    end: Duration,
    ending: Duration,
    running: Duration,
}

fn measure(functions: usize) -> Result<Row> {
    let dir = tempfile::tempdir()?;
    let daemon = Daemon::start(dir.path(), &[])?;
    let program = Program::start(functions)?;
    let pid = program.0.id().to_string();
    let id = daemon.ctl(&[
        "start",
        "--mode=counting",
        "--pid",
        &pid,
        "--python",
        "--python-uprobes-only",
    ])?;
    std::thread::sleep(Duration::from_secs(3));

    let t = Instant::now();
    let mut stop = daemon
        .ctl_command(&["stop", id.trim()])
        .stdout(Stdio::null())
        .spawn()?;
    let (mut ending, mut lists) = (Duration::ZERO, 0);
    while stop.try_wait()?.is_none() {
        let l = Instant::now();
        daemon.ctl(&["list"])?;
        ending = ending.max(l.elapsed());
        lists += 1;
    }
    let end = t.elapsed();
    ensure!(stop.wait()?.success(), "tracerctl stop failed");

    // As many lists with a session that only runs.
    daemon.ctl(&[
        "start",
        "--mode=counting",
        "--pid",
        &pid,
        "--python",
        "--python-uprobes-only",
    ])?;
    std::thread::sleep(Duration::from_secs(3));
    let mut running = Duration::ZERO;
    for _ in 0..lists.max(1) {
        let l = Instant::now();
        daemon.ctl(&["list"])?;
        running = running.max(l.elapsed());
    }
    Ok(Row {
        end,
        ending,
        running,
    })
}

/// `python3` calling each of N generated functions over and over; killed on drop.
struct Program(Child);

impl Program {
    fn start(functions: usize) -> Result<Self> {
        let code = format!(
            r#"
src = "".join(f"def f{{i}}(x):\n    return x\n" for i in range({functions}))
ns = {{}}
exec(compile(src, "generated.py", "exec"), ns)
fs = [ns[f"f{{i}}"] for i in range({functions})]
print("ready", flush=True)
while True:
    for f in fs:
        f(0)
"#
        );
        let mut child = Command::new("python3")
            .args(["-c", &code])
            .stdout(Stdio::piped())
            .spawn()
            .context("running python3")?;
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().context("stdout")?).read_line(&mut line)?;
        ensure!(line == "ready\n", "python3 said {line:?}");
        Ok(Self(child))
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
