"""A bounded load test of `eyrie serve` on loopback (run by crates/server/tests/serve_e2e.rs): 64 concurrent
streaming clients with mixed prompt and output lengths, a third of them disconnecting mid-stream, plus malformed
JSON, an oversized body and invalid UTF-8 among them. Checks: every client that stayed got exactly one finish
chunk, the usage it asked for and [DONE]; bad requests got 4xx with an OpenAI error body; afterwards the server is
idle with every KV block free, and it still answers.

usage: load_test.py URL
"""
import asyncio
import json
import random
import sys

import httpx

URL = sys.argv[1]
CLIENTS = 64


async def stream_one(client, i):
    rng = random.Random(i)
    prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"]) for _ in range(rng.randint(1, 60)))
    max_tokens = rng.randint(2, 48)
    disconnect = i % 3 == 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.7, "seed": i,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", URL + "/v1/completions", json=body) as r:
        assert r.status_code == 200, (i, r.status_code, await r.aread())
        finishes, usage, done, chunks = [], None, False, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            chunks += 1
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                if c.get("finish_reason"):
                    finishes.append(c["finish_reason"])
            if disconnect and chunks >= 2:
                return "disconnected"
    assert done and finishes == ["length"], (i, finishes, done)
    assert usage["completion_tokens"] == max_tokens, (i, usage, max_tokens)
    return "completed"


async def bad_one(client, kind):
    if kind == "json":
        r = await client.post(URL + "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    elif kind == "huge":
        r = await client.post(URL + "/v1/completions", content=b" " * (33 * 1024 * 1024), headers={"content-type": "application/json"})
    else:
        r = await client.post(URL + "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (kind, r.status_code, r.text[:200])
    assert "error" in r.json(), (kind, r.text[:200])
    return kind


async def metrics(client):
    text = (await client.get(URL + "/metrics")).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


async def main():
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        before = await metrics(client)
        tasks = [stream_one(client, i) for i in range(CLIENTS)]
        tasks += [bad_one(client, k) for k in ("json", "huge", "utf8") for _ in range(3)]
        results = await asyncio.gather(*tasks)
        completed = results.count("completed")
        disconnected = results.count("disconnected")
        assert completed + disconnected == CLIENTS, results
        assert disconnected == len(range(0, CLIENTS, 3)), results
        for _ in range(300):
            m = await metrics(client)
            if m["eyrie:num_requests_running"] == 0 and m["eyrie:num_requests_waiting"] == 0 and m["eyrie:kv_cache_blocks_used"] == 0:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"not idle after the load: {m}")
        key = 'eyrie:requests_total{model="eyrie-tiny",outcome="%s"}'
        ok = m[key % "ok"] - before[key % "ok"]
        cancelled = m[key % "cancelled"] - before[key % "cancelled"]
        # Nothing lost or duplicated: every streamed request finished exactly once in the engine (a client that
        # left after its last token counts as ok).
        assert ok + cancelled == CLIENTS and ok >= completed, (ok, cancelled, completed, m)
        r = await client.post(URL + "/v1/completions", json={"prompt": "still there?", "max_tokens": 3})
        assert r.status_code == 200, r.text
        print(f"load: {completed} completed, {disconnected} disconnected, 9 bad requests rejected; "
              f"engine counted ok={ok:.0f} cancelled={cancelled:.0f}; KV blocks all free")


asyncio.run(main())
