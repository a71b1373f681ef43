//! What a long wait is at (`job submit --wait`, `rollout status --watch`, `cluster
//! bootstrap`, `mig apply --wait`): when stdout is a terminal, someone is watching, so a
//! spinner on stderr shows the elapsed time and the current step, and each step stays above it;
//! otherwise (a pipe, a script, CI) every step is a plain line on stderr, as a log keeps it.
//! Either way stdout carries only the command's answer.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio::time::Instant;

pub struct Progress {
    bar: Option<ProgressBar>,
    started: Instant,
    last: String,
}

impl Progress {
    /// Starts showing `what` is being waited for.
    pub fn start(what: &str) -> Progress {
        Progress::new(what, std::io::stdout().is_terminal())
    }

    fn new(what: &str, terminal: bool) -> Progress {
        let bar = terminal.then(|| {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} [{elapsed:>3}] {msg}").expect("a valid progress template"),
            );
            bar.enable_steady_tick(Duration::from_millis(120));
            bar.set_message(what.to_string());
            bar
        });
        if bar.is_none() {
            eprintln!("{what}");
        }
        Progress {
            bar,
            started: Instant::now(),
            last: String::new(),
        }
    }

    /// A step: kept above the spinner (which then shows it), or a line with the elapsed
    /// time. The same step twice in a row is said once.
    pub fn step(&mut self, msg: impl Into<String>) {
        let msg = msg.into();
        if msg == self.last {
            return;
        }
        let line = format!("[{:>6.1}s] {msg}", self.started.elapsed().as_secs_f64());
        match &self.bar {
            Some(bar) => {
                bar.println(line);
                bar.set_message(msg.clone());
            }
            None => eprintln!("{line}"),
        }
        self.last = msg;
    }

    /// Runs `f` (which writes to stdout) with the spinner out of the way.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }
}

impl Drop for Progress {
    /// The spinner goes when the wait ends, however it ends (an error too).
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_terminal_steps_are_said_once_each() {
        let mut p = Progress::new("waiting", false);
        assert!(p.bar.is_none());
        p.step("queued");
        p.step("queued");
        assert_eq!(p.last, "queued");
        p.step("running");
        assert_eq!(p.last, "running");
        assert_eq!(p.suspend(|| 7), 7);
    }
}
