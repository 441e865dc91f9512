//! Group commit for a backend's script calls.
//!
//! A script call costs the server a fixed price (reading the command, setting up the script,
//! answering) beside the work for each lease in it, and that price is most of an acquire's cost:
//! `redis-benchmark` on Redis 7.0 measured the acquire script at 8.8 us of server CPU per lease
//! alone and 3.3 us per lease 64 to a call. So a call is sent at once when none of its kind is in
//! flight or queued (a lone caller waits for nothing). Otherwise it queues, and the first to
//! queue schedules a flush: a task that yields once, so that the callers woken together with it
//! (typically by one batch's answers) queue theirs too, then sends everything queued as one
//! script call. Under load the fixed price is paid once per batch instead of once per lease, and
//! batches do not wait for one another; idle, nothing changes.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use crate::error::Result;

/// Items per script call: enough to spread the fixed price, few enough not to hold the server
/// long. A larger queue goes out as several calls at once.
const MAX_BATCH: usize = 64;

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

    /// `item` was sent, but its caller stopped waiting before the answer came: `answer` when it
    /// came, `None` when the caller's own call was dropped in flight (it may have run). An
    /// acquire undoes a grant nobody will hold; nothing else needs to.
    fn unclaimed(&self, item: &Self::Item, answer: Option<Result<Self::Reply>>) {
        let _ = (item, answer);
    }
}

struct State<F: Flush> {
    /// Calls of this kind in flight.
    in_flight: usize,
    /// A flush is scheduled and has not yet taken the queue.
    scheduled: bool,
    items: Vec<F::Item>,
    /// Where each queued item's answer goes, in the same order.
    replies: Vec<Reply<F>>,
    /// What to call once a queued item's call is in line on the connection, by index into
    /// `items` (few items have one: only releases that hand a turn on).
    in_line: Vec<(usize, InLine)>,
}

/// Called once an item's script call is in line on the connection: polled once, it has put its
/// request on the queue to the server, ahead of every request made after.
pub(super) type InLine = Box<dyn FnOnce() + Send>;

/// A queued item's answer, sent back with the item: a caller who left after it was sent but
/// before it read it hands both to [`Flush::unclaimed`].
type Reply<F> = oneshot::Sender<(<F as Flush>::Item, Result<<F as Flush>::Reply>)>;

/// Sends one kind of script call, coalescing the calls that arrive while others are in flight.
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
                scheduled: false,
                items: Vec::new(),
                replies: Vec::new(),
                in_line: Vec::new(),
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State<F>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends `item` now if nothing of its kind is in flight or queued, else with the next batch.
    /// `None` when no answer came: the batch was dropped (its runtime shut down) or answered
    /// short, so the item may or may not have been carried out.
    pub(super) async fn run(self: &Arc<Self>, item: F::Item) -> Option<Result<F::Reply>> {
        self.run_in_line(item, None::<fn()>).await
    }

    /// [`run`](Self::run), calling `in_line` once the item's call has been polled once, which in
    /// the common case puts its request in line on the connection (redis-rs queues a request to
    /// its connection on the first poll, in order; `RedisBackend::release_in_line` lists when
    /// not). Not called when the item is not sent.
    pub(super) async fn run_in_line(
        self: &Arc<Self>,
        item: F::Item,
        in_line: Option<impl FnOnce() + Send + 'static>,
    ) -> Option<Result<F::Reply>> {
        let mut in_line = in_line;
        let queued = {
            let mut state = self.state();
            if state.in_flight == 0 && !state.scheduled {
                state.in_flight += 1;
                Ok(item)
            } else {
                let (tx, rx) = oneshot::channel();
                if let Some(f) = in_line.take() {
                    let index = state.items.len();
                    state.in_line.push((index, Box::new(f)));
                }
                state.items.push(item);
                state.replies.push(tx);
                if !state.scheduled {
                    state.scheduled = true;
                    drop(state);
                    self.schedule();
                }
                Err(rx)
            }
        };
        match queued {
            Ok(item) => {
                let _in_flight = InFlight(self.clone());
                let mut unanswered = Unanswered {
                    flush: &self.flush,
                    item: Some(&item),
                };
                let mut flush = std::pin::pin!(self.flush.flush(std::slice::from_ref(&item)));
                let answer = std::future::poll_fn(|cx| {
                    let polled = flush.as_mut().poll(cx);
                    if let Some(f) = in_line.take() {
                        f();
                    }
                    polled
                })
                .await
                .pop();
                unanswered.item = None;
                answer
            }
            Err(rx) => {
                let mut waiting = Waiting {
                    flush: &self.flush,
                    rx,
                };
                (&mut waiting.rx).await.ok().map(|(_, answer)| answer)
            }
        }
    }

    fn schedule(self: &Arc<Self>) {
        let scheduled = Scheduled(Some(self.clone()));
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to send from: dropped, the schedule lets the queue go.
            return;
        };
        runtime.spawn(async move {
            // The callers woken with this one queue their calls before the batch is taken.
            tokio::task::yield_now().await;
            let mut scheduled = scheduled;
            let Some(this) = scheduled.0.take() else {
                return;
            };
            let (items, replies, in_line) = {
                let mut state = this.state();
                state.scheduled = false;
                state.in_flight += 1;
                (
                    std::mem::take(&mut state.items),
                    std::mem::take(&mut state.replies),
                    std::mem::take(&mut state.in_line),
                )
            };
            let _in_flight = InFlight(this.clone());
            this.send(items, replies, in_line).await;
        });
    }

    async fn send(
        &self,
        mut items: Vec<F::Item>,
        mut replies: Vec<Reply<F>>,
        mut in_line: Vec<(usize, InLine)>,
    ) {
        if !F::SEND_ABANDONED && replies.iter().any(|tx| tx.is_closed()) {
            // Not sent, so not in line: those items' calls are dropped uncalled.
            // Read once: a caller leaving between two reads would keep its place in line for an
            // item that is not sent.
            let kept: Vec<bool> = replies.iter().map(|tx| !tx.is_closed()).collect();
            in_line.retain(|(i, _)| kept[*i]);
            (items, replies) = items
                .into_iter()
                .zip(replies)
                .zip(&kept)
                .filter_map(|(pair, &keep)| keep.then_some(pair))
                .unzip();
        }
        let answers = {
            let calls = items.chunks(MAX_BATCH).map(|chunk| self.flush.flush(chunk));
            let mut calls = std::pin::pin!(futures_util::future::join_all(calls));
            // The first poll of the join polls every call once.
            std::future::poll_fn(|cx| {
                let polled = calls.as_mut().poll(cx);
                for (_, f) in in_line.drain(..) {
                    f();
                }
                polled
            })
            .await
        };
        // An answer list shorter than its chunk drops the rest's senders: told no answer came.
        let mut items = items.into_iter();
        let mut replies = replies.into_iter();
        for answers in answers {
            let mut answers = answers.into_iter();
            for (item, tx) in items.by_ref().zip(replies.by_ref()).take(MAX_BATCH) {
                if let Some(answer) = answers.next()
                    && let Err((item, answer)) = tx.send((item, answer))
                {
                    self.flush.unclaimed(&item, Some(answer));
                }
            }
        }
    }
}

/// A lone call's item while its call is in flight: dropped armed (the caller's future was
/// dropped mid-call), the item is reported unclaimed, since the call may still run.
struct Unanswered<'a, F: Flush> {
    flush: &'a F,
    item: Option<&'a F::Item>,
}

impl<F: Flush> Drop for Unanswered<'_, F> {
    fn drop(&mut self) {
        if let Some(item) = self.item {
            self.flush.unclaimed(item, None);
        }
    }
}

/// A queued caller's wait for its answer. Dropped before the answer was read (the caller's
/// future dropped, even after the answer came), it closes the channel and hands an answer that
/// came to [`Flush::unclaimed`] with its item: a grant must not be lost with its caller.
struct Waiting<'a, F: Flush> {
    flush: &'a F,
    rx: oneshot::Receiver<(F::Item, Result<F::Reply>)>,
}

impl<F: Flush> Drop for Waiting<'_, F> {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok((item, answer)) = self.rx.try_recv() {
            self.flush.unclaimed(&item, Some(answer));
        }
    }
}

/// A call of one kind in flight, however it ends (the caller's future dropped included).
struct InFlight<F: Flush>(Arc<Batcher<F>>);

impl<F: Flush> Drop for InFlight<F> {
    fn drop(&mut self) {
        self.0.state().in_flight -= 1;
    }
}

/// A flush scheduled that has not taken the queue. Dropped so (its runtime shut down before it
/// ran), it lets the queue go: each queued caller is told no answer came, and the next caller
/// schedules afresh instead of queueing behind a flush that will never run.
struct Scheduled<F: Flush>(Option<Arc<Batcher<F>>>);

impl<F: Flush> Drop for Scheduled<F> {
    fn drop(&mut self) {
        if let Some(batcher) = self.0.take() {
            let queue = {
                let mut state = batcher.state();
                state.scheduled = false;
                (
                    std::mem::take(&mut state.items),
                    std::mem::take(&mut state.replies),
                    std::mem::take(&mut state.in_line),
                )
            };
            drop(queue);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::pin;
    use std::task::Poll;
    use std::time::Duration;
    use tokio::sync::Semaphore;

    /// Answers each item with itself, once the test lets a call through; records call sizes.
    struct Echo<const SEND: bool> {
        sizes: Mutex<Vec<usize>>,
        gate: Semaphore,
        /// Answer only the first item of each call.
        short: bool,
        /// Items reported unclaimed, with whether their answer came.
        unclaimed: Mutex<Vec<(u32, bool)>>,
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

        fn unclaimed(&self, item: &u32, answer: Option<Result<u32>>) {
            if let Some(answer) = &answer {
                assert_eq!(answer.as_ref().ok(), Some(item), "its own answer");
            }
            let mut unclaimed = self.unclaimed.lock().expect("unclaimed");
            unclaimed.push((*item, answer.is_some()));
        }
    }

    fn echo<const SEND: bool>(short: bool) -> Arc<Batcher<Echo<SEND>>> {
        Batcher::new(Echo {
            sizes: Mutex::new(Vec::new()),
            gate: Semaphore::new(0),
            short,
            unclaimed: Mutex::new(Vec::new()),
        })
    }

    /// A grant must not be lost with its caller: an item whose caller stopped waiting after it
    /// was sent is handed back to the flush, with its answer when one came (a queued item) and
    /// without when the caller's own call was dropped in flight (a lone item). Items whose
    /// callers kept waiting are not.
    #[tokio::test]
    async fn items_sent_for_callers_who_left_are_unclaimed() {
        let b = echo::<false>(false);
        let alone = tokio::spawn({
            let b = b.clone();
            async move { b.run(0).await }
        });
        until_calls(&b, 1).await;
        let (queued, kept) = {
            let (b1, b2) = (b.clone(), b.clone());
            (
                tokio::spawn(async move { b1.run(1).await }),
                tokio::spawn(async move { b2.run(2).await }),
            )
        };
        until_calls(&b, 2).await;
        // Both calls are out; their callers leave, one the lone call's, one a queued one's.
        alone.abort();
        queued.abort();
        assert!(alone.await.expect_err("aborted").is_cancelled());
        assert!(queued.await.expect_err("aborted").is_cancelled());
        b.flush.gate.add_permits(100);
        assert_eq!(
            kept.await
                .expect("task")
                .expect("answered")
                .expect("echoed"),
            2
        );
        let mut unclaimed = b.flush.unclaimed.lock().expect("unclaimed").clone();
        unclaimed.sort();
        assert_eq!(unclaimed, vec![(0, false), (1, true)]);
    }

    /// A queued caller whose answer has come but who has not read it yet, and never will (its
    /// future dropped before its next poll: a lost `select!` branch, an abort): the answer is
    /// handed back with its item, not dropped with the channel.
    #[tokio::test]
    async fn an_answer_that_came_for_a_caller_who_left_is_unclaimed() {
        let b = echo::<false>(false);
        let mut alone = Box::pin(b.run(0));
        let mut queued = Box::pin(b.run(1));
        std::future::poll_fn(|cx| {
            assert!(alone.as_mut().poll(cx).is_pending());
            assert!(queued.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        until_calls(&b, 2).await;
        b.flush.gate.add_permits(100);
        // The scheduled flush answers into the queued caller's channel; nobody polls it.
        let give_up = tokio::time::Instant::now() + Duration::from_secs(5);
        while b.state().in_flight > 1 {
            assert!(
                tokio::time::Instant::now() < give_up,
                "the flush never ended"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(queued);
        assert_eq!(
            b.flush.unclaimed.lock().expect("unclaimed").clone(),
            vec![(1, true)]
        );
        assert_eq!(alone.await.expect("answered").expect("echoed"), 0);
    }

    /// What an item's `in_line` call recorded: the items whose calls were out.
    fn noted(calls: &Arc<Mutex<Vec<u32>>>, i: u32) -> impl FnOnce() + Send + 'static {
        let calls = calls.clone();
        move || calls.lock().expect("calls").push(i)
    }

    /// A release hands its key's turn on once its call is out, before the answer: a lone item's
    /// `in_line` comes with its call's first poll, a queued one's with its batch's.
    #[tokio::test]
    async fn in_line_comes_when_the_call_is_out_not_when_answered() {
        let b = echo::<true>(false);
        let calls = Arc::new(Mutex::new(Vec::new()));
        let alone = tokio::spawn({
            let (b, f) = (b.clone(), noted(&calls, 0));
            async move { b.run_in_line(0, Some(f)).await }
        });
        until_calls(&b, 1).await;
        assert_eq!(
            *calls.lock().expect("calls"),
            vec![0],
            "the lone call is out"
        );
        let queued = tokio::spawn({
            let (b, f) = (b.clone(), noted(&calls, 1));
            async move { b.run_in_line(1, Some(f)).await }
        });
        let plain = tokio::spawn({
            let b = b.clone();
            async move { b.run(2).await }
        });
        until_calls(&b, 2).await;
        assert_eq!(
            sizes(&b),
            vec![1, 2],
            "the two queued items went out as one call"
        );
        assert_eq!(
            *calls.lock().expect("calls"),
            vec![0, 1],
            "the batch is out"
        );
        assert!(
            !alone.is_finished() && !queued.is_finished(),
            "nothing answered yet"
        );
        b.flush.gate.add_permits(100);
        for (task, i) in [(alone, 0), (queued, 1), (plain, 2)] {
            let answer = task
                .await
                .expect("task")
                .expect("answered")
                .expect("echoed");
            assert_eq!(answer, i);
        }
        assert_eq!(
            *calls.lock().expect("calls"),
            vec![0, 1],
            "each called once"
        );
    }

    /// A lone call in flight, then item 1 queued behind it with an `in_line` that records it,
    /// whose caller leaves before the scheduled flush takes the queue (that flush runs on this
    /// thread, at the next await at the earliest).
    async fn queued_and_left<const SEND: bool>() -> (
        Arc<Batcher<Echo<SEND>>>,
        Arc<Mutex<Vec<u32>>>,
        tokio::task::JoinHandle<Option<Result<u32>>>,
    ) {
        let b = echo::<SEND>(false);
        let calls = Arc::new(Mutex::new(Vec::new()));
        let alone = tokio::spawn({
            let b = b.clone();
            async move { b.run(0).await }
        });
        until_calls(&b, 1).await;
        let mut queued = Box::pin(b.run_in_line(1, Some(noted(&calls, 1))));
        std::future::poll_fn(|cx| {
            assert!(queued.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        drop(queued);
        (b, calls, alone)
    }

    /// A queued release whose caller left is sent all the same, and is in line with its batch.
    #[tokio::test]
    async fn an_abandoned_item_sent_anyway_is_in_line() {
        let (b, calls, alone) = queued_and_left::<true>().await;
        until_calls(&b, 2).await;
        assert_eq!(*calls.lock().expect("calls"), vec![1]);
        b.flush.gate.add_permits(100);
        let answer = alone.await.expect("task").expect("answered");
        assert_eq!(answer.expect("echoed"), 0);
    }

    /// An item not sent (an acquire whose caller left while it was queued) is not in line.
    #[tokio::test]
    async fn an_item_not_sent_is_never_in_line() {
        let (b, calls, alone) = queued_and_left::<false>().await;
        b.flush.gate.add_permits(100);
        let answer = alone.await.expect("task").expect("answered");
        assert_eq!(answer.expect("echoed"), 0);
        let give_up = tokio::time::Instant::now() + Duration::from_secs(5);
        while b.state().scheduled || b.state().in_flight > 0 {
            assert!(
                tokio::time::Instant::now() < give_up,
                "the flush never ended"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(sizes(&b), vec![1], "the queued item was not sent");
        assert!(calls.lock().expect("calls").is_empty());
    }

    fn sizes<const SEND: bool>(b: &Batcher<Echo<SEND>>) -> Vec<usize> {
        b.flush.sizes.lock().expect("sizes").clone()
    }

    /// Waits until `n` calls were made; a batcher that never makes them fails the test instead
    /// of hanging it.
    async fn until_calls<const SEND: bool>(b: &Batcher<Echo<SEND>>, n: usize) {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(5);
        while sizes(b).len() < n {
            assert!(
                tokio::time::Instant::now() < give_up,
                "{n} calls never made: {:?}",
                sizes(b)
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Calls items `0..n` at once from one task (as the tasks one batch's answers wake do), lets
    /// the calls through once both are made, and returns the answers.
    async fn run_at_once<const SEND: bool>(
        b: &Arc<Batcher<Echo<SEND>>>,
        n: u32,
    ) -> Vec<Option<Result<u32>>> {
        let runs = (0..n).map(|i| {
            let b = b.clone();
            async move { b.run(i).await }
        });
        let all = tokio::spawn(futures_util::future::join_all(runs));
        until_calls(b, 2).await;
        assert_eq!(
            sizes(b),
            vec![1, n as usize - 1],
            "the first goes alone, the rest together"
        );
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
        let state = b.state();
        assert_eq!((state.in_flight, state.scheduled), (0, false), "idle again");
    }

    #[tokio::test]
    async fn an_idle_batcher_sends_each_call_alone() {
        let b = echo::<false>(false);
        b.flush.gate.add_permits(100);
        for i in 0..5 {
            // Answered on its first poll: sent by its caller, not handed to a scheduled flush.
            let answer = futures_util::FutureExt::now_or_never(b.run(i)).expect("sent at once");
            assert_eq!(answer.expect("answered").expect("echoed"), i);
        }
        assert_eq!(sizes(&b), vec![1; 5]);
        let state = b.state();
        assert_eq!((state.in_flight, state.scheduled), (0, false), "idle again");
    }

    /// A queue longer than `MAX_BATCH` goes out as several calls at once, and each answer
    /// reaches its own caller, also when a call answers short.
    #[tokio::test]
    async fn a_long_queue_goes_out_in_calls_of_max_batch() {
        for short in [false, true] {
            let b = echo::<false>(short);
            // One alone, then MAX_BATCH, MAX_BATCH and 2.
            let n = 2 * MAX_BATCH as u32 + 3;
            let runs = (0..n).map(|i| {
                let b = b.clone();
                async move { b.run(i).await }
            });
            let all = tokio::spawn(futures_util::future::join_all(runs));
            until_calls(&b, 4).await;
            assert_eq!(sizes(&b), vec![1, MAX_BATCH, MAX_BATCH, 2]);
            b.flush.gate.add_permits(1000);
            let answers = all.await.expect("the callers' task");
            for (i, answer) in answers.into_iter().enumerate() {
                let first_of_its_call = i == 0 || (i - 1) % MAX_BATCH == 0;
                let want = (!short || first_of_its_call).then_some(i as u32);
                assert_eq!(
                    answer.map(|r| r.expect("echoed")),
                    want,
                    "item {i}, short {short}"
                );
            }
        }
    }

    #[tokio::test]
    async fn batches_do_not_wait_for_one_another() {
        let b = echo::<false>(false);
        let first = tokio::spawn(run_at_once_unopened(b.clone(), 0..4));
        until_calls(&b, 2).await;
        let second = tokio::spawn(run_at_once_unopened(b.clone(), 10..13));
        until_calls(&b, 3).await;
        assert_eq!(
            sizes(&b),
            vec![1, 3, 3],
            "sent while the first batch was in flight"
        );
        b.flush.gate.add_permits(100);
        let answers: Vec<u32> = [first, second]
            .into_iter()
            .map(|t| async { t.await.expect("task") })
            .collect::<futures_util::future::JoinAll<_>>()
            .await
            .into_iter()
            .flatten()
            .map(|a| a.expect("answered").expect("echoed"))
            .collect();
        assert_eq!(answers, vec![0, 1, 2, 3, 10, 11, 12]);
    }

    async fn run_at_once_unopened<const SEND: bool>(
        b: Arc<Batcher<Echo<SEND>>>,
        items: std::ops::Range<u32>,
    ) -> Vec<Option<Result<u32>>> {
        futures_util::future::join_all(items.map(|i| b.run(i))).await
    }

    /// Sends one call alone and queues three behind it, the second of which its caller drops
    /// before the flush takes the queue; returns the sizes of the calls made.
    async fn abandon_one<const SEND: bool>() -> Vec<usize> {
        let b = echo::<SEND>(false);
        let mut alone = pin!(b.run(0));
        let (mut kept, mut gone, mut last) =
            (pin!(b.run(10)), Box::pin(b.run(11)), pin!(b.run(12)));
        // One poll each, on this task, before the scheduled flush can run.
        std::future::poll_fn(|cx| {
            for f in [
                alone.as_mut().poll(cx),
                kept.as_mut().poll(cx),
                gone.as_mut().poll(cx),
                last.as_mut().poll(cx),
            ] {
                assert!(f.is_pending(), "nothing is answered before the gate opens");
            }
            Poll::Ready(())
        })
        .await;
        drop(gone);
        b.flush.gate.add_permits(100);
        assert_eq!(alone.await.expect("answered").expect("echoed"), 0);
        assert_eq!(kept.await.expect("answered").expect("echoed"), 10);
        assert_eq!(last.await.expect("answered").expect("echoed"), 12);
        sizes(&b)
    }

    #[tokio::test]
    async fn an_abandoned_item_is_not_sent_when_the_flush_says_so() {
        assert_eq!(abandon_one::<false>().await, vec![1, 2]);
    }

    #[tokio::test]
    async fn an_abandoned_item_is_sent_when_the_flush_says_so() {
        assert_eq!(abandon_one::<true>().await, vec![1, 3]);
    }

    #[tokio::test]
    async fn an_item_left_unanswered_is_told_so() {
        let b = echo::<false>(true);
        let answers: Vec<Option<u32>> = run_at_once(&b, 6)
            .await
            .into_iter()
            .map(|a| a.map(|r| r.expect("echoed")))
            .collect();
        assert_eq!(
            answers,
            vec![Some(0), Some(1), None, None, None, None],
            "the queued batch answered only its first item"
        );
    }

    #[test]
    fn a_flush_whose_runtime_is_gone_lets_the_queue_go() {
        let b = echo::<false>(false);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let mut alone = Box::pin(b.run(0));
        let mut queued = Box::pin(b.run(1));
        runtime.block_on(std::future::poll_fn(|cx| {
            assert!(alone.as_mut().poll(cx).is_pending());
            assert!(queued.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        }));
        drop(alone);
        // The scheduled flush never ran: shutting the runtime down dropped it.
        drop(runtime);
        assert!(!b.state().scheduled, "the next caller schedules afresh");
        let answer = futures_util::FutureExt::now_or_never(queued).expect("answered at once");
        assert!(answer.is_none(), "told that no answer came");
    }
}
