//! Simulated GPUs, configured from TOML, for dev mode, tests, chaos and benchmarks.
//!
//! ```toml
//! node = "sim-h100-1"          # used in the simulated UUIDs
//! [[gpu]]
//! product = "H100-80GB"
//! count = 2
//! mig = true                   # optional: start in MIG mode (no devices yet)
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use serde::Deserialize;

use super::{Gpu, GpuBackend, GpuError, Health, MigDevice, MigState, Product};

const GIB: u64 = 1024 * 1024 * 1024;

#[derive(Debug, Deserialize)]
struct SimFile {
    node: String,
    #[serde(default)]
    gpu: Vec<SimGpuFile>,
}

#[derive(Debug, Deserialize)]
struct SimGpuFile {
    product: String,
    #[serde(default = "one")]
    count: u32,
    /// GiB; defaults to the product's.
    memory_gib: Option<u64>,
    #[serde(default)]
    mig: bool,
}

fn one() -> u32 {
    1
}

/// Mutable state of the simulated GPUs.
struct SimState {
    gpus: Vec<Gpu>,
    /// Load set by the simulated replicas: uuid → utilisation percent.
    load: BTreeMap<String, u32>,
}

/// A host with simulated GPUs.
pub struct SimBackend {
    node: String,
    state: Mutex<SimState>,
}

impl SimBackend {
    /// Reads a simulated GPU config file.
    pub fn from_file(path: &Path) -> Result<Self, GpuError> {
        let text = std::fs::read_to_string(path).map_err(|e| GpuError::SimConfig {
            path: path.display().to_string(),
            detail: e.to_string(),
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            GpuError::SimConfig { detail, .. } => GpuError::SimConfig {
                path: path.display().to_string(),
                detail,
            },
            other => other,
        })
    }

    /// Parses a simulated GPU config.
    pub fn from_toml(text: &str) -> Result<Self, GpuError> {
        let bad = |detail: String| GpuError::SimConfig {
            path: "<text>".into(),
            detail,
        };
        let file: SimFile = toml::from_str(text).map_err(|e| bad(e.to_string().trim().to_string()))?;
        if file.node.is_empty() {
            return Err(bad("`node` must be a non-empty name".into()));
        }
        let mut gpus = Vec::new();
        for (i, g) in file.gpu.iter().enumerate() {
            let product = Product::parse(&g.product).ok_or_else(|| {
                bad(format!(
                    "gpu[{i}].product = {:?}: expected one of L4, L40S, A100-40GB, A100-80GB, H100-80GB, H200, B200",
                    g.product
                ))
            })?;
            if g.mig && !product.mig_capable() {
                return Err(bad(format!(
                    "gpu[{i}].mig = true: {product} has no MIG (it supports time-slicing only)"
                )));
            }
            let memory = g.memory_gib.or(product.memory_gib()).unwrap_or(0) * GIB;
            for _ in 0..g.count {
                let index = gpus.len() as u32;
                gpus.push(Gpu {
                    index,
                    uuid: format!("GPU-sim-{}-{index}", file.node),
                    driver_name: format!("Simulated {product}"),
                    product: product.clone(),
                    memory_total_bytes: memory,
                    memory_used_bytes: 0,
                    utilisation_pct: 0,
                    mig: MigState {
                        capable: product.mig_capable(),
                        enabled: g.mig,
                        devices: Vec::new(),
                    },
                    health: Health {
                        ecc_uncorrected: Some(0),
                        healthy: true,
                        reason: None,
                    },
                });
            }
        }
        if gpus.is_empty() {
            return Err(bad("no [[gpu]] entries: a simulated node needs at least one GPU".into()));
        }
        Ok(SimBackend {
            node: file.node,
            state: Mutex::new(SimState {
                gpus,
                load: BTreeMap::new(),
            }),
        })
    }

    /// The simulated node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the utilisation and memory a simulated replica puts on a GPU (or MIG device: its
    /// parent GPU is charged).
    pub fn set_load(&self, uuid: &str, utilisation_pct: u32, memory_used_bytes: u64) -> Result<(), GpuError> {
        let mut st = self.lock();
        let gpu = st
            .gpus
            .iter_mut()
            .find(|g| g.uuid == uuid || g.mig.devices.iter().any(|d| d.uuid == uuid))
            .ok_or_else(|| GpuError::UnknownGpu(uuid.to_string()))?;
        gpu.memory_used_bytes = memory_used_bytes.min(gpu.memory_total_bytes);
        let parent = gpu.uuid.clone();
        st.load.insert(parent, utilisation_pct.min(100));
        Ok(())
    }

    /// Marks a GPU unhealthy (an XID or ECC fault), for failure tests.
    pub fn inject_fault(&self, uuid: &str, reason: &str) -> Result<(), GpuError> {
        let mut st = self.lock();
        let gpu = st
            .gpus
            .iter_mut()
            .find(|g| g.uuid == uuid)
            .ok_or_else(|| GpuError::UnknownGpu(uuid.to_string()))?;
        gpu.health.healthy = false;
        gpu.health.ecc_uncorrected = Some(gpu.health.ecc_uncorrected.unwrap_or(0) + 1);
        gpu.health.reason = Some(reason.to_string());
        Ok(())
    }
}

impl GpuBackend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn inventory(&self) -> Result<Vec<Gpu>, GpuError> {
        let st = self.lock();
        Ok(st
            .gpus
            .iter()
            .map(|g| Gpu {
                utilisation_pct: st.load.get(&g.uuid).copied().unwrap_or(0),
                ..g.clone()
            })
            .collect())
    }

    fn set_mig_devices(&self, uuid: &str, profiles: &[String]) -> Result<(), GpuError> {
        let mut st = self.lock();
        let gpu = st
            .gpus
            .iter_mut()
            .find(|g| g.uuid == uuid)
            .ok_or_else(|| GpuError::UnknownGpu(uuid.to_string()))?;
        if !gpu.mig.capable {
            return Err(GpuError::Unsupported(format!("{} ({uuid}) has no MIG", gpu.product)));
        }
        gpu.mig.enabled = !profiles.is_empty() || gpu.mig.enabled;
        gpu.mig.devices = profiles
            .iter()
            .enumerate()
            .map(|(i, p)| MigDevice {
                uuid: format!("MIG-{}-{i}", uuid.trim_start_matches("GPU-")),
                profile: p.clone(),
            })
            .collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_inventory_from_toml() {
        let b = SimBackend::from_toml(
            r#"
node = "n1"
[[gpu]]
product = "H100-80GB"
count = 2
mig = true
[[gpu]]
product = "L4"
"#,
        )
        .unwrap();
        let inv = b.inventory().unwrap();
        assert_eq!(inv.len(), 3);
        assert_eq!(inv[0].product, Product::H100_80GB);
        assert_eq!(inv[0].memory_total_bytes, 80 * GIB);
        assert!(inv[0].mig.enabled && inv[0].mig.capable);
        assert_eq!(inv[2].product, Product::L4);
        assert!(!inv[2].mig.capable);
        assert_eq!(inv[2].uuid, "GPU-sim-n1-2");
    }

    #[test]
    fn utilisation_follows_the_replicas_load() {
        let b = SimBackend::from_toml("node = \"n\"\n[[gpu]]\nproduct = \"L4\"\n").unwrap();
        b.set_load("GPU-sim-n-0", 70, GIB).unwrap();
        let g = &b.inventory().unwrap()[0];
        assert_eq!(g.utilisation_pct, 70);
        assert_eq!(g.memory_used_bytes, GIB);
        assert!(b.set_load("GPU-nope", 1, 0).is_err());
    }

    #[test]
    fn bad_configs_say_what_is_wrong() {
        for (text, want) in [
            ("node = \"n\"\n[[gpu]]\nproduct = \"RTX9090\"\n", "gpu[0].product"),
            ("node = \"n\"\n[[gpu]]\nproduct = \"L4\"\nmig = true\n", "has no MIG"),
            ("node = \"n\"\n", "at least one GPU"),
            ("node = \"\"\n[[gpu]]\nproduct = \"L4\"\n", "non-empty"),
        ] {
            let e = SimBackend::from_toml(text).err().expect(want).to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}
