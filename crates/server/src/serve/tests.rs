//! In-process tests of the server (`tower::ServiceExt::oneshot`, no socket) on the embedded tiny model and burn's
//! `Flex` CPU backend: every endpoint, the OpenAI parameters and errors, streaming, cancellation, concurrency,
//! preemption and prefix caching. Greedy outputs are checked against the model's own `generate_greedy`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use burn::backend::Flex;
use clap::Parser;
use eyrie_model::DeepseekV3;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

use super::app::{self, AppState, app};
use super::{ServeArgs, launch, tiny};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: ServeArgs,
}

struct Server {
    state: Arc<AppState>,
    _engine: std::thread::JoinHandle<()>,
    _tx: std::sync::mpsc::Sender<super::Message>,
}

fn start(flags: &[&str]) -> Server {
    let args = Cli::parse_from(std::iter::once("serve").chain(flags.iter().copied())).args;
    let dir = tiny::materialize().unwrap();
    let launched = launch::<Flex>(&dir, tiny::NAME, &args, Default::default()).unwrap();
    launched.loaded.recv().unwrap().unwrap();
    Server { state: launched.state, _engine: launched.engine_thread, _tx: launched.tx }
}

async fn call(
    state: &Arc<AppState>,
    method: &str,
    uri: &str,
    body: Option<Body>,
    key: Option<&str>,
) -> (StatusCode, Vec<u8>) {
    let mut req = Request::builder().method(method).uri(uri).header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = app(state.clone()).oneshot(req.body(body.unwrap_or_else(Body::empty)).unwrap()).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes().to_vec();
    (status, bytes)
}

async fn post(state: &Arc<AppState>, uri: &str, body: Value) -> (StatusCode, Value) {
    let (status, bytes) = call(state, "POST", uri, Some(Body::from(body.to_string())), None).await;
    (status, serde_json::from_slice(&bytes).unwrap_or_else(|_| json!({"raw": String::from_utf8_lossy(&bytes)})))
}

/// The `data:` payloads of an SSE body.
fn sse_data(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes).lines().filter_map(|l| l.strip_prefix("data: ").map(str::to_owned)).collect()
}

fn assert_error(status: StatusCode, body: &Value, want: StatusCode, param: Option<&str>) {
    assert_eq!(status, want, "{body}");
    let err = &body["error"];
    assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(err["type"].is_string(), "{body}");
    if let Some(p) = param {
        assert_eq!(err["param"], p, "{body}");
    }
}

async fn wait_idle(state: &Arc<AppState>) {
    for _ in 0..200 {
        let g = state.metrics.gauges();
        if g.running == 0 && g.waiting == 0 && g.kv_blocks_used == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the engine did not become idle: {:?}", state.metrics.gauges());
}

/// The warm-up's decode steps (widths 1 to 16 here) leave nothing behind: no KV block held, no prefix cached, no
/// request counted, before the server says it is ready.
#[test]
fn warm_up_leaves_the_cache_empty() {
    let s = start(&["--max-running-requests", "16"]);
    let g = s.state.metrics.gauges();
    assert!(g.kv_blocks_total >= 16, "{g:?}");
    assert_eq!((g.kv_blocks_used, g.kv_blocks_cached, g.running, g.waiting), (0, 0, 0, 0), "{g:?}");
}

#[test]
fn warm_up_tokens_give_the_moe_experts_of_one_two_and_three_tokens() {
    use super::engine::warm_up_tokens;
    assert_eq!(warm_up_tokens(1, 1000), vec![11]);
    // Up to 5 rows: all distinct.
    let t = warm_up_tokens(5, 163_840);
    assert!((1..5).all(|i| !t[..i].contains(&t[i])), "{t:?}");
    for n in [6, 16, 17, 64, 65, 256] {
        let t = warm_up_tokens(n, 163_840);
        let count = |x: u32| t.iter().filter(|&&y| y == x).count();
        assert_eq!((count(t[0]), count(t[3]), count(t[5])), (3, 2, 1), "{n}: {t:?}");
        assert!(t[5..].iter().all(|&x| count(x) == 1), "{n}");
    }
    // Every token is inside the vocabulary, even a tiny one.
    assert!(warm_up_tokens(256, 7).iter().all(|&x| x < 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_models_metrics_and_unknown_routes() {
    let s = start(&[]);
    let (status, body) = call(&s.state, "GET", "/health", None, None).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let (status, body) = call(&s.state, "GET", "/v1/models", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let models: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(models["data"][0]["id"], tiny::NAME);
    let (status, _) = call(&s.state, "GET", &format!("/v1/models/{}", tiny::NAME), None, None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = call(&s.state, "GET", "/v1/models/nope", None, None).await;
    assert_error(status, &serde_json::from_slice(&body).unwrap(), StatusCode::NOT_FOUND, Some("model"));
    let (status, body) = call(&s.state, "GET", "/v1/nothing", None, None).await;
    assert_error(status, &serde_json::from_slice(&body).unwrap(), StatusCode::NOT_FOUND, None);
    let (status, body) = call(&s.state, "GET", "/metrics", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(body).unwrap();
    assert!(text.contains("eyrie:kv_cache_blocks_total 4096"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_completion_equals_the_model_and_reports_usage() {
    let s = start(&[]);
    let prompt: Vec<u32> = vec![5, 300, 17, 900, 42, 7, 64];
    let (status, body) = post(
        &s.state,
        "/v1/completions",
        json!({"model": tiny::NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true, "logprobs": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let model = DeepseekV3::<Flex>::load(tiny::materialize().unwrap(), &Default::default()).unwrap();
    let want = model.generate_greedy(&prompt, 12, &Default::default()).unwrap();
    let text = s.state.tokenizer.decode(&want, true).unwrap();
    assert_eq!(body["choices"][0]["text"], text, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(body["usage"]["completion_tokens"], 12);
    assert_eq!(body["usage"]["total_tokens"], prompt.len() + 12);
    let lp = &body["choices"][0]["logprobs"];
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 12);
    for (i, l) in lp["token_logprobs"].as_array().unwrap().iter().enumerate() {
        let l = l.as_f64().unwrap();
        let best =
            lp["top_logprobs"][i].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert!(l <= 0.0 && (l - best).abs() < 1e-6, "greedy picks the most likely token: {l} vs {best}");
    }
    wait_idle(&s.state).await;
}

/// Overlap scheduling (a greedy step queued before the previous step's picks are read, fed with them on the
/// device) gives exactly the plain schedule's tokens: concurrent greedy requests of different lengths, a stop token
/// that ends a sequence while its next step is already queued, a sampled request beside them (its steps are not
/// overlapped), every block freed; the plain server (`--disable-overlap-schedule`) overlaps nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_scheduling_gives_the_plain_schedules_tokens() {
    let model = DeepseekV3::<Flex>::load(tiny::materialize().unwrap(), &Default::default()).unwrap();
    let prompts: Vec<Vec<u32>> =
        (0..5u32).map(|i| (0..(4 + 3 * i)).map(|j| (i * 131 + j * 29) % 1000).collect()).collect();
    let lengths = [1usize, 2, 7, 12, 12];
    let wants: Vec<Vec<u32>> =
        prompts.iter().zip(lengths).map(|(p, n)| model.generate_greedy(p, n, &Default::default()).unwrap()).collect();
    // The last prompt stops at the 6th token of its greedy continuation (first occurrence).
    let stop = wants[4][5];
    let cut = wants[4].iter().position(|&t| t == stop).unwrap() + 1;
    let mut outputs = Vec::new();
    for flags in [&[][..], &["--disable-overlap-schedule"][..]] {
        let s = start(flags);
        let mut tasks = Vec::new();
        for (i, (p, n)) in prompts.iter().zip(lengths).enumerate() {
            let state = s.state.clone();
            let mut body = json!({"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": true});
            if i == 4 {
                body["stop_token_ids"] = json!([stop]);
            }
            tasks.push(tokio::spawn(async move { post(&state, "/v1/completions", body).await }));
        }
        let state = s.state.clone();
        let sampled = json!({"prompt": prompts[0], "max_tokens": 9, "temperature": 0.8, "seed": 7, "ignore_eos": true});
        let sampled = tokio::spawn(async move { post(&state, "/v1/completions", sampled).await });
        let mut texts = Vec::new();
        for t in tasks {
            let (status, body) = t.await.unwrap();
            assert_eq!(status, StatusCode::OK, "{body}");
            texts.push(body["choices"][0]["text"].as_str().unwrap().to_string());
        }
        let (status, body) = sampled.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        texts.push(body["choices"][0]["text"].as_str().unwrap().to_string());
        for (i, want) in wants.iter().enumerate() {
            let want = if i == 4 { &want[..cut] } else { &want[..] };
            assert_eq!(texts[i], s.state.tokenizer.decode(want, true).unwrap(), "prompt {i}, flags {flags:?}");
        }
        wait_idle(&s.state).await;
        let overlapped = s.state.metrics.overlapped_steps.load(std::sync::atomic::Ordering::Relaxed);
        if flags.is_empty() {
            assert!(overlapped > 0, "the default schedule overlapped no step");
        } else {
            assert_eq!(overlapped, 0, "--disable-overlap-schedule overlapped {overlapped} steps");
        }
        outputs.push(texts);
    }
    assert_eq!(outputs[0], outputs[1], "overlapped and plain schedules differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_equals_non_streaming_with_usage_and_done() {
    let s = start(&[]);
    let body = json!({
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
        "max_tokens": 10, "temperature": 0, "ignore_eos": true,
        "chat_template_kwargs": {"thinking": false}
    });
    let (status, full) = post(&s.state, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{full}");
    assert_eq!(full["object"], "chat.completion");
    assert_eq!(full["choices"][0]["message"]["role"], "assistant");
    assert_eq!(full["usage"]["completion_tokens"], 10);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, bytes) =
        call(&s.state, "POST", "/v1/chat/completions", Some(Body::from(streamed.to_string())), None).await;
    assert_eq!(status, StatusCode::OK);
    let data = sse_data(&bytes);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut content = String::new();
    let mut reasoning = String::new();
    for c in &chunks {
        if let Some(choice) = c["choices"].get(0) {
            content.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
            reasoning.push_str(choice["delta"]["reasoning_content"].as_str().unwrap_or(""));
        }
    }
    let want_content = full["choices"][0]["message"]["content"].as_str().unwrap_or("");
    let want_reasoning = full["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or("");
    assert_eq!((content.as_str(), reasoning.as_str()), (want_content, want_reasoning));
    let finish: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec![&json!("length")]);
    let usage = &chunks.last().unwrap();
    assert!(usage["choices"].as_array().unwrap().is_empty());
    assert_eq!(usage["usage"]["completion_tokens"], full["usage"]["completion_tokens"]);
    assert_eq!(usage["usage"]["prompt_tokens"], full["usage"]["prompt_tokens"]);
    // The same prompt again: every full block of it came from the prefix cache.
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 32, "{usage}");
    wait_idle(&s.state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_seeds_logprobs_and_prefix_cache() {
    let s = start(&[]);
    let base = json!({"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let (_, plain) = post(&s.state, "/v1/completions", base.clone()).await;
    let text = plain["choices"][0]["text"].as_str().unwrap().to_string();
    // Stop at a piece from the middle of the text (chars, not bytes, to stay on boundaries).
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "{text:?}");
    let stop: String = chars[5..8].iter().collect();
    let mut with_stop = base.clone();
    with_stop["stop"] = json!([stop.clone()]);
    let (_, cut) = post(&s.state, "/v1/completions", with_stop.clone()).await;
    let want = &text[..text.find(&stop).unwrap()];
    assert_eq!(cut["choices"][0]["text"], want, "stop {stop:?} in {text:?}");
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    // Streaming cuts at the same place.
    with_stop["stream"] = json!(true);
    let (_, bytes) = call(&s.state, "POST", "/v1/completions", Some(Body::from(with_stop.to_string())), None).await;
    let streamed: String = sse_data(&bytes)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(streamed, want);
    // The second identical prompt hit the prefix cache? (the prompt is shorter than a block: no.) A long shared
    // prefix does.
    let long: String = "lorem ipsum dolor sit amet ".repeat(20);
    let (_, first) = post(&s.state, "/v1/completions", json!({"prompt": long, "max_tokens": 2})).await;
    let (_, second) = post(&s.state, "/v1/completions", json!({"prompt": long, "max_tokens": 2})).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{first}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached < prompt_tokens, "{second}");
    // Seeds: same seed, same sample; sampling differs from greedy somewhere across seeds.
    let sampled = |seed: u64| json!({"prompt": "Once upon", "max_tokens": 16, "temperature": 1.0, "seed": seed, "ignore_eos": true});
    let (_, a) = post(&s.state, "/v1/completions", sampled(7)).await;
    let (_, b) = post(&s.state, "/v1/completions", sampled(7)).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let mut differs = false;
    for seed in 8..12 {
        let (_, c) = post(&s.state, "/v1/completions", sampled(seed)).await;
        differs |= c["choices"][0]["text"] != a["choices"][0]["text"];
    }
    assert!(differs, "different seeds give different samples");
    // Seeded requests served together (their tokens picked on several threads in one step) draw what each draws
    // alone.
    let mut solo = Vec::new();
    for seed in 20..26 {
        let (_, body) = post(&s.state, "/v1/completions", sampled(seed)).await;
        solo.push(body["choices"][0]["text"].clone());
    }
    let tasks: Vec<_> = (20..26)
        .map(|seed| {
            let (state, body) = (s.state.clone(), sampled(seed));
            tokio::spawn(async move { post(&state, "/v1/completions", body).await })
        })
        .collect();
    for (want, t) in solo.iter().zip(tasks) {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(&body["choices"][0]["text"], want, "{body}");
    }
    // Chat logprobs.
    let (status, lp) = post(
        &s.state,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": true, "top_logprobs": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{lp}");
    let content = lp["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty());
    for entry in content {
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 3);
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
    }
    wait_idle(&s.state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let s = start(&["--api-key", "sekrit", "--context-length", "256"]);
    let send = |body: Body, key: Option<&'static str>| {
        let state = s.state.clone();
        async move {
            let (status, bytes) = call(&state, "POST", "/v1/chat/completions", Some(body), key).await;
            (status, serde_json::from_slice::<Value>(&bytes).unwrap_or(json!({"raw": String::from_utf8_lossy(&bytes)})))
        }
    };
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, body) = send(Body::from(ok.to_string()), None).await;
    assert_error(status, &body, StatusCode::UNAUTHORIZED, None);
    let (status, body) = send(Body::from(ok.to_string()), Some("wrong")).await;
    assert_error(status, &body, StatusCode::UNAUTHORIZED, None);
    let key = Some("sekrit");
    let (status, body) = send(Body::from("{not json"), key).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, None);
    let (status, body) = send(Body::from(vec![0xff, 0xfe, b'{']), key).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, None);
    let (status, body) = send(
        Body::from(json!({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).to_string()),
        key,
    )
    .await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("temperature"));
    let (status, body) = send(Body::from(json!({"messages": []}).to_string()), key).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("messages"));
    let (status, body) =
        send(Body::from(json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).to_string()), key)
            .await;
    assert_error(status, &body, StatusCode::NOT_FOUND, Some("model"));
    let (status, body) =
        send(Body::from(json!({"messages": [{"role": "user", "content": "hi"}], "n": 3}).to_string()), key).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("n"));
    let (status, body) =
        send(Body::from(json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}).to_string()), key)
            .await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("max_tokens"));
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    let long = "word ".repeat(400);
    let (status, body) =
        send(Body::from(json!({"messages": [{"role": "user", "content": long}]}).to_string()), key).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("messages"));
    let (status, body) = send(Body::from(json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}).to_string()), key).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("tool_choice"));
    let huge = vec![b' '; app::MAX_BODY_BYTES + 10];
    let (status, body) = send(Body::from(huge), key).await;
    assert_error(status, &body, StatusCode::PAYLOAD_TOO_LARGE, None);
    // Still serving.
    let (status, body) = send(Body::from(ok.to_string()), key).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _) = call(&s.state, "GET", "/health", None, None).await;
    assert_eq!(status, StatusCode::OK, "health needs no key");
    wait_idle(&s.state).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_preemption_and_cancellation_free_every_block() {
    // A cache of 24 blocks of 4 tokens for 8 sequences forces preemption; outputs must still equal solo runs.
    let s = start(&[
        "--max-total-tokens",
        "96",
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "8",
        "--max-running-requests",
        "8",
    ]);
    let prompts: Vec<Vec<u32>> =
        (0..8u32).map(|i| (0..(3 + i * 2)).map(|j| (i * 97 + j * 13) % 1000).collect()).collect();
    let model = DeepseekV3::<Flex>::load(tiny::materialize().unwrap(), &Default::default()).unwrap();
    let mut tasks = Vec::new();
    for p in &prompts {
        let state = s.state.clone();
        let body = json!({"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": true});
        tasks.push(tokio::spawn(async move { post(&state, "/v1/completions", body).await }));
    }
    for (p, t) in prompts.iter().zip(tasks) {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        let want = model.generate_greedy(p, 10, &Default::default()).unwrap();
        assert_eq!(body["choices"][0]["text"], s.state.tokenizer.decode(&want, true).unwrap(), "prompt {p:?}");
    }
    assert!(s.state.metrics.preemptions.load(std::sync::atomic::Ordering::Relaxed) > 0, "the small cache preempted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_frees_its_blocks() {
    let s = start(&[]);
    let body = json!({"prompt": "a b c d", "max_tokens": 20000, "stream": true, "ignore_eos": true});
    let req = Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app(s.state.clone()).oneshot(req).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    drop(body);
    // The gauges may still be the idle ones from before the request: wait for the cancellation itself.
    let cancelled = || s.state.metrics.requests_cancelled.load(std::sync::atomic::Ordering::Relaxed);
    for _ in 0..500 {
        if cancelled() >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cancelled(), 1);
    wait_idle(&s.state).await;
    assert!(s.state.metrics.generation_tokens.load(std::sync::atomic::Ordering::Relaxed) < 20000);
}

#[test]
fn reasoning_and_kimi_tool_calls_are_split_from_content() {
    let tokenizer = Arc::new(eyrie_model::tokenizer::Tokenizer::from_dir(tiny::materialize().unwrap()).unwrap());
    let enc = |t: &str| tokenizer.encode(t, true).unwrap();
    let ids: Vec<u32> = [
        "let me think",
        "</think>",
        "Sunny: ",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "functions.get_weather:0",
        "<|tool_call_argument_begin|>",
        "{\"city\": \"Paris\"}",
        "<|tool_call_end|>",
        "<|tool_call_begin|>",
        "functions.time:1",
        "<|tool_call_argument_begin|>",
        "{}",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    ]
    .iter()
    .flat_map(|t| enc(t))
    .collect();
    let mut parser = super::output::OutputParser::new(tokenizer.clone(), true, true, true, Vec::new());
    let mut deltas: Vec<super::output::Delta> = ids.iter().map(|&id| parser.push(id)).collect();
    deltas.push(parser.finish());
    let reasoning: String = deltas.iter().map(|d| d.reasoning.as_str()).collect();
    let content: String = deltas.iter().map(|d| d.content.as_str()).collect();
    assert_eq!(reasoning, "let me think");
    assert_eq!(content, "Sunny: ");
    let calls = parser.tool_calls();
    assert_eq!(calls.len(), 2);
    assert_eq!((calls[0].id.as_str(), calls[0].function.name.as_str()), ("functions.get_weather:0", "get_weather"));
    assert_eq!(calls[0].function.arguments, "{\"city\": \"Paris\"}");
    assert_eq!((calls[1].function.name.as_str(), calls[1].function.arguments.as_str()), ("time", "{}"));
    // The streamed fragments rebuild the same calls: a header delta first, then argument pieces.
    let mut rebuilt = vec![String::new(); 2];
    for d in deltas.iter().flat_map(|d| &d.tool_calls) {
        rebuilt[d.index].push_str(&d.function.arguments);
        if d.function.name.is_some() {
            assert!(d.id.is_some() && d.function.arguments.is_empty());
        }
    }
    assert_eq!(rebuilt, vec![calls[0].function.arguments.clone(), "{}".to_string()]);
    // Without thinking in the prompt, text is content until a `<think>` token.
    let mut plain = super::output::OutputParser::new(tokenizer.clone(), false, true, false, vec!["STOP".into()]);
    let text: String = enc("<think>hm</think>ok then STOP and more").iter().map(|&id| plain.push(id).content).collect();
    assert_eq!(text, "ok then ");
    assert!(plain.stopped());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_serving_is_token_identical_to_plain_serving() {
    let drafter = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/serve/tiny-drafter");
    let plain = start(&["--max-total-tokens", "512", "--page-size", "4"]);
    let chain = start(&[
        "--max-total-tokens",
        "512",
        "--page-size",
        "4",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        drafter,
        "--speculative-num-steps",
        "3",
    ]);
    let tree = start(&[
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        drafter,
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "2",
        "--speculative-num-draft-tokens",
        "5",
    ]);
    // Each engine's warm-up ran a speculative request through its steps (the server would not have started had it
    // failed) and left nothing behind: no request counted, no block held or cached.
    for server in [&chain, &tree] {
        let g = server.state.metrics.gauges();
        assert_eq!((g.kv_blocks_used, g.kv_blocks_cached, g.running, g.waiting), (0, 0, 0, 0), "{g:?}");
        assert_eq!(server.state.metrics.requests_ok.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert!(g.kv_blocks_total > 0, "{g:?}");
    }
    let prompts: Vec<Vec<u32>> =
        (0..6u32).map(|i| (0..(2 + i * 5)).map(|j| (i * 31 + j * 7) % 1000).collect()).collect();
    for server in [&chain, &tree] {
        let mut tasks = Vec::new();
        for p in &prompts {
            let body = json!({"prompt": p, "max_tokens": 9, "temperature": 0, "ignore_eos": true});
            let (a, b) = (plain.state.clone(), server.state.clone());
            tasks.push(tokio::spawn(async move {
                (post(&a, "/v1/completions", body.clone()).await, post(&b, "/v1/completions", body).await)
            }));
        }
        for t in tasks {
            let ((sa, want), (sb, got)) = t.await.unwrap();
            assert_eq!((sa, sb), (StatusCode::OK, StatusCode::OK), "{want} {got}");
            assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
            assert_eq!(got["usage"]["completion_tokens"], 9, "tokens past max_tokens are cut");
        }
        let (_, metrics) = call(&server.state, "GET", "/metrics", None, None).await;
        let text = String::from_utf8(metrics).unwrap();
        assert!(text.contains("eyrie:spec_decode_acceptance_rate{position=\"0\"}"), "{text}");
        wait_idle(&server.state).await;
    }
    // Log-probabilities are refused clearly rather than silently missing.
    let (status, body) = post(&chain.state, "/v1/completions", json!({"prompt": "x", "logprobs": 1})).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, Some("logprobs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_and_expert_parallel_serving_equals_plain_serving() {
    // A small cache and short prefill chunks (as the preemption test above), so that the parallel engine admits
    // many requests at once and must preempt.
    let small =
        ["--max-total-tokens", "96", "--page-size", "4", "--chunked-prefill-size", "8", "--max-running-requests", "8"];
    let plain = start(&small);
    let splits = [
        ["--tp-size", "2", "--ep-size", "1"],
        ["--tp-size", "2", "--ep-size", "2"],
        ["--tp-size", "1", "--ep-size", "4"],
    ];
    let prompts: Vec<Vec<u32>> =
        (0..6u32).map(|i| (0..(2 + i * 5)).map(|j| (i * 31 + j * 7) % 1000).collect()).collect();
    for split in splits {
        let flags: Vec<&str> = small.iter().chain(split.iter()).copied().collect();
        let server = start(&flags);
        // Both servers get all requests at once (not one after the other), so each batches and preempts.
        let mut tasks = Vec::new();
        for p in prompts.iter().chain(prompts.iter()) {
            let body = json!({"prompt": p, "max_tokens": 9, "temperature": 0, "ignore_eos": true});
            let (a, b) = (plain.state.clone(), server.state.clone());
            let body_b = body.clone();
            let want = tokio::spawn(async move { post(&a, "/v1/completions", body).await });
            let got = tokio::spawn(async move { post(&b, "/v1/completions", body_b).await });
            tasks.push((want, got));
        }
        for (want, got) in tasks {
            let ((sa, want), (sb, got)) = (want.await.unwrap(), got.await.unwrap());
            assert_eq!((sa, sb), (StatusCode::OK, StatusCode::OK), "{split:?}: {want} {got}");
            assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"], "{split:?}");
        }
        wait_idle(&server.state).await;
        let (_, metrics) = call(&server.state, "GET", "/metrics", None, None).await;
        let text = String::from_utf8(metrics).unwrap();
        let value = |name: &str| -> f64 {
            text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse().ok()).unwrap_or(-1.0)
        };
        assert_eq!(value("eyrie:kv_cache_blocks_used "), 0.0, "{split:?}: every block is free\n{text}");
        let preempted = server.state.metrics.preemptions.load(std::sync::atomic::Ordering::Relaxed);
        assert!(preempted > 0, "{split:?}: the small cache preempted");
        // The group's decode steps overlapped, each rank feeding its own picks (`forward_batch_chained`).
        let overlapped = server.state.metrics.overlapped_steps.load(std::sync::atomic::Ordering::Relaxed);
        assert!(overlapped > 0, "{split:?}: no step overlapped");
    }
}

#[test]
fn bad_parallel_layouts_are_launch_errors_naming_the_flag() {
    let dir = tiny::materialize().unwrap();
    for (flags, want) in [
        (vec!["--tp-size", "3"], "num_attention_heads"),
        (vec!["--ep-size", "3"], "n_routed_experts"),
        (vec!["--tp-size", "0"], "--tp-size"),
        (
            vec![
                "--tp-size",
                "2",
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/serve/tiny-drafter"),
            ],
            "not supported yet",
        ),
    ] {
        let args = Cli::parse_from(std::iter::once("serve").chain(flags.iter().copied())).args;
        let err = match super::run_checks(&args) {
            Err(e) => e,
            Ok(()) => match launch::<Flex>(&dir, tiny::NAME, &args, Default::default()) {
                Err(e) => e,
                Ok(_) => panic!("{flags:?} was accepted"),
            },
        };
        let text = format!("{err:#}");
        assert!(text.contains(want), "{flags:?}: {text}");
    }
}
