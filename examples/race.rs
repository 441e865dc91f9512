//! The race: four workers reach for one lock at once.
//!
//! 1. Workers A-D run the acquire together; exactly one gets the lease, the rest see it held.
//! 2. The holder crashes without releasing. Because the lease has an expiry (PX), the key frees
//!    itself and another worker takes it, with a higher fence.
//! 3. The anti-pattern: a lock with no expiry (`SET NX` alone). The same crash leaves it held
//!    forever; the others give up after a bounded wait. That is the deadlock PX prevents.
//!
//! ```text
//! cargo run --example race                                      # in-memory backend
//! cargo run --example race -- --redis redis://127.0.0.1:6379/   # a Redis/Valkey server
//! ```

use std::time::Duration;

use leasehold::{Error, LockOptions, Locker};

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
    // A fresh key per run, so reruns against one server never see each other's locks.
    let key = format!("resource:race-{}", std::process::id());
    let ttl = Duration::from_millis(800);
    let opts = LockOptions::new().ttl(ttl).renew(false);

    println!("\n== 1. four workers run the acquire at once (ttl {ttl:?})");
    let mut tasks = Vec::new();
    for name in ["A", "B", "C", "D"] {
        let (locker, key, opts) = (locker.clone(), key.clone(), opts.clone());
        tasks.push(tokio::spawn(async move {
            (name, locker.try_acquire(&key, &opts).await)
        }));
    }
    let mut holder = None;
    let mut others = Vec::new();
    for t in tasks {
        let (name, result) = t.await?;
        match result {
            Ok(lease) => {
                println!(
                    "worker {name}: OK, holds the lock with fence {}",
                    lease.fence()
                );
                holder = Some((name, lease));
            }
            Err(Error::Busy { remaining, .. }) => {
                println!("worker {name}: held by another (expires in {remaining:?})");
                others.push(name);
            }
            Err(e) => return Err(e.into()),
        }
    }
    let (holder_name, lease) = holder.ok_or("nobody got the lock")?;
    if others.len() != 3 {
        return Err("expected exactly one winner".into());
    }
    let first_fence = lease.fence();

    println!("\n== 2. worker {holder_name} crashes without releasing");
    // A crashed process runs no destructor: forgetting the guard leaves the lease on the server,
    // exactly as a crash would (dropping it would release it in the background).
    std::mem::forget(lease);
    let wait = opts.clone().wait(Duration::from_secs(3));
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for name in others.clone() {
        let (locker, key, wait) = (locker.clone(), key.clone(), wait.clone());
        tasks.push(tokio::spawn(async move {
            let lease = locker.acquire(&key, &wait).await?;
            let at = started.elapsed();
            let fence = lease.fence();
            println!(
                "worker {name}: took the lock after {at:.0?}, fence {fence}, then released it"
            );
            lease.release().await?;
            Ok::<_, Error>((at, fence))
        }));
    }
    let mut grants = Vec::new();
    for t in tasks {
        grants.push(t.await??);
    }
    grants.sort();
    let first_after = grants.first().ok_or("nobody took the expired lock")?;
    if first_after.0 < ttl / 2 {
        return Err("the lock was taken before the crashed holder's lease expired".into());
    }
    let mut last = first_fence;
    for (_, fence) in &grants {
        if *fence <= last {
            return Err("the fence did not increase".into());
        }
        last = *fence;
    }
    println!("every later grant carried a higher fence than {first_fence}.");
    println!("with PX the crash cost one TTL, not the lock.");

    println!("\n== 3. the anti-pattern: SET {key} NX with no expiry, then the same crash");
    let never = format!("{key}:no-px");
    let stuck = match &redis_url {
        Some(url) => {
            let server_key = locker.lock_key(&never)?.lock_key();
            let mut conn = redis::Client::open(url.as_str())?
                .get_multiplexed_async_connection()
                .await?;
            let set: Option<String> = redis::cmd("SET")
                .arg(&server_key)
                .arg("crashed-holder")
                .arg("NX")
                .query_async(&mut conn)
                .await?;
            println!("worker {holder_name}: SET NX -> {set:?}, then crashes");
            Some((conn, server_key))
        }
        None => {
            // In memory there is no raw SET; a holder that renews forever and never releases
            // is what a key without expiry is to everyone else.
            let lease = locker
                .try_acquire(&never, &LockOptions::new().ttl(ttl))
                .await?;
            println!("worker {holder_name}: took a lock that never expires, then crashes");
            tokio::spawn(async move {
                let _held_forever = lease;
                std::future::pending::<()>().await;
            });
            None
        }
    };
    let wait = opts.clone().wait(Duration::from_secs(2));
    let mut tasks = Vec::new();
    for name in others {
        let (locker, never, wait) = (locker.clone(), never.clone(), wait.clone());
        tasks.push(tokio::spawn(async move {
            (name, locker.acquire(&never, &wait).await)
        }));
    }
    let mut deadlocked = 0;
    for t in tasks {
        let (name, result) = t.await?;
        match result {
            Err(Error::WaitTimeout { waited, .. }) => {
                println!("worker {name}: gave up after {waited:.1?}: deadlock");
                deadlocked += 1;
            }
            Ok(_) => return Err("a lock without expiry was taken: the demo is wrong".into()),
            Err(e) => return Err(e.into()),
        }
    }
    if let Some((mut conn, server_key)) = stuck {
        let _: i64 = redis::cmd("DEL")
            .arg(&server_key)
            .query_async(&mut conn)
            .await?;
    }
    println!(
        "{deadlocked} workers deadlocked: without an expiry, a crashed holder holds the lock forever."
    );
    Ok(())
}
