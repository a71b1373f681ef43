//! Tenants: hashed API keys and per-class ceilings and rates, and how they change.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;
use crate::refused::Refused;

/// Limits of one tenant on one lane (class).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLimit {
    /// Requests in flight (queued or running) at once on one router.
    pub concurrency: u32,
    /// Sustained requests per second (token bucket refill).
    pub rate_per_s: u32,
    /// Bucket size: requests that may arrive at once above the rate.
    pub burst: u32,
    /// Language-model lanes: input + output tokens per minute (a bucket a minute deep).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_min: Option<u32>,
}

/// A tenant: its API key (only the sha256 is stored) and its limits per class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    pub name: String,
    /// sha256 (hex) of the API key.
    pub key_sha256: String,
    /// Class name (or `*` for every class without its own entry) → limit. No entry: no limit.
    #[serde(default)]
    pub limits: BTreeMap<String, TenantLimit>,
}

impl Tenant {
    /// The limit that applies to `class`, if any.
    pub fn limit_for(&self, class: &str) -> Option<TenantLimit> {
        self.limits.get(class).or_else(|| self.limits.get("*")).copied()
    }
}

impl TenantLimit {
    pub fn validate(&self) -> Result<(), Refused> {
        if self.concurrency == 0 || self.rate_per_s == 0 || self.burst == 0 || self.tokens_per_min == Some(0) {
            return Err(format!(
                "limit {self:?}: concurrency, rate_per_s, burst and tokens_per_min must all be > 0 (to stop a tenant, rotate its key)"
            ).into());
        }
        Ok(())
    }
}

/// sha256 (hex) of an API key, as stored.
pub fn hash_key(key: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

impl Registry {
    pub fn create_tenant(&mut self, tenant: &Tenant) -> Result<(), Refused> {
        validate_name("tenant", &tenant.name)?;
        if self.tenants.contains_key(&tenant.name) {
            return Err(Refused::Conflict(format!(
                "tenant {} exists; use `lanectl tenant rotate-key` for a new key",
                tenant.name
            )));
        }
        if self.tenants.len() >= MAX_ENTRIES {
            return Err(Refused::Conflict(format!("{MAX_ENTRIES} tenants already")));
        }
        for l in tenant.limits.values() {
            l.validate()?;
        }
        self.tenants.insert(tenant.name.clone(), tenant.clone());
        Ok(())
    }

    pub fn set_tenant_limit(&mut self, tenant: &str, class: &str, limit: Option<TenantLimit>) -> Result<(), Refused> {
        if class != "*" && !self.classes.contains_key(class) {
            return Err(Refused::NotFound(format!(
                "no class {class}; give a class from `lanectl lane list`, or * for every class"
            )));
        }
        let t = self
            .tenants
            .get_mut(tenant)
            .ok_or_else(|| Refused::NotFound(format!("no tenant {tenant}; `lanectl tenant list` shows the tenants")))?;
        match limit {
            Some(l) => {
                l.validate()?;
                t.limits.insert(class.to_string(), l);
            }
            None => {
                t.limits.remove(class);
            }
        }
        Ok(())
    }

    pub fn rotate_key(&mut self, tenant: &str, key_sha256: &str) -> Result<(), Refused> {
        let t = self
            .tenants
            .get_mut(tenant)
            .ok_or_else(|| Refused::NotFound(format!("no tenant {tenant}; `lanectl tenant list` shows the tenants")))?;
        t.key_sha256 = key_sha256.to_string();
        Ok(())
    }
}
