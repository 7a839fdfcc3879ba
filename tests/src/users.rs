//! The unprivileged users tests act as: `tracer-test-member`, in the group `tracer-test` that
//! tracerd's socket admits (created when missing, with groupadd/useradd, as root).

use std::{
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::PathBuf,
    process::Command,
};

use crate::{bin, Daemon};

pub const GROUP: &str = "tracer-test";
pub const MEMBER: &str = "tracer-test-member";

/// The member's uid and the group's gid; None where the tools to make them are missing.
pub fn member() -> Option<(u32, u32)> {
    if nix::unistd::Group::from_name(GROUP).ok()?.is_none() {
        Command::new("groupadd").arg(GROUP).status().ok()?;
    }
    if nix::unistd::User::from_name(MEMBER).ok()?.is_none() {
        Command::new("useradd")
            .args(["--no-create-home", "--shell", "/usr/sbin/nologin", MEMBER])
            .status()
            .ok()?;
    }
    let _ = Command::new("usermod")
        .args(["-a", "-G", GROUP, MEMBER])
        .status();
    let uid = nix::unistd::User::from_name(MEMBER).ok()??.uid.as_raw();
    let gid = nix::unistd::Group::from_name(GROUP).ok()??.gid.as_raw();
    Some((uid, gid))
}

/// `cmd` run as `uid`:`gid`.
pub fn as_user(cmd: &mut Command, uid: u32, gid: u32) -> &mut Command {
    // SAFETY: only async-signal-safe syscalls between fork and exec. Groups first, then gid,
    // then uid: each later step drops the right to do the earlier ones.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setgroups(&[nix::unistd::Gid::from_raw(gid)])?;
            nix::unistd::setgid(nix::unistd::Gid::from_raw(gid))?;
            nix::unistd::setuid(nix::unistd::Uid::from_raw(uid))?;
            Ok(())
        })
    }
}

/// tracerctl copied where any user can run it (the build tree may sit under a private home).
pub fn public_ctl(d: &Daemon) -> PathBuf {
    let path = d.dir.path().join("tracerctl");
    std::fs::copy(bin("tracerctl"), &path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}
