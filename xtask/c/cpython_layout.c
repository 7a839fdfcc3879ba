/* Prints the CPython struct offsets tracer's BPF programs need, from the interpreter's own
 * (internal) headers. Built and run by `cargo xtask py-layouts` for each installed CPython version;
 * its output is what daemon/src/python/layout.rs holds. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#endif
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h>
#endif

#define OFF(t, f) printf("    %s: %zu,\n", #f, offsetof(t, f))

int main(void) {
    printf("// CPython %d.%d\n", PY_MAJOR_VERSION, PY_MINOR_VERSION);
    printf("runtime_interpreters_head: %zu,\n", offsetof(_PyRuntimeState, interpreters.head));
#if PY_VERSION_HEX >= 0x030B0000
    printf("interp_threads_head: %zu,\n", offsetof(PyInterpreterState, threads.head));
#else
    printf("interp_threads_head: %zu,\n", offsetof(PyInterpreterState, tstate_head));
#endif
    printf("tstate_next: %zu,\n", offsetof(PyThreadState, next));
#if PY_VERSION_HEX >= 0x030B0000
    printf("tstate_native_thread_id: %zu,\n", offsetof(PyThreadState, native_thread_id));
#endif
#if PY_VERSION_HEX >= 0x030D0000
    printf("tstate_current_frame: %zu,\n", offsetof(PyThreadState, current_frame));
    printf("iframe_code: %zu,\n", offsetof(_PyInterpreterFrame, f_executable));
    printf("iframe_previous: %zu,\n", offsetof(_PyInterpreterFrame, previous));
#elif PY_VERSION_HEX >= 0x030B0000
    printf("tstate_cframe: %zu,\n", offsetof(PyThreadState, cframe));
    printf("cframe_current_frame: %zu,\n", offsetof(_PyCFrame, current_frame));
    printf("iframe_code: %zu,\n", offsetof(_PyInterpreterFrame, f_code));
    printf("iframe_previous: %zu,\n", offsetof(_PyInterpreterFrame, previous));
#else
    printf("tstate_frame: %zu,\n", offsetof(PyThreadState, frame));
    printf("frame_code: %zu,\n", offsetof(PyFrameObject, f_code));
    printf("frame_back: %zu,\n", offsetof(PyFrameObject, f_back));
#endif
    printf("code_filename: %zu,\n", offsetof(PyCodeObject, co_filename));
    printf("code_name: %zu,\n", offsetof(PyCodeObject, co_name));
#if PY_VERSION_HEX >= 0x030B0000
    printf("code_qualname: %zu,\n", offsetof(PyCodeObject, co_qualname));
#endif
    printf("code_firstlineno: %zu,\n", offsetof(PyCodeObject, co_firstlineno));
    /* Sampling: the current instruction, the line table, entry frames, thread ids. */
#if PY_VERSION_HEX >= 0x030D0000
    printf("iframe_instr_ptr: %zu,\n", offsetof(_PyInterpreterFrame, instr_ptr));
#elif PY_VERSION_HEX >= 0x030B0000
    printf("iframe_prev_instr: %zu,\n", offsetof(_PyInterpreterFrame, prev_instr));
#else
    printf("frame_lasti: %zu,\n", offsetof(PyFrameObject, f_lasti));
#endif
#if PY_VERSION_HEX >= 0x030C0000
    printf("iframe_owner: %zu,\n", offsetof(_PyInterpreterFrame, owner));
#elif PY_VERSION_HEX >= 0x030B0000
    printf("iframe_is_entry: %zu,\n", offsetof(_PyInterpreterFrame, is_entry));
#endif
#if PY_VERSION_HEX >= 0x030B0000
    printf("code_adaptive: %zu,\n", offsetof(PyCodeObject, co_code_adaptive));
#endif
    printf("code_linetable: %zu,\n", offsetof(PyCodeObject, co_linetable));
    printf("tstate_thread_id: %zu,\n", offsetof(PyThreadState, thread_id));
    /* Counting: the instrumentation versions RESUME compares (a stale code object is
     * instrumented and its RESUME run again). */
#if PY_VERSION_HEX >= 0x030C0000
    printf("code_instrumentation_version: %zu (%zu bytes),\n",
           offsetof(PyCodeObject, _co_instrumentation_version),
           sizeof(((PyCodeObject *)0)->_co_instrumentation_version));
#endif
    printf("tstate_tracing: %zu,\n", offsetof(PyThreadState, tracing));
#if PY_VERSION_HEX >= 0x030D0000
    printf("tstate_eval_breaker: %zu,\n", offsetof(PyThreadState, eval_breaker));
#elif PY_VERSION_HEX >= 0x030C0000
    printf("tstate_interp: %zu,\n", offsetof(PyThreadState, interp));
    printf("interp_monitoring_version: %zu (%zu bytes),\n",
           offsetof(PyInterpreterState, monitoring_version),
           sizeof(((PyInterpreterState *)0)->monitoring_version));
#endif
    /* Sampling: whether the sampled thread holds the GIL (locked, and it the last holder):
     * the runtime's own GIL before 3.12, the interpreter's (PEP 684) from 3.12. */
#if PY_VERSION_HEX >= 0x030C0000
    printf("interp_gil_locked: %zu,\n", offsetof(PyInterpreterState, _gil.locked));
    printf("interp_gil_last_holder: %zu,\n", offsetof(PyInterpreterState, _gil.last_holder));
#else
    printf("runtime_gil_locked: %zu,\n", offsetof(_PyRuntimeState, ceval.gil.locked));
    printf("runtime_gil_last_holder: %zu,\n", offsetof(_PyRuntimeState, ceval.gil.last_holder));
#endif
    printf("bytes_data: %zu,\n", offsetof(PyBytesObject, ob_sval));
    printf("unicode_length: %zu,\n", offsetof(PyASCIIObject, length));
    printf("unicode_state: %zu,\n", offsetof(PyASCIIObject, state));
    printf("unicode_ascii_data: %zu,\n", sizeof(PyASCIIObject));
    return 0;
}
