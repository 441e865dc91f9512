//! Group commit for a backend's script calls.
//!
//! A script call costs the server a fixed price (reading the command, setting up the script,
//! answering) beside the work for each lease in it, and that price is most of an acquire's cost:
//! `redis-benchmark` on Redis 7.0 measured the acquire script at 8.8 us of server CPU per lease
//! alone and 3.3 us per lease 64 to a call. So a call is sent at once while few of its kind are
//! in flight (a lone caller waits for nothing); the calls that arrive meanwhile queue, and go
//! out together in one script call when one in flight answers. Under load the fixed price is
//! paid once per batch instead of once per lease; idle, nothing changes.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use crate::error::Result;

/// Items per script call: enough to spread the fixed price, few enough not to hold the server
/// long. A larger queue goes out as several calls at once.
const MAX_BATCH: usize = 64;

/// Calls of one kind in flight before new ones queue. One alone leaves the server idle while
/// the client takes a batch's answers and builds the next; two overlap the two. More split the
/// queue into smaller batches and cost the server more per lease than they gain (measured with
/// `examples/bench.rs`, 64 tasks on distinct keys: one 86-94k cycles/s, two 100-104k, four
/// 102-114k at 3-5% more server CPU per cycle).
const IN_FLIGHT: usize = 2;

/// One kind of script call that can carry many items.
pub(super) trait Flush: Send + Sync + 'static {
    /// What one caller asks for.
    type Item: Send + 'static;
    /// What one caller is answered.
    type Reply: Send + 'static;
    /// Whether an item whose caller stopped waiting before it was sent is sent anyway. An
    /// acquire nobody waits for is better not made (its grant would block the key for a TTL); a
    /// release is sent whatever happens to its caller.
    const SEND_ABANDONED: bool;

    /// One script call for `items`: one answer each, in order.
    fn flush(&self, items: &[Self::Item]) -> impl Future<Output = Vec<Result<Self::Reply>>> + Send;
}

struct State<F: Flush> {
    /// Calls of this kind in flight; at the limit, new items queue behind them.
    in_flight: usize,
    items: Vec<F::Item>,
    /// Where each queued item's answer goes, in the same order.
    replies: Vec<oneshot::Sender<Result<F::Reply>>>,
}

/// Sends one kind of script call, coalescing the calls that arrive while one is in flight.
pub(super) struct Batcher<F: Flush> {
    flush: F,
    state: Mutex<State<F>>,
}

impl<F: Flush> Batcher<F> {
    pub(super) fn new(flush: F) -> Arc<Batcher<F>> {
        Arc::new(Batcher {
            flush,
            state: Mutex::new(State {
                in_flight: 0,
                items: Vec::new(),
                replies: Vec::new(),
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State<F>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends `item` now if nothing of its kind is in flight, else with the next batch. `None`
    /// when no answer came: the batch was dropped (its runtime shut down) or answered short,
    /// so the item may or may not have been carried out.
    pub(super) async fn run(self: &Arc<Self>, item: F::Item) -> Option<Result<F::Reply>> {
        let queued = {
            let mut state = self.state();
            if state.in_flight >= IN_FLIGHT {
                let (tx, rx) = oneshot::channel();
                state.items.push(item);
                state.replies.push(tx);
                Err(rx)
            } else {
                state.in_flight += 1;
                Ok(item)
            }
        };
        match queued {
            Ok(item) => {
                // Hands the queue on however this ends, the caller's future dropped included.
                let _turn = Turn(self.clone());
                self.flush.flush(std::slice::from_ref(&item)).await.pop()
            }
            Err(rx) => rx.await.ok(),
        }
    }

    /// Called when a call of this kind has answered: sends what queued meanwhile, or goes idle.
    fn finish(self: &Arc<Self>) {
        let (items, replies) = {
            let mut state = self.state();
            if state.items.is_empty() {
                state.in_flight -= 1;
                return;
            }
            (
                std::mem::take(&mut state.items),
                std::mem::take(&mut state.replies),
            )
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let turn = Turn(self.clone());
                runtime.spawn(async move {
                    turn.0.send(items, replies).await;
                    drop(turn);
                });
            }
            // No runtime to send from: the queued callers, their senders dropped, are told no
            // answer came.
            Err(_) => {
                self.state().in_flight -= 1;
                drop((items, replies));
            }
        }
    }

    async fn send(
        &self,
        mut items: Vec<F::Item>,
        mut replies: Vec<oneshot::Sender<Result<F::Reply>>>,
    ) {
        if !F::SEND_ABANDONED && replies.iter().any(|tx| tx.is_closed()) {
            (items, replies) = items
                .into_iter()
                .zip(replies)
                .filter(|(_, tx)| !tx.is_closed())
                .unzip();
        }
        let calls = items.chunks(MAX_BATCH).map(|chunk| self.flush.flush(chunk));
        let answers = futures_util::future::join_all(calls).await;
        // An answer list shorter than its chunk drops the rest's senders: told no answer came.
        let mut replies = replies.into_iter();
        for (chunk, answers) in items.chunks(MAX_BATCH).zip(answers) {
            let mut senders = replies.by_ref().take(chunk.len());
            for answer in answers {
                if let Some(tx) = senders.next() {
                    let _ = tx.send(answer);
                }
            }
            senders.for_each(drop);
        }
    }
}

/// The right to send a call of one kind; dropped, it hands on to what queued meanwhile.
struct Turn<F: Flush>(Arc<Batcher<F>>);

impl<F: Flush> Drop for Turn<F> {
    fn drop(&mut self) {
        self.0.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::sync::Semaphore;

    /// Answers each item with itself, once the test lets a call through; records call sizes.
    struct Echo<const SEND: bool> {
        sizes: Mutex<Vec<usize>>,
        gate: Semaphore,
        /// Answer only the first item of each call.
        short: bool,
    }

    impl<const SEND: bool> Flush for Echo<SEND> {
        type Item = u32;
        type Reply = u32;
        const SEND_ABANDONED: bool = SEND;

        async fn flush(&self, items: &[u32]) -> Vec<Result<u32>> {
            self.sizes.lock().expect("sizes").push(items.len());
            self.gate.acquire().await.expect("gate open").forget();
            let answered = if self.short { &items[..1] } else { items };
            answered.iter().map(|&i| Ok(i)).collect()
        }
    }

    fn echo<const SEND: bool>(short: bool) -> Arc<Batcher<Echo<SEND>>> {
        Batcher::new(Echo {
            sizes: Mutex::new(Vec::new()),
            gate: Semaphore::new(0),
            short,
        })
    }

    async fn until_queued<F: Flush>(b: &Batcher<F>, n: usize) {
        while b.state().items.len() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn sizes<const SEND: bool>(b: &Batcher<Echo<SEND>>) -> Vec<usize> {
        b.flush.sizes.lock().expect("sizes").clone()
    }

    /// Calls items `0..n` at once from one task, lets the calls through once all but the
    /// first are queued, and returns the answers.
    async fn run_at_once<const SEND: bool>(
        b: &Arc<Batcher<Echo<SEND>>>,
        n: u32,
    ) -> Vec<Option<Result<u32>>> {
        let runs = (0..n).map(|i| {
            let b = b.clone();
            async move { b.run(i).await }
        });
        let all = tokio::spawn(futures_util::future::join_all(runs));
        until_queued(b, n as usize - IN_FLIGHT).await;
        assert_eq!(sizes(b), vec![1; IN_FLIGHT], "the first calls go alone");
        b.flush.gate.add_permits(100);
        all.await.expect("the callers' task")
    }

    #[tokio::test]
    async fn calls_that_queue_go_out_together() {
        let b = echo::<false>(false);
        let answers: Vec<u32> = run_at_once(&b, 10)
            .await
            .into_iter()
            .map(|a| a.expect("answered").expect("echoed"))
            .collect();
        assert_eq!(
            answers,
            (0..10).collect::<Vec<_>>(),
            "each caller gets its own answer"
        );
        let mut want = vec![1; IN_FLIGHT];
        want.push(10 - IN_FLIGHT);
        assert_eq!(sizes(&b), want, "the queued items went out in one call");
        assert_eq!(b.state().in_flight, 0);
    }

    #[tokio::test]
    async fn an_idle_batcher_sends_each_call_alone() {
        let b = echo::<false>(false);
        b.flush.gate.add_permits(100);
        for i in 0..5 {
            assert_eq!(b.run(i).await.expect("answered").expect("echoed"), i);
        }
        assert_eq!(sizes(&b), vec![1; 5]);
    }

    /// Queues `IN_FLIGHT` calls in flight and three behind them, drops the second queued one,
    /// and returns the sizes of the calls made.
    async fn abandon_one<const SEND: bool>() -> Vec<usize> {
        let b = echo::<SEND>(false);
        let spawn = |items: std::ops::Range<u32>| -> Vec<_> {
            items
                .map(|i| {
                    let b = b.clone();
                    tokio::spawn(async move { b.run(i).await })
                })
                .collect()
        };
        let in_flight = spawn(0..IN_FLIGHT as u32);
        while sizes(&b).len() < IN_FLIGHT {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut queued = spawn(10..13);
        until_queued(&b, 3).await;
        queued[1].abort();
        while !queued[1].is_finished() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        b.flush.gate.add_permits(100);
        let aborted = queued.remove(1);
        assert!(aborted.await.expect_err("aborted").is_cancelled());
        for (t, want) in in_flight
            .into_iter()
            .chain(queued)
            .zip((0..IN_FLIGHT as u32).chain([10, 12]))
        {
            let answer = t.await.expect("task").expect("answered").expect("echoed");
            assert_eq!(answer, want);
        }
        sizes(&b)
    }

    #[tokio::test]
    async fn an_abandoned_item_is_not_sent_when_the_flush_says_so() {
        let mut want = vec![1; IN_FLIGHT];
        want.push(2);
        assert_eq!(abandon_one::<false>().await, want);
    }

    #[tokio::test]
    async fn an_abandoned_item_is_sent_when_the_flush_says_so() {
        let mut want = vec![1; IN_FLIGHT];
        want.push(3);
        assert_eq!(abandon_one::<true>().await, want);
    }

    #[tokio::test]
    async fn an_item_left_unanswered_is_told_so() {
        let b = echo::<false>(true);
        let answers: Vec<Option<u32>> = run_at_once(&b, 6)
            .await
            .into_iter()
            .map(|a| a.map(|r| r.expect("echoed")))
            .collect();
        let mut want: Vec<Option<u32>> = (0..=IN_FLIGHT as u32).map(Some).collect();
        want.resize(6, None);
        assert_eq!(
            answers, want,
            "the queued batch answered only its first item"
        );
    }
}
