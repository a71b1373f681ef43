//! The OpenAI wire, byte by byte: server-sent events scanned with a bound on each event, the
//! usage an engine reports, and the few body rewrites the router makes (the served model's name,
//! asking for usage, a streamed answer turned whole).

use bytes::Bytes;
use serde::Deserialize;

/// An SSE `error` event, as OpenAI-compatible clients read it.
pub(crate) fn error_event(message: &str) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": "laneway_stream_error"}});
    Bytes::from(format!("event: error\ndata: {v}\n\n"))
}

/// The part of a completion (or a streamed chunk) the router reads.
#[derive(Deserialize)]
pub struct Chunk {
    #[serde(default)]
    pub(crate) choices: Vec<ChunkChoice>,
    #[serde(default)]
    pub(crate) usage: Option<ReportedUsage>,
}

#[derive(Deserialize)]
pub struct ChunkChoice {
    #[serde(default)]
    pub(crate) delta: Option<Delta>,
    #[serde(default)]
    pub(crate) text: Option<String>,
}

#[derive(Deserialize)]
pub struct Delta {
    #[serde(default)]
    pub(crate) content: Option<String>,
}

#[derive(Deserialize, Clone, Copy)]
pub struct ReportedUsage {
    pub(crate) prompt_tokens: u32,
    /// Absent from an embeddings answer.
    #[serde(default)]
    pub(crate) completion_tokens: u32,
    /// The simulated server's GPU time for the request; real servers do not report it.
    #[serde(default)]
    pub(crate) laneway_gpu_ms: Option<f64>,
}

impl Chunk {
    pub(crate) fn has_token(&self) -> bool {
        self.choices.iter().any(|c| {
            c.text.as_deref().is_some_and(|t| !t.is_empty())
                || c.delta
                    .as_ref()
                    .and_then(|d| d.content.as_deref())
                    .is_some_and(|t| !t.is_empty())
        })
    }
}

/// A server-sent event stream's line (or, stripping, event) over the router's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("sent a server-sent event line or event over the router's limit of {limit} bytes (router.max_event_bytes); the stream was cut off there")]
pub struct EventTooLong {
    pub(crate) limit: usize,
}

/// Reads server-sent events as they pass, across frame boundaries. When it strips the usage
/// chunk (the router asked for it, the client did not), it also rebuilds what passes on: whole
/// events only, without that one; otherwise frames pass on untouched. What it holds is bounded:
/// a line (and, stripping, an event) longer than `max_event_bytes` ends the scan.
pub struct SseScanner {
    /// An event line split across frames.
    pub(crate) carry: Vec<u8>,
    /// The longest line, and the longest event stripping, it reads.
    pub(crate) max_event_bytes: usize,
    pub(crate) strip_usage: bool,
    /// Stripping: the lines read of the event not yet ended.
    pub(crate) event: Vec<u8>,
    /// Stripping: that event is the usage chunk.
    pub(crate) event_is_usage: bool,
    /// Stripping: whole events to pass on.
    pub(crate) out: Vec<u8>,
}

impl SseScanner {
    pub fn new(strip_usage: bool, max_event_bytes: usize) -> Self {
        SseScanner {
            carry: Vec::new(),
            max_event_bytes,
            strip_usage,
            event: Vec::new(),
            event_is_usage: false,
            out: Vec::new(),
        }
    }

    pub(crate) fn strips(&self) -> bool {
        self.strip_usage
    }

    /// Events in `data` that carry a token, and the usage if one reported it; or, for a line
    /// (or an event) over the limit, the error, after which the stream must end
    /// ([`SseScanner::cut_off`]).
    pub fn scan(&mut self, data: &[u8]) -> Result<(u32, Option<ReportedUsage>), EventTooLong> {
        let too_long = EventTooLong {
            limit: self.max_event_bytes,
        };
        let (mut tokens, mut usage) = (0, None);
        let mut rest = data;
        while let Some(i) = rest.iter().position(|b| *b == b'\n') {
            if self.carry.len() + i > self.max_event_bytes {
                return Err(too_long);
            }
            let line = if self.carry.is_empty() {
                &rest[..i]
            } else {
                self.carry.extend_from_slice(&rest[..i]);
                self.carry.as_slice()
            };
            if let Some(payload) = line.strip_prefix(b"data:") {
                let payload = payload.trim_ascii();
                if payload != b"[DONE]" {
                    if let Ok(c) = serde_json::from_slice::<Chunk>(payload) {
                        tokens += u32::from(c.has_token());
                        // The usage chunk has no choices (OpenAI's `include_usage`).
                        self.event_is_usage |= c.usage.is_some() && c.choices.is_empty();
                        usage = c.usage.or(usage);
                    }
                }
            }
            if self.strip_usage {
                if self.event.len() + line.len() + 1 > self.max_event_bytes {
                    return Err(too_long);
                }
                self.event.extend_from_slice(line);
                self.event.push(b'\n');
                if line.trim_ascii().is_empty() {
                    if !self.event_is_usage {
                        self.out.extend_from_slice(&self.event);
                    }
                    self.event.clear();
                }
            }
            if line.trim_ascii().is_empty() {
                self.event_is_usage = false;
            }
            self.carry.clear();
            rest = &rest[i + 1..];
        }
        if self.carry.len() + rest.len() > self.max_event_bytes {
            return Err(too_long);
        }
        self.carry.extend_from_slice(rest);
        Ok((tokens, usage))
    }

    /// After [`EventTooLong`] on `data`: what still passes on before the error event, and
    /// nothing is held any more. Stripping, the whole events read before the long one; else
    /// `data` as it came and a blank line, which ends the line cut off mid-way.
    pub(crate) fn cut_off(&mut self, data: Bytes) -> Bytes {
        let out = std::mem::take(&mut self.out);
        (self.carry, self.event) = (Vec::new(), Vec::new());
        if self.strip_usage {
            return Bytes::from(out);
        }
        let mut passed = Vec::with_capacity(data.len() + 2);
        passed.extend_from_slice(&data);
        passed.extend_from_slice(b"\n\n");
        Bytes::from(passed)
    }

    /// Stripping: the whole events read so far, to pass on.
    pub fn take_out(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.out))
    }

    /// Stripping, at the end of the stream: whatever was held back of an unfinished event.
    pub(crate) fn rest(&mut self) -> Bytes {
        if !self.strip_usage {
            return Bytes::new();
        }
        let mut rest = std::mem::take(&mut self.out);
        if !self.event_is_usage {
            rest.append(&mut self.event);
            rest.append(&mut self.carry);
        }
        Bytes::from(rest)
    }
}

/// The request's body with `stream_options.include_usage` set, so the replica reports the
/// stream's tokens (and, simulated, its GPU time) at the end. The body parsed as a completion
/// request already; were it somehow not a JSON object, it goes on unchanged.
pub(crate) fn asking_for_usage(body: &Bytes) -> Bytes {
    rewritten(body, |obj| {
        let options = obj.entry("stream_options").or_insert_with(|| serde_json::json!({}));
        if !options.is_object() {
            *options = serde_json::json!({});
        }
        options["include_usage"] = serde_json::Value::Bool(true);
    })
}

/// Whether the request asks for greedy sampling (`temperature` 0): the only kind whose answer
/// the result cache may give again.
pub(crate) fn greedy(body: &Bytes) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("temperature")?.as_f64())
        == Some(0.0)
}

/// The body a shadow copy is sent with: a whole answer (its usage read from it), whatever
/// the caller asked for.
pub(crate) fn whole_answer(body: &Bytes) -> Bytes {
    rewritten(body, |obj| {
        obj.insert("stream".into(), serde_json::Value::Bool(false));
        obj.remove("stream_options");
    })
}

/// Tokens and (simulated) GPU time a whole answer reports: (input, output, GPU ms).
pub(crate) fn answer_usage(body: &[u8]) -> Option<(u32, u32, Option<f64>)> {
    let u = serde_json::from_slice::<Chunk>(body).ok()?.usage?;
    Some((u.prompt_tokens, u.completion_tokens, u.laneway_gpu_ms))
}

/// The request's body for the model `name` (its fallback answers it: the engine serves only
/// its own name).
pub(crate) fn for_model(body: &Bytes, name: &str) -> Bytes {
    rewritten(body, |obj| {
        obj.insert("model".into(), serde_json::Value::String(name.into()));
    })
}

/// `body` with `change` made to it. The body parsed as a completion request already; were it
/// somehow not a JSON object, it goes on unchanged.
pub(crate) fn rewritten(body: &Bytes, change: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> Bytes {
    let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_slice::<serde_json::Value>(body) else {
        return body.clone();
    };
    change(&mut obj);
    serde_json::to_vec(&obj)
        .map(Bytes::from)
        .unwrap_or_else(|_| body.clone())
}
