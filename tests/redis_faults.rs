//! Faults only a real server can show: restarts, script loss, killed connections, foreign key
//! types (alone and inside a shared script call), a server that goes away. Each runs on Redis
//! and on Valkey (a missing server binary fails the test, never skips it).

mod support;

use std::time::Duration;

use leasehold::{Error, LockOptions, Locker, RedisConfig, Release};
use support::{Flavor, Server, some_keys};
use tokio::time::{Instant, sleep};

fn opts(ttl_ms: u64) -> LockOptions {
    LockOptions::new().ttl(Duration::from_millis(ttl_ms))
}

/// Scenario 6: a restart without persistence loses the counter, yet the next fence is higher.
async fn fence_survives_restart(flavor: Flavor) {
    let mut server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let before = locker
        .try_acquire("restart", &opts(1_000))
        .await
        .expect("a");
    let f1 = before.fence();
    before.release().await.expect("release");
    server.restart();
    let fence_key = locker
        .lock_key("restart")
        .expect("key")
        .fence_key()
        .to_owned();
    assert_eq!(
        server.cmd::<i64>(&["EXISTS", &fence_key]),
        0,
        "the restart kept the counter"
    );
    let after = acquire_retrying(&locker, "restart").await;
    assert!(
        after.fence() > f1,
        "fence went back: {} then {}",
        f1,
        after.fence()
    );
}

/// The limit written down in `FenceGate`'s docs and docs/DEPLOYMENT.md, shown: the gate's
/// highest fence is one key, and a restart without persistence forgets it, so a fence lower
/// than one admitted before is admitted after. (Were this test to fail, the gate would have
/// gained durability and the docs should say so.)
async fn a_gate_forgets_at_a_restart_without_persistence(flavor: Flavor) {
    let mut server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let gate = locker.fence_gate("ledger").expect("gate");
    gate.admit(leasehold::Fence(2)).await.expect("admit 2");
    assert!(matches!(
        gate.admit(leasehold::Fence(1)).await,
        Err(Error::Stale { .. })
    ));
    server.restart();
    let mut admitted = gate.admit(leasehold::Fence(1)).await;
    // The locker reconnects on its own; a call or two may meet the restart.
    for _ in 0..50 {
        if !matches!(admitted, Err(ref e) if e.is_transient()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        admitted = gate.admit(leasehold::Fence(1)).await;
    }
    assert!(admitted.is_ok(), "{admitted:?}");
}

/// The server-time half of `max(stored + 1, server time in µs)`: a key's first fence is the
/// server's clock in microseconds at the grant (between two `TIME` readings around it), and
/// with the counter lost (deleted, as by a restart without persistence) the next grant's fence
/// comes from the clock again, above the first.
async fn a_fence_is_the_servers_clock_when_none_is_stored(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let k = locker.lock_key("clocked").expect("key");
    let server_us = || -> u64 {
        let t: Vec<String> = server.cmd(&["TIME"]);
        let secs: u64 = t[0].parse().expect("seconds");
        let micros: u64 = t[1].parse().expect("microseconds");
        secs * 1_000_000 + micros
    };
    let before = server_us();
    let first = locker
        .try_acquire("clocked", &opts(1_000))
        .await
        .expect("a");
    let after = server_us();
    let f1 = first.fence().get();
    assert!(
        (before..=after).contains(&f1),
        "fence {f1} outside the server's clock {before}..={after}"
    );
    first.release().await.expect("release");
    let _: i64 = server.cmd(&["DEL", k.fence_key()]);
    std::thread::sleep(Duration::from_millis(2));
    let before = server_us();
    let second = locker
        .try_acquire("clocked", &opts(1_000))
        .await
        .expect("a");
    let f2 = second.fence().get();
    assert!(
        f2 >= before && f2 > f1,
        "fence {f2} after the counter was lost: clock {before}, first {f1}"
    );
    second.release().await.expect("release");
}

/// The `stored + 1` half of `max(stored + 1, server time)`: a fence stored ahead of the clock
/// (a clock stepped back, or fences written by another scheme) still rises by exactly one per
/// grant, also above 2^53, where a script computing in Lua doubles would round it. (That a lost
/// reply's retry hands back the same fence is `a_retry_hands_back_the_first_grants_fence`, in
/// `redis_lost_reply.rs`.)
async fn fence_ahead_of_the_clock_rises_by_one(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let k = locker.lock_key("ahead").expect("key");
    for stored in [(1u64 << 53) + 1, 9_999_999_999_999_999_999, u64::MAX - 2] {
        let _: () = server.cmd(&["SET", k.fence_key(), &stored.to_string()]);
        let mut last = stored;
        for _ in 0..2 {
            let lease = locker.try_acquire("ahead", &opts(1_000)).await.expect("a");
            assert_eq!(
                lease.fence().get(),
                last + 1,
                "after {last} (stored {stored})"
            );
            last = lease.fence().get();
            lease.release().await.expect("release");
        }
        let kept: String = server.cmd(&["GET", k.fence_key()]);
        assert_eq!(kept, last.to_string());
    }
    // A grant of 2^64 - 1 itself, retried with its token (its reply lost), is handed back
    // that fence, as the in-memory backend does: the fence is readable, only none above it is.
    {
        use leasehold::{AcquireReply, Backend, Token};
        let _: () = server.cmd(&["SET", k.fence_key(), &(u64::MAX - 1).to_string()]);
        let token = Token::generate();
        for attempt in ["first", "retried"] {
            let reply = locker
                .backend()
                .acquire(&k, &token, Duration::from_secs(5))
                .await;
            assert!(
                matches!(
                    reply,
                    Ok(AcquireReply::Granted {
                        fence: u64::MAX,
                        ..
                    })
                ),
                "{attempt} grant: {reply:?}"
            );
            assert_eq!(server.cmd::<i64>(&["EXISTS", k.lock_key()]), 1);
        }
        let _: i64 = server.cmd(&["DEL", k.lock_key()]);
    }
    // At 2^64 - 1 no higher fence exists: the acquire is refused, the lock taken back and the
    // stored fence kept, rather than a grant with a fence no client can read holding the key.
    let refused = locker.try_acquire("ahead", &opts(30_000)).await;
    assert!(
        matches!(&refused, Err(e @ Error::FenceExhausted { .. }) if !e.is_transient()),
        "an acquire past the largest fence, refused for good: {refused:?}"
    );
    assert_eq!(server.cmd::<i64>(&["EXISTS", k.lock_key()]), 0);
    let kept: String = server.cmd(&["GET", k.fence_key()]);
    assert_eq!(kept, u64::MAX.to_string());
    // A decimal wider than 64 bits is above every fence as well (a quorum agrees).
    let wide = "123456789012345678901234567890";
    let _: () = server.cmd(&["SET", k.fence_key(), wide]);
    let refused = locker.try_acquire("ahead", &opts(30_000)).await;
    assert!(
        matches!(&refused, Err(Error::FenceExhausted { .. })),
        "{refused:?}"
    );
    assert_eq!(server.cmd::<String>(&["GET", k.fence_key()]), wide);
}

async fn acquire_retrying(locker: &Locker, key: &str) -> leasehold::Lease {
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        match locker.try_acquire(key, &opts(1_000)).await {
            Ok(l) => return l,
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("no reconnect: {e}"),
        }
    }
}

/// Scenario 7: `SCRIPT FLUSH` between acquire and release; release and extend still work.
async fn script_flush(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let a = locker
        .try_acquire("flush", &opts(5_000).renew(false))
        .await
        .expect("a");
    let _: String = server.cmd(&["SCRIPT", "FLUSH"]);
    a.extend(Duration::from_secs(5))
        .await
        .expect("extend after flush");
    let _: String = server.cmd(&["SCRIPT", "FLUSH"]);
    assert_eq!(a.release().await.expect("release"), Release::Released);
}

/// Scenario 10: the client's connections are killed; operations work again after reconnect.
async fn client_kill(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let a = locker.try_acquire("ck", &opts(5_000)).await.expect("a");
    let _: i64 = server.cmd(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
    let _: i64 = server.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    // The first command after the kill may fail (its outcome unknown); later ones must succeed.
    let give_up = Instant::now() + Duration::from_secs(5);
    let released = loop {
        match locker.try_acquire("ck2", &opts(1_000)).await {
            Ok(l) => break l,
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("no recovery after CLIENT KILL: {e}"),
        }
    };
    drop(released);
    assert_eq!(a.release().await.expect("release"), Release::Released);
}

/// A reconnect refused at its `AUTH` (the ACL user's password changed under a running
/// locker; `maxclients` refuses the same way) does not stay the connection's answer: once the
/// password is back, requests succeed again. (redis-rs's manager reconnects by itself only
/// after an I/O error, and answered every later request "authentication failed", for good.)
async fn a_refused_reconnect_is_tried_again(flavor: Flavor) {
    refused_reconnect_tried_again(flavor, "").await
}

/// As [`a_refused_reconnect_is_tried_again`], over RESP3 (`?protocol=resp3`), where the
/// refused reconnect's `HELLO 3 AUTH` comes back as the server's `WRONGPASS` error rather than
/// as a failed authentication: it was taken for an answer, the connection never checked, and
/// every later call refused until the process restarted.
async fn a_refused_reconnect_over_resp3_is_tried_again(flavor: Flavor) {
    refused_reconnect_tried_again(flavor, "?protocol=resp3").await
}

/// The user's password is changed and its connection killed, then the password put back: the
/// locker (its URL ending in `query`) answers again.
async fn refused_reconnect_tried_again(flavor: Flavor, query: &str) {
    let server = Server::start(flavor);
    let url = server.acl_user_url() + query;
    let locker = Locker::redis(&url).await.expect("connect");
    drop(
        locker
            .try_acquire("before", &opts(5_000))
            .await
            .expect("before"),
    );
    let _: () = server.cmd(&["ACL", "SETUSER", "leasehold", "resetpass", ">rotated"]);
    let _: i64 = server.cmd(&["CLIENT", "KILL", "USER", "leasehold"]);
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        match locker.try_acquire("during", &opts(1_000)).await {
            Err(_) => break,
            Ok(_) if Instant::now() < give_up => sleep(Duration::from_millis(50)).await,
            Ok(_) => panic!("still answered with the password changed"),
        }
    }
    // Past the manager's own reconnect attempts, which the changed password refuses.
    sleep(Duration::from_millis(1_500)).await;
    // A reconnect was in fact refused at its AUTH (not only the killed connection's requests).
    let log: Vec<std::collections::HashMap<String, String>> = server.cmd(&["ACL", "LOG"]);
    assert!(
        log.iter().any(|entry| {
            entry.get("reason").map(String::as_str) == Some("auth")
                && entry.get("username").map(String::as_str) == Some("leasehold")
        }),
        "no reconnect refused at AUTH: {log:?}"
    );
    // The rule of docs/leasehold.acl again, with its password.
    server.acl_user_url();
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        match locker.try_acquire("after", &opts(1_000)).await {
            Ok(_) => break,
            Err(e) if Instant::now() < give_up => {
                let _ = e;
                sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("no recovery once the password was back: {e}"),
        }
    }
}

/// A server busy with a long script refuses every request with `BUSY`, and would answer a
/// connection check's `PING` the same: the refusals are passed on (transient) and the shared
/// connection is kept, not replaced on each one (the check is for reconnects refused at their
/// login, which stay a connection's answer for good).
async fn a_server_busy_with_a_script_keeps_the_connection(flavor: Flavor) {
    let server = Server::start_with_args(flavor, &["--busy-reply-threshold", "50"]);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let warm = locker
        .try_acquire("warm", &opts(5_000))
        .await
        .expect("warm");
    warm.release().await.expect("release");
    let connections = || -> u64 {
        let n = server.info_field("stats", "total_connections_received");
        n.parse().expect("a connection count")
    };
    let before = connections();
    let mut busy = server.conn();
    let script = std::thread::spawn(move || {
        ::redis::cmd("EVAL")
            .arg("while true do end")
            .arg(0)
            .query::<()>(&mut busy)
    });
    sleep(Duration::from_millis(300)).await;
    for _ in 0..10 {
        match locker.try_acquire("during", &opts(5_000)).await {
            Err(e) => assert!(e.is_transient(), "{e}"),
            Ok(_) => panic!("granted while the server ran a script"),
        }
        sleep(Duration::from_millis(50)).await;
    }
    // Room for checks the refusals might have started.
    sleep(Duration::from_millis(500)).await;
    let _: () = server.cmd(&["SCRIPT", "KILL"]);
    assert!(script.join().expect("script thread").is_err(), "killed");
    // Three of the test's own: the script's, `SCRIPT KILL`'s and this count's.
    let opened = connections() - before - 3;
    assert_eq!(
        opened, 0,
        "the locker opened {opened} connections while the server was busy"
    );
    let after = locker
        .try_acquire("after", &opts(5_000))
        .await
        .expect("after");
    after.release().await.expect("release");
}

/// A key holding another type is reported and left untouched.
async fn wrong_type(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let k = locker.lock_key("typed").expect("key");
    let _: i64 = server.cmd(&["RPUSH", k.lock_key(), "precious"]);
    match locker.try_acquire("typed", &opts(1_000)).await {
        Err(Error::WrongType { found, server_key }) => {
            assert_eq!(found, "list");
            assert_eq!(server_key, k.lock_key());
        }
        other => panic!("expected WrongType, got {other:?}"),
    }
    let kept: Vec<String> = server.cmd(&["LRANGE", k.lock_key(), "0", "-1"]);
    assert_eq!(kept, vec!["precious".to_owned()]);
    let _: i64 = server.cmd(&["DEL", k.lock_key()]);
    let _: i64 = server.cmd(&["HSET", k.fence_key(), "f", "v"]);
    match locker.try_acquire("typed", &opts(1_000)).await {
        Err(Error::WrongType { found, server_key }) => {
            assert_eq!(found, "hash");
            assert_eq!(
                server_key,
                k.fence_key(),
                "the error names the key that holds the hash"
            );
        }
        other => panic!("expected WrongType, got {other:?}"),
    }
    let kept: Vec<String> = server.cmd(&["HGETALL", k.fence_key()]);
    assert_eq!(kept, vec!["f".to_owned(), "v".to_owned()]);
    assert_eq!(
        server.cmd::<i64>(&["EXISTS", k.lock_key()]),
        0,
        "nothing was written"
    );
    let gate_key = "{leasehold:ledger}:gate";
    let _: i64 = server.cmd(&["SADD", gate_key, "x"]);
    let gate = locker.fence_gate("ledger").expect("gate");
    assert!(matches!(
        gate.admit(leasehold::Fence(5)).await,
        Err(Error::WrongType { .. })
    ));
}

/// A gate key holding a string that is not a fence (written by something else: not a decimal,
/// a leading zero, above 2^64 - 1) refuses with `WrongType` and is left as it was: a gate that
/// cannot read its highest fence must not admit every writer. At the edges, `0` and 2^64 - 1
/// are fences.
async fn a_gate_that_holds_no_fence_refuses(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let gate = locker.fence_gate("ledger").expect("gate");
    let gate_key = "{leasehold:ledger}:gate";
    for found in [
        "abc",
        "0042",
        "-1",
        "18446744073709551616",
        "99999999999999999999999",
    ] {
        let _: () = server.cmd(&["SET", gate_key, found]);
        let r = gate.admit(leasehold::Fence(5)).await;
        assert!(
            matches!(r, Err(Error::WrongType { ref server_key, .. }) if server_key == gate_key),
            "{found}: {r:?}"
        );
        assert!(
            !r.as_ref().is_err_and(|e| e.is_transient()),
            "{found}: {r:?}"
        );
        let kept: String = server.cmd(&["GET", gate_key]);
        assert_eq!(kept, found, "the gate key was changed");
    }
    let _: () = server.cmd(&["SET", gate_key, "18446744073709551615"]);
    let r = gate.admit(leasehold::Fence(5)).await;
    assert!(
        matches!(
            r,
            Err(Error::Stale {
                highest: leasehold::Fence(u64::MAX),
                ..
            })
        ),
        "{r:?}"
    );
    let _: () = server.cmd(&["SET", gate_key, "0"]);
    gate.admit(leasehold::Fence(0))
        .await
        .expect("fence 0 after 0");
}

/// A locker on `server` that gives up on a silent or dead server within 300 ms.
async fn quick_to_give_up(server: &Server) -> Locker {
    let config = RedisConfig::default()
        .response_timeout(Duration::from_millis(300))
        .connection_timeout(Duration::from_millis(300));
    Locker::redis_with(&server.url(), config)
        .await
        .expect("connect")
}

/// A server that goes away turns into errors within the response timeout, not a hang, and a
/// held lease is reported lost before its local deadline.
async fn server_goes_away(flavor: Flavor) {
    let mut server = Server::start(flavor);
    let locker = quick_to_give_up(&server).await;
    let lease = locker
        .try_acquire("gone", &opts(1_500))
        .await
        .expect("lease");
    let deadline = Instant::now() + lease.remaining();
    server.kill();
    tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("lost never fired");
    let told = Instant::now();
    assert!(
        told < deadline,
        "told {:?} after the local deadline",
        told - deadline
    );
    assert_eq!(lease.remaining(), Duration::ZERO);
    let t = Instant::now();
    let r = locker.try_acquire("other", &opts(1_000)).await;
    assert!(matches!(r, Err(ref e) if e.is_transient()), "{r:?}");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "hung for {:?}",
        t.elapsed()
    );
}

/// A wait is for a busy key, not for a server in trouble: a waiting acquire on a server that
/// has gone away ends at its first error (transient, so the caller may retry), long before its
/// wait, rather than holding its caller (an HTTP request, a job) for the whole wait.
async fn a_wait_ends_at_the_first_error_of_a_server_that_went_away(flavor: Flavor) {
    let mut server = Server::start(flavor);
    let locker = quick_to_give_up(&server).await;
    server.kill();
    let t = Instant::now();
    let r = locker
        .acquire("down", &opts(1_000).wait(Duration::from_secs(30)))
        .await;
    assert!(matches!(r, Err(ref e) if e.is_transient()), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

/// Waiters of one locker queued behind the one asking the server end with its error: on a
/// server gone silent, the first attempt takes its timeouts (300 ms, twice: the reply was lost,
/// so it asks again) and the rest end with it, transient, rather than one after another until
/// the last ones run out their wait and end with a `WaitTimeout`, which is not transient.
async fn queued_waiters_end_with_the_first_error(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = quick_to_give_up(&server).await;
    // Connected, scripts loaded: the waiters meet the silence, nothing else.
    let warm = locker
        .try_acquire("warm", &opts(1_000))
        .await
        .expect("warm");
    warm.release().await.expect("release");
    let _: () = server.cmd(&["CLIENT", "PAUSE", "10000", "ALL"]);
    let started = Instant::now();
    let spawn_waiter = |wait: Duration| {
        let locker = locker.clone();
        tokio::spawn(async move {
            let r = locker.acquire("silent", &opts(1_000).wait(wait)).await;
            (r, started.elapsed())
        })
    };
    let waiters: Vec<_> = (0..6)
        .map(|_| spawn_waiter(Duration::from_secs(2)))
        .collect();
    // Queued behind them, with a wait that ends before the first one's error (300 ms response
    // timeout) comes.
    let short = spawn_waiter(Duration::from_millis(100));
    let mut queued_behind = 0;
    for w in waiters {
        let (r, took) = w.await.expect("waiter");
        assert!(matches!(r, Err(ref e) if e.is_transient()), "{r:?}");
        // Each waiting its own response timeout in turn would take 6 x 300 ms.
        assert!(
            took < Duration::from_millis(1_200),
            "ended after {took:?}: {r:?}"
        );
        if let Err(e @ Error::Unavailable(_)) = &r
            && e.to_string().contains("ahead of this one")
        {
            queued_behind += 1;
        }
    }
    // One waiter is first in line and meets the silence itself; the others end with its error.
    assert!(
        queued_behind >= 5,
        "{queued_behind} waiters ended by the one ahead"
    );
    let (r, took) = short.await.expect("short waiter");
    assert!(
        matches!(r, Err(Error::WaitTimeout { .. })),
        "{r:?} after {took:?}"
    );
}

/// Releases missed while the subscription connection was down still wake waiters: after it
/// reconnects, every waiter retries. The lock is deleted without a publish (as a release during
/// the gap would go unseen), then the subscription is killed; the waiter must get the key long
/// before the holder's TTL, which is all its timer would give it.
async fn waiters_woken_after_resubscribe(flavor: Flavor) {
    let server = Server::start(flavor);
    let holder_side = Locker::redis(&server.url()).await.expect("connect");
    let waiter_side = Locker::redis(&server.url()).await.expect("connect");
    let held = holder_side
        .try_acquire("gap", &opts(20_000))
        .await
        .expect("holder");
    let attempts_before = calls(&server, "evalsha");
    let waiter = tokio::spawn(async move {
        let started = Instant::now();
        let lease = waiter_side
            .acquire("gap", &opts(1_000).wait(Duration::from_secs(15)))
            .await;
        (lease.map(|l| l.fence()), started.elapsed())
    });
    // Wait until the waiter's subscription is in place.
    let channel = holder_side
        .lock_key("gap")
        .expect("key")
        .channel()
        .to_owned();
    server.wait_for_subscriber(&channel).await;
    // Subscribed, the waiter asks once more at once (a release in between would otherwise go
    // unseen). Let that attempt find the key held: deleted before it, the key is simply taken,
    // the subscription closes, and there is no gap to test (seen in CI as "no pub/sub client
    // to kill"). After it the waiter sleeps on the holder's 20 s TTL. Its two attempts (before
    // and after subscribing) are counted at the server rather than given a fixed time.
    let counting = Instant::now();
    while calls(&server, "evalsha") < attempts_before + 2 {
        assert!(
            counting.elapsed() < Duration::from_secs(10),
            "the waiter's attempts did not reach the server"
        );
        sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !waiter.is_finished(),
        "the waiter got the key while it was held"
    );
    let lock_key = holder_side
        .lock_key("gap")
        .expect("key")
        .lock_key()
        .to_owned();
    let _: i64 = server.cmd(&["DEL", &lock_key]);
    server.kill_subscribers().await;
    let (fence, waited) = waiter.await.expect("waiter task");
    let fence = fence.expect("the waiter got the key");
    assert!(fence > held.fence());
    assert!(
        waited < Duration::from_secs(5),
        "woken by its timer, not by the reconnect: {waited:?}"
    );
    drop(held);
}

/// A server that drops the subscription connection as soon as it is made (here killed every
/// 50 ms for 2 s): the subscriber reconnects with backoff, not at once, so the waiter it wakes
/// on every reconnect asks the server a handful of times, not once per kill. Once the kills
/// stop, a release still wakes the waiter.
async fn a_subscription_dropped_at_once_is_paced(flavor: Flavor) {
    let server = Server::start(flavor);
    let holder_side = Locker::redis(&server.url()).await.expect("connect");
    let waiter_side = Locker::redis(&server.url()).await.expect("connect");
    let held = holder_side
        .try_acquire("churn", &opts(30_000).renew(false))
        .await
        .expect("holder");
    let waiter = tokio::spawn(async move {
        let lease = waiter_side
            .acquire("churn", &opts(1_000).wait(Duration::from_secs(20)))
            .await;
        (lease.map(|l| l.fence()), Instant::now())
    });
    let channel = holder_side
        .lock_key("churn")
        .expect("key")
        .channel()
        .to_owned();
    server.wait_for_subscriber(&channel).await;
    let attempts_before = calls(&server, "evalsha");
    let churn = Instant::now();
    while churn.elapsed() < Duration::from_secs(2) {
        let _: i64 = server.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]);
        sleep(Duration::from_millis(50)).await;
    }
    let attempts = calls(&server, "evalsha") - attempts_before;
    // Backing off from 20 ms to 1 s: about eight reconnects in 2 s, against forty kills.
    assert!(
        attempts <= 16,
        "{attempts} attempts by one waiter in 2 s of dropped subscriptions"
    );
    assert!(!waiter.is_finished(), "the waiter got a held key");
    server.wait_for_subscriber(&channel).await;
    let held_fence = held.fence();
    let released = Instant::now();
    assert_eq!(
        held.release().await.expect("release"),
        leasehold::Release::Released
    );
    let (fence, granted) = waiter.await.expect("waiter task");
    assert!(fence.expect("the waiter got the key") > held_fence);
    assert!(
        granted - released < Duration::from_secs(1),
        "woken {:?} after the release",
        granted - released
    );
}

/// A lock key someone else set with a plain `SET` (no expiry): `Busy` with no remaining time,
/// the value left alone, and a waiter that backs off rather than spinning until its deadline.
async fn held_without_expiry(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    start_counting(&server, &locker).await;
    let k = locker.lock_key("forever").expect("key");
    let _: () = server.cmd(&["SET", k.lock_key(), "someone"]);
    match locker.try_acquire("forever", &opts(1_000)).await {
        Err(Error::Busy { remaining, .. }) => {
            assert_eq!(
                remaining, None,
                "a key without expiry has no time left to report"
            )
        }
        other => panic!("expected Busy, got {other:?}"),
    }
    let started = Instant::now();
    match locker
        .acquire("forever", &opts(1_000).wait(Duration::from_millis(500)))
        .await
    {
        Err(Error::WaitTimeout { .. }) => {}
        other => panic!("expected WaitTimeout, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(500));
    // Backing off from 10 ms and doubling, half a second takes a handful of tries; a loop
    // without a pause would make thousands.
    let tries = calls(&server, "evalsha") - 1;
    assert!(tries <= 12, "{tries} acquire calls in 500 ms");
    let value: String = server.cmd(&["GET", k.lock_key()]);
    assert_eq!(value, "someone", "the other holder's key was touched");
    assert_eq!(server.cmd::<i64>(&["PTTL", k.lock_key()]), -1);
}

/// Clients connected to the server (normal and pub/sub), counting `conn`, which asks: the
/// same connection each time, so that a test connection closing does not count.
fn clients(conn: &mut ::redis::Connection) -> usize {
    let list: String = ::redis::cmd("CLIENT")
        .arg("LIST")
        .query(conn)
        .expect("CLIENT LIST");
    list.lines().filter(|l| !l.trim().is_empty()).count()
}

/// One locker, however many keys it holds and waits for, uses two connections: one
/// multiplexed connection for every command and one subscription for every waited key.
async fn one_connection_and_one_subscription_per_locker(flavor: Flavor) {
    let server = Server::start(flavor);
    let holder = Locker::redis(&server.url()).await.expect("connect");
    let mut held = Vec::new();
    for i in 0..50 {
        let key = format!("many:{i}");
        held.push(
            holder
                .try_acquire(&key, &opts(30_000))
                .await
                .expect("holder"),
        );
    }
    let mut test_conn = server.conn();
    let before = clients(&mut test_conn);
    let waiter_side = Locker::redis(&server.url()).await.expect("connect");
    let waiters: Vec<_> = (0..50)
        .map(|i| {
            let locker = waiter_side.clone();
            tokio::spawn(async move {
                let o = opts(30_000).wait(Duration::from_secs(20));
                let lease = locker.acquire(&format!("many:{i}"), &o).await;
                lease.map(|l| l.fence())
            })
        })
        .collect();
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        let channels: Vec<String> = ::redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .query(&mut test_conn)
            .expect("PUBSUB CHANNELS");
        if channels.len() == 50 {
            break;
        }
        assert!(
            Instant::now() < give_up,
            "{} of 50 keys subscribed",
            channels.len()
        );
        sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        clients(&mut test_conn) - before,
        2,
        "the waiting locker's connections (50 keys held, 50 waited for)"
    );
    for lease in held {
        lease.release().await.expect("release");
    }
    for w in waiters {
        w.await.expect("waiter").expect("each waiter gets its key");
    }
    assert_eq!(clients(&mut test_conn) - before, 2, "after the waits");
}

/// A server that takes the TCP connection but never answers (a stalled link): connecting
/// fails once `connection_timeout` has passed, rather than hanging.
async fn connecting_is_bounded_by_the_connection_timeout(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = support::proxy::Proxy::start(server.port).await;
    proxy.stall(true);
    let config = RedisConfig::default().connection_timeout(Duration::from_millis(500));
    let started = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        Locker::redis_with(&proxy.url(), config),
    )
    .await
    .expect("still connecting after 10 s");
    assert!(r.is_err(), "connected through a stalled link");
    // The whole connect within the timeout (and some slack), not one timeout per attempt of
    // the three the connection manager makes (1.5 s and its backoff, as it took before).
    assert!(
        started.elapsed() < Duration::from_millis(1_200),
        "gave up only after {:?}",
        started.elapsed()
    );
}

/// The connection drops and every new one hangs (the link stalls as the server's host goes):
/// the connection manager's reconnect, three connection attempts and their pauses, is not
/// waited for whole. An attempt ends within the response timeout, twice with the retry of an
/// outcome it cannot know, as the acquire docs say.
async fn a_hanging_reconnect_is_bounded_by_the_response_timeout(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = support::proxy::Proxy::start(server.port).await;
    let config = RedisConfig::default()
        .response_timeout(Duration::from_millis(300))
        .connection_timeout(Duration::from_millis(600));
    let locker = Locker::redis_with(&proxy.url(), config)
        .await
        .expect("connect");
    let o = opts(5_000).renew(false);
    locker
        .try_acquire("before", &o)
        .await
        .expect("acquire")
        .release()
        .await
        .expect("release");
    // Open connections closed; new ones taken, then never answered.
    proxy.stall(true);
    proxy.cut(true);
    proxy.cut(false);
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(30), locker.try_acquire("during", &o))
        .await
        .expect("still trying after 30 s");
    let took = started.elapsed();
    match r {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!("want OutcomeUnknown, got {:?}", other.map(|l| l.fence())),
    }
    // Two response timeouts (0.6 s) and slack; waited whole, a reconnect alone is three
    // connection timeouts (1.8 s) and the pauses between them.
    assert!(took < Duration::from_millis(1_200), "took {took:?}");
    proxy.stall(false);
    let again = acquire_retrying(&locker, "after").await;
    again.release().await.expect("release");
}

/// Waits (at most 5 s) until `n` connections were made through `proxy`: a locker's shared
/// connection comes first, then its subscription's.
async fn proxied_connections(proxy: &support::proxy::Proxy, n: usize) {
    let started = Instant::now();
    while proxy.connections() < n {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{} of {n} connections made through the proxy",
            proxy.connections()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A subscription slow to be confirmed (it may take a second) does not carry a short wait
/// past its deadline.
async fn a_slow_subscription_keeps_the_wait_deadline(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = support::proxy::Proxy::start(server.port).await;
    let locker = Locker::redis(&proxy.url()).await.expect("connect");
    // The locker's connections through the proxy: the shared one, then the subscription's.
    proxied_connections(&proxy, 2).await;
    let holder = Locker::redis(&server.url()).await.expect("connect");
    let held = holder
        .try_acquire("slow-sub", &opts(20_000))
        .await
        .expect("holder");
    proxy.delay_requests_of(1, Duration::from_millis(1500));
    let started = Instant::now();
    let waited = locker
        .acquire("slow-sub", &opts(5_000).wait(Duration::from_millis(150)))
        .await;
    let took = started.elapsed();
    assert!(
        matches!(waited, Err(Error::WaitTimeout { .. })),
        "{waited:?}"
    );
    assert!(
        took < Duration::from_millis(700),
        "a 150 ms wait took {took:?}"
    );
    held.release().await.expect("release");

    // The same for a queue's waiting claim, on the same slow subscription.
    let backend = leasehold::RedisBackend::connect(&proxy.url())
        .await
        .expect("connect");
    let queue = leasehold::queue::Queue::builder("slow-sub")
        .on_redis(backend)
        .expect("queue");
    proxied_connections(&proxy, 4).await;
    proxy.delay_requests_of(3, Duration::from_millis(1500));
    let started = Instant::now();
    let claimed = queue
        .claim_wait(Duration::from_secs(5), Duration::from_millis(150))
        .await
        .expect("claim_wait");
    let took = started.elapsed();
    assert!(claimed.is_none());
    assert!(
        took < Duration::from_millis(700),
        "a 150 ms claim wait took {took:?}"
    );
}

/// A subscription confirmed only after its waiter stopped waiting for the confirmation (a
/// second) still wakes that waiter: it tried again at the give-up, found the key held and went
/// to sleep on the holder's 20 s TTL; the release came before the SUBSCRIBE reached the server,
/// so its publish reached nobody. Once the late confirmation comes, the waiter tries again.
async fn a_late_confirmed_subscription_still_wakes_its_waiter(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = support::proxy::Proxy::start(server.port).await;
    // Patient enough that the subscription's own check (a PING every 5 s, delayed like the
    // rest) does not replace the connection, which would wake every waiter by itself.
    let patient = RedisConfig::default().response_timeout(Duration::from_secs(10));
    let locker = Locker::redis_with(&proxy.url(), patient)
        .await
        .expect("connect");
    proxied_connections(&proxy, 2).await;
    let holder = Locker::redis(&server.url()).await.expect("connect");
    let held = holder
        .try_acquire("late-sub", &opts(20_000))
        .await
        .expect("holder");
    proxy.delay_requests_of(1, Duration::from_millis(2_500));
    let started = Instant::now();
    let waiter = tokio::spawn(async move {
        let lease = locker
            .acquire("late-sub", &opts(5_000).wait(Duration::from_secs(30)))
            .await;
        (lease.map(|l| l.fence()), started.elapsed())
    });
    // Past the waiter's give-up on the confirmation, before its SUBSCRIBE reaches the server.
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    assert!(!waiter.is_finished(), "the key is held");
    let held_fence = held.fence();
    held.release().await.expect("release");
    let (lease, took) = waiter.await.expect("waiter");
    let fence = lease.expect("the waiter's lease");
    assert!(fence > held_fence, "{fence} after {held_fence}");
    assert!(
        took < Duration::from_secs(12),
        "woken by its timer ({took:?}), not by the late confirmation"
    );
}

/// Acquires that queue behind one another go out as one batch; callers that stop waiting
/// after their grants came back but before reading them (their futures dropped unpolled, as a
/// lost `select!` branch drops one) leave no key held: the grants are released.
async fn grants_answered_to_callers_who_left_are_released(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let o = LockOptions::new().ttl(Duration::from_secs(30)).renew(false);
    let keys: Vec<String> = (0..16).map(|i| format!("left-{i}")).collect();
    let mut calls: Vec<_> = keys
        .iter()
        .map(|k| Box::pin(locker.try_acquire(k, &o)))
        .collect();
    // Each call is polled once: it sends its acquire and waits. A call whose reply came back
    // within that one poll (this thread descheduled between the send and the look, on a loaded
    // machine) hands its lease over, and drops it unread here, which releases it too; at least
    // one call must be left waiting for the test to show anything.
    let waiting = std::future::poll_fn(|cx| {
        let mut waiting = 0;
        for c in &mut calls {
            waiting += usize::from(c.as_mut().poll(cx).is_pending());
        }
        std::task::Poll::Ready(waiting)
    })
    .await;
    assert!(waiting > 0, "every call was answered within its first poll");
    // The batch is answered into the callers' channels meanwhile; nobody reads them.
    sleep(Duration::from_millis(500)).await;
    drop(calls);
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<String> = server.cmd(&["KEYS", "*left-*:lock"]);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < give_up, "held by nobody: {left:?}");
        sleep(Duration::from_millis(20)).await;
    }
}

/// A wait of zero on a held key ends at once, without subscribing for wake-ups it cannot use
/// (nor unsubscribing after), as `try_acquire` would.
async fn a_zero_wait_does_not_subscribe(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let held = locker
        .try_acquire("zero", &opts(20_000))
        .await
        .expect("holder");
    start_counting(&server, &locker).await;
    for _ in 0..3 {
        let r = locker
            .acquire("zero", &opts(5_000).wait(Duration::ZERO))
            .await;
        assert!(matches!(r, Err(Error::WaitTimeout { .. })), "{r:?}");
    }
    assert_eq!(calls(&server, "subscribe"), 0, "a zero wait subscribed");
    held.release().await.expect("release");
}

/// Bad input is refused before any round trip, as the README says: not one command reaches
/// the server for an empty or oversized key, a zero or oversized TTL, or a zero extend.
async fn bad_input_reaches_no_server(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let held = locker
        .try_acquire("held", &opts(30_000).renew(false))
        .await
        .expect("grant");
    start_counting(&server, &locker).await;
    let long_key = "k".repeat(leasehold::MAX_KEY_LEN + 1);
    let too_long = leasehold::MAX_TTL + Duration::from_millis(1);
    for (what, r) in [
        ("empty key", locker.try_acquire("", &opts(1_000)).await),
        (
            "long key",
            locker.try_acquire(&long_key, &opts(1_000)).await,
        ),
        (
            "zero ttl",
            locker
                .try_acquire("k", &LockOptions::new().ttl(Duration::ZERO))
                .await,
        ),
        (
            "long ttl",
            locker
                .try_acquire("k", &LockOptions::new().ttl(too_long))
                .await,
        ),
        (
            "waiting, empty key",
            locker
                .acquire("", &opts(1_000).wait(Duration::from_secs(1)))
                .await,
        ),
    ] {
        assert!(
            matches!(r, Err(Error::InvalidKey { .. } | Error::InvalidTtl { .. })),
            "{what}: {:?}",
            r.map(|l| l.fence())
        );
    }
    let extended = held.extend(Duration::ZERO).await;
    assert!(
        matches!(extended, Err(Error::InvalidTtl { .. })),
        "{extended:?}"
    );
    // Every command but this test's own (`CONFIG RESETSTAT`, `INFO`) and those of connections
    // the locker makes in the background whatever the caller does (the handshake's `HELLO`
    // and `CLIENT SETINFO`, the subscription's `PING` every 5 s).
    let stats = server.cmd::<String>(&["INFO", "commandstats"]);
    let background = ["info:", "ping:", "config|", "client|", "hello:", "select:"];
    let reached: Vec<&str> = stats
        .lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter(|l| !background.iter().any(|b| l.starts_with(b)))
        .collect();
    assert!(
        reached.is_empty(),
        "commands reached the server: {reached:?}"
    );
    held.release().await.expect("release");
}

/// Calls of `command` the server has answered since its stats were last reset.
fn calls(server: &Server, command: &str) -> u64 {
    let stats = server.info_field("commandstats", &format!("cmdstat_{command}"));
    stats
        .strip_prefix("calls=")
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// How many `command` calls the server refused before running them (an ACL rule, say).
fn rejected(server: &Server, command: &str) -> u64 {
    let stats = server.info_field("commandstats", &format!("cmdstat_{command}"));
    stats
        .split(',')
        .find_map(|field| field.strip_prefix("rejected_calls="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Loads the scripts (so that NOSCRIPT retries do not count), then zeroes the command counts.
async fn start_counting(server: &Server, locker: &Locker) {
    let warm = locker
        .try_acquire("warm", &opts(5_000))
        .await
        .expect("warm");
    warm.release().await.expect("release");
    let _: () = server.cmd(&["CONFIG", "RESETSTAT"]);
}

/// Releases `held`, then waits for `waiters`: each must get its key, woken by a release (within
/// 5 s, where the holders' 20 s TTL would be what wakes a waiter that missed it).
async fn released_to(
    held: Vec<leasehold::Lease>,
    waiters: Vec<tokio::task::JoinHandle<(Result<leasehold::Fence, Error>, String)>>,
) {
    let started = Instant::now();
    for lease in held {
        lease.release().await.expect("release");
    }
    for w in waiters {
        let (got, key) = w.await.expect("waiter");
        assert!(got.is_ok(), "{key}: {got:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "woken by timers ({:?}), not by the releases",
        started.elapsed()
    );
}

/// Waiters that start waiting on many keys at once subscribe in a few `SUBSCRIBE` commands, not
/// one each in turn, and each is woken by its key's release; their subscriptions end in a few
/// `UNSUBSCRIBE`s. One channel an ACL rule refuses
/// among them costs only its own subscription (the burst is sent again channel by channel).
async fn a_burst_of_waiters_subscribes_in_few_commands(flavor: Flavor) {
    const KEYS: usize = 40;
    let server = Server::start(flavor);
    let _: () = server.cmd(&[
        "ACL",
        "SETUSER",
        "some-channels",
        "on",
        ">pw",
        "~*",
        "&*burst*",
        "+@all",
    ]);
    // A link of 10 ms round trips: a SUBSCRIBE takes long enough for the waiters' to queue
    // behind it (on loopback each is confirmed before the next waiter asks).
    let proxy = support::proxy::Proxy::start(server.port).await;
    proxy.set_latency(Duration::from_millis(5));
    let url = proxy.url().replacen("://", "://some-channels:pw@", 1);
    let waiting = Locker::redis(&url).await.expect("connect");
    let holding = Locker::redis(&server.url()).await.expect("connect");
    let hold = |keys: Vec<String>| {
        let holding = holding.clone();
        async move {
            let mut held = Vec::new();
            for key in keys {
                held.push(
                    holding
                        .try_acquire(&key, &opts(20_000))
                        .await
                        .expect("hold"),
                );
            }
            held
        }
    };
    let wait = |keys: Vec<String>| {
        keys.into_iter()
            .map(|key| {
                let locker = waiting.clone();
                tokio::spawn(async move {
                    let wait = opts(5_000).wait(Duration::from_secs(15));
                    (locker.acquire(&key, &wait).await.map(|l| l.fence()), key)
                })
            })
            .collect::<Vec<_>>()
    };
    let subscribed = |keys: &[String]| {
        let channels: Vec<String> = keys
            .iter()
            .map(|k| holding.lock_key(k).expect("key").channel().to_owned())
            .collect();
        let server = &server;
        async move {
            for channel in channels {
                server.wait_for_subscriber(&channel).await;
            }
        }
    };
    let burst: Vec<String> = (0..KEYS).map(|i| format!("burst-{i}")).collect();
    let held = hold(burst.clone()).await;
    start_counting(&server, &waiting).await;
    let waiters = wait(burst.clone());
    subscribed(&burst).await;
    let subscribes = calls(&server, "subscribe");
    assert!(
        (1..=10).contains(&subscribes),
        "{subscribes} SUBSCRIBE commands for {KEYS} keys"
    );
    released_to(held, waiters).await;

    // The waiters are gone, and so are their subscriptions: in a few commands as well.
    let left = Instant::now();
    for key in &burst {
        let channel = holding.lock_key(key).expect("key").channel().to_owned();
        while server
            .cmd::<(String, i64)>(&["PUBSUB", "NUMSUB", &channel])
            .1
            > 0
        {
            assert!(
                left.elapsed() < Duration::from_secs(5),
                "{channel} still subscribed"
            );
            sleep(Duration::from_millis(10)).await;
        }
    }
    let unsubscribes = calls(&server, "unsubscribe");
    assert!(
        (1..=10).contains(&unsubscribes),
        "{unsubscribes} UNSUBSCRIBE commands for {KEYS} keys"
    );

    // A burst with a channel the ACL rule refuses: the others are subscribed all the same. The
    // subscription connection's requests are slowed so that the burst queues behind the first
    // SUBSCRIBE and goes as one, which the server refuses whole (counted), then one by one.
    let mut mixed: Vec<String> = (KEYS..KEYS + 5).map(|i| format!("burst-{i}")).collect();
    mixed.push("denied".to_owned());
    let held = hold(mixed.clone()).await;
    proxy.delay_requests_of(1, Duration::from_millis(300));
    let refused_before = rejected(&server, "subscribe");
    let mut waiters = wait(mixed.clone());
    mixed.pop();
    subscribed(&mixed).await;
    // The refused burst, then the denied channel alone (sent last, after the others, so
    // counted a little later): two refusals.
    let counting = Instant::now();
    while rejected(&server, "subscribe") - refused_before < 2 {
        assert!(
            counting.elapsed() < Duration::from_secs(5),
            "{} SUBSCRIBE refused: the denied channel was never in a refused burst",
            rejected(&server, "subscribe") - refused_before
        );
        sleep(Duration::from_millis(10)).await;
    }
    let on_denied = waiters.pop().expect("the denied key's waiter");
    let mut held = held;
    let denied = held.pop().expect("the denied key's lease");
    released_to(held, waiters).await;
    // Its waiter, unsubscribed, would take the key on its timer once freed
    // (`a_refused_subscription_costs_only_its_own_key`); not waited for here.
    assert!(!on_denied.is_finished(), "the denied key is still held");
    on_denied.abort();
    denied.release().await.expect("release");
}

/// Renewal on one server goes in batches: one script call per 256 leases (README), not one per
/// lease. 600 renewing leases for two TTLs: about three calls a round, where lease by lease it
/// would be 600.
async fn renewal_is_batched(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let ttl = Duration::from_secs(2);
    let names: Vec<String> = (0..600).map(|i| format!("batched-{i}")).collect();
    let o = LockOptions::new().ttl(ttl);
    let leases =
        futures_util::future::try_join_all(names.iter().map(|n| locker.try_acquire(n, &o)))
            .await
            .expect("grants");
    let _: () = server.cmd(&["CONFIG", "RESETSTAT"]);
    let window = Instant::now();
    sleep(ttl * 2).await;
    let scripts = calls(&server, "evalsha") + calls(&server, "eval");
    // Renewals come every third of the TTL, and one more may start as the window closes.
    // Leases fall due as they were granted, within a sixth of the TTL of each other unless the
    // machine is slow: those further apart may take one round more to come into step.
    let rounds =
        u64::try_from(window.elapsed().as_millis() / (ttl / 3).as_millis()).expect("ms") + 1;
    let batches = 600u64.div_ceil(256);
    assert!(
        scripts >= rounds - 1,
        "{scripts} script calls in {rounds} rounds: not renewed?"
    );
    assert!(
        scripts <= batches * (rounds + 1),
        "{scripts} script calls for 600 leases in {rounds} rounds"
    );
    assert!(leases.iter().all(|l| !l.is_lost()), "a lease was lost");
}

/// Acquires and releases that arrive while others are in flight share script calls, and each
/// caller still gets its own grant, fence and release.
async fn concurrent_calls_share_scripts(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    start_counting(&server, &locker).await;

    let keys: Vec<String> = (0..64).map(|i| format!("many:{i}")).collect();
    let o = opts(30_000).renew(false);
    let before = server.time_micros();
    let leases = futures_util::future::join_all(keys.iter().map(|k| locker.try_acquire(k, &o)))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .expect("every distinct key is granted");
    let acquire_calls = calls(&server, "evalsha");
    assert_eq!(
        acquire_calls, 2,
        "64 acquires: one alone, then the 63 queued behind it in one call"
    );
    let after = server.time_micros();
    for lease in &leases {
        let fence = lease.fence().0;
        assert!(
            (before..=after).contains(&fence),
            "fence {fence} is not the server's clock during the acquires ({before}..={after})"
        );
    }
    for (k, lease) in keys.iter().zip(&leases) {
        let lock_key = locker.lock_key(k).expect("key");
        let stored: String = server.cmd(&["GET", lock_key.lock_key()]);
        assert_eq!(stored, lease.token().as_str(), "{k} holds its own token");
    }

    let released = futures_util::future::join_all(leases.into_iter().map(|l| l.release())).await;
    for r in released {
        assert_eq!(r.expect("release"), Release::Released);
    }
    let release_calls = calls(&server, "evalsha") - acquire_calls;
    assert_eq!(
        release_calls, 2,
        "64 releases: one alone, then the 63 queued behind it in one call"
    );
    let left: Vec<String> = server.cmd(&["KEYS", "*:lock"]);
    assert!(left.is_empty(), "locks left after release: {left:?}");
}

/// Acquires `keys` at once (30 s, no renewal), checking that they went out as one batch
/// beside the first lone call: otherwise a test of batches proves nothing.
async fn acquire_in_one_batch(
    server: &Server,
    locker: &Locker,
    keys: &[String],
) -> Vec<leasehold::Result<leasehold::Lease>> {
    start_counting(server, locker).await;
    let o = opts(30_000).renew(false);
    let results =
        futures_util::future::join_all(keys.iter().map(|k| locker.try_acquire(k, &o))).await;
    assert_eq!(
        calls(server, "evalsha") + calls(server, "eval"),
        2,
        "the acquires did not share calls, so this proves nothing about batches"
    );
    results
}

/// The same batch as a user who may not run `TYPE` (which only names a foreign key's type):
/// the foreign key's item fails with the server's refusal, and the rest of the batch is
/// granted, not failed after some of it was written, which would leave those keys held by
/// nobody.
async fn a_refused_type_fails_only_its_own_item(flavor: Flavor) {
    let server = Server::start(flavor);
    let _: () = server.cmd(&[
        "ACL", "SETUSER", "no-type", "on", ">pw", "~*", "&*", "+@all", "-type",
    ]);
    let url = server.url().replacen("://", "://no-type:pw@", 1);
    let locker = Locker::redis(&url).await.expect("connect");
    let keys: Vec<String> = (0..32).map(|i| format!("typeless:{i}")).collect();
    let list = locker.lock_key(&keys[5]).expect("key");
    let _: i64 = server.cmd(&["RPUSH", list.lock_key(), "precious"]);
    let results = acquire_in_one_batch(&server, &locker, &keys).await;
    for (i, r) in results.into_iter().enumerate() {
        match (i, r) {
            (5, Err(_)) => {}
            (5, Ok(_)) => panic!("the foreign key was granted"),
            (_, Ok(lease)) => {
                lease.release().await.expect("release");
            }
            (_, Err(e)) => {
                let k = locker.lock_key(&keys[i]).expect("key");
                let held: i64 = server.cmd(&["EXISTS", k.lock_key()]);
                panic!("item {i} failed beside the foreign key ({e}); its key held: {held}");
            }
        }
    }
    let kept: Vec<String> = server.cmd(&["LRANGE", list.lock_key(), "0", "-1"]);
    assert_eq!(kept, vec!["precious".to_owned()]);
}

/// A locker logged in as `some-keys`, made with every key allowed.
async fn some_keys_locker(server: &Server) -> Locker {
    some_keys(server, &["~*"]);
    let url = server.url().replacen("://", "://some-keys:pw@", 1);
    Locker::redis(&url).await.expect("connect")
}

/// Whether `e` is the server's ACL refusal (`NOPERM`).
fn is_noperm(e: &Error) -> bool {
    matches!(e, Error::Refused { source, .. } if source.code() == Some("NOPERM"))
}

/// A key the ACL user may not touch refuses the whole script call that names it (the server
/// checks every key a call declares before the script runs): its own item fails, and the
/// others of that call are sent again one a call and answered, acquires and releases alike.
async fn a_key_the_user_may_not_touch_fails_only_its_own_item(flavor: Flavor) {
    let server = Server::start(flavor);
    let user = |keys: &[&str]| some_keys(&server, keys);
    let locker = some_keys_locker(&server).await;
    let mut keys: Vec<String> = (0..32).map(|i| format!("ok:{i}")).collect();
    keys[5] = "denied:5".to_owned();
    let only_ok = ["~*ok:*", "~*warm*"];

    // Acquires: the shared call is refused, then each of its items goes alone.
    user(&only_ok);
    start_counting(&server, &locker).await;
    let o = opts(30_000).renew(false);
    let results =
        futures_util::future::join_all(keys.iter().map(|k| locker.try_acquire(k, &o))).await;
    assert_eq!(
        (calls(&server, "evalsha"), rejected(&server, "evalsha")),
        (31, 2),
        "want: the first acquire alone, the other 31 refused together, then each alone"
    );
    let mut leases = Vec::new();
    for (i, r) in results.into_iter().enumerate() {
        match (i, r) {
            (5, Err(e)) => assert!(is_noperm(&e), "item 5: {e}"),
            (5, Ok(_)) => panic!("the key outside the user's patterns was granted"),
            (_, Ok(lease)) => leases.push(lease),
            (_, Err(e)) => panic!("item {i} failed beside the refused key: {e}"),
        }
    }
    for lease in leases {
        assert_eq!(lease.release().await.expect("release"), Release::Released);
    }

    // Releases: all 32 taken while every key was allowed, then released under the narrower rule.
    user(&["~*"]);
    let leases: Vec<_> =
        futures_util::future::join_all(keys.iter().map(|k| locker.try_acquire(k, &o)))
            .await
            .into_iter()
            .map(|r| r.expect("acquire with every key allowed"))
            .collect();
    user(&only_ok);
    let _: () = server.cmd(&["CONFIG", "RESETSTAT"]);
    let released = futures_util::future::join_all(leases.into_iter().map(|l| l.release())).await;
    assert_eq!(
        (calls(&server, "evalsha"), rejected(&server, "evalsha")),
        (31, 2),
        "want: the first release alone, the other 31 refused together, then each alone"
    );
    for (i, r) in released.into_iter().enumerate() {
        let lock = locker.lock_key(&keys[i]).expect("key");
        let held: i64 = server.cmd(&["EXISTS", lock.lock_key()]);
        match (i, r) {
            (5, Err(e)) => {
                assert!(is_noperm(&e), "item 5: {e}");
                assert_eq!(held, 1, "the refused release deleted its key");
            }
            (5, Ok(r)) => panic!("the key outside the user's patterns was released: {r:?}"),
            (_, Ok(r)) => {
                assert_eq!(r, Release::Released, "item {i}");
                assert_eq!(held, 0, "item {i} still held after its release");
            }
            (_, Err(e)) => panic!("item {i} failed beside the refused key: {e}"),
        }
    }
}

/// A renewal call shared by a lease whose key the ACL user may no longer touch: that lease,
/// retried alone until its deadline, is told it is lost before it, and the lease beside it
/// keeps being renewed (with the whole call refused for both, it was lost too).
async fn a_key_the_user_may_no_longer_touch_loses_only_its_own_lease(flavor: Flavor) {
    let server = Server::start(flavor);
    let user = |keys: &[&str]| some_keys(&server, keys);
    let locker = some_keys_locker(&server).await;
    let o = opts(1_500);
    let (kept, revoked) = tokio::join!(
        locker.try_acquire("ok:kept", &o),
        locker.try_acquire("denied:revoked", &o)
    );
    let (kept, revoked) = (kept.expect("acquire"), revoked.expect("acquire"));
    user(&["~*ok:*"]);
    let _: () = server.cmd(&["CONFIG", "RESETSTAT"]);
    tokio::time::timeout(Duration::from_secs(3), revoked.lost())
        .await
        .expect("the lease the user may no longer touch was not told it is lost");
    // Two TTLs more: the other lease must have been renewed all along.
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    assert!(!kept.is_lost(), "the lease beside the refused key was lost");
    let lock = locker.lock_key("ok:kept").expect("key");
    let pttl: i64 = server.cmd(&["PTTL", lock.lock_key()]);
    assert!(
        pttl > 0,
        "the kept lease's key is gone from the server ({pttl})"
    );
    assert!(
        rejected(&server, "evalsha") >= 2,
        "want: the shared renewal refused, then the revoked lease's own (and its retries)"
    );
    assert_eq!(kept.release().await.expect("release"), Release::Released);
}

/// One item of a shared call that meets a foreign type fails alone: the others are granted,
/// and nothing is written for it.
async fn one_foreign_key_in_a_batch(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let keys: Vec<String> = (0..32).map(|i| format!("mixed:{i}")).collect();
    let list = locker.lock_key(&keys[5]).expect("key");
    let _: i64 = server.cmd(&["RPUSH", list.lock_key(), "precious"]);
    let hash = locker.lock_key(&keys[9]).expect("key");
    let _: i64 = server.cmd(&["HSET", hash.fence_key(), "f", "v"]);
    let results = acquire_in_one_batch(&server, &locker, &keys).await;
    for (i, r) in results.into_iter().enumerate() {
        match (i, r) {
            (5, Err(Error::WrongType { server_key, found })) => {
                assert_eq!(
                    (server_key.as_str(), found.as_str()),
                    (list.lock_key(), "list")
                );
            }
            (9, Err(Error::WrongType { server_key, found })) => {
                assert_eq!(
                    (server_key.as_str(), found.as_str()),
                    (hash.fence_key(), "hash")
                );
            }
            (5 | 9, other) => panic!("item {i}: want WrongType, got {other:?}"),
            (_, Ok(_)) => {}
            (_, Err(e)) => panic!("item {i} failed beside a foreign key: {e}"),
        }
    }
    let kept: Vec<String> = server.cmd(&["LRANGE", list.lock_key(), "0", "-1"]);
    assert_eq!(kept, vec!["precious".to_owned()]);
    assert_eq!(
        server.cmd::<i64>(&["EXISTS", hash.lock_key()]),
        0,
        "the lock whose fence key is foreign was taken back"
    );
}

/// `holding` holds `key` while a task waits for it on `waiting`; once the waiter is subscribed
/// and has found the key held once more, `fault` runs and the holder releases. How long after
/// the release the waiter got the key (its fence checked above the holder's).
async fn woken_after_release<B: leasehold::Backend + Clone + 'static>(
    server: &Server,
    holding: &Locker,
    waiting: &Locker<B>,
    key: &'static str,
    fault: impl FnOnce(),
) -> Duration {
    let held = holding.try_acquire(key, &opts(30_000)).await.expect("hold");
    let waiter = tokio::spawn({
        let waiting = waiting.clone();
        async move {
            waiting
                .acquire(key, &opts(5_000).wait(Duration::from_secs(40)))
                .await
                .map(|l| l.fence())
        }
    });
    let channel = holding.lock_key(key).expect("key").channel().to_owned();
    server.wait_for_subscriber(&channel).await;
    // Subscribed, the waiter asks once more; let that find the key held.
    sleep(Duration::from_millis(300)).await;
    fault();
    let held_fence = held.fence();
    let released_at = Instant::now();
    held.release().await.expect("release");
    let fence = waiter
        .await
        .expect("waiter task")
        .expect("the waiter got the key");
    assert!(fence > held_fence);
    released_at.elapsed()
}

/// A subscription the server refuses for one channel (an ACL user whose channel rule leaves
/// out some keys): the waiters on that key fall back to their timers, and the one connection
/// serving every other key's wake-ups carries on. A refused channel once broke the connection,
/// and every reconnect, resubscribing all channels in one command, was refused again: a tight
/// reconnect loop, and no wake-up for any key.
async fn a_refused_subscription_costs_only_its_own_key(flavor: Flavor) {
    let server = Server::start(flavor);
    let _: () = server.cmd(&[
        "ACL",
        "SETUSER",
        "few-channels",
        "on",
        ">pw",
        "~*",
        "&*allowed*",
        "+@all",
    ]);
    let url = server.url().replacen("://", "://few-channels:pw@", 1);
    let waiting = Locker::redis(&url).await.expect("connect");
    let holding = Locker::redis(&server.url()).await.expect("connect");
    let denied = holding
        .try_acquire("denied", &opts(20_000))
        .await
        .expect("hold");
    let allowed = holding
        .try_acquire("allowed", &opts(20_000))
        .await
        .expect("hold");
    let wait = |key: &'static str| {
        let locker = waiting.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let got = locker
                .acquire(key, &opts(5_000).wait(Duration::from_secs(15)))
                .await;
            (got.map(|l| l.fence()), started.elapsed())
        })
    };
    let on_denied = wait("denied");
    sleep(Duration::from_millis(200)).await;
    let on_allowed = wait("allowed");
    let channel = holding
        .lock_key("allowed")
        .expect("key")
        .channel()
        .to_owned();
    server.wait_for_subscriber(&channel).await;
    let connections = || -> u64 {
        server
            .info_field("stats", "total_connections_received")
            .parse()
            .expect("a count")
    };
    let before = connections();
    sleep(Duration::from_secs(1)).await;
    let made = connections() - before;
    assert!(
        made <= 2,
        "{made} connections in a second: the subscriber reconnects in a loop"
    );
    let released_at = Instant::now();
    allowed.release().await.expect("release");
    let (fence, _) = on_allowed.await.expect("waiter task");
    fence.expect("the waiter on the allowed key got it");
    assert!(
        released_at.elapsed() < Duration::from_secs(2),
        "woken {:?} after the release: by its timer, not by the release",
        released_at.elapsed()
    );
    assert!(
        !on_denied.is_finished(),
        "the waiter on the held key got it"
    );
    on_denied.abort();
    drop(denied);
}

/// The subscription connection goes silent without closing (its peer gone: a half-open
/// connection, as after a failover moved the server's address): a `PING` every 5 s finds it
/// out, and once the new connection is subscribed every waiter is woken, so a release sent into
/// the silent one costs a waiter seconds rather than the holder's whole TTL.
async fn a_silent_subscription_is_replaced(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = support::proxy::Proxy::start(server.port).await;
    let config = leasehold::RedisConfig::default().response_timeout(Duration::from_millis(500));
    let backend = leasehold::RedisBackend::connect_with(&proxy.url(), config)
        .await
        .expect("connect");
    let waiting = Locker::new(backend);
    // The locker's connections through the proxy: the shared one, then the subscription's.
    let started = Instant::now();
    while proxy.connections() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the subscription connection was not made"
        );
        sleep(Duration::from_millis(10)).await;
    }
    let holding = Locker::redis(&server.url()).await.expect("connect");
    let waited = woken_after_release(&server, &holding, &waiting, "silent", || {
        proxy.black_hole(1)
    })
    .await;
    // The README's promise: replaced within the 5 s check and the response timeout (0.5 s
    // here), plus the reconnect and resubscribe.
    assert!(
        waited < Duration::from_secs(7),
        "woken {waited:?} after the release: not within the 5 s check and the response timeout"
    );
    assert!(
        proxy.connections() >= 3,
        "no new subscription connection was made"
    );
}

/// The shared command connection goes silent (its peer gone without closing it, as after a
/// failover that moved the address): the requests on it time out, a check finds it silent and
/// replaces it, and the locker grants again within seconds. (It kept sending on the silent
/// connection, every call timing out, until the kernel gave up on the socket.)
async fn a_silent_command_connection_is_replaced(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = support::proxy::Proxy::start(server.port).await;
    let config = leasehold::RedisConfig::default()
        .response_timeout(Duration::from_millis(300))
        .connection_timeout(Duration::from_millis(500));
    let locker = Locker::redis_with(&proxy.url(), config)
        .await
        .expect("connect");
    let warm = locker
        .try_acquire("warm", &LockOptions::new())
        .await
        .expect("warm");
    warm.release().await.expect("release");
    // The shared connection is the locker's first (the subscription's comes after it).
    let before = proxy.connections();
    proxy.black_hole(0);
    // Traffic beside the loop below, so that requests sent on the silent connection go on
    // timing out after it was replaced: they must not replace the new one again.
    let traffic: Vec<_> = (0..4)
        .map(|i| {
            let locker = locker.clone();
            tokio::spawn(async move {
                let end = Instant::now() + Duration::from_secs(4);
                while Instant::now() < end {
                    if let Ok(l) = locker
                        .try_acquire(&format!("traffic:{i}"), &LockOptions::new())
                        .await
                    {
                        let _ = l.release().await;
                    }
                    sleep(Duration::from_millis(100)).await;
                }
            })
        })
        .collect();
    let (lease, failures) = support::granted_again(
        &locker,
        "after",
        &LockOptions::new(),
        Duration::from_secs(10),
    )
    .await;
    assert!(failures >= 1, "the silent connection never failed a call");
    lease.release().await.expect("release");
    for t in traffic {
        t.await.expect("traffic");
    }
    assert_eq!(
        proxy.connections(),
        before + 1,
        "not exactly one new connection for one silent one"
    );
}

/// A Redis `Locker` kept beyond the runtime it connected on (in a static, used from one
/// `#[tokio::test]` runtime after another): on the next runtime it still grants, and a waiter
/// is still woken by a release, the subscription started again there. Its first subscription
/// task died with the first runtime, and every later waiter slept to the holder's TTL.
fn a_locker_outlives_the_runtime_it_connected_on(flavor: Flavor) {
    let server = Server::start(flavor);
    let first = support::runtime();
    let locker = first.block_on(async {
        let locker = Locker::redis(&server.url()).await.expect("connect");
        // A wait on the first runtime starts the subscription there.
        let holding = Locker::redis(&server.url()).await.expect("connect");
        woken_after_release(&server, &holding, &locker, "first", || {}).await;
        locker
    });
    drop(first);
    support::runtime().block_on(async {
        let lease = locker
            .try_acquire("second", &opts(5_000))
            .await
            .expect("grant");
        lease.release().await.expect("release");
        let holding = Locker::redis(&server.url()).await.expect("connect");
        let waited = woken_after_release(&server, &holding, &locker, "second", || {}).await;
        assert!(
            waited < Duration::from_secs(5),
            "woken {waited:?} after the release: by its timer, not by the release"
        );
    });
}

/// As above, with a waiter already asleep when the first runtime shuts down: it waits on the
/// second runtime, subscribed through the first runtime's task, which goes. The next wait on
/// another key starts the subscription again, which subscribes every watched channel and
/// wakes their waiters, so the sleeping waiter hears a release from then on.
fn a_waiter_asleep_when_the_subscription_went_is_heard_again(flavor: Flavor) {
    let server = Server::start(flavor);
    let first = support::runtime();
    let locker = first.block_on(async { Locker::redis(&server.url()).await.expect("connect") });
    let second = support::runtime();
    let holding = second.block_on(async { Locker::redis(&server.url()).await.expect("connect") });
    let hold = |key: &'static str| {
        second.block_on(async { holding.try_acquire(key, &opts(30_000)).await.expect("hold") })
    };
    let (asleep_on, other) = (hold("asleep"), hold("other"));
    let wait = |key: &'static str| {
        let locker = locker.clone();
        second.spawn(async move {
            locker
                .acquire(key, &opts(5_000).wait(Duration::from_secs(40)))
                .await
                .map(|l| l.fence())
        })
    };
    let channel = |key| holding.lock_key(key).expect("key").channel().to_owned();
    let asleep = wait("asleep");
    second.block_on(server.wait_for_subscriber(&channel("asleep")));
    // The subscription task, and the channel's subscription with it, go with the first runtime.
    drop(first);
    second.block_on(async {
        let started = Instant::now();
        loop {
            let (_, n): (String, i64) = server.cmd(&["PUBSUB", "NUMSUB", &channel("asleep")]);
            if n == 0 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "still subscribed"
            );
            sleep(Duration::from_millis(20)).await;
        }
    });
    let _next = wait("other");
    second.block_on(async {
        server.wait_for_subscriber(&channel("asleep")).await;
        sleep(Duration::from_millis(300)).await;
        let released_at = Instant::now();
        asleep_on.release().await.expect("release");
        asleep.await.expect("task").expect("the waiter got the key");
        assert!(
            released_at.elapsed() < Duration::from_secs(5),
            "woken {:?} after the release: by its timer, not by the release",
            released_at.elapsed()
        );
        drop(other);
    });
}

/// The scenarios that build their own runtimes, as plain `#[test]`s on Redis and on Valkey.
macro_rules! across_runtimes {
    ($($scenario:ident),* $(,)?) => {
        mod across_runtimes {
            $(
                mod $scenario {
                    #[test]
                    fn on_redis() {
                        super::super::$scenario(super::super::Flavor::Redis);
                    }
                    #[test]
                    fn on_valkey() {
                        super::super::$scenario(super::super::Flavor::Valkey);
                    }
                }
            )*
        }
    };
}

across_runtimes!(
    a_locker_outlives_the_runtime_it_connected_on,
    a_waiter_asleep_when_the_subscription_went_is_heard_again,
);

macro_rules! faults {
    ($modname:ident, $flavor:expr) => {
        mod $modname {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn fence_survives_restart() {
                super::fence_survives_restart($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_fence_is_the_servers_clock_when_none_is_stored() {
                super::a_fence_is_the_servers_clock_when_none_is_stored($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn fence_ahead_of_the_clock_rises_by_one() {
                super::fence_ahead_of_the_clock_rises_by_one($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn script_flush() {
                super::script_flush($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_hanging_reconnect_is_bounded_by_the_response_timeout() {
                super::a_hanging_reconnect_is_bounded_by_the_response_timeout($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn client_kill() {
                super::client_kill($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_refused_reconnect_is_tried_again() {
                super::a_refused_reconnect_is_tried_again($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_server_busy_with_a_script_keeps_the_connection() {
                super::a_server_busy_with_a_script_keeps_the_connection($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_refused_reconnect_over_resp3_is_tried_again() {
                super::a_refused_reconnect_over_resp3_is_tried_again($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn wrong_type() {
                super::wrong_type($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn holder_process_killed() {
                super::holder_process_killed($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn waiters_woken_after_resubscribe() {
                super::waiters_woken_after_resubscribe($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_subscription_dropped_at_once_is_paced() {
                super::a_subscription_dropped_at_once_is_paced($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewal_is_batched() {
                super::renewal_is_batched($flavor).await
            }
            // One thread: every call is made before the scheduled flush can run, so the
            // count of script calls is exact (with two, the flush may run while calls are
            // still being made, and take them in several batches).
            #[tokio::test(flavor = "current_thread")]
            async fn concurrent_calls_share_scripts() {
                super::concurrent_calls_share_scripts($flavor).await
            }
            #[tokio::test(flavor = "current_thread")]
            async fn a_refused_type_fails_only_its_own_item() {
                super::a_refused_type_fails_only_its_own_item($flavor).await
            }
            #[tokio::test(flavor = "current_thread")]
            async fn a_key_the_user_may_not_touch_fails_only_its_own_item() {
                super::a_key_the_user_may_not_touch_fails_only_its_own_item($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_key_the_user_may_no_longer_touch_loses_only_its_own_lease() {
                super::a_key_the_user_may_no_longer_touch_loses_only_its_own_lease($flavor).await
            }
            #[tokio::test(flavor = "current_thread")]
            async fn one_foreign_key_in_a_batch() {
                super::one_foreign_key_in_a_batch($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn connecting_is_bounded_by_the_connection_timeout() {
                super::connecting_is_bounded_by_the_connection_timeout($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_slow_subscription_keeps_the_wait_deadline() {
                super::a_slow_subscription_keeps_the_wait_deadline($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_late_confirmed_subscription_still_wakes_its_waiter() {
                super::a_late_confirmed_subscription_still_wakes_its_waiter($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn grants_answered_to_callers_who_left_are_released() {
                super::grants_answered_to_callers_who_left_are_released($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn bad_input_reaches_no_server() {
                super::bad_input_reaches_no_server($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_zero_wait_does_not_subscribe() {
                super::a_zero_wait_does_not_subscribe($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn held_without_expiry() {
                super::held_without_expiry($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_connection_and_one_subscription_per_locker() {
                super::one_connection_and_one_subscription_per_locker($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn server_goes_away() {
                super::server_goes_away($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_wait_ends_at_the_first_error_of_a_server_that_went_away() {
                super::a_wait_ends_at_the_first_error_of_a_server_that_went_away($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn queued_waiters_end_with_the_first_error() {
                super::queued_waiters_end_with_the_first_error($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_gate_forgets_at_a_restart_without_persistence() {
                super::a_gate_forgets_at_a_restart_without_persistence($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_gate_that_holds_no_fence_refuses() {
                super::a_gate_that_holds_no_fence_refuses($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_silent_subscription_is_replaced() {
                super::a_silent_subscription_is_replaced($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_silent_command_connection_is_replaced() {
                super::a_silent_command_connection_is_replaced($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_burst_of_waiters_subscribes_in_few_commands() {
                super::a_burst_of_waiters_subscribes_in_few_commands($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_refused_subscription_costs_only_its_own_key() {
                super::a_refused_subscription_costs_only_its_own_key($flavor).await
            }
        }
    };
}

faults!(redis, Flavor::Redis);
faults!(valkey, Flavor::Valkey);

/// The child side of `holder_process_killed`: holds a renewing lease until it is killed. It is
/// an entry point for that child process, not a check of its own, so it is ignored in normal
/// runs and the parent starts it with `--ignored`.
#[tokio::test]
#[ignore = "entry point of the holder process spawned by holder_process_killed"]
async fn holder_child() {
    let Ok(url) = std::env::var("LEASEHOLD_CHILD_URL") else {
        return;
    };
    let locker = Locker::redis(&url).await.expect("child connects");
    let lease = locker
        .try_acquire("killed", &opts(1_000))
        .await
        .expect("child acquires");
    println!("HELD {}", lease.fence());
    sleep(Duration::from_secs(60)).await;
}

/// Scenario 11 with a real process: a holder process renewing its lease is SIGKILLed; another
/// acquires within one TTL plus a small margin.
async fn holder_process_killed(flavor: Flavor) {
    use std::io::{BufRead, BufReader};
    let server = Server::start(flavor);
    let mut child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "holder_child",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("LEASEHOLD_CHILD_URL", server.url())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn holder process");
    let stdout = child.stdout.take().expect("child stdout");
    let mut fence = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read child");
        // libtest prints the test name on the same line, before the child's own output.
        if let Some((_, f)) = line.split_once("HELD ") {
            fence = Some(f.trim().parse::<u64>().expect("fence"));
            break;
        }
    }
    let child_fence = fence.expect("the child never reported its lease");
    let locker = Locker::redis(&server.url()).await.expect("connect");
    // Held well past its TTL while the child renews.
    sleep(Duration::from_millis(1_500)).await;
    assert!(matches!(
        locker.try_acquire("killed", &opts(1_000)).await,
        Err(Error::Busy { .. })
    ));
    child.kill().expect("SIGKILL the holder");
    let killed = Instant::now();
    let _ = child.wait();
    let key = locker.lock_key("killed").expect("key");
    let left = Duration::from_millis(server.cmd::<u64>(&["PTTL", key.lock_key()]));
    let lease = locker
        .acquire("killed", &opts(1_000).wait(Duration::from_secs(5)))
        .await
        .expect("acquire after the holder died");
    let waited = killed.elapsed();
    // The waiter's timer is set from the holder's PTTL: taken soon after the key expires, far
    // from the 5 s wait's end, with room for a loaded machine.
    assert!(
        waited <= left + Duration::from_millis(500),
        "waited {waited:?} for a lease with {left:?} left"
    );
    assert!(lease.fence().get() > child_fence);
}
