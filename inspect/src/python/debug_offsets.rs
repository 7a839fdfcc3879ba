//! `_Py_DebugOffsets`: the struct offsets CPython 3.13+ publishes about itself at the start
//! of `_PyRuntime` (the `.PyRuntime` section), for debuggers and profilers reading it from
//! outside. The values sit in the file's initialised data, so the binary alone tells them.
//!
//! The struct itself grows between versions (fields are added inside its sub-structs), so
//! each version's declaration is written out below, in the order of CPython's
//! `Include/internal/pycore_debug_offsets.h`; a field is found by its position: 3.14 and
//! 3.15 in full, to the last sub-struct `debugger_support` (PEP 768 remote execution,
//! `remote_exec`), 3.13 up to `unicode_object`, all tracer reads of it. A newer version
//! tracer has not seen is read with the newest declaration it knows, and checked for sense
//! before use.

use object::{Object, ObjectSection, ObjectSymbol};

/// What each version's struct declares, word by word: `struct: field field …`, structs
/// separated by `|`. Every word before a field tracer uses must be there, or the field is
/// miscounted: `debugger_support` tells where remote execution writes into the target.
const V3_13: &str = "\
    : cookie version free_threaded |\
    runtime_state: size finalizing interpreters_head |\
    interpreter_state: size id next threads_head gc imports_modules sysdict builtins ceval_gil \
        gil_runtime_state gil_runtime_state_enabled gil_runtime_state_locked \
        gil_runtime_state_holder |\
    thread_state: size prev next interp current_frame thread_id native_thread_id \
        datastack_chunk status |\
    interpreter_frame: size previous executable instr_ptr localsplus owner |\
    code_object: size filename name qualname linetable firstlineno argcount localsplusnames \
        localspluskinds co_code_adaptive |\
    pyobject: size ob_type |\
    type_object: size tp_name tp_repr tp_flags |\
    tuple_object: size ob_item ob_size |\
    list_object: size ob_item ob_size |\
    dict_object: size ma_keys ma_values |\
    float_object: size ob_fval |\
    long_object: size lv_tag ob_digit |\
    bytes_object: size ob_size ob_sval |\
    unicode_object: size state length asciiobject_size";

const V3_14: &str = "\
    : cookie version free_threaded |\
    runtime_state: size finalizing interpreters_head |\
    interpreter_state: size id next threads_head threads_main gc imports_modules sysdict \
        builtins ceval_gil gil_runtime_state gil_runtime_state_enabled \
        gil_runtime_state_locked gil_runtime_state_holder code_object_generation \
        tlbc_generation |\
    thread_state: size prev next interp current_frame thread_id native_thread_id \
        datastack_chunk status |\
    interpreter_frame: size previous executable instr_ptr localsplus owner stackpointer \
        tlbc_index |\
    code_object: size filename name qualname linetable firstlineno argcount localsplusnames \
        localspluskinds co_code_adaptive co_tlbc |\
    pyobject: size ob_type |\
    type_object: size tp_name tp_repr tp_flags |\
    tuple_object: size ob_item ob_size |\
    list_object: size ob_item ob_size |\
    set_object: size used table mask |\
    dict_object: size ma_keys ma_values |\
    float_object: size ob_fval |\
    long_object: size lv_tag ob_digit |\
    bytes_object: size ob_size ob_sval |\
    unicode_object: size state length asciiobject_size |\
    gc: size collecting |\
    gen_object: size gi_name gi_iframe gi_frame_state |\
    llist_node: next prev |\
    debugger_support: eval_breaker remote_debugger_support remote_debugging_enabled \
        debugger_pending_call debugger_script_path debugger_script_path_size";

const V3_15: &str = "\
    : cookie version free_threaded |\
    runtime_state: size finalizing interpreters_head |\
    interpreter_state: size id next threads_head threads_main gc imports_modules sysdict \
        builtins ceval_gil gil_runtime_state gil_runtime_state_enabled \
        gil_runtime_state_locked gil_runtime_state_holder code_object_generation \
        tlbc_generation |\
    thread_state: size prev next interp current_frame base_frame last_profiled_frame \
        last_profiled_frame_seq thread_id native_thread_id datastack_chunk status holds_gil \
        gil_requested current_exception exc_state |\
    err_stackitem: exc_value |\
    interpreter_frame: size previous executable instr_ptr localsplus owner stackpointer \
        tlbc_index |\
    code_object: size filename name qualname linetable firstlineno argcount localsplusnames \
        localspluskinds co_code_adaptive co_tlbc |\
    pyobject: size ob_type |\
    type_object: size tp_name tp_repr tp_flags tp_basicsize tp_dictoffset |\
    heap_type_object: size ht_cached_keys |\
    tuple_object: size ob_item ob_size |\
    list_object: size ob_item ob_size |\
    set_object: size used table mask |\
    dict_object: size ma_keys ma_values |\
    float_object: size ob_fval |\
    long_object: size lv_tag ob_digit |\
    bytes_object: size ob_size ob_sval |\
    unicode_object: size state length asciiobject_size compactunicodeobject_size |\
    gc: size collecting frame generation_stats_size generation_stats |\
    gen_object: size gi_name gi_iframe gi_frame_state |\
    llist_node: next prev |\
    debugger_support: eval_breaker remote_debugger_support remote_debugging_enabled \
        debugger_pending_call debugger_script_path debugger_script_path_size";

const COOKIE: &[u8; 8] = b"xdebugpy";

/// The declarations by the minor version that introduced them; a later version is read with
/// the last one not newer than itself.
const DECLARATIONS: &[(u32, &str)] = &[(13, V3_13), (14, V3_14), (15, V3_15)];

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DebugOffsetsError {
    #[error("no _PyRuntime (.PyRuntime section or symbol) in the binary")]
    NoRuntime,
    #[error("_PyRuntime does not start with the debug offsets' cookie")]
    NoCookie,
    #[error("_PyRuntime's debug offsets are cut short")]
    Short,
}

/// One binary's debug offsets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DebugOffsets {
    /// `PY_VERSION_HEX` of the interpreter (3.14.10 final: 0x030e0af0).
    pub version_hex: u64,
    pub free_threaded: bool,
    /// Whether the declaration used is the interpreter's own version's (false: a newer
    /// version read with the newest declaration tracer knows).
    pub exact_declaration: bool,
    declaration: &'static str,
    words: Vec<u64>,
}

impl DebugOffsets {
    /// Reads them from an ELF file: the start of `.PyRuntime`, else of the `_PyRuntime`
    /// symbol. Ok(None): older than 3.13 (no cookie where 3.13+ puts it).
    pub fn read(file: &object::File) -> Result<Option<Self>, DebugOffsetsError> {
        let bytes = runtime_bytes(file).ok_or(DebugOffsetsError::NoRuntime)?;
        Self::parse(bytes)
    }

    pub fn parse(bytes: &[u8]) -> Result<Option<Self>, DebugOffsetsError> {
        if bytes.len() < 16 || &bytes[..8] != COOKIE {
            return Ok(None);
        }
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                bytes.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        let version_hex = word(1).ok_or(DebugOffsetsError::Short)?;
        let minor = ((version_hex >> 16) & 0xff) as u32;
        let &(since, declaration) = DECLARATIONS
            .iter()
            .rev()
            .find(|(since, _)| *since <= minor)
            .ok_or(DebugOffsetsError::NoCookie)?;
        let n = declaration.split('|').flat_map(|s| fields(s).1).count();
        let words: Vec<u64> = (0..n)
            .map(word)
            .collect::<Option<_>>()
            .ok_or(DebugOffsetsError::Short)?;
        Ok(Some(Self {
            version_hex,
            free_threaded: words[2] != 0,
            exact_declaration: since == minor,
            declaration,
            words,
        }))
    }

    pub fn minor(&self) -> u32 {
        ((self.version_hex >> 16) & 0xff) as u32
    }

    /// "3.14.10" (with the release level for pre-releases: "3.15.0b2").
    pub fn version(&self) -> String {
        let v = self.version_hex;
        let level = match (v >> 4) & 0xf {
            0xa => "a",
            0xb => "b",
            0xc => "rc",
            _ => "",
        };
        let serial = if level.is_empty() {
            String::new()
        } else {
            (v & 0xf).to_string()
        };
        format!(
            "{}.{}.{}{level}{serial}",
            v >> 24,
            (v >> 16) & 0xff,
            (v >> 8) & 0xff
        )
    }

    /// A field by `struct.field`, e.g. `thread_state.current_frame`.
    pub fn get(&self, name: &str) -> Option<u64> {
        let (want_struct, want_field) = name.split_once('.')?;
        let mut i = 0;
        for part in self.declaration.split('|') {
            let (s, fs) = fields(part);
            for f in fs {
                if s == want_struct && f == want_field {
                    return self.words.get(i).copied();
                }
                i += 1;
            }
        }
        None
    }

    /// Whether `struct.field` lies inside its struct as the same offsets say (a newer
    /// version's reordered declaration would show here).
    pub fn plausible(&self, name: &str) -> bool {
        let Some((s, _)) = name.split_once('.') else {
            return false;
        };
        match (self.get(name), self.get(&format!("{s}.size"))) {
            (Some(off), Some(size)) => off < size && size < 1 << 24,
            _ => false,
        }
    }
}

/// ("struct", ["field", …]) of one `|`-separated part of a declaration.
fn fields(part: &str) -> (&str, impl Iterator<Item = &str>) {
    let (s, fs) = part.split_once(':').unwrap_or(("", part));
    (s.trim(), fs.split_whitespace())
}

fn runtime_bytes<'a>(file: &object::File<'a>) -> Option<&'a [u8]> {
    if let Some(data) = file
        .section_by_name(".PyRuntime")
        .and_then(|s| s.data().ok())
    {
        return Some(data);
    }
    let sym = file
        .symbols()
        .chain(file.dynamic_symbols())
        .find(|s| s.is_definition() && s.name() == Ok("_PyRuntime"))?;
    let section = file.section_by_index(sym.section_index()?).ok()?;
    let data = section.data().ok()?;
    data.get(usize::try_from(sym.address().checked_sub(section.address())?).ok()?..)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 3.14 struct's prefix as a GIL build of 3.14.10 writes it.
    fn sample_3_14() -> Vec<u8> {
        let n = V3_14.split('|').flat_map(|s| fields(s).1).count();
        let mut words = vec![0u64; n];
        words[1] = 0x030e_0af0;
        let mut b: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        b[..8].copy_from_slice(COOKIE);
        let mut put = |name: &str, v: u64| {
            let d = DebugOffsets::parse(&b.clone()).unwrap().unwrap();
            let i = (0..n)
                .find(|&i| {
                    let mut probe = d.clone();
                    probe.words[i] = u64::MAX;
                    probe.get(name) == Some(u64::MAX)
                })
                .unwrap();
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        };
        put("thread_state.size", 832);
        put("thread_state.current_frame", 72);
        put("interpreter_frame.owner", 74);
        b
    }

    #[test]
    fn fields_are_found_by_position() {
        let d = DebugOffsets::parse(&sample_3_14()).unwrap().unwrap();
        assert_eq!(d.minor(), 14);
        assert_eq!(d.version(), "3.14.10");
        assert!(d.exact_declaration && !d.free_threaded);
        assert_eq!(d.get("thread_state.current_frame"), Some(72));
        assert_eq!(d.get("interpreter_frame.owner"), Some(74));
        assert!(d.plausible("thread_state.current_frame"));
        assert!(!d.plausible("code_object.filename"));
        assert_eq!(d.get("thread_state.nonexistent"), None);
    }

    #[test]
    fn older_runtimes_have_no_cookie() {
        assert_eq!(DebugOffsets::parse(&[0u8; 64]), Ok(None));
    }

    #[test]
    fn a_newer_version_is_read_with_the_newest_declaration() {
        let mut b = sample_3_14();
        b[8..16].copy_from_slice(&0x0310_00a1u64.to_le_bytes());
        b.resize(b.len() + 512, 0);
        let d = DebugOffsets::parse(&b).unwrap().unwrap();
        assert_eq!(d.minor(), 16);
        assert_eq!(d.version(), "3.16.0a1");
        assert!(!d.exact_declaration);
    }

    /// Debian's 3.14 and 3.15 (`cargo xtask setup`), executables and libpython: the whole
    /// struct is counted right if its last sub-struct reads as CPython declares it
    /// (`_PyRemoteDebuggerSupport`: an int32 flag, then a 512-byte path).
    #[test]
    fn debugger_support_is_read_from_real_binaries() {
        let root =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cpython-root/usr");
        for (minor, path) in [
            (14, "bin/python3.14"),
            (15, "bin/python3.15"),
            (14, "lib/x86_64-linux-gnu/libpython3.14.so.1.0"),
            (15, "lib/x86_64-linux-gnu/libpython3.15.so.1.0"),
        ] {
            let path = root.join(path);
            let Ok(data) = std::fs::read(&path) else {
                tracer_testkit::skip(format_args!(
                    "{} is absent (cargo xtask setup)",
                    path.display()
                ));
                continue;
            };
            let file = object::File::parse(&*data).unwrap();
            let d = DebugOffsets::read(&file).unwrap().unwrap();
            let at = |f: &str| d.get(&format!("debugger_support.{f}")).unwrap();
            assert_eq!((d.minor(), d.exact_declaration), (minor, true));
            assert_eq!(at("debugger_script_path_size"), 512, "{}", path.display());
            assert_eq!(at("debugger_pending_call"), 0, "{}", path.display());
            assert_eq!(at("debugger_script_path"), 4, "{}", path.display());
            let tstate = d.get("thread_state.size").unwrap();
            assert!(at("eval_breaker") + 8 <= tstate);
            assert!(at("remote_debugger_support") + 4 + 512 <= tstate);
            assert!(at("remote_debugging_enabled") < d.get("interpreter_state.size").unwrap());
            if minor == 15 {
                // PyCompactUnicodeObject: the ASCII header, utf8_length and utf8.
                assert_eq!(
                    d.get("unicode_object.compactunicodeobject_size"),
                    Some(d.get("unicode_object.asciiobject_size").unwrap() + 16)
                );
            }
        }
    }

    #[test]
    fn pre_releases_are_named() {
        let d = DebugOffsets {
            version_hex: 0x030f_00b2,
            free_threaded: false,
            exact_declaration: true,
            declaration: V3_15,
            words: vec![],
        };
        assert_eq!(d.version(), "3.15.0b2");
    }
}
