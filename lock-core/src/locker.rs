use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tracing::{Instrument, debug, debug_span, instrument, warn};

use crate::backend::{
    AcquireReply, AnyBackend, Backend, ClusterBackend, MemoryBackend, QuorumBackend, QuorumConfig,
    RedisBackend, RedisConfig,
};
use crate::error::{Error, Result};
use crate::lease::{Lease, LeaseInfo, Release};
use crate::renew::{self, Cmd, Inbox, LeaseState};
use crate::turnstile::{NoTurn, Turnstiles};
use crate::types::{
    Fence, LockKey, Token, drift, validate_key, validate_scope, validate_ttl, warn_ahead,
};

/// How one acquisition behaves. The defaults follow the common convention: a 30 s lease renewed
/// automatically, and [`Locker::acquire`] waiting up to 10 s.
///
/// ```
/// use lock_core::LockOptions;
/// use std::time::Duration;
/// let opts = LockOptions::new().ttl(Duration::from_secs(5)).wait(Duration::from_secs(1)).renew(false);
/// assert_eq!(opts.ttl_value(), Duration::from_secs(5));
/// ```
#[derive(Clone, Debug)]
pub struct LockOptions {
    ttl: Duration,
    wait: Duration,
    renew: bool,
    replicas: u32,
    replica_timeout: Duration,
    keep_fence: Option<Duration>,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: Duration::from_secs(30),
            wait: Duration::from_secs(10),
            renew: true,
            replicas: 0,
            replica_timeout: Duration::from_millis(100),
            keep_fence: None,
        }
    }
}

impl LockOptions {
    /// The defaults: ttl 30 s, wait 10 s, renewal on.
    ///
    /// ```
    /// use lock_core::LockOptions;
    /// use std::time::Duration;
    /// let opts = LockOptions::new();
    /// assert_eq!(opts.ttl_value(), Duration::from_secs(30));
    /// assert_eq!(opts.wait_value(), Duration::from_secs(10));
    /// ```
    pub fn new() -> LockOptions {
        LockOptions::default()
    }
    /// The lease's time to live on the server.
    /// From [`MIN_TTL`](crate::MIN_TTL) to [`MAX_TTL`](crate::MAX_TTL); anything else is
    /// refused with [`Error::InvalidTtl`] before any round trip.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Error, LockOptions, Locker};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::memory();
    /// let opts = LockOptions::new().ttl(Duration::from_secs(5));
    /// let lease = locker.acquire("nightly", &opts).await?;
    /// assert!(lease.remaining() <= Duration::from_secs(5));
    /// let zero = LockOptions::new().ttl(Duration::ZERO);
    /// assert!(matches!(locker.acquire("other", &zero).await, Err(Error::InvalidTtl { .. })));
    /// # Ok(()) }
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }
    /// How long [`Locker::acquire`] waits for a busy key before [`Error::WaitTimeout`];
    /// `Duration::MAX` waits as long as it takes.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Error, LockOptions, Locker};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::memory();
    /// let held = locker.acquire("import", &LockOptions::new()).await?;
    /// let brief = LockOptions::new().wait(Duration::from_millis(20));
    /// assert!(matches!(locker.acquire("import", &brief).await, Err(Error::WaitTimeout { .. })));
    /// held.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }
    /// Whether the locker renews the lease automatically while the guard lives.
    /// Off, the lease runs out after its TTL unless [`Lease::extend`] is called.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::memory();
    /// let opts = LockOptions::new().ttl(Duration::from_millis(50)).renew(false);
    /// let lease = locker.acquire("once", &opts).await?;
    /// lease.lost().await; // a little before the 50 ms are up
    /// assert!(lease.is_lost());
    /// # Ok(()) }
    /// ```
    pub fn renew(mut self, renew: bool) -> Self {
        self.renew = renew;
        self
    }
    /// Hands a lease out only once `replicas` replicas of the server acknowledge the grant
    /// (`WAIT`, on a connection of its own so the shared one never stalls), so that a failover
    /// to one of them keeps it. Fewer acknowledgements within
    /// [`replica_timeout`](Self::replica_timeout) release the grant and return
    /// [`Error::NotReplicated`]. Zero (the default) does not wait. Redis/Valkey standalone only.
    ///
    /// This narrows, but does not close, the failover window: replication stays asynchronous
    /// for writes after the grant, and a replica that acknowledged can still lose a later
    /// renewal. The fence remains what protects the data.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::redis("redis://127.0.0.1:6379/").await?;
    /// let opts = LockOptions::new().replicas(1).replica_timeout(Duration::from_millis(50));
    /// let lease = locker.acquire("failover-safe", &opts).await?; // or Error::NotReplicated
    /// # lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn replicas(mut self, replicas: u32) -> Self {
        self.replicas = replicas;
        self
    }
    /// How long an acquire waits for the replicas' acknowledgement (default 100 ms; from 1 ms
    /// to [`MAX_TTL`](crate::MAX_TTL), else [`Error::InvalidDuration`] when replicas are asked
    /// for).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use lock_core::{Error, LockOptions, Locker};
    /// use std::time::Duration;
    ///
    /// let opts = LockOptions::new().replicas(1).replica_timeout(Duration::ZERO);
    /// let refused = Locker::memory().acquire("k", &opts).await;
    /// assert!(matches!(refused, Err(Error::InvalidDuration { what: "replica timeout", .. })));
    /// # }
    /// ```
    pub fn replica_timeout(mut self, timeout: Duration) -> Self {
        self.replica_timeout = timeout;
        self
    }
    /// Keeps the key's fence only `keep` past each grant (or the lease's TTL, if longer)
    /// instead of for ever, for keys used once or a few times: delivery ids, request ids, job
    /// ids. By default a fence key stays for good, one small value per key ever locked (on the
    /// in-memory backend, one map entry), which keys without end would pile up.
    ///
    /// What it costs: a grant after the fence was forgotten takes its fence from the clock
    /// alone (the server's in microseconds, or this process's on the in-memory backend). A
    /// fence is kept until the clock has passed it by `keep` (one ahead of the clock, as
    /// after a step back, stays that much longer; an exhausted one stays for good), so fences
    /// keep rising unless the clock steps back by more than `keep` after that. The in-memory backend forgets in sweeps, so its entries can stay a while
    /// past `keep` (it keeps at most about twice the keys still in use). A quorum and an
    /// acquire that waits for [`replicas`](Self::replicas) keep the fence for ever, as
    /// without this option. From 1 ms to [`MAX_KEEP_FENCE`](crate::MAX_KEEP_FENCE) (a year),
    /// else [`Error::InvalidDuration`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::memory();
    /// let once = LockOptions::new().keep_fence(Duration::from_secs(24 * 3600));
    /// let lease = locker.try_acquire("delivery:msg_2Jx9", &once).await?;
    /// // ... handle the delivery, writing with lease.fence() ...
    /// lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn keep_fence(mut self, keep: Duration) -> Self {
        self.keep_fence = Some(keep);
        self
    }
    /// Checks the options before any round trip.
    fn validate(&self) -> Result<()> {
        validate_ttl(self.ttl)?;
        if let Some(keep) = self.keep_fence {
            let reason = if keep < Duration::from_millis(1) {
                "below 1 ms"
            } else if keep > crate::MAX_KEEP_FENCE {
                "above MAX_KEEP_FENCE (a year)"
            } else {
                ""
            };
            if !reason.is_empty() {
                return Err(Error::InvalidDuration {
                    what: "fence keep",
                    value: keep,
                    reason,
                });
            }
        }
        if self.replicas > 0 {
            crate::types::validate_replica_timeout(self.replica_timeout)?;
        }
        Ok(())
    }
    /// The configured TTL.
    ///
    /// ```
    /// # use lock_core::LockOptions; use std::time::Duration;
    /// let opts = LockOptions::new().ttl(Duration::from_secs(3));
    /// assert_eq!(opts.ttl_value(), Duration::from_secs(3));
    /// ```
    pub fn ttl_value(&self) -> Duration {
        self.ttl
    }
    /// The configured wait.
    ///
    /// ```
    /// # use lock_core::LockOptions; use std::time::Duration;
    /// assert_eq!(LockOptions::new().wait(Duration::ZERO).wait_value(), Duration::ZERO);
    /// ```
    pub fn wait_value(&self) -> Duration {
        self.wait
    }
}

pub(crate) struct Core<B: Backend + Clone> {
    pub(crate) backend: B,
    prefix: String,
    next_id: AtomicU64,
    driver: OnceLock<Arc<Inbox>>,
    turnstiles: Arc<Turnstiles>,
}

impl<B: Backend + Clone> Core<B> {
    /// Hands a command to the renewal driver, starting it on the current runtime when none
    /// runs: on first use, and again when the runtime it ran on has shut down (a `Locker` kept
    /// in a static and used from one `#[tokio::test]` runtime after another, say), which would
    /// otherwise leave every later lease unrenewed and every dropped guard unreleased.
    pub(crate) fn send(&self, cmd: Cmd) {
        let inbox = self.driver.get_or_init(Inbox::new);
        if !inbox.running.load(Ordering::Acquire)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
            && inbox
                .running
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            renew::spawn(&runtime, self.backend.clone(), inbox.clone());
        }
        inbox.push(cmd);
    }

    /// Whether a command sent now is taken soon: a driver runs, or this thread is in a runtime
    /// that [`send`](Self::send) starts one on.
    pub(crate) fn driver_can_run(&self) -> bool {
        self.driver
            .get()
            .is_some_and(|inbox| inbox.running.load(Ordering::Acquire))
            || tokio::runtime::Handle::try_current().is_ok()
    }

    /// Hands a command to a renewal driver that already runs, and returns whether it did: with
    /// none (and no runtime here to start one on), nothing would ever take it, and queued it
    /// would stay for the locker's life.
    pub(crate) fn send_if_running(&self, cmd: Cmd) -> bool {
        match self.driver.get() {
            Some(inbox) if inbox.running.load(Ordering::Acquire) => {
                inbox.push(cmd);
                true
            }
            _ => false,
        }
    }
}

impl<B: Backend + Clone> Drop for Core<B> {
    fn drop(&mut self) {
        // Every locker handle and lease is gone: the driver releases what dropped guards left
        // and stops.
        if let Some(inbox) = self.driver.get() {
            inbox.close();
        }
    }
}

/// The next pause of a waiter with no holder's TTL to go by: `backoff` doubled (to 500 ms at
/// most), jittered between half and one and a half of it.
fn next_backoff(backoff: &mut Duration) -> Duration {
    *backoff = (*backoff * 2).min(Duration::from_millis(500));
    jitter(*backoff) + *backoff / 2
}

/// How long a waiter sleeps before its next attempt when no wake-up comes: the holder's
/// remaining TTL and a little jitter (so that waiters who saw the same TTL do not all ask at
/// once), or the next backoff for a holder without one.
fn timer(remaining: Option<Duration>, backoff: &mut Duration) -> Duration {
    match remaining {
        Some(r) => r + jitter(Duration::from_millis(5)),
        None => next_backoff(backoff),
    }
}

/// How many grants that came back after their validity end a waiting acquire.
const MAX_LATE_GRANTS: u32 = 3;

/// What one acquire round trip came to.
enum Attempt<B: Backend + Clone> {
    Granted(Lease<B>),
    /// Held by another, with its remaining TTL when it has one.
    Held(Option<Duration>),
    /// Granted, but the reply came after the grant's validity: it is being given back.
    Late,
}

/// An acquire in flight: dropped before its answer came (the caller's future dropped), it
/// releases what the acquire may have granted.
struct Abandoned<'a, B: Backend + Clone> {
    locker: &'a Locker<B>,
    key: &'a LockKey,
    token: &'a Token,
    armed: bool,
}

impl<B: Backend + Clone> Drop for Abandoned<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            self.locker.release_in_background(self.key, self.token);
        }
    }
}

/// Takes leases on one backend. Cheap to clone; clones share the backend, the renewal driver and
/// the wake-up subscription.
///
/// The renewal driver is a task on the runtime that first used the locker (started again on a
/// later one once that runtime has shut down): use a locker from one runtime at a time, and
/// give runtimes that run side by side a locker each. Leases taken on a second runtime are
/// renewed only while the first one is driven, and on Redis the calls that queue behind one in
/// flight (acquires and releases sent together) are sent from a task on the runtime of the
/// call that queued first: if that runtime stops being driven but is not shut down (a
/// current-thread runtime between `block_on` calls), they wait until it is driven again.
///
/// ```
/// use lock_core::{Locker, LockOptions};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// let locker = Locker::memory();
/// let lease = locker.acquire("payments:7", &LockOptions::default()).await?;
/// // ... work, passing lease.fence() to the resource ...
/// lease.release().await?;
/// # Ok(()) }
/// ```
pub struct Locker<B: Backend + Clone = AnyBackend> {
    core: Arc<Core<B>>,
}

impl<B: Backend + Clone> Clone for Locker<B> {
    fn clone(&self) -> Self {
        Locker {
            core: self.core.clone(),
        }
    }
}

/// The key prefix, which tells lockers apart in a log (so that a `Locker` can sit in a
/// `#[derive(Debug)]` state struct).
///
/// ```
/// let locker = lock_core::Locker::memory().with_prefix("billing")?;
/// assert_eq!(format!("{locker:?}"), r#"Locker { prefix: "billing", .. }"#);
/// # Ok::<(), lock_core::Error>(())
/// ```
impl<B: Backend + Clone> std::fmt::Debug for Locker<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locker")
            .field("prefix", &self.core.prefix)
            .finish_non_exhaustive()
    }
}

/// The key prefix used unless [`Locker::with_prefix`] says otherwise.
///
/// ```
/// use lock_core::{DEFAULT_PREFIX, Locker};
/// let names = Locker::memory().lock_key("k")?;
/// assert_eq!(names.lock_key(), format!("{{{DEFAULT_PREFIX}:k}}:lock"));
/// # Ok::<(), lock_core::Error>(())
/// ```
pub const DEFAULT_PREFIX: &str = "leasehold";

impl Locker<AnyBackend> {
    /// A locker on a fresh in-memory backend.
    ///
    /// Every `Locker::memory()` is a lock space of its own; clone the locker to share it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    ///
    /// let locker = Locker::memory();
    /// let other_task = locker.clone(); // the same locks
    /// let lease = locker.try_acquire("k", &LockOptions::new()).await?;
    /// assert!(other_task.try_acquire("k", &LockOptions::new()).await.is_err());
    /// # lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn memory() -> Locker {
        Locker::new(AnyBackend::Memory(MemoryBackend::new()))
    }

    /// A locker on a Redis or Valkey server at `url`.
    ///
    /// Connects once (one multiplexed connection, reconnecting on its own, shared by every lease
    /// of the locker and its clones); [`Error::Unavailable`] if the server cannot be reached.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    ///
    /// let locker = Locker::redis("redis://127.0.0.1:6379/").await?;
    /// let lease = locker.acquire("payments:7", &LockOptions::new()).await?;
    /// lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub async fn redis(url: &str) -> Result<Locker> {
        Ok(Locker::new(AnyBackend::Redis(
            RedisBackend::connect(url).await?,
        )))
    }

    /// A locker on a Redis or Valkey Cluster, reached through any of `nodes`.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    ///
    /// let nodes = ["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"];
    /// let locker = Locker::redis_cluster(&nodes).await?;
    /// let lease = locker.acquire("payments:7", &LockOptions::new()).await?;
    /// lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub async fn redis_cluster(nodes: &[&str]) -> Result<Locker> {
        Ok(Locker::new(AnyBackend::Cluster(
            ClusterBackend::connect(nodes).await?,
        )))
    }

    /// A locker on a Redis or Valkey Cluster, with explicit connection settings (timeouts, and
    /// the certificate authority for `rediss://` nodes).
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Locker, RedisConfig};
    /// use std::time::Duration;
    ///
    /// let nodes = ["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"];
    /// let config = RedisConfig::default().response_timeout(Duration::from_millis(500));
    /// let locker = Locker::redis_cluster_with(&nodes, config).await?;
    /// # Ok(()) }
    /// ```
    pub async fn redis_cluster_with(nodes: &[&str], config: RedisConfig) -> Result<Locker> {
        Ok(Locker::new(AnyBackend::Cluster(
            ClusterBackend::connect_with(nodes, config).await?,
        )))
    }

    /// A locker on a Redlock quorum of independent Redis or Valkey servers (3 or 5, each given
    /// as `redis://host:port/db`), with fences that keep increasing when the majority changes
    /// (see [`QuorumBackend`]).
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    ///
    /// let locker = Locker::redlock(&[
    ///     "redis://10.0.0.1:6379/",
    ///     "redis://10.0.0.2:6379/",
    ///     "redis://10.0.0.3:6379/",
    /// ])
    /// .await?;
    /// let lease = locker.acquire("payments:7", &LockOptions::new()).await?;
    /// lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub async fn redlock(urls: &[&str]) -> Result<Locker> {
        Ok(Locker::new(AnyBackend::Quorum(
            QuorumBackend::connect(urls).await?,
        )))
    }

    /// A locker on a Redlock quorum, with explicit settings.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Locker, QuorumConfig};
    /// use std::time::Duration;
    ///
    /// let config = QuorumConfig::default().member_timeout(Duration::from_millis(20));
    /// let urls = ["redis://10.0.0.1:6379/", "redis://10.0.0.2:6379/", "redis://10.0.0.3:6379/"];
    /// let locker = Locker::redlock_with(&urls, config).await?;
    /// # Ok(()) }
    /// ```
    pub async fn redlock_with(urls: &[&str], config: QuorumConfig) -> Result<Locker> {
        Ok(Locker::new(AnyBackend::Quorum(
            QuorumBackend::connect_with(urls, config).await?,
        )))
    }

    /// A locker on a Redis or Valkey server, with explicit connection settings.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Locker, RedisConfig};
    /// use std::time::Duration;
    ///
    /// let config = RedisConfig::default().response_timeout(Duration::from_millis(500));
    /// let locker = Locker::redis_with("redis://127.0.0.1:6379/", config).await?;
    /// # Ok(()) }
    /// ```
    pub async fn redis_with(url: &str, config: RedisConfig) -> Result<Locker> {
        Ok(Locker::new(AnyBackend::Redis(
            RedisBackend::connect_with(url, config).await?,
        )))
    }
}

impl<B: Backend + Clone> Locker<B> {
    /// A locker on any backend, with the default key prefix.
    ///
    /// A locker typed by its backend skips the [`AnyBackend`] dispatch, and lets code reach
    /// backend-specific methods through [`backend`](Self::backend).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker, MemoryBackend};
    ///
    /// let locker: Locker<MemoryBackend> = Locker::new(MemoryBackend::new());
    /// let lease = locker.try_acquire("k", &LockOptions::new()).await?;
    /// # lease.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn new(backend: B) -> Locker<B> {
        Locker {
            core: Arc::new(Core {
                backend,
                prefix: DEFAULT_PREFIX.to_owned(),
                next_id: AtomicU64::new(1),
                driver: OnceLock::new(),
                turnstiles: Arc::default(),
            }),
        }
    }

    /// The same backend under another key prefix (server keys become `{prefix:key}:...`), so
    /// that keys under two prefixes are two locks. The prefix obeys the rules of a key (not
    /// empty, no braces, no control characters) and has no `:`, else [`Error::InvalidKey`]:
    /// with one, prefix `a:b` and key `c` would name the lock of prefix `a` and key `b:c`.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    ///
    /// let billing = Locker::memory();
    /// let reports = billing.with_prefix("reports")?;
    /// let opts = LockOptions::new();
    /// let a = billing.try_acquire("nightly", &opts).await?;
    /// let b = reports.try_acquire("nightly", &opts).await?; // another lock
    /// # a.release().await?; b.release().await?;
    /// assert!(billing.with_prefix("bad}prefix").is_err());
    /// assert!(billing.with_prefix("billing:reports").is_err());
    /// # Ok(()) }
    /// ```
    pub fn with_prefix(&self, prefix: impl Into<String>) -> Result<Locker<B>> {
        let prefix = prefix.into();
        // A brace would end the hash tag early and split a lock's keys across cluster slots.
        validate_scope(&prefix)?;
        self.with_any_prefix(prefix)
    }

    /// The same backend, with keys in a namespace of their own that no plain locker can name,
    /// whatever its prefix and keys: for a library that takes locks on a caller's locker under
    /// names built from untrusted input (`lock-tower`'s `DedupeLayer` keeps its claims here, so
    /// that a `LockLayer` key taken from a request cannot hold a delivery's claim). Server keys
    /// become `{prefix:\x1Fnamespace:key}:...`: the unit separator (0x1F) is a control character,
    /// which no key, prefix or namespace may contain. The
    /// namespace obeys the rules of a prefix (see [`with_prefix`](Self::with_prefix)), else
    /// [`Error::InvalidKey`].
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    ///
    /// let locker = Locker::memory();
    /// let claims = locker.with_namespace("dedupe")?;
    /// assert_eq!(claims.lock_key("42")?.lock_key(), "{leasehold:\x1Fdedupe:42}:lock");
    /// let opts = LockOptions::new();
    /// // A plain key spelled like the claim's name is another lock.
    /// let plain = locker.try_acquire("dedupe:42", &opts).await?;
    /// let claim = claims.try_acquire("42", &opts).await?;
    /// # plain.release().await?; claim.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn with_namespace(&self, namespace: &str) -> Result<Locker<B>> {
        validate_scope(namespace)?;
        self.with_any_prefix(format!("{}:\u{1f}{namespace}", self.core.prefix))
    }

    /// A locker on this backend under `prefix`, checked by the caller; a new `Core`, so its
    /// leases have a renewal driver and turnstiles of their own.
    fn with_any_prefix(&self, prefix: String) -> Result<Locker<B>> {
        Ok(Locker {
            core: Arc::new(Core {
                backend: self.core.backend.clone(),
                prefix,
                next_id: AtomicU64::new(1),
                driver: OnceLock::new(),
                turnstiles: Arc::default(),
            }),
        })
    }

    /// The backend this locker runs on.
    ///
    /// ```
    /// use lock_core::{AnyBackend, Locker};
    ///
    /// let locker = Locker::memory();
    /// assert!(matches!(locker.backend(), AnyBackend::Memory(_)));
    /// ```
    pub fn backend(&self) -> &B {
        &self.core.backend
    }

    /// The server-side names of `key` under this locker's prefix: one hash tag, so that the
    /// lock and fence keys share a cluster slot.
    ///
    /// ```
    /// let locker = lock_core::Locker::memory();
    /// let names = locker.lock_key("invoice-42")?;
    /// assert_eq!(names.lock_key(), "{leasehold:invoice-42}:lock");
    /// assert_eq!(names.fence_key(), "{leasehold:invoice-42}:fence");
    /// assert!(locker.lock_key("").is_err());
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn lock_key(&self, key: &str) -> Result<LockKey> {
        validate_key(key)?;
        Ok(LockKey::new(&self.core.prefix, key))
    }

    /// Takes the lease if it is free, in one round trip; otherwise [`Error::Busy`] with the
    /// holder's remaining TTL.
    ///
    /// It never waits, so it never queues: a free key is taken at once, even while tasks of this
    /// locker wait for it in [`acquire`](Self::acquire).
    ///
    /// A grant whose reply arrives after its validity (ttl less drift, counted from before the
    /// request), or so near its end that it would count as lost at once (see
    /// [`Lease::lost`]), is released and reported as [`Error::LeaseLost`]: a lease is never
    /// handed out already expired.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Error, LockOptions, Locker};
    ///
    /// let locker = Locker::memory();
    /// let opts = LockOptions::new();
    /// let lease = locker.try_acquire("report", &opts).await?;
    /// match locker.try_acquire("report", &opts).await {
    ///     Err(Error::Busy { remaining, .. }) => assert!(remaining.is_some()),
    ///     other => panic!("want Busy, got {other:?}"),
    /// }
    /// lease.release().await?;
    /// # Ok(()) }
    /// ```
    #[instrument(level = "debug", skip(self, opts), fields(ttl = ?opts.ttl))]
    pub async fn try_acquire(&self, key: &str, opts: &LockOptions) -> Result<Lease<B>> {
        let key = self.lock_key(key)?;
        opts.validate()?;
        let token = self.core.backend.token();
        match self.attempt(&key, &token, opts).await? {
            Attempt::Granted(lease) => Ok(lease),
            Attempt::Held(remaining) => Err(Error::Busy {
                key: key.key().to_owned(),
                remaining,
            }),
            Attempt::Late => Err(Error::LeaseLost {
                key: key.key().to_owned(),
            }),
        }
    }

    /// Takes the lease, waiting up to the options' `wait` for the holder to release it.
    ///
    /// Waiters wake when the holder releases (a release publishes on the key's channel, and one
    /// subscription per locker serves every waited key), and otherwise when the holder's TTL runs
    /// out plus a small jitter, which covers holders that crashed without releasing.
    ///
    /// Waiters of one locker take turns in arrival order: only the first asks the server, and a
    /// task that asks again after releasing queues behind them. Waiters in other processes still
    /// race for the key when it frees.
    ///
    /// The wait is for a busy key, not for a server in trouble: an error ends it at once (a
    /// server gone away, a refusal, no quorum), so that an outage does not hold every waiting
    /// caller for its whole wait. Retry on [`Error::is_transient`] to ride out a failover. A
    /// transient error of the waiter asking the server ends the waiters of this locker queued
    /// behind it for the same key too, at once, with [`Error::Unavailable`] naming it (nothing
    /// of theirs was sent): otherwise each would spend an attempt's timeouts in turn, and the
    /// last ones would run out their wait and end with a `WaitTimeout`, which is not transient.
    /// (A waiter whose own wait ends before that first attempt's error comes still ends with
    /// `WaitTimeout`.) Only failures on the shared connection are passed on this way, not those
    /// of an acquire waiting for [`replicas`](LockOptions::replicas), which uses connections of
    /// its own.
    ///
    /// The wait bounds the time between attempts, not an attempt already sent when it runs
    /// out: that one is answered first. On a slow or unreachable server an attempt can take the
    /// backend's response timeout, twice when its reply is lost and it is sent again to learn
    /// whether it landed (and, with [`replicas`](LockOptions::replicas), the replica timeout
    /// on top), so a short wait on a failing server ends with its error that much later. On a
    /// Redlock quorum one attempt is up to [`QuorumConfig::retries`](crate::QuorumConfig::retries)
    /// more rounds after a split vote (no one with a majority), each after a pause of up to
    /// [`retry_delay`](crate::QuorumConfig::retry_delay) (about 0.5 s in all with the
    /// defaults), so a wait shorter than that (or [`try_acquire`](Self::try_acquire)) can end
    /// that much after its deadline.
    ///
    /// A grant whose reply comes too late to be handed out (see
    /// [`try_acquire`](Self::try_acquire)) is given back and the wait goes on after a pause,
    /// with a new token. One that comes when the wait is over, or the third in one call (a TTL
    /// too short for the link), is reported as [`Error::LeaseLost`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{LockOptions, Locker};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::memory();
    /// let opts = LockOptions::new().wait(Duration::from_secs(5));
    /// let first = locker.acquire("account:7", &opts).await?;
    /// let fence = first.fence();
    /// let waiter = tokio::spawn({
    ///     let locker = locker.clone();
    ///     let opts = opts.clone();
    ///     async move { locker.acquire("account:7", &opts).await }
    /// });
    /// first.release().await?; // wakes the waiter at once
    /// let second = waiter.await.expect("the waiter task")?;
    /// assert!(second.fence() > fence);
    /// # second.release().await?;
    /// # Ok(()) }
    /// ```
    #[instrument(level = "debug", skip(self, opts), fields(ttl = ?opts.ttl, wait = ?opts.wait))]
    pub async fn acquire(&self, key: &str, opts: &LockOptions) -> Result<Lease<B>> {
        let key = self.lock_key(key)?;
        opts.validate()?;
        let mut token = self.core.backend.token();
        let started = Instant::now();
        let give_up = crate::types::deadline_after(started, opts.wait);
        let turn = self.core.turnstiles.enter(key.key());
        let permit = match turn.wait_turn(give_up).await {
            Ok(permit) => permit,
            Err(NoTurn::TimedOut) => {
                return Err(Error::WaitTimeout {
                    key: key.key().to_owned(),
                    waited: started.elapsed(),
                });
            }
            // Nothing of this call was sent: not reached, rather than an unknown outcome.
            Err(NoTurn::AheadFailed(what)) => {
                return Err(Error::Unavailable(redis::RedisError::from(
                    std::io::Error::other(format!(
                        "an acquire of the same key ahead of this one in the Locker's queue \
                         failed: {what}"
                    )),
                )));
            }
        };
        let mut watch = None;
        // A subscription not yet confirmed, waited for again after an attempt its timer made.
        let mut subscribing = None;
        let mut backoff = Duration::from_millis(5);
        let mut late = 0;
        loop {
            if let Some(w) = watch.as_mut() {
                crate::wake::Watch::mark_seen(w);
            }
            let attempt = self.attempt(&key, &token, opts).await;
            // A failure on the dedicated connections of a replicated acquire says nothing of
            // the shared one the waiters behind may use.
            let attempt = attempt.map_err(|e| match opts.replicas {
                0 => turn.failed(e),
                _ => e,
            });
            let remaining = match attempt? {
                Attempt::Granted(mut lease) => {
                    debug!(waited = ?started.elapsed(), fence = lease.fence.0, "acquired");
                    turn.hold(lease.state.clone(), permit);
                    lease.turn = Some(turn);
                    return Ok(lease);
                }
                Attempt::Held(remaining) => {
                    // A fresh token for the next attempt, as after a late grant below: on a
                    // quorum, this attempt's give-backs to members that voted for it may still
                    // be on their way, token-checked, and with the same token they would take
                    // back the votes the next attempt wins there.
                    token = self.core.backend.token();
                    if watch.is_some() && self.core.backend.held_wakes_waiters() {
                        // This attempt's give-backs publish on the key's channel and wake this
                        // waiter at once: without a pause it would ask again every round trip
                        // while a majority still holds the key. A release meanwhile is not
                        // missed: its wake-up is still there when the wait below begins.
                        let now = Instant::now();
                        tokio::time::sleep_until((now + next_backoff(&mut backoff)).min(give_up))
                            .await;
                    }
                    remaining
                }
                // A grant whose reply came too late to be handed out is being given back:
                // within the wait it is one more attempt that did not win, since a loaded
                // machine or a slow link makes a late reply a passing thing. Not forever: a
                // TTL too short for the link would take the key and wake every waiter on
                // each try, so a few late grants end the wait.
                Attempt::Late => {
                    late += 1;
                    let now = Instant::now();
                    if late >= MAX_LATE_GRANTS || now >= give_up {
                        return Err(Error::LeaseLost {
                            key: key.key().to_owned(),
                        });
                    }
                    debug!(
                        late,
                        "grant came back after its validity; given back, waiting on"
                    );
                    // A fresh token: the give-back still on its way is token-checked, and with
                    // the same token it would free the grant the next attempt wins (the acquire
                    // script grants a token its own key again).
                    token = self.core.backend.token();
                    // A pause the give-back's own wake-up does not cut short, so that late
                    // tries are spaced out as busy ones are.
                    tokio::time::sleep_until((now + next_backoff(&mut backoff)).min(give_up)).await;
                    continue;
                }
            };
            if watch.is_none() {
                if Instant::now() >= give_up {
                    // A wait that is already over (`wait(Duration::ZERO)`) has no use for a
                    // subscription.
                    return Err(Error::WaitTimeout {
                        key: key.key().to_owned(),
                        waited: started.elapsed(),
                    });
                }
                // Subscribe, then try once more at once: a release between the failed attempt
                // and the subscription would otherwise go unseen until the timer. A slow
                // subscription (it may wait a second for the server's confirmation, more while
                // its connection is made again) must carry the wait neither past its deadline
                // nor past the holder's TTL: when the timer comes first the attempt is made
                // then, and the subscription is waited for again after it.
                let pending =
                    subscribing.get_or_insert_with(|| Box::pin(self.core.backend.watch(&key)));
                let retry_at = (Instant::now() + timer(remaining, &mut backoff)).min(give_up);
                let subscribed = tokio::select! {
                    biased;
                    w = pending => Some(w),
                    () = tokio::time::sleep_until(retry_at) => None,
                };
                if let Some(w) = subscribed {
                    subscribing = None;
                    watch = Some(w.map_err(|e| turn.failed(e))?);
                } else if Instant::now() >= give_up {
                    return Err(Error::WaitTimeout {
                        key: key.key().to_owned(),
                        waited: started.elapsed(),
                    });
                }
                continue;
            }
            let now = Instant::now();
            if now >= give_up {
                return Err(Error::WaitTimeout {
                    key: key.key().to_owned(),
                    waited: now - started,
                });
            }
            let wake_at = (now + timer(remaining, &mut backoff)).min(give_up);
            let w = watch.as_mut().expect("watch was set above");
            tokio::select! {
                _ = w.changed() => {},
                _ = tokio::time::sleep_until(wake_at) => {},
            }
        }
    }

    /// One acquire on the backend, keeping the fence as the options say.
    async fn grant(
        &self,
        key: &LockKey,
        token: &Token,
        opts: &LockOptions,
    ) -> Result<AcquireReply> {
        match opts.keep_fence {
            None => self.core.backend.acquire(key, token, opts.ttl).await,
            Some(keep) => {
                (self.core.backend)
                    .acquire_keeping_fence(key, token, opts.ttl, keep)
                    .await
            }
        }
    }

    async fn attempt(
        &self,
        key: &LockKey,
        token: &Token,
        opts: &LockOptions,
    ) -> Result<Attempt<B>> {
        // Validity counts from before the request leaves, so a slow reply can only shorten it.
        let start = Instant::now();
        // Dropped mid-call (a timeout around the acquire, a caller that went away), the acquire
        // may still land with nobody to hold it: released in the background unless the backend
        // sees to that itself. Armed for acquires that wait for replicas too: the backend
        // gives back a grant whose caller left during its exchange, but a grant that too few
        // replicas have is given back below, and that release can be cut short as well.
        let mut abandoned = Abandoned {
            locker: self,
            key,
            token,
            armed: opts.replicas > 0 || !self.core.backend.undoes_abandoned_grants(),
        };
        // The rare paths are boxed: their futures would otherwise inflate every acquire's state
        // machine, which is moved on each await of the common path.
        let mut retried = false;
        let reply = async {
            if opts.replicas > 0 {
                return Box::pin(self.attempt_replicated(key, token, opts)).await;
            }
            match self.grant(key, token, opts).await {
                // A reply lost, or one that came unreadable (the script ran all the same).
                Err(e) if e.may_have_landed() => {
                    // The script is idempotent per token: asking again tells us whether the
                    // first one landed. If even that fails, free whatever we may have been
                    // granted. A caller that leaves meanwhile must free it too: the backend
                    // gives back only what its own call may have granted, and the retry may
                    // still be queued, unsent, while the first grant holds the key.
                    let mut retry_abandoned = Abandoned {
                        locker: self,
                        key,
                        token,
                        // Unless the guard above is armed already.
                        armed: self.core.backend.undoes_abandoned_grants(),
                    };
                    retried = true;
                    let again = Box::pin(self.grant(key, token, opts)).await;
                    retry_abandoned.armed = false;
                    if again.is_err() {
                        self.release_in_background(key, token);
                    }
                    again
                }
                other => other,
            }
        }
        .await;
        // Answered, either way: a grant is handled below, a failure by the backend.
        abandoned.armed = false;
        match reply? {
            AcquireReply::Held { remaining } => Ok(Attempt::Held(remaining)),
            AcquireReply::Granted { fence, valid_from } => {
                let start = valid_from.map_or(start, |from| from.max(start));
                let state =
                    LeaseState::new(start + opts.ttl - drift(opts.ttl), warn_ahead(opts.ttl));
                if retried {
                    // The first send may still reach the server, after later extends, and set
                    // the TTL again from then (its script renews a grant it finds its own).
                    state.may_land_late(opts.ttl);
                }
                if state.alarm() <= Instant::now() {
                    // The reply took the whole validity: the grant may already have expired
                    // on the server and be held by another, so it is no lease at all. Free it
                    // in case it has not expired yet.
                    debug!(fence, "grant arrived after its validity; releasing it");
                    self.release_in_background(key, token);
                    return Ok(Attempt::Late);
                }
                let id = self.core.next_id.fetch_add(1, Ordering::Relaxed);
                if opts.renew {
                    self.core.send(Cmd::Add {
                        id,
                        key: key.clone(),
                        token: token.clone(),
                        ttl: opts.ttl,
                        sent: start,
                        state: state.clone(),
                    });
                }
                Ok(Attempt::Granted(Lease {
                    core: self.core.clone(),
                    id,
                    key: key.clone(),
                    token: token.clone(),
                    fence: Fence(fence),
                    state,
                    renewing: opts.renew,
                    turn: None,
                    extends: tokio::sync::Mutex::new(()),
                    done: false,
                }))
            }
        }
    }

    /// One acquire that is handed out only once `opts.replicas` replicas have the grant.
    async fn attempt_replicated(
        &self,
        key: &LockKey,
        token: &Token,
        opts: &LockOptions,
    ) -> Result<AcquireReply> {
        let answer = self
            .core
            .backend
            .acquire_replicated(key, token, opts.ttl, opts.replicas, opts.replica_timeout)
            .await;
        match answer {
            Ok((AcquireReply::Granted { .. }, acked)) if acked < opts.replicas => {
                // A grant the replicas lack could vanish in a failover: not a lease.
                if let Err(e) = self.core.backend.release(key, token).await {
                    warn!(key = key.key(), error = %e, "under-replicated grant not given back; it expires with its TTL");
                }
                Err(Error::NotReplicated {
                    key: key.key().to_owned(),
                    acked,
                    wanted: opts.replicas,
                })
            }
            // A grant of unknown outcome is the backend's to give back: only it knows which
            // connection the acquire went out on, and a release on another could overtake it.
            other => other.map(|(reply, _)| reply),
        }
    }

    /// Frees a grant that may exist but will not be handed out, without waiting.
    fn release_in_background(&self, key: &LockKey, token: &Token) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Nothing can run the release; the grant expires with its TTL.
            return;
        };
        let backend = self.core.backend.clone();
        let (key, token) = (key.clone(), token.clone());
        runtime.spawn(async move {
            let first = backend.release(&key, &token).await;
            if let Err(e) =
                crate::renew::release_again_if_in_doubt(&backend, &key, &token, first).await
            {
                warn!(key = key.key(), error = %e, "grant not handed out and not given back; it expires with its TTL");
            }
        });
    }

    /// Runs `body` while holding the lease on `key`, renewing it meanwhile (unless
    /// `opts.renew(false)`: then the body must finish within the TTL), then releases it.
    ///
    /// If the lease is lost while the body runs, the body is dropped (cancelled) and the call
    /// returns [`Error::LeaseLost`]: the body never runs past the lease's validity as this
    /// process measures it. A lease taken away on the server (its key deleted from outside, a
    /// failover that lost it) is noticed at the next renewal, up to about a third of the TTL
    /// later, so writes the body makes elsewhere should carry the fence ([`FenceGate`]). A body
    /// that ends after the lease counted as lost (one that blocked its thread past that point,
    /// where nothing could cancel it) is answered `LeaseLost` too, its result dropped. A body
    /// that finished in time is its result, whatever the release then finds; a release that
    /// finds the lease gone, or fails, is logged at `warn`.
    ///
    /// ```
    /// use lock_core::{Locker, LockOptions};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// let locker = Locker::memory();
    /// let fence = locker
    ///     .with_lock("nightly-report", &LockOptions::default(), |lease| async move {
    ///         lease.fence()
    ///     })
    ///     .await?;
    /// println!("ran with fence {fence}");
    /// # Ok(()) }
    /// ```
    pub async fn with_lock<F, Fut, T>(&self, key: &str, opts: &LockOptions, body: F) -> Result<T>
    where
        F: FnOnce(LeaseInfo) -> Fut,
        Fut: Future<Output = T>,
    {
        let lease = self.acquire(key, opts).await?;
        let span = debug_span!("with_lock", key = lease.key(), fence = lease.fence().0);
        let info = lease.info();
        let fut = body(info).instrument(span);
        tokio::select! {
            biased;
            _ = lease.lost() => Err(Error::LeaseLost { key: lease.key().to_owned() }),
            out = fut => {
                // Lost meanwhile, though its `lost()` had not woken yet (its timer fires when the
                // runtime next reads the clock; a body that blocked its thread finishes first):
                // the body ran past the lease's validity, and is answered as if cancelled.
                if lease.is_lost() {
                    return Err(Error::LeaseLost { key: lease.key().to_owned() });
                }
                // The body finished while the lease was, as far as we knew, held: its result
                // stands, and what the release finds is only worth a warning.
                match lease.release().await {
                    Ok(Release::Released) => {}
                    Ok(Release::NotHeld) => warn!(key, "with_lock: the lease had lapsed by the time the body finished"),
                    Err(e) => warn!(key, error = %e, "with_lock: release failed; the lease expires with its ttl"),
                }
                Ok(out)
            }
        }
    }

    /// A fence-checking gate for `resource` (see [`FenceGate`]).
    /// The resource name obeys the rules of a key, else [`Error::InvalidKey`].
    ///
    /// Fences are ordered per lock key, so give each lock key its own gate (the example names
    /// both `"ledger"`): a gate shared by several keys compares fences that were never meant to
    /// be compared, and refuses a live holder of one key whose fence is below one admitted for
    /// another.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Error, LockOptions, Locker};
    ///
    /// let locker = Locker::memory();
    /// let gate = locker.fence_gate("ledger")?;
    /// let first = locker.acquire("ledger", &LockOptions::new()).await?;
    /// let old_fence = first.fence();
    /// drop(first); // say the holder stalled, and its lease passed on
    /// let second = locker.acquire("ledger", &LockOptions::new()).await?;
    /// gate.admit(second.fence()).await?; // the new holder writes
    /// // The stalled holder wakes up and tries to write: refused.
    /// assert!(matches!(gate.admit(old_fence).await, Err(Error::Stale { .. })));
    /// # second.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn fence_gate(&self, resource: &str) -> Result<FenceGate<B>> {
        validate_key(resource)?;
        Ok(FenceGate {
            core: self.core.clone(),
            resource: resource.to_owned(),
            key: format!("{{{}:{}}}:gate", self.core.prefix, resource),
        })
    }
}

/// Refuses writes from older grants: admits a fence only if it is at least every fence admitted
/// before for the same resource.
///
/// Equal fences are admitted so that one lease may write several times. Run the check in the
/// same store as the data where you can; this gate is the reference form, on the locker's
/// backend (a script on Redis).
///
/// `admit` is a check, not a write: it protects a write only as far as nothing can come
/// between the two. A holder paused after its `admit` and before its write (the very pause a
/// fence is for) still writes late, over a newer holder's data. Where the data's own store can
/// take the fence in the same operation as the write, check it there: a conditional update on a
/// fence column (`UPDATE ... SET .., fence = $1 WHERE id = $2 AND fence <= $1`), or a script
/// that compares and writes in one call. A separate gate narrows the window to the time
/// between the two calls; it does not close it.
///
/// The highest fence admitted is one key on the backend, and it is only as durable as that
/// key: a restart without persistence, or a failover to a replica that had not received the
/// last admit, forgets it, and the gate then admits a fence lower than one it admitted before
/// (the lock's own fence survives those through server time; a gate has nothing to fall back
/// on). Where writes must stay fenced through them, run the gate on a server with
/// `appendonly yes` and `appendfsync always`, or keep the check beside the data (a conditional
/// update on a fence column), which survives with it. On a Redlock quorum the gate needs a
/// majority of members to admit and refuses a fence that any member answering has seen
/// beaten, so members restarting empty make it forget only when they and the members that
/// missed the highest admit (down or too slow at the time) are together a majority: a
/// minority restarting after an admit every member took does not forget. A key at the
/// gate's place that holds anything but a fence (another type, or a string that is not a
/// canonical decimal up to 2^64 - 1: no sign, no leading zero) is refused with
/// [`Error::WrongType`] and left as it is.
///
/// ```
/// use lock_core::{Error, Fence, Locker};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// let locker = Locker::memory();
/// let gate = locker.fence_gate("ledger")?;
/// gate.admit(Fence(10)).await?;
/// assert!(matches!(gate.admit(Fence(9)).await, Err(Error::Stale { highest: Fence(10), .. })));
/// # Ok(()) }
/// ```
pub struct FenceGate<B: Backend + Clone = AnyBackend> {
    core: Arc<Core<B>>,
    resource: String,
    key: String,
}

/// Cheap: the clone shares the locker's backend and checks the same resource.
impl<B: Backend + Clone> Clone for FenceGate<B> {
    fn clone(&self) -> Self {
        FenceGate {
            core: self.core.clone(),
            resource: self.resource.clone(),
            key: self.key.clone(),
        }
    }
}

/// The resource and the gate's key on the server.
///
/// ```
/// let gate = lock_core::Locker::memory().fence_gate("ledger")?;
/// assert_eq!(
///     format!("{gate:?}"),
///     r#"FenceGate { resource: "ledger", key: "{leasehold:ledger}:gate" }"#
/// );
/// # Ok::<(), lock_core::Error>(())
/// ```
impl<B: Backend + Clone> std::fmt::Debug for FenceGate<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceGate")
            .field("resource", &self.resource)
            .field("key", &self.key)
            .finish()
    }
}

impl<B: Backend + Clone> FenceGate<B> {
    /// Admits `fence`, or refuses it with [`Error::Stale`] if a higher one was admitted.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Fence, Locker};
    ///
    /// let gate = Locker::memory().fence_gate("ledger")?;
    /// gate.admit(Fence(7)).await?;
    /// gate.admit(Fence(7)).await?; // the same lease may write again
    /// gate.admit(Fence(8)).await?;
    /// assert!(gate.admit(Fence(7)).await.is_err());
    /// # Ok(()) }
    /// ```
    pub async fn admit(&self, fence: Fence) -> Result<()> {
        match self.core.backend.admit(&self.key, fence.0).await? {
            None => Ok(()),
            Some(highest) => Err(Error::Stale {
                resource: self.resource.clone(),
                fence,
                highest: Fence(highest),
            }),
        }
    }
}

/// A random duration in `[0, max]` from the OS RNG, to spread waiters apart.
fn jitter(max: Duration) -> Duration {
    let mut b = [0u8; 4];
    if getrandom::fill(&mut b).is_err() {
        return max / 2;
    }
    let frac = u32::from_le_bytes(b) as f64 / u32::MAX as f64;
    max.mul_f64(frac)
}

#[cfg(test)]
mod tests {
    use super::*;

    impl<B: Backend + Clone> Locker<B> {
        /// Commands queued for the renewal driver and not yet taken.
        fn queued(&self) -> usize {
            self.core.driver.get().map_or(0, |inbox| inbox.queued())
        }

        /// Times the renewal driver has taken its queue.
        fn driver_looks(&self) -> usize {
            self.core.driver.get().map_or(0, |inbox| inbox.looks())
        }
    }

    /// Leases released before the driver sees them must not wake it one by one: the first
    /// add wakes it, and it then sleeps until that add would have been due, so later adds
    /// (due later) leave it asleep. The driver gets a turn after every lease here, and finds
    /// each lease's add already taken back by its release.
    #[tokio::test(flavor = "current_thread")]
    async fn leases_released_at_once_do_not_wake_the_driver_each() {
        let locker = Locker::memory();
        let o = opts(Duration::from_secs(30));
        for i in 0..500 {
            let lease = locker
                .try_acquire(&format!("k{i}"), &o)
                .await
                .expect("free");
            lease.release().await.expect("release");
            tokio::task::yield_now().await;
        }
        let looks = locker.driver_looks();
        assert!(
            looks <= 5,
            "the driver looked {looks} times for 500 short leases"
        );
        // Renewal still works for a lease that stays.
        assert_renewed(&locker, "kept").await;
    }

    fn opts(ttl: Duration) -> LockOptions {
        LockOptions::new().ttl(ttl)
    }

    /// The parts of `Backend` a test backend leaves to the memory backend in its `inner`.
    /// Acquire and release as the wrapped memory backend does them, for test backends that
    /// change only other calls.
    macro_rules! forward_grants_to_memory {
        () => {
            fn acquire(
                &self,
                key: &LockKey,
                token: &Token,
                ttl: Duration,
            ) -> impl Future<Output = Result<AcquireReply>> + Send {
                self.inner.acquire(key, token, ttl)
            }
            fn release(
                &self,
                key: &LockKey,
                token: &Token,
            ) -> impl Future<Output = Result<bool>> + Send {
                self.inner.release(key, token)
            }
        };
    }

    /// The parts of `Backend` a test backend leaves to the memory backend in its `inner`;
    /// `(extend)`: the extends too; `(extend, own watch)` and `(own watch)`: all but the watch.
    macro_rules! forward_to_memory {
        (extend) => {
            forward_to_memory!(extend, own watch);
            forward_to_memory!(watch);
        };
        (extend, own watch) => {
            fn extend(
                &self,
                items: &[(LockKey, Token)],
                ttl: Duration,
            ) -> impl Future<Output = Result<Vec<bool>>> + Send {
                self.inner.extend(items, ttl)
            }
            forward_to_memory!(own watch);
        };
        (own watch) => {
            fn admit(
                &self,
                gate_key: &str,
                fence: u64,
            ) -> impl Future<Output = Result<Option<u64>>> + Send {
                self.inner.admit(gate_key, fence)
            }
            fn wakeups(&self) -> &Arc<crate::wake::Wakeups> {
                self.inner.wakeups()
            }
        };
        () => {
            forward_to_memory!(own watch);
            forward_to_memory!(watch);
        };
        (watch) => {
            fn watch(
                &self,
                key: &LockKey,
            ) -> impl Future<Output = Result<crate::wake::Watch>> + Send {
                self.inner.watch(key)
            }
        };
    }

    /// The memory backend whose subscriptions take `delay` to be confirmed, as on a server
    /// whose subscription connection is being made again.
    #[derive(Clone)]
    struct SlowWatch {
        inner: MemoryBackend,
        delay: Duration,
    }

    impl Backend for SlowWatch {
        forward_grants_to_memory!();
        forward_to_memory!(extend, own watch);
        fn watch(&self, key: &LockKey) -> impl Future<Output = Result<crate::wake::Watch>> + Send {
            let (inner, key, delay) = (self.inner.clone(), key.clone(), self.delay);
            async move {
                tokio::time::sleep(delay).await;
                inner.watch(&key).await
            }
        }
    }

    /// A waiter whose subscription is slow to be confirmed still tries again once the
    /// holder's TTL has run out (a holder that crashed, so no wake-up comes), rather than
    /// waiting for the confirmation first: here past its own deadline, a wait ended
    /// `WaitTimeout` on a key free for most of it.
    #[tokio::test]
    async fn a_slow_subscription_does_not_hold_back_the_retry_at_the_holders_ttl() {
        let mem = MemoryBackend::new();
        let locker = Locker::new(SlowWatch {
            inner: mem.clone(),
            delay: Duration::from_secs(30),
        });
        let key = locker.lock_key("crashed").expect("key");
        let crashed = mem.token();
        let held = mem
            .acquire(&key, &crashed, Duration::from_millis(100))
            .await;
        assert!(matches!(held, Ok(AcquireReply::Granted { .. })), "{held:?}");
        let started = Instant::now();
        let lease = locker
            .acquire(
                "crashed",
                &opts(Duration::from_secs(5)).wait(Duration::from_secs(2)),
            )
            .await
            .expect("the key freed at its TTL, 1.9 s before the wait's deadline");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "taken {:?} after the wait began, for a holder with 100 ms left",
            started.elapsed()
        );
        lease.release().await.expect("release");
    }

    /// How [`Faulty`] answers acquires.
    #[derive(Clone, Copy)]
    enum AcquireFault {
        /// The first acquire is granted and answered `OutcomeUnknown` (a reply lost on the way
        /// back); every later one never answers (a retry still queued behind a slow call).
        LostReplyThenSilence,
        /// The first `count` acquires are granted, and answered `after` later (a slow link).
        LateReplies { count: u64, after: Duration },
        /// The first acquire is granted and answered `OutcomeUnknown`; later ones are answered.
        LostReply,
    }

    /// The memory backend with faults of a network in front of it. It claims to undo grants
    /// its own acquires made, as the Redis backend does, so that only the locker can free
    /// what the faults leave behind.
    #[derive(Clone)]
    struct Faulty {
        inner: MemoryBackend,
        acquires: Arc<AtomicU64>,
        fault: AcquireFault,
        /// How long each release takes to reach the store.
        release_delay: Duration,
    }

    impl Faulty {
        fn new(inner: &MemoryBackend, fault: AcquireFault, release_delay: Duration) -> Faulty {
            Faulty {
                inner: inner.clone(),
                acquires: Arc::default(),
                fault,
                release_delay,
            }
        }

        fn acquires(&self) -> u64 {
            self.acquires.load(Ordering::SeqCst)
        }
    }

    impl Backend for Faulty {
        fn acquire(
            &self,
            key: &LockKey,
            token: &Token,
            ttl: Duration,
        ) -> impl Future<Output = Result<AcquireReply>> + Send {
            let n = self.acquires.fetch_add(1, Ordering::SeqCst);
            let grant = self.inner.acquire(key, token, ttl);
            let (fault, user) = (self.fault, key.key().to_owned());
            async move {
                match fault {
                    AcquireFault::LostReplyThenSilence if n > 0 => std::future::pending().await,
                    AcquireFault::LostReplyThenSilence => {
                        grant.await?;
                        Err(Error::OutcomeUnknown {
                            op: "acquire",
                            key: user,
                            source: redis::RedisError::from((redis::ErrorKind::Io, "reply lost")),
                        })
                    }
                    AcquireFault::LostReply if n == 0 => {
                        grant.await?;
                        Err(Error::OutcomeUnknown {
                            op: "acquire",
                            key: user,
                            source: redis::RedisError::from((redis::ErrorKind::Io, "reply lost")),
                        })
                    }
                    AcquireFault::LostReply => grant.await,
                    AcquireFault::LateReplies { count, after } => {
                        let reply = grant.await;
                        if n < count {
                            tokio::time::sleep(after).await;
                        }
                        reply
                    }
                }
            }
        }
        fn release(
            &self,
            key: &LockKey,
            token: &Token,
        ) -> impl Future<Output = Result<bool>> + Send {
            let (inner, key, token, delay) = (
                self.inner.clone(),
                key.clone(),
                token.clone(),
                self.release_delay,
            );
            async move {
                tokio::time::sleep(delay).await;
                inner.release(&key, &token).await
            }
        }
        forward_to_memory!(extend);
        fn undoes_abandoned_grants(&self) -> bool {
            true
        }
    }

    /// The memory backend with a slow reply for the first extend with `slow_ttl`: every
    /// extend runs on the store when sent, in order, and that one's answer takes `delay`, so
    /// an extend sent after it runs after it and may be answered before it.
    #[derive(Clone)]
    struct SlowReply {
        inner: MemoryBackend,
        slow_ttl: Duration,
        delay: Duration,
        slowed: Arc<std::sync::atomic::AtomicBool>,
        /// Whether the slow one is still unanswered.
        pending: Arc<std::sync::atomic::AtomicBool>,
        /// Extends answered while the slow one was unanswered.
        overtook: Arc<AtomicU64>,
    }

    impl SlowReply {
        /// Over `inner`, answering the first extend with `slow_ttl` after `delay`.
        fn new(inner: &MemoryBackend, slow_ttl: Duration, delay: Duration) -> SlowReply {
            SlowReply {
                inner: inner.clone(),
                slow_ttl,
                delay,
                slowed: Arc::default(),
                pending: Arc::default(),
                overtook: Arc::default(),
            }
        }
    }

    impl Backend for SlowReply {
        forward_grants_to_memory!();
        fn extend(
            &self,
            items: &[(LockKey, Token)],
            ttl: Duration,
        ) -> impl Future<Output = Result<Vec<bool>>> + Send {
            let (me, items) = (self.clone(), items.to_vec());
            async move {
                let ran = me.inner.extend(&items, ttl).await;
                if ttl == me.slow_ttl && !me.slowed.swap(true, Ordering::SeqCst) {
                    me.pending.store(true, Ordering::SeqCst);
                    tokio::time::sleep(me.delay).await;
                    me.pending.store(false, Ordering::SeqCst);
                } else if me.pending.load(Ordering::SeqCst) {
                    me.overtook.fetch_add(1, Ordering::SeqCst);
                }
                ran
            }
        }
        forward_to_memory!();
    }

    /// The memory backend with its extends changed: sent `before` late, answered `after`
    /// late, counted (calls, and items per key), the next `miscount` answered with no answer
    /// at all (a backend breaking the one-answer-per-item contract), and renewals of the key
    /// `unanswered` left without an answer (its node not answering).
    #[derive(Clone, Default)]
    struct Extends {
        inner: MemoryBackend,
        before: Duration,
        after: Duration,
        sent: Arc<AtomicU64>,
        items: Arc<std::sync::Mutex<std::collections::HashMap<String, u64>>>,
        miscount: Arc<AtomicU64>,
        unanswered: Option<&'static str>,
        /// The TTL of every renewal (`extend_each`) call, in order.
        renewals: Arc<std::sync::Mutex<Vec<Duration>>>,
    }

    impl Backend for Extends {
        forward_grants_to_memory!();
        fn extend(
            &self,
            items: &[(LockKey, Token)],
            ttl: Duration,
        ) -> impl Future<Output = Result<Vec<bool>>> + Send {
            self.sent.fetch_add(1, Ordering::SeqCst);
            for (key, _) in items {
                *self
                    .items
                    .lock()
                    .expect("items")
                    .entry(key.key().to_owned())
                    .or_default() += 1;
            }
            let (me, items) = (self.clone(), items.to_vec());
            async move {
                tokio::time::sleep(me.before).await;
                let ran = me.inner.extend(&items, ttl).await?;
                tokio::time::sleep(me.after).await;
                let miscount = me
                    .miscount
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                Ok(if miscount { Vec::new() } else { ran })
            }
        }
        fn extend_each(
            &self,
            items: &[(LockKey, Token)],
            ttl: Duration,
        ) -> impl Future<Output = Result<Vec<Option<bool>>>> + Send {
            self.renewals.lock().expect("renewals").push(ttl);
            let unanswered: Vec<bool> = items
                .iter()
                .map(|(key, _)| Some(key.key()) == self.unanswered)
                .collect();
            let answers = self.extend(items, ttl);
            async move {
                Ok(answers
                    .await?
                    .into_iter()
                    .zip(unanswered)
                    .map(|(held, unanswered)| (!unanswered).then_some(held))
                    .collect())
            }
        }
        forward_to_memory!();
    }

    /// No renewal is sent while an explicit `extend` is on its way (it renews the lease itself):
    /// with the extend travelling from 100 ms to about 1 s, past the renewal due at 400 ms, the
    /// driver sends nothing; once it is answered, renewals go on, carrying its TTL.
    #[tokio::test(start_paused = true)]
    async fn no_renewal_is_sent_while_an_extend_travels() {
        let backend = Extends {
            before: Duration::from_millis(900),
            ..Extends::default()
        };
        let renewals = backend.renewals.clone();
        let locker = Locker::new(backend);
        let opts = LockOptions::new().ttl(Duration::from_millis(1_200));
        let lease = Arc::new(locker.try_acquire("k", &opts).await.expect("acquire"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let extending = tokio::spawn({
            let lease = lease.clone();
            async move { lease.extend(Duration::from_secs(2)).await }
        });
        tokio::time::sleep(Duration::from_millis(850)).await;
        assert!(
            renewals.lock().expect("renewals").is_empty(),
            "renewed while the extend travelled: {:?}",
            renewals.lock().expect("renewals")
        );
        extending.await.expect("task").expect("extend");
        // The next renewal is due a third of the new TTL after the extend was answered.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let sent = renewals.lock().expect("renewals").clone();
        assert!(
            !sent.is_empty() && sent.iter().all(|&ttl| ttl == Duration::from_secs(2)),
            "renewals after the extend: {sent:?}"
        );
    }

    /// Explicit extends that never answer, and a first renewal refused at once (a brief
    /// refusal); the rest goes to the memory backend.
    #[derive(Clone, Default)]
    struct HungExtend {
        inner: MemoryBackend,
        renewals: Arc<AtomicU64>,
    }

    impl Backend for HungExtend {
        forward_grants_to_memory!();
        fn extend(
            &self,
            _items: &[(LockKey, Token)],
            _ttl: Duration,
        ) -> impl Future<Output = Result<Vec<bool>>> + Send {
            std::future::pending()
        }
        fn extend_each(
            &self,
            items: &[(LockKey, Token)],
            ttl: Duration,
        ) -> impl Future<Output = Result<Vec<Option<bool>>>> + Send {
            let first = self.renewals.fetch_add(1, Ordering::SeqCst) == 0;
            let answers = self.inner.extend(items, ttl);
            async move {
                if first {
                    return Err(unavailable("refused once"));
                }
                Ok(answers.await?.into_iter().map(Some).collect())
            }
        }
        forward_to_memory!();
    }

    /// A renewal that fails is tried again before the lease's alarm, even when the TTL it
    /// renews with is far longer than what is left: a 30 s lease whose extend to 100 ms was
    /// given up on (outcome unknown, so the deadline is capped near 100 ms) and whose next
    /// renewal is refused once survives on the retry. (The retry was filed a tenth of the TTL,
    /// up to 250 ms, after the failure, past the alarm: the lease was reported lost at about
    /// 90 ms though the backend answered again a millisecond later.)
    #[tokio::test(start_paused = true)]
    async fn a_failed_renewal_is_retried_before_the_alarm() {
        let backend = HungExtend::default();
        let renewals = backend.renewals.clone();
        let locker = Locker::new(backend);
        let opts = LockOptions::new().ttl(Duration::from_secs(30));
        let lease = locker.try_acquire("k", &opts).await.expect("acquire");
        let extend = lease.extend(Duration::from_millis(100));
        let gave_up = tokio::time::timeout(Duration::from_millis(20), extend).await;
        assert!(gave_up.is_err(), "the extend answered: {gave_up:?}");
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(
            renewals.load(Ordering::SeqCst) >= 2,
            "renewals sent: {renewals:?}"
        );
        assert!(!lease.is_lost(), "lost after one refused renewal");
        assert!(lease.remaining() > Duration::ZERO);
    }

    /// Two tasks extending one lease in loops, so that one extend is always on its way: every
    /// extend succeeds, and the lease stays held. (While two travelled at once, each answer
    /// was capped at the earliest deadline of any extend sent since none travelled, which
    /// never came again: the lease ran down and was reported lost within its first TTL.)
    #[tokio::test(start_paused = true)]
    async fn extends_from_two_tasks_keep_the_lease() {
        let backend = Extends {
            after: Duration::from_millis(10),
            ..Extends::default()
        };
        let locker = Locker::new(backend);
        let fixed = LockOptions::new().ttl(Duration::from_secs(1)).renew(false);
        let lease = Arc::new(locker.try_acquire("k", &fixed).await.expect("acquire"));
        let ok = Arc::new(AtomicU64::new(0));
        let mut loops = Vec::new();
        for offset in [0, 5] {
            let (lease, ok) = (lease.clone(), ok.clone());
            loops.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(offset)).await;
                let end = Instant::now() + Duration::from_secs(3);
                while Instant::now() < end {
                    lease.extend(Duration::from_secs(1)).await.expect("extend");
                    ok.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }));
        }
        for l in loops {
            l.await.expect("extend loop");
        }
        assert!(ok.load(Ordering::SeqCst) > 100, "{ok:?}");
        assert!(!lease.is_lost(), "lost while every extend succeeded");
        assert!(
            lease.remaining() > Duration::from_millis(900),
            "{:?}",
            lease.remaining()
        );
    }

    /// Leases acquired a moment apart renew together from their first round on: the later
    /// ones, due within a sixth of the TTL of the first, go early with it and stay in step.
    /// (With a fixed 20 ms window, two groups acquired 100 ms apart renewed in two calls every
    /// round for as long as they were held: 11 calls here, where 6 do.)
    #[tokio::test(start_paused = true)]
    async fn leases_acquired_apart_renew_in_one_call_a_round() {
        let backend = Extends::default();
        let sent = backend.sent.clone();
        let locker = Locker::new(backend);
        let o = LockOptions::new().ttl(Duration::from_millis(1_200));
        let start = Instant::now();
        let first = locker.try_acquire("first", &o).await.expect("acquire");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let second = locker.try_acquire("second", &o).await.expect("acquire");
        // Rounds every 400 ms from the first grant: at 400, 800, ..., 2400.
        tokio::time::sleep_until(start + Duration::from_millis(2_450)).await;
        assert_eq!(
            sent.load(Ordering::SeqCst),
            6,
            "renewal calls in six rounds"
        );
        assert!(!first.is_lost() && !second.is_lost());
        // Past its first round, a lease renews a third of its TTL after the last send.
        assert!(
            first.remaining() > Duration::from_millis(1_000),
            "{:?}",
            first.remaining()
        );
        assert!(
            second.remaining() > Duration::from_millis(1_000),
            "{:?}",
            second.remaining()
        );
    }

    /// A lease retried after its renewal went unanswered (every 250 ms, as its node fails
    /// over, say) takes no other lease along early, not even one of its own TTL: only a
    /// lease's round does. A healthy 6 s lease beside it renews once a round, a third of its
    /// TTL apart: at 3.2 s and 5.2 s. (With every renewal taking along leases within a sixth
    /// of their TTL, each retry took the healthy lease along once it was within a second of
    /// its round: 4 renewals by 5.9 s, at 2.25, 3.25, 4.25 and 5.25 s.)
    #[tokio::test(start_paused = true)]
    async fn a_retried_lease_takes_no_other_along() {
        let backend = Extends {
            unanswered: Some("unanswered"),
            ..Extends::default()
        };
        let items = backend.items.clone();
        let locker = Locker::new(backend);
        let ttl = opts(Duration::from_secs(6));
        let start = Instant::now();
        let unanswered = locker
            .try_acquire("unanswered", &ttl)
            .await
            .expect("acquire");
        // Granted past the window of the other's first round (at 2 s, back to 1 s), so
        // that round does not take it along.
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        let healthy = locker.try_acquire("healthy", &ttl).await.expect("acquire");
        // The unanswered lease is retried from 2 s on, until it counts as lost (5.8 s).
        tokio::time::sleep_until(start + Duration::from_millis(5_900)).await;
        let items = items.lock().expect("items").clone();
        assert_eq!(items.get("healthy"), Some(&2), "{items:?}");
        assert!(
            items.get("unanswered").is_some_and(|n| *n >= 10),
            "not retried: {items:?}"
        );
        assert!(unanswered.is_lost(), "renewed without an answer");
        assert!(!healthy.is_lost());
    }

    /// A short lease's rounds take no lease of another TTL along: a script call carries one
    /// TTL, so such a lease would go in a call of its own, early for nothing. (When each
    /// lease's window applied to every round, a 60 s lease beside a 3 s one renewed every 10 s
    /// instead of every 20 s: 4 renewals in 45 s, where 2 do.)
    #[tokio::test(start_paused = true)]
    async fn rounds_take_only_leases_of_their_ttl_along() {
        let backend = Extends::default();
        let items = backend.items.clone();
        let locker = Locker::new(backend);
        let start = Instant::now();
        let short = locker
            .try_acquire("short", &opts(Duration::from_secs(3)))
            .await
            .expect("acquire");
        let long = locker
            .try_acquire("long", &opts(Duration::from_secs(60)))
            .await
            .expect("acquire");
        tokio::time::sleep_until(start + Duration::from_millis(45_500)).await;
        let items = items.lock().expect("items").clone();
        // Rounds of the long lease at 20 s and 40 s; of the short one every second.
        assert_eq!(items.get("long"), Some(&2), "{items:?}");
        assert_eq!(items.get("short"), Some(&45), "{items:?}");
        assert!(!short.is_lost() && !long.is_lost());
    }

    mod captured {
        include!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/support/captured.rs"
        ));
    }

    /// Back-to-back explicit extends on a paused (or coarse) clock: the second, longer one
    /// counts, as it does on the server. (Its send time equalled the first's answer time, and
    /// the tie was read as the second having been sent before the first was answered, so its
    /// longer deadline was dropped: `remaining()` about 2 s and `lost()` then, while the store
    /// held the lease for 10 s.)
    #[tokio::test(start_paused = true)]
    async fn back_to_back_extends_count_the_last() {
        let locker = Locker::memory();
        let lease = locker
            .try_acquire("k", &opts(Duration::from_secs(1)).renew(false))
            .await
            .expect("acquire");
        lease.extend(Duration::from_secs(2)).await.expect("2 s");
        lease.extend(Duration::from_secs(10)).await.expect("10 s");
        assert!(
            lease.remaining() > Duration::from_secs(9),
            "{:?}",
            lease.remaining()
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!lease.is_lost());
    }

    /// A renewal on its way when the holder releases finds the key deleted by that release:
    /// the lease ended, it was not lost, and no warning says so. (It warned "lease lost: the
    /// server no longer holds it" on an ordinary release.)
    #[tokio::test(start_paused = true)]
    async fn a_renewal_overtaken_by_release_is_no_loss() {
        let (logs, _logging) = captured::capture(tracing::Level::WARN);
        let memory = MemoryBackend::new();
        let locker = Locker::new(Extends {
            inner: memory.clone(),
            before: Duration::from_millis(50),
            ..Extends::default()
        });
        let lease = locker
            .try_acquire("k", &opts(Duration::from_millis(300)))
            .await
            .expect("acquire");
        // The renewal is sent at about 100 ms and runs 50 ms later, after this release.
        tokio::time::sleep(Duration::from_millis(120)).await;
        let info = lease.info();
        assert_eq!(
            lease.release().await.expect("release"),
            crate::Release::Released
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let key = locker.lock_key("k").expect("key");
        assert!(!memory.is_held(&key), "renewed after release");
        assert!(info.is_lost(), "the view does not follow the release");
        assert!(
            !logs.text().contains("WARN"),
            "a release was logged as a loss: {}",
            logs.text()
        );
    }

    /// An answer of another count than the leases sent says nothing of any of them: a
    /// renewal batch answered so is retried (the lease was left unfiled, never renewed again,
    /// and lost at its alarm), and an explicit extend so answered is an unknown outcome, not
    /// a lost lease.
    #[tokio::test(start_paused = true)]
    async fn an_answer_of_another_count_is_no_verdict() {
        let memory = MemoryBackend::new();
        let backend = Extends {
            inner: memory.clone(),
            miscount: Arc::new(AtomicU64::new(1)),
            ..Extends::default()
        };
        let locker = Locker::new(backend.clone());
        let renewing = locker
            .try_acquire("renewed", &opts(Duration::from_millis(300)))
            .await
            .expect("acquire");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            backend.miscount.load(Ordering::SeqCst),
            0,
            "no renewal was sent"
        );
        assert!(
            !renewing.is_lost(),
            "a miscounted renewal answer lost the lease"
        );

        let fixed = LockOptions::new().ttl(Duration::from_secs(10)).renew(false);
        let lease = locker.try_acquire("fixed", &fixed).await.expect("acquire");
        backend.miscount.store(1, Ordering::SeqCst);
        let extended = lease.extend(Duration::from_secs(20)).await;
        assert!(
            matches!(extended, Err(Error::OutcomeUnknown { op: "extend", .. })),
            "{extended:?}"
        );
        assert!(
            !lease.is_lost(),
            "an extend without a verdict lost the lease"
        );
        assert!(
            lease.remaining() <= Duration::from_secs(10),
            "{:?}",
            lease.remaining()
        );
        // Some time passes, as it always does on a real clock: an extend sent at the very
        // instant the unknown one was settled counts as sent before it (and may only shorten).
        tokio::time::sleep(Duration::from_millis(1)).await;
        lease.extend(Duration::from_secs(20)).await.expect("extend");
        assert!(lease.remaining() > Duration::from_secs(19));
    }

    /// A renewal sent just before an extend to a longer TTL, and answered after it: the
    /// lease cannot tell which ran last on the server, so the renewal's reply shortens it to
    /// the old TTL. The next renewal must then come before that shortened deadline, with the
    /// new TTL; scheduled a third of the new TTL later, it came after the lease had been given
    /// up as lost.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_shortened_the_lease_is_followed_in_time() {
        let memory = MemoryBackend::new();
        let backend = SlowReply::new(
            &memory,
            Duration::from_millis(300),
            Duration::from_millis(50),
        );
        let locker = Locker::new(backend.clone());
        let lease = locker
            .try_acquire("k", &opts(Duration::from_millis(300)))
            .await
            .expect("acquire");
        // The renewal due at 100 ms is sent, and answered 50 ms later.
        tokio::time::sleep(Duration::from_millis(110)).await;
        lease.extend(Duration::from_secs(30)).await.expect("extend");
        assert!(
            backend.overtook.load(Ordering::SeqCst) >= 1,
            "the extend was not answered before the renewal sent ahead of it"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !lease.is_lost(),
            "the lease was given up although renewal worked"
        );
        assert!(
            lease.remaining() > Duration::from_secs(20),
            "{:?}",
            lease.remaining()
        );
        let other = Locker::new(memory);
        assert!(matches!(
            other.try_acquire("k", &opts(Duration::from_secs(1))).await,
            Err(Error::Busy { .. })
        ));
        lease.release().await.expect("release");
    }

    /// An extend answered after the lease's alarm reports it lost, and the driver renews it no
    /// more: the holder was told to stop, and a renewal would keep the key from everyone for
    /// another TTL. (The extend ran on the server at once and holds the key to 21 s; answered
    /// at 20.5 s, past the alarm at about 20.3 s. The renewal put off while it travelled came
    /// a quarter second later, and set the key to expire 30 s on.)
    #[tokio::test(start_paused = true)]
    async fn a_lease_lost_to_a_late_extend_is_not_renewed() {
        let memory = MemoryBackend::new();
        let backend = SlowReply::new(
            &memory,
            Duration::from_secs(20),
            Duration::from_millis(19_500),
        );
        let locker = Locker::new(backend);
        let lease = locker
            .try_acquire("k", &opts(Duration::from_secs(30)))
            .await
            .expect("acquire");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let extended = lease.extend(Duration::from_secs(20)).await;
        assert!(
            matches!(extended, Err(Error::LeaseLost { .. })),
            "{extended:?}"
        );
        assert!(lease.is_lost());
        // The guard is kept (a dropped one is released anyway): past the extend's expiry on
        // the server, the key must be free.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let key = locker.lock_key("k").expect("key");
        assert!(!memory.is_held(&key), "renewed after it was reported lost");
        drop(lease);
    }

    /// A wait of zero is over at once, yet a free key is still tried once and taken, however
    /// the timer and the free turn are polled (a paused clock fires the timer on its first
    /// poll).
    #[tokio::test(start_paused = true)]
    async fn a_zero_wait_takes_a_free_key() {
        let locker = Locker::memory();
        let o = opts(Duration::from_secs(1)).wait(Duration::ZERO);
        for i in 0..32 {
            let lease = locker
                .acquire(&format!("k{i}"), &o)
                .await
                .expect("a free key");
            lease.release().await.expect("release");
        }
    }

    /// A waiting acquire whose grant came back after its validity (970 ms for a 1 s lease,
    /// whose alarm is at 960 ms) waits on with a new token, and is handed a later grant that
    /// the late one's give-back cannot free: that give-back takes 20 ms to land, while the
    /// late grant still holds the key, and finds a different token. (With the same token the
    /// next attempt would be granted the key again and the give-back would then delete it.)
    #[tokio::test(start_paused = true)]
    async fn a_late_grant_is_given_back_and_the_wait_goes_on_with_a_new_token() {
        let memory = MemoryBackend::new();
        let late = AcquireFault::LateReplies {
            count: 1,
            after: Duration::from_millis(970),
        };
        let locker = Locker::new(Faulty::new(&memory, late, Duration::from_millis(20)));
        let o = opts(Duration::from_secs(1))
            .renew(false)
            .wait(Duration::from_secs(5));
        let lease = locker.acquire("k", &o).await.expect("a later grant");
        assert!(locker.backend().acquires() >= 2, "the first grant was late");
        assert!(!lease.is_lost());
        // Every give-back has landed by now; the lease's own TTL runs for most of a second.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let other = Locker::new(memory);
        match other.try_acquire("k", &o).await {
            Err(Error::Busy { .. }) => {}
            Ok(_) => panic!("the late grant's give-back freed the lease handed out"),
            Err(e) => panic!("{e}"),
        }
    }

    /// A TTL too short for the link: every grant comes back late. The wait ends after the
    /// third such grant, long before its deadline, rather than taking the key and waking every
    /// waiter on each try for a minute.
    #[tokio::test(start_paused = true)]
    async fn late_grants_end_the_wait_after_three() {
        let always_late = AcquireFault::LateReplies {
            count: u64::MAX,
            after: Duration::from_millis(970),
        };
        let locker = Locker::new(Faulty::new(
            &MemoryBackend::new(),
            always_late,
            Duration::ZERO,
        ));
        let o = opts(Duration::from_secs(1))
            .renew(false)
            .wait(Duration::from_secs(60));
        let started = Instant::now();
        match locker.acquire("k", &o).await {
            Err(Error::LeaseLost { .. }) => {}
            other => panic!("want LeaseLost, got {:?}", other.map(|l| l.fence())),
        }
        assert_eq!(
            locker.backend().acquires(),
            3,
            "late grants before the wait ended"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }

    /// A late grant that comes back when the wait is already over ends it as the docs say:
    /// `LeaseLost` (a grant was made and given back), not `WaitTimeout`, and no second try.
    #[tokio::test(start_paused = true)]
    async fn a_late_grant_after_the_wait_is_over_is_lease_lost() {
        let late = AcquireFault::LateReplies {
            count: 1,
            after: Duration::from_millis(970),
        };
        let locker = Locker::new(Faulty::new(&MemoryBackend::new(), late, Duration::ZERO));
        let o = opts(Duration::from_secs(1))
            .renew(false)
            .wait(Duration::from_millis(500));
        match locker.acquire("k", &o).await {
            Err(Error::LeaseLost { key }) => assert_eq!(key, "k"),
            other => panic!("want LeaseLost, got {:?}", other.map(|l| l.fence())),
        }
        assert_eq!(locker.backend().acquires(), 1, "tried again after the wait");
    }

    /// An acquire whose reply was lost is asked again with the same token; a caller that gives
    /// up while that retry is unanswered leaves the first grant holding the key, with no one to
    /// hold it and nothing in the backend to undo it: the locker frees it.
    #[tokio::test]
    async fn a_caller_gone_during_the_retry_frees_the_first_grant() {
        let memory = MemoryBackend::new();
        let locker = Locker::new(Faulty::new(
            &memory,
            AcquireFault::LostReplyThenSilence,
            Duration::ZERO,
        ));
        let o = opts(Duration::from_secs(30)).renew(false);
        let gone =
            tokio::time::timeout(Duration::from_millis(50), locker.try_acquire("k", &o)).await;
        assert!(gone.is_err(), "the retry answered: {gone:?}");
        assert_eq!(locker.backend().acquires(), 2, "asked twice");
        let plain = Locker::new(memory);
        let give_up = Instant::now() + Duration::from_secs(2);
        loop {
            match plain.try_acquire("k", &o).await {
                Ok(_) => break,
                Err(Error::Busy { .. }) if Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                Err(e) => panic!("the first grant still holds the key (30 s TTL): {e}"),
            }
        }
    }

    /// An acquire answered by its retry (the first reply lost): the first send may still be
    /// delivered later and renew the grant it finds its own for its TTL from then, so a later
    /// extend to a longer TTL is counted with the acquire's TTL.
    #[tokio::test]
    async fn an_acquire_answered_by_its_retry_caps_later_extends() {
        let memory = MemoryBackend::new();
        let locker = Locker::new(Faulty::new(
            &memory,
            AcquireFault::LostReply,
            Duration::ZERO,
        ));
        let ttl = Duration::from_secs(2);
        let lease = locker
            .try_acquire("k", &opts(ttl).renew(false))
            .await
            .expect("granted by the retry");
        assert_eq!(locker.backend().acquires(), 2, "asked twice");
        lease.extend(Duration::from_secs(30)).await.expect("extend");
        assert!(
            lease.remaining() <= ttl,
            "{:?} left where the first send may set 2 s",
            lease.remaining()
        );
        assert!(lease.remaining() > ttl / 2, "{:?}", lease.remaining());
    }

    /// The memory backend whose grants come `delay` late, whose replicated grants reach no
    /// replica, and whose releases all fail: what the locker does not hand out, it cannot give
    /// back either.
    #[derive(Clone)]
    struct GivesNothingBack {
        inner: MemoryBackend,
        delay: Duration,
    }

    impl Backend for GivesNothingBack {
        async fn acquire(
            &self,
            key: &LockKey,
            token: &Token,
            ttl: Duration,
        ) -> Result<AcquireReply> {
            let reply = self.inner.acquire(key, token, ttl).await;
            tokio::time::sleep(self.delay).await;
            reply
        }
        async fn acquire_replicated(
            &self,
            key: &LockKey,
            token: &Token,
            ttl: Duration,
            _replicas: u32,
            _timeout: Duration,
        ) -> Result<(AcquireReply, u32)> {
            Ok((self.inner.acquire(key, token, ttl).await?, 0))
        }
        async fn release(&self, _key: &LockKey, _token: &Token) -> Result<bool> {
            Err(unavailable("releases fail"))
        }
        forward_to_memory!(extend);
    }

    /// A grant not handed out (under-replicated, or come after its validity) whose release
    /// then fails stays held by nobody for its TTL: the locker says so at `warn` instead of
    /// dropping the error.
    #[tokio::test]
    async fn a_grant_that_cannot_be_given_back_is_told() {
        let (logs, _logging) = captured::capture(tracing::Level::WARN);
        let replicated = Locker::new(GivesNothingBack {
            inner: MemoryBackend::new(),
            delay: Duration::ZERO,
        });
        let o = opts(Duration::from_secs(5)).renew(false).replicas(1);
        let e = replicated
            .try_acquire("k", &o)
            .await
            .expect_err("no replica");
        assert!(matches!(e, Error::NotReplicated { .. }), "{e}");
        let text = logs.text();
        assert!(
            text.contains("WARN") && text.contains("under-replicated grant not given back"),
            "{text}"
        );

        let late = Locker::new(GivesNothingBack {
            inner: MemoryBackend::new(),
            delay: Duration::from_millis(150),
        });
        let o = opts(Duration::from_millis(100)).renew(false);
        let e = late.try_acquire("k", &o).await.expect_err("come too late");
        assert!(matches!(e, Error::LeaseLost { .. }), "{e}");
        let give_up = Instant::now() + Duration::from_secs(5);
        while !logs.text().contains("not handed out and not given back") {
            assert!(Instant::now() < give_up, "not told: {}", logs.text());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Takes a 150 ms lease on `key` and checks that renewal keeps it over four TTLs.
    async fn assert_renewed(locker: &Locker, key: &str) {
        let lease = locker
            .try_acquire(key, &opts(Duration::from_millis(150)))
            .await
            .expect("free");
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!lease.is_lost(), "the lease on {key} was not renewed");
    }

    /// The memory backend with every extend failing (a server that stopped answering renewals,
    /// while the key stays held on it), or every release (`releases`).
    #[derive(Clone)]
    struct Dead {
        inner: MemoryBackend,
        releases: bool,
    }

    fn unavailable(what: &'static str) -> Error {
        Error::Unavailable(redis::RedisError::from((redis::ErrorKind::Io, what)))
    }

    impl Backend for Dead {
        fn acquire(
            &self,
            key: &LockKey,
            token: &Token,
            ttl: Duration,
        ) -> impl Future<Output = Result<AcquireReply>> + Send {
            self.inner.acquire(key, token, ttl)
        }
        async fn release(&self, key: &LockKey, token: &Token) -> Result<bool> {
            if self.releases {
                return Err(unavailable("releases fail"));
            }
            self.inner.release(key, token).await
        }
        async fn extend(&self, leases: &[(LockKey, Token)], ttl: Duration) -> Result<Vec<bool>> {
            if self.releases {
                return self.inner.extend(leases, ttl).await;
            }
            Err(unavailable("renewals fail"))
        }
        forward_to_memory!();
    }

    /// Renewals never answer (a batch still in flight when its runtime shuts down); explicit
    /// extends do.
    #[derive(Clone)]
    struct Hanging {
        inner: MemoryBackend,
    }

    impl Backend for Hanging {
        forward_grants_to_memory!();
        fn extend(
            &self,
            leases: &[(LockKey, Token)],
            ttl: Duration,
        ) -> impl Future<Output = Result<Vec<bool>>> + Send {
            self.inner.extend(leases, ttl)
        }
        async fn extend_each(
            &self,
            _leases: &[(LockKey, Token)],
            _ttl: Duration,
        ) -> Result<Vec<Option<bool>>> {
            std::future::pending().await
        }
        forward_to_memory!();
    }

    /// A renewal in flight when the driver's runtime shuts down is settled as of unknown
    /// outcome, not left travelling for ever: an explicit extend on the next runtime then moves
    /// the lease's deadline to the extend's send time plus the cut-off renewal's TTL (that
    /// renewal may still land and set no more than that), where a renewal travelling for ever
    /// capped it at the deadline the renewal would have set, already almost over.
    #[test]
    fn a_renewal_cut_off_with_its_runtime_does_not_cap_later_extends() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
        };
        let locker = Locker::new(Hanging {
            inner: MemoryBackend::new(),
        });
        let ttl = Duration::from_millis(1_200);
        let first = runtime();
        let lease = first.block_on(async {
            let opts = LockOptions::new().ttl(ttl);
            let lease = locker.try_acquire("k", &opts).await.expect("grant");
            // The first renewal goes out a third of the TTL in, and hangs.
            tokio::time::sleep(Duration::from_millis(500)).await;
            lease
        });
        drop(first);
        runtime().block_on(async {
            // Nearer the cut-off renewal's deadline (about 1.6 s after the grant) than the
            // grant's TTL is long.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let sent = std::time::Instant::now();
            lease.extend(Duration::from_secs(10)).await.expect("extend");
            let left = lease.remaining();
            let most = ttl.saturating_sub(sent.elapsed());
            assert!(
                left > most.mul_f64(0.8) && left <= most,
                "{left:?} left after the extend; want about {most:?}"
            );
            assert!(!lease.is_lost());
        });
    }

    /// `with_lock` returns the body's result once it finished, whatever the release then
    /// finds, and says at `warn` when that was not a clean release: the key deleted from outside
    /// while the body ran (noticed by no renewal yet), or a release the backend refused.
    #[tokio::test]
    async fn with_lock_warns_of_a_release_that_found_the_lease_gone_or_failed() {
        let (logs, _logging) = captured::capture(tracing::Level::WARN);

        let memory = MemoryBackend::new();
        let locker = Locker::new(memory.clone());
        let key = locker.lock_key("deleted").expect("key");
        let out = locker
            .with_lock("deleted", &opts(Duration::from_secs(30)), |_| async {
                assert!(memory.force_delete(&key), "held while the body runs");
                7
            })
            .await;
        assert_eq!(out.expect("the body's result"), 7);
        let text = logs.text();
        assert!(
            text.contains("WARN") && text.contains("lapsed") && text.contains("deleted"),
            "{text}"
        );

        let locker = Locker::new(Dead {
            inner: MemoryBackend::new(),
            releases: true,
        });
        let out = locker
            .with_lock("refused", &opts(Duration::from_secs(30)), |_| async { 8 })
            .await;
        assert_eq!(out.expect("the body's result"), 8);
        let text = logs.text();
        assert!(
            text.contains("release failed") && text.contains("releases fail"),
            "{text}"
        );
    }

    /// A body that panics, or a `with_lock` call dropped while its body runs (a timeout around
    /// it), leaves the key free at once, not held until its TTL.
    #[tokio::test]
    async fn with_lock_frees_the_key_when_its_body_panics_or_its_call_is_dropped() {
        let memory = MemoryBackend::new();
        let locker = Locker::new(memory.clone());
        let key = locker.lock_key("k").expect("key");
        let freed = || async {
            let start = Instant::now();
            while memory.is_held(&key) {
                assert!(start.elapsed() < Duration::from_secs(5), "still held");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        let l = locker.clone();
        let panicked = tokio::spawn(async move {
            l.with_lock("k", &opts(Duration::from_secs(60)), |_| async {
                if true {
                    panic!("the body panics");
                }
            })
            .await
        })
        .await;
        assert!(panicked.is_err_and(|e| e.is_panic()));
        freed().await;
        let cut = tokio::time::timeout(
            Duration::from_millis(50),
            locker.with_lock("k", &opts(Duration::from_secs(60)), |_| {
                std::future::pending::<()>()
            }),
        )
        .await;
        assert!(cut.is_err(), "the body never ends");
        freed().await;
    }

    /// `with_lock` on a lost lease drops its body, returns `LeaseLost`, and releases the key:
    /// lost because renewals failed, the key is still held on the store, and is free before
    /// its TTL would have freed it.
    #[tokio::test(start_paused = true)]
    async fn with_lock_releases_a_lease_it_lost() {
        let memory = MemoryBackend::new();
        let locker = Locker::new(Dead {
            inner: memory.clone(),
            releases: false,
        });
        let key = locker.lock_key("k").expect("key");
        let started = Instant::now();
        let ttl = Duration::from_secs(2);
        let out = locker
            .with_lock("k", &opts(ttl), |_| std::future::pending::<()>())
            .await;
        assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
        let lost_at = started.elapsed();
        // Before the local deadline (the TTL less the drift allowance), as promised: lost at
        // its alarm, ahead of it, not when validity already ran out.
        let deadline = ttl - crate::types::drift(ttl);
        assert!(
            lost_at < deadline,
            "lost at {lost_at:?}, deadline {deadline:?}"
        );
        let free = async {
            while memory.is_held(&key) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_millis(20), free)
            .await
            .expect("still held after with_lock returned");
        assert!(started.elapsed() < ttl, "freed only by its TTL");
    }

    /// A body that finishes after its lease counted as lost, before the lease's `lost()` woke
    /// (the body blocked its thread past the alarm, so the timer had no chance to fire), is
    /// answered `LeaseLost`, as a body cancelled by the loss is: it ran past the validity.
    #[tokio::test(flavor = "current_thread")]
    async fn with_lock_answers_a_body_that_outlived_its_lease_lost() {
        let locker = Locker::memory();
        let opts = LockOptions::new()
            .ttl(Duration::from_millis(100))
            .renew(false);
        let out = locker
            .with_lock("k", &opts, |info| async move {
                std::thread::sleep(info.remaining() + Duration::from_millis(1));
                info.is_lost()
            })
            .await;
        assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
        // A body that ends in time is its result.
        let out = locker
            .with_lock("k", &opts, |info| async move { info.is_lost() })
            .await;
        assert!(matches!(out, Ok(false)), "{out:?}");
    }

    /// A guard dropped on a thread outside any runtime (a `Drop` in synchronous code) does
    /// not panic, and is released by the renewal driver on the runtime's own threads: the key
    /// is free long before its 60 s TTL. Renewing or not.
    #[test]
    fn a_guard_dropped_outside_a_runtime_is_released() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let locker = Locker::memory();
        // With no driver running yet (no lease of this locker renewed), a guard without
        // renewal dropped here has nothing to hand its release to: it is left to its TTL, and
        // nothing is queued for a driver that may never come.
        for i in 0..100 {
            let once = opts(Duration::from_secs(60)).renew(false);
            let lease = rt
                .block_on(locker.try_acquire(&format!("once:{i}"), &once))
                .expect("acquire");
            drop(lease);
        }
        let queued = locker.core.driver.get().map_or(0, |inbox| inbox.queued());
        assert_eq!(queued, 0, "releases queued with no driver to take them");
        for renew in [true, false] {
            let lease = rt
                .block_on(locker.try_acquire("k", &opts(Duration::from_secs(60)).renew(renew)))
                .expect("acquire");
            if !renew {
                // The driver runs on the runtime's worker, as it would once any lease renewed.
                let warm = rt.block_on(locker.try_acquire("warm", &opts(Duration::from_secs(60))));
                drop(warm);
            }
            assert!(tokio::runtime::Handle::try_current().is_err());
            drop(lease);
            let again = rt.block_on(async {
                let wait = opts(Duration::from_secs(1)).wait(Duration::from_secs(2));
                locker.acquire("k", &wait).await
            });
            let again = again.unwrap_or_else(|e| panic!("renew {renew}: not released: {e}"));
            rt.block_on(again.release()).expect("release");
        }
    }

    /// A renewing guard dropped where no driver takes its release: its turn still goes on, at
    /// the latest when the lease runs out, so a waiter in another runtime is granted the key
    /// once its TTL has passed, not told its wait timed out. Dropped outside any runtime after
    /// its driver's runtime shut down (the turn goes at once), and dropped in the last poll of
    /// the runtime its driver lives on, which then shuts down with the release still queued
    /// (the turn goes when the lease runs out).
    #[test]
    fn a_guard_dropped_with_no_driver_to_take_it_hands_its_turn_on() {
        for parked in [false, true] {
            let memory = MemoryBackend::new();
            let locker = Locker::new(memory.clone());
            // Unparked, long enough that a turn handed on only when the lease runs out is
            // told apart from one handed on at the drop.
            let ttl = Duration::from_millis(if parked { 1_000 } else { 3_000 });
            let first = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let lease = first
                .block_on(locker.acquire("k", &opts(ttl)))
                .expect("acquire");
            let second = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("runtime");
            let waiter = second.spawn({
                let locker = locker.clone();
                async move {
                    let wait = opts(ttl).wait(Duration::from_secs(5));
                    locker.acquire("k", &wait).await
                }
            });
            // The waiter queues behind the lease's turn.
            std::thread::sleep(Duration::from_millis(100));
            if parked {
                // The drop queues the release for the driver, which this runtime never polls
                // again.
                first.block_on(async move { drop(lease) });
                drop(first);
            } else {
                // Its driver stops with it.
                drop(first);
                assert!(tokio::runtime::Handle::try_current().is_err());
                // Freed on the store as if its release had run: the waiter is granted as soon
                // as the turn comes.
                assert!(memory.force_delete(&locker.lock_key("k").expect("key")));
                drop(lease);
            }
            let dropped = std::time::Instant::now();
            let next = second.block_on(waiter).expect("waiter task");
            let next = next.unwrap_or_else(|e| panic!("parked {parked}: the turn never came: {e}"));
            if !parked {
                let took = dropped.elapsed();
                assert!(
                    took < Duration::from_millis(1_500),
                    "the turn came {took:?} after the drop, not at once"
                );
            }
            second.block_on(next.release()).expect("release");
        }
    }

    /// A `Locker` outlives the runtime its renewal driver started on (kept in a static, used
    /// by one test runtime after another): the next runtime's leases are renewed all the same,
    /// by a driver started there. Also when the first runtime ended before its driver task was
    /// ever polled.
    #[test]
    fn renewal_outlives_the_runtime_it_started_on() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
        };
        let locker = Locker::memory();
        let (kept, granted) = runtime().block_on(async {
            let lease = locker
                .try_acquire("first", &opts(Duration::from_millis(150)))
                .await
                .expect("free");
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(!lease.is_lost(), "not renewed on the first runtime");
            (lease, std::time::Instant::now())
        });
        runtime().block_on(assert_renewed(&locker, "second"));
        // A lease the first driver held when its runtime shut down is not taken over (README:
        // "they report lost at their deadline"): it was last renewed before `granted`, so by
        // its TTL after that it is lost, `lost()` resolves on the later runtime, and the key is
        // free for another holder.
        runtime().block_on(async {
            tokio::time::sleep_until((granted + Duration::from_millis(150)).into()).await;
            assert!(kept.is_lost(), "a lease nobody renews outlived its TTL");
            tokio::time::timeout(Duration::from_secs(1), kept.lost())
                .await
                .expect("lost() resolves on the later runtime");
            let next = locker
                .try_acquire("first", &opts(Duration::from_millis(150)))
                .await
                .expect("the lease nobody renewed ran out");
            assert!(next.fence() > kept.fence());
        });
        // The driver spawned here never runs: the acquire completes without yielding and the
        // runtime shuts down with the task still unpolled.
        let unpolled = Locker::memory();
        runtime().block_on(async {
            let lease = unpolled
                .try_acquire("first", &opts(Duration::from_millis(150)))
                .await
                .expect("free");
            drop(lease);
        });
        runtime().block_on(assert_renewed(&unpolled, "second"));
    }

    /// The driver sleeps until the long lease's renewal, 20 s away; a short lease taken
    /// meanwhile must wake it, or its first renewal would come far too late.
    #[tokio::test]
    async fn a_short_lease_wakes_a_driver_asleep_for_a_long_one() {
        let locker = Locker::memory();
        let _long = locker
            .try_acquire("long", &opts(Duration::from_secs(60)))
            .await
            .expect("long");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_renewed(&locker, "short").await;
    }

    /// A lease released while its add is still queued takes the add back: nothing is left
    /// for the driver.
    #[tokio::test]
    async fn a_short_lease_leaves_nothing_queued() {
        let locker = Locker::memory();
        let o = opts(Duration::from_secs(60));
        let _long = locker.try_acquire("long", &o).await.expect("long");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(locker.queued(), 0);
        let lease = locker.try_acquire("short", &o).await.expect("short");
        assert_eq!(locker.queued(), 1, "the add waits for the driver");
        lease.release().await.expect("release");
        assert_eq!(locker.queued(), 0, "the release took the add back");
    }

    /// Leases that live a while but less than a third of their TTL never need the driver, so
    /// it is not woken for them; but their commands must not pile up without bound either.
    #[tokio::test]
    async fn queued_commands_stay_bounded() {
        let locker = Locker::memory();
        let o = opts(Duration::from_secs(60));
        let _long = locker.try_acquire("long", &o).await.expect("long");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut most = 0;
        // 200 held at a time: a release finds its add too far back to take it back.
        let mut held = std::collections::VecDeque::new();
        for i in 0..10_000 {
            held.push_back(locker.try_acquire(&format!("k{i}"), &o).await.expect("k"));
            if held.len() > 200
                && let Some(oldest) = held.pop_front()
            {
                oldest.release().await.expect("release");
            }
            most = most.max(locker.queued());
            tokio::task::yield_now().await;
        }
        assert!(most > 200, "commands were not queued ({most})");
        assert!(
            most <= renew::INBOX_LIMIT + 2,
            "{most} commands queued, above the limit"
        );
    }

    /// The in-memory backend never waits: `try_acquire` and `release` complete on their first
    /// poll. lock-tower's `LockLayer` relies on it to run them on its own stack.
    #[tokio::test]
    async fn memory_operations_complete_on_first_poll() {
        use std::future::Future;
        use std::task::{Context, Poll, Waker};
        let locker = Locker::memory();
        let o = opts(Duration::from_secs(5));
        let mut cx = Context::from_waker(Waker::noop());
        let Poll::Ready(lease) = std::pin::pin!(locker.try_acquire("k", &o)).poll(&mut cx) else {
            panic!("try_acquire was pending");
        };
        let lease = lease.expect("grant");
        let busy = std::pin::pin!(locker.try_acquire("k", &o)).poll(&mut cx);
        assert!(matches!(busy, Poll::Ready(Err(Error::Busy { .. }))));
        let released = std::pin::pin!(lease.release()).poll(&mut cx);
        assert!(matches!(
            released,
            Poll::Ready(Ok(crate::Release::Released))
        ));
    }

    /// Dropping a renewing guard stops its renewal at once: dropped just before its first
    /// renewal was due, it is never renewed (and it is released), while a guard kept is.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_guard_is_never_renewed() {
        let memory = MemoryBackend::new();
        let backend = Extends {
            inner: memory.clone(),
            ..Extends::default()
        };
        let locker = Locker::new(backend.clone());
        let o = opts(Duration::from_millis(300));
        let dropped = locker.try_acquire("dropped", &o).await.expect("acquire");
        // The first renewal is due at a third of the TTL, 100 ms.
        tokio::time::sleep(Duration::from_millis(95)).await;
        drop(dropped);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(backend.sent.load(Ordering::SeqCst), 0, "renewed after drop");
        let key = locker.lock_key("dropped").expect("key");
        assert!(!memory.is_held(&key), "not released");
        // The control: the same lease kept is renewed on that schedule.
        let kept = locker.try_acquire("kept", &o).await.expect("acquire");
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(backend.sent.load(Ordering::SeqCst) >= 2);
        kept.release().await.expect("release");
    }

    /// A guard dropped while the driver sleeps is released at once, not at the driver's next
    /// timer.
    #[tokio::test]
    async fn a_dropped_guard_is_released_promptly() {
        let locker = Locker::memory();
        let o = opts(Duration::from_secs(60));
        let _long = locker.try_acquire("long", &o).await.expect("long");
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(locker.try_acquire("dropped", &o).await.expect("dropped"));
        let again = locker
            .acquire("dropped", &o.clone().wait(Duration::from_secs(2)))
            .await
            .expect("released by the drop, long before the driver's timer");
        again.release().await.expect("release");
    }
}
