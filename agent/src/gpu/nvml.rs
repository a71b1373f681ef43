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

/// Runs `nvidia-smi <args> -i <uuid>`; with `none_is_ok`, "no instance found" is success.
fn nvidia_smi(uuid: &str, args: &[&str], none_is_ok: bool) -> Result<(), GpuError> {
    let out = std::process::Command::new("nvidia-smi")
        .args(args)
        .args(["-i", uuid])
        .output()
        .map_err(|e| GpuError::Unsupported(format!("running nvidia-smi (needed to apply MIG geometry): {e}")))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let nothing = text.to_ascii_lowercase().contains("no ") && text.to_ascii_lowercase().contains("found");
    if out.status.success() || (none_is_ok && nothing) {
        return Ok(());
    }
    Err(GpuError::Unsupported(format!(
        "`nvidia-smi {} -i {uuid}` failed: {}",
        args.join(" "),
        text.trim()
    )))
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

    /// Enables MIG mode through NVML, then replaces the GPU's instances with `profiles`
    /// through `nvidia-smi mig` (nvml-wrapper has no safe wrapper for the GPU-instance and
    /// compute-instance calls, and this workspace forbids `unsafe`), and checks the result
    /// through NVML. The caller has validated the geometry and drained the GPU.
    fn set_mig_devices(&self, uuid: &str, profiles: &[String]) -> Result<(), GpuError> {
        let device = call("nvmlDeviceGetHandleByUUID", uuid, self.nvml.device_by_uuid(uuid))?;
        let mode = call("nvmlDeviceGetMigMode", uuid, device.mig_mode())?;
        if mode.current != 1 {
            call("nvmlDeviceSetMigMode", uuid, device.set_mig_mode(true))?;
            let mode = call("nvmlDeviceGetMigMode", uuid, device.mig_mode())?;
            if mode.current != 1 {
                return Err(GpuError::Unsupported(format!(
                    "MIG mode on GPU {uuid} is pending until the GPU is reset; drain the node, run \
                     `nvidia-smi -i {uuid} -r` (or reboot), and the agent applies the geometry then"
                )));
            }
        }
        // Compute instances first, then GPU instances; "no instance found" is not an error.
        for args in [["mig", "-dci"], ["mig", "-dgi"]] {
            nvidia_smi(uuid, &args, true)?;
        }
        if profiles.is_empty() {
            // The whole card: MIG off again (a card in MIG mode without instances runs nothing).
            call("nvmlDeviceSetMigMode", uuid, device.set_mig_mode(false))?;
            return Ok(());
        }
        let list = profiles.join(",");
        nvidia_smi(uuid, &["mig", "-cgi", &list, "-C"], false)?;
        let device = call("nvmlDeviceGetHandleByUUID", uuid, self.nvml.device_by_uuid(uuid))?;
        let mut have: Vec<String> = mig_devices(&device, uuid)?.into_iter().map(|d| d.profile).collect();
        let mut want = profiles.to_vec();
        have.sort();
        want.sort();
        if have != want {
            return Err(GpuError::Unsupported(format!(
                "GPU {uuid} has MIG devices {have:?} after applying {want:?}; check `nvidia-smi mig -lgi -i {uuid}`"
            )));
        }
        Ok(())
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_profile_names_parse() {
        assert_eq!(mig_profile_from_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), "1g.10gb");
        assert_eq!(mig_profile_from_name("NVIDIA A100-SXM4-40GB MIG 3g.20gb"), "3g.20gb");
    }

    /// Runs on a GPU host with a MIG-capable card that nothing uses:
    /// `LANEWAY_MIG_TEST_GPU=GPU-… cargo test -p laneway-agent -- --ignored nvml_mig`.
    /// Applies two half-card slices, checks them, then removes them.
    #[test]
    #[ignore = "needs an idle MIG-capable NVIDIA GPU (H100/H200/A100) and root"]
    fn nvml_mig_geometry_applies_on_a_real_gpu() {
        let b = NvmlBackend::new().expect("NVML loads on a GPU host");
        let inv = b.inventory().expect("inventory");
        let gpu = match std::env::var("LANEWAY_MIG_TEST_GPU") {
            Ok(u) => inv
                .into_iter()
                .find(|g| g.uuid == u)
                .expect("LANEWAY_MIG_TEST_GPU names a GPU here"),
            Err(_) => inv.into_iter().find(|g| g.mig.capable).expect("a MIG-capable GPU"),
        };
        let half = crate::mig::profiles(&gpu.product)
            .and_then(|t| t.iter().find(|p| p.compute_slices == 3))
            .expect("a 3g profile")
            .name
            .to_string();
        let geometry = vec![half.clone(), half];
        b.set_mig_devices(&gpu.uuid, &geometry).expect("applied");
        let now = b.inventory().unwrap().into_iter().find(|g| g.uuid == gpu.uuid).unwrap();
        let mut have: Vec<String> = now.mig.devices.iter().map(|d| d.profile.clone()).collect();
        have.sort();
        assert_eq!(have, geometry);
        // Applying the same geometry again is idempotent; an empty one clears it.
        b.set_mig_devices(&gpu.uuid, &geometry).expect("idempotent");
        b.set_mig_devices(&gpu.uuid, &[]).expect("cleared");
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
