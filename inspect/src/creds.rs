//! Acting as another user for file access: Linux keeps file-system ids per thread.

/// (uid, gid).
pub type Ids = (u32, u32);

/// Runs `f` with this thread's file-system ids set to `owner`'s: what it makes is the
/// owner's, and the kernel lets it do only what the owner may (a root thread's file
/// capabilities are off while its fsuid is not 0). Linux keeps these ids per thread.
pub fn as_user<T>(owner: Ids, f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    if owner == (0, 0) {
        return f();
    }
    struct Back(u32, u32);
    impl Drop for Back {
        fn drop(&mut self) {
            // SAFETY: plain syscalls on this thread's own credentials.
            unsafe {
                libc::setfsuid(self.0);
                libc::setfsgid(self.1);
            }
        }
    }
    // SAFETY: as above; each returns the id before the call. An invalid id (u32::MAX)
    // changes nothing and returns the current one: how the change is checked.
    let back = unsafe {
        let gid = libc::setfsgid(owner.1) as u32;
        let uid = libc::setfsuid(owner.0) as u32;
        Back(uid, gid)
    };
    // SAFETY: as above.
    let now = unsafe {
        (
            libc::setfsuid(u32::MAX) as u32,
            libc::setfsgid(u32::MAX) as u32,
        )
    };
    if now != owner {
        drop(back);
        return Err(std::io::Error::other(format!(
            "could not act as uid {} gid {}",
            owner.0, owner.1
        )));
    }
    let out = f();
    drop(back);
    out
}
