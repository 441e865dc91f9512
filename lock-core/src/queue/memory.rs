//! The queue in this process: the same steps as the Redis scripts, each under one lock, with
//! deadlines on this process's monotonic clock.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::{ClaimReply, JobInfo, JobState, Op, QueueCounts, Reaped, Refusal, Settled};
use crate::error::Result;
use crate::types::LockKey;
use crate::wake::{Wakeups, Watch};

#[derive(Clone)]
pub(crate) struct MemoryQueue {
    state: Arc<Mutex<State>>,
    wakeups: Arc<Wakeups>,
    channel: String,
    clock: Clock,
}

/// Due delayed jobs a claim moves back to pending, as `queue_claim.lua`'s `LIMIT 0 100`.
const PROMOTE_PER_CLAIM: usize = 100;

struct Job {
    state: JobState,
    attempts: u64,
    max: u64,
    payload: Vec<u8>,
    error: Option<String>,
    /// Deadline (active), ready time (delayed) or time of death (dead), in [`Clock`] ms.
    at_ms: Option<u64>,
    /// When a done marker goes away, in [`Clock`] ms.
    expires_ms: Option<u64>,
}

/// A job id ordered as the decimal text Redis stores it as: a sorted set orders members of
/// equal score by their bytes ("10" < "100" < "9"), and which of the jobs due at one
/// millisecond a claim's or reap's `LIMIT` takes must be the same here as there.
#[derive(Clone, Copy, PartialEq, Eq)]
struct ByText(u64);

impl Ord for ByText {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let digits = |n: u64| n.checked_ilog10().map_or(1, |l| l + 1);
        let (a, b) = (self.0, other.0);
        let (da, db) = (digits(a), digits(b));
        // Padded with zeros to the same number of digits, the two line up digit by digit; equal
        // then, the shorter is a prefix of the longer and comes first.
        let pad = |n: u64, by: u32| u128::from(n) * 10u128.pow(by);
        pad(a, db.saturating_sub(da))
            .cmp(&pad(b, da.saturating_sub(db)))
            .then(da.cmp(&db))
    }
}

impl PartialOrd for ByText {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

#[derive(Default)]
struct State {
    seq: u64,
    jobs: HashMap<u64, Job>,
    pending: BTreeSet<u64>,
    /// (deadline, id), in [`Clock`] ms
    active: BTreeSet<(u64, ByText)>,
    /// (ready time, id), in [`Clock`] ms
    delayed: BTreeSet<(u64, ByText)>,
    /// (time of death, id), in [`Clock`] ms
    dead: BTreeSet<(u64, ByText)>,
    /// Done markers in completion order with their expiry; `keep_done` is fixed per queue, so
    /// expiries only grow along the queue.
    done: VecDeque<(u64, u64)>,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The queue's time: ms on the monotonic clock since the queue was made. Leases are timed on
/// it, as the memory lock backend times its leases, because the wall clock can step (NTP, a
/// resumed VM): a step forward would let the reaper hand a held job to a second worker, a step
/// back would keep a lapsed one from the reaper. The wall clock is read only to report a time.
#[derive(Clone)]
struct Clock {
    origin: Instant,
    /// Unix-epoch µs minus monotonic µs since `origin`, as last taken: the two clocks tick
    /// apart, so an offset read afresh at every call would move by a millisecond within each
    /// millisecond, and one deadline would read differently from call to call.
    offset_us: Arc<AtomicI64>,
}

impl Clock {
    fn new() -> Clock {
        let clock = Clock {
            origin: Instant::now(),
            offset_us: Arc::default(),
        };
        clock
            .offset_us
            .store(clock.fresh_offset(), Ordering::Relaxed);
        clock
    }

    fn now(&self) -> u64 {
        millis(self.origin.elapsed())
    }

    /// The wall clock's reading less the monotonic one, taken between two monotonic reads a
    /// few microseconds apart: a thread preempted between the two clocks would otherwise take
    /// an offset off by the length of its pause (and, stored, report times that far off).
    fn fresh_offset(&self) -> i64 {
        let us = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        let mut offset = 0;
        for _ in 0..5 {
            let before = us(self.origin.elapsed());
            let wall = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(us)
                .unwrap_or(0);
            let after = us(self.origin.elapsed());
            offset = wall.saturating_sub(before / 2 + after / 2);
            if after - before < 100 {
                break;
            }
        }
        offset
    }

    /// `at` as ms since the Unix epoch, on the wall clock as it reads now, within a millisecond:
    /// the offset is taken again only once the clocks have moved more than that apart (a step
    /// of the wall clock, or its slewing adding up).
    fn wall(&self, at: u64) -> u64 {
        let fresh = self.fresh_offset();
        let mut offset = self.offset_us.load(Ordering::Relaxed);
        if fresh.abs_diff(offset) > 1000 {
            self.offset_us.store(fresh, Ordering::Relaxed);
            offset = fresh;
        }
        let us = i128::from(at) * 1000 + i128::from(offset);
        u64::try_from(us.div_euclid(1000)).unwrap_or(if us < 0 { 0 } else { u64::MAX })
    }
}

impl State {
    fn expire_done(&mut self, now: u64) {
        while let Some(&(expires, id)) = self.done.front() {
            // As a Redis key: still there in the millisecond it expires at.
            if expires >= now {
                break;
            }
            self.done.pop_front();
            if self
                .jobs
                .get(&id)
                .is_some_and(|j| j.state == JobState::Done && j.expires_ms == Some(expires))
            {
                self.jobs.remove(&id);
            }
        }
    }

    /// Takes the job out of whichever timed set holds it.
    fn unindex(&mut self, id: u64) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        match (job.state, job.at_ms) {
            (JobState::Pending, _) => {
                self.pending.remove(&id);
            }
            (JobState::Active, Some(at)) => {
                self.active.remove(&(at, ByText(id)));
            }
            (JobState::Delayed, Some(at)) => {
                self.delayed.remove(&(at, ByText(id)));
            }
            (JobState::Dead, Some(at)) => {
                self.dead.remove(&(at, ByText(id)));
            }
            _ => {}
        }
    }

    /// Moves due delayed jobs back to pending, at most [`PROMOTE_PER_CLAIM`] of them, the
    /// earliest due first, as `queue_claim.lua` does (a claim's script must stay short).
    fn promote_due(&mut self, now: u64) {
        for _ in 0..PROMOTE_PER_CLAIM {
            let Some(&(ready, ByText(id))) = self.delayed.first() else {
                break;
            };
            if ready > now {
                break;
            }
            self.delayed.remove(&(ready, ByText(id)));
            if let Some(job) = self.jobs.get_mut(&id) {
                job.state = JobState::Pending;
                job.at_ms = None;
                self.pending.insert(id);
            }
        }
    }
}

impl MemoryQueue {
    pub(crate) fn new(prefix: &str, name: &str) -> MemoryQueue {
        MemoryQueue {
            state: Arc::default(),
            wakeups: Arc::default(),
            channel: LockKey::new(prefix, name).channel().to_owned(),
            clock: Clock::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wake(&self) {
        self.wakeups.wake(&self.channel);
    }

    pub(crate) async fn enqueue(&self, payloads: &[&[u8]], max: u64) -> Result<Vec<u64>> {
        let ids = {
            let mut st = self.state();
            let mut ids = Vec::with_capacity(payloads.len());
            for p in payloads {
                st.seq += 1;
                let id = st.seq;
                st.jobs.insert(
                    id,
                    Job {
                        state: JobState::Pending,
                        attempts: 0,
                        max,
                        payload: p.to_vec(),
                        error: None,
                        at_ms: None,
                        expires_ms: None,
                    },
                );
                st.pending.insert(id);
                ids.push(id);
            }
            ids
        };
        self.wake();
        Ok(ids)
    }

    /// `_holder`, the claim's token, is not kept: this store never hands an id out twice, so
    /// (id, attempts) names one claim (a server that loses its writes can reuse ids).
    pub(crate) async fn claim(&self, lease_ms: u64, _holder: &str) -> Result<ClaimReply> {
        let mut st = self.state();
        let now = self.clock.now();
        st.promote_due(now);
        let Some(id) = st.pending.pop_first() else {
            let next_due = st
                .delayed
                .first()
                .map(|&(ready, _)| Duration::from_millis(ready.saturating_sub(now)));
            return Ok(ClaimReply::Empty { next_due });
        };
        let deadline_ms = now.saturating_add(lease_ms);
        st.active.insert((deadline_ms, ByText(id)));
        let Some(job) = st.jobs.get_mut(&id) else {
            // Every pending id has a job in this store; an orphan cannot arise here.
            st.active.remove(&(deadline_ms, ByText(id)));
            return Ok(ClaimReply::Empty { next_due: None });
        };
        job.attempts += 1;
        job.state = JobState::Active;
        job.at_ms = Some(deadline_ms);
        Ok(ClaimReply::Claimed {
            id,
            attempts: job.attempts,
            deadline_ms: self.clock.wall(deadline_ms),
            payload: job.payload.clone(),
        })
    }

    pub(crate) async fn settle(
        &self,
        id: u64,
        attempts: u64,
        _holder: &str,
        op: &Op<'_>,
    ) -> Result<std::result::Result<Settled, Refusal>> {
        let mut woke = false;
        let reply = {
            let mut st = self.state();
            let now = self.clock.now();
            st.expire_done(now);
            let Some(job) = st.jobs.get(&id) else {
                return Ok(Err(Refusal::Unknown));
            };
            if attempts > job.attempts {
                return Ok(Err(Refusal::Unissued {
                    current: job.attempts,
                }));
            }
            if job.attempts != attempts {
                return Ok(Err(Refusal::Stale {
                    current: job.attempts,
                }));
            }
            if job.state == JobState::Done && matches!(op, Op::Complete { .. }) {
                return Ok(Ok(Settled {
                    state: JobState::Done,
                    at_ms: None,
                }));
            }
            if job.state != JobState::Active {
                return Ok(Err(Refusal::NotHeld {
                    state: job.state.as_str().to_owned(),
                }));
            }
            st.unindex(id);
            let st = &mut *st;
            let Some(job) = st.jobs.get_mut(&id) else {
                return Ok(Err(Refusal::Unknown));
            };
            match *op {
                Op::Complete { keep_done_ms } => {
                    if keep_done_ms == 0 {
                        st.jobs.remove(&id);
                    } else {
                        let expires = now.saturating_add(keep_done_ms);
                        job.state = JobState::Done;
                        job.payload = Vec::new();
                        job.error = None;
                        job.at_ms = None;
                        job.expires_ms = Some(expires);
                        st.done.push_back((expires, id));
                    }
                    Settled {
                        state: JobState::Done,
                        at_ms: None,
                    }
                }
                Op::Retry { delay_ms, error } => {
                    if !error.is_empty() {
                        job.error = Some(error.to_owned());
                    }
                    if job.max > 0 && attempts >= job.max {
                        job.state = JobState::Dead;
                        job.at_ms = Some(now);
                        st.dead.insert((now, ByText(id)));
                    } else if delay_ms > 0 {
                        let ready = now.saturating_add(delay_ms);
                        job.state = JobState::Delayed;
                        job.at_ms = Some(ready);
                        st.delayed.insert((ready, ByText(id)));
                        // Waiting claimers sleep until the next delayed job they saw is due:
                        // this one may be due sooner.
                        woke = true;
                    } else {
                        job.state = JobState::Pending;
                        job.at_ms = None;
                        st.pending.insert(id);
                        woke = true;
                    }
                    Settled {
                        state: job.state,
                        at_ms: job.at_ms,
                    }
                }
                Op::Fail { reason } => {
                    job.state = JobState::Dead;
                    job.error = Some(reason.to_owned());
                    job.at_ms = Some(now);
                    st.dead.insert((now, ByText(id)));
                    Settled {
                        state: JobState::Dead,
                        at_ms: Some(now),
                    }
                }
                Op::Extend { lease_ms } => {
                    let deadline = now.saturating_add(lease_ms);
                    job.at_ms = Some(deadline);
                    st.active.insert((deadline, ByText(id)));
                    Settled {
                        state: JobState::Active,
                        at_ms: Some(deadline),
                    }
                }
            }
        };
        if woke {
            self.wake();
        }
        Ok(Ok(Settled {
            state: reply.state,
            at_ms: reply.at_ms.map(|at| self.clock.wall(at)),
        }))
    }

    pub(crate) async fn reap(&self, limit: usize) -> Result<(Vec<Reaped>, usize)> {
        let mut moved = Vec::new();
        {
            let mut st = self.state();
            let now = self.clock.now();
            // Strictly before now, as the script's `(now` bound.
            while moved.len() < limit {
                let Some(&(deadline, ByText(id))) = st.active.first() else {
                    break;
                };
                if deadline >= now {
                    break;
                }
                st.active.remove(&(deadline, ByText(id)));
                let st = &mut *st;
                let Some(job) = st.jobs.get_mut(&id) else {
                    continue;
                };
                job.error = Some(format!("lease expired on attempt {}", job.attempts));
                if job.max > 0 && job.attempts >= job.max {
                    job.state = JobState::Dead;
                    job.at_ms = Some(now);
                    st.dead.insert((now, ByText(id)));
                } else {
                    job.state = JobState::Pending;
                    job.at_ms = None;
                    st.pending.insert(id);
                }
                moved.push(Reaped {
                    id: super::JobId(id),
                    attempts: job.attempts,
                    to: job.state,
                });
            }
        }
        if moved.iter().any(|r| r.to == JobState::Pending) {
            self.wake();
        }
        let taken = moved.len();
        Ok((moved, taken))
    }

    pub(crate) async fn purge_dead(&self, age_ms: u64, limit: usize) -> Result<u64> {
        let mut st = self.state();
        let now = self.clock.now();
        let mut removed = 0;
        while removed < limit {
            let Some(&(died, ByText(id))) = st.dead.first() else {
                break;
            };
            // Died at least `age_ms` ago, as the script's `<= now - age` bound.
            if died.saturating_add(age_ms) > now {
                break;
            }
            st.dead.remove(&(died, ByText(id)));
            if st.jobs.get(&id).is_some_and(|j| j.state == JobState::Dead) {
                st.jobs.remove(&id);
            }
            removed += 1;
        }
        Ok(removed as u64)
    }

    pub(crate) async fn counts(&self) -> Result<QueueCounts> {
        let st = self.state();
        Ok(QueueCounts {
            pending: st.pending.len() as u64,
            active: st.active.len() as u64,
            delayed: st.delayed.len() as u64,
            dead: st.dead.len() as u64,
        })
    }

    pub(crate) async fn job(&self, id: u64) -> Result<Option<JobInfo>> {
        let mut st = self.state();
        let now = self.clock.now();
        st.expire_done(now);
        Ok(st.jobs.get(&id).map(|j| JobInfo {
            id: super::JobId(id),
            state: j.state,
            attempts: j.attempts,
            max_attempts: j.max,
            error: j.error.clone(),
            payload: (j.state != JobState::Done).then(|| j.payload.clone()),
            at_ms: j.at_ms.map(|at| self.clock.wall(at)),
        }))
    }

    pub(crate) async fn watch(&self) -> Result<Watch> {
        let (rx, _) = self.wakeups.register(&self.channel);
        Ok(Watch {
            rx,
            channel: self.channel.clone(),
            wakeups: self.wakeups.clone(),
            on_last: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{ByText, ClaimReply, JobState, MemoryQueue, Op};
    use crate::backend::memory::tests::at_once;
    use std::time::Duration;

    /// A step that waits for the queue's lock reads the clock once it has it, as a script reads
    /// `TIME` inside its atomic step: a complete kept waiting 1.5 s still keeps its done marker
    /// for the whole second from when it ran, not from when it was called.
    #[test]
    fn a_step_kept_waiting_for_the_lock_times_from_when_it_runs() {
        let q = MemoryQueue::new("leasehold", "clock");
        let id = at_once(q.enqueue(&[b"job"], 5)).expect("enqueue")[0];
        let Ok(ClaimReply::Claimed { attempts, .. }) = at_once(q.claim(60_000, "")) else {
            panic!("no claim");
        };
        std::thread::scope(|scope| {
            let held = q.state();
            let settle = scope.spawn(|| {
                let op = Op::Complete {
                    keep_done_ms: 1_000,
                };
                at_once(q.settle(id, attempts, "", &op))
            });
            std::thread::sleep(Duration::from_millis(1_500));
            drop(held);
            let settled = settle.join().expect("settle").expect("settled");
            assert!(settled.is_ok(), "complete refused");
        });
        let info = at_once(q.job(id)).expect("job");
        assert_eq!(
            info.map(|i| i.state),
            Some(JobState::Done),
            "the marker expired before the complete returned"
        );
    }

    /// A done marker lives through the millisecond it expires at, as the Redis key the scripts
    /// write does (`PEXPIRE`: a key is gone once the clock is past its expiry), and is gone the
    /// next.
    #[tokio::test(start_paused = true)]
    async fn a_done_marker_lives_through_its_last_millisecond() {
        let q = MemoryQueue::new("leasehold", "last-ms");
        let id = at_once(q.enqueue(&[b"job"], 5)).expect("enqueue")[0];
        let Ok(ClaimReply::Claimed { attempts, .. }) = at_once(q.claim(60_000, "")) else {
            panic!("no claim");
        };
        let op = Op::Complete { keep_done_ms: 100 };
        let settled = at_once(q.settle(id, attempts, "", &op)).expect("settled");
        assert!(settled.is_ok(), "complete refused");
        let state = || at_once(q.job(id)).expect("job").map(|i| i.state);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(
            state(),
            Some(JobState::Done),
            "gone in its last millisecond"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(state(), None, "kept past its expiry");
    }

    /// Ids order as their decimal texts do, which is how Redis orders members of one score.
    #[test]
    fn ids_order_as_their_text() {
        let mut ids: Vec<u64> = (0..1_200).collect();
        ids.extend([
            9,
            10,
            99,
            100,
            1_000_000,
            u64::MAX,
            u64::MAX - 1,
            10u64.pow(19),
        ]);
        for &a in &ids {
            for &b in ids.iter().step_by(7) {
                assert_eq!(
                    ByText(a).cmp(&ByText(b)),
                    a.to_string().cmp(&b.to_string()),
                    "{a} against {b}"
                );
            }
        }
    }
}
