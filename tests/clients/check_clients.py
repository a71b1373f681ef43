"""The ecosystem's official clients against a running Laneway router (`laneway-control dev`).

Run by tests/it/clients.rs with LANEWAY_ROUTER (http://host:port) and LANEWAY_KEY (the dev
tenant's API key) set, in the venv `.ci/run` makes (`tests/clients/requirements.txt`). Each check
asserts what the client returns, not only that it did not raise; the first failed check ends the
run with its message. Prints one JSON line of what passed.
"""

import asyncio
import json
import os
import sys
import subprocess
import time

import numpy as np

if sys.argv[1:] == ["kserve"]:
    # kserve's and tritonclient's generated protos both define package `inference`: one
    # process can load only one of them, so kserve's clients run in a process of their own.
    import kserve
else:
    import openai
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

ROUTER = os.environ["LANEWAY_ROUTER"]
KEY = os.environ["LANEWAY_KEY"]
passed = []


def auth():
    """The key, in a fresh dict per call: tritonclient adds its binary header to the dict it is
    given, which would then go with the next (JSON) request too."""
    return {"Authorization": f"Bearer {KEY}"}


def check(name, ok, detail=""):
    if not ok:
        print(f"FAILED {name}: {detail}", file=sys.stderr)
        sys.exit(1)
    passed.append(name)


def raises(fn, exc):
    try:
        fn()
    except exc as e:
        return e
    return None


def triton_http():
    host = ROUTER.removeprefix("http://")
    client = triton.InferenceServerClient(url=host)
    check("server live", client.is_server_live())
    meta = client.get_server_metadata()
    check("server metadata", meta["name"] == "laneway" and "binary_tensor_data" in meta["extensions"], meta)

    deadline = time.time() + 90
    while not client.is_model_ready("whisper", headers=auth()):
        check("whisper becomes ready", time.time() < deadline, "no ready replica within 90 s")
        time.sleep(0.5)
    model = client.get_model_metadata("whisper", headers=auth())
    check(
        "model metadata",
        model["name"] == "whisper"
        and "1" in model["versions"]
        and model["inputs"] == [{"name": "audio", "datatype": "FP32", "shape": [-1, -1]}]
        and model["outputs"][0]["name"] == "tokens",
        model,
    )
    check("version ready", client.is_model_ready("whisper", model_version="1", headers=auth()))

    audio = np.array([[0.25, -1.5, 3.0, 42.0]], dtype=np.float32)
    for binary in (True, False):
        tensor = triton.InferInput("audio", list(audio.shape), "FP32")
        tensor.set_data_from_numpy(audio, binary_data=binary)
        result = client.infer("whisper", [tensor], headers=auth(), request_id="req-7")
        out = result.as_numpy("output0")
        check(
            f"infer (binary_data={binary})",
            out is not None and out.shape == audio.shape and np.array_equal(out, audio),
            f"{out!r}",
        )
        check(f"request id echoed (binary_data={binary})", result.get_response().get("id") == "req-7")

    tensor = triton.InferInput("audio", [1, 4], "FP32")
    tensor.set_data_from_numpy(audio)
    pinned = client.infer("whisper", [tensor], model_version="1", headers=auth())
    check("infer pinned to version 1", np.array_equal(pinned.as_numpy("output0"), audio))
    e = raises(lambda: client.infer("whisper", [tensor], model_version="9", headers=auth()), InferenceServerException)
    check("unknown version refused", e is not None and "no version" in str(e), e)
    e = raises(lambda: client.infer("nope", [tensor], headers=auth()), InferenceServerException)
    check("unknown model refused", e is not None and "not registered" in str(e), e)

    wrong = triton.InferInput("audio", [1, 5], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 5), dtype=np.float32))
    wrong._shape = [1, 6]  # a client that lies about its shape
    e = raises(lambda: client.infer("whisper", [wrong], headers=auth()), InferenceServerException)
    check("binary size against shape refused", e is not None and "binary_data_size" in str(e), e)
    e = raises(lambda: client.infer("whisper", [tensor]), InferenceServerException)
    check("no key refused", e is not None and "API key" in str(e), e)


def triton_over_grpc():
    """tritonclient.grpc on the router's own port: raw tensors, metadata, and refusals as gRPC
    codes, the API key in the `authorization` metadata."""
    host = ROUTER.removeprefix("http://")
    client = triton_grpc.InferenceServerClient(url=host)
    key = {"authorization": f"Bearer {KEY}"}
    check("grpc server live", client.is_server_live())
    check("grpc server ready", client.is_server_ready())
    meta = client.get_server_metadata(as_json=True)
    check("grpc server metadata", meta["name"] == "laneway" and "binary_tensor_data" in meta["extensions"], meta)
    check("grpc model ready", client.is_model_ready("whisper", headers=key))
    model = client.get_model_metadata("whisper", headers=key, as_json=True)
    check(
        "grpc model metadata",
        model["name"] == "whisper"
        and model["inputs"] == [{"name": "audio", "datatype": "FP32", "shape": ["-1", "-1"]}],
        model,
    )
    audio = np.array([[0.5, -1.25, 8.0]], dtype=np.float32)
    tensor = triton_grpc.InferInput("audio", list(audio.shape), "FP32")
    tensor.set_data_from_numpy(audio)
    result = client.infer("whisper", [tensor], headers=key, request_id="req-g")
    out = result.as_numpy("output0")
    check("grpc infer (raw tensors)", out is not None and np.array_equal(out, audio), f"{out!r}")
    check("grpc request id echoed", result.get_response().id == "req-g")
    pinned = client.infer("whisper", [tensor], model_version="1", headers=key)
    check("grpc infer pinned to version 1", np.array_equal(pinned.as_numpy("output0"), audio))

    def status(fn):
        e = raises(fn, InferenceServerException)
        return (e.status() if e else None), e

    code, e = status(lambda: client.infer("nope", [tensor], headers=key))
    check("grpc unknown model is NOT_FOUND", code == "StatusCode.NOT_FOUND" and "not registered" in str(e), e)
    code, e = status(lambda: client.infer("whisper", [tensor]))
    check("grpc no key is UNAUTHENTICATED", code == "StatusCode.UNAUTHENTICATED" and "API key" in str(e), e)
    code, e = status(lambda: client.infer("whisper", [tensor], model_version="9", headers=key))
    check("grpc unknown version is NOT_FOUND", code == "StatusCode.NOT_FOUND" and "no version" in str(e), e)
    prompt = triton_grpc.InferInput("prompt", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"a lighthouse"], dtype=np.object_))
    code, e = status(lambda: client.infer("wan-video", [prompt], headers=key))
    check("grpc to a durable model is FAILED_PRECONDITION", code == "StatusCode.FAILED_PRECONDITION" and "/v1/jobs" in str(e), e)
    wrong = triton_grpc.InferInput("audio", [1, 3], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    wrong.set_shape([1, 4])  # a client that lies about its shape
    code, e = status(lambda: client.infer("whisper", [wrong], headers=key))
    check("grpc size against shape is INVALID_ARGUMENT", code == "StatusCode.INVALID_ARGUMENT", e)


async def kserve_clients():
    """kserve's own InferenceRESTClient (v2) and InferenceGRPCClient against the same router."""
    host = ROUTER.removeprefix("http://")
    data = [1.0, 2.5, -3.0]

    def request(model="whisper"):
        tensor = kserve.InferInput(name="audio", shape=[1, 3], datatype="FP32", data=data)
        return kserve.InferRequest(model_name=model, infer_inputs=[tensor], request_id="req-k")

    rest = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2"))
    try:
        check("kserve REST server live", await rest.is_server_live(ROUTER))
        check("kserve REST model ready", await rest.is_model_ready(ROUTER, "whisper", headers=auth()))
        res = await rest.infer(ROUTER, request(), model_name="whisper", headers=auth())
        out = res.outputs[0].as_numpy()
        check("kserve REST infer", res.id == "req-k" and out.tolist() == [data], res)
        try:
            await rest.infer(ROUTER, request("nope"), model_name="nope", headers=auth())
            e = None
        except Exception as exc:  # httpx.HTTPStatusError, with the router's body
            e = exc
        check("kserve REST unknown model refused", e is not None and "404" in str(e) and "not registered" in str(e), e)
    finally:
        await rest.close()

    grpc_client = kserve.InferenceGRPCClient(host, retries=0)
    key = [("authorization", f"Bearer {KEY}")]
    try:
        check("kserve gRPC server live", await grpc_client.is_server_live())
        check("kserve gRPC model ready", await grpc_client.is_model_ready("whisper", headers=key))
        res = await grpc_client.infer(request(), headers=key)
        out = res.outputs[0].as_numpy()
        check("kserve gRPC infer", res.id == "req-k" and out.tolist() == [data], res)
        try:
            await grpc_client.infer(request("nope"), headers=key)
            e = None
        except Exception as exc:  # grpc.aio.AioRpcError
            e = exc
        check("kserve gRPC unknown model is NOT_FOUND", e is not None and e.code().name == "NOT_FOUND", e)

        # A burst at the `image` class (a bounded lane: 2 at a time, 900 ms each, a 2 s
        # budget): what its queue cannot finish in time is shed as RESOURCE_EXHAUSTED, with
        # the wait in `retry-after` metadata, never as an error of another kind.
        async def one():
            img = kserve.InferInput(name="img", shape=[1], datatype="FP32", data=[1.0])
            try:
                await grpc_client.infer(kserve.InferRequest(model_name="sdxl", infer_inputs=[img]), headers=key)
                return "ok", None
            except Exception as exc:
                return exc.code().name, dict(exc.trailing_metadata() or ())

        # Larger bursts until one is shed: an earlier run may have scaled the lane up.
        for n in (20, 60, 150):
            outcomes = await asyncio.gather(*(one() for _ in range(n)))
            codes = {c for c, _ in outcomes}
            if "RESOURCE_EXHAUSTED" in codes:
                break
        shed = [m for c, m in outcomes if c == "RESOURCE_EXHAUSTED"]
        check(
            "kserve gRPC burst: admitted or RESOURCE_EXHAUSTED with retry-after",
            "ok" in codes and shed and codes <= {"ok", "RESOURCE_EXHAUSTED"}
            and all(int(m.get("retry-after", "0")) >= 1 for m in shed),
            outcomes,
        )
    finally:
        await grpc_client.close()


def openai_api():
    client = openai.OpenAI(base_url=f"{ROUTER}/v1", api_key=KEY)
    ids = [m.id for m in client.models.list()]
    check("models.list", ids == ["bge-small", "llama-3-8b"], ids)
    check("models.retrieve", client.models.retrieve("llama-3-8b").id == "llama-3-8b")
    e = raises(lambda: client.models.retrieve("whisper"), openai.NotFoundError)
    check("a model that is no language model is not found", e is not None and e.code == "model_not_found", e)
    bad = openai.OpenAI(base_url=f"{ROUTER}/v1", api_key="lw_wrong")
    e = raises(lambda: bad.models.list(), openai.AuthenticationError)
    check("a wrong key is an authentication error", e is not None, e)

    deadline = time.time() + 90
    while True:
        try:
            chat = client.chat.completions.create(
                model="llama-3-8b", messages=[{"role": "user", "content": "hello"}], max_tokens=8
            )
            break
        except (openai.APIStatusError, openai.APIConnectionError) as e:
            check("llama-3-8b becomes ready", time.time() < deadline, e)
            time.sleep(0.5)
    check(
        "chat completion",
        chat.choices[0].message.content and chat.usage.completion_tokens > 0,
        chat,
    )
    chunks = list(
        client.chat.completions.create(
            model="llama-3-8b", messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check("streamed chat completion", len(chunks) > 1 and text, [c.model_dump() for c in chunks[:3]])

    deadline = time.time() + 90
    while True:
        try:
            emb = client.embeddings.create(model="bge-small", input=["hello", "a lighthouse"])
            break
        except (openai.APIStatusError, openai.APIConnectionError) as e:
            check("bge-small becomes ready", time.time() < deadline, e)
            time.sleep(0.5)
    check(
        "embeddings",
        [d.index for d in emb.data] == [0, 1]
        and all(len(d.embedding) == 8 for d in emb.data)
        and emb.data[0].embedding != emb.data[1].embedding
        and emb.usage.prompt_tokens > 0,
        emb,
    )
    again = client.embeddings.create(model="bge-small", input="hello")
    check("an embedding is the same next time", again.data[0].embedding == emb.data[0].embedding)

    # Router-made errors in OpenAI's error object: the client raises the right class, with
    # the router's message.
    e = raises(
        lambda: client.chat.completions.create(model="bge-small", messages=[{"role": "user", "content": "x"}]),
        openai.BadRequestError,
    )
    check("chat to an embedding model is a BadRequestError", e is not None and "/v1/embeddings" in e.message, e)
    e = raises(lambda: client.embeddings.create(model="nope", input="x"), openai.NotFoundError)
    check("an unknown model is a NotFoundError", e is not None and e.code == "model_not_found", e)
    e = raises(lambda: client.embeddings.create(model="bge-small", input="x" * 4000), openai.BadRequestError)
    check("an input over the context is refused", e is not None and "context of 512 tokens" in e.message, e)


if sys.argv[1:] == ["kserve"]:
    asyncio.run(kserve_clients())
    print(json.dumps(passed))
else:
    triton_http()
    triton_over_grpc()
    openai_api()
    theirs = subprocess.run([sys.executable, __file__, "kserve"], capture_output=True, text=True)
    check("kserve's clients", theirs.returncode == 0, theirs.stderr + theirs.stdout)
    passed.extend(json.loads(theirs.stdout.strip().splitlines()[-1]))
    print(json.dumps({"clients": "ok", "passed": passed}))
