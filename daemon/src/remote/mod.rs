//! Serving over TCP: TLS always (plaintext only when forced, on loopback), clients
//! authenticated by certificate (mTLS, the default) or bearer token, and allowed what the
//! access policy grants them.

pub mod gate;
pub mod policy;
pub mod trusted;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use tonic::{
    transport::{Certificate, Identity, ServerTlsConfig},
    Request, Status,
};

pub use policy::{Grant, Policy, Role};

/// How TCP clients prove who they are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Auth {
    /// A client certificate signed by `--client-ca` (mutual TLS).
    #[default]
    Mtls,
    /// `authorization: Bearer TOKEN`, over server-only TLS.
    Token,
}

/// `tracerd --listen` and what goes with it, as given.
#[derive(Clone, Debug, Default)]
pub struct ListenOptions {
    pub listen: String,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub client_ca: Option<PathBuf>,
    pub auth: Auth,
    pub access: Option<PathBuf>,
    /// Serve without TLS; only on a loopback address (tests).
    pub insecure_plaintext: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("--listen wants tcp://HOST:PORT, got '{0}'")]
    BadListen(String),
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Read(#[from] trusted::TrustedFileError),
    #[error(transparent)]
    Policy(#[from] policy::PolicyError),
    #[error("TLS: {0}")]
    Tls(#[from] tonic::transport::Error),
}

/// A resolved TCP listener: where, with which TLS, and who may do what.
pub struct Tcp {
    pub addr: SocketAddr,
    pub tls: Option<ServerTlsConfig>,
    pub remote: Arc<Remote>,
}

impl ListenOptions {
    pub fn resolve(&self) -> Result<Tcp, RemoteError> {
        let addr: SocketAddr = self
            .listen
            .strip_prefix("tcp://")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| RemoteError::BadListen(self.listen.clone()))?;
        let config = |s: &str| RemoteError::Config(s.to_owned());
        let access = self.access.as_deref().ok_or_else(|| {
            config("--listen needs --access FILE: the policy naming the clients that may connect and what they may do")
        })?;
        let policy = Policy::load(access)?;
        let tls = if self.insecure_plaintext {
            if !addr.ip().is_loopback() {
                return Err(config(
                    "--insecure-plaintext serves only on a loopback address; elsewhere use --tls-cert and --tls-key",
                ));
            }
            if self.auth == Auth::Mtls || self.tls_cert.is_some() || self.client_ca.is_some() {
                return Err(config(
                    "--insecure-plaintext has no TLS: it goes with --auth token only",
                ));
            }
            None
        } else {
            let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
                return Err(config(
                    "--listen serves TLS only: give --tls-cert and --tls-key (or --insecure-plaintext on loopback, for tests)",
                ));
            };
            // A handshake that never ends would hold its connection (and a task) until the
            // connection's own deadline; this ends it sooner.
            let mut tls = ServerTlsConfig::new()
                .identity(Identity::from_pem(read(cert)?, read(key)?))
                .timeout(crate::conn::tcp::AUTHENTICATE_WITHIN);
            match (self.auth, &self.client_ca) {
                (Auth::Mtls, Some(ca)) => {
                    tls = tls.client_ca_root(Certificate::from_pem(read(ca)?));
                }
                (Auth::Mtls, None) => {
                    return Err(config(
                        "--auth mtls (the default) needs --client-ca: the CA that signs client certificates",
                    ))
                }
                (Auth::Token, Some(_)) => {
                    return Err(config(
                        "--client-ca is for --auth mtls; token clients present no certificate",
                    ))
                }
                (Auth::Token, None) => {}
            }
            Some(tls)
        };
        let usable = match self.auth {
            Auth::Mtls => policy.has_certs(),
            Auth::Token => policy.has_tokens(),
        };
        if !usable {
            return Err(config(match self.auth {
                Auth::Mtls => "the access policy names no client by cert: nobody could connect with --auth mtls",
                Auth::Token => "the access policy names no client by token_sha256: nobody could connect with --auth token",
            }));
        }
        Ok(Tcp {
            addr,
            tls,
            remote: Arc::new(Remote {
                policy,
                auth: self.auth,
            }),
        })
    }
}

fn read(path: &Path) -> Result<Vec<u8>, RemoteError> {
    Ok(trusted::read(path)?)
}

/// Identifies TCP callers.
pub struct Remote {
    policy: Policy,
    auth: Auth,
}

impl Remote {
    pub fn identify<T>(&self, req: &Request<T>) -> Result<Arc<Grant>, Status> {
        self.identify_parts(req.metadata().as_ref(), req.extensions())
    }

    /// Identifies a caller by what its request's headers and connection say: the gate does
    /// it before a request's body is read.
    pub fn identify_parts(
        &self,
        headers: &tonic::codegen::http::HeaderMap,
        extensions: &tonic::codegen::http::Extensions,
    ) -> Result<Arc<Grant>, Status> {
        match self.auth {
            Auth::Mtls => {
                // TLS has already checked the chain against --client-ca.
                let certs = crate::conn::tcp::peer_certs(extensions).ok_or_else(|| {
                    Status::unauthenticated("this daemon wants a client certificate (mTLS)")
                })?;
                let cert = certs.first().ok_or_else(|| {
                    Status::unauthenticated("this daemon wants a client certificate (mTLS)")
                })?;
                let names = cert_names(cert.as_ref());
                self.policy.for_cert(&names).ok_or_else(|| {
                    Status::permission_denied(format!(
                        "client certificate {} is not in the access policy",
                        if names.is_empty() {
                            "with no name".to_owned()
                        } else {
                            format!("'{}'", names.join("', '"))
                        }
                    ))
                })
            }
            Auth::Token => {
                let header = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .ok_or_else(|| {
                        Status::unauthenticated(
                            "this daemon wants a bearer token (tracerctl --token-file)",
                        )
                    })?;
                let token = header.strip_prefix("Bearer ").ok_or_else(|| {
                    Status::unauthenticated("authorization is not 'Bearer TOKEN'")
                })?;
                self.policy
                    .for_token(token.trim())
                    .ok_or_else(|| Status::unauthenticated("unknown token"))
            }
        }
    }
}

/// A certificate's DNS names, then its subject's common names.
pub fn cert_names(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut names = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(d) = n {
                names.push((*d).to_owned());
            }
        }
    }
    for cn in cert.subject().iter_common_name() {
        if let Ok(s) = cn.as_str() {
            if !names.iter().any(|n| n == s) {
                names.push(s.to_owned());
            }
        }
    }
    names
}
