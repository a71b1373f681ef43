//! What the router and the simulated LLM server both need to know about an OpenAI-compatible
//! completion request (`POST /v1/chat/completions`, `POST /v1/completions`, as vLLM, TGI and
//! SGLang serve them): the prompt as text, the output budget, whether to stream, and a token
//! estimate.
//!
//! Neither side has the model's tokenizer, so tokens are *estimated* as one per four characters
//! (OpenAI's rule of thumb for English). The router admits by the estimate; the ledger meters
//! what the replica reports in `usage` when it reports it.

use serde_json::Value;

/// Characters per estimated token.
pub const CHARS_PER_TOKEN: usize = 4;

/// Estimated tokens of `text`: one per [`CHARS_PER_TOKEN`] characters, rounded up.
pub fn estimate_tokens(text: &str) -> u32 {
    let chars = text.chars().count();
    u32::try_from(chars.div_ceil(CHARS_PER_TOKEN)).unwrap_or(u32::MAX)
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`: `messages`.
    Chat,
    /// `/v1/completions`: `prompt`.
    Completion,
    /// `/v1/embeddings`: `input`, nothing generated.
    Embeddings,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completion => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
        }
    }

    /// The kind of language model the endpoint serves.
    pub fn task(self) -> crate::registry::LlmTask {
        match self {
            Endpoint::Embeddings => crate::registry::LlmTask::Embed,
            Endpoint::Chat | Endpoint::Completion => crate::registry::LlmTask::Generate,
        }
    }

    /// The `object` of a streamed chunk (OpenAI's names).
    pub fn chunk_object(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
            // Never streamed; the object of a whole answer.
            Endpoint::Embeddings => "list",
        }
    }
}

/// The fields of a completion request that admission and the simulator read. The body itself
/// is passed to the replica untouched.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub model: String,
    /// The prompt as one text: chat messages as `role: content` lines.
    pub prompt: String,
    /// `max_tokens` (or `max_completion_tokens`), when the client gave one.
    pub max_tokens: Option<u32>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the token counts.
    pub include_usage: bool,
}

impl CompletionRequest {
    /// Reads a request body. Errors say which field is wrong and what it should be.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| format!("the body is not valid JSON: {e}"))?;
        let obj = v
            .as_object()
            .ok_or("the body must be a JSON object with `model` and `messages` or `prompt`")?;
        let model = match obj.get("model") {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            Some(_) => return Err("`model` must be a non-empty string".into()),
            None => return Err("missing field `model`: name the model to run".into()),
        };
        let prompt = match endpoint {
            Endpoint::Chat => chat_prompt(obj.get("messages"))?,
            Endpoint::Completion => completion_prompt(obj.get("prompt"))?,
            Endpoint::Embeddings => {
                // Checked here; counted by [`embedding_tokens`]. The text (of string inputs)
                // is the prompt a prefix hash would read.
                embedding_tokens(obj.get("input"))?;
                embedding_text(obj.get("input"))
            }
        };
        let max_tokens = match obj.get("max_completion_tokens").or_else(|| obj.get("max_tokens")) {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) => match n.as_u64() {
                Some(n) if n >= 1 => Some(u32::try_from(n).unwrap_or(u32::MAX)),
                _ => return Err(format!("`max_tokens` = {n}: expected a whole number ≥ 1")),
            },
            Some(other) => return Err(format!("`max_tokens` = {other}: expected a whole number ≥ 1")),
        };
        let stream = match obj.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(format!("`stream` = {other}: expected true or false")),
        };
        let include_usage = obj
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(CompletionRequest {
            model,
            prompt,
            max_tokens,
            stream,
            include_usage,
        })
    }

    /// Estimated input tokens.
    pub fn input_tokens(&self) -> u32 {
        estimate_tokens(&self.prompt)
    }
}

fn chat_prompt(messages: Option<&Value>) -> Result<String, String> {
    let Some(Value::Array(messages)) = messages else {
        return Err("missing or malformed `messages`: expected an array of {role, content}".into());
    };
    if messages.is_empty() {
        return Err("`messages` is empty: send at least one message".into());
    }
    let mut text = String::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("`messages[{i}].role` is missing or not a string"))?;
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            // Content parts: the text parts count, others (images) are the replica's business.
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
            None | Some(Value::Null) => String::new(),
            Some(_) => return Err(format!("`messages[{i}].content` must be a string or an array of parts")),
        };
        text.push_str(role);
        text.push_str(": ");
        text.push_str(&content);
        text.push('\n');
    }
    Ok(text)
}

fn completion_prompt(prompt: Option<&Value>) -> Result<String, String> {
    match prompt {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) && !items.is_empty() => {
            Ok(items.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("\n"))
        }
        _ => Err("missing or malformed `prompt`: expected a string (or an array of strings)".into()),
    }
}

/// Tokens of each input of an embeddings request's `input`: a string (estimated), an array of
/// strings, an array of token ids, or an array of those (each counted exactly). Errors say
/// what `input` should be.
pub fn embedding_tokens(input: Option<&Value>) -> Result<Vec<u32>, String> {
    const SHAPE: &str =
        "`input` must be a string, an array of strings, an array of token ids, or an array of token-id arrays";
    let ids = |items: &[Value]| -> Option<u32> {
        items
            .iter()
            .all(|t| t.as_u64().is_some())
            .then(|| u32::try_from(items.len()).unwrap_or(u32::MAX))
    };
    let one = |v: &Value| -> Option<u32> {
        match v {
            Value::String(s) => Some(estimate_tokens(s)),
            Value::Array(items) if !items.is_empty() => ids(items),
            _ => None,
        }
    };
    let counts = match input {
        Some(Value::String(s)) => vec![estimate_tokens(s)],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err("`input` is empty: send at least one text to embed".into())
        }
        Some(Value::Array(items)) if items[0].is_u64() => vec![ids(items).ok_or(SHAPE)?],
        Some(Value::Array(items)) => items.iter().map(one).collect::<Option<Vec<_>>>().ok_or(SHAPE)?,
        None | Some(Value::Null) => return Err("missing field `input`: the text (or texts) to embed".into()),
        Some(_) => return Err(SHAPE.into()),
    };
    Ok(counts)
}

fn embedding_text(input: Option<&Value>) -> String {
    match input {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("\n"),
        _ => String::new(),
    }
}

/// A hash of the prompt's first `tokens` estimated tokens: requests that share it share a
/// KV-cache prefix on the replica that served one of them.
pub fn prefix_hash(prompt: &str, tokens: u32) -> u64 {
    use std::hash::{Hash, Hasher};
    let chars = (tokens as usize).saturating_mul(CHARS_PER_TOKEN);
    let end = prompt.char_indices().nth(chars).map_or(prompt.len(), |(i, _)| i);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prompt[..end].hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_inputs_are_counted_each() {
        let count = |v: serde_json::Value| embedding_tokens(Some(&v));
        assert_eq!(count(serde_json::json!("12345678")), Ok(vec![2]));
        assert_eq!(count(serde_json::json!(["1234", "12345678"])), Ok(vec![1, 2]));
        assert_eq!(
            count(serde_json::json!([5, 6, 7])),
            Ok(vec![3]),
            "token ids count exactly"
        );
        assert_eq!(count(serde_json::json!([[5, 6], [7]])), Ok(vec![2, 1]));
        assert!(count(serde_json::json!([[5, -6]])).is_err());
        let r = CompletionRequest::parse(Endpoint::Embeddings, br#"{"model":"m","input":["ab","cd"]}"#).unwrap();
        assert_eq!((r.prompt.as_str(), r.max_tokens, r.stream), ("ab\ncd", None, false));
    }

    #[test]
    fn requests_are_read_with_errors_that_name_the_field() {
        let r = CompletionRequest::parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, "system: be brief\nuser: hi\n");
        assert_eq!((r.max_tokens, r.stream, r.include_usage), (Some(5), true, true));
        assert_eq!(r.input_tokens(), 7);
        let r = CompletionRequest::parse(Endpoint::Completion, br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert_eq!((r.prompt.as_str(), r.max_tokens, r.stream), ("a\nb", None, false));

        for (endpoint, body, says) in [
            (Endpoint::Chat, &br#"{"messages":[]}"#[..], "missing field `model`"),
            (Endpoint::Chat, br#"{"model":"m","messages":[]}"#, "`messages` is empty"),
            (
                Endpoint::Chat,
                br#"{"model":"m","messages":[{"content":"x"}]}"#,
                "messages[0].role",
            ),
            (Endpoint::Completion, br#"{"model":"m"}"#, "`prompt`"),
            (
                Endpoint::Completion,
                br#"{"model":"m","prompt":"x","max_tokens":0}"#,
                "max_tokens",
            ),
            (
                Endpoint::Completion,
                br#"{"model":"m","prompt":"x","stream":"yes"}"#,
                "`stream`",
            ),
            (Endpoint::Completion, b"nope", "not valid JSON"),
            (Endpoint::Embeddings, br#"{"model":"m"}"#, "missing field `input`"),
            (Endpoint::Embeddings, br#"{"model":"m","input":[]}"#, "`input` is empty"),
            (Endpoint::Embeddings, br#"{"model":"m","input":[1,"a"]}"#, "token ids"),
            (
                Endpoint::Embeddings,
                br#"{"model":"m","input":{"a":1}}"#,
                "must be a string",
            ),
        ] {
            let e = CompletionRequest::parse(endpoint, body).unwrap_err();
            assert!(e.contains(says), "{e} should mention {says}");
        }
    }

    #[test]
    fn prefix_hashes_see_only_the_prefix() {
        let a = format!("{}{}", "s".repeat(400), "question one");
        let b = format!("{}{}", "s".repeat(400), "another question");
        assert_eq!(prefix_hash(&a, 100), prefix_hash(&b, 100));
        assert_ne!(prefix_hash(&a, 200), prefix_hash(&b, 200));
        assert_eq!(prefix_hash("short", 100), prefix_hash("short", 1000));
    }
}
