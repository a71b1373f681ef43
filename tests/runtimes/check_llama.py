"""A real LLM engine (llama.cpp's OpenAI-compatible server) through Laneway's router, with the
official `openai` client: the model listed, a whole chat completion with its usage, a streamed
one token by token, then the same short completion timed through the router and straight to
the replica (the router's added latency). Environment: LANEWAY_ROUTER, LANEWAY_KEY,
LANEWAY_REPLICA (the replica's own host:port). Prints one JSON line."""

import json
import os
import statistics
import time

from openai import OpenAI

router = OpenAI(base_url=os.environ["LANEWAY_ROUTER"] + "/v1", api_key=os.environ["LANEWAY_KEY"])
direct = OpenAI(base_url=f"http://{os.environ['LANEWAY_REPLICA']}/v1", api_key="unused")
messages = [{"role": "user", "content": "hello fleet"}]
report = {}

ids = [m.id for m in router.models.list().data]
assert "tiny-llama" in ids, ids

whole = router.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12)
assert whole.choices[0].message.role == "assistant", whole
assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0, whole.usage
report["whole"] = {"prompt_tokens": whole.usage.prompt_tokens, "completion_tokens": whole.usage.completion_tokens}

t0 = time.perf_counter()
first, chunks, finish = None, 0, None
for chunk in router.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, stream=True):
    if not chunk.choices:
        continue
    if chunk.choices[0].delta.content is not None and first is None:
        first = time.perf_counter() - t0
    chunks += 1
    finish = chunk.choices[0].finish_reason or finish
assert chunks >= 2 and finish is not None, (chunks, finish)
report["stream"] = {"chunks": chunks, "finish_reason": finish, "ttft_ms": round(first * 1000, 1)}


def timed(client, n=30):
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=4)
        samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


timed(router, 3)
timed(direct, 3)
rounds = [(timed(router), timed(direct)) for _ in range(2)]
report["router_p50_ms"] = round(statistics.mean(r for r, _ in rounds), 2)
report["direct_p50_ms"] = round(statistics.mean(d for _, d in rounds), 2)
report["added_p50_ms"] = round(report["router_p50_ms"] - report["direct_p50_ms"], 2)
report["llama"] = "ok"
print(json.dumps(report))
