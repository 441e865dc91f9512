//! `#[locked]` functions, run on memory, a real `redis-server` and a real `valkey-server`. The
//! macro only calls `Locker`'s own methods, which `tests/behaviour.rs` runs on every backend
//! (clusters, quorums, TLS and ACL users too), so it is not run on those again. Every function here names its locker with `locker = ...`, because the default
//! locker is process-wide and these tests run in parallel; the default path has its own test
//! binary (`tests/locked_default.rs`).
#![cfg(feature = "macros")]

#[path = "support/captured.rs"]
mod captured;
mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{
    AnyBackend, Error, Fence, LockOptions, Locker, MemoryBackend, current_fence, current_lease,
    locked,
};
use support::{Flavor, Server};
use tokio::sync::{Barrier, Notify};
use tokio::time::{Instant, sleep, timeout};
use tracing::Instrument;

enum Harness {
    Memory(MemoryBackend),
    Server(Server),
}

impl Harness {
    async fn locker(&self) -> Locker {
        match self {
            Harness::Memory(m) => Locker::new(AnyBackend::Memory(m.clone())),
            Harness::Server(s) => Locker::redis(&s.url()).await.expect("connect"),
        }
    }

    /// Deletes a lock from outside, as an operator or a failover would.
    fn delete(&self, locker: &Locker, key: &str) {
        let k = locker.lock_key(key).expect("key");
        match self {
            Harness::Memory(m) => {
                assert!(m.force_delete(&k), "nothing to delete at {key}");
            }
            Harness::Server(s) => {
                let n: i64 = s.cmd(&["DEL", k.lock_key()]);
                assert_eq!(n, 1, "nothing to delete at {key}");
            }
        }
    }
}

/// An application error, to show that lock failures arrive through `From`.
#[derive(Debug)]
enum AppError {
    Lock(Error),
    Declined(u64),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Lock(e)
    }
}

/// What the bodies record: how many run at once, and the fences in the order they ran.
#[derive(Default)]
struct Probe {
    inside: AtomicUsize,
    max_inside: AtomicUsize,
    fences: Mutex<Vec<Fence>>,
}

#[locked(key = "job:{job}", locker = locker, ttl = "5s", wait = "60s")]
async fn exclusive_job(
    locker: Locker,
    job: &'static str,
    probe: Arc<Probe>,
) -> Result<Fence, Error> {
    let now = probe.inside.fetch_add(1, Ordering::SeqCst) + 1;
    probe.max_inside.fetch_max(now, Ordering::SeqCst);
    let fence = current_fence().expect("a fence inside the body");
    probe.fences.lock().expect("probe").push(fence);
    // Long enough that overlapping bodies would be seen, short enough for eight in a row.
    sleep(Duration::from_millis(40)).await;
    probe.inside.fetch_sub(1, Ordering::SeqCst);
    Ok(fence)
}

async fn never_two_at_once(h: Harness) {
    let locker = h.locker().await;
    let probe = Arc::new(Probe::default());
    let tasks: Vec<_> = (0..8)
        .map(|_| tokio::spawn(exclusive_job(locker.clone(), "one", probe.clone())))
        .collect();
    let mut returned = Vec::new();
    for t in tasks {
        returned.push(t.await.expect("join").expect("every call gets its turn"));
    }
    assert_eq!(
        probe.max_inside.load(Ordering::SeqCst),
        1,
        "two bodies ran at once"
    );
    let fences = probe.fences.lock().expect("probe").clone();
    assert_eq!(fences.len(), 8);
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences in running order must strictly increase: {fences:?}"
    );
    returned.sort();
    assert_eq!(returned, fences, "each call returned its own body's fence");
    assert_eq!(current_fence(), None, "no fence outside a body");
}

#[locked(key = "meet:{which}", locker = locker, ttl = "5s")]
async fn meet(locker: &Locker, which: u32, barrier: Arc<Barrier>) -> Result<bool, Error> {
    // Both bodies must be inside at the same time for the barrier to open.
    Ok(timeout(Duration::from_secs(20), barrier.wait())
        .await
        .is_ok())
}

async fn different_keys_run_in_parallel(h: Harness) {
    let locker = h.locker().await;
    let barrier = Arc::new(Barrier::new(2));
    let (a, b) = tokio::join!(
        meet(&locker, 1, barrier.clone()),
        meet(&locker, 2, barrier.clone())
    );
    assert!(
        a.expect("key 1") && b.expect("key 2"),
        "the bodies did not overlap"
    );
}

struct Account {
    locker: Arc<Locker>,
    id: u64,
    balance: u64,
    fences: Vec<Fence>,
}

impl Account {
    #[locked(key = "account:{id}", locker = locker, wait = "5s")]
    async fn open(locker: Arc<Locker>, id: u64, opening: impl Into<u64>) -> Result<Self, Error> {
        let fence = current_fence().expect("fence");
        Ok(Account {
            locker,
            id,
            balance: opening.into(),
            fences: vec![fence],
        })
    }

    #[locked(key = format!("account:{}", self.id), locker = self.locker, wait = "5s")]
    async fn balance(&self) -> Result<u64, Error> {
        Ok(self.balance)
    }

    #[locked(key = format!("account:{}", self.id), locker = &self.locker, ttl = "10s", wait = "5s")]
    pub(crate) async fn deposit(&mut self, amount: u64) -> Result<u64, AppError> {
        if amount == 0 {
            return Err(AppError::Declined(self.id));
        }
        self.balance += amount;
        self.fences.push(current_fence().expect("fence"));
        Ok(self.balance)
    }

    #[locked(key = format!("account:{}", self.id), locker = self.locker.clone(), wait = "5s")]
    async fn close(self) -> Result<(u64, Vec<Fence>), Error> {
        Ok((self.balance, self.fences))
    }
}

async fn methods_with_receivers(h: Harness) {
    let locker = Arc::new(h.locker().await);
    let mut acct = Account::open(locker.clone(), 9, 10u8).await.expect("open");
    assert_eq!(acct.balance().await.expect("balance"), 10);
    assert_eq!(acct.deposit(5).await.expect("deposit"), 15);
    assert!(matches!(acct.deposit(0).await, Err(AppError::Declined(9))));
    assert_eq!(acct.deposit(1).await.expect("deposit"), 16);
    // The key is the account's: someone holding it makes `&self` methods wait, then give up.
    let held = locker
        .acquire(
            "account:9",
            &LockOptions::new().ttl(Duration::from_secs(30)),
        )
        .await
        .expect("hold");
    let busy = acct.deposit(1).await;
    assert!(
        matches!(busy, Err(AppError::Lock(Error::WaitTimeout { .. }))),
        "{busy:?}"
    );
    held.release().await.expect("release");
    let (balance, fences) = acct.close().await.expect("close");
    assert_eq!(balance, 16);
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
}

#[locked(key = item, locker = locker, wait = "5s")]
async fn describe<T>(
    locker: &Locker,
    item: T,
    suffix: impl AsRef<str> + Send,
) -> Result<String, Error>
where
    T: std::fmt::Display + Send,
{
    let key = current_lease().expect("lease").key().to_owned();
    Ok(format!("{key}={item}{}", suffix.as_ref()))
}

#[locked(key = "first-word:{name}", locker = locker)]
async fn first_word<'a>(locker: &Locker, name: &str, text: &'a str) -> Result<&'a str, Error> {
    Ok(text.split(' ').next().unwrap_or(text))
}

async fn generic_functions(h: Harness) {
    let locker = h.locker().await;
    assert_eq!(describe(&locker, 42u32, "!").await.expect("u32"), "42=42!");
    assert_eq!(
        describe(&locker, String::from("k"), String::from("?"))
            .await
            .expect("string"),
        "k=k?"
    );
    let text = String::from("hello lease world");
    assert_eq!(
        first_word(&locker, "t", &text).await.expect("word"),
        "hello"
    );
}

/// `?` converts the body's errors through `From`, and an early `return` leaves the body.
#[locked(key = "settle:{order_id}", locker = locker, wait = "5s")]
async fn settle(locker: &Locker, order_id: u64, amount: &str) -> Result<u64, AppError> {
    let amount: u64 = amount.parse().map_err(|_| AppError::Declined(order_id))?;
    if amount == 0 {
        return Ok(0);
    }
    if amount > 1_000 {
        Err(Error::InvalidKey {
            reason: "stands in for any leasehold error the body meets",
        })?;
    }
    Ok(amount * 2)
}

/// The return type may be an alias of a `Result` whose error takes `leasehold::Error`.
type AppResult<T> = Result<T, AppError>;

#[locked(key = "aliased:{id}", locker = locker)]
async fn aliased(locker: &Locker, id: u64) -> AppResult<u64> {
    Ok(id + 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_alias_as_return_type() {
    let locker = Locker::memory();
    assert_eq!(aliased(&locker, 1).await.expect("ran"), 2);
    let held = locker
        .try_acquire("aliased:1", &LockOptions::default())
        .await
        .expect("held");
    assert!(matches!(
        aliased(&locker, 1).await,
        Err(AppError::Lock(Error::Busy { .. }))
    ));
    held.release().await.expect("release");
}

/// Arguments handed on by a `macro_rules!` (`$t:expr` fragments arrive in invisible groups)
/// are read as written: a key template still captures, a duration string is still parsed.
macro_rules! locked_job {
    ($name:ident, $id:ident, $key:expr, $ttl:expr) => {
        #[locked(key = $key, ttl = $ttl, locker = locker)]
        async fn $name(locker: &Locker, $id: u64) -> Result<Duration, Error> {
            Ok(current_lease().expect("a lease").remaining())
        }
    };
}
// The captured parameter is named by the caller too: the template's `{id}` is the caller's
// token, and macro hygiene would not let it see a name the macro made up.
locked_job!(forwarded, id, "forwarded:{id}", "5s");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arguments_through_macro_rules() {
    let locker = Locker::memory();
    // The 5 s TTL less the drift allowance, not the 30 s default.
    let left = forwarded(&locker, 7).await.expect("ran");
    assert!(
        left > Duration::from_secs(4) && left <= Duration::from_secs(5),
        "{left:?}"
    );
    let held = locker
        .try_acquire("forwarded:7", &LockOptions::default())
        .await
        .expect("held");
    assert!(matches!(
        forwarded(&locker, 7).await,
        Err(Error::Busy { .. })
    ));
    held.release().await.expect("release");
}

/// `#[tracing::instrument]` above `#[locked]`, and below it.
#[tracing::instrument(skip(locker))]
#[locked(key = "traced:{id}", locker = locker)]
async fn traced_outside(locker: &Locker, id: u64) -> Result<Option<Fence>, Error> {
    Ok(current_fence())
}

#[locked(key = "traced:{id}", locker = locker)]
#[tracing::instrument(skip(locker))]
async fn traced_inside(locker: &Locker, id: u64) -> Result<Option<Fence>, Error> {
    Ok(current_fence())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instrument_on_either_side() {
    let locker = Locker::memory();
    assert!(traced_outside(&locker, 1).await.expect("ran").is_some());
    assert!(traced_inside(&locker, 1).await.expect("ran").is_some());
    let held = locker
        .try_acquire("traced:2", &LockOptions::default())
        .await
        .expect("held");
    assert!(matches!(
        traced_outside(&locker, 2).await,
        Err(Error::Busy { .. })
    ));
    assert!(matches!(
        traced_inside(&locker, 2).await,
        Err(Error::Busy { .. })
    ));
    held.release().await.expect("release");
}

/// The fence a body sees, and what a task it spawns sees.
#[locked(key = "spawner", locker = locker)]
async fn spawner(locker: &Locker) -> Result<(Option<Fence>, Option<Fence>), Error> {
    let spawned = tokio::spawn(async { current_fence() })
        .await
        .expect("spawned task");
    Ok((current_fence(), spawned))
}

/// Records, when dropped, whether it was dropped inside a `#[locked]` body (under its lease).
struct DropWitness(&'static str, Arc<Mutex<Vec<(&'static str, bool)>>>);

impl Drop for DropWitness {
    fn drop(&mut self) {
        let inside = current_fence().is_some();
        self.1.lock().expect("witness log").push((self.0, inside));
    }
}

impl std::fmt::Display for DropWitness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// A parameter whose body uses one field of it.
struct Order {
    id: u64,
    _witness: DropWitness,
}

/// Parameters the body never mentions: one by a `_` name, one in a pattern, one the key's
/// format string reads, a `_` one, and `self` by value; and one the body uses only through a
/// field (an `async move` block would take that field alone).
#[locked(key = "drops:{id}:{keyed}", locker = locker)]
async fn leaves_its_parameters(
    locker: &Locker,
    id: u64,
    _guard: DropWitness,
    (_in_pattern, _n): (DropWitness, u8),
    keyed: DropWitness,
    _: DropWitness,
    order: Order,
) -> Result<u64, Error> {
    Ok(order.id)
}

impl DropWitness {
    #[locked(key = "drops:self", locker = locker)]
    async fn consumed(self, locker: &Locker) -> Result<(), Error> {
        Ok(())
    }
}

/// The parameters the body never mentions are dropped when it ends, under the lease, as the
/// macro's docs promise, and so is the whole of one the body reads a field of; only a `_`
/// one, which has no name to take, after the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_the_body_leaves_are_dropped_under_the_lease() {
    let locker = Locker::memory();
    let log = Arc::new(Mutex::new(Vec::new()));
    let w = |name| DropWitness(name, log.clone());
    leaves_its_parameters(
        &locker,
        1,
        w("_guard"),
        (w("_in_pattern"), 0),
        w("keyed"),
        w("_"),
        Order {
            id: 9,
            _witness: w("order"),
        },
    )
    .await
    .expect("ran");
    w("self").consumed(&locker).await.expect("ran");
    let mut seen = log.lock().expect("witness log").clone();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("_", false),
            ("_guard", true),
            ("_in_pattern", true),
            ("keyed", true),
            ("order", true),
            ("self", true)
        ]
    );
}

/// A key made by an expression that takes a parameter by value.
fn order_key(order: String) -> String {
    format!("order:{order}")
}

/// A parameter moved by the key expression, and one `#[cfg]`'d away, both named as the body
/// would otherwise be made to own them (`_`): it is not (it could not be: the first is gone
/// before the body runs, the second never was), and the function compiles.
#[locked(key = order_key(_order), locker = locker)]
async fn parameters_the_body_cannot_own(
    locker: &Locker,
    _order: String,
    #[cfg(any())] _gone: u32,
) -> Result<Option<String>, Error> {
    Ok(current_lease().map(|l| l.key().to_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_moved_by_the_key_or_cfgd_away_still_compile() {
    let locker = Locker::memory();
    let key = parameters_the_body_cannot_own(&locker, "7".to_owned())
        .await
        .expect("ran");
    assert_eq!(key.as_deref(), Some("order:7"));
}

/// `current_fence()` is task-local, as documented: a task the body spawns does not see it
/// (it runs outside the lease's scope, and may outlive it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_task_sees_no_fence() {
    let locker = Locker::memory();
    let (own, spawned) = spawner(&locker).await.expect("ran");
    assert!(own.is_some(), "the body sees its fence");
    assert_eq!(spawned, None, "a spawned task saw the body's fence");
}

/// A return type that mentions `impl Trait`: `?` and early `return` infer against the rest of
/// it. Parameters and locals may be named like the macro's own locals, and the body may use
/// them.
#[locked(key = "digits:{__lh_key}", locker = __lh_locker)]
async fn digits(
    __lh_locker: &Locker,
    __lh_key: u64,
    text: &str,
) -> Result<impl Iterator<Item = u32> + use<>, AppError> {
    let __lh_settings = __lh_locker.lock_key("digits")?;
    assert_eq!(__lh_settings.key(), "digits");
    let n: u32 = text.parse().map_err(|_| AppError::Declined(__lh_key))?;
    if n == 0 {
        return Ok(vec![0].into_iter());
    }
    let __lh_fake_return = n.to_string();
    Ok(__lh_fake_return
        .chars()
        .filter_map(|c| c.to_digit(10))
        .collect::<Vec<_>>()
        .into_iter())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impl_trait_result_and_the_macros_own_names() {
    let locker = Locker::memory();
    let got: Vec<u32> = digits(&locker, 1, "407").await.expect("ran").collect();
    assert_eq!(got, [4, 0, 7]);
    let zero: Vec<u32> = digits(&locker, 1, "0")
        .await
        .expect("early return")
        .collect();
    assert_eq!(zero, [0]);
    assert!(matches!(
        digits(&locker, 2, "x").await,
        Err(AppError::Declined(2))
    ));
    let held = locker
        .try_acquire("digits:3", &LockOptions::default())
        .await
        .expect("held");
    assert!(matches!(
        digits(&locker, 3, "1").await,
        Err(AppError::Lock(Error::Busy { .. }))
    ));
    held.release().await.expect("release");
    locker
        .try_acquire("digits:1", &LockOptions::default())
        .await
        .expect("released after every return");
}

async fn question_mark_and_return(h: Harness) {
    let locker = h.locker().await;
    assert_eq!(settle(&locker, 1, "21").await.expect("ok"), 42);
    assert_eq!(settle(&locker, 1, "0").await.expect("early return"), 0);
    assert!(matches!(
        settle(&locker, 1, "x").await,
        Err(AppError::Declined(1))
    ));
    assert!(matches!(
        settle(&locker, 1, "5000").await,
        Err(AppError::Lock(Error::InvalidKey { .. }))
    ));
    // Every path above released the lease: a fail-fast taker finds the key free.
    locker
        .try_acquire("settle:1", &LockOptions::default())
        .await
        .expect("released after every return");
}

#[locked(key = "busy", locker = locker, wait = "300ms")]
async fn waits_briefly(locker: &Locker, ran: &AtomicBool) -> Result<(), Error> {
    ran.store(true, Ordering::SeqCst);
    Ok(())
}

#[locked(key = "busy", locker = locker)]
async fn fails_fast(locker: &Locker, ran: &AtomicBool) -> Result<(), Error> {
    ran.store(true, Ordering::SeqCst);
    Ok(())
}

/// `wait` as an expression, read at each call: the README's `Duration` form.
#[locked(key = "busy", locker = locker, wait = wait)]
async fn waits_for(locker: &Locker, wait: Duration, ran: &AtomicBool) -> Result<(), Error> {
    ran.store(true, Ordering::SeqCst);
    Ok(())
}

async fn wait_timeout_and_fail_fast(h: Harness) {
    let locker = h.locker().await;
    let ran = AtomicBool::new(false);
    let holder = locker
        .acquire("busy", &LockOptions::new().ttl(Duration::from_secs(30)))
        .await
        .expect("hold");
    let started = Instant::now();
    match waits_briefly(&locker, &ran).await {
        Err(Error::WaitTimeout { waited, .. }) => {
            assert!(waited >= Duration::from_millis(300), "{waited:?}")
        }
        other => panic!("expected WaitTimeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(matches!(
        fails_fast(&locker, &ran).await,
        Err(Error::Busy { .. })
    ));
    let started = Instant::now();
    match waits_for(&locker, Duration::from_millis(200), &ran).await {
        Err(Error::WaitTimeout { waited, .. }) => {
            assert!(waited >= Duration::from_millis(200), "{waited:?}")
        }
        other => panic!("expected WaitTimeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(!ran.load(Ordering::SeqCst), "a body ran without the lease");
    // A longer wait, given at the call, outlasts the holder, which releases meanwhile.
    let (waited, ()) = tokio::join!(waits_for(&locker, Duration::from_secs(10), &ran), async {
        sleep(Duration::from_millis(300)).await;
        holder.release().await.expect("release");
    });
    waited.expect("granted once the holder released, within the wait");
    assert!(ran.swap(false, Ordering::SeqCst));
    waits_briefly(&locker, &ran).await.expect("free now");
    fails_fast(&locker, &ran).await.expect("free now");
    assert!(ran.load(Ordering::SeqCst));
}

#[locked(key = key, locker = locker, ttl = ttl, renew = renew)]
async fn long_job(
    locker: &Locker,
    key: &str,
    ttl: Duration,
    renew: bool,
    started: &Notify,
    finished: &AtomicBool,
) -> Result<(), Error> {
    started.notify_one();
    sleep(Duration::from_secs(15)).await;
    finished.store(true, Ordering::SeqCst);
    Ok(())
}

/// The key is deleted from outside while the body runs: renewal finds it gone, the body is
/// dropped, and the call returns LeaseLost long before the body would have finished, at the
/// first renewal (ttl/3 = 1 s in), well before the lease's deadline (3 s).
async fn loss_cancels_the_body(h: Harness) {
    let locker = h.locker().await;
    let (started, finished) = (Notify::new(), AtomicBool::new(false));
    let call = long_job(
        &locker,
        "lossy",
        Duration::from_secs(3),
        true,
        &started,
        &finished,
    );
    let deleter = async {
        started.notified().await;
        h.delete(&locker, "lossy");
    };
    let begun = Instant::now();
    let (result, ()) = tokio::join!(call, deleter);
    assert!(
        matches!(result, Err(Error::LeaseLost { ref key }) if key == "lossy"),
        "{result:?}"
    );
    assert!(
        begun.elapsed() < Duration::from_secs(2),
        "loss seen {:?} after the start: not at the first renewal",
        begun.elapsed()
    );
    assert!(
        !finished.load(Ordering::SeqCst),
        "the body ran on after the loss"
    );
    locker
        .try_acquire("lossy", &LockOptions::default())
        .await
        .expect("nothing left held");
}

#[locked(key = "blocker", locker = locker, ttl = "100ms", renew = false)]
async fn blocks_its_thread(locker: &Locker, block: Duration) -> Result<(), Error> {
    std::thread::sleep(block);
    Ok(())
}

/// A body that blocks its thread past its lease's validity gives the loss's timer no chance
/// to fire before it ends: it still ran past the validity, and the call answers `LeaseLost`,
/// as for a body the loss cancelled. One that ends in time is its result.
#[tokio::test(flavor = "current_thread")]
async fn a_body_that_outlived_its_lease_is_answered_lost() {
    let locker = Locker::memory();
    let out = blocks_its_thread(&locker, Duration::from_millis(150)).await;
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
    blocks_its_thread(&locker, Duration::ZERO)
        .await
        .expect("a body that ends in time");
}

/// Without renewal the lease runs out at its TTL, and that too cancels the body.
async fn expiry_without_renewal_cancels(h: Harness) {
    let locker = h.locker().await;
    let (started, finished) = (Notify::new(), AtomicBool::new(false));
    let begun = Instant::now();
    let result = long_job(
        &locker,
        "unrenewed",
        Duration::from_millis(500),
        false,
        &started,
        &finished,
    )
    .await;
    assert!(matches!(result, Err(Error::LeaseLost { .. })), "{result:?}");
    let took = begun.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(10),
        "{took:?}"
    );
    assert!(!finished.load(Ordering::SeqCst));
}

/// What a body saw of its lease: time left at the start, and whether it was lost at the end.
type Seen = (Duration, bool);

#[locked(key = "renewed", locker = locker, ttl = "1s")]
async fn outlives_its_ttl(locker: &Locker) -> Result<Seen, Error> {
    let at_start = current_lease().expect("lease").remaining();
    sleep(Duration::from_secs(3)).await;
    Ok((at_start, current_lease().expect("lease").is_lost()))
}

/// A bare `renew` means `true`: the same three TTLs of sleep as above, at 600 ms written in
/// milliseconds.
#[locked(key = "renewed_bare", locker = locker, ttl = "600ms", renew)]
async fn renewed_by_bare_flag(locker: &Locker) -> Result<Seen, Error> {
    let at_start = current_lease().expect("lease").remaining();
    sleep(Duration::from_millis(1_800)).await;
    Ok((at_start, current_lease().expect("lease").is_lost()))
}

#[locked(key = "default_ttl", locker = locker)]
async fn default_settings(locker: &Locker) -> Result<Duration, Error> {
    Ok(current_lease().expect("lease").remaining())
}

/// The TTL written as text is the one in force (time left at the start is within it, so a
/// silently ignored `ttl` would show the 30 s default), and renewal carries the body through
/// three of them; absent, the TTL is 30 s.
async fn renewal_keeps_the_body_running(h: Harness) {
    let locker = h.locker().await;
    let (at_start, lost) = outlives_its_ttl(&locker).await.expect("renewed throughout");
    assert!(
        at_start <= Duration::from_secs(1) && at_start > Duration::from_millis(500),
        "{at_start:?} left of a 1 s lease"
    );
    assert!(!lost, "lost although renewed");
    let (at_start, lost) = renewed_by_bare_flag(&locker)
        .await
        .expect("renewed throughout");
    assert!(
        at_start <= Duration::from_millis(600) && at_start > Duration::from_millis(300),
        "{at_start:?} left of a 600 ms lease"
    );
    assert!(!lost, "lost although a bare `renew` was given");
    let left = default_settings(&locker).await.expect("default");
    assert!(
        left <= Duration::from_secs(30) && left > Duration::from_secs(25),
        "{left:?} left of the default 30 s lease"
    );
}

#[locked(key = "panicky", locker = locker, ttl = "30s")]
async fn panics(locker: Locker, really: bool) -> Result<(), Error> {
    if really {
        panic!("boom inside the body");
    }
    Ok(())
}

async fn panic_releases_and_propagates(h: Harness) {
    let locker = h.locker().await;
    let err = tokio::spawn(panics(locker.clone(), true))
        .await
        .expect_err("the panic reaches the caller");
    let payload = err.into_panic();
    assert_eq!(
        payload.downcast_ref::<&str>().copied(),
        Some("boom inside the body")
    );
    // Released in the background well inside the 30 s TTL.
    let lease = locker
        .acquire("panicky", &LockOptions::new().wait(Duration::from_secs(10)))
        .await
        .expect("released after the panic, not left to expire");
    lease.release().await.expect("release");
    panics(locker, false).await.expect("runs normally");
}

/// A caller that gives up (here a timeout around the call) drops the body, and the lease is
/// released in the background rather than left to its 30 s TTL.
async fn dropping_the_call_releases(h: Harness) {
    let locker = h.locker().await;
    let (started, finished) = (Notify::new(), AtomicBool::new(false));
    let call = long_job(
        &locker,
        "abandoned",
        Duration::from_secs(30),
        true,
        &started,
        &finished,
    );
    assert!(timeout(Duration::from_millis(300), call).await.is_err());
    let lease = locker
        .acquire(
            "abandoned",
            &LockOptions::new().wait(Duration::from_secs(10)),
        )
        .await
        .expect("released when the call was dropped");
    lease.release().await.expect("release");
    assert!(!finished.load(Ordering::SeqCst));
}

/// `#[locked]` on an `async fn` in a trait impl.
trait Job {
    async fn run(&self, input: u64) -> Result<u64, Error>;
}

struct Doubler {
    locker: Locker,
}

impl Job for Doubler {
    #[locked(key = format!("doubler:{input}"), locker = self.locker, wait = "5s")]
    async fn run(&self, input: u64) -> Result<u64, Error> {
        Ok(input * 2)
    }
}

async fn trait_impls(h: Harness) {
    let job = Doubler {
        locker: h.locker().await,
    };
    assert_eq!(job.run(21).await.expect("run"), 42);
}

#[locked(key = "inner", locker = locker)]
async fn inner(locker: Locker) -> Result<String, Error> {
    Ok(current_lease().expect("inner lease").key().to_owned())
}

#[locked(key = "outer", locker = locker)]
async fn outer(locker: Locker) -> Result<(String, String, String), Error> {
    let key = || current_lease().expect("outer lease").key().to_owned();
    let before = key();
    let nested = inner(locker.clone()).await?;
    Ok((before, nested, key()))
}

async fn nested_calls_see_their_own_lease(h: Harness) {
    let locker = h.locker().await;
    let (before, nested, after) = outer(locker).await.expect("nested");
    assert_eq!(
        (before.as_str(), nested.as_str(), after.as_str()),
        ("outer", "inner", "outer")
    );
}

#[locked(key = key, locker = locker, ttl = ttl)]
async fn checked_at_call(
    locker: &Locker,
    key: String,
    ttl: Duration,
    ran: &AtomicBool,
) -> Result<(), Error> {
    ran.store(true, Ordering::SeqCst);
    Ok(())
}

async fn bad_input_is_a_typed_error(h: Harness) {
    let locker = h.locker().await;
    let ran = AtomicBool::new(false);
    let ok_ttl = Duration::from_secs(5);
    for key in ["", "a{b}", "line\nbreak"] {
        let r = checked_at_call(&locker, key.to_owned(), ok_ttl, &ran).await;
        assert!(matches!(r, Err(Error::InvalidKey { .. })), "{key:?}: {r:?}");
    }
    for ttl in [
        Duration::ZERO,
        Duration::from_millis(1),
        Duration::from_secs(90_000),
    ] {
        let r = checked_at_call(&locker, "k".to_owned(), ttl, &ran).await;
        assert!(matches!(r, Err(Error::InvalidTtl { .. })), "{ttl:?}: {r:?}");
    }
    assert!(!ran.load(Ordering::SeqCst));
    checked_at_call(&locker, "k".to_owned(), ok_ttl, &ran)
        .await
        .expect("valid");
    assert!(ran.load(Ordering::SeqCst));
}

/// Code that reaches leasehold under another path names it with `crate = ...`. The path here
/// re-exports leasehold's macro runtime with its entry point wrapped to count its calls, so a
/// macro that ignored `crate = ...` (and went to `::leasehold` itself) would leave the count at
/// zero.
mod renamed {
    pub mod lh {
        pub mod __private {
            use std::sync::atomic::{AtomicUsize, Ordering};

            pub use leasehold::__private::*;
            use leasehold::{Backend, Locker};

            pub static CALLS: AtomicUsize = AtomicUsize::new(0);

            pub async fn locked<B, R, Fut>(
                locker: leasehold::Result<Locker<B>>,
                key: String,
                settings: Settings,
                from_lock_error: fn(Error) -> R,
                body: Fut,
            ) -> R
            where
                B: Backend + Clone,
                Fut: Future<Output = R>,
            {
                CALLS.fetch_add(1, Ordering::SeqCst);
                leasehold::__private::locked(locker, key, settings, from_lock_error, body).await
            }
        }
    }
}

#[locked(key = "renamed", locker = locker, crate = crate::renamed::lh)]
async fn through_a_path(locker: &Locker) -> Result<Fence, Error> {
    Ok(current_fence().expect("fence"))
}

#[locked(key = "renamed", locker = locker, crate = "crate::renamed::lh", renew)]
async fn through_a_string(locker: &Locker) -> Result<Fence, Error> {
    Ok(current_fence().expect("fence"))
}

#[tokio::test]
async fn crate_override() {
    let locker = Locker::memory();
    let a = through_a_path(&locker).await.expect("path");
    let b = through_a_string(&locker).await.expect("string");
    assert!(b > a);
    assert_eq!(
        renamed::lh::__private::CALLS.load(Ordering::SeqCst),
        2,
        "both calls went through the path named by `crate = ...`"
    );
}

macro_rules! suite {
    ($modname:ident, $make:expr) => {
        mod $modname {
            use super::*;
            fn harness() -> Harness {
                $make
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn never_two_at_once() {
                super::never_two_at_once(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn different_keys_run_in_parallel() {
                super::different_keys_run_in_parallel(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn methods_with_receivers() {
                super::methods_with_receivers(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn generic_functions() {
                super::generic_functions(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn question_mark_and_return() {
                super::question_mark_and_return(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn wait_timeout_and_fail_fast() {
                super::wait_timeout_and_fail_fast(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn loss_cancels_the_body() {
                super::loss_cancels_the_body(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn expiry_without_renewal_cancels() {
                super::expiry_without_renewal_cancels(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewal_keeps_the_body_running() {
                super::renewal_keeps_the_body_running(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn panic_releases_and_propagates() {
                super::panic_releases_and_propagates(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn dropping_the_call_releases() {
                super::dropping_the_call_releases(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn trait_impls() {
                super::trait_impls(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn nested_calls_see_their_own_lease() {
                super::nested_calls_see_their_own_lease(harness()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn bad_input_is_a_typed_error() {
                super::bad_input_is_a_typed_error(harness()).await
            }
        }
    };
}

suite!(memory, Harness::Memory(MemoryBackend::new()));
suite!(redis, Harness::Server(Server::start(Flavor::Redis)));
suite!(valkey, Harness::Server(Server::start(Flavor::Valkey)));

/// Settings whose expressions borrow through a temporary (a `RefCell` borrow, a mutex guard):
/// the temporary ends before the body runs, as the docs promise, so the body may borrow the
/// same cell mutably and the future stays `Send`. (They were held for the whole body: a
/// `BorrowMutError` panic, a future that was not `Send`.)
struct Tuned {
    locker: Locker,
    ttl: std::cell::RefCell<Duration>,
}

impl Tuned {
    #[locked(key = "tuned", locker = self.locker, ttl = *self.ttl.borrow())]
    async fn retune(&self) -> Result<Duration, Error> {
        *self.ttl.borrow_mut() = Duration::from_secs(5);
        Ok(current_lease().expect("lease").remaining())
    }
}

struct Shared {
    locker: Locker,
    wait: Mutex<Duration>,
}

impl Shared {
    #[locked(key = "shared", locker = self.locker, wait = *self.wait.lock().expect("wait"))]
    async fn run(self: Arc<Self>) -> Result<Duration, Error> {
        tokio::task::yield_now().await;
        Ok(*self.wait.lock().expect("wait"))
    }
}

fn assert_send<T: Send>(t: T) -> T {
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_borrow_only_while_they_are_read() {
    let tuned = Tuned {
        locker: Locker::memory(),
        ttl: std::cell::RefCell::new(Duration::from_secs(60)),
    };
    let left = tuned.retune().await.expect("ran");
    assert!(
        left > Duration::from_secs(30),
        "the ttl read was not 60 s: {left:?}"
    );
    assert_eq!(*tuned.ttl.borrow(), Duration::from_secs(5));
    let shared = Arc::new(Shared {
        locker: Locker::memory(),
        wait: Mutex::new(Duration::from_secs(2)),
    });
    let ran = tokio::spawn(assert_send(shared.clone().run()))
        .await
        .expect("task")
        .expect("ran");
    assert_eq!(ran, Duration::from_secs(2));
}

#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("refused")
    }
}

impl std::error::Error for Refused {}

/// A value coerced to the return type's boxed trait object beside an `impl Trait`, as a plain
/// `async fn` allows: the rest of the return type is still pinned inside the body. (With the
/// `impl` in it, nothing was pinned, and `Box<Refused>` was taken for the error type.)
#[locked(key = "shown", locker = locker)]
async fn shown(
    locker: &Locker,
    n: u32,
) -> Result<impl std::fmt::Display + use<>, Box<dyn std::error::Error + Send + Sync>> {
    if n == 0 {
        return Err(Box::new(Refused));
    }
    Ok(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impl_trait_result_still_coerces_its_error() {
    let locker = Locker::memory();
    assert_eq!(shown(&locker, 7).await.expect("shown").to_string(), "7");
    let refused = shown(&locker, 0).await.err().expect("refused");
    assert_eq!(refused.to_string(), "refused");
}

/// Above `#[tokio::test]`, as the docs suggest for a test that must hold a lock: the test body
/// runs under the lease.
#[locked(key = "as-a-test", locker = Locker::memory())]
#[tokio::test]
async fn locked_above_tokio_test() -> Result<(), Error> {
    assert!(
        current_fence().is_some(),
        "the test body ran without its lease"
    );
    Ok(())
}

#[locked(key = "same", locker = locker)]
async fn inner_same(locker: &Locker) -> Result<(), Error> {
    Ok(())
}

#[locked(key = "same", locker = locker, wait = "100ms")]
async fn inner_same_waiting(locker: &Locker) -> Result<(), Error> {
    Ok(())
}

#[locked(key = "same", locker = locker)]
async fn outer_same(locker: &Locker) -> Result<(Error, Error), Error> {
    let busy = inner_same(locker).await.expect_err("re-entered");
    let waited = inner_same_waiting(locker).await.expect_err("re-entered");
    Ok((busy, waited))
}

/// As the docs say, a lease is not re-entrant: a nested call on the key its caller holds gets
/// `Busy` at once, or with `wait` waits for itself until `WaitTimeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_call_on_the_same_key_is_refused() {
    let locker = Locker::memory();
    let (busy, waited) = outer_same(&locker).await.expect("outer ran");
    assert!(matches!(busy, Error::Busy { .. }), "{busy:?}");
    assert!(matches!(waited, Error::WaitTimeout { .. }), "{waited:?}");
}

#[locked(key = "raw-name", locker = locker)]
async fn r#match(locker: &Locker) -> Result<(), Error> {
    tracing::info!("inside");
    Ok(())
}

/// A raw identifier names the span by the function's name, not its spelling: `match`.
#[tokio::test]
async fn a_raw_identifier_names_the_span_without_its_prefix() {
    let (logs, _logging) = captured::capture(tracing::Level::DEBUG);
    r#match(&Locker::memory()).await.expect("locked");
    let text = logs.text();
    assert!(text.contains("function=\"match\""), "{text}");
    assert!(!text.contains("r#match"), "{text}");
}

#[locked(key = "caller-span", locker = locker)]
async fn under_the_callers_span(locker: &Locker) -> Result<u64, Error> {
    Ok(current_fence().expect("a fence").0)
}

/// The fence goes on the `locked` span alone. With that span disabled (a subscriber at INFO),
/// a caller's span with a `fence` field of its own keeps it as the caller left it (it was
/// written there, since the current span inside was the caller's).
#[tokio::test]
async fn the_fence_is_not_written_on_a_callers_span() {
    let (logs, _logging) = captured::capture(tracing::Level::INFO);
    let locker = Locker::memory();
    let caller = tracing::info_span!("caller", fence = tracing::field::Empty);
    let fence = under_the_callers_span(&locker)
        .instrument(caller.clone())
        .await
        .expect("locked");
    assert!(fence > 0);
    caller.in_scope(|| tracing::info!("after"));
    let text = logs.text();
    assert!(text.contains("after"), "{text}");
    assert!(!text.contains("fence="), "{text}");
}

/// Whether `key` is held on `locker`: a fail-fast taker finds it busy. Asked from inside a body,
/// it says whether the body runs under that key.
async fn is_held(locker: &Locker, key: &str) -> bool {
    match locker.try_acquire(key, &LockOptions::default()).await {
        Err(Error::Busy { .. }) => true,
        Ok(lease) => {
            lease.release().await.expect("release");
            false
        }
        Err(e) => panic!("try_acquire({key:?}): {e:?}"),
    }
}

/// The key a body runs under, as its lease names it.
fn lease_key() -> String {
    current_lease().expect("a lease").key().to_owned()
}

/// Keys written without captures are taken as written, escapes read (`\u{41}` is `A`, not a
/// capture) and a raw literal's backslash kept.
#[locked(key = "plain-key", locker = locker)]
async fn plain_key(locker: &Locker) -> Result<(String, bool), Error> {
    Ok((lease_key(), is_held(locker, "plain-key").await))
}

#[locked(key = "esc\u{41}:\x42", locker = locker)]
async fn escaped_key(locker: &Locker) -> Result<(String, bool), Error> {
    Ok((lease_key(), is_held(locker, "escA:B").await))
}

#[locked(key = r"raw\key", locker = locker)]
async fn raw_key(locker: &Locker) -> Result<(String, bool), Error> {
    Ok((lease_key(), is_held(locker, "raw\\key").await))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_without_captures_are_taken_as_written() {
    let locker = Locker::memory();
    assert_eq!(
        plain_key(&locker).await.expect("ran"),
        ("plain-key".to_owned(), true)
    );
    assert_eq!(
        escaped_key(&locker).await.expect("ran"),
        ("escA:B".to_owned(), true)
    );
    assert_eq!(
        raw_key(&locker).await.expect("ran"),
        ("raw\\key".to_owned(), true)
    );
    assert!(
        !is_held(&locker, "plain-key").await,
        "released after the call"
    );
}

struct Point {
    x: u32,
    y: u32,
}

struct OrderId(u64);

/// Parameters bound by patterns: the key captures the names they bind, and the body sees them.
#[locked(key = "pair:{a}-{b}", locker = locker)]
async fn pair(locker: &Locker, (a, b): (u32, u32)) -> Result<(u32, bool), Error> {
    Ok((a + b, is_held(locker, "pair:1-2").await))
}

#[locked(key = "point:{x}", locker = locker)]
async fn point(locker: &Locker, Point { x, .. }: Point) -> Result<(u32, bool), Error> {
    Ok((x, is_held(locker, "point:3").await))
}

#[locked(key = "order:{id}", locker = locker)]
async fn order(
    locker: &Locker,
    OrderId(id): OrderId,
    &(first, _): &(u8, u8),
) -> Result<(u64, u8, bool), Error> {
    Ok((id, first, is_held(locker, "order:9").await))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn argument_patterns() {
    let locker = Locker::memory();
    assert_eq!(pair(&locker, (1, 2)).await.expect("ran"), (3, true));
    let p = Point { x: 3, y: 4 };
    assert_eq!(p.y, 4);
    assert_eq!(point(&locker, p).await.expect("ran"), (3, true));
    assert_eq!(
        order(&locker, OrderId(9), &(5, 6)).await.expect("ran"),
        (9, 5, true)
    );
    // From outside: the pattern's key is the one taken.
    let held = locker
        .try_acquire("pair:1-2", &LockOptions::default())
        .await
        .expect("free");
    assert!(matches!(
        pair(&locker, (1, 2)).await,
        Err(Error::Busy { .. })
    ));
    held.release().await.expect("release");
}

/// A key template in parentheses is still a template (read as an expression it would be the
/// literal text `ticket:{n}`, refused on every call).
#[locked(key = ("ticket:{n}"), ttl = ("5s"), locker = locker)]
async fn ticket(locker: &Locker, n: u32) -> Result<bool, Error> {
    Ok(is_held(locker, &format!("ticket:{n}")).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_in_parentheses() {
    let locker = Locker::memory();
    assert!(ticket(&locker, 4).await.expect("ran"));
}

/// `mut` parameters (and a pattern binding one): the key is read from the values passed in,
/// before the body changes them, and the body may change them.
#[locked(key = "countdown:{n}", locker = locker)]
async fn countdown(
    locker: &Locker,
    mut n: u32,
    (mut log, step): (Vec<u32>, u32),
) -> Result<(Vec<u32>, bool), Error> {
    while n > 0 {
        log.push(n);
        n = n.saturating_sub(step);
    }
    Ok((log, is_held(locker, "countdown:3").await))
}

struct Drain {
    locker: Locker,
    id: u64,
    items: Vec<u32>,
}

impl Drain {
    #[locked(key = format!("drain:{}", self.id), locker = self.locker.clone())]
    async fn drain(mut self) -> Result<(Vec<u32>, bool), Error> {
        self.items.reverse();
        let held = is_held(&self.locker, "drain:4").await;
        Ok((std::mem::take(&mut self.items), held))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mut_arguments() {
    let locker = Locker::memory();
    assert_eq!(
        countdown(&locker, 3, (vec![9], 1)).await.expect("ran"),
        (vec![9, 3, 2, 1], true)
    );
    let drain = Drain {
        locker: locker.clone(),
        id: 4,
        items: vec![1, 2, 3],
    };
    assert_eq!(drain.drain().await.expect("ran"), (vec![3, 2, 1], true));
}

/// `self` captured by a key template, through `Display`.
struct Tenant {
    locker: Locker,
    name: &'static str,
}

impl std::fmt::Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tenant-{}", self.name)
    }
}

impl Tenant {
    #[locked(key = "audit:{self}", locker = self.locker)]
    async fn audit(&self) -> Result<(String, bool), Error> {
        Ok((
            lease_key(),
            is_held(&self.locker, "audit:tenant-acme").await,
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_method_captures_self_in_its_key() {
    let tenant = Tenant {
        locker: Locker::memory(),
        name: "acme",
    };
    assert_eq!(
        tenant.audit().await.expect("ran"),
        ("audit:tenant-acme".to_owned(), true)
    );
    let held = tenant
        .locker
        .try_acquire("audit:tenant-acme", &LockOptions::default())
        .await
        .expect("free");
    assert!(matches!(tenant.audit().await, Err(Error::Busy { .. })));
    held.release().await.expect("release");
}

/// `#[locked]` on a trait's default method body: implementors that keep it run it under the
/// key, those that override it do not.
trait Audited {
    fn locker(&self) -> &Locker;
    fn id(&self) -> u64;

    #[locked(key = format!("audited:{}", self.id()), locker = self.locker())]
    async fn audit(&self) -> Result<(String, bool), Error> {
        let key = format!("audited:{}", self.id());
        Ok((lease_key(), is_held(self.locker(), &key).await))
    }
}

struct Store {
    locker: Locker,
    id: u64,
}

impl Audited for Store {
    fn locker(&self) -> &Locker {
        &self.locker
    }
    fn id(&self) -> u64 {
        self.id
    }
}

struct Unlocked {
    locker: Locker,
}

impl Audited for Unlocked {
    fn locker(&self) -> &Locker {
        &self.locker
    }
    fn id(&self) -> u64 {
        0
    }
    async fn audit(&self) -> Result<(String, bool), Error> {
        Ok((String::new(), current_lease().is_some()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trait_default_method() {
    let locker = Locker::memory();
    let store = Store {
        locker: locker.clone(),
        id: 7,
    };
    assert_eq!(
        store.audit().await.expect("ran"),
        ("audited:7".to_owned(), true)
    );
    let held = locker
        .try_acquire("audited:7", &LockOptions::default())
        .await
        .expect("free");
    assert!(matches!(store.audit().await, Err(Error::Busy { .. })));
    held.release().await.expect("release");
    let unlocked = Unlocked { locker };
    assert_eq!(
        unlocked.audit().await.expect("ran"),
        (String::new(), false),
        "an override runs as written"
    );
}

/// Visibility is kept: functions declared `pub(crate)`, `pub(super)` and `pub(in path)` in one
/// module (and a `pub(crate)` method) are called from a sibling module, which would not
/// compile if they were private.
mod visibility {
    mod jobs {
        use super::super::*;

        #[locked(key = "visible:crate", locker = locker)]
        pub(crate) async fn crate_wide(locker: &Locker) -> Result<bool, Error> {
            Ok(is_held(locker, "visible:crate").await)
        }

        #[locked(key = "visible:super", locker = locker)]
        pub(super) async fn parent_wide(locker: &Locker) -> Result<bool, Error> {
            Ok(is_held(locker, "visible:super").await)
        }

        #[locked(key = "visible:in", locker = locker)]
        pub(in crate::visibility) async fn in_path(locker: &Locker) -> Result<bool, Error> {
            Ok(is_held(locker, "visible:in").await)
        }

        pub(crate) struct Worker(pub(crate) Locker);

        impl Worker {
            #[locked(key = "visible:method", locker = self.0)]
            pub(crate) async fn work(&self) -> Result<bool, Error> {
                Ok(is_held(&self.0, "visible:method").await)
            }
        }
    }

    mod callers {
        use super::super::*;
        use super::jobs;

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn called_from_a_sibling_module() {
            let locker = Locker::memory();
            assert!(jobs::crate_wide(&locker).await.expect("ran"));
            assert!(jobs::parent_wide(&locker).await.expect("ran"));
            assert!(jobs::in_path(&locker).await.expect("ran"));
            assert!(jobs::Worker(locker).work().await.expect("ran"));
        }
    }
}
