//! GPU inventory behind one trait, with an NVML backend for real hosts and a simulated one for
//! dev mode, tests and chaos.

pub mod nvml;
pub use laneway_core::gpu::product;
pub mod sim;

use serde::{Deserialize, Serialize};

pub use product::Product;

/// One MIG device (a GPU instance with its compute instance) carved out of a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDevice {
    /// `MIG-…` UUID: what `CUDA_VISIBLE_DEVICES` names to pin a replica to this slice.
    pub uuid: String,
    /// mig-parted profile name, e.g. `1g.10gb`.
    pub profile: String,
}

/// MIG state of a GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigState {
    /// The product supports MIG.
    pub capable: bool,
    /// MIG mode is on.
    pub enabled: bool,
    pub devices: Vec<MigDevice>,
}

/// Health signals of a GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// Uncorrected (double-bit) ECC errors since the driver loaded; `None` if not reported.
    pub ecc_uncorrected: Option<u64>,
    /// False when the GPU should not receive new replicas.
    pub healthy: bool,
    /// Why it is unhealthy, for operators.
    pub reason: Option<String>,
}

/// One physical GPU as the agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    pub product: Product,
    /// The product name the driver reported.
    pub driver_name: String,
    pub memory_total_bytes: u64,
    pub memory_used_bytes: u64,
    /// Percent of time a kernel was running over the last sample period.
    pub utilisation_pct: u32,
    pub mig: MigState,
    pub health: Health,
}

/// Why the GPU backend failed. Messages say what to do.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "NVML is not available on this host ({detail}): the NVIDIA driver is not installed or \
         libnvidia-ml.so.1 is not on the loader path; install the driver, or run with \
         `--backend sim --sim-config FILE` to use simulated GPUs"
    )]
    NvmlUnavailable { detail: String },
    #[error("NVML call {call} failed on GPU {gpu}: {detail}")]
    Nvml {
        call: &'static str,
        gpu: String,
        detail: String,
    },
    #[error("no GPU with UUID {0} on this host; `laneway-agent gpus` lists them")]
    UnknownGpu(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("invalid simulated GPU config {path}: {detail}")]
    SimConfig { path: String, detail: String },
}

/// The GPU inventory and MIG geometry of one host.
pub trait GpuBackend: Send + Sync {
    /// Backend name for logs and output (`nvml`, `sim`).
    fn name(&self) -> &'static str;

    /// Current inventory, one entry per physical GPU, in index order.
    fn inventory(&self) -> Result<Vec<Gpu>, GpuError>;

    /// Replaces the MIG devices of GPU `uuid` with one device per profile in `profiles`
    /// (already validated against the product by [`crate::mig`]), enabling MIG mode if needed.
    fn set_mig_devices(&self, uuid: &str, profiles: &[String]) -> Result<(), GpuError>;
}
