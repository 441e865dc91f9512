//! Differential property test: the memory backend and a real Redis server, driven through the
//! `Backend` trait with the same random sequences of acquires (plain and keeping the fence),
//! releases, extends and sleeps, over a few keys and holders, with TTLs short enough to expire
//! mid-sequence. Each backend is checked step by step against a model of the lease semantics
//! (its own copy, kept in sync with what that backend answered; a holder's remaining TTL
//! included), and the two backends' answers against each other wherever neither can be racing
//! an expiry and both models saw the keys alike.
//!
//! Timing: every call is bracketed by clock readings (`sent`, `answered`); a lease granted or
//! extended by a call in that window with TTL `t` expires somewhere in
//! `[sent + t, answered + t + 1 ms]` (Redis keeps a key through the millisecond of its
//! expiry). A later call on that lease is judged only when its own window lies wholly before
//! or after that interval, with `MARGIN` to spare; otherwise it races the expiry and either
//! answer is accepted, the model following what the backend said.
//!
//! Fences differ in value between the backends (each takes them from its own clock): only
//! their properties are compared. A new grant's fence is above every fence granted before on
//! that key in that backend; a repeated acquire by the holder (the lost-reply retry) answers
//! its lease's own fence while that fence is kept (a keep-fence grant's fence is kept for its
//! keep from the grant, which an extend does not renew), and a new, higher one after.

mod support;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold::backend::{AcquireReply, Backend, MemoryBackend, RedisBackend};
use leasehold::{LockKey, Locker, Token};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use support::{Flavor, Server};

const KEYS: usize = 3;
const HOLDERS: usize = 3;
/// Lease TTLs, in ms: most short enough to run out within a sequence.
const TTLS: [u64; 6] = [10, 15, 25, 40, 80, 1_000];
/// How long a keep-fence acquire keeps the fence (at least the TTL, on both backends).
const KEEPS: [u64; 3] = [0, 30, 150];
/// Slack on each side of an expiry interval, for the two clocks (Redis's wall clock, this
/// process's monotonic one) and timer jitter: a call this close to an expiry races it.
const MARGIN: Duration = Duration::from_millis(2);
/// How far past its expiry a key is still there: Redis expires a key once its clock is past
/// the (whole) millisecond of its expiry.
const LAST_MS: Duration = Duration::from_millis(1);

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        key: usize,
        holder: usize,
        ttl: u64,
        /// `Some(ms)`: `acquire_keeping_fence` with that keep.
        keep: Option<u64>,
    },
    Release {
        key: usize,
        holder: usize,
    },
    /// One extend call renewing each (key, holder) in order.
    Extend {
        items: Vec<(usize, usize)>,
        ttl: u64,
    },
    Sleep(u64),
}

fn ttl() -> impl Strategy<Value = u64> {
    proptest::sample::select(TTLS.to_vec())
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS, 0..HOLDERS, ttl(), proptest::option::weighted(0.3, proptest::sample::select(KEEPS.to_vec())))
            .prop_map(|(key, holder, ttl, keep)| Op::Acquire { key, holder, ttl, keep }),
        2 => (0..KEYS, 0..HOLDERS).prop_map(|(key, holder)| Op::Release { key, holder }),
        2 => (proptest::collection::vec((0..KEYS, 0..HOLDERS), 1..=2), ttl())
            .prop_map(|(items, ttl)| Op::Extend { items, ttl }),
        2 => (1..30u64).prop_map(Op::Sleep),
    ]
}

/// A lease as a backend's model knows it.
#[derive(Clone, Copy, Debug)]
struct Lease {
    holder: usize,
    fence: u64,
    /// The step whose grant made the fence. Two models agree on a lease only if the same
    /// step made it on both: a repeated acquire that races the fence's keep may keep the
    /// fence on one backend and take a new one (kept for another span) on the other.
    granted_by: usize,
    /// The earliest and latest instants the lease can end at.
    ends: (Instant, Instant),
    /// The same for its fence, when a keep-fence grant made it (`None`: kept for ever). An
    /// extend renews the lease, not this: a repeated acquire by the holder once the fence is
    /// gone takes a new one, as after a restart.
    forgotten: Option<(Instant, Instant)>,
}

impl Lease {
    fn new(
        holder: usize,
        fence: u64,
        granted_by: usize,
        window: Window,
        ttl: Duration,
        keep: Option<u64>,
    ) -> Lease {
        Lease {
            holder,
            fence,
            granted_by,
            ends: window.expiry(ttl),
            // Kept at least the TTL, on both backends.
            forgotten: keep.map(|k| window.expiry(Duration::from_millis(k).max(ttl))),
        }
    }
}

/// When a call ran: between its `sent` and `answered` readings.
#[derive(Clone, Copy, Debug)]
struct Window {
    sent: Instant,
    answered: Instant,
}

impl Window {
    /// The interval in which a lease granted or renewed by this call for `ttl` ends.
    fn expiry(self, ttl: Duration) -> (Instant, Instant) {
        (self.sent + ttl, self.answered + ttl + LAST_MS)
    }
}

/// What a model can say of a key's lease when a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    /// No lease, or one sure to have ended.
    Free,
    /// Sure to be live, held by this holder.
    Held(usize),
    /// The call may run before or after the lease's end.
    Racing(usize),
}

#[derive(Clone, Debug, Default)]
struct KeyModel {
    lease: Option<Lease>,
    /// The highest fence granted on this key so far.
    last_fence: u64,
}

impl KeyModel {
    fn seen(&self, call: Window) -> Seen {
        match self.lease {
            None => Seen::Free,
            Some(l) if call.answered + MARGIN < l.ends.0 => Seen::Held(l.holder),
            Some(l) if call.sent > l.ends.1 + MARGIN => Seen::Free,
            Some(l) => Seen::Racing(l.holder),
        }
    }
}

/// One backend's model: one `KeyModel` per key.
#[derive(Clone, Debug, Default)]
struct Model {
    keys: [KeyModel; KEYS],
}

/// What a call answered, for comparison and the trace.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    /// `same` tells whether it is the holder's lease's own fence (a repeated acquire).
    Granted {
        fence: u64,
        same: bool,
    },
    Held {
        remaining: Option<Duration>,
    },
    Released(bool),
    Extended(Vec<bool>),
}

impl Outcome {
    /// The outcome with its backend-specific values (fence, remaining) left out.
    fn kind(&self) -> Outcome {
        match self {
            Outcome::Granted { same, .. } => Outcome::Granted {
                fence: 0,
                same: *same,
            },
            Outcome::Held { .. } => Outcome::Held { remaining: None },
            other => other.clone(),
        }
    }
}

/// Checks one backend's answer to `op` (run in `call`) against its model and updates the
/// model from it. Returns what the model saw of each key the call touched, in the order it
/// touched them (an extend of one key twice judges the second against the first renewal).
fn apply(
    model: &mut Model,
    step: usize,
    op: &Op,
    call: Window,
    outcome: &Outcome,
) -> Result<Vec<Seen>, String> {
    let mut seen = Vec::new();
    match (op, outcome) {
        (
            Op::Acquire {
                key,
                holder,
                ttl,
                keep,
            },
            _,
        ) => {
            let ttl = Duration::from_millis(*ttl);
            let k = &mut model.keys[*key];
            let s = k.seen(call);
            // Whether the holder's fence is still kept: a repeated acquire that may run on
            // either side of its keep's end races it as a lease's end is raced.
            let fence_kept = k.lease.map_or(Some(true), |l| match l.forgotten {
                None => Some(true),
                Some((early, _)) if call.answered + MARGIN < early => Some(true),
                Some((_, late)) if call.sent > late + MARGIN => Some(false),
                Some(_) => None,
            });
            seen.push(match s {
                Seen::Held(h) if h == *holder && fence_kept.is_none() => Seen::Racing(h),
                s => s,
            });
            match (s, outcome) {
                // A repeated acquire by the holder: its own fence while it is kept, the TTL
                // reset (the fence's keep is not).
                (Seen::Held(h) | Seen::Racing(h), Outcome::Granted { fence, same: true })
                    if h == *holder =>
                {
                    if fence_kept == Some(false) {
                        return Err(format!(
                            "a repeated acquire by the holder answered its fence {fence} after \
                             the fence's keep ran out"
                        ));
                    }
                    let lease = k.lease.as_mut().ok_or("no lease")?;
                    lease.ends = call.expiry(ttl);
                }
                (Seen::Held(h), Outcome::Granted { fence, same: false })
                    if h == *holder && fence_kept == Some(true) =>
                {
                    let lease = k.lease.ok_or("no lease")?;
                    return Err(format!(
                        "a repeated acquire by the holder of a live lease (fence {}) was granted \
                         another fence, {fence}",
                        lease.fence
                    ));
                }
                // Past its fence's keep: a new fence, above every earlier one, kept as this
                // call says.
                (Seen::Held(h) | Seen::Racing(h), Outcome::Granted { fence, same: false })
                    if h == *holder =>
                {
                    if *fence <= k.last_fence {
                        return Err(format!(
                            "fence {fence} granted again after fence {} on this key",
                            k.last_fence
                        ));
                    }
                    k.last_fence = *fence;
                    k.lease = Some(Lease::new(*holder, *fence, step, call, ttl, *keep));
                }
                // A new grant: a fresh fence, above every earlier one.
                (Seen::Free | Seen::Racing(_), Outcome::Granted { fence, same: false }) => {
                    if *fence <= k.last_fence {
                        return Err(format!(
                            "fence {fence} granted after fence {} on this key",
                            k.last_fence
                        ));
                    }
                    k.last_fence = *fence;
                    k.lease = Some(Lease::new(*holder, *fence, step, call, ttl, *keep));
                }
                (Seen::Held(h) | Seen::Racing(h), Outcome::Held { remaining }) if h != *holder => {
                    let lease = k.lease.as_mut().ok_or("no lease")?;
                    // The lease was still there when the call ran.
                    lease.ends.0 = lease.ends.0.max(call.sent);
                    let Some(r) = remaining else {
                        return Err("held without an expiry".into());
                    };
                    // What is left is the time to the lease's end less its last millisecond,
                    // read somewhere in the call's window.
                    let low = lease
                        .ends
                        .0
                        .saturating_duration_since(call.answered + LAST_MS + MARGIN);
                    let high = lease.ends.1.saturating_duration_since(call.sent) + MARGIN;
                    if *r < low || *r > high {
                        return Err(format!(
                            "{r:?} remaining, the model expects {low:?} to {high:?}"
                        ));
                    }
                }
                (s, o) => return Err(format!("{o:?} where the model sees {s:?}")),
            }
        }
        (Op::Release { key, holder }, Outcome::Released(released)) => {
            let k = &mut model.keys[*key];
            let s = k.seen(call);
            seen.push(s);
            match (s, *released) {
                (Seen::Held(h) | Seen::Racing(h), true) if h == *holder => k.lease = None,
                (Seen::Free, false) => k.lease = None,
                (Seen::Held(h), false) if h != *holder => {}
                // Another's lease, still there or not: untouched (it ends when it ends).
                (Seen::Racing(h), false) if h != *holder => {}
                // The holder's lease had ended.
                (Seen::Racing(_), false) => k.lease = None,
                (s, r) => return Err(format!("released {r} where the model sees {s:?}")),
            }
        }
        (Op::Extend { items, ttl }, Outcome::Extended(answers)) => {
            let ttl = Duration::from_millis(*ttl);
            if answers.len() != items.len() {
                return Err(format!(
                    "{} answers to {} items",
                    answers.len(),
                    items.len()
                ));
            }
            for ((key, holder), renewed) in items.iter().zip(answers) {
                let k = &mut model.keys[*key];
                let s = k.seen(call);
                seen.push(s);
                match (s, *renewed) {
                    (Seen::Held(h) | Seen::Racing(h), true) if h == *holder => {
                        let lease = k.lease.as_mut().ok_or("no lease")?;
                        lease.ends = call.expiry(ttl);
                    }
                    (Seen::Free, false) => k.lease = None,
                    (Seen::Held(h) | Seen::Racing(h), false) if h != *holder => {}
                    (Seen::Racing(_), false) => k.lease = None,
                    (s, r) => {
                        return Err(format!(
                            "extend of key {key} by holder {holder} answered {r} where the model sees {s:?}"
                        ));
                    }
                }
            }
        }
        (op, o) => return Err(format!("{o:?} answered to {op:?}")),
    }
    Ok(seen)
}

/// Runs `op` on one backend; the outcome and when the call ran.
async fn run<B: Backend>(
    backend: &B,
    model: &Model,
    keys: &[LockKey],
    tokens: &[Token],
    op: &Op,
) -> (Outcome, Window) {
    let sent = Instant::now();
    let outcome = match op {
        Op::Acquire {
            key,
            holder,
            ttl,
            keep,
        } => {
            let (k, t, ttl) = (&keys[*key], &tokens[*holder], Duration::from_millis(*ttl));
            let reply = match keep {
                None => backend.acquire(k, t, ttl).await,
                Some(keep) => {
                    backend
                        .acquire_keeping_fence(k, t, ttl, Duration::from_millis(*keep))
                        .await
                }
            };
            match reply.expect("acquire") {
                AcquireReply::Granted { fence, .. } => {
                    // Whether this is the holder's own lease, answered with its fence.
                    let same = model.keys[*key]
                        .lease
                        .is_some_and(|l| l.holder == *holder && l.fence == fence);
                    Outcome::Granted { fence, same }
                }
                AcquireReply::Held { remaining } => Outcome::Held { remaining },
            }
        }
        Op::Release { key, holder } => Outcome::Released(
            backend
                .release(&keys[*key], &tokens[*holder])
                .await
                .expect("release"),
        ),
        Op::Extend { items, ttl } => {
            let items: Vec<(LockKey, Token)> = items
                .iter()
                .map(|(k, h)| (keys[*k].clone(), tokens[*h].clone()))
                .collect();
            Outcome::Extended(
                backend
                    .extend(&items, Duration::from_millis(*ttl))
                    .await
                    .expect("extend"),
            )
        }
        Op::Sleep(_) => unreachable!("a sleep is taken once, for both backends"),
    };
    let answered = Instant::now();
    (outcome, Window { sent, answered })
}

/// Whether the two models agree on the lease of every key `op` touches (its holder, and the
/// grant that made its fence): only then must the backends answer alike (after a racing
/// call, they may have gone different ways).
fn in_step(memory: &Model, redis: &Model, op: &Op) -> bool {
    let same = |k: usize| match (memory.keys[k].lease, redis.keys[k].lease) {
        (None, None) => true,
        (Some(m), Some(r)) => m.holder == r.holder && m.granted_by == r.granted_by,
        _ => false,
    };
    match op {
        Op::Acquire { key, .. } | Op::Release { key, .. } => same(*key),
        Op::Extend { items, .. } => items.iter().all(|(k, _)| same(*k)),
        Op::Sleep(_) => true,
    }
}

static CASE: AtomicU64 = AtomicU64::new(0);

async fn case(
    memory: &MemoryBackend,
    redis: &RedisBackend,
    run_id: u64,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let n = CASE.fetch_add(1, Ordering::Relaxed);
    let names = Locker::new(memory.clone());
    // Fresh keys and tokens each case: nothing left by an earlier case is seen.
    let keys: Vec<LockKey> = (0..KEYS)
        .map(|k| {
            names
                .lock_key(&format!("parity:{run_id}:{n}:{k}"))
                .expect("key")
        })
        .collect();
    let tokens: Vec<Token> = (0..HOLDERS).map(|_| Token::generate()).collect();
    let (mut on_memory, mut on_redis) = (Model::default(), Model::default());
    let mut trace = String::new();
    let start = Instant::now();
    for (i, op) in ops.iter().enumerate() {
        if let Op::Sleep(ms) = op {
            // Once, for both backends.
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            let _ = writeln!(trace, "  {i:>2}. {op:?}");
            continue;
        }
        let in_step_before = in_step(&on_memory, &on_redis, op);
        let (m, mw) = run(memory, &on_memory, &keys, &tokens, op).await;
        let (r, rw) = run(redis, &on_redis, &keys, &tokens, op).await;
        let at = |w: Window| w.sent.duration_since(start).as_secs_f64() * 1e3;
        let _ = writeln!(
            trace,
            "  {i:>2}. {op:?}\n      memory {m:?} at {:.2} ms; redis {r:?} at {:.2} ms",
            at(mw),
            at(rw)
        );
        let seen_m = apply(&mut on_memory, i, op, mw, &m);
        let seen_r = apply(&mut on_redis, i, op, rw, &r);
        let fail = |why: String| {
            TestCaseError::fail(format!("step {i}: {why}\nsequence (case {n}):\n{trace}"))
        };
        let seen_m = seen_m.map_err(|e| fail(format!("memory: {e}")))?;
        let seen_r = seen_r.map_err(|e| fail(format!("redis: {e}")))?;
        // Where neither backend's call can have raced an expiry and both models saw the keys
        // it touched alike, the two must have answered alike. (The two calls of a step run one
        // after the other: a pause between them can put one lease surely live and the other
        // surely over, each answer then true to its own model. What is left of a lease is
        // checked against each backend's own model only, for the same reason.)
        let settled = |seen: &[Seen]| seen.iter().all(|s| !matches!(s, Seen::Racing(_)));
        if in_step_before && seen_m == seen_r && settled(&seen_m) && m.kind() != r.kind() {
            return Err(fail(format!("memory answered {m:?}, redis {r:?}")));
        }
    }
    Ok(())
}

/// A `redis-server` of its own (kept alive by the first value), a runtime, and the two
/// backends: the memory backend and that server's.
fn both_backends() -> (Server, tokio::runtime::Runtime, MemoryBackend, RedisBackend) {
    let server = Server::start(Flavor::Redis);
    let rt = support::runtime();
    let redis = rt
        .block_on(RedisBackend::connect(&server.url()))
        .expect("connect to the test server");
    (server, rt, MemoryBackend::new(), redis)
}

/// The memory backend and Redis answer random sequences alike.
#[test]
fn memory_backend_answers_as_redis() {
    let (_server, rt, memory, redis) = both_backends();
    let run_id = u64::from(std::process::id());
    let mut runner = TestRunner::new(Config {
        cases: 64,
        // Each shrink step replays a sequence against the server, sleeps included.
        max_shrink_iters: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let ops = proptest::collection::vec(op(), 4..40);
    let started = Instant::now();
    let result = runner.run(&ops, |ops| rt.block_on(case(&memory, &redis, run_id, &ops)));
    eprintln!(
        "{} cases in {:?}",
        CASE.load(Ordering::Relaxed),
        started.elapsed()
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Busy-waits until `at`: a timer would overshoot by up to a millisecond, the very precision
/// looked at here.
fn spin_until(at: Instant) {
    while Instant::now() < at {
        std::hint::spin_loop();
    }
}

/// What one trial of `a_lease_lives_through_the_millisecond_of_its_expiry` saw on a backend.
#[derive(Debug, Default)]
struct LastMs {
    trials: u32,
    /// Trials where the lease was held by a call sent its TTL after the grant was answered.
    outlived: u32,
    /// Trials whose check was answered less than TTL + 1 ms after the grant was sent: a lease
    /// kept through the millisecond of its expiry must have been seen held in those.
    conclusive: u32,
    /// Conclusive trials where the lease was seen gone.
    ended_early: u32,
}

fn last_ms_trial<B: Backend>(
    rt: &tokio::runtime::Runtime,
    backend: &B,
    key: &LockKey,
    seen: &mut LastMs,
) {
    let ttl = Duration::from_millis(10);
    let (holder, other) = (Token::generate(), Token::generate());
    let sent = Instant::now();
    let granted = rt.block_on(backend.acquire(key, &holder, ttl));
    let answered = Instant::now();
    assert!(
        matches!(granted, Ok(AcquireReply::Granted { .. })),
        "{granted:?}"
    );
    // Its TTL after the grant was answered (so after it ran): a lease ended at the exact
    // instant is gone by now.
    spin_until(answered + ttl);
    let check_sent = Instant::now();
    let reply = rt
        .block_on(backend.acquire(key, &other, ttl))
        .expect("acquire");
    let check_answered = Instant::now();
    seen.trials += 1;
    let held = match reply {
        AcquireReply::Held { remaining } => {
            // The last millisecond: 0 left, as `PTTL` reads then.
            assert!(
                remaining.is_some_and(|r| r < LAST_MS),
                "{remaining:?} left past the TTL"
            );
            true
        }
        AcquireReply::Granted { .. } => false,
    };
    if held {
        seen.outlived += 1;
        // A millisecond later (with margin) it is gone on both.
        spin_until(sent.max(check_sent) + ttl + LAST_MS + MARGIN);
        let reply = rt
            .block_on(backend.acquire(key, &other, ttl))
            .expect("acquire");
        assert!(
            matches!(reply, AcquireReply::Granted { .. }),
            "held more than a millisecond past its TTL: {reply:?}"
        );
    }
    if check_answered < sent + ttl + LAST_MS {
        seen.conclusive += 1;
        seen.ended_early += u32::from(!held);
    }
    rt.block_on(backend.release(key, &other)).expect("release");
}

/// Redis keeps a key through the millisecond of its expiry (`now > when`, in whole ms): a
/// lease checked its TTL after the grant was answered is still held there, with 0 left, most
/// of the time, and always gone 1 ms later. The memory backend must keep it as long: held
/// whenever the check was answered within TTL + 1 ms of the grant being sent. (The random
/// sequences above cannot tell: a call that close to an expiry races it, and either answer
/// passes there.)
#[test]
fn a_lease_lives_through_the_millisecond_of_its_expiry() {
    let (_server, rt, memory, redis) = both_backends();
    let key = Locker::new(memory.clone())
        .lock_key("last-millisecond")
        .expect("key");
    let (mut on_memory, mut on_redis) = (LastMs::default(), LastMs::default());
    // Until both have shown enough, within a bound: on a loaded machine a check can take more
    // than the millisecond it looks at.
    for _ in 0..200 {
        last_ms_trial(&rt, &memory, &key, &mut on_memory);
        last_ms_trial(&rt, &redis, &key, &mut on_redis);
        if on_redis.outlived >= 5 && on_memory.conclusive >= 20 {
            break;
        }
    }
    eprintln!("memory {on_memory:?}\nredis {on_redis:?}");
    assert!(
        on_redis.outlived >= 5,
        "Redis no longer keeps a key through the millisecond of its expiry? {on_redis:?}"
    );
    assert!(
        on_memory.conclusive >= 20,
        "too few conclusive trials: {on_memory:?}"
    );
    assert_eq!(
        on_memory.ended_early, 0,
        "the memory backend ended leases before Redis would have: {on_memory:?}"
    );
}

/// A keep-fence grant (keep 0: the fence is kept for the TTL), extended well past that, then
/// acquired again by its holder once the keep ran out: the grant's fence and the retry's.
fn retry_after_the_keep<B: Backend>(
    rt: &tokio::runtime::Runtime,
    backend: &B,
    key: &LockKey,
) -> (u64, u64) {
    let ms = Duration::from_millis;
    let token = Token::generate();
    let granted = rt.block_on(backend.acquire_keeping_fence(key, &token, ms(200), ms(0)));
    let items = [(key.clone(), token.clone())];
    let extended = rt.block_on(backend.extend(&items, ms(5_000)));
    assert_eq!(extended.expect("extend"), [true]);
    // Past the keep, well within the extended lease.
    std::thread::sleep(ms(400));
    let retried = rt.block_on(backend.acquire(key, &token, ms(5_000)));
    match (granted.expect("acquire"), retried.expect("acquire")) {
        (AcquireReply::Granted { fence: a, .. }, AcquireReply::Granted { fence: b, .. }) => (a, b),
        other => panic!("{other:?}"),
    }
}

/// A repeated acquire by the holder (the lost-reply retry) answers alike on both backends
/// once the keep of a keep-fence grant has run out while the lease, extended, is still held.
/// Found by the random sequences: on Redis the fence key expires with the keep (counted from
/// the grant, not renewed by an extend), and the retry, finding no fence, takes a new one from
/// the clock; the memory backend answered the lease's own fence.
#[test]
fn a_retry_answers_alike_once_the_keep_ran_out() {
    let (_server, rt, memory, redis) = both_backends();
    let key = Locker::new(memory.clone())
        .lock_key("retry-after-the-keep")
        .expect("key");
    let (m, r) = (
        retry_after_the_keep(&rt, &memory, &key),
        retry_after_the_keep(&rt, &redis, &key),
    );
    assert_eq!(
        m.0 == m.1,
        r.0 == r.1,
        "whether the retry answered the grant's fence: memory {} ({} then {}), redis {} ({} then {})",
        m.0 == m.1,
        m.0,
        m.1,
        r.0 == r.1,
        r.0,
        r.1
    );
}

/// The case the random sequences once tripped on in CI: a repeated acquire by the holder
/// races the end of its fence's keep, and one backend keeps the fence while the other takes a
/// new one (kept for ever). Both models then name the same holder, but the next repeated
/// acquire may rightly answer `same: true` on one and `same: false` on the other, so the two
/// must not be compared until a later grant brings them back in step.
#[test]
fn models_split_by_a_race_on_the_fence_keep_are_not_compared() {
    let t0 = Instant::now();
    let at = |ms: u64, micros: u64| Window {
        sent: t0 + Duration::from_millis(ms),
        answered: t0 + Duration::from_millis(ms) + Duration::from_micros(micros),
    };
    let grant = Op::Acquire {
        key: 0,
        holder: 0,
        ttl: 40,
        keep: Some(0),
    };
    let extend = Op::Extend {
        items: vec![(0, 0)],
        ttl: 1_000,
    };
    let again = Op::Acquire {
        key: 0,
        holder: 0,
        ttl: 15,
        keep: None,
    };
    let (mut memory, mut redis) = (Model::default(), Model::default());
    for model in [&mut memory, &mut redis] {
        let granted = Outcome::Granted {
            fence: 10,
            same: false,
        };
        apply(model, 0, &grant, at(0, 100), &granted).expect("grant");
        apply(
            model,
            1,
            &extend,
            at(39, 100),
            &Outcome::Extended(vec![true]),
        )
        .expect("extend");
    }
    // 40.5 ms: inside the window in which the fence's keep (40 ms) ends.
    let kept = Outcome::Granted {
        fence: 10,
        same: true,
    };
    let renewed = Outcome::Granted {
        fence: 20,
        same: false,
    };
    assert_eq!(
        apply(&mut memory, 2, &again, at(40, 500), &kept).expect("kept"),
        vec![Seen::Racing(0)]
    );
    assert_eq!(
        apply(&mut redis, 2, &again, at(40, 500), &renewed).expect("renewed"),
        vec![Seen::Racing(0)]
    );
    assert!(
        !in_step(&memory, &redis, &again),
        "the models count as in step after keeping and renewing the fence"
    );
    // A new grant to both after the lease ends brings them back in step.
    for model in [&mut memory, &mut redis] {
        let granted = Outcome::Granted {
            fence: 30,
            same: false,
        };
        apply(model, 3, &grant, at(2_000, 100), &granted).expect("grant after the end");
    }
    assert!(in_step(&memory, &redis, &again));
}
