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
    /// `co_code_adaptive` (3.11+): where the instructions start within the code object.
    pub code_adaptive: u64,
    /// `co_linetable` (a bytes object; its data starts 32 bytes in on every version).
    pub code_linetable: u64,
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
        frame_instr: 0,
        frame_is_entry: 0,
        tstate_thread_id: 0,
        runtime_interpreters_head: 0,
        interp_threads_head: 0,
        tstate_next: 0,
    }
}

/// What sampling reads besides: the frame's instruction and entry flag, and the thread list
/// (`_PyRuntime.interpreters.head->threads.head`, then `next`) with the id a thread state is
/// matched on.
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

pub const VERSIONS: &[Version] = &[
    Version {
        minor: 10,
        index: 0,
        // co_name: 3.10 code objects have no qualname.
        probe: sampled(
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
        runtime_interpreters_head: 32,
        interp_threads_head: 8,
        tstate_next: 8,
        tstate_native_thread_id: None,
        code_adaptive: 0,
        code_linetable: 120,
        resume_opcodes: &[],
        exit_opcodes: &[],
    },
    Version {
        minor: 11,
        index: 1,
        probe: sampled(
            probe(py_kind::CFRAME, 56, 8, 0, (32, 48), (112, 128, 72), 48),
            (56, 68),
            160,
            (40, 16),
        ),
        runtime_interpreters_head: 40,
        interp_threads_head: 16,
        tstate_next: 8,
        tstate_native_thread_id: Some(160),
        code_adaptive: 184,
        code_linetable: 136,
        resume_opcodes: &[(151, "RESUME"), (150, "RESUME_QUICK")],
        exit_opcodes: &[(83, "RETURN_VALUE"), (86, "YIELD_VALUE")],
    },
    Version {
        minor: 12,
        index: 2,
        probe: sampled(
            with_owner(probe(py_kind::CFRAME, 56, 0, 0, (0, 8), (112, 128, 68), 40)),
            (56, 0),
            144,
            (40, 72),
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
    },
    Version {
        minor: 13,
        index: 3,
        probe: sampled(
            with_owner(probe(
                py_kind::CURRENT_FRAME,
                0,
                0,
                72,
                (0, 8),
                (112, 128, 68),
                40,
            )),
            (56, 0),
            160,
            (632, 7344),
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
            if let Some(id) = v.tstate_native_thread_id {
                assert_eq!(u64::from(v.probe.tstate_thread_id), id);
            }
            assert_ne!(v.probe.frame_instr, 0);
        }
    }
}
