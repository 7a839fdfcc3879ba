//! A tracing session's events streamed to a client as they are recorded (`StreamEvents`).
//! The session's spool broadcasts batches and never waits: a client that reads slower than
//! events arrive falls behind, skips whole batches, and is told how many events it missed.

use std::{collections::HashMap, pin::Pin};

use tokio::sync::{broadcast::error::RecvError, mpsc};
use tokio_stream::{wrappers::ReceiverStream, Stream};
use tonic::Status;
use tracer_common::{trace_kind, TraceEvent as Raw};
use tracer_proto::{trace_event::Kind, EventBatch, TraceEvent};

use crate::session::manager::Subscription;

type Events = Pin<Box<dyn Stream<Item = Result<EventBatch, Status>> + Send>>;

pub fn stream(sub: Subscription) -> Events {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let Subscription {
            mut events,
            next_seq,
            names,
            probes,
            counters,
        } = sub;
        let (mut next, mut missed) = (next_seq, 0u64);
        let mut given_up = std::collections::HashSet::new();
        // GPU kernels' names, read from their processes once each.
        let mut gpu_names: HashMap<(u32, u64), String> = HashMap::new();
        loop {
            let batch = match events.recv().await {
                Ok(b) => b,
                // The gap shows in the next batch's sequence number.
                Err(RecvError::Lagged(_)) => continue,
                Err(RecvError::Closed) => return,
            };
            missed += batch.first_seq.saturating_sub(next);
            next = batch.first_seq + batch.events.len() as u64;
            // A function's name comes from the kernel on a ring of its own, read by another
            // task: a call may arrive here first. Wait for it (up to 2 s on a loaded machine;
            // once per function) rather than send it unnamed.
            // Functions that never get one (entered before the session) are waited for once.
            for round in 0..=200 {
                let missing: Vec<(u32, u64, u64)> = {
                    let names = names.lock().unwrap_or_else(|e| e.into_inner());
                    batch
                        .events
                        .iter()
                        .filter(|e| e.kind == trace_kind::PY_CALL)
                        .map(|e| (e.pid, e.a, e.b))
                        .filter(|k| !names.contains_key(k) && !given_up.contains(k))
                        .collect()
                };
                if missing.is_empty() {
                    break;
                }
                if round == 200 {
                    given_up.extend(missing);
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            for e in batch
                .events
                .iter()
                .filter(|e| e.kind == trace_kind::GPU_KERNEL)
            {
                gpu_names.entry((e.pid, e.a)).or_insert_with(|| {
                    tracer_inspect::cuda::name_in_process(e.pid, e.a)
                        .unwrap_or_else(|| format!("kernel {:#x}", e.a))
                });
            }
            let msg = {
                let names = names.lock().unwrap_or_else(|e| e.into_inner());
                EventBatch {
                    events: batch
                        .events
                        .iter()
                        .map(|ev| {
                            convert(
                                ev,
                                |key| {
                                    names.get(&key).map(|f| {
                                        (f.qualname.clone(), f.filename.clone(), f.firstlineno)
                                    })
                                },
                                &probes,
                                &counters,
                                &gpu_names,
                            )
                        })
                        .collect(),
                    missed,
                }
            };
            // A client that went away ends this task; nothing else waits on it.
            if tx.send(Ok(msg)).await.is_err() {
                return;
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

fn convert(
    ev: &Raw,
    name: impl Fn((u32, u64, u64)) -> Option<(String, String, i32)>,
    probes: &[String],
    counters: &[tracer_report::trace::TraceCounter],
    gpu_names: &HashMap<(u32, u64), String>,
) -> TraceEvent {
    let mut out = TraceEvent {
        start_ns: ev.start_ns,
        end_ns: ev.end_ns,
        pid: ev.pid,
        tid: ev.tid,
        cpu: ev.cpu,
        exit_inferred: tracer_report::trace::exit_inferred(ev),
        ..TraceEvent::default()
    };
    match ev.kind {
        trace_kind::PY_CALL => {
            out.set_kind(Kind::PythonCall);
            // Named once the kernel's first sighting of the function has been read.
            match name((ev.pid, ev.a, ev.b)) {
                Some((q, f, line)) => (out.name, out.file, out.line) = (q, f, line),
                None => out.name = format!("[code object {:#x}]", ev.a),
            }
        }
        trace_kind::NATIVE_CALL => {
            out.set_kind(Kind::NativeCall);
            out.name = probes.get(ev.a as usize).cloned().unwrap_or_default();
        }
        trace_kind::CUDA_LAUNCH => {
            // Kernel names are resolved when the session ends; live, the entry point and handle.
            out.set_kind(Kind::CudaLaunch);
            out.name = format!(
                "{} {:#x}",
                tracer_inspect::cuda::api_name(u32::from(ev.flags)),
                ev.a
            );
        }
        trace_kind::CUDA_MEMORY => {
            out.set_kind(Kind::CudaMemory);
            out.name = tracer_report::trace::Named::CudaMemory(u32::from(ev.flags)).name();
            out.value = ev.a;
        }
        trace_kind::GPU_KERNEL => {
            out.set_kind(Kind::GpuKernel);
            let track = tracer_report::trace::GpuTrack::of(ev);
            let kernel = gpu_names
                .get(&(ev.pid, ev.a))
                .cloned()
                .unwrap_or_else(|| format!("kernel {:#x}", ev.a));
            out.name = format!("{kernel} on {}", track.name());
        }
        trace_kind::OFF_CPU => {
            out.set_kind(Kind::OffCpu);
            out.name = tracer_report::trace::Named::OffCpu(tracer_report::away::reason(ev)).name();
        }
        trace_kind::COUNTER => {
            out.set_kind(Kind::Counter);
            out.name = counters
                .get(ev.a as usize)
                .map(|c| c.event.clone())
                .unwrap_or_default();
            out.value = ev.b;
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_kernels_stream_with_their_track() {
        let raw = Raw {
            kind: trace_kind::GPU_KERNEL,
            pid: 7,
            tid: 99,
            start_ns: 1_000,
            end_ns: 5_000,
            a: 0xa0,
            b: 1 << 32 | 13,
            ..Raw::default()
        };
        let ev = convert(&raw, |_| None, &[], &[], &HashMap::new());
        assert_eq!(ev.kind(), Kind::GpuKernel);
        assert_eq!((ev.start_ns, ev.end_ns, ev.pid), (1_000, 5_000, 7));
        assert_eq!(ev.name, "kernel 0xa0 on GPU 1 stream 13");
        let names = HashMap::from([((7, 0xa0), "relu(float*, int)".to_owned())]);
        let ev = convert(&raw, |_| None, &[], &[], &names);
        assert_eq!(ev.name, "relu(float*, int) on GPU 1 stream 13");
    }
}
