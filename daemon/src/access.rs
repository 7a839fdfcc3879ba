//! Who may do what: from the caller's credentials on the Unix socket (SO_PEERCRED), or from
//! the access policy's grant for a TCP client.

use std::sync::Arc;

use crate::{
    error::Error,
    remote::{Grant, Role},
};
use tracer_inspect::process;

/// The client behind a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The Unix socket peer's uid; None over TCP.
    pub uid: Option<u32>,
    /// The Unix socket peer's pid (when the kernel could name it); None over TCP.
    pub pid: Option<u32>,
    /// A TCP client's grant from the access policy.
    pub remote: Option<Arc<Grant>>,
}

impl Caller {
    pub const ROOT: Caller = Caller {
        uid: Some(0),
        pid: None,
        remote: None,
    };

    pub fn local(uid: u32) -> Self {
        Caller {
            uid: Some(uid),
            pid: None,
            remote: None,
        }
    }

    pub fn remote(grant: Arc<Grant>) -> Self {
        Caller {
            uid: None,
            pid: None,
            remote: Some(grant),
        }
    }

    /// Who it is, for logs.
    pub fn describe(&self) -> String {
        match (&self.remote, self.uid) {
            (Some(g), _) => format!("client '{}'", g.name),
            (None, Some(uid)) => format!("uid {uid}"),
            (None, None) => "an anonymous client".into(),
        }
    }

    /// The local user whose rights it acts with; none for read-only clients.
    pub fn acting_uid(&self, action: &str) -> Result<u32, Error> {
        match (&self.remote, self.uid) {
            (Some(g), _) if g.role == Role::Trace => Ok(g.uid),
            (Some(g), _) => Err(Error::PermissionDenied {
                reason: format!("{action}: client '{}' may only read", g.name),
            }),
            (None, Some(uid)) => Ok(uid),
            (None, None) => Err(Error::PermissionDenied {
                reason: format!("{action} needs the caller's credentials"),
            }),
        }
    }

    /// Root may trace anything; another user only processes whose uids are all its own; a
    /// TCP client confined to cgroups only processes in them.
    pub fn may_trace_pid(&self, pid: u32) -> Result<(), Error> {
        let uid = self.acting_uid("tracing a process")?;
        if let Some(g) = self.remote.as_ref().filter(|g| !g.cgroups.is_empty()) {
            let cg = crate::container::of(pid)
                .ok_or(Error::NoSuchProcess { pid })?
                .cgroup;
            if !g.cgroups.iter().any(|prefix| under(&cg, prefix)) {
                return Err(Error::PermissionDenied {
                    reason: format!(
                        "client '{}' may not trace pid {pid}: its cgroup {cg} is not under {}",
                        g.name,
                        g.cgroups.join(", ")
                    ),
                });
            }
        }
        if uid == 0 {
            return Ok(());
        }
        match process::ptrace_boundary(pid, uid) {
            Err(_) => Err(Error::NoSuchProcess { pid }),
            Ok(None) => Ok(()),
            Ok(Some(why)) => Err(Error::PermissionDenied {
                reason: format!("uid {uid} may not trace pid {pid}: {why}"),
            }),
        }
    }

    /// Having code loaded into a process (tracer's counter: PEP 768, ptrace, a launched
    /// command's preload) is what ptrace's attach allows, which Yama restricts further than
    /// tracing with uprobes (read access): at scope 1 a user may attach only to its own
    /// descendants, at 2 only with CAP_SYS_PTRACE. tracerd holds that capability for root
    /// callers alone, so another caller's target must descend from its client process.
    pub fn may_load_into(&self, pid: u32) -> Result<(), Error> {
        self.may_trace_pid(pid)?;
        let uid = self.acting_uid("loading code into a process")?;
        yama_permits(process::yama_ptrace_scope(), uid, self.pid, pid)
            .map_err(|reason| Error::PermissionDenied { reason })
    }

    pub fn may_trace_all(&self) -> Result<(), Error> {
        let uid = self.acting_uid("a system-wide session")?;
        if let Some(g) = self.remote.as_ref().filter(|g| !g.cgroups.is_empty()) {
            return Err(Error::PermissionDenied {
                reason: format!(
                    "client '{}' is confined to cgroups and may not start system-wide (--all) sessions",
                    g.name
                ),
            });
        }
        match uid {
            0 => Ok(()),
            uid => Err(Error::PermissionDenied {
                reason: format!(
                    "only root may start system-wide (--all) sessions; caller is uid {uid}"
                ),
            }),
        }
    }

    /// Reading a session (status, report, events): its owner, root, or a read client. To
    /// anyone else it does not exist: the answer is the one for an id nobody has.
    pub fn may_read(&self, owner: u32, id: &str) -> Result<(), Error> {
        if self.sees(owner) {
            Ok(())
        } else {
            Err(Error::NoSuchSession { id: id.into() })
        }
    }

    /// Stopping a session: its owner or root.
    pub fn may_stop(&self, owner: u32, id: &str) -> Result<(), Error> {
        match self.acting_uid("stopping a session")? {
            0 => Ok(()),
            uid if uid == owner => Ok(()),
            // As for reading: not told apart from an id nobody has.
            _ if !self.sees(owner) => Err(Error::NoSuchSession { id: id.into() }),
            _ => Err(Error::PermissionDenied {
                reason: format!("session {id} belongs to uid {owner}"),
            }),
        }
    }

    /// Whether a listing shows this caller a session.
    pub fn sees(&self, owner: u32) -> bool {
        match (&self.remote, self.uid) {
            (Some(g), _) if g.role == Role::Read => true,
            (Some(g), _) => g.uid == 0 || g.uid == owner,
            (None, Some(uid)) => uid == 0 || uid == owner,
            (None, None) => false,
        }
    }
}

/// Yama's rule for `uid`, whose client is `client` (None over TCP), attaching to `pid`.
fn yama_permits(scope: u8, uid: u32, client: Option<u32>, pid: u32) -> Result<(), String> {
    match (scope, client) {
        (0, _) => Ok(()),
        // Root's requests are tracerd's own, with CAP_SYS_PTRACE; at 3 the kernel refuses all.
        (_, _) if uid == 0 => Ok(()),
        (1, Some(c)) if process::descends_from(pid, &[c]) => Ok(()),
        (1, Some(c)) => Err(format!(
            "kernel.yama.ptrace_scope is 1: uid {uid} may have code loaded only into processes its client (pid {c}) started, and pid {pid} is not one"
        )),
        (1, None) => Err(format!(
            "kernel.yama.ptrace_scope is 1: a client over TCP (uid {uid}) started no process here, so it may have code loaded into none"
        )),
        (s, _) => Err(format!(
            "kernel.yama.ptrace_scope is {s}: only root may have code loaded into a process"
        )),
    }
}

/// `cgroup` is `prefix` or lies below it (path components, not string prefixes).
fn under(cgroup: &str, prefix: &str) -> bool {
    let p = prefix.trim_end_matches('/');
    p.is_empty()
        || cgroup == p
        || cgroup
            .strip_prefix(p)
            .is_some_and(|rest| rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Yama's scopes (this kernel may have no Yama: the rule is asked with each scope), with
    /// a real child of this process and its parent, which is no descendant.
    #[test]
    fn loading_obeys_yama_as_ptrace_would() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let (me, kid) = (std::process::id(), child.id());
        let parent = process::parent(me).unwrap();
        assert_eq!(yama_permits(0, 1000, None, parent), Ok(()));
        assert_eq!(yama_permits(1, 1000, Some(me), kid), Ok(()));
        let refused = yama_permits(1, 1000, Some(me), parent).unwrap_err();
        assert!(
            refused.contains(&format!("pid {parent} is not one")),
            "{refused}"
        );
        assert!(yama_permits(1, 1000, None, kid)
            .unwrap_err()
            .contains("over TCP"));
        assert!(yama_permits(2, 1000, Some(me), kid)
            .unwrap_err()
            .contains("only root"));
        assert_eq!(yama_permits(2, 0, None, parent), Ok(()));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn non_root_users_are_confined() {
        let user = Caller::local(1000);
        assert!(user.may_trace_all().is_err());
        assert!(Caller::ROOT.may_trace_all().is_ok());
        // pid 1 runs as root.
        assert!(matches!(
            user.may_trace_pid(1),
            Err(Error::PermissionDenied { .. })
        ));
        assert!(user.may_read(1000, "x").is_ok());
        assert!(user.may_read(1001, "x").is_err());
        assert!(user.may_stop(1001, "x").is_err());
        assert!(Caller::ROOT.may_stop(1001, "x").is_ok());
    }

    fn grant(role: Role, uid: u32, cgroups: &[&str]) -> Caller {
        Caller::remote(Arc::new(Grant {
            name: "c".into(),
            role,
            uid,
            cgroups: cgroups.iter().map(|s| s.to_string()).collect(),
        }))
    }

    #[test]
    fn remote_clients_get_what_their_grant_says() {
        let reader = grant(Role::Read, u32::MAX, &[]);
        assert!(reader.sees(0) && reader.sees(1000));
        assert!(reader.may_read(0, "x").is_ok());
        assert!(reader.may_stop(0, "x").is_err());
        assert!(reader.may_trace_pid(1).is_err());
        assert!(reader.may_trace_all().is_err());

        let admin = grant(Role::Trace, 0, &[]);
        assert!(admin.may_trace_all().is_ok());
        assert!(admin.may_trace_pid(std::process::id()).is_ok());
        assert!(admin.may_stop(1000, "x").is_ok());

        let own = crate::container::of(std::process::id()).unwrap().cgroup;
        let confined = grant(Role::Trace, 0, &[&own]);
        assert!(confined.may_trace_pid(std::process::id()).is_ok());
        assert!(confined.may_trace_all().is_err());
        let elsewhere = grant(Role::Trace, 0, &["/no/such.slice"]);
        let err = elsewhere.may_trace_pid(std::process::id()).unwrap_err();
        assert!(
            err.to_string().contains("is not under /no/such.slice"),
            "{err}"
        );
    }

    #[test]
    fn cgroup_prefixes_match_whole_components() {
        assert!(under("/a/b", "/a"));
        assert!(under("/a/b", "/a/"));
        assert!(under("/a", "/a"));
        assert!(!under("/ab", "/a"));
        assert!(under("/anything", "/"));
    }
}
