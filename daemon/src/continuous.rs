//! Continuous profiling: a sampling session that, every period, takes the window of samples
//! that just ended, names it, and pushes it as pprof to a Pyroscope-compatible endpoint
//! (the `push.v1.PusherService/Push` Connect API that Grafana Pyroscope and Alloy serve),
//! one series per process group: command, container and pod, as labels.
//!
//! Pushing runs on its own task behind a bounded queue: an endpoint that is slow or down
//! costs windows (counted as dropped, oldest first) and retries, never samples.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{profile::Profile, report::ProcessOrigin};

/// Windows kept while the endpoint does not take them.
const QUEUE: usize = 16;
const TIMEOUT: Duration = Duration::from_secs(10);

/// The Connect API's messages (push/v1/push.proto and types/v1/types.proto of Grafana
/// Pyroscope), with prost's derive.
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
}

/// Where profiles go: `http://HOST:PORT[/PREFIX]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub authority: String,
    pub path: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Self, String> {
        if url.starts_with("https://") {
            return Err("push endpoints over https are not supported yet: push to a local Alloy or a plain-HTTP Pyroscope".into());
        }
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("the push endpoint must be http://HOST:PORT, got '{url}'"))?;
        let (authority, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.is_empty() || !authority.contains(':') {
            return Err(format!(
                "the push endpoint needs a host and port, got '{url}'"
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        Ok(Endpoint {
            authority: authority.to_owned(),
            path: if prefix.is_empty() {
                "/push.v1.PusherService/Push".into()
            } else {
                format!("/{prefix}/push.v1.PusherService/Push")
            },
        })
    }
}

/// What the pusher did, for the session's status.
#[derive(Debug, Default)]
pub struct Stats {
    pub pushed: AtomicU64,
    pub failed: AtomicU64,
    pub dropped: AtomicU64,
    pub last_error: Mutex<String>,
}

/// The push request for one window: a series per (command, container, pod).
pub fn request(profile: &Profile, containers: &[ProcessOrigin], node: &str, id: &str) -> Vec<u8> {
    let origins: std::collections::HashMap<u32, &crate::container::Origin> =
        containers.iter().map(|c| (c.pid, &c.origin)).collect();
    let mut groups: BTreeMap<Vec<(String, String)>, Vec<usize>> = BTreeMap::new();
    for (i, s) in profile.stacks.iter().enumerate() {
        let mut labels = vec![
            ("__name__".to_owned(), "process_cpu".to_owned()),
            ("node".to_owned(), node.to_owned()),
            ("comm".to_owned(), s.comm.clone()),
        ];
        let service = match origins.get(&s.pid) {
            Some(o) => {
                for (k, v) in [
                    ("container_id", &o.container_id),
                    ("pod_uid", &o.pod_uid),
                    ("pod", &o.hostname),
                ] {
                    if let Some(v) = v {
                        labels.push((k.to_owned(), v.clone()));
                    }
                }
                o.hostname.clone().unwrap_or_else(|| s.comm.clone())
            }
            None => s.comm.clone(),
        };
        labels.push(("service_name".to_owned(), service));
        labels.sort();
        groups.entry(labels).or_default().push(i);
    }
    let series = groups
        .into_iter()
        .enumerate()
        .map(|(n, (labels, stacks))| {
            let part = Profile {
                stacks: stacks.iter().map(|&i| profile.stacks[i].clone()).collect(),
                ..profile.clone()
            };
            pb::RawProfileSeries {
                labels: labels
                    .into_iter()
                    .map(|(name, value)| pb::LabelPair { name, value })
                    .collect(),
                samples: vec![pb::RawSample {
                    raw_profile: crate::export::pprof::pprof(&part, containers),
                    id: format!("{id}-{n}"),
                }],
            }
        })
        .collect();
    pb::PushRequest { series }.encode_to_vec()
}

/// The queue of windows waiting for the endpoint, and the task that empties it; the task
/// ends once every `Pusher` is dropped and the queue is pushed (or given up on).
#[derive(Clone)]
pub struct Pusher {
    tx: tokio::sync::mpsc::Sender<Vec<u8>>,
    pub stats: Arc<Stats>,
}

impl Pusher {
    pub fn spawn(endpoint: Endpoint) -> Self {
        let stats = Arc::new(Stats::default());
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(QUEUE);
        let st = stats.clone();
        tokio::spawn(async move {
            let mut queue: VecDeque<Vec<u8>> = VecDeque::new();
            let mut backoff = Duration::from_millis(250);
            let mut tries_after_end = 0;
            let enqueue = |queue: &mut VecDeque<Vec<u8>>, body| {
                if queue.len() == QUEUE {
                    queue.pop_front();
                    st.dropped.fetch_add(1, Ordering::Relaxed);
                }
                queue.push_back(body);
            };
            loop {
                if queue.is_empty() {
                    // Nothing to retry: wait for a window, or the session's end.
                    match rx.recv().await {
                        Some(body) => enqueue(&mut queue, body),
                        None => return,
                    }
                } else if !rx.is_closed() {
                    tokio::select! {
                        m = rx.recv() => if let Some(body) = m { enqueue(&mut queue, body) },
                        _ = tokio::time::sleep(backoff) => {}
                    }
                } else {
                    // The session ended with windows still queued: a few more tries.
                    tries_after_end += 1;
                    if tries_after_end > 3 {
                        st.dropped.fetch_add(queue.len() as u64, Ordering::Relaxed);
                        return;
                    }
                    tokio::time::sleep(backoff).await;
                }
                while let Some(body) = queue.front() {
                    match post(&endpoint, body).await {
                        Ok(()) => {
                            st.pushed.fetch_add(1, Ordering::Relaxed);
                            queue.pop_front();
                            backoff = Duration::from_millis(250);
                        }
                        Err(e) => {
                            st.failed.fetch_add(1, Ordering::Relaxed);
                            *st.last_error.lock().unwrap_or_else(|e| e.into_inner()) = e;
                            backoff = (backoff * 2).min(Duration::from_secs(10));
                            break;
                        }
                    }
                }
            }
        });
        Pusher { tx, stats }
    }

    /// Queues a window; never waits (a full queue drops it, counted).
    pub fn push(&self, body: Vec<u8>) {
        if self.tx.try_send(body).is_err() {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn post(endpoint: &Endpoint, body: &[u8]) -> Result<(), String> {
    let attempt = async {
        let mut conn = tokio::net::TcpStream::connect(&endpoint.authority)
            .await
            .map_err(|e| format!("connecting to {}: {e}", endpoint.authority))?;
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/proto\r\nConnect-Protocol-Version: 1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            endpoint.path,
            endpoint.authority,
            body.len()
        );
        conn.write_all(head.as_bytes())
            .await
            .and(conn.write_all(body).await)
            .map_err(|e| format!("sending to {}: {e}", endpoint.authority))?;
        let mut reply = Vec::new();
        let mut buf = [0u8; 4096];
        while !reply.windows(2).any(|w| w == b"\r\n") {
            match conn.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => reply.extend_from_slice(&buf[..n]),
                Err(e) => return Err(format!("reading the reply of {}: {e}", endpoint.authority)),
            }
        }
        let line = String::from_utf8_lossy(&reply);
        let line = line.lines().next().unwrap_or("");
        match line.split_whitespace().nth(1) {
            Some(code) if code.starts_with('2') => Ok(()),
            _ => Err(format!("{} answered '{line}'", endpoint.authority)),
        }
    };
    tokio::time::timeout(TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "{} did not answer within {TIMEOUT:?}",
                endpoint.authority
            ))
        })
}

/// A continuous session's ticker and pusher; the ticker stops when this is dropped.
pub struct Running {
    pub pusher: Pusher,
    ticker: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Every `period`, takes `slot`'s window and queues it for the endpoint.
    pub fn start(
        endpoint: Endpoint,
        period: Duration,
        windows: crate::session::sampling::Windows,
        slot: u8,
        session: String,
    ) -> Self {
        let pusher = Pusher::spawn(endpoint);
        let p = pusher.clone();
        let ticker = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let (w, id) = (windows.clone(), session.clone());
                // Naming may read binaries: off the async threads.
                let body =
                    tokio::task::spawn_blocking(move || w.take(slot).and_then(|p| window(&p, &id)))
                        .await
                        .ok()
                        .flatten();
                if let Some(b) = body {
                    p.push(b);
                }
            }
        });
        Running { pusher, ticker }
    }

    /// Pushes the session's last window (its report's profile) and lets the pusher finish.
    pub fn finish(self, last: Option<&Profile>, session: &str) {
        self.ticker.abort();
        if let Some(b) = last.and_then(|p| window(p, session)) {
            self.pusher.push(b);
        }
    }

    pub fn stats(&self) -> &Stats {
        &self.pusher.stats
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.ticker.abort();
    }
}

/// A window's push request, with its processes attributed to containers and pods; None
/// for a window without samples.
pub fn window(profile: &Profile, session: &str) -> Option<Vec<u8>> {
    if profile.stacks.is_empty() {
        return None;
    }
    let containers: Vec<ProcessOrigin> =
        crate::container::attribute(profile.stacks.iter().map(|s| s.pid))
            .into_iter()
            .map(|(pid, origin)| ProcessOrigin { pid, origin })
            .collect();
    let node = nix::sys::utsname::uname()
        .map(|u| u.nodename().to_string_lossy().into_owned())
        .unwrap_or_default();
    let id = format!("{session}-{}", profile.start_unix_ns);
    Some(request(profile, &containers, &node, &id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        let e = Endpoint::parse("http://pyroscope:4040").unwrap();
        assert_eq!(e.authority, "pyroscope:4040");
        assert_eq!(e.path, "/push.v1.PusherService/Push");
        let e = Endpoint::parse("http://h:1/prefix/").unwrap();
        assert_eq!(e.path, "/prefix/push.v1.PusherService/Push");
        assert!(Endpoint::parse("https://h:1")
            .unwrap_err()
            .contains("https"));
        assert!(Endpoint::parse("h:1").is_err());
        assert!(Endpoint::parse("http://h").is_err());
    }
}
