"""A serving benchmark for `eyrie serve` (or any OpenAI-compatible server), in the style of SGLang's
`bench_serving` with its random dataset: a deterministic synthetic workload sent over streaming
`/v1/completions` (or `/v1/chat/completions`), swept over client concurrency levels and/or Poisson request
rates. Run by `cargo xtask bench serve`, which starts the server; runs alone against any URL.

Needs only the Python standard library (3.8+): the HTTP/1.1 client is written on asyncio streams, so the same file
runs on the development machine and on the GPU machine with nothing installed.

Workload (SGLang's `--dataset-name random` semantics): for request i, input length ~ U[int(input_len * r),
input_len] and output length ~ U[int(output_len * r), output_len] with r = --range-ratio, drawn once from --seed,
so every run of a sweep sends the same lengths; the prompt tokens are random ids in --token-range, drawn per run
(seed, run index), so no run gets prefix-cache hits from an earlier one. `--shared-prefix-len P` makes the prompts
of a run start with one of `--num-prefix-groups` shared P-token prefixes (prefix caching on purpose).
Completions send the prompt as token ids (exact lengths); chat sends as many random English words (more tokens
than words, plus the chat template's; the prompt tokens reported come from the server's `usage`). Each request has `ignore_eos: true` and a fixed
`max_tokens`, so output lengths are what was asked for.

Measures per run: request, input-token and output-token throughput; TTFT (send to first token-bearing chunk),
TPOT ((latency - TTFT) / (output tokens - 1), per request), ITL (time between token-bearing chunks; a chunk can
carry several tokens under speculative decoding), end-to-end latency, errors; and, from `GET /metrics` before and
after the run, the server's prompt / generated / prefix-cache-hit tokens, engine steps (generated tokens per step
is the mean decode batch), preemptions, its own TTFT and ITL means, and the speculative acceptance rate per draft
position (`eyrie:spec_decode_acceptance_rate`, a gauge over the server's lifetime, not per run).

usage: bench_serve.py --url http://127.0.0.1:30000 [--max-concurrency 1,4,16,64] [--request-rate inf]
                      [--num-prompts 64] [--input-len 256] [--output-len 64] [--range-ratio 0.5] [--json out.json]
"""
import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import ssl
import sys
import time
import urllib.parse

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or had not but "
         "what all when we there can more if out so up said one about other into them then she many some would "
         "time these two way could people my than first water been who its now find long down day did get come "
         "made may part over new sound take only little work know place year live me back give most very after "
         "thing our just name good sentence man think say great where help through much before line right too "
         "mean old any same tell boy follow came want show also around form three small set put end does another "
         "well large must big even such because turn here why ask went men read need land different home us move "
         "try kind hand picture again change off play spell air away animal house point page letter mother answer "
         "found study still learn should world high every near add food between own below country plant last "
         "school father keep tree never start city earth eye light thought head under story saw left few while "
         "along might close something seem next hard open example begin life always those both paper together got "
         "group often run important until children side feet car mile night walk white sea began grow took river "
         "four carry state once book hear stop without second later miss idea enough eat face watch far really "
         "almost let above girl sometimes mountain cut young talk soon list song being leave family").split()


# ---------------------------------------------------------------------------------------------------------------
# HTTP/1.1 on asyncio streams (one connection per request, `Connection: close`).


class HttpError(Exception):
    pass


class Url:
    def __init__(self, url):
        u = urllib.parse.urlsplit(url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.tls else 80)
        self.base = u.path

    def __str__(self):
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}{self.base}"


class Response:
    """Status, headers, and the body as an async iterator of byte blocks (chunked, sized, or up to EOF)."""

    def __init__(self, reader, writer, status, headers):
        self.reader, self.writer, self.status, self.headers = reader, writer, status, headers

    async def blocks(self):
        r = self.reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await r.readline()
                if not size_line:
                    raise HttpError("connection closed inside a chunked body")
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                data = await r.readexactly(size)
                await r.readline()
                yield data
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await r.read(min(left, 65536))
                if not data:
                    raise HttpError("connection closed before the end of the body")
                left -= len(data)
                yield data
        else:
            while True:
                data = await r.read(65536)
                if not data:
                    return
                yield data

    async def body(self):
        return b"".join([b async for b in self.blocks()])

    async def lines(self):
        """The body split into lines (SSE framing), without their line endings."""
        buf = b""
        async for block in self.blocks():
            buf += block
            *done, buf = buf.split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if buf:
            yield buf.rstrip(b"\r").decode("utf-8", "replace")

    def close(self):
        self.writer.close()


async def request(url, method, path, body=None, api_key=None):
    """Sends one request and reads the status line and headers; the caller reads the body and closes."""
    ctx = ssl.create_default_context() if url.tls else None
    reader, writer = await asyncio.open_connection(url.host, url.port, ssl=ctx, limit=1 << 20)
    payload = b"" if body is None else json.dumps(body).encode()
    head = [f"{method} {url.base}{path} HTTP/1.1", f"Host: {url.host}:{url.port}", "Connection: close",
            "Accept: */*", "User-Agent: eyrie-bench-serve"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    await writer.drain()
    status_line = await reader.readline()
    parts = status_line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        writer.close()
        raise HttpError(f"bad status line {status_line[:80]!r}")
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return Response(reader, writer, int(parts[1]), headers)


async def get_text(url, path, api_key=None, timeout=30):
    async def go():
        r = await request(url, "GET", path, api_key=api_key)
        try:
            return r.status, (await r.body()).decode("utf-8", "replace")
        finally:
            r.close()

    return await asyncio.wait_for(go(), timeout)


# ---------------------------------------------------------------------------------------------------------------
# Workload.


def lengths(args):
    """(input_len, output_len) per request: SGLang's random dataset, drawn once from the seed."""
    rng = random.Random(args.seed)
    lo_in = max(int(args.input_len * args.range_ratio), 1)
    lo_out = max(int(args.output_len * args.range_ratio), 1)
    return [(rng.randint(lo_in, args.input_len), rng.randint(lo_out, args.output_len)) for _ in range(args.num_prompts)]


def prompts(args, lens, run_index):
    """One prompt per request (token ids for completions, words for chat); fresh random content per run."""
    rng = random.Random(f"{args.seed}/{run_index}")
    lo, hi = args.token_range
    draw = (lambda n: [rng.randrange(lo, hi) for _ in range(n)]) if args.backend == "completions" else \
        (lambda n: [rng.choice(WORDS) for _ in range(n)])
    prefixes = [draw(args.shared_prefix_len) for _ in range(args.num_prefix_groups)] if args.shared_prefix_len else []
    out = []
    for i, (n_in, _) in enumerate(lens):
        p = (prefixes[i % len(prefixes)] if prefixes else []) + draw(n_in)
        out.append(p if args.backend == "completions" else " ".join(p))
    return out


# ---------------------------------------------------------------------------------------------------------------
# One streaming request.


async def one_request(args, url, model, prompt, max_tokens, index, run_index):
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.temperature > 0:
        body["seed"] = run_index * 1_000_003 + index
    if args.backend == "completions":
        body["prompt"] = prompt
        path = "/v1/completions"
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    rec = {"ok": False, "error": None, "ttft": None, "latency": None, "itl": [], "prompt_tokens": None,
           "completion_tokens": None, "cached_tokens": None, "chunks": 0, "max_tokens": max_tokens}
    start = time.perf_counter()
    last = None
    try:
        r = await request(url, "POST", path, body, args.api_key)
        try:
            if r.status != 200:
                text = (await r.body()).decode("utf-8", "replace")
                raise HttpError(f"HTTP {r.status}: {text[:200]}")
            done = False
            async for line in r.lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise HttpError(f"error chunk: {json.dumps(chunk['error'])[:200]}")
                now = time.perf_counter()
                if chunk.get("usage"):
                    u = chunk["usage"]
                    rec["prompt_tokens"] = u.get("prompt_tokens")
                    rec["completion_tokens"] = u.get("completion_tokens")
                    rec["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                has_token = False
                for c in chunk.get("choices") or []:
                    d = c.get("delta") or {}
                    if c.get("text") or d.get("content") or d.get("reasoning_content") or d.get("tool_calls") \
                            or c.get("logprobs"):
                        has_token = True
                if not has_token:
                    continue
                rec["chunks"] += 1
                if last is None:
                    rec["ttft"] = now - start
                else:
                    rec["itl"].append(now - last)
                last = now
            if not done:
                raise HttpError("stream ended without [DONE]")
        finally:
            r.close()
        rec["latency"] = time.perf_counter() - start
        if rec["completion_tokens"] is None:
            rec["completion_tokens"] = rec["chunks"]
        if rec["ttft"] is None:
            raise HttpError("no token in the stream")
        rec["ok"] = True
    except (OSError, HttpError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["latency"] = time.perf_counter() - start
    return rec


# ---------------------------------------------------------------------------------------------------------------
# /metrics.


def parse_metrics(text):
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and " " in line:
            name, value = line.rsplit(" ", 1)
            try:
                values[name] = float(value)
            except ValueError:
                pass
    return values


async def scrape(url, api_key):
    try:
        status, text = await get_text(url, "/metrics", api_key)
        return parse_metrics(text) if status == 200 else {}
    except (OSError, HttpError, asyncio.TimeoutError):
        return {}


def server_side(before, after):
    """Counter deltas over the run and the spec-decode gauges after it; {} when the server has no eyrie metrics."""
    if not after or "eyrie:generation_tokens_total" not in after:
        return {}

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    out = {
        "prompt_tokens": delta("eyrie:prompt_tokens_total"),
        "generation_tokens": delta("eyrie:generation_tokens_total"),
        "prefix_cache_hit_tokens": delta("eyrie:prefix_cache_hit_tokens_total"),
        "engine_steps": delta("eyrie:engine_steps_total"),
        "preemptions": delta("eyrie:preemptions_total"),
        "requests": {k.split('outcome="')[1].rstrip('"}'): delta(k) for k in after
                     if k.startswith("eyrie:requests_total{")},
    }
    out["generated_tokens_per_step"] = out["generation_tokens"] / out["engine_steps"] if out["engine_steps"] else None
    out["prefix_cache_hit_rate"] = out["prefix_cache_hit_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else None
    for short, name in (("ttft", "eyrie:time_to_first_token_seconds"), ("itl", "eyrie:inter_token_latency_seconds")):
        n = delta(name + "_count")
        out[f"{short}_mean_ms"] = 1000 * delta(name + "_sum") / n if n else None
    rates = sorted((int(k.split('position="')[1].split('"')[0]), v) for k, v in after.items()
                   if k.startswith("eyrie:spec_decode_acceptance_rate{"))
    if rates:
        # rate[i] = P(draft position i accepted) and acceptance is a prefix, so E[accepted] = sum of the rates.
        out["spec_acceptance_rate_per_position"] = [v for _, v in rates]
        out["spec_acceptance_length"] = 1 + sum(v for _, v in rates)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Statistics and one run.


def percentile(xs, p):
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def summary_ms(xs):
    if not xs:
        return {"mean": None, "median": None, "p90": None, "p99": None, "max": None}
    ms = [1000 * x for x in xs]
    return {"mean": sum(ms) / len(ms), "median": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "max": max(ms)}


async def run_once(args, url, model, lens, concurrency, rate, run_index):
    texts = prompts(args, lens, run_index)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    arrivals = random.Random(f"{args.seed}/arrivals/{run_index}")

    async def limited(i):
        if sem is None:
            return await one_request(args, url, model, texts[i], lens[i][1], i, run_index)
        async with sem:
            return await one_request(args, url, model, texts[i], lens[i][1], i, run_index)

    before = await scrape(url, args.api_key)
    t0 = time.perf_counter()
    tasks = []
    for i in range(len(texts)):
        tasks.append(asyncio.create_task(limited(i)))
        if rate != math.inf and i + 1 < len(texts):
            await asyncio.sleep(arrivals.expovariate(rate))
    recs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    # The engine publishes counters at the end of its step: give the last one a moment.
    await asyncio.sleep(0.2)
    after = await scrape(url, args.api_key)

    ok = [r for r in recs if r["ok"]]
    in_tok = sum(r["prompt_tokens"] or 0 for r in ok)
    out_tok = sum(r["completion_tokens"] or 0 for r in ok)
    tpot = [(r["latency"] - r["ttft"]) / (r["completion_tokens"] - 1) for r in ok if r["completion_tokens"] > 1]
    errors = [r["error"] for r in recs if not r["ok"]]
    short = [r for r in ok if r["completion_tokens"] != r["max_tokens"]]
    return {
        "max_concurrency": concurrency,
        "request_rate": None if rate == math.inf else rate,
        "num_prompts": len(recs),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "outputs_not_max_tokens": len(short),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_token_throughput": in_tok / duration,
        "output_token_throughput": out_tok / duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "client_cached_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "achieved_concurrency": sum(r["latency"] for r in ok) / duration,
        "ttft_ms": summary_ms([r["ttft"] for r in ok]),
        "tpot_ms": summary_ms(tpot),
        "itl_ms": summary_ms([x for r in ok for x in r["itl"]]),
        "e2e_latency_ms": summary_ms([r["latency"] for r in ok]),
        "server": server_side(before, after),
        # The client machine's 1-minute load average at the end (when client and server share a small machine,
        # other work on it shows here).
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


# ---------------------------------------------------------------------------------------------------------------
# Tables.


def fmt(v, digits=1):
    if v is None:
        return "-"
    if isinstance(v, float) and v == math.inf:
        return "inf"
    return f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def tables(runs):
    rows1 = ["| concurrency | rate (req/s) | ok / errors | duration s | req/s | input tok/s | output tok/s | "
             "tokens / step | prefix-hit tokens | accept length |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows2 = ["| concurrency | rate | TTFT mean / median / p90 / p99 ms | TPOT mean / median / p99 ms | "
             "ITL mean / median / p99 ms | E2E mean / median / p99 ms |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        s = r["server"]
        conc = fmt(r["max_concurrency"]) if r["max_concurrency"] else "unlimited"
        rate = fmt(r["request_rate"], 2) if r["request_rate"] is not None else "inf"
        hit = "-" if not s else f"{s['prefix_cache_hit_tokens']:.0f} / {s['prompt_tokens']:.0f}"
        rows1.append(f"| {conc} | {rate} | {r['completed']} / {r['errors']} | {fmt(r['duration_s'], 2)} | "
                     f"{fmt(r['request_throughput'], 2)} | {fmt(r['input_token_throughput'])} | "
                     f"{fmt(r['output_token_throughput'])} | {fmt(s.get('generated_tokens_per_step'), 2)} | {hit} | "
                     f"{fmt(s.get('spec_acceptance_length'), 2)} |")
        t, p, i, e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2e_latency_ms"]
        rows2.append(f"| {conc} | {rate} | {fmt(t['mean'])} / {fmt(t['median'])} / {fmt(t['p90'])} / {fmt(t['p99'])} "
                     f"| {fmt(p['mean'], 2)} / {fmt(p['median'], 2)} / {fmt(p['p99'], 2)} "
                     f"| {fmt(i['mean'], 2)} / {fmt(i['median'], 2)} / {fmt(i['p99'], 2)} "
                     f"| {fmt(e['mean'])} / {fmt(e['median'])} / {fmt(e['p99'])} |")
    return "\n".join(rows1) + "\n\n" + "\n".join(rows2)


# ---------------------------------------------------------------------------------------------------------------


def parse_list(text, conv):
    return [conv(x) for x in text.split(",") if x.strip()]


def parse_rate(x):
    x = x.strip().lower()
    return math.inf if x in ("inf", "0") else float(x)


def parse_concurrency(x):
    x = x.strip().lower()
    return 0 if x in ("0", "none", "unlimited") else int(x)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    ap.add_argument("--backend", choices=("completions", "chat"), default="completions")
    ap.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", help="Bearer key for /v1 routes")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    ap.add_argument("--input-len", type=int, default=256, help="longest prompt (tokens)")
    ap.add_argument("--output-len", type=int, default=64, help="longest completion (tokens, sent as max_tokens)")
    ap.add_argument("--range-ratio", type=float, default=0.5,
                    help="lengths are uniform in [len * ratio, len] (1 = fixed lengths)")
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a prefix shared within a group")
    ap.add_argument("--num-prefix-groups", type=int, default=1)
    ap.add_argument("--token-range", default="0:1000",
                    help="random prompt token ids are drawn from LO:HI (ordinary tokens of the model)")
    ap.add_argument("--max-concurrency", default="1,4,16,64",
                    help="comma list; one run each (0 = unlimited); crossed with --request-rate")
    ap.add_argument("--request-rate", default="inf", help="comma list of Poisson arrival rates (req/s); inf = all at once")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup-requests", type=int, default=2, help="short requests sent before the sweep")
    ap.add_argument("--wait-ready", type=float, default=0,
                    help="first poll GET /health for up to this many seconds until it answers 200")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--label", default="", help="free text stored in the JSON (machine, binary, ...)")
    args = ap.parse_args(argv)
    lo, _, hi = args.token_range.partition(":")
    args.token_range = (int(lo), int(hi))
    if args.token_range[0] >= args.token_range[1] or args.num_prompts < 1 or args.input_len < 1 \
            or args.output_len < 1 or not 0 <= args.range_ratio <= 1 or args.num_prefix_groups < 1:
        ap.error("bad workload parameters")
    args.concurrencies = parse_list(args.max_concurrency, parse_concurrency)
    args.rates = parse_list(args.request_rate, parse_rate)
    return args


async def wait_ready(url, seconds):
    deadline = time.monotonic() + seconds
    while True:
        try:
            status, _ = await get_text(url, "/health", timeout=5)
            if status == 200:
                return
        except (OSError, HttpError, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}/health did not answer 200 within {seconds:.0f} s")
        await asyncio.sleep(0.5)


async def main(argv):
    args = parse_args(argv)
    url = Url(args.url)
    if args.wait_ready > 0:
        await wait_ready(url, args.wait_ready)
    model = args.model
    if model is None:
        status, text = await get_text(url, "/v1/models", args.api_key)
        if status != 200:
            raise SystemExit(f"GET /v1/models: HTTP {status}: {text[:200]}")
        model = json.loads(text)["data"][0]["id"]
    lens = lengths(args)
    print(f"bench_serve: {url} model {model!r}, {args.backend}, {args.num_prompts} prompts per run, input "
          f"{min(n for n, _ in lens)}..{max(n for n, _ in lens)} (+{args.shared_prefix_len} shared) tokens, output "
          f"{min(n for _, n in lens)}..{max(n for _, n in lens)} tokens", file=sys.stderr)
    for w in range(args.warmup_requests):
        rec = await one_request(args, url, model, prompts(args, [(8, 4)], f"warmup{w}")[0], 4, w, -1 - w)
        if not rec["ok"]:
            raise SystemExit(f"warm-up request failed: {rec['error']}")
    runs = []
    run_index = 0
    for rate in args.rates:
        for conc in args.concurrencies:
            r = await run_once(args, url, model, lens, conc, rate, run_index)
            run_index += 1
            runs.append(r)
            print(f"  concurrency {conc or 'unlimited'}, rate {rate}: {r['completed']} ok, {r['errors']} errors in "
                  f"{r['duration_s']:.2f} s, {r['output_token_throughput']:.1f} output tok/s, TTFT median "
                  f"{fmt(r['ttft_ms']['median'])} ms", file=sys.stderr)
            for e in r["error_examples"]:
                print(f"    error: {e}", file=sys.stderr)
    print(tables(runs))
    result = {
        "benchmark": "serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "url": str(url),
        "model": model,
        "label": args.label,
        "client": {"python": platform.python_version(), "host": platform.node(), "platform": platform.platform(),
                   "cpus": os.cpu_count()},
        "workload": {"backend": args.backend, "num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "range_ratio": args.range_ratio,
                     "shared_prefix_len": args.shared_prefix_len, "num_prefix_groups": args.num_prefix_groups,
                     "token_range": list(args.token_range), "temperature": args.temperature, "seed": args.seed,
                     "ignore_eos": True, "lengths": [list(x) for x in lens]},
        "notes": "times in ms; TTFT = send to first token-bearing chunk; TPOT per request excludes the first token; "
                 "ITL = gaps between token-bearing chunks; server.* are /metrics deltas over the run, except "
                 "spec_acceptance_* (a gauge over the server's lifetime)",
        "runs": runs,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if any(r["errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
