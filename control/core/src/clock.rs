//! The one wall-clock read every process shares, for the timestamps commands and records carry.
//! Decisions never call it: they take `now` from their caller, so tests can inject the time.

/// Wall-clock milliseconds since the Unix epoch (0 on a clock set before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
