use crate::types::Fence;
use std::time::Duration;

/// Everything that can go wrong when taking, keeping or using a lease.
///
/// Input problems ([`Error::InvalidKey`], [`Error::InvalidTtl`]) are reported before any round
/// trip. Server problems keep the underlying [`redis::RedisError`] as their source.
///
/// The message of [`Error::Unavailable`], [`Error::Refused`], [`Error::Codec`] and
/// [`Error::PartlyEnqueued`] includes its cause as well, because much of what reports an error
/// prints its message alone (JSON log formatters, a job's failure reason, an HTTP body); a
/// report that walks [`source()`](std::error::Error::source) too, such as anyhow's `{:#}`,
/// shows the cause twice.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lock_core::Result<()> {
/// use lock_core::{Error, LockOptions, Locker};
/// use std::time::Duration;
///
/// let locker = Locker::memory();
/// let held = locker.acquire("report", &LockOptions::new()).await?;
/// match locker.try_acquire("report", &LockOptions::new()).await {
///     Ok(lease) => {
///         // ... the work ...
///         lease.release().await?;
///     }
///     Err(Error::Busy { remaining, .. }) => {
///         println!("busy; try again in {:?}", remaining.unwrap_or(Duration::from_secs(1)));
///     }
///     Err(e) if e.is_transient() => println!("server trouble, retry later: {e}"),
///     Err(e) => return Err(e),
/// }
/// # held.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another holder has the key; `remaining` is its lease's time left, when the server knows it
    /// (a key set without expiry by someone else has none).
    #[error("lock `{key}` is held by another holder")]
    Busy {
        /// The key that was asked for.
        key: String,
        /// Time left on the holder's lease, if it has an expiry.
        remaining: Option<Duration>,
    },
    /// The wait deadline passed before the lease could be taken: the key was last seen held,
    /// or the wait ended queued behind this locker's other waiters of the key, or while its
    /// wake-up subscription was still being confirmed.
    #[error("gave up waiting for lock `{key}` after {waited:?}")]
    WaitTimeout {
        /// The key that was waited for.
        key: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The lease ran out or was taken away while it was supposed to be held, or its grant
    /// arrived after its validity had already run out (from `try_acquire`; from `acquire` when
    /// its wait is over or after three such grants).
    #[error("lease on `{key}` was lost")]
    LeaseLost {
        /// The key whose lease was lost.
        key: String,
    },
    /// A fenced resource refused a write from an older grant.
    #[error("stale fence {fence} for `{resource}`: {highest} was already accepted")]
    Stale {
        /// The resource that refused the write.
        resource: String,
        /// The fence that was offered.
        fence: Fence,
        /// The highest fence the resource has accepted.
        highest: Fence,
    },
    /// The key's stored fence is 2^64 - 1 (or a decimal above it): no higher fence exists, so
    /// the acquire was refused and nothing is held. Asking again cannot change that. Fences
    /// come from the clock in microseconds, so only a fence key written from outside (or
    /// grants following one set near the top) gets here; resetting it
    /// (`LockKey::fence_key`) gives up the guarantee that fences only rise.
    #[error("no fence is left for `{key}`: its stored fence is 2^64 - 1 or more")]
    FenceExhausted {
        /// The key whose fence is exhausted.
        key: String,
    },
    /// The key is empty, too long or contains a forbidden character.
    #[error("invalid key: {reason}")]
    InvalidKey {
        /// Why the key was refused.
        reason: &'static str,
    },
    /// The TTL is zero, too short or above [`MAX_TTL`](crate::MAX_TTL).
    #[error("invalid ttl {ttl:?}: {reason}")]
    InvalidTtl {
        /// The TTL that was refused.
        ttl: Duration,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A duration setting other than a lease's TTL is out of its range (a replica, response,
    /// connection or quorum member timeout under 1 ms, a done marker kept for more than a
    /// year, a reap interval under 1 ms). Reported before any round trip.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidDuration {
        /// Which setting it was.
        what: &'static str,
        /// The value that was refused.
        value: Duration,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A count setting is out of range (a worker's concurrency above
    /// [`MAX_CONCURRENCY`](crate::queue::MAX_CONCURRENCY)). Reported before any work starts.
    #[error("invalid {what} {value}: {reason}")]
    InvalidCount {
        /// Which setting it was.
        what: &'static str,
        /// The value that was refused.
        value: u64,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The server key already holds a value of another type; nothing was overwritten.
    #[error(
        "server key `{server_key}` holds a {found}, not a leasehold value; nothing was changed"
    )]
    WrongType {
        /// The server key that holds the foreign type, with prefix and hash tag (a lease's lock
        /// or fence key, a gate's key, a queue's key): named apart from the `key` of the other
        /// variants, which is the key as the caller named it.
        server_key: String,
        /// The Redis type found there.
        found: String,
    },
    /// The queue has no job with this id (never enqueued, or completed and forgotten).
    #[error("queue `{queue}` has no job {id}")]
    UnknownJob {
        /// The queue that was asked.
        queue: String,
        /// The job id that was asked for.
        id: u64,
    },
    /// A job payload is larger than [`MAX_PAYLOAD`](crate::queue::MAX_PAYLOAD); nothing was
    /// enqueued.
    #[error("payload of {len} bytes is larger than the {max}-byte limit")]
    PayloadTooLarge {
        /// The payload's size in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// [`Queue::enqueue_many`](crate::queue::Queue::enqueue_many) failed after some of its
    /// round trips had landed: `enqueued` are the ids of the jobs they added, in order (the
    /// first `enqueued.len()` payloads), so that a retry can send only the rest. Whether the
    /// round trip that failed added its jobs is what `source` says (nothing when the server
    /// refused it; unknown after [`Error::OutcomeUnknown`]).
    #[error("{} jobs were enqueued before a round trip failed: {source}", enqueued.len())]
    PartlyEnqueued {
        /// The jobs the round trips before the failure added.
        enqueued: Vec<crate::queue::JobId>,
        /// Why the next round trip failed.
        #[source]
        source: Box<Error>,
    },
    /// A typed payload could not be encoded or decoded.
    #[error("payload codec: {0}")]
    Codec(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A `#[locked]` function without `locker = ...` was called before
    /// [`set_default_locker`](crate::set_default_locker) installed a default locker.
    #[error(
        "no default locker is installed: call `set_default_locker` at start-up, or give `#[locked]` a `locker = ...`"
    )]
    NoDefaultLocker,
    /// [`set_default_locker`](crate::set_default_locker) was called again; the first locker stays.
    #[error("a default locker is already installed; it can be set only once")]
    DefaultLockerAlreadySet,
    /// Fewer replicas than asked for acknowledged the grant within the replica timeout
    /// ([`LockOptions::replicas`](crate::LockOptions::replicas)); the grant was released.
    #[error("lock `{key}`: {acked} of {wanted} replicas acknowledged the grant in time")]
    NotReplicated {
        /// The key that was asked for.
        key: String,
        /// Replicas that acknowledged.
        acked: u32,
        /// Replicas asked for.
        wanted: u32,
    },
    /// A call that starts background tasks was made outside a tokio runtime, where nothing
    /// could run them (a [`Worker`](crate::queue::Worker) started from plain `main`, say).
    #[error("{what} needs a tokio runtime: call it from within one")]
    NoRuntime {
        /// What was called.
        what: &'static str,
    },
    /// The backend cannot do what the options ask (for example waiting for replicas on the
    /// in-memory backend).
    #[error("{what} is not supported by the {backend} backend")]
    Unsupported {
        /// What was asked for.
        what: &'static str,
        /// The backend that cannot do it.
        backend: &'static str,
    },
    /// Too few members of a [`QuorumBackend`](crate::backend::QuorumBackend) agreed within the
    /// time allowed (the lease's validity, or the member timeout); a failed acquire then
    /// releases what it may have taken on the members (one whose release goes unanswered keeps
    /// it until its TTL runs out).
    #[error(
        "no quorum for {op} on `{key}`: {agreed} of {members} members agreed in time, {needed} needed"
    )]
    NoQuorum {
        /// The operation that found no quorum.
        op: &'static str,
        /// The key (or gate) it was for.
        key: String,
        /// How many members agreed: for an acquire, those whose grant (or, once a quorum
        /// granted, whose fence write-back) counted; it may reach `needed` when the votes came
        /// but the validity ran out before the grant could be made.
        agreed: usize,
        /// How many must agree: a majority.
        needed: usize,
        /// How many members there are.
        members: usize,
    },
    /// The member list of a quorum cannot work: too few members, or one server listed twice.
    #[error("invalid quorum: {reason}")]
    InvalidQuorum {
        /// What is wrong with the members.
        reason: &'static str,
    },
    /// The server could not be reached, or answered in a shape leasehold does not understand.
    /// In the second case the script may have run: an acquire is asked again with the same
    /// token, as after a lost reply ([`Error::OutcomeUnknown`]), or given back when it waits for
    /// replicas, so the grant it may have made is not left holding the key; a release is sent
    /// again; a worker counts a settle answered so as in doubt.
    #[error("backend unavailable: {0}")]
    Unavailable(#[source] redis::RedisError),
    /// The server was reached and answered the command with an error instead of running it:
    /// out of memory (`OOM`), writes stopped after a failed save (`MISCONF`), a command the
    /// client's ACL user may not run (`NOPERM`), a read-only replica (`READONLY`), data still
    /// loading (`LOADING`, on one server; on a cluster see [`Error::OutcomeUnknown`]). Under
    /// OOM, MISCONF and READONLY the server refuses a script at its first write, so the call
    /// wrote nothing; an ACL rule that denies a later command of a queue script is refused
    /// there, after the script's earlier writes (see the README's section on restricted users).
    /// It may succeed once the condition clears, except where the server lacks the command or
    /// its syntax (an older server than leasehold needs: `ERR syntax error` for the
    /// `SET ... NX GET` of Redis 7), which [`is_transient`](Error::is_transient) does not
    /// count as passing.
    #[error("the server refused {op} on `{key}`: {source}")]
    Refused {
        /// The operation that was refused.
        op: &'static str,
        /// The key (or gate, or queue) it was for.
        key: String,
        /// The server's error reply.
        #[source]
        source: redis::RedisError,
    },
    /// The connection dropped or the reply timed out after the command was sent, so whether it
    /// took effect is unknown. On a cluster also when the client lost its connections while
    /// the command was in flight (redis-rs reports that as "no connection"), when a node did
    /// not answer an explicit extend within a quarter of its TTL, and when the error is one the
    /// client's failed slot-map refresh may have met (a node still `LOADING` or `BUSY`, a
    /// connection or a login refused, a reply that did not parse): redis-rs hands that error to
    /// every request in flight, including ones a node already ran.
    #[error("outcome of {op} on `{key}` is unknown: no verdict came back ({source})")]
    OutcomeUnknown {
        /// The operation that was in flight.
        op: &'static str,
        /// The key it was for.
        key: String,
        /// The error that cut the reply off.
        #[source]
        source: redis::RedisError,
    },
}

/// Shorthand for results whose error is [`Error`].
///
/// ```
/// fn check(key: &str) -> lock_core::Result<()> {
///     lock_core::Locker::memory().lock_key(key)?;
///     Ok(())
/// }
/// assert!(check("").is_err());
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether the failure came from the transport or the server's condition rather than from
    /// the lock's state, so that a retry later may succeed.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use lock_core::{LockOptions, Locker};
    /// // Nothing listens on port 1: the connection is refused.
    /// let Err(down) = Locker::redis("redis://127.0.0.1:1/").await else { panic!("connected") };
    /// assert!(down.is_transient());
    /// let bad = Locker::memory().try_acquire("", &LockOptions::new()).await;
    /// let Err(bad) = bad else { panic!("an empty key was accepted") };
    /// assert!(!bad.is_transient()); // bad input stays bad
    /// let Err(typo) = Locker::redis("redis//127.0.0.1:6379").await else { panic!("connected") };
    /// assert!(!typo.is_transient()); // so does a URL that does not parse
    /// # }
    /// ```
    pub fn is_transient(&self) -> bool {
        match self {
            Error::PartlyEnqueued { source, .. } => source.is_transient(),
            // A URL that does not parse, a scheme or TLS setting this build cannot use: the
            // same input fails the same way however long one waits.
            Error::Unavailable(e) if e.kind() == redis::ErrorKind::InvalidClientConfig => false,
            // The server does not have the command or its syntax (`SET ... NX GET` before
            // Redis 7): refused the same way on every retry. Other `ERR` refusals may pass
            // (an ACL denial inside a script is an `ERR`, as is a script killed).
            Error::Refused { source, .. } if lacks_the_command(source) => false,
            _ => matches!(
                self,
                Error::Refused { .. }
                    | Error::Unavailable(_)
                    | Error::OutcomeUnknown { .. }
                    | Error::NoQuorum { .. }
                    // Replicas lagging, paused or restarting; the grant was given back.
                    | Error::NotReplicated { .. }
            ),
        }
    }

    /// Whether the call may have taken effect although it failed: no reply came
    /// ([`Error::OutcomeUnknown`]), or one came that leasehold cannot read (a shape its script
    /// never gives, or bytes that do not parse), so the script may well have run.
    pub(crate) fn may_have_landed(&self) -> bool {
        match self {
            Error::OutcomeUnknown { .. } => true,
            Error::Unavailable(e) => matches!(
                e.kind(),
                redis::ErrorKind::UnexpectedReturnType | redis::ErrorKind::Parse
            ),
            _ => false,
        }
    }
}

/// Whether the server refused a command it does not have, or a syntax it does not know: a
/// server older than leasehold needs.
fn lacks_the_command(e: &redis::RedisError) -> bool {
    let text = e.to_string();
    e.code() == Some("ERR")
        && [
            "syntax error",
            "unknown command",
            "unknown subcommand",
            "wrong number of arguments",
            // The same inside a script (removed with `rename-command`), as Redis 7 and Valkey
            // word it.
            "Unknown Redis command called from script",
            "Unknown command called from script",
        ]
        .iter()
        .any(|lacking| text.contains(lacking))
}

/// Sorts a redis error into "maybe applied", "refused by the server" and "not reached".
pub(crate) fn classify(op: &'static str, key: &str, err: redis::RedisError) -> Error {
    let maybe_sent = ((err.is_io_error() || err.is_timeout() || err.is_connection_dropped())
        && !err.is_connection_refusal())
        // The cluster client's "no connection" is also what it gives requests already sent
        // when a slot-map refresh fails (see `ClusterConn`): it may follow a run.
        || err.kind() == redis::ErrorKind::ClusterConnectionNotFound;
    if maybe_sent {
        Error::OutcomeUnknown {
            op,
            key: key.to_owned(),
            source: err,
        }
    } else if err.code().is_some() {
        // An error reply (`-OOM ...`): the server is there and said no; calling it unavailable
        // would send an operator looking at the network instead of at the server's state.
        Error::Refused {
            op,
            key: key.to_owned(),
            source: err,
        }
    } else {
        Error::Unavailable(err)
    }
}

/// As [`classify`], for a request sent on a cluster. redis-rs hands the error of a failed
/// slot-map refresh to every request in flight, including requests a node already ran (see
/// `ClusterConn`), and the refusals a refresh meets say nothing of those requests: a node still
/// `LOADING` or `BUSY` with a script (its `PING`), a connection refused, a login refused
/// (reconnecting), a slot map that did not parse. Read as "wrote nothing", they would leave a
/// grant that landed held by no one and a settle that landed not in doubt, so on a cluster
/// they count as no verdict. A request refused this way directly was not run; taking it for
/// unknown costs only a token-checked release or a repeat, which finds it so. Not covered:
/// `NOPERM` for the refresh's own commands, after the ACL user lost them while connected, stays
/// a refusal, since a script's own `NOPERM` (a command the user may not run inside it) is one.
pub(crate) fn classify_cluster(op: &'static str, key: &str, err: redis::RedisError) -> Error {
    let refresh_may_give = err.is_connection_refusal()
        || matches!(
            err.kind(),
            redis::ErrorKind::AuthenticationFailed | redis::ErrorKind::Parse
        )
        || matches!(
            err.code(),
            Some("LOADING" | "BUSY" | "WRONGPASS" | "NOAUTH")
        );
    if refresh_may_give {
        Error::OutcomeUnknown {
            op,
            key: key.to_owned(),
            source: err,
        }
    } else {
        classify(op, key, err)
    }
}

/// A server's error reply line (`OOM command not allowed ...`) as the error redis-rs makes of
/// it, or a client error carrying the line when it does not parse as one.
pub(crate) fn error_reply(line: &str) -> redis::RedisError {
    let line = line.replace(['\r', '\n'], " ");
    match redis::parse_redis_value(format!("-{line}\r\n").as_bytes()) {
        Ok(redis::Value::ServerError(e)) => e.into(),
        _ => redis::RedisError::from((redis::ErrorKind::Client, "refused", line)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_sorted_by_whether_the_request_may_have_run() {
        let sort = |e: redis::RedisError| classify("acquire", "k", e);
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(matches!(sort(reset.into()), Error::OutcomeUnknown { .. }));
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(matches!(sort(refused.into()), Error::Unavailable(_)));
        let oom = error_reply("OOM command not allowed");
        assert!(matches!(sort(oom), Error::Refused { .. }));
        // The cluster client's "no connection" can reach a request already sent.
        let none = redis::RedisError::from((
            redis::ErrorKind::ClusterConnectionNotFound,
            "No connections found",
        ));
        assert!(matches!(sort(none), Error::OutcomeUnknown { .. }));
    }

    /// A server that cannot run the command at all refuses it the same way on every retry; one
    /// in a passing condition may not, including the `ERR` refusals that are conditions (ACL
    /// denials inside a script, as Redis 7.0 and Valkey word them; a killed script).
    #[test]
    fn a_missing_command_is_not_transient() {
        let refusal = |line: &str| classify("acquire", "k", error_reply(line));
        for lacking in [
            "ERR syntax error",
            "ERR unknown command 'hpexpire', with args beginning with: ",
            "ERR wrong number of arguments for 'set' command",
            "ERR Unknown Redis command called from script script: 8f1c, on @user_script:16.",
            "ERR Unknown command called from script script: 8f1c, on @user_script:16.",
        ] {
            let e = refusal(lacking);
            assert!(
                matches!(e, Error::Refused { .. }) && !e.is_transient(),
                "{lacking}: {e:?}"
            );
        }
        for passing in [
            "ERR The user executing the script can't run this command or subcommand",
            "ERR ACL failure in script: No permissions to access a key",
            "ERR Script killed by user with SCRIPT KILL...",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "READONLY You can't write against a read only replica.",
            "BUSY Redis is busy running a script.",
            "MISCONF Errors writing to the AOF file",
        ] {
            let e = refusal(passing);
            assert!(
                matches!(e, Error::Refused { .. }) && e.is_transient(),
                "{passing}: {e:?}"
            );
        }
    }

    #[test]
    fn on_a_cluster_what_a_slot_refresh_meets_is_no_verdict() {
        let loading = || error_reply("LOADING Redis is loading the dataset in memory");
        let refused = || std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        let login = || error_reply("WRONGPASS invalid username-password pair or user is disabled.");
        let anonymous = || error_reply("NOAUTH Authentication required.");
        let failed = || redis::RedisError::from((redis::ErrorKind::AuthenticationFailed, "failed"));
        let busy = || error_reply("BUSY Redis is busy running a script.");
        let unparsed = || redis::RedisError::from((redis::ErrorKind::Parse, "bad slot map"));
        for e in [
            loading(),
            refused(),
            login(),
            anonymous(),
            failed(),
            busy(),
            unparsed(),
        ] {
            let shown = e.to_string();
            assert!(
                matches!(
                    classify_cluster("acquire", "k", e),
                    Error::OutcomeUnknown { .. }
                ),
                "{shown}"
            );
        }
        // On one server the same replies answer the request itself.
        assert!(matches!(
            classify("acquire", "k", loading()),
            Error::Refused { .. }
        ));
        assert!(matches!(
            classify("acquire", "k", refused()),
            Error::Unavailable(_)
        ));
        // Refusals a refresh never meets keep their verdict on a cluster too.
        let oom = error_reply("OOM command not allowed");
        assert!(matches!(
            classify_cluster("acquire", "k", oom),
            Error::Refused { .. }
        ));
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(matches!(
            classify_cluster("acquire", "k", reset.into()),
            Error::OutcomeUnknown { .. }
        ));
    }
}
