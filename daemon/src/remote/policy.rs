//! The access policy for TCP clients (`tracerd --access FILE`, TOML): who each client is
//! (a client certificate's name, or a bearer token's SHA-256) and what it may do.
//!
//! ```toml
//! [[client]]
//! name = "dashboard"
//! cert = "dashboard.example.org"   # a DNS name or the subject CN of its certificate
//! role = "read"                     # list, watch and read every session's reports
//!
//! [[client]]
//! name = "alice"
//! token_sha256 = "5e88…"            # sha256sum of the token the client sends
//! role = "trace"                    # also start and stop sessions…
//! uid = 1000                        # …as this local user: root traces anything, others their own
//! cgroups = ["/user.slice/"]        # optional: only processes under these cgroups
//! ```

use std::{collections::HashMap, path::Path, sync::Arc};

use serde::Deserialize;
use sha2::{Digest, Sha256};

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Lists, watches and reads every session; starts and stops none.
    Read,
    /// Starts sessions as its `uid` and stops and reads those (all of them as uid 0).
    Trace,
}

/// What one remote client may do.
#[derive(Debug, PartialEq, Eq)]
pub struct Grant {
    pub name: String,
    pub role: Role,
    /// The local user its sessions run as (trace role).
    pub uid: u32,
    /// cgroup path prefixes of the processes it may trace; empty: any (as `uid` allows).
    pub cgroups: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("access policy {0}")]
    Read(#[from] super::trusted::TrustedFileError),
    #[error("access policy: {0}")]
    Syntax(String),
    #[error("access policy, client '{name}': {why}")]
    Client { name: String, why: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default, rename = "client")]
    clients: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    cert: Option<String>,
    token_sha256: Option<String>,
    role: Role,
    uid: Option<u32>,
    #[serde(default)]
    cgroups: Vec<String>,
}

#[derive(Debug, Default)]
pub struct Policy {
    by_cert: HashMap<String, Arc<Grant>>,
    by_token: HashMap<[u8; 32], Arc<Grant>>,
}

impl Policy {
    pub fn load(path: &Path) -> Result<Self, PolicyError> {
        Self::parse(&super::trusted::read_text(path)?)
    }

    pub fn parse(text: &str) -> Result<Self, PolicyError> {
        let file: PolicyFile =
            toml::from_str(text).map_err(|e| PolicyError::Syntax(e.message().to_owned()))?;
        let mut policy = Policy::default();
        let mut names = std::collections::HashSet::new();
        for e in file.clients {
            let bad = |why: &str| PolicyError::Client {
                name: e.name.clone(),
                why: why.to_owned(),
            };
            if !names.insert(e.name.clone()) {
                return Err(bad("named twice"));
            }
            let uid = match (e.role, e.uid) {
                (Role::Trace, Some(uid)) => uid,
                (Role::Trace, None) => {
                    return Err(bad("a trace client needs the uid its sessions run as"))
                }
                (Role::Read, None) if e.cgroups.is_empty() => u32::MAX,
                (Role::Read, _) => {
                    return Err(bad(
                        "read clients see every session: uid and cgroups are for trace clients",
                    ))
                }
            };
            if let Some(c) = e.cgroups.iter().find(|c| !c.starts_with('/')) {
                return Err(bad(&format!(
                    "cgroup '{c}' is not a path from the cgroup root"
                )));
            }
            let grant = Arc::new(Grant {
                name: e.name.clone(),
                role: e.role,
                uid,
                cgroups: e.cgroups.clone(),
            });
            match (&e.cert, &e.token_sha256) {
                (Some(cert), None) => {
                    if policy.by_cert.insert(cert.clone(), grant).is_some() {
                        return Err(bad(&format!("certificate name '{cert}' is given twice")));
                    }
                }
                (None, Some(hex)) => {
                    let digest = parse_sha256(hex).ok_or_else(|| {
                        bad("token_sha256 wants 64 hex digits (sha256sum of the token)")
                    })?;
                    if policy.by_token.insert(digest, grant).is_some() {
                        return Err(bad("the same token is given twice"));
                    }
                }
                _ => return Err(bad("give exactly one of cert and token_sha256")),
            }
        }
        Ok(policy)
    }

    /// The grant of the first of a certificate's names the policy knows.
    pub fn for_cert(&self, names: &[String]) -> Option<Arc<Grant>> {
        names.iter().find_map(|n| self.by_cert.get(n).cloned())
    }

    pub fn for_token(&self, token: &str) -> Option<Arc<Grant>> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_token.get(&digest).cloned()
    }

    pub fn has_tokens(&self) -> bool {
        !self.by_token.is_empty()
    }

    pub fn has_certs(&self) -> bool {
        !self.by_cert.is_empty()
    }
}

fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    // sha256("secret"), as `printf secret | sha256sum` prints it.
    const SECRET: &str = "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b";

    #[test]
    fn clients_are_found_by_certificate_name_or_token() {
        let p = Policy::parse(&format!(
            r#"
            [[client]]
            name = "dash"
            cert = "dash.example"
            role = "read"

            [[client]]
            name = "alice"
            token_sha256 = "{SECRET}"
            role = "trace"
            uid = 1000
            cgroups = ["/user.slice/"]
            "#
        ))
        .unwrap();
        let dash = p
            .for_cert(&["other".into(), "dash.example".into()])
            .unwrap();
        assert_eq!(dash.role, Role::Read);
        let alice = p.for_token("secret").unwrap();
        assert_eq!((alice.role, alice.uid), (Role::Trace, 1000));
        assert_eq!(alice.cgroups, ["/user.slice/"]);
        assert!(p.for_token("Secret").is_none());
        assert!(p.for_cert(&["alice".into()]).is_none());
    }

    #[test]
    fn the_kubernetes_policy_parses() {
        let yaml = include_str!("../../../deploy/kubernetes/access.yaml");
        let toml: String = yaml
            .lines()
            .skip_while(|l| !l.contains("access.toml: |"))
            .skip(1)
            .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
            .collect();
        let p = Policy::parse(&toml).unwrap();
        assert_eq!(
            p.for_cert(&["ops.tracer.internal".into()]).unwrap().role,
            Role::Trace
        );
        assert_eq!(
            p.for_cert(&["viewer.tracer.internal".into()]).unwrap().role,
            Role::Read
        );
    }

    #[test]
    fn mistakes_are_named() {
        let err = |text: &str| Policy::parse(text).unwrap_err().to_string();
        assert!(err("[[client]]\nname = 'a'\ncert = 'a'\nrole = 'trace'").contains("needs the uid"));
        assert!(
            err("[[client]]\nname = 'a'\ncert = 'a'\nrole = 'read'\nuid = 0")
                .contains("read clients see every session")
        );
        assert!(err("[[client]]\nname = 'a'\nrole = 'read'").contains("exactly one of"));
        assert!(
            err("[[client]]\nname = 'a'\ntoken_sha256 = 'ab'\nrole = 'read'")
                .contains("64 hex digits")
        );
        assert!(err("[[client]]\nname = 'a'\ncert = 'a'\nrole = 'admin'").contains("admin"));
        assert!(err("[[client]]\nname = 'a'\ncert = 'a'\nrole = 'read'\n[[client]]\nname = 'b'\ncert = 'a'\nrole = 'read'")
            .contains("given twice"));
        assert!(err(
            "[[client]]\nname = 'a'\ncert = 'a'\nrole = 'trace'\nuid = 0\ncgroups = ['x']"
        )
        .contains("not a path"));
    }
}
