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

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Pyroscope { authority: String, path: String },
    Parca { authority: String },
    Otlp { authority: String },
}

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
    pub fn parse(url: &str) -> Result<Self, String> {
        if url.starts_with("https://") {
            return Err("push endpoints over https are not supported yet: push to a local Alloy or a plain-HTTP Pyroscope".into());
        }
        for (scheme, make) in [
            (
                "parca://",
                (|authority| Endpoint::Parca { authority }) as fn(String) -> Endpoint,
            ),
            ("otlp://", |authority| Endpoint::Otlp { authority }),
        ] {
            let Some(rest) = url.strip_prefix(scheme) else {
                continue;
            };
            let (authority, path) = authority_of(rest, url)?;
            if !path.is_empty() {
                return Err(format!(
                    "a {scheme} endpoint is HOST:PORT only, got '{url}'"
                ));
            }
            return Ok(make(authority.to_owned()));
        }
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            format!("the push endpoint must be http://HOST:PORT (Pyroscope), parca://HOST:PORT or otlp://HOST:PORT, got '{url}'")
        })?;
        let (authority, prefix) = authority_of(rest, url)?;
        let prefix = prefix.trim_end_matches('/');
        Ok(Endpoint::Pyroscope {
            authority: authority.to_owned(),
            path: if prefix.is_empty() {
                "/push.v1.PusherService/Push".into()
            } else {
                format!("/{prefix}/push.v1.PusherService/Push")
            },
        })
    }

    /// The request body for these series (Pyroscope and Parca; OTLP's is made whole by
    /// `tracer_report::export::otlp`).
    pub fn encode(&self, series: Vec<Series>) -> Vec<u8> {
        let labels = |l: Vec<(String, String)>| {
            l.into_iter()
                .map(|(name, value)| pb::LabelPair { name, value })
                .collect()
        };
        match self {
            Endpoint::Pyroscope { .. } => pb::PushRequest {
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
            Endpoint::Parca { .. } | Endpoint::Otlp { .. } => pb::WriteRawRequest {
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
        let (authority, attempt) = match self {
            Endpoint::Pyroscope { authority, path } => (
                authority,
                Box::pin(post_http(authority, path, body))
                    as std::pin::Pin<
                        Box<dyn std::future::Future<Output = Result<(), String>> + Send + '_>,
                    >,
            ),
            Endpoint::Parca { authority } => (authority, Box::pin(write_raw(authority, body)) as _),
            Endpoint::Otlp { authority } => (authority, Box::pin(export(authority, body)) as _),
        };
        tokio::time::timeout(TIMEOUT, attempt)
            .await
            .unwrap_or_else(|_| Err(format!("{authority} did not answer within {TIMEOUT:?}")))
    }
}

async fn write_raw(authority: &str, body: &[u8]) -> Result<(), String> {
    let req =
        pb::WriteRawRequest::decode(body).map_err(|e| format!("re-reading a request: {e}"))?;
    unary::<_, pb::WriteRawResponse>(authority, PARCA_WRITE_RAW, req)
        .await
        .map(drop)
}

/// OTLP's export; a receiver that takes the request but rejects profiles in it says so in
/// its answer (`partial_success`), which counts as a failed push.
async fn export(authority: &str, body: &[u8]) -> Result<(), String> {
    let req = otlp::ExportProfilesServiceRequest::decode(body)
        .map_err(|e| format!("re-reading a request: {e}"))?;
    let answer =
        unary::<_, otlp::ExportProfilesServiceResponse>(authority, OTLP_EXPORT, req).await?;
    match answer.partial_success {
        Some(p) if p.rejected_profiles > 0 || !p.error_message.is_empty() => Err(format!(
            "{authority} rejected {} profiles: {}",
            p.rejected_profiles, p.error_message
        )),
        _ => Ok(()),
    }
}

/// One unary gRPC call to `path` at `authority`, without TLS.
async fn unary<Req, Resp>(authority: &str, path: &'static str, req: Req) -> Result<Resp, String>
where
    Req: Message + Send + Sync + 'static,
    Resp: Message + Default + Send + Sync + 'static,
{
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{authority}"))
        .map_err(|e| format!("{authority}: {e}"))?
        .connect()
        .await
        .map_err(|e| format!("connecting to {authority}: {e}"))?;
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

async fn post_http(authority: &str, path: &str, body: &[u8]) -> Result<(), String> {
    let mut conn = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|e| format!("connecting to {authority}: {e}"))?;
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

    #[test]
    fn endpoints_parse() {
        let e = Endpoint::parse("http://pyroscope:4040").unwrap();
        assert_eq!(
            e,
            Endpoint::Pyroscope {
                authority: "pyroscope:4040".into(),
                path: "/push.v1.PusherService/Push".into()
            }
        );
        let Endpoint::Pyroscope { path, .. } = Endpoint::parse("http://h:1/prefix/").unwrap()
        else {
            panic!()
        };
        assert_eq!(path, "/prefix/push.v1.PusherService/Push");
        assert_eq!(
            Endpoint::parse("parca://p:7070").unwrap(),
            Endpoint::Parca {
                authority: "p:7070".into()
            }
        );
        assert!(Endpoint::parse("https://h:1")
            .unwrap_err()
            .contains("https"));
        assert!(Endpoint::parse("h:1").is_err());
        assert!(Endpoint::parse("http://h").is_err());
        assert!(Endpoint::parse("parca://h:1/x").is_err());
        assert_eq!(
            Endpoint::parse("otlp://c:4317").unwrap(),
            Endpoint::Otlp {
                authority: "c:4317".into()
            }
        );
        assert!(Endpoint::parse("otlp://c").is_err());
    }
}
