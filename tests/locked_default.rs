//! The process-wide default locker, in a test binary of its own: the default is set once per
//! process, so the "none installed" and "installed" halves must run in order, in one test.
#![cfg(feature = "macros")]

use std::sync::atomic::{AtomicUsize, Ordering};

use leasehold::{Error, Fence, Locker, current_fence, default_locker, locked, set_default_locker};

static RUNS: AtomicUsize = AtomicUsize::new(0);

#[locked(key = "report:{day}", ttl = "5s")]
async fn nightly_report(day: u32) -> Result<Fence, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(current_fence().expect("fence inside the body"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_locker_is_required_then_used_then_fixed() {
    assert!(default_locker().is_none());
    let r = nightly_report(1).await;
    assert!(matches!(r, Err(Error::NoDefaultLocker)), "{r:?}");
    assert_eq!(
        RUNS.load(Ordering::SeqCst),
        0,
        "the body ran without a lease"
    );
    let message = Error::NoDefaultLocker.to_string();
    assert!(message.contains("set_default_locker"), "{message}");

    let locker = Locker::memory();
    set_default_locker(locker.clone()).expect("first install");
    let first = nightly_report(1).await.expect("runs on the default");
    let second = nightly_report(1).await.expect("runs again");
    assert!(second > first);
    assert_eq!(RUNS.load(Ordering::SeqCst), 2);

    // The lease was taken on the installed locker: holding the key there makes the call busy.
    let held = locker
        .try_acquire("report:1", &leasehold::LockOptions::default())
        .await
        .expect("free between calls");
    assert!(matches!(nightly_report(1).await, Err(Error::Busy { .. })));
    held.release().await.expect("release");

    assert!(matches!(
        set_default_locker(Locker::memory()),
        Err(Error::DefaultLockerAlreadySet)
    ));
    // The first default stays in place.
    let held = locker
        .try_acquire("report:2", &leasehold::LockOptions::default())
        .await
        .expect("free");
    assert!(matches!(nightly_report(2).await, Err(Error::Busy { .. })));
    held.release().await.expect("release");
}
