//! Wake-ups for waiters: one registry per `Locker`, fed by whichever backend sees releases.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};

use crate::types::LockKey;

/// A per-key generation counter that waiters watch; a release bumps it.
///
/// Each backend keeps one, fed by its subscription (or, in memory, by the release itself);
/// waiting acquires watch it. Waking a channel nobody watches does nothing.
///
/// ```
/// use lock_core::{Backend, Locker};
/// let locker = Locker::memory();
/// let wakeups = locker.backend().wakeups();
/// wakeups.wake(locker.lock_key("k")?.channel());
/// wakeups.wake_all();
/// # Ok::<(), lock_core::Error>(())
/// ```
#[derive(Default)]
pub struct Wakeups {
    keys: Mutex<HashMap<String, Slot>>,
}

struct Slot {
    tx: watch::Sender<u64>,
    watchers: usize,
    /// Whether the channel's subscription was confirmed (or given up on): a watcher that
    /// arrives while the first one still waits for it must wait too, or a release published
    /// before the subscription takes effect would pass it by.
    subscribed: Arc<watch::Sender<bool>>,
}

/// What [`Wakeups::register`] tells the caller about the key's subscription.
pub(crate) enum Registered {
    /// This is the first watcher: the backend must subscribe to the key's channel, and mark
    /// it subscribed when the server confirmed (or it gave up waiting).
    First(Arc<watch::Sender<bool>>),
    /// Someone already watches the key; the subscription exists or is being made.
    Existing(Arc<watch::Sender<bool>>),
}

impl Wakeups {
    pub(crate) fn register(&self, channel: &str) -> (watch::Receiver<u64>, Registered) {
        self.register_then(channel, || {})
    }

    /// Registers a watcher of `channel`; for its first, runs `on_first` (which must not touch
    /// this registry) before the registry is unlocked. A subscribe sent from there cannot be
    /// overtaken by the unsubscribe of a last watcher leaving on another thread: see
    /// [`Wakeups::unregister_then`].
    pub(crate) fn register_then(
        &self,
        channel: &str,
        on_first: impl FnOnce(),
    ) -> (watch::Receiver<u64>, Registered) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        match keys.get_mut(channel) {
            Some(slot) => {
                slot.watchers += 1;
                (
                    slot.tx.subscribe(),
                    Registered::Existing(slot.subscribed.clone()),
                )
            }
            None => {
                let (tx, rx) = watch::channel(0);
                let subscribed = Arc::new(watch::Sender::new(false));
                keys.insert(
                    channel.to_owned(),
                    Slot {
                        tx,
                        watchers: 1,
                        subscribed: subscribed.clone(),
                    },
                );
                on_first();
                (rx, Registered::First(subscribed))
            }
        }
    }

    /// Unregisters a watcher of `channel`; when it was the last, runs `on_last` (which must not
    /// touch this registry) before the registry is unlocked. So the commands these two send
    /// reach a subscription task in the order the registry changed: an unsubscribe sent after
    /// unlocking could arrive behind the subscribe of the next first watcher and leave a watched
    /// channel unsubscribed until all its watchers left.
    pub(crate) fn unregister_then(&self, channel: &str, on_last: impl FnOnce()) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = keys.get_mut(channel) {
            slot.watchers -= 1;
            if slot.watchers == 0 {
                keys.remove(channel);
                on_last();
            }
        }
    }

    /// Wakes every waiter of one channel. On a Redlock quorum each waiting acquire watches a
    /// channel of its own (the key's channel and an id), which this does not reach: wake
    /// them with [`wake_all`](Self::wake_all).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Backend, Locker, MemoryBackend};
    /// let backend = MemoryBackend::new();
    /// let key = Locker::memory().lock_key("k")?;
    /// let watch = backend.watch(&key).await?; // what a waiting acquire holds
    /// backend.wakeups().wake(key.channel()); // its waiter tries again now
    /// # drop(watch);
    /// # Ok(()) }
    /// ```
    pub fn wake(&self, channel: &str) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = keys.get(channel) {
            slot.tx.send_modify(|g| *g += 1);
        }
    }

    /// Wakes every waiter: used after a subscription gap, when releases may have been missed.
    ///
    /// ```
    /// use lock_core::{Backend, MemoryBackend};
    /// MemoryBackend::new().wakeups().wake_all();
    /// ```
    pub fn wake_all(&self) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        for slot in keys.values() {
            slot.tx.send_modify(|g| *g += 1);
        }
    }

    /// How many channels have waiters now: one per waited key on one server (and per waiting
    /// acquire on a quorum), for metrics and leak checks.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
    /// use lock_core::{Backend, Locker, MemoryBackend};
    /// let backend = MemoryBackend::new();
    /// let watch = backend.watch(&Locker::memory().lock_key("k")?).await?;
    /// assert_eq!(backend.wakeups().watched(), 1);
    /// drop(watch);
    /// assert_eq!(backend.wakeups().watched(), 0);
    /// # Ok(()) }
    /// ```
    pub fn watched(&self) -> usize {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The channels currently watched, for resubscribing after a reconnect.
    /// Whether `channel` has waiters now.
    pub(crate) fn is_watched(&self, channel: &str) -> bool {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        keys.contains_key(channel)
    }

    pub(crate) fn channels(&self) -> Vec<String> {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        keys.keys().cloned().collect()
    }
}

/// A request to a backend's one subscription task, which handles them in the order they were
/// sent; they are sent with the registry locked ([`Wakeups::register_then`],
/// [`Wakeups::unregister_then`]), so a late unsubscribe of a channel's last waiter can never
/// undo the subscribe of its next first one.
pub(crate) enum SubCmd {
    /// Subscribe to the channel; the sender is answered once the server confirmed it.
    Subscribe(String, oneshot::Sender<()>),
    /// Unsubscribe from the channel: its last waiter left.
    Unsubscribe(String),
}

/// The way to a backend's subscription task, which takes [`SubCmd`]s.
pub(crate) struct Subscriptions {
    tx: Mutex<mpsc::UnboundedSender<SubCmd>>,
    /// Starts the task again on the current runtime, when there is one to start it.
    restart: Box<dyn Fn() -> mpsc::UnboundedSender<SubCmd> + Send + Sync>,
}

impl Subscriptions {
    /// A task that is never started again, for tests that play it by hand.
    #[cfg(test)]
    pub(crate) fn fixed(tx: mpsc::UnboundedSender<SubCmd>) -> Subscriptions {
        let same = tx.clone();
        Subscriptions {
            tx: Mutex::new(tx),
            restart: Box::new(move || same.clone()),
        }
    }

    /// A task started by `start` now, and again on the runtime of the next subscribe when it
    /// is gone: a `Locker` kept in a static and used from one `#[tokio::test]` runtime after
    /// another lost its subscription with the first runtime, and every later waiter slept to
    /// the holder's TTL. The new task subscribes every watched channel and wakes their waiters.
    pub(crate) fn restarting(
        start: impl Fn() -> mpsc::UnboundedSender<SubCmd> + Send + Sync + 'static,
    ) -> Subscriptions {
        Subscriptions {
            tx: Mutex::new(start()),
            restart: Box::new(start),
        }
    }

    /// The way to the task, started again first if it is gone.
    fn running(&self) -> std::sync::MutexGuard<'_, mpsc::UnboundedSender<SubCmd>> {
        let mut tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        if tx.is_closed() && tokio::runtime::Handle::try_current().is_ok() {
            *tx = (self.restart)();
        }
        tx
    }

    fn subscribe(&self, cmd: SubCmd) -> bool {
        self.running().send(cmd).is_ok()
    }

    /// Sent to the task running now, never starting one: a task started again resubscribes
    /// only the channels still watched.
    fn unsubscribe(&self, channel: String) {
        let tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = tx.send(SubCmd::Unsubscribe(channel));
    }
}

/// Registers a waiter for releases of `key` with a backend whose subscription task takes
/// [`SubCmd`]s through `subs`. The first waiter of a channel waits (up to a second) for the
/// subscription to be confirmed: without that a release could slip in unseen. If subscribing
/// fails, the waiter still has its timer, and a reconnecting subscriber wakes everyone.
pub(crate) async fn watch_through(
    wakeups: &Arc<Wakeups>,
    subs: &Arc<Subscriptions>,
    key: &LockKey,
) -> Watch {
    // Every waiter checks the task, not only a channel's first: waiters joining a channel
    // subscribed by a task that has gone with its runtime would otherwise wait for their
    // timers until some other channel's first waiter came. Started again, the task subscribes
    // every watched channel and wakes their waiters.
    drop(subs.running());
    let channel = key.channel().to_owned();
    let (ack_tx, ack_rx) = oneshot::channel();
    let mut subscribing = false;
    let (rx, registered) = wakeups.register_then(&channel, || {
        subscribing = subs.subscribe(SubCmd::Subscribe(channel.clone(), ack_tx));
    });
    let subs = subs.clone();
    let watch = Watch {
        rx,
        channel,
        wakeups: wakeups.clone(),
        on_last: Some(Box::new(move |ch| subs.unsubscribe(ch))),
    };
    match registered {
        Registered::First(subscribed) => {
            let mut confirmed = subscribed.subscribe();
            // Settled (confirmed, or given up on after a second) by a task of its own, not by
            // this waiter: if it left first (a timeout around its acquire), the others would
            // stop waiting while the subscribe it sent is still on its way.
            // Made outside the task, so that a task dropped unpolled settles it too.
            let settled = Confirmed(subscribed);
            tokio::spawn(async move {
                let _settled = settled;
                if subscribing {
                    let _ = tokio::time::timeout(Duration::from_secs(1), ack_rx).await;
                }
            });
            let _ =
                tokio::time::timeout(LONGEST_CONFIRM_WAIT, confirmed.wait_for(|done| *done)).await;
        }
        Registered::Existing(subscribed) => {
            let mut confirmed = subscribed.subscribe();
            let _ = tokio::time::timeout(Duration::from_secs(1), confirmed.wait_for(|done| *done))
                .await;
        }
    }
    watch
}

/// The longest a watch waits for its subscription's confirmation before it is returned
/// unconfirmed (but subscribed): a first waiter's bound (the task that settles the channel gives
/// up after a second, so it is rarely reached); later waiters wait a second at most.
pub(crate) const LONGEST_CONFIRM_WAIT: Duration = Duration::from_secs(2);

/// Marks a channel's subscription settled when dropped.
struct Confirmed(Arc<watch::Sender<bool>>);

impl Drop for Confirmed {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

/// A waiter's registration; unsubscribes the backend when the last one for a key is dropped.
///
/// Made by [`Backend::watch`](crate::Backend::watch); waiting acquires hold one while they
/// wait.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::{Backend, Locker, MemoryBackend};
/// let backend = MemoryBackend::new();
/// let watch = backend.watch(&Locker::memory().lock_key("k")?).await?;
/// drop(watch); // the last watcher of the key: its subscription ends
/// # Ok(()) }
/// ```
pub struct Watch {
    pub(crate) rx: watch::Receiver<u64>,
    pub(crate) channel: String,
    pub(crate) wakeups: Arc<Wakeups>,
    /// Run when this was the channel's last watcher, with the registry locked (see
    /// [`Wakeups::unregister_then`]): it must not touch the registry.
    pub(crate) on_last: Option<Box<dyn Fn(String) + Send + Sync>>,
}

impl Watch {
    /// Marks the current generation seen, so the next `changed` waits for a new release.
    pub(crate) fn mark_seen(&mut self) {
        self.rx.borrow_and_update();
    }

    pub(crate) async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            // The slot is gone only if we were unregistered; never wake spuriously in a loop.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let channel = std::mem::take(&mut self.channel);
        self.wakeups.unregister_then(&channel, || {
            if let Some(f) = &self.on_last {
                f(channel.clone());
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry fed by a subscription task the test plays by hand.
    struct Registry {
        wakeups: Arc<Wakeups>,
        subs: Arc<Subscriptions>,
        sub_rx: mpsc::UnboundedReceiver<SubCmd>,
        key: LockKey,
    }

    impl Registry {
        fn new(key: &str) -> Registry {
            let (sub_tx, sub_rx) = mpsc::unbounded_channel();
            Registry {
                wakeups: Arc::default(),
                subs: Arc::new(Subscriptions::fixed(sub_tx)),
                sub_rx,
                key: LockKey::new("t", key),
            }
        }

        /// A waiter registering on its own task.
        fn watcher(&self) -> tokio::task::JoinHandle<Watch> {
            let (wakeups, subs, key) = (self.wakeups.clone(), self.subs.clone(), self.key.clone());
            tokio::spawn(async move { watch_through(&wakeups, &subs, &key).await })
        }

        /// The first watcher's subscribe, as the subscription task receives it: its ack.
        async fn subscribed(&mut self) -> oneshot::Sender<()> {
            let Some(SubCmd::Subscribe(_, ack)) = self.sub_rx.recv().await else {
                panic!("the first watcher did not subscribe");
            };
            ack
        }
    }

    /// A watcher that arrives while the first one's subscribe is still unconfirmed waits for
    /// it too: returned at once, it could try the key, find it held, and sleep through a
    /// release published before the subscription took effect.
    #[tokio::test]
    async fn a_second_watcher_waits_for_the_first_ones_subscription() {
        let mut r = Registry::new("second");
        let first = r.watcher();
        let ack = r.subscribed().await;
        let second = r.watcher();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !second.is_finished(),
            "the second watcher returned before the subscription was confirmed"
        );
        ack.send(()).expect("the first watcher waits for its ack");
        let both = tokio::time::timeout(Duration::from_millis(500), async {
            (first.await.expect("first"), second.await.expect("second"))
        });
        let (_first, _second) = both.await.expect("both return once confirmed");
        assert!(
            r.sub_rx.try_recv().is_err(),
            "one subscribe for the channel"
        );
    }

    /// The first watcher leaving before its subscription is confirmed (a timeout around the
    /// acquire) does not release the others' wait: the subscribe it sent is still on its way.
    #[tokio::test]
    async fn a_first_watcher_that_leaves_does_not_end_the_others_wait() {
        let mut r = Registry::new("left");
        let first = r.watcher();
        let ack = r.subscribed().await;
        let second = r.watcher();
        tokio::time::sleep(Duration::from_millis(50)).await;
        first.abort();
        let _ = first.await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !second.is_finished(),
            "the second watcher returned before the subscription was confirmed"
        );
        ack.send(())
            .expect("the subscription's ack is still awaited");
        tokio::time::timeout(Duration::from_millis(500), second)
            .await
            .expect("the second watcher returns once confirmed")
            .expect("second");
    }

    /// The unsubscribe of a channel's last watcher is sent while the registry is locked, so no
    /// new first watcher can register between the two and send its subscribe first: the
    /// channel would then end unsubscribed while watched. (That window is a few instructions
    /// wide, too narrow for a test to hit by racing two threads: 150,000 rounds of it never
    /// did here, so the test checks the lock instead.)
    #[tokio::test]
    async fn commands_are_sent_with_the_registry_locked() {
        let wakeups = Arc::new(Wakeups::default());
        let (sub_tx, mut sub_rx) = mpsc::unbounded_channel::<SubCmd>();
        let locked_at_send = Arc::new(Mutex::new(Vec::new()));
        let key = LockKey::new("t", "locked");
        let answering = tokio::spawn(async move {
            let mut seen = Vec::new();
            while let Some(cmd) = sub_rx.recv().await {
                match cmd {
                    SubCmd::Subscribe(ch, ack) => {
                        seen.push((ch, true));
                        let _ = ack.send(());
                    }
                    SubCmd::Unsubscribe(ch) => seen.push((ch, false)),
                }
            }
            seen
        });
        let subs = Arc::new(Subscriptions::fixed(sub_tx.clone()));
        let mut watch = watch_through(&wakeups, &subs, &key).await;
        // The unsubscribe, sent by the watch's own drop, checks the lock as it is sent.
        let (wakeups2, sent) = (wakeups.clone(), locked_at_send.clone());
        let tx = sub_tx.clone();
        watch.on_last = Some(Box::new(move |ch| {
            sent.lock()
                .expect("sent")
                .push(wakeups2.keys.try_lock().is_err());
            let _ = tx.send(SubCmd::Unsubscribe(ch));
        }));
        drop(watch);
        assert_eq!(*locked_at_send.lock().expect("sent"), vec![true]);
        drop((sub_tx, subs));
        let seen = answering.await.expect("the answering task");
        let channel = key.channel().to_owned();
        assert_eq!(seen, vec![(channel.clone(), true), (channel, false)]);
    }
}
