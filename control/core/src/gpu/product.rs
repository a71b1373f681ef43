//! GPU products as Laneway names them: the key of node pools, model profiles and prices.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A normalised GPU product.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum Product {
    L4,
    L40S,
    A100_40GB,
    A100_80GB,
    H100_80GB,
    H200,
    B200,
    /// Anything else, by the name the driver reports.
    Other(String),
}

const GIB: u64 = 1024 * 1024 * 1024;

impl Product {
    /// Normalises a driver product name (e.g. `NVIDIA H100 80GB HBM3`) and total memory.
    pub fn from_driver(name: &str, memory_bytes: u64) -> Product {
        let n = name.to_ascii_uppercase().replace('-', " ");
        let has = |s: &str| n.split_whitespace().any(|w| w == s);
        if has("L40S") {
            Product::L40S
        } else if has("L4") {
            Product::L4
        } else if has("H200") {
            Product::H200
        } else if has("B200") {
            Product::B200
        } else if has("H100") {
            Product::H100_80GB
        } else if has("A100") {
            // The 40 GB and 80 GB A100s share a name stem; memory tells them apart.
            if memory_bytes > 48 * GIB || n.contains("80GB") {
                Product::A100_80GB
            } else {
                Product::A100_40GB
            }
        } else {
            Product::Other(name.trim().to_string())
        }
    }

    /// Whether the product supports MIG partitioning (L4 and L40S time-slice only).
    pub fn mig_capable(&self) -> bool {
        matches!(
            self,
            Product::A100_40GB | Product::A100_80GB | Product::H100_80GB | Product::H200 | Product::B200
        )
    }

    /// Parses a Laneway product name (`H100-80GB`), as written in configuration.
    pub fn parse(s: &str) -> Option<Product> {
        Some(match s {
            "L4" => Product::L4,
            "L40S" => Product::L40S,
            "A100-40GB" => Product::A100_40GB,
            "A100-80GB" => Product::A100_80GB,
            "H100-80GB" => Product::H100_80GB,
            "H200" => Product::H200,
            "B200" => Product::B200,
            _ => return None,
        })
    }

    /// Memory of the product in GiB, when known.
    pub fn memory_gib(&self) -> Option<u64> {
        Some(match self {
            Product::L4 => 24,
            Product::L40S => 48,
            Product::A100_40GB => 40,
            Product::A100_80GB | Product::H100_80GB => 80,
            Product::H200 => 141,
            Product::B200 => 180,
            Product::Other(_) => return None,
        })
    }
}

impl fmt::Display for Product {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Product::L4 => "L4",
            Product::L40S => "L40S",
            Product::A100_40GB => "A100-40GB",
            Product::A100_80GB => "A100-80GB",
            Product::H100_80GB => "H100-80GB",
            Product::H200 => "H200",
            Product::B200 => "B200",
            Product::Other(name) => name,
        })
    }
}

impl From<Product> for String {
    fn from(p: Product) -> String {
        p.to_string()
    }
}

impl From<String> for Product {
    fn from(s: String) -> Product {
        Product::parse(&s).unwrap_or(Product::Other(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_names_normalise() {
        let cases = [
            ("NVIDIA L4", 24, Product::L4),
            ("NVIDIA L40S", 48, Product::L40S),
            ("NVIDIA A100-SXM4-40GB", 40, Product::A100_40GB),
            ("NVIDIA A100-SXM4-80GB", 80, Product::A100_80GB),
            ("NVIDIA A100 80GB PCIe", 80, Product::A100_80GB),
            ("NVIDIA H100 80GB HBM3", 80, Product::H100_80GB),
            ("NVIDIA H200", 141, Product::H200),
            ("Tesla T4", 16, Product::Other("Tesla T4".into())),
        ];
        for (name, gib, want) in cases {
            assert_eq!(Product::from_driver(name, gib * GIB), want, "{name}");
        }
    }

    #[test]
    fn names_round_trip_and_mig_capability() {
        for p in [
            Product::L4,
            Product::L40S,
            Product::A100_80GB,
            Product::H100_80GB,
            Product::H200,
        ] {
            assert_eq!(Product::parse(&p.to_string()), Some(p.clone()));
        }
        assert!(!Product::L4.mig_capable());
        assert!(!Product::L40S.mig_capable());
        assert!(Product::H100_80GB.mig_capable());
        assert!(Product::H200.mig_capable());
    }
}
