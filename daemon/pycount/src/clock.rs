//! The counter's clock: CLOCK_MONOTONIC nanoseconds, the BPF counter's clock. Read twice a
//! call, it is most of the counter's cost: where the kernel keeps time with the TSC (so the
//! TSC runs at one rate and agrees across CPUs), `rdtsc` scaled to nanoseconds costs half
//! of the vDSO's `clock_gettime`. The scale is measured against `clock_gettime`, from the
//! start to each periodic check; until the first check has a millisecond to measure over,
//! on any other machine, and once the scaled TSC strays from `clock_gettime`, it is
//! `clock_gettime`.

pub struct Clock {
    /// The kernel's clocksource is the TSC.
    tsc_ok: bool,
    /// Scaling the TSC now.
    tsc: bool,
    /// TSC and nanoseconds read together when counting started: the scale's baseline.
    anchor_tsc: u64,
    anchor_ns: u64,
    /// The latest pair read together, and nanoseconds per tick (32.32 fixed point).
    base_tsc: u64,
    base_ns: u64,
    mult: u64,
}

/// The shortest baseline the scale is measured over.
const MIN_BASELINE_NS: u64 = 1_000_000;
/// How far the scaled TSC may stray from `clock_gettime` between checks, besides the
/// scale's own error.
const MAX_DRIFT_NS: u64 = 1_000_000;

impl Clock {
    pub const NEW: Self = Self {
        tsc_ok: false,
        tsc: false,
        anchor_tsc: 0,
        anchor_ns: 0,
        base_tsc: 0,
        base_ns: 0,
        mult: 0,
    };

    /// Counting starts: `clock_gettime` until the first calibration.
    pub fn start(&mut self) {
        *self = Self::NEW;
        self.tsc_ok = cfg!(target_arch = "x86_64")
            && std::fs::read("/sys/devices/system/clocksource/clocksource0/current_clocksource")
                .is_ok_and(|s| s.trim_ascii() == b"tsc");
        if self.tsc_ok {
            self.anchor_tsc = tsc();
            self.anchor_ns = mono_ns();
        }
    }

    /// Measures the scale over everything since the start (more precise each time).
    #[cold]
    pub fn calibrate(&mut self) {
        if !self.tsc_ok {
            return;
        }
        let (c, n) = (tsc(), mono_ns());
        // The scale's error (10⁻⁴ at worst, from a first millisecond's baseline) times the
        // time since the last check, and some room.
        let room = MAX_DRIFT_NS + n.wrapping_sub(self.base_ns) / 1000;
        if self.tsc && self.scaled(c).abs_diff(n) > room {
            // Not the clock it seemed (the kernel may have given up on the TSC since).
            self.tsc_ok = false;
            self.tsc = false;
            return;
        }
        let (dc, dn) = (
            c.wrapping_sub(self.anchor_tsc),
            n.wrapping_sub(self.anchor_ns),
        );
        if dn < MIN_BASELINE_NS || dn > i64::MAX as u64 || dc == 0 || dc > i64::MAX as u64 {
            return;
        }
        let Ok(mult) = u64::try_from((u128::from(dn) << 32) / u128::from(dc)) else {
            return;
        };
        self.mult = mult;
        self.base_tsc = c;
        self.base_ns = n;
        self.tsc = true;
    }

    #[inline(always)]
    pub fn now(&self) -> u64 {
        if self.tsc {
            self.scaled(tsc())
        } else {
            mono_ns()
        }
    }

    #[inline(always)]
    fn scaled(&self, c: u64) -> u64 {
        // Signed: another CPU's TSC may read a little behind the base.
        let d = c.wrapping_sub(self.base_tsc) as i64;
        let ns = (i128::from(d) * i128::from(self.mult)) >> 32;
        self.base_ns.wrapping_add_signed(ns as i64)
    }
}

#[inline(always)]
fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes into `ts`; the vDSO answers, no system call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn tsc() -> u64 {
    // SAFETY: rdtsc has no preconditions (only used where the kernel itself relies on it).
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
fn tsc() -> u64 {
    0
}
