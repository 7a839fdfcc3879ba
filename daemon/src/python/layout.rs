//! Per-version CPython facts: struct offsets (x86-64, release builds) and opcode numbers.
//!
//! Offsets come from each version's own headers through `xtask/c/cpython_layout.c`
//! (`cargo xtask py-layouts`); opcode numbers from its `opcode.h`/`opcode_ids.h`. One table
//! per version, chosen once per interpreter binary (after py-spy's per-version modules).

use tracer_common::{py_kind, PyLayout};

/// What the daemon itself reads (thread list) besides what the probes read.
#[derive(Clone, Copy, Debug)]
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
    /// Opcodes whose handlers start or resume a frame: RESUME and its specialised and
    /// instrumented forms (the latter run while sys.monitoring or a profiler is active).
    pub resume_opcodes: &'static [(u8, &'static str)],
    /// Opcodes whose handlers leave a frame: returns and yields, plain and instrumented.
    pub exit_opcodes: &'static [(u8, &'static str)],
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
    }
}

/// With `_PyInterpreterFrame.owner` (3.12+): `char owner` after `stacktop` and
/// `return_offset`, at 70 in 3.12 and 3.13 alike.
const fn with_owner(mut p: PyLayout) -> PyLayout {
    p.frame_owner = 70;
    p
}

pub const VERSIONS: &[Version] = &[
    Version {
        minor: 10,
        index: 0,
        // co_name: 3.10 code objects have no qualname.
        probe: probe(
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
        runtime_interpreters_head: 32,
        interp_threads_head: 8,
        tstate_next: 8,
        tstate_native_thread_id: None,
        resume_opcodes: &[],
        exit_opcodes: &[],
    },
    Version {
        minor: 11,
        index: 1,
        probe: probe(py_kind::CFRAME, 56, 8, 0, (32, 48), (112, 128, 72), 48),
        runtime_interpreters_head: 40,
        interp_threads_head: 16,
        tstate_next: 8,
        tstate_native_thread_id: Some(160),
        resume_opcodes: &[(151, "RESUME"), (150, "RESUME_QUICK")],
        exit_opcodes: &[(83, "RETURN_VALUE"), (86, "YIELD_VALUE")],
    },
    Version {
        minor: 12,
        index: 2,
        probe: with_owner(probe(py_kind::CFRAME, 56, 0, 0, (0, 8), (112, 128, 68), 40)),
        runtime_interpreters_head: 40,
        interp_threads_head: 72,
        tstate_next: 8,
        tstate_native_thread_id: Some(144),
        resume_opcodes: &[(151, "RESUME"), (240, "INSTRUMENTED_RESUME")],
        exit_opcodes: &[
            (83, "RETURN_VALUE"),
            (121, "RETURN_CONST"),
            (150, "YIELD_VALUE"),
            (242, "INSTRUMENTED_RETURN_VALUE"),
            (247, "INSTRUMENTED_RETURN_CONST"),
            (243, "INSTRUMENTED_YIELD_VALUE"),
        ],
    },
    Version {
        minor: 13,
        index: 3,
        probe: with_owner(probe(
            py_kind::CURRENT_FRAME,
            0,
            0,
            72,
            (0, 8),
            (112, 128, 68),
            40,
        )),
        runtime_interpreters_head: 632,
        interp_threads_head: 7344,
        tstate_next: 8,
        tstate_native_thread_id: Some(160),
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
    },
];

pub fn version(minor: u32) -> Option<&'static Version> {
    VERSIONS.iter().find(|v| v.minor == minor)
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
}
