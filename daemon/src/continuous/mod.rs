//! Continuous profiling: a sampling session that, every period, takes the window of samples
//! that just ended, names it, and pushes it as pprof to a Pyroscope or Parca endpoint
//! (`sinks.rs`), one series per process group: command, container and pod, as labels; or as
//! OpenTelemetry profiles to an OTLP receiver, one resource per process.
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

pub mod sinks;
mod tls;

pub use sinks::{Endpoint, Kind, Series};

use tracer_report::profile::Profile;
use tracer_report::ProcessOrigin;

/// Windows kept while the endpoint does not take them.
const QUEUE: usize = 16;

/// What the pusher did, for the session's status.
#[derive(Debug, Default)]
pub struct Stats {
    pub pushed: AtomicU64,
    pub failed: AtomicU64,
    pub dropped: AtomicU64,
    pub last_error: Mutex<String>,
}

/// A window's series: one per (command, container, pod), each its own pprof.
pub fn series(
    profile: &Profile,
    containers: &[ProcessOrigin],
    node: &str,
    id: &str,
) -> Vec<Series> {
    let origins: std::collections::HashMap<u32, &tracer_report::Origin> =
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
                // What the process calls itself, else its pod's name, else its command.
                o.service_name
                    .clone()
                    .or_else(|| o.hostname.clone())
                    .unwrap_or_else(|| s.comm.clone())
            }
            None => s.comm.clone(),
        };
        labels.push(("service_name".to_owned(), service));
        labels.sort();
        groups.entry(labels).or_default().push(i);
    }
    groups
        .into_iter()
        .enumerate()
        .map(|(n, (labels, stacks))| {
            let part = Profile {
                stacks: stacks.iter().map(|&i| profile.stacks[i].clone()).collect(),
                ..profile.clone()
            };
            Series {
                labels,
                pprof: tracer_report::export::pprof(&part, containers),
                id: format!("{id}-{n}"),
            }
        })
        .collect()
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
                    match endpoint.post(body).await {
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

/// A continuous session's ticker and pusher; the ticker stops when this is dropped.
pub struct Running {
    pub pusher: Pusher,
    endpoint: Endpoint,
    ticker: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Every `period`, takes a window (`take`: the samples since the last one, named; it
    /// may read binaries, so it runs on a blocking thread) and queues it for the endpoint.
    pub fn start(
        endpoint: Endpoint,
        period: Duration,
        take: Arc<dyn Fn() -> Option<Profile> + Send + Sync>,
        session: String,
    ) -> Self {
        let pusher = Pusher::spawn(endpoint.clone());
        let p = pusher.clone();
        let ep = endpoint.clone();
        let ticker = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let (take, id, ep) = (take.clone(), session.clone(), ep.clone());
                let body =
                    tokio::task::spawn_blocking(move || take().and_then(|p| window(&ep, &p, &id)))
                        .await
                        .ok()
                        .flatten();
                if let Some(b) = body {
                    p.push(b);
                }
            }
        });
        Running {
            pusher,
            endpoint,
            ticker,
        }
    }

    /// Pushes the session's last window (its report's profile) and lets the pusher finish.
    pub fn finish(self, last: Option<&Profile>, session: &str) {
        self.ticker.abort();
        if let Some(b) = last.and_then(|p| window(&self.endpoint, p, session)) {
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

/// A window's push request for `endpoint`, with its processes attributed to containers and
/// pods; None for a window without samples.
pub fn window(endpoint: &Endpoint, profile: &Profile, session: &str) -> Option<Vec<u8>> {
    if profile.stacks.is_empty() {
        return None;
    }
    let containers = crate::container::attribute(profile.stacks.iter().map(|s| s.pid));
    let node = crate::container::host_name();
    if endpoint.kind == Kind::Otlp {
        return Some(tracer_report::export::otlp(profile, &containers, &node));
    }
    let id = format!("{session}-{}", profile.start_unix_ns);
    Some(endpoint.encode(series(profile, &containers, &node, &id)))
}
