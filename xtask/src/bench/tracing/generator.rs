//! The event generator of `cargo xtask bench tracing`'s part 1: a small C program calling
//! `tick` at a target rate, its build, and what it prints.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::bench::seconds;

/// The event generator. `tick` is built without optimisation so that it starts with
/// `push %rbp`, an instruction the kernel emulates: a probe on an instruction it must
/// single-step instead (the RIP-relative load an optimised `tick` starts with) costs
/// ≈ 18 µs a hit on the development VM instead of ≈ 0.5 µs, and would measure that.
/// (`optimize` is a GCC attribute; `cc` is GCC on Debian.)
const GENERATOR: &str = r#"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile unsigned long sink;

__attribute__((noinline, optimize("O0"))) void tick(unsigned long i) { sink += i; }

static double rate, seconds;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

struct result { unsigned long calls; double seconds; };

/* Calls tick at `rate` a second (0: as fast as it can) for `seconds`, checking the clock
   every 1000 calls and sleeping or spinning until the next 1000 are due. */
static void *run(void *arg) {
    struct result *r = arg;
    unsigned long n = 0;
    double t0 = now(), t = t0;
    while (t - t0 < seconds) {
        for (int k = 0; k < 1000; k++)
            tick(n++);
        t = now();
        if (rate > 0) {
            double due = t0 + n / rate;
            while (t < due) {
                if (due - t > 0.0002) {
                    struct timespec s = {0, (long)((due - t - 0.0001) * 1e9)};
                    nanosleep(&s, 0);
                }
                t = now();
            }
        }
    }
    r->calls = n;
    r->seconds = t - t0;
    return 0;
}

/* gen RATE SECONDS THREADS: RATE calls a second in all, shared by THREADS threads. */
int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: gen RATE SECONDS THREADS\n");
        return 2;
    }
    int threads = atoi(argv[3]);
    if (threads < 1 || threads > 64)
        return 2;
    rate = atof(argv[1]) / threads;
    seconds = atof(argv[2]);
    pthread_t th[64];
    struct result r[64];
    for (int i = 0; i < threads; i++)
        pthread_create(&th[i], 0, run, &r[i]);
    unsigned long calls = 0;
    double t = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], 0);
        calls += r[i].calls;
        if (r[i].seconds > t)
            t = r[i].seconds;
    }
    printf("CALLS %lu\nRATE %.0f\nSECONDS %.6f\n", calls, calls / t, t);
    return 0;
}
"#;

/// Builds the generator in `dir`.
pub(super) fn compile_generator(dir: &Path) -> Result<PathBuf> {
    let src = dir.join("gen.c");
    fs::write(&src, GENERATOR)?;
    let gen = dir.join("gen");
    let out = Command::new("cc")
        .args(["-O2", "-pthread", "-o"])
        .arg(&gen)
        .arg(&src)
        .output()
        .context("running cc (Debian package gcc)")?;
    if !out.status.success() {
        bail!(
            "compiling the generator: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(gen)
}

/// The generator's rate alone, unpaced, one thread, for one second.
pub(super) fn untraced_rate(gen: &Path) -> Result<u64> {
    let out = Command::new(gen).args(["0", "1", "1"]).output()?;
    Ok(generated(&out.stdout)?.0)
}

/// (calls, seconds) the generator printed.
pub(super) fn generated(out: &[u8]) -> Result<(u64, f64)> {
    let text = String::from_utf8_lossy(out);
    let calls = text
        .lines()
        .find_map(|l| l.strip_prefix("CALLS "))
        .context("the generator printed no count")?
        .trim()
        .parse()?;
    Ok((calls, seconds(out)?))
}
