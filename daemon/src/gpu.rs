//! GPU metrics from NVML (the NVIDIA driver's management library), sampled on a thread of
//! their own while a CUDA session runs: utilization, memory used, power, SM clock and
//! temperature, per device. Where NVML cannot be loaded (no NVIDIA driver) the report says
//! why; nothing else depends on it. In tracing sessions every reading is also a point on a
//! counter track of the trace ("GPU 0 power", …).

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::Duration,
};

use nvml_wrapper::{
    enum_wrappers::device::{Clock, TemperatureSensor},
    Device, Nvml,
};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuReport {
    /// Why there are no metrics (NVML could not be loaded or initialised).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
    pub period_ms: u64,
    pub devices: Vec<GpuDevice>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuDevice {
    pub index: u32,
    pub name: String,
    pub samples: u64,
    /// Metrics the device reported; one it does not support is absent.
    pub metrics: Vec<GpuMetric>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuMetric {
    pub name: String,
    pub unit: String,
    pub min: f64,
    pub mean: f64,
    pub max: f64,
}

/// A trace's counter tracks, for tracing sessions: readings become COUNTER events.
pub struct TraceTracks {
    pub spool: Arc<std::sync::Mutex<crate::session::tracing::Spool>>,
    pub counters: crate::session::trace_session::Counters,
    /// The pid the tracks are shown under (the target, or 0 for the machine).
    pub pid: u32,
}

impl TraceTracks {
    /// One reading of a device as COUNTER events, in integer units: %, MiB, mW, MHz, °C.
    fn record(&self, index: u32, values: &[Option<f64>; 6]) {
        const UNITS: [(&str, f64); 6] = [
            ("%", 1.0),
            ("%", 1.0),
            ("MiB", 1.0),
            ("mW", 1000.0),
            ("MHz", 1.0),
            ("°C", 1.0),
        ];
        let at = crate::clock::monotonic_ns();
        let events: Vec<tracer_common::TraceEvent> = METRICS
            .iter()
            .zip(UNITS)
            .zip(values)
            .filter_map(|(((name, _), (unit, scale)), v)| {
                let v = (*v)?;
                Some(tracer_common::TraceEvent {
                    kind: tracer_common::trace_kind::COUNTER,
                    pid: self.pid,
                    start_ns: at,
                    end_ns: at,
                    a: self
                        .counters
                        .index(&format!("GPU {index} {name}"), unit, true),
                    b: (v * scale).round().max(0.0) as u64,
                    ..Default::default()
                })
            })
            .collect();
        if !events.is_empty() {
            crate::session::tracing::push_local(&self.spool, &events);
        }
    }
}

/// Samples every GPU until finished.
pub struct GpuSampler {
    period: Duration,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<Result<Vec<GpuDevice>, String>>>,
}

/// Running min/sum/max of one metric.
#[derive(Clone, Copy)]
struct Acc {
    min: f64,
    sum: f64,
    max: f64,
    n: u64,
}

impl Acc {
    fn add(&mut self, v: f64) {
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        self.sum += v;
        self.n += 1;
    }
}

const METRICS: [(&str, &str); 6] = [
    ("gpu utilization", "%"),
    ("memory utilization", "%"),
    ("memory used", "MiB"),
    ("power", "W"),
    ("SM clock", "MHz"),
    ("temperature", "°C"),
];

/// One reading of each metric the device supports (None where it does not).
fn read(d: &Device) -> [Option<f64>; 6] {
    let util = d.utilization_rates().ok();
    [
        util.as_ref().map(|u| f64::from(u.gpu)),
        util.as_ref().map(|u| f64::from(u.memory)),
        d.memory_info()
            .ok()
            .map(|m| m.used as f64 / f64::from(1u32 << 20)),
        d.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
        d.clock_info(Clock::SM).ok().map(f64::from),
        d.temperature(TemperatureSensor::Gpu).ok().map(f64::from),
    ]
}

/// The GPUs NVML reports, as "index: name"; or why NVML cannot be used.
pub fn devices() -> Result<Vec<String>, String> {
    let nvml = Nvml::init().map_err(|e| format!("NVML: {e}"))?;
    let count = nvml.device_count().map_err(|e| format!("NVML: {e}"))?;
    Ok((0..count)
        .map(|i| {
            let name = nvml.device_by_index(i).and_then(|d| d.name());
            format!("{i}: {}", name.unwrap_or_else(|e| format!("[{e}]")))
        })
        .collect())
}

fn sample(
    period: Duration,
    stop: &AtomicBool,
    tracks: Option<TraceTracks>,
) -> Result<Vec<GpuDevice>, String> {
    let nvml = Nvml::init().map_err(|e| format!("NVML: {e}"))?;
    let count = nvml.device_count().map_err(|e| format!("NVML: {e}"))?;
    let devices: Vec<(u32, Device)> = (0..count)
        .filter_map(|i| Some((i, nvml.device_by_index(i).ok()?)))
        .collect();
    let empty = Acc {
        min: f64::INFINITY,
        sum: 0.0,
        max: f64::NEG_INFINITY,
        n: 0,
    };
    let mut acc = vec![[empty; 6]; devices.len()];
    let mut samples = vec![0u64; devices.len()];
    loop {
        for (k, (index, d)) in devices.iter().enumerate() {
            let values = read(d);
            if let Some(t) = &tracks {
                t.record(*index, &values);
            }
            for (m, v) in values.into_iter().enumerate() {
                if let Some(v) = v {
                    acc[k][m].add(v);
                }
            }
            samples[k] += 1;
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
        thread::park_timeout(period);
        if stop.load(Ordering::Relaxed) {
            break;
        }
    }
    Ok(devices
        .iter()
        .enumerate()
        .map(|(k, (index, d))| GpuDevice {
            index: *index,
            name: d.name().unwrap_or_default(),
            samples: samples[k],
            metrics: METRICS
                .iter()
                .zip(acc[k])
                .filter(|(_, a)| a.n > 0)
                .map(|((name, unit), a)| GpuMetric {
                    name: (*name).into(),
                    unit: (*unit).into(),
                    min: a.min,
                    mean: a.sum / a.n as f64,
                    max: a.max,
                })
                .collect(),
        })
        .collect())
}

impl GpuSampler {
    /// `tracks`: a tracing session's counter tracks, which get every reading.
    pub fn start(period: Duration, tracks: Option<TraceTracks>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = thread::Builder::new()
            .name("tracer-gpu".into())
            .spawn(move || sample(period, &flag, tracks))
            .ok();
        Self {
            period,
            stop,
            thread,
        }
    }

    /// Takes a last reading and returns the metrics (or why there are none).
    pub fn finish(mut self) -> GpuReport {
        self.stop.store(true, Ordering::Relaxed);
        let result = match self.thread.take() {
            Some(t) => {
                t.thread().unpark();
                t.join()
                    .unwrap_or_else(|_| Err("the GPU sampling thread failed".into()))
            }
            None => Err("could not start the GPU sampling thread".into()),
        };
        let period_ms = u64::try_from(self.period.as_millis()).unwrap_or(u64::MAX);
        match result {
            Ok(devices) => GpuReport {
                unavailable: None,
                period_ms,
                devices,
            },
            Err(why) => GpuReport {
                unavailable: Some(why),
                period_ms,
                devices: Vec::new(),
            },
        }
    }
}
