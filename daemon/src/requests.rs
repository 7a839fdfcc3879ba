//! What every request (Unix socket and TCP) passes through, before the services: refusals of
//! connections over their caps, the count of requests in flight that keeps a connection
//! from being idle, and the status of requests that do not decode.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use tonic::{
    body::Body,
    codegen::{http, Body as HttpBody, Service},
    Status,
};

use crate::conn::{InFlight, PeerInfo};

#[derive(Clone, Copy, Debug, Default)]
pub struct Layer;

impl<S> tower::Layer<S> for Layer {
    type Service = Requests<S>;

    fn layer(&self, inner: S) -> Requests<S> {
        Requests { inner }
    }
}

#[derive(Clone, Debug)]
pub struct Requests<S> {
    inner: S,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> Service<http::Request<B>> for Requests<S>
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

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let peer = req.extensions().get::<PeerInfo>().cloned();
        if let Some(why) = peer.as_ref().and_then(|p| p.refused.clone()) {
            let refused = Status::resource_exhausted(why.to_string()).into_http();
            return Box::pin(async move { Ok(refused) });
        }
        let in_flight = match &peer {
            Some(p) => Some(p.activity.begin()),
            None => crate::conn::tcp::peer(req.extensions()).map(|p| p.activity.begin()),
        };
        let mut inner = self.inner.clone();
        std::mem::swap(&mut self.inner, &mut inner);
        Box::pin(async move {
            let mut resp = inner.call(req).await?;
            undecodable_is_invalid(&mut resp);
            Ok(match in_flight {
                // In flight until its response's last byte: a stream may be quiet for long.
                Some(guard) => resp.map(|body| {
                    Body::new(Tracked {
                        body,
                        _guard: guard,
                    })
                }),
                None => resp,
            })
        })
    }
}

/// tonic answers a request that does not decode with INTERNAL; the fault is the client's.
fn undecodable_is_invalid(resp: &mut http::Response<Body>) {
    let h = resp.headers();
    let internal = h.get("grpc-status").is_some_and(|s| s == "13");
    let message = h
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .map(|m| m.replace("%20", " "))
        .unwrap_or_default();
    let undecodable = [
        "failed to decode Protobuf message",
        "protocol error: received message",
        "Unexpected EOF decoding stream",
    ]
    .iter()
    .any(|p| message.starts_with(p));
    if internal && undecodable {
        resp.headers_mut().insert(
            "grpc-status",
            http::HeaderValue::from(tonic::Code::InvalidArgument as i32),
        );
    }
}

/// A response body that holds its request's place in flight until it ends.
struct Tracked {
    body: Body,
    _guard: InFlight,
}

impl HttpBody for Tracked {
    type Data = <Body as HttpBody>::Data;
    type Error = <Body as HttpBody>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
