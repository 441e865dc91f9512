//! `#[locked]` applied by another crate's `macro_rules!` with `crate = $crate::...`, while this
//! crate passes the locker and the return type: the macro's own paths into the re-export keep
//! the `$crate` of the crate that wrote them. (Respanned to the caller's tokens, `$crate`
//! named this crate, which has no `__lh`, and this file did not compile.)
#![cfg(feature = "macros")]

use std::time::Duration;

use leasehold::LockOptions;
use leasehold_reexport_fixture::{Error, Locker, guarded};

guarded!(holding, "reexport-key", locker, [Result<u64, Error>], {
    // Held while the body runs: another try for the key is refused.
    let other = locker
        .try_acquire("reexport-key", &LockOptions::new())
        .await;
    assert!(matches!(other, Err(Error::Busy { .. })), "{other:?}");
    Ok(7)
});

#[tokio::test]
async fn a_re_exporting_crates_macro_rules_applies_locked() {
    let locker = Locker::memory();
    assert_eq!(holding(locker.clone()).await.expect("run"), 7);
    let after = locker
        .try_acquire(
            "reexport-key",
            &LockOptions::new().ttl(Duration::from_secs(5)),
        )
        .await
        .expect("released after the body");
    after.release().await.expect("release");
}
