//! MIG geometry: per-product profile tables in mig-parted's names and the pure checks on a
//! declared layout. Applying a layout to a GPU is the agent's (`laneway_agent::mig`).
//!
//! MIG geometry is a capacity plan, not an autoscaling lever (DESIGN §4): changing it destroys
//! every MIG device on the GPU, so the controller drains the GPU before it asks for a change.

use std::collections::BTreeMap;

use super::Product;

/// One MIG profile: the compute slices (of 7) and memory slices (of 8) it takes, and how many
/// of it fit on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfileSpec {
    pub name: &'static str,
    pub compute_slices: u32,
    pub memory_slices: u32,
    pub max_per_gpu: u32,
}

const fn p(name: &'static str, compute_slices: u32, memory_slices: u32, max_per_gpu: u32) -> ProfileSpec {
    ProfileSpec {
        name,
        compute_slices,
        memory_slices,
        max_per_gpu,
    }
}

const A100_40GB: &[ProfileSpec] = &[
    p("1g.5gb", 1, 1, 7),
    p("1g.10gb", 1, 2, 4),
    p("2g.10gb", 2, 2, 3),
    p("3g.20gb", 3, 4, 2),
    p("4g.20gb", 4, 4, 1),
    p("7g.40gb", 7, 8, 1),
];
const X_80GB: &[ProfileSpec] = &[
    p("1g.10gb", 1, 1, 7),
    p("1g.20gb", 1, 2, 4),
    p("2g.20gb", 2, 2, 3),
    p("3g.40gb", 3, 4, 2),
    p("4g.40gb", 4, 4, 1),
    p("7g.80gb", 7, 8, 1),
];
const H200: &[ProfileSpec] = &[
    p("1g.18gb", 1, 1, 7),
    p("1g.35gb", 1, 2, 4),
    p("2g.35gb", 2, 2, 3),
    p("3g.71gb", 3, 4, 2),
    p("4g.71gb", 4, 4, 1),
    p("7g.141gb", 7, 8, 1),
];
const B200: &[ProfileSpec] = &[
    p("1g.23gb", 1, 1, 7),
    p("1g.45gb", 1, 2, 4),
    p("2g.45gb", 2, 2, 3),
    p("3g.90gb", 3, 4, 2),
    p("4g.90gb", 4, 4, 1),
    p("7g.180gb", 7, 8, 1),
];

/// The MIG profiles of a product; `None` for products without MIG.
pub fn profiles(product: &Product) -> Option<&'static [ProfileSpec]> {
    match product {
        Product::A100_40GB => Some(A100_40GB),
        Product::A100_80GB | Product::H100_80GB => Some(X_80GB),
        Product::H200 => Some(H200),
        Product::B200 => Some(B200),
        Product::L4 | Product::L40S | Product::Other(_) => None,
    }
}

/// A geometry: profile name → how many devices of it.
pub type Geometry = BTreeMap<String, u32>;

/// Why a geometry was refused by the product's profile table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("{product} GPU {uuid} has no MIG; it supports time-slicing only, so give it whole-card replicas")]
    NotMigCapable { product: Product, uuid: String },
    #[error("{profile:?} is not a MIG profile of {product}; valid profiles: {valid}")]
    UnknownProfile {
        profile: String,
        product: Product,
        valid: String,
    },
    #[error("{count} x {profile} requested, but at most {max} fit on one {product}")]
    TooMany {
        profile: String,
        count: u32,
        max: u32,
        product: Product,
    },
    #[error("the geometry needs {needed} of 7 compute slices on {product}; remove or shrink devices")]
    ComputeOverflow { needed: u32, product: Product },
    #[error("the geometry needs {needed} of 8 memory slices on {product}; remove or shrink devices")]
    MemoryOverflow { needed: u32, product: Product },
}

/// Checks a geometry against the product's profile table.
pub fn validate(product: &Product, uuid: &str, geometry: &Geometry) -> Result<(), GeometryError> {
    let table = profiles(product).ok_or_else(|| GeometryError::NotMigCapable {
        product: product.clone(),
        uuid: uuid.to_string(),
    })?;
    let (mut compute, mut memory) = (0, 0);
    for (name, &count) in geometry {
        let spec = table
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| GeometryError::UnknownProfile {
                profile: name.clone(),
                product: product.clone(),
                valid: table.iter().map(|s| s.name).collect::<Vec<_>>().join(", "),
            })?;
        if count > spec.max_per_gpu {
            return Err(GeometryError::TooMany {
                profile: name.clone(),
                count,
                max: spec.max_per_gpu,
                product: product.clone(),
            });
        }
        compute += spec.compute_slices * count;
        memory += spec.memory_slices * count;
    }
    if compute > 7 {
        return Err(GeometryError::ComputeOverflow {
            needed: compute,
            product: product.clone(),
        });
    }
    if memory > 8 {
        return Err(GeometryError::MemoryOverflow {
            needed: memory,
            product: product.clone(),
        });
    }
    Ok(())
}

/// The devices a geometry expands to, largest first (the order NVIDIA recommends creating them).
pub fn device_list(product: &Product, geometry: &Geometry) -> Vec<String> {
    let table = profiles(product).unwrap_or(&[]);
    let mut out: Vec<(u32, u32, String)> = Vec::new();
    for (name, &count) in geometry {
        let (c, m) = table
            .iter()
            .find(|s| s.name == name)
            .map_or((0, 0), |s| (s.compute_slices, s.memory_slices));
        for _ in 0..count {
            out.push((c, m, name.clone()));
        }
    }
    out.sort_by(|a, b| (b.0, b.1).cmp(&(a.0, a.1)).then(a.2.cmp(&b.2)));
    out.into_iter().map(|(_, _, n)| n).collect()
}
