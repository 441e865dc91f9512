//! Claim leases: one behaviour suite for the queue on memory, a real `redis-server` and a real
//! `valkey-server`, then faults only a server can show (foreign key types, a restart with AOF,
//! a worker process SIGKILLed mid-job, client clocks skewed by minutes).

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::Error;
use leasehold::queue::{
    JobError, JobId, JobState, MAX_CONCURRENCY, MAX_ERROR_LEN, MAX_PAYLOAD, MAX_RETRY_DELAY, Queue,
    QueueBuilder, Worker, WorkerHandle,
};
use support::{Cluster, Flavor, Server};
use tokio::time::{Instant, sleep};

/// A store under test. Memory queues are shared by name, as server queues are.
enum Harness {
    Memory(Mutex<HashMap<String, Queue>>),
    Server(Server),
    /// A server the queue reaches as the restricted `leasehold-queue` user of
    /// `docs/leasehold.acl`.
    Acl(Server),
    Cluster(Cluster),
    /// A cluster whose every node the queue reaches as the `leasehold-queue-cluster` user.
    ClusterAcl(Cluster),
}

impl Harness {
    fn memory() -> Harness {
        Harness::Memory(Mutex::new(HashMap::new()))
    }

    /// A handle on the queue `b` names: on a server, a new connection each time, as separate
    /// worker processes would have.
    async fn open(&self, b: QueueBuilder) -> Queue {
        match self {
            Harness::Memory(m) => {
                let probe = b.clone().memory().expect("memory queue");
                let mut m = m.lock().expect("harness lock");
                m.entry(probe.name().to_owned()).or_insert(probe).clone()
            }
            Harness::Server(s) => b.redis(&s.url()).await.expect("connect"),
            Harness::Acl(s) => {
                let url = s.acl_user_url_for("leasehold-queue");
                // The rule really restricts: keys outside the prefix are refused.
                let outside = ::redis::Client::open(url.as_str())
                    .and_then(|c| c.get_connection())
                    .and_then(|mut c| {
                        ::redis::cmd("ZADD")
                            .arg("other:pending")
                            .arg(1)
                            .arg("1")
                            .query::<()>(&mut c)
                    });
                assert!(
                    outside.is_err(),
                    "the ACL user could write outside its prefix"
                );
                b.redis(&url).await.expect("connect as the ACL user")
            }
            Harness::ClusterAcl(c) => {
                let urls: Vec<String> = c
                    .nodes
                    .iter()
                    .map(|n| n.acl_user_url_for("leasehold-queue-cluster"))
                    .collect();
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                b.cluster(&urls).await.expect("connect as the ACL user")
            }
            Harness::Cluster(c) => {
                let urls = c.urls();
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                b.cluster(&urls).await.expect("connect")
            }
        }
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Polls `cond` until it holds or `limit` passes; the caller asserts on the result.
async fn eventually<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let give_up = Instant::now() + limit;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= give_up {
            return false;
        }
        sleep(ms(20)).await;
    }
}

async fn fifo_claim_complete(h: Harness) {
    let q = h.open(Queue::builder("fifo")).await;
    let mut ids = Vec::new();
    for i in 0..5u8 {
        ids.push(q.enqueue([b'j', i]).await.expect("enqueue"));
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids rise: {ids:?}");
    let c = q.counts().await.expect("counts");
    assert_eq!((c.pending, c.active, c.delayed, c.dead), (5, 0, 0, 0));
    for (i, id) in ids.iter().enumerate() {
        let claim = q.claim(ms(30_000)).await.expect("claim").expect("a job");
        assert_eq!(claim.id(), *id, "claims come out in enqueue order");
        assert_eq!(claim.attempts(), 1);
        assert_eq!(claim.fence().get(), 1);
        assert_eq!(claim.payload(), &[b'j', i as u8]);
        assert!(claim.remaining() > ms(25_000), "{:?}", claim.remaining());
        let info = q.job(*id).await.expect("job");
        assert_eq!(info.state, JobState::Active);
        assert_eq!(info.at_ms, Some(claim.deadline_ms()));
        claim.complete().await.expect("complete");
    }
    assert!(q.claim(ms(30_000)).await.expect("claim").is_none());
    let c = q.counts().await.expect("counts");
    assert_eq!((c.pending, c.active, c.delayed, c.dead), (0, 0, 0, 0));
    let done = q.job(ids[0]).await.expect("done marker");
    assert_eq!(
        (done.state, done.attempts, done.payload),
        (JobState::Done, 1, None)
    );
    // A complete whose reply was lost can be sent again.
    q.complete(ids[0], 1).await.expect("repeated complete");
    // Any other step on a finished attempt is refused.
    assert!(matches!(
        q.retry(ids[0], 1, Duration::ZERO).await,
        Err(Error::LeaseLost { .. })
    ));
}

async fn sixteen_workers_two_thousand_jobs(h: Harness) {
    const JOBS: u64 = 2_000;
    let producer = h.open(Queue::builder("bulk")).await;
    let payloads: Vec<Vec<u8>> = (0..JOBS).map(|i| i.to_string().into_bytes()).collect();
    let ids = producer.enqueue_many(&payloads).await.expect("enqueue");
    assert_eq!(ids.len() as u64, JOBS);
    let runs: Arc<Mutex<HashMap<JobId, u64>>> = Arc::default();
    let mut workers: Vec<WorkerHandle> = Vec::new();
    for _ in 0..16 {
        let q = h.open(Queue::builder("bulk")).await;
        let runs = runs.clone();
        let w = Worker::new(q)
            .concurrency(2)
            .ttl(ms(30_000))
            .start(move |job| {
                let runs = runs.clone();
                async move {
                    *runs.lock().expect("runs").entry(job.id()).or_default() += 1;
                    tokio::task::yield_now().await;
                    Ok(())
                }
            })
            .expect("start worker");
        workers.push(w);
    }
    let all_done = eventually(Duration::from_secs(120), || async {
        workers.iter().map(|w| w.report().completed).sum::<u64>() == JOBS
    })
    .await;
    let mut total = leasehold::queue::WorkerReport::default();
    for w in workers {
        let r = w.shutdown(Duration::from_secs(10)).await;
        total.claimed += r.claimed;
        total.completed += r.completed;
        total.lost += r.lost;
        total.retried += r.retried;
        total.failed += r.failed;
    }
    assert!(all_done, "not every job completed in time: {total:?}");
    assert_eq!(total.completed, JOBS, "{total:?}");
    assert_eq!(total.claimed, JOBS, "a job was claimed twice: {total:?}");
    assert_eq!((total.lost, total.retried, total.failed), (0, 0, 0));
    {
        let runs = runs.lock().expect("runs");
        assert_eq!(runs.len() as u64, JOBS, "some job never ran");
        for id in &ids {
            assert_eq!(
                runs.get(id),
                Some(&1),
                "job {id} ran {:?} times",
                runs.get(id)
            );
        }
    }
    let c = producer.counts().await.expect("counts");
    assert_eq!((c.pending, c.active, c.delayed, c.dead), (0, 0, 0, 0));
}

/// A worker task aborted mid-job: the job is reaped after its lease, completed by another worker
/// at attempts + 1, and the dead worker's late complete is refused as stale.
async fn aborted_worker_is_reaped(h: Harness) {
    let q = h.open(Queue::builder("crash")).await;
    let id = q.enqueue(b"work").await.expect("enqueue");
    let started = Arc::new(AtomicBool::new(false));
    let flag = started.clone();
    let doomed_queue = h.open(Queue::builder("crash")).await;
    let doomed = Worker::new(doomed_queue)
        .ttl(ms(1_000))
        .reap_every(Duration::from_secs(3_600))
        .start(move |_job| {
            let flag = flag.clone();
            async move {
                flag.store(true, Ordering::SeqCst);
                std::future::pending::<()>().await;
                Ok(())
            }
        })
        .expect("start");
    assert!(
        eventually(Duration::from_secs(10), || async {
            started.load(Ordering::SeqCst)
        })
        .await
    );
    doomed.abort();
    let aborted_at = Instant::now();
    // The first lease's deadline on the store's clock (the wall clock of this machine, for the
    // memory store and for a server on loopback alike).
    let deadline_ms = q
        .job(id)
        .await
        .expect("job")
        .at_ms
        .expect("an active job has a deadline");
    // Past the deadline the first lease still holds until someone reaps; nothing refreshes it.
    let seen: Arc<Mutex<Vec<u64>>> = Arc::default();
    let rescued_ms = Arc::new(AtomicU64::new(0));
    let rescued = rescued_ms.clone();
    let rec = seen.clone();
    let rescuer = Worker::new(h.open(Queue::builder("crash")).await)
        .ttl(ms(5_000))
        .reap_every(ms(100))
        .start(move |job| {
            let rec = rec.clone();
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock after 1970")
                .as_millis() as u64;
            rescued.store(now_ms, Ordering::SeqCst);
            async move {
                rec.lock().expect("seen").push(job.attempts());
                Ok(())
            }
        })
        .expect("start");
    assert!(
        eventually(Duration::from_secs(10), || async {
            rescuer.report().completed == 1
        })
        .await,
        "the job never came back"
    );
    let waited = aborted_at.elapsed();
    // Not before the lease ran out (1 ms of slack for the store clock's rounding), and not
    // long after it.
    let rescued_ms = rescued_ms.load(Ordering::SeqCst);
    assert!(
        rescued_ms + 1 >= deadline_ms,
        "handed out again {} ms before the first lease's deadline",
        deadline_ms - rescued_ms
    );
    assert!(waited <= ms(1_000 + 2_000), "reaped too late: {waited:?}");
    assert_eq!(*seen.lock().expect("seen"), vec![2]);
    match q.complete(id, 1).await {
        Err(Error::Stale { fence, highest, .. }) => {
            assert_eq!((fence.get(), highest.get()), (1, 2))
        }
        other => panic!("late complete was not refused as stale: {other:?}"),
    }
    let info = q.job(id).await.expect("job");
    assert_eq!((info.state, info.attempts), (JobState::Done, 2));
    rescuer.shutdown(Duration::from_secs(5)).await;
}

/// Steps after the lease ended: refused, with nothing changed.
async fn lapsed_lease_is_refused(h: Harness) {
    let q = h.open(Queue::builder("lapse")).await;
    let id = q.enqueue(b"x").await.expect("enqueue");
    // Leases of 300 ms: a claim's reply on a loaded machine still comes within them.
    let mut first = q.claim(ms(300)).await.expect("claim").expect("job");
    // Extend moves the deadline: a reap after the first deadline moves nothing.
    first.extend(ms(5_000)).await.expect("extend");
    sleep(ms(500)).await;
    assert!(q.reap().await.expect("reap").is_empty());
    // Claimed again with a short lease that nobody renews.
    q.retry(id, 1, Duration::ZERO).await.expect("retry");
    let second = q.claim(ms(300)).await.expect("claim").expect("job");
    assert_eq!(second.attempts(), 2);
    sleep(ms(500)).await;
    let reaped = q.reap().await.expect("reap");
    assert_eq!(reaped.len(), 1);
    assert_eq!(
        (reaped[0].id, reaped[0].attempts, reaped[0].to),
        (id, 2, JobState::Pending)
    );
    // Reaped but not claimed again: the lease is lost, not stale.
    assert!(matches!(
        q.extend(id, 2, ms(5_000)).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        q.complete(id, 2).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        q.fail(id, 2, "late").await,
        Err(Error::LeaseLost { .. })
    ));
    let info = q.job(id).await.expect("job");
    assert_eq!((info.state, info.attempts), (JobState::Pending, 2));
    assert_eq!(info.error.as_deref(), Some("lease expired on attempt 2"));
    let third = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(third.attempts(), 3);
    for stale in [1, 2] {
        assert!(matches!(
            q.complete(id, stale).await,
            Err(Error::Stale { fence, highest, .. }) if fence.get() == stale && highest.get() == 3
        ));
        assert!(matches!(
            q.extend(id, stale, ms(5_000)).await,
            Err(Error::Stale { .. })
        ));
        assert!(matches!(
            q.retry(id, stale, Duration::ZERO).await,
            Err(Error::Stale { .. })
        ));
        assert!(matches!(
            q.fail(id, stale, "no").await,
            Err(Error::Stale { .. })
        ));
    }
    let info = q.job(id).await.expect("job");
    assert_eq!((info.state, info.attempts), (JobState::Active, 3));
    third
        .complete()
        .await
        .expect("the current attempt completes");
}

async fn retries_delay_and_dead_set(h: Harness) {
    let q = h.open(Queue::builder("retry").max_attempts(3)).await;
    let id = q.enqueue(b"flaky").await.expect("enqueue");
    let c1 = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(
        c1.retry_because(Duration::ZERO, "first failure")
            .await
            .expect("retry"),
        JobState::Pending
    );
    let c2 = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(c2.attempts(), 2);
    let retried_at = Instant::now();
    assert_eq!(c2.retry(ms(1_000)).await.expect("retry"), JobState::Delayed);
    assert_eq!(q.counts().await.expect("counts").delayed, 1);
    let info = q.job(id).await.expect("job");
    assert_eq!(info.state, JobState::Delayed);
    assert_eq!(info.error.as_deref(), Some("first failure"));
    assert!(
        q.claim(ms(5_000)).await.expect("claim").is_none(),
        "delay not honoured"
    );
    let c3 = q
        .claim_wait(ms(5_000), Duration::from_secs(5))
        .await
        .expect("claim_wait")
        .expect("the delayed job became due");
    // Due a second after the retry, on the store's clock; found by the waiter's timer.
    let waited = retried_at.elapsed();
    assert!(waited >= ms(999) && waited <= ms(4_000), "{waited:?}");
    assert_eq!(c3.attempts(), 3);
    // The last attempt's retry sends it to the dead set instead.
    let wall_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_millis() as u64
    };
    let before = wall_ms();
    assert_eq!(
        c3.retry_because(Duration::ZERO, "third failure")
            .await
            .expect("retry"),
        JobState::Dead
    );
    let after = wall_ms();
    let c = q.counts().await.expect("counts");
    assert_eq!((c.pending, c.active, c.delayed, c.dead), (0, 0, 0, 1));
    let info = q.job(id).await.expect("job");
    assert_eq!(info.state, JobState::Dead);
    assert_eq!(info.error.as_deref(), Some("third failure"));
    assert_eq!(info.payload.as_deref(), Some(b"flaky".as_slice()));
    // A dead job's time is its time of death (the store's clock, this machine's here; a few
    // ms of slack for the memory store's reading of it).
    let died = info.at_ms.expect("a time of death");
    assert!(
        before.saturating_sub(5) <= died && died <= after + 5,
        "died at {died}, between {before} and {after}"
    );
}

/// A retry's and a failure's error are stored cut to `MAX_ERROR_LEN` bytes, at a character
/// boundary, on every store.
async fn long_errors_are_stored_cut(h: Harness) {
    let q = h.open(Queue::builder("long-errors").max_attempts(5)).await;
    let id = q.enqueue(b"job").await.expect("enqueue");
    // Two bytes a character, with one byte before: the limit falls inside a character.
    let wide = format!("x{}", "\u{e9}".repeat(MAX_ERROR_LEN));
    let c1 = q.claim(ms(5_000)).await.expect("claim").expect("job");
    c1.retry_because(Duration::ZERO, &wide)
        .await
        .expect("retry");
    let stored = q.job(id).await.expect("job").error.expect("an error");
    assert_eq!(
        stored.len(),
        MAX_ERROR_LEN - 1,
        "cut at the character boundary"
    );
    assert!(wide.starts_with(&stored));
    let c2 = q.claim(ms(5_000)).await.expect("claim").expect("job");
    c2.fail(&"y".repeat(MAX_ERROR_LEN + 1)).await.expect("fail");
    let info = q.job(id).await.expect("job");
    assert_eq!(info.state, JobState::Dead);
    assert_eq!(info.error, Some("y".repeat(MAX_ERROR_LEN)));
}

async fn reaper_sends_to_dead_after_max_attempts(h: Harness) {
    let q = h.open(Queue::builder("reapdead").max_attempts(2)).await;
    let id = q.enqueue(b"hangs").await.expect("enqueue");
    // Leases long enough that a claim's reply, on a loaded machine, still comes within them
    // (a reply after its lease is refused as `LeaseLost`).
    for attempt in 1..=2u64 {
        let c = q.claim(ms(300)).await.expect("claim").expect("job");
        assert_eq!(c.attempts(), attempt);
        sleep(ms(500)).await;
        let reaped = q.reap().await.expect("reap");
        let to = if attempt == 2 {
            JobState::Dead
        } else {
            JobState::Pending
        };
        assert_eq!(reaped.len(), 1);
        assert_eq!(
            (reaped[0].id, reaped[0].attempts, reaped[0].to),
            (id, attempt, to)
        );
    }
    assert!(q.claim(ms(50)).await.expect("claim").is_none());
    let info = q.job(id).await.expect("job");
    assert_eq!(info.state, JobState::Dead);
    assert_eq!(info.error.as_deref(), Some("lease expired on attempt 2"));
    assert_eq!(q.counts().await.expect("counts").dead, 1);
}

async fn worker_settles_by_outcome(h: Harness) {
    let q = h.open(Queue::builder("outcomes").max_attempts(5)).await;
    let flaky = q.enqueue(b"flaky").await.expect("enqueue");
    let doomed = q.enqueue(b"doomed").await.expect("enqueue");
    let seen: Arc<Mutex<Vec<(JobId, u64)>>> = Arc::default();
    let rec = seen.clone();
    let w = Worker::new(q.clone())
        .concurrency(2)
        .ttl(ms(5_000))
        .backoff(ms(50), ms(200))
        .start(move |job| {
            let rec = rec.clone();
            async move {
                rec.lock().expect("seen").push((job.id(), job.attempts()));
                match job.payload() {
                    b"doomed" => Err(JobError::permanent("cannot ever work")),
                    _ if job.attempts() < 3 => {
                        let n: Result<u8, _> = "not a number".parse::<u8>();
                        n?;
                        Ok(())
                    }
                    _ => Ok(()),
                }
            }
        })
        .expect("start");
    assert!(
        eventually(Duration::from_secs(10), || async {
            let r = w.report();
            r.completed == 1 && r.failed == 1
        })
        .await,
        "{:?}",
        w.report()
    );
    let r = w.shutdown(Duration::from_secs(5)).await;
    assert_eq!((r.completed, r.failed, r.retried, r.lost), (1, 1, 2, 0));
    let flaky_runs: Vec<u64> = seen
        .lock()
        .expect("seen")
        .iter()
        .filter(|(i, _)| *i == flaky)
        .map(|(_, a)| *a)
        .collect();
    assert_eq!(flaky_runs, vec![1, 2, 3]);
    let dead = q.job(doomed).await.expect("job");
    assert_eq!(dead.state, JobState::Dead);
    assert_eq!(dead.error.as_deref(), Some("cannot ever work"));
    assert_eq!(q.job(flaky).await.expect("job").state, JobState::Done);
}

/// A failed attempt is retried after `backoff × 2^(attempts-1)`, capped at `max_backoff`:
/// with 50 ms and a 100 ms cap, the gaps between the six attempts are at least 50, 100, 100,
/// 100 and 100 ms, and the last stays well under the 800 ms an uncapped doubling would give.
async fn retries_back_off_exponentially_up_to_the_cap(h: Harness) {
    let q = h.open(Queue::builder("backoff").max_attempts(6)).await;
    q.enqueue(b"always fails").await.expect("enqueue");
    let starts: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let rec = starts.clone();
    let w = Worker::new(q.clone())
        .ttl(ms(5_000))
        .backoff(ms(50), ms(100))
        .start(move |_job| {
            let rec = rec.clone();
            async move {
                rec.lock().expect("starts").push(Instant::now());
                Err::<(), _>(JobError::retry("not yet"))
            }
        })
        .expect("start");
    assert!(
        eventually(Duration::from_secs(10), || async {
            starts.lock().expect("starts").len() == 6
        })
        .await,
        "six attempts: {:?}",
        w.report()
    );
    w.shutdown(Duration::from_secs(5)).await;
    let starts = starts.lock().expect("starts").clone();
    let gaps: Vec<Duration> = starts.windows(2).map(|p| p[1] - p[0]).collect();
    // The delay runs on the server's clock and the gaps on this one: a millisecond of slack.
    assert_eq!(gaps.len(), 5, "{gaps:?}");
    for (gap, at_least) in gaps.iter().zip([50, 100, 100, 100, 100]) {
        assert!(*gap + ms(1) >= ms(at_least), "gaps {gaps:?}");
    }
    assert!(gaps[4] < ms(500), "the cap did not hold: gaps {gaps:?}");
}

/// A worker whose handle is dropped goes on working: the handle is for stopping it, not a
/// guard that stops it.
async fn dropped_handle_leaves_the_worker_running(h: Harness) {
    let q = h.open(Queue::builder("unowned")).await;
    drop(
        Worker::new(q.clone())
            .start(|_job| async { Ok::<(), JobError>(()) })
            .expect("start"),
    );
    let ids = [
        q.enqueue(b"a").await.expect("enqueue"),
        q.enqueue(b"b").await.expect("enqueue"),
        q.enqueue(b"c").await.expect("enqueue"),
    ];
    let done = eventually(Duration::from_secs(10), || async {
        let mut all = true;
        for id in ids {
            all &= q.job(id).await.expect("job").state == JobState::Done;
        }
        all
    })
    .await;
    assert!(
        done,
        "jobs enqueued after the handle was dropped were not run"
    );
}

/// A claim moves at most 100 due retries back to pending, the earliest due first, on every
/// backend alike: with 150 due, the 100 that came due first are claimable at once (the lowest
/// id among them first), and the other 50 join with the next claim.
async fn due_retries_return_a_hundred_a_claim(h: Harness) {
    let q = h.open(Queue::builder("due")).await;
    let ids = q.enqueue_many(vec![b"x"; 150]).await.expect("enqueue");
    let mut claims = Vec::new();
    for _ in 0..150 {
        claims.push(q.claim(ms(30_000)).await.expect("claim").expect("job"));
    }
    // Ids 51..=150 come due first, 1..=50 later.
    let (due_first, due_later): (Vec<_>, Vec<_>) =
        claims.into_iter().partition(|c| c.id() > ids[49]);
    for c in due_first {
        assert_eq!(c.retry(ms(100)).await.expect("retry"), JobState::Delayed);
    }
    for c in due_later {
        assert_eq!(c.retry(ms(400)).await.expect("retry"), JobState::Delayed);
    }
    sleep(ms(600)).await;
    let first = q.claim(ms(30_000)).await.expect("claim").expect("job");
    assert_eq!(
        first.id(),
        ids[50],
        "the lowest id of the 100 that came due first"
    );
    let second = q.claim(ms(30_000)).await.expect("claim").expect("job");
    assert_eq!(
        second.id(),
        ids[0],
        "the other 50 joined with the next claim"
    );
}

/// A batch larger than one round trip (by count and by bytes) lands whole and in order.
async fn enqueue_many_in_order(h: Harness) {
    let q = h.open(Queue::builder("batch")).await;
    let mut payloads: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; MAX_PAYLOAD]).collect();
    payloads.extend((0..600u32).map(|i| i.to_be_bytes().to_vec()));
    let ids = q.enqueue_many(&payloads).await.expect("enqueue");
    assert_eq!(ids.len(), payloads.len());
    assert!(
        ids.windows(2).all(|w| w[1].get() == w[0].get() + 1),
        "ids not consecutive"
    );
    for (id, payload) in ids.iter().zip(&payloads) {
        let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
        assert_eq!(c.id(), *id);
        assert!(
            c.payload() == payload.as_slice(),
            "payload of job {id} differs"
        );
        c.complete().await.expect("complete");
    }
    assert!(q.claim(ms(5_000)).await.expect("claim").is_none());
}

/// A panicking handler is a failed attempt: the job is retried with the panic as its error, and
/// the worker keeps going.
async fn handler_panic_is_retried(h: Harness) {
    let q = h.open(Queue::builder("panics")).await;
    let id = q.enqueue(b"boom").await.expect("enqueue");
    let w = Worker::new(q.clone())
        .backoff(ms(20), ms(20))
        .start(|job| async move {
            if job.attempts() == 1 {
                panic!("first attempt explodes");
            }
            Ok(())
        })
        .expect("start");
    assert!(
        eventually(Duration::from_secs(10), || async {
            w.report().completed == 1
        })
        .await,
        "{:?}",
        w.report()
    );
    let r = w.shutdown(Duration::from_secs(5)).await;
    assert_eq!((r.retried, r.completed, r.lost), (1, 1, 0));
    let info = q.job(id).await.expect("job");
    assert_eq!((info.state, info.attempts), (JobState::Done, 2));
}

/// A handler that panics before it returns its future (in the closure's synchronous part)
/// counts as a failed attempt as one that panics inside it does: the job is retried, and the
/// slot (here the only one) goes on to the next job.
async fn handler_panic_before_its_future_is_retried(h: Harness) {
    let q = h.open(Queue::builder("sync-panics")).await;
    let first = q.enqueue(b"boom").await.expect("enqueue");
    let second = q.enqueue(b"fine").await.expect("enqueue");
    let w = Worker::new(q.clone())
        .concurrency(1)
        .backoff(ms(20), ms(20))
        .start(|job| {
            if job.payload() == b"boom" && job.attempts() == 1 {
                panic!("the closure explodes before its future exists");
            }
            async move { Ok(()) }
        })
        .expect("start");
    assert!(
        eventually(Duration::from_secs(10), || async {
            w.report().completed == 2
        })
        .await,
        "{:?}",
        w.report()
    );
    let r = w.shutdown(Duration::from_secs(5)).await;
    assert_eq!((r.retried, r.completed, r.in_flight), (1, 2, 0), "{r:?}");
    assert_eq!(q.job(first).await.expect("job").attempts, 2);
    assert_eq!(q.job(second).await.expect("job").attempts, 1);
}

/// A handler that blocks its thread past its lease (CPU work, a synchronous call) keeps the
/// lease: renewal runs on a task of its own, so the job is not reaped and handed to another
/// worker while the handler still runs. The handler blocks for 2.5 TTLs; the TTL is long
/// enough for a renewal round trip on a loaded 2-core machine with one thread blocked (at
/// 1 s the cluster variant lost the lease once in a CI run).
async fn a_blocking_handler_keeps_its_lease(h: Harness) {
    let q = h.open(Queue::builder("blocking")).await;
    let id = q.enqueue(b"crunch").await.expect("enqueue");
    let w = Worker::new(q.clone())
        .ttl(ms(2_000))
        .reap_every(Duration::from_secs(3_600))
        .start(|_job| async move {
            std::thread::sleep(Duration::from_millis(5_000));
            Ok(())
        })
        .expect("start");
    until_running(&w).await;
    let mut stolen = None;
    let started = tokio::time::Instant::now();
    while w.report().completed == 0 && started.elapsed() < Duration::from_secs(15) {
        q.reap().await.expect("reap");
        if let Some(c) = q.claim(Duration::from_secs(30)).await.expect("claim") {
            stolen = Some(c.attempts());
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    assert_eq!(
        stolen, None,
        "the job was reaped and claimed again while its handler ran"
    );
    let r = w.shutdown(Duration::from_secs(5)).await;
    assert_eq!((r.completed, r.lost), (1, 0), "{r:?}");
    assert_eq!(q.job(id).await.expect("job").attempts, 1);
}

/// `purge_dead` removes dead jobs by age, hashes and all, and nothing else: not the young dead,
/// not pending, active or delayed jobs.
async fn purge_dead_removes_old_dead_jobs(h: Harness) {
    let q = h.open(Queue::builder("purge").max_attempts(2)).await;
    let ids = q
        .enqueue_many(["old", "young", "active", "delayed", "pending"])
        .await
        .expect("enqueue");
    let claim = || async { q.claim(ms(30_000)).await.expect("claim").expect("a job") };
    claim().await.fail("old").await.expect("fail");
    sleep(ms(1_000)).await;
    claim().await.fail("young").await.expect("fail");
    let active = claim().await;
    let to = claim().await.retry(ms(60_000)).await.expect("retry");
    assert_eq!(to, JobState::Delayed);
    assert_eq!(q.counts().await.expect("counts").dead, 2);
    assert_eq!(
        q.purge_dead(ms(3_600_000)).await.expect("purge"),
        0,
        "nothing an hour old"
    );
    assert_eq!(
        q.purge_dead(ms(500)).await.expect("purge"),
        1,
        "only the old one"
    );
    assert!(matches!(q.job(ids[0]).await, Err(Error::UnknownJob { .. })));
    assert_eq!(q.job(ids[1]).await.expect("young").state, JobState::Dead);
    assert_eq!(q.purge_dead(Duration::ZERO).await.expect("purge"), 1);
    assert!(matches!(q.job(ids[1]).await, Err(Error::UnknownJob { .. })));
    let counts = q.counts().await.expect("counts");
    assert_eq!(
        (counts.dead, counts.active, counts.delayed, counts.pending),
        (0, 1, 1, 1),
        "{counts:?}"
    );
    assert_eq!(q.job(ids[2]).await.expect("active").state, JobState::Active);
    assert_eq!(
        q.job(ids[3]).await.expect("delayed").state,
        JobState::Delayed
    );
    assert_eq!(
        q.job(ids[4]).await.expect("pending").state,
        JobState::Pending
    );
    active.complete().await.expect("complete");
    assert_eq!(q.purge_dead(Duration::ZERO).await.expect("purge"), 0);
}

/// Waits until the worker runs a handler; a worker that never claims fails the test.
async fn until_running(w: &leasehold::queue::WorkerHandle) {
    assert!(
        eventually(Duration::from_secs(10), || async {
            w.report().in_flight == 1
        })
        .await,
        "the worker did not claim the job"
    );
}

/// Sets its flag when dropped: a handler holding one tells when it was cancelled.
struct OnDrop(Arc<AtomicBool>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A handler whose lease is taken away is cancelled; its result never lands.
async fn lost_lease_cancels_handler(h: Harness) {
    let q = h.open(Queue::builder("cancel")).await;
    let id = q.enqueue(b"slow").await.expect("enqueue");
    let running = Arc::new(AtomicU64::new(0));
    let dropped = Arc::new(AtomicBool::new(false));
    let (r, d) = (running.clone(), dropped.clone());
    let w = Worker::new(q.clone())
        .ttl(ms(1_500))
        .reap_every(Duration::from_secs(3_600))
        .start(move |job| {
            let (r, d) = (r.clone(), d.clone());
            async move {
                let _guard = OnDrop(d);
                r.store(job.attempts(), Ordering::SeqCst);
                sleep(Duration::from_secs(60)).await;
                Ok(())
            }
        })
        .expect("start");
    assert!(
        eventually(Duration::from_secs(5), || async {
            running.load(Ordering::SeqCst) == 1
        })
        .await
    );
    // Renewal holds the lease well past its length.
    sleep(ms(3_000)).await;
    assert!(
        !dropped.load(Ordering::SeqCst),
        "cancelled while the lease was renewed"
    );
    assert_eq!(q.job(id).await.expect("job").state, JobState::Active);
    // An operator fails the job out from under the worker: the next extend is refused.
    q.fail(id, 1, "operator").await.expect("fail");
    assert!(
        eventually(ms(4_000), || async { dropped.load(Ordering::SeqCst) }).await,
        "handler kept running without its lease"
    );
    let r = w.shutdown(Duration::from_secs(5)).await;
    assert_eq!((r.lost, r.completed), (1, 0));
    assert_eq!(q.job(id).await.expect("job").state, JobState::Dead);
}

/// A handler future that panics while it is dropped (cancelled on a lost lease, a guard's
/// `Drop` failing) costs the job its attempt, not the worker its slot: the next job still runs.
async fn a_handler_panicking_when_cancelled_keeps_the_slot(h: Harness) {
    let q = h.open(Queue::builder("drop-panics")).await;
    let doomed = q.enqueue(b"doomed").await.expect("enqueue");
    struct PanicOnDrop;
    impl Drop for PanicOnDrop {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                panic!("the handler's guard fails as it is dropped");
            }
        }
    }
    let w = Worker::new(q.clone())
        .concurrency(1)
        .ttl(ms(600))
        .reap_every(Duration::from_secs(3_600))
        .start(|job| async move {
            if job.payload() == b"doomed" {
                let _guard = PanicOnDrop;
                sleep(Duration::from_secs(60)).await;
            }
            Ok(())
        })
        .expect("start");
    until_running(&w).await;
    // The next extend is refused: the handler is cancelled, and its guard panics.
    q.fail(doomed, 1, "operator").await.expect("fail");
    let next = q.enqueue(b"next").await.expect("enqueue");
    assert!(
        eventually(Duration::from_secs(5), || async {
            w.report().completed == 1
        })
        .await,
        "the slot died with the cancelled handler: {:?}",
        w.report()
    );
    let r = w.shutdown(Duration::from_secs(5)).await;
    assert_eq!((r.lost, r.completed, r.in_flight), (1, 1, 0), "{r:?}");
    assert_eq!(q.job(next).await.expect("job").state, JobState::Done);
}

/// A shutdown given up on (its future dropped, as an outer timeout does, or never polled, as
/// the losing branch of a `select!` is) still stops the worker: the handler is dropped, its
/// renewal ends, and the reaper can return the job.
async fn a_dropped_shutdown_still_stops_the_worker(h: Harness) {
    for polled in [true, false] {
        let q = h
            .open(Queue::builder(if polled {
                "dropped-shutdown"
            } else {
                "unpolled-shutdown"
            }))
            .await;
        let id = q.enqueue(b"stuck").await.expect("enqueue");
        let dropped = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicBool::new(false));
        let (d, s) = (dropped.clone(), started.clone());
        let w = Worker::new(q.clone())
            .ttl(ms(300))
            .reap_every(Duration::from_secs(3_600))
            .start(move |_job| {
                let (d, s) = (d.clone(), s.clone());
                async move {
                    let _guard = OnDrop(d);
                    s.store(true, Ordering::SeqCst);
                    std::future::pending::<()>().await;
                    Ok(())
                }
            })
            .expect("start");
        // Not only claimed (`in_flight` counts a job before its handler is first polled): a
        // handler cut off before its body ran would hold no guard to tell of its drop.
        assert!(
            eventually(Duration::from_secs(10), || async {
                started.load(Ordering::SeqCst)
            })
            .await,
            "the handler never started"
        );
        let shutdown = w.shutdown(Duration::from_secs(10));
        if polled {
            assert!(
                tokio::time::timeout(ms(50), shutdown).await.is_err(),
                "the handler never ends, so the shutdown cannot finish in its grace"
            );
        } else {
            drop(shutdown);
        }
        assert!(
            eventually(Duration::from_secs(2), || async {
                dropped.load(Ordering::SeqCst)
            })
            .await,
            "polled {polled}: the handler still runs after its shutdown was dropped"
        );
        // No renewal keeps the lease any more: it lapses and the job comes back.
        assert!(
            eventually(Duration::from_secs(3), || async {
                q.reap().await.expect("reap");
                q.job(id).await.expect("job").state == JobState::Pending
            })
            .await,
            "polled {polled}: the job's lease was still renewed"
        );
    }
}

/// More dead jobs than one purge batch (500): one call removes them all; and purged by three
/// callers at once, every job is removed, each by exactly one of them.
async fn purge_dead_in_batches_from_many_purgers(h: Harness) {
    let q = h.open(Queue::builder("purge-many")).await;
    let kill = |n: u32| {
        let q = q.clone();
        async move {
            let payloads: Vec<Vec<u8>> = (0..n).map(|i| i.to_be_bytes().to_vec()).collect();
            q.enqueue_many(&payloads).await.expect("enqueue");
            while let Some(c) = q.claim(ms(30_000)).await.expect("claim") {
                c.fail("dead").await.expect("fail");
            }
            assert_eq!(q.counts().await.expect("counts").dead, u64::from(n));
        }
    };
    kill(1_100).await;
    assert_eq!(q.purge_dead(Duration::ZERO).await.expect("purge"), 1_100);
    assert_eq!(q.counts().await.expect("counts").dead, 0);
    kill(1_100).await;
    let purgers: Vec<_> = (0..3)
        .map(|_| {
            let q = q.clone();
            tokio::spawn(async move { q.purge_dead(Duration::ZERO).await.expect("purge") })
        })
        .collect();
    let mut removed = 0;
    for p in purgers {
        removed += p.await.expect("purger");
    }
    assert_eq!(removed, 1_100);
    assert_eq!(q.counts().await.expect("counts").dead, 0);
}

async fn claim_wait_wakes_on_enqueue(h: Harness) {
    let q = h.open(Queue::builder("wake")).await;
    let started = Instant::now();
    assert!(
        q.claim_wait(ms(5_000), ms(300))
            .await
            .expect("wait")
            .is_none()
    );
    let waited = started.elapsed();
    assert!(waited >= ms(300) && waited < ms(1_500), "{waited:?}");
    let waiter = {
        let q = q.clone();
        tokio::spawn(async move {
            let c = q.claim_wait(ms(5_000), Duration::from_secs(10)).await;
            (Instant::now(), c)
        })
    };
    // Midway between the 1 s fallback polls, so a wake-up is told apart from a poll.
    sleep(ms(1_200)).await;
    let producer = h.open(Queue::builder("wake")).await;
    let enqueued = Instant::now();
    let id = producer.enqueue(b"now").await.expect("enqueue");
    let (woke, claim) = waiter.await.expect("waiter");
    let claim = claim.expect("claim_wait").expect("a job");
    assert_eq!(claim.id(), id);
    let lag = woke - enqueued;
    assert!(lag < ms(500), "woken only by the fallback poll: {lag:?}");
}

async fn shutdown_is_graceful(h: Harness) {
    let q = h.open(Queue::builder("shutdown")).await;
    let a = q.enqueue(b"a").await.expect("enqueue");
    let slow = |d: Duration| {
        move |_job| async move {
            sleep(d).await;
            Ok(())
        }
    };
    let w = Worker::new(q.clone()).start(slow(ms(500))).expect("start");
    assert!(eventually(Duration::from_secs(5), || async { w.report().claimed == 1 }).await);
    let r = w.shutdown(Duration::from_secs(10)).await;
    assert_eq!((r.completed, r.in_flight), (1, 0), "{r:?}");
    assert_eq!(q.job(a).await.expect("job").state, JobState::Done);
    // A job cut off at the grace deadline stays active, for the reaper.
    let b = q.enqueue(b"b").await.expect("enqueue");
    let w = Worker::new(q.clone())
        .start(slow(Duration::from_secs(30)))
        .expect("start");
    assert!(eventually(Duration::from_secs(5), || async { w.report().claimed == 1 }).await);
    let r = w.shutdown(ms(200)).await;
    assert_eq!((r.completed, r.in_flight), (0, 1), "{r:?}");
    assert_eq!(q.job(b).await.expect("job").state, JobState::Active);
}

/// Claiming stops when `shutdown` is called, not when its future is first polled: a job
/// enqueued while the future sits unpolled stays pending. (The worker of the test before is
/// gone by the time anything is enqueued, so that cannot tell.)
async fn claiming_stops_when_shutdown_is_called(h: Harness) {
    let q = h.open(Queue::builder("shutdown_called")).await;
    let w = Worker::new(q.clone())
        .start(|_| async { Ok(()) })
        .expect("start");
    // The worker, on another thread of the runtime, finds nothing and waits for an enqueue.
    sleep(ms(100)).await;
    let stopping = w.shutdown(Duration::from_secs(5));
    let id = q.enqueue(b"x").await.expect("enqueue");
    sleep(ms(300)).await;
    assert_eq!(q.job(id).await.expect("job").state, JobState::Pending);
    let r = stopping.await;
    assert_eq!(r.claimed, 0, "{r:?}");
    assert_eq!(q.job(id).await.expect("job").state, JobState::Pending);
}

/// A stop that comes together with a wake-up claims nothing. On memory an enqueue's wake-up is
/// delivered before `enqueue` returns, so with the worker asleep in its claim wait and the stop
/// sent right after, both are ready at the worker's next poll. Two guards see to it: the wait
/// looks at the stop first (`biased`), and the claim loop looks again before each claim; this
/// fails only when neither holds (a wait then picking between the two at random would claim
/// in about half of the twenty rounds).
#[tokio::test(flavor = "current_thread")]
async fn a_stop_with_a_wake_up_claims_nothing() {
    for round in 0..20 {
        let q = Queue::memory("stop_and_wake").expect("queue");
        let w = Worker::new(q.clone())
            .concurrency(1)
            .start(|_| async { Ok(()) })
            .expect("start");
        // The worker runs while this task sleeps: it finds nothing, subscribes and waits.
        sleep(ms(50)).await;
        let id = q.enqueue(b"x").await.expect("enqueue");
        let r = w.shutdown(ms(500)).await;
        assert_eq!(r.claimed, 0, "round {round}: claimed after shutdown: {r:?}");
        assert_eq!(q.job(id).await.expect("job").state, JobState::Pending);
    }
}

/// Jobs 9 to 200 retried to come due at one millisecond: a claim promotes the first 100 of
/// them as Redis orders members of one score, by their text ("10" < "100" < "9"), and hands
/// out the lowest of those, 10, not 9. Both stores alike (memory took ties by number and
/// handed out 9).
async fn take_due_ties(q: &Queue, tie: impl AsyncFn(&[JobId])) {
    q.enqueue_many(vec![b"done"; 8]).await.expect("enqueue");
    for _ in 0..8 {
        let c = q.claim(ms(60_000)).await.expect("claim");
        c.expect("job").complete().await.expect("complete");
    }
    let ids = q.enqueue_many(vec![b"x"; 192]).await.expect("enqueue");
    assert_eq!((ids[0], ids[191]), (JobId(9), JobId(200)));
    for _ in &ids {
        let c = q.claim(ms(60_000)).await.expect("claim").expect("job");
        assert_eq!(c.retry(ms(1_000)).await.expect("retry"), JobState::Delayed);
    }
    tie(&ids).await;
    let first = q.claim(ms(60_000)).await.expect("claim").expect("job");
    assert_eq!(first.id(), JobId(10));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn memory_takes_due_ties_in_redis_order() {
    let q = Queue::memory("ties").expect("queue");
    // On a paused clock every retry above came due at the same millisecond.
    take_due_ties(&q, async |_| sleep(ms(2_000)).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_takes_due_ties_in_its_order() {
    let server = Server::start(Flavor::Redis);
    let q = Queue::redis(&server.url(), "ties").await.expect("connect");
    take_due_ties(&q, async |ids| {
        for id in ids {
            let member = id.0.to_string();
            let _: i64 = server.cmd(&["ZADD", "{leasehold:ties}:delayed", "1", &member]);
        }
    })
    .await;
}

/// The memory queue times leases on the monotonic clock and reports them on the wall clock:
/// one deadline reads the same at every call. (An offset between the clocks taken afresh at
/// each call moved by a millisecond within each millisecond, so two reads of one deadline
/// could differ by one.)
#[tokio::test(flavor = "current_thread")]
async fn memory_reports_a_deadline_the_same_at_every_call() {
    let q = Queue::memory("steady").expect("queue");
    let id = q.enqueue(b"x").await.expect("enqueue");
    let claim = q.claim(ms(30_000)).await.expect("claim").expect("a job");
    let wall_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64;
    assert!(
        claim.deadline_ms().abs_diff(wall_now + 30_000) < 1_000,
        "deadline {} is not 30 s after the wall clock's {wall_now}",
        claim.deadline_ms()
    );
    for i in 0..2_000 {
        let at = q.job(id).await.expect("job").at_ms;
        assert_eq!(at, Some(claim.deadline_ms()), "read {i}");
        // Spread the reads over the millisecond's phases.
        if i % 50 == 0 {
            sleep(Duration::from_micros(300)).await;
        }
    }
}

async fn bad_input(h: Harness) {
    assert!(matches!(Queue::memory(""), Err(Error::InvalidKey { .. })));
    assert!(matches!(
        Queue::memory("a{b"),
        Err(Error::InvalidKey { .. })
    ));
    assert!(matches!(
        Queue::builder("q").prefix("p}x").memory(),
        Err(Error::InvalidKey { .. })
    ));
    // Prefix `a:b` with queue `c` would be queue `b:c` under prefix `a`.
    assert!(matches!(
        Queue::builder("c").prefix("a:b").memory(),
        Err(Error::InvalidKey { .. })
    ));
    let q = h.open(Queue::builder("bad")).await;
    assert!(matches!(
        q.claim(Duration::ZERO).await,
        Err(Error::InvalidTtl { .. })
    ));
    assert!(matches!(
        q.claim_wait(Duration::ZERO, ms(10)).await,
        Err(Error::InvalidTtl { .. })
    ));
    // Either side of lock-core's range, not only zero: refused before anything is claimed.
    let (over, under) = (leasehold::MAX_TTL + ms(1), leasehold::MIN_TTL / 2);
    q.enqueue(b"untouched").await.expect("enqueue");
    for ttl in [over, under] {
        assert!(
            matches!(q.claim(ttl).await, Err(Error::InvalidTtl { .. })),
            "{ttl:?}"
        );
        assert!(
            matches!(
                q.claim_wait(ttl, ms(10)).await,
                Err(Error::InvalidTtl { .. })
            ),
            "{ttl:?}"
        );
        let refused = Worker::new(q.clone())
            .ttl(ttl)
            .start(|_job| async { Ok(()) });
        assert!(matches!(refused, Err(Error::InvalidTtl { .. })), "{ttl:?}");
    }
    let c = q.counts().await.expect("counts");
    assert_eq!((c.pending, c.active), (1, 0), "a refused TTL claimed a job");
    q.claim(ms(5_000))
        .await
        .expect("claim")
        .expect("the job")
        .complete()
        .await
        .expect("complete");
    let big = vec![7u8; MAX_PAYLOAD + 1];
    assert!(matches!(
        q.enqueue(&big).await,
        Err(Error::PayloadTooLarge { len, max }) if len == MAX_PAYLOAD + 1 && max == MAX_PAYLOAD
    ));
    // One oversize payload in a batch: none of the batch is added.
    let batch = [vec![1u8; 10], big.clone()];
    assert!(matches!(
        q.enqueue_many(&batch).await,
        Err(Error::PayloadTooLarge { .. })
    ));
    assert_eq!(q.counts().await.expect("counts").pending, 0);
    let id = q
        .enqueue(vec![9u8; MAX_PAYLOAD])
        .await
        .expect("the limit itself is accepted");
    let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(c.payload().len(), MAX_PAYLOAD);
    assert!(matches!(
        q.extend(id, 1, Duration::ZERO).await,
        Err(Error::InvalidTtl { .. })
    ));
    for missing in [JobId(0), JobId(9_999)] {
        assert!(
            matches!(q.complete(missing, 1).await, Err(Error::UnknownJob { id, .. }) if id == missing.0)
        );
        assert!(matches!(
            q.job(missing).await,
            Err(Error::UnknownJob { .. })
        ));
        assert!(matches!(
            q.retry(missing, 1, Duration::ZERO).await,
            Err(Error::UnknownJob { .. })
        ));
    }
    assert!(matches!(
        Worker::new(q.clone())
            .ttl(Duration::ZERO)
            .start(|_| async { Ok(()) }),
        Err(Error::InvalidTtl { .. })
    ));
    for every in [Duration::ZERO, Duration::from_micros(999)] {
        assert!(matches!(
            Worker::new(q.clone())
                .reap_every(every)
                .start(|_| async { Ok(()) }),
            Err(Error::InvalidDuration {
                what: "reap interval",
                ..
            })
        ));
    }
    // A concurrency meant as "unbounded" is refused before a task is spawned.
    for n in [MAX_CONCURRENCY + 1, usize::MAX] {
        assert!(matches!(
            Worker::new(q.clone())
                .concurrency(n)
                .start(|_| async { Ok(()) }),
            Err(Error::InvalidCount {
                what: "concurrency",
                ..
            })
        ));
    }
    assert!(matches!(
        Queue::builder("q").keep_done(Duration::MAX).memory(),
        Err(Error::InvalidDuration {
            what: "keep_done",
            ..
        })
    ));
    // Nothing above disturbed the job in flight.
    c.complete().await.expect("complete");
    // A wait of `Duration::MAX` means as long as it takes.
    let id = q.enqueue(b"forever").await.expect("enqueue");
    let c = q.claim_wait(ms(5_000), Duration::MAX).await.expect("claim");
    let c = c.expect("the pending job at once");
    assert_eq!(c.id(), id);
    c.complete().await.expect("complete");
    assert!(
        tokio::time::timeout(ms(200), q.claim_wait(ms(5_000), Duration::MAX))
            .await
            .is_err(),
        "an empty queue is waited on"
    );
    // keep_done(0): completed jobs vanish at once, and their late callers get UnknownJob.
    let q0 = h
        .open(Queue::builder("nodone").keep_done(Duration::ZERO))
        .await;
    let id = q0.enqueue(b"x").await.expect("enqueue");
    q0.claim(ms(5_000))
        .await
        .expect("claim")
        .expect("job")
        .complete()
        .await
        .expect("complete");
    assert!(matches!(
        q0.complete(id, 1).await,
        Err(Error::UnknownJob { .. })
    ));
}

/// A settle repeated after it landed answers as `Claim`'s docs say: a complete again
/// succeeds while the done marker is kept and finds no job with `keep_done` zero; a retry or
/// fail again is refused as no longer held (`LeaseLost`), and as `Stale` once the retried job
/// was claimed again.
async fn repeated_settles_answer_as_documented(h: Harness) {
    let q = h.open(Queue::builder("repeats")).await;
    let id = q.enqueue(b"x").await.expect("enqueue");
    let first = q.claim(ms(30_000)).await.expect("claim").expect("job");
    assert_eq!(first.retry(ms(0)).await.expect("retry"), JobState::Pending);
    let again = first.retry(ms(0)).await;
    assert!(
        matches!(again, Err(Error::LeaseLost { .. })),
        "retry again: {again:?}"
    );
    let fail = first.fail("late").await;
    assert!(
        matches!(fail, Err(Error::LeaseLost { .. })),
        "fail after retry: {fail:?}"
    );

    let second = q
        .claim(ms(30_000))
        .await
        .expect("claim")
        .expect("the retried job");
    assert_eq!((second.id(), second.attempts()), (id, 2));
    let stale = first.retry(ms(0)).await;
    assert!(
        matches!(stale, Err(Error::Stale { .. })),
        "retry after re-claim: {stale:?}"
    );
    let stale = first.fail("late").await;
    assert!(
        matches!(stale, Err(Error::Stale { .. })),
        "fail after re-claim: {stale:?}"
    );
    assert_eq!(
        q.job(id).await.expect("job").state,
        JobState::Active,
        "the stale settles changed it"
    );

    second.complete().await.expect("complete");
    second
        .complete()
        .await
        .expect("complete again, while the done marker is kept");
    assert_eq!(q.job(id).await.expect("job").state, JobState::Done);

    let q = h
        .open(Queue::builder("repeats-unkept").keep_done(Duration::ZERO))
        .await;
    let id = q.enqueue(b"y").await.expect("enqueue");
    let c = q.claim(ms(30_000)).await.expect("claim").expect("job");
    c.complete().await.expect("complete");
    let again = c.complete().await;
    assert!(
        matches!(again, Err(Error::UnknownJob { id: gone, .. }) if gone == id.0),
        "complete again with keep_done zero: {again:?}"
    );
    let c = {
        q.enqueue(b"z").await.expect("enqueue");
        q.claim(ms(30_000)).await.expect("claim").expect("job")
    };
    let dead = c.id();
    c.fail("bad").await.expect("fail");
    assert_eq!(q.job(dead).await.expect("job").state, JobState::Dead);
    let again = c.fail("bad").await;
    assert!(
        matches!(again, Err(Error::LeaseLost { .. })),
        "fail again: {again:?}"
    );
}

/// A retry delay above `MAX_RETRY_DELAY` is refused before any round trip, with nothing
/// changed; the maximum itself parks the job, and every store reports when it is due.
async fn retry_delay_is_bounded(h: Harness) {
    let q = h.open(Queue::builder("delaycap")).await;
    let id = q.enqueue(b"x").await.expect("enqueue");
    let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
    for delay in [Duration::MAX, MAX_RETRY_DELAY + ms(1)] {
        assert!(
            matches!(
                q.retry(id, 1, delay).await,
                Err(Error::InvalidDuration { what: "retry delay", value, .. }) if value == delay
            ),
            "retry with a delay of {delay:?} was not refused"
        );
        assert!(matches!(
            q.retry_because(id, 1, delay, "why").await,
            Err(Error::InvalidDuration {
                what: "retry delay",
                ..
            })
        ));
    }
    let info = q.job(id).await.expect("job");
    assert_eq!((info.state, info.attempts), (JobState::Active, 1));
    assert!(matches!(
        Worker::new(q.clone())
            .backoff(ms(10), MAX_RETRY_DELAY + ms(1))
            .start(|_| async { Ok(()) }),
        Err(Error::InvalidDuration {
            what: "max backoff",
            ..
        })
    ));
    // Refused through the claim too, and the claim is not spent: it settles afterwards.
    assert!(matches!(
        c.retry(Duration::MAX).await,
        Err(Error::InvalidDuration {
            what: "retry delay",
            ..
        })
    ));
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64;
    assert_eq!(
        c.retry(MAX_RETRY_DELAY)
            .await
            .expect("the maximum is accepted"),
        JobState::Delayed
    );
    let at = q.job(id).await.expect("job").at_ms.expect("a due time");
    let year = MAX_RETRY_DELAY.as_millis() as u64;
    assert!(
        at >= before + year - 60_000 && at <= before + year + 60_000,
        "due at {at}, not a year after {before}"
    );
    // Under a millisecond, the stores' unit, is still a delay, not an immediate retry.
    q.enqueue(b"y").await.expect("enqueue");
    let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
    let state = c.retry(Duration::from_micros(500)).await.expect("retry");
    assert_eq!(state, JobState::Delayed);
}

/// A lease past its deadline that no reap has returned still holds (the module's limits say
/// so): nobody else can claim the job, and its holder may still extend and complete it.
async fn lapsed_unreaped_lease_still_holds(h: Harness) {
    let q = h.open(Queue::builder("lapsed")).await;
    let id = q.enqueue(b"x").await.expect("enqueue");
    let c = q.claim(ms(100)).await.expect("claim").expect("job");
    sleep(ms(300)).await;
    assert!(
        q.claim(ms(1_000)).await.expect("claim").is_none(),
        "a lapsed, unreaped lease was claimed again"
    );
    q.extend(id, c.attempts(), ms(5_000))
        .await
        .expect("its holder may extend it");
    q.complete(id, c.attempts())
        .await
        .expect("its holder may complete it");
    assert_eq!(q.job(id).await.expect("job").state, JobState::Done);
}

/// A retry without delay puts the job back where it was in line, not behind the jobs enqueued
/// after it.
async fn zero_delay_retry_keeps_its_place(h: Harness) {
    let q = h.open(Queue::builder("inline")).await;
    let a = q.enqueue(b"a").await.expect("enqueue");
    let b = q.enqueue(b"b").await.expect("enqueue");
    q.enqueue(b"c").await.expect("enqueue");
    let first = q.claim(ms(5_000)).await.expect("claim").expect("a");
    assert_eq!(first.id(), a);
    assert_eq!(
        q.retry(a, first.attempts(), Duration::ZERO)
            .await
            .expect("retry"),
        JobState::Pending
    );
    let again = q.claim(ms(5_000)).await.expect("claim").expect("a again");
    assert_eq!(
        (again.id(), again.attempts()),
        (a, 2),
        "not back at its place"
    );
    let next = q.claim(ms(5_000)).await.expect("claim").expect("b");
    assert_eq!(next.id(), b);
    // A delayed retry keeps its place too once due: ahead of a job enqueued after it.
    again.retry(ms(150)).await.expect("retry");
    let later = q.enqueue(b"later").await.expect("enqueue");
    sleep(ms(250)).await;
    let due = q.claim(ms(5_000)).await.expect("claim").expect("a, due");
    assert_eq!((due.id(), due.attempts()), (a, 3), "not back at its place");
    let c = q.claim(ms(5_000)).await.expect("claim").expect("c");
    assert!(c.id() < later, "{:?} claimed before c", c.id());
}

/// A worker runs `concurrency` handlers at once, no more and (with jobs waiting) no fewer;
/// zero counts as one.
async fn concurrency_is_the_number_of_handlers_at_once(h: Harness) {
    for (n, jobs, want) in [(3usize, 9, 3usize), (0, 4, 1)] {
        let q = h.open(Queue::builder(format!("conc{n}"))).await;
        for i in 0..jobs {
            q.enqueue(vec![i as u8]).await.expect("enqueue");
        }
        let (running, peak) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (r, p) = (running.clone(), peak.clone());
        let w = Worker::new(q.clone())
            .concurrency(n)
            .ttl(ms(5_000))
            .start(move |_job| {
                let (r, p) = (r.clone(), p.clone());
                async move {
                    let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                    p.fetch_max(now, Ordering::SeqCst);
                    sleep(ms(300)).await;
                    r.fetch_sub(1, Ordering::SeqCst);
                    Ok::<(), JobError>(())
                }
            })
            .expect("start");
        assert!(
            eventually(Duration::from_secs(15), || async {
                w.report().completed == jobs as u64
            })
            .await,
            "concurrency {n}: {:?}",
            w.report()
        );
        w.shutdown(Duration::from_secs(5)).await;
        assert_eq!(
            peak.load(Ordering::SeqCst),
            want as u64,
            "concurrency {n}: handlers at once"
        );
    }
}

/// Reaps run at once from several handles move each expired job once.
async fn concurrent_reaps_move_each_job_once(h: Harness) {
    let q = h.open(Queue::builder("reapers")).await;
    let mut ids = Vec::new();
    for i in 0..40u8 {
        ids.push(q.enqueue(vec![i]).await.expect("enqueue"));
    }
    // Leases long enough that each claim's reply, on a loaded machine, still comes within
    // them (a reply after its lease is refused as `LeaseLost`).
    for _ in 0..40 {
        q.claim(ms(400)).await.expect("claim").expect("job");
    }
    sleep(ms(600)).await;
    let mut reapers = Vec::new();
    for _ in 0..4 {
        let r = h.open(Queue::builder("reapers")).await;
        reapers.push(tokio::spawn(async move { r.reap().await }));
    }
    let mut moved = Vec::new();
    for r in reapers {
        moved.extend(r.await.expect("join").expect("reap"));
    }
    let mut got: Vec<JobId> = moved.iter().map(|m| m.id).collect();
    got.sort();
    let before = got.len();
    got.dedup();
    assert_eq!(before, got.len(), "a job was reaped twice");
    assert_eq!(got, ids, "reaped {} of 40", got.len());
    for id in got {
        let job = q.job(id).await.expect("job");
        assert_eq!((job.state, job.attempts), (JobState::Pending, 1));
    }
}

/// Churn: eight workers claim with 40 ms leases and work 0-80 ms without renewing, so about
/// half their leases lapse, while two reapers sweep every 10 ms. Every job ends done exactly
/// once, by its last claim; no attempt number (the fence) is handed out twice; every claim
/// either completed or was reaped, and every reaped claim's complete was refused; nothing is
/// left active, pending or dead.
async fn churn_of_lapsing_leases_loses_nothing(h: Harness) {
    const JOBS: usize = 150;
    const LEASE: Duration = Duration::from_millis(40);
    let producer = h.open(Queue::builder("churn").max_attempts(0)).await;
    let payloads: Vec<Vec<u8>> = (0..JOBS).map(|i| i.to_string().into_bytes()).collect();
    let ids = producer.enqueue_many(&payloads).await.expect("enqueue");
    let stop = Arc::new(AtomicBool::new(false));
    let claims: Arc<Mutex<Vec<(JobId, u64)>>> = Arc::default();
    let accepted: Arc<Mutex<HashMap<JobId, Vec<u64>>>> = Arc::default();
    let refused: Arc<Mutex<Vec<(JobId, u64)>>> = Arc::default();
    let mut workers = Vec::new();
    for seed in 0..8u64 {
        let q = h.open(Queue::builder("churn").max_attempts(0)).await;
        let (stop, claims, accepted, refused) = (
            stop.clone(),
            claims.clone(),
            accepted.clone(),
            refused.clone(),
        );
        workers.push(tokio::spawn(async move {
            // A small LCG: different work times per worker, the same each run.
            let mut state = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            while !stop.load(Ordering::SeqCst) {
                let Some(claim) = q.claim(LEASE).await.expect("claim") else {
                    sleep(ms(5)).await;
                    continue;
                };
                let (id, attempts) = (claim.id(), claim.attempts());
                claims.lock().expect("claims").push((id, attempts));
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                sleep(ms((state >> 33) % 80)).await;
                match claim.complete().await {
                    Ok(()) => accepted
                        .lock()
                        .expect("accepted")
                        .entry(id)
                        .or_default()
                        .push(attempts),
                    Err(Error::Stale { .. } | Error::LeaseLost { .. }) => {
                        refused.lock().expect("refused").push((id, attempts))
                    }
                    Err(e) => panic!("complete of {id} at {attempts}: {e}"),
                }
            }
        }));
    }
    let reaped: Arc<Mutex<Vec<(JobId, u64)>>> = Arc::default();
    let mut reapers = Vec::new();
    for _ in 0..2 {
        let q = h.open(Queue::builder("churn").max_attempts(0)).await;
        let (stop, reaped) = (stop.clone(), reaped.clone());
        reapers.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                for r in q.reap().await.expect("reap") {
                    assert_eq!(r.to, JobState::Pending, "{r:?}");
                    reaped.lock().expect("reaped").push((r.id, r.attempts));
                }
                sleep(ms(10)).await;
            }
        }));
    }
    let all_done = eventually(Duration::from_secs(60), || async {
        accepted.lock().expect("accepted").len() == JOBS
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for t in workers.into_iter().chain(reapers) {
        t.await.expect("a worker or reaper panicked");
    }
    let accepted = accepted.lock().expect("accepted").clone();
    assert!(all_done, "{} of {JOBS} jobs done in time", accepted.len());
    let mut claims = claims.lock().expect("claims").clone();
    let mut reaped = reaped.lock().expect("reaped").clone();
    let mut refused = refused.lock().expect("refused").clone();
    // The churn this is about happened.
    assert!(
        reaped.len() >= JOBS / 10,
        "only {} leases reaped: too little churn to tell",
        reaped.len()
    );
    for id in &ids {
        let done = accepted.get(id).map(Vec::as_slice);
        let info = producer.job(*id).await.expect("job");
        assert_eq!(info.state, JobState::Done, "{id}");
        assert_eq!(done, Some(&[info.attempts][..]), "{id}: completes accepted");
        let mut attempts: Vec<u64> = claims
            .iter()
            .filter(|(c, _)| c == id)
            .map(|(_, a)| *a)
            .collect();
        attempts.sort_unstable();
        let expected: Vec<u64> = (1..=info.attempts).collect();
        assert_eq!(attempts, expected, "{id}: attempts claimed");
    }
    // Each claim but a job's last was reaped, and its holder's complete refused.
    claims.sort_unstable();
    let mut not_last: Vec<(JobId, u64)> = claims
        .iter()
        .filter(|(id, a)| accepted.get(id).is_some_and(|done| done[0] != *a))
        .copied()
        .collect();
    not_last.sort_unstable();
    reaped.sort_unstable();
    refused.sort_unstable();
    assert_eq!(reaped, not_last, "reaped claims");
    assert_eq!(refused, not_last, "refused completes");
    let c = producer.counts().await.expect("counts");
    assert_eq!((c.pending, c.active, c.delayed, c.dead), (0, 0, 0, 0));
}

/// `max_attempts(0)` sets no limit: a job retried more often than the default limit allows
/// stays pending.
async fn no_attempt_limit_with_zero(h: Harness) {
    let q = h.open(Queue::builder("unlimited").max_attempts(0)).await;
    let id = q.enqueue(b"x").await.expect("enqueue");
    for attempt in 1..=8u64 {
        let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
        assert_eq!((c.id(), c.attempts()), (id, attempt));
        assert_eq!(
            q.retry(id, attempt, Duration::ZERO).await.expect("retry"),
            JobState::Pending,
            "attempt {attempt}"
        );
    }
}

/// Waiters wake when a retry or a reap returns a job to pending, not only on enqueue, and when
/// a retry delays a job (to look again and sleep until it is due).
async fn claim_wait_wakes_on_retry_and_reap(h: Harness) {
    let q = h.open(Queue::builder("rewake")).await;
    for how in ["retry", "delayed retry", "reap"] {
        let id = q.enqueue(how.as_bytes()).await.expect("enqueue");
        let held = q
            .claim(if how == "reap" { ms(100) } else { ms(5_000) })
            .await
            .expect("claim")
            .expect("job");
        let waiter = {
            let q = h.open(Queue::builder("rewake")).await;
            tokio::spawn(async move {
                let c = q.claim_wait(ms(5_000), Duration::from_secs(10)).await;
                (Instant::now(), c)
            })
        };
        // Midway between the 1 s fallback polls, so a wake-up is told apart from a poll.
        sleep(ms(1_200)).await;
        let returned = Instant::now();
        if how == "retry" {
            q.retry(id, held.attempts(), Duration::ZERO)
                .await
                .expect("retry");
        } else if how == "delayed retry" {
            // The waiter last looked when nothing was delayed: woken now, it looks again and
            // sleeps until the job is due.
            q.retry(id, held.attempts(), ms(50)).await.expect("retry");
        } else {
            assert_eq!(q.reap().await.expect("reap").len(), 1);
        }
        let (woke, claim) = waiter.await.expect("waiter");
        let claim = claim.expect("claim_wait").expect("a job");
        assert_eq!((claim.id(), claim.attempts()), (id, 2), "{how}");
        let lag = woke - returned;
        assert!(
            lag < ms(500),
            "{how}: woken only by the fallback poll: {lag:?}"
        );
        q.complete(id, 2).await.expect("complete");
    }
}

/// A completed job's marker stays for `keep_done`: until then a late caller of an old attempt
/// is told `Stale`, after it `UnknownJob`, as is everyone else.
async fn done_marker_expires_after_keep_done(h: Harness) {
    let q = h.open(Queue::builder("marker").keep_done(ms(300))).await;
    let id = q.enqueue(b"x").await.expect("enqueue");
    let first = q.claim(ms(5_000)).await.expect("claim").expect("job");
    q.retry(id, first.attempts(), Duration::ZERO)
        .await
        .expect("retry");
    let second = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(second.attempts(), 2);
    q.complete(id, 2).await.expect("complete");
    let late = q.complete(id, 1).await;
    assert!(matches!(late, Err(Error::Stale { .. })), "{late:?}");
    q.complete(id, 2)
        .await
        .expect("the same completion again, while the marker stays");
    sleep(ms(600)).await;
    for attempt in [1, 2] {
        let r = q.complete(id, attempt).await;
        assert!(
            matches!(r, Err(Error::UnknownJob { .. })),
            "attempt {attempt}: {r:?}"
        );
    }
    assert!(matches!(q.job(id).await, Err(Error::UnknownJob { .. })));
}

/// An attempt higher than any the job was given was never granted: it is not stale (no newer
/// attempt superseded it), and no step of it lands.
async fn unissued_attempt_is_refused(h: Harness) {
    let q = h.open(Queue::builder("unissued")).await;
    let id = q.enqueue(b"x").await.expect("enqueue");
    let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(c.attempts(), 1);
    let res = q.complete(id, 7).await;
    assert!(matches!(res, Err(Error::LeaseLost { .. })), "{res:?}");
    assert!(matches!(
        q.extend(id, 7, ms(5_000)).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        q.retry(id, 7, Duration::ZERO).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        q.fail(id, 7, "no").await,
        Err(Error::LeaseLost { .. })
    ));
    // A lower attempt is still stale.
    assert!(matches!(
        q.complete(id, 0).await,
        Err(Error::Stale { fence, highest, .. }) if fence.get() == 0 && highest.get() == 1
    ));
    let info = q.job(id).await.expect("job");
    assert_eq!((info.state, info.attempts), (JobState::Active, 1));
    c.complete().await.expect("the real attempt completes");
    // The done marker remembers attempt 1; attempt 7 is still one that never was.
    assert!(matches!(
        q.complete(id, 7).await,
        Err(Error::LeaseLost { .. })
    ));
    q.complete(id, 1).await.expect("a repeated complete");
    // A job never claimed has no attempt 1 yet.
    let fresh = q.enqueue(b"y").await.expect("enqueue");
    assert!(matches!(
        q.complete(fresh, 1).await,
        Err(Error::LeaseLost { .. })
    ));
    assert_eq!(q.job(fresh).await.expect("job").state, JobState::Pending);
}

#[cfg(feature = "serde")]
async fn typed_payloads(h: Harness) {
    let q = h.open(Queue::builder("typed")).await;
    q.enqueue_json(&(7u32, "seven")).await.expect("enqueue");
    q.enqueue(b"not json").await.expect("enqueue");
    let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(
        c.json::<(u32, String)>().expect("decode"),
        (7, "seven".to_owned())
    );
    c.complete().await.expect("complete");
    let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert!(matches!(c.json::<(u32, String)>(), Err(Error::Codec(_))));
}

#[cfg(not(feature = "serde"))]
async fn typed_payloads(_h: Harness) {
    panic!("the suite must be run with --all-features (the `serde` feature)");
}

macro_rules! suite {
    ($modname:ident, $make:expr) => {
        mod $modname {
            use super::*;
            fn harness() -> Harness {
                $make
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn claiming_stops_when_shutdown_is_called() {
                super::claiming_stops_when_shutdown_is_called(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn fifo_claim_complete() {
                super::fifo_claim_complete(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sixteen_workers_two_thousand_jobs() {
                super::sixteen_workers_two_thousand_jobs(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn aborted_worker_is_reaped() {
                super::aborted_worker_is_reaped(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lapsed_lease_is_refused() {
                super::lapsed_lease_is_refused(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn retries_delay_and_dead_set() {
                super::retries_delay_and_dead_set(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn long_errors_are_stored_cut() {
                super::long_errors_are_stored_cut(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn reaper_sends_to_dead_after_max_attempts() {
                super::reaper_sends_to_dead_after_max_attempts(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn worker_settles_by_outcome() {
                super::worker_settles_by_outcome(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn retries_back_off_exponentially_up_to_the_cap() {
                super::retries_back_off_exponentially_up_to_the_cap(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn dropped_handle_leaves_the_worker_running() {
                super::dropped_handle_leaves_the_worker_running(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn due_retries_return_a_hundred_a_claim() {
                super::due_retries_return_a_hundred_a_claim(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn enqueue_many_in_order() {
                super::enqueue_many_in_order(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn handler_panic_is_retried() {
                super::handler_panic_is_retried(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn purge_dead_in_batches_from_many_purgers() {
                super::purge_dead_in_batches_from_many_purgers(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn purge_dead_removes_old_dead_jobs() {
                super::purge_dead_removes_old_dead_jobs(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn handler_panic_before_its_future_is_retried() {
                super::handler_panic_before_its_future_is_retried(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_blocking_handler_keeps_its_lease() {
                super::a_blocking_handler_keeps_its_lease(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_handler_panicking_when_cancelled_keeps_the_slot() {
                super::a_handler_panicking_when_cancelled_keeps_the_slot(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_dropped_shutdown_still_stops_the_worker() {
                super::a_dropped_shutdown_still_stops_the_worker(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lost_lease_cancels_handler() {
                super::lost_lease_cancels_handler(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lapsed_unreaped_lease_still_holds() {
                super::lapsed_unreaped_lease_still_holds(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn zero_delay_retry_keeps_its_place() {
                super::zero_delay_retry_keeps_its_place(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrency_is_the_number_of_handlers_at_once() {
                super::concurrency_is_the_number_of_handlers_at_once(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_reaps_move_each_job_once() {
                super::concurrent_reaps_move_each_job_once(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn churn_of_lapsing_leases_loses_nothing() {
                super::churn_of_lapsing_leases_loses_nothing(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn no_attempt_limit_with_zero() {
                super::no_attempt_limit_with_zero(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn claim_wait_wakes_on_retry_and_reap() {
                super::claim_wait_wakes_on_retry_and_reap(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn done_marker_expires_after_keep_done() {
                super::done_marker_expires_after_keep_done(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn claim_wait_wakes_on_enqueue() {
                super::claim_wait_wakes_on_enqueue(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shutdown_is_graceful() {
                super::shutdown_is_graceful(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn bad_input() {
                super::bad_input(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn retry_delay_is_bounded() {
                super::retry_delay_is_bounded(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn repeated_settles_answer_as_documented() {
                super::repeated_settles_answer_as_documented(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn unissued_attempt_is_refused() {
                super::unissued_attempt_is_refused(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn typed_payloads() {
                super::typed_payloads(harness()).await
            }
        }
    };
}

suite!(memory, Harness::memory());
suite!(redis, Harness::Server(Server::start(Flavor::Redis)));
suite!(valkey, Harness::Server(Server::start(Flavor::Valkey)));
suite!(redis_acl, Harness::Acl(Server::start(Flavor::Redis)));
suite!(valkey_acl, Harness::Acl(Server::start(Flavor::Valkey)));
suite!(
    redis_cluster,
    Harness::Cluster(Cluster::start(Flavor::Redis, 3, 0))
);
suite!(
    valkey_cluster,
    Harness::Cluster(Cluster::start(Flavor::Valkey, 3, 0))
);
suite!(
    redis_cluster_acl,
    Harness::ClusterAcl(Cluster::start(Flavor::Redis, 3, 0))
);

/// `max_attempts` is stored with each job at enqueue: a handle opened later with another limit
/// changes neither the jobs already queued nor, through them, how soon they die. (Server
/// queues: a memory queue is one object, whose builder is used once.)
async fn max_attempts_is_fixed_at_enqueue(s: Server) {
    let url = s.url();
    let open = |n| Queue::builder("fixed").max_attempts(n).redis(&url);
    let one = open(1).await.expect("connect");
    let five = open(5).await.expect("connect");
    let dies = one.enqueue(b"x").await.expect("enqueue");
    let c = five.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(c.id(), dies);
    assert_eq!(
        c.retry(Duration::ZERO).await.expect("retry"),
        JobState::Dead
    );
    let lives = five.enqueue(b"y").await.expect("enqueue");
    let c = one.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(c.id(), lives);
    assert_eq!(
        c.retry(Duration::ZERO).await.expect("retry"),
        JobState::Pending
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_attempts_is_fixed_at_enqueue_on_redis() {
    max_attempts_is_fixed_at_enqueue(Server::start(Flavor::Redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_attempts_is_fixed_at_enqueue_on_valkey() {
    max_attempts_is_fixed_at_enqueue(Server::start(Flavor::Valkey)).await;
}
