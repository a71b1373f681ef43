//! What a completion request counts against its model's context and its tenant's tokens per
//! minute, estimated before it goes anywhere (the router has no tokenizer: one token per
//! [`CHARS_PER_TOKEN`] characters, or bytes of JSON).
//!
//! Everything the engine turns into prompt tokens counts: the messages' text, and, by the length
//! of its JSON, whatever else the request carries that the router does not know to be a sampling
//! parameter — tool and function definitions, earlier turns' tool calls, content parts that are
//! not text (an image counts at least [`MEDIA_PART_TOKENS`]), a document list, template
//! arguments. And every sequence the engine generates counts: `max_tokens` for each of the
//! `n` (or `best_of`) choices of each prompt of a batch.

use laneway_core::llm::{CompletionRequest, Endpoint, CHARS_PER_TOKEN};
use serde_json::{Map, Value};

/// The least a content part that is not text (an image, audio) counts: what one image costs
/// the commonest open vision models (LLaVA-1.5: 24 × 24 patches). A part whose JSON is longer
/// (a `data:` URL) counts by its length.
pub const MEDIA_PART_TOKENS: u32 = 576;

/// Top-level fields that only steer sampling or the transport: they never reach the prompt.
/// Any other field counts by the length of its JSON.
const PARAMETERS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "echo",
    "user",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "parallel_tool_calls",
    "add_generation_prompt",
    "add_special_tokens",
    "continue_final_message",
    "priority",
    "request_id",
    "service_tier",
];

/// A completion request's estimated tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenCount {
    /// Prompt tokens: the text, and everything else that reaches the prompt.
    pub input: u32,
    /// Output tokens of one sequence: `max_tokens`, or the model's default.
    pub max_tokens: u32,
    /// Sequences the engine generates: the larger of `n` and `best_of`, for each prompt (a
    /// completion's `prompt` may be a batch).
    pub sequences: u32,
    /// An embeddings request's longest input, which alone must fit the context (its inputs
    /// are embedded one by one); `None` for completions, whose whole input is one prompt.
    pub longest: Option<u32>,
}

impl TokenCount {
    /// Counts the request `req` parsed from `body` (sent to `endpoint`), for a model whose
    /// `max_tokens` is `default_max_tokens` when the request gives none. Errors say which field
    /// is wrong and what it should be.
    pub fn of(
        endpoint: Endpoint,
        body: &[u8],
        req: &CompletionRequest,
        default_max_tokens: u32,
    ) -> Result<Self, String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| format!("the body is not valid JSON: {e}"))?;
        let obj = v.as_object().ok_or("the body must be a JSON object")?;
        if endpoint == Endpoint::Embeddings {
            // Each input is one sequence of the model's context; nothing is generated.
            let each = laneway_core::llm::embedding_tokens(obj.get("input"))?;
            return Ok(TokenCount {
                input: saturate(each.iter().map(|&n| u64::from(n)).sum()),
                max_tokens: 0,
                sequences: 1,
                longest: each.iter().copied().max(),
            });
        }
        let choices = whole_number(obj, "n")?.max(whole_number(obj, "best_of")?);
        let prompts = match (endpoint, obj.get("prompt")) {
            (Endpoint::Completion, Some(Value::Array(batch))) => batch.len().max(1),
            _ => 1,
        };
        let mut extra_bytes = 0u64;
        let mut media_tokens = 0u64;
        for (key, value) in obj {
            if !PARAMETERS.contains(&key.as_str()) {
                extra_bytes += field_len(key, value);
            }
        }
        if let (Endpoint::Chat, Some(Value::Array(messages))) = (endpoint, obj.get("messages")) {
            for m in messages.iter().filter_map(Value::as_object) {
                for (key, value) in m {
                    match (key.as_str(), value) {
                        // The role and text content are in the request's prompt text already.
                        ("role", _) | ("content", Value::String(_) | Value::Null) => {}
                        ("content", Value::Array(parts)) => {
                            for part in parts.iter().filter(|p| !plain_text(p)) {
                                let bytes = json_len(part);
                                extra_bytes += bytes;
                                if !is_text_type(part) {
                                    media_tokens += u64::from(MEDIA_PART_TOKENS).saturating_sub(tokens_of(bytes));
                                }
                            }
                        }
                        // Tool calls, names, tool call ids: rendered into the prompt.
                        _ => extra_bytes += field_len(key, value),
                    }
                }
            }
        }
        let input = u64::from(req.input_tokens()) + tokens_of(extra_bytes) + media_tokens;
        Ok(TokenCount {
            input: saturate(input),
            max_tokens: req.max_tokens.unwrap_or(default_max_tokens),
            sequences: saturate(u64::from(choices).saturating_mul(prompts as u64)),
            longest: None,
        })
    }

    /// What one sequence needs of the model's context: its input and its `max_tokens`.
    pub fn per_sequence(&self) -> u64 {
        u64::from(self.longest.unwrap_or(self.input)) + u64::from(self.max_tokens)
    }

    /// What the request takes from its tenant's tokens per minute: its input, and `max_tokens`
    /// for every sequence.
    pub fn total(&self) -> u32 {
        saturate(u64::from(self.input) + u64::from(self.max_tokens) * u64::from(self.sequences))
    }
}

/// `obj[name]` as a whole number ≥ 1; 1 when absent or null.
fn whole_number(obj: &Map<String, Value>, name: &str) -> Result<u32, String> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(1),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) if v >= 1 => Ok(saturate(v)),
            _ => Err(format!("`{name}` = {n}: expected a whole number ≥ 1")),
        },
        Some(other) => Err(format!("`{name}` = {other}: expected a whole number ≥ 1")),
    }
}

/// A content part that is only text (`{"type": "text", "text": …}`): counted with the prompt.
fn plain_text(part: &Value) -> bool {
    part.as_object().is_some_and(|p| {
        p.get("text").is_some_and(Value::is_string)
            && is_text_type(part)
            && p.keys().all(|k| k == "type" || k == "text")
    })
}

/// A part whose `type` is `text` (or that names none but has a text).
fn is_text_type(part: &Value) -> bool {
    match part.get("type") {
        Some(t) => t == "text",
        None => part.get("text").is_some_and(Value::is_string),
    }
}

fn tokens_of(bytes: u64) -> u64 {
    bytes.div_ceil(CHARS_PER_TOKEN as u64)
}

fn saturate(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The length of `"key":value` as JSON.
fn field_len(key: &str, value: &Value) -> u64 {
    key.len() as u64 + 3 + json_len(value)
}

/// The length of `v` as compact JSON, without building the text.
fn json_len(v: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    // Writing a Value to a counter cannot fail.
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(endpoint: Endpoint, body: serde_json::Value) -> Result<TokenCount, String> {
        let bytes = serde_json::to_vec(&body).unwrap();
        let req = CompletionRequest::parse(endpoint, &bytes).unwrap();
        TokenCount::of(endpoint, &bytes, &req, 8)
    }

    fn chat(extra: serde_json::Value) -> TokenCount {
        let mut body =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        count(Endpoint::Chat, body).unwrap()
    }

    #[test]
    fn a_plain_request_counts_its_text_and_max_tokens() {
        // "user: hi\n" is 9 characters: 3 tokens.
        let c =
            chat(serde_json::json!({"stream": true, "temperature": 0.7, "stream_options": {"include_usage": true}}));
        assert_eq!(
            c,
            TokenCount {
                input: 3,
                max_tokens: 10,
                sequences: 1,
                longest: None,
            }
        );
        assert_eq!((c.per_sequence(), c.total()), (13, 13));
        let c = count(
            Endpoint::Completion,
            serde_json::json!({"model": "m", "prompt": "abcdefgh"}),
        )
        .unwrap();
        assert_eq!(
            c,
            TokenCount {
                input: 2,
                max_tokens: 8,
                sequences: 1,
                longest: None,
            },
            "the model's default max_tokens"
        );
    }

    #[test]
    fn an_embeddings_batch_counts_every_input_and_fits_the_longest() {
        let c = count(
            Endpoint::Embeddings,
            serde_json::json!({"model": "m", "input": ["abcdefgh", "abcd", [1, 2, 3]]}),
        )
        .unwrap();
        assert_eq!((c.input, c.max_tokens, c.longest), (6, 0, Some(3)));
        assert_eq!(
            (c.per_sequence(), c.total()),
            (3, 6),
            "the context holds one input at a time"
        );
    }

    #[test]
    fn every_choice_and_every_prompt_of_a_batch_reserves_its_max_tokens() {
        let cases = [
            (serde_json::json!({"n": 4}), 4),
            (serde_json::json!({"best_of": 5, "n": 2}), 5),
            (serde_json::json!({"n": null}), 1),
        ];
        for (extra, sequences) in cases {
            let c = chat(extra.clone());
            assert_eq!(c.sequences, sequences, "{extra}");
            assert_eq!(c.total(), 3 + 10 * sequences, "{extra}");
            assert_eq!(c.per_sequence(), 13, "the context holds one sequence: {extra}");
        }
        let c = count(
            Endpoint::Completion,
            serde_json::json!({"model": "m", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 10}),
        )
        .unwrap();
        // "a\nb\nc": 2 tokens of input, once; 10 for each of 2 choices of 3 prompts.
        assert_eq!((c.sequences, c.total()), (6, 2 + 60));
        for bad in [
            serde_json::json!(0),
            serde_json::json!("4"),
            serde_json::json!(2.5),
            serde_json::json!(-1),
        ] {
            let body = serde_json::json!({"model": "m", "prompt": "x", "n": bad});
            let e = count(Endpoint::Completion, body).unwrap_err();
            assert!(e.contains("`n`") && e.contains("whole number"), "{e}");
        }
        let c = chat(serde_json::json!({"n": u64::MAX, "max_tokens": u32::MAX}));
        assert_eq!(c.total(), u32::MAX, "saturates instead of wrapping");
    }

    #[test]
    fn tools_tool_calls_and_unknown_fields_count_by_their_length() {
        let tools = serde_json::json!([{"type": "function", "function": {"name": "lookup", "description": "x".repeat(4000), "parameters": {"type": "object"}}}]);
        let c = chat(serde_json::json!({ "tools": tools }));
        assert!(c.input > 1000, "4000 characters of tool description: {c:?}");
        let c = chat(serde_json::json!({ "functions": [{"name": "f", "description": "y".repeat(400)}] }));
        assert!(c.input > 100, "{c:?}");
        let c = chat(serde_json::json!({ "chat_template_kwargs": {"documents": ["z".repeat(800)]} }));
        assert!(c.input > 200, "{c:?}");
        let body = serde_json::json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "a".repeat(400)}}]},
            {"role": "tool", "tool_call_id": "1", "content": "ok"},
        ]});
        let c = count(Endpoint::Chat, body).unwrap();
        assert!(c.input > 100, "earlier tool calls are in the prompt: {c:?}");
    }

    #[test]
    fn content_parts_that_are_not_text_count_at_least_an_image() {
        let with = |parts: serde_json::Value| {
            count(
                Endpoint::Chat,
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": parts}]}),
            )
            .unwrap()
            .input
        };
        let text_only = with(serde_json::json!([{"type": "text", "text": "hi"}]));
        assert_eq!(text_only, 3, "a text part counts as text");
        let url = with(
            serde_json::json!([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]),
        );
        assert_eq!(url, 3 + MEDIA_PART_TOKENS, "an image by URL counts as one image");
        let inline = with(
            serde_json::json!([{"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", "A".repeat(40_000))}}]),
        );
        assert!(inline >= 10_000, "an inline image counts by its length: {inline}");
        // A text field on a part that is not text does not make it free.
        let disguised =
            with(serde_json::json!([{"type": "input_audio", "text": "", "input_audio": {"data": "B".repeat(8000)}}]));
        assert!(disguised >= 2000, "{disguised}");
    }
}
