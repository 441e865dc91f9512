//! Queue faults only a real server can show: keys of a foreign type, a restart with AOF, a
//! worker process SIGKILLed mid-job, and worker processes whose clocks are minutes off (run
//! under libfaketime). Each runs on Redis and on Valkey. Last, the memory queue under a wall
//! clock that steps (libfaketime again, no server).

#[path = "support/captured.rs"]
mod captured;
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold::Error;
use leasehold::RedisConfig;
use leasehold::queue::{JobId, JobState, Queue, Worker};
use support::proxy::Proxy;
use support::{Flavor, Server, has_binary};
use tokio::time::{Instant, sleep};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The server's clock in ms, from `TIME`.
fn server_ms(server: &Server) -> u64 {
    server.time_micros() / 1_000
}

fn local_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

/// A queue key of a foreign type is reported as `WrongType` with nothing changed; a job key of
/// a foreign type is set aside in the dead set, untouched, and the rest of the queue goes on.
async fn foreign_types(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "wt").await.expect("connect");
    // The pending set is a string: every step refuses, the string is untouched.
    let _: () = server.cmd(&["SET", "{leasehold:wt}:pending", "mine"]);
    for res in [
        q.enqueue(b"x").await.map(|_| ()),
        q.claim(ms(5_000)).await.map(|_| ()),
        q.counts().await.map(|_| ()),
        q.reap().await.map(|_| ()),
    ] {
        match res {
            Err(Error::WrongType { server_key, found }) => {
                assert_eq!(
                    (server_key.as_str(), found.as_str()),
                    ("{leasehold:wt}:pending", "string")
                )
            }
            other => panic!("expected WrongType, got {other:?}"),
        }
    }
    let kept: String = server.cmd(&["GET", "{leasehold:wt}:pending"]);
    assert_eq!(kept, "mine");
    assert_eq!(
        server.cmd::<i64>(&["EXISTS", "{leasehold:wt}:seq"]),
        0,
        "enqueue wrote"
    );
    let _: i64 = server.cmd(&["DEL", "{leasehold:wt}:pending"]);

    // A foreign key where the next job would go: enqueue steps over it rather than overwrite.
    let _: i64 = server.cmd(&["RPUSH", "{leasehold:wt}:job:1", "someone else's list"]);
    let id = q.enqueue(b"first").await.expect("enqueue");
    assert_eq!(id, JobId(2));
    assert_eq!(server.cmd::<i64>(&["LLEN", "{leasehold:wt}:job:1"]), 1);

    // A claimed job's key replaced by a string: complete and job refuse, and the active set
    // keeps the id.
    // Leases of 300 ms here: a claim's reply on a loaded machine still comes within them.
    let claim = q.claim(ms(300)).await.expect("claim").expect("job");
    let _: () = server.cmd(&["SET", "{leasehold:wt}:job:2", "clobbered"]);
    assert!(matches!(
        q.complete(claim.id(), 1).await,
        Err(Error::WrongType { .. })
    ));
    assert!(matches!(
        q.job(claim.id()).await,
        Err(Error::WrongType { .. })
    ));
    assert_eq!(
        server.cmd::<i64>(&["ZCARD", "{leasehold:wt}:active"]),
        1,
        "a refused complete changed the active set"
    );
    // Its lease expires beside a healthy one: the reaper returns the healthy job and sets the
    // foreign one aside in the dead set, without touching its key.
    let healthy = q.enqueue(b"healthy").await.expect("enqueue");
    let lapsed = q.claim(ms(300)).await.expect("claim").expect("job");
    assert_eq!(lapsed.id(), healthy);
    sleep(ms(500)).await;
    let mut reaped = q
        .reap()
        .await
        .expect("a foreign job key stalled the reaper");
    reaped.sort_by_key(|r| r.id);
    assert_eq!(
        reaped
            .iter()
            .map(|r| (r.id, r.attempts, r.to))
            .collect::<Vec<_>>(),
        vec![
            (claim.id(), 0, JobState::Dead),
            (healthy, 1, JobState::Pending)
        ]
    );
    assert_eq!(server.cmd::<i64>(&["ZCARD", "{leasehold:wt}:active"]), 0);
    assert!(
        server
            .cmd::<Option<String>>(&["ZSCORE", "{leasehold:wt}:dead", "2"])
            .is_some(),
        "the foreign job was not set aside in the dead set"
    );
    let kept: String = server.cmd(&["GET", "{leasehold:wt}:job:2"]);
    assert_eq!(kept, "clobbered");
    let again = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!((again.id(), again.attempts()), (healthy, 2));
    again.complete().await.expect("complete");

    // A foreign key at the head of pending: the claim sets it aside and takes the next job.
    let foreign = q.enqueue(b"clobbered").await.expect("enqueue");
    let next = q.enqueue(b"next").await.expect("enqueue");
    let _: i64 = server.cmd(&["DEL", &format!("{{leasehold:wt}}:job:{foreign}")]);
    let _: i64 = server.cmd(&[
        "RPUSH",
        &format!("{{leasehold:wt}}:job:{foreign}"),
        "someone else's list",
    ]);
    let got = q
        .claim(ms(5_000))
        .await
        .expect("a foreign job key at the head of pending stalled every claim")
        .expect("the next pending job");
    assert_eq!(got.id(), next);
    got.complete().await.expect("complete");
    assert_eq!(server.cmd::<i64>(&["ZCARD", "{leasehold:wt}:pending"]), 0);
    assert!(
        server
            .cmd::<Option<String>>(&["ZSCORE", "{leasehold:wt}:dead", &foreign.to_string()])
            .is_some(),
        "the foreign pending job was not set aside in the dead set"
    );
    assert_eq!(
        server.cmd::<i64>(&["LLEN", &format!("{{leasehold:wt}}:job:{foreign}")]),
        1
    );

    // A foreign key on a delayed retry that comes due: the same.
    let delayed = q.enqueue(b"delayed").await.expect("enqueue");
    let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!(c.id(), delayed);
    assert_eq!(c.retry(ms(50)).await.expect("retry"), JobState::Delayed);
    let _: () = server.cmd(&[
        "SET",
        &format!("{{leasehold:wt}}:job:{delayed}"),
        "clobbered",
    ]);
    let last = q.enqueue(b"last").await.expect("enqueue");
    sleep(ms(200)).await;
    let got = q
        .claim(ms(5_000))
        .await
        .expect("a foreign delayed job key stalled every claim")
        .expect("the last pending job");
    assert_eq!(got.id(), last);
    got.complete().await.expect("complete");
    let c = q.counts().await.expect("counts");
    assert_eq!((c.pending, c.active, c.delayed, c.dead), (0, 0, 0, 3));
    let kept: String = server.cmd(&["GET", &format!("{{leasehold:wt}}:job:{delayed}")]);
    assert_eq!(kept, "clobbered");
}

/// A job hash whose `attempts` field was overwritten with something not an integer cannot be
/// given a fence: the claim marks it dead with the reason and takes the next job, rather than
/// fail every claim while it heads the pending set. One whose payload was deleted the same.
async fn corrupt_attempts(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "ca").await.expect("connect");
    // Not an integer; below zero, an integer but no fence (it was claimed, with a fence of -4
    // no client could read, and the claim reported the server unreachable); 2^53 - 1 and 2^54,
    // where the next attempt is past what Lua's doubles hold exactly (2^54 + 1 and 2^54 + 2
    // were both handed out as the fence 2^54, and the first claim could settle the second's).
    for (dead, found) in [
        (1, "three"),
        (2, "-5"),
        (3, "9007199254740991"),
        (4, "18014398509481984"),
    ] {
        let corrupt = q.enqueue(b"corrupt").await.expect("enqueue");
        let next = q.enqueue(b"next").await.expect("enqueue");
        let jk = format!("{{leasehold:ca}}:job:{corrupt}");
        let _: i64 = server.cmd(&["HSET", &jk, "attempts", found]);
        let got = q
            .claim(ms(5_000))
            .await
            .expect("a corrupt job at the head of pending failed the claim")
            .expect("the next pending job");
        assert_eq!((got.id(), got.attempts()), (next, 1), "{found}");
        got.complete().await.expect("complete");
        let info = q.job(corrupt).await.expect("the corrupt job");
        assert_eq!(info.state, JobState::Dead, "{found}");
        let why = info.error.unwrap_or_default();
        assert!(why.contains("attempts"), "{found}: reason {why:?}");
        let c = q.counts().await.expect("counts");
        assert_eq!((c.pending, c.active, c.dead), (0, 0, dead), "{found}");
        // The field is left as it was found, for whoever wrote it to see.
        let kept: String = server.cmd(&["HGET", &jk, "attempts"]);
        assert_eq!(kept, found);
    }
    // The last exact fence is still handed out, exactly.
    let last = q.enqueue(b"last").await.expect("enqueue");
    let jk = format!("{{leasehold:ca}}:job:{last}");
    let _: i64 = server.cmd(&["HSET", &jk, "attempts", "9007199254740990"]);
    let got = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!((got.id(), got.attempts()), (last, 9_007_199_254_740_991));
    got.complete().await.expect("complete");
    // Attempts changed from outside while the job was leased (-1 and -5 are below zero, 2.5
    // is no integer, nan is no number, inf and 1e30 are above any limit): the reaper moves it
    // as any other expired lease (past the attempt limit to the dead set) and says where,
    // attempts reported within 0..2^53 (-1 was read as the reply's marker of a foreign key
    // type: reported dead while it went to pending; -5, 2.5 and the rest failed the reap
    // after it moved the jobs).
    for (found, to) in [
        ("-1", JobState::Pending),
        ("-5", JobState::Pending),
        ("2.5", JobState::Pending),
        ("nan", JobState::Pending),
        ("inf", JobState::Dead),
        ("1e30", JobState::Dead),
    ] {
        let leased = q.enqueue(b"leased").await.expect("enqueue");
        // 300 ms: the claim's reply on a loaded machine still comes within it.
        let got = q.claim(ms(300)).await.expect("claim").expect("job");
        assert_eq!(got.id(), leased);
        let jk = format!("{{leasehold:ca}}:job:{leased}");
        let _: i64 = server.cmd(&["HSET", &jk, "attempts", found]);
        sleep(ms(450)).await;
        let reaped = q.reap().await.expect("reap");
        let seen: Vec<_> = reaped.iter().map(|r| (r.id, r.to)).collect();
        assert_eq!(seen, vec![(leased, to)], "{found}");
        assert_eq!(q.job(leased).await.expect("job").state, to, "{found}");
        // Its next claim sets it aside (as above) or hands it out; either way the queue is
        // left empty for the next round.
        while let Some(c) = q.claim(ms(5_000)).await.expect("claim") {
            c.complete().await.expect("complete");
        }
    }
    // Attempts changed from outside while the job is leased, and its holder settles it: told
    // its lease is over (as by a reap), not a server fault, which a worker would keep
    // retrying until its lease ran out. Text that Lua reads as 1 but the claim's `HINCRBY`
    // refuses ('1.0', '0x1', ' 1', '01') is as corrupt here as there: it used to settle.
    for found in ["-5", "2.5", "nan", "1e30", "1.0", "0x1", " 1", "01"] {
        let leased = q.enqueue(b"settled").await.expect("enqueue");
        let got = q.claim(ms(5_000)).await.expect("claim").expect("job");
        assert_eq!(got.id(), leased);
        let jk = format!("{{leasehold:ca}}:job:{leased}");
        let _: i64 = server.cmd(&["HSET", &jk, "attempts", found]);
        for step in ["extend", "complete"] {
            let settled = match step {
                "extend" => q.extend(leased, 1, ms(5_000)).await.map(|_| ()),
                _ => q.complete(leased, 1).await,
            };
            assert!(
                matches!(settled, Err(leasehold::Error::LeaseLost { .. })),
                "{step} with attempts {found}: {settled:?}"
            );
        }
    }
    // A job hash whose payload was deleted: handed out, it would run on an empty payload and
    // be completed with its data gone. It dies with the reason; its attempts are untouched.
    let emptied = q.enqueue(b"data").await.expect("enqueue");
    let next = q.enqueue(b"next").await.expect("enqueue");
    let jk = format!("{{leasehold:ca}}:job:{emptied}");
    let _: i64 = server.cmd(&["HDEL", &jk, "payload"]);
    let got = q
        .claim(ms(5_000))
        .await
        .expect("claim")
        .expect("the next job");
    assert_eq!((got.id(), got.payload()), (next, &b"next"[..]));
    got.complete().await.expect("complete");
    let info = q.job(emptied).await.expect("the emptied job");
    assert_eq!(info.state, JobState::Dead);
    assert_eq!(info.error.as_deref(), Some("payload missing"));
    assert_eq!(info.attempts, 0);
    // An empty payload is a payload: claimed as any other.
    let empty = q.enqueue(b"").await.expect("enqueue");
    let got = q
        .claim(ms(5_000))
        .await
        .expect("claim")
        .expect("the empty job");
    assert_eq!((got.id(), got.payload()), (empty, &b""[..]));
    got.complete().await.expect("complete");
    // Any other refusal of the increment is the server's, not the job's: the claim fails and
    // the job stays pending.
    let again = q.enqueue(b"again").await.expect("enqueue");
    let _: () = server.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
    let refused = q.claim(ms(5_000)).await;
    let _: () = server.cmd(&["CONFIG", "SET", "maxmemory", "0"]);
    assert!(refused.is_err(), "a claim under OOM answered {refused:?}");
    let info = q.job(again).await.expect("the job");
    assert_eq!(info.state, JobState::Pending);
    let got = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!((got.id(), got.attempts()), (again, 1));
}

/// Job keys deleted from outside are dropped from the sets as they are met, and they cost no
/// job its turn: a reap whose first batch met one still moves every expired job, and a claim
/// that met a whole round of them still finds the job behind.
async fn deleted_job_keys(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "dk").await.expect("connect");
    let jk = |id: JobId| format!("{{leasehold:dk}}:job:{}", id.0);
    // More expired leases than one reap batch (500), the first one's key deleted.
    let payloads: Vec<Vec<u8>> = (0..501u32).map(|i| i.to_be_bytes().to_vec()).collect();
    let ids = q.enqueue_many(&payloads).await.expect("enqueue");
    // Leases long enough that no claim's reply comes back after its lease on a loaded machine
    // (that claim would be given back, not expire); the sleep outlasts them.
    for _ in &ids {
        q.claim(ms(300)).await.expect("claim").expect("job");
    }
    let _: i64 = server.cmd(&["DEL", &jk(ids[0])]);
    sleep(ms(400)).await;
    let reaped = q.reap().await.expect("reap");
    assert_eq!(reaped.len(), 500);
    let c = q.counts().await.expect("counts");
    assert_eq!((c.active, c.pending), (0, 500), "{c:?}");
    // A whole claim round (100 ids) of deleted keys before a claimable job.
    let _: i64 = server.cmd(&["DEL", "{leasehold:dk}:pending"]);
    let ids = q.enqueue_many(&payloads[..101]).await.expect("enqueue");
    for &id in &ids[..100] {
        let _: i64 = server.cmd(&["DEL", &jk(id)]);
    }
    let got = q
        .claim(ms(5_000))
        .await
        .expect("claim")
        .expect("the job behind 100 deleted ones");
    assert_eq!(got.id(), ids[100]);
    got.complete().await.expect("complete");
    // The same among due retries: a whole promotion round (100 ids) of deleted keys before a
    // due retry still claims it, rather than report an empty queue.
    let ids = q.enqueue_many(&payloads[..101]).await.expect("enqueue");
    for (i, &id) in ids.iter().enumerate() {
        let claim = q.claim(ms(5_000)).await.expect("claim").expect("job");
        assert_eq!(claim.id(), id);
        // Due one after another, so the deleted ones are promoted first.
        claim.retry(ms(1_000 + i as u64)).await.expect("retry");
    }
    for &id in &ids[..100] {
        let _: i64 = server.cmd(&["DEL", &jk(id)]);
    }
    sleep(ms(1_300)).await;
    let got = q
        .claim(ms(5_000))
        .await
        .expect("claim")
        .expect("the retry due behind 100 deleted ones");
    assert_eq!(got.id(), ids[100]);
}

/// A server that loses its writes (a restart without persistence, a failover, a flush) hands
/// the same job id out again, and the new job's first claim has the same attempt number as a
/// claim made before the loss. The old claim's holder must not extend or settle the new job:
/// a claim is told apart by a token of its own, not by (id, attempts) alone.
async fn a_reissued_id_is_not_the_old_claims(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "ri").await.expect("connect");
    q.enqueue_many(["one", "two", "three"])
        .await
        .expect("enqueue");
    let claim = || async { q.claim(ms(30_000)).await.expect("claim").expect("job") };
    let (mut old1, old2, old3) = (claim().await, claim().await, claim().await);
    let _: () = server.cmd(&["FLUSHALL"]);
    q.enqueue_many(["one again", "two again", "three again"])
        .await
        .expect("enqueue");
    let (new1, new2, new3) = (claim().await, claim().await, claim().await);
    for (old, new) in [(&old1, &new1), (&old2, &new2), (&old3, &new3)] {
        assert_eq!((new.id(), new.attempts()), (old.id(), old.attempts()));
    }
    let r = old1.extend(ms(30_000)).await;
    assert!(
        matches!(r, Err(Error::LeaseLost { .. })),
        "the old claim extended the new job: {r:?}"
    );
    let r = old2.retry(Duration::ZERO).await;
    assert!(
        matches!(r, Err(Error::LeaseLost { .. })),
        "the old claim retried the new job: {r:?}"
    );
    let r = old3.fail("stale").await;
    assert!(
        matches!(r, Err(Error::LeaseLost { .. })),
        "the old claim failed the new job: {r:?}"
    );
    for new in [&new1, &new2, &new3] {
        assert_eq!(q.job(new.id()).await.expect("job").state, JobState::Active);
    }
    // Once the new claim has completed, its done marker keeps its holder: the old claim's
    // complete is still refused, not taken for a repeat of the new claim's.
    let (id, attempts) = (new1.id(), new1.attempts());
    new1.complete().await.expect("complete");
    assert_eq!(q.job(id).await.expect("job").state, JobState::Done);
    let r = old1.complete().await;
    assert!(
        matches!(r, Err(Error::LeaseLost { .. })),
        "the old claim completed the new job: {r:?}"
    );
    // By id and attempt alone (an operator's call), the step is not told apart: a repeated
    // complete succeeds on the marker.
    q.complete(id, attempts)
        .await
        .expect("a repeated complete by id");
    new2.complete().await.expect("complete");
    new3.complete().await.expect("complete");
}

/// A job id counter far behind its jobs (deleted by hand, evicted, rolled back) costs an
/// enqueue a few probes, not one per job in a single script call that blocks the server, and
/// never overwrites a job.
async fn a_counter_far_behind_costs_a_few_probes(flavor: Flavor) {
    let server = Server::start(flavor);
    // As the restricted user of docs/leasehold.acl: the counter's repair is a command of its
    // own, which the rule must allow.
    let q = Queue::redis(&server.acl_user_url_for("leasehold-queue"), "cb")
        .await
        .expect("connect");
    let payloads: Vec<String> = (0..500).map(|i| format!("job {i}")).collect();
    let ids = q.enqueue_many(&payloads).await.expect("enqueue");
    let _: i64 = server.cmd(&["DEL", "{leasehold:cb}:seq"]);
    let exists_calls = |server: &Server| -> u64 {
        let info: String = server.cmd(&["INFO", "commandstats"]);
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_exists:calls="))
            .map_or(0, |rest| {
                rest.split(',')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("calls")
            })
    };
    let before = exists_calls(&server);
    let id = q.enqueue("after the reset").await.expect("enqueue");
    let probes = exists_calls(&server) - before;
    assert!(
        !ids.contains(&id),
        "the new job took the id of an existing one: {id:?}"
    );
    assert!(
        probes <= 20,
        "{probes} EXISTS probes for one enqueue behind 500 jobs"
    );
    for (i, old) in ids.iter().enumerate() {
        let job = q.job(*old).await.expect("old job");
        assert_eq!(
            job.payload,
            Some(format!("job {i}").into_bytes()),
            "job {old:?} overwritten"
        );
    }
    let next = q.enqueue("next").await.expect("enqueue");
    assert!(
        next > id,
        "ids go on rising from the new one: {next:?} after {id:?}"
    );
    // A search that gives up (keys planted at every power-of-two distance from the second
    // payload's id) fails the whole call with nothing stored: the first payload is not left
    // behind for the caller's retry to store twice.
    let before = q.counts().await.expect("counts").pending;
    let _: () = server.cmd(&["SET", "{leasehold:cb}:seq", "1000000"]);
    for k in 0..42 {
        let planted = 1_000_002u64 + (1u64 << k) - 1;
        let _: () = server.cmd(&["SET", &format!("{{leasehold:cb}}:job:{planted}"), "x"]);
    }
    let refused = q.enqueue_many(["first", "second"]).await;
    assert!(refused.is_err(), "{refused:?}");
    let after = q.counts().await.expect("counts").pending;
    assert_eq!(after, before, "a job of the refused call was stored");
}

/// A job id counter set from outside to what ids cannot be drawn from (not a decimal, or so
/// high that Lua's doubles would round two ids of one call to the same) refuses the enqueue
/// with `WrongType`, not transient, adding nothing; the highest counter allowed still works.
async fn a_counter_past_exact_ids_is_refused(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "cx").await.expect("connect");
    let limit = (1u64 << 53) - (1u64 << 43);
    for bad in [
        "9007199254740994".to_owned(),
        limit.to_string(),
        "abc".to_owned(),
        "-5".to_owned(),
        "007".to_owned(),
        "".to_owned(),
    ] {
        let _: () = server.cmd(&["SET", "{leasehold:cx}:seq", &bad]);
        match q.enqueue_many(["a", "b"]).await {
            Err(e @ Error::WrongType { .. }) => {
                assert!(!e.is_transient(), "{e}");
                let Error::WrongType { server_key, .. } = &e else {
                    unreachable!()
                };
                assert_eq!(server_key, "{leasehold:cx}:seq");
            }
            other => panic!("counter {bad:?}: expected WrongType, got {other:?}"),
        }
        let kept: String = server.cmd(&["GET", "{leasehold:cx}:seq"]);
        assert_eq!(kept, bad, "the counter was changed");
        assert_eq!(
            q.counts().await.expect("counts").pending,
            0,
            "counter {bad:?}"
        );
    }
    let _: () = server.cmd(&["SET", "{leasehold:cx}:seq", &(limit - 1).to_string()]);
    let ids = q.enqueue_many(["a", "b"]).await.expect("enqueue");
    assert_eq!(ids, [JobId(limit), JobId(limit + 1)]);
    for (id, payload) in ids.iter().zip(["a", "b"]) {
        let job = q.job(*id).await.expect("job");
        assert_eq!(job.payload, Some(payload.as_bytes().to_vec()));
    }
}

/// The same for a `Worker`: after the server lost its writes and another worker claimed the
/// new job under the old id and attempt, the first worker's renewal is refused, its handler is
/// cancelled, and it does not complete the new job.
async fn a_worker_does_not_renew_a_reissued_id(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "rw").await.expect("connect");
    q.enqueue(b"before the loss").await.expect("enqueue");
    let w = Worker::new(q.clone())
        .ttl(ms(600))
        .reap_every(Duration::from_secs(3_600))
        .start(|_job| async move {
            sleep(Duration::from_secs(60)).await;
            Ok(())
        })
        .expect("start");
    let deadline = Instant::now() + Duration::from_secs(5);
    while w.report().in_flight == 0 {
        assert!(
            Instant::now() < deadline,
            "the worker did not claim the job"
        );
        sleep(ms(20)).await;
    }
    let _: () = server.cmd(&["FLUSHALL"]);
    q.enqueue(b"after the loss").await.expect("enqueue");
    let new = q.claim(ms(30_000)).await.expect("claim").expect("job");
    assert_eq!((new.id(), new.attempts()), (JobId(1), 1));
    let deadline = Instant::now() + Duration::from_secs(5);
    while w.report().lost == 0 {
        assert!(
            Instant::now() < deadline,
            "the worker kept renewing the new job: {:?}",
            w.report()
        );
        sleep(ms(20)).await;
    }
    let r = w.shutdown(Duration::from_secs(5)).await;
    assert_eq!((r.lost, r.completed), (1, 0), "{r:?}");
    assert_eq!(q.job(new.id()).await.expect("job").state, JobState::Active);
    new.complete()
        .await
        .expect("the new claim completes its job");
}

/// Scenario from the issue: a restart with AOF loses no enqueued job, and leases survive too.
async fn aof_restart_keeps_jobs(flavor: Flavor) {
    let mut server = Server::start_with(flavor, true);
    let q = Queue::redis(&server.url(), "durable")
        .await
        .expect("connect");
    let payloads: Vec<Vec<u8>> = (0..300u32).map(|i| i.to_be_bytes().to_vec()).collect();
    let ids = q.enqueue_many(&payloads).await.expect("enqueue");
    let held = q.claim(ms(60_000)).await.expect("claim").expect("job");
    server.restart();
    let q = Queue::redis(&server.url(), "durable")
        .await
        .expect("reconnect");
    let c = q.counts().await.expect("counts");
    assert_eq!((c.pending, c.active), (299, 1), "{c:?}");
    let info = q.job(held.id()).await.expect("the claimed job");
    assert_eq!((info.state, info.attempts), (JobState::Active, 1));
    for (id, payload) in ids.iter().zip(&payloads).skip(1) {
        let claim = q.claim(ms(5_000)).await.expect("claim").expect("job");
        assert_eq!((claim.id(), claim.payload()), (*id, payload.as_slice()));
        claim.complete().await.expect("complete");
    }
    // The lease taken before the restart is still the one that can complete the job.
    q.complete(held.id(), 1)
        .await
        .expect("complete across restart");
    // The id counter survived too: no id is handed out twice.
    let next = q.enqueue(b"after").await.expect("enqueue");
    assert!(next > *ids.last().expect("ids"), "{next} reused an id");
}

/// Re-runs this test binary as a child process running only `test`, with `env` set.
fn spawn_child(test: &str, env: &[(&str, &str)], faketime: Option<&str>) -> Child {
    let exe = std::env::current_exe().expect("test binary");
    let args = [
        "--exact",
        test,
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ];
    let mut cmd = match faketime {
        Some(offset) => {
            assert!(
                has_binary("faketime"),
                "`faketime` is not on PATH: install Debian's `faketime` package (scripts/test.sh does)"
            );
            let mut c = Command::new("faketime");
            c.arg("-f").arg(offset).arg(exe).args(args);
            // Timers keep the real monotonic clock; only wall-clock readings are skewed.
            c.env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
            c
        }
        None => {
            let mut c = Command::new(exe);
            c.args(args);
            c
        }
    };
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdout(Stdio::piped())
        .spawn()
        .expect("spawn child process")
}

/// Reads the child's stdout until a line containing `tag`, and returns what follows the tag.
fn read_tagged(child: &mut Child, tag: &str) -> String {
    let stdout = child.stdout.as_mut().expect("child stdout");
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).expect("read child");
        assert!(n > 0, "the child exited without printing {tag}");
        // libtest prints the test name on the same line, before the child's own output.
        if let Some((_, rest)) = line.split_once(tag) {
            return rest.trim().to_owned();
        }
    }
}

fn fields(text: &str) -> Vec<u64> {
    text.split_whitespace()
        .map(|f| f.parse().expect("number"))
        .collect()
}

/// The child side of `worker_process_killed`: a worker whose handler never finishes; its lease
/// is renewed for as long as the process lives.
#[tokio::test]
#[ignore = "run as a child process by worker_process_killed"]
async fn worker_child() {
    let Ok(url) = std::env::var("LEASEHOLD_QUEUE_URL") else {
        return;
    };
    let q = Queue::redis(&url, "killed").await.expect("child connects");
    let _worker = Worker::new(q)
        .ttl(ms(2_000))
        .start(|job| async move {
            println!("RUNNING {} {}", job.id(), job.attempts());
            std::future::pending::<()>().await;
            Ok(())
        })
        .expect("child worker");
    sleep(Duration::from_secs(120)).await;
}

/// A worker process SIGKILLed mid-job: the job is reaped after its lease, completed by another
/// worker with attempts + 1, and the dead worker's late complete is refused as stale.
async fn worker_process_killed(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "killed")
        .await
        .expect("connect");
    let id = q.enqueue(b"job").await.expect("enqueue");
    let mut child = spawn_child(
        "worker_child",
        &[("LEASEHOLD_QUEUE_URL", &server.url())],
        None,
    );
    let got = fields(&read_tagged(&mut child, "RUNNING "));
    assert_eq!(got, vec![id.get(), 1]);
    // Held well past one lease while the child renews it.
    sleep(ms(4_000)).await;
    assert!(
        q.reap().await.expect("reap").is_empty(),
        "reaped a renewed lease"
    );
    assert_eq!(q.job(id).await.expect("job").state, JobState::Active);
    child.kill().expect("SIGKILL the worker");
    let _ = child.wait();
    // How much of the dead worker's lease the server still counts (its deadline in the
    // active set, against the server's clock).
    let deadline_ms: u64 = server
        .cmd::<String>(&["ZSCORE", "{leasehold:killed}:active", &id.get().to_string()])
        .parse()
        .expect("deadline");
    let left = ms(deadline_ms.saturating_sub(server.time_micros() / 1_000));
    let killed = Instant::now();
    // When the rescuer's handler started, and the attempt it was handed.
    let seen: Arc<Mutex<Vec<(Instant, u64)>>> = Arc::default();
    let rec = seen.clone();
    let rescuer = Worker::new(q.clone())
        .ttl(ms(5_000))
        .reap_every(ms(100))
        .start(move |job| {
            let rec = rec.clone();
            async move {
                rec.lock()
                    .expect("seen")
                    .push((Instant::now(), job.attempts()));
                Ok(())
            }
        })
        .expect("start");
    let give_up = Instant::now() + Duration::from_secs(10);
    while rescuer.report().completed == 0 && Instant::now() < give_up {
        sleep(ms(20)).await;
    }
    assert_eq!(rescuer.report().completed, 1, "the job never came back");
    let seen = seen.lock().expect("seen").clone();
    assert_eq!(seen.iter().map(|s| s.1).collect::<Vec<_>>(), vec![2]);
    // Handed out again only once the lease ran out on the server's clock, and soon after:
    // within a reap interval (100 ms) and room for a loaded machine.
    let waited = seen[0].0 - killed;
    assert!(
        waited + ms(5) >= left,
        "handed out {:?} before the lease ran out",
        left - waited
    );
    assert!(
        waited <= left + ms(600),
        "handed out {waited:?} after the kill, with {left:?} of the lease left"
    );
    match q.complete(id, 1).await {
        Err(Error::Stale { fence, highest, .. }) => {
            assert_eq!((fence.get(), highest.get()), (1, 2))
        }
        other => panic!("the dead worker's complete was not refused: {other:?}"),
    }
    rescuer.shutdown(Duration::from_secs(5)).await;
}

/// The worker's link stalls mid-job (a proxy stops forwarding, connections open): its extends
/// hang until the connection's response timeout (30 s here). The handler must still be
/// cancelled before its local deadline, before the server lets the 8 s lease go and another
/// worker, reaping every 50 ms on a link of its own, is given the job (the margin is the
/// drift allowance and the early warning, about 285 ms: at a 2 s lease it was 75 ms, little
/// on a loaded machine). Ending the handler when the hung extend timed out would leave both
/// handlers running at once for seconds.
async fn stalled_extend_cancels_in_time(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let config = RedisConfig::default().response_timeout(Duration::from_secs(30));
    let stalled_link = leasehold::RedisBackend::connect_with(&proxy.url(), config)
        .await
        .expect("connect through the proxy");
    let q = Queue::builder("stalled")
        .on_redis(stalled_link)
        .expect("queue");
    let id = q.enqueue(b"job").await.expect("enqueue");
    // When the first handler started and when it was dropped; when the second one started.
    let first: Arc<Mutex<(Option<Instant>, Option<Instant>)>> = Arc::default();
    // When the rescuer's handler started, and the attempt it was handed.
    let second: Arc<Mutex<Option<(Instant, u64)>>> = Arc::default();
    struct Dropped(Arc<Mutex<(Option<Instant>, Option<Instant>)>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.lock().expect("first").1 = Some(Instant::now());
        }
    }
    let rec = first.clone();
    let stalled = Worker::new(q.clone())
        .ttl(ms(8_000))
        .reap_every(Duration::from_secs(60))
        .start(move |_| {
            let rec = rec.clone();
            async move {
                rec.lock().expect("first").0 = Some(Instant::now());
                let _dropped = Dropped(rec);
                sleep(Duration::from_secs(60)).await;
                Ok(())
            }
        })
        .expect("start");
    let give_up = Instant::now() + Duration::from_secs(20);
    while first.lock().expect("first").0.is_none() && Instant::now() < give_up {
        sleep(ms(5)).await;
    }
    let started = first
        .lock()
        .expect("first")
        .0
        .expect("the first worker claimed the job");
    proxy.stall(true);
    let direct = Queue::redis(&server.url(), "stalled")
        .await
        .expect("connect");
    let rec = second.clone();
    let rescuer = Worker::new(direct)
        .ttl(ms(5_000))
        .reap_every(ms(50))
        .start(move |job| {
            let rec = rec.clone();
            async move {
                // Recorded, not asserted here: the worker turns a panicking handler into a
                // retry, so an assertion failing in it would only show as a timeout.
                rec.lock()
                    .expect("second")
                    .get_or_insert((Instant::now(), job.attempts()));
                Ok(())
            }
        })
        .expect("start");
    while rescuer.report().completed == 0 && Instant::now() < give_up {
        sleep(ms(10)).await;
    }
    assert_eq!(rescuer.report().completed, 1, "the job never came back");
    let (second_started, attempt) = second.lock().expect("second").expect("second handler ran");
    assert_eq!(attempt, 2, "the rescuer was not handed the second attempt");
    let dropped = first.lock().expect("first").1;
    let dropped = dropped
        .expect("the stalled worker's handler was still running when the job went to another");
    assert!(
        dropped < second_started,
        "the stalled handler was dropped {:?} after the other one started",
        dropped - second_started
    );
    assert!(
        dropped - started < ms(8_000),
        "cancelled {:?} after the handler started, past its 8 s lease",
        dropped - started
    );
    proxy.stall(false);
    // Completed by the other worker.
    let direct = Queue::redis(&server.url(), "stalled")
        .await
        .expect("connect");
    assert_eq!(direct.job(id).await.expect("job").state, JobState::Done);
    rescuer.shutdown(Duration::from_secs(5)).await;
    stalled.shutdown(Duration::from_secs(5)).await;
}

/// A slow link (350 ms round trips against a 900 ms lease): the first extend is due a third of
/// the lease after the claim was sent, not after its slow reply came. Counted from the reply,
/// it would go out at 650 ms and answer at 1,000 ms, past the 889 ms local deadline, and a
/// healthy job would be cancelled on its first extend.
async fn slow_link_keeps_the_lease(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let q = Queue::redis(&proxy.url(), "slow").await.expect("connect");
    // The scripts loaded first: a script's first call answers NOSCRIPT and is sent again, a
    // second round trip that is not what this test is about.
    q.enqueue(b"warm").await.expect("enqueue");
    let mut warm = q.claim(ms(900)).await.expect("claim").expect("job");
    warm.extend(ms(900)).await.expect("extend");
    warm.complete().await.expect("complete");
    q.enqueue(b"job").await.expect("enqueue");
    proxy.set_latency(ms(175));
    let worker = Worker::new(q)
        .ttl(ms(900))
        .start(|_| async {
            sleep(ms(2_000)).await;
            Ok(())
        })
        .expect("start");
    let give_up = Instant::now() + Duration::from_secs(15);
    while worker.report().completed + worker.report().lost == 0 && Instant::now() < give_up {
        sleep(ms(20)).await;
    }
    let report = worker.report();
    assert_eq!(
        (report.completed, report.lost),
        (1, 0),
        "the job did not survive a slow link: {report:?}"
    );
    worker.shutdown(Duration::from_secs(5)).await;
}

/// A queue through a proxy, whose claim, retry and complete scripts are loaded (as in
/// `slow_link_keeps_the_lease`), and one job enqueued.
async fn warm_queue_through_proxy(flavor: Flavor, name: &str) -> (Server, Proxy, Queue, JobId) {
    warm_queue_through_proxy_with(flavor, name, RedisConfig::default()).await
}

/// [`warm_queue_through_proxy`] with a connection configuration of the test's own.
async fn warm_queue_through_proxy_with(
    flavor: Flavor,
    name: &str,
    config: RedisConfig,
) -> (Server, Proxy, Queue, JobId) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let backend = leasehold::RedisBackend::connect_with(&proxy.url(), config)
        .await
        .expect("connect through the proxy");
    let q = Queue::builder(name).on_redis(backend).expect("queue");
    q.enqueue(b"warm").await.expect("enqueue");
    let warm = q.claim(ms(900)).await.expect("claim").expect("job");
    warm.retry(Duration::ZERO).await.expect("retry");
    let warm = q.claim(ms(900)).await.expect("claim").expect("job");
    warm.complete().await.expect("complete");
    let id = q.enqueue(b"job").await.expect("enqueue");
    (server, proxy, q, id)
}

/// Waits until `done` counts something in `worker`'s report (10 s at most), and returns it.
async fn report_once(
    worker: &leasehold::queue::WorkerHandle,
    done: impl Fn(&leasehold::queue::WorkerReport) -> u64,
) -> leasehold::queue::WorkerReport {
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        let report = worker.report();
        if done(&report) > 0 {
            return report;
        }
        assert!(Instant::now() < give_up, "not settled: {report:?}");
        sleep(ms(20)).await;
    }
}

/// Job `id` once it has had `attempts` claims and is active no more (given back in the
/// background), or as it stands after 5 s.
async fn once_settled(q: &Queue, id: JobId, attempts: u64) -> leasehold::queue::JobInfo {
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        let info = q.job(id).await.expect("job");
        let settled = info.attempts >= attempts && info.state != JobState::Active;
        if settled || Instant::now() >= give_up {
            return info;
        }
        sleep(ms(20)).await;
    }
}

/// Job `id`, claimed once for nobody, is back in pending within seconds (not left active
/// until a reaper finds it), its attempt counted and `why` noted; the next claim gets it.
async fn given_back(q: &Queue, proxy: &Proxy, id: JobId, why: &str) {
    let info = once_settled(q, id, 1).await;
    assert_eq!(
        (info.state, info.attempts),
        (JobState::Pending, 1),
        "{info:?}"
    );
    assert_eq!(info.error.as_deref(), Some(why));
    proxy.set_latency(Duration::ZERO);
    let again = q.claim(ms(5_000)).await.expect("claim").expect("job");
    assert_eq!((again.id(), again.attempts()), (id, 2));
    again.complete().await.expect("complete");
}

/// A claim whose reply arrives after its lease ran out (round trips slower than the TTL) is not
/// handed out: the caller is told `LeaseLost`, and the job is given back at once.
async fn a_late_claim_is_given_back(flavor: Flavor) {
    let (_server, proxy, q, id) = warm_queue_through_proxy(flavor, "late").await;
    proxy.set_latency(ms(150));
    let late = q.claim(ms(200)).await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    let why = "the claim's reply arrived after its lease ran out";
    given_back(&q, &proxy, id, why).await;
}

/// A claim that comes back late on the job's last attempt gives the job to the dead set, with
/// why, not back to pending: no attempt is left to run it again.
async fn a_late_claim_on_its_last_attempt_goes_dead(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let q = Queue::builder("last")
        .max_attempts(1)
        .redis(&proxy.url())
        .await
        .expect("connect");
    // The scripts loaded first (the give-back runs the retry script), on a quick link.
    q.enqueue(b"warm").await.expect("enqueue");
    let warm = q.claim(ms(900)).await.expect("claim").expect("job");
    assert_eq!(
        warm.retry(Duration::ZERO).await.expect("retry"),
        JobState::Dead
    );
    let id = q.enqueue(b"job").await.expect("enqueue");
    proxy.set_latency(ms(150));
    let late = q.claim(ms(200)).await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    let info = once_settled(&q, id, 1).await;
    assert_eq!((info.state, info.attempts), (JobState::Dead, 1), "{info:?}");
    assert_eq!(
        info.error.as_deref(),
        Some("the claim's reply arrived after its lease ran out")
    );
}

/// A waiting claim whose first claim comes back late (the link slowed for a moment) gives that
/// job back and goes on waiting: once round trips are quick again it gets the job, within its
/// wait, instead of ending with `LeaseLost`.
async fn a_waiting_claim_outlasts_a_late_claim(flavor: Flavor) {
    let (server, proxy, q, id) = warm_queue_through_proxy(flavor, "late_wait").await;
    // Beside the proxy, so that watching the job neither waits out its latency nor adds to it.
    let direct = Queue::redis(&server.url(), "late_wait")
        .await
        .expect("connect");
    proxy.set_latency(ms(150));
    let waiting = tokio::spawn({
        let q = q.clone();
        async move { q.claim_wait(ms(200), Duration::from_secs(20)).await }
    });
    // The link recovers once the first claim came back late and its job was given back (set
    // back to pending); recovering as soon as the claim landed, the link could carry its reply
    // without the latency when the proxy read it late on a loaded machine.
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        let info = direct.job(id).await.expect("job");
        if info.attempts >= 2 || (info.attempts == 1 && info.state == JobState::Pending) {
            break;
        }
        assert!(
            Instant::now() < give_up,
            "the first claim was never given back"
        );
        sleep(ms(5)).await;
    }
    proxy.set_latency(Duration::ZERO);
    let claim = waiting
        .await
        .expect("join")
        .expect("the wait goes on past a late claim")
        .expect("a job within the wait");
    assert_eq!(claim.id(), id);
    // A second claim sent before the link recovered is late too: 3.
    assert!(
        (2..=3).contains(&claim.attempts()),
        "the late claim's attempt is not counted: {}",
        claim.attempts()
    );
    claim.complete().await.expect("complete");
}

/// Round trips that stay slower than the TTL: every claim comes back late and is given back,
/// and the third ends the wait with `LeaseLost` long before its 30 s are over, the job pending
/// again with those three attempts counted.
async fn a_waiting_claim_ends_after_three_late_claims(flavor: Flavor) {
    let (server, proxy, q, id) = warm_queue_through_proxy(flavor, "late_thrice").await;
    let direct = Queue::redis(&server.url(), "late_thrice")
        .await
        .expect("connect");
    proxy.set_latency(ms(150));
    let started = Instant::now();
    let late = q.claim_wait(ms(200), Duration::from_secs(30)).await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "ended after {:?}",
        started.elapsed()
    );
    // The third give-back runs in the background; nothing claims the job after it.
    let info = once_settled(&direct, id, 3).await;
    assert_eq!(
        (info.state, info.attempts),
        (JobState::Pending, 3),
        "{info:?}"
    );
    sleep(ms(500)).await;
    let later = direct.job(id).await.expect("job");
    assert_eq!(
        later.attempts, 3,
        "claimed again after the wait ended: {later:?}"
    );
}

/// A claim whose caller leaves before it is answered (a timeout around it): the job it was
/// granted is given back at once, not left active for its 60 s lease.
async fn an_abandoned_claim_is_given_back(flavor: Flavor) {
    let (_server, proxy, q, id) = warm_queue_through_proxy(flavor, "abandoned").await;
    proxy.set_latency(ms(100));
    let cut = tokio::time::timeout(ms(50), q.claim(ms(60_000))).await;
    assert!(cut.is_err(), "answered in 50 ms through 200 ms round trips");
    let why = "its claimer left before the claim was answered";
    given_back(&q, &proxy, id, why).await;
}

/// A claim answered while its caller's future sits unpolled, and dropped before it reads the
/// answer (the other branch of a `select!` won in the same wake-up, or its task was aborted):
/// the job is given back at once, as for a caller who left before the answer came, not left
/// active for its whole lease.
async fn an_answered_claim_dropped_unread_is_given_back(flavor: Flavor) {
    let (server, proxy, q, id) = warm_queue_through_proxy(flavor, "unread").await;
    // Beside the proxy, so that watching the job does not wait out its latency.
    let direct = Queue::redis(&server.url(), "unread")
        .await
        .expect("connect");
    // The reply reaches the client a good while after the claim ran on the server.
    proxy.set_latency(ms(100));
    let mut claim = Box::pin(q.claim(ms(60_000)));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            claim.as_mut().poll(&mut cx).is_pending(),
            "answered before the claim was seen to run"
        );
        if direct.job(id).await.expect("job").state == JobState::Active {
            break;
        }
        assert!(Instant::now() < give_up, "the claim never ran");
        sleep(ms(5)).await;
    }
    // Unpolled from here on: the answer comes back into its channel, unread.
    sleep(ms(600)).await;
    drop(claim);
    let why = "its claimer left before the claim was answered";
    given_back(&q, &proxy, id, why).await;
}

/// How the reply of a settle that ran goes wrong on its way back.
#[derive(Clone, Copy, Debug)]
enum Reply {
    /// The proxy closes the connection instead of passing it on.
    Lost,
    /// It arrives in a shape the script never gives (a job state it does not have).
    Garbled,
}

/// A settle whose reply is lost (the proxy closes the connection after the server ran it) or
/// garbled: the worker repeats it, the repeat finds the job settled and no longer held, and
/// the worker says so as a settle in doubt, not as a lease that was lost. It still counts it
/// under `lost`, as documented: it cannot tell a try that landed from a lease that ran out
/// between the tries.
async fn a_settle_whose_reply_went_wrong_is_in_doubt(flavor: Flavor, reply: Reply) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let q = Queue::redis(&proxy.url(), "doubt").await.expect("connect");
    // The fail script loaded first, so that the armed fault meets its reply, not a NOSCRIPT.
    q.enqueue(b"warm").await.expect("enqueue");
    let warm = q.claim(ms(5_000)).await.expect("claim").expect("job");
    warm.fail("warm").await.expect("fail");
    let id = q.enqueue(b"job").await.expect("enqueue");
    // fail.lua's reply, `{1, 'dead', now}`.
    let fail_reply = b"*3\r\n:1\r\n$4\r\ndead\r\n";
    match reply {
        Reply::Lost => proxy.drop_replies(fail_reply, 1),
        Reply::Garbled => proxy.replace_replies(fail_reply, b"*3\r\n:1\r\n$4\r\nDEAD\r\n", 1),
    }
    let (logs, _logging) = captured::capture(tracing::Level::WARN);
    let worker = Worker::new(q.clone())
        .ttl(ms(5_000))
        .reap_every(Duration::from_secs(3_600))
        .start(|_| async { Err(leasehold::queue::JobError::permanent("bad payload")) })
        .expect("start");
    report_once(&worker, |r| r.failed + r.lost).await;
    let report = worker.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        proxy.dropped.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the reply was {reply:?}"
    );
    assert_eq!((report.failed, report.lost), (0, 1), "{report:?}");
    let job = q.job(id).await.expect("job");
    assert_eq!(job.state, JobState::Dead, "the first fail landed");
    let text = logs.text();
    // The repeat reached the server and was refused as no longer held.
    let doubt = text
        .lines()
        .find(|l| l.contains("settle in doubt"))
        .unwrap_or_else(|| panic!("no settle in doubt logged: {text}"));
    assert!(
        doubt.contains("error=lease on `doubt/job:"),
        "not the refusal: {doubt}"
    );
    assert!(
        !text.contains("the lease was lost before it landed"),
        "{text}"
    );
}

/// A worker whose settle meets a short outage (the link cut for 4 s just as the handler
/// returns) tries it again while the lease lasts, with the 6 s lease renewed meanwhile (its
/// first extend is due at 2 s, in the outage, and goes through once it ends), and the settle
/// lands once the link is back: the job is done, its handler run once. (Five tries in a row
/// gave up within the outage, and the reaper would have run the job again.)
async fn a_settle_waits_out_a_short_outage(flavor: Flavor) {
    let o = settle_through_an_outage(flavor, "outage", ms(6_000)).await;
    sleep(ms(4_000)).await;
    o.proxy.cut(false);
    report_once(&o.worker, |r| r.completed + r.lost).await;
    let report = o.worker.shutdown(Duration::from_secs(5)).await;
    assert_eq!((report.completed, report.lost), (1, 0), "{report:?}");
    assert_eq!(o.queue.job(o.id).await.expect("job").state, JobState::Done);
    assert_eq!(o.runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// The same with an outage longer than the lease (2 s): the worker stops trying once the lease
/// is lost (its renewal fails through the outage), well before the link is back, and counts
/// the job lost; it is left active for the reaper, its handler run once.
async fn a_settle_gives_up_when_the_lease_is_lost(flavor: Flavor) {
    let o = settle_through_an_outage(flavor, "gone", ms(2_000)).await;
    let cut_at = Instant::now();
    let report = report_once(&o.worker, |r| r.completed + r.lost).await;
    let gave_up = cut_at.elapsed();
    assert_eq!((report.completed, report.lost), (0, 1), "{report:?}");
    assert!(
        gave_up < ms(3_500),
        "gave up {gave_up:?} into the outage, past the 2 s lease"
    );
    sleep(ms(4_000).saturating_sub(cut_at.elapsed())).await;
    o.proxy.cut(false);
    let report = o.worker.shutdown(Duration::from_secs(5)).await;
    assert_eq!((report.completed, report.lost), (0, 1), "{report:?}");
    // Read on a link of its own: the proxied one may still be reconnecting.
    let direct = Queue::redis(&o.server.url(), "gone")
        .await
        .expect("connect");
    assert_eq!(direct.job(o.id).await.expect("job").state, JobState::Active);
    assert_eq!(o.runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A settle the server refuses every time while the extends still go through (an ACL rule
/// denying the HDEL of the complete script and nothing the extend runs) is given up one lease
/// TTL after its first refusal: the job is counted lost and left active for the reaper, where
/// trying while the lease lasts would have kept it renewed, and the slot taken, for ever. The
/// lease was renewed while the settle was tried.
async fn a_settle_refused_for_good_gives_up_after_a_ttl(flavor: Flavor) {
    let server = Server::start(flavor);
    let url = server.acl_user_url_for("leasehold-queue");
    let queue = Queue::redis(&url, "denied").await.expect("connect");
    let id = queue.enqueue(b"job").await.expect("enqueue");
    let _: String = server.cmd(&["ACL", "SETUSER", "leasehold-queue", "-hdel"]);
    let ttl = ms(1_500);
    let returned = Arc::new(Mutex::new(None));
    let worker = {
        let returned = returned.clone();
        Worker::new(queue.clone())
            .ttl(ttl)
            .reap_every(Duration::from_secs(3_600))
            .start(move |_| {
                let returned = returned.clone();
                async move {
                    *returned.lock().expect("lock") = Some(Instant::now());
                    Ok(())
                }
            })
            .expect("start")
    };
    let report = report_once(&worker, |r| r.completed + r.lost).await;
    let returned = returned.lock().expect("lock").expect("the handler ran");
    let gave_up = returned.elapsed();
    assert_eq!((report.completed, report.lost), (0, 1), "{report:?}");
    assert!(
        gave_up >= ttl,
        "gave up {gave_up:?} after the handler returned, before one lease TTL ({ttl:?})"
    );
    // Claimed at least a TTL ago: still held only because the extends went on.
    let job = queue.job(id).await.expect("job");
    assert_eq!(job.state, JobState::Active, "{job:?}");
    let deadline = job.at_ms.expect("an active job has a deadline");
    let now = server_ms(&server);
    assert!(
        deadline > now,
        "the lease ran out ({deadline} <= {now} ms): it was not renewed while the settle was tried"
    );
    worker.shutdown(Duration::from_secs(5)).await;
}

/// What `settle_through_an_outage` set up.
struct Outage {
    server: Server,
    proxy: Arc<Proxy>,
    queue: Queue,
    id: JobId,
    runs: Arc<std::sync::atomic::AtomicUsize>,
    worker: leasehold::queue::WorkerHandle,
}

/// A warm queue through a proxy (quick timeouts, so that each try fails well within the
/// outage rather than waiting most of it out) and a worker with leases of `ttl` whose handler
/// cuts the link as it returns; returns once the handler ran, with the link cut.
async fn settle_through_an_outage(flavor: Flavor, name: &str, ttl: Duration) -> Outage {
    let quick = RedisConfig::default()
        .response_timeout(ms(300))
        .connection_timeout(ms(300));
    let (server, proxy, queue, id) = warm_queue_through_proxy_with(flavor, name, quick).await;
    let proxy = Arc::new(proxy);
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let worker = {
        let (proxy, runs) = (proxy.clone(), runs.clone());
        Worker::new(queue.clone())
            .ttl(ttl)
            .reap_every(Duration::from_secs(3_600))
            .start(move |_| {
                let (proxy, runs) = (proxy.clone(), runs.clone());
                async move {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    proxy.cut(true);
                    Ok(())
                }
            })
            .expect("start")
    };
    let give_up = Instant::now() + Duration::from_secs(10);
    while runs.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(Instant::now() < give_up, "the job was not run");
        sleep(ms(10)).await;
    }
    Outage {
        server,
        proxy,
        queue,
        id,
        runs,
        worker,
    }
}

/// A claim whose complete fails on a transient error (the link to the server cut) is not
/// spent: once the link is back, the same claim completes its job with its own token.
async fn a_claim_settles_again_after_a_transient_error(flavor: Flavor) {
    let server = Server::start(flavor);
    let proxy = Proxy::start(server.port).await;
    let q = Queue::redis(&proxy.url(), "again").await.expect("connect");
    let id = q.enqueue(b"job").await.expect("enqueue");
    let claim = q.claim(ms(30_000)).await.expect("claim").expect("job");
    proxy.cut(true);
    let cut = claim.complete().await;
    assert!(
        matches!(&cut, Err(e) if e.is_transient()),
        "a complete over a cut link: {cut:?}"
    );
    proxy.cut(false);
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        match claim.complete().await {
            Ok(()) => break,
            Err(e) if e.is_transient() && Instant::now() < give_up => sleep(ms(50)).await,
            Err(e) => panic!("the claim did not complete once the link was back: {e}"),
        }
    }
    assert_eq!(q.job(id).await.expect("job").state, JobState::Done);
}

/// The child side of `skewed_clients`: claims one job and leaves it, claims and completes
/// another, and reports its own wall clock beside the deadlines it was given.
#[tokio::test]
#[ignore = "run as a child process under faketime by skewed_clients"]
async fn skewed_child() {
    let Ok(url) = std::env::var("LEASEHOLD_SKEW_URL") else {
        return;
    };
    let q = Queue::redis(&url, "skew").await.expect("child connects");
    let left = q.claim(ms(4_000)).await.expect("claim").expect("job");
    let mut done = q.claim(ms(30_000)).await.expect("claim").expect("job");
    done.extend(ms(30_000)).await.expect("extend");
    let second_deadline = done.deadline_ms();
    done.complete().await.expect("complete");
    println!(
        "SKEW {} {} {} {}",
        local_ms(),
        left.id(),
        left.deadline_ms(),
        second_deadline
    );
}

/// Workers whose clocks are ten minutes ahead or behind lease on the server's clock: deadlines
/// are server time + lease, a behind clock does not make a fresh lease reapable, and an ahead
/// clock does not stretch a lease by ten minutes.
async fn skewed_clients(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "skew").await.expect("connect");
    for offset in ["+10m", "-10m"] {
        let left = q.enqueue(b"left").await.expect("enqueue");
        q.enqueue(b"done").await.expect("enqueue");
        let before = server_ms(&server);
        let mut child = spawn_child(
            "skewed_child",
            &[("LEASEHOLD_SKEW_URL", &server.url())],
            Some(offset),
        );
        let got = fields(&read_tagged(&mut child, "SKEW "));
        let status = child.wait().expect("child exit");
        assert!(status.success(), "child under {offset} failed: {status:?}");
        let after = server_ms(&server);
        let [child_clock, left_id, deadline, second_deadline] = got[..] else {
            panic!("child printed {got:?}");
        };
        // The child really ran on a skewed clock.
        let skew = child_clock as i64 - after as i64;
        assert!(
            skew.unsigned_abs() > 5 * 60 * 1000,
            "faketime {offset} did not skew the child: {skew} ms"
        );
        assert_eq!(left_id, left.get());
        // Deadlines are the server's clock plus the lease, whatever the child's clock says.
        assert!(
            deadline >= before + 4_000 && deadline <= after + 4_000,
            "{offset}: deadline {deadline} outside server [{before}, {after}] + 4000"
        );
        assert!(
            second_deadline >= before + 30_000 && second_deadline <= after + 30_000,
            "{offset}: extended deadline {second_deadline} off the server clock"
        );
        // A fresh lease is not reapable yet ...
        assert!(
            q.reap().await.expect("reap").iter().all(|r| r.id != left),
            "{offset}: reaped before its lease ran out"
        );
        // ... and it is reapable once its 4 s have passed on the server.
        while server_ms(&server) <= deadline {
            sleep(ms(50)).await;
        }
        let reaped = q.reap().await.expect("reap");
        assert_eq!(reaped.len(), 1, "{offset}: {reaped:?}");
        assert_eq!((reaped[0].id, reaped[0].attempts), (left, 1));
        // Tidy for the next offset.
        let again = q.claim(ms(5_000)).await.expect("claim").expect("job");
        again.complete().await.expect("complete");
    }
}

/// The child side of `memory_leases_ignore_clock_steps`: a memory queue whose process sees its
/// wall clock step ten minutes forward, then twenty back, while leases are held. The child
/// steps its own clock by rewriting libfaketime's timestamp file.
#[tokio::test]
#[ignore = "run as a child process under faketime by memory_leases_ignore_clock_steps"]
async fn clock_step_child() {
    let Ok(file) = std::env::var("LEASEHOLD_CLOCK_FILE") else {
        return;
    };
    let step = |offset: &str| {
        let wall = local_ms() as i64;
        let mono = std::time::Instant::now();
        std::fs::write(&file, offset).expect("rewrite the faketime file");
        let stepped = local_ms() as i64 - wall - mono.elapsed().as_millis() as i64;
        assert!(
            stepped.unsigned_abs() > 5 * 60 * 1000,
            "faketime did not step the wall clock to {offset}: {stepped} ms"
        );
    };
    let q = Queue::memory("steps").expect("queue");

    // Forward: a held lease must not expire because the wall clock jumped past its deadline.
    let id = q.enqueue(b"held").await.expect("enqueue");
    let mut held = q.claim(ms(5_000)).await.expect("claim").expect("job");
    step("+10m");
    let reaped = q.reap().await.expect("reap");
    assert!(
        reaped.is_empty(),
        "a wall-clock step forward expired a lease its holder still has: {reaped:?}"
    );
    assert!(
        q.claim(ms(5_000)).await.expect("claim").is_none(),
        "a second worker was given a job the first still holds"
    );
    // The deadline is still reported in wall-clock ms, on the clock as it reads now.
    let at = q.job(id).await.expect("job").at_ms.expect("a deadline");
    let now = local_ms();
    assert!(
        at > now && at <= now + 5_000,
        "deadline {at} is not within the 5 s lease of the wall clock {now}"
    );
    held.extend(ms(5_000)).await.expect("the holder extends");
    held.complete().await.expect("the holder completes");

    // Backward: a lease must not outlive its ttl by the size of the step.
    let left = q.enqueue(b"left").await.expect("enqueue");
    let lapsed = q.claim(ms(200)).await.expect("claim").expect("job");
    assert_eq!(lapsed.id(), left);
    step("-10m");
    sleep(ms(400)).await;
    let reaped = q.reap().await.expect("reap");
    assert_eq!(
        reaped.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![left],
        "a wall-clock step back stretched a 200 ms lease"
    );
    println!("STEPPED ok");
}

/// The memory queue leases on the monotonic clock, as the memory lock backend does: a wall
/// clock stepped forward (NTP, a resumed VM) must not hand a held job to a second worker, and
/// one stepped back must not keep a lapsed job from the reaper. Only the wall clock is faked.
#[tokio::test]
async fn memory_leases_ignore_clock_steps() {
    assert!(
        has_binary("faketime"),
        "`faketime` is not on PATH: install Debian's `faketime` package (scripts/test.sh does)"
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("faketime.rc");
    std::fs::write(&file, "+0").expect("write the faketime file");
    let exe = std::env::current_exe().expect("test binary");
    // The wrapper preloads libfaketime; `env -u FAKETIME` then drops its fixed offset, which
    // would outrank the file, so the child's clock follows the file it rewrites.
    let mut child = Command::new("faketime")
        .args(["-f", "+0", "env", "-u", "FAKETIME"])
        .arg(exe)
        .args([
            "--exact",
            "clock_step_child",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("FAKETIME_TIMESTAMP_FILE", &file)
        .env("FAKETIME_NO_CACHE", "1")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .env("LEASEHOLD_CLOCK_FILE", &file)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child process");
    assert_eq!(read_tagged(&mut child, "STEPPED "), "ok");
    let status = child.wait().expect("child exit");
    assert!(status.success(), "the clock-step child failed: {status:?}");
}

/// A queue on a locker's backend shares its connection and subscription; a lock named like the
/// queue shares the queue's hash tag and wake-up channel but none of its keys.
async fn shares_backend_with_locks(flavor: Flavor) {
    let server = Server::start(flavor);
    let backend = leasehold::RedisBackend::connect(&server.url())
        .await
        .expect("connect");
    let locker = leasehold::Locker::new(leasehold::AnyBackend::Redis(backend.clone()));
    let q = Queue::builder("jobs").on_redis(backend).expect("queue");
    let lease = locker
        .try_acquire("jobs", &leasehold::LockOptions::new().renew(false))
        .await
        .expect("lock");
    let waiter = {
        let q = q.clone();
        tokio::spawn(async move { q.claim_wait(ms(5_000), Duration::from_secs(10)).await })
    };
    sleep(ms(300)).await;
    // The lock's release wakes the waiter spuriously; it finds nothing and keeps waiting.
    lease.release().await.expect("release");
    sleep(ms(300)).await;
    assert!(!waiter.is_finished(), "a lock release ended the queue wait");
    let id = q.enqueue(b"x").await.expect("enqueue");
    let claim = waiter
        .await
        .expect("waiter")
        .expect("claim_wait")
        .expect("job");
    assert_eq!(claim.id(), id);
    // And the lock still works beside the queue's keys.
    let again = locker
        .try_acquire("jobs", &leasehold::LockOptions::new())
        .await
        .expect("lock again");
    claim.complete().await.expect("complete");
    again.release().await.expect("release");
}

/// A server failure in the second round trip of an `enqueue_many` (out of memory once the four
/// 1 MiB payloads of that trip arrive): the first trip's 256 jobs stay enqueued and the error
/// names their ids, so that a retry sends only the rest and adds no job twice.
async fn enqueue_many_failing_midway_names_what_landed(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "partly")
        .await
        .expect("connect");
    // Loads the script and the keys' structures before the baseline is read.
    let warm = q.enqueue(b"warm").await.expect("enqueue");
    q.claim(ms(5_000))
        .await
        .expect("claim")
        .expect("job")
        .complete()
        .await
        .expect("complete");
    let mut payloads: Vec<Vec<u8>> = (0..256u32).map(|i| i.to_be_bytes().to_vec()).collect();
    payloads.extend((0..4u8).map(|i| vec![i; 1 << 20]));
    let info: String = server.cmd(&["INFO", "memory"]);
    let used: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory");
    let limit = (used + (1 << 20)).to_string();
    let _: () = server.cmd(&["CONFIG", "SET", "maxmemory", &limit]);
    let out = q.enqueue_many(&payloads).await;
    let _: () = server.cmd(&["CONFIG", "SET", "maxmemory", "0"]);
    let Err(Error::PartlyEnqueued { enqueued, source }) = out else {
        panic!("expected a partial enqueue, got {out:?}");
    };
    assert!(matches!(*source, Error::Refused { .. }), "{source:?}");
    assert_eq!(enqueued.len(), 256);
    assert_eq!(enqueued[0].0, warm.0 + 1);
    assert_eq!(q.counts().await.expect("counts").pending, 256);
    let rest = q.enqueue_many(&payloads[256..]).await.expect("the rest");
    assert_eq!(rest.len(), 4);
    // Every payload once, in order.
    for (i, want) in payloads.iter().enumerate() {
        let c = q.claim(ms(5_000)).await.expect("claim").expect("job");
        assert_eq!(c.payload(), want.as_slice(), "job {i}");
        assert_eq!(c.id(), if i < 256 { enqueued[i] } else { rest[i - 256] });
        c.complete().await.expect("complete");
    }
    assert!(q.claim(ms(5_000)).await.expect("claim").is_none());
}

/// A worker of 200 slots, idle, asks the server like a small one: a few claimers poll on the
/// fallback beat and answer an enqueue's wake-up, not every slot (200 claims a second idle,
/// and 200 claims to hand out one job, on the connection the running jobs' extends share).
async fn idle_slots_do_not_each_ask_the_server(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "idle").await.expect("connect");
    let ran = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let worker = Worker::new(q.clone())
        .concurrency(200)
        .reap_every(Duration::from_secs(3_600))
        .start({
            let ran = ran.clone();
            move |_job| {
                ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Ok(()) }
            }
        })
        .expect("start");
    // Every slot has had its first look by then.
    sleep(ms(500)).await;
    let before = server.script_calls();
    sleep(ms(2_500)).await;
    let idle = server.script_calls() - before;
    // Eight claimers polling once a second: about 20 in 2.5 s.
    assert!(idle <= 60, "{idle} script calls in 2.5 s idle");

    let before = server.script_calls();
    q.enqueue(b"one").await.expect("enqueue");
    let report = report_once(&worker, |r| r.completed).await;
    assert_eq!((report.claimed, report.errors), (1, 0), "{report:?}");
    sleep(ms(200)).await;
    // The enqueue, a claim per claimer woken, the complete.
    let handing_out = server.script_calls() - before;
    assert!(
        handing_out <= 30,
        "{handing_out} script calls to hand out one job"
    );
    assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 1);
    worker.shutdown(Duration::from_secs(1)).await;
}

/// Claims that fail for good are counted in the report (the log says why), and a worker of
/// many slots retries them at one backoff per claimer, not one per slot.
async fn failing_claims_are_counted(flavor: Flavor) {
    let server = Server::start(flavor);
    let q = Queue::redis(&server.url(), "failing")
        .await
        .expect("connect");
    let _: () = server.cmd(&["SET", "{leasehold:failing}:pending", "mine"]);
    let worker = Worker::new(q)
        .concurrency(200)
        .reap_every(Duration::from_secs(3_600))
        .start(|_job| async { Ok(()) })
        .expect("start");
    sleep(ms(1_500)).await;
    let report = worker.report();
    assert_eq!(report.claimed, 0, "{report:?}");
    // Eight claimers backing off from 50 ms: five tries or so each in 1.5 s.
    assert!(
        (1..=80).contains(&report.errors),
        "claim errors counted: {report:?}"
    );
    let report = worker.shutdown(Duration::from_secs(1)).await;
    assert!(report.errors >= 1, "{report:?}");
}

macro_rules! faults {
    ($modname:ident, $flavor:expr) => {
        mod $modname {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn enqueue_many_failing_midway_names_what_landed() {
                super::enqueue_many_failing_midway_names_what_landed($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_counter_far_behind_costs_a_few_probes() {
                super::a_counter_far_behind_costs_a_few_probes($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_counter_past_exact_ids_is_refused() {
                super::a_counter_past_exact_ids_is_refused($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn idle_slots_do_not_each_ask_the_server() {
                super::idle_slots_do_not_each_ask_the_server($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn failing_claims_are_counted() {
                super::failing_claims_are_counted($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn foreign_types() {
                super::foreign_types($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn deleted_job_keys() {
                super::deleted_job_keys($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_reissued_id_is_not_the_old_claims() {
                super::a_reissued_id_is_not_the_old_claims($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_worker_does_not_renew_a_reissued_id() {
                super::a_worker_does_not_renew_a_reissued_id($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn corrupt_attempts() {
                super::corrupt_attempts($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn aof_restart_keeps_jobs() {
                super::aof_restart_keeps_jobs($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn worker_process_killed() {
                super::worker_process_killed($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn skewed_clients() {
                super::skewed_clients($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stalled_extend_cancels_in_time() {
                super::stalled_extend_cancels_in_time($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn slow_link_keeps_the_lease() {
                super::slow_link_keeps_the_lease($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_claim_settles_again_after_a_transient_error() {
                super::a_claim_settles_again_after_a_transient_error($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_settle_waits_out_a_short_outage() {
                super::a_settle_waits_out_a_short_outage($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_settle_gives_up_when_the_lease_is_lost() {
                super::a_settle_gives_up_when_the_lease_is_lost($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_settle_refused_for_good_gives_up_after_a_ttl() {
                super::a_settle_refused_for_good_gives_up_after_a_ttl($flavor).await
            }
            // One thread: the worker's tasks log to this thread's captured subscriber.
            #[tokio::test]
            async fn a_settle_whose_reply_was_lost_is_in_doubt() {
                super::a_settle_whose_reply_went_wrong_is_in_doubt($flavor, super::Reply::Lost)
                    .await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_late_claim_is_given_back() {
                super::a_late_claim_is_given_back($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_late_claim_on_its_last_attempt_goes_dead() {
                super::a_late_claim_on_its_last_attempt_goes_dead($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_abandoned_claim_is_given_back() {
                super::an_abandoned_claim_is_given_back($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_answered_claim_dropped_unread_is_given_back() {
                super::an_answered_claim_dropped_unread_is_given_back($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_waiting_claim_outlasts_a_late_claim() {
                super::a_waiting_claim_outlasts_a_late_claim($flavor).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_waiting_claim_ends_after_three_late_claims() {
                super::a_waiting_claim_ends_after_three_late_claims($flavor).await
            }
            #[tokio::test]
            async fn a_settle_whose_reply_was_garbled_is_in_doubt() {
                super::a_settle_whose_reply_went_wrong_is_in_doubt($flavor, super::Reply::Garbled)
                    .await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shares_backend_with_locks() {
                super::shares_backend_with_locks($flavor).await
            }
        }
    };
}

faults!(redis, Flavor::Redis);
faults!(valkey, Flavor::Valkey);
