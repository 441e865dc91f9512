//! The response future both layers return: the acquire, the handler and the store all run here,
//! never in `poll_ready`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use crate::body::LockBody;

type Inner<B, E> = Pin<Box<dyn Future<Output = Result<Response<LockBody<B>>, E>> + Send>>;

/// The response future of [`Lock`](crate::lock::Lock) and [`Dedupe`](crate::dedupe::Dedupe).
///
/// It is boxed: it awaits the lock backend, then the inner service, and (for dedupe) the result
/// store, and one allocation per request is cheap beside those round trips.
///
/// ```
/// use axum::{body::Body, handler::HandlerWithoutStateExt};
/// use lock_core::{LockOptions, Locker};
/// use lock_tower::{KeyExtractor, LockLayer, ResponseFuture};
/// use tower_layer::Layer;
/// use tower_service::Service;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// let locker = Locker::memory();
/// let mut svc = LockLayer::new(locker.clone(), KeyExtractor::path_segment(1))
///     .layer((|| async { "withdrawn" }).into_service());
/// let req = http::Request::post("/accounts/7").body(Body::empty())?;
/// let future: ResponseFuture<Body, _> = svc.call(req);
///
/// // `call` took no lease: the future does, when it runs, and here someone got there first.
/// let _held = locker.try_acquire("7", &LockOptions::new()).await?;
/// assert_eq!(future.await?.status(), 409);
/// # Ok(()) }
/// ```
pub struct ResponseFuture<B, E> {
    inner: Inner<B, E>,
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new(
        f: impl Future<Output = Result<Response<LockBody<B>>, E>> + Send + 'static,
    ) -> Self {
        ResponseFuture { inner: Box::pin(f) }
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<LockBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
