//! Extractors that hand the handler the fence and the lease view the layers put on the request.

use std::convert::Infallible;
use std::fmt;

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, Response};
use bytes::Bytes;
use http::StatusCode;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::request::Parts;
use lock_core::LeaseInfo;

/// What a layer puts into the request extensions once it holds the lease.
#[derive(Clone, Debug)]
pub(crate) struct Held {
    pub(crate) fence: lock_core::Fence,
    pub(crate) info: LeaseInfo,
}

/// The fence of the lease that [`LockLayer`](crate::LockLayer) or
/// [`DedupeLayer`](crate::DedupeLayer) took for this request, as an axum extractor.
///
/// Pass it on to the resource you write to, so the resource can refuse writes from an older
/// grant (see [`lock_core::FenceGate`]). Use `Option<Fence>` on handlers that may run without a
/// layer; a plain `Fence` on a route without one is answered with
/// [`MissingLease`] (500), as axum's `Extension` does for a missing extension.
///
/// ```
/// use axum::{Router, routing::post};
/// use lock_tower::{Fence, KeyExtractor, LockLayer};
///
/// async fn withdraw(Fence(fence): Fence) -> String {
///     format!("withdrawn under fence {fence}")
/// }
///
/// let locker = lock_core::Locker::memory();
/// let app: Router = Router::new()
///     .route("/accounts/{id}/withdraw", post(withdraw))
///     .route_layer(LockLayer::new(locker, KeyExtractor::route_param("id")));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence(pub lock_core::Fence);

/// A view of the lease held for this request (key, fence, time left, lost signal), as an axum
/// extractor. Missing layer: [`MissingLease`] (500); `Option<HeldLease>` never rejects.
#[derive(Clone, Debug)]
pub struct HeldLease(pub LeaseInfo);

/// The rejection of [`Fence`] and [`HeldLease`] on a route without a lock layer: a server
/// misconfiguration, so 500.
#[derive(Debug)]
pub struct MissingLease {
    extractor: &'static str,
}

impl fmt::Display for MissingLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the `{}` extractor was used on a route without LockLayer or DedupeLayer",
            self.extractor
        )
    }
}

impl std::error::Error for MissingLease {}

impl IntoResponse for MissingLease {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "type": "urn:leasehold:problem:missing-lease",
            "title": "Missing lease",
            "status": 500,
            "detail": self.to_string(),
        });
        tracing::error!(extractor = self.extractor, "{self}");
        let mut res = Response::new(axum_core::body::Body::from(Bytes::from(body.to_string())));
        *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        res
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Fence {
    type Rejection = MissingLease;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Held>()
            .map(|h| Fence(h.fence))
            .ok_or(MissingLease { extractor: "Fence" })
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for Fence {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Held>().map(|h| Fence(h.fence)))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HeldLease {
    type Rejection = MissingLease;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Held>()
            .map(|h| HeldLease(h.info.clone()))
            .ok_or(MissingLease {
                extractor: "HeldLease",
            })
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for HeldLease {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<Held>()
            .map(|h| HeldLease(h.info.clone())))
    }
}

impl Fence {
    /// The fence from a request's extensions, for non-axum Tower services.
    pub fn from_extensions(ext: &http::Extensions) -> Option<Fence> {
        ext.get::<Held>().map(|h| Fence(h.fence))
    }
}
