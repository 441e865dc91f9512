//! The Redis / Valkey backend: one multiplexed, auto-reconnecting connection per backend and one
//! subscription connection for every waited key.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{Script, Value};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, warn};

use super::batch::{Batcher, Flush};
use super::{AcquireReply, Backend};
use crate::error::{Error, Result, classify};
use crate::types::{LockKey, Token};
use crate::wake::{SubCmd, Subscriptions, Wakeups, Watch, watch_through};

/// Leases per extend script call: large enough to batch, small enough not to stall the server.
pub(super) const EXTEND_CHUNK: usize = 256;

/// Connection settings for [`RedisBackend`]. The defaults suit a server on the same network.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::{Locker, RedisConfig};
/// use std::time::Duration;
///
/// // A server that does not answer within 300 ms is an error, not a hang.
/// let config = RedisConfig::default().response_timeout(Duration::from_millis(300));
/// let locker = Locker::redis_with("redis://127.0.0.1:6379/", config).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RedisConfig {
    /// How long one command may wait for its reply before it fails (default 2 s), so that a dead
    /// server turns into an error rather than a hang. It counts from when the command is made,
    /// a wait for a reconnect in progress included (one to a server whose new connections hang
    /// is otherwise three connection attempts and the pauses between them).
    pub response_timeout: Duration,
    /// How long connecting may take (default 2 s): the first connect as a whole, retries
    /// included, and each attempt of a reconnect.
    pub connection_timeout: Duration,
    /// For `rediss://` URLs (feature `tls`): the certificate authorities to trust, in PEM, instead
    /// of the platform's. `None` (the default) uses the platform's trust store. Present whether
    /// or not the feature is on, so that turning it on elsewhere in a build changes no code
    /// here; without it, a `Some` is refused with [`Error::Unsupported`] when connecting.
    pub tls_root_pem: Option<Vec<u8>>,
}

/// Two seconds for a reply and two for connecting.
///
/// ```
/// use lock_core::RedisConfig;
/// use std::time::Duration;
/// let config = RedisConfig::default();
/// assert_eq!(config.response_timeout, Duration::from_secs(2));
/// assert_eq!(config.connection_timeout, Duration::from_secs(2));
/// ```
impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            response_timeout: Duration::from_secs(2),
            connection_timeout: Duration::from_secs(2),
            tls_root_pem: None,
        }
    }
}

impl RedisConfig {
    /// Sets [`response_timeout`](Self::response_timeout): how long one command may wait for its
    /// reply.
    ///
    /// ```
    /// use lock_core::RedisConfig;
    /// use std::time::Duration;
    /// let config = RedisConfig::default().response_timeout(Duration::from_millis(300));
    /// assert_eq!(config.response_timeout, Duration::from_millis(300));
    /// ```
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Sets [`connection_timeout`](Self::connection_timeout): how long connecting may take.
    ///
    /// ```
    /// use lock_core::RedisConfig;
    /// use std::time::Duration;
    /// let config = RedisConfig::default().connection_timeout(Duration::from_millis(500));
    /// assert_eq!(config.connection_timeout, Duration::from_millis(500));
    /// ```
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// Sets [`tls_root_pem`](Self::tls_root_pem): the certificate authorities (PEM) that
    /// `rediss://` connections trust, or `None` for the platform's. Needs the `tls` feature
    /// to connect with one.
    ///
    /// ```
    /// use lock_core::RedisConfig;
    /// let pem = b"-----BEGIN CERTIFICATE-----\n...".to_vec();
    /// let config = RedisConfig::default().tls_root_pem(pem);
    /// assert!(config.tls_root_pem.is_some());
    /// assert!(config.tls_root_pem(None).tls_root_pem.is_none());
    /// ```
    pub fn tls_root_pem(mut self, pem: impl Into<Option<Vec<u8>>>) -> Self {
        self.tls_root_pem = pem.into();
        self
    }

    /// A timeout under a millisecond fails every request (or every connect) it bounds, and
    /// would report a sound server as unreachable: refused before any connection is made.
    /// `Duration::MAX` is no timeout at all.
    pub(crate) fn validate(&self) -> Result<()> {
        self.validate_for(cfg!(feature = "tls"))
    }

    /// [`validate`](Self::validate) for a build with or without TLS: both are tested in one
    /// build (the tests run with every feature on).
    fn validate_for(&self, tls_built: bool) -> Result<()> {
        for (what, value) in [
            ("response timeout", self.response_timeout),
            ("connection timeout", self.connection_timeout),
        ] {
            if value < Duration::from_millis(1) {
                return Err(Error::InvalidDuration {
                    what,
                    value,
                    reason: "under 1 ms: every request would time out",
                });
            }
        }
        if !tls_built && self.tls_root_pem.is_some() {
            return Err(Error::Unsupported {
                what: "a TLS root certificate without the `tls` feature",
                backend: "redis",
            });
        }
        Ok(())
    }

    /// A client for `url` with these settings: plain `redis://`, or `rediss://` (TLS) with the
    /// `tls` feature.
    pub(crate) fn client(&self, url: &str) -> Result<redis::Client> {
        #[cfg(feature = "tls")]
        {
            // rustls needs one crypto provider per process; ring is the one built in. Another
            // already installed by the application is kept.
            let _ = rustls::crypto::ring::default_provider().install_default();
            if let Some(root) = &self.tls_root_pem {
                let certs = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root.clone()),
                };
                return redis::Client::build_with_tls(url, certs).map_err(Error::Unavailable);
            }
        }
        redis::Client::open(url).map_err(Error::Unavailable)
    }
}

/// The Lua scripts every server-backed backend runs, loaded on first use (`EVALSHA`, then
/// `SCRIPT LOAD` on `NOSCRIPT`).
pub(super) struct Scripts {
    acquire: Script,
    release: Script,
    extend: Script,
    admit: Script,
    /// Sent through a cluster connection, whose errors are sorted by `classify_cluster`.
    on_cluster: bool,
}

impl Scripts {
    /// For one server.
    pub(super) fn new() -> Scripts {
        Scripts {
            acquire: Script::new(include_str!("../lua/acquire.lua")),
            release: Script::new(include_str!("../lua/release.lua")),
            extend: Script::new(include_str!("../lua/extend.lua")),
            admit: Script::new(include_str!("../lua/fence_gate.lua")),
            on_cluster: false,
        }
    }

    /// For a cluster.
    pub(super) fn for_cluster() -> Scripts {
        Scripts {
            on_cluster: true,
            ..Scripts::new()
        }
    }

    /// The error of a call that got no answer from its script.
    fn classify(&self, op: &'static str, key: &str, err: redis::RedisError) -> Error {
        if self.on_cluster {
            crate::error::classify_cluster(op, key, err)
        } else {
            classify(op, key, err)
        }
    }
}

/// A Redis or Valkey server. Clones share the connection.
///
/// Scripts run by `EVALSHA`, falling back to loading them on `NOSCRIPT` (after a restart or a
/// `SCRIPT FLUSH`).
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::{LockOptions, Locker, RedisBackend};
///
/// // Typed by its backend: no dispatch, and the backend's own methods stay in reach.
/// let backend = RedisBackend::connect("redis://127.0.0.1:6379/").await?;
/// let locker: Locker<RedisBackend> = Locker::new(backend);
/// let lease = locker.acquire("k", &LockOptions::new()).await?;
/// # lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    conn: RedisConn,
    /// Connections kept aside for acquires that wait for replicas: `WAIT` blocks the
    /// connection it runs on, and must run on the connection that wrote.
    dedicated: Arc<Dedicated>,
    scripts: Arc<Scripts>,
    acquires: Arc<Batcher<Acquires>>,
    releases: Arc<Batcher<Releases>>,
    wakeups: Arc<Wakeups>,
    subs: Arc<Subscriptions>,
}

/// What a batcher sends on: the shared connection and the scripts.
struct Sender {
    conn: RedisConn,
    scripts: Arc<Scripts>,
}

/// Acquires on the shared connection, coalesced while others are in flight.
struct Acquires(Sender);

impl Flush for Acquires {
    /// The key, the token, the lease's TTL and how long to keep the fence (`None`: for ever).
    type Item = (LockKey, Token, Duration, Option<Duration>);
    type Reply = AcquireReply;
    const SEND_ABANDONED: bool = false;

    async fn flush(&self, items: &[Self::Item]) -> Vec<Result<AcquireReply>> {
        let items = items
            .iter()
            .map(|(key, token, ttl, keep)| (key, token, *ttl, *keep));
        ops::acquire_many(&mut self.0.conn.clone(), &self.0.scripts, items).await
    }

    /// A grant, or a call that may have made one, whose caller is gone: nobody will hold or
    /// renew it, so it is released at once instead of keeping the key for its TTL. The
    /// release is token-checked, so one for a grant that never happened changes nothing; and it
    /// goes on the shared connection after the acquire was handed to it, so it runs after it,
    /// unless that connection was replaced meanwhile (gone silent): an acquire held up on the
    /// old one can then land after it and keep the key, held by nobody, for its TTL (the
    /// README's "a stalled request can land late").
    fn unclaimed(&self, item: &Self::Item, answer: Option<Result<AcquireReply>>) {
        match answer {
            // Nothing was granted.
            Some(Ok(AcquireReply::Held { .. })) => return,
            Some(Err(e)) if !e.may_have_landed() => return,
            _ => {}
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (mut conn, scripts) = (self.0.conn.clone(), self.0.scripts.clone());
        let (key, token) = (item.0.clone(), item.1.clone());
        runtime.spawn(async move {
            let mut released = ops::release(&mut conn, &scripts, &key, &token, "PUBLISH").await;
            // As a dropped guard's release: one that got no verdict (sent on the connection
            // the grant's reply was lost with, say) may never have reached the server.
            if released.as_ref().is_err_and(Error::may_have_landed) {
                released = ops::release(&mut conn, &scripts, &key, &token, "PUBLISH").await;
            }
            match released {
                Ok(held) => debug!(key = key.key(), held, "abandoned grant released"),
                Err(e) => warn!(key = key.key(), error = %e, "abandoned grant not released; it expires with its TTL"),
            }
        });
    }
}

/// Releases on the shared connection, coalesced while others are in flight.
struct Releases(Sender);

impl Flush for Releases {
    type Item = (LockKey, Token);
    type Reply = bool;
    const SEND_ABANDONED: bool = true;

    async fn flush(&self, items: &[Self::Item]) -> Vec<Result<bool>> {
        let items = items.iter().map(|(key, token)| (key, token));
        ops::release_many(&mut self.0.conn.clone(), &self.0.scripts, items, "PUBLISH").await
    }
}

/// A batched call that came back without this item's answer: it may or may not have run.
fn unanswered(op: &'static str, key: &LockKey) -> Error {
    Error::OutcomeUnknown {
        op,
        key: key.key().to_owned(),
        source: redis::RedisError::from(std::io::Error::other("the call was dropped unanswered")),
    }
}

impl RedisBackend {
    /// Connects to `url` (`redis://host:port/db`) with default settings.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// let backend = lock_core::RedisBackend::connect("redis://127.0.0.1:6379/0").await?;
    /// let locker = lock_core::Locker::new(backend);
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<RedisBackend> {
        RedisBackend::connect_with(url, RedisConfig::default()).await
    }

    /// Connects to `url` with explicit settings.
    ///
    /// A URL that cannot be parsed, or a server that cannot be reached within the connection
    /// timeout, is [`Error::Unavailable`]; a timeout under 1 ms is [`Error::InvalidDuration`],
    /// before any connection is made:
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use lock_core::{Error, RedisBackend, RedisConfig};
    /// use std::time::Duration;
    /// let refused = RedisBackend::connect_with("not a url", RedisConfig::default()).await;
    /// assert!(matches!(refused, Err(Error::Unavailable(_))));
    /// let zero = RedisConfig::default().response_timeout(Duration::ZERO);
    /// let refused = RedisBackend::connect_with("redis://127.0.0.1:1/", zero).await;
    /// assert!(matches!(refused, Err(Error::InvalidDuration { what: "response timeout", .. })));
    /// let tiny = RedisConfig::default().connection_timeout(Duration::from_nanos(1));
    /// let refused = RedisBackend::connect_with("redis://127.0.0.1:1/", tiny).await;
    /// assert!(matches!(refused, Err(Error::InvalidDuration { what: "connection timeout", .. })));
    /// # }
    /// ```
    pub async fn connect_with(url: &str, config: RedisConfig) -> Result<RedisBackend> {
        config.validate()?;
        let client = config.client(url)?;
        let cm_config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(config.response_timeout))
            .set_connection_timeout(Some(config.connection_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let conn = RedisConn::connect(client.clone(), cm_config, config.connection_timeout)
            .await
            .map_err(Error::Unavailable)?;
        let dedicated = Arc::new(Dedicated {
            client: client.clone(),
            config: config.clone(),
            idle: Mutex::new(Vec::new()),
        });
        let wakeups = Arc::new(Wakeups::default());
        let subs = Arc::new(Subscriptions::restarting({
            let wakeups = wakeups.clone();
            move || {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(subscriber(
                    client.clone(),
                    config.clone(),
                    wakeups.clone(),
                    rx,
                ));
                tx
            }
        }));
        let scripts = Arc::new(Scripts::new());
        let sender = || Sender {
            conn: conn.clone(),
            scripts: scripts.clone(),
        };
        Ok(RedisBackend {
            acquires: Batcher::new(Acquires(sender())),
            releases: Batcher::new(Releases(sender())),
            conn,
            dedicated,
            scripts,
            wakeups,
            subs,
        })
    }

    /// The shared connection, for callers that want to run their own commands beside the locks.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use lock_core::redis::AsyncCommands;
    /// let backend = lock_core::RedisBackend::connect("redis://127.0.0.1:6379/").await?;
    /// let mut conn = backend.connection();
    /// let _: () = conn.set("report:last-run", "2026-12-04").await?;
    /// # Ok(()) }
    /// ```
    pub fn connection(&self) -> RedisConn {
        self.conn.clone()
    }
}

/// The shared connection of a [`RedisBackend`]: a redis-rs [`ConnectionManager`], which
/// reconnects when its connection drops, made again when it goes silent instead.
///
/// A connection whose peer vanished without closing it (a failover that moved the address, a
/// NAT or firewall that forgot the flow) does not drop: each request times out, and the
/// manager, which reconnects only on a dropped connection, keeps sending on it until the
/// kernel gives up on the socket (about a quarter of an hour). So after a request times out,
/// a `PING` checks the connection (within the connection timeout), and a connection that does
/// not answer it is replaced by a new one; requests still waiting on the old one time out. The
/// same check follows a failure that is neither the server's answer nor an I/O error (which the
/// manager handles): a reconnect refused at its `AUTH` (a password rotated, a server at
/// `maxclients`) would otherwise stay the manager's answer to every request.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use lock_core::redis::AsyncCommands;
/// let backend = lock_core::RedisBackend::connect("redis://127.0.0.1:6379/").await?;
/// let mut conn: lock_core::backend::redis::RedisConn = backend.connection();
/// let n: i64 = conn.incr("visits", 1).await?;
/// # let _ = n;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisConn(Arc<Shared>);

struct Shared {
    /// The manager requests go to, and how many times it was replaced: a request that timed
    /// out on an earlier one (sent before the replacement) says nothing of the current one.
    now: Mutex<(ConnectionManager, u64)>,
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// How long the check's `PING`, and a new connection, may take.
    patience: Duration,
    /// One check at a time: the requests timing out together on a silent connection start one.
    checking: std::sync::atomic::AtomicBool,
}

impl RedisConn {
    async fn connect(
        client: redis::Client,
        config: ConnectionManagerConfig,
        patience: Duration,
    ) -> redis::RedisResult<RedisConn> {
        // The manager's own retries (each attempt bounded by the connection timeout) inside one
        // bound: connecting as a whole takes at most the connection timeout, as documented, not
        // one per attempt plus the backoff between them.
        let manager = tokio::time::timeout(
            patience,
            ConnectionManager::new_with_config(client.clone(), config.clone()),
        )
        .await
        .map_err(|_| {
            redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connecting took longer than the connection timeout",
            ))
        })??;
        Ok(RedisConn(Arc::new(Shared {
            now: Mutex::new((manager, 0)),
            client,
            config,
            patience,
            checking: std::sync::atomic::AtomicBool::new(false),
        })))
    }

    /// The redis-rs connection manager requests go to now (a new one after a silent one was
    /// replaced).
    pub fn manager(&self) -> ConnectionManager {
        self.current().0
    }

    fn current(&self) -> (ConnectionManager, u64) {
        self.0
            .now
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// `request` within the response timeout, from when it is made. The manager bounds a
    /// request's send and answer by it, but not its wait for a reconnect in progress: to a
    /// server whose new connections hang (a host gone, packets dropped), that wait is the
    /// manager's three connection attempts and the pauses between them, several response
    /// timeouts for every request, and again for an attempt's retry. Cut short, the request
    /// may or may not have been sent: a timeout, as one on a silent connection.
    async fn bounded<T>(
        &self,
        request: impl Future<Output = redis::RedisResult<T>>,
    ) -> redis::RedisResult<T> {
        let Some(limit) = self.0.config.response_timeout() else {
            return request.await;
        };
        tokio::time::timeout(limit, request)
            .await
            .unwrap_or_else(|_| {
                Err(redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no answer within the response timeout (the connection may be reconnecting)",
                )))
            })
    }

    /// Checks the current connection, and replaces it if it is silent: for a caller that gave
    /// up on a request before the response timeout could fire (a quorum's member timeout).
    pub(crate) fn check(&self) {
        let (manager, generation) = self.current();
        self.timed_out(manager, generation);
    }

    /// After a request on `manager` (the `generation`th) timed out, or failed as
    /// [`needs_a_check`] says: checks it, and replaces it
    /// if it is silent. Only the current one: a request sent before a replacement may time out
    /// after it, on the connection already replaced.
    fn timed_out(&self, manager: ConnectionManager, generation: u64) {
        use std::sync::atomic::Ordering;
        /// Clears the flag however the check ends, also when its task is dropped unfinished
        /// (its runtime shut down): left set, it would keep every later check from starting.
        struct Checking(Arc<Shared>);
        impl Drop for Checking {
            fn drop(&mut self) {
                self.0.checking.store(false, Ordering::Release);
            }
        }
        if self.current().1 != generation || self.0.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        let checking = Checking(self.0.clone());
        tokio::spawn(async move {
            let shared = &checking.0;
            let mut probe = manager.clone();
            let cmd = redis::cmd("PING");
            let ping = cmd.query_async::<Value>(&mut probe);
            let silent = !matches!(tokio::time::timeout(shared.patience, ping).await, Ok(Ok(_)));
            if silent {
                let fresh = ConnectionManager::new_with_config(
                    shared.client.clone(),
                    shared.config.clone(),
                );
                match tokio::time::timeout(shared.patience, fresh).await {
                    Ok(Ok(fresh)) => {
                        warn!("the shared connection stopped answering; replaced by a new one");
                        let mut now = shared.now.lock().unwrap_or_else(PoisonError::into_inner);
                        *now = (fresh, generation + 1);
                    }
                    Ok(Err(e)) => {
                        warn!(error = %e, "the shared connection stopped answering, and a new one failed");
                    }
                    Err(_) => {
                        warn!(
                            "the shared connection stopped answering, and a new one took too long"
                        );
                    }
                }
            }
            drop(checking);
        });
    }
}

/// Whether a failed request calls for a check of its connection: a timeout (a silent
/// connection), or a failure that is neither the server's answer nor an I/O error. redis-rs's
/// manager reconnects by itself after an I/O error (checking then too would race its
/// reconnect); a reconnect that failed otherwise (its `AUTH` refused, as while a password is
/// rotated or the server is at `maxclients`) stays its answer to every later request, for
/// good, unless the connection is replaced. Over RESP3 that answer is the server's own reply
/// to the refused `HELLO 3 AUTH` (`WRONGPASS`, or `NOAUTH` without a password), so those
/// codes are checked too. Not other replies: a server busy with a script or loading its data
/// answers the check's `PING` with the same refusal, and each check would replace a working
/// connection for as long as that lasts.
fn needs_a_check(e: &redis::RedisError) -> bool {
    e.is_timeout() || (!e.is_io_error() && matches!(e.code(), None | Some("WRONGPASS" | "NOAUTH")))
}

impl redis::aio::ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        let (mut manager, generation) = self.current();
        Box::pin(async move {
            let answer = self.bounded(manager.req_packed_command(cmd)).await;
            if answer.as_ref().is_err_and(needs_a_check) {
                self.timed_out(manager, generation);
            }
            answer
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        let (mut manager, generation) = self.current();
        Box::pin(async move {
            let answer = self
                .bounded(manager.req_packed_commands(pipeline, offset, count))
                .await;
            if answer.as_ref().is_err_and(needs_a_check) {
                self.timed_out(manager, generation);
            }
            answer
        })
    }

    fn get_db(&self) -> i64 {
        self.manager().get_db()
    }
}

/// An integer reply.
pub(super) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

/// A fence in a reply: an integer, or a decimal string where a script must not round it (Lua
/// numbers are doubles, exact only up to 2^53; fences go to `u64::MAX`).
pub(super) fn fence_value(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

/// A reply as text, for error messages (a type name, a member's answer).
pub(super) fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        other => format!("{other:?}"),
    }
}

fn pair(reply: &Value) -> Option<(i64, &Value)> {
    match reply {
        Value::Array(items) if items.len() == 2 => Some((int(&items[0])?, &items[1])),
        _ => None,
    }
}

/// A script answered in a shape it never should: a version mismatch or a corrupted key.
pub(super) fn unexpected(what: &str, reply: &Value) -> Error {
    Error::Unavailable(redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected script reply",
        format!("{what}: {reply:?}"),
    )))
}

/// The script calls, on any connection: a standalone server's or a cluster's.
pub(super) mod ops {
    use super::*;
    use redis::aio::ConnectionLike;

    pub(crate) async fn acquire<C: ConnectionLike>(
        conn: &mut C,
        scripts: &Scripts,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        keep: Option<Duration>,
    ) -> Result<AcquireReply> {
        let items = std::iter::once((key, token, ttl, keep));
        let answer = acquire_call(conn, scripts, items.clone()).await;
        let mut answers = acquire_answers(scripts, items, answer);
        answers
            .pop()
            .unwrap_or_else(|| Err(unexpected("acquire", &Value::Nil)))
    }

    /// One script call granting each of `items` (all in one slot on a cluster): one answer per
    /// item, in order. An item's `keep` is how long its fence key outlives the grant (at least
    /// its TTL); `None` keeps it for ever.
    pub(crate) async fn acquire_many<'a, C, I>(
        conn: &mut C,
        scripts: &Scripts,
        items: I,
    ) -> Vec<Result<AcquireReply>>
    where
        C: ConnectionLike + Clone,
        I: ExactSizeIterator<Item = (&'a LockKey, &'a Token, Duration, Option<Duration>)> + Clone,
    {
        match acquire_call(conn, scripts, items.clone()).await {
            Err(e) if items.len() > 1 && refused_for_a_key(&e) => {
                let alone = items.map(|item| {
                    let mut conn = conn.clone();
                    async move {
                        let one = std::iter::once(item);
                        acquire_answers(
                            scripts,
                            one.clone(),
                            acquire_call(&mut conn, scripts, one).await,
                        )
                    }
                });
                let answers = futures_util::future::join_all(alone).await;
                answers.into_iter().flatten().collect()
            }
            answer => acquire_answers(scripts, items, answer),
        }
    }

    async fn acquire_call<'a, C, I>(
        conn: &mut C,
        scripts: &Scripts,
        items: I,
    ) -> redis::RedisResult<Value>
    where
        C: ConnectionLike,
        I: Iterator<Item = (&'a LockKey, &'a Token, Duration, Option<Duration>)>,
    {
        let mut inv = scripts.acquire.prepare_invoke();
        for (key, token, ttl, keep) in items {
            // 0: kept for ever. Bounded here too (the trait method is public; `LockOptions`
            // refuses more than a year before any round trip), so no overflow.
            let keep = keep.map_or(0, |keep| {
                keep.min(crate::MAX_KEEP_FENCE).max(ttl).as_millis() as u64
            });
            inv.key(key.lock_key())
                .key(key.fence_key())
                .arg(token.as_str())
                .arg(ttl.as_millis() as u64)
                .arg(keep);
        }
        inv.invoke_async::<Value>(conn).await
    }

    fn acquire_answers<'a, I>(
        scripts: &Scripts,
        items: I,
        answer: redis::RedisResult<Value>,
    ) -> Vec<Result<AcquireReply>>
    where
        I: ExactSizeIterator<Item = (&'a LockKey, &'a Token, Duration, Option<Duration>)>,
    {
        match answer {
            Ok(Value::Array(replies)) if replies.len() == 2 * items.len() => items
                .zip(replies.chunks_exact(2))
                .map(|((key, ..), reply)| acquire_reply(key, &reply[0], &reply[1]))
                .collect(),
            Ok(reply) => items.map(|_| Err(unexpected("acquire", &reply))).collect(),
            Err(e) => items
                .map(|(key, ..)| Err(scripts.classify("acquire", key.key(), e.clone())))
                .collect(),
        }
    }

    /// Whether the server refused a whole call for one of the keys it names: an ACL rule checks
    /// every key a script call declares before the script runs, so one item's key outside the
    /// user's key patterns refuses the call for every item in it. Sent again one item a call,
    /// the others get their own answers rather than a refusal that is not theirs (a `Locker`
    /// with a prefix the user may not touch, beside one it may, on one shared connection).
    pub(super) fn refused_for_a_key(e: &redis::RedisError) -> bool {
        // Redis 7.0: "...access one of the keys used as arguments"; Redis 7.2+ and Valkey:
        // "No permissions to access a key". Not the bare word: a command refusal names the
        // user ("User monkey has no permissions to run..."), whose name may hold it.
        let text = e.to_string();
        e.code() == Some("NOPERM")
            && (text.contains("one of the keys") || text.contains("access a key"))
    }

    /// One item's answer: its status and value (see `acquire.lua`).
    pub(super) fn acquire_reply(
        key: &LockKey,
        status: &Value,
        value: &Value,
    ) -> Result<AcquireReply> {
        let unexpected = || {
            unexpected(
                "acquire",
                &Value::Array(vec![status.clone(), value.clone()]),
            )
        };
        match int(status) {
            Some(1) => Ok(AcquireReply::Granted {
                fence: fence_value(value).ok_or_else(unexpected)?,
                valid_from: None,
            }),
            // Held: the holder's PTTL, -1 when it has no expiry. Anything but an integer is
            // no PTTL: read as "held for ever", it would hide a reply the script never gives.
            Some(0) => {
                let pttl = int(value).ok_or_else(unexpected)?;
                Ok(AcquireReply::Held {
                    remaining: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
                })
            }
            // The type (-1, -2) and the refusal (-3) are text; a status with anything else is
            // as unreadable as an unknown status.
            _ if !matches!(value, Value::BulkString(_) | Value::SimpleString(_))
                && matches!(int(status), Some(-3..=-1)) =>
            {
                Err(unexpected())
            }
            // The item's lock (-1) or fence (-2) key holds a foreign type; name the key.
            Some(-1) => Err(Error::WrongType {
                server_key: key.lock_key().to_owned(),
                found: text(value),
            }),
            Some(-2) => Err(Error::WrongType {
                server_key: key.fence_key().to_owned(),
                found: text(value),
            }),
            Some(-3) => Err(classify("acquire", key.key(), refusal(value))),
            Some(-4) => Err(Error::FenceExhausted {
                key: key.key().to_owned(),
            }),
            _ => Err(unexpected()),
        }
    }

    /// `publish` is the command that wakes waiters: `PUBLISH`, or `SPUBLISH` on a cluster.
    pub(crate) async fn release<C: ConnectionLike>(
        conn: &mut C,
        scripts: &Scripts,
        key: &LockKey,
        token: &Token,
        publish: &str,
    ) -> Result<bool> {
        let items = std::iter::once((key, token));
        let answer = release_call(conn, scripts, items.clone(), publish).await;
        let mut answers = release_answers(scripts, items, answer);
        answers
            .pop()
            .unwrap_or_else(|| Err(unexpected("release", &Value::Nil)))
    }

    /// One script call releasing each of `items` (all in one slot on a cluster): whether each
    /// token still held its lease, in order.
    pub(crate) async fn release_many<'a, C, I>(
        conn: &mut C,
        scripts: &Scripts,
        items: I,
        publish: &str,
    ) -> Vec<Result<bool>>
    where
        C: ConnectionLike + Clone,
        I: ExactSizeIterator<Item = (&'a LockKey, &'a Token)> + Clone,
    {
        match release_call(conn, scripts, items.clone(), publish).await {
            Err(e) if items.len() > 1 && refused_for_a_key(&e) => {
                let alone = items.map(|item| {
                    let mut conn = conn.clone();
                    async move {
                        let one = std::iter::once(item);
                        let answer = release_call(&mut conn, scripts, one.clone(), publish).await;
                        release_answers(scripts, one, answer)
                    }
                });
                let answers = futures_util::future::join_all(alone).await;
                answers.into_iter().flatten().collect()
            }
            answer => release_answers(scripts, items, answer),
        }
    }

    async fn release_call<'a, C, I>(
        conn: &mut C,
        scripts: &Scripts,
        items: I,
        publish: &str,
    ) -> redis::RedisResult<Value>
    where
        C: ConnectionLike,
        I: Iterator<Item = (&'a LockKey, &'a Token)>,
    {
        let mut inv = scripts.release.prepare_invoke();
        inv.arg(publish);
        for (key, token) in items {
            inv.key(key.lock_key())
                .arg(token.as_str())
                .arg(key.channel());
        }
        inv.invoke_async::<Value>(conn).await
    }

    fn release_answers<'a, I>(
        scripts: &Scripts,
        items: I,
        answer: redis::RedisResult<Value>,
    ) -> Vec<Result<bool>>
    where
        I: ExactSizeIterator<Item = (&'a LockKey, &'a Token)>,
    {
        match answer {
            Ok(Value::Array(replies)) if replies.len() == items.len() => items
                .zip(&replies)
                .map(|((key, _), reply)| match reply {
                    // Any other number is no verdict: read as "not held", it would tell a
                    // holder whose release ran that it had lost the lease.
                    Value::Int(1) => Ok(true),
                    Value::Int(0) => Ok(false),
                    // Text is the server's refusal of this item's command.
                    Value::BulkString(_) => Err(classify("release", key.key(), refusal(reply))),
                    _ => Err(unexpected("release", reply)),
                })
                .collect(),
            Ok(reply) => items.map(|_| Err(unexpected("release", &reply))).collect(),
            Err(e) => items
                .map(|(key, _)| Err(scripts.classify("release", key.key(), e.clone())))
                .collect(),
        }
    }

    /// The server's refusal of one item, as the error its own reply would have been: a script
    /// that carries many items answers each one's refusal as text instead of failing them all.
    fn refusal(err: &Value) -> redis::RedisError {
        crate::error::error_reply(&text(err))
    }

    /// One script call for `items`, which must all sit in one slot on a cluster.
    pub(crate) async fn extend<C: ConnectionLike>(
        conn: C,
        scripts: &Scripts,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Result<Vec<bool>> {
        // A lone lease (an explicit extend) is named in the error; a batch has no one key.
        let named = match items {
            [(key, _)] => key.key(),
            _ => "(batch)",
        };
        let answers = extend_call(conn, scripts, items, ttl)
            .await
            .map_err(|e| scripts.classify("extend", named, e))?;
        extend_answers(items, answers)
    }

    /// As [`extend`], for the renewal driver, with an answer per lease: when the server refuses
    /// the whole call for a key the ACL user may not touch (its rule changed while the lease
    /// was held), each lease is sent again alone, and those refused get the refusal as their
    /// own answer (the driver retries them until their deadline: the rule may be put back
    /// meanwhile), rather than failing the renewal of every lease in the call.
    pub(crate) async fn extend_each<C: ConnectionLike + Clone>(
        conn: C,
        scripts: &Scripts,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Result<Vec<Result<bool>>> {
        // A lone lease (an explicit extend on a cluster's slot) is named in the error.
        let named = match items {
            [(key, _)] => key.key(),
            _ => "(batch)",
        };
        match extend_call(conn.clone(), scripts, items, ttl).await {
            Err(e) if items.len() > 1 && refused_for_a_key(&e) => {
                let alone = items.iter().map(|item| {
                    let one = std::slice::from_ref(item);
                    let call = extend_call(conn.clone(), scripts, one, ttl);
                    async move { (one, call.await) }
                });
                let mut out = Vec::with_capacity(items.len());
                for (one, answer) in futures_util::future::join_all(alone).await {
                    let key = one[0].0.key();
                    match answer {
                        Ok(answer) => out.extend(extend_answers(one, answer)?.into_iter().map(Ok)),
                        Err(e) if refused_for_a_key(&e) => {
                            out.push(Err(scripts.classify("extend", key, e)));
                        }
                        Err(e) => return Err(scripts.classify("extend", named, e)),
                    }
                }
                Ok(out)
            }
            Err(e) => Err(scripts.classify("extend", named, e)),
            Ok(answers) => Ok(extend_answers(items, answers)?
                .into_iter()
                .map(Ok)
                .collect()),
        }
    }

    /// Answers are matched to leases by position: a reply of another length (or with a value
    /// the script never gives) would tell one lease another's fate, so it fails the whole call
    /// instead, as an unreadable reply.
    fn extend_answers(items: &[(LockKey, Token)], answers: Vec<i64>) -> Result<Vec<bool>> {
        if answers.len() != items.len() || answers.iter().any(|&n| n != 0 && n != 1) {
            let reply = Value::Array(answers.into_iter().map(Value::Int).collect());
            return Err(unexpected("extend", &reply));
        }
        Ok(answers.into_iter().map(|n| n == 1).collect())
    }

    async fn extend_call<C: ConnectionLike>(
        mut conn: C,
        scripts: &Scripts,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> redis::RedisResult<Vec<i64>> {
        let mut inv = scripts.extend.prepare_invoke();
        inv.arg(ttl.as_millis() as u64);
        for (key, token) in items {
            inv.key(key.lock_key()).arg(token.as_str());
        }
        inv.invoke_async::<Vec<i64>>(&mut conn).await
    }

    pub(crate) async fn admit<C: ConnectionLike>(
        conn: &mut C,
        scripts: &Scripts,
        gate_key: &str,
        fence: u64,
    ) -> Result<Option<u64>> {
        let reply: Value = scripts
            .admit
            .key(gate_key)
            .arg(fence)
            .invoke_async(conn)
            .await
            .map_err(|e| scripts.classify("admit", gate_key, e))?;
        match pair(&reply) {
            Some((1, _)) => Ok(None),
            Some((0, highest)) => Ok(Some(
                fence_value(highest).ok_or_else(|| unexpected("admit", &reply))?,
            )),
            Some((-1, found)) => Err(Error::WrongType {
                server_key: gate_key.to_owned(),
                found: text(found),
            }),
            _ => Err(unexpected("admit", &reply)),
        }
    }
}

impl RedisBackend {
    /// The acquire and its `WAIT` on `conn`, a dedicated connection. After an error `conn` is
    /// not used again (a timeout leaves a reply owed on it). `gone` tells whether the caller has
    /// left: a grant made for nobody is not worth waiting for replicas.
    async fn replicated_on(
        &self,
        conn: &mut MultiplexedConnection,
        key: &LockKey,
        token: &Token,
        (ttl, replicas, timeout): (Duration, u32, Duration),
        gone: impl Fn() -> bool,
    ) -> Result<(AcquireReply, u32)> {
        let bound = self.dedicated.config.response_timeout;
        let timed_out = |op| {
            classify(
                op,
                key.key(),
                redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut)),
            )
        };
        let grant = ops::acquire(conn, &self.scripts, key, token, ttl, None);
        let reply = tokio::time::timeout(bound, grant)
            .await
            .map_err(|_| timed_out("acquire"))??;
        if !matches!(reply, AcquireReply::Granted { .. }) || gone() {
            return Ok((reply, 0));
        }
        // WAIT counts the replicas that have every write this connection made, the grant's
        // lock and fence among them; it blocks only this connection.
        let acked: Result<i64> = tokio::time::timeout(
            bound.saturating_add(timeout),
            redis::cmd("WAIT")
                .arg(replicas)
                .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX))
                .query_async(conn),
        )
        .await
        .map_err(|_| timed_out("wait"))
        .and_then(|r| r.map_err(|e| classify("wait", key.key(), e)));
        match acked {
            Ok(acked) => Ok((reply, u32::try_from(acked.max(0)).unwrap_or(u32::MAX))),
            Err(e) => {
                // No one will hold the grant: give the key back rather than leave it taken
                // until its TTL runs out. The acquire was answered, so the release cannot
                // overtake it, on whichever connection it goes.
                if let Err(release) = self.release(key, token).await {
                    warn!(key = key.key(), error = %release, "grant not given back after a failed WAIT; it expires with its TTL");
                }
                Err(e)
            }
        }
    }

    /// After an acquire whose outcome is unknown (no reply in time, a dropped connection):
    /// releases on the same connection, where the release queues behind the acquire if the
    /// acquire is still on its way. A release on any other connection could get there first,
    /// find nothing, and leave a late grant holding the key for its TTL.
    async fn give_back_unknown(
        &self,
        mut conn: MultiplexedConnection,
        key: &LockKey,
        token: &Token,
    ) {
        let bound = self.dedicated.config.response_timeout;
        let undo = ops::release(&mut conn, &self.scripts, key, token, "PUBLISH");
        match tokio::time::timeout(bound, undo).await {
            Ok(Ok(_)) => {}
            // The connection itself failed (it dropped while the acquire was out, which is
            // often why its outcome is unknown): an acquire sent on it has run or never will,
            // so a release on the shared connection can no longer get there first.
            Ok(Err(e @ (Error::Unavailable(_) | Error::OutcomeUnknown { .. }))) => {
                debug!(key = key.key(), error = %e, "the acquire's connection failed; giving it back on the shared one");
                if let Err(e) = Backend::release(self, key, token).await {
                    warn!(key = key.key(), error = %e, "acquire of unknown outcome not given back; a grant would expire with its TTL");
                }
            }
            Ok(Err(e)) => {
                warn!(key = key.key(), error = %e, "acquire of unknown outcome not given back; a grant would expire with its TTL");
            }
            Err(_) => {
                warn!(
                    key = key.key(),
                    "give-back of an acquire of unknown outcome unanswered in time; it may still land behind the acquire"
                );
            }
        }
    }
}

/// A few plain connections used one caller at a time, for commands that block their connection.
struct Dedicated {
    client: redis::Client,
    config: RedisConfig,
    idle: Mutex<Vec<MultiplexedConnection>>,
}

/// Idle dedicated connections kept for reuse; more are opened while all are busy.
const MAX_IDLE_DEDICATED: usize = 8;

impl Dedicated {
    /// An idle connection that answers a `PING`, or a new one. A pooled connection does not
    /// reconnect: one the server closed meanwhile (a restart, a failover, `CLIENT KILL`, or the
    /// runtime it was made on shut down) would fail the acquire sent on it, with its outcome
    /// unknown. The `PING` costs a round trip beside the `WAIT` these acquires make anyway. It
    /// checks the connection is alive, not fast: a closed one fails it at once, and a silent
    /// one is given as long as making a new connection may take. A silent one empties the
    /// pool: the others went idle on the same server and path, and pinging each in turn (up to
    /// eight connection timeouts) would carry the acquire far past any bound it documents.
    async fn take(&self) -> Result<MultiplexedConnection> {
        loop {
            let idle = self
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            let Some(mut conn) = idle else { break };
            let cmd = redis::cmd("PING");
            let ping = cmd.query_async::<Value>(&mut conn);
            match tokio::time::timeout(self.config.connection_timeout, ping).await {
                Ok(Ok(_)) => return Ok(conn),
                Ok(Err(_)) => debug!("a pooled dedicated connection failed; dropping it"),
                Err(_) => {
                    debug!("a pooled dedicated connection was silent; dropping the pool");
                    self.idle
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clear();
                    break;
                }
            }
        }
        // No response timeout here: the caller bounds each use, WAIT included.
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.config.connection_timeout))
            .set_response_timeout(None);
        self.client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await
            .map_err(Error::Unavailable)
    }

    fn give_back(&self, conn: MultiplexedConnection) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < MAX_IDLE_DEDICATED {
            idle.push(conn);
        }
    }
}

impl Backend for RedisBackend {
    async fn acquire(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<AcquireReply> {
        crate::types::validate_ttl(ttl)?;
        let item = (key.clone(), token.clone(), ttl, None);
        (self.acquires.run(item).await).unwrap_or_else(|| Err(unanswered("acquire", key)))
    }

    async fn acquire_keeping_fence(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        keep: Duration,
    ) -> Result<AcquireReply> {
        crate::types::validate_ttl(ttl)?;
        let item = (key.clone(), token.clone(), ttl, Some(keep));
        (self.acquires.run(item).await).unwrap_or_else(|| Err(unanswered("acquire", key)))
    }

    async fn acquire_replicated(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        replicas: u32,
        timeout: Duration,
    ) -> Result<(AcquireReply, u32)> {
        crate::types::validate_ttl(ttl)?;
        // Checked here too: the trait method is public, and a zero timeout would block the
        // dedicated connection on the server.
        crate::types::validate_replica_timeout(timeout)?;
        let (answer, answered) = tokio::sync::oneshot::channel();
        let backend = self.clone();
        let (key, token) = (key.clone(), token.clone());
        let unheard = {
            let key = key.clone();
            move |_| Err(unanswered("acquire", &key))
        };
        // A task of its own, which a caller who leaves mid-way (a timeout around the acquire)
        // cannot cut short: a grant made for nobody is given back once the acquire was
        // answered, and an acquire left unanswered is given back behind it on its own
        // connection. Given back as other abandoned acquires are (on the shared connection, at
        // once), the release could reach the server before the acquire, find nothing, and
        // leave the grant holding the key for its TTL.
        let exchange = async move {
            if answer.is_closed() {
                return;
            }
            let mut conn = match backend.dedicated.take().await {
                Ok(conn) => conn,
                Err(e) => {
                    let _ = answer.send(Err(e));
                    return;
                }
            };
            let outcome = backend
                .replicated_on(&mut conn, &key, &token, (ttl, replicas, timeout), || {
                    answer.is_closed()
                })
                .await;
            // Not a WAIT's lost reply: `replicated_on` gave that grant back already. An
            // unreadable reply may be either's, and a second token-checked release is harmless.
            let unanswered = match &outcome {
                Err(Error::OutcomeUnknown { op, .. }) => *op == "acquire",
                Err(e) => e.may_have_landed(),
                Ok(_) => false,
            };
            // Back in the pool before the caller hears the answer, so that its next acquire
            // finds it there.
            let conn = match outcome {
                Ok(_) => {
                    backend.dedicated.give_back(conn);
                    None
                }
                Err(_) => Some(conn),
            };
            // A caller who left: the acquire was answered, so a release on the shared
            // connection cannot overtake it.
            if let Err(Ok((AcquireReply::Granted { .. }, _))) = answer.send(outcome) {
                debug!(
                    key = key.key(),
                    "replicated grant whose caller left; giving it back"
                );
                if let Err(e) = backend.release(&key, &token).await {
                    warn!(key = key.key(), error = %e, "abandoned replicated grant not given back; it expires with its TTL");
                }
            }
            // After the answer: the caller learns of the unknown outcome without waiting for
            // this round trip.
            if let (true, Some(conn)) = (unanswered, conn) {
                backend.give_back_unknown(conn, &key, &token).await;
            }
        };
        tokio::spawn(exchange.instrument(tracing::Span::current()));
        answered.await.unwrap_or_else(unheard)
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool> {
        let item = (key.clone(), token.clone());
        (self.releases.run(item).await).unwrap_or_else(|| Err(unanswered("release", key)))
    }

    /// In line once its script call was polled: redis-rs puts a request on its connection's
    /// queue on the first poll, and the connection sends in queue order. Not so in rarer cases,
    /// where the next acquire may overtake the release (and find the key held, at the cost of a
    /// round trip): a reconnection under way (both wait for it, and either may go first), a
    /// script the server no longer has (the release's `EVALSHA` is refused `NOSCRIPT` and sent
    /// again after the acquire), the connection replaced after a silent spell, redis-rs's
    /// queue full, the task's tokio budget spent at that poll, and an acquire waiting for
    /// replicas (it goes on a connection of its own).
    async fn release_in_line(
        &self,
        key: &LockKey,
        token: &Token,
        in_line: impl FnOnce() + Send + 'static,
    ) -> Result<bool> {
        let item = (key.clone(), token.clone());
        (self.releases.run_in_line(item, Some(in_line)).await)
            .unwrap_or_else(|| Err(unanswered("release", key)))
    }

    async fn extend(&self, items: &[(LockKey, Token)], ttl: Duration) -> Result<Vec<bool>> {
        crate::types::validate_ttl(ttl)?;
        // Chunks go out together on the multiplexed connection: one pipelined burst, no
        // per-lease round trip, and no single script long enough to stall the server.
        let calls = items
            .chunks(EXTEND_CHUNK)
            .map(|chunk| ops::extend(self.conn.clone(), &self.scripts, chunk, ttl));
        let answers = futures_util::future::try_join_all(calls).await?;
        Ok(answers.into_iter().flatten().collect())
    }

    async fn extend_each(
        &self,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Result<Vec<Option<bool>>> {
        crate::types::validate_ttl(ttl)?;
        let calls = items
            .chunks(EXTEND_CHUNK)
            .map(|chunk| ops::extend_each(self.conn.clone(), &self.scripts, chunk, ttl));
        let answers = futures_util::future::try_join_all(calls).await?;
        let answer = |a: Result<bool>| match a {
            Ok(held) => Some(held),
            Err(e) => {
                debug!(error = %e, "renewal refused for this lease's key alone; retried");
                None
            }
        };
        Ok(answers.into_iter().flatten().map(answer).collect())
    }

    async fn admit(&self, gate_key: &str, fence: u64) -> Result<Option<u64>> {
        ops::admit(&mut self.conn.clone(), &self.scripts, gate_key, fence).await
    }

    async fn watch(&self, key: &LockKey) -> Result<Watch> {
        Ok(watch_through(&self.wakeups, &self.subs, key).await)
    }

    fn wakeups(&self) -> &Arc<Wakeups> {
        &self.wakeups
    }

    // Its acquire batcher releases a grant whose caller left (`Acquires::unclaimed`).
    fn undoes_abandoned_grants(&self) -> bool {
        true
    }
}

/// The most channels one `SUBSCRIBE` or `UNSUBSCRIBE` carries: enough for a burst, short
/// enough that the server answers it at once.
const MAX_SUBSCRIBE_BATCH: usize = 256;

/// Queued subscription commands of one kind, sent as one command.
enum Run {
    Subscribe(Vec<(String, tokio::sync::oneshot::Sender<()>)>),
    Unsubscribe(Vec<String>),
}

/// `first` and the commands of its kind queued right behind it (up to
/// [`MAX_SUBSCRIBE_BATCH`]), and the first queued command of the other kind, which must wait for
/// this run to be sent.
fn take_run(rx: &mut mpsc::UnboundedReceiver<SubCmd>, first: SubCmd) -> (Run, Option<SubCmd>) {
    let mut run = match first {
        SubCmd::Subscribe(ch, ack) => Run::Subscribe(vec![(ch, ack)]),
        SubCmd::Unsubscribe(ch) => Run::Unsubscribe(vec![ch]),
    };
    loop {
        let len = match &run {
            Run::Subscribe(v) => v.len(),
            Run::Unsubscribe(v) => v.len(),
        };
        if len >= MAX_SUBSCRIBE_BATCH {
            return (run, None);
        }
        match (rx.try_recv(), &mut run) {
            (Ok(SubCmd::Subscribe(ch, ack)), Run::Subscribe(v)) => v.push((ch, ack)),
            (Ok(SubCmd::Unsubscribe(ch)), Run::Unsubscribe(v)) => v.push(ch),
            (Ok(other), _) => return (run, Some(other)),
            (Err(_), _) => return (run, None),
        }
    }
}

/// How long a subscription session must have lasted for the reconnect backoff to start over.
const STEADY_SESSION: Duration = Duration::from_secs(1);

/// How often the subscription connection is checked with a `PING`.
const SUBSCRIPTION_CHECK: Duration = Duration::from_secs(5);

/// The single subscription connection: reconnects, resubscribes, and on every (re)connect wakes
/// all waiters, since releases during the gap were not seen.
async fn subscriber(
    client: redis::Client,
    config: RedisConfig,
    wakeups: Arc<Wakeups>,
    mut rx: mpsc::UnboundedReceiver<SubCmd>,
) {
    let mut backoff = Duration::from_millis(20);
    // redis-rs gives pub/sub requests no response timeout of their own: without one a
    // connection that went silent would hold every later subscribe for ever.
    let bound = config.response_timeout;
    loop {
        let connected =
            tokio::time::timeout(config.connection_timeout, client.get_async_pubsub()).await;
        let (mut sink, mut stream) = match connected {
            Ok(Ok(p)) => p.split(),
            failed => {
                if let Ok(Err(e)) = failed {
                    debug!(error = %e, "subscription connect failed");
                }
                if !drain_while_down(&mut rx, backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        if !subscribe_all(&mut sink, wakeups.channels(), bound, |_| {}).await {
            // Broken as soon as made: back off as after a failed connect, not in a tight loop.
            if !drain_while_down(&mut rx, backoff).await {
                return;
            }
            backoff = (backoff * 2).min(Duration::from_secs(1));
            continue;
        }
        let session = tokio::time::Instant::now();
        wakeups.wake_all();
        let mut check = tokio::time::interval_at(
            tokio::time::Instant::now() + SUBSCRIPTION_CHECK,
            SUBSCRIPTION_CHECK,
        );
        loop {
            tokio::select! {
                _ = check.tick() => {
                    // A connection whose peer went away silently (a half-open TCP connection
                    // after a failover moved the address, a NAT entry that timed out) delivers
                    // nothing and never ends: only a request that goes unanswered shows it.
                    let pong = tokio::time::timeout(bound, sink.ping::<Value>()).await;
                    let alive = match &pong {
                        Ok(Ok(_)) => true,
                        Ok(Err(e)) => refused(e),
                        Err(_) => false,
                    };
                    if !alive {
                        warn!("subscription connection did not answer a PING; reconnecting");
                        break;
                    }
                }
                msg = stream.next() => match msg {
                    Some(msg) => wakeups.wake(msg.get_channel_name()),
                    None => {
                        warn!("subscription connection lost; waiters fall back to timers");
                        break;
                    }
                },
                cmd = rx.recv() => {
                    let Some(mut cmd) = cmd else { return };
                    // The commands queued behind this one go with it, a run of one kind per
                    // command: a burst of newly waited keys (or of keys whose last waiter
                    // left) costs one round trip, not one each in turn, under which the last
                    // ones' waiters would wait out their confirmation and give up on it, or
                    // wait behind a queue of unsubscribes. Runs keep their order: a channel's
                    // subscribe and unsubscribe alternate, and each goes in its own run.
                    let live = loop {
                        let (run, next) = take_run(&mut rx, cmd);
                        let live = match run {
                            Run::Subscribe(batch) => {
                                let channels = batch.iter().map(|(ch, _)| ch.clone()).collect();
                                let mut acks = batch.into_iter().map(|(_, ack)| ack);
                                // Confirmed after its waiter stopped waiting for it (a
                                // second): that waiter tried again and went to sleep on its
                                // timer, and a release published before this SUBSCRIBE reached
                                // the server went unheard. Its waiters try once more, now that
                                // releases reach them.
                                let confirmed = |ch: &str| {
                                    if let Some(ack) = acks.next()
                                        && ack.send(()).is_err()
                                    {
                                        wakeups.wake(ch);
                                    }
                                };
                                subscribe_all(&mut sink, channels, bound, confirmed).await
                            }
                            Run::Unsubscribe(channels) => {
                                let sent =
                                    tokio::time::timeout(bound, sink.unsubscribe(&channels)).await;
                                answered(sent, &channels.join(" "))
                            }
                        };
                        match next {
                            Some(c) if live => cmd = c,
                            _ => break live,
                        }
                    };
                    if !live {
                        break;
                    }
                }
            }
        }
        if session.elapsed() >= STEADY_SESSION {
            backoff = Duration::from_millis(20);
        } else {
            // Ended as soon as it started (a server or proxy that drops pub/sub clients after
            // the handshake): paced like a failed connect, since each new session wakes every
            // waiter, and each woken waiter asks the server again.
            if !drain_while_down(&mut rx, backoff).await {
                return;
            }
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
}

/// Subscribes to `channels` (a new connection's, or a burst of new ones): in one command, or,
/// when the server refuses that (one channel its ACL rule leaves out refuses them all), one at a
/// time, so that only the refused ones go without. `confirmed` is called for each channel, in
/// order, once it is subscribed or refused alone (in the one-at-a-time case as each is
/// answered, not when all are). False when the connection failed.
async fn subscribe_all(
    sink: &mut redis::aio::PubSubSink,
    channels: Vec<String>,
    bound: Duration,
    mut confirmed: impl FnMut(&str),
) -> bool {
    let Some(first) = channels.first() else {
        return true;
    };
    match tokio::time::timeout(bound, sink.subscribe(&channels)).await {
        Ok(Ok(())) => {
            channels.iter().for_each(|ch| confirmed(ch));
            true
        }
        Ok(Err(e)) if refused(&e) && channels.len() > 1 => {
            for ch in &channels {
                let sent = tokio::time::timeout(bound, sink.subscribe(ch)).await;
                if !answered(sent, ch) {
                    return false;
                }
                confirmed(ch);
            }
            true
        }
        // One channel refused alone (logged, and confirmed: its waiters fall back to their
        // timers), or a failed connection (logged).
        sent => {
            let live = answered(sent, first);
            if live {
                confirmed(first);
            }
            live
        }
    }
}

/// Whether a (un)subscribe left the connection usable: done, or refused by the server for its
/// channel alone (logged: that channel's waiters fall back to their timers).
fn answered(
    sent: std::result::Result<redis::RedisResult<()>, tokio::time::error::Elapsed>,
    channel: &str,
) -> bool {
    match sent {
        Ok(Ok(())) => true,
        Ok(Err(e)) if refused(&e) => {
            warn!(channel, error = %e, "subscription refused; waiters on this key fall back to timers");
            true
        }
        Ok(Err(e)) => {
            debug!(error = %e, "subscription connection failed");
            false
        }
        Err(_) => {
            warn!("subscription connection did not answer in time; reconnecting");
            false
        }
    }
}

/// A server's refusal of a command (`NOPERM`, ...), after which the connection still works.
fn refused(e: &redis::RedisError) -> bool {
    matches!(e.kind(), redis::ErrorKind::Server(_))
}

/// While disconnected, answer subscribe requests at once (the waiter keeps its timer) and sleep
/// the backoff. Returns false when the backend is gone.
pub(super) async fn drain_while_down(
    rx: &mut mpsc::UnboundedReceiver<SubCmd>,
    backoff: Duration,
) -> bool {
    let sleep = tokio::time::sleep(backoff);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            _ = &mut sleep => return true,
            cmd = rx.recv() => if cmd.is_none() {
                return false;
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No script formats a number with `%d`: the server's Lua formats it through a C `long`,
    /// 32 bits on some builds (ARMv7, 32-bit x86), where a clock in microseconds, a fence or
    /// a large expiry would wrap (a fence would go backwards). `%.0f` is exact to 2^53 on
    /// every build.
    #[test]
    fn no_script_formats_an_integer_through_a_c_long() {
        for (name, script) in [
            ("acquire.lua", include_str!("../lua/acquire.lua")),
            ("extend.lua", include_str!("../lua/extend.lua")),
            ("extend_node.lua", include_str!("../lua/extend_node.lua")),
            ("fence_gate.lua", include_str!("../lua/fence_gate.lua")),
            ("queue_claim.lua", include_str!("../lua/queue_claim.lua")),
            ("queue_common.lua", include_str!("../lua/queue_common.lua")),
            (
                "queue_complete.lua",
                include_str!("../lua/queue_complete.lua"),
            ),
            (
                "queue_enqueue.lua",
                include_str!("../lua/queue_enqueue.lua"),
            ),
            ("queue_extend.lua", include_str!("../lua/queue_extend.lua")),
            ("queue_fail.lua", include_str!("../lua/queue_fail.lua")),
            (
                "queue_inspect.lua",
                include_str!("../lua/queue_inspect.lua"),
            ),
            ("queue_purge.lua", include_str!("../lua/queue_purge.lua")),
            ("queue_reap.lua", include_str!("../lua/queue_reap.lua")),
            ("queue_retry.lua", include_str!("../lua/queue_retry.lua")),
            (
                "quorum_acquire.lua",
                include_str!("../lua/quorum_acquire.lua"),
            ),
            ("quorum_fence.lua", include_str!("../lua/quorum_fence.lua")),
            ("release.lua", include_str!("../lua/release.lua")),
        ] {
            for (i, line) in script.lines().enumerate() {
                let code = line.split("--").next().unwrap_or_default();
                assert!(
                    !code.contains("format('%d'") && !code.contains("format(\"%d\""),
                    "{name}:{}: {line}",
                    i + 1
                );
            }
        }
    }

    /// A call refused for a key, as Redis 7.0 and Redis 7.2+/Valkey word it, is told from a
    /// command refused to a user whose name holds "key", and from other refusals.
    #[test]
    fn a_refusal_for_a_key_is_told_by_its_words() {
        let refused = |line: &str| ops::refused_for_a_key(&crate::error::error_reply(line));
        assert!(refused(
            "NOPERM this user has no permissions to access one of the keys used as arguments"
        ));
        assert!(refused("NOPERM No permissions to access a key"));
        assert!(!refused(
            "NOPERM User monkey has no permissions to run the 'evalsha' command"
        ));
        assert!(!refused("NOPERM No permissions to access a channel"));
        assert!(!refused(
            "ERR ACL failure in script: No permissions to access a key"
        ));
    }

    /// Each status of `acquire.lua` with the value it comes with is read; with any other value
    /// it is an unreadable reply (which the locker asks again about), never a verdict.
    #[test]
    fn acquire_replies_are_read_strictly() {
        let key = LockKey::new("", "k");
        let read =
            |status: i64, value: Value| ops::acquire_reply(&key, &Value::Int(status), &value);
        let text = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert!(matches!(
            read(1, Value::Int(7)),
            Ok(AcquireReply::Granted {
                fence: 7,
                valid_from: None
            })
        ));
        let held = read(0, Value::Int(1500));
        assert!(
            matches!(held, Ok(AcquireReply::Held { remaining: Some(d) }) if d.as_millis() == 1500),
            "{held:?}"
        );
        assert!(matches!(
            read(0, Value::Int(-1)),
            Ok(AcquireReply::Held { remaining: None })
        ));
        assert!(matches!(
            read(-1, text("list")),
            Err(Error::WrongType { .. })
        ));
        assert!(matches!(
            read(-3, text("OOM command not allowed")),
            Err(Error::Refused { .. })
        ));
        for (status, value) in [
            (0, Value::Nil),
            (0, text("1500")),
            (-1, Value::Nil),
            (-2, Value::Int(3)),
            (-3, Value::Nil),
            (-3, Value::Array(vec![])),
            (2, Value::Int(1)),
        ] {
            let r = read(status, value.clone());
            assert!(
                matches!(&r, Err(e) if e.may_have_landed()),
                "{status}, {value:?}: {r:?}"
            );
        }
    }

    /// A CA given without the `tls` feature is refused before any connection, not ignored (the
    /// connection would then trust the platform's roots instead of the CA asked for).
    #[test]
    fn a_tls_root_needs_the_tls_feature() {
        let config = RedisConfig::default().tls_root_pem(b"a CA in PEM".to_vec());
        assert!(config.validate_for(true).is_ok());
        let refused = config.validate_for(false);
        assert!(
            matches!(refused, Err(Error::Unsupported { .. })),
            "{refused:?}"
        );
        assert!(RedisConfig::default().validate_for(false).is_ok());
        assert_eq!(
            config.validate().is_ok(),
            cfg!(feature = "tls"),
            "this build"
        );
    }
}
