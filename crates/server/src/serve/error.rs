//! API errors in OpenAI's body format, `{"error": {"message", "type", "param", "code"}}`, with the status OpenAI
//! (and vLLM/SGLang) use: 400 bad parameter or prompt too long, 401 bad key, 404 unknown model or route, 413 body
//! too large, 429/503 when full or not ready. Internal causes are logged to stderr, not sent.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The offending request field, when one is to blame.
    pub param: Option<String>,
    /// OpenAI's `code` (e.g. `model_not_found`, `context_length_exceeded`).
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), param: None, code: None }
    }

    /// 400 `invalid_request_error`, naming the parameter.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self { param: param.map(str::to_owned), ..Self::new(StatusCode::BAD_REQUEST, message) }
    }

    /// 400 with `code: context_length_exceeded`.
    pub fn context_length(message: impl Into<String>, param: &str) -> Self {
        Self { code: Some("context_length_exceeded"), ..Self::invalid(message, Some(param)) }
    }

    /// 401.
    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "Incorrect API key provided (send `Authorization: Bearer KEY`)")
        }
    }

    /// 404 for a model name the server does not serve.
    pub fn unknown_model(name: &str, served: &str) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                format!("The model `{name}` does not exist; this server serves `{served}`"),
            )
        }
    }

    /// 404 for an unknown route.
    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("no route for {path}"))
    }

    /// 503: not ready yet, shutting down, or the queue is full.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// 500 with a generic message; the cause goes to the log.
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        eprintln!("eyrie: internal error: {cause}");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal server error (logged)")
    }

    /// Any status with a message (body extraction failures keep their status, e.g. 413).
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, message)
    }

    /// OpenAI's `type` for the status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            500..=599 if self.status != StatusCode::SERVICE_UNAVAILABLE => "internal_server_error",
            503 => "service_unavailable_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": self.code}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
