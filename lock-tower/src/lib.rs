//! Tower middleware for leasehold.
//!
//! This crate is a placeholder: the lock and dedupe layers are tracked by their own issue and are
//! not implemented yet, so it exports nothing.
