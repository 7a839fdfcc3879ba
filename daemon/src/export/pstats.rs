//! Python's pstats file format: `marshal.dumps(stats)`, where stats maps
//! `(filename, lineno, funcname)` to `(primitive calls, ncalls, tottime, cumtime, callers)`,
//! as `cProfile.Profile.dump_stats` writes it. `pstats.Stats(path)` and snakeviz read it.

use std::collections::BTreeMap;

use crate::report::PyFunction;

/// pstats' key: (filename, first line, function name).
type Key = (String, i64, String);
/// Primitive calls, calls, tottime ns, cumtime ns.
type Totals = (u64, u64, u64, u64);

/// The pstats bytes for these functions. Processes are merged (pstats has no pid), and
/// functions are named by their `co_name`, as cProfile names them. Callers are not recorded.
pub fn encode(functions: &[PyFunction]) -> Vec<u8> {
    let mut merged: BTreeMap<Key, Totals> = BTreeMap::new();
    for f in functions {
        let name = f
            .qualname
            .rsplit('.')
            .next()
            .unwrap_or(&f.qualname)
            .to_owned();
        let e = merged
            .entry((f.filename.clone(), i64::from(f.firstlineno), name))
            .or_default();
        e.0 += f.primitive_calls;
        e.1 += f.ncalls;
        e.2 += f.tottime_ns;
        e.3 += f.cumtime_ns;
    }
    let mut out = vec![b'{'];
    for ((file, line, name), (cc, nc, tt, ct)) in merged {
        tuple(&mut out, 3);
        string(&mut out, &file);
        int(&mut out, line);
        string(&mut out, &name);
        tuple(&mut out, 5);
        int(&mut out, i64::try_from(cc).unwrap_or(i64::MAX));
        int(&mut out, i64::try_from(nc).unwrap_or(i64::MAX));
        float(&mut out, tt as f64 / 1e9);
        float(&mut out, ct as f64 / 1e9);
        out.extend_from_slice(b"{0"); // callers: an empty dict
    }
    out.push(b'0');
    out
}

fn tuple(out: &mut Vec<u8>, n: u8) {
    out.extend_from_slice(&[b')', n]);
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.push(b'u');
    out.extend_from_slice(&u32::try_from(s.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn float(out: &mut Vec<u8>, v: f64) {
    out.push(b'g');
    out.extend_from_slice(&v.to_le_bytes());
}

/// marshal's TYPE_INT for 32-bit values, TYPE_LONG (base 2^15 digits) beyond.
fn int(out: &mut Vec<u8>, v: i64) {
    if let Ok(small) = i32::try_from(v) {
        out.push(b'i');
        out.extend_from_slice(&small.to_le_bytes());
        return;
    }
    let mut mag = v.unsigned_abs();
    let mut digits = Vec::new();
    while mag > 0 {
        digits.push((mag & 0x7fff) as u16);
        mag >>= 15;
    }
    let n = i32::try_from(digits.len()).unwrap_or(i32::MAX);
    out.push(b'l');
    out.extend_from_slice(&(if v < 0 { -n } else { n }).to_le_bytes());
    for d in digits {
        out.extend_from_slice(&d.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_ints() {
        let mut b = Vec::new();
        int(&mut b, 5);
        assert_eq!(b, [b'i', 5, 0, 0, 0]);
        b.clear();
        int(&mut b, 1 << 40);
        // 2^40 = 2^(15*2) * 2^10: digits 0, 0, 1024.
        assert_eq!(b, [b'l', 3, 0, 0, 0, 0, 0, 0, 0, 0, 4]);
    }

    #[test]
    fn python_reads_it_back() {
        let f = PyFunction {
            pid: 1,
            qualname: "Shape.area".into(),
            filename: "/x/app.py".into(),
            firstlineno: 7,
            ncalls: 21891,
            primitive_calls: 1,
            tottime_ns: 1_500_000,
            cumtime_ns: 3_000_000_000_000,
        };
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), encode(&[f])).unwrap();
        let code = "import pstats,sys; s=pstats.Stats(sys.argv[1]).stats; print(s[('/x/app.py',7,'area')][:4])";
        let Ok(out) = std::process::Command::new("python3")
            .args(["-c", code])
            .arg(file.path())
            .output()
        else {
            println!("skipping: no python3");
            return;
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "(1, 21891, 0.0015, 3000.0)"
        );
    }
}
