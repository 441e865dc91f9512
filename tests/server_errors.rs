//! A server that answers errors: real `redis-server` / `valkey-server` processes put into states
//! where they refuse commands, never a mock. Out of memory (`maxmemory 1`, `noeviction`: OOM on
//! writes that need memory), the connected ACL user stripped of every command at run time
//! (NOPERM) or only of the first command its scripts run (refused inside the script), writes
//! stopped after a failed background save (MISCONF), the server turned into a replica
//! (READONLY), and a server still loading its dataset after a restart (LOADING). Under each,
//! every operation of the locks, the fence gate and the claim queue must answer a typed error
//! or a full success, never a panic and never a misleading error (a foreign key type, a busy
//! key, a lease not held); an error must leave every key as it was; a held lease whose renewals
//! are refused must be reported lost before its deadline, and one refused for less than its
//! validity must not be; and everything must work again once the condition clears.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use leasehold::queue::{JobId, Queue, Worker};
use leasehold::{Error, Lease, LockOptions, Locker, Release};
use support::{Cluster, Flavor, Server};
use tokio::time::{Instant, sleep, timeout};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Condition {
    /// `maxmemory 1` with `noeviction`: the server refuses commands that may grow memory.
    Oom,
    /// The client's ACL user loses every command while its connections stay open.
    NoPerm,
    /// `stop-writes-on-bgsave-error` after a background save that failed: every write refused.
    Misconf,
    /// The client's ACL user keeps `EVALSHA` but loses the first command its scripts run (`TIME`
    /// for acquire, `GET` for release and extend, `TYPE` for the queue), as with a rule written
    /// for an older release: the refusal arrives inside the script, where a `redis.pcall` sees it
    /// as a value.
    DeniedInScript,
    /// The server turned into a replica (of a master that is not there, so it keeps its data):
    /// every write refused with `READONLY`, as after a failover demoted the server the client
    /// still talks to.
    ReadOnly,
}

const LOCK_USER: &str = "leasehold";
const QUEUE_USER: &str = "leasehold-queue";

fn opts(ttl_ms: u64) -> LockOptions {
    LockOptions::new().ttl(Duration::from_millis(ttl_ms))
}

/// URLs for the locker and the queue: as the restricted users of `docs/leasehold.acl` for the
/// ACL conditions (whose permissions they take away), as the default user otherwise.
fn urls(server: &Server, cond: Condition) -> (String, String) {
    match cond {
        Condition::NoPerm | Condition::DeniedInScript => (
            server.acl_user_url_for(LOCK_USER),
            server.acl_user_url_for(QUEUE_USER),
        ),
        _ => (server.url(), server.url()),
    }
}

/// Waits for the background save to finish and returns its status (`ok` or `err`).
fn bgsave_status(server: &Server) -> String {
    let give_up = std::time::Instant::now() + Duration::from_secs(10);
    while server.info_field("persistence", "rdb_bgsave_in_progress") != "0" {
        assert!(std::time::Instant::now() < give_up, "BGSAVE never ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    server.info_field("persistence", "rdb_last_bgsave_status")
}

fn set_condition(server: &Server, cond: Condition, on: bool) {
    match (cond, on) {
        (Condition::Oom, true) => {
            let _: () = server.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
            let _: () = server.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
        }
        (Condition::Oom, false) => {
            let _: () = server.cmd(&["CONFIG", "SET", "maxmemory", "0"]);
        }
        (Condition::NoPerm, true) => {
            let _: () = server.cmd(&["ACL", "SETUSER", LOCK_USER, "-@all"]);
            let _: () = server.cmd(&["ACL", "SETUSER", QUEUE_USER, "-@all"]);
        }
        (Condition::DeniedInScript, true) => {
            let _: () = server.cmd(&["ACL", "SETUSER", LOCK_USER, "-get", "-time"]);
            let _: () = server.cmd(&["ACL", "SETUSER", QUEUE_USER, "-type"]);
        }
        (Condition::ReadOnly, true) => {
            let port = support::free_port().to_string();
            let _: () = server.cmd(&["REPLICAOF", "127.0.0.1", &port]);
        }
        (Condition::ReadOnly, false) => {
            let _: () = server.cmd(&["REPLICAOF", "NO", "ONE"]);
        }
        (Condition::NoPerm | Condition::DeniedInScript, false) => {
            server.acl_user_url_for(LOCK_USER);
            server.acl_user_url_for(QUEUE_USER);
        }
        (Condition::Misconf, true) => {
            // The server refuses writes only when save points are configured (the support starts
            // it with none). The save fails where the dump would be renamed into place: a
            // directory already sits there (the tests run as root, so permissions cannot make
            // it fail).
            let _: () = server.cmd(&["CONFIG", "SET", "save", "3600 1"]);
            let _: () = server.cmd(&["CONFIG", "SET", "stop-writes-on-bgsave-error", "yes"]);
            std::fs::create_dir(dump_path(server)).expect("a directory where the dump goes");
            let _: String = server.cmd(&["BGSAVE"]);
            assert_eq!(
                bgsave_status(server),
                "err",
                "the background save did not fail"
            );
        }
        (Condition::Misconf, false) => {
            std::fs::remove_dir(dump_path(server)).expect("remove the directory");
            let _: String = server.cmd(&["BGSAVE"]);
            assert_eq!(
                bgsave_status(server),
                "ok",
                "the background save still fails"
            );
        }
    }
}

fn dump_path(server: &Server) -> std::path::PathBuf {
    let dir: Vec<String> = server.cmd(&["CONFIG", "GET", "dir"]);
    let file: Vec<String> = server.cmd(&["CONFIG", "GET", "dbfilename"]);
    std::path::Path::new(&dir[1]).join(&file[1])
}

/// Every key with its type and contents (not its TTL), read as the default user.
fn snapshot(server: &Server) -> BTreeMap<String, String> {
    let mut conn = server.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).expect("KEYS");
    let mut out = BTreeMap::new();
    for k in keys {
        let kind: String = redis::cmd("TYPE").arg(&k).query(&mut conn).expect("TYPE");
        let value = match kind.as_str() {
            "string" => redis::cmd("GET")
                .arg(&k)
                .query::<Option<String>>(&mut conn)
                .expect("GET")
                .unwrap_or_default(),
            "hash" => {
                let h: BTreeMap<String, String> = redis::cmd("HGETALL")
                    .arg(&k)
                    .query(&mut conn)
                    .expect("HGETALL");
                format!("{h:?}")
            }
            "zset" => {
                let z: Vec<String> = redis::cmd("ZRANGE")
                    .arg(&k)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(&mut conn)
                    .expect("ZRANGE");
                format!("{z:?}")
            }
            other => other.to_owned(),
        };
        out.insert(k, format!("{kind} {value}"));
    }
    out
}

/// The typed error a refused command must become.
fn is_refusal(e: &Error) -> bool {
    matches!(e, Error::Refused { .. })
}

/// An operation under the condition that the server must refuse: a typed refusal, and every key
/// as it was.
#[track_caller]
fn refused<T: std::fmt::Debug>(
    server: &Server,
    before: &BTreeMap<String, String>,
    what: &str,
    r: leasehold::Result<T>,
) {
    match r {
        Err(e) if is_refusal(&e) => {}
        other => panic!("{what}: want the server's refusal, got {other:?}"),
    }
    assert_eq!(
        &snapshot(server),
        before,
        "{what} changed keys while refused"
    );
}

/// A queue settle or reap, whose first write frees memory (`ZREM`, `HDEL`): under OOM it runs in
/// full (Redis lets a script that has written once write on); under any other condition it is
/// refused with every key as it was. Returns whether it ran.
#[track_caller]
fn runs_only_under_oom<T: std::fmt::Debug>(
    must_run: bool,
    server: &Server,
    before: &BTreeMap<String, String>,
    what: &str,
    r: leasehold::Result<T>,
) -> bool {
    if must_run {
        if let Err(e) = r {
            panic!("{what} under OOM: its first write frees memory, so it runs; got {e:?}");
        }
        true
    } else {
        refused(server, before, what, r);
        false
    }
}

/// Every lock, gate and queue operation against a server in `cond`, then recovery.
async fn every_operation(flavor: Flavor, cond: Condition) {
    let server = Server::start(flavor);
    let (lock_url, queue_url) = urls(&server, cond);
    let locker = Locker::redis(&lock_url).await.expect("connect");
    let other = Locker::redis(&lock_url)
        .await
        .expect("connect a second client");
    let held = other
        .try_acquire("held", &opts(30_000))
        .await
        .expect("held");
    let mine = locker
        .try_acquire("mine", &opts(30_000).renew(false))
        .await
        .expect("mine");
    let gate = locker.fence_gate("ledger").expect("gate");
    gate.admit(mine.fence()).await.expect("admit");

    let q = Queue::redis(&queue_url, "jobs").await.expect("queue");
    let mut jobs = BTreeSet::new();
    for p in [b"a", b"b", b"c", b"d", b"e", b"f"] {
        jobs.insert(q.enqueue(p).await.expect("enqueue"));
    }
    let active = q.claim(Duration::from_secs(60)).await.expect("claim");
    let active = active.expect("a pending job");
    // 300 ms: its reply on a loaded machine still comes within it.
    let expiring = q.claim(Duration::from_millis(300)).await.expect("claim");
    assert!(expiring.is_some(), "a pending job");
    let delayed = q.claim(Duration::from_secs(60)).await.expect("claim");
    let delayed = delayed.expect("a pending job");
    let (delayed_id, delayed_att) = (delayed.id(), delayed.attempts());
    q.retry(delayed_id, delayed_att, Duration::from_millis(50))
        .await
        .expect("retry with a delay");
    let to_retry = q.claim(Duration::from_secs(60)).await.expect("claim");
    let to_retry = to_retry.expect("a pending job");
    let to_fail = q.claim(Duration::from_secs(60)).await.expect("claim");
    let to_fail = to_fail.expect("a pending job");
    // One job left pending, three active, one whose lease ran out, one delayed and due.
    sleep(Duration::from_millis(400)).await;

    set_condition(&server, cond, true);
    let before = snapshot(&server);

    // Refused whatever the data: each needs memory (OOM), writes (MISCONF, READONLY), or any
    // command (NOPERM), or runs a denied command (DeniedInScript) before it writes anything.
    refused(
        &server,
        &before,
        "try_acquire of a free key",
        locker.try_acquire("free", &opts(5_000)).await,
    );
    refused(
        &server,
        &before,
        "try_acquire of a held key",
        locker.try_acquire("held", &opts(5_000)).await,
    );
    let started = Instant::now();
    refused(
        &server,
        &before,
        "acquire with a wait",
        locker
            .acquire("free", &opts(5_000).wait(Duration::from_secs(3)))
            .await,
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "acquire spent its wait on a refusal: {:?}",
        started.elapsed()
    );
    refused(
        &server,
        &before,
        "with_lock",
        locker.with_lock("free", &opts(5_000), |_| async {}).await,
    );
    refused(
        &server,
        &before,
        "fence gate admit",
        gate.admit(leasehold::Fence(mine.fence().get() + 1)).await,
    );
    refused(&server, &before, "enqueue", q.enqueue(b"e").await);
    refused(
        &server,
        &before,
        "queue extend",
        q.extend(active.id(), active.attempts(), Duration::from_secs(60))
            .await,
    );

    // Under OOM these run: they free memory or need none (Redis lets a script that has written
    // once write on). Otherwise they are refused.
    let must_run = cond == Condition::Oom;
    let mut completed = BTreeSet::new();
    let before = snapshot(&server);
    let r = q.complete(active.id(), active.attempts()).await;
    if runs_only_under_oom(must_run, &server, &before, "queue complete", r) {
        completed.insert(active.id());
    }
    let before = snapshot(&server);
    let r = q
        .retry(to_retry.id(), to_retry.attempts(), Duration::ZERO)
        .await;
    let retried = runs_only_under_oom(must_run, &server, &before, "queue retry", r);
    let before = snapshot(&server);
    let r = q.fail(to_fail.id(), to_fail.attempts(), "hostile").await;
    let mut failed = BTreeSet::new();
    if runs_only_under_oom(must_run, &server, &before, "queue fail", r) {
        failed.insert(to_fail.id());
    }
    let before = snapshot(&server);
    runs_only_under_oom(must_run, &server, &before, "reap", q.reap().await);
    let before = snapshot(&server);
    let claimed = q.claim(Duration::from_secs(60)).await;
    let claimed = match claimed {
        Ok(c) if must_run => c,
        Err(e) if is_refusal(&e) => {
            assert_eq!(snapshot(&server), before, "a refused claim changed keys");
            None
        }
        other => panic!("claim: want the server's refusal (or, under OOM, success), got {other:?}"),
    };
    let before = snapshot(&server);
    let counts = q.counts().await;
    match cond {
        // Reading needs neither memory nor writes.
        Condition::Oom | Condition::Misconf | Condition::ReadOnly => {
            counts.expect("counts under a write refusal");
        }
        Condition::NoPerm | Condition::DeniedInScript => {
            refused(&server, &before, "counts", counts)
        }
    }

    let before = snapshot(&server);
    let extended = mine.extend(Duration::from_secs(30)).await;
    if must_run {
        extended.expect("extend under OOM: PEXPIRE needs no memory");
    } else {
        refused(&server, &before, "lease extend", extended);
    }
    let released = mine.release().await;
    if must_run {
        assert_eq!(released.expect("release under OOM"), Release::Released);
    } else {
        refused(&server, &before, "release", released);
    }
    assert!(!held.is_lost(), "the other holder lost its lease");

    // The condition clears: everything works again, nothing was lost.
    set_condition(&server, cond, false);
    let short = opts(5_000);
    let fresh = retry_until_ok("acquire after recovery", || {
        locker.try_acquire("free", &short)
    })
    .await;
    assert!(
        fresh.fence() > held.fence(),
        "fences went back: {} after {}",
        fresh.fence(),
        held.fence()
    );
    retry_until_ok("admit after recovery", || gate.admit(fresh.fence())).await;
    assert!(matches!(
        gate.admit(held.fence()).await,
        Err(Error::Stale { .. })
    ));
    match locker.try_acquire("held", &opts(5_000)).await {
        Err(Error::Busy { .. }) => {}
        other => panic!("the held key must still be held: {other:?}"),
    }
    assert_eq!(fresh.release().await.expect("release"), Release::Released);
    assert_eq!(held.release().await.expect("release"), Release::Released);
    if !must_run {
        // `mine` was refused its release: it is still on the server.
        let key = locker.lock_key("mine").expect("key").lock_key().to_owned();
        assert_eq!(server.cmd::<i64>(&["EXISTS", &key]), 1);
    }

    // Every job comes out exactly once: drain the queue, reaping the expired lease.
    if let Some(c) = claimed {
        q.complete(c.id(), c.attempts()).await.expect("complete");
        completed.insert(c.id());
    }
    // Settle by hand what was refused under the condition: each job still active as before.
    if !retried {
        q.retry(to_retry.id(), to_retry.attempts(), Duration::ZERO)
            .await
            .expect("retry after recovery");
    }
    if failed.is_empty() {
        q.fail(to_fail.id(), to_fail.attempts(), "after recovery")
            .await
            .expect("fail after recovery");
        failed.insert(to_fail.id());
    }
    let extra = retry_until_ok("enqueue after recovery", || q.enqueue(b"e")).await;
    let mut expected = jobs;
    expected.insert(extra);
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        q.reap().await.expect("reap");
        while let Some(c) = q.claim(Duration::from_secs(60)).await.expect("claim") {
            q.complete(c.id(), c.attempts()).await.expect("complete");
            assert!(completed.insert(c.id()), "job {:?} ran twice", c.id());
        }
        let n = q.counts().await.expect("counts");
        if (n.pending, n.active, n.delayed, n.dead) == (0, 0, 0, 1) {
            break;
        }
        // The active job's 60 s lease is still running unless it was completed above.
        if n.active == 1 && n.pending + n.delayed == 0 {
            q.complete(active.id(), active.attempts())
                .await
                .expect("complete the active job");
            completed.insert(active.id());
            continue;
        }
        assert!(Instant::now() < give_up, "the queue never drained: {n:?}");
        sleep(Duration::from_millis(20)).await;
    }
    let info = q.job(to_fail.id()).await.expect("the failed job");
    assert_eq!(info.state, leasehold::queue::JobState::Dead);
    completed.extend(failed);
    assert_eq!(completed, expected, "jobs lost or invented");
}

/// Retries an operation that may fail once while a connection settles after the condition.
async fn retry_until_ok<T, F, Fut>(what: &str, mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = leasehold::Result<T>>,
{
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        match op().await {
            Ok(v) => return v,
            Err(e) if Instant::now() < give_up && e.is_transient() => {
                sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

/// A renewing lease on a server that starts refusing: lost before its deadline when renewal is
/// refused; kept when renewal still runs (OOM: PEXPIRE needs no memory).
async fn renewal(flavor: Flavor, cond: Condition) {
    let server = Server::start(flavor);
    let (lock_url, _) = urls(&server, cond);
    let locker = Locker::redis(&lock_url).await.expect("connect");
    // The drift allowance (1% + 2 ms) is the margin by which loss is reported early: 2 s gives
    // 22 ms, room for a late timer on a loaded machine.
    let ttl = Duration::from_millis(2_000);
    let lease = locker
        .try_acquire("renewed", &LockOptions::new().ttl(ttl))
        .await
        .expect("acquire");
    let key = locker
        .lock_key("renewed")
        .expect("key")
        .lock_key()
        .to_owned();
    set_condition(&server, cond, true);
    let fired = timeout(3 * ttl, lease.lost()).await.is_ok();
    if cond == Condition::Oom {
        assert!(!fired, "renewal under OOM failed: PEXPIRE needs no memory");
        assert!(server.cmd::<i64>(&["PTTL", &key]) > 0, "the key lapsed");
    } else {
        assert!(fired, "lost() never fired while every renewal was refused");
        let pttl: i64 = server.cmd(&["PTTL", &key]);
        // Read at once after lost() fired: the server still holds the key, so the holder was
        // told before another could take it.
        assert!(
            pttl > 0,
            "lost() fired after the server let the key expire (PTTL {pttl})"
        );
        eprintln!("lost() fired {pttl} ms before the server's expiry");
    }
    set_condition(&server, cond, false);
    match lease.release().await {
        Ok(r) if cond == Condition::Oom => assert_eq!(r, Release::Released),
        // Lost, yet still on the server (its last renewal landed): the token still matches.
        Ok(_) => {}
        Err(e) => panic!("release after recovery: {e:?}"),
    }
    // A fresh lease renews again once the condition has cleared.
    let again: Lease = locker
        .try_acquire("renewed2", &LockOptions::new().ttl(ttl))
        .await
        .expect("acquire after recovery");
    assert!(
        timeout(2 * ttl, again.lost()).await.is_err(),
        "renewal did not recover"
    );
    again.release().await.expect("release");
}

/// A renewing lease on servers (one, or the members of a Redlock quorum) that refuse for a
/// while shorter than its validity: an explicit extend answers a transient error and leaves the
/// lease alone, the renewals refused in the meantime are retried, and once the condition clears
/// renewal resumes and the lease was never lost. Under OOM renewal runs throughout.
///
/// Before release.lua/extend.lua told a refusal from "not held", a `GET` denied inside the
/// script (DeniedInScript) read as "not held": extend answered `LeaseLost` and the first refused
/// renewal marked a lease lost that the server still held.
async fn brief_refusal(flavor: Flavor, cond: Condition, members: usize) {
    let servers: Vec<Server> = (0..members).map(|_| Server::start(flavor)).collect();
    let lock_urls: Vec<String> = servers.iter().map(|s| urls(s, cond).0).collect();
    let locker = if members == 1 {
        Locker::redis(&lock_urls[0]).await.expect("connect")
    } else {
        let urls: Vec<&str> = lock_urls.iter().map(String::as_str).collect();
        Locker::redlock(&urls).await.expect("connect")
    };
    // Renewal every third of the TTL, retries every tenth (at most 250 ms). 4 s, so that the
    // condition can be cleared (a background save on each of three members, for MISCONF) and a
    // retry get through well before the lease's alarm on a loaded machine: at 2 s that left
    // about 400 ms.
    let ttl = Duration::from_millis(4_000);
    let lease = locker
        .try_acquire("brief", &LockOptions::new().ttl(ttl))
        .await
        .expect("acquire");
    let granted = Instant::now();
    let key = locker.lock_key("brief").expect("key").lock_key().to_owned();
    for s in &servers {
        set_condition(s, cond, true);
    }
    assert!(
        granted.elapsed() < ttl / 3,
        "setting the condition took {:?}: the first renewal may have gone through before it",
        granted.elapsed()
    );
    let runs = cond == Condition::Oom;
    // One server names the refused lease; a quorum whose members all refused cannot tell.
    match lease.extend(ttl).await {
        Ok(()) if runs => {}
        Err(Error::Refused { op, key, .. }) if !runs && members == 1 => {
            assert_eq!((op, key.as_str()), ("extend", "brief"));
        }
        Err(Error::NoQuorum { .. }) if !runs && members > 1 => {}
        other => panic!("extend under {cond:?}: want the server's refusal, got {other:?}"),
    }
    assert!(!lease.is_lost(), "a refused extend marked the lease lost");
    // Past the first renewal (a third of the TTL) and its retries, counted from the grant.
    tokio::time::sleep_until(granted + ttl * 3 / 5).await;
    assert!(
        !lease.is_lost(),
        "the lease was reported lost (seen {:?} after the grant) while every server held it",
        granted.elapsed()
    );
    if !runs {
        // No renewal got through: the key runs down from the grant, or from the refused
        // extend, whose server never ran it.
        for s in &servers {
            let pttl: i64 = s.cmd(&["PTTL", &key]);
            assert!(
                pttl > 0 && pttl < (ttl - ttl / 3).as_millis() as i64,
                "a renewal went through under {cond:?} (PTTL {pttl})"
            );
        }
    }
    // Servers recover one after another (MISCONF's recovery is a background save each). Once a
    // quorum of them renewed, the next renewal is due a third of the TTL later, so a member
    // that recovered just after may let its copy expire first: Redlock holds the lease on the
    // quorum, which is what is checked.
    for s in &servers {
        set_condition(s, cond, false);
    }
    let recovered = granted.elapsed();
    // Well past the deadline the refused renewals would have left it.
    sleep(ttl).await;
    assert!(
        !lease.is_lost(),
        "renewal did not resume after the condition (cleared {recovered:?} after the grant)"
    );
    let holding = servers
        .iter()
        .filter(|s| s.cmd::<i64>(&["PTTL", &key]) > 0)
        .count();
    let needed = members / 2 + 1;
    assert!(
        holding >= needed,
        "the key is held on {holding} of {members} servers (cleared {recovered:?} after the grant)"
    );
    if holding < members {
        eprintln!(
            "{} of {members} members let the key expire before they recovered ({recovered:?})",
            members - holding
        );
    }
    assert_eq!(lease.release().await.expect("release"), Release::Released);
}

/// The same on a 3-master cluster, where renewal goes to each node as one script over its slots
/// and, when a node refuses that, slot by slot: both meet the denied `GET`. An explicit extend
/// answers the node's refusal (`Error::Refused` naming the lease, not `Unavailable`, which would
/// say the node could not be reached), and the lease outlasts the refusal. The cluster's user
/// has every command (the client needs `CLUSTER SLOTS`) until `GET` is taken away.
async fn cluster_brief_refusal_in_script(flavor: Flavor) {
    let cluster = Cluster::start(flavor, 3, 0);
    let set_user = |rule: &[&str]| {
        for n in &cluster.nodes {
            let mut args = vec!["ACL", "SETUSER", "locks"];
            args.extend_from_slice(rule);
            let _: () = n.cmd(&args);
        }
    };
    set_user(&["on", ">pw", "~*", "&*", "+@all"]);
    let urls: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("redis://locks:pw@127.0.0.1:{}/", n.port))
        .collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let locker = Locker::redis_cluster(&urls).await.expect("connect");
    // 4 s, as on one server and a quorum (at 2 s the checks below had about 400 ms to spare).
    let ttl = Duration::from_millis(4_000);
    let lease = locker
        .try_acquire("brief", &LockOptions::new().ttl(ttl))
        .await
        .expect("acquire");
    let granted = Instant::now();
    let key = locker.lock_key("brief").expect("key").lock_key().to_owned();
    set_user(&["-get"]);
    match lease.extend(ttl).await {
        Err(Error::Refused { op, key, .. }) => {
            assert_eq!((op, key.as_str()), ("extend", "brief"));
        }
        other => panic!("extend with GET denied: want the server's refusal, got {other:?}"),
    }
    // Past the first renewal (a third of the TTL) and its retries, counted from the grant.
    tokio::time::sleep_until(granted + ttl * 3 / 5).await;
    assert!(
        !lease.is_lost(),
        "the lease was reported lost (seen {:?} after the grant) while the cluster held it",
        granted.elapsed()
    );
    let pttl: i64 = cluster.cmd(&["PTTL", &key]);
    assert!(
        pttl > 0 && pttl < (ttl - ttl / 3).as_millis() as i64,
        "a renewal went through with GET denied (PTTL {pttl})"
    );
    set_user(&["+get"]);
    sleep(ttl).await;
    assert!(
        !lease.is_lost(),
        "renewal did not resume after the condition"
    );
    assert_eq!(lease.release().await.expect("release"), Release::Released);
}

/// A worker's job lease on a server that starts refusing: the worker cancels the handler while
/// the lease still holds on the server (its renewal needs a write, refused under all three
/// conditions, OOM included: `ZADD` may need memory), and once the condition clears the reaper
/// hands the job out again and it completes.
async fn worker_renewal(flavor: Flavor, cond: Condition) {
    /// Notes when the handler was dropped (cancelled).
    struct OnDrop(Arc<Mutex<Option<Instant>>>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        }
    }
    let server = Server::start(flavor);
    let (_, queue_url) = urls(&server, cond);
    let q = Queue::redis(&queue_url, "work").await.expect("queue");
    let id = q.enqueue(b"slow").await.expect("enqueue");
    let runs = Arc::new(AtomicU64::new(0));
    let dropped = Arc::new(Mutex::new(None));
    let (r, d) = (runs.clone(), dropped.clone());
    // As for `renewal`: 2 s leaves a 22 ms drift allowance.
    let lease = Duration::from_millis(2_000);
    let worker = Worker::new(q.clone())
        .ttl(lease)
        .reap_every(Duration::from_millis(200))
        .start(move |_job| {
            let (r, d) = (r.clone(), d.clone());
            async move {
                // The first run blocks until it is cancelled; the run after recovery completes.
                if r.fetch_add(1, Ordering::SeqCst) == 0 {
                    let _guard = OnDrop(d);
                    sleep(Duration::from_secs(60)).await;
                }
                Ok(())
            }
        })
        .expect("start");
    let give_up = Instant::now() + Duration::from_secs(5);
    while runs.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < give_up, "the worker never ran the job");
        sleep(Duration::from_millis(10)).await;
    }
    // Renewal holds the lease past its length before the condition.
    sleep(lease + lease / 2).await;
    let dropped_at = || *dropped.lock().unwrap_or_else(PoisonError::into_inner);
    assert!(dropped_at().is_none(), "cancelled while renewals worked");
    set_condition(&server, cond, true);
    let give_up = Instant::now() + 3 * lease;
    let cancelled = loop {
        if let Some(at) = dropped_at() {
            break at;
        }
        assert!(
            Instant::now() < give_up,
            "the handler ran on while every renewal was refused"
        );
        sleep(Duration::from_millis(5)).await;
    };
    // The job's lease deadline on the server's clock, mapped onto the local clock through one
    // reading of both: the handler must have been dropped before it, so before anyone else
    // could claim the job.
    let read_at = Instant::now();
    let now = server_now_ms(&server) as i64;
    let deadline = job_deadline_ms(&server, &q, id) as i64;
    let since_cancel = read_at.duration_since(cancelled).as_millis() as i64;
    let margin = deadline - now + since_cancel;
    assert!(
        margin > 0,
        "the handler was cancelled {} ms after its lease ran out on the server",
        -margin
    );
    eprintln!("cancelled {margin} ms before the server's lease deadline");
    set_condition(&server, cond, false);
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        let n = q.counts().await;
        if runs.load(Ordering::SeqCst) >= 2
            && n.as_ref()
                .is_ok_and(|n| (n.pending, n.active, n.delayed, n.dead) == (0, 0, 0, 0))
        {
            break;
        }
        assert!(
            Instant::now() < give_up,
            "the job never completed after recovery: {n:?}, {} runs",
            runs.load(Ordering::SeqCst)
        );
        sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the job ran more than twice"
    );
    let report = worker.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report.completed, 1, "{report:?}");
}

/// The job's lease deadline in server milliseconds, read as the default user.
fn job_deadline_ms(server: &Server, q: &Queue, id: JobId) -> u64 {
    let key = format!("{{leasehold:{}}}:active", q.name());
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(&key)
        .arg(id.get().to_string())
        .query(&mut server.conn())
        .expect("ZSCORE");
    score.expect("the job is still active") as u64
}

fn server_now_ms(server: &Server) -> u64 {
    server.time_micros() / 1_000
}

/// A Redlock quorum whose members run out of memory: one refusing member still leaves a
/// majority that grants; two make the acquire fail for want of a quorum (not for a foreign type
/// the keys do not hold), with no lock key left behind; after recovery the fence keeps rising.
async fn quorum_members_out_of_memory(flavor: Flavor) {
    let members: Vec<Server> = (0..3).map(|_| Server::start(flavor)).collect();
    let urls: Vec<String> = members.iter().map(Server::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let locker = Locker::redlock(&urls).await.expect("connect");
    let key = locker.lock_key("q").expect("key").lock_key().to_owned();

    set_condition(&members[0], Condition::Oom, true);
    let first = locker
        .try_acquire("q", &opts(5_000))
        .await
        .expect("two of three members still grant");
    let fence = first.fence();
    assert_eq!(first.release().await.expect("release"), Release::Released);

    set_condition(&members[1], Condition::Oom, true);
    match locker.try_acquire("q", &opts(5_000)).await {
        Err(Error::NoQuorum { .. }) => {}
        other => panic!("want NoQuorum with two members out of memory, got {other:?}"),
    }
    for m in &members {
        assert_eq!(
            m.cmd::<i64>(&["EXISTS", &key]),
            0,
            "a failed acquire left a key"
        );
    }

    set_condition(&members[0], Condition::Oom, false);
    set_condition(&members[1], Condition::Oom, false);
    let again = locker
        .try_acquire("q", &opts(5_000))
        .await
        .expect("acquire after recovery");
    assert!(again.fence() > fence, "{} after {fence}", again.fence());
    again.release().await.expect("release");
}

/// Whether `e` is the server's `LOADING` refusal.
fn is_loading(e: &Error) -> bool {
    matches!(e, Error::Refused { source, .. }
        if source.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading))
}

fn refused_loading<T: std::fmt::Debug>(what: &str, r: leasehold::Result<T>) {
    match r {
        Err(e) if is_loading(&e) => assert!(e.is_transient(), "{what}: {e} is not transient"),
        other => panic!("{what} while the server loads: want Refused (LOADING), got {other:?}"),
    }
}

/// A server loading its dataset after a restart refuses every command of ours with `LOADING`.
/// Each operation then answers `Refused` (transient), never a misleading error: not busy, not
/// "not held", not a lost lease. A lease saved with the dataset is neither lost nor taken while
/// the server loads; once loaded it is still its holder's, a release refused during the load
/// left its key in place, and the next grant's fence is higher.
async fn loading(flavor: Flavor) {
    let mut server = Server::start(flavor);
    // Loaded at 50 us a key: 20,000 keys took about 2.5 s here (each pause sleeps longer than
    // asked); twice that leaves room for a loaded machine.
    let _: i64 = server.cmd(&[
        "EVAL",
        "for i = 1, tonumber(ARGV[1]) do redis.call('SET', 'pad:' .. i, 'x') end return 1",
        "0",
        "40000",
    ]);
    let locker = Locker::redis(&server.url()).await.expect("connect");
    let other = Locker::redis(&server.url()).await.expect("connect");
    let kept = locker
        .try_acquire("kept", &opts(30_000))
        .await
        .expect("kept");
    let dropped = locker
        .try_acquire("dropped", &opts(30_000))
        .await
        .expect("dropped");
    let dropped_key = locker
        .lock_key("dropped")
        .expect("key")
        .lock_key()
        .to_owned();
    let gate = locker.fence_gate("ledger").expect("gate");
    gate.admit(kept.fence()).await.expect("admit");
    let q = Queue::redis(&server.url(), "jobs").await.expect("queue");
    let job = q.enqueue(b"saved").await.expect("enqueue");
    let _: String = server.cmd(&["SAVE"]);

    server.restart_loading(Duration::from_micros(50));
    // The first commands after the kill may meet the dead connection (or a reconnect); from
    // the first `LOADING` on, the connection is the new one.
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        match locker.try_acquire("free", &opts(5_000)).await {
            Err(e) if is_loading(&e) => break,
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                sleep(Duration::from_millis(10)).await;
            }
            other => panic!("want LOADING after the restart, got {other:?}"),
        }
    }
    refused_loading(
        "try_acquire of a saved key",
        other.try_acquire("kept", &opts(5_000)).await,
    );
    refused_loading(
        "try_acquire of a free key",
        other.try_acquire("free", &opts(5_000)).await,
    );
    refused_loading("extend", kept.extend(Duration::from_secs(30)).await);
    refused_loading("release", dropped.release().await);
    refused_loading("admit", gate.admit(kept.fence()).await);
    // The queue's own connection meets the dead one first, as the locker's did.
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        match q.counts().await {
            Err(e) if is_loading(&e) => break,
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                sleep(Duration::from_millis(10)).await;
            }
            other => panic!("want LOADING from the queue, got {other:?}"),
        }
    }
    refused_loading("enqueue", q.enqueue(b"new").await);
    refused_loading("claim", q.claim(Duration::from_secs(60)).await);
    assert!(!kept.is_lost(), "a refused extend marked the lease lost");
    assert_eq!(
        server.loading(),
        Some(true),
        "the load ended before the checks did: the answers above were not all read while it lasted"
    );

    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    while server.loading() != Some(false) {
        assert!(std::time::Instant::now() < give_up, "the load never ended");
        sleep(Duration::from_millis(20)).await;
    }
    assert!(
        matches!(
            other.try_acquire("kept", &opts(5_000)).await,
            Err(Error::Busy { .. })
        ),
        "the lease saved with the dataset is not held after the load"
    );
    assert_eq!(
        server.cmd::<i64>(&["EXISTS", &dropped_key]),
        1,
        "a release refused while loading removed the key"
    );
    assert!(!kept.is_lost(), "the lease was reported lost");
    let fence = kept.fence();
    assert_eq!(kept.release().await.expect("release"), Release::Released);
    let next = other
        .try_acquire("kept", &opts(5_000))
        .await
        .expect("acquire after the release");
    assert!(next.fence() > fence, "{} after {fence}", next.fence());
    gate.admit(next.fence())
        .await
        .expect("admit the next fence");
    assert!(
        matches!(gate.admit(fence).await, Err(Error::Stale { .. })),
        "the gate forgot the fence it admitted before the restart"
    );
    next.release().await.expect("release");
    let claim = q.claim(Duration::from_secs(60)).await.expect("claim");
    let claim = claim.expect("the job saved with the dataset");
    assert_eq!((claim.id(), claim.payload()), (job, &b"saved"[..]));
    let empty = q.claim(Duration::from_secs(60)).await.expect("claim");
    assert!(empty.is_none(), "a refused enqueue left a job: {empty:?}");
}

/// On a cluster, `LOADING` is no verdict. A node loading its dataset refuses a keyed command
/// with `CLUSTERDOWN`, not `LOADING` (checked here on the node itself), so the `LOADING` a
/// cluster request meets is the error of the client's failed slot-map refresh (a node's
/// answer to its `PING` or `CLUSTER SLOTS`), which redis-rs hands to every request in flight,
/// including ones a node already ran. Through a load, then, no cluster operation answers
/// `Refused` with `LOADING` ("wrote nothing"; the unit test in `error.rs` pins what it answers
/// instead, `OutcomeUnknown`), every error is transient, and nothing is left held: after the
/// load the key asked for during it is free, the lease saved with the dataset is still its
/// holder's, and the saved job is still there.
async fn cluster_loading(flavor: Flavor) {
    let mut cluster = Cluster::start(flavor, 1, 0);
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let node = &mut cluster.nodes[0];
    let _: i64 = node.cmd(&[
        "EVAL",
        "for i = 1, tonumber(ARGV[1]) do redis.call('SET', 'pad:' .. i, 'x') end return 1",
        "0",
        "40000",
    ]);
    let locker = Locker::redis_cluster(&urls).await.expect("connect");
    let kept = locker
        .try_acquire("kept", &opts(30_000))
        .await
        .expect("kept");
    let q = Queue::builder("jobs").cluster(&urls).await.expect("queue");
    q.enqueue(b"saved").await.expect("enqueue");
    let _: String = node.cmd(&["SAVE"]);

    node.restart_loading(Duration::from_micros(50));
    let mut raw = node.conn();
    let ping = redis::cmd("PING").query::<String>(&mut raw).err();
    let set = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query::<()>(&mut raw)
        .err();
    let code = |e: &Option<redis::RedisError>| e.as_ref().and_then(|e| e.code().map(str::to_owned));
    assert_eq!(
        (code(&ping).as_deref(), code(&set).as_deref()),
        (Some("LOADING"), Some("CLUSTERDOWN")),
        "what a loading cluster node answers: PING {ping:?}, SET {set:?}"
    );
    let mut errors = 0;
    while node.loading() == Some(true) {
        let acquired = locker.try_acquire("free", &opts(5_000)).await;
        let enqueued = q.enqueue(b"new").await;
        for e in [acquired.err(), enqueued.err()].into_iter().flatten() {
            assert!(
                !is_loading(&e),
                "a cluster request that met LOADING said it wrote nothing: {e:?}"
            );
            assert!(e.is_transient(), "{e:?} is not transient");
            errors += 1;
        }
        sleep(Duration::from_millis(10)).await;
    }
    assert!(errors > 0, "no request was refused while the node loaded");

    let other = Locker::redis_cluster(&urls).await.expect("connect");
    let give_up = Instant::now() + Duration::from_secs(10);
    let free = loop {
        // The node takes up its slots a moment after the load. A wait shorter than the 5 s TTL:
        // an acquire of the loop above that landed as the load ended was dropped, and its
        // background release frees the key at once; a grant left to its TTL would not be.
        match other
            .acquire("free", &opts(5_000).wait(Duration::from_secs(2)))
            .await
        {
            Ok(free) => break free,
            Err(e) if e.is_transient() && Instant::now() < give_up => {
                sleep(Duration::from_millis(20)).await;
            }
            other => panic!("the key asked for during the load is not free after it: {other:?}"),
        }
    };
    assert!(
        matches!(
            other.try_acquire("kept", &opts(5_000)).await,
            Err(Error::Busy { .. })
        ),
        "the lease saved with the dataset is not held after the load"
    );
    assert!(!kept.is_lost(), "the lease was reported lost");
    free.release().await.expect("release");
    assert_eq!(kept.release().await.expect("release"), Release::Released);
    let claim = q.claim(Duration::from_secs(60)).await.expect("claim");
    assert_eq!(claim.expect("the saved job").payload(), &b"saved"[..]);
}

/// A release whose wake-up `PUBLISH` the server refuses (the ACL user may not publish) still
/// releases: the answer is `Released` and the key is gone; the refused publish is only a
/// wake-up missed, and a waiter still gets the lease from its timer.
async fn refused_publish(flavor: Flavor) {
    let server = Server::start(flavor);
    let locker = Locker::redis(&server.acl_user_url())
        .await
        .expect("connect as the lock user");
    let waiter = Locker::redis(&server.url()).await.expect("connect");
    let lease = locker
        .try_acquire("k", &opts(1_000))
        .await
        .expect("acquire");
    let key = locker.lock_key("k").expect("key").lock_key().to_owned();
    let waiting = tokio::spawn(async move {
        waiter
            .acquire("k", &opts(5_000).wait(Duration::from_secs(5)))
            .await
    });
    sleep(Duration::from_millis(100)).await;
    let _: () = server.cmd(&["ACL", "SETUSER", LOCK_USER, "-publish"]);
    let _: () = server.cmd(&["ACL", "LOG", "RESET"]);

    assert_eq!(lease.release().await.expect("release"), Release::Released);
    assert_eq!(
        server.cmd::<i64>(&["EXISTS", &key]),
        0,
        "the key is still there"
    );
    let log: Vec<std::collections::HashMap<String, redis::Value>> = server.cmd(&["ACL", "LOG"]);
    let denied = |e: &std::collections::HashMap<String, redis::Value>, field, want: &str| {
        e.get(field) == Some(&redis::Value::BulkString(want.as_bytes().to_vec()))
    };
    assert!(
        log.iter()
            .any(|e| denied(e, "object", "publish") && denied(e, "context", "lua")),
        "the server did not refuse the release's PUBLISH: {log:?}"
    );
    let next = timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter hung")
        .expect("the waiter panicked")
        .expect("the waiter gets the lease from its timer");
    next.release().await.expect("release");
}

/// The queue's wake-ups refused as `refused_publish` refuses the release's: the steps that
/// publish (enqueue, retry, reap) have already written when the `PUBLISH` is refused, so they
/// succeed, with their writes, and a waiting claim still finds the job by its timer. Reported
/// as refused, an enqueue would be retried by its caller and the job stored twice.
async fn queue_refused_publish(flavor: Flavor) {
    let server = Server::start(flavor);
    let queue = Queue::redis(&server.acl_user_url_for(QUEUE_USER), "refused-publish")
        .await
        .expect("connect as the queue user");
    let _: () = server.cmd(&["ACL", "SETUSER", QUEUE_USER, "-publish"]);
    let _: () = server.cmd(&["ACL", "LOG", "RESET"]);
    let id = queue.enqueue(b"once").await.expect("enqueue");
    assert_eq!(
        queue.counts().await.expect("counts").pending,
        1,
        "stored once"
    );
    let claim = queue
        .claim(Duration::from_secs(30))
        .await
        .expect("claim")
        .expect("the job");
    assert_eq!(claim.id(), id);
    claim.retry(Duration::ZERO).await.expect("retry");
    // 300 ms: a claim's reply on a loaded machine still comes within it (a reply after its
    // lease is refused as `LeaseLost`).
    let lapsed = queue
        .claim(Duration::from_millis(300))
        .await
        .expect("claim")
        .expect("the job again");
    assert_eq!(lapsed.attempts(), 2);
    sleep(Duration::from_millis(400)).await;
    let reaped = queue.reap().await.expect("reap");
    assert_eq!(reaped.len(), 1);
    let log: Vec<std::collections::HashMap<String, redis::Value>> = server.cmd(&["ACL", "LOG"]);
    assert!(
        log.iter()
            .any(|e| e.get("object") == Some(&redis::Value::BulkString(b"publish".to_vec()))),
        "the server did not refuse the queue's PUBLISH: {log:?}"
    );
    let again = queue
        .claim(Duration::from_secs(30))
        .await
        .expect("claim")
        .expect("the reaped job");
    assert_eq!((again.id(), again.attempts()), (id, 3));
    again.complete().await.expect("complete");
    // A claim already waiting when a job arrives without a wake-up finds it by its timer
    // (CLAIM_POLL_FALLBACK, a second), not at the end of its wait.
    let waiting = tokio::spawn({
        let queue = queue.clone();
        async move {
            let started = Instant::now();
            let claimed = queue
                .claim_wait(Duration::from_secs(30), Duration::from_secs(10))
                .await;
            (claimed.map(|c| c.map(|c| c.id())), started.elapsed())
        }
    });
    sleep(Duration::from_millis(200)).await;
    let late = queue.enqueue(b"late").await.expect("enqueue");
    let (claimed, took) = waiting.await.expect("the waiting claim");
    assert_eq!(claimed.expect("claim_wait"), Some(late));
    assert!(
        took < Duration::from_secs(5),
        "the claim waited {took:?}: neither woken nor found by its timer"
    );
}

/// A queue user made from the rule before `complete` kept the job's key as its done marker (no
/// `HDEL`): as the README says, each complete is refused with the job left as it was (still
/// active, claimable by no one else, its payload kept), and goes through once `HDEL` is given.
async fn queue_complete_without_hdel(flavor: Flavor) {
    let server = Server::start(flavor);
    let queue = Queue::redis(&server.acl_user_url_for(QUEUE_USER), "no-hdel")
        .await
        .expect("connect as the queue user");
    let id = queue.enqueue(b"kept").await.expect("enqueue");
    let claim = queue
        .claim(Duration::from_secs(30))
        .await
        .expect("claim")
        .expect("the job");
    let _: () = server.cmd(&["ACL", "SETUSER", QUEUE_USER, "-hdel"]);
    let before = snapshot(&server);
    for _ in 0..2 {
        match queue.complete(id, claim.attempts()).await {
            Err(e) if is_refusal(&e) => {}
            other => panic!("want a refusal, got {other:?}"),
        }
    }
    assert_eq!(
        snapshot(&server),
        before,
        "a refused complete changed a key"
    );
    let _: () = server.cmd(&["ACL", "SETUSER", QUEUE_USER, "+hdel"]);
    let info = queue.job(id).await.expect("job");
    assert_eq!(info.state, leasehold::queue::JobState::Active);
    assert_eq!(info.payload.as_deref(), Some(b"kept".as_slice()));
    claim
        .complete()
        .await
        .expect("complete with HDEL given back");
    assert_eq!(
        queue.job(id).await.expect("job").state,
        leasehold::queue::JobState::Done
    );
    let c = queue.counts().await.expect("counts");
    assert_eq!((c.pending, c.active, c.delayed, c.dead), (0, 0, 0, 0));
}

/// For each scenario `name`, the tests `redis_name` and `valkey_name`.
macro_rules! on_redis_and_valkey {
    ($($name:ident: $redis:ident, $valkey:ident;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $redis() {
                $name(Flavor::Redis).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $valkey() {
                $name(Flavor::Valkey).await;
            }
        )*
    };
}

/// A `#[locked]` body on a server that starts refusing its renewals (the ACL user loses every
/// command) once it has been renewed past its 2 s TTL: the body is dropped and the call returns
/// `LeaseLost` within that TTL of the first refusal, through the same loss signal as a plain
/// lease.
#[cfg(feature = "macros")]
async fn locked_body_cancelled_when_renewal_is_refused(flavor: Flavor) {
    let server = Server::start(flavor);
    let (lock_url, _) = urls(&server, Condition::NoPerm);
    let locker = Locker::redis(&lock_url).await.expect("connect");
    let started = Arc::new(tokio::sync::Notify::new());
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let call = tokio::spawn(renewed_until_refused(
        locker,
        started.clone(),
        finished.clone(),
    ));
    started.notified().await;
    // Renewed past its TTL before the refusals start.
    sleep(Duration::from_secs(3)).await;
    assert!(
        !call.is_finished(),
        "the body ended before renewals were refused"
    );
    let refused_at = Instant::now();
    set_condition(&server, Condition::NoPerm, true);
    let out = timeout(Duration::from_secs(6), call)
        .await
        .expect("the body still ran seconds after its lease's deadline")
        .expect("the call's task");
    let took = refused_at.elapsed();
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
    assert!(
        took < Duration::from_secs(2),
        "LeaseLost came {took:?} after renewals were refused, past the 2 s lease"
    );
    assert!(!finished.load(Ordering::SeqCst), "the body ran to its end");
    set_condition(&server, Condition::NoPerm, false);
}

#[cfg(feature = "macros")]
#[leasehold::locked(key = "refused-renewal", locker = locker, ttl = "2s")]
async fn renewed_until_refused(
    locker: Locker,
    started: Arc<tokio::sync::Notify>,
    finished: Arc<std::sync::atomic::AtomicBool>,
) -> Result<(), Error> {
    started.notify_one();
    sleep(Duration::from_secs(8)).await;
    finished.store(true, Ordering::SeqCst);
    Ok(())
}

#[cfg(feature = "macros")]
on_redis_and_valkey! {
    locked_body_cancelled_when_renewal_is_refused:
        redis_locked_body_cancelled_when_renewal_is_refused,
        valkey_locked_body_cancelled_when_renewal_is_refused;
}

on_redis_and_valkey! {
    cluster_brief_refusal_in_script: redis_cluster_brief_refusal_in_script,
        valkey_cluster_brief_refusal_in_script;
    quorum_members_out_of_memory: redis_quorum_members_out_of_memory,
        valkey_quorum_members_out_of_memory;
    loading: redis_loading, valkey_loading;
    cluster_loading: redis_cluster_loading, valkey_cluster_loading;
    refused_publish: redis_refused_publish, valkey_refused_publish;
    queue_refused_publish: redis_queue_refused_publish, valkey_queue_refused_publish;
    queue_complete_without_hdel: redis_queue_complete_without_hdel,
        valkey_queue_complete_without_hdel;
}

macro_rules! hostile {
    ($($name:ident: $flavor:expr, $cond:expr;)*) => {
        mod every_operation {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    every_operation($flavor, $cond).await;
                }
            )*
        }
        mod renewal {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    renewal($flavor, $cond).await;
                }
            )*
        }
        mod brief_refusal {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    brief_refusal($flavor, $cond, 1).await;
                }
            )*
        }
        /// The same on a Redlock quorum of three servers, all in the condition.
        mod quorum_brief_refusal {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    brief_refusal($flavor, $cond, 3).await;
                }
            )*
        }
        mod worker_renewal {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    worker_renewal($flavor, $cond).await;
                }
            )*
        }
    };
}

hostile! {
    redis_oom: Flavor::Redis, Condition::Oom;
    redis_noperm: Flavor::Redis, Condition::NoPerm;
    redis_misconf: Flavor::Redis, Condition::Misconf;
    valkey_oom: Flavor::Valkey, Condition::Oom;
    valkey_noperm: Flavor::Valkey, Condition::NoPerm;
    valkey_misconf: Flavor::Valkey, Condition::Misconf;
    redis_denied_in_script: Flavor::Redis, Condition::DeniedInScript;
    valkey_denied_in_script: Flavor::Valkey, Condition::DeniedInScript;
    redis_readonly: Flavor::Redis, Condition::ReadOnly;
    valkey_readonly: Flavor::Valkey, Condition::ReadOnly;
}
