//! Who may do what, from the caller's credentials (SO_PEERCRED on the Unix socket).

use crate::{error::Error, process};

/// The client behind a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    /// None: no credentials (a TCP client).
    pub uid: Option<u32>,
}

impl Caller {
    pub const ROOT: Caller = Caller { uid: Some(0) };

    pub fn is_root(self) -> bool {
        self.uid == Some(0)
    }

    fn uid(self, action: &str) -> Result<u32, Error> {
        self.uid.ok_or_else(|| Error::PermissionDenied {
            reason: format!(
                "{action} needs the caller's credentials, which only the Unix socket carries"
            ),
        })
    }

    /// Root may trace anything; another user only processes whose uids are all its own.
    pub fn may_trace_pid(self, pid: u32) -> Result<(), Error> {
        let uid = self.uid("tracing a process")?;
        if uid == 0 {
            return Ok(());
        }
        let uids = process::uids(pid).map_err(|_| Error::NoSuchProcess { pid })?;
        if uids.iter().all(|&u| u == uid) {
            Ok(())
        } else {
            Err(Error::PermissionDenied {
                reason: format!(
                    "uid {uid} may not trace pid {pid}, which runs as uid {}",
                    uids[0]
                ),
            })
        }
    }

    pub fn may_trace_all(self) -> Result<(), Error> {
        match self.uid("a system-wide session")? {
            0 => Ok(()),
            uid => Err(Error::PermissionDenied {
                reason: format!(
                    "only root may start system-wide (--all) sessions; caller is uid {uid}"
                ),
            }),
        }
    }

    /// Stopping a session or reading its report: its owner, or root.
    pub fn may_access(self, owner: u32, id: &str) -> Result<(), Error> {
        match self.uid {
            Some(0) => Ok(()),
            Some(uid) if uid == owner => Ok(()),
            _ => Err(Error::PermissionDenied {
                reason: format!("session {id} belongs to uid {owner}"),
            }),
        }
    }

    /// Whether a listing shows this caller a session.
    pub fn sees(self, owner: u32) -> bool {
        self.uid.is_some_and(|uid| uid == 0 || uid == owner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_root_users_are_confined() {
        let user = Caller { uid: Some(1000) };
        assert!(user.may_trace_all().is_err());
        assert!(Caller::ROOT.may_trace_all().is_ok());
        // pid 1 runs as root.
        assert!(matches!(
            user.may_trace_pid(1),
            Err(Error::PermissionDenied { .. })
        ));
        assert!(user.may_access(1000, "x").is_ok());
        assert!(user.may_access(1001, "x").is_err());
        assert!(Caller::ROOT.may_access(1001, "x").is_ok());
        let tcp = Caller { uid: None };
        assert!(tcp.may_trace_pid(1).is_err());
        assert!(!tcp.sees(0));
    }
}
