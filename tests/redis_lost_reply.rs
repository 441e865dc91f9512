//! Scenario 10 with the reply cut off: the server runs the command, the connection dies before
//! the reply arrives; and scenario 4, replies slowed to most of the TTL. A small TCP proxy of our own sits between the locker and a real server and
//! drops chosen replies (closing the connection), so the command has certainly run.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use leasehold::{Error, Lease, LockOptions, Locker, RedisConfig, Release};
use support::proxy::Proxy;
use support::{Flavor, Server};
use tokio::time::{Instant, sleep};

fn opts() -> LockOptions {
    LockOptions::new().ttl(Duration::from_secs(10)).renew(false)
}

/// A one-item acquire call's reply granting it: `{1, fence}` as RESP.
const GRANT: &[u8] = b"*2\r\n:1\r\n";

/// A one-item release call's reply: `{1}`, released.
const RELEASED: &[u8] = b"*1\r\n:1\r\n";

/// A server, a proxy in front of it, and a locker through the proxy whose acquire, extend and
/// release scripts are loaded, so that a fault armed next meets no `NOSCRIPT` round trip.
async fn through_proxy(flavor: Flavor) -> (Server, Proxy, Locker) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    let warm = locker.try_acquire("warm", &opts()).await.expect("warm");
    warm.extend(Duration::from_secs(10)).await.expect("extend");
    warm.release().await.expect("release");
    (server, proxy, locker)
}

/// How a grant's reply goes wrong on its way back, once.
#[derive(Clone, Copy, Debug)]
enum Reply {
    /// The proxy closes the connection instead of passing it on.
    Lost,
    /// It arrives in a shape the script never gives (a faulty proxy, another version of the
    /// script): the script ran all the same.
    Garbled,
}

/// The grant's reply is lost, or comes back garbled, once: the locker asks again with the same
/// token, the script recognises it, and the caller gets the one grant that happened, with its
/// fence (not an error while the grant holds the key with nobody to release it).
async fn a_grant_reply_gone_wrong_is_resolved(flavor: Flavor, reply: Reply) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    match reply {
        Reply::Lost => proxy.drop_replies(GRANT, 1),
        // Status 9: none the script gives. Same length, so the stream stays in step.
        Reply::Garbled => proxy.replace_replies(GRANT, b"*2\r\n:9\r\n", 1),
    }
    let lease = locker
        .try_acquire("lost-reply", &opts())
        .await
        .expect("the retry resolves the outcome");
    assert_eq!(
        proxy.dropped.load(Ordering::SeqCst),
        1,
        "the reply was {reply:?}"
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
    assert_eq!(lease.release().await.expect("release"), Release::Released);
}

/// The grant's reply is lost, and its fence key goes before the retry (evicted under an
/// `allkeys-*` policy, deleted by an operator): the retry still hands out a real fence, from
/// the clock, never 0, and stores it.
async fn a_retry_after_the_fence_key_went_gets_a_fence(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let k = locker.lock_key("fence-gone").expect("key");
    // A slow link: the retry reaches the server well after the first grant, so the fence key
    // is deleted in between.
    proxy.set_latency(Duration::from_millis(300));
    proxy.drop_replies(GRANT, 1);
    let acquiring = tokio::spawn({
        let locker = locker.clone();
        async move { locker.try_acquire("fence-gone", &opts()).await }
    });
    granted_within(&server, k.lock_key(), Duration::from_secs(2)).await;
    let deleted: i64 = server.cmd(&["DEL", k.fence_key()]);
    assert_eq!(deleted, 1, "the retry came first");
    let lease = acquiring
        .await
        .expect("task")
        .expect("the retry resolves the outcome");
    assert_eq!(
        proxy.dropped.load(Ordering::SeqCst),
        1,
        "the reply was lost"
    );
    assert!(lease.fence().get() > 0, "fence {}", lease.fence());
    let stored: String = server.cmd(&["GET", k.fence_key()]);
    assert_eq!(stored.parse::<u64>().expect("fence"), lease.fence().get());
    proxy.set_latency(Duration::ZERO);
    lease.release().await.expect("release");
}

/// The retry of a grant whose reply was lost hands back the fence of that grant, read from the
/// server before the retry arrives, and advances nothing: with the fence from the clock, and
/// with a stored fence ahead of the clock (the grant took it plus one). The check that only
/// compared the returned fence with the stored one could not tell, since the script stores what
/// it returns.
async fn a_retry_hands_back_the_first_grants_fence(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    // A slow link: the retry reaches the server well after the first grant.
    proxy.set_latency(Duration::from_millis(300));
    let ahead = u64::MAX / 2;
    for (key, stored) in [("retry-clock", None), ("retry-ahead", Some(ahead))] {
        let k = locker.lock_key(key).expect("key");
        if let Some(f) = stored {
            let _: () = server.cmd(&["SET", k.fence_key(), &f.to_string()]);
        }
        proxy.drop_replies(GRANT, 1);
        let dropped = proxy.dropped.load(Ordering::SeqCst);
        let acquiring = tokio::spawn({
            let locker = locker.clone();
            async move { locker.try_acquire(key, &opts()).await }
        });
        granted_within(&server, k.lock_key(), Duration::from_secs(2)).await;
        let first: String = server.cmd(&["GET", k.fence_key()]);
        let first: u64 = first.parse().expect("fence");
        if let Some(f) = stored {
            assert_eq!(first, f + 1, "a fence ahead of the clock rises by one");
        }
        let lease = acquiring
            .await
            .expect("task")
            .expect("the retry resolves the outcome");
        assert_eq!(
            proxy.dropped.load(Ordering::SeqCst),
            dropped + 1,
            "no reply lost"
        );
        assert_eq!(
            lease.fence().get(),
            first,
            "{key}: not the first grant's fence"
        );
        let stored_after: String = server.cmd(&["GET", k.fence_key()]);
        assert_eq!(stored_after.parse::<u64>().expect("fence"), first, "{key}");
        lease.release().await.expect("release");
    }
    proxy.set_latency(Duration::ZERO);
}

/// Both the grant's reply and the retry's are lost: the caller gets `OutcomeUnknown`, and the
/// grant that may exist is released in the background, so the key is not left held.
async fn unresolved_grant_is_released(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
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

/// An acquire whose caller left while it travelled (a timeout around it): the grant that may
/// exist is released in the background at once, on the same connection, and when the grant's
/// reply is lost (the connection closed) that release's reply goes with it. The release is
/// sent again, as a dropped guard's is. Its first delete ran here, so the key is gone either
/// way: the count of script calls tells whether it was sent again.
async fn an_abandoned_grants_release_gone_wrong_is_sent_again(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let before = server.script_calls();
    proxy.delay_replies(Duration::from_millis(300));
    proxy.drop_replies(GRANT, 1);
    let left = tokio::time::timeout(
        Duration::from_millis(100),
        locker.try_acquire("abandoned", &opts()),
    )
    .await;
    assert!(left.is_err(), "the acquire answered: {left:?}");
    let give_up = Instant::now() + Duration::from_secs(5);
    while server.script_calls() < before + 3 && Instant::now() < give_up {
        sleep(Duration::from_millis(20)).await;
    }
    // Time for a fourth call, had there been one.
    sleep(Duration::from_millis(700)).await;
    assert_eq!(proxy.dropped.load(Ordering::SeqCst), 1, "the grant's reply");
    assert_eq!(
        server.script_calls() - before,
        3,
        "the acquire, its release, and that release once more"
    );
    let k = locker.lock_key("abandoned").expect("key");
    assert_eq!(server.cmd::<i64>(&["EXISTS", k.lock_key()]), 0);
}

/// The release's reply is lost: the repeated release finds the key gone, and since the first
/// may or may not have been the one that deleted it, the caller is told `OutcomeUnknown`; the
/// key is not left held either way.
async fn lost_release_reply(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    let lease = locker.try_acquire("rel", &opts()).await.expect("lease");
    let info = lease.info();
    proxy.drop_replies(RELEASED, 1);
    match lease.release().await {
        Err(Error::OutcomeUnknown { op, .. }) => assert_eq!(op, "release"),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    assert_eq!(proxy.dropped.load(Ordering::SeqCst), 1);
    // A release that failed still ends the lease for every view of it: renewal stopped, and
    // the key may be gone (here it is), so work watching `lost()` must stop now, not at the
    // lease's deadline.
    assert!(
        info.is_lost(),
        "a view still sees the lease held after its release failed"
    );
    tokio::time::timeout(Duration::from_millis(100), info.lost())
        .await
        .expect("lost() did not resolve after the release failed");
    let k = locker.lock_key("rel").expect("key");
    assert_eq!(server.cmd::<i64>(&["EXISTS", k.lock_key()]), 0);
}

/// A release answered with a number its script never gives: its delete ran, so the reply is
/// no verdict, neither "released" nor "not held" (which would tell a holder whose release ran
/// that it had lost the lease). The release is sent again, finds nothing, and answers
/// `OutcomeUnknown`; the key is gone.
async fn a_garbled_release_reply_is_no_verdict(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let lease = locker
        .try_acquire("garbled-rel", &opts())
        .await
        .expect("lease");
    proxy.replace_replies(RELEASED, b"*1\r\n:7\r\n", 1);
    match lease.release().await {
        Err(Error::OutcomeUnknown { op, .. }) => assert_eq!(op, "release"),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    assert_eq!(
        proxy.dropped.load(Ordering::SeqCst),
        1,
        "the reply was replaced"
    );
    let k = locker.lock_key("garbled-rel").expect("key");
    assert_eq!(server.cmd::<i64>(&["EXISTS", k.lock_key()]), 0);
}

/// A dropped guard's background release whose reply is lost or unreadable is sent again, as
/// `Lease::release` sends its own: the first may never have reached the server (a connection
/// dropped before it went out), and nobody else would free the key before its TTL. Both drop
/// paths: a renewing lease's (the renewal driver releases it) and a plain one's (a task of its
/// own). The first delete ran here, so the key is gone either way: the count of release calls
/// tells whether it was sent again.
async fn a_dropped_lease_release_gone_wrong_is_sent_again(
    flavor: Flavor,
    reply: Reply,
    renew: bool,
) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let lease = locker
        .try_acquire("dropped-rel", &opts().renew(renew))
        .await
        .expect("lease");
    let before = server.script_calls();
    match reply {
        Reply::Lost => proxy.drop_replies(RELEASED, 1),
        Reply::Garbled => proxy.replace_replies(RELEASED, b"*1\r\n:7\r\n", 1),
    }
    drop(lease);
    let give_up = Instant::now() + Duration::from_secs(5);
    while server.script_calls() < before + 2 && Instant::now() < give_up {
        sleep(Duration::from_millis(20)).await;
    }
    // Time for a third call, had there been one.
    sleep(Duration::from_millis(100)).await;
    assert_eq!(
        proxy.dropped.load(Ordering::SeqCst),
        1,
        "the reply was {reply:?}"
    );
    assert_eq!(
        server.script_calls() - before,
        2,
        "the release was not sent again once"
    );
    let k = locker.lock_key("dropped-rel").expect("key");
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
                // The validity as handed out (read at once: at 0.9 of the TTL it has about
                // 20 ms left), then the server's TTL: the local deadline must not pass the
                // server's expiry, which is at most the PTTL after its reply came.
                let remaining = lease.remaining();
                let deadline = Instant::now() + remaining;
                assert!(
                    remaining > Duration::ZERO,
                    "delay {factor}: handed out expired"
                );
                let pttl: i64 = server.cmd(&["PTTL", k.lock_key()]);
                let expiry = Instant::now() + Duration::from_millis(pttl.max(0) as u64 + 1);
                assert!(
                    deadline <= expiry,
                    "delay {factor}: validity {remaining:?} overstates the server's {pttl} ms"
                );
                handed_out += 1;
                drop(lease);
            }
            Err(Error::LeaseLost { .. }) => {
                // Refused only when the reply came after the lease's alarm: the validity (ttl
                // less the 1% + 2 ms drift allowance) less the 2.5% + 3 ms by which a lease
                // counts as lost before its deadline (381 ms of 400).
                let alarm = ttl
                    - (ttl / 100 + Duration::from_millis(2))
                    - (ttl / 40 + Duration::from_millis(3));
                assert!(
                    took >= alarm,
                    "delay {factor}: a grant that arrived in {took:?} was refused (alarm {alarm:?})"
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

/// A waiting acquire whose grant comes back after its validity gives that grant back and goes
/// on waiting, as it would after a busy answer: it is handed a later grant, with a token of its
/// own, well within its wait.
async fn a_late_grant_does_not_end_the_wait(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let ttl = Duration::from_millis(200);
    let o = LockOptions::new()
        .ttl(ttl)
        .renew(false)
        .wait(Duration::from_secs(5));
    let key = "late-wait";
    let k = locker.lock_key(key).expect("key");
    // Taken when the proxy reads a reply: the first grant's reply is held back 260 ms, past
    // the lease's validity, whatever is set afterwards.
    proxy.delay_replies(ttl.mul_f64(1.3));
    let waiter = {
        let (locker, o) = (locker.clone(), o.clone());
        tokio::spawn(async move { locker.acquire(key, &o).await })
    };
    let give_up = Instant::now() + Duration::from_secs(2);
    while proxy.delayed.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < give_up,
            "the grant's reply never came back"
        );
        sleep(Duration::from_millis(2)).await;
    }
    proxy.delay_replies(Duration::ZERO);
    let late_token: String = server
        .cmd::<Option<String>>(&["GET", k.lock_key()])
        .expect("the first grant holds the key while its reply is held back");
    let late_fence = fence_of(&server, &locker, key);
    let lease = waiter
        .await
        .expect("task")
        .expect("a grant that came late ended the wait");
    assert_ne!(
        lease.token().as_str(),
        late_token,
        "the grant that came after its validity was handed out"
    );
    assert!(
        lease.fence().get() > late_fence,
        "the lease handed out is not a later grant: fence {:?}, the late one {late_fence}",
        lease.fence()
    );
    assert!(lease.remaining() > Duration::ZERO, "handed out expired");
    let holder: String = server.cmd(&["GET", k.lock_key()]);
    assert_eq!(
        holder,
        lease.token().as_str(),
        "the lock holds the lease's token"
    );
    assert_eq!(lease.release().await.expect("release"), Release::Released);
}

/// A link whose round trip is a third of the TTL: renewal still keeps the lease. The first
/// renewal is due a third of the TTL after the grant was *asked for*, which is when its validity
/// starts; due a third after the grant's slow reply arrived, it would be sent so late that its
/// own reply came after the deadline.
async fn renewal_keeps_a_lease_over_a_slow_link(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    // Scaled so that each renewal's reply has about 350 ms to spare (at 300 ms and a 100 ms
    // round trip it had 85 ms, a dozen times in a row); timed from the grant's arrival instead,
    // the first renewal's reply would still come after the deadline.
    let ttl = Duration::from_millis(1_200);
    let o = LockOptions::new().ttl(ttl);
    // Every script loaded before the slow link: a first EVALSHA answered NOSCRIPT costs two
    // more round trips.
    let warm = locker.try_acquire("warm", &o).await.expect("warm");
    warm.extend(ttl).await.expect("extend");
    warm.release().await.expect("release");
    // 200 ms each way: every round trip takes at least 400 ms, a third of the TTL.
    proxy.set_latency(Duration::from_millis(200));
    let lease = locker.try_acquire("far", &o).await.expect("grant");
    sleep(ttl * 4).await;
    assert!(
        !lease.is_lost(),
        "renewal over a 400 ms round trip lost a 1.2 s lease"
    );
    assert_eq!(lease.release().await.expect("release"), Release::Released);
}

/// The bound docs/RELIABILITY.md gives: a lease has one renewal in flight at a time, so it is
/// kept while a round trip stays under roughly half the TTL, and lost above that although the
/// server would have kept it. At 0.4 x TTL (800 ms at 2 s) it is kept for three TTLs; at
/// 0.6 x TTL (1.2 s) `lost()` fires within the TTL, with the key still held on the server.
async fn renewal_keeps_a_lease_below_half_the_ttl_not_above(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    let ttl = Duration::from_secs(2);
    let o = LockOptions::new().ttl(ttl);
    // Every script loaded before the slow link.
    let warm = locker.try_acquire("warm", &o).await.expect("warm");
    warm.extend(ttl).await.expect("extend");
    warm.release().await.expect("release");
    proxy.set_latency(ttl.mul_f64(0.2));
    let kept = locker.try_acquire("below-half", &o).await.expect("grant");
    sleep(ttl * 3).await;
    assert!(
        !kept.is_lost(),
        "renewal over an 800 ms round trip lost a 2 s lease"
    );
    proxy.set_latency(ttl.mul_f64(0.3));
    // Renewals of the lease above still in flight at the old latency are done by now.
    let lost = locker.try_acquire("above-half", &o).await.expect("grant");
    let told = tokio::time::timeout(ttl, lost.lost()).await;
    assert!(told.is_ok(), "a 1.2 s round trip kept a 2 s lease");
    let key = locker.lock_key("above-half").expect("key");
    assert_eq!(
        server.cmd::<i64>(&["EXISTS", key.lock_key()]),
        1,
        "the key was gone from the server when the holder was told"
    );
    proxy.set_latency(Duration::ZERO);
    assert_eq!(kept.release().await.expect("release"), Release::Released);
}

/// A stalled link: renewals go out and no reply comes back. Every holder hears of the loss
/// before its lease's local deadline (`now + remaining()` read once the stall began).
async fn stalled_renewals_are_told_before_the_deadline(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    // Told 2.5% of the TTL + 3 ms ahead of the deadline: 103 ms at 4 s, room for a watcher to
    // be woken on a loaded machine (28 ms at 1 s).
    let o = LockOptions::new().ttl(Duration::from_millis(4_000));
    let mut leases = Vec::new();
    for i in 0..8 {
        leases.push(
            locker
                .try_acquire(&format!("stalled:{i}"), &o)
                .await
                .expect("grant"),
        );
    }
    proxy.stall(true);
    // A reply already past the proxy when the stall began could still move a deadline.
    sleep(Duration::from_millis(30)).await;
    let mut watchers = Vec::new();
    for lease in &leases {
        let info = lease.info();
        let deadline = Instant::now() + info.remaining();
        watchers.push(tokio::spawn(async move {
            info.lost().await;
            (Instant::now(), deadline)
        }));
    }
    for w in watchers {
        let (told, deadline) = tokio::time::timeout(Duration::from_secs(6), w)
            .await
            .expect("lost fired")
            .expect("join");
        assert!(
            told < deadline,
            "told {:?} after the local deadline",
            told - deadline
        );
    }
    proxy.stall(false);
    drop(leases);
}

/// Extends `lease` to 3 s with the reply lost on its way back: `OutcomeUnknown`.
async fn extend_to_3s_losing_the_reply(proxy: &Proxy, lease: &Lease) {
    proxy.drop_replies(RELEASED, 1);
    let outcome = lease.extend(Duration::from_millis(3_000)).await;
    assert!(
        matches!(outcome, Err(Error::OutcomeUnknown { .. })),
        "{outcome:?}"
    );
}

/// An extend to a shorter TTL whose reply is lost: it ran on the server, so the key now
/// expires with the short TTL. The caller gets `OutcomeUnknown`, and the lease no longer claims
/// the old 30 s: `remaining()` is within the new TTL and `lost()` fires before the server lets
/// the key go.
async fn lost_extend_reply_shortens_the_lease(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let opts = LockOptions::new().ttl(Duration::from_secs(30)).renew(false);
    let lease = locker
        .try_acquire("shortened", &opts)
        .await
        .expect("acquire");
    extend_to_3s_losing_the_reply(&proxy, &lease).await;
    assert_eq!(
        proxy.dropped.load(Ordering::SeqCst),
        1,
        "the reply was lost"
    );
    let k = locker.lock_key("shortened").expect("key");
    let pttl: i64 = server.cmd(&["PTTL", k.lock_key()]);
    assert!(pttl > 0 && pttl <= 3_000, "the extend ran: PTTL {pttl}");
    assert!(
        lease.remaining() <= Duration::from_millis(3_000),
        "remaining {:?} after an extend to 3 s that may have landed",
        lease.remaining()
    );
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("lost() fired");
    assert!(started.elapsed() < Duration::from_millis(3_000));
    let pttl: i64 = server.cmd(&["PTTL", k.lock_key()]);
    assert!(pttl > 0, "lost() fired after the server let the key go");
}

/// The same lost extend reply on a lease that renews: the shortened deadline brings its next
/// renewal forward (by halfway to the new alarm), so the lease is kept, not reported lost at
/// the shortened deadline with no renewal tried. The renewals carry the grant's 30 s to the
/// server, but the lease counts its deadlines with the extend's 3 s from then on: that extend
/// may yet be delivered again later (see `a_request_of_unknown_outcome_caps_later_deadlines`).
async fn a_renewing_lease_renews_after_a_lost_extend_reply(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let opts = LockOptions::new().ttl(Duration::from_secs(30));
    let lease = locker
        .try_acquire("shortened-renewing", &opts)
        .await
        .expect("acquire");
    extend_to_3s_losing_the_reply(&proxy, &lease).await;
    assert!(lease.remaining() <= Duration::from_millis(3_000));
    sleep(Duration::from_millis(4_000)).await;
    assert!(
        !lease.is_lost(),
        "lost at the shortened deadline, though the server was there to renew it"
    );
    let k = locker.lock_key("shortened-renewing").expect("key");
    let pttl: i64 = server.cmd(&["PTTL", k.lock_key()]);
    assert!(
        pttl > 3_000,
        "not renewed on the server: {pttl} ms left after the 3 s extend"
    );
    let left = lease.remaining();
    assert!(
        left > Duration::ZERO && left <= Duration::from_millis(3_000),
        "{left:?} left: want the renewals counted with the lost extend's 3 s"
    );
    lease.release().await.expect("release");
}

/// An extend to a shorter TTL whose caller gives up before the reply (a timeout around it):
/// the extend still runs on the server, so the lease must not go on claiming the old 30 s, or
/// the key would expire under a holder that believes it has most of that left.
async fn a_cancelled_extend_shortens_the_lease(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let opts = LockOptions::new().ttl(Duration::from_secs(30)).renew(false);
    let lease = locker
        .try_acquire("cut-short", &opts)
        .await
        .expect("acquire");
    proxy.delay_replies(Duration::from_millis(500));
    let gave_up = tokio::time::timeout(
        Duration::from_millis(50),
        lease.extend(Duration::from_millis(3_000)),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "the extend answered in 50 ms: {gave_up:?}"
    );
    proxy.delay_replies(Duration::ZERO);
    let k = locker.lock_key("cut-short").expect("key");
    let deadline = Instant::now() + Duration::from_secs(5);
    let pttl = loop {
        let pttl: i64 = server.cmd(&["PTTL", k.lock_key()]);
        if pttl <= 3_000 || Instant::now() > deadline {
            break pttl;
        }
        sleep(Duration::from_millis(5)).await;
    };
    assert!(
        pttl > 0 && pttl <= 3_000,
        "the extend never ran: PTTL {pttl}"
    );
    assert!(
        lease.remaining() <= Duration::from_millis(pttl as u64),
        "remaining {:?} while the server expires the key in {pttl} ms",
        lease.remaining()
    );
}

/// An acquire whose caller gives up while the call is in flight (a `timeout` around it, a
/// client that went away): the grant still lands on the server, and nobody holds it. It is
/// released at once instead of keeping the key for its 30 s TTL.
async fn a_cancelled_acquire_leaves_nothing_held(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    proxy.delay_replies(Duration::from_millis(300));
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        locker.try_acquire("cancelled", &opts()),
    )
    .await;
    assert!(gave_up.is_err(), "the acquire answered within 100 ms");
    proxy.delay_replies(Duration::ZERO);
    let k = locker.lock_key("cancelled").expect("key");
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        let exists: i64 = server.cmd(&["EXISTS", k.lock_key()]);
        if exists == 0 {
            break;
        }
        let pttl: i64 = server.cmd(&["PTTL", k.lock_key()]);
        assert!(
            Instant::now() < give_up,
            "the abandoned grant still holds the key ({pttl} ms left)"
        );
        sleep(Duration::from_millis(20)).await;
    }
    // The abandoned acquire was granted (it wrote its fence), so the key went because it was
    // given back, not because it was never taken.
    let fence: Option<String> = server.cmd(&["GET", k.fence_key()]);
    assert!(
        fence.is_some(),
        "the abandoned acquire never reached the server"
    );
    // The key is free for the next caller.
    let lease = locker
        .try_acquire("cancelled", &opts())
        .await
        .expect("free");
    lease.release().await.expect("release");
}

/// Options for an acquire that waits for one replica, 100 ms at most: no replica is started, so
/// such an acquire is granted, waits, and is refused.
fn replicated() -> LockOptions {
    opts()
        .replicas(1)
        .replica_timeout(Duration::from_millis(100))
}

/// Opens `locker`'s dedicated connection with a replicated acquire of `key` (refused: no
/// replica; the connection is kept for the next one) and slows that connection's requests,
/// alone, by `delay`. Returns the fence that refused grant was given.
async fn slow_dedicated_connection(
    server: &Server,
    locker: &Locker,
    proxy: &Proxy,
    key: &str,
    delay: Duration,
) -> u64 {
    // The connections the locker opens from tasks of its own (the subscription's) are counted
    // first: the count has not moved for 100 ms.
    let before = loop {
        let n = proxy.connections();
        sleep(Duration::from_millis(100)).await;
        if proxy.connections() == n {
            break n;
        }
    };
    match locker.try_acquire(key, &replicated()).await {
        Err(Error::NotReplicated { acked: 0, .. }) => {}
        other => panic!("expected NotReplicated without a replica, got {other:?}"),
    }
    assert_eq!(proxy.connections(), before + 1, "one dedicated connection");
    proxy.delay_requests_of(before, delay);
    fence_of(server, locker, key)
}

/// The last fence granted on `key`, as the server stores it.
fn fence_of(server: &Server, locker: &Locker, key: &str) -> u64 {
    let k = locker.lock_key(key).expect("key");
    let stored: Option<String> = server.cmd(&["GET", k.fence_key()]);
    stored.map_or(0, |f| f.parse().expect("a fence"))
}

/// Waits for a grant of `key` to land on the server after its acquire ended (its fence rises
/// above `fence_before`; the key itself may be given back too soon to be seen held), then for
/// the key to be free, well before the grant's 10 s TTL.
async fn late_grant_is_given_back(server: &Server, locker: &Locker, key: &str, fence_before: u64) {
    let k = locker.lock_key(key).expect("key");
    let give_up = Instant::now() + Duration::from_secs(2);
    while fence_of(server, locker, key) == fence_before {
        assert!(
            Instant::now() < give_up,
            "the acquire never reached the server"
        );
        sleep(Duration::from_millis(5)).await;
    }
    freed_within(
        server,
        k.lock_key(),
        Duration::from_secs(3),
        "the late grant",
    )
    .await;
}

/// Waits for a grant of `lock_key` to land on the server (its reply may still be on its way).
async fn granted_within(server: &Server, lock_key: &str, limit: Duration) {
    let give_up = Instant::now() + limit;
    while server.cmd::<i64>(&["EXISTS", lock_key]) == 0 {
        assert!(Instant::now() < give_up, "never granted");
        sleep(Duration::from_millis(2)).await;
    }
}

/// Waits for `lock_key` to be gone from the server, failing after `limit` with what holds it.
async fn freed_within(server: &Server, lock_key: &str, limit: Duration, what: &str) {
    let give_up = Instant::now() + limit;
    while server.cmd::<i64>(&["EXISTS", lock_key]) == 1 {
        let pttl: i64 = server.cmd(&["PTTL", lock_key]);
        assert!(
            Instant::now() < give_up,
            "{what} still holds the key ({pttl} ms left)"
        );
        sleep(Duration::from_millis(20)).await;
    }
}

/// As above for an acquire that waits for replicas, which runs on a connection of its own:
/// given back on the shared connection, the release could reach the server before the acquire,
/// find nothing, and leave the grant holding the key for its TTL. Here the dedicated
/// connection's requests take 300 ms to arrive, so the caller is gone, and its locker's
/// give-back on the shared connection answered, before the acquire reaches the server.
async fn a_cancelled_replicated_acquire_leaves_nothing_held(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let fence = slow_dedicated_connection(
        &server,
        &locker,
        &proxy,
        "replicated",
        Duration::from_millis(300),
    )
    .await;
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        locker.try_acquire("replicated", &replicated()),
    )
    .await;
    assert!(gave_up.is_err(), "the acquire answered within 100 ms");
    late_grant_is_given_back(&server, &locker, "replicated", fence).await;
}

/// As above, with the caller still there but the acquire unanswered within the response
/// timeout: its outcome is unknown, and the grant it may still make is given back behind it on
/// its own connection. Given back on the shared connection (as the locker does for an unknown
/// outcome), the release would reach the server first and find nothing.
async fn an_unanswered_replicated_acquire_leaves_nothing_held(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let config = RedisConfig::default().response_timeout(Duration::from_millis(300));
    let locker = Locker::redis_with(&proxy.url(), config)
        .await
        .expect("connect");
    let fence = slow_dedicated_connection(
        &server,
        &locker,
        &proxy,
        "unanswered",
        Duration::from_millis(600),
    )
    .await;
    match locker.try_acquire("unanswered", &replicated()).await {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!("expected the acquire's outcome unknown, got {other:?}"),
    }
    late_grant_is_given_back(&server, &locker, "unanswered", fence).await;
}

/// A replicated acquire whose connection drops with the grant's reply: the outcome is unknown,
/// and the give-back cannot go on that connection, which is gone. It goes on the shared one (the
/// dead connection can deliver nothing more, so nothing can overtake it): the key is free long
/// before the grant's 10 s TTL. (The give-back failed on the dead connection, with a warning,
/// and the key stayed held by nobody for the TTL.)
async fn a_replicated_acquire_on_a_dropped_connection_leaves_nothing_held(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    slow_dedicated_connection(&server, &locker, &proxy, "dropped-link", Duration::ZERO).await;
    proxy.drop_replies(GRANT, 1);
    match locker.try_acquire("dropped-link", &replicated()).await {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!("expected the acquire's outcome unknown, got {other:?}"),
    }
    assert_eq!(
        proxy.dropped.load(Ordering::SeqCst),
        1,
        "the reply was lost"
    );
    let k = locker.lock_key("dropped-link").expect("key");
    freed_within(&server, k.lock_key(), Duration::from_secs(3), "the grant").await;
}

/// A release whose caller gives up before it is answered: the guard's drop sends it again (it
/// may never have reached the server, as when cancelled during a reconnect). Here the first one
/// is held up in a stalled link, so both reach the server: two release calls, where a guard
/// that counted the cancelled release as done sent one.
async fn a_cancelled_release_is_sent_again(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let lease = locker
        .try_acquire("dropped", &opts())
        .await
        .expect("acquire");
    let before = server.script_calls();
    proxy.stall(true);
    let gave_up = tokio::time::timeout(Duration::from_millis(100), lease.release()).await;
    assert!(
        gave_up.is_err(),
        "the release answered through a stalled link"
    );
    sleep(Duration::from_millis(100)).await;
    proxy.stall(false);
    let k = locker.lock_key("dropped").expect("key");
    let give_up = Instant::now() + Duration::from_secs(5);
    while server.script_calls() < before + 2 && Instant::now() < give_up {
        sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        server.script_calls() - before,
        2,
        "the release was not sent again"
    );
    let exists: i64 = server.cmd(&["EXISTS", k.lock_key()]);
    assert_eq!(exists, 0);
}

/// An extend answered in a shape the script never gives (no answer for the lease: a server
/// running another version of the script, a faulty proxy) is an error, not a verdict: the
/// lease is not reported lost on the strength of a missing answer, and the next extend renews
/// it. Before, the missing answer was read as "not held" and the lease was given up.
async fn a_malformed_extend_reply_is_no_verdict(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let lease = locker
        .try_acquire("malformed", &opts())
        .await
        .expect("acquire");
    proxy.replace_replies(RELEASED, b"*0\r\n", 1);
    let outcome = lease.extend(Duration::from_secs(10)).await;
    assert_eq!(
        proxy.dropped.load(Ordering::SeqCst),
        1,
        "the reply was replaced"
    );
    assert!(matches!(outcome, Err(Error::Unavailable(_))), "{outcome:?}");
    assert!(!lease.is_lost(), "lost on a reply that said nothing of it");
    lease
        .extend(Duration::from_secs(10))
        .await
        .expect("the next extend renews it");
    let k = locker.lock_key("malformed").expect("key");
    let pttl: i64 = server.cmd(&["PTTL", k.lock_key()]);
    assert!(pttl > 9_000, "PTTL {pttl}");
    assert_eq!(lease.release().await.expect("release"), Release::Released);
}

/// A handoff between two waiters of one locker holds one round trip: the next waiter's turn
/// comes once the release is in line on the connection, and its acquire, sent behind the
/// release on the same connection, reaches the server after it. Over a link of 250 ms each way
/// the grant comes about as long after the release starts as an uncontended acquire takes
/// (500 ms); waiting for the release's answer first, it came a round trip later (1 s).
///
/// The same when the holder drops its guard instead, renewing or not: the release goes in the
/// background, and the turn with it once it is in line. Handed on at the drop, the waiter asked
/// before the release was sent, found the key held, subscribed and asked again (1.5 s).
async fn a_handoff_holds_one_round_trip(flavor: Flavor, end: End) {
    let (_server, proxy, locker) = through_proxy(flavor).await;
    let wait = opts().wait(Duration::from_secs(10));
    let held = wait.clone().renew(end == End::DropRenewing);
    // Long enough that a loaded machine's stalls stay well inside the half round trip of
    // margin either way.
    let one_way = Duration::from_millis(250);
    let slow = || proxy.set_latency(one_way);
    let h = support::timed_handoff(
        &locker,
        "handoff",
        &held,
        &wait,
        slow,
        async |first| match end {
            End::Release => {
                assert_eq!(first.release().await.expect("release"), Release::Released)
            }
            End::Drop | End::DropRenewing => drop(first),
        },
    )
    .await;
    assert!(
        h.handoff < h.uncontended + one_way,
        "{end:?}: the grant came {:?} after the holder let go, an uncontended acquire took \
         {:?}: the release was not overlapped",
        h.handoff,
        h.uncontended
    );
    proxy.set_latency(Duration::ZERO);
    h.second.release().await.expect("release");
    h.alone.release().await.expect("release");
}

/// How a holder lets go of its lease.
#[derive(Clone, Copy, Debug, PartialEq)]
enum End {
    Release,
    /// The guard dropped, renewal off: the release is spawned.
    Drop,
    /// The guard of a renewing lease dropped: the renewal driver releases it.
    DropRenewing,
}

/// The rarer case: the next acquire overtakes the release. The server lost the release script
/// (a restart, a `SCRIPT FLUSH`) but has the acquire script, so the release's `EVALSHA` is
/// refused `NOSCRIPT` and sent again after the waiter's acquire, which finds the key held with
/// nearly all of its 10 s left. The waiter subscribes and asks again, and is granted within a
/// few round trips of 300 ms, not after the TTL.
async fn a_handoff_overtaking_its_release_is_still_prompt(flavor: Flavor) {
    let (server, proxy, locker) = through_proxy(flavor).await;
    let wait = opts().wait(Duration::from_secs(10));
    let first = locker.acquire("overtaken", &wait).await.expect("first");
    let waiter = tokio::spawn({
        let (locker, wait) = (locker.clone(), wait.clone());
        async move {
            let lease = locker.acquire("overtaken", &wait).await;
            (lease, Instant::now())
        }
    });
    sleep(Duration::from_millis(200)).await;
    let _: String = server.cmd(&["SCRIPT", "FLUSH"]);
    let _: String = server.cmd(&[
        "SCRIPT",
        "LOAD",
        include_str!("../lock-core/src/lua/acquire.lua"),
    ]);
    proxy.set_latency(Duration::from_millis(150));
    let started = Instant::now();
    assert_eq!(first.release().await.expect("release"), Release::Released);
    let (second, granted) = waiter.await.expect("waiter task");
    let second = second.expect("the waiter is granted the key");
    let handoff = granted - started;
    assert!(
        handoff < Duration::from_millis(2_500),
        "the grant came {handoff:?} after the release started"
    );
    // The release was refused for its script, as this case needs (not a plain handoff).
    let stats: String = server.cmd(&["INFO", "errorstats"]);
    assert!(
        stats.contains("errorstat_NOSCRIPT:count="),
        "no release refused NOSCRIPT: {stats}"
    );
    proxy.set_latency(Duration::ZERO);
    second.release().await.expect("release");
}

macro_rules! lost_replies {
    ($modname:ident, $flavor:expr) => {
        mod $modname {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_malformed_extend_reply_is_no_verdict() {
                super::a_malformed_extend_reply_is_no_verdict($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_garbled_grant_reply_is_asked_again() {
                super::a_grant_reply_gone_wrong_is_resolved($flavor, super::Reply::Garbled).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_garbled_release_reply_is_no_verdict() {
                super::a_garbled_release_reply_is_no_verdict($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_dropped_renewing_lease_release_garbled_is_sent_again() {
                super::a_dropped_lease_release_gone_wrong_is_sent_again(
                    $flavor,
                    super::Reply::Garbled,
                    true,
                )
                .await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_dropped_lease_release_lost_is_sent_again() {
                super::a_dropped_lease_release_gone_wrong_is_sent_again(
                    $flavor,
                    super::Reply::Lost,
                    false,
                )
                .await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lost_grant_reply_is_resolved() {
                super::a_grant_reply_gone_wrong_is_resolved($flavor, super::Reply::Lost).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_retry_after_the_fence_key_went_gets_a_fence() {
                super::a_retry_after_the_fence_key_went_gets_a_fence($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_abandoned_grants_release_gone_wrong_is_sent_again() {
                super::an_abandoned_grants_release_gone_wrong_is_sent_again($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn unresolved_grant_is_released() {
                super::unresolved_grant_is_released($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_retry_hands_back_the_first_grants_fence() {
                super::a_retry_hands_back_the_first_grants_fence($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn slow_replies_never_give_expired_leases() {
                super::slow_replies_never_give_expired_leases($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_late_grant_does_not_end_the_wait() {
                super::a_late_grant_does_not_end_the_wait($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewal_keeps_a_lease_over_a_slow_link() {
                super::renewal_keeps_a_lease_over_a_slow_link($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewal_keeps_a_lease_below_half_the_ttl_not_above() {
                super::renewal_keeps_a_lease_below_half_the_ttl_not_above($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stalled_renewals_are_told_before_the_deadline() {
                super::stalled_renewals_are_told_before_the_deadline($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lost_extend_reply_shortens_the_lease() {
                super::lost_extend_reply_shortens_the_lease($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_renewing_lease_renews_after_a_lost_extend_reply() {
                super::a_renewing_lease_renews_after_a_lost_extend_reply($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_cancelled_extend_shortens_the_lease() {
                super::a_cancelled_extend_shortens_the_lease($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_cancelled_acquire_leaves_nothing_held() {
                super::a_cancelled_acquire_leaves_nothing_held($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_cancelled_replicated_acquire_leaves_nothing_held() {
                super::a_cancelled_replicated_acquire_leaves_nothing_held($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_unanswered_replicated_acquire_leaves_nothing_held() {
                super::an_unanswered_replicated_acquire_leaves_nothing_held($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_replicated_acquire_on_a_dropped_connection_leaves_nothing_held() {
                super::a_replicated_acquire_on_a_dropped_connection_leaves_nothing_held($flavor)
                    .await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_cancelled_release_is_sent_again() {
                super::a_cancelled_release_is_sent_again($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_handoff_overtaking_its_release_is_still_prompt() {
                super::a_handoff_overtaking_its_release_is_still_prompt($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_handoff_holds_one_round_trip() {
                super::a_handoff_holds_one_round_trip($flavor, End::Release).await
            }
            // One thread: the waiter and the release's task run in the order they were
            // woken, so a turn handed on before the release is in line is always overtaking.
            #[tokio::test(flavor = "current_thread")]
            async fn a_handoff_from_a_dropped_guard_holds_one_round_trip() {
                super::a_handoff_holds_one_round_trip($flavor, End::Drop).await
            }
            // One thread: the waiter and the release's task run in the order they were
            // woken, so a turn handed on before the release is in line is always overtaking.
            #[tokio::test(flavor = "current_thread")]
            async fn a_handoff_from_a_dropped_renewing_guard_holds_one_round_trip() {
                super::a_handoff_holds_one_round_trip($flavor, End::DropRenewing).await
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
