//! Property test: the memory backend against a simple model of one key, under random sequences
//! of acquire, release and extend by a few holders (leases long enough not to expire).

use std::time::Duration;

use leasehold::backend::{AcquireReply, Backend, MemoryBackend};
use leasehold::{Locker, Token};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Acquire(usize),
    Release(usize),
    Extend(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3usize).prop_map(Op::Acquire),
        (0..3usize).prop_map(Op::Release),
        (0..3usize).prop_map(Op::Extend),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn memory_backend_matches_model(ops in proptest::collection::vec(op(), 1..60)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
        rt.block_on(async {
            let backend = MemoryBackend::new();
            let key = Locker::new(backend.clone()).lock_key("model").expect("key");
            let tokens: Vec<Token> = (0..3).map(|_| Token::generate()).collect();
            let ttl = Duration::from_secs(60);
            let mut owner: Option<usize> = None;
            let mut last_fence = 0u64;
            for op in ops {
                match op {
                    Op::Acquire(h) => {
                        let reply = backend.acquire(&key, &tokens[h], ttl).await.expect("acquire");
                        match (owner, reply) {
                            (None, AcquireReply::Granted { fence, .. }) => {
                                prop_assert!(fence > last_fence);
                                last_fence = fence;
                                owner = Some(h);
                            }
                            // Re-acquiring with one's own token is the lost-reply retry: same fence.
                            (Some(o), AcquireReply::Granted { fence, .. }) if o == h => {
                                prop_assert_eq!(fence, last_fence);
                            }
                            (Some(o), AcquireReply::Held { remaining }) if o != h => {
                                prop_assert!(remaining.is_some());
                            }
                            (o, r) => prop_assert!(false, "owner {:?}, reply {:?}", o, r),
                        }
                    }
                    Op::Release(h) => {
                        let released = backend.release(&key, &tokens[h]).await.expect("release");
                        prop_assert_eq!(released, owner == Some(h));
                        if released {
                            owner = None;
                        }
                    }
                    Op::Extend(h) => {
                        let held = backend
                            .extend(&[(key.clone(), tokens[h].clone())], ttl)
                            .await
                            .expect("extend");
                        prop_assert_eq!(held, vec![owner == Some(h)]);
                    }
                }
            }
            Ok(())
        })?;
    }
}
