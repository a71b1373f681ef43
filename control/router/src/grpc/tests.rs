use super::*;
use crate::http::tests::{router_with, serve_on_free_port, sim_replica};
use pb::grpc_inference_service_client::GrpcInferenceServiceClient;
use pb::model_infer_request::InferRequestedOutputTensor;

fn fp32(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn input(name: &str, datatype: &str, shape: Vec<i64>) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape,
        ..Default::default()
    }
}

fn infer_request(model: &str, raw: Vec<u8>) -> pb::ModelInferRequest {
    pb::ModelInferRequest {
        model_name: model.into(),
        id: "req-1".into(),
        inputs: vec![input("x", "FP32", vec![1, 2])],
        raw_input_contents: vec![raw],
        ..Default::default()
    }
}

#[test]
fn raw_tensors_become_binary_data_or_json_as_the_model_takes_them() {
    let mut msg = infer_request("m", fp32(&[1.5, -2.0]));
    msg.outputs = vec![InferRequestedOutputTensor {
        name: "y".into(),
        parameters: Default::default(),
    }];
    let (body, json_len) = http_request(&msg, true, 1 << 20).unwrap();
    let json_len = json_len.unwrap();
    let v: Value = serde_json::from_slice(&body[..json_len]).unwrap();
    assert_eq!(v["id"], "req-1");
    assert_eq!(v["inputs"][0]["parameters"]["binary_data_size"], 8);
    assert_eq!(v["outputs"][0]["parameters"]["binary_data"], true);
    assert_eq!(&body[json_len..], &fp32(&[1.5, -2.0])[..]);

    let (body, json_len) = http_request(&msg, false, 1 << 20).unwrap();
    assert!(json_len.is_none());
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["inputs"][0]["data"], json!([1.5, -2.0]));
    assert!(v["inputs"][0].get("parameters").is_none());
}

#[test]
fn typed_contents_are_checked_and_converted() {
    let mut msg = pb::ModelInferRequest {
        model_name: "m".into(),
        inputs: vec![input("n", "INT8", vec![3])],
        ..Default::default()
    };
    msg.inputs[0].contents = Some(pb::InferTensorContents {
        int_contents: vec![1, -2, 3],
        ..Default::default()
    });
    let (body, _) = http_request(&msg, false, 1 << 20).unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["inputs"][0]["data"], json!([1, -2, 3]));

    // Out of the datatype's range, or fewer elements than the shape.
    msg.inputs[0].contents.as_mut().unwrap().int_contents = vec![1, 300, 3];
    let e = http_request(&msg, false, 1 << 20).unwrap_err();
    assert!(e.contains("300 is out of range for INT8"), "{e}");
    msg.inputs[0].contents.as_mut().unwrap().int_contents = vec![1, 2];
    let e = http_request(&msg, false, 1 << 20).unwrap_err();
    assert!(e.contains("input n") && e.contains("= 3"), "{e}");
}

#[test]
fn malformed_requests_say_what_to_send() {
    let mut msg = infer_request("m", fp32(&[1.0, 2.0]));
    msg.raw_input_contents.push(vec![0; 4]);
    let e = http_request(&msg, true, 1 << 20).unwrap_err();
    assert!(e.contains("2 entries for 1 inputs"), "{e}");

    let mut msg = infer_request("m", fp32(&[1.0, 2.0]));
    msg.inputs[0].contents = Some(Default::default());
    assert!(http_request(&msg, true, 1 << 20).unwrap_err().contains("send one form"));

    // FP16 has no JSON form: a JSON-only server cannot take it.
    let mut msg = infer_request("m", vec![0; 4]);
    msg.inputs[0].datatype = "FP16".into();
    let e = http_request(&msg, false, 1 << 20).unwrap_err();
    assert!(e.contains("binary_tensors = true"), "{e}");
    assert!(http_request(&msg, true, 1 << 20).is_ok());
}

#[test]
fn what_json_cannot_carry_is_refused_not_altered() {
    // NaN, non-UTF-8 BYTES, and more elements than the conversion allows.
    let msg = infer_request("m", fp32(&[1.0, f32::NAN]));
    let e = http_request(&msg, false, 1 << 20).unwrap_err();
    assert!(e.contains("NaN or infinite"), "{e}");
    assert!(http_request(&msg, true, 1 << 20).is_ok(), "binary data carries it");
    let mut msg = infer_request("m", vec![2, 0, 0, 0, 0xff, 0xfe]);
    msg.inputs[0] = input("x", "BYTES", vec![1]);
    let e = http_request(&msg, false, 1 << 20).unwrap_err();
    assert!(e.contains("not UTF-8"), "{e}");
    let msg = infer_request("m", fp32(&[1.0, 2.0]));
    let e = http_request(&msg, false, 1).unwrap_err();
    assert!(e.contains("2 elements are more than the router converts (1)"), "{e}");
}

#[test]
fn answers_come_back_as_raw_outputs_json_or_binary() {
    let body = json!({
        "model_name": "m", "model_version": "v2", "id": "req-1",
        "outputs": [{"name": "y", "datatype": "INT64", "shape": [2], "data": [7, -1]}],
    })
    .to_string();
    let a = grpc_answer(&HeaderMap::new(), body.as_bytes()).unwrap();
    assert_eq!(
        (a.model_name.as_str(), a.model_version.as_str(), a.id.as_str()),
        ("m", "v2", "req-1")
    );
    assert_eq!(a.outputs[0].shape, vec![2]);
    let want: Vec<u8> = [7i64, -1].iter().flat_map(|n| n.to_le_bytes()).collect();
    assert_eq!(a.raw_output_contents, vec![want]);

    let header = json!({
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}],
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    body.extend_from_slice(&fp32(&[1.0, 2.0]));
    let mut h = HeaderMap::new();
    h.insert(INFERENCE_HEADER, HeaderValue::from(header.len()));
    let a = grpc_answer(&h, &body).unwrap();
    assert_eq!(a.raw_output_contents, vec![fp32(&[1.0, 2.0])]);
    assert!(
        a.outputs[0].parameters.is_empty(),
        "binary_data_size is the HTTP form's own"
    );
    // A replica whose sizes do not add up is not passed on as if they did.
    body.truncate(body.len() - 1);
    assert!(grpc_answer(&h, &body).unwrap_err().contains("says 8 binary bytes"));
}

#[tokio::test]
async fn refusals_keep_their_meaning_and_their_wait() {
    use crate::answer::{error, shed, with_retry_after, Meta};
    let busy = shed(with_retry_after(
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "every replica is busy".into(),
            &Meta::default(),
        ),
        Duration::from_secs(2),
    ));
    let s = status_of(busy).await;
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert_eq!(s.message(), "every replica is busy");
    assert_eq!(s.metadata().get("retry-after").unwrap(), "2");
    use tonic_types::StatusExt;
    let retry = s.get_details_retry_info().expect("a RetryInfo detail");
    assert_eq!(retry.retry_delay, Some(Duration::from_secs(2)));
    assert!(s.metadata().get("x-laneway-lane").is_some());

    let none = with_retry_after(
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no ready replica".into(),
            &Meta::default(),
        ),
        Duration::from_secs(1),
    );
    assert_eq!(status_of(none).await.code(), Code::Unavailable);
    for (http, grpc) in [
        (StatusCode::UNAUTHORIZED, Code::Unauthenticated),
        (StatusCode::NOT_FOUND, Code::NotFound),
        (StatusCode::BAD_REQUEST, Code::InvalidArgument),
        (StatusCode::TOO_MANY_REQUESTS, Code::ResourceExhausted),
        (StatusCode::GATEWAY_TIMEOUT, Code::DeadlineExceeded),
    ] {
        let s = status_of(error(http, "x".into(), &Meta::default())).await;
        assert_eq!(s.code(), grpc, "{http}");
        assert!(s.get_details_retry_info().is_none());
    }
}

/// `msg` as tenant `k` sends it.
fn with_key<T>(msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut().insert("authorization", "Bearer k".parse().unwrap());
    r
}

/// Over the router's own port, as a gRPC client connects: the model answers through the same
/// pipeline as HTTP (the replica's echo of the input comes back raw), the key is checked, and an
/// unknown model is `NOT_FOUND`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_client_infers_on_the_routers_port() {
    let replica = sim_replica(1.0).await;
    let server = serve_on_free_port(router_with(&[("r1", replica)])).await;
    let mut client = GrpcInferenceServiceClient::connect(format!("http://{}", server.addr))
        .await
        .unwrap();

    let live = client.server_live(pb::ServerLiveRequest {}).await.unwrap();
    assert!(live.into_inner().live);
    let meta = client
        .server_metadata(pb::ServerMetadataRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(meta.extensions, vec!["binary_tensor_data".to_string()]);
    let ready = client
        .model_ready(with_key(pb::ModelReadyRequest {
            name: "whisper".into(),
            version: String::new(),
        }))
        .await
        .unwrap();
    assert!(ready.into_inner().ready);

    let r = client
        .model_infer(with_key(infer_request("whisper", fp32(&[1.5, -2.0]))))
        .await
        .unwrap();
    assert_eq!(r.metadata().get("x-laneway-replica").unwrap(), "n1/r1");
    let answer = r.into_inner();
    assert_eq!(answer.id, "req-1");
    assert_eq!(answer.outputs[0].name, "output0");
    assert_eq!(answer.raw_output_contents, vec![fp32(&[1.5, -2.0])]);

    let e = client
        .model_infer(Request::new(infer_request("whisper", fp32(&[1.0, 2.0]))))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("Authorization"), "{}", e.message());
    let e = client
        .model_infer(with_key(infer_request("nope", fp32(&[1.0, 2.0]))))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = client
        .model_metadata(with_key(pb::ModelMetadataRequest {
            name: "nope".into(),
            version: String::new(),
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");

    // HTTP/1.1 on the same port is unchanged.
    let http = reqwest::get(format!("http://{}/v2", server.addr)).await.unwrap();
    assert_eq!(http.status(), 200);
    server.stop().await;
}

/// A gRPC message that trickles in (a byte every 200 ms, never whole) holds its stream no
/// longer than the body timeout: the call ends with an error status, not never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_stops_arriving_is_cut_off() {
    use futures::StreamExt;
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    let router = router_with(&[]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let settings = crate::server::RouterSettings {
        body_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let server = crate::server::serve(router, axum::Router::new(), listener, &settings).unwrap();
    let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    // A message header that promises 1000 bytes, then a byte at a time.
    let mut head = vec![0u8];
    head.extend_from_slice(&1000u32.to_be_bytes());
    let trickle = futures::stream::unfold((), |()| async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        Some((Ok(Frame::data(Bytes::from_static(&[0]))), ()))
    });
    let frames = futures::stream::iter([Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(head)))])
        .chain(Box::pin(trickle));
    let req = axum::http::Request::post(format!(
        "http://{}/inference.GRPCInferenceService/ModelInfer",
        server.addr
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .header("authorization", "Bearer k")
    .body(StreamBody::new(frames))
    .unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(10), async {
        let resp = send.send_request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let trailers = body.collect().await.ok().and_then(|c| c.trailers().cloned());
        let status = parts
            .headers
            .get("grpc-status")
            .or(trailers.as_ref().and_then(|t| t.get("grpc-status")));
        status.map(|s| s.to_str().unwrap().to_string())
    })
    .await
    .expect("the stalled call ended within the body timeout");
    assert!(matches!(answered.as_deref(), Some(s) if s != "0"), "{answered:?}");
    server.stop().await;
}

/// An HTTP/2 connection with no request for the header timeout is closed, as an idle HTTP/1.1
/// keep-alive is: a client that only handshakes holds no connection permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let settings = crate::server::RouterSettings {
        header_read_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let server = crate::server::serve(router_with(&[]), axum::Router::new(), listener, &settings).unwrap();
    let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let (_send, conn) = hyper::client::conn::http2::handshake::<_, _, http_body_util::Empty<Bytes>>(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), conn).await;
    assert!(ended.is_ok(), "the idle connection was still open after 5 s");
    server.stop().await;
}
