//! The Python the interpreter runs for tracer: the start script, which loads the counter
//! library and registers its callbacks (or, before 3.12, has it put a C profile function on
//! every thread), and the removal script, which takes them away.

use tracer_common::inproc::state;

/// A Python string literal.
fn py_str(s: &str) -> String {
    format!("{s:?}")
}

const EVENTS: &str = "(E.PY_START, module.py_start), (E.PY_RESUME, module.py_resume), \
    (E.PY_THROW, module.py_throw), (E.PY_RETURN, module.py_return), \
    (E.PY_YIELD, module.py_yield), (E.PY_UNWIND, module.py_unwind)";

/// Runs in the process (PEP 768 runs it in a namespace of its own). It must never raise:
/// the interpreter would print the exception on the program's stderr. When it does not
/// count (tracerd gave up waiting, or it cannot), it deletes the directory's files itself:
/// tracerd has withdrawn the other threads' requests by then.
///
/// `at_exit`: the counter stops when the interpreter starts to exit (atexit), as
/// `python -m cProfile` stops once the script is done: what finalisation runs (a generator
/// abandoned in a global, closed then) is not the program's run.
pub(super) fn start_script(dir: &str, counts: &str, library: &str, at_exit: bool) -> String {
    format!(
        r#"def _tracer_pycount(directory, counts, library, at_exit):
    import os, sys
    # None before 3.12: a C profile function counts there (launched commands only).
    monitoring = getattr(sys, "monitoring", None)

    def cleanup():
        for name in os.listdir(directory):
            try:
                os.unlink(os.path.join(directory, name))
            except BaseException:
                pass
        try:
            os.rmdir(directory)
        except BaseException:
            pass

    # A child forked with its parent's request still pending: the parent's counter is not
    # its to take.
    if not counts.endswith(f".{{os.getpid()}}"):
        return
    # Every thread was asked: a second run finds the counter started and leaves, calling
    # nothing in Python (its own two frames are taken out of the report). A run after
    # tracerd gave up (the process was busy in native code) deletes the files.
    try:
        with open(counts, "rb") as f:
            head = f.read(16)
        state = int.from_bytes(head[12:16], "little") if len(head) == 16 else None
        if state == {CANCELLED}:
            cleanup()
        if state != {PENDING}:
            return
    except BaseException:
        return
    try:
        from importlib.machinery import ExtensionFileLoader
        from importlib.util import module_from_spec, spec_from_loader
        loader = ExtensionFileLoader("_tracer_pycount", library)
        module = module_from_spec(spec_from_loader("_tracer_pycount", loader))
        loader.exec_module(module)
    except BaseException as e:
        try:
            with open(os.path.join(directory, "{LOAD_ERROR}"), "w") as f:
                f.write(f"loading the counter library: {{e!r}}")
        except BaseException:
            pass
        return
    if monitoring is None:
        try:
            if at_exit:
                import atexit
                atexit.register(module.stop)
            if not module.start_profile(counts):
                cleanup()
        except BaseException as e:
            try:
                module.refuse(counts, f"starting the counter: {{e!r}}")
            except BaseException:
                pass
        return
    tool = None
    started = False
    try:
        for t in (3, 4):
            if monitoring.get_tool(t) is None:
                monitoring.use_tool_id(t, "tracer")
                tool = t
                break
        else:
            held = ", ".join(f"{{t}}: {{monitoring.get_tool(t)}}" for t in (3, 4))
            module.refuse(counts, f"sys.monitoring tool ids 3 and 4 are taken ({{held}})")
            cleanup()
            return
        if not module.start(counts, tool, monitoring.DISABLE):
            monitoring.free_tool_id(tool)
            cleanup()
            return
        started = True
        if at_exit:
            import atexit
            atexit.register(module.stop)
        E = monitoring.events
        for event, callback in ({EVENTS}):
            monitoring.register_callback(tool, event, callback)
        monitoring.set_events(tool, E.PY_START | E.PY_RESUME | E.PY_THROW | E.PY_RETURN | E.PY_YIELD | E.PY_UNWIND)
    except BaseException as e:
        try:
            module.refuse(counts, f"starting the counter: {{e!r}}")
            if started:
                module.stop()
            if tool is not None:
                monitoring.set_events(tool, 0)
                monitoring.free_tool_id(tool)
        except BaseException:
            pass
_tracer_pycount({}, {}, {}, {})
"#,
        py_str(dir),
        py_str(counts),
        py_str(library),
        if at_exit { "True" } else { "False" }
    )
}

const PENDING: u32 = state::PENDING;
const CANCELLED: u32 = state::CANCELLED;

/// Written by the start script when the library does not load (a musl libc, say).
pub(super) const LOAD_ERROR: &str = "load-error";

/// Frees the tool id, drops the counter's references (the module loaded from `library`),
/// and deletes the process's counts file last: tracerd takes the file's absence as "done".
pub(super) fn remove_script(tool: u32, counts: &str, library: &str) -> String {
    format!(
        r#"def _tracer_pycount_remove(tool, counts, library):
    import sys, os
    monitoring = sys.monitoring
    try:
        if monitoring.get_tool(tool) == "tracer":
            monitoring.set_events(tool, 0)
            E = monitoring.events
            previous = [monitoring.register_callback(tool, e, None) for e in (E.PY_START, E.PY_RESUME, E.PY_THROW, E.PY_RETURN, E.PY_YIELD, E.PY_UNWIND)]
            monitoring.free_tool_id(tool)
            # Where the callbacks answered DISABLE (between the session's end and now), the
            # interpreter would skip a later session's tool there too.
            monitoring.restart_events()
            module = getattr(previous[0], "__self__", None)
            if module is not None and hasattr(module, "stop"):
                module.stop()
    except BaseException:
        pass
    # Loading an extension module lists it there, whatever the loader asked.
    try:
        if getattr(sys.modules.get("_tracer_pycount"), "__file__", "") == library:
            del sys.modules["_tracer_pycount"]
    except BaseException:
        pass
    try:
        os.unlink(counts)
    except BaseException:
        pass
_tracer_pycount_remove({tool}, {}, {})
"#,
        py_str(counts),
        py_str(library)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_are_python_with_their_paths_quoted() {
        let s = start_script("/tmp/a b", "/tmp/a b/counts.1", "/tmp/a \"b\"/lib.so", true);
        assert!(s.contains(
            r#"_tracer_pycount("/tmp/a b", "/tmp/a b/counts.1", "/tmp/a \"b\"/lib.so", True)"#
        ));
        assert!(s.contains("monitoring.set_events(tool, E.PY_START"));
        let r = remove_script(3, "/tmp/x/counts.7", "/tmp/x-code/lib.so");
        assert!(
            r.ends_with("_tracer_pycount_remove(3, \"/tmp/x/counts.7\", \"/tmp/x-code/lib.so\")\n")
        );
    }
}
