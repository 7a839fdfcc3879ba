//! The few CPython C-API items the module uses, declared by hand from the stable ABI (abi3):
//! one build loads into every CPython 3.12+ with the GIL, and building needs no headers.

#![allow(non_snake_case, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_long, c_void, CStr};

/// The object header of GIL builds (`PyObject_HEAD`); only its address is used.
#[repr(C)]
pub struct PyObject {
    pub ob_refcnt: isize,
    pub ob_type: *mut c_void,
}

/// A `METH_FASTCALL` function: positional arguments only, as a C array.
pub type FastCall =
    unsafe extern "C" fn(*mut PyObject, *const *mut PyObject, isize) -> *mut PyObject;
pub const METH_FASTCALL: c_int = 0x80;
/// `PYTHON_ABI_VERSION`: what `PyModule_Create` passes under the limited API.
pub const PYTHON_ABI_VERSION: c_int = 3;

#[repr(C)]
pub struct PyMethodDef {
    pub ml_name: *const c_char,
    pub ml_meth: Option<FastCall>,
    pub ml_flags: c_int,
    pub ml_doc: *const c_char,
}

impl PyMethodDef {
    pub const fn fastcall(name: &'static CStr, f: FastCall, doc: &'static CStr) -> Self {
        Self {
            ml_name: name.as_ptr(),
            ml_meth: Some(f),
            ml_flags: METH_FASTCALL,
            ml_doc: doc.as_ptr(),
        }
    }

    pub const END: Self = Self {
        ml_name: std::ptr::null(),
        ml_meth: None,
        ml_flags: 0,
        ml_doc: std::ptr::null(),
    };
}

#[repr(C)]
pub struct PyModuleDefBase {
    pub ob_refcnt: isize,
    pub ob_type: *mut c_void,
    pub m_init: Option<unsafe extern "C" fn() -> *mut PyObject>,
    pub m_index: isize,
    pub m_copy: *mut PyObject,
}

/// `PyModuleDef_HEAD_INIT`.
pub const PY_MODULE_DEF_HEAD_INIT: PyModuleDefBase = PyModuleDefBase {
    ob_refcnt: 1,
    ob_type: std::ptr::null_mut(),
    m_init: None,
    m_index: 0,
    m_copy: std::ptr::null_mut(),
};

#[repr(C)]
pub struct PyModuleDef {
    pub m_base: PyModuleDefBase,
    pub m_name: *const c_char,
    pub m_doc: *const c_char,
    pub m_size: isize,
    pub m_methods: *mut PyMethodDef,
    pub m_slots: *mut c_void,
    pub m_traverse: *mut c_void,
    pub m_clear: *mut c_void,
    pub m_free: *mut c_void,
}

unsafe extern "C" {
    pub fn PyModule_Create2(def: *mut PyModuleDef, apiver: c_int) -> *mut PyObject;
    pub fn Py_IncRef(o: *mut PyObject);
    pub fn Py_DecRef(o: *mut PyObject);
    pub fn PyObject_GetAttrString(o: *mut PyObject, name: *const c_char) -> *mut PyObject;
    pub fn PyUnicode_AsUTF8AndSize(o: *mut PyObject, size: *mut isize) -> *const c_char;
    pub fn PyLong_AsLong(o: *mut PyObject) -> c_long;
    pub fn PyLong_FromLong(v: c_long) -> *mut PyObject;
    pub fn PyBool_FromLong(v: c_long) -> *mut PyObject;
    pub fn PyErr_Occurred() -> *mut PyObject;
    pub fn PyErr_Clear();
    pub fn PyErr_SetString(exc: *mut PyObject, msg: *const c_char);
    pub static mut PyExc_RuntimeError: *mut PyObject;
    pub static mut PyExc_ImportError: *mut PyObject;
    pub static mut _Py_NoneStruct: PyObject;
}

/// A new reference to None.
///
/// # Safety
/// The GIL is held.
pub unsafe fn none() -> *mut PyObject {
    let none = &raw mut _Py_NoneStruct;
    // SAFETY: None lives as long as the interpreter; the caller holds the GIL.
    unsafe { Py_IncRef(none) };
    none
}

/// Raises RuntimeError(`msg`); returns the NULL a failing function returns.
///
/// # Safety
/// The GIL is held.
pub unsafe fn raise(msg: &str) -> *mut PyObject {
    // Interior NULs cannot come from our own messages; drop them rather than fail.
    let msg = std::ffi::CString::new(msg.replace('\0', "")).unwrap_or_default();
    // SAFETY: the exception type is a live static of the interpreter; GIL held.
    unsafe { PyErr_SetString(PyExc_RuntimeError, msg.as_ptr()) };
    std::ptr::null_mut()
}

/// The UTF-8 bytes of a str (borrowed from the object, which caches them), or None with no
/// error left set.
///
/// # Safety
/// The GIL is held and `o` is a live object that outlives the returned slice.
pub unsafe fn utf8<'a>(o: *mut PyObject) -> Option<&'a [u8]> {
    let mut len = 0isize;
    // SAFETY: GIL held; a non-str sets an error, which is cleared below.
    let p = unsafe { PyUnicode_AsUTF8AndSize(o, &mut len) };
    if p.is_null() || len < 0 {
        // SAFETY: GIL held.
        unsafe { PyErr_Clear() };
        return None;
    }
    // SAFETY: CPython keeps `len` bytes at `p` for as long as the str lives.
    Some(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len as usize) })
}
