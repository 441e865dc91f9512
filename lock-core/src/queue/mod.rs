//! Claim leases: a work queue whose mutual exclusion is the lease on each job, not a mutex.
//!
//! A job is leased to exactly one worker at a time by [`Queue::claim`]: one atomic step pops the
//! oldest pending job, raises its `attempts` (the job's [`Fence`]) and scores it in the active
//! set at *server time + lease*. Every later step ([`complete`](Queue::complete),
//! [`retry`](Queue::retry), [`fail`](Queue::fail), [`extend`](Queue::extend)) names the attempt
//! it belongs to and is refused with [`Error::Stale`] once a newer attempt exists, so a worker
//! that paused past its lease cannot complete or retry a job another worker now holds.
//! [`Queue::reap`] returns every job whose lease deadline passed to pending (keeping its
//! attempts) or, after its maximum attempts, to the dead set.
//!
//! Delivery is at least once: a worker that finishes its work but loses the lease before
//! `complete` lands sees [`Error::Stale`] or [`Error::LeaseLost`], and the job runs again. Make
//! handlers idempotent, or have the resource they write check [`Claim::fence`] keyed by the job
//! id as well as the resource (see [`Claim::fence`]): the fence is the job's attempt count,
//! which starts at 1 for every job, so a [`FenceGate`](crate::FenceGate) named after the
//! resource alone would refuse job B's first attempt after job A's third.
//!
//! # Keys and clocks
//!
//! On Redis / Valkey everything lives under one hash tag, `{prefix:queue}`, so a queue sits in a
//! single cluster slot: `:pending`, `:active`, `:delayed`, `:dead` (sorted sets), `:seq` (the id
//! counter) and `:job:<id>` (a hash with `state`, `attempts`, `max`, `payload`, `error`).
//! Deadlines are read from the server's `TIME` inside the scripts; a worker's own clock is never
//! consulted, so a skewed client leases correctly. The memory backend times leases on this
//! process's monotonic clock, so a step of the wall clock (NTP, a resumed VM) neither expires a
//! held lease nor stretches a lapsed one; it reports times (`deadline_ms`, `at_ms`) in Unix
//! epoch ms as the wall clock reads when it answers.
//!
//! Durability is the server's: with append-only persistence a restart loses no enqueued job;
//! without it a restart loses the queue.
//!
//! # Limits
//!
//! - At least once, not exactly once (see above). A job runs again whenever its lease is lost.
//! - Expired leases come back only when something calls [`Queue::reap`]; every [`Worker`] does
//!   on a beat, so a queue with no running worker returns nothing until one starts.
//! - A lease that passed its deadline but was not reaped yet still holds: the worker may extend
//!   or complete it, since nobody else can have the job.
//! - After a job completes, a marker stays for [`QueueBuilder::keep_done`]; a late caller of an
//!   old attempt gets [`Error::Stale`] while it stays, [`Error::UnknownJob`] after.
//! - Dead jobs are kept, payload included, until [`Queue::purge_dead`] removes them: nothing
//!   removes them on its own, so a queue whose jobs keep dying grows until something purges
//!   it (a beat in your service, say `purge_dead` of what died over a week ago every hour).
//! - Payloads are at most [`MAX_PAYLOAD`] bytes; errors are stored cut to [`MAX_ERROR_LEN`].
//! - `max_attempts` is stored with each job at enqueue; changing the builder later does not
//!   change jobs already queued.
//! - The scripts write step by step and a server does not roll a script back: an ACL rule that
//!   denies one of their later commands (not the first) can leave a job out of every set. The
//!   rule in `docs/leasehold.acl` grants them all.
//! - On a cluster ([`QueueBuilder::cluster`]) a queue lives in one slot (one hash tag), so it
//!   gets one shard's throughput; spread load over several queues.
//! - On a single Redis primary with asynchronous replicas, a failover can lose the latest
//!   claims and completions, as it can any write: a job may then run again. Its fence may
//!   then repeat, too: a claim the replica missed leaves the attempt count one lower, so the
//!   next claim gets the same attempt number as the lost one, and a resource checking the
//!   fence cannot tell the two workers apart (the first one's own steps are refused, and its
//!   handler cancelled at its next extend). Unlike a lock's fence, the attempt count has no
//!   clock in it: where two runs of one job must never both write across a failover, make
//!   the write itself idempotent.
//! - On Redis / Valkey a lease runs on the server's wall clock: a step forward of that clock
//!   (NTP stepping it, a resumed VM, a failover to a replica whose clock is ahead) ends
//!   leases early, and the next reap hands their jobs to other workers while the first ones,
//!   whose own deadlines are local, still run them until their next extend is refused (up to
//!   a third of the lease). Run the servers' clocks in slew mode; the job's fence (its attempt
//!   count) still refuses the late worker's writes where they are checked.
//! - A server that loses writes (a failover, a restart without persistence, a flush) can hand
//!   a job id out again, and the new job's claims count their attempts from 1 again. A
//!   [`Claim`]'s own steps, and a [`Worker`]'s, carry the claim's token and are refused on the
//!   new job ([`Error::LeaseLost`] at the same attempt, [`Error::Stale`] once the new job has
//!   had more); the steps that name a job by id and attempt alone ([`Queue::complete`] and the
//!   rest) cannot tell the two apart, and neither can any step on a job claimed by a version
//!   of leasehold from before the token (during a rolling upgrade). When only the id counter
//!   is lost or set back while the jobs remain, an enqueue never overwrites a job: it leaps
//!   over existing ids (1, 2, 4, ... on, a few probes even a million jobs behind) and moves the
//!   counter there, so new ids can fall into gaps the old jobs left rather than strictly after
//!   every old one.
//!
//! ```
//! use lock_core::queue::Queue;
//! use std::time::Duration;
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
//! let queue = Queue::memory("emails")?; // or Queue::redis("redis://127.0.0.1/", "emails").await?
//! let id = queue.enqueue(b"hello".as_slice()).await?;
//! let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job is pending");
//! assert_eq!((claim.id(), claim.attempts()), (id, 1));
//! claim.complete().await?;
//! assert_eq!(queue.counts().await?.pending, 0);
//! # Ok(()) }
//! ```

mod memory;
mod redis;
mod worker;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, instrument, warn};

use crate::backend::{ClusterBackend, RedisBackend};
use crate::error::{Error, Result};
use crate::locker::DEFAULT_PREFIX;
use crate::types::{Fence, Token, drift, validate_key, validate_scope, validate_ttl, warn_ahead};
use crate::wake::Watch;

pub use worker::{Job, JobError, MAX_CONCURRENCY, Worker, WorkerHandle, WorkerReport};

/// Largest payload accepted by [`Queue::enqueue`], in bytes (1 MiB). Larger data belongs in a
/// blob store, with its address in the payload.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// use lock_core::{Error, queue::MAX_PAYLOAD};
/// assert_eq!(MAX_PAYLOAD, 1024 * 1024); // the README's "1 MiB"
/// let too_big = vec![0u8; MAX_PAYLOAD + 1];
/// assert!(matches!(queue.enqueue(&too_big).await, Err(Error::PayloadTooLarge { .. })));
/// # Ok(()) }
/// ```
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Longest error or failure reason stored with a job, in bytes; longer texts are cut at a
/// character boundary.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// use lock_core::queue::MAX_ERROR_LEN;
/// queue.enqueue(b"x").await?;
/// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
/// let id = claim.id();
/// claim.fail(&"e".repeat(MAX_ERROR_LEN + 100)).await?;
/// assert_eq!(queue.job(id).await?.error.map(|e| e.len()), Some(MAX_ERROR_LEN));
/// # Ok(()) }
/// ```
pub const MAX_ERROR_LEN: usize = 4096;
/// Attempts a job gets unless [`QueueBuilder::max_attempts`] says otherwise.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// use lock_core::queue::DEFAULT_MAX_ATTEMPTS;
/// let id = queue.enqueue(b"x").await?;
/// assert_eq!(queue.job(id).await?.max_attempts, u64::from(DEFAULT_MAX_ATTEMPTS));
/// # Ok(()) }
/// ```
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// How long a completed job leaves a marker behind unless [`QueueBuilder::keep_done`] says
/// otherwise: long enough that a late worker is told it is stale rather than that the job is
/// unknown.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// use lock_core::{Error, queue::DEFAULT_KEEP_DONE};
/// assert_eq!(DEFAULT_KEEP_DONE, Duration::from_secs(3600));
/// queue.enqueue(b"x").await?;
/// let first = queue.claim(Duration::from_secs(30)).await?.expect("a job");
/// let (id, old) = (first.id(), first.attempts());
/// first.complete().await?;
/// // Within the hour a repeated complete of the same attempt is confirmed, not unknown.
/// queue.complete(id, old).await?;
/// # Ok(()) }
/// ```
pub const DEFAULT_KEEP_DONE: Duration = Duration::from_secs(60 * 60);
/// The longest [`QueueBuilder::keep_done`] accepted: a year.
///
/// ```
/// use lock_core::{Error, queue::{MAX_KEEP_DONE, Queue}};
/// use std::time::Duration;
/// let refused = Queue::builder("q").keep_done(MAX_KEEP_DONE + Duration::from_secs(1)).memory();
/// assert!(matches!(refused, Err(Error::InvalidDuration { .. })));
/// ```
pub const MAX_KEEP_DONE: Duration = Duration::from_secs(365 * 86_400);
/// The longest delay [`Queue::retry`] accepts: a year. A longer one is refused with
/// [`Error::InvalidDuration`] before any round trip; park a job for good with
/// [`Queue::fail`] instead.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// use lock_core::{Error, queue::MAX_RETRY_DELAY};
/// queue.enqueue(b"x").await?;
/// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
/// let too_late = MAX_RETRY_DELAY + Duration::from_secs(1);
/// let refused = queue.retry(claim.id(), claim.attempts(), too_late).await;
/// assert!(matches!(refused, Err(Error::InvalidDuration { .. })));
/// # Ok(()) }
/// ```
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(365 * 86_400);
/// How often a waiting claim looks again when no wake-up arrives (a lost subscription, a
/// reaped job whose wake-up was missed).
///
/// ```
/// assert_eq!(lock_core::queue::CLAIM_POLL_FALLBACK, std::time::Duration::from_secs(1));
/// ```
pub const CLAIM_POLL_FALLBACK: Duration = Duration::from_secs(1);
/// Most jobs one reap script moves; [`Queue::reap`] repeats until none are left.
const REAP_BATCH: usize = 500;
/// Most payloads one enqueue script carries.
const ENQUEUE_BATCH: usize = 256;
/// Most payload bytes one enqueue script carries (a single larger payload goes alone), so one
/// call stays well inside the connection's response timeout.
const ENQUEUE_BATCH_BYTES: usize = 4 << 20;

/// A job's number within its queue: assigned at enqueue, increasing in enqueue order.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// let a = queue.enqueue(b"first").await?;
/// let b = queue.enqueue(b"second").await?;
/// assert!(b > a);
/// println!("enqueued job {b}");
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobId(pub u64);

impl JobId {
    /// The id as a plain number.
    ///
    /// ```
    /// assert_eq!(lock_core::queue::JobId(7).get(), 7);
    /// ```
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Where a job is in its life.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// use lock_core::queue::JobState;
/// let id = queue.enqueue(b"x").await?;
/// assert_eq!(queue.job(id).await?.state, JobState::Pending);
/// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
/// assert_eq!(queue.job(id).await?.state, JobState::Active);
/// assert_eq!(claim.retry(Duration::from_secs(60)).await?, JobState::Delayed);
/// assert_eq!(JobState::Delayed.to_string(), "delayed");
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum JobState {
    /// Waiting to be claimed.
    Pending,
    /// Waiting for its retry delay to pass before it becomes pending again.
    Delayed,
    /// Leased to a worker until its deadline.
    Active,
    /// Out of attempts or failed for good; kept with its last error.
    Dead,
    /// Completed; only a marker is left, for [`QueueBuilder::keep_done`].
    Done,
}

impl JobState {
    fn parse(s: &str) -> Option<JobState> {
        Some(match s {
            "pending" => JobState::Pending,
            "delayed" => JobState::Delayed,
            "active" => JobState::Active,
            "dead" => JobState::Dead,
            "done" => JobState::Done,
            _ => return None,
        })
    }

    fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Delayed => "delayed",
            JobState::Active => "active",
            JobState::Dead => "dead",
            JobState::Done => "done",
        }
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How many jobs are in each set.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// use lock_core::queue::QueueCounts;
/// queue.enqueue_many([b"a", b"b"]).await?;
/// let _claim = queue.claim(Duration::from_secs(30)).await?;
/// assert_eq!(queue.counts().await?, QueueCounts { pending: 1, active: 1, delayed: 0, dead: 0 });
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueCounts {
    /// Waiting to be claimed.
    pub pending: u64,
    /// Leased to a worker.
    pub active: u64,
    /// Waiting out a retry delay.
    pub delayed: u64,
    /// In the dead set.
    pub dead: u64,
}

/// One job as the store holds it (see [`Queue::job`]).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// let id = queue.enqueue(b"welcome").await?;
/// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
/// claim.retry_because(Duration::ZERO, "smtp timeout").await?;
/// let info = queue.job(id).await?;
/// assert_eq!((info.attempts, info.error.as_deref()), (1, Some("smtp timeout")));
/// assert_eq!(info.payload.as_deref(), Some(&b"welcome"[..]));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobInfo {
    /// The job.
    pub id: JobId,
    /// Where it is.
    pub state: JobState,
    /// Claims so far: the fence of the latest claim.
    pub attempts: u64,
    /// Claims it may have before it goes to the dead set (0: no limit).
    pub max_attempts: u64,
    /// The last error: a retry's or failure's reason, or the reaper's note of an expired lease.
    pub error: Option<String>,
    /// The payload; `None` once the job is done.
    pub payload: Option<Vec<u8>>,
    /// Milliseconds since the Unix epoch on the store's clock: the lease deadline (active), the
    /// time it becomes pending again (delayed) or the time it died (dead).
    pub at_ms: Option<u64>,
}

/// A job the reaper moved (see [`Queue::reap`]).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// use lock_core::queue::JobState;
/// queue.enqueue(b"x").await?;
/// let crashed = queue.claim(Duration::from_millis(20)).await?.expect("a job");
/// tokio::time::sleep(Duration::from_millis(40)).await;
/// let reaped = queue.reap().await?;
/// let back = (reaped[0].id, reaped[0].attempts, reaped[0].to);
/// assert_eq!(back, (crashed.id(), 1, JobState::Pending));
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reaped {
    /// The job.
    pub id: JobId,
    /// Its attempts, unchanged by the reap; 0 for a job whose server key held a foreign type,
    /// which the reaper set aside in the dead set without reading it.
    pub attempts: u64,
    /// Where it went: [`JobState::Pending`], or [`JobState::Dead`] when out of attempts.
    pub to: JobState,
}

/// Configures a [`Queue`]; finish with [`memory`](QueueBuilder::memory),
/// [`redis`](QueueBuilder::redis), [`on_redis`](QueueBuilder::on_redis),
/// [`cluster`](QueueBuilder::cluster) or [`on_cluster`](QueueBuilder::on_cluster).
///
/// ```
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::builder("thumbnails")
///     .prefix("media")
///     .max_attempts(3)
///     .keep_done(Duration::from_secs(600))
///     .memory()?;
/// assert_eq!(queue.name(), "thumbnails");
/// # Ok::<(), lock_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct QueueBuilder {
    name: String,
    prefix: String,
    max_attempts: u32,
    keep_done: Duration,
}

impl QueueBuilder {
    /// The key prefix (default [`DEFAULT_PREFIX`]); server keys become `{prefix:queue}:...`.
    /// The rules of a key, and no `:` (prefix `a:b` and queue `c` would name the queue `b:c`
    /// under prefix `a`), else [`Error::InvalidKey`] from the finishing call
    /// ([`memory`](QueueBuilder::memory), [`redis`](QueueBuilder::redis),
    /// [`on_redis`](QueueBuilder::on_redis), [`cluster`](QueueBuilder::cluster) or
    /// [`on_cluster`](QueueBuilder::on_cluster)).
    ///
    /// ```
    /// use lock_core::queue::Queue;
    /// let queue = Queue::builder("emails").prefix("billing").memory()?;
    /// assert!(Queue::builder("emails").prefix("a:b").memory().is_err());
    /// # let _ = queue;
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Claims a job may have before the reaper or a retry sends it to the dead set
    /// (default [`DEFAULT_MAX_ATTEMPTS`]; 0 means no limit). Stored with each job at enqueue.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{JobState, Queue};
    /// use std::time::Duration;
    /// let queue = Queue::builder("once").max_attempts(1).memory()?;
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert_eq!(claim.retry(Duration::ZERO).await?, JobState::Dead); // no attempts left
    /// # Ok(()) }
    /// ```
    pub fn max_attempts(mut self, max: u32) -> Self {
        self.max_attempts = max;
        self
    }

    /// How long a completed job's marker stays (default [`DEFAULT_KEEP_DONE`]). While it stays,
    /// a late caller of an old attempt gets [`Error::Stale`] and a repeated complete of the last
    /// attempt succeeds; afterwards both get [`Error::UnknownJob`]. Kept in whole milliseconds
    /// (under one but above zero counts as one). Zero deletes completed jobs at once, so a
    /// complete whose reply was lost cannot be confirmed (a worker counts it as lost); above
    /// [`MAX_KEEP_DONE`] the queue is not built ([`Error::InvalidDuration`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Error, queue::Queue};
    /// use std::time::Duration;
    /// let queue = Queue::builder("q").keep_done(Duration::ZERO).memory()?;
    /// let id = queue.enqueue(b"x").await?;
    /// queue.claim(Duration::from_secs(30)).await?.expect("a job").complete().await?;
    /// assert!(matches!(queue.job(id).await, Err(Error::UnknownJob { .. }))); // nothing kept
    /// # Ok(()) }
    /// ```
    pub fn keep_done(mut self, keep: Duration) -> Self {
        self.keep_done = keep;
        self
    }

    fn check(&self) -> Result<()> {
        validate_key(&self.name)?;
        validate_scope(&self.prefix)?;
        // The server would refuse the marker's expiry only after the job was deleted.
        if self.keep_done > MAX_KEEP_DONE {
            return Err(Error::InvalidDuration {
                what: "keep_done",
                value: self.keep_done,
                reason: "above MAX_KEEP_DONE (a year)",
            });
        }
        Ok(())
    }

    /// A queue held in this process. Clones of the returned queue share it; another call
    /// makes another, separate queue, even under the same name.
    ///
    /// ```
    /// use lock_core::queue::Queue;
    /// let queue = Queue::builder("thumbnails").max_attempts(3).memory()?;
    /// # let _ = queue;
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn memory(self) -> Result<Queue> {
        self.check()?;
        let store = Store::Memory(memory::MemoryQueue::new(&self.prefix, &self.name));
        Ok(self.finish(store))
    }

    /// A queue on the Redis or Valkey server at `url`, on its own connection.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// let queue = Queue::builder("thumbnails").max_attempts(3).redis("redis://127.0.0.1/").await?;
    /// # Ok(()) }
    /// ```
    pub async fn redis(self, url: &str) -> Result<Queue> {
        self.check()?;
        let backend = RedisBackend::connect(url).await?;
        self.on_redis(backend)
    }

    /// A queue on an existing backend, sharing its connection and its wake-up subscription
    /// with the locks taken through it.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Locker, RedisBackend, queue::Queue};
    /// let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
    /// let queue = Queue::builder("thumbnails").on_redis(backend.clone())?;
    /// let locker = Locker::new(backend); // one connection for both
    /// # Ok(()) }
    /// ```
    pub fn on_redis(self, backend: RedisBackend) -> Result<Queue> {
        self.check()?;
        let store = Store::Redis(Box::new(redis::RedisQueue::new(
            redis::Server::Single(backend),
            &self.prefix,
            &self.name,
        )));
        Ok(self.finish(store))
    }

    /// A queue on a Redis or Valkey Cluster, reached through any of `nodes`. Every key of the
    /// queue shares one hash tag, so the whole queue lives in one slot (one master).
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// let queue = Queue::builder("thumbnails").cluster(&["redis://10.0.0.1:7000/"]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn cluster(self, nodes: &[&str]) -> Result<Queue> {
        self.check()?;
        let backend = ClusterBackend::connect(nodes).await?;
        self.on_cluster(backend)
    }

    /// A queue on an existing cluster backend, sharing its connection and its sharded
    /// subscription with the locks taken through it.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{ClusterBackend, Locker, queue::Queue};
    /// let backend = ClusterBackend::connect(&["redis://10.0.0.1:7000/"]).await?;
    /// let queue = Queue::builder("thumbnails").on_cluster(backend.clone())?;
    /// let locker = Locker::new(backend);
    /// # Ok(()) }
    /// ```
    pub fn on_cluster(self, backend: ClusterBackend) -> Result<Queue> {
        self.check()?;
        let store = Store::Redis(Box::new(redis::RedisQueue::new(
            redis::Server::Cluster(backend),
            &self.prefix,
            &self.name,
        )));
        Ok(self.finish(store))
    }

    fn finish(self, store: Store) -> Queue {
        Queue {
            inner: Arc::new(Inner {
                name: self.name,
                max_attempts: self.max_attempts,
                keep_done: self.keep_done,
                store,
            }),
        }
    }
}

pub(crate) enum Store {
    Memory(memory::MemoryQueue),
    // Boxed: the Redis side carries its connection and key names, the memory side one Arc.
    Redis(Box<redis::RedisQueue>),
}

/// What a claim script answered.
pub(crate) enum ClaimReply {
    Claimed {
        id: u64,
        attempts: u64,
        deadline_ms: u64,
        payload: Vec<u8>,
    },
    /// Nothing pending; when the next delayed job becomes due, if any.
    Empty { next_due: Option<Duration> },
    /// A whole round of pending ids was set aside unclaimable (foreign types, corrupt jobs):
    /// more may be pending, so the claim asks again.
    SetAside,
}

/// Why a step on a job was refused.
pub(crate) enum Refusal {
    Unknown,
    Stale {
        current: u64,
    },
    NotHeld {
        state: String,
    },
    /// The caller named an attempt above the job's latest: one never granted (made up, or a
    /// claim a failover lost), which no newer attempt superseded, so it is not stale.
    Unissued {
        current: u64,
    },
}

/// One step on a claimed job.
pub(crate) enum Op<'a> {
    Complete { keep_done_ms: u64 },
    Retry { delay_ms: u64, error: &'a str },
    Fail { reason: &'a str },
    Extend { lease_ms: u64 },
}

impl Op<'_> {
    fn name(&self) -> &'static str {
        match self {
            Op::Complete { .. } => "complete",
            Op::Retry { .. } => "retry",
            Op::Fail { .. } => "fail",
            Op::Extend { .. } => "extend",
        }
    }
}

/// Where a step left the job, and its new deadline or ready time if it has one.
pub(crate) struct Settled {
    pub(crate) state: JobState,
    pub(crate) at_ms: Option<u64>,
}

macro_rules! store {
    ($self:expr, $s:ident => $e:expr) => {
        match &$self.inner.store {
            Store::Memory($s) => $e,
            Store::Redis($s) => $e,
        }
    };
}

struct Inner {
    name: String,
    max_attempts: u32,
    keep_done: Duration,
    store: Store,
}

/// A work queue with claim leases, on memory or Redis / Valkey. Cheap to clone; clones share
/// the store and its connection.
///
/// See the [module documentation](self) for the model, keys and clocks.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// let worker_side = queue.clone(); // clones share the queue
/// queue.enqueue(b"welcome").await?;
/// let claim = worker_side.claim(Duration::from_secs(30)).await?.expect("a job");
/// claim.complete().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Queue {
    inner: Arc<Inner>,
}

impl fmt::Debug for Queue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `d` in the whole milliseconds the stores count in, where anything under one but zero is
/// one: a retry delay or a done marker's keep under a millisecond is still a delay or a keep
/// (zero alone means none).
fn whole_ms(d: Duration) -> u64 {
    ms(d).max(u64::from(!d.is_zero()))
}

/// Checks a retry delay before any round trip. A delay past the bound is a unit mistake, not
/// a plan, and far enough past it the stores stop agreeing on when the job is due (the server's
/// score overflows its integer reply, the memory store saturates).
fn validate_retry_delay(delay: Duration) -> Result<()> {
    if delay > MAX_RETRY_DELAY {
        return Err(Error::InvalidDuration {
            what: "retry delay",
            value: delay,
            reason: "above MAX_RETRY_DELAY (a year)",
        });
    }
    Ok(())
}

/// Cuts `text` to [`MAX_ERROR_LEN`] bytes at a character boundary.
fn clip(text: &str) -> &str {
    if text.len() <= MAX_ERROR_LEN {
        return text;
    }
    let mut end = MAX_ERROR_LEN;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl Queue {
    /// Starts configuring a queue named `name` (any key-safe text: no braces or control
    /// characters, at most 512 bytes).
    ///
    /// ```
    /// use lock_core::queue::Queue;
    /// let queue = Queue::builder("emails").max_attempts(10).memory()?;
    /// assert!(Queue::builder("").memory().is_err());
    /// # let _ = queue;
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn builder(name: impl Into<String>) -> QueueBuilder {
        QueueBuilder {
            name: name.into(),
            prefix: DEFAULT_PREFIX.to_owned(),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            keep_done: DEFAULT_KEEP_DONE,
        }
    }

    /// A queue in this process with the defaults (see [`QueueBuilder::memory`]).
    ///
    /// ```
    /// let queue = lock_core::queue::Queue::memory("emails")?;
    /// # let _ = queue;
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn memory(name: &str) -> Result<Queue> {
        Queue::builder(name).memory()
    }

    /// A queue on the Redis or Valkey server at `url`, with the defaults.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// let queue = lock_core::queue::Queue::redis("redis://127.0.0.1/", "emails").await?;
    /// # Ok(()) }
    /// ```
    pub async fn redis(url: &str, name: &str) -> Result<Queue> {
        Queue::builder(name).redis(url).await
    }

    /// The queue's name.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// assert_eq!(queue.name(), "mail");
    /// # Ok(()) }
    /// ```
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    fn job_name(&self, id: JobId) -> String {
        format!("{}/job:{}", self.inner.name, id.0)
    }

    /// Adds a job at the back of the queue and wakes waiting claimers. Returns its id.
    ///
    /// Payloads above [`MAX_PAYLOAD`] are refused with [`Error::PayloadTooLarge`]. On Redis,
    /// a queue key of a foreign type, or a job id counter set from outside to anything but a
    /// decimal below 2^53 - 2^43 (ids pass through the server's Lua as doubles), is refused
    /// with [`Error::WrongType`] and nothing is added.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// let id = queue.enqueue(b"to: ada@example.com").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert_eq!((claim.id(), claim.payload()), (id, &b"to: ada@example.com"[..]));
    /// # Ok(()) }
    /// ```
    #[instrument(level = "debug", skip_all, fields(queue = %self.inner.name))]
    pub async fn enqueue(&self, payload: impl AsRef<[u8]>) -> Result<JobId> {
        let ids = self.enqueue_many([payload]).await?;
        // Both stores answer one id per payload; this only guards against a broken reply.
        ids.into_iter().next().ok_or_else(|| {
            Error::Unavailable(::redis::RedisError::from((
                ::redis::ErrorKind::UnexpectedReturnType,
                "enqueue returned no id",
            )))
        })
    }

    /// Adds several jobs in order, up to 256 (and 4 MiB) per round trip. Every payload is
    /// checked before any is sent, so an oversize one means none were added. A server failure
    /// midway leaves the round trips that succeeded enqueued, and says which:
    /// [`Error::PartlyEnqueued`] carries their ids (a failure in the first round trip is
    /// returned as it is).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// let ids = queue.enqueue_many(["a", "b", "c"]).await?;
    /// assert_eq!(ids.len(), 3);
    /// assert_eq!(queue.counts().await?.pending, 3);
    /// # Ok(()) }
    /// ```
    #[instrument(level = "debug", skip_all, fields(queue = %self.inner.name))]
    pub async fn enqueue_many<I, P>(&self, payloads: I) -> Result<Vec<JobId>>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        let payloads: Vec<P> = payloads.into_iter().collect();
        for p in &payloads {
            let len = p.as_ref().len();
            if len > MAX_PAYLOAD {
                return Err(Error::PayloadTooLarge {
                    len,
                    max: MAX_PAYLOAD,
                });
            }
        }
        let max = u64::from(self.inner.max_attempts);
        let mut ids = Vec::with_capacity(payloads.len());
        let mut rest: &[P] = &payloads;
        while !rest.is_empty() {
            let mut take = 0;
            let mut bytes = 0;
            for p in rest.iter().take(ENQUEUE_BATCH) {
                let len = p.as_ref().len();
                if take > 0 && bytes + len > ENQUEUE_BATCH_BYTES {
                    break;
                }
                take += 1;
                bytes += len;
            }
            let (chunk, tail) = rest.split_at(take);
            rest = tail;
            let chunk: Vec<&[u8]> = chunk.iter().map(AsRef::as_ref).collect();
            // Chunks land one by one: if a later one fails, the earlier ones stay enqueued, and
            // the caller learns which (a retry of the whole list would add them twice).
            match store!(self, s => s.enqueue(&chunk, max).await) {
                Ok(got) => ids.extend(got.into_iter().map(JobId)),
                Err(e) if ids.is_empty() => return Err(e),
                Err(e) => {
                    return Err(Error::PartlyEnqueued {
                        enqueued: ids,
                        source: Box::new(e),
                    });
                }
            }
        }
        debug!(count = ids.len(), "enqueued");
        Ok(ids)
    }

    /// Serialises `value` as JSON and enqueues it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use serde_json::{Value, json};
    /// use std::time::Duration;
    ///
    /// let queue = Queue::memory("thumbnails")?;
    /// queue.enqueue_json(&json!({ "path": "cat.png", "width": 128 })).await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert_eq!(claim.json::<Value>()?["width"], 128);
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "serde")]
    pub async fn enqueue_json<T: serde::Serialize + ?Sized>(&self, value: &T) -> Result<JobId> {
        let bytes = serde_json::to_vec(value).map_err(|e| Error::Codec(Box::new(e)))?;
        self.enqueue(bytes).await
    }

    /// Claims the oldest pending job for `ttl`, or returns `None` when nothing is pending.
    ///
    /// Retries whose delay has passed rejoin pending first, at their original place, at most
    /// 100 a claim and the earliest due first (so a claim stays one short step however many
    /// retries come due at once; of those due at one millisecond, in the order of their ids'
    /// decimal text, as a Redis sorted set orders them, on every store); the rest join with
    /// the next claims. One atomic step raises the job's attempts (its fence) and sets its
    /// deadline to the
    /// store's clock plus `ttl`. The lease is not renewed: call [`Claim::extend`] for long
    /// work, or run jobs through a [`Worker`], which does. A claim whose reply is lost in
    /// transit ([`Error::OutcomeUnknown`]) leaves the job active until the reaper returns it.
    /// A claim whose reply arrives after its validity (ttl less drift, counted from before the
    /// request), or so near its end that no work fits, is given back at once (to pending, or to
    /// the dead set on its last attempt, its attempt counted, as the reaper would) and reported
    /// as [`Error::LeaseLost`]: a claim is never handed out already expired. A claim whose
    /// caller stops waiting for it (a timeout or a `select!` around the call) is given back
    /// the same way once it is answered, not left active for its whole lease.
    ///
    /// On Redis / Valkey, a job whose key was overwritten with another type (by someone else)
    /// is not claimed: its id is set aside in the dead set, its key left untouched, with a
    /// warning in the log, and the claim goes on to the next job. So is a job whose `attempts`
    /// field was overwritten with something not an integer (it has no fence to give): it goes
    /// to the dead set with the reason as its error, the field kept as it was found. Any other
    /// refusal by the server (out of memory, an ACL rule denying the script's first command)
    /// fails the claim and leaves the job pending. An ACL rule that denies a later command of
    /// the script (`ZADD`, `HSET`) is not undone that way: the server does not roll a script
    /// back, so the job can be left out of every set. Give the queue's user the whole rule of
    /// `docs/leasehold.acl`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// assert!(queue.claim(Duration::from_secs(30)).await?.is_none()); // nothing pending
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert_eq!(claim.attempts(), 1);
    /// # claim.complete().await?;
    /// # Ok(()) }
    /// ```
    #[instrument(level = "debug", skip_all, fields(queue = %self.inner.name, ttl = ?ttl))]
    pub async fn claim(&self, ttl: Duration) -> Result<Option<Claim>> {
        validate_ttl(ttl)?;
        match self.claim_once(ttl).await? {
            Once::Claimed(claim) => Ok(Some(claim)),
            Once::Empty(_) => Ok(None),
            Once::Late(key) => Err(Error::LeaseLost { key }),
        }
    }

    /// Claims the oldest pending job, waiting up to `wait` for one to arrive
    /// (`Duration::MAX`: as long as it takes).
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> lock_core::Result<()> {
    /// use std::time::Duration;
    /// use lock_core::queue::Queue;
    ///
    /// let q = Queue::memory("orders")?;
    /// let producer = q.clone();
    /// tokio::spawn(async move { producer.enqueue(b"order 1").await });
    /// let job = q.claim_wait(Duration::from_secs(30), Duration::from_secs(5)).await?;
    /// assert_eq!(job.expect("woken by the enqueue").payload(), b"order 1");
    /// # Ok(()) }
    /// ```
    ///
    /// Waiters wake on enqueue (and on retries and reaps that return jobs to pending), on a
    /// retry that delays a job (to look again), and otherwise when the next delayed job is due
    /// or after [`CLAIM_POLL_FALLBACK`]. A claim that comes back after its validity is given
    /// back, as in [`claim`](Self::claim), and the wait goes on (a stalled machine or a slow
    /// link makes one a passing thing); the third such claim, or one at the end of the wait,
    /// ends it with [`Error::LeaseLost`]: round trips slower than the TTL would otherwise take
    /// the job and give it back for as long as the wait lasts. A [`Worker`] then backs off and
    /// claims again.
    pub async fn claim_wait(&self, ttl: Duration, wait: Duration) -> Result<Option<Claim>> {
        validate_ttl(ttl)?;
        let give_up = crate::types::deadline_after(Instant::now(), wait);
        self.claim_until(ttl, give_up, None).await
    }

    /// One claim round trip.
    async fn claim_once(&self, ttl: Duration) -> Result<Once> {
        // The local deadline counts from before the request leaves, so a slow reply can only
        // shorten it.
        // The claim's own token: a server that lost its writes can hand the same id out again,
        // with attempts counting from 1 again, and only this tells the two claims apart.
        let holder = Token::generate();
        loop {
            let start = Instant::now();
            match self.claim_request(ttl, &holder).await? {
                ClaimReply::Claimed {
                    id,
                    attempts,
                    deadline_ms,
                    payload,
                } => {
                    let claim = Claim {
                        queue: self.clone(),
                        id: JobId(id),
                        holder,
                        attempts,
                        deadline_ms,
                        local_deadline: start + ttl - drift(ttl),
                        payload,
                    };
                    if claim.local_deadline <= Instant::now() + warn_ahead(ttl) {
                        // The reply took the lease's validity, or nearly: the job may be reaped
                        // and claimed again already, and run here it would run unprotected.
                        // Given back now rather than when the reaper finds it, its attempt
                        // counted, as the reaper counts a holder's that crashed.
                        debug!(
                            id,
                            attempts, "claim arrived after its validity; giving it back"
                        );
                        let key = self.job_name(claim.id);
                        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                            runtime.spawn(async move {
                                let why = "the claim's reply arrived after its lease ran out";
                                if let Err(e) = claim.retry_because(Duration::ZERO, why).await {
                                    warn!(id, error = %e, "a late claim was not given back; the reaper returns it");
                                }
                            });
                        }
                        return Ok(Once::Late(key));
                    }
                    debug!(id, attempts, "claimed");
                    return Ok(Once::Claimed(claim));
                }
                ClaimReply::Empty { next_due } => return Ok(Once::Empty(next_due)),
                ClaimReply::SetAside => {}
            }
        }
    }

    /// One claim request. On Redis / Valkey it runs on a task of its own, which a caller who
    /// leaves mid-way (a timeout or a `select!` around the claim) cannot cut short: a job
    /// claimed for nobody goes back to pending at once (its attempt counted, as the reaper
    /// would count it) instead of staying active for its whole lease. The memory store answers
    /// on the first poll, so nothing is left in flight there.
    async fn claim_request(&self, ttl: Duration, holder: &Token) -> Result<ClaimReply> {
        let redis = match &self.inner.store {
            Store::Memory(s) => return s.claim(ms(ttl), holder.as_str()).await,
            Store::Redis(s) => s,
        };
        let (answer, answered) = tokio::sync::oneshot::channel();
        let (queue, owner) = (self.clone(), holder.clone());
        let exchange = async move {
            if answer.is_closed() {
                return;
            }
            let reply = store!(queue, s => s.claim(ms(ttl), owner.as_str()).await);
            if let Err(reply) = answer.send(reply) {
                give_back_unread(queue, owner, reply).await;
            }
        };
        tokio::spawn(exchange.instrument(tracing::Span::current()));
        let mut unread = Unread {
            queue: self,
            holder,
            answered,
        };
        (&mut unread.answered)
            .await
            .unwrap_or_else(|_| Err(redis.unanswered("claim")))
    }

    /// The waiting claim shared by [`Queue::claim_wait`] and the worker. `stop` ends the wait
    /// only between round trips, never in the middle of a claim, so a cancelled waiter cannot
    /// strand a job it was granted.
    pub(crate) async fn claim_until(
        &self,
        ttl: Duration,
        give_up: Instant,
        stop: Option<&CancellationToken>,
    ) -> Result<Option<Claim>> {
        let mut watch: Option<Watch> = None;
        let mut late = 0;
        loop {
            if let Some(w) = watch.as_mut() {
                w.mark_seen();
            }
            // A stop is honoured before every claim: the wake-up that ended the last wait may
            // have come together with it.
            if stop.is_some_and(CancellationToken::is_cancelled) {
                return Ok(None);
            }
            let next_due = match self.claim_once(ttl).await? {
                Once::Claimed(claim) => return Ok(Some(claim)),
                Once::Empty(next_due) => next_due,
                // A late claim was given back: the wait goes on, as the locker's does after a
                // late grant (a stalled machine or a slow link makes one a passing thing), until
                // a few of them say the round trips are slower than the TTL.
                Once::Late(key) => {
                    late += 1;
                    if late >= MAX_LATE_CLAIMS || Instant::now() >= give_up {
                        return Err(Error::LeaseLost { key });
                    }
                    // Its give-back wakes this wait when the job is pending again.
                    None
                }
            };
            if watch.is_none() {
                if Instant::now() >= give_up {
                    // A wait already over (`Duration::ZERO`) has no use for a subscription.
                    return Ok(None);
                }
                // Subscribe, then look once more: an enqueue between the empty claim and the
                // subscription would otherwise wait for the fallback timer. Bounded by the
                // wait: a subscription slow to be confirmed must not carry it past its end.
                let subscribed = async { store!(self, s => s.watch().await) };
                match tokio::time::timeout_at(give_up, subscribed).await {
                    Ok(w) => watch = Some(w?),
                    Err(_) => return Ok(None),
                }
                continue;
            }
            let now = Instant::now();
            if now >= give_up || stop.is_some_and(CancellationToken::is_cancelled) {
                return Ok(None);
            }
            let timer = next_due
                .map(|d| d + Duration::from_millis(2))
                .unwrap_or(CLAIM_POLL_FALLBACK)
                .min(CLAIM_POLL_FALLBACK);
            let wake_at = (now + timer).min(give_up);
            let Some(w) = watch.as_mut() else { continue };
            let stopped = async {
                match stop {
                    Some(t) => t.cancelled().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = stopped => return Ok(None),
                _ = w.changed() => {},
                _ = tokio::time::sleep_until(wake_at) => {},
            }
        }
    }

    async fn settle(&self, id: JobId, attempts: u64, holder: &str, op: Op<'_>) -> Result<Settled> {
        let name = op.name();
        let reply = store!(self, s => s.settle(id.0, attempts, holder, &op).await)?;
        match reply {
            Ok(done) => {
                debug!(op = name, id = id.0, attempts, state = %done.state, "settled");
                Ok(done)
            }
            Err(Refusal::Unknown) => Err(Error::UnknownJob {
                queue: self.inner.name.clone(),
                id: id.0,
            }),
            Err(Refusal::Stale { current }) => {
                debug!(op = name, id = id.0, attempts, current, "stale");
                Err(Error::Stale {
                    resource: self.job_name(id),
                    fence: Fence(attempts),
                    highest: Fence(current),
                })
            }
            Err(Refusal::Unissued { current }) => {
                debug!(
                    op = name,
                    id = id.0,
                    attempts,
                    current,
                    "attempt never granted"
                );
                Err(Error::LeaseLost {
                    key: self.job_name(id),
                })
            }
            Err(Refusal::NotHeld { state }) => {
                debug!(
                    op = name,
                    id = id.0,
                    attempts,
                    state,
                    "lease no longer held"
                );
                Err(Error::LeaseLost {
                    key: self.job_name(id),
                })
            }
        }
    }

    /// Marks attempt `attempts` of job `id` done and removes it from the active set.
    ///
    /// Refused with [`Error::Stale`] when a newer attempt exists, [`Error::LeaseLost`] when the
    /// attempt's lease ended without a newer claim (reaped back to pending, or already retried
    /// or failed) or when `attempts` is above the job's latest attempt (one never granted, such
    /// as a claim a failover lost: nothing superseded it, so it is not stale), and
    /// [`Error::UnknownJob`] when no such job exists. Completing the same
    /// attempt twice succeeds while the job's done marker is kept
    /// ([`QueueBuilder::keep_done`]), so a complete whose reply was lost can be sent again;
    /// with `keep_done` zero, or once the marker has expired, the repeat finds no job
    /// ([`Error::UnknownJob`]) and cannot tell a completion that landed from one that did not.
    ///
    /// By id and attempt alone this step cannot tell a job from one that reuses its id after
    /// the server lost writes (see the module's limits); [`Claim::complete`] can.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// use lock_core::Error;
    /// queue.enqueue(b"x").await?;
    /// let first = queue.claim(Duration::from_millis(20)).await?.expect("a job");
    /// let (id, attempt) = (first.id(), first.attempts());
    /// tokio::time::sleep(Duration::from_millis(40)).await; // paused past the lease
    /// queue.reap().await?;
    /// let second = queue.claim(Duration::from_secs(30)).await?.expect("the job again");
    /// // The first worker wakes up and reports done: refused, a newer attempt holds the job.
    /// assert!(matches!(queue.complete(id, attempt).await, Err(Error::Stale { .. })));
    /// queue.complete(id, second.attempts()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn complete(&self, id: JobId, attempts: u64) -> Result<()> {
        self.complete_as(id, attempts, "").await
    }

    /// [`Queue::complete`] by the claim whose token is `holder` ('' for any).
    #[instrument(level = "debug", skip(self, holder), fields(queue = %self.inner.name))]
    pub(crate) async fn complete_as(&self, id: JobId, attempts: u64, holder: &str) -> Result<()> {
        let keep_done_ms = whole_ms(self.inner.keep_done);
        self.settle(id, attempts, holder, Op::Complete { keep_done_ms })
            .await
            .map(|_| ())
    }

    /// Gives the job back: pending at once (at its original place) when `delay` is zero,
    /// delayed otherwise, or dead when it has used all its attempts. Returns where it went.
    /// Refused as [`Queue::complete`] is, and a `delay` above [`MAX_RETRY_DELAY`] with
    /// [`Error::InvalidDuration`] before any round trip.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> lock_core::Result<()> {
    /// use std::time::Duration;
    /// use lock_core::queue::{JobState, Queue};
    ///
    /// let q = Queue::memory("mail")?;
    /// q.enqueue(b"welcome").await?;
    /// let job = q.claim(Duration::from_secs(30)).await?.expect("a job");
    /// let to = q.retry(job.id(), job.attempts(), Duration::ZERO).await?;
    /// assert_eq!(to, JobState::Pending);
    /// let again = q.claim(Duration::from_secs(30)).await?.expect("the same job");
    /// assert_eq!((again.id(), again.attempts()), (job.id(), 2));
    /// # Ok(()) }
    /// ```
    pub async fn retry(&self, id: JobId, attempts: u64, delay: Duration) -> Result<JobState> {
        self.retry_because(id, attempts, delay, "").await
    }

    /// [`Queue::retry`], recording `error` as the job's last error (cut to [`MAX_ERROR_LEN`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// use lock_core::queue::JobState;
    /// let id = queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// let delay = Duration::from_secs(5);
    /// let to = queue.retry_because(id, claim.attempts(), delay, "rate limited").await?;
    /// assert_eq!(to, JobState::Delayed);
    /// assert_eq!(queue.job(id).await?.error.as_deref(), Some("rate limited"));
    /// # Ok(()) }
    /// ```
    pub async fn retry_because(
        &self,
        id: JobId,
        attempts: u64,
        delay: Duration,
        error: &str,
    ) -> Result<JobState> {
        self.retry_as(id, attempts, "", delay, error).await
    }

    /// [`Queue::retry_because`] by the claim whose token is `holder` ('' for any).
    #[instrument(level = "debug", skip(self, holder, error), fields(queue = %self.inner.name))]
    pub(crate) async fn retry_as(
        &self,
        id: JobId,
        attempts: u64,
        holder: &str,
        delay: Duration,
        error: &str,
    ) -> Result<JobState> {
        validate_retry_delay(delay)?;
        let op = Op::Retry {
            delay_ms: whole_ms(delay),
            error: clip(error),
        };
        Ok(self.settle(id, attempts, holder, op).await?.state)
    }

    /// Sends the job to the dead set now, with `reason` (cut to [`MAX_ERROR_LEN`]) as its last
    /// error, whatever attempts it has left. Refused as [`Queue::complete`] is.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// use lock_core::queue::JobState;
    /// let id = queue.enqueue(b"not an address").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// queue.fail(id, claim.attempts(), "malformed address").await?;
    /// assert_eq!(queue.job(id).await?.state, JobState::Dead);
    /// assert_eq!(queue.counts().await?.dead, 1);
    /// # Ok(()) }
    /// ```
    pub async fn fail(&self, id: JobId, attempts: u64, reason: &str) -> Result<()> {
        self.fail_as(id, attempts, "", reason).await
    }

    /// [`Queue::fail`] by the claim whose token is `holder` ('' for any).
    #[instrument(level = "debug", skip(self, holder, reason), fields(queue = %self.inner.name))]
    pub(crate) async fn fail_as(
        &self,
        id: JobId,
        attempts: u64,
        holder: &str,
        reason: &str,
    ) -> Result<()> {
        let op = Op::Fail {
            reason: clip(reason),
        };
        self.settle(id, attempts, holder, op).await.map(|_| ())
    }

    /// Moves the job's deadline to the store's clock plus `ttl`. Returns the new deadline in
    /// milliseconds since the Unix epoch on the store's clock. Refused as
    /// [`Queue::complete`] is, so a lease that was reaped is never revived.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(1)).await?.expect("a job");
    /// let deadline = queue.extend(claim.id(), claim.attempts(), Duration::from_secs(60)).await?;
    /// assert!(deadline > claim.deadline_ms());
    /// # Ok(()) }
    /// ```
    pub async fn extend(&self, id: JobId, attempts: u64, ttl: Duration) -> Result<u64> {
        self.extend_as(id, attempts, "", ttl).await
    }

    /// [`Queue::extend`] by the claim whose token is `holder` ('' for any).
    #[instrument(level = "debug", skip(self, holder), fields(queue = %self.inner.name))]
    pub(crate) async fn extend_as(
        &self,
        id: JobId,
        attempts: u64,
        holder: &str,
        ttl: Duration,
    ) -> Result<u64> {
        validate_ttl(ttl)?;
        let op = Op::Extend { lease_ms: ms(ttl) };
        let done = self.settle(id, attempts, holder, op).await?;
        Ok(done.at_ms.unwrap_or_default())
    }

    /// Moves every active job whose deadline has passed on the store's clock back to pending,
    /// keeping its attempts, or to the dead set when it has used all its attempts. Returns what
    /// it moved. Safe to run from many workers at once: each job is moved once.
    ///
    /// On Redis / Valkey, an expired job whose key was overwritten with another type is set
    /// aside in the dead set with its key untouched, logged as a warning and returned with
    /// `attempts` 0, and the other expired leases are reaped as usual.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> lock_core::Result<()> {
    /// use std::time::Duration;
    /// use lock_core::queue::{JobState, Queue};
    ///
    /// let q = Queue::memory("thumbnails")?;
    /// q.enqueue(b"cat.png").await?;
    /// // A worker claims it and dies: its lease runs out.
    /// let lost = q.claim(Duration::from_millis(20)).await?.expect("a job");
    /// tokio::time::sleep(Duration::from_millis(50)).await;
    /// let reaped = q.reap().await?;
    /// assert_eq!((reaped[0].id, reaped[0].to), (lost.id(), JobState::Pending));
    /// # Ok(()) }
    /// ```
    #[instrument(level = "debug", skip(self), fields(queue = %self.inner.name))]
    pub async fn reap(&self) -> Result<Vec<Reaped>> {
        let mut all = Vec::new();
        loop {
            // Counted by the ids taken, not the jobs moved: on a server, an id whose key was
            // deleted from outside is taken and dropped, so a full batch may move fewer.
            let (batch, taken) = store!(self, s => s.reap(REAP_BATCH).await)?;
            all.extend(batch);
            if taken < REAP_BATCH {
                break;
            }
        }
        if !all.is_empty() {
            debug!(moved = all.len(), "reaped");
        }
        Ok(all)
    }

    /// Removes the dead jobs that died at least `older_than` ago on the store's clock (zero:
    /// every dead job), payloads and last errors with them, and returns how many. Read what you
    /// want to keep first ([`Queue::job`]); a removed job is [`Error::UnknownJob`] afterwards.
    /// Jobs in any other state are never touched. Safe to run from many processes at once:
    /// each job is removed once.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"not an address").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// claim.fail("malformed address").await?;
    /// assert_eq!(queue.purge_dead(Duration::from_secs(7 * 86_400)).await?, 0); // too recent
    /// assert_eq!(queue.purge_dead(Duration::ZERO).await?, 1);
    /// assert_eq!(queue.counts().await?.dead, 0);
    /// # Ok(()) }
    /// ```
    #[instrument(level = "debug", skip(self), fields(queue = %self.inner.name))]
    pub async fn purge_dead(&self, older_than: Duration) -> Result<u64> {
        // Far past any job's age, and short of where the script's arithmetic on doubles would
        // stop being exact.
        let age = ms(older_than).min(1 << 50);
        let mut removed = 0;
        loop {
            let n = store!(self, s => s.purge_dead(age, REAP_BATCH).await)?;
            removed += n;
            if n < REAP_BATCH as u64 {
                break;
            }
        }
        if removed > 0 {
            debug!(removed, "purged dead jobs");
        }
        Ok(removed)
    }

    /// How many jobs are pending, active, delayed and dead.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"x").await?;
    /// let counts = queue.counts().await?;
    /// assert_eq!((counts.pending, counts.active), (1, 0));
    /// # Ok(()) }
    /// ```
    pub async fn counts(&self) -> Result<QueueCounts> {
        store!(self, s => s.counts().await)
    }

    /// One job's state, attempts, last error and payload; [`Error::UnknownJob`] when it does not
    /// exist (or was completed longer than [`QueueBuilder::keep_done`] ago).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// use lock_core::{Error, queue::{JobId, JobState}};
    /// let id = queue.enqueue(b"x").await?;
    /// assert_eq!(queue.job(id).await?.state, JobState::Pending);
    /// assert!(matches!(queue.job(JobId(999)).await, Err(Error::UnknownJob { .. })));
    /// # Ok(()) }
    /// ```
    pub async fn job(&self, id: JobId) -> Result<JobInfo> {
        store!(self, s => s.job(id.0).await)?.ok_or_else(|| Error::UnknownJob {
            queue: self.inner.name.clone(),
            id: id.0,
        })
    }
}

/// A job leased to this caller: its payload, its attempt number (the fence) and its deadline.
///
/// Dropping a claim does nothing on the store: the job stays active until its deadline, then
/// the reaper returns it, as if the worker had crashed. Settle it with
/// [`complete`](Claim::complete), [`retry`](Claim::retry) or [`fail`](Claim::fail).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::Queue;
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// queue.enqueue(b"welcome").await?;
/// if let Some(claim) = queue.claim(Duration::from_secs(30)).await? {
///     match std::str::from_utf8(claim.payload()) {
///         Ok(text) => {
///             println!("sending {text}");
///             claim.complete().await?;
///         }
///         Err(_) => claim.fail("payload is not UTF-8").await?,
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Claim {
    queue: Queue,
    id: JobId,
    /// This claim's token, checked by its steps on a server (see `claim_once`).
    holder: Token,
    attempts: u64,
    deadline_ms: u64,
    local_deadline: Instant,
    payload: Vec<u8>,
}

impl Claim {
    /// The job.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// let id = queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert_eq!(claim.id(), id);
    /// # Ok(()) }
    /// ```
    pub fn id(&self) -> JobId {
        self.id
    }

    /// This claim's attempt number: 1 for the first claim of the job, one more for each claim
    /// after.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert_eq!(claim.attempts(), 1);
    /// claim.retry(Duration::ZERO).await?;
    /// let again = queue.claim(Duration::from_secs(30)).await?.expect("the job again");
    /// assert_eq!(again.attempts(), 2);
    /// # Ok(()) }
    /// ```
    pub fn attempts(&self) -> u64 {
        self.attempts
    }

    /// The attempt number as a [`Fence`], for resources that refuse older writers.
    ///
    /// It counts this job's claims only and starts at 1 for every job, so the check must be
    /// keyed by the job id as well as the resource: a [`FenceGate`](crate::FenceGate) named
    /// after the resource alone, having admitted job A's attempt 3, would refuse job B's
    /// attempt 1. A gate per job leaves one small key per job on the server; where the resource
    /// is your own store, keeping the (job id, attempts) pair beside the data does the same.
    ///
    /// ```
    /// use lock_core::queue::Queue;
    /// use lock_core::{Error, Locker};
    /// use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// let locker = Locker::memory();
    /// let queue = Queue::memory("invoices")?;
    /// queue.enqueue(b"invoice 17").await?;
    /// let first = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// let (id, old) = (first.id(), first.fence());
    /// first.retry(Duration::ZERO).await?; // as if its lease was lost
    /// let second = queue.claim(Duration::from_secs(30)).await?.expect("the same job");
    /// // The gate's resource names the job: fences of different jobs do not compare.
    /// let gate = locker.fence_gate(&format!("invoices-table/job:{id}"))?;
    /// gate.admit(second.fence()).await?;
    /// assert!(matches!(gate.admit(old).await, Err(Error::Stale { .. })));
    /// second.complete().await?;
    /// # Ok(()) }
    /// ```
    pub fn fence(&self) -> Fence {
        Fence(self.attempts)
    }

    /// The payload as enqueued.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"hello").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert_eq!(claim.payload(), b"hello");
    /// # Ok(()) }
    /// ```
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Decodes a JSON payload (see [`Queue::enqueue_json`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Error, queue::Queue};
    /// use std::time::Duration;
    /// let queue = Queue::memory("orders")?;
    /// queue.enqueue(b"not json").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert!(matches!(claim.json::<serde_json::Value>(), Err(Error::Codec(_))));
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "serde")]
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.payload).map_err(|e| Error::Codec(Box::new(e)))
    }

    /// The lease deadline in milliseconds since the Unix epoch, on the store's clock (the
    /// server's for Redis), as of the claim or the last [`extend`](Claim::extend).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// use std::time::{SystemTime, UNIX_EPOCH};
    /// let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970");
    /// let now_ms = since_epoch.as_millis() as u64;
    /// assert!(claim.deadline_ms() > now_ms);
    /// # Ok(()) }
    /// ```
    pub fn deadline_ms(&self) -> u64 {
        self.deadline_ms
    }

    /// Time left on the lease by this process's clock, counted from before the claim (or the
    /// last extend) was sent and less a drift allowance, so it never overstates the lease.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert!(claim.remaining() <= Duration::from_secs(30));
    /// # Ok(()) }
    /// ```
    pub fn remaining(&self) -> Duration {
        self.local_deadline
            .saturating_duration_since(Instant::now())
    }

    /// The queue the job came from.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert_eq!(claim.queue().name(), "mail");
    /// # Ok(()) }
    /// ```
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    pub(crate) fn into_parts(self) -> (Queue, JobId, Token, u64, u64, Instant, Vec<u8>) {
        (
            self.queue,
            self.id,
            self.holder,
            self.attempts,
            self.deadline_ms,
            self.local_deadline,
            self.payload,
        )
    }

    /// Extends the lease to the store's clock plus `ttl` (see [`Queue::extend`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"x").await?;
    /// let mut claim = queue.claim(Duration::from_secs(1)).await?.expect("a job");
    /// claim.extend(Duration::from_secs(60)).await?; // long work: keep the lease
    /// assert!(claim.remaining() > Duration::from_secs(1));
    /// # Ok(()) }
    /// ```
    pub async fn extend(&mut self, ttl: Duration) -> Result<()> {
        let start = Instant::now();
        self.deadline_ms = self
            .queue
            .extend_as(self.id, self.attempts, self.holder.as_str(), ttl)
            .await?;
        self.local_deadline = start + ttl - drift(ttl);
        Ok(())
    }

    /// Completes the job (see [`Queue::complete`]).
    ///
    /// The settling steps (this one, [`retry`](Claim::retry), [`retry_because`](Claim::retry_because)
    /// and [`fail`](Claim::fail)) borrow the claim, so that one refused for bad input or failed
    /// on a transient error ([`Error::is_transient`]) can be sent again with the claim's own
    /// token. A repeat after a try whose reply was lost cannot always tell that the try landed:
    /// a complete repeated succeeds while the job's done marker is kept, and finds no job
    /// ([`Error::UnknownJob`]) on a queue with `keep_done` zero; a retry or fail repeated
    /// after it landed is refused as no longer held ([`Error::LeaseLost`]), or as
    /// [`Error::Stale`] once a retried job was claimed again.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// claim.complete().await?;
    /// assert_eq!(queue.counts().await?.active, 0);
    /// # Ok(()) }
    /// ```
    pub async fn complete(&self) -> Result<()> {
        let holder = self.holder.as_str();
        self.queue.complete_as(self.id, self.attempts, holder).await
    }

    /// Gives the job back after `delay` (see [`Queue::retry`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// use lock_core::queue::JobState;
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// assert_eq!(claim.retry(Duration::from_secs(10)).await?, JobState::Delayed);
    /// # Ok(()) }
    /// ```
    pub async fn retry(&self, delay: Duration) -> Result<JobState> {
        self.retry_because(delay, "").await
    }

    /// Gives the job back after `delay`, recording `error` (see [`Queue::retry_because`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// let id = queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// claim.retry_because(Duration::ZERO, "upstream 503").await?;
    /// assert_eq!(queue.job(id).await?.error.as_deref(), Some("upstream 503"));
    /// # Ok(()) }
    /// ```
    pub async fn retry_because(&self, delay: Duration, error: &str) -> Result<JobState> {
        let holder = self.holder.as_str();
        self.queue
            .retry_as(self.id, self.attempts, holder, delay, error)
            .await
    }

    /// Sends the job to the dead set with `reason` (see [`Queue::fail`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::Queue;
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"x").await?;
    /// let claim = queue.claim(Duration::from_secs(30)).await?.expect("a job");
    /// claim.fail("bad payload").await?;
    /// assert_eq!(queue.counts().await?.dead, 1);
    /// # Ok(()) }
    /// ```
    pub async fn fail(&self, reason: &str) -> Result<()> {
        let holder = self.holder.as_str();
        self.queue
            .fail_as(self.id, self.attempts, holder, reason)
            .await
    }
}

/// How many claims that came back after their validity end a waiting claim.
const MAX_LATE_CLAIMS: u32 = 3;

/// What one claim round trip came to.
enum Once {
    /// A job, claimed in time.
    Claimed(Claim),
    /// Nothing pending; the next delayed job's due time, if any.
    Empty(Option<Duration>),
    /// A job whose claim arrived after its validity, given back; its key.
    Late(String),
}

/// A claim request's answer channel, on the caller's side. Dropped before the answer was read
/// (the caller's future dropped after the answer came: the other branch of a `select!` won in
/// the same wake-up, or its task was aborted), it closes the channel and gives back a job the
/// answer claimed, as the request's task does for a caller who left before the answer came.
struct Unread<'a> {
    queue: &'a Queue,
    holder: &'a Token,
    answered: tokio::sync::oneshot::Receiver<Result<ClaimReply>>,
}

impl Drop for Unread<'_> {
    fn drop(&mut self) {
        self.answered.close();
        if let Ok(reply) = self.answered.try_recv()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let (queue, holder) = (self.queue.clone(), self.holder.clone());
            runtime.spawn(give_back_unread(queue, holder, reply));
        }
    }
}

/// Gives back the job `reply` claimed for a caller who will never read it: to pending at once
/// (its attempt counted, as the reaper would count it) rather than active for its whole lease.
async fn give_back_unread(queue: Queue, holder: Token, reply: Result<ClaimReply>) {
    let Ok(ClaimReply::Claimed {
        id,
        attempts,
        deadline_ms,
        payload,
    }) = reply
    else {
        return;
    };
    debug!(
        id,
        attempts, "claimed for a caller who left; giving it back"
    );
    let claim = Claim {
        queue,
        id: JobId(id),
        holder,
        attempts,
        deadline_ms,
        local_deadline: Instant::now(),
        payload,
    };
    let why = "its claimer left before the claim was answered";
    if let Err(e) = claim.retry_because(Duration::ZERO, why).await {
        warn!(id, attempts, error = %e, "a job claimed for nobody was not given back; the reaper returns it");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn under_a_millisecond_counts_as_one() {
        assert_eq!(whole_ms(Duration::ZERO), 0);
        assert_eq!(whole_ms(Duration::from_nanos(1)), 1);
        assert_eq!(whole_ms(Duration::from_micros(999)), 1);
        assert_eq!(whole_ms(Duration::from_micros(1_500)), 1);
        assert_eq!(whole_ms(Duration::from_secs(2)), 2_000);
        assert_eq!(whole_ms(Duration::MAX), u64::MAX);
    }

    #[test]
    fn errors_are_clipped_at_char_boundaries() {
        let long = "é".repeat(MAX_ERROR_LEN);
        let c = clip(&long);
        assert!(c.len() <= MAX_ERROR_LEN && c.len() >= MAX_ERROR_LEN - 1);
        assert_eq!(clip("short"), "short");
    }

    #[test]
    fn states_round_trip() {
        for s in [
            JobState::Pending,
            JobState::Delayed,
            JobState::Active,
            JobState::Dead,
            JobState::Done,
        ] {
            assert_eq!(JobState::parse(s.as_str()), Some(s));
        }
        assert_eq!(JobState::parse("other"), None);
    }
}
