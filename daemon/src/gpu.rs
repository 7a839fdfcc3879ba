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

pub use tracer_report::gpu::{GpuDevice, GpuMetric, GpuReport};

/// Where every reading goes besides the session's totals (a tracing session's counter
/// tracks): `record(device, readings)`, each reading a metric's name, its unit and its value
/// in that unit, rounded: %, MiB, mW, MHz, °C.
pub trait Tracks: Send {
    fn record(&self, device: u32, readings: &[(&'static str, &'static str, u64)]);
}

/// A device's readings in the units tracks show them in.
fn in_track_units(values: &[Option<f64>; 6]) -> Vec<(&'static str, &'static str, u64)> {
    const UNITS: [(&str, f64); 6] = [
        ("%", 1.0),
        ("%", 1.0),
        ("MiB", 1.0),
        ("mW", 1000.0),
        ("MHz", 1.0),
        ("°C", 1.0),
    ];
    METRICS
        .iter()
        .zip(UNITS)
        .zip(values)
        .filter_map(|(((name, _), (unit, scale)), v)| {
            Some((*name, unit, ((*v)? * scale).round().max(0.0) as u64))
        })
        .collect()
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
    tracks: Option<Box<dyn Tracks>>,
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
                let readings = in_track_units(&values);
                if !readings.is_empty() {
                    t.record(*index, &readings);
                }
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
    pub fn start(period: Duration, tracks: Option<Box<dyn Tracks>>) -> Self {
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
