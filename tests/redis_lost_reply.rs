//! Scenario 10 with the reply cut off: the server runs the command, the connection dies before
//! the reply arrives; and scenario 4, replies slowed to most of the TTL. A small TCP proxy of our own sits between the locker and a real server and
//! drops chosen replies (closing the connection), so the command has certainly run.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use leasehold::{Error, LockOptions, Locker};
use support::proxy::Proxy;
use support::{Flavor, Server};
use tokio::time::{Instant, sleep};

fn opts() -> LockOptions {
    LockOptions::new().ttl(Duration::from_secs(10)).renew(false)
}

/// A grant reply: `{1, fence}` as RESP.
const GRANT: &[u8] = b"*2\r\n:1\r\n";

/// The grant's reply is lost once: the locker asks again with the same token, the script
/// recognises it, and the caller gets the one grant that happened, with its fence.
async fn lost_grant_reply_is_resolved(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    // Scripts loaded and connections open before the fault.
    locker
        .try_acquire("warm", &opts())
        .await
        .expect("warm")
        .release()
        .await
        .expect("release");
    proxy.drop_replies(GRANT, 1);
    let lease = locker
        .try_acquire("lost-reply", &opts())
        .await
        .expect("the retry resolves the outcome");
    assert_eq!(
        proxy.dropped.load(Ordering::SeqCst),
        1,
        "the reply was lost"
    );
    let k = locker.lock_key("lost-reply").expect("key");
    let holder: String = server.cmd(&["GET", k.lock_key()]);
    assert_eq!(holder, lease.token().as_str(), "the lock holds our token");
    let stored: String = server.cmd(&["GET", k.fence_key()]);
    assert_eq!(
        stored.parse::<u64>().expect("fence"),
        lease.fence().get(),
        "one grant, one fence: the retry did not advance it again"
    );
    lease.release().await.expect("release");
}

/// Both the grant's reply and the retry's are lost: the caller gets `OutcomeUnknown`, and the
/// grant that may exist is released in the background, so the key is not left held.
async fn unresolved_grant_is_released(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    locker
        .try_acquire("warm", &opts())
        .await
        .expect("warm")
        .release()
        .await
        .expect("release");
    proxy.drop_replies(GRANT, 2);
    match locker.try_acquire("twice-lost", &opts()).await {
        Err(Error::OutcomeUnknown { op, .. }) => assert_eq!(op, "acquire"),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    assert_eq!(proxy.dropped.load(Ordering::SeqCst), 2);
    let k = locker.lock_key("twice-lost").expect("key");
    let started = Instant::now();
    while server.cmd::<i64>(&["EXISTS", k.lock_key()]) == 1 {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the granted lock was left held for its whole TTL"
        );
        sleep(Duration::from_millis(20)).await;
    }
    // And the key is free for the next caller.
    locker
        .try_acquire("twice-lost", &opts())
        .await
        .expect("free")
        .release()
        .await
        .expect("release");
}

/// The release's reply is lost: the repeated release finds the key gone, and since the first
/// may or may not have been the one that deleted it, the caller is told `OutcomeUnknown`; the
/// key is not left held either way.
async fn lost_release_reply(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    let lease = locker.try_acquire("rel", &opts()).await.expect("lease");
    proxy.drop_replies(b":1\r\n", 1);
    match lease.release().await {
        Err(Error::OutcomeUnknown { op, .. }) => assert_eq!(op, "release"),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    assert_eq!(proxy.dropped.load(Ordering::SeqCst), 1);
    let k = locker.lock_key("rel").expect("key");
    assert_eq!(server.cmd::<i64>(&["EXISTS", k.lock_key()]), 0);
}

/// Scenario 4: replies slowed to a large part of the TTL. A lease handed out still has validity
/// left, never more than the server's own TTL; a grant whose reply came after its validity is
/// refused and released.
async fn slow_replies_never_give_expired_leases(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    let ttl = Duration::from_millis(400);
    let o = LockOptions::new().ttl(ttl).renew(false);
    locker
        .try_acquire("warm", &o)
        .await
        .expect("warm")
        .release()
        .await
        .expect("release");
    let (mut handed_out, mut refused) = (0, 0);
    for (i, factor) in [0.5, 0.9, 1.05, 1.3].into_iter().enumerate() {
        proxy.delay_replies(ttl.mul_f64(factor));
        let key = format!("slow:{i}");
        let k = locker.lock_key(&key).expect("key");
        let asked = Instant::now();
        let result = locker.try_acquire(&key, &o).await;
        let took = asked.elapsed();
        match result {
            Ok(lease) => {
                // Read the server's TTL first: our estimate, taken after, must not exceed it.
                let pttl: i64 = server.cmd(&["PTTL", k.lock_key()]);
                let remaining = lease.remaining();
                assert!(
                    remaining > Duration::ZERO,
                    "delay {factor}: handed out expired"
                );
                assert!(
                    remaining <= Duration::from_millis(pttl.max(0) as u64 + 1),
                    "delay {factor}: validity {remaining:?} overstates the server's {pttl} ms"
                );
                handed_out += 1;
                drop(lease);
            }
            Err(Error::LeaseLost { .. }) => {
                // Refused only when the reply really came after the validity (ttl less the
                // 1% + 2 ms drift allowance).
                assert!(
                    took >= ttl - ttl / 100 - Duration::from_millis(2),
                    "delay {factor}: a grant that arrived in {took:?} was refused"
                );
                refused += 1;
                // The refused grant does not linger: released (or, at worst, expired) at once.
                let started = Instant::now();
                while server.cmd::<i64>(&["EXISTS", k.lock_key()]) == 1 {
                    assert!(
                        started.elapsed() < ttl,
                        "delay {factor}: the refused grant was left held"
                    );
                    sleep(Duration::from_millis(10)).await;
                }
            }
            Err(e) => panic!("delay {factor}: unexpected {e}"),
        }
    }
    proxy.delay_replies(Duration::ZERO);
    assert!(
        handed_out >= 1 && refused >= 1,
        "both paths ran: {handed_out} {refused}"
    );
}

macro_rules! lost_replies {
    ($modname:ident, $flavor:expr) => {
        mod $modname {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lost_grant_reply_is_resolved() {
                super::lost_grant_reply_is_resolved($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn unresolved_grant_is_released() {
                super::unresolved_grant_is_released($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn slow_replies_never_give_expired_leases() {
                super::slow_replies_never_give_expired_leases($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lost_release_reply() {
                super::lost_release_reply($flavor).await
            }
        }
    };
}

lost_replies!(on_redis, Flavor::Redis);
lost_replies!(on_valkey, Flavor::Valkey);
