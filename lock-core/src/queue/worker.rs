//! Runs handlers over a queue: claims, keeps each lease alive while its handler runs, cancels a
//! handler whose lease is lost, settles the job, and reaps on a beat.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, sleep, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::{JobId, JobState, MAX_RETRY_DELAY, Queue};
use crate::error::{Error, Result};
use crate::types::{Fence, Token, drift, validate_ttl, warn_ahead};

/// A claimed job as a handler sees it. The worker owns the lease; the handler only does the
/// work.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::{Queue, Worker};
/// use std::time::Duration;
/// let queue = Queue::memory("greetings")?;
/// queue.enqueue(b"hello").await?;
/// let (out, mut done) = tokio::sync::mpsc::unbounded_channel();
/// let worker = Worker::new(queue).start(move |job| {
///     let out = out.clone();
///     async move {
///         let text = std::str::from_utf8(job.payload())?; // not UTF-8: retried
///         out.send(format!("{text}, attempt {}", job.attempts()))?;
///         Ok(())
///     }
/// })?;
/// assert_eq!(done.recv().await.as_deref(), Some("hello, attempt 1"));
/// worker.shutdown(Duration::from_secs(1)).await;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Job {
    id: JobId,
    attempts: u64,
    deadline_ms: u64,
    payload: Vec<u8>,
}

impl Job {
    /// The job.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// let id = queue.enqueue(b"welcome").await?;
    /// let (seen, mut jobs) = tokio::sync::mpsc::unbounded_channel();
    /// let worker = Worker::new(queue).start(move |job| {
    ///     let _ = seen.send(job); // a copy out, to look at
    ///     async { Ok(()) }
    /// })?;
    /// let job = jobs.recv().await.expect("the worker ran the job");
    /// assert_eq!(job.id(), id);
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn id(&self) -> JobId {
        self.id
    }

    /// This run's attempt number (1 on the first run).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{JobError, Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"welcome").await?;
    /// let (seen, mut attempts) = tokio::sync::mpsc::unbounded_channel();
    /// let worker = Worker::new(queue)
    ///     .backoff(Duration::ZERO, Duration::ZERO) // retry at once
    ///     .start(move |job| {
    ///         let _ = seen.send(job.attempts());
    ///         async move {
    ///             match job.attempts() {
    ///                 1 => Err(JobError::retry("flaky upstream")),
    ///                 _ => Ok(()),
    ///             }
    ///         }
    ///     })?;
    /// assert_eq!(attempts.recv().await, Some(1));
    /// assert_eq!(attempts.recv().await, Some(2)); // the same job, run again
    /// let report = worker.shutdown(Duration::from_secs(1)).await;
    /// assert_eq!((report.retried, report.completed), (1, 1));
    /// # Ok(()) }
    /// ```
    pub fn attempts(&self) -> u64 {
        self.attempts
    }

    /// The attempt number as a [`Fence`], for resources that refuse older writers. It counts
    /// this job's claims only and starts at 1 for every job, so a resource checking it must
    /// key its check by the job id too (a [`FenceGate`](crate::FenceGate) named after the
    /// resource *and* the job): one keyed by the resource alone would refuse job B's attempt 1
    /// after admitting job A's attempt 3. See [`Claim::fence`](super::Claim::fence).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::Fence;
    /// use lock_core::queue::{JobError, Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("invoices")?;
    /// queue.enqueue(b"invoice 17").await?;
    /// let (seen, mut jobs) = tokio::sync::mpsc::unbounded_channel();
    /// let worker = Worker::new(queue)
    ///     .backoff(Duration::ZERO, Duration::ZERO)
    ///     .start(move |job| {
    ///         let first = job.attempts() == 1;
    ///         let _ = seen.send(job);
    ///         async move {
    ///             if first {
    ///                 return Err(JobError::retry("lost the race"));
    ///             }
    ///             Ok(())
    ///         }
    ///     })?;
    /// let first = jobs.recv().await.expect("the first run");
    /// let second = jobs.recv().await.expect("the second run");
    /// assert_eq!((first.fence(), second.fence()), (Fence(1), Fence(2)));
    /// assert_eq!(first.id(), second.id()); // compare fences of one job only
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn fence(&self) -> Fence {
        Fence(self.attempts)
    }

    /// The payload as enqueued.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("resize")?;
    /// queue.enqueue(b"cat.png").await?;
    /// let (seen, mut payloads) = tokio::sync::mpsc::unbounded_channel();
    /// let worker = Worker::new(queue).start(move |job| {
    ///     let _ = seen.send(job.payload().to_vec());
    ///     async { Ok(()) }
    /// })?;
    /// assert_eq!(payloads.recv().await.as_deref(), Some(&b"cat.png"[..]));
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The lease deadline at claim time, in ms since the Unix epoch on the store's clock.
    ///
    /// It is not moved by the worker's extends: the job keeps the deadline of its claim.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{Queue, Worker};
    /// use std::time::{Duration, SystemTime, UNIX_EPOCH};
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"welcome").await?;
    /// let (seen, mut jobs) = tokio::sync::mpsc::unbounded_channel();
    /// let worker = Worker::new(queue)
    ///     .ttl(Duration::from_secs(10))
    ///     .start(move |job| {
    ///         let _ = seen.send(job);
    ///         async { Ok(()) }
    ///     })?;
    /// let job = jobs.recv().await.expect("the worker ran the job");
    /// let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970");
    /// let now_ms = since_epoch.as_millis() as u64;
    /// // Claimed a moment ago for 10 s (give or take a clock tick).
    /// let left_ms = job.deadline_ms().saturating_sub(now_ms);
    /// assert!(left_ms > 9_000 && left_ms <= 10_010, "{left_ms} ms left");
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn deadline_ms(&self) -> u64 {
        self.deadline_ms
    }

    /// Decodes a JSON payload (see [`Queue::enqueue_json`]); [`Error::Codec`] when it is not
    /// JSON of that shape.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{Queue, Worker};
    /// use serde_json::{Value, json};
    /// use std::time::Duration;
    /// let queue = Queue::memory("thumbnails")?;
    /// queue.enqueue_json(&json!({ "path": "cat.png", "width": 128 })).await?;
    /// let (seen, mut jobs) = tokio::sync::mpsc::unbounded_channel();
    /// let worker = Worker::new(queue).start(move |job| {
    ///     let _ = seen.send(job);
    ///     async { Ok(()) }
    /// })?;
    /// let job = jobs.recv().await.expect("the worker ran the job");
    /// assert_eq!(job.json::<Value>()?["width"], 128);
    /// assert!(job.json::<Vec<u32>>().is_err()); // an object, not a list
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "serde")]
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.payload).map_err(|e| Error::Codec(Box::new(e)))
    }
}

/// Why a handler did not finish its job: retried with backoff, or failed for good.
///
/// Any error converts into a retryable one, so handlers can use `?`:
///
/// ```
/// use lock_core::queue::{Job, JobError};
/// async fn handle(job: Job) -> Result<(), JobError> {
///     let text = std::str::from_utf8(job.payload())?; // a retry if this fails
///     if text.is_empty() {
///         return Err(JobError::permanent("empty job")); // straight to the dead set
///     }
///     Ok(())
/// }
/// ```
#[derive(Debug)]
pub struct JobError {
    message: String,
    permanent: bool,
}

impl JobError {
    /// A failure worth another attempt: the job is retried after the worker's backoff, or goes
    /// to the dead set when it has no attempts left. The message is stored as the job's error.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{JobError, JobState, Queue, Worker};
    /// use std::time::Duration;
    /// let err = JobError::retry("smtp timeout");
    /// assert!(!err.is_permanent());
    /// assert_eq!(err.to_string(), "smtp timeout");
    ///
    /// let queue = Queue::memory("mail")?;
    /// let id = queue.enqueue(b"welcome").await?;
    /// let worker = Worker::new(queue.clone())
    ///     .backoff(Duration::from_secs(60), Duration::from_secs(60))
    ///     .start(|_job| async { Err(JobError::retry("smtp timeout")) })?;
    /// while worker.report().retried == 0 {
    ///     tokio::time::sleep(Duration::from_millis(5)).await;
    /// }
    /// let info = queue.job(id).await?;
    /// assert_eq!(info.state, JobState::Delayed); // back in 60 s, for attempt 2
    /// assert_eq!(info.error.as_deref(), Some("smtp timeout"));
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn retry(message: impl fmt::Display) -> JobError {
        JobError {
            message: message.to_string(),
            permanent: false,
        }
    }

    /// A failure no retry will fix: the job goes to the dead set now, whatever attempts it has
    /// left. The message is stored as the job's error.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{JobError, JobState, Queue, Worker};
    /// use std::time::Duration;
    /// assert!(JobError::permanent("mailbox gone").is_permanent());
    ///
    /// let queue = Queue::memory("mail")?; // 5 attempts a job by default
    /// let id = queue.enqueue(b"bounce").await?;
    /// let worker = Worker::new(queue.clone())
    ///     .start(|_job| async { Err(JobError::permanent("mailbox gone")) })?;
    /// while worker.report().failed == 0 {
    ///     tokio::time::sleep(Duration::from_millis(5)).await;
    /// }
    /// let info = queue.job(id).await?;
    /// assert_eq!((info.state, info.attempts), (JobState::Dead, 1)); // no second attempt
    /// assert_eq!(info.error.as_deref(), Some("mailbox gone"));
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn permanent(message: impl fmt::Display) -> JobError {
        JobError {
            message: message.to_string(),
            permanent: true,
        }
    }

    /// Whether the job should go straight to the dead set.
    ///
    /// ```
    /// use lock_core::queue::JobError;
    /// assert!(JobError::permanent("bad payload").is_permanent());
    /// assert!(!JobError::retry("timeout").is_permanent());
    /// // Errors converted by `?` are retries.
    /// assert!(!JobError::from(std::fmt::Error).is_permanent());
    /// ```
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl<E: std::error::Error> From<E> for JobError {
    fn from(e: E) -> JobError {
        JobError::retry(e)
    }
}

/// What a worker did, as counts (see [`WorkerHandle::report`]).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::{Queue, Worker, WorkerReport};
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// queue.enqueue(b"welcome").await?;
/// let worker = Worker::new(queue).start(|_job| async { Ok(()) })?;
/// while worker.report().completed == 0 {
///     tokio::time::sleep(Duration::from_millis(5)).await;
/// }
/// let report = worker.shutdown(Duration::from_secs(1)).await;
/// assert_eq!(report, WorkerReport { claimed: 1, completed: 1, ..WorkerReport::default() });
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerReport {
    /// Jobs claimed.
    pub claimed: u64,
    /// Jobs completed.
    pub completed: u64,
    /// Jobs given back for another attempt (or sent to the dead set by their last retry).
    pub retried: u64,
    /// Jobs failed for good by their handler.
    pub failed: u64,
    /// Jobs whose lease was lost: the handler was cancelled, or its result was refused as
    /// stale or could not be settled (a settle that fails on a transient error is tried again,
    /// its lease renewed meanwhile, until the lease is lost or for one lease TTL at most). The
    /// reaper returns them; another worker runs them again.
    /// So does a settle (complete, retry or fail) whose reply was lost or unreadable when its
    /// repeat is then refused, though the first may have landed (a repeated retry or fail finds
    /// the job no longer held; a repeated complete, on a queue with `keep_done` zero, finds no
    /// job); the worker logs those as in doubt, not as lost.
    pub lost: u64,
    /// Handlers still running when the report was taken; after a shutdown, the ones cut off at
    /// the grace deadline (their jobs are left to the reaper).
    pub in_flight: u64,
    /// Claims and reaps that failed (the server refused or did not answer); each is tried
    /// again after a backoff. A count that keeps rising while `claimed` does not says the
    /// worker cannot take work (a queue key of a foreign type, an ACL refusal, a server down):
    /// the log says why.
    pub errors: u64,
}

#[derive(Default)]
struct Stats {
    claimed: AtomicU64,
    completed: AtomicU64,
    retried: AtomicU64,
    failed: AtomicU64,
    lost: AtomicU64,
    in_flight: AtomicU64,
    errors: AtomicU64,
}

impl Stats {
    fn report(&self) -> WorkerReport {
        WorkerReport {
            claimed: self.claimed.load(Ordering::Relaxed),
            completed: self.completed.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The most handlers one [`Worker`] runs at once: each is a task waiting on the queue, and a
/// worker is meant for a process's share of the work, not for a task per job.
///
/// ```
/// assert_eq!(lock_core::queue::MAX_CONCURRENCY, 10_000);
/// ```
pub const MAX_CONCURRENCY: usize = 10_000;

/// How many of a worker's idle slots ask the server for a job at once: enough to claim
/// several jobs per round trip when work arrives in bulk, few enough that an idle worker of
/// thousands of slots polls like a small one.
const MAX_CLAIMERS: usize = 8;

/// Runs a handler over a [`Queue`] with `concurrency` jobs at a time.
///
/// Each job's lease is extended every third of the lease while its handler runs. If an extend
/// is refused, or the lease's time runs out locally while extends keep failing, the handler is
/// dropped (cancelled) before another worker can be given the job. `Ok` completes the job; a
/// [`JobError`] retries it after an exponential backoff (`backoff × 2^(attempts-1)`, capped at
/// `max_backoff`) or, if permanent, fails it. A handler that panics (in its future, or in the
/// closure before it returns one) counts as a retryable failure; one that panics as it is
/// dropped after a lost lease is logged, and its slot goes on claiming. Every worker also runs
/// [`Queue::reap`] on a beat, so crashed workers' jobs come back without a separate process.
///
/// Renewal runs on a task of its own, so a handler that blocks its thread (CPU work, a
/// synchronous call) keeps its lease on a multi-threaded runtime while another of the
/// runtime's threads is free to run the renewal (and the connection it uses): with as many
/// blocking handlers as worker threads nothing renews, and the lease runs out under them. Put
/// blocking work in `spawn_blocking` (or `block_in_place`) to keep it off the runtime's
/// threads. On a current-thread runtime nothing else runs while a handler blocks.
/// Cancellation, like any future's, takes effect at the handler's next `.await`: a handler
/// that blocks past a lost lease runs on until it yields, which is why writes should check the
/// job's fence.
///
/// A claim answered after its validity is given back with its attempt counted, as the reaper
/// would (see [`Queue::claim`]): a worker whose round trips to the server are slower than
/// its lease (a TTL under the response timeout and a stalled server, a starved runtime) can
/// send jobs to the dead set after `max_attempts` such claims without their handler running.
/// Keep the TTL well above the round trip.
///
/// ```
/// use lock_core::queue::{Queue, Worker};
/// use std::time::Duration;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// let queue = Queue::memory("resize")?;
/// queue.enqueue(b"cat.png".as_slice()).await?;
/// let worker = Worker::new(queue.clone())
///     .concurrency(4)
///     .ttl(Duration::from_secs(10))
///     .start(|job| async move {
///         println!("resizing {:?} (attempt {})", job.payload(), job.attempts());
///         Ok(())
///     })?;
/// while queue.counts().await?.pending + queue.counts().await?.active > 0 {
///     tokio::time::sleep(Duration::from_millis(5)).await;
/// }
/// let report = worker.shutdown(Duration::from_secs(5)).await;
/// assert_eq!(report.completed, 1);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Worker {
    queue: Queue,
    concurrency: usize,
    ttl: Duration,
    reap_every: Duration,
    backoff: Duration,
    max_backoff: Duration,
}

impl Worker {
    /// A worker on `queue` with the defaults: one job at a time, 30 s leases, a reap every
    /// second, retries after 1 s doubling up to 5 min.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// let first = queue.enqueue(b"first").await?;
    /// let second = queue.enqueue(b"second").await?;
    /// let (seen, mut ids) = tokio::sync::mpsc::unbounded_channel();
    /// let worker = Worker::new(queue).start(move |job| {
    ///     let _ = seen.send(job.id());
    ///     async { Ok(()) }
    /// })?;
    /// // One job at a time, oldest first.
    /// assert_eq!((ids.recv().await, ids.recv().await), (Some(first), Some(second)));
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn new(queue: Queue) -> Worker {
        Worker {
            queue,
            concurrency: 1,
            ttl: Duration::from_secs(30),
            reap_every: Duration::from_secs(1),
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
        }
    }

    /// How many handlers run at once (at least one; above [`MAX_CONCURRENCY`],
    /// [`start`](Self::start) refuses with [`Error::InvalidCount`]).
    ///
    /// Idle slots take turns asking the queue for work, eight at a time at most, so a worker
    /// of thousands of slots costs an idle server what a small one does; a slot that claims a
    /// job hands its turn on before running the job.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::Error;
    /// use lock_core::queue::{MAX_CONCURRENCY, Queue, Worker};
    /// let queue = Queue::memory("thumbnails")?;
    /// let handler = |_job| async { Ok(()) };
    /// let too_many = Worker::new(queue.clone()).concurrency(MAX_CONCURRENCY + 1).start(handler);
    /// assert!(matches!(too_many, Err(Error::InvalidCount { what: "concurrency", .. })));
    /// let worker = Worker::new(queue).concurrency(MAX_CONCURRENCY).start(handler)?;
    /// worker.shutdown(std::time::Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// How long each claim's lease lasts, and how far each extend moves it (default 30 s;
    /// between [`MIN_TTL`](crate::MIN_TTL) and [`MAX_TTL`](crate::MAX_TTL), else
    /// [`start`](Self::start) refuses with [`Error::InvalidTtl`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::Error;
    /// use lock_core::queue::{Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("thumbnails")?;
    /// let handler = |_job| async { Ok(()) };
    /// let zero = Worker::new(queue.clone()).ttl(Duration::ZERO).start(handler);
    /// assert!(matches!(zero, Err(Error::InvalidTtl { .. })));
    /// let worker = Worker::new(queue).ttl(Duration::from_secs(5)).start(handler)?;
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How often this worker runs the reaper (default every second; 1 ms or more, else
    /// [`start`](Self::start) refuses with [`Error::InvalidDuration`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::Error;
    /// use lock_core::queue::{Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("thumbnails")?;
    /// let handler = |_job| async { Ok(()) };
    /// let busy = Worker::new(queue.clone()).reap_every(Duration::ZERO).start(handler);
    /// assert!(matches!(busy, Err(Error::InvalidDuration { what: "reap interval", .. })));
    /// let worker = Worker::new(queue).reap_every(Duration::from_secs(5)).start(handler)?;
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn reap_every(mut self, every: Duration) -> Self {
        self.reap_every = every;
        self
    }

    /// The first retry delay and the cap the doubling stops at (default 1 s and 5 min; a cap
    /// above [`MAX_RETRY_DELAY`] is refused by [`start`](Self::start) with
    /// [`Error::InvalidDuration`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::Error;
    /// use lock_core::queue::{MAX_RETRY_DELAY, Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("thumbnails")?;
    /// let handler = |_job| async { Ok(()) };
    /// let far = MAX_RETRY_DELAY + Duration::from_secs(1);
    /// let refused = Worker::new(queue.clone()).backoff(Duration::from_secs(1), far).start(handler);
    /// assert!(matches!(refused, Err(Error::InvalidDuration { what: "max backoff", .. })));
    /// let worker = Worker::new(queue)
    ///     .backoff(Duration::from_millis(100), Duration::from_secs(60))
    ///     .start(handler)?;
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = first;
        self.max_backoff = max;
        self
    }

    fn delay_for(&self, attempts: u64) -> Duration {
        // Doubled step by step rather than by one shift: a shift wide enough for late attempts
        // overflows its multiplier, and one narrow enough stops short of a far cap. The steps
        // end once the cap is reached, so there are at most about a hundred (a nanosecond
        // doubled to `Duration::MAX`).
        let mut delay = self.backoff;
        for _ in 1..attempts {
            // Zero doubles to zero: no step changes it.
            if delay >= self.max_backoff || delay.is_zero() {
                break;
            }
            delay = delay.saturating_mul(2);
        }
        delay.min(self.max_backoff)
    }

    /// Starts claiming and running jobs on the current runtime. Fails at once with
    /// [`Error::InvalidTtl`] if the lease is out of range, [`Error::InvalidDuration`] if the
    /// reap interval is under a millisecond or the backoff cap is above [`MAX_RETRY_DELAY`], or
    /// [`Error::InvalidCount`] if the concurrency is above [`MAX_CONCURRENCY`], or
    /// [`Error::NoRuntime`] when called outside a tokio runtime.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::Error;
    /// use lock_core::queue::{Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"welcome").await?;
    /// let handler = |_job| async { Ok(()) };
    /// let refused = Worker::new(queue.clone()).ttl(Duration::ZERO).start(handler);
    /// assert!(matches!(refused, Err(Error::InvalidTtl { .. })));
    /// assert_eq!(queue.counts().await?.pending, 1); // nothing was claimed
    ///
    /// let worker = Worker::new(queue.clone()).start(handler)?;
    /// while worker.report().completed == 0 {
    ///     tokio::time::sleep(Duration::from_millis(5)).await;
    /// }
    /// assert_eq!(queue.counts().await?.pending, 0);
    /// worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn start<F, Fut>(self, handler: F) -> Result<WorkerHandle>
    where
        F: Fn(Job) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), JobError>> + Send + 'static,
    {
        validate_ttl(self.ttl)?;
        // Below a millisecond the reaper would call the server back to back.
        if self.reap_every < Duration::from_millis(1) {
            return Err(Error::InvalidDuration {
                what: "reap interval",
                value: self.reap_every,
                reason: "the reap interval must be 1 ms or more",
            });
        }
        // Each slot is a task of its own, spawned here: a count meant as "unbounded" would
        // spawn until memory ran out.
        if self.concurrency > MAX_CONCURRENCY {
            return Err(Error::InvalidCount {
                what: "concurrency",
                value: u64::try_from(self.concurrency).unwrap_or(u64::MAX),
                reason: "above MAX_CONCURRENCY",
            });
        }
        // Refused here rather than at the first retry, which would fail every retry for good
        // and leave each failed job to the reaper, to run again without backoff.
        if self.max_backoff > MAX_RETRY_DELAY {
            return Err(Error::InvalidDuration {
                what: "max backoff",
                value: self.max_backoff,
                reason: "above MAX_RETRY_DELAY (a year)",
            });
        }
        // Outside a runtime `tokio::spawn` would panic; a typed error lets the caller say where
        // the runtime went missing.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(Error::NoRuntime {
                what: "Worker::start",
            });
        };
        let (stop, cut) = (CancellationToken::new(), CancellationToken::new());
        let stats = Arc::new(Stats::default());
        let worker = Arc::new(self);
        let handler = Arc::new(handler);
        let task = runtime.spawn(run(
            worker,
            handler,
            stop.clone(),
            cut.clone(),
            stats.clone(),
        ));
        Ok(WorkerHandle {
            stop,
            cut,
            stats,
            task,
        })
    }
}

/// A running [`Worker`]. Dropping the handle leaves the worker running; call
/// [`shutdown`](WorkerHandle::shutdown) to stop it gracefully or [`abort`](WorkerHandle::abort)
/// to stop it at once.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::queue::{JobState, Queue, Worker};
/// use std::time::Duration;
/// let queue = Queue::memory("mail")?;
/// let handle = Worker::new(queue.clone()).start(|_job| async { Ok(()) })?;
/// drop(handle); // the worker runs on, with no way left to stop it
/// let id = queue.enqueue(b"welcome").await?;
/// while queue.job(id).await?.state != JobState::Done {
///     tokio::time::sleep(Duration::from_millis(5)).await;
/// }
/// # Ok(()) }
/// ```
pub struct WorkerHandle {
    stop: CancellationToken,
    /// Cancelled when a shutdown's grace ran out: the running handlers are dropped.
    cut: CancellationToken,
    stats: Arc<Stats>,
    task: JoinHandle<()>,
}

/// What the worker has done so far, and whether it was told to stop.
impl fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerHandle")
            .field("report", &self.report())
            .field("stopping", &self.stop.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl WorkerHandle {
    /// What the worker has done so far.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{JobError, Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// queue.enqueue(b"welcome".as_slice()).await?;
    /// queue.enqueue(b"bounce".as_slice()).await?;
    /// let worker = Worker::new(queue).start(|job| async move {
    ///     match job.payload() {
    ///         b"bounce" => Err(JobError::permanent("mailbox gone")),
    ///         _ => Ok(()),
    ///     }
    /// })?;
    /// while worker.report().completed + worker.report().failed < 2 {
    ///     tokio::time::sleep(Duration::from_millis(5)).await;
    /// }
    /// assert_eq!((worker.report().completed, worker.report().failed), (1, 1));
    /// # worker.shutdown(Duration::from_secs(1)).await;
    /// # Ok(()) }
    /// ```
    pub fn report(&self) -> WorkerReport {
        self.stats.report()
    }

    /// Stops claiming, lets running handlers finish and settle for up to `grace`, then cuts off
    /// whatever still runs (those jobs stay active until the reaper returns them).
    ///
    /// Dropping this future before it finishes (an outer timeout, a second Ctrl-C), or before
    /// it was ever polled (the losing branch of a `select!`), cuts the handlers off at once, as
    /// [`abort`](WorkerHandle::abort) does: the handle is gone, and a worker left running could
    /// no longer be stopped. Claiming stops when `shutdown` is called, not when it is first
    /// polled.
    ///
    /// Cutting off drops each handler at its next `.await`, and this returns once they are
    /// dropped (their guards with them). One that blocks its thread at that moment is waited
    /// for up to a second, then runs on until it yields, after this returns.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{Job, JobState, Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// let handler = |job: Job| async move {
    ///     let quick = job.payload() == b"quick";
    ///     let work = if quick { Duration::from_millis(20) } else { Duration::from_secs(3600) };
    ///     tokio::time::sleep(work).await;
    ///     Ok(())
    /// };
    /// queue.enqueue(b"quick").await?;
    /// let worker = Worker::new(queue.clone()).start(handler)?;
    /// while worker.report().in_flight == 0 {
    ///     tokio::time::sleep(Duration::from_millis(1)).await;
    /// }
    /// // A handler that ends within the grace finishes, and its job is completed.
    /// let report = worker.shutdown(Duration::from_secs(5)).await;
    /// assert_eq!((report.completed, report.in_flight), (1, 0));
    ///
    /// let id = queue.enqueue(b"slow").await?;
    /// let worker = Worker::new(queue.clone()).start(handler)?;
    /// while worker.report().in_flight == 0 {
    ///     tokio::time::sleep(Duration::from_millis(1)).await;
    /// }
    /// // One that does not is cut off; its job stays active until the reaper returns it.
    /// let report = worker.shutdown(Duration::from_millis(50)).await;
    /// assert_eq!((report.completed, report.in_flight), (0, 1));
    /// assert_eq!(queue.job(id).await?.state, JobState::Active);
    /// # Ok(()) }
    /// ```
    pub fn shutdown(self, grace: Duration) -> impl Future<Output = WorkerReport> + Send + 'static {
        // Here, not in the future: one dropped unpolled must still stop the worker.
        self.stop.cancel();
        let mut task = AbortOnDrop(self.task);
        let (cut, stats) = (self.cut, self.stats);
        async move {
            if tokio::time::timeout(grace, &mut task.0).await.is_err() {
                warn!("handlers still running at the shutdown deadline; cutting them off");
                // The worker drops its handlers and waits until each is gone, so that none
                // holds its guards past the return (aborting the worker's task alone only asks
                // for them to be dropped, which a current-thread runtime does later). A handler
                // that blocks its thread is waited for a moment, then left to end on its own.
                cut.cancel();
                if tokio::time::timeout(CUT_PATIENCE, &mut task.0)
                    .await
                    .is_err()
                {
                    task.0.abort();
                    let _ = (&mut task.0).await;
                }
            }
            stats.report()
        }
    }

    /// Stops everything at once, as a crash would: running handlers are dropped mid-job and
    /// their jobs stay active until the reaper returns them.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::queue::{JobState, Queue, Worker};
    /// use std::time::Duration;
    /// let queue = Queue::memory("mail")?;
    /// let id = queue.enqueue(b"welcome").await?;
    /// let worker = Worker::new(queue.clone())
    ///     .ttl(Duration::from_millis(100))
    ///     .start(|_job| async {
    ///         tokio::time::sleep(Duration::from_secs(3600)).await;
    ///         Ok(())
    ///     })?;
    /// while worker.report().in_flight == 0 {
    ///     tokio::time::sleep(Duration::from_millis(1)).await;
    /// }
    /// worker.abort();
    /// assert_eq!(queue.job(id).await?.state, JobState::Active); // not given back
    /// tokio::time::sleep(Duration::from_millis(300)).await; // no one extends the lease now
    /// let reaped = queue.reap().await?;
    /// let back = reaped.first().map(|r| (r.id, r.attempts, r.to));
    /// assert_eq!(back, Some((id, 1, JobState::Pending)));
    /// assert_eq!(worker.report().completed, 0);
    /// # Ok(()) }
    /// ```
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// How long a shutdown whose grace ran out waits for the cut-off handlers to be dropped.
const CUT_PATIENCE: Duration = Duration::from_secs(1);

async fn run<F, Fut>(
    worker: Arc<Worker>,
    handler: Arc<F>,
    stop: CancellationToken,
    cut: CancellationToken,
    stats: Arc<Stats>,
) where
    F: Fn(Job) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<(), JobError>> + Send + 'static,
{
    // Everything lives in this set, so aborting this task drops every handler with it.
    let mut tasks = JoinSet::new();
    let claimers = Arc::new(Semaphore::new(worker.concurrency.min(MAX_CLAIMERS)));
    for slot in 0..worker.concurrency {
        let span = info_span!("worker_slot", queue = worker.queue.name(), slot);
        let claimers = claimers.clone();
        tasks.spawn(
            slot_loop(
                worker.clone(),
                handler.clone(),
                stop.clone(),
                stats.clone(),
                claimers,
            )
            .instrument(span),
        );
    }
    let reaper_stop = stop.clone();
    let reaper = worker.clone();
    let reaper_stats = stats.clone();
    tasks.spawn(async move {
        loop {
            tokio::select! {
                _ = reaper_stop.cancelled() => return,
                _ = sleep(reaper.reap_every) => {},
            }
            match reaper.queue.reap().await {
                Ok(moved) if !moved.is_empty() => {
                    info!(
                        queue = reaper.queue.name(),
                        moved = moved.len(),
                        "reaped expired leases"
                    )
                }
                Ok(_) => {}
                Err(e) => {
                    bump(&reaper_stats.errors);
                    warn!(queue = reaper.queue.name(), error = %e, "reap failed");
                }
            }
        }
    });
    loop {
        tokio::select! {
            biased;
            () = cut.cancelled() => {
                tasks.abort_all();
                // Each returns once its task was dropped, guards and all.
                while tasks.join_next().await.is_some() {}
                return;
            }
            next = tasks.join_next() => {
                if next.is_none() {
                    return;
                }
            }
        }
    }
}

async fn slot_loop<F, Fut>(
    worker: Arc<Worker>,
    handler: Arc<F>,
    stop: CancellationToken,
    stats: Arc<Stats>,
    claimers: Arc<Semaphore>,
) where
    F: Fn(Job) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = std::result::Result<(), JobError>> + Send + 'static,
{
    let mut pause = Duration::from_millis(50);
    let mut place = None;
    while !stop.is_cancelled() {
        // Idle slots queue for a claimer's place rather than each asking the server: a
        // thousand idle slots would otherwise each poll on the fallback beat and each claim on
        // every enqueue's wake-up, on the connection the running jobs' extends share.
        if place.is_none() {
            let taken = tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                taken = claimers.acquire() => taken,
            };
            // Never closed: the semaphore lives as long as the slots.
            let Ok(taken) = taken else { return };
            place = Some(taken);
        }
        // Wait in bounded rounds so the loop re-checks `stop` even if no wake-up comes.
        let give_up = Instant::now() + Duration::from_secs(30);
        match worker
            .queue
            .claim_until(worker.ttl, give_up, Some(&stop))
            .await
        {
            Ok(Some(claim)) => {
                // The next idle slot claims while this one runs its job.
                place = None;
                pause = Duration::from_millis(50);
                bump(&stats.claimed);
                stats.in_flight.fetch_add(1, Ordering::Relaxed);
                run_job(&worker, &*handler, claim, &stats).await;
                stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
            // A round that found nothing lets the other idle slots have their turn.
            Ok(None) => place = None,
            Err(e) => {
                bump(&stats.errors);
                warn!(error = %e, "claim failed; retrying");
                // The place is kept through the pause and the retry, so a failing server sees
                // this slot's backoff, not every idle slot trying in turn from the first.
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = sleep(pause) => {},
                }
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

async fn run_job<F, Fut>(worker: &Worker, handler: &F, claim: super::Claim, stats: &Stats)
where
    F: Fn(Job) -> Fut,
    Fut: Future<Output = std::result::Result<(), JobError>>,
{
    let (queue, id, holder, attempts, deadline_ms, local_deadline, payload) = claim.into_parts();
    let span = info_span!("job", queue = queue.name(), id = id.0, attempts);
    async {
        let job = Job {
            id,
            attempts,
            deadline_ms,
            payload,
        };
        // A panicking handler counts as a failed attempt, not a dead slot: the job is retried
        // and this slot goes on claiming. The call is inside the caught future, since a closure
        // may panic before it returns one, and so is the drop of a handler that finished.
        // Boxed, so that a handler cancelled on a lost lease is dropped where its panic can be
        // caught too (a guard's `Drop` may fail).
        let work = std::panic::AssertUnwindSafe(async { handler(job).await });
        let mut work = Box::pin(work.catch_unwind());
        // Renewal on a task of its own: a handler that blocks its thread (CPU work, a
        // synchronous call) would otherwise stop its own lease's renewal, and the job would be
        // reaped and run by another worker while this one still runs it. The task ends with
        // the job (dropped, it is aborted).
        let mut renewal = AbortOnDrop(tokio::spawn(keep_alive(
            queue.clone(),
            id,
            holder.clone(),
            attempts,
            worker.ttl,
            local_deadline,
        )));
        // A task spawned from a worker thread waits in that thread's next-task slot (tokio's
        // LIFO slot), which other threads do not steal from: let it start (it then sleeps until
        // its first extend, and whichever thread's timers wake it runs it) before the handler
        // can block this thread.
        tokio::task::yield_now().await;
        let outcome = tokio::select! {
            biased;
            lost = &mut renewal.0 => {
                let reason = lost
                    .map_or_else(|e| format!("renewal task failed: {e}"), |e| e.to_string());
                warn!(%reason, "lease lost; handler cancelled");
                bump(&stats.lost);
                let dropped = std::panic::AssertUnwindSafe(|| drop(work));
                if let Err(panic) = std::panic::catch_unwind(dropped) {
                    let panic = panic_text(&*panic);
                    warn!(panic, "the cancelled handler panicked as it was dropped");
                }
                return;
            }
            out = &mut work => out.unwrap_or_else(|panic| {
                Err(JobError::retry(format!("handler panicked: {}", panic_text(&*panic))))
            }),
        };
        // The renewal goes on while the result is settled: a settle that meets a transient
        // error (a failover, a restart of a second or two) is tried again for as long as the
        // lease lasts, not for a fixed few tries after which the reaper would run the job again.
        let mut in_doubt = false;
        let settled = match &outcome {
            Ok(()) => while_held(&mut renewal, &mut in_doubt, worker.ttl, || {
                queue.complete_as(id, attempts, holder.as_str())
            })
            .await
            .map(|_| {
                bump(&stats.completed);
            }),
            Err(e) if e.is_permanent() => while_held(&mut renewal, &mut in_doubt, worker.ttl, || {
                queue.fail_as(id, attempts, holder.as_str(), &e.message)
            })
            .await
            .map(|_| {
                bump(&stats.failed);
            }),
            Err(e) => {
                let delay = worker.delay_for(attempts);
                while_held(&mut renewal, &mut in_doubt, worker.ttl, || {
                    queue.retry_as(id, attempts, holder.as_str(), delay, &e.message)
                })
                .await
                .map(|to| {
                    debug!(to = %to, ?delay, error = %e, "retrying");
                    if to == JobState::Dead {
                        debug!("out of attempts: dead");
                    }
                    bump(&stats.retried);
                })
            }
        };
        drop(renewal);
        match settled {
            Ok(()) => {}
            Err(e @ (Error::Stale { .. } | Error::LeaseLost { .. } | Error::UnknownJob { .. }))
                if in_doubt =>
            {
                // Most likely the unanswered try landed and the repeat found the job settled;
                // the worker cannot tell that from a lease that ran out between the tries.
                warn!(
                    error = %e,
                    "settle in doubt: a try whose reply was lost or unreadable may have landed, and \
                     the repeat found the job no longer held; if it did not land, the reaper \
                     returns the job"
                );
                bump(&stats.lost);
            }
            Err(e @ (Error::Stale { .. } | Error::LeaseLost { .. })) => {
                warn!(error = %e, "result refused: the lease was lost before it landed");
                bump(&stats.lost);
            }
            Err(e @ (Error::UnknownJob { .. } | Error::WrongType { .. })) => {
                // Nothing the reaper can return: the job's key was deleted or replaced.
                warn!(error = %e, "could not settle the job: its record is gone or foreign");
                bump(&stats.lost);
            }
            Err(e) => {
                // A settle given up on while in doubt may have landed; otherwise the job's
                // lease runs out and the reaper returns it.
                warn!(
                    error = %e,
                    in_doubt,
                    "could not settle the job; unless a try landed, the reaper returns it once \
                     its lease runs out"
                );
                bump(&stats.lost);
            }
        }
    }
    .instrument(span)
    .await
}

/// A panic's message, when it is text.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text payload".to_owned())
}

/// Settling is idempotent per attempt (a repeated complete succeeds while the done marker is
/// kept; a repeated retry or fail is refused as no longer held, which the caller then reports),
/// so a settle that fails on a transient error is tried again, with a pause doubling from
/// 20 ms to 1 s, while the lease lasts (`renewal`, still extending it, ends when it is lost,
/// and its error is returned then) and for at most `patience` (the lease's TTL) after the
/// first failure. Past that the reaper returns the job.
///
/// Sets `in_doubt` when a try's outcome is unknown (its reply was lost, or came unreadable):
/// that try may have landed, so a refusal of a later one does not show that the lease was
/// lost.
async fn while_held<T, Fut>(
    renewal: &mut AbortOnDrop<Error>,
    in_doubt: &mut bool,
    patience: Duration,
    mut op: impl FnMut() -> Fut,
) -> Result<T>
where
    Fut: Future<Output = Result<T>>,
{
    let mut pause = Duration::from_millis(20);
    let mut give_up = None;
    loop {
        match op().await {
            Err(e) if e.is_transient() => {
                // Not for ever: a refusal the extends do not meet (an ACL rule denying the
                // settle script alone) would keep the lease renewed and the slot taken.
                *in_doubt |= e.may_have_landed();
                let until = *give_up.get_or_insert_with(|| Instant::now() + patience);
                if Instant::now() >= until {
                    return Err(e);
                }
                debug!(error = %e, ?pause, "settle failed; trying again while the lease lasts");
                tokio::select! {
                    biased;
                    lost = &mut renewal.0 => {
                        // An unanswered try that landed settles the job, and the next extend
                        // is then refused: one more try finds it settled (a complete is
                        // answered again while its done marker is kept).
                        if *in_doubt {
                            return op().await;
                        }
                        // Lost: no try is worth more than the reaper, and the renewal's error
                        // says more than this one.
                        return Err(lost.unwrap_or(e));
                    }
                    () = sleep(pause) => {}
                }
                pause = (pause * 2).min(SETTLE_PAUSE_CAP);
            }
            other => return other,
        }
    }
}

/// The longest pause between two tries of a settle that failed on a transient error.
const SETTLE_PAUSE_CAP: Duration = Duration::from_secs(1);

/// A task aborted when its handle is dropped: a job's renewal task when the job ended (or its
/// slot was aborted); the worker itself when a shutdown is given up on.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Extends the lease every third of it; returns only when the lease is lost: an extend was
/// refused, or the local deadline passed while extends kept failing or hung.
async fn keep_alive(
    queue: Queue,
    id: JobId,
    holder: Token,
    attempts: u64,
    ttl: Duration,
    mut local_deadline: Instant,
) -> Error {
    let lost = || Error::LeaseLost {
        key: format!("{}/job:{}", queue.name(), id.0),
    };
    let every = ttl / 3;
    // A third of the lease after the claim was sent (the local deadline counts from then, less
    // the drift allowance), not after its reply came: a slow reply must not use up the time
    // for the first extend.
    let mut next = local_deadline
        .checked_sub(ttl.saturating_sub(drift(ttl)).saturating_sub(every))
        .unwrap_or_else(Instant::now);
    // The handler is cancelled a little before the local deadline, as a lock's `lost()` fires:
    // a timer wakes up to a millisecond late, and on a busy machine the cancelling task may
    // wait for a CPU.
    let alarm = |deadline: Instant| deadline.checked_sub(warn_ahead(ttl)).unwrap_or(deadline);
    loop {
        sleep_until(next.min(alarm(local_deadline))).await;
        if Instant::now() >= alarm(local_deadline) {
            return lost();
        }
        let start = Instant::now();
        // An extend that hangs (a stalled link, a paused server) is cut off at the alarm: the
        // handler must stop before the server can give the job to another worker, not when the
        // connection's response timeout ends the call.
        let extended = tokio::select! {
            biased;
            () = sleep_until(alarm(local_deadline)) => return lost(),
            extended = queue.extend_as(id, attempts, holder.as_str(), ttl) => extended,
        };
        match extended {
            Ok(_) => {
                local_deadline = start + ttl - drift(ttl);
                next = start + every;
            }
            Err(e) if e.is_transient() => {
                debug!(error = %e, "extend failed; trying again before the deadline");
                next = Instant::now() + (ttl / 20).max(Duration::from_millis(5));
            }
            Err(e) => return e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Idle slots take turns to claim, eight at a time, but a slot hands its turn on before it
    /// runs its job: with more slots than claimers, every slot still runs a job at once (were
    /// the turn kept while the job runs, twelve slots would run eight jobs at a time).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_slot_runs_a_job_though_few_claim_at_once() {
        let queue = Queue::memory("turns").expect("queue");
        let slots = MAX_CLAIMERS + 4;
        for _ in 0..slots {
            queue.enqueue(b"job").await.expect("enqueue");
        }
        let release = Arc::new(Semaphore::new(0));
        let worker = Worker::new(queue)
            .concurrency(slots)
            .start({
                let release = release.clone();
                move |_job| {
                    let release = release.clone();
                    async move {
                        release.acquire().await.expect("open").forget();
                        Ok(())
                    }
                }
            })
            .expect("start");
        let give_up = Instant::now() + Duration::from_secs(5);
        while worker.report().in_flight < slots as u64 {
            assert!(
                Instant::now() < give_up,
                "jobs running at once: {:?}",
                worker.report()
            );
            sleep(Duration::from_millis(10)).await;
        }
        release.add_permits(slots);
        let report = worker.shutdown(Duration::from_secs(2)).await;
        assert_eq!(report.completed, slots as u64, "{report:?}");
    }

    /// A handler cut off at the end of a shutdown's grace is dropped, guards and all, before
    /// the shutdown returns (aborting the worker's task only asked for the handlers to be
    /// dropped: on another thread, a guard whose drop takes a while was still held after the
    /// return).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cut_off_handler_is_dropped_before_shutdown_returns() {
        struct Guard(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Guard {
            fn drop(&mut self) {
                // A guard with work to do as it goes (a rollback, a file flushed).
                std::thread::sleep(Duration::from_millis(200));
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let queue = Queue::memory("cut").expect("queue");
        queue.enqueue(b"slow").await.expect("enqueue");
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, running) = (dropped.clone(), started.clone());
        let worker = Worker::new(queue.clone())
            .start(move |_| {
                let guard = Guard(flag.clone());
                let running = running.clone();
                async move {
                    let _guard = guard;
                    running.store(true, Ordering::SeqCst);
                    sleep(Duration::from_secs(3_600)).await;
                    Ok(())
                }
            })
            .expect("start");
        // The handler running, not only counted in flight (counted before it is first polled).
        while !started.load(Ordering::SeqCst) {
            sleep(Duration::from_millis(1)).await;
        }
        let report = worker.shutdown(Duration::from_millis(50)).await;
        assert_eq!(report.in_flight, 1);
        assert!(
            dropped.load(Ordering::SeqCst),
            "the cut-off handler still held its guard when shutdown returned"
        );
    }

    /// Started from plain synchronous code, with no runtime to run it on: a typed error, not the
    /// panic of `tokio::spawn`, and nothing claimed.
    #[test]
    fn a_start_outside_a_runtime_is_refused() {
        let queue = Queue::memory("no-runtime").expect("queue");
        let started = Worker::new(queue).start(|_| async { Ok(()) });
        assert!(
            matches!(
                started,
                Err(Error::NoRuntime {
                    what: "Worker::start"
                })
            ),
            "{:?}",
            started.map(|_| ())
        );
    }

    /// `backoff × 2^(attempts-1)`, capped at `max_backoff`, at every attempt count: also a far
    /// cap reached only after more than 30 doublings, and attempts past any shift width.
    #[test]
    fn delays_double_up_to_the_cap() {
        let q = Queue::builder("q").memory().expect("queue");
        let us = Duration::from_micros;
        let w = Worker::new(q).backoff(us(1), Duration::from_secs(3600));
        assert_eq!(w.delay_for(0), us(1));
        assert_eq!(w.delay_for(1), us(1));
        assert_eq!(w.delay_for(2), us(2));
        assert_eq!(w.delay_for(31), us(1 << 30));
        assert_eq!(w.delay_for(32), us(1 << 31));
        assert_eq!(w.delay_for(33), Duration::from_secs(3600));
        assert_eq!(w.delay_for(u64::MAX), Duration::from_secs(3600));
        let w = w.backoff(Duration::ZERO, Duration::from_secs(1));
        assert_eq!(w.delay_for(u64::MAX), Duration::ZERO);
    }
}
