//! GPU metrics as a report holds them (NVML's readings, summarized per device).

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
