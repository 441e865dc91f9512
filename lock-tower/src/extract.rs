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

/// The one extension both layers write, so that stacked layers agree on the lease a handler
/// sees: a `LockLayer`'s decision (its lease, or none) stands over a `DedupeLayer`'s claim,
/// whichever layer is outside. The claim guards a delivery id, not the resource the lock
/// names; its fence, handed to that resource's gate, would outrank the lock holders' own.
#[derive(Clone, Debug)]
enum Slot {
    /// A `LockLayer` holds a lease for the request.
    Lock(Held),
    /// A `LockLayer` let the request through without one (a method it skips, no key under
    /// `pass_through_without_key`): the handler runs unlocked.
    Unlocked,
    /// A `DedupeLayer`'s claim, where no `LockLayer` decided.
    Claim(Held),
}

/// A `LockLayer` holds `held` for the request: it is the handler's, over anything outside.
pub(crate) fn lock_held(ext: &mut http::Extensions, held: Held) {
    ext.insert(Slot::Lock(held));
}

/// A `LockLayer` let the request through without a lease. An outer `LockLayer`'s lease still
/// holds and stays the handler's; an outer `DedupeLayer`'s claim is no lock, and goes.
pub(crate) fn lock_passed(ext: &mut http::Extensions) {
    if !matches!(ext.get::<Slot>(), Some(Slot::Lock(_))) {
        ext.insert(Slot::Unlocked);
    }
}

/// A `DedupeLayer` claimed the request's delivery: the handler's lease unless a `LockLayer`
/// outside already decided.
pub(crate) fn claim_held(ext: &mut http::Extensions, held: Held) {
    if matches!(ext.get::<Slot>(), None | Some(Slot::Claim(_))) {
        ext.insert(Slot::Claim(held));
    }
}

fn held(ext: &http::Extensions) -> Option<&Held> {
    match ext.get::<Slot>()? {
        Slot::Lock(h) | Slot::Claim(h) => Some(h),
        Slot::Unlocked => None,
    }
}

/// The fence of the lease that [`LockLayer`](crate::LockLayer) or
/// [`DedupeLayer`](crate::DedupeLayer) took for this request, as an axum extractor.
///
/// Pass it on to the resource you write to, so the resource can refuse writes from an older
/// grant (see [`lock_core::FenceGate`]). Use `Option<Fence>` on handlers that may run without a
/// layer; a plain `Fence` on a route without one is answered with
/// [`MissingLease`] (500), as axum's `Extension` does for a missing extension.
///
/// Where both layers run on a request, in either order, the `LockLayer` decides: its lease's
/// fence, or none when it let the request through without one (a method it skips, no key
/// under `pass_through_without_key`). A `DedupeLayer`'s claim guards a delivery id, not the
/// resource the lock names, and never stands in for the lock. Of two `LockLayer`s the inner
/// one's lease is the handler's, and an outer one's stays when the inner lets the request by.
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
///
/// ```
/// use axum::{Router, body::Body, routing::post};
/// use lock_tower::{HeldLease, KeyExtractor, LockLayer};
/// use tower_service::Service;
///
/// async fn export(HeldLease(lease): HeldLease) -> String {
///     // A long job checks `lease.is_lost()` between steps and stops once it is.
///     assert!(!lease.is_lost());
///     format!("exported under {}", lease.key())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::route_param("id"))
///     .key_prefix("export:");
/// let mut app: Router = Router::new().route("/exports/{id}", post(export)).route_layer(layer);
///
/// let res = app.call(http::Request::post("/exports/7").body(Body::empty())?).await?;
/// assert_eq!(axum::body::to_bytes(res.into_body(), 1024).await?, "exported under export:7");
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct HeldLease(pub LeaseInfo);

/// The rejection of [`Fence`] and [`HeldLease`] on a route without a lock layer: a server
/// misconfiguration, so 500.
///
/// ```
/// use axum::{Router, body::Body, routing::post};
/// use lock_tower::Fence;
/// use tower_service::Service;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// // Neither route has a lock layer.
/// let mut app: Router = Router::new()
///     .route("/strict", post(|Fence(f): Fence| async move { f.to_string() }))
///     .route("/lenient", post(|f: Option<Fence>| async move { format!("{f:?}") }));
///
/// let res = app.call(http::Request::post("/strict").body(Body::empty())?).await?;
/// assert_eq!(res.status(), 500);
/// assert_eq!(res.headers()["content-type"], "application/problem+json");
/// let res = app.call(http::Request::post("/lenient").body(Body::empty())?).await?;
/// assert_eq!(axum::body::to_bytes(res.into_body(), 1024).await?, "None");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct MissingLease {
    extractor: &'static str,
}

impl fmt::Display for MissingLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the `{}` extractor found no lease: the route has no LockLayer or DedupeLayer, or \
             the layer let this request through without one (a method it skips, or no key \
             under `pass_through_without_key`); use `Option<_>` where that is expected",
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
        held(&parts.extensions)
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
        Ok(held(&parts.extensions).map(|h| Fence(h.fence)))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HeldLease {
    type Rejection = MissingLease;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        held(&parts.extensions)
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
        Ok(held(&parts.extensions).map(|h| HeldLease(h.info.clone())))
    }
}

impl Fence {
    /// The fence from a request's extensions, for non-axum Tower services.
    ///
    /// ```
    /// use axum::{Router, body::Body, extract::Request, routing::post};
    /// use lock_tower::{Fence, KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// // Any code holding the request (a plain Tower service, a middleware inside the
    /// // layer) finds the fence this way.
    /// async fn withdraw(req: Request) -> String {
    ///     let fence = Fence::from_extensions(req.extensions()).expect("under a LockLayer");
    ///     fence.0.to_string()
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::path_segment(1));
    /// let mut app: Router = Router::new().route("/accounts/{id}", post(withdraw)).layer(layer);
    /// let mut fences = Vec::new();
    /// for _ in 0..2 {
    ///     let res = app.call(http::Request::post("/accounts/7").body(Body::empty())?).await?;
    ///     let body = axum::body::to_bytes(res.into_body(), 64).await?;
    ///     fences.push(std::str::from_utf8(&body)?.parse::<u64>()?);
    /// }
    /// // Each grant of the key has a newer fence.
    /// assert!(fences[1] > fences[0]);
    /// # Ok(()) }
    /// ```
    pub fn from_extensions(ext: &http::Extensions) -> Option<Fence> {
        held(ext).map(|h| Fence(h.fence))
    }
}

impl HeldLease {
    /// The lease's information (key, fence, time left, loss) from a request's extensions, for
    /// non-axum Tower services, as [`Fence::from_extensions`] gives the fence.
    ///
    /// ```
    /// use axum::{Router, body::Body, extract::Request, routing::post};
    /// use lock_tower::{HeldLease, KeyExtractor, LockLayer};
    /// use tower_service::Service;
    ///
    /// async fn export(req: Request) -> String {
    ///     let HeldLease(lease) = HeldLease::from_extensions(req.extensions()).expect("under a LockLayer");
    ///     format!("{} with {} s left", lease.key(), lease.remaining().as_secs())
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lock_tower::BoxError> {
    /// let layer = LockLayer::new(lock_core::Locker::memory(), KeyExtractor::path_segment(1));
    /// let mut app: Router = Router::new().route("/exports/{id}", post(export)).layer(layer);
    /// let res = app.call(http::Request::post("/exports/7").body(Body::empty())?).await?;
    /// let body = axum::body::to_bytes(res.into_body(), 64).await?;
    /// assert!(body.starts_with(b"7 with "), "{body:?}");
    /// // Without the layer there is none.
    /// assert!(HeldLease::from_extensions(&http::Extensions::new()).is_none());
    /// # Ok(()) }
    /// ```
    pub fn from_extensions(ext: &http::Extensions) -> Option<HeldLease> {
        held(ext).map(|h| HeldLease(h.info.clone()))
    }
}
