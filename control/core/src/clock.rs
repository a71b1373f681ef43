//! The one wall-clock read every process shares, for the timestamps commands and records carry.
//! Decisions never call it: they take `now` from their caller, so tests can inject the time.

use std::sync::atomic::{AtomicI64, Ordering};

/// Milliseconds added to the system clock: 0, unless a chaos run jumped this process's clock
/// (a testing build's `clock::offset_ms` failpoint; see [`set_offset_ms`]).
static OFFSET_MS: AtomicI64 = AtomicI64::new(0);

/// Wall-clock milliseconds since the Unix epoch (0 on a clock set before 1970).
pub fn unix_ms() -> u64 {
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    real.saturating_add_signed(OFFSET_MS.load(Ordering::Relaxed))
}

/// Jumps this process's wall clock by `ms` from the system's (0: back to it), as an NTP step
/// or a bad RTC would. Only the chaos harness calls it, through a testing build's
/// `SetFailpoint("clock::offset_ms", "<ms>")`; the monotonic clocks Raft's timers and leases
/// use are not touched, as a real jump does not touch them.
pub fn set_offset_ms(ms: i64) {
    OFFSET_MS.store(ms, Ordering::Relaxed);
}

/// The current jump (see [`set_offset_ms`]).
pub fn offset_ms() -> i64 {
    OFFSET_MS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jump_moves_the_wall_clock_and_back() {
        let before = unix_ms();
        set_offset_ms(3_600_000);
        let jumped = unix_ms();
        set_offset_ms(-3_600_000);
        let back = unix_ms();
        set_offset_ms(0);
        assert!(
            jumped >= before + 3_600_000 && jumped < before + 3_660_000,
            "{before} → {jumped}"
        );
        assert!(
            back + 3_600_000 <= unix_ms() + 1000 && back < before,
            "{before} → {back}"
        );
    }
}
