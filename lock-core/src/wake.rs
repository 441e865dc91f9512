//! Wake-ups for waiters: one registry per `Locker`, fed by whichever backend sees releases.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};

use crate::types::LockKey;

/// A per-key generation counter that waiters watch; a release bumps it.
#[derive(Default)]
pub struct Wakeups {
    keys: Mutex<HashMap<String, Slot>>,
}

struct Slot {
    tx: watch::Sender<u64>,
    watchers: usize,
}

/// What [`Wakeups::register`] tells the caller about the key's subscription.
pub(crate) enum Registered {
    /// This is the first watcher: the backend must subscribe to the key's channel.
    First,
    /// Someone already watches the key; the subscription exists.
    Existing,
}

impl Wakeups {
    pub(crate) fn register(&self, channel: &str) -> (watch::Receiver<u64>, Registered) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        match keys.get_mut(channel) {
            Some(slot) => {
                slot.watchers += 1;
                (slot.tx.subscribe(), Registered::Existing)
            }
            None => {
                let (tx, rx) = watch::channel(0);
                keys.insert(channel.to_owned(), Slot { tx, watchers: 1 });
                (rx, Registered::First)
            }
        }
    }

    /// Returns true when the last watcher left and the subscription can go.
    pub(crate) fn unregister(&self, channel: &str) -> bool {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = keys.get_mut(channel) {
            slot.watchers -= 1;
            if slot.watchers == 0 {
                keys.remove(channel);
                return true;
            }
        }
        false
    }

    /// Wakes every waiter of one channel.
    pub fn wake(&self, channel: &str) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = keys.get(channel) {
            slot.tx.send_modify(|g| *g += 1);
        }
    }

    /// Wakes every waiter: used after a subscription gap, when releases may have been missed.
    pub fn wake_all(&self) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        for slot in keys.values() {
            slot.tx.send_modify(|g| *g += 1);
        }
    }

    /// The channels currently watched, for resubscribing after a reconnect.
    pub(crate) fn channels(&self) -> Vec<String> {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        keys.keys().cloned().collect()
    }
}

/// A request to a backend's one subscription task, which handles them in order so that a late
/// unsubscribe of a channel's last waiter can never undo the subscribe of its next first one.
pub(crate) enum SubCmd {
    /// Subscribe to the channel; the sender is answered once the server confirmed it.
    Subscribe(String, oneshot::Sender<()>),
    /// Unsubscribe from the channel: its last waiter left.
    Unsubscribe(String),
}

/// Registers a waiter for releases of `key` with a backend whose subscription task takes
/// [`SubCmd`]s on `sub_tx`. The first waiter of a channel waits (up to a second) for the
/// subscription to be confirmed: without that a release could slip in unseen. If subscribing
/// fails, the waiter still has its timer, and a reconnecting subscriber wakes everyone.
pub(crate) async fn watch_through(
    wakeups: &Arc<Wakeups>,
    sub_tx: &mpsc::UnboundedSender<SubCmd>,
    key: &LockKey,
) -> Watch {
    let channel = key.channel().to_owned();
    let (rx, reg) = wakeups.register(&channel);
    let tx = sub_tx.clone();
    let watch = Watch {
        rx,
        channel: channel.clone(),
        wakeups: wakeups.clone(),
        on_last: Some(Box::new(move |ch| {
            let _ = tx.send(SubCmd::Unsubscribe(ch));
        })),
    };
    if let Registered::First = reg {
        let (ack_tx, ack_rx) = oneshot::channel();
        if sub_tx.send(SubCmd::Subscribe(channel, ack_tx)).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(1), ack_rx).await;
        }
    }
    watch
}

/// A waiter's registration; unsubscribes the backend when the last one for a key is dropped.
pub struct Watch {
    pub(crate) rx: watch::Receiver<u64>,
    pub(crate) channel: String,
    pub(crate) wakeups: Arc<Wakeups>,
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
        if self.wakeups.unregister(&self.channel)
            && let Some(f) = &self.on_last
        {
            f(std::mem::take(&mut self.channel));
        }
    }
}
