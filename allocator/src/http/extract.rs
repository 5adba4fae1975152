//! Extractors whose rejections are the allocator's [`Error`], so malformed
//! JSON is a 400, a wrong type or value a 422 naming the field, and an
//! oversized body a 413, all in the documented JSON shape.

use crate::error::Error;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

/// `Json<T>` with the allocator's rejections.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = Error;

    async fn from_request(req: Request, state: &S) -> Result<Self, Error> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(ApiJson(v)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

/// A body already read as JSON (by [`ApiJson`]) as `T`, with the same
/// rejections as `ApiJson<T>`: a route with two body forms reads the
/// value, picks the form, and still names the field at fault.
pub fn parse_json<T: DeserializeOwned>(value: &serde_json::Value) -> Result<T, Error> {
    let bytes = serde_json::to_vec(value).map_err(|e| Error::MalformedJson(e.to_string()))?;
    axum::Json::<T>::from_bytes(&bytes).map(|axum::Json(v)| v).map_err(json_rejection)
}

/// An optional JSON body: none (or only white space) is `None`; anything
/// else must be a `T`, with the same rejections as `ApiJson<T>`.
pub fn parse_optional_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<Option<T>, Error> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    axum::Json::<T>::from_bytes(bytes).map(|axum::Json(v)| Some(v)).map_err(json_rejection)
}

fn json_rejection(r: JsonRejection) -> Error {
    match r {
        JsonRejection::JsonDataError(e) => {
            // axum's message carries serde_path_to_error's path: "want: invalid type ...".
            let text = e.body_text();
            let detail = text
                .strip_prefix("Failed to deserialize the JSON body into the target type: ")
                .unwrap_or(&text);
            let field = detail.split(':').next().filter(|f| !f.contains(' ')).unwrap_or("body");
            Error::invalid(field, detail.to_string())
        }
        JsonRejection::JsonSyntaxError(e) => Error::MalformedJson(e.body_text()),
        JsonRejection::MissingJsonContentType(e) => Error::UnsupportedMediaType(e.body_text()),
        other if other.status() == StatusCode::PAYLOAD_TOO_LARGE => Error::PayloadTooLarge,
        other => Error::MalformedJson(other.body_text()),
    }
}

/// `Path<T>` with the allocator's rejections.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Error> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(ApiPath(v)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                Err(Error::invalid("path", e.body_text()))
            }
            Err(e) => Err(Error::invalid("path", e.body_text())),
        }
    }
}

/// `Query<T>` with the allocator's rejections.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Error> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(ApiQuery(v)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => {
                Err(Error::invalid("query", e.body_text()))
            }
            Err(e) => Err(Error::invalid("query", e.body_text())),
        }
    }
}

/// Validates an identifier field against DESIGN §5's regex.
pub fn check_id(field: &str, value: &str) -> Result<(), Error> {
    quota_shared::ids::validate_id(value).map_err(|e| Error::invalid(field, format!("{value:?} {e}")))
}

/// The largest count accepted anywhere (tokens, wants, reports): far above any
/// real quota and far below where sums could overflow an `i64`.
pub const MAX_COUNT: i64 = 1_000_000_000_000;

/// Validates a count in `[min, MAX_COUNT]`.
pub fn check_count(field: &str, value: i64, min: i64) -> Result<(), Error> {
    if value < min {
        return Err(Error::invalid(field, format!("must be at least {min}, got {value}")));
    }
    if value > MAX_COUNT {
        return Err(Error::invalid(field, format!("must be at most {MAX_COUNT}, got {value}")));
    }
    Ok(())
}
