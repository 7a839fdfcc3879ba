//! C++ names spelled as c++filt (binutils' libiberty) spells them, as perf, torch.profiler
//! and Nsight show them, so that a kernel or function name found in another tool's output is
//! found in tracer's. cpp_demangle writes a template argument that is a literal of a
//! suffixed integer type as a cast (`std::array<char*, (unsigned long)3>`); libiberty
//! writes the literal with its suffix (`std::array<char*, 3ul>`).

/// The casts libiberty prints as a suffix instead. A cast that is the start of another comes
/// after it.
const SUFFIXED: [(&str, &str); 5] = [
    ("(unsigned long long)", "ull"),
    ("(unsigned long)", "ul"),
    ("(unsigned int)", "u"),
    ("(long long)", "ll"),
    ("(long)", "l"),
];

/// A mangled C++ name (`_Z…`) demangled as c++filt does; any other name as it is.
pub fn cpp(name: &str) -> String {
    match cpp_demangle::Symbol::new(name)
        .ok()
        .and_then(|s| s.demangle().ok())
    {
        Some(demangled) => literals(&demangled),
        None => name.to_owned(),
    }
}

/// A demangled name with cpp_demangle's casts of integer literals written as libiberty
/// writes them (`(long)-3` → `-3l`). A cast of anything but a whole literal stays.
pub fn literals(demangled: &str) -> String {
    if !demangled.contains(")") {
        return demangled.to_owned();
    }
    let mut out = String::with_capacity(demangled.len());
    let mut rest = demangled;
    'scan: while let Some(c) = rest.chars().next() {
        if c == '(' {
            for (cast, suffix) in SUFFIXED {
                let Some(after) = rest.strip_prefix(cast) else {
                    continue;
                };
                let sign = usize::from(after.starts_with('-'));
                let digits = after[sign..].bytes().take_while(u8::is_ascii_digit).count();
                let end = sign + digits;
                let whole = !after[end..].starts_with(|c: char| c.is_alphanumeric() || c == '_');
                if digits > 0 && whole {
                    out.push_str(&after[..end]);
                    out.push_str(suffix);
                    rest = &after[end..];
                    continue 'scan;
                }
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{cpp, literals};

    /// Names g++ mangled for templates shaped like PyTorch's CUDA kernels (integer literals of
    /// each suffixed type, negative ones, a lambda, an anonymous namespace, bool and char
    /// arguments), each demangled as c++filt demangles it.
    const MANGLED: [&str; 8] = [
        "_Z3negILin5EEvv",
        "_Z4litsILb0ELc0ELsn2ELh0ELx1ELm0EEvv",
        "_Z4litsILb1ELc97ELs5ELh7ELxn8ELm12EEvv",
        "_ZN2at6native13reduce_kernelINS0_12_GLOBAL__N_14AnonEdlLi1ELb0ELln3ELj0ELy0EEEvPT_T0_T1_",
        "_ZN2at6native13reduce_kernelIfdjLi4ELb1ELl7ELj9ELy11EEEvPT_T0_T1_",
        "_ZN2at6native27unrolled_elementwise_kernelIZ3usevEUlfE_St5arrayIPcLm2EEEEviT_T0_",
        "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_",
        "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_15CUDAFunctor_addIfEESt5arrayIPcLm3EEEEviT0_T1_",
    ];

    #[test]
    fn names_are_spelled_as_cxxfilt_spells_them() {
        let out = match std::process::Command::new("c++filt").args(MANGLED).output() {
            Ok(out) if out.status.success() => out,
            other => {
                tracer_testkit::skip(format_args!("c++filt (binutils) did not run: {other:?}"));
                return;
            }
        };
        let want = String::from_utf8(out.stdout).unwrap();
        let want: Vec<&str> = want.lines().collect();
        let got: Vec<String> = MANGLED.iter().map(|m| cpp(m)).collect();
        assert_eq!(got, want);
        assert!(want[7].contains("std::array<char*, 3ul>"), "{}", want[7]);
    }

    #[test]
    fn only_whole_literals_lose_their_cast() {
        assert_eq!(literals("f<(long)-3, (long)x>"), "f<-3l, (long)x>");
        assert_eq!(literals("f<(long)3a>"), "f<(long)3a>");
        assert_eq!(
            literals("(anonymous namespace)::g()"),
            "(anonymous namespace)::g()"
        );
        assert_eq!(cpp("triton_poi_fused_add_0"), "triton_poi_fused_add_0");
    }
}
