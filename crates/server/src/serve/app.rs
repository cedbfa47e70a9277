//! The HTTP surface: `fn app(state) -> Router` with the OpenAI endpoints, health, models and metrics. Handlers
//! validate and tokenize on the async runtime, hand the request to the engine thread, and turn its events into a
//! response (SSE chunks when streaming). Dropping a response (client gone) cancels the request in the engine.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use eyrie_model::chat::{ChatTemplate, RenderOptions};
use eyrie_model::tokenizer::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::engine::{EngineParams, Event, FinishReason, Message, Submission, TokenLogprobs};
use super::error::ApiError;
use super::metrics::Metrics;
use super::output::{Delta, OutputParser};
use super::protocol::*;

/// Chunks buffered per stream before the producer waits for the client (so a gone client is noticed soon).
const SSE_BUFFER: usize = 8;

/// Largest request body accepted (413 above).
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// An oversized body up to this size is read and discarded before the 413 goes out, as nginx's lingering close
/// does: closing a socket with unread data resets it, and the client then sees a reset instead of the 413.
const MAX_DRAIN_BYTES: u64 = 4 * MAX_BODY_BYTES as u64;
/// How long draining an oversized body may take.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What every handler shares.
#[derive(Debug)]
pub struct AppState {
    pub served_model: String,
    pub api_key: Option<String>,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub vocab_size: usize,
    pub context_length: usize,
    pub engine: std::sync::Mutex<Sender<Message>>,
    pub ready: Arc<AtomicBool>,
    pub shutting_down: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
    /// Requests in flight (queued or running) at most; 503 above.
    pub max_in_flight: usize,
    pub in_flight: AtomicUsize,
    pub created: u64,
    /// Speculative decoding is on (log-probabilities are then not reported).
    pub speculative: bool,
}

type Shared = Arc<AppState>;

/// The router.
pub fn app(state: Shared) -> Router {
    let v1 = Router::new()
        .route("/chat/completions", post(chat_completions))
        .route("/completions", post(completions))
        .route("/models", get(models))
        .route("/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .nest("/v1", v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(reject_oversized))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(|_: Box<dyn std::any::Any + Send>| {
            ApiError::internal("a request handler panicked").into_response()
        }))
        .with_state(state)
}

/// Answers 413 to a body whose declared length is over [`MAX_BODY_BYTES`], after draining it (bounded by
/// [`MAX_DRAIN_BYTES`] and [`DRAIN_TIMEOUT`]) so that the client reads the answer. Bodies without a declared length
/// are cut at the limit by `DefaultBodyLimit`.
async fn reject_oversized(req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let Some(len) = declared.filter(|&n| n > MAX_BODY_BYTES as u64) else {
        return next.run(req).await;
    };
    if len <= MAX_DRAIN_BYTES {
        let mut body = req.into_body().into_data_stream();
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, async move {
            while let Some(Ok(_)) = futures_util::StreamExt::next(&mut body).await {}
        })
        .await;
    }
    let mut response = ApiError::with_status(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the request body is {len} bytes; at most {MAX_BODY_BYTES} are accepted"),
    )
    .into_response();
    response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    response
}

async fn auth(State(state): State<Shared>, headers: HeaderMap, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given =
            headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if given.map(str::trim) != Some(key.as_str()) {
            Metrics::add(&state.metrics.requests_client_error, 1);
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn health(State(state): State<Shared>) -> Response {
    if state.shutting_down.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "shutting down"}))).into_response()
    } else if state.ready.load(Ordering::SeqCst) {
        axum::Json(json!({"status": "ok"})).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "loading"}))).into_response()
    }
}

async fn metrics(State(state): State<Shared>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render(&state.served_model)).into_response()
}

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.served_model,
        "object": "model",
        "created": state.created,
        "owned_by": "eyrie",
        "root": state.served_model,
        "max_model_len": state.context_length,
    })
}

async fn models(State(state): State<Shared>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_card(&state)]})).into_response()
}

async fn model(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    if id == state.served_model {
        axum::Json(model_card(&state)).into_response()
    } else {
        ApiError::unknown_model(&id, &state.served_model).into_response()
    }
}

/// Parses a JSON body, naming the field at fault; body-limit and read failures keep their status (413, 400).
fn parse_body<T: serde::de::DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| ApiError::with_status(e.status(), format!("could not read the request body: {e}")))?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object", None));
    }
    // The shared fields are flattened into each request type, which hides their path from serde: check them on
    // their own first so that the error names the field.
    typed::<CommonParams>(value.clone())?;
    typed::<T>(value)
}

fn typed<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let param = (path != ".").then_some(path);
        ApiError::invalid(format!("invalid request: {inner}"), param.as_deref())
    })
}

fn check_model(state: &AppState, requested: Option<&str>) -> Result<(), ApiError> {
    match requested {
        Some(name) if !name.is_empty() && name != state.served_model => {
            Err(ApiError::unknown_model(name, &state.served_model))
        }
        _ => Ok(()),
    }
}

fn check_ready(state: &AppState) -> Result<(), ApiError> {
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    if !state.ready.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the model is still loading; retry when GET /health answers 200"));
    }
    Ok(())
}

/// Caps `max_tokens` by the context: an explicit request that cannot fit is a 400 (as vLLM), an absent one fills
/// the context.
fn completion_budget(state: &AppState, prompt_len: usize, requested: Option<usize>) -> Result<usize, ApiError> {
    let ctx = state.context_length;
    if prompt_len >= ctx {
        return Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {ctx} tokens. However, your prompt is {prompt_len} tokens."
            ),
            "messages",
        ));
    }
    match requested {
        Some(m) if prompt_len.saturating_add(m) > ctx => Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({prompt_len} \
                 in the prompt, {m} for the completion).",
                prompt_len.saturating_add(m)
            ),
            "max_tokens",
        )),
        Some(m) => Ok(m),
        None => Ok(ctx - prompt_len),
    }
}

/// A request handed to the engine: its event stream, and a guard that cancels it and frees its slot when dropped.
struct InFlight {
    events: mpsc::UnboundedReceiver<Event>,
    guard: CancelGuard,
}

struct CancelGuard {
    cancel: Arc<AtomicBool>,
    state: Shared,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
        self.state.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn submit(state: &Shared, prompt: Vec<u32>, params: EngineParams) -> Result<InFlight, ApiError> {
    if state.in_flight.fetch_add(1, Ordering::SeqCst) >= state.max_in_flight {
        state.in_flight.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError::unavailable(format!(
            "the server is at capacity ({} requests in flight); retry later",
            state.max_in_flight
        )));
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let guard = CancelGuard { cancel: cancel.clone(), state: state.clone() };
    let (tx, rx) = mpsc::unbounded_channel();
    let sent = state
        .engine
        .lock()
        .map_err(|_| ApiError::internal("engine channel lock poisoned"))?
        .send(Message::Submit(Box::new(Submission { prompt, params, events: tx, cancel })));
    if sent.is_err() {
        return Err(ApiError::unavailable("the engine has stopped"));
    }
    Ok(InFlight { events: rx, guard })
}

fn engine_params(state: &AppState, p: &GenerationParams, max_tokens: usize) -> Result<EngineParams, ApiError> {
    if state.speculative && p.logprobs.is_some() {
        return Err(ApiError::invalid(
            "logprobs are not reported while the server runs speculative decoding",
            Some("logprobs"),
        ));
    }
    Ok(EngineParams {
        sampling: p.sampling,
        max_tokens,
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs,
    })
}

fn finish_reason(reason: FinishReason, stopped_by_string: bool, tool_calls: bool) -> &'static str {
    match reason {
        _ if stopped_by_string => "stop",
        FinishReason::Stop if tool_calls => "tool_calls",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
        FinishReason::Length => "length",
    }
}

fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id).map(|b| b.into_owned()).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

fn chat_logprob(tokenizer: &Tokenizer, id: u32, lp: &TokenLogprobs) -> TokenLogprob {
    let (token, bytes) = token_text(tokenizer, id);
    let top = lp
        .top
        .iter()
        .map(|&(t, l)| {
            let (token, bytes) = token_text(tokenizer, t);
            TopLogprob { token, logprob: l, bytes }
        })
        .collect();
    TokenLogprob { token, logprob: lp.logprob, bytes, top_logprobs: top }
}

fn sse_json(value: &impl serde::Serialize) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(value).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}")))
}

type SseStream =
    Sse<axum::response::sse::KeepAliveStream<futures_util::stream::BoxStream<'static, Result<SseEvent, Infallible>>>>;

/// An SSE response fed by a task; when the client goes away the channel closes, the task ends and its guard
/// cancels the request.
fn sse_from_channel(rx: mpsc::Receiver<SseEvent>) -> SseStream {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) });
    Sse::new(Box::pin(stream) as futures_util::stream::BoxStream<'static, _>).keep_alive(KeepAlive::default())
}

/// The end of a stream: the chunk that carries `finish_reason`, the usage chunk when asked for, then `[DONE]`
/// (stops early when the client is gone).
async fn end_stream<T: serde::Serialize>(tx: &mpsc::Sender<SseEvent>, finish: T, usage: Option<T>) {
    if tx.send(sse_json(&finish)).await.is_err() {
        return;
    }
    if let Some(usage) = usage
        && tx.send(sse_json(&usage)).await.is_err()
    {
        return;
    }
    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
}

/// A stream whose request failed in the engine: an OpenAI error object, then `[DONE]`.
async fn fail_stream(tx: &mpsc::Sender<SseEvent>, why: String) {
    let _ = tx.send(sse_json(&ApiError::internal(why).body())).await;
    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
}

// ---------------------------------------------------------------------------------------------------------------
// /v1/chat/completions

async fn chat_completions(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match chat_inner(state.clone(), body).await {
        Ok(r) => r,
        Err(e) => {
            let counter = if e.status.is_client_error() {
                &state.metrics.requests_client_error
            } else {
                &state.metrics.requests_server_error
            };
            Metrics::add(counter, 1);
            e.into_response()
        }
    }
}

async fn chat_inner(state: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    check_model(&state, req.common.model.as_deref())?;
    check_ready(&state)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages must contain at least one message", Some("messages")));
    }
    let logprobs = if req.logprobs.unwrap_or(false) {
        Some(top_logprobs("top_logprobs", req.top_logprobs)?)
    } else if req.top_logprobs.is_some_and(|k| k > 0) {
        return Err(ApiError::invalid("top_logprobs requires logprobs: true", Some("top_logprobs")));
    } else {
        None
    };
    let params = req.common.validate(logprobs, state.vocab_size)?;
    if let Some(format) = &req.response_format
        && format.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(ApiError::invalid(
            "response_format other than {\"type\": \"text\"} is not supported (no constrained decoding yet)",
            Some("response_format"),
        ));
    }
    let tool_choice = match &req.tool_choice {
        None => "auto",
        Some(Value::String(s)) if s == "auto" || s == "none" => s.as_str(),
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice must be \"auto\" or \"none\": forcing a tool (\"required\" or a named function) needs \
                 constrained decoding, which this server does not do yet",
                Some("tool_choice"),
            ));
        }
    };
    let tools = req.tools.as_deref().filter(|t| !t.is_empty() && tool_choice != "none");
    let Some(template) = &state.template else {
        return Err(ApiError::invalid("this model has no chat template; use /v1/completions", Some("messages")));
    };
    let kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    let thinking = kwargs.get("thinking").or_else(|| kwargs.get("enable_thinking")).and_then(Value::as_bool);
    let options = RenderOptions { thinking, extra: kwargs };
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(!req.continue_final_message);
    let rendered = template
        .render(&req.messages, tools, add_generation_prompt, &options)
        .map_err(|e| ApiError::invalid(format!("the chat template rejected the messages: {e}"), Some("messages")))?;
    let prompt = state
        .tokenizer
        .encode(&rendered, true)
        .map_err(|e| ApiError::invalid(format!("could not tokenize the prompt: {e}"), Some("messages")))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt renders to no tokens", Some("messages")));
    }
    let max_tokens = completion_budget(&state, prompt.len(), params.max_tokens)?;
    let starts_in_reasoning = rendered.trim_end().ends_with("<think>");
    let parser =
        OutputParser::new(state.tokenizer.clone(), starts_in_reasoning, true, tools.is_some(), params.stop.clone());
    let flight = submit(&state, prompt, engine_params(&state, &params, max_tokens)?)?;
    let id = format!("chatcmpl-{}", uuid_like());
    if params.stream {
        Ok(stream_chat(state, flight, parser, params, id).into_response())
    } else {
        collect_chat(state, flight, parser, params, id).await
    }
}

async fn collect_chat(
    state: Shared,
    mut flight: InFlight,
    mut parser: OutputParser,
    params: GenerationParams,
    id: String,
) -> Result<Response, ApiError> {
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut logprobs = params.logprobs.map(|_| ChatLogprobs::default());
    let mut add = |d: Delta| {
        content.push_str(&d.content);
        reasoning.push_str(&d.reasoning);
    };
    loop {
        match flight.events.recv().await {
            Some(Event::Token { id: tok, logprobs: lp }) => {
                if let (Some(all), Some(lp)) = (&mut logprobs, &lp) {
                    all.content.push(chat_logprob(&state.tokenizer, tok, lp));
                }
                add(parser.push(tok));
                if parser.stopped() {
                    flight.guard.cancel.store(true, Ordering::SeqCst);
                }
            }
            Some(Event::Finished { reason, prompt_tokens, completion_tokens, cached_tokens }) => {
                add(parser.finish());
                let tool_calls = parser.tool_calls().to_vec();
                let finish = finish_reason(reason, parser.stopped(), !tool_calls.is_empty());
                let body = ChatResponse {
                    id,
                    object: "chat.completion",
                    created: now_secs(),
                    model: state.served_model.clone(),
                    choices: vec![ChatChoice {
                        index: 0,
                        message: ResponseMessage {
                            role: "assistant",
                            content: (!content.is_empty() || tool_calls.is_empty()).then_some(content),
                            reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
                            tool_calls,
                        },
                        logprobs,
                        finish_reason: Some(finish),
                    }],
                    usage: Usage::new(prompt_tokens, completion_tokens, cached_tokens),
                };
                return Ok(axum::Json(body).into_response());
            }
            Some(Event::Failed(why)) => return Err(ApiError::internal(why)),
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    }
}

fn stream_chat(
    state: Shared,
    mut flight: InFlight,
    mut parser: OutputParser,
    params: GenerationParams,
    id: String,
) -> SseStream {
    let (tx, rx) = mpsc::channel::<SseEvent>(SSE_BUFFER);
    tokio::spawn(async move {
        let created = now_secs();
        let model = state.served_model.clone();
        let chunk = |delta: ChatDelta, logprobs: Option<ChatLogprobs>, finish: Option<&'static str>| ChatChunk {
            id: id.clone(),
            object: "chat.completion.chunk",
            created,
            model: model.clone(),
            choices: vec![ChatChunkChoice { index: 0, delta, logprobs, finish_reason: finish }],
            usage: None,
        };
        let to_delta = |d: Delta| ChatDelta {
            role: None,
            content: (!d.content.is_empty()).then_some(d.content),
            reasoning_content: (!d.reasoning.is_empty()).then_some(d.reasoning),
            tool_calls: d.tool_calls,
        };
        let first = ChatDelta { role: Some("assistant"), content: Some(String::new()), ..Default::default() };
        if tx.send(sse_json(&chunk(first, None, None))).await.is_err() {
            return;
        }
        loop {
            let event = flight.events.recv().await;
            let sent = match event {
                Some(Event::Token { id: tok, logprobs: lp }) => {
                    let d = parser.push(tok);
                    if parser.stopped() {
                        flight.guard.cancel.store(true, Ordering::SeqCst);
                    }
                    let lp = lp
                        .filter(|_| params.logprobs.is_some())
                        .map(|lp| ChatLogprobs { content: vec![chat_logprob(&state.tokenizer, tok, &lp)] });
                    if d.is_empty() && lp.is_none() {
                        continue;
                    }
                    tx.send(sse_json(&chunk(to_delta(d), lp, None))).await
                }
                Some(Event::Finished { reason, prompt_tokens, completion_tokens, cached_tokens }) => {
                    let d = parser.finish();
                    if !d.is_empty() && tx.send(sse_json(&chunk(to_delta(d), None, None))).await.is_err() {
                        return;
                    }
                    let finish = finish_reason(reason, parser.stopped(), !parser.tool_calls().is_empty());
                    let usage = params.include_usage.then(|| {
                        let mut last = chunk(ChatDelta::default(), None, None);
                        last.choices.clear();
                        last.usage = Some(Usage::new(prompt_tokens, completion_tokens, cached_tokens));
                        last
                    });
                    return end_stream(&tx, chunk(ChatDelta::default(), None, Some(finish)), usage).await;
                }
                Some(Event::Failed(why)) => return fail_stream(&tx, why).await,
                None => return,
            };
            if sent.is_err() {
                return; // client gone: dropping `flight` cancels the request
            }
        }
    });
    sse_from_channel(rx)
}

// ---------------------------------------------------------------------------------------------------------------
// /v1/completions

async fn completions(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match completions_inner(state.clone(), body).await {
        Ok(r) => r,
        Err(e) => {
            let counter = if e.status.is_client_error() {
                &state.metrics.requests_client_error
            } else {
                &state.metrics.requests_server_error
            };
            Metrics::add(counter, 1);
            e.into_response()
        }
    }
}

async fn completions_inner(state: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    check_model(&state, req.common.model.as_deref())?;
    check_ready(&state)?;
    if req.echo {
        return Err(ApiError::invalid("echo is not supported", Some("echo")));
    }
    if req.suffix.is_some() {
        return Err(ApiError::invalid("suffix is not supported", Some("suffix")));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid("best_of other than 1 is not supported", Some("best_of")));
    }
    let logprobs = req.logprobs.map(|k| top_logprobs("logprobs", Some(k))).transpose()?;
    let params = req.common.validate(logprobs, state.vocab_size)?;
    let one_prompt = "one prompt per request: send a string or one list of token ids";
    let prompt = match &req.prompt {
        Prompt::Text(t) => state.tokenizer.encode(t, false),
        Prompt::Texts(v) if v.len() == 1 => state.tokenizer.encode(&v[0], false),
        Prompt::Tokens(ids) => Ok(token_ids("prompt", ids, state.vocab_size)?),
        Prompt::TokenLists(v) if v.len() == 1 => Ok(token_ids("prompt", &v[0], state.vocab_size)?),
        _ => return Err(ApiError::invalid(one_prompt, Some("prompt"))),
    }
    .map_err(|e| ApiError::invalid(format!("could not tokenize the prompt: {e}"), Some("prompt")))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    let max_tokens =
        completion_budget(&state, prompt.len(), Some(params.max_tokens.unwrap_or(16))).map_err(|mut e| {
            e.param = Some(if params.max_tokens.is_some() { "max_tokens" } else { "prompt" }.into());
            e
        })?;
    let parser = OutputParser::new(state.tokenizer.clone(), false, false, false, params.stop.clone());
    let flight = submit(&state, prompt, engine_params(&state, &params, max_tokens)?)?;
    let id = format!("cmpl-{}", uuid_like());
    if params.stream {
        Ok(stream_completion(state, flight, parser, params, id).into_response())
    } else {
        collect_completion(state, flight, parser, params, id).await
    }
}

fn completion_logprob_entry(
    state: &AppState,
    tok: u32,
    lp: &TokenLogprobs,
    offset: usize,
    out: &mut CompletionLogprobs,
) {
    let (token, _) = token_text(&state.tokenizer, tok);
    out.tokens.push(token);
    out.token_logprobs.push(lp.logprob);
    let mut top = serde_json::Map::new();
    for &(t, l) in &lp.top {
        top.insert(token_text(&state.tokenizer, t).0, json!(l));
    }
    out.top_logprobs.push(top);
    out.text_offset.push(offset);
}

async fn collect_completion(
    state: Shared,
    mut flight: InFlight,
    mut parser: OutputParser,
    params: GenerationParams,
    id: String,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut logprobs = params.logprobs.map(|_| CompletionLogprobs::default());
    loop {
        match flight.events.recv().await {
            Some(Event::Token { id: tok, logprobs: lp }) => {
                if let (Some(all), Some(lp)) = (&mut logprobs, &lp) {
                    completion_logprob_entry(&state, tok, lp, text.len(), all);
                }
                text.push_str(&parser.push(tok).content);
                if parser.stopped() {
                    flight.guard.cancel.store(true, Ordering::SeqCst);
                }
            }
            Some(Event::Finished { reason, prompt_tokens, completion_tokens, cached_tokens }) => {
                text.push_str(&parser.finish().content);
                let body = CompletionResponse {
                    id,
                    object: "text_completion",
                    created: now_secs(),
                    model: state.served_model.clone(),
                    choices: vec![CompletionChoice {
                        index: 0,
                        text,
                        logprobs,
                        finish_reason: Some(finish_reason(reason, parser.stopped(), false)),
                    }],
                    usage: Some(Usage::new(prompt_tokens, completion_tokens, cached_tokens)),
                };
                return Ok(axum::Json(body).into_response());
            }
            Some(Event::Failed(why)) => return Err(ApiError::internal(why)),
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    }
}

fn stream_completion(
    state: Shared,
    mut flight: InFlight,
    mut parser: OutputParser,
    params: GenerationParams,
    id: String,
) -> SseStream {
    let (tx, rx) = mpsc::channel::<SseEvent>(SSE_BUFFER);
    tokio::spawn(async move {
        let created = now_secs();
        let chunk =
            |text: String, logprobs: Option<CompletionLogprobs>, finish: Option<&'static str>| CompletionResponse {
                id: id.clone(),
                object: "text_completion",
                created,
                model: state.served_model.clone(),
                choices: vec![CompletionChoice { index: 0, text, logprobs, finish_reason: finish }],
                usage: None,
            };
        let mut offset = 0;
        loop {
            let sent = match flight.events.recv().await {
                Some(Event::Token { id: tok, logprobs: lp }) => {
                    let text = parser.push(tok).content;
                    if parser.stopped() {
                        flight.guard.cancel.store(true, Ordering::SeqCst);
                    }
                    let lp = lp.filter(|_| params.logprobs.is_some()).map(|lp| {
                        let mut one = CompletionLogprobs::default();
                        completion_logprob_entry(&state, tok, &lp, offset, &mut one);
                        one
                    });
                    offset += text.len();
                    if text.is_empty() && lp.is_none() {
                        continue;
                    }
                    tx.send(sse_json(&chunk(text, lp, None))).await
                }
                Some(Event::Finished { reason, prompt_tokens, completion_tokens, cached_tokens }) => {
                    let text = parser.finish().content;
                    let finish = finish_reason(reason, parser.stopped(), false);
                    let usage = params.include_usage.then(|| {
                        let mut last = chunk(String::new(), None, None);
                        last.choices.clear();
                        last.usage = Some(Usage::new(prompt_tokens, completion_tokens, cached_tokens));
                        last
                    });
                    return end_stream(&tx, chunk(text, None, Some(finish)), usage).await;
                }
                Some(Event::Failed(why)) => return fail_stream(&tx, why).await,
                None => return,
            };
            if sent.is_err() {
                return;
            }
        }
    });
    sse_from_channel(rx)
}

/// A random 24-hex-digit id (request ids need uniqueness, not cryptographic strength).
fn uuid_like() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(COUNTER.fetch_add(1, Ordering::Relaxed));
    format!("{:016x}{:08x}", h.finish(), COUNTER.load(Ordering::Relaxed))
}
