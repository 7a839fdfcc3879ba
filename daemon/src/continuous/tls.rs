//! TLS for pushes (`https://`, `parcas://`, `otlps://`): the endpoint's certificate checked
//! against the CA the session gave (else the system's roots), and a client certificate where
//! the endpoint asks for one. The PEMs come in the start request (tracerctl reads them as
//! its user: tracerd opens no file a caller names).

use std::sync::Arc;

use rustls_pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls;

/// What a session gave for TLS, checked.
#[derive(Clone)]
pub struct Tls {
    ca: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
    rustls: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca", &self.ca.is_some())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

impl PartialEq for Tls {
    fn eq(&self, other: &Self) -> bool {
        self.ca == other.ca && self.identity == other.identity
    }
}

impl Eq for Tls {}

impl Tls {
    /// From PEM text: a CA (empty: the system's roots), and a client certificate and key
    /// (both or neither).
    pub fn new(ca: &[u8], cert: &[u8], key: &[u8]) -> Result<Self, String> {
        let mut roots = rustls::RootCertStore::empty();
        if ca.is_empty() {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err("no CA was given for the push endpoint (--push-ca) and the system has no root certificates".into());
            }
        } else {
            let certs = certificates(ca, "the push CA")?;
            for c in certs {
                roots.add(c).map_err(|e| format!("the push CA: {e}"))?;
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots);
        let identity = match (cert.is_empty(), key.is_empty()) {
            (true, true) => None,
            (false, false) => Some((cert.to_vec(), key.to_vec())),
            _ => return Err("a client certificate needs its key, and a key its certificate (--push-cert with --push-key)".into()),
        };
        let config = match &identity {
            None => builder.with_no_client_auth(),
            Some((c, k)) => {
                let key = PrivateKeyDer::from_pem_slice(k)
                    .map_err(|e| format!("the push client key: {e}"))?;
                builder
                    .with_client_auth_cert(certificates(c, "the push client certificate")?, key)
                    .map_err(|e| format!("the push client certificate: {e}"))?
            }
        };
        Ok(Tls {
            ca: (!ca.is_empty()).then(|| ca.to_vec()),
            identity,
            rustls: Arc::new(config),
        })
    }

    /// tonic's settings for a gRPC endpoint at `host`.
    pub fn grpc(&self, host: &str) -> tonic::transport::ClientTlsConfig {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let mut c = ClientTlsConfig::new().domain_name(host);
        c = match &self.ca {
            Some(ca) => c.ca_certificate(Certificate::from_pem(ca)),
            None => c.with_native_roots(),
        };
        if let Some((cert, key)) = &self.identity {
            c = c.identity(Identity::from_pem(cert, key));
        }
        c
    }

    /// A TLS stream to `host` over `tcp`.
    pub async fn connect(
        &self,
        host: &str,
        tcp: tokio::net::TcpStream,
    ) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| format!("{host} is no TLS server name: {e}"))?;
        tokio_rustls::TlsConnector::from(self.rustls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {host}: {e}"))
    }
}

fn certificates(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{what}: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{what} holds no PEM certificate"));
    }
    Ok(certs)
}

/// The host of `HOST:PORT` (`[v6]:PORT` too).
pub fn host_of(authority: &str) -> &str {
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}
