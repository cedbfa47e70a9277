"""End-to-end tests of `eyrie serve` with the official `openai` Python client (run by crates/server/tests/serve_e2e.rs,
which starts the servers): chat and completions, streaming and not, usage, stop strings, seeds, errors, and --
on fixtures/serve/scripted, whose greedy output is a fixed script -- reasoning_content and Kimi tool calls.

usage: openai_e2e.py TINY_URL API_KEY SCRIPTED_URL
"""
import json
import sys

import openai

TINY_URL, API_KEY, SCRIPTED_URL = sys.argv[1:4]
tiny = openai.OpenAI(base_url=TINY_URL + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
scripted = openai.OpenAI(base_url=SCRIPTED_URL + "/v1", api_key="unused", max_retries=0, timeout=120)
MODEL = "eyrie-tiny"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
passed = []


def test(fn):
    fn()
    passed.append(fn.__name__)
    print(f"ok  {fn.__name__}", flush=True)
    return fn


@test
def models_list():
    ids = [m.id for m in tiny.models.list().data]
    assert ids == [MODEL], ids


@test
def chat_non_streaming_and_streaming_agree():
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = tiny.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length", choice
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0, full.usage
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    stream = tiny.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    content, reasoning, finishes, usage = "", "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert content == (choice.message.content or ""), (content, choice.message.content)
    assert reasoning == ((choice.message.model_extra or {}).get("reasoning_content") or "")
    assert finishes == ["length"], finishes
    assert usage is not None and usage.completion_tokens == 12, usage


@test
def completions_and_stop_strings():
    base = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, **GREEDY)
    text = tiny.completions.create(**base).choices[0].text
    assert len(text) >= 8, repr(text)
    stop = text[4:7]
    cut = tiny.completions.create(stop=[stop], **base).choices[0]
    assert cut.text == text[: text.index(stop)], (cut.text, text, stop)
    assert cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in tiny.completions.create(stop=[stop], stream=True, **base) if c.choices)
    assert streamed == cut.text, (streamed, cut.text)


@test
def seeds_reproduce_samples():
    args = dict(model=MODEL, prompt="The weather", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = tiny.completions.create(seed=11, **args).choices[0].text
    b = tiny.completions.create(seed=11, **args).choices[0].text
    assert a == b, (a, b)
    others = {tiny.completions.create(seed=s, **args).choices[0].text for s in range(12, 16)}
    assert others != {a}, "different seeds give different samples"


@test
def logprobs():
    r = tiny.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5, "greedy takes the most likely token"


@test
def errors_have_openai_shape():
    try:
        tiny.chat.completions.create(model="gpt-404", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert e.body["param"] == "model", e.body
    try:
        tiny.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=9)
        raise AssertionError("temperature 9 accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "temperature", e.body
    try:
        tiny.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**9)
        raise AssertionError("max_tokens beyond the context accepted")
    except openai.BadRequestError as e:
        assert e.body["code"] == "context_length_exceeded", e.body
    bad_key = openai.OpenAI(base_url=TINY_URL + "/v1", api_key="wrong", max_retries=0)
    try:
        bad_key.models.list()
        raise AssertionError("a wrong API key was accepted")
    except openai.AuthenticationError:
        pass


def weather_call(message):
    calls = message.tool_calls
    assert calls and len(calls) == 1, message
    assert calls[0].function.name == "get_weather", calls
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}, calls
    assert calls[0].id == "functions.get_weather:0", calls
    return calls[0]


@test
def tool_calls_and_reasoning_non_streaming():
    r = scripted.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Ok", choice.message
    assert choice.message.model_extra.get("reasoning_content") == "Hmm", choice.message
    call = weather_call(choice.message)
    # The conversation continues with the tool's answer: the template renders the call and the result.
    follow = scripted.chat.completions.create(
        model="scripted",
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Ok", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "{\"sky\": \"clear\"}"},
        ],
        tools=TOOLS,
        temperature=0,
    )
    assert follow.choices[0].finish_reason == "tool_calls"


@test
def tool_calls_and_reasoning_streaming():
    stream = scripted.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, temperature=0, stream=True
    )
    content, reasoning, finishes, calls = "", "", [], {}
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = slot["id"] or d.id
                slot["name"] = slot["name"] or (d.function.name if d.function else None)
                slot["arguments"] += (d.function.arguments or "") if d.function else ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert (content, reasoning, finishes) == ("Ok", "Hmm", ["tool_calls"]), (content, reasoning, finishes)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"] == "functions.get_weather:0"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}, calls


print(f"{len(passed)} passed")
