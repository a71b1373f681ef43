//! Real GPUs through NVML (`nvml-wrapper`, which loads libnvidia-ml at run time, so the agent
//! builds and runs on hosts without a driver and fails only when NVML is asked for).

use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::{Gpu, GpuBackend, GpuError, Health, MigDevice, MigState, Product};

/// GPUs of this host through NVML.
pub struct NvmlBackend {
    nvml: Nvml,
}

impl NvmlBackend {
    /// Loads and initialises NVML; a host without the driver gets a clear error, not a panic.
    pub fn new() -> Result<Self, GpuError> {
        match Nvml::init() {
            Ok(nvml) => Ok(NvmlBackend { nvml }),
            Err(e) => Err(GpuError::NvmlUnavailable { detail: e.to_string() }),
        }
    }
}

fn call<T>(call: &'static str, gpu: &str, r: Result<T, NvmlError>) -> Result<T, GpuError> {
    r.map_err(|e| GpuError::Nvml {
        call,
        gpu: gpu.to_string(),
        detail: e.to_string(),
    })
}

/// Profile name of a MIG device from its NVML name (`NVIDIA H100 80GB HBM3 MIG 1g.10gb`).
pub fn mig_profile_from_name(name: &str) -> String {
    name.rsplit_once("MIG ")
        .map(|(_, p)| p.trim().to_string())
        .unwrap_or_else(|| name.trim().to_string())
}

fn mig_devices(device: &Device<'_>, gpu: &str) -> Result<Vec<MigDevice>, GpuError> {
    // nvmlDeviceGetMaxMigDeviceCount: the number of MIG slots, some of them unused.
    let max = call("nvmlDeviceGetMaxMigDeviceCount", gpu, device.mig_device_count())?;
    let mut out = Vec::new();
    for i in 0..max {
        // Unused MIG slots report NotFound; that is not an error.
        let Ok(mig) = device.mig_device_by_index(i) else {
            continue;
        };
        let uuid = call("nvmlDeviceGetUUID (MIG)", gpu, mig.uuid())?;
        let name = call("nvmlDeviceGetName (MIG)", gpu, mig.name())?;
        out.push(MigDevice {
            uuid,
            profile: mig_profile_from_name(&name),
        });
    }
    Ok(out)
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn inventory(&self) -> Result<Vec<Gpu>, GpuError> {
        let count = call("nvmlDeviceGetCount", "-", self.nvml.device_count())?;
        let mut gpus = Vec::new();
        for index in 0..count {
            // One broken GPU (fallen off the bus, say) is reported unhealthy; the others keep
            // the node schedulable.
            match self.gpu(index) {
                Ok(g) => gpus.push(g),
                Err(e) => {
                    tracing::warn!(index, error = %e, "GPU unreadable through NVML; reporting it unhealthy");
                    gpus.push(Gpu {
                        index,
                        uuid: format!("GPU-unreadable-{index}"),
                        product: Product::Other("unknown".into()),
                        driver_name: String::new(),
                        memory_total_bytes: 0,
                        memory_used_bytes: 0,
                        utilisation_pct: 0,
                        mig: MigState::default(),
                        health: Health {
                            ecc_uncorrected: None,
                            healthy: false,
                            reason: Some(e.to_string()),
                        },
                    });
                }
            }
        }
        Ok(gpus)
    }

    fn set_mig_devices(&self, uuid: &str, _profiles: &[String]) -> Result<(), GpuError> {
        self.refuse_mig_apply(uuid)
    }
}

impl NvmlBackend {
    fn gpu(&self, index: u32) -> Result<Gpu, GpuError> {
        let label = format!("#{index}");
        let device = call("nvmlDeviceGetHandleByIndex", &label, self.nvml.device_by_index(index))?;
        let uuid = call("nvmlDeviceGetUUID", &label, device.uuid())?;
        let driver_name = call("nvmlDeviceGetName", &uuid, device.name())?;
        let memory = call("nvmlDeviceGetMemoryInfo", &uuid, device.memory_info())?;
        let product = Product::from_driver(&driver_name, memory.total);
        // Utilisation is not reported for GPUs in MIG mode; report 0 rather than fail.
        let utilisation_pct = device.utilization_rates().map(|u| u.gpu).unwrap_or(0);
        let enabled = matches!(device.mig_mode(), Ok(m) if m.current == 1);
        let devices = if enabled {
            mig_devices(&device, &uuid)?
        } else {
            Vec::new()
        };
        let ecc_uncorrected = device
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .ok();
        let healthy = ecc_uncorrected.unwrap_or(0) == 0;
        Ok(Gpu {
            index,
            uuid,
            mig: MigState {
                capable: product.mig_capable(),
                enabled,
                devices,
            },
            product,
            driver_name,
            memory_total_bytes: memory.total,
            memory_used_bytes: memory.used,
            utilisation_pct,
            health: Health {
                ecc_uncorrected,
                healthy,
                reason: (!healthy).then(|| "uncorrected ECC errors since the driver loaded".to_string()),
            },
        })
    }

    fn refuse_mig_apply(&self, uuid: &str) -> Result<(), GpuError> {
        // nvml-wrapper 0.13 has no safe wrapper for nvmlDeviceCreateGpuInstance /
        // nvmlGpuInstanceCreateComputeInstance; calling them needs the raw FFI, which this crate
        // does not allow yet (see issue #3's note). Refuse clearly instead of half-applying.
        Err(GpuError::Unsupported(format!(
            "applying MIG geometry through NVML is not available in this build; on GPU {uuid} apply the \
             validated geometry with `nvidia-smi mig -cgi <profiles> -C` (or mig-parted) while it is drained"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_profile_names_parse() {
        assert_eq!(mig_profile_from_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), "1g.10gb");
        assert_eq!(mig_profile_from_name("NVIDIA A100-SXM4-40GB MIG 3g.20gb"), "3g.20gb");
    }

    /// Runs on a GPU host: `cargo test -p laneway-agent -- --ignored nvml`.
    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn nvml_inventory_on_a_real_gpu() {
        let b = NvmlBackend::new().expect("NVML loads on a GPU host");
        let inv = b.inventory().expect("inventory");
        assert!(!inv.is_empty(), "no GPUs reported");
        for g in &inv {
            assert!(g.uuid.starts_with("GPU-"), "{g:?}");
            assert!(g.memory_total_bytes > 0, "{g:?}");
            assert!(!matches!(g.product, Product::Other(_)) || !g.driver_name.is_empty());
            for d in &g.mig.devices {
                assert!(d.uuid.starts_with("MIG-"), "{d:?}");
            }
        }
    }
}
