//! Queueing formulas for the capacity planner: M/M/c with Erlang C.
//!
//! A card (or MIG slice) running a model is one server whose rate is `max_batch / service time`
//! requests per second: at load the batcher fills batches, so that is the rate it drains at.
//! Erlang C gives the probability that an arrival waits; the M/M/c waiting time tail is
//! `P(W > t) = C · exp(-(cμ - λ) t)`, from which the p99 wait follows.

/// Probability that an arrival has to wait in an M/M/c queue with `c` servers and offered load
/// `a = λ/μ` Erlangs. Returns 1.0 when the queue is unstable (`a >= c`).
///
/// Computed through the Erlang B recursion, which stays stable for thousands of servers where
/// the factorial form overflows.
pub fn erlang_c(c: u32, a: f64) -> f64 {
    if c == 0 || a >= c as f64 {
        return 1.0;
    }
    if a <= 0.0 {
        return 0.0;
    }
    let mut b = 1.0;
    for k in 1..=c {
        b = a * b / (k as f64 + a * b);
    }
    let c = c as f64;
    c * b / (c - a * (1.0 - b))
}

/// The `q` quantile (e.g. 0.99) of the waiting time in seconds for M/M/c with arrival rate
/// `lambda` and per-server rate `mu`; `f64::INFINITY` when unstable.
pub fn wait_quantile(c: u32, lambda: f64, mu: f64, q: f64) -> f64 {
    let capacity = c as f64 * mu;
    if lambda >= capacity {
        return f64::INFINITY;
    }
    let p_wait = erlang_c(c, lambda / mu);
    let tail = 1.0 - q;
    if p_wait <= tail {
        return 0.0;
    }
    (p_wait / tail).ln() / (capacity - lambda)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erlang_c_matches_published_values() {
        // (servers, Erlangs, P(wait)) from standard Erlang C tables.
        let table = [
            (1, 0.5, 0.5),
            (2, 1.0, 0.3333),
            (3, 2.0, 0.4444),
            (5, 4.0, 0.5541),
            (10, 8.0, 0.4092),
            (20, 15.0, 0.1604),
        ];
        for (c, a, want) in table {
            let got = erlang_c(c, a);
            assert!((got - want).abs() < 5e-4, "C({c}, {a}) = {got}, table says {want}");
        }
    }

    #[test]
    fn unstable_and_idle_edges() {
        assert_eq!(erlang_c(4, 4.0), 1.0);
        assert_eq!(erlang_c(4, 0.0), 0.0);
        assert_eq!(wait_quantile(2, 10.0, 5.0, 0.99), f64::INFINITY);
        // Light load: fewer than 1% wait at all, so the p99 wait is zero.
        assert_eq!(wait_quantile(10, 1.0, 5.0, 0.99), 0.0);
    }

    #[test]
    fn large_fleets_do_not_overflow() {
        let p = erlang_c(5000, 4900.0);
        assert!(p.is_finite() && (0.0..=1.0).contains(&p), "{p}");
    }

    proptest::proptest! {
        #[test]
        fn more_servers_never_wait_more(c in 1u32..200, load in 0.05f64..0.99) {
            let a = c as f64 * load;
            proptest::prop_assert!(erlang_c(c + 1, a) <= erlang_c(c, a) + 1e-12);
        }

        #[test]
        fn more_load_never_waits_less(c in 1u32..200, load in 0.05f64..0.95) {
            let a = c as f64 * load;
            proptest::prop_assert!(erlang_c(c, a * 1.01) + 1e-12 >= erlang_c(c, a));
        }
    }
}
