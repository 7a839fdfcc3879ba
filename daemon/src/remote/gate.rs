//! What a request passes before its body is read, on both servers (after `requests`).
//!
//! Over TCP, its caller is identified from its headers and its connection (token or client
//! certificate) and refused at once when unknown, whatever the service (tracer's, health,
//! reflection): an anonymous peer gets no body buffered (up to the 4 MiB a message may
//! have, on every stream it opens), no decoding and no wait, and its connection is not
//! counted as authenticated (see `conn::tcp`). A request let through carries its caller's
//! grant (`Identified`).
//!
//! On both, a message over the size limit is answered RESOURCE_EXHAUSTED, as gRPC's own
//! servers answer it, not OUT_OF_RANGE as tonic does.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use tonic::{
    body::Body,
    codegen::{http, Service},
    Status,
};

use super::{Grant, Remote};
use crate::conn::Refusals;

/// A TCP caller the gate identified, in its request's extensions.
#[derive(Clone, Debug)]
pub struct Identified(pub Arc<Grant>);

#[derive(Clone, Default)]
pub struct Gate {
    /// How TCP callers are identified; None where nothing is served on TCP.
    remote: Option<Arc<Remote>>,
}

impl Gate {
    pub fn new(remote: Option<Arc<Remote>>) -> Self {
        Gate { remote }
    }
}

impl<S> tower::Layer<S> for Gate {
    type Service = Gated<S>;

    fn layer(&self, inner: S) -> Gated<S> {
        Gated {
            inner,
            remote: self.remote.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Gated<S> {
    inner: S,
    remote: Option<Arc<Remote>>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// Refused TCP requests, logged a few at a time.
static REFUSED: Mutex<Refusals> = Mutex::new(Refusals::new());

impl<S, B> Service<http::Request<B>> for Gated<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if let Some(peer) = crate::conn::tcp::peer(req.extensions()) {
            let identified = match &self.remote {
                Some(remote) => remote.identify_parts(req.headers(), req.extensions()),
                None => Err(Status::unauthenticated("no credentials")),
            };
            match identified {
                Ok(grant) => {
                    peer.activity.authenticated();
                    req.extensions_mut().insert(Identified(grant));
                }
                Err(status) => {
                    let address = peer
                        .tcp
                        .remote_addr()
                        .map_or_else(String::new, |a| a.to_string());
                    crate::conn::Refused::TcpRequest.count();
                    let mut r = REFUSED.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(unsaid) = r.due() {
                        tracing::warn!(
                            %address,
                            refused_since_last_said = unsaid,
                            "TCP request to {} refused before its body was read: {}",
                            req.uri().path(),
                            status.message()
                        );
                    }
                    let refused = status.into_http();
                    return Box::pin(async move { Ok(refused) });
                }
            }
        }
        let mut inner = self.inner.clone();
        std::mem::swap(&mut self.inner, &mut inner);
        Box::pin(async move {
            let mut resp = inner.call(req).await?;
            too_large_is_exhausted(&mut resp);
            Ok(resp)
        })
    }
}

/// tonic answers a message over its size limit with OUT_OF_RANGE, before buffering it; gRPC
/// says RESOURCE_EXHAUSTED, which is what clients look for.
fn too_large_is_exhausted(resp: &mut http::Response<Body>) {
    let h = resp.headers();
    let out_of_range = h.get("grpc-status").is_some_and(|s| s.as_bytes() == b"11");
    let too_large = h.get("grpc-message").is_some_and(|m| {
        m.as_bytes()
            .starts_with(b"Error,%20decoded%20message%20length%20too%20large")
    });
    if out_of_range && too_large {
        resp.headers_mut().insert(
            "grpc-status",
            http::HeaderValue::from(tonic::Code::ResourceExhausted as i32),
        );
    }
}
