//! A small job runner: workers race to run the same job through a `#[locked]` function.
//!
//! 1. Six workers call `run_job` at once with `wait`: they take turns, one body at a time, each
//!    with a higher fence, and each run's fence is admitted by the ledger's fence gate.
//! 2. Three workers call `try_job` (no `wait`, so fail fast): one runs, the others skip at once
//!    with `Error::Busy` instead of queueing.
//!
//! ```text
//! cargo run --example locked_fn                                      # in-memory backend
//! cargo run --example locked_fn -- --redis redis://127.0.0.1:6379/   # a Redis/Valkey server
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use leasehold::{Error, Fence, FenceGate, Locker, Token, current_fence, locked};
use tokio::time::{Instant, sleep};

/// The job runner's own error; lock failures arrive through `From<leasehold::Error>`.
#[derive(Debug)]
enum JobError {
    Lock(Error),
    NoFence,
}

impl From<Error> for JobError {
    fn from(e: Error) -> Self {
        JobError::Lock(e)
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JobError::Lock(e) => write!(f, "{e}"),
            JobError::NoFence => f.write_str("ran outside a lease"),
        }
    }
}

impl std::error::Error for JobError {}

/// One run of the job: its fence, and when its body began and ended.
struct Run {
    fence: Fence,
    began: Instant,
    ended: Instant,
}

/// Runs `job` once the lease on it is ours, waiting up to 10 s for other workers.
#[locked(key = "job:{job}", ttl = "2s", wait = "10s")]
async fn run_job(
    job: &str,
    worker: &str,
    ledger: &FenceGate,
    started: Instant,
) -> Result<Run, JobError> {
    let began = Instant::now();
    let fence = current_fence().ok_or(JobError::NoFence)?;
    println!(
        "  {:>5} ms  worker {worker}: running {job} with fence {fence}",
        started.elapsed().as_millis()
    );
    sleep(Duration::from_millis(120)).await;
    // The write is fenced: a worker that lost its lease and came back late would be refused.
    ledger.admit(fence).await?;
    Ok(Run {
        fence,
        began,
        ended: Instant::now(),
    })
}

/// Runs `job` only if nobody else is on it right now.
#[locked(key = "job:{job}", ttl = "2s")]
async fn try_job(job: &str, worker: &str) -> Result<Fence, JobError> {
    let fence = current_fence().ok_or(JobError::NoFence)?;
    println!("  worker {worker}: running {job} with fence {fence}");
    sleep(Duration::from_millis(300)).await;
    Ok(fence)
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let redis_url = args
        .iter()
        .position(|a| a == "--redis")
        .map(|i| args.get(i + 1).cloned().ok_or("--redis needs a URL"))
        .transpose()?;
    let locker = match &redis_url {
        Some(url) => Locker::redis(url).await?,
        None => Locker::memory(),
    };
    println!(
        "backend: {}",
        redis_url
            .as_deref()
            .unwrap_or("in-memory (pass --redis URL for a server)")
    );
    leasehold::set_default_locker(locker.clone())?;
    // A fresh job name per run, so reruns against one server never see each other's leases.
    let run = Token::generate().as_str()[..8].to_owned();
    let job = format!("nightly-{run}");

    println!("\n== 1. six workers race for {job}, waiting their turn");
    let ledger = Arc::new(locker.fence_gate(&format!("ledger-{run}"))?);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in ["A", "B", "C", "D", "E", "F"] {
        let (ledger, job) = (ledger.clone(), job.clone());
        tasks.push(tokio::spawn(async move {
            (worker, run_job(&job, worker, &ledger, started).await)
        }));
    }
    let mut runs = Vec::new();
    for t in tasks {
        let (worker, result) = t.await?;
        runs.push((result?, worker));
    }
    // The story, checked: in the order the bodies ran, each began after the one before it
    // ended, and under a higher fence.
    runs.sort_by_key(|(run, _)| run.began);
    for pair in runs.windows(2) {
        let ((before, a), (after, b)) = (&pair[0], &pair[1]);
        if after.began < before.ended {
            return Err(format!("worker {b} began before worker {a} had ended").into());
        }
        if after.fence <= before.fence {
            return Err(format!(
                "worker {b} ran after worker {a} under fence {}, not above {}",
                after.fence, before.fence
            )
            .into());
        }
    }
    let order: Vec<String> = runs
        .iter()
        .map(|(run, w)| format!("{w}:{}", run.fence))
        .collect();
    println!(
        "  one at a time, fences strictly increasing in the order they ran: {}",
        order.join(" < ")
    );

    println!("\n== 2. three workers try {job} at once, without waiting");
    let mut tasks = Vec::new();
    for worker in ["X", "Y", "Z"] {
        let job = job.clone();
        tasks.push(tokio::spawn(async move {
            (worker, try_job(&job, worker).await)
        }));
    }
    let (mut ran, mut skipped) = (0, 0);
    for t in tasks {
        match t.await? {
            (worker, Ok(fence)) => {
                ran += 1;
                println!("  worker {worker}: done (fence {fence})")
            }
            (worker, Err(JobError::Lock(Error::Busy { .. }))) => {
                skipped += 1;
                println!("  worker {worker}: skipped, another worker holds the job")
            }
            (worker, Err(e)) => return Err(format!("worker {worker}: failed: {e}").into()),
        }
    }
    // The story, checked: someone ran, and someone found the job taken and skipped (all three
    // start together and a run takes 300 ms, so normally one runs and two skip).
    if ran == 0 || skipped == 0 {
        return Err(
            format!("expected a run and a skip, got {ran} run and {skipped} skipped").into(),
        );
    }
    Ok(())
}
