//! asyncio tasks: where a thread's running task, a task's coroutine and the tasks awaiting
//! it are. From 3.14 the `_asyncio` module publishes its own offsets in an ELF section,
//! `.AsyncioDebug` (what `python -m asyncio pstree` reads); the interpreter's
//! `_Py_DebugOffsets` give the coroutine and frame fields. `_asyncio` is built into some
//! interpreters and a `lib-dynload` extension in others, read from the file before the
//! program imports it, so that a process is looked at once. 3.11–3.13 publish nothing:
//! their private structs' offsets are tracer's table ([`legacy`]).

use std::path::{Path, PathBuf};

use object::{Object, ObjectSection};
use tracer_common::PyAsyncLayout;

use super::debug_offsets::DebugOffsets;

#[derive(Debug, thiserror::Error)]
pub enum AsyncioError {
    #[error("asyncio task stacks need CPython 3.11 or later")]
    TooOld,
    #[error("this interpreter is free-threaded")]
    FreeThreaded,
    #[error("no _asyncio module with an .AsyncioDebug section was found beside {0}")]
    NoModule(PathBuf),
    #[error("{path}: implausible .AsyncioDebug offsets ({field})")]
    Implausible { path: PathBuf, field: &'static str },
}

/// The 13 words of `struct _Py_AsyncioModuleDebugOffsets`, in its order.
const SECTION_WORDS: usize = 13;
const TASK_SIZE: usize = 0;
const TASK_NAME: usize = 1;
const TASK_AWAITED_BY: usize = 2;
const TASK_AWAITED_BY_IS_SET: usize = 4;
const TASK_CORO: usize = 5;
const THREAD_SIZE: usize = 9;
const THREAD_RUNNING_LOOP: usize = 10;
const THREAD_RUNNING_TASK: usize = 11;

/// How the sampler reads tasks of processes running the interpreter at `interpreter` (the
/// binary or libpython holding `_PyRuntime`), whose ELF is `file`, CPython 3.`minor`.
pub fn layout(
    interpreter: &Path,
    file: &object::File,
    minor: u32,
) -> Result<PyAsyncLayout, AsyncioError> {
    let offsets = DebugOffsets::read(file).ok().flatten();
    if offsets.as_ref().is_some_and(|d| d.free_threaded) {
        return Err(AsyncioError::FreeThreaded);
    }
    if (11..=13).contains(&minor) {
        return legacy(minor).ok_or(AsyncioError::TooOld);
    }
    let offsets = offsets
        .filter(|d| d.minor() >= 14)
        .ok_or(AsyncioError::TooOld)?;
    let (path, words) = match section_words(file) {
        Some(w) => (interpreter.to_owned(), w),
        None => extension(interpreter, offsets.minor())?,
    };
    let debug = |name: &str| {
        offsets
            .get(name)
            .filter(|_| name.ends_with("ob_type") || offsets.plausible(name))
            .and_then(|v| u32::try_from(v).ok())
    };
    let yield_from: i8 = if offsets.minor() == 14 { -1 } else { 2 };
    let layout = build(debug, &words).map_err(|field| AsyncioError::Implausible { path, field })?;
    Ok(PyAsyncLayout {
        yield_from_state: u32::from(yield_from as u8),
        ..layout
    })
}

/// The layout from the section's words and the interpreter's offsets (`debug`), each
/// checked to lie inside its struct: the section is data of a file a user may write.
fn build(debug: impl Fn(&str) -> Option<u32>, w: &[u64]) -> Result<PyAsyncLayout, &'static str> {
    let within = |i: usize, size: usize, name: &'static str| -> Result<u32, &'static str> {
        match u32::try_from(w[i]) {
            Ok(v) if w[i] + 8 <= w[size] && w[size] < 1 << 20 => Ok(v),
            _ => Err(name),
        }
    };
    let debug = |name: &'static str| debug(name).ok_or(name);
    Ok(PyAsyncLayout {
        tstate_running_loop: within(THREAD_RUNNING_LOOP, THREAD_SIZE, "running loop")?,
        tstate_running_task: within(THREAD_RUNNING_TASK, THREAD_SIZE, "running task")?,
        task_coro: within(TASK_CORO, TASK_SIZE, "task coro")?,
        task_name: within(TASK_NAME, TASK_SIZE, "task name")?,
        task_awaited_by: within(TASK_AWAITED_BY, TASK_SIZE, "task awaited_by")?,
        task_awaited_by_is_set: within(TASK_AWAITED_BY_IS_SET, TASK_SIZE, "awaited_by_is_set")?,
        gen_iframe: debug("gen_object.gi_iframe")?,
        gen_frame_state: debug("gen_object.gi_frame_state")?,
        frame_stackpointer: debug("interpreter_frame.stackpointer")?,
        ob_type: debug("pyobject.ob_type")?,
        set_table: debug("set_object.table")?,
        set_mask: debug("set_object.mask")?,
        ..PyAsyncLayout::default()
    })
}

/// 3.11–3.13's private layouts (x86-64 release builds; each field found in a running
/// interpreter of each version by the object it must hold): `_PyInterpreterFrame`'s
/// `stacktop` and `localsplus`, the coroutine's embedded frame and `gi_frame_state`, the C
/// future's `fut_callback0`/`fut_callbacks` and the C task's `task_fut_waiter`, `task_coro`
/// and `task_name` (3.13 dropped two of the future's fields), `co_flags`,
/// `PyFunctionObject.func_closure` and the cell of `gather`'s `_done_callback` holding
/// its future, and `events.Handle._callback` (its `__slots__`, stored
/// sorted: `_args` first). A suspended coroutine's `gi_frame_state` is -1 on each (3.13
/// names it `FRAME_SUSPENDED_YIELD_FROM`; 3.11/3.12 use it for any suspension, and the
/// awaited object's type tells an `await` apart).
fn legacy(minor: u32) -> Option<PyAsyncLayout> {
    let (gen_iframe, gen_frame_state, task_fut_waiter) = match minor {
        11 => (80, 75, 128),
        12 => (72, 67, 128),
        13 => (72, 67, 112),
        _ => return None,
    };
    Some(PyAsyncLayout {
        task_coro: task_fut_waiter + 8,
        task_name: task_fut_waiter + 16,
        gen_iframe,
        gen_frame_state,
        frame_stackpointer: 64,
        ob_type: 8,
        yield_from_state: u32::from(-1i8 as u8),
        legacy: 1,
        frame_localsplus: 72,
        code_flags: 48,
        handle_callback: 24,
        fut_callback0: 24,
        fut_callbacks: 40,
        task_fut_waiter,
        func_closure: 72,
        // `children`, `nfinished`, `nfuts`, `outer`, `return_exceptions` on each.
        gather_outer: 3,
        ..PyAsyncLayout::default()
    })
}

fn section_words(file: &object::File) -> Option<Vec<u64>> {
    let data = file.section_by_name(".AsyncioDebug")?.data().ok()?;
    (data.len() >= SECTION_WORDS * 8).then(|| {
        data.chunks_exact(8)
            .take(SECTION_WORDS)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect()
    })
}

/// The `_asyncio` extension of the interpreter at `interpreter`: in `lib-dynload` of its
/// prefix (`PREFIX/bin/python3.N`, `PREFIX/lib/libpython3.N.so`, or Debian's
/// `PREFIX/lib/<triplet>/libpython3.N.so`).
fn extension(interpreter: &Path, minor: u32) -> Result<(PathBuf, Vec<u64>), AsyncioError> {
    let dir = interpreter.parent().unwrap_or(Path::new("/"));
    let lib = format!("python3.{minor}/lib-dynload");
    let candidates = [
        dir.join("..").join("lib").join(&lib),
        dir.join("..").join("lib64").join(&lib),
        dir.join(&lib),
        dir.join("..").join(&lib),
    ];
    let prefix = format!("_asyncio.cpython-3{minor}");
    for d in candidates {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if !(name.starts_with(&prefix) && name.ends_with(".so")) {
                continue;
            }
            let path = e.path();
            let Ok(data) = crate::binary::map(&path) else {
                continue;
            };
            let words = object::File::parse(&*data)
                .ok()
                .and_then(|f| section_words(&f));
            if let Some(w) = words {
                return Ok((path, w));
            }
        }
    }
    Err(AsyncioError::NoModule(interpreter.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_past_their_struct_are_refused() {
        let mut w = vec![0u64; SECTION_WORDS];
        w[TASK_SIZE] = 200;
        w[THREAD_SIZE] = 1000;
        w[TASK_CORO] = 500;
        assert_eq!(build(|_| Some(8), &w), Err("task coro"));
        w[TASK_CORO] = 100;
        let l = build(|_| Some(8), &w).unwrap();
        assert_eq!(l.task_coro, 100);
        assert_eq!(
            build(|n| (n != "set_object.mask").then_some(8), &w),
            Err("set_object.mask")
        );
        w[THREAD_SIZE] = 1 << 40;
        assert!(build(|_| Some(8), &w).is_err());
    }
}
