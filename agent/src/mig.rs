//! MIG geometry applied to a GPU: declarative per-GPU layouts in mig-parted profile names,
//! validated against the product's profile table (`laneway_core::gpu::mig`), applied only to a
//! drained GPU, idempotently.
//!
//! MIG geometry is a capacity plan, not an autoscaling lever (DESIGN §4): changing it destroys
//! every MIG device on the GPU, so the controller drains the GPU before it asks for a change.

pub use laneway_core::gpu::mig::{device_list, profiles, validate, Geometry, GeometryError, ProfileSpec};

use crate::gpu::{GpuBackend, GpuError};

/// Why a MIG layout was not applied.
#[derive(Debug, thiserror::Error)]
pub enum MigError {
    /// The layout does not fit the product's profile table.
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error("GPU {uuid} still runs {replicas} replica(s); drain it before changing its MIG geometry")]
    ReplicasRunning { uuid: String, replicas: usize },
    #[error(transparent)]
    Backend(#[from] GpuError),
}

/// What [`apply`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The GPU already had this geometry; nothing was touched.
    Unchanged,
    /// The MIG devices were replaced.
    Changed { devices: Vec<String> },
}

/// Applies `geometry` to GPU `uuid`: validated, idempotent, refused while replicas run on it.
pub fn apply(
    backend: &dyn GpuBackend,
    uuid: &str,
    geometry: &Geometry,
    running_replicas: usize,
) -> Result<Applied, MigError> {
    let gpu = backend
        .inventory()?
        .into_iter()
        .find(|g| g.uuid == uuid)
        .ok_or_else(|| GpuError::UnknownGpu(uuid.to_string()))?;
    validate(&gpu.product, uuid, geometry)?;
    let desired = device_list(&gpu.product, geometry);
    let mut current: Vec<String> = gpu.mig.devices.iter().map(|d| d.profile.clone()).collect();
    let mut wanted = desired.clone();
    current.sort();
    wanted.sort();
    if current == wanted && (gpu.mig.enabled || desired.is_empty()) {
        return Ok(Applied::Unchanged);
    }
    if running_replicas > 0 {
        return Err(MigError::ReplicasRunning {
            uuid: uuid.to_string(),
            replicas: running_replicas,
        });
    }
    backend.set_mig_devices(uuid, &desired)?;
    Ok(Applied::Changed { devices: desired })
}

/// How long after a failed apply the agent tries a GPU's layout again.
pub const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// Brings GPUs to the MIG layouts the controllers want, one heartbeat reply at a time.
#[derive(Default)]
pub struct Reconciler {
    /// GPUs whose last apply failed, and when to try again.
    retry_at: std::collections::HashMap<String, tokio::time::Instant>,
    /// GPUs already reported as waiting for their replicas to leave (logged once).
    waiting: std::collections::HashSet<String>,
}

impl Reconciler {
    /// Applies each wanted layout whose GPU runs no replica (`running` counts the replicas on
    /// a GPU or its MIG devices). Returns the GPUs whose layout is still to be applied: no
    /// placed replica may start on them.
    pub fn reconcile(
        &mut self,
        backend: &dyn GpuBackend,
        wanted: &[(String, Vec<String>)],
        running: impl Fn(&str, &[String]) -> usize,
    ) -> std::collections::HashSet<String> {
        let mut pending = std::collections::HashSet::new();
        if wanted.is_empty() {
            return pending;
        }
        let inventory = match backend.inventory() {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the GPUs to apply MIG layouts");
                return wanted.iter().map(|(g, _)| g.clone()).collect();
            }
        };
        let now = tokio::time::Instant::now();
        for (uuid, profiles) in wanted {
            let mut geometry = Geometry::new();
            for p in profiles {
                *geometry.entry(p.clone()).or_default() += 1;
            }
            let Some(gpu) = inventory.iter().find(|g| &g.uuid == uuid) else {
                tracing::warn!(gpu = %uuid, "a MIG layout was set for a GPU this host does not have");
                continue;
            };
            let devices: Vec<String> = gpu.mig.devices.iter().map(|d| d.uuid.clone()).collect();
            let on_it = running(uuid, &devices);
            if self.retry_at.get(uuid).is_some_and(|t| *t > now) {
                pending.insert(uuid.clone());
                continue;
            }
            match apply(backend, uuid, &geometry, on_it) {
                Ok(Applied::Unchanged) => {
                    self.waiting.remove(uuid);
                }
                Ok(Applied::Changed { devices }) => {
                    self.waiting.remove(uuid);
                    tracing::info!(gpu = %uuid, ?devices, "applied the MIG layout");
                }
                Err(MigError::ReplicasRunning { replicas, .. }) => {
                    if self.waiting.insert(uuid.clone()) {
                        tracing::info!(gpu = %uuid, replicas, "MIG layout waits until the replicas on this GPU have moved off");
                    }
                    pending.insert(uuid.clone());
                }
                Err(e) => {
                    tracing::warn!(gpu = %uuid, error = %e, "cannot apply the MIG layout; trying again in {RETRY_AFTER:?}");
                    self.retry_at.insert(uuid.clone(), now + RETRY_AFTER);
                    pending.insert(uuid.clone());
                }
            }
        }
        pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::sim::SimBackend;
    use crate::gpu::Product;

    /// A product, a geometry, and (for invalid ones) what the error must say.
    type Case<'a> = (Product, &'a [(&'a str, u32)], &'a str);

    fn geo(items: &[(&str, u32)]) -> Geometry {
        items.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn valid_geometries_per_product() {
        let ok: &[(Product, &[(&str, u32)])] = &[
            (Product::H100_80GB, &[("1g.10gb", 7)]),
            (Product::H100_80GB, &[("3g.40gb", 2)]),
            (Product::H100_80GB, &[("4g.40gb", 1), ("2g.20gb", 1), ("1g.10gb", 1)]),
            (Product::H100_80GB, &[("7g.80gb", 1)]),
            (Product::H200, &[("1g.18gb", 7)]),
            (Product::H200, &[("3g.71gb", 1), ("1g.35gb", 2)]),
            (Product::A100_40GB, &[("3g.20gb", 1), ("2g.10gb", 1), ("1g.5gb", 2)]),
        ];
        for (product, g) in ok {
            validate(product, "GPU-x", &geo(g)).unwrap_or_else(|e| panic!("{product} {g:?}: {e}"));
        }
    }

    #[test]
    fn invalid_geometries_say_why() {
        let cases: &[Case] = &[
            (Product::H100_80GB, &[("1g.10gb", 8)], "at most 7"),
            (Product::H100_80GB, &[("7g.80gb", 1), ("1g.10gb", 1)], "compute slices"),
            (Product::H100_80GB, &[("3g.40gb", 2), ("1g.20gb", 1)], "memory slices"),
            (Product::H100_80GB, &[("4g.40gb", 1), ("1g.20gb", 3)], "memory slices"),
            (Product::H100_80GB, &[("1g.18gb", 1)], "not a MIG profile of H100-80GB"),
            (Product::H200, &[("1g.10gb", 1)], "valid profiles: 1g.18gb"),
            (Product::L4, &[("1g.10gb", 1)], "time-slicing only"),
            (Product::L40S, &[("1g.10gb", 1)], "time-slicing only"),
        ];
        for (product, g, want) in cases {
            let e = validate(product, "GPU-x", &geo(g)).expect_err(want).to_string();
            assert!(e.contains(want), "{product} {g:?}: {e}");
        }
    }

    fn node() -> SimBackend {
        SimBackend::from_toml("node = \"n\"\n[[gpu]]\nproduct = \"H100-80GB\"\n[[gpu]]\nproduct = \"L4\"\n").unwrap()
    }

    #[test]
    fn apply_is_idempotent_and_refused_while_replicas_run() {
        let b = node();
        let g = geo(&[("3g.40gb", 1), ("1g.10gb", 2)]);
        let h100 = "GPU-sim-n-0";
        assert_eq!(
            apply(&b, h100, &g, 0).unwrap(),
            Applied::Changed {
                devices: vec!["3g.40gb".into(), "1g.10gb".into(), "1g.10gb".into()]
            }
        );
        let inv = b.inventory().unwrap();
        assert!(inv[0].mig.enabled);
        assert_eq!(inv[0].mig.devices.len(), 3);
        assert!(inv[0].mig.devices.iter().all(|d| d.uuid.starts_with("MIG-")));
        // Same geometry again: nothing to do, even with replicas running on it.
        assert_eq!(apply(&b, h100, &g, 2).unwrap(), Applied::Unchanged);
        // A different geometry while replicas run: refused, and the GPU is untouched.
        let e = apply(&b, h100, &geo(&[("7g.80gb", 1)]), 1).unwrap_err();
        assert!(matches!(e, MigError::ReplicasRunning { .. }), "{e}");
        assert_eq!(b.inventory().unwrap()[0].mig.devices.len(), 3);
        // Drained: applied.
        assert!(matches!(
            apply(&b, h100, &geo(&[("7g.80gb", 1)]), 0).unwrap(),
            Applied::Changed { .. }
        ));
    }

    #[test]
    fn apply_refuses_non_mig_products_and_unknown_gpus() {
        let b = node();
        let e = apply(&b, "GPU-sim-n-1", &geo(&[("1g.10gb", 1)]), 0).unwrap_err();
        assert!(
            matches!(e, MigError::Geometry(GeometryError::NotMigCapable { .. })),
            "{e}"
        );
        let e = apply(&b, "GPU-nope", &geo(&[("1g.10gb", 1)]), 0).unwrap_err();
        assert!(e.to_string().contains("no GPU with UUID GPU-nope"), "{e}");
    }
}
