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

use leasehold::{Error, LockOptions, Locker, Token};

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
    let key = format!("resource:race-{}", &Token::generate().as_str()[..12]);
    let ttl = Duration::from_millis(800);
    let opts = LockOptions::new().ttl(ttl).renew(false);

    println!("\n== 1. four workers run the acquire at once (ttl {ttl:?})");
    // No grant is older than this, so no lease granted now expires before `began + ttl`.
    let began = tokio::time::Instant::now();
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
                let left = remaining.map_or("no expiry".to_owned(), |r| format!("{r:.0?}"));
                println!("worker {name}: held (holder's lease expires in {left})");
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
            println!("worker {name}: took it after {at:.0?}, fence {fence}; releases it");
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
    // A millisecond of slack: servers count TTLs in whole milliseconds on their own clock.
    if (started - began) + first_after.0 + Duration::from_millis(1) < ttl {
        return Err("the lock was taken before the crashed holder's lease expired".into());
    }
    let mut last = first_fence;
    for (_, fence) in &grants {
        if *fence <= last {
            return Err(format!("fence {fence} is not higher than {last}").into());
        }
        println!("  fence {fence} > {last}: higher than every earlier grant");
        last = *fence;
    }
    println!("with PX the crash cost one TTL, not the lock; a resource checking fences");
    println!("can refuse the crashed holder if it wakes up and writes.");

    println!(
        "\n== 3. the anti-pattern: a lock with no expiry (SET NX, no PX), then the same crash"
    );
    let never = format!("{key}:no-px");
    let stuck = match &redis_url {
        Some(url) => {
            let server_key = locker.lock_key(&never)?.lock_key().to_owned();
            let mut conn = redis::Client::open(url.as_str())?
                .get_multiplexed_async_connection()
                .await?;
            let set: Option<String> = redis::cmd("SET")
                .arg(&server_key)
                .arg("crashed-holder")
                .arg("NX")
                .query_async(&mut conn)
                .await?;
            let set = set.ok_or("the no-expiry key already existed")?;
            println!("worker {holder_name}: SET {server_key} NX -> {set}, then crashes");
            Some((conn, server_key))
        }
        None => {
            // In memory there is no raw SET, and every lease expires; the longest TTL there is
            // (a day) outlasts any wait here, as no expiry would. The crash is the same as above.
            let no_expiry = LockOptions::new().ttl(leasehold::MAX_TTL).renew(false);
            let lease = locker.try_acquire(&never, &no_expiry).await?;
            println!(
                "worker {holder_name}: takes the lock with a {:?} TTL (standing in for no expiry), then crashes",
                leasehold::MAX_TTL
            );
            std::mem::forget(lease);
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
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await);
    }
    // Clean up before judging, so a failed run leaves no key without expiry on the server.
    let cleaned = if let Some((mut conn, server_key)) = stuck {
        // The stuck key, and the fence counters of this run's one-off keys.
        let _: i64 = redis::cmd("DEL")
            .arg(&server_key)
            .arg(locker.lock_key(&never)?.fence_key())
            .arg(locker.lock_key(&key)?.fence_key())
            .query_async(&mut conn)
            .await?;
        Some(server_key)
    } else {
        None
    };
    let mut deadlocked = 0;
    for result in results {
        let (name, result) = result?;
        match result {
            Err(Error::WaitTimeout { waited, .. }) => {
                println!("worker {name}: gave up after {waited:.1?}: deadlock");
                deadlocked += 1;
            }
            Ok(_) => return Err("a lock without expiry was taken: the demo is wrong".into()),
            Err(e) => return Err(e.into()),
        }
    }
    println!(
        "{deadlocked} workers deadlocked: without an expiry, a crashed holder holds the lock forever."
    );
    if let Some(server_key) = cleaned {
        println!("(deleted {server_key} from the server)");
    }
    Ok(())
}
