//! Where continuous profiles go, and how each kind of endpoint is spoken to:
//! - `http://HOST:PORT[/PREFIX]`: Pyroscope's `push.v1.PusherService/Push` Connect API
//!   (Grafana Pyroscope, Alloy's `pyroscope.receive_http`), protobuf over HTTP/1.1;
//! - `parca://HOST:PORT`: Parca's `ProfileStoreService/WriteRaw`, gRPC without TLS;
//! - `otlp://HOST:PORT`: OpenTelemetry's `ProfilesService/Export` (an OTLP collector, or any
//!   receiver of the profiles signal), gRPC without TLS.
//!
//! Pyroscope and Parca take a set of series, each a label set and a gzipped pprof; OTLP one
//! request whose resources are the processes (`tracer_report::export::otlp`).

use std::time::Duration;

use opentelemetry_proto::tonic::collector::profiles::v1development as otlp;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TIMEOUT: Duration = Duration::from_secs(10);
const PARCA_WRITE_RAW: &str = "/parca.profilestore.v1alpha1.ProfileStoreService/WriteRaw";
const OTLP_EXPORT: &str =
    "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export";

/// The endpoints' messages, with prost's derive: Pyroscope's push/v1 and types/v1, Parca's
/// profilestore/v1alpha1 (only the fields tracer fills).
mod pb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PushRequest {
        #[prost(message, repeated, tag = "1")]
        pub series: Vec<RawProfileSeries>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RawProfileSeries {
        #[prost(message, repeated, tag = "1")]
        pub labels: Vec<LabelPair>,
        #[prost(message, repeated, tag = "2")]
        pub samples: Vec<RawSample>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RawSample {
        #[prost(bytes = "vec", tag = "1")]
        pub raw_profile: Vec<u8>,
        #[prost(string, tag = "2")]
        pub id: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LabelPair {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub value: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WriteRawRequest {
        #[prost(message, repeated, tag = "2")]
        pub series: Vec<ParcaSeries>,
        #[prost(bool, tag = "3")]
        pub normalized: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ParcaSeries {
        #[prost(message, optional, tag = "1")]
        pub labels: Option<LabelSet>,
        #[prost(message, repeated, tag = "2")]
        pub samples: Vec<ParcaSample>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LabelSet {
        #[prost(message, repeated, tag = "1")]
        pub labels: Vec<LabelPair>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ParcaSample {
        #[prost(bytes = "vec", tag = "1")]
        pub raw_profile: Vec<u8>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WriteRawResponse {}
}

/// One series of a window: sorted labels and a gzipped pprof.
pub struct Series {
    pub labels: Vec<(String, String)>,
    pub pprof: Vec<u8>,
    pub id: String,
}

/// Where pushes go: the kind of endpoint, its `HOST:PORT`, and TLS where the scheme asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub kind: Kind,
    pub authority: String,
    pub tls: Option<super::tls::Tls>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Pyroscope { path: String },
    Parca,
    Otlp,
}

/// The schemes, plaintext and TLS.
const SCHEMES: [(&str, &str); 3] = [
    ("http://", "https://"),
    ("parca://", "parcas://"),
    ("otlp://", "otlps://"),
];

fn authority_of<'a>(rest: &'a str, url: &str) -> Result<(&'a str, &'a str), String> {
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    if authority.is_empty() || !authority.contains(':') {
        return Err(format!(
            "the push endpoint needs a host and port, got '{url}'"
        ));
    }
    Ok((authority, path))
}

impl Endpoint {
    /// `url`, with the TLS settings the session gave (`tls`: CA, client certificate and key
    /// PEMs; all empty: none given).
    pub fn parse(url: &str, tls: [&[u8]; 3]) -> Result<Self, String> {
        let given = tls.iter().any(|t| !t.is_empty());
        for (n, (plain, with_tls)) in SCHEMES.into_iter().enumerate() {
            let (rest, secure) = match (url.strip_prefix(plain), url.strip_prefix(with_tls)) {
                (Some(rest), _) => (rest, false),
                (_, Some(rest)) => (rest, true),
                _ => continue,
            };
            let (authority, path) = authority_of(rest, url)?;
            let kind = match n {
                0 => {
                    let prefix = path.trim_end_matches('/');
                    Kind::Pyroscope {
                        path: if prefix.is_empty() {
                            "/push.v1.PusherService/Push".into()
                        } else {
                            format!("/{prefix}/push.v1.PusherService/Push")
                        },
                    }
                }
                _ if !path.is_empty() => {
                    return Err(format!(
                        "a {plain} or {with_tls} endpoint is HOST:PORT only, got '{url}'"
                    ))
                }
                1 => Kind::Parca,
                _ => Kind::Otlp,
            };
            if given && !secure {
                return Err(format!(
                    "--push-ca, --push-cert and --push-key are for TLS endpoints ({with_tls}), got '{url}'"
                ));
            }
            let tls = match secure {
                true => Some(super::tls::Tls::new(tls[0], tls[1], tls[2])?),
                false => None,
            };
            return Ok(Endpoint {
                kind,
                authority: authority.to_owned(),
                tls,
            });
        }
        Err(format!("the push endpoint must be http[s]://HOST:PORT (Pyroscope), parca[s]://HOST:PORT or otlp[s]://HOST:PORT, got '{url}'"))
    }

    /// The request body for these series (Pyroscope and Parca; OTLP's is made whole by
    /// `tracer_report::export::otlp`).
    pub fn encode(&self, series: Vec<Series>) -> Vec<u8> {
        let labels = |l: Vec<(String, String)>| {
            l.into_iter()
                .map(|(name, value)| pb::LabelPair { name, value })
                .collect()
        };
        match self.kind {
            Kind::Pyroscope { .. } => pb::PushRequest {
                series: series
                    .into_iter()
                    .map(|s| pb::RawProfileSeries {
                        labels: labels(s.labels),
                        samples: vec![pb::RawSample {
                            raw_profile: s.pprof,
                            id: s.id,
                        }],
                    })
                    .collect(),
            }
            .encode_to_vec(),
            Kind::Parca | Kind::Otlp => pb::WriteRawRequest {
                series: series
                    .into_iter()
                    .map(|s| pb::ParcaSeries {
                        labels: Some(pb::LabelSet {
                            labels: labels(s.labels),
                        }),
                        samples: vec![pb::ParcaSample {
                            raw_profile: s.pprof,
                        }],
                    })
                    .collect(),
                normalized: false,
            }
            .encode_to_vec(),
        }
    }

    /// Sends one encoded request; Err says why it was not taken.
    pub async fn post(&self, body: &[u8]) -> Result<(), String> {
        let attempt = async {
            match &self.kind {
                Kind::Pyroscope { path } => self.post_http(path, body).await,
                Kind::Parca => {
                    let req = pb::WriteRawRequest::decode(body)
                        .map_err(|e| format!("re-reading a request: {e}"))?;
                    self.unary::<_, pb::WriteRawResponse>(PARCA_WRITE_RAW, req)
                        .await
                        .map(drop)
                }
                Kind::Otlp => self.export(body).await,
            }
        };
        let authority = &self.authority;
        tokio::time::timeout(TIMEOUT, attempt)
            .await
            .unwrap_or_else(|_| Err(format!("{authority} did not answer within {TIMEOUT:?}")))
    }

    /// OTLP's export; a receiver that takes the request but rejects profiles in it says so
    /// in its answer (`partial_success`), which counts as a failed push.
    async fn export(&self, body: &[u8]) -> Result<(), String> {
        let req = otlp::ExportProfilesServiceRequest::decode(body)
            .map_err(|e| format!("re-reading a request: {e}"))?;
        let answer = self
            .unary::<_, otlp::ExportProfilesServiceResponse>(OTLP_EXPORT, req)
            .await?;
        match answer.partial_success {
            Some(p) if p.rejected_profiles > 0 || !p.error_message.is_empty() => Err(format!(
                "{} rejected {} profiles: {}",
                self.authority, p.rejected_profiles, p.error_message
            )),
            _ => Ok(()),
        }
    }

    /// One unary gRPC call to `path`.
    async fn unary<Req, Resp>(&self, path: &'static str, req: Req) -> Result<Resp, String>
    where
        Req: Message + Send + Sync + 'static,
        Resp: Message + Default + Send + Sync + 'static,
    {
        let authority = &self.authority;
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint =
            tonic::transport::Endpoint::from_shared(format!("{scheme}://{authority}"))
                .map_err(|e| format!("{authority}: {e}"))?;
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.grpc(super::tls::host_of(authority)))
                .map_err(|e| format!("TLS for {authority}: {e}"))?;
        }
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| format!("connecting to {authority}: {}", chain(&e)))?;
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready()
            .await
            .map_err(|e| format!("connecting to {authority}: {e}"))?;
        grpc.unary(
            tonic::Request::new(req),
            tonic::codegen::http::uri::PathAndQuery::from_static(path),
            tonic_prost::ProstCodec::<Req, Resp>::default(),
        )
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("{authority} answered {:?}: {}", s.code(), s.message()))
    }

    /// Pyroscope's Connect API: one HTTP/1.1 POST, over TLS where asked.
    async fn post_http(&self, path: &str, body: &[u8]) -> Result<(), String> {
        let authority = &self.authority;
        let tcp = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| format!("connecting to {authority}: {e}"))?;
        match &self.tls {
            Some(tls) => {
                let conn = tls.connect(super::tls::host_of(authority), tcp).await?;
                post_on(conn, authority, path, body).await
            }
            None => post_on(tcp, authority, path, body).await,
        }
    }
}

/// An error with its causes (a TLS refusal sits under "transport error").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

async fn post_on(
    mut conn: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    authority: &str,
    path: &str,
    body: &[u8],
) -> Result<(), String> {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/proto\r\nConnect-Protocol-Version: 1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes())
        .await
        .and(conn.write_all(body).await)
        .map_err(|e| format!("sending to {authority}: {e}"))?;
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    while !reply.windows(2).any(|w| w == b"\r\n") {
        match conn.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("reading the reply of {authority}: {e}")),
        }
    }
    let line = String::from_utf8_lossy(&reply);
    let line = line.lines().next().unwrap_or("");
    match line.split_whitespace().nth(1) {
        Some(code) if code.starts_with('2') => Ok(()),
        _ => Err(format!("{authority} answered '{line}'")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: [&[u8]; 3] = [b"", b"", b""];

    #[test]
    fn endpoints_parse() {
        let e = Endpoint::parse("http://pyroscope:4040", NONE).unwrap();
        assert_eq!(e.authority, "pyroscope:4040");
        assert_eq!(
            e.kind,
            Kind::Pyroscope {
                path: "/push.v1.PusherService/Push".into()
            }
        );
        assert!(e.tls.is_none());
        let e = Endpoint::parse("http://h:1/prefix/", NONE).unwrap();
        assert_eq!(
            e.kind,
            Kind::Pyroscope {
                path: "/prefix/push.v1.PusherService/Push".into()
            }
        );
        assert_eq!(
            Endpoint::parse("parca://p:7070", NONE).unwrap().kind,
            Kind::Parca
        );
        assert_eq!(
            Endpoint::parse("otlp://c:4317", NONE).unwrap().kind,
            Kind::Otlp
        );
        assert!(Endpoint::parse("h:1", NONE).is_err());
        assert!(Endpoint::parse("http://h", NONE).is_err());
        assert!(Endpoint::parse("parca://h:1/x", NONE).is_err());
        assert!(Endpoint::parse("otlp://c", NONE).is_err());
    }

    #[test]
    fn tls_is_for_tls_schemes_and_checks_its_pems() {
        let e = Endpoint::parse("http://h:1", [b"x", b"", b""]).unwrap_err();
        assert!(e.contains("https://"), "{e}");
        let e = Endpoint::parse("otlps://c:4317", [b"not pem", b"", b""]).unwrap_err();
        assert!(e.contains("push CA"), "{e}");
        let e = Endpoint::parse("parcas://c:1", [b"", b"cert", b""]).unwrap_err();
        assert!(e.contains("--push-key"), "{e}");
        assert_eq!(super::super::tls::host_of("[::1]:4317"), "::1");
        assert_eq!(super::super::tls::host_of("collector:4317"), "collector");
    }
}
