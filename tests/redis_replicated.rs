//! Acquires that wait for replicas (`LockOptions::replicas`), on a real master and replica.

mod support;

use std::time::Duration;

use leasehold::{Backend, Error, LockOptions, Locker, RedisBackend, Token};
use support::{Cluster, Flavor, Server};
use tokio::time::Instant;

fn replicated(timeout_ms: u64) -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_secs(10))
        .replicas(1)
        .replica_timeout(Duration::from_millis(timeout_ms))
}

/// A replicated grant is on the replica by the time it is handed out.
async fn grant_reaches_the_replica(flavor: Flavor) {
    let master = Server::start(flavor);
    let replica = Server::start_replica_of(&master);
    let locker = Locker::redis(&master.url()).await.expect("connect");
    let lease = locker
        .try_acquire("repl", &replicated(2_000))
        .await
        .expect("replicated grant");
    let k = locker.lock_key("repl").expect("key");
    let on_replica: String = replica.cmd(&["GET", k.lock_key()]);
    assert_eq!(on_replica, lease.token().as_str());
    let fence: String = replica.cmd(&["GET", k.fence_key()]);
    assert_eq!(fence.parse::<u64>().expect("fence"), lease.fence().get());
    lease.release().await.expect("release");
    // A replicated acquire keeps the fence for ever, `keep_fence` or not (documented on
    // `LockOptions::keep_fence`); a plain one with it sets the keep as the fence key's expiry.
    let brief = Duration::from_millis(60_000);
    let kept = locker
        .try_acquire("repl", &replicated(2_000).keep_fence(brief))
        .await
        .expect("replicated grant");
    assert_eq!(master.cmd::<i64>(&["PTTL", k.fence_key()]), -1);
    kept.release().await.expect("release");
    let plain = LockOptions::new().renew(false).keep_fence(brief);
    let forgets = locker.try_acquire("repl", &plain).await.expect("grant");
    let pttl: i64 = master.cmd(&["PTTL", k.fence_key()]);
    assert!((50_000..=60_000).contains(&pttl), "PTTL {pttl}");
    forgets.release().await.expect("release");
}

/// Without the replica, the grant is refused and released, and the shared connection is not
/// stalled by the blocked `WAIT`.
async fn missing_replica_refuses_without_stalling(flavor: Flavor) {
    let master = Server::start(flavor);
    let mut replica = Server::start_replica_of(&master);
    let locker = Locker::redis(&master.url()).await.expect("connect");
    replica.kill();
    let waiting = {
        let locker = locker.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let r = locker.try_acquire("repl", &replicated(1_500)).await;
            (r.map(|l| l.fence()), started.elapsed())
        })
    };
    // Until the `WAIT` blocks on the server (not a guess at how long that takes, which a
    // loaded machine could make the check below pass without a blocked `WAIT` to stall behind).
    let blocking = Instant::now();
    while !master
        .cmd::<String>(&["INFO", "clients"])
        .contains("blocked_clients:1")
    {
        assert!(
            blocking.elapsed() < Duration::from_secs(1),
            "WAIT never blocked"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t = Instant::now();
    let other = locker
        .try_acquire("other", &LockOptions::new())
        .await
        .expect("plain acquire while WAIT blocks");
    assert!(
        t.elapsed() < Duration::from_millis(700),
        "the shared connection stalled for {:?}",
        t.elapsed()
    );
    other.release().await.expect("release");
    let (result, took) = waiting.await.expect("task");
    match result {
        Err(e @ Error::NotReplicated { acked, wanted, .. }) => {
            assert_eq!((acked, wanted), (0, 1));
            // The replicas' condition, not the lock's state: worth a retry later.
            assert!(e.is_transient(), "{e}");
        }
        other => panic!("expected NotReplicated, got {other:?}"),
    }
    assert!(
        took >= Duration::from_millis(1_400),
        "WAIT returned after {took:?}"
    );
    let k = locker.lock_key("repl").expect("key");
    assert_eq!(
        master.cmd::<i64>(&["EXISTS", k.lock_key()]),
        0,
        "the refused grant was released"
    );
}

/// A `WAIT` the server refuses (an ACL user without it) fails the acquire with the server's
/// refusal, and the grant made before it is given back, not left taken until its TTL.
async fn refused_wait_gives_the_grant_back(flavor: Flavor) {
    let master = Server::start(flavor);
    let url = master.acl_user_url();
    let _: () = master.cmd(&["ACL", "SETUSER", "leasehold", "-wait"]);
    let locker = Locker::redis(&url).await.expect("connect");
    match locker.try_acquire("repl", &replicated(500)).await {
        Err(Error::Refused { op, .. }) => assert_eq!(op, "wait"),
        other => panic!("expected the WAIT refused, got {other:?}"),
    }
    let k = locker.lock_key("repl").expect("key");
    assert_eq!(
        master.cmd::<i64>(&["EXISTS", k.lock_key()]),
        0,
        "the grant was left behind"
    );
}

/// A replica timeout below 1 ms (`WAIT n 0` blocks for good) or above `MAX_TTL` is refused
/// before any round trip; without replicas it is not used, so not checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_timeout_out_of_range() {
    let locker = Locker::memory();
    for bad in [Duration::ZERO, Duration::from_micros(999), Duration::MAX] {
        let opts = LockOptions::new().replicas(1).replica_timeout(bad);
        match locker.try_acquire("k", &opts).await {
            Err(Error::InvalidDuration { what, value, .. }) => {
                assert_eq!((what, value), ("replica timeout", bad));
            }
            other => panic!("{bad:?}: expected InvalidDuration, got {other:?}"),
        }
    }
    let opts = LockOptions::new().replica_timeout(Duration::ZERO);
    let lease = locker
        .try_acquire("k", &opts)
        .await
        .expect("no replicas asked");
    lease.release().await.expect("release");
    // The backend's own trait method is public too, and checks the same before sending
    // anything (a `WAIT 1 0` would block its connection on the server).
    let server = Server::start(Flavor::Redis);
    let backend = RedisBackend::connect(&server.url()).await.expect("connect");
    let key = Locker::memory().lock_key("k").expect("key");
    for bad in [Duration::ZERO, Duration::from_micros(999), Duration::MAX] {
        let token = Token::generate();
        let r = backend
            .acquire_replicated(&key, &token, Duration::from_secs(10), 1, bad)
            .await;
        assert!(
            matches!(
                r,
                Err(Error::InvalidDuration {
                    what: "replica timeout",
                    ..
                })
            ),
            "{bad:?}: {r:?}"
        );
    }
    let exists: i64 = server.cmd(&["EXISTS", key.lock_key()]);
    assert_eq!(exists, 0, "a refused acquire wrote the key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_refuses_replicas() {
    let locker = Locker::memory();
    match locker.try_acquire("k", &replicated(100)).await {
        Err(Error::Unsupported { backend, .. }) => assert_eq!(backend, "in-memory"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

/// A cluster and a Redlock quorum refuse `replicas(n)` before sending anything, rather than
/// handing out grants the caller believes replicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_and_quorum_refuse_replicas() {
    let cluster = Cluster::start(Flavor::Redis, 3, 0);
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let locker = Locker::redis_cluster(&urls).await.expect("connect");
    match locker.try_acquire("k", &replicated(100)).await {
        Err(Error::Unsupported { backend, .. }) => assert_eq!(backend, "cluster"),
        other => panic!("cluster: expected Unsupported, got {other:?}"),
    }
    let k = locker.lock_key("k").expect("key");
    assert_eq!(
        cluster.cmd::<i64>(&["EXISTS", k.lock_key()]),
        0,
        "cluster: key written"
    );

    let members: Vec<Server> = (0..3).map(|_| Server::start(Flavor::Redis)).collect();
    let urls: Vec<String> = members.iter().map(Server::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let locker = Locker::redlock(&urls).await.expect("connect");
    match locker.try_acquire("k", &replicated(100)).await {
        Err(Error::Unsupported { backend, .. }) => assert_eq!(backend, "quorum"),
        other => panic!("quorum: expected Unsupported, got {other:?}"),
    }
    for m in &members {
        assert_eq!(
            m.cmd::<i64>(&["EXISTS", k.lock_key()]),
            0,
            "quorum: key written"
        );
    }
}

/// The connections kept aside for acquires that wait for replicas outlive a `CLIENT KILL`
/// (as a restart or failover would close them): the next replicated acquire is answered as
/// the first was, on a connection made again, not failed on the dead one it took from the pool.
async fn pooled_connections_are_made_again(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let not_replicated = |r: &Result<leasehold::Lease, Error>| {
        matches!(
            r,
            Err(Error::NotReplicated {
                acked: 0,
                wanted: 1,
                ..
            })
        )
    };
    // No replica: refused, and the connection goes back to the pool.
    let first = locker.try_acquire("pooled", &replicated(50)).await;
    assert!(not_replicated(&first), "{:?}", first.map(|l| l.fence()));
    let _: i64 = server.cmd(&["CLIENT", "KILL", "TYPE", "normal"]);
    // The shared connection is made again at its first failed request (the refused grant is
    // given back on it): a plain acquire until it works.
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        match locker.try_acquire("plain", &LockOptions::new()).await {
            Ok(lease) => {
                lease.release().await.expect("release");
                break;
            }
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("the shared connection did not come back: {e}"),
        }
    }
    for attempt in 0..3 {
        let again = locker.try_acquire("pooled", &replicated(50)).await;
        assert!(
            not_replicated(&again),
            "attempt {attempt} after the kill: {:?}",
            again.map(|l| l.fence())
        );
    }
}

/// A path gone silent after the pool filled costs a replicated acquire one `PING` of the
/// connection timeout (and a connect attempt), not one `PING` per pooled connection: eight
/// connections, 400 ms each, were 3.6 s before it failed; now under a second.
async fn a_silent_pool_costs_one_ping(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = support::proxy::Proxy::start(server.port).await;
    let config = leasehold::RedisConfig::default()
        .connection_timeout(Duration::from_millis(400))
        .response_timeout(Duration::from_millis(400));
    let locker = Locker::redis_with(&proxy.url(), config)
        .await
        .expect("connect");
    // Eight acquires at once take eight dedicated connections (each `WAIT`s 500 ms, long
    // enough that they overlap on a loaded machine); without a replica each is refused, and its
    // connection goes back to the pool.
    let fill: Vec<_> = (0..8)
        .map(|i| {
            let locker = locker.clone();
            tokio::spawn(async move {
                locker
                    .try_acquire(&format!("pool-{i}"), &replicated(500))
                    .await
                    .map(|l| l.fence())
            })
        })
        .collect();
    for f in fill {
        let r = f.await.expect("task");
        assert!(matches!(r, Err(Error::NotReplicated { .. })), "{r:?}");
    }
    assert!(
        proxy.connections() >= 8,
        "{} connections",
        proxy.connections()
    );
    proxy.stall(true);
    let started = Instant::now();
    let r = locker.try_acquire("silent", &replicated(50)).await;
    let took = started.elapsed();
    proxy.stall(false);
    assert!(
        matches!(r, Err(ref e) if e.is_transient()),
        "{:?}",
        r.map(|l| l.fence())
    );
    assert!(
        took < Duration::from_millis(2_000),
        "{took:?}: the pooled connections were pinged one by one"
    );
}

/// A replicated acquire whose grant reply comes back garbled (a shape the script never gives:
/// it ran all the same) fails, and its grant is given back at once on its own connection, not
/// left holding the key until its TTL (10 s).
async fn a_garbled_grant_reply_is_given_back(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = support::proxy::Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    // The acquire script loaded first, so that the armed fault meets its reply.
    let warm = locker
        .try_acquire("warm", &LockOptions::new())
        .await
        .expect("warm");
    warm.release().await.expect("release");
    // `{1, fence}` with a status the script never gives; same length.
    proxy.replace_replies(b"*2\r\n:1\r\n", b"*2\r\n:9\r\n", 1);
    let r = locker.try_acquire("repl", &replicated(500)).await;
    assert!(
        matches!(r, Err(Error::Unavailable(_))),
        "{:?}",
        r.map(|l| l.fence())
    );
    assert_eq!(
        proxy.dropped.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the reply was replaced"
    );
    let k = locker.lock_key("repl").expect("key");
    let given_back = Instant::now();
    while server.cmd::<i64>(&["EXISTS", k.lock_key()]) == 1 {
        assert!(
            given_back.elapsed() < Duration::from_secs(3),
            "the grant was left holding the key"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

macro_rules! replicated_suite {
    ($modname:ident, $flavor:expr) => {
        mod $modname {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn grant_reaches_the_replica() {
                super::grant_reaches_the_replica($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn missing_replica_refuses_without_stalling() {
                super::missing_replica_refuses_without_stalling($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn pooled_connections_are_made_again() {
                super::pooled_connections_are_made_again($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_garbled_grant_reply_is_given_back() {
                super::a_garbled_grant_reply_is_given_back($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_silent_pool_costs_one_ping() {
                super::a_silent_pool_costs_one_ping($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn refused_wait_gives_the_grant_back() {
                super::refused_wait_gives_the_grant_back($flavor).await
            }
        }
    };
}

replicated_suite!(on_redis, Flavor::Redis);
replicated_suite!(on_valkey, Flavor::Valkey);
