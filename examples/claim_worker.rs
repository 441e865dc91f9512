//! Claim leases: a producer, a worker that crashes mid-job, two healthy workers and a reaper.
//!
//! 1. The producer enqueues six jobs.
//! 2. Worker C claims the first one (attempt 1, a 1 s lease on the store's clock) and crashes
//!    while running it: its task is aborted, so nothing renews or settles the lease.
//! 3. Workers A and B run the rest. Once C's lease deadline passes, the reaper returns its job
//!    to pending, keeping its attempts; A or B claims it as attempt 2 and completes it.
//! 4. C "comes back" and tries to complete the job with its old attempt number; the queue
//!    refuses it as stale, because attempt 2 exists. That refusal is the fence.
//!
//! ```text
//! cargo run --example claim_worker                                      # in-memory queue
//! cargo run --example claim_worker -- --redis redis://127.0.0.1:6379/   # a Redis/Valkey server
//! ```

use std::time::Duration;

use leasehold::Token;
use leasehold::queue::{Queue, Worker, WorkerHandle};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Another handle on the same queue: its own connection on a server, as a separate worker
/// process would have; a clone in memory, where the queue lives in this process.
async fn handle(queue: &Queue, redis_url: Option<&str>) -> Result<Queue, BoxError> {
    Ok(match redis_url {
        Some(url) => Queue::redis(url, queue.name()).await?,
        None => queue.clone(),
    })
}

fn healthy(queue: Queue, name: &'static str, t0: Instant) -> Result<WorkerHandle, BoxError> {
    Ok(Worker::new(queue)
        .ttl(Duration::from_secs(5))
        // The reaper below runs on its own beat, so its moves can be printed.
        .reap_every(Duration::from_secs(3_600))
        .start(move |job| async move {
            println!(
                "{:>6} ms  worker {name}: job {} attempt {} ({})",
                t0.elapsed().as_millis(),
                job.id(),
                job.attempts(),
                String::from_utf8_lossy(job.payload())
            );
            sleep(Duration::from_millis(150)).await;
            Ok(())
        })?)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let redis_url = args
        .iter()
        .position(|a| a == "--redis")
        .map(|i| args.get(i + 1).cloned().ok_or("--redis needs a URL"))
        .transpose()?;
    println!(
        "store: {}",
        redis_url
            .as_deref()
            .unwrap_or("in-memory (pass --redis URL for a server)")
    );
    // A fresh queue per run, so reruns against one server never see each other's jobs.
    let name = format!("claims-{}", &Token::generate().as_str()[..12]);
    let queue = match &redis_url {
        Some(url) => Queue::redis(url, &name).await?,
        None => Queue::memory(&name)?,
    };
    let t0 = Instant::now();

    println!("\n== 1. the producer enqueues six jobs on `{name}`");
    let payloads: Vec<String> = (1..=6).map(|i| format!("send email #{i}")).collect();
    let ids = queue.enqueue_many(&payloads).await?;
    let shown: Vec<String> = ids.iter().map(ToString::to_string).collect();
    println!("enqueued jobs {}", shown.join(", "));

    println!("\n== 2. worker C takes the first job and crashes mid-job");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let crashing = Worker::new(handle(&queue, redis_url.as_deref()).await?)
        .ttl(Duration::from_secs(1))
        .start(move |job| {
            let tx = tx.clone();
            async move {
                let _ = tx.send((job.id(), job.attempts(), job.deadline_ms()));
                std::future::pending::<()>().await; // never finishes
                Ok(())
            }
        })?;
    let (crashed_id, crashed_attempts, deadline_ms) =
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await?
            .ok_or("worker C never claimed")?;
    println!(
        "{:>6} ms  worker C: job {crashed_id} attempt {crashed_attempts}, lease deadline {deadline_ms} (store clock)",
        t0.elapsed().as_millis()
    );
    crashing.abort();
    println!(
        "{:>6} ms  worker C: crashed (task aborted; nobody renews its lease)",
        t0.elapsed().as_millis()
    );

    println!("\n== 3. workers A and B run the rest; the reaper returns C's job after its lease");
    let a = healthy(handle(&queue, redis_url.as_deref()).await?, "A", t0)?;
    let b = healthy(handle(&queue, redis_url.as_deref()).await?, "B", t0)?;
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        for r in queue.reap().await? {
            println!(
                "{:>6} ms  reaper: job {} back to {} (attempts stay {})",
                t0.elapsed().as_millis(),
                r.id,
                r.to,
                r.attempts
            );
        }
        let done = a.report().completed + b.report().completed;
        if done == ids.len() as u64 {
            break;
        }
        if Instant::now() > give_up {
            return Err(format!("only {done} of {} jobs completed", ids.len()).into());
        }
        sleep(Duration::from_millis(100)).await;
    }
    let info = queue.job(crashed_id).await?;
    println!(
        "job {crashed_id} is now {} after attempt {}",
        info.state, info.attempts
    );

    println!(
        "\n== 4. worker C comes back and completes job {crashed_id} as attempt {crashed_attempts}"
    );
    match queue.complete(crashed_id, crashed_attempts).await {
        Err(e @ leasehold::Error::Stale { .. }) => println!("refused: {e}"),
        Ok(()) => return Err("the stale completion was accepted".into()),
        Err(e) => return Err(e.into()),
    }

    let ra = a.shutdown(Duration::from_secs(5)).await;
    let rb = b.shutdown(Duration::from_secs(5)).await;
    let counts = queue.counts().await?;
    println!(
        "\nworker A completed {}, worker B completed {}; left: {} pending, {} active, {} dead",
        ra.completed, rb.completed, counts.pending, counts.active, counts.dead
    );
    Ok(())
}
