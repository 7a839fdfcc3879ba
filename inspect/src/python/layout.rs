//! Per-version CPython facts: struct offsets (x86-64, release builds) and opcode numbers.
//!
//! Offsets come from each version's own headers through `xtask/c/cpython_layout.c`
//! (`cargo xtask py-layouts`); opcode numbers from its `opcode.h`/`opcode_ids.h`. One table
//! per version, chosen once per interpreter binary (after py-spy's per-version modules).

use std::sync::Mutex;

use tracer_common::{py_kind, PyLayout};

use super::debug_offsets::DebugOffsets;

/// What the daemon itself reads (thread list) besides what the probes read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Version {
    pub minor: u32,
    /// Index into the BPF `PY_LAYOUTS` array (the probes' attach cookie).
    pub index: u32,
    pub probe: PyLayout,
    pub runtime_interpreters_head: u64,
    pub interp_threads_head: u64,
    pub tstate_next: u64,
    /// None on 3.10 (it has no native thread id, and needs none: its probe reads the frame argument).
    pub tstate_native_thread_id: Option<u64>,
    /// `co_code_adaptive` (3.11+): where the instructions start within the code object.
    pub code_adaptive: u64,
    /// `co_linetable` (a bytes object; its data starts 32 bytes in on every version).
    pub code_linetable: u64,
    /// Opcodes whose handlers start or resume a frame: RESUME and its specialised and
    /// instrumented forms (the latter run while sys.monitoring or a profiler is active).
    pub resume_opcodes: &'static [(u8, &'static str)],
    /// Opcodes whose handlers leave a frame: returns and yields, plain and instrumented.
    pub exit_opcodes: &'static [(u8, &'static str)],
    /// Why calls cannot be counted on this interpreter (sampling still works), if so.
    pub no_counting: Option<&'static str>,
    /// Where the layout came from: "tracer's table", or the interpreter's debug offsets.
    pub source: &'static str,
}

const fn probe(
    kind: u32,
    tstate_cframe: u32,
    cframe_current_frame: u32,
    tstate_current_frame: u32,
    frame: (u32, u32),
    code: (u32, u32, u32),
    unicode_ascii_data: u32,
) -> PyLayout {
    PyLayout {
        kind,
        tstate_cframe,
        cframe_current_frame,
        tstate_current_frame,
        frame_code: frame.0,
        frame_previous: frame.1,
        frame_owner: 0,
        code_filename: code.0,
        code_qualname: code.1,
        code_firstlineno: code.2,
        unicode_state: 32,
        unicode_ascii_data,
        frame_instr: 0,
        frame_is_entry: 0,
        tstate_thread_id: 0,
        runtime_interpreters_head: 0,
        interp_threads_head: 0,
        tstate_next: 0,
        executable_tag_bits: 0,
        code_flags: 0,
        code_instr_version: 0,
        tstate_interp: 0,
        interp_monitoring_version: 0,
        tstate_eval_breaker: 0,
        tstate_tracing: 0,
        gil_locked: 0,
        gil_holder: 0,
        gil_in_interp: 0,
    }
}

/// Whether the sampled thread holds the GIL: `(locked, last_holder)` within `_PyRuntime`
/// before 3.12, within the interpreter state from 3.12 (`cargo xtask py-layouts`).
const fn gil(mut p: PyLayout, (locked, holder): (u32, u32), in_interp: bool) -> PyLayout {
    p.gil_locked = locked;
    p.gil_holder = holder;
    p.gil_in_interp = in_interp as u32;
    p
}

/// 3.12: a code object's instrumentation version against the interpreter's
/// `monitoring_version` (`_co_instrumentation_version` at 160, `interp` at 16,
/// `monitoring_version` at 48; `cargo xtask py-layouts`).
const fn monitoring_3_12(mut p: PyLayout) -> PyLayout {
    p.code_instr_version = 160;
    p.tstate_interp = 16;
    p.interp_monitoring_version = 48;
    p
}

/// 3.13+: against the thread's `eval_breaker` (at 24) above its event bits
/// (`_co_instrumentation_version` at 168); `tracing`: `PyThreadState.tracing`, inside which
/// (a trace or profile function running) RESUME does not check.
const fn monitoring_3_13(mut p: PyLayout, tracing: u32) -> PyLayout {
    p.code_instr_version = 168;
    p.tstate_eval_breaker = 24;
    p.tstate_tracing = tracing;
    p
}

/// The fields a table knows and debug offsets do not (see `PyLayout::code_instr_version`),
/// copied onto a layout derived from an interpreter's debug offsets.
pub fn with_table_extras(mut p: PyLayout, table: &PyLayout) -> PyLayout {
    p.code_instr_version = table.code_instr_version;
    p.tstate_interp = table.tstate_interp;
    p.interp_monitoring_version = table.interp_monitoring_version;
    p.tstate_eval_breaker = table.tstate_eval_breaker;
    p.tstate_tracing = table.tstate_tracing;
    p
}

/// What sampling reads besides: the frame's instruction and entry flag, and the thread list
/// (`_PyRuntime.interpreters.head->threads.head`, then `next`) with the id a thread state is
/// matched on (`thread_id`: `pthread_self()`, the same in every pid namespace).
const fn sampled(
    mut p: PyLayout,
    (frame_instr, frame_is_entry): (u32, u32),
    tstate_thread_id: u32,
    (runtime_interpreters_head, interp_threads_head): (u32, u32),
) -> PyLayout {
    p.frame_instr = frame_instr;
    p.frame_is_entry = frame_is_entry;
    p.tstate_thread_id = tstate_thread_id;
    p.runtime_interpreters_head = runtime_interpreters_head;
    p.interp_threads_head = interp_threads_head;
    // `PyThreadState.next` follows `prev` at the start of the struct on every version.
    p.tstate_next = 8;
    p
}

/// With `_PyInterpreterFrame.owner` (3.12+): `char owner` after `stacktop` and
/// `return_offset`, at 70 in 3.12 and 3.13 alike.
const fn with_owner(mut p: PyLayout) -> PyLayout {
    p.frame_owner = 70;
    p
}

/// 3.14+: `f_executable` is a `_PyStackRef`, whose low bits tag the reference (one bit in
/// 3.14's GIL builds, more in later ones; objects are 16-byte aligned, so clearing three is
/// safe), and `owner` moved to 74 after the new `stackpointer`.
const fn stackref(mut p: PyLayout) -> PyLayout {
    p.frame_owner = 74;
    p.executable_tag_bits = 7;
    p
}

/// 3.15+: generator expressions run RESUME before RETURN_GENERATOR (see
/// `PyLayout::code_flags`); `co_flags` follows `co_exceptiontable` at 48 from 3.11 on.
const fn resume_before_generator(mut p: PyLayout) -> PyLayout {
    p.code_flags = 48;
    p
}

const TABLE: &str = "tracer's table";

pub const VERSIONS: &[Version] = &[
    Version {
        minor: 10,
        index: 0,
        // co_name: 3.10 code objects have no qualname.
        probe: gil(
            sampled(
                probe(
                    py_kind::EVAL_ARG_FRAME,
                    0,
                    0,
                    // PyThreadState.frame: the caller's frame again once a frame has returned.
                    24,
                    // f_code, f_back.
                    (32, 24),
                    (104, 112, 40),
                    48,
                ),
                // f_lasti; every 3.10 frame is its own run of the eval loop.
                (96, 0),
                176,
                (32, 8),
            ),
            (368, 360),
            false,
        ),
        runtime_interpreters_head: 32,
        interp_threads_head: 8,
        tstate_next: 8,
        tstate_native_thread_id: None,
        code_adaptive: 0,
        code_linetable: 120,
        resume_opcodes: &[],
        exit_opcodes: &[],
        no_counting: None,
        source: TABLE,
    },
    Version {
        minor: 11,
        index: 1,
        probe: gil(
            sampled(
                probe(py_kind::CFRAME, 56, 8, 0, (32, 48), (112, 128, 72), 48),
                (56, 68),
                152,
                (40, 16),
            ),
            (376, 368),
            false,
        ),
        runtime_interpreters_head: 40,
        interp_threads_head: 16,
        tstate_next: 8,
        tstate_native_thread_id: Some(160),
        code_adaptive: 184,
        code_linetable: 136,
        resume_opcodes: &[(151, "RESUME"), (150, "RESUME_QUICK")],
        exit_opcodes: &[(83, "RETURN_VALUE"), (86, "YIELD_VALUE")],
        no_counting: None,
        source: TABLE,
    },
    Version {
        minor: 12,
        index: 2,
        probe: gil(
            sampled(
                monitoring_3_12(with_owner(probe(
                    py_kind::CFRAME,
                    56,
                    0,
                    0,
                    (0, 8),
                    (112, 128, 68),
                    40,
                ))),
                (56, 0),
                136,
                (40, 72),
            ),
            (1056, 1048),
            true,
        ),
        runtime_interpreters_head: 40,
        interp_threads_head: 72,
        tstate_next: 8,
        tstate_native_thread_id: Some(144),
        code_adaptive: 192,
        code_linetable: 136,
        resume_opcodes: &[(151, "RESUME"), (240, "INSTRUMENTED_RESUME")],
        exit_opcodes: &[
            (83, "RETURN_VALUE"),
            (121, "RETURN_CONST"),
            (150, "YIELD_VALUE"),
            (242, "INSTRUMENTED_RETURN_VALUE"),
            (247, "INSTRUMENTED_RETURN_CONST"),
            (243, "INSTRUMENTED_YIELD_VALUE"),
        ],
        no_counting: None,
        source: TABLE,
    },
    Version {
        minor: 13,
        index: 3,
        probe: gil(
            sampled(
                monitoring_3_13(
                    with_owner(probe(
                        py_kind::CURRENT_FRAME,
                        0,
                        0,
                        72,
                        (0, 8),
                        (112, 128, 68),
                        40,
                    )),
                    60,
                ),
                (56, 0),
                152,
                (632, 7344),
            ),
            (7768, 7760),
            true,
        ),
        runtime_interpreters_head: 632,
        interp_threads_head: 7344,
        tstate_next: 8,
        tstate_native_thread_id: Some(160),
        code_adaptive: 200,
        code_linetable: 136,
        resume_opcodes: &[
            (149, "RESUME"),
            (207, "RESUME_CHECK"),
            (236, "INSTRUMENTED_RESUME"),
        ],
        exit_opcodes: &[
            (36, "RETURN_VALUE"),
            (103, "RETURN_CONST"),
            (118, "YIELD_VALUE"),
            (239, "INSTRUMENTED_RETURN_VALUE"),
            (240, "INSTRUMENTED_RETURN_CONST"),
            (241, "INSTRUMENTED_YIELD_VALUE"),
        ],
        no_counting: None,
        source: TABLE,
    },
    Version {
        minor: 14,
        index: 4,
        probe: gil(
            sampled(
                monitoring_3_13(
                    stackref(probe(
                        py_kind::CURRENT_FRAME,
                        0,
                        0,
                        72,
                        (0, 8),
                        (112, 128, 68),
                        40,
                    )),
                    60,
                ),
                (56, 0),
                152,
                (808, 7344),
            ),
            (7800, 7792),
            true,
        ),
        runtime_interpreters_head: 808,
        interp_threads_head: 7344,
        tstate_next: 8,
        tstate_native_thread_id: Some(160),
        code_adaptive: 208,
        code_linetable: 136,
        resume_opcodes: &[
            (128, "RESUME"),
            (196, "RESUME_CHECK"),
            (245, "INSTRUMENTED_RESUME"),
        ],
        exit_opcodes: &[
            (35, "RETURN_VALUE"),
            (120, "YIELD_VALUE"),
            (246, "INSTRUMENTED_RETURN_VALUE"),
            (247, "INSTRUMENTED_YIELD_VALUE"),
        ],
        no_counting: None,
        source: TABLE,
    },
    Version {
        minor: 15,
        index: 5,
        probe: gil(
            sampled(
                monitoring_3_13(
                    resume_before_generator(stackref(probe(
                        py_kind::CURRENT_FRAME,
                        0,
                        0,
                        72,
                        (0, 8),
                        (112, 128, 68),
                        40,
                    ))),
                    64,
                ),
                (56, 0),
                176,
                (936, 7336),
            ),
            (7752, 7744),
            true,
        ),
        runtime_interpreters_head: 936,
        interp_threads_head: 7336,
        tstate_next: 8,
        tstate_native_thread_id: Some(184),
        code_adaptive: 208,
        code_linetable: 136,
        resume_opcodes: &[
            (128, "RESUME"),
            (200, "RESUME_CHECK"),
            (201, "RESUME_CHECK_JIT"),
            (244, "INSTRUMENTED_RESUME"),
        ],
        exit_opcodes: &[
            (33, "RETURN_VALUE"),
            (119, "YIELD_VALUE"),
            (245, "INSTRUMENTED_RETURN_VALUE"),
            (246, "INSTRUMENTED_YIELD_VALUE"),
        ],
        no_counting: None,
        source: TABLE,
    },
];

pub fn version(minor: u32) -> Option<&'static Version> {
    VERSIONS.iter().find(|v| v.minor == minor)
}

/// Opcodes tracer probes, by name: those that start or resume a frame, and those that leave it.
pub const RESUME_NAMES: &[&str] = &[
    "RESUME",
    "RESUME_CHECK",
    "RESUME_CHECK_JIT",
    "INSTRUMENTED_RESUME",
];
pub const EXIT_NAMES: &[&str] = &[
    "RETURN_VALUE",
    "RETURN_CONST",
    "YIELD_VALUE",
    "INSTRUMENTED_RETURN_VALUE",
    "INSTRUMENTED_RETURN_CONST",
    "INSTRUMENTED_YIELD_VALUE",
];

/// The layout an interpreter's own debug offsets give (3.13+), with `minor`'s opcode numbers
/// left to the caller. Err: an offset tracer needs is missing or makes no sense.
pub fn from_debug_offsets(d: &DebugOffsets) -> Result<Version, String> {
    const NEEDED: &[&str] = &[
        "runtime_state.interpreters_head",
        "interpreter_state.threads_head",
        "thread_state.next",
        "thread_state.current_frame",
        "thread_state.thread_id",
        "thread_state.native_thread_id",
        "interpreter_frame.previous",
        "interpreter_frame.executable",
        "interpreter_frame.instr_ptr",
        "interpreter_frame.owner",
        "code_object.filename",
        "code_object.qualname",
        "code_object.firstlineno",
        "code_object.linetable",
        "code_object.co_code_adaptive",
        "unicode_object.state",
    ];
    if let Some(bad) = NEEDED.iter().find(|n| !d.plausible(n)) {
        return Err(format!(
            "CPython {}'s debug offsets give no sensible {bad}",
            d.version()
        ));
    }
    let get = |n: &str| d.get(n).unwrap_or(0);
    let off = |n: &str| u32::try_from(get(n)).unwrap_or(u32::MAX);
    let ascii_data = off("unicode_object.asciiobject_size");
    if ascii_data == 0 || ascii_data > 256 {
        return Err(format!(
            "CPython {}'s debug offsets give no sensible unicode_object.asciiobject_size",
            d.version()
        ));
    }
    let mut probe = sampled(
        probe(
            py_kind::CURRENT_FRAME,
            0,
            0,
            off("thread_state.current_frame"),
            (
                off("interpreter_frame.executable"),
                off("interpreter_frame.previous"),
            ),
            (
                off("code_object.filename"),
                off("code_object.qualname"),
                off("code_object.firstlineno"),
            ),
            ascii_data,
        ),
        (off("interpreter_frame.instr_ptr"), 0),
        off("thread_state.thread_id"),
        (
            off("runtime_state.interpreters_head"),
            off("interpreter_state.threads_head"),
        ),
    );
    probe.unicode_state = off("unicode_object.state");
    probe.frame_owner = off("interpreter_frame.owner");
    probe.tstate_next = off("thread_state.next");
    // The GIL is optional: without it, samples say nothing about it. A free-threaded build
    // has none to hold (and is refused before this).
    let (locked, holder) = (
        "interpreter_state.gil_runtime_state_locked",
        "interpreter_state.gil_runtime_state_holder",
    );
    if d.plausible(locked) && d.plausible(holder) && get(locked) != 0 {
        probe = gil(probe, (off(locked), off(holder)), true);
    }
    if d.minor() >= 14 {
        probe.executable_tag_bits = 7;
    }
    if d.minor() >= 15 {
        probe = resume_before_generator(probe);
    }
    Ok(Version {
        minor: d.minor(),
        index: u32::MAX,
        probe,
        runtime_interpreters_head: get("runtime_state.interpreters_head"),
        interp_threads_head: get("interpreter_state.threads_head"),
        tstate_next: get("thread_state.next"),
        tstate_native_thread_id: Some(get("thread_state.native_thread_id")),
        code_adaptive: get("code_object.co_code_adaptive"),
        code_linetable: get("code_object.linetable"),
        resume_opcodes: &[],
        exit_opcodes: &[],
        no_counting: None,
        source: "the interpreter's debug offsets",
    })
}

/// Layouts not in tracer's table (a version it has not seen, or a build whose offsets differ
/// from the table's), each given a slot of the BPF layout array once. Bounded: one per
/// distinct layout, and the array's size caps them.
static DERIVED: Mutex<Vec<&'static Version>> = Mutex::new(Vec::new());

/// The `'static` version for `v`: the table's own entry when equal, else a slot of its own.
pub fn intern(mut v: Version) -> Result<&'static Version, String> {
    if let Some(known) = VERSIONS.iter().find(|k| {
        Version {
            index: k.index,
            source: k.source,
            ..v
        } == **k
    }) {
        return Ok(known);
    }
    let mut derived = DERIVED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(d) = derived.iter().find(|d| {
        Version {
            index: d.index,
            ..v
        } == ***d
    }) {
        return Ok(d);
    }
    let index = (VERSIONS.len() + derived.len()) as u32;
    if index >= tracer_common::PY_LAYOUTS_MAX {
        return Err(format!(
            "too many distinct CPython layouts in use (tracer keeps {})",
            tracer_common::PY_LAYOUTS_MAX
        ));
    }
    v.index = index;
    let v: &'static Version = Box::leak(Box::new(v));
    derived.push(v);
    Ok(v)
}

/// The version whose layout the probes know by `index` (the table's or an interned one).
pub fn by_index(index: u32) -> Option<&'static Version> {
    if let Some(v) = VERSIONS.iter().find(|v| v.index == index) {
        return Some(v);
    }
    DERIVED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .find(|v| v.index == index)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_are_positions() {
        for (i, v) in VERSIONS.iter().enumerate() {
            assert_eq!(v.index as usize, i);
            assert!(v.index < tracer_common::PY_LAYOUTS_MAX);
        }
    }

    #[test]
    fn sampling_reads_the_same_thread_list_as_the_daemon() {
        for v in VERSIONS {
            assert_eq!(
                u64::from(v.probe.runtime_interpreters_head),
                v.runtime_interpreters_head
            );
            assert_eq!(
                u64::from(v.probe.interp_threads_head),
                v.interp_threads_head
            );
            assert_eq!(u64::from(v.probe.tstate_next), v.tstate_next);
            // `unsigned long thread_id, native_thread_id;` on every version.
            if let Some(id) = v.tstate_native_thread_id {
                assert_eq!(u64::from(v.probe.tstate_thread_id) + 8, id);
            }
            assert_ne!(v.probe.frame_instr, 0);
        }
    }
}
