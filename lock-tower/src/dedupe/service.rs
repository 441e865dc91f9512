use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full};
use lock_core::{AnyBackend, Lease};
use sha2::{Digest, Sha256};
use tower_service::Service;
use tracing::Instrument;

use super::layer::DedupeConfig;
use super::store::{Record, Store, StoreError};
use crate::body::{BoxError, LeaseLostWhileStreaming, LockBody};
use crate::extract::{Held, claim_held};
use crate::future::ResponseFuture;
use crate::key::KeyProblem;
use crate::lock::service::{declared_len, refuse, release};
use crate::reject::Reason;
use crate::util::{
    MethodFilter, ReplyBody, RequestBody, empty_methods, no_room_for_key, read_capped, reject,
};

/// Marks a response that is a replay of a stored result.
pub(crate) const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Marks a replay whose body was above the stored-body cap and was not kept.
pub(crate) const BODY_OMITTED: HeaderName = HeaderName::from_static("idempotent-body-omitted");

/// The service [`DedupeLayer`](super::DedupeLayer) wraps around an inner service.
///
/// Without axum's router, wrap any Tower service (here an axum handler made one):
///
/// ```
/// use axum::{body::Body, handler::HandlerWithoutStateExt};
/// use lock_tower::{DedupeLayer, dedupe::Dedupe};
/// use tower_layer::Layer;
/// use tower_service::Service;
///
/// async fn create_order() -> &'static str {
///     "created"
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lock_tower::BoxError> {
/// let layer = DedupeLayer::new(lock_core::Locker::memory());
/// let mut svc: Dedupe<_> = layer.layer(create_order.into_service());
/// for replayed in [false, true] {
///     let req = http::Request::post("/orders").header("idempotency-key", r#""o-1""#);
///     let res = svc.call(req.body(Body::empty())?).await?;
///     assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Dedupe<S> {
    pub(crate) inner: S,
    pub(crate) cfg: Arc<DedupeConfig>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Dedupe<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + Unpin + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<LockBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cfg = self.cfg.clone();
        let span = tracing::debug_span!(
            "dedupe_layer",
            id = tracing::field::Empty,
            fence = tracing::field::Empty
        );
        ResponseFuture::new(run(cfg, inner, req).instrument(span))
    }
}

fn hex(digest: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(digest.len() * 2);
    for b in digest {
        s.push(HEX[usize::from(b >> 4)] as char);
        s.push(HEX[usize::from(b & 0xf)] as char);
    }
    s
}

/// A 500 for settings under which no delivery can be deduplicated: its result could not be
/// stored (retention out of range, a backend with no result store) or its claim not taken (a
/// claim TTL out of range). A setup problem no retry can cure: a 503 with `Retry-After` would
/// have every sender retry for ever, and running the handler undeduplicated would break the
/// layer's promise.
fn settings_problem<B>(cfg: &DedupeConfig) -> Option<Response<LockBody<B>>> {
    let rejections = &cfg.rejections;
    let ttl = cfg.claim.ttl_value();
    let (problem, detail) = if cfg.retention < super::layer::MIN_RETENTION
        || cfg.retention > super::layer::MAX_RETENTION
    {
        (
            "the layer's settings are out of range",
            format!(
                "the retention {:?} is out of range (1 ms to a year)",
                cfg.retention
            ),
        )
    } else if !(lock_core::MIN_TTL..=lock_core::MAX_TTL).contains(&ttl) {
        (
            "the layer's settings are out of range",
            format!("the claim TTL {ttl:?} is out of range (10 ms to 24 h)"),
        )
    } else if matches!(cfg.store, Store::Unsupported) {
        (
            "the layer's backend cannot keep results",
            StoreError::Unsupported.to_string(),
        )
    } else {
        return None;
    };
    rejections.setup_logged.log(problem, &detail);
    Some(reject(rejections, Reason::Misconfigured, None, detail))
}

/// A request without a usable key: through without dedupe where the layer was told so, else
/// refused.
async fn unkeyed<S, ReqBody, ResBody>(
    cfg: &DedupeConfig,
    mut inner: S,
    req: Request<RequestBody<ReqBody>>,
    problem: KeyProblem,
) -> Result<Response<LockBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + Unpin + 'static,
{
    if problem.reason == Reason::MissingKey && cfg.pass_unkeyed {
        tracing::debug!(why = %problem.detail, "no key; passing through without dedupe");
        return Ok(inner.call(req).await?.map(LockBody::pass));
    }
    Ok(reject(
        &cfg.rejections,
        problem.refusal(&cfg.rejections),
        None,
        problem.detail,
    ))
}

/// The claims that the `DedupeLayer`s around a request hold for it, by lock key. A layer inside
/// one that holds the same claim (the same scope and key on the same locker, as a router-wide
/// layer and a route's own) lets the request by: taking the claim again, it would find it
/// taken and answer every delivery 409, which the outer layer does not store, for ever.
#[derive(Clone, Default)]
struct ClaimsHeld(Vec<String>);

/// SHA-256 of length-prefixed parts, so no two different part lists hash alike.
fn digest(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    hex(&h.finalize())
}

async fn run<S, ReqBody, ResBody>(
    cfg: Arc<DedupeConfig>,
    mut inner: S,
    req: Request<ReqBody>,
) -> Result<Response<LockBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + Unpin + 'static,
    ResBody::Error: Into<BoxError>,
{
    match cfg.method_filter(req.method()) {
        MethodFilter::Applies => {}
        MethodFilter::Skips => {
            let res = inner.call(req.map(Either::Left)).await?;
            return Ok(res.map(LockBody::pass));
        }
        MethodFilter::Empty => return Ok(empty_methods(&cfg.rejections)),
    }
    let rejections = &cfg.rejections;
    let (mut parts, body) = req.into_parts();
    if cfg.key.needs_body() && cfg.request_limit == 0 {
        return Ok(no_room_for_key(rejections));
    }
    // A key in the request's head is looked for before the body is read: the body is read only
    // for a keyed request's fingerprint, so a request without a key passes on with its body
    // untouched and unbounded (or is refused at once, without uploading it first).
    let mut head_key = None;
    if !cfg.key.needs_body() {
        match cfg.key.extract(&mut parts, None).await {
            Ok(k) => head_key = Some(k),
            Err(p) => {
                let req = Request::from_parts(parts, Either::Left(body));
                return unkeyed(&cfg, inner, req, p).await;
            }
        }
    }
    let bytes = match read_capped(body, cfg.request_limit).await {
        Ok(b) => b,
        Err((reason, detail)) => return Ok(reject(rejections, reason, None, detail)),
    };
    let key = match head_key {
        Some(k) => k,
        None => match cfg.key.extract(&mut parts, Some(&bytes)).await {
            Ok(k) => k,
            Err(p) => {
                let req = Request::from_parts(parts, Either::Right(Full::new(bytes)));
                return unkeyed(&cfg, inner, req, p).await;
            }
        },
    };
    // Only now, for a request the layer dedupes (an unkeyed one it passes on is none of its
    // business), and before any store look-up, so the answer does not depend on whether the
    // store is reachable.
    if let Some(res) = settings_problem(&cfg) {
        return Ok(res);
    }
    // Hashed, so a hostile key can neither collide with another scope's keys nor spell a
    // storage key of its choosing; the claims' own namespace (see `DedupeConfig::claims`) keeps
    // other lockers' keys away from them.
    let id = digest(&[cfg.scope.as_bytes(), key.as_bytes()]);
    let path = crate::key::full_uri(&parts)
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let fingerprint = digest(&[parts.method.as_str().as_bytes(), path.as_bytes(), &bytes]);
    tracing::Span::current().record("id", &id[..16]);

    let unavailable = |detail: String| {
        tracing::warn!(%detail, "dedupe store failed");
        reject(
            rejections,
            Reason::Unavailable,
            Some(Duration::from_secs(1)),
            "the dedupe store is unavailable",
        )
    };
    let store_failed = |e: StoreError| match e {
        // Replayed, it would answer something the handler never said; run again, it would
        // repeat a delivery already handled. Neither: refused until the record expires with
        // its retention, and said loudly, since only an operator can mend it.
        StoreError::Corrupt(detail) => {
            tracing::error!(%detail, "stored result unreadable");
            reject(
                rejections,
                Reason::Unavailable,
                None,
                "the stored result for this key is unreadable",
            )
        }
        e => unavailable(e.to_string()),
    };
    let lock_key = match cfg.claims.lock_key(&id) {
        Ok(k) => k.lock_key().to_owned(),
        Err(e) => return Ok(refuse(rejections, &e)),
    };
    // `{prefix:\x1Fdedupe:<id>}:lock` → `{prefix:\x1Fdedupe:<id>}:result`: one hash tag, one
    // slot.
    let result_key = format!(
        "{}:result",
        lock_key.strip_suffix(":lock").unwrap_or(&lock_key)
    );

    if (parts.extensions.get::<ClaimsHeld>()).is_some_and(|held| held.0.contains(&lock_key)) {
        tracing::debug!("a DedupeLayer outside this one holds the claim; passing through");
        let req = Request::from_parts(parts, Either::Right(Full::new(bytes)));
        return Ok(inner.call(req).await?.map(LockBody::pass));
    }
    match cfg.store.get(&result_key).await {
        Ok(Some(rec)) => return Ok(replay(&cfg, &rec, &fingerprint)),
        Ok(None) => {}
        Err(e) => return Ok(store_failed(e)),
    }
    let taken = if cfg.wait {
        cfg.claims.acquire(&id, &cfg.claim).await
    } else {
        cfg.claims.try_acquire(&id, &cfg.claim).await
    };
    let claim = match taken {
        Ok(l) => l,
        Err(e) => return Ok(refuse(rejections, &e)),
    };
    let in_process = matches!(cfg.claims.backend(), AnyBackend::Memory(_));
    // A first run may have stored its result and released between our look-up and our claim;
    // the claim orders us after it, so looking again now cannot miss it.
    match cfg.store.get(&result_key).await {
        Ok(Some(rec)) => {
            release(claim, in_process).await;
            return Ok(replay(&cfg, &rec, &fingerprint));
        }
        Ok(None) => {}
        Err(e) => {
            release(claim, in_process).await;
            return Ok(store_failed(e));
        }
    }
    tracing::Span::current().record("fence", claim.fence().0);
    let info = claim.info();
    claim_held(
        &mut parts.extensions,
        Held {
            fence: claim.fence(),
            info: info.clone(),
        },
    );
    // axum answers a HEAD request with the GET handler's head: the length of a body it then
    // drops, as a 304 names the length of one it never sends.
    let reply = ReplyBody::of(&parts.method);
    let mut held = parts.extensions.remove::<ClaimsHeld>().unwrap_or_default();
    held.0.push(lock_key.clone());
    parts.extensions.insert(held);
    let handler = inner.call(Request::from_parts(parts, Either::Right(Full::new(bytes))));
    let res = tokio::select! {
        biased;
        _ = info.lost() => {
            tracing::warn!("claim lost while the handler ran; handler cancelled, nothing stored");
            return Ok(reject(rejections, Reason::LeaseLost, None, "the claim on this delivery was lost before the handler finished; the handler was cancelled and nothing was stored"));
        }
        res = handler => res?,
    };
    let status = res.status();
    // A client error that says when to come back (a 409 with `Retry-After` from a `LockLayer`
    // inside this one, a rate limit, a 408 from a timeout layer inside) is as passing as a 5xx:
    // stored, it would be replayed for the whole retention and the delivery never handled.
    let transient = status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
        || (status.is_client_error() && res.headers().contains_key(http::header::RETRY_AFTER));
    if status.is_server_error() || transient {
        // Not an answer to keep: free the claim so the sender's retry runs the handler again.
        release(claim, in_process).await;
        return Ok(res.map(LockBody::pass));
    }
    // The handler's work is done. Reading its body, storing the result and releasing the claim
    // run in a task of their own: a client that hangs up now drops this future, and if that cut
    // the store short the sender's retry would run the handler a second time.
    let job = Completion {
        cfg: cfg.clone(),
        claim,
        lock_key,
        result_key,
        fingerprint,
        in_process,
        reply,
    };
    let (head, body) = res.into_parts();
    // Dropped with this future when the caller hangs up, which the task sees as its receiver
    // ending.
    let (_caller, hung_up) = tokio::sync::oneshot::channel::<()>();
    match tokio::spawn(job.run(head, body, hung_up).in_current_span()).await {
        Ok(res) => Ok(res),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only a runtime shutting down cancels the task; the claim expires with its TTL.
        Err(_) => Ok(unavailable("the runtime is shutting down".to_owned())),
    }
}

/// The channel a relay task hands the rest of a body on: frames, an error, or `None` for a
/// clean end.
type Relay = tokio::sync::mpsc::Sender<Option<Result<http_body::Frame<Bytes>, BoxError>>>;

/// What is left to do once the handler answered: store its result under the claim, then
/// release the claim.
struct Completion {
    cfg: Arc<DedupeConfig>,
    claim: Lease,
    lock_key: String,
    result_key: String,
    fingerprint: String,
    in_process: bool,
    /// What the request's method means for the body: none is to come after the head of a
    /// HEAD request, or of a 2xx to CONNECT, whatever length the head declares.
    reply: ReplyBody,
}

impl Completion {
    /// `hung_up` ends when the caller has gone: from then on the body is read for one claim
    /// TTL at most, as above the cap.
    async fn run<B>(
        self,
        head: http::response::Parts,
        mut body: B,
        mut hung_up: tokio::sync::oneshot::Receiver<()>,
    ) -> Response<LockBody<B>>
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError>,
    {
        let cfg = &self.cfg;
        let mut buf = BytesMut::new();
        // A first frame over the cap on its own, handed on as it came rather than copied.
        let mut whole = None;
        let mut overflow = false;
        // A body with a declared length ends at its last byte: the server stops polling it
        // there, so one that stays pending after it (a stream whose sender lingers) must not
        // hold up the answer, nor keep the claim for ever.
        // A status that carries no body (1xx, 204, 304) may still name the length of one
        // (a 304's `Content-Length` is the representation's), as may the answer to a HEAD
        // request: nothing is to come, and the server drops the body unpolled. A body of known
        // size is read to its end all the same (it is all here, and stored its size gives a
        // replayed HEAD the length); a stream is not read at all, since one that never ends
        // would hold the answer back for good.
        let declared = if !self.reply.omitted(head.status) {
            declared_len(&head, &body, None)
        } else if body.size_hint().exact().is_some() {
            None
        } else {
            Some(0)
        };
        // The body may still be doing the handler's work; a claim lost meanwhile lets a
        // duplicate run beside it, so the body is dropped rather than answered as handled.
        let info = self.claim.info();
        let mut lost = std::pin::pin!(info.lost());
        // A body that stalls or trickles below the cap (a heartbeat) after the caller left
        // would keep the claim renewed, and every retry of the delivery refused, until it
        // ended or reached the cap: days, at a few bytes a minute.
        let mut give_up: Option<tokio::time::Instant> = None;
        loop {
            if declared.is_some_and(|d| buf.len() as u64 >= d) {
                break;
            }
            let next = tokio::select! {
                biased;
                () = &mut lost => return self.lost_before_the_head(),
                _ = &mut hung_up, if give_up.is_none() => {
                    give_up = Some(tokio::time::Instant::now() + cfg.claim.ttl_value());
                    continue;
                }
                () = sleep_until_some(give_up) => return self.outlasted_its_caller().await,
                next = next_frame(&mut body) => next,
            };
            match next {
                None if declared.is_some_and(|d| (buf.len() as u64) < d) => {
                    return self.cut_short().await;
                }
                None => break,
                // Trailers are a body's last frame, whatever `is_end_stream` says after them
                // (servers send them and drop the body): an end like `None`.
                Some(Ok(frame)) if frame.is_trailers() => {
                    if declared.is_some_and(|d| (buf.len() as u64) < d) {
                        return self.cut_short().await;
                    }
                    break;
                }
                Some(Ok(frame)) => {
                    // Trailers are not stored or replayed; data frames are.
                    if let Ok(mut data) = frame.into_data() {
                        // The server sends no more than the declared length; neither is more
                        // stored.
                        if let Some(d) = declared {
                            data.truncate(usize::try_from(d).unwrap_or(usize::MAX) - buf.len());
                        }
                        if buf.is_empty() && data.len() > cfg.stored_limit {
                            whole = Some(data);
                            overflow = true;
                            break;
                        }
                        buf.extend_from_slice(&data);
                        if buf.len() > cfg.stored_limit {
                            overflow = true;
                            break;
                        }
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "response body failed; nothing stored");
                    release(self.claim, self.in_process).await;
                    return reject(
                        &cfg.rejections,
                        Reason::ResponseFailed,
                        None,
                        "the handler's response body failed; nothing was stored, so a retry \
                         runs the handler again",
                    );
                }
            }
        }
        let buf = whole.unwrap_or_else(|| buf.freeze());
        let rec = Record {
            fingerprint: self.fingerprint.clone(),
            status: head.status,
            headers: cfg
                .replay_headers
                .iter()
                .flat_map(|n| {
                    head.headers
                        .get_all(n)
                        .iter()
                        .map(|v| (n.clone(), v.clone()))
                })
                .collect(),
            body: if overflow { Bytes::new() } else { buf.clone() },
            body_omitted: overflow,
        };
        // Above the cap the rest streams to the caller, and only a body that ends well may be
        // recorded: one that fails later must leave nothing behind, or the sender's retry would
        // get a replayed success for work whose answer never arrived.
        let left = declared.map(|d| d.saturating_sub(buf.len() as u64));
        if left.is_some_and(|l| l > 0) && body.is_end_stream() {
            return self.cut_short().await;
        }
        // A body whose last byte is already here: the server would send the buffered bytes as
        // the whole response and drop the body unpolled, before a relay could record it. The
        // spent body is not polled again (it need not say it ended).
        if !overflow || left == Some(0) || body.is_end_stream() {
            self.finish(&rec).await;
            return Response::from_parts(head, LockBody::local(Full::new(buf)));
        }
        // A task reads the rest, so a caller hanging up mid-body does not stop the record from
        // being written once the body ends.
        let hint = body.size_hint();
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        // A caller who hung up while the body was read below the cap: the relay's TTL after
        // the hang-up counts from then, not from when it notices.
        tokio::spawn(self.relay(rec, body, tx, left, give_up).in_current_span());
        Response::from_parts(head, LockBody::relayed(buf, rx, hint))
    }

    /// The claim was lost while the body was read, before anything went to the caller: the
    /// body (dropped with the caller of this) is cut, nothing is stored, and the caller is told
    /// as when the claim is lost while the handler runs.
    fn lost_before_the_head<B>(self) -> Response<LockBody<B>> {
        tracing::warn!("claim lost while the response body was read; body dropped, nothing stored");
        reject(
            &self.cfg.rejections,
            Reason::LeaseLost,
            None,
            "the claim on this delivery was lost before the response was complete; the \
             response was dropped and nothing was stored",
        )
    }

    /// The caller hung up while the body was read below the cap, and a claim TTL later it has
    /// not ended: nothing is stored and the claim is freed, so the sender's retry runs the
    /// handler again. Nobody reads the answer.
    async fn outlasted_its_caller<B>(self) -> Response<LockBody<B>> {
        tracing::warn!(
            "response body still unfinished a claim TTL after the caller hung up; nothing \
             stored, claim released"
        );
        release(self.claim, self.in_process).await;
        reject(
            &self.cfg.rejections,
            Reason::ResponseFailed,
            None,
            "the handler's response body outlasted the caller by a claim TTL; nothing was \
             stored, so a retry runs the handler again",
        )
    }

    /// A body that ended before its declared length: the caller could not be sent it whole,
    /// so nothing is stored and the claim is freed for a retry.
    async fn cut_short<B>(self) -> Response<LockBody<B>> {
        tracing::warn!("response body ended before its declared length; nothing stored");
        release(self.claim, self.in_process).await;
        reject(
            &self.cfg.rejections,
            Reason::ResponseFailed,
            None,
            "the handler's response body ended before its declared length; nothing was \
             stored, so a retry runs the handler again",
        )
    }

    /// Streams the rest of an overflowing body to the caller through `tx`, then records `rec`
    /// (status and headers, body omitted) and releases the claim, both before the caller sees
    /// the end; a body that fails stores nothing and frees the claim before the error goes on.
    /// `left` is what is still to come of a body whose length was declared: the server stops
    /// polling such a body at its last byte, so the frame that completes it is the end.
    /// `give_up` is set when the caller is known to have hung up already.
    async fn relay<B>(
        self,
        rec: Record,
        mut body: B,
        tx: Relay,
        mut left: Option<u64>,
        mut give_up: Option<tokio::time::Instant>,
    ) where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        let mut tx = Some(tx);
        let mut last = None;
        // Once the caller hangs up, the rest is read on only for as long as the claim's TTL:
        // a body that never ends (a stream, a heartbeat) would otherwise keep the claim
        // renewed, and every retry of the delivery refused, for ever.
        let read_on = self.cfg.claim.ttl_value();
        // As below the cap: a claim lost while the body streams cuts it.
        let info = self.claim.info();
        let mut lost = std::pin::pin!(info.lost());
        let lost_error = || -> BoxError {
            tracing::warn!(
                "claim lost while the response streamed above the stored-body cap; nothing stored"
            );
            Box::new(LeaseLostWhileStreaming::new(info.key().to_owned()))
        };
        while left != Some(0) && !body.is_end_stream() {
            let next = tokio::select! {
                biased;
                () = &mut lost => return self.cut_off(tx, lost_error()).await,
                () = sleep_until_some(give_up) => {
                    tracing::warn!(
                        ?read_on,
                        "response body still streaming a claim TTL after the caller hung up; \
                         nothing stored, claim released"
                    );
                    let cut = "the response body outlasted the caller by a claim TTL".into();
                    return self.cut_off(tx, cut).await;
                }
                // A body that goes quiet gives no frame whose send would fail: the hang-up is
                // watched for, or the claim would be held (and renewed) for ever.
                () = hung_up(tx.as_ref()), if give_up.is_none() => {
                    tx = None;
                    give_up = Some(tokio::time::Instant::now() + read_on);
                    continue;
                }
                next = next_frame(&mut body) => next,
            };
            match next {
                None => break,
                Some(Ok(frame)) => {
                    // As below the cap, trailers are neither stored nor handed on; they are
                    // the body's last frame, whatever `is_end_stream` says after them.
                    let mut data = match frame.into_data() {
                        Ok(data) => data,
                        Err(frame) if frame.is_trailers() => break,
                        Err(_) => continue,
                    };
                    if let Some(l) = &mut left {
                        data.truncate(usize::try_from(*l).unwrap_or(usize::MAX));
                        *l -= data.len() as u64;
                    }
                    let frame = http_body::Frame::data(data);
                    if left == Some(0) || body.is_end_stream() {
                        last = Some(frame);
                        break;
                    }
                    if let Some(t) = &tx {
                        // A caller that stops reading holds the send; the claim may go meanwhile.
                        let sent = tokio::select! {
                            biased;
                            () = &mut lost => return self.cut_off(tx, lost_error()).await,
                            sent = t.send(Some(Ok(frame))) => sent,
                        };
                        if sent.is_err() {
                            // The caller hung up; the rest is read all the same, so that a body
                            // that ends well is still recorded.
                            tx = None;
                            give_up.get_or_insert_with(|| tokio::time::Instant::now() + read_on);
                        }
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "response body failed above the stored-body cap; nothing stored");
                    return self.cut_off(tx, e).await;
                }
            }
        }
        if left.is_some_and(|l| l > 0) {
            tracing::warn!("response body ended before its declared length; nothing stored");
            let short = "the response body ended before its declared length".into();
            return self.cut_off(tx, short).await;
        }
        self.finish(&rec).await;
        if let Some(t) = tx {
            if let Some(frame) = last {
                let _ = t.send(Some(Ok(frame))).await;
            }
            // The clean end: a channel closed without it reads as a broken relay.
            let _ = t.send(None).await;
        }
    }

    /// A relayed body that cannot end well: nothing is stored, the claim is freed, and the
    /// caller (if still there) gets `error` in place of the body's end.
    async fn cut_off(self, tx: Option<Relay>, error: BoxError) {
        release(self.claim, self.in_process).await;
        if let Some(t) = tx {
            let _ = t.send(Some(Err(error))).await;
        }
    }

    /// Stores `rec` under the claim, then releases the claim.
    async fn finish(self, rec: &Record) {
        let cfg = &self.cfg;
        match cfg
            .store
            .put(
                &self.claim,
                cfg.claim.ttl_value(),
                &self.lock_key,
                &self.result_key,
                rec,
                cfg.retention,
            )
            .await
        {
            Ok(true) => {}
            Ok(false) => tracing::warn!("claim lapsed before the result was stored; not stored"),
            // The answer still goes out; the claim is released below, so a retry runs the
            // handler again rather than waiting out the claim's TTL.
            Err(e) => tracing::warn!(error = %e, "result not stored"),
        }
        release(self.claim, self.in_process).await;
    }
}

/// Headers that describe a response's bytes, left off a replay whose body was not stored: with
/// them the empty stand-in would pass for the original representation (its validators, its
/// encoding, its location), to a cache above all.
const DESCRIBE_THE_BODY: [&str; 9] = [
    "content-encoding",
    "content-range",
    "content-location",
    "etag",
    "last-modified",
    "cache-control",
    "content-digest",
    "repr-digest",
    "digest",
];

/// The stored answer for a duplicate, or the mismatch rejection.
fn replay<B>(cfg: &DedupeConfig, rec: &Record, fingerprint: &str) -> Response<LockBody<B>> {
    if rec.fingerprint != fingerprint {
        return reject(
            &cfg.rejections,
            Reason::KeyReused,
            None,
            "this key was used before with a different request (method, path or body)",
        );
    }
    let mut res = Response::new(LockBody::local(Full::new(rec.body.clone())));
    *res.status_mut() = rec.status;
    for (name, value) in &rec.headers {
        if rec.body_omitted && DESCRIBE_THE_BODY.contains(&name.as_str()) {
            continue;
        }
        res.headers_mut().append(name.clone(), value.clone());
    }
    res.headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    if rec.body_omitted {
        res.headers_mut()
            .insert(BODY_OMITTED, HeaderValue::from_static("true"));
        // An empty stand-in for the original's bytes: no cache may keep it as the resource.
        res.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    res
}

/// Resolves once the caller at the other end of `tx` has gone (never when there is none).
async fn hung_up(tx: Option<&Relay>) {
    match tx {
        Some(t) => t.closed().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `deadline`, or for ever without one.
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The body's next frame, its error converted at once: the inner error type need not be
/// `Send`.
async fn next_frame<B>(body: &mut B) -> Option<Result<http_body::Frame<Bytes>, BoxError>>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    body.frame()
        .await
        .map(|r| r.map_err(Into::<BoxError>::into))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_length_prefixed() {
        assert_ne!(digest(&[b"ab", b"c"]), digest(&[b"a", b"bc"]));
        assert_eq!(digest(&[b"x"]).len(), 64);
    }
}
