//! The small trait every backend implements, and the backends themselves.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Result;
use crate::types::{LockKey, Token};
use crate::wake::{Wakeups, Watch};

mod batch;
pub mod cluster;
pub mod memory;
pub mod quorum;
pub mod redis;

pub use self::cluster::{ClusterBackend, ClusterConn};
pub use self::memory::MemoryBackend;
pub use self::quorum::{QuorumBackend, QuorumConfig};
pub use self::redis::{RedisBackend, RedisConfig, RedisConn};

/// What the server answered to an acquire.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::{AcquireReply, Backend, Locker, MemoryBackend, Token};
/// use std::time::Duration;
/// let backend = MemoryBackend::new();
/// let key = Locker::memory().lock_key("k")?;
/// let ttl = Duration::from_secs(1);
/// let first = backend.acquire(&key, &Token::generate(), ttl).await?;
/// assert!(matches!(first, AcquireReply::Granted { .. }));
/// let second = backend.acquire(&key, &Token::generate(), ttl).await?;
/// assert!(matches!(second, AcquireReply::Held { remaining: Some(_) }));
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireReply {
    /// The lease is ours, with this fence.
    Granted {
        /// The fence of this grant.
        fence: u64,
        /// When the grant's validity counts from, if later than the call: a quorum that retried
        /// counts from the round that won, whose votes each set the lease's TTL anew on their
        /// member (the failed rounds' grants were given back first). `None`: from the call,
        /// before anything was sent.
        valid_from: Option<Instant>,
    },
    /// Another holder has it; its remaining TTL if it has one.
    Held {
        /// The holder's time left, `None` when the key has no expiry.
        remaining: Option<Duration>,
    },
}

/// The storage a [`Locker`](crate::Locker) runs on.
///
/// Implemented by the backends of this crate (memory, Redis/Valkey, cluster, quorum), and
/// public so that code generic over them can call it. A backend of your own cannot be written
/// yet: [`watch`](Backend::watch) must return a [`Watch`], which only this crate
/// can make.
///
/// On one server (memory, Redis/Valkey, the shard of a cluster that holds the key) every
/// operation is one atomic step; a quorum's are one such step on each member, with the
/// outcome decided by the majority (see [`QuorumBackend`]). `release` and `extend` check the token and
/// never touch a lease that is not the caller's; `extend` never recreates an expired lease. A
/// `ttl` outside [`MIN_TTL`](crate::MIN_TTL)`..=`[`MAX_TTL`](crate::MAX_TTL) is refused with
/// [`Error::InvalidTtl`](crate::Error::InvalidTtl) before anything is sent.
///
/// Code generic over the backend takes a `Locker<B>`:
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::{Backend, LockOptions, Locker, MemoryBackend};
///
/// async fn nightly_report<B: Backend + Clone>(locker: &Locker<B>) -> lock_core::Result<()> {
///     let lease = locker.try_acquire("nightly-report", &LockOptions::new()).await?;
///     // ... the report, writing with lease.fence() ...
///     lease.release().await?;
///     Ok(())
/// }
/// nightly_report(&Locker::new(MemoryBackend::new())).await?;
/// nightly_report(&Locker::memory()).await?; // `Locker<AnyBackend>`
/// # Ok(()) }
/// ```
pub trait Backend: Send + Sync + 'static {
    /// The backend's name in messages, such as the [`Error::Unsupported`](crate::Error::Unsupported)
    /// a backend without replicas answers to [`acquire_replicated`](Backend::acquire_replicated).
    const NAME: &'static str = "chosen";

    /// Grants the lease (`SET NX PX` semantics) and advances the fence, or reports the holder.
    fn acquire(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
    ) -> impl Future<Output = Result<AcquireReply>> + Send;

    /// As [`acquire`](Backend::acquire), but a grant keeps the key's fence only for `keep`
    /// (or the lease's `ttl`, if longer) instead of for ever; see
    /// [`LockOptions::keep_fence`](crate::LockOptions::keep_fence). The default keeps it for
    /// ever, which is always safe: only the storage grows.
    fn acquire_keeping_fence(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        keep: Duration,
    ) -> impl Future<Output = Result<AcquireReply>> + Send {
        let _ = keep;
        self.acquire(key, token, ttl)
    }

    /// As [`acquire`](Backend::acquire), then waits up to `timeout` for `replicas` replicas to
    /// acknowledge the writes (`WAIT`); returns the reply and how many acknowledged. Backends
    /// without replicas answer [`Error::Unsupported`](crate::Error::Unsupported). An acquire
    /// whose outcome is unknown, or whose caller left before the answer, is given back by the
    /// backend, in order behind the acquire; a grant it answered is the caller's.
    fn acquire_replicated(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        replicas: u32,
        timeout: Duration,
    ) -> impl Future<Output = Result<(AcquireReply, u32)>> + Send {
        let _ = (key, token, ttl, replicas, timeout);
        async {
            Err(crate::Error::Unsupported {
                what: "waiting for replicas",
                backend: Self::NAME,
            })
        }
    }

    /// Deletes the lease if `token` still holds it and wakes waiters. Returns whether it did.
    fn release(&self, key: &LockKey, token: &Token) -> impl Future<Output = Result<bool>> + Send;

    /// Resets the TTL of each lease still held by its token; one answer per item, in order.
    fn extend(
        &self,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> impl Future<Output = Result<Vec<bool>>> + Send;

    /// As [`extend`](Backend::extend), for the renewal driver: one answer per item, `None` where
    /// that item's outcome is unknown (its part of the batch failed) so that it is retried while
    /// the others settle. The default answers all or nothing; a backend whose batch spans
    /// several servers answers per server (a cluster) or per lease (a quorum, where one lease's
    /// answer may hang on a silent member while the others' are decided), so that one failed
    /// node does not stall the renewal of leases on the others.
    fn extend_each(
        &self,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> impl Future<Output = Result<Vec<Option<bool>>>> + Send {
        let answers = self.extend(items, ttl);
        async move { Ok(answers.await?.into_iter().map(Some).collect()) }
    }

    /// Admits `fence` at the gate stored under `gate_key` if no higher fence was admitted before.
    /// Returns `Ok(None)` when admitted and `Ok(Some(highest))` when stale.
    fn admit(&self, gate_key: &str, fence: u64)
    -> impl Future<Output = Result<Option<u64>>> + Send;

    /// Registers interest in releases of `key`. When this returns, a release that happens later
    /// is guaranteed to bump the watch (or, after a subscription gap, every watch) once the
    /// subscription is confirmed: it is waited for up to about a second; if it is not
    /// confirmed by then, the waiter's timer, and the wake-all of a later resubscription,
    /// cover the gap.
    fn watch(&self, key: &LockKey) -> impl Future<Output = Result<Watch>> + Send;

    /// The wake-up registry this backend feeds.
    fn wakeups(&self) -> &Arc<Wakeups>;

    /// Draws the token of a new acquire. The default is [`Token::generate`]: OS randomness,
    /// never bytes a parent process read before a `fork`. The memory backend, whose leases
    /// never leave the process, skips that fork check (a system call per token).
    fn token(&self) -> Token {
        Token::generate()
    }

    /// Whether the backend itself releases a grant whose [`acquire`](Backend::acquire) was
    /// dropped in flight (or its acquires cannot be dropped in flight). Otherwise the locker
    /// releases one in the background, token-checked, in case the acquire landed.
    fn undoes_abandoned_grants(&self) -> bool {
        false
    }

    /// Whether an acquire answered [`Held`](AcquireReply::Held) may have woken its own key's
    /// waiters: a quorum gives back the votes it won in a round it lost, and each give-back
    /// publishes a release like any other. A waiting locker then pauses (with backoff) before
    /// it waits again, so that its own give-back does not send it straight back to a key a
    /// majority still holds.
    fn held_wakes_waiters(&self) -> bool {
        false
    }

    /// [`release`](Backend::release), calling `in_line` once the release is in line ahead of
    /// every request sent on its connection after the call, so that the server runs it before
    /// them. The locker then hands the key's turn to the next waiter in this process, whose
    /// acquire, travelling behind the release, takes one round trip where waiting for the
    /// answer takes two. The default calls `in_line` when the answer came. Calling it too early
    /// costs speed, never safety: an acquire that overtakes the release finds the key held,
    /// subscribes to its wake-ups and asks again (about one round trip more than waiting for
    /// the answer would have taken).
    fn release_in_line(
        &self,
        key: &LockKey,
        token: &Token,
        in_line: impl FnOnce() + Send + 'static,
    ) -> impl Future<Output = Result<bool>> + Send {
        async move {
            let held = self.release(key, token).await;
            in_line();
            held
        }
    }
}

/// Any of the built-in backends (memory, Redis/Valkey, cluster, quorum), chosen at run time (for example from a command-line flag).
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::Locker;
/// // `Locker` is `Locker<AnyBackend>`: one type whichever backend the flag picks.
/// let locker = match std::env::args().nth(1) {
///     Some(url) => Locker::redis(&url).await?,
///     None => Locker::memory(),
/// };
/// # let _ = locker;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub enum AnyBackend {
    /// The in-process backend.
    Memory(MemoryBackend),
    /// A Redis or Valkey server.
    Redis(RedisBackend),
    /// A Redis or Valkey Cluster.
    Cluster(ClusterBackend),
    /// A Redlock quorum of independent Redis or Valkey servers.
    Quorum(QuorumBackend),
}

macro_rules! dispatch {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::Memory($b) => $e,
            AnyBackend::Redis($b) => $e,
            AnyBackend::Cluster($b) => $e,
            AnyBackend::Quorum($b) => $e,
        }
    };
}

/// As `dispatch!`, but the network backends' futures are boxed. A future over an enum is as
/// large as its largest variant's: unboxed, every in-memory acquire and release would carry (and
/// move, at each await up the stack) the space a Redis round trip needs, while one allocation
/// is nothing beside that round trip.
macro_rules! dispatch_boxed {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::Memory($b) => $e.await,
            AnyBackend::Redis($b) => Box::pin($e).await,
            AnyBackend::Cluster($b) => Box::pin($e).await,
            AnyBackend::Quorum($b) => Box::pin($e).await,
        }
    };
}

impl Backend for AnyBackend {
    async fn acquire(&self, key: &LockKey, token: &Token, ttl: Duration) -> Result<AcquireReply> {
        dispatch_boxed!(self, b => b.acquire(key, token, ttl))
    }
    async fn acquire_keeping_fence(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        keep: Duration,
    ) -> Result<AcquireReply> {
        dispatch_boxed!(self, b => b.acquire_keeping_fence(key, token, ttl, keep))
    }
    async fn acquire_replicated(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Duration,
        replicas: u32,
        timeout: Duration,
    ) -> Result<(AcquireReply, u32)> {
        dispatch!(self, b => b.acquire_replicated(key, token, ttl, replicas, timeout).await)
    }
    async fn release(&self, key: &LockKey, token: &Token) -> Result<bool> {
        dispatch_boxed!(self, b => b.release(key, token))
    }
    async fn extend(&self, items: &[(LockKey, Token)], ttl: Duration) -> Result<Vec<bool>> {
        dispatch!(self, b => b.extend(items, ttl).await)
    }
    async fn extend_each(
        &self,
        items: &[(LockKey, Token)],
        ttl: Duration,
    ) -> Result<Vec<Option<bool>>> {
        dispatch!(self, b => b.extend_each(items, ttl).await)
    }
    async fn admit(&self, gate_key: &str, fence: u64) -> Result<Option<u64>> {
        dispatch!(self, b => b.admit(gate_key, fence).await)
    }
    async fn watch(&self, key: &LockKey) -> Result<Watch> {
        dispatch!(self, b => b.watch(key).await)
    }
    fn wakeups(&self) -> &Arc<Wakeups> {
        dispatch!(self, b => b.wakeups())
    }
    fn undoes_abandoned_grants(&self) -> bool {
        dispatch!(self, b => b.undoes_abandoned_grants())
    }
    fn held_wakes_waiters(&self) -> bool {
        dispatch!(self, b => b.held_wakes_waiters())
    }
    fn token(&self) -> Token {
        dispatch!(self, b => b.token())
    }
    async fn release_in_line(
        &self,
        key: &LockKey,
        token: &Token,
        in_line: impl FnOnce() + Send + 'static,
    ) -> Result<bool> {
        dispatch_boxed!(self, b => b.release_in_line(key, token, in_line))
    }
}
