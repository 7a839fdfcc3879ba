//! Python's pstats file format: `marshal.dumps(stats)`, where stats maps
//! `(filename, lineno, funcname)` to `(primitive calls, ncalls, tottime, cumtime, callers)`,
//! as `cProfile.Profile.dump_stats` writes it. `pstats.Stats(path)` and snakeviz read it.

use std::collections::BTreeMap;

use crate::PyFunction;

/// pstats' key: (filename, first line, function name).
type Key = (String, i64, String);
/// Primitive calls, calls, tottime ns, cumtime ns.
type Totals = (u64, u64, u64, u64);

/// pstats names functions by `co_name`; tracer reports qualnames.
fn key(qualname: &str, filename: &str, firstlineno: i32) -> Key {
    let name = qualname.rsplit('.').next().unwrap_or(qualname).to_owned();
    (filename.to_owned(), i64::from(firstlineno), name)
}

fn add(t: &mut Totals, cc: u64, nc: u64, tt: u64, ct: u64) {
    t.0 += cc;
    t.1 += nc;
    t.2 += tt;
    t.3 += ct;
}

fn count(out: &mut Vec<u8>, n: u64) {
    int(out, i64::try_from(n).unwrap_or(i64::MAX));
}

/// The pstats bytes for these functions and their callers. Processes are merged (pstats
/// has no pid), and functions are named by their `co_name`, as cProfile names them.
pub fn encode(functions: &[PyFunction]) -> Vec<u8> {
    let mut merged: BTreeMap<Key, (Totals, BTreeMap<Key, Totals>)> = BTreeMap::new();
    for f in functions {
        let e = merged
            .entry(key(&f.qualname, &f.filename, f.firstlineno))
            .or_default();
        add(
            &mut e.0,
            f.primitive_calls,
            f.ncalls,
            f.tottime_ns,
            f.cumtime_ns,
        );
        for c in &f.callers {
            let t =
                e.1.entry(key(&c.qualname, &c.filename, c.firstlineno))
                    .or_default();
            add(t, c.primitive_calls, c.ncalls, c.tottime_ns, c.cumtime_ns);
        }
    }
    let mut out = vec![b'{'];
    for (k, ((cc, nc, tt, ct), callers)) in merged {
        key_tuple(&mut out, &k);
        tuple(&mut out, 5);
        count(&mut out, cc);
        count(&mut out, nc);
        float(&mut out, tt as f64 / 1e9);
        float(&mut out, ct as f64 / 1e9);
        out.push(b'{');
        for (from, (cc, nc, tt, ct)) in callers {
            key_tuple(&mut out, &from);
            // cProfile writes a caller's numbers ncalls first, unlike the function's own.
            tuple(&mut out, 4);
            count(&mut out, nc);
            count(&mut out, cc);
            float(&mut out, tt as f64 / 1e9);
            float(&mut out, ct as f64 / 1e9);
        }
        out.push(b'0');
    }
    out.push(b'0');
    out
}

fn key_tuple(out: &mut Vec<u8>, (file, line, name): &Key) {
    tuple(out, 3);
    string(out, file);
    int(out, *line);
    string(out, name);
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
            callers: vec![crate::PyCaller {
                qualname: "main".into(),
                filename: "/x/app.py".into(),
                firstlineno: 1,
                ncalls: 3,
                primitive_calls: 2,
                tottime_ns: 1_000_000,
                cumtime_ns: 2_000_000,
            }],
        };
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), encode(&[f])).unwrap();
        let code = "import pstats,sys; s=pstats.Stats(sys.argv[1]).stats; v=s[('/x/app.py',7,'area')]; print(v[:4], v[4])";
        let Ok(out) = std::process::Command::new("python3")
            .args(["-c", code])
            .arg(file.path())
            .output()
        else {
            tracer_testkit::skip(format_args!("no python3"));
            return;
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "(1, 21891, 0.0015, 3000.0) {('/x/app.py', 1, 'main'): (3, 2, 0.001, 0.002)}"
        );
    }
}
