//! A master of a real cluster killed under load: the clients recover, every key's fences keep
//! rising, and the double grants the failover caused are counted and printed (a failover can
//! lose a lock; that is the documented limit, and the fence is what protects the data).

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{Fence, LockOptions, Locker};
use support::{Cluster, Flavor};
use tokio::time::{Instant, sleep};

/// One grant as the client saw it.
#[derive(Clone, Debug)]
struct Grant {
    key: usize,
    fence: Fence,
    from: Instant,
    until: Instant,
}

async fn master_killed_under_load(flavor: Flavor) {
    let mut cluster = Cluster::start(flavor, 3, 1);
    // The surviving shards keep serving while the failed one fails over (the default stops the
    // whole cluster until every slot is covered again, and nothing could be renewed anywhere).
    for node in &cluster.nodes {
        let _: () = node.cmd(&["CONFIG", "SET", "cluster-require-full-coverage", "no"]);
    }
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let locker = Locker::redis_cluster(&urls).await.expect("connect");
    const KEYS: usize = 24;
    let grants = Arc::new(Mutex::new(Vec::<Grant>::new()));
    let errors = Arc::new(Mutex::new(0usize));
    let stop_at = Instant::now() + Duration::from_secs(9);
    let mut tasks = Vec::new();
    for t in 0..8usize {
        let (locker, grants, errors) = (locker.clone(), grants.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let o = LockOptions::new()
                .ttl(Duration::from_millis(500))
                .wait(Duration::from_millis(300))
                .renew(false);
            let mut i = t;
            while Instant::now() < stop_at {
                let key = i % KEYS;
                i += 7;
                match locker.acquire(&format!("k{key}"), &o).await {
                    Ok(lease) => {
                        let from = Instant::now();
                        sleep(Duration::from_millis(3)).await;
                        let until = Instant::now();
                        let fence = lease.fence();
                        let _ = lease.release().await;
                        grants.lock().expect("grants").push(Grant {
                            key,
                            fence,
                            from,
                            until,
                        });
                    }
                    Err(e) if e.is_transient() => {
                        *errors.lock().expect("errors") += 1;
                        sleep(Duration::from_millis(20)).await;
                    }
                    // Slow replies during the failover: a grant that came back after its
                    // validity is refused (and released), as it must be.
                    Err(
                        leasehold::Error::WaitTimeout { .. } | leasehold::Error::LeaseLost { .. },
                    ) => {}
                    Err(e) => panic!("unexpected error: {e}"),
                }
            }
        }));
    }
    // Long-held renewing leases on keys of every shard, through the failover: renewals are
    // batched per node, so the batch for the dead master fails and falls back to slot-by-slot
    // renewal on a fresh slot map. Leases on the surviving masters must not be lost because one
    // node died; those on the failed shard may be, and are counted.
    let held_opts = LockOptions::new().ttl(Duration::from_secs(2));
    let mut held = Vec::new();
    for i in 0..30 {
        held.push(
            locker
                .try_acquire(&format!("held{i}"), &held_opts)
                .await
                .expect("a long-held lease"),
        );
    }
    let on_killed: Vec<bool> = held
        .iter()
        .map(|l| {
            let k = locker.lock_key(l.key()).expect("key");
            // Only the master serving a key answers for it; the others answer MOVED.
            redis::cmd("EXISTS")
                .arg(k.lock_key())
                .query::<i64>(&mut cluster.nodes[0].conn())
                .is_ok_and(|n| n == 1)
        })
        .collect();
    assert!(
        on_killed.iter().any(|b| *b) && on_killed.iter().any(|b| !*b),
        "the held leases span the killed master and the others"
    );
    sleep(Duration::from_secs(2)).await;
    // The first node is a master (`--cluster create` makes the first N nodes masters).
    let killed_at = Instant::now();
    cluster.nodes[0].kill();
    for t in tasks {
        t.await.expect("load task");
    }
    let grants = grants.lock().expect("grants").clone();
    let errors = *errors.lock().expect("errors");
    let mut per_second = [0usize; 12];
    for g in &grants {
        let s = (g
            .from
            .saturating_duration_since(killed_at - Duration::from_secs(2)))
        .as_secs() as usize;
        per_second[s.min(11)] += 1;
    }
    println!("grants per second (kill at 2): {per_second:?}, errors {errors}");

    // Every key kept being granted after the failover, the killed master's slots included.
    let mut recovered = [false; KEYS];
    for g in &grants {
        if g.from > killed_at + Duration::from_secs(5) {
            recovered[g.key] = true;
        }
    }
    assert!(
        recovered.iter().all(|r| *r),
        "keys never granted again after the failover: {:?}",
        recovered
            .iter()
            .enumerate()
            .filter(|(_, r)| !**r)
            .map(|(k, _)| k)
            .collect::<Vec<_>>()
    );

    // Per key: a grant that began after another ended carries a higher fence; overlapping
    // grants are double grants, counted and shown.
    let mut doubles = 0;
    for key in 0..KEYS {
        let mut on_key: Vec<&Grant> = grants.iter().filter(|g| g.key == key).collect();
        on_key.sort_by_key(|g| g.from);
        for (i, a) in on_key.iter().enumerate() {
            for b in &on_key[i + 1..] {
                if b.from > a.until {
                    assert!(
                        b.fence > a.fence,
                        "key {key}: fence {} granted after {} ended, yet not higher",
                        b.fence,
                        a.fence
                    );
                } else {
                    doubles += 1;
                }
            }
        }
    }
    let lost_elsewhere: Vec<&str> = held
        .iter()
        .zip(&on_killed)
        .filter(|(l, killed)| !**killed && l.is_lost())
        .map(|(l, _)| l.key())
        .collect();
    assert!(
        lost_elsewhere.is_empty(),
        "leases on surviving masters were lost: {lost_elsewhere:?}"
    );
    let lost_on_failed = held
        .iter()
        .zip(&on_killed)
        .filter(|(l, killed)| **killed && l.is_lost())
        .count();
    println!(
        "{flavor:?} cluster, master killed under load: {} grants, {} transient errors, {} double grants, {} of {} renewing leases on the failed shard lost",
        grants.len(),
        errors,
        doubles,
        lost_on_failed,
        on_killed.iter().filter(|b| **b).count()
    );
}

/// On a cluster, a waiter whose sharded subscription is cut is woken once the client
/// resubscribes, even though the release happened while it was not subscribed (a silent delete
/// here). Without that it would sleep until the holder's TTL.
async fn waiter_woken_after_resubscribe(flavor: Flavor) {
    let cluster = Cluster::start(flavor, 3, 0);
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let holder_side = Locker::redis_cluster(&urls).await.expect("connect");
    let waiter_side = Locker::redis_cluster(&urls).await.expect("connect");
    let ttl = LockOptions::new().ttl(Duration::from_secs(20));
    let held = holder_side.try_acquire("gap", &ttl).await.expect("holder");
    let waiter = tokio::spawn(async move {
        let started = Instant::now();
        let lease = waiter_side
            .acquire(
                "gap",
                &LockOptions::new()
                    .ttl(Duration::from_secs(1))
                    .wait(Duration::from_secs(15)),
            )
            .await;
        (lease.map(|l| l.fence()), started.elapsed())
    });
    let k = holder_side.lock_key("gap").expect("key");
    let channel = k.channel();
    let started = Instant::now();
    while cluster
        .cmd::<Vec<(String, i64)>>(&["PUBSUB", "SHARDNUMSUB", channel])
        .first()
        .is_none_or(|(_, n)| *n == 0)
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never subscribed"
        );
        sleep(Duration::from_millis(10)).await;
    }
    let _: i64 = cluster.cmd(&["DEL", k.lock_key()]);
    // Every client connection of every node: the client reconnects and resubscribes.
    for node in &cluster.nodes {
        let _: i64 = node.cmd(&["CLIENT", "KILL", "TYPE", "normal"]);
    }
    let (fence, waited) = waiter.await.expect("waiter task");
    assert!(fence.expect("the waiter got the key") > held.fence());
    assert!(
        waited < Duration::from_secs(5),
        "woken by its timer, not by the resubscription: {waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_waiter_woken_after_resubscribe() {
    waiter_woken_after_resubscribe(Flavor::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_waiter_woken_after_resubscribe() {
    waiter_woken_after_resubscribe(Flavor::Valkey).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_master_killed_under_load() {
    master_killed_under_load(Flavor::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_master_killed_under_load() {
    master_killed_under_load(Flavor::Valkey).await
}

/// The README's ACL section says the plain `leasehold` rule cannot even connect to a cluster
/// (the client reads the slot map with `CLUSTER SLOTS`, which that rule does not allow), so
/// that `leasehold-cluster` is needed there; this keeps that sentence true.
#[tokio::test]
async fn the_plain_acl_rule_cannot_connect_to_a_cluster() {
    let cluster = Cluster::start(Flavor::Redis, 3, 0);
    let urls = |user: &str| -> Vec<String> {
        cluster
            .nodes
            .iter()
            .map(|n| n.acl_user_url_for(user))
            .collect()
    };
    let plain = urls("leasehold");
    let plain: Vec<&str> = plain.iter().map(String::as_str).collect();
    let err = match Locker::redis_cluster(&plain).await {
        Err(e) => e,
        Ok(_) => panic!("the plain `leasehold` rule connected to a cluster"),
    };
    assert!(
        err.to_string().contains("cluster|slots"),
        "refused for another reason than the slot map: {err}"
    );
    let cluster_rule = urls("leasehold-cluster");
    let cluster_rule: Vec<&str> = cluster_rule.iter().map(String::as_str).collect();
    let locker = Locker::redis_cluster(&cluster_rule)
        .await
        .expect("the `leasehold-cluster` rule connects");
    let lease = locker
        .try_acquire("acl", &LockOptions::new())
        .await
        .expect("and takes a lease");
    lease.release().await.expect("and releases it");
}
