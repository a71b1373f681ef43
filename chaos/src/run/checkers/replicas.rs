//! Replicas: a killed host's replicas are ready elsewhere within the scenario's bound, a
//! crashed replica is replaced within it, and after healing every warm floor is met again.

use serde_json::json;

use super::Verdict;
use crate::run::inject::FaultRecord;

/// `restored`: the time the floors took after healing, or why they were not met.
pub fn check(faults: &[FaultRecord], restored: &Result<u64, String>, bound_s: u64) -> Verdict {
    let measured: Vec<&FaultRecord> = faults
        .iter()
        .filter(|f| !f.kind.judged_by_raft() && (f.recovery_ms.is_some() || f.recovery_error.is_some()))
        .collect();
    let worst = measured.iter().filter_map(|f| f.recovery_ms).max();
    let mut v = Verdict::new(
        "replicas",
        json!({
            "faults_measured": measured.len(),
            "worst_recovery_ms": worst,
            "bound_ms": bound_s * 1000,
            "floors_restored_after_healing_ms": restored.as_ref().ok(),
        }),
    );
    for f in &measured {
        if let Some(e) = &f.recovery_error {
            v.violations.push(format!(
                "{} of {} at {} ms: replicas not ready elsewhere within {bound_s} s ({e})",
                f.kind.as_str(),
                f.target,
                f.at_ms
            ));
        }
    }
    if let Err(e) = restored {
        v.violations
            .push(format!("warm floors not restored after healing: {e}"));
    }
    v
}
