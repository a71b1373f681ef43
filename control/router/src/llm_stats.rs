//! What a router measured of its language models lately: time to first token, inter-token
//! latency and tokens per model and lane, for the autoscaler's signals, `lane show` and the
//! dashboard.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use laneway_core::lane_report::LlmSummary;
use tokio::time::Instant;

use super::RequestRecord;

/// The window of the TTFT the fast loop scales on.
pub const SIGNAL_WINDOW: Duration = Duration::from_secs(10);

/// Samples older than this leave the recent statistics.
pub const RECENT: Duration = Duration::from_secs(60);

pub const MAX_TTFT_SAMPLES: usize = 4096;

pub const MAX_ITL_SAMPLES: usize = 16384;

/// Recent samples of one (class, model).
#[derive(Default)]
pub struct Recent {
    ttft: VecDeque<(Instant, f64)>,
    itl: VecDeque<(Instant, f64)>,
    /// (finished at, input tokens, output tokens, GPU ms).
    done: VecDeque<(Instant, u32, u32, f64)>,
}

impl Recent {
    fn trim(&mut self, now: Instant) {
        let old = |at: &Instant| now.saturating_duration_since(*at) > RECENT;
        while self.ttft.front().is_some_and(|(at, _)| old(at)) || self.ttft.len() > MAX_TTFT_SAMPLES {
            self.ttft.pop_front();
        }
        while self.itl.front().is_some_and(|(at, _)| old(at)) || self.itl.len() > MAX_ITL_SAMPLES {
            self.itl.pop_front();
        }
        while self.done.front().is_some_and(|(at, ..)| old(at)) || self.done.len() > MAX_TTFT_SAMPLES {
            self.done.pop_front();
        }
    }
}

/// Quantile `q` (0–1) of `values` by nearest rank.
pub fn quantile(mut values: Vec<f64>, q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    Some(values[rank - 1])
}

/// TTFT, ITL and tokens of the language models this router served lately.
#[derive(Default)]
pub struct LlmStats {
    models: Mutex<HashMap<(String, String), Recent>>,
}

impl LlmStats {
    fn with<R>(&self, class: &str, model: &str, f: impl FnOnce(&mut Recent) -> R) -> R {
        let mut m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        f(m.entry((class.to_string(), model.to_string())).or_default())
    }

    pub fn observe_itl(&self, class: &str, model: &str, ms: f64, now: Instant) {
        self.with(class, model, |r| {
            r.itl.push_back((now, ms));
            r.trim(now);
        });
    }

    /// Counts a finished request (one that reached a replica and measured a first token).
    pub fn finished(&self, rec: &RequestRecord, now: Instant) {
        let Some(ttft) = rec.ttft_ms else { return };
        self.with(&rec.class, &rec.model, |r| {
            r.ttft.push_back((now, ttft));
            r.done
                .push_back((now, rec.input_tokens, rec.output_tokens, rec.gpu_ms.unwrap_or(0.0)));
            r.trim(now);
        });
    }

    /// The models of `class`, summarised.
    pub fn summary(&self, class: &str, now: Instant) -> Vec<LlmSummary> {
        let mut m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<LlmSummary> = m
            .iter_mut()
            .filter(|((c, _), _)| c == class)
            .map(|((_, model), r)| {
                r.trim(now);
                let ttft: Vec<f64> = r.ttft.iter().map(|(_, v)| *v).collect();
                let itl: Vec<f64> = r.itl.iter().map(|(_, v)| *v).collect();
                let gpu_ms: f64 = r.done.iter().map(|d| d.3).sum();
                let output: u64 = r.done.iter().map(|d| u64::from(d.2)).sum();
                LlmSummary {
                    model: model.clone(),
                    requests: r.done.len() as u64,
                    ttft_p50_ms: quantile(ttft.clone(), 0.5),
                    ttft_p99_ms: quantile(ttft, 0.99),
                    itl_p50_ms: quantile(itl.clone(), 0.5),
                    itl_p99_ms: quantile(itl, 0.99),
                    input_tokens: r.done.iter().map(|d| u64::from(d.1)).sum(),
                    output_tokens: output,
                    output_tokens_per_gpu_s: (gpu_ms > 0.0).then(|| output as f64 / (gpu_ms / 1000.0)),
                }
            })
            .filter(|s| s.requests > 0 || s.itl_p99_ms.is_some())
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }

    /// TTFT and ITL p99 (ms) of every model of `class` over the last `window`.
    pub fn lane_p99(&self, class: &str, window: Duration, now: Instant) -> (Option<f64>, Option<f64>) {
        let m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let recent = |samples: &VecDeque<(Instant, f64)>| -> Vec<f64> {
            samples
                .iter()
                .filter(|(at, _)| now.saturating_duration_since(*at) <= window)
                .map(|(_, v)| *v)
                .collect()
        };
        let (mut ttft, mut itl) = (Vec::new(), Vec::new());
        for ((c, _), r) in m.iter() {
            if c == class {
                ttft.extend(recent(&r.ttft));
                itl.extend(recent(&r.itl));
            }
        }
        (quantile(ttft, 0.99), quantile(itl, 0.99))
    }

    /// TTFT p99 (ms) of `model` over the last `window`, and how many samples it rests on.
    pub fn ttft_p99(&self, model: &str, window: Duration, now: Instant) -> Option<(f64, usize)> {
        let m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let values: Vec<f64> = m
            .iter()
            .filter(|((_, name), _)| name == model)
            .flat_map(|(_, r)| r.ttft.iter())
            .filter(|(at, _)| now.saturating_duration_since(*at) <= window)
            .map(|(_, v)| *v)
            .collect();
        let n = values.len();
        quantile(values, 0.99).map(|p| (p, n))
    }
}
