//! Naming what the kernel side sends as raw addresses, once per unique address: native
//! frames with blazesym (kept per build id, on a thread of its own) and PLT stubs, Python
//! frames from their code objects; and a sample's copied user stack unwound (`.eh_frame`)
//! into the frames a profile holds. Knows no session.

mod stacks;
mod symbolize;

pub use stacks::{python_location, Captured, Named, Naming, RawStack, Renumbered, Resolver};
pub use symbolize::{Sym, Symbolizer};
