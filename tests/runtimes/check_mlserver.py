"""Real inference through Laneway's router to MLServer, checked against scikit-learn itself.

Sends the iris samples with tritonclient.http (JSON tensors, then binary tensors, the client's
default), compares the species the server answers with the trained model's own `predict` on the
same input, then times the same request sent to the router and straight to the replica (the
router's added latency). Environment: LANEWAY_ROUTER, LANEWAY_KEY, LANEWAY_MODEL_FILE (the
trained model), LANEWAY_REPLICA (the replica's own host:port). Prints one JSON line.
"""

import json
import os
import statistics
import time

import joblib
import numpy as np
import tritonclient.http as httpclient
from sklearn.datasets import load_iris

router = os.environ["LANEWAY_ROUTER"].removeprefix("http://")
headers = {"Authorization": f"Bearer {os.environ['LANEWAY_KEY']}"}
model = joblib.load(os.environ["LANEWAY_MODEL_FILE"])
features, _ = load_iris(return_X_y=True)
batch = features[::10].astype(np.float32)  # 15 flowers, every species
expected = model.predict(batch)


def infer(client, binary, extra_headers=None):
    x = httpclient.InferInput("features", list(batch.shape), "FP32")
    x.set_data_from_numpy(batch, binary_data=binary)
    out = httpclient.InferRequestedOutput("predict", binary_data=binary)
    # A copy: tritonclient writes Inference-Header-Content-Length into the dict it is given,
    # and a JSON request sent with that dict afterwards would carry a stale one.
    r = client.infer("iris", [x], outputs=[out], headers=dict(extra_headers or {}))
    return r.as_numpy("predict").reshape(-1)


client = httpclient.InferenceServerClient(router)
assert client.is_model_ready("iris", headers=headers), "iris is not ready through the router"
meta = client.get_model_metadata("iris", headers=headers)
assert meta["inputs"][0]["name"] == "features", meta
report = {"samples": len(batch)}
for binary in (False, True):
    got = infer(client, binary, headers)
    assert np.array_equal(got, expected), f"binary={binary}: server {got} != sklearn {expected}"
    report["binary" if binary else "json"] = "matches sklearn"


# JSON tensors both ways: MLServer's REST API reads no binary ones (the router converts them).
def timed(c, hdrs, n=200):
    for _ in range(10):
        infer(c, False, hdrs)
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        infer(c, False, hdrs)
        samples.append((time.perf_counter() - t) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


direct = httpclient.InferenceServerClient(os.environ["LANEWAY_REPLICA"])
# Interleaved rounds, so a busy moment of the machine lands on both sides.
rounds = [(timed(client, headers, 100), timed(direct, None, 100)) for _ in range(2)]
via = [r[0] for r in rounds]
dir_ = [r[1] for r in rounds]
report["router_p50_ms"] = round(statistics.mean(v[0] for v in via), 3)
report["router_p99_ms"] = round(statistics.mean(v[1] for v in via), 3)
report["direct_p50_ms"] = round(statistics.mean(d[0] for d in dir_), 3)
report["direct_p99_ms"] = round(statistics.mean(d[1] for d in dir_), 3)
report["added_p50_ms"] = round(report["router_p50_ms"] - report["direct_p50_ms"], 3)
report["mlserver"] = "ok"
print(json.dumps(report))
