//! The router's KServe v2 gRPC face (`inference.GRPCInferenceService`), served on the router's
//! own port beside HTTP. It only translates: a `ModelInfer` becomes the v2 HTTP request it
//! stands for (tensors as binary data when every version of the model takes them, else as JSON
//! `data`) and goes through [`super::http::infer`] — the same authentication (the API key in the
//! `authorization` metadata), lanes, tenants, cache, metering, shedding and tracing — and its
//! answer comes back as a `ModelInferResponse` with every output in `raw_output_contents`.
//! Refusals keep their meaning: a shed or a tenant over its ceiling is `RESOURCE_EXHAUSTED`
//! with the wait in a `google.rpc.RetryInfo` detail and `retry-after` metadata; Laneway's
//! response headers (`x-laneway-*`, `x-request-id`) come back as metadata. Replicas are reached
//! over HTTP (ADR 0024).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Map, Value};
use tonic::metadata::MetadataMap;
use tonic::{Code, Request, Status};

use super::answer::Shed;
use super::http::ModelPath;
use super::Router;
use laneway_core::kserve::{self, INFERENCE_HEADER};

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("inference");
}

use pb::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use pb::infer_parameter::ParameterChoice;
use pb::model_infer_request::InferInputTensor;
use pb::model_infer_response::InferOutputTensor;
use pb::model_metadata_response::TensorMetadata;

/// The gRPC path prefix the service answers under (`/inference.GRPCInferenceService/…`).
pub const PATH: &str = "/inference.GRPCInferenceService/{*rpc}";

/// The service, with message limits from the router's body limits: a request message as large
/// as an HTTP body may be, an answer as large as the router reads from a replica; behind
/// [`KeyFirst`].
pub fn service(router: Arc<Router>) -> KeyFirst<GrpcInferenceServiceServer<Inference>> {
    let limits = router.bodies().limits().clone();
    let inner = GrpcInferenceServiceServer::new(Inference { router: router.clone() })
        .max_decoding_message_size(limits.max_body_bytes)
        .max_encoding_message_size(limits.max_answer_bytes);
    KeyFirst {
        router,
        inner,
        body_timeout: limits.body_timeout,
    }
}

/// Checks what can be checked before tonic reads a message: that this router has caught up,
/// and, for every RPC but the three server-level ones, that the `authorization` metadata holds
/// a tenant's key — so a client without one costs no decoding, as an HTTP body is not read
/// before its key is checked. The message must then arrive whole within the body timeout
/// ([`Deadline`]), as an HTTP body must.
#[derive(Clone)]
pub struct KeyFirst<S> {
    router: Arc<Router>,
    inner: S,
    body_timeout: Duration,
}

/// A request body that must end within a time from when its headers came; after it, an error
/// (tonic answers the call with a status), however slowly the bytes trickle.
pub struct Deadline {
    inner: Body,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
    after: Duration,
}

impl hyper::body::Body for Deadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        use std::future::Future;
        use std::task::Poll;
        if let Poll::Ready(frame) = std::pin::Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if self.sleep.as_mut().poll(cx).is_ready() {
            let why = format!(
                "the message did not arrive whole within the router's body timeout ({} ms)",
                self.after.as_millis()
            );
            return Poll::Ready(Some(Err(why.into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl<S> tonic::codegen::Service<axum::http::Request<Body>> for KeyFirst<S>
where
    S: tonic::codegen::Service<
        axum::http::Request<Deadline>,
        Response = axum::http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
    >,
    S::Future: Send + 'static,
{
    type Response = axum::http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = futures::future::Either<std::future::Ready<Result<Self::Response, Self::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: axum::http::Request<Body>) -> Self::Future {
        let path = req.uri().path();
        let server_level = ["/ServerLive", "/ServerReady", "/ServerMetadata"]
            .iter()
            .any(|rpc| path.ends_with(rpc));
        let refused = if server_level {
            None
        } else if !self.router.is_ready() {
            Some(Status::unavailable(
                "this router is catching up with the cluster (it just started or joined, or has not yet received the routing state); retry in a moment or through another router",
            ))
        } else {
            super::pipeline::authenticate(&self.router.table(), req.headers(), &super::answer::Meta::default())
                .err()
                .map(|r| {
                    let said = r.extensions().get::<super::answer::Said>().map(|s| s.0.to_string());
                    Status::unauthenticated(said.unwrap_or_else(|| "unknown or missing API key".into()))
                })
        };
        match refused {
            Some(status) => futures::future::Either::Left(std::future::ready(Ok(status.into_http()))),
            None => {
                let after = self.body_timeout;
                let req = req.map(|inner| Deadline {
                    inner,
                    sleep: Box::pin(tokio::time::sleep(after)),
                    after,
                });
                futures::future::Either::Right(self.inner.call(req))
            }
        }
    }
}

pub struct Inference {
    router: Arc<Router>,
}

impl Inference {
    /// As the HTTP paths: nothing is answered from a state that has not caught up.
    fn caught_up(&self) -> Result<(), Status> {
        if self.router.is_ready() {
            return Ok(());
        }
        Err(Status::unavailable(
            "this router is catching up with the cluster (it just started or joined, or has not yet received the routing state); retry in a moment or through another router",
        ))
    }
}

/// The request's metadata as the HTTP headers the pipeline reads (the API key, `x-request-id`,
/// `traceparent`), without gRPC's own.
fn headers_of(metadata: MetadataMap) -> HeaderMap {
    metadata
        .into_headers()
        .into_iter()
        .filter_map(|(k, v)| Some((k?, v)))
        .filter(|(k, _)| {
            let k = k.as_str();
            // The binary part's length is the router's to give, from the message it converts.
            !(k.starts_with("grpc-") || k == "content-type" || k == "te" || k == "inference-header-content-length")
        })
        .collect()
}

/// The gRPC status a router answer that is not 200 stands for, with its message (the `error`
/// of the body), Laneway's headers as metadata, and a `RetryInfo` when it says when to retry.
async fn status_of(resp: Response) -> Status {
    let status = resp.status();
    let shed = resp.extensions().get::<Shed>().is_some();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    // A replica's error page may be large; a status message travels in a header.
    let message: String = message.chars().take(1024).collect();
    let code = match status {
        _ if shed => Code::ResourceExhausted,
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => Code::InvalidArgument,
        StatusCode::UNAUTHORIZED => Code::Unauthenticated,
        StatusCode::FORBIDDEN => Code::PermissionDenied,
        StatusCode::NOT_FOUND => Code::NotFound,
        StatusCode::CONFLICT => Code::Aborted,
        StatusCode::PAYLOAD_TOO_LARGE | StatusCode::TOO_MANY_REQUESTS => Code::ResourceExhausted,
        StatusCode::REQUEST_TIMEOUT | StatusCode::GATEWAY_TIMEOUT => Code::DeadlineExceeded,
        StatusCode::NOT_IMPLEMENTED => Code::Unimplemented,
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE => Code::Unavailable,
        _ => Code::Internal,
    };
    let retry = parts
        .headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs);
    let metadata = MetadataMap::from_headers(laneway_headers(&parts.headers));
    let mut status = match retry {
        Some(wait) => {
            use tonic_types::{ErrorDetails, StatusExt};
            Status::with_error_details(code, message, ErrorDetails::with_retry_info(Some(wait)))
        }
        None => Status::new(code, message),
    };
    status.metadata_mut().as_mut().extend(metadata.into_headers());
    status
}

/// Laneway's response headers, for metadata: `x-laneway-*`, `x-request-id`, `retry-after`.
fn laneway_headers(h: &HeaderMap) -> HeaderMap {
    h.iter()
        .filter(|(k, _)| {
            let k = k.as_str();
            k.starts_with("x-laneway-") || k == "x-request-id" || k == "retry-after"
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn param_json(p: &pb::InferParameter) -> Value {
    match &p.parameter_choice {
        Some(ParameterChoice::BoolParam(b)) => Value::Bool(*b),
        Some(ParameterChoice::Int64Param(n)) => Value::from(*n),
        Some(ParameterChoice::StringParam(s)) => Value::String(s.clone()),
        None => Value::Null,
    }
}

fn params_json(p: &HashMap<String, pb::InferParameter>) -> Map<String, Value> {
    p.iter().map(|(k, v)| (k.clone(), param_json(v))).collect()
}

fn param_pb(v: &Value) -> Option<pb::InferParameter> {
    let choice = match v {
        Value::Bool(b) => ParameterChoice::BoolParam(*b),
        Value::Number(n) => ParameterChoice::Int64Param(n.as_i64()?),
        Value::String(s) => ParameterChoice::StringParam(s.clone()),
        _ => return None,
    };
    Some(pb::InferParameter {
        parameter_choice: Some(choice),
    })
}

/// A tensor's typed contents as raw bytes (what `raw_input_contents` would have held).
fn raw_of(t: &InferInputTensor) -> Result<Vec<u8>, String> {
    let c = t.contents.clone().unwrap_or_default();
    let mut out = Vec::new();
    let wrong = || {
        format!(
            "input {}: its contents are not in the field for {} (INT8/16/32 in int_contents, UINT8/16/32 in uint_contents, …); FP16 and BF16 go in raw_input_contents",
            t.name, t.datatype
        )
    };
    let narrow = |n: i64, lo: i64, hi: i64| {
        if (lo..=hi).contains(&n) {
            Ok(n)
        } else {
            Err(format!("input {}: {n} is out of range for {}", t.name, t.datatype))
        }
    };
    match t.datatype.as_str() {
        "BOOL" => out.extend(c.bool_contents.iter().map(|b| u8::from(*b))),
        "INT8" => {
            for n in &c.int_contents {
                out.extend_from_slice(&(narrow((*n).into(), -128, 127)? as i8).to_le_bytes());
            }
        }
        "INT16" => {
            for n in &c.int_contents {
                out.extend_from_slice(&(narrow((*n).into(), -32_768, 32_767)? as i16).to_le_bytes());
            }
        }
        "INT32" => c
            .int_contents
            .iter()
            .for_each(|n| out.extend_from_slice(&n.to_le_bytes())),
        "INT64" => c
            .int64_contents
            .iter()
            .for_each(|n| out.extend_from_slice(&n.to_le_bytes())),
        "UINT8" => {
            for n in &c.uint_contents {
                out.push(narrow((*n).into(), 0, 255)? as u8);
            }
        }
        "UINT16" => {
            for n in &c.uint_contents {
                out.extend_from_slice(&(narrow((*n).into(), 0, 65_535)? as u16).to_le_bytes());
            }
        }
        "UINT32" => c
            .uint_contents
            .iter()
            .for_each(|n| out.extend_from_slice(&n.to_le_bytes())),
        "UINT64" => c
            .uint64_contents
            .iter()
            .for_each(|n| out.extend_from_slice(&n.to_le_bytes())),
        "FP32" => c
            .fp32_contents
            .iter()
            .for_each(|n| out.extend_from_slice(&n.to_le_bytes())),
        "FP64" => c
            .fp64_contents
            .iter()
            .for_each(|n| out.extend_from_slice(&n.to_le_bytes())),
        "BYTES" => {
            for b in &c.bytes_contents {
                let len = u32::try_from(b.len()).map_err(|_| format!("input {}: an element over 4 GiB", t.name))?;
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(b);
            }
        }
        _ => return Err(wrong()),
    }
    Ok(out)
}

/// The v2 HTTP request a `ModelInfer` stands for: its body and, for binary tensors, the JSON
/// part's length. `binary`: the model's servers take binary tensors (else the tensors go as JSON
/// `data`, which FP16 and BF16 have no form of).
fn http_request(
    msg: &pb::ModelInferRequest,
    binary: bool,
    json_elements: u64,
) -> Result<(Vec<u8>, Option<usize>), String> {
    if !binary {
        let mut total = 0u64;
        for t in &msg.inputs {
            total = total.saturating_add(kserve::elements(&t.name, &t.shape)?);
        }
        if total > json_elements {
            return Err(format!(
                "the model's servers take tensors as JSON only, and {total} elements are more than the router converts ({json_elements}); send smaller tensors, or serve the model with a server that takes binary tensors (`binary_tensors = true`)"
            ));
        }
    }
    if !msg.raw_input_contents.is_empty() && msg.raw_input_contents.len() != msg.inputs.len() {
        return Err(format!(
            "raw_input_contents has {} entries for {} inputs; give one per input, in order, or none (typed contents)",
            msg.raw_input_contents.len(),
            msg.inputs.len()
        ));
    }
    let mut tail = Vec::new();
    let mut inputs = Vec::with_capacity(msg.inputs.len());
    for (i, t) in msg.inputs.iter().enumerate() {
        let raw = match msg.raw_input_contents.get(i) {
            Some(_) if t.contents.is_some() => {
                return Err(format!(
                    "input {}: both contents and raw_input_contents; send one form",
                    t.name
                ))
            }
            Some(raw) => raw.clone(),
            None => raw_of(t)?,
        };
        kserve::check_binary(&t.name, &t.datatype, &t.shape, &raw)?;
        let mut params = params_json(&t.parameters);
        let mut input = json!({"name": t.name, "datatype": t.datatype, "shape": t.shape});
        if binary {
            params.insert("binary_data_size".into(), Value::from(raw.len()));
            tail.extend_from_slice(&raw);
        } else {
            lossless_as_json(t, &raw)?;
            let data = kserve::decode(&t.datatype, &raw).ok_or_else(|| {
                format!(
                    "input {}: the model's servers take tensors as JSON only, and {} has no JSON form; declare `binary_tensors = true` for a server that takes binary data",
                    t.name, t.datatype
                )
            })?;
            input["data"] = Value::Array(data);
        }
        if !params.is_empty() {
            input["parameters"] = Value::Object(params);
        }
        inputs.push(input);
    }
    let outputs: Vec<Value> = msg
        .outputs
        .iter()
        .map(|o| {
            let mut params = params_json(&o.parameters);
            if binary {
                params.insert("binary_data".into(), Value::Bool(true));
            }
            json!({"name": o.name, "parameters": params})
        })
        .collect();
    let mut params = params_json(&msg.parameters);
    if binary && outputs.is_empty() {
        params.insert("binary_data_output".into(), Value::Bool(true));
    }
    let mut body = json!({"inputs": inputs});
    if !msg.id.is_empty() {
        body["id"] = Value::String(msg.id.clone());
    }
    if !outputs.is_empty() {
        body["outputs"] = Value::Array(outputs);
    }
    if !params.is_empty() {
        body["parameters"] = Value::Object(params);
    }
    let mut out = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
    let json_len = out.len();
    out.extend_from_slice(&tail);
    Ok((out, binary.then_some(json_len)))
}

/// Refuses what JSON `data` cannot carry unchanged: BYTES that are not UTF-8 (an image) and
/// NaN or infinite floats (JSON has no number for them).
fn lossless_as_json(t: &InferInputTensor, raw: &[u8]) -> Result<(), String> {
    match kserve::json_loss(&t.datatype, raw) {
        Some(why) => Err(format!(
            "input {}: {why}; the model's servers take tensors as JSON only — serve it with a server that takes binary tensors (`binary_tensors = true`)",
            t.name
        )),
        None => Ok(()),
    }
}

/// A v2 HTTP answer (JSON, or JSON and binary outputs) as a `ModelInferResponse`, every
/// output's data in `raw_output_contents`.
fn grpc_answer(headers: &HeaderMap, body: &[u8]) -> Result<pb::ModelInferResponse, String> {
    let json_len = match headers.get(INFERENCE_HEADER) {
        Some(v) => kserve::json_part_len(v.as_bytes())?,
        None => body.len(),
    };
    let (json, mut binary) = kserve::split_binary(body, json_len)?;
    let v: Value = serde_json::from_slice(json).map_err(|e| format!("the replica's answer is not v2 JSON: {e}"))?;
    let text = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    let params = |v: &Value| -> HashMap<String, pb::InferParameter> {
        v.get("parameters")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| k.as_str() != "binary_data_size")
                    .filter_map(|(k, v)| Some((k.clone(), param_pb(v)?)))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut outputs = Vec::new();
    let mut raw = Vec::new();
    for o in v.get("outputs").and_then(Value::as_array).into_iter().flatten() {
        let name = o.get("name").and_then(Value::as_str).unwrap_or_default().to_string();
        let datatype = o
            .get("datatype")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let shape: Vec<i64> = o
            .get("shape")
            .and_then(Value::as_array)
            .map(|s| s.iter().filter_map(Value::as_i64).collect())
            .unwrap_or_default();
        let size = o
            .get("parameters")
            .and_then(|p| p.get("binary_data_size"))
            .and_then(Value::as_u64);
        let bytes = match size {
            Some(n) => {
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                if n > binary.len() {
                    return Err(format!(
                        "the replica's output {name} says {n} binary bytes but {} are left",
                        binary.len()
                    ));
                }
                let (b, rest) = binary.split_at(n);
                binary = rest;
                b.to_vec()
            }
            None => kserve::encode(&name, &datatype, o.get("data").unwrap_or(&Value::Null))?,
        };
        outputs.push(InferOutputTensor {
            parameters: params(o),
            name,
            datatype,
            shape,
            contents: None,
        });
        raw.push(bytes);
    }
    Ok(pb::ModelInferResponse {
        model_name: text("model_name"),
        model_version: text("model_version"),
        id: text("id"),
        parameters: params(&v),
        outputs,
        raw_output_contents: raw,
    })
}

fn tensors(specs: &[kserve::TensorSpec]) -> Vec<TensorMetadata> {
    specs
        .iter()
        .map(|t| TensorMetadata {
            name: t.name.clone(),
            datatype: t.datatype.clone(),
            shape: t.shape.clone(),
        })
        .collect()
}

fn version_of(v: &str) -> Option<String> {
    (!v.is_empty()).then(|| v.to_string())
}

/// The answer of one of the HTTP handlers: 200's headers and body, or its status.
async fn whole(resp: Response) -> Result<(HeaderMap, Bytes), Status> {
    if resp.status() != StatusCode::OK {
        return Err(status_of(resp).await);
    }
    let (parts, body) = resp.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(|e| Status::internal(format!("reading the router's answer: {e}")))?
        .to_bytes();
    Ok((parts.headers, bytes))
}

fn with_metadata<T>(msg: T, headers: &HeaderMap) -> tonic::Response<T> {
    let mut r = tonic::Response::new(msg);
    r.metadata_mut().as_mut().extend(laneway_headers(headers));
    r
}

#[tonic::async_trait]
impl GrpcInferenceService for Inference {
    async fn server_live(
        &self,
        _: Request<pb::ServerLiveRequest>,
    ) -> Result<tonic::Response<pb::ServerLiveResponse>, Status> {
        Ok(tonic::Response::new(pb::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<pb::ServerReadyRequest>,
    ) -> Result<tonic::Response<pb::ServerReadyResponse>, Status> {
        Ok(tonic::Response::new(pb::ServerReadyResponse {
            ready: self.router.is_ready(),
        }))
    }

    /// Ready when a replica of the model (that version) is; `NOT_FOUND` for a model this
    /// tenant cannot see, as the HTTP path says 404.
    async fn model_ready(
        &self,
        req: Request<pb::ModelReadyRequest>,
    ) -> Result<tonic::Response<pb::ModelReadyResponse>, Status> {
        self.caught_up()?;
        let (metadata, _, msg) = req.into_parts();
        let path = ModelPath::new(msg.name, version_of(&msg.version));
        let resp = super::http::model_ready(State(self.router.clone()), Path(path), headers_of(metadata)).await;
        match resp.status() {
            StatusCode::OK => Ok(with_metadata(pb::ModelReadyResponse { ready: true }, resp.headers())),
            StatusCode::SERVICE_UNAVAILABLE => {
                Ok(with_metadata(pb::ModelReadyResponse { ready: false }, resp.headers()))
            }
            _ => Err(status_of(resp).await),
        }
    }

    async fn server_metadata(
        &self,
        _: Request<pb::ServerMetadataRequest>,
    ) -> Result<tonic::Response<pb::ServerMetadataResponse>, Status> {
        Ok(tonic::Response::new(pb::ServerMetadataResponse {
            name: super::http::SERVER_NAME.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: super::http::EXTENSIONS.iter().map(|e| e.to_string()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        req: Request<pb::ModelMetadataRequest>,
    ) -> Result<tonic::Response<pb::ModelMetadataResponse>, Status> {
        self.caught_up()?;
        let (metadata, _, msg) = req.into_parts();
        let headers = headers_of(metadata);
        let (meta, route) =
            match super::http::authorized(&self.router, &msg.name, version_of(&msg.version).as_deref(), &headers) {
                Ok(x) => x,
                Err(r) => return Err(status_of(r).await),
            };
        let versions = match version_of(&msg.version) {
            Some(v) => vec![v],
            None => self.router.table().versions(&route.public),
        };
        let mut h = HeaderMap::new();
        super::answer::stamp(&mut h, &meta);
        Ok(with_metadata(
            pb::ModelMetadataResponse {
                name: route.public.clone(),
                versions,
                platform: super::http::PLATFORM.into(),
                inputs: tensors(&route.inputs),
                outputs: tensors(&route.outputs),
            },
            &h,
        ))
    }

    async fn model_infer(
        &self,
        req: Request<pb::ModelInferRequest>,
    ) -> Result<tonic::Response<pb::ModelInferResponse>, Status> {
        self.caught_up()?;
        let (metadata, _, msg) = req.into_parts();
        let mut headers = headers_of(metadata);
        let version = version_of(&msg.model_version);
        let (binary, durable) = {
            let table = self.router.table();
            let entries: Vec<_> = table.models.values().filter(|m| m.public == msg.model_name).collect();
            let durable = entries
                .iter()
                .find(|m| m.class.lane == laneway_core::registry::LaneKind::Durable)
                .map(|m| m.class.name.clone());
            (!entries.is_empty() && entries.iter().all(|m| m.binary_tensors), durable)
        };
        if let Some(class) = durable {
            // A job answers 202 with an id, which ModelInfer has no form for: refused before
            // anything is queued or billed.
            return Err(Status::failed_precondition(format!(
                "model {} is in the durable class {class}: it takes jobs, over HTTP (POST /v1/jobs, or POST /v2/models/{}/infer for a job id); gRPC ModelInfer answers synchronously",
                msg.model_name, msg.model_name
            )));
        }
        let limit = super::body::json_elements_limit(self.router.bodies().limits().max_body_bytes);
        let (body, json_len) = http_request(&msg, binary, limit).map_err(Status::invalid_argument)?;
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        if let Some(n) = json_len {
            headers.insert(INFERENCE_HEADER, HeaderValue::from(n));
        }
        let path = ModelPath::new(msg.model_name, version);
        let resp = super::http::infer(State(self.router.clone()), Path(path), headers, Body::from(body)).await;
        let (headers, body) = whole(resp).await?;
        let answer = grpc_answer(&headers, &body)
            .map_err(|e| Status::internal(format!("converting the replica's answer: {e}")))?;
        Ok(with_metadata(answer, &headers))
    }
}

#[cfg(test)]
mod tests;
