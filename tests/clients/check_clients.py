"""The ecosystem's official clients against a running Laneway router (`laneway-control dev`).

Run by tests/it/clients.rs with LANEWAY_ROUTER (http://host:port) and LANEWAY_KEY (the dev
tenant's API key) set, in the venv `.ci/run` makes (`tests/clients/requirements.txt`). Each check
asserts what the client returns, not only that it did not raise; the first failed check ends the
run with its message. Prints one JSON line of what passed.
"""

import json
import os
import sys
import time

import numpy as np
import openai
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


def kserve():
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


def openai_api():
    client = openai.OpenAI(base_url=f"{ROUTER}/v1", api_key=KEY)
    ids = [m.id for m in client.models.list()]
    check("models.list", ids == ["llama-3-8b"], ids)
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


kserve()
openai_api()
print(json.dumps({"clients": "ok", "passed": passed}))
